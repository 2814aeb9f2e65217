"""Transformer Engine's fp8 attention (Megatron-Core's TransformerConfig.fp8_dot_product_attention): what it
costs, where it runs, that no export can set it, and which validation rows run it.

Golden facts, from the sources:
- cuDNN 9's SDPA runs up to 2x (bf16) and 3x (fp8) PyTorch's eager attention on H100 / H200 (NVIDIA, "Accelerating
  Transformers with NVIDIA cuDNN 9"): fp8 is 1.5x bf16 on the same fused kernel.
- With fp8_dpa (and not fp8_mha), TE's DotProductAttention casts Q, K, V to fp8 in the forward and O, dO in the
  backward.
- TE v2.18 get_attention_backend: fp8 attention needs cuDNN's FusedAttention (FlashAttention and unfused are
  disabled for fp8 training); delayed scaling on sm90+, current scaling and MXFP8 on sm100+ only, block scaling and
  NVFP4 never; Megatron-Core passes no fp8_dpa to Float8BlockScaling (fp8_utils.get_fp8_recipe).
- Megatron-LM's arguments.py lists fp8_dot_product_attention among the TransformerConfig fields with no CLI
  argument; a Megatron-Bridge mixed_precision preset sets it False over the model config at runtime.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from autotune import api
from autotune.datasets import load_dataset
from autotune.export import ExportRefused, export
from autotune.validate import case_from_row
from cli.main import app
from costmodels import compute
from costmodels.params import EfficiencyParams
from costmodels.specs import SpecError

_SPEC = importlib.util.spec_from_file_location("compare_gpu", Path(__file__).parent / "gpu" / "compare_gpu.py")
cg = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cg)

CUDNN_FP8_OVER_BF16 = 3.0 / 2.0      # cuDNN 9 blog: 3x (fp8) and 2x (bf16) PyTorch eager attention, on H100

#: the six Megatron-Bridge 26.08 GB200 / GB300 rows whose recipes set mixed_precision.fp8_dot_product_attention
FP8_ATTENTION_ROWS = {f"mbridge-cur-26.08-{m}-DGX-{g}-{n}" for m, g, n in [
    ("GPT_OSS_120B", "GB300", "64g-MXFP8-5"), ("GPT_OSS_120B", "GB200", "64g-MXFP8-6"),
    ("Qwen3_30B_a3B", "GB300", "8g-MXFP8-7"), ("Qwen3_30B_a3B", "GB200", "8g-MXFP8-8"),
    ("Qwen3_235B_a22B", "GB300", "256g-MXFP8-9"), ("Qwen3_235B_a22B", "GB200", "256g-MXFP8-10")]}


def _problem(gpu="b200", recipe="mxfp8", precision="fp8", model="llama3-8b", **fw):
    fw = {"attention_backend": "fused", "fp8_dot_product_attention": True, "fp8_recipe": recipe, **fw}
    return api.build_problem(model=model, gpu=gpu, gpus=8, global_batch=64, seq_len=8192, precision=precision,
                             framework=fw)


def _shapes(T, tp):
    return SimpleNamespace(tokens=np.float32(T), tokens_elem=np.float32(T), tp=np.float32(tp), cp=np.float32(1.0),
                           ep=np.float32(1.0), routed_tokens=np.float32(0.0), softmax_fallback=np.float32(0.0))


def _core(fp8, *, seq=16384.0, heads=32, head_dim=128, tp=1.0, window=0, gpu="h100"):
    return cg.attention_core_s(gpu, head_dim, heads, seq, fp8=fp8, tp=tp, window=window)


def test_fp8_attention_forward_runs_at_cudnns_fp8_rate_on_h100():
    """fp8 doubles the MMAs' rate, not the exponentials': on H100 at head dim 128 the forward gains 1.5x."""
    assert _core(0.0)[0] / _core(1.0)[0] == pytest.approx(CUDNN_FP8_OVER_BF16, abs=0.05)


@settings(max_examples=25, deadline=None)
@given(seq=st.sampled_from([1024, 4096, 32768]), heads=st.sampled_from([8, 32, 64]),
       head_dim=st.sampled_from([64, 128]), tp=st.sampled_from([1, 2, 8]), window=st.sampled_from([0, 128]),
       gpu=st.sampled_from(["h100", "b200", "gb300"]))
def test_fp8_attention_is_faster_but_never_beyond_the_fp8_mma_rate(seq, heads, head_dim, tp, window, gpu):
    bf16 = _core(0.0, seq=seq, heads=heads, head_dim=head_dim, tp=tp, window=window, gpu=gpu)
    fp8 = _core(1.0, seq=seq, heads=heads, head_dim=head_dim, tp=tp, window=window, gpu=gpu)
    for b, f in zip(bf16, fp8):
        assert 1.0 < b / f < compute.FP8_MMA_X


def test_fp8_attention_casts_q_k_v_forward_and_o_do_backward():
    """The attention block's elementwise time grows by lp_cast_bytes per cast element: Q, K, V forward, O and dO
    backward, with the layer's backward costed as twice its forward (a third of the casts sit in the forward)."""
    T, tp, h, heads, kv_heads, d = 8192.0, 2.0, 4096.0, 32.0, 8.0, 128.0
    M = {"hidden": h, "ffn": 14336.0, "expert_ffn": 0.0, "shared_ffn": 0.0, "experts": 0.0,
         "q_up_n": (heads + 2 * kv_heads) * d, "kv_up_n": 0.0, "attn_out_k": heads * d, "expert_bias": 0.0}
    H, e = {"hbm_bw": 3.35e12}, EfficiencyParams()
    J = {"low_precision": 1.0, "permute_fusion": 1.0, "fp8_amax_pass": 0.0, "fp8_attention": 0.0,
         "flex_dispatch": 0.0, "allgather_dispatch": 0.0}
    off = compute.elementwise_s(_shapes(T, tp), M, H, J, e)[0]
    on = compute.elementwise_s(_shapes(T, tp), M, H, {**J, "fp8_attention": 1.0}, e)[0]
    forward_casts = T * (heads + 2 * kv_heads) * d / tp            # Q, K, V
    backward_casts = T * 2 * heads * d / tp                          # O, dO
    total = e.lp_cast_bytes * (forward_casts + backward_casts) / (3.35e12 * e.hbm_eff)
    assert 3.0 * float(on - off) == pytest.approx(total, rel=1e-5)   # forward + backward (2x forward)


def test_fp8_attention_makes_a_long_sequence_step_faster_and_leaves_bf16_attention_alone():
    plan = "tp=1,pp=1,dp=8,mbs=1,zero=1"
    on, off = _problem(), _problem(fp8_dot_product_attention=False)
    step = lambda p: api.predict_plan(p, api.plan_from_text(plan, p))["step_time_s"]
    assert on.job.fp8_attention and not off.job.fp8_attention
    assert step(on) < step(off)


@pytest.mark.parametrize("gpu,recipe,ok", [
    ("h100", "delayed", True), ("h200", "delayed", True), ("b200", "delayed", True), ("gb200", "delayed", True),
    ("b200", "tensorwise", True), ("b200", "mxfp8", True), ("gb300", "mxfp8", True),
    ("h100", "tensorwise", False),          # current-scaling fp8 attention: sm100+ only
    ("h100", "blockwise", False), ("b200", "blockwise", False),   # Megatron passes block scaling no fp8_dpa
])
def test_te_runs_fp8_attention_where_cudnn_has_it(gpu, recipe, ok):
    if ok:
        assert _problem(gpu=gpu, recipe=recipe).job.fp8_attention
    else:
        with pytest.raises(SpecError, match="fp8_dot_product_attention"):
            _problem(gpu=gpu, recipe=recipe)


@pytest.mark.parametrize("override,reason", [
    ({"precision": "bf16"}, "needs fp8 training"),
    ({"precision": "fp4"}, "needs fp8 training"),
    ({"attention_backend": "flash"}, "cuDNN's fused attention only"),
    ({"attention_backend": "unfused"}, "cuDNN's fused attention only"),
    ({"framework": "deepspeed"}, "Megatron-Core option"),
    ({"framework": "jax"}, "Megatron-Core option"),
])
def test_fp8_attention_needs_fp8_megatron_and_cudnn(override, reason):
    with pytest.raises(SpecError, match=reason) as err:
        _problem(**override)
    assert err.value.field == "fp8_dot_product_attention"


@pytest.mark.parametrize("target,why", [
    ("megatron", "no flag"), ("bridge", "cfg.mixed_precision.fp8_dot_product_attention=True"),
    ("torchtitan", "Megatron-Core setting"), ("maxtext", "Megatron-Core setting")])
def test_no_export_can_set_fp8_attention(target, why):
    problem = _problem()
    plan = api.plan_from_text("tp=1,pp=1,dp=8,mbs=1,zero=1", problem)
    with pytest.raises(ExportRefused, match=why) as err:
        export(target, plan, problem)
    assert "fp8_dot_product_attention=true" in str(err.value)
    off = _problem(fp8_dot_product_attention=False, fp8_param_gather=True)    # the mxfp8 preset keeps fp8 weights
    if target in ("megatron", "bridge"):
        export(target, api.plan_from_text("tp=1,pp=1,dp=8,mbs=1,zero=1", off), off)


def test_the_cli_prices_it_notes_it_and_refuses_it_in_one_line():
    args = ["predict", "--model", "llama3-8b", "--gpu", "b200", "--gpus", "8", "--global-batch", "64", "--seq-len",
            "8192", "--precision", "fp8", "--fp8-recipe", "mxfp8", "--attention-backend", "fused",
            "--plan", "tp=1,pp=1,dp=8,mbs=1,zero=1", "--json"]
    on = CliRunner().invoke(app, args + ["--fp8-dot-product-attention"])
    off = CliRunner().invoke(app, args)
    assert on.exit_code == 0 and off.exit_code == 0, on.output + off.output
    assert json.loads(on.stdout)["step_time_s"] < json.loads(off.stdout)["step_time_s"]
    text = CliRunner().invoke(app, args[:-1] + ["--fp8-dot-product-attention"])
    assert text.exit_code == 0 and "attention core runs in fp8" in text.output
    bad = CliRunner().invoke(app, ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--precision",
                                   "fp8", "--fp8-recipe", "tensorwise", "--attention-backend", "fused",
                                   "--fp8-dot-product-attention", "--plan", "tp=1,pp=1,dp=8,mbs=1,zero=1"])
    assert bad.exit_code == 2
    lines = bad.output.strip().splitlines()
    assert len(lines) == 1 and "fp8_dot_product_attention" in lines[0] and "Traceback" not in bad.output


def test_validation_reads_fp8_attention_from_the_recipes():
    rows = load_dataset("public")
    found = {r["id"] for r in rows if r["id"] in FP8_ATTENTION_ROWS}
    assert found == FP8_ATTENTION_ROWS, "the bundled rows moved"
    for r in rows:
        if r["id"] in FP8_ATTENTION_ROWS or r["id"].startswith("mbridge-cur-26.08-DeepSeekV3"):
            fw = case_from_row(r).problem.job
            assert fw.fp8_attention is (r["id"] in FP8_ATTENTION_ROWS)
            if fw.fp8_attention:
                assert fw.framework.attention_backend.value == "fused"
