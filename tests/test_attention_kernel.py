"""Which attention kernel a job runs, and what it costs: Megatron-Core's --attention-backend (default auto) and
Transformer Engine's choice under it.

Golden facts, from the sources and the bundled measurements:
- Megatron-Core's --attention-backend defaults to auto (megatron/training/arguments.py, core_v0.14-v0.18); it sets
  NVTE_FLASH_ATTN=1 / NVTE_FUSED_ATTN=0 for flash, the reverse for fused, and leaves both on for auto
  (language_module.py _set_attention_backend). Megatron-Bridge's recipes leave it to auto.
- With both on, Transformer Engine disables FlashAttention "to give FusedAttention preference on Hopper+ for
  performance reasons" (get_attention_backend, v1.4-v2.14, compute capability >= 9.0); on Ampere it keeps
  FlashAttention.
- Measured on an H100 and an H200 (tests/data/gpu/*_microbench.json): causal bf16 attention forward + backward,
  FlashAttention-2 (PyTorch's flash backend) against cuDNN's fused kernel, 0.54-0.69 over head dims 64 / 128 and
  sequences 1024-16384. FlashAttention-3's paper puts FA2 at ~35 % of H100's peak.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from autotune import api
from autotune.export import export
from autotune.saved import problem_from_report
from cli.main import app
from costmodels import compute
from costmodels.specs import AttentionBackend, AttentionKernel, Framework, SpecError

DATA = Path(__file__).parent / "data" / "gpu"
A, FL, FU, UN = AttentionBackend.AUTO, AttentionBackend.FLASH, AttentionBackend.FUSED, AttentionBackend.UNFUSED
MEG, DS, JAX = Framework.MEGATRON, Framework.DEEPSPEED, Framework.JAX
CUDNN, FA2 = AttentionKernel.CUDNN, AttentionKernel.FLASH_ATTN_2


def tiny_gpt_oss_config(**extra) -> dict:
    """A four-layer GPT-OSS config.json (transformers' GptOssConfig keys)."""
    return {"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
            "num_local_experts": 8, "num_experts_per_tok": 2, **extra}


def _measured_ratios() -> list:
    """FlashAttention-2 / cuDNN forward + backward TFLOP/s, per (GPU, head dim, sequence) of the bundled runs."""
    out = []
    for gpu in ("h100", "h200"):
        rows = json.loads((DATA / f"{gpu}_microbench.json").read_text())["attention"]
        rate = {(r["backend"], r["head_dim"], r["seq"]): r["fwd_bwd_tflops"] for r in rows if "fwd_bwd_tflops" in r}
        out += [rate[("flash", d, s)] / rate[k] for k in rate if k[0] == "cudnn"
                for d, s in [k[1:]] if ("flash", d, s) in rate]
    return out


@pytest.mark.parametrize("backend,framework,family,kernel", [
    (A, MEG, "hopper", CUDNN), (A, MEG, "blackwell", CUDNN),        # TE's preference on Hopper+
    (A, MEG, "ampere", FA2), (A, MEG, "", FA2),                      # ... and FlashAttention elsewhere
    (FL, MEG, "hopper", FA2), (FL, MEG, "ampere", FA2),              # NVTE_FUSED_ATTN=0
    (FU, MEG, "ampere", CUDNN), (FU, MEG, "blackwell", CUDNN),       # NVTE_FLASH_ATTN=0
    (UN, MEG, "hopper", AttentionKernel.UNFUSED),
    (A, DS, "hopper", FA2), (FL, DS, "hopper", FA2),                 # Megatron-DeepSpeed: --use-flash-attn-v2
    (A, JAX, "ampere", CUDNN), (A, JAX, "hopper", CUDNN),            # jax.nn.dot_product_attention "cudnn":
    (FL, JAX, "hopper", CUDNN), (UN, JAX, "hopper", AttentionKernel.UNFUSED),   # XLA has no FlashAttention-2
])
def test_the_backend_resolves_to_the_kernel_transformer_engine_runs(backend, framework, family, kernel):
    assert backend.kernel(framework, family) is kernel


def test_flash_attention_2s_rate_on_hopper_is_the_measured_one():
    ratios = _measured_ratios()
    assert len(ratios) == 20
    assert 0.5 < min(ratios) and max(ratios) < 0.72
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    assert compute.FLASH_ATTN_2_RATE_ON_HOPPER_PLUS == pytest.approx(geomean, abs=0.01)


@pytest.mark.parametrize("kernel,family,rate", [
    (FA2, "hopper", compute.FLASH_ATTN_2_RATE_ON_HOPPER_PLUS), (FA2, "blackwell", compute.FLASH_ATTN_2_RATE_ON_HOPPER_PLUS),
    (FA2, "ampere", 1.0), (CUDNN, "hopper", 1.0), (CUDNN, "ampere", 1.0)])
def test_the_kernel_rate_is_relative_to_the_family_default(kernel, family, rate):
    assert compute.attention_kernel_rate(kernel, family) == rate


def _step(gpu: str, backend: str, seq: int, framework: str = "megatron") -> float:
    p = api.build_problem(model="llama3-8b", gpu=gpu, gpus=8, global_batch=16, seq_len=seq, precision="bf16",
                          framework={"attention_backend": backend, "framework": framework})
    return api.predict_plan(p, api.plan_from_text("tp=1,pp=1,dp=8,mbs=1,zero=1,recompute=full", p))["step_time_s"]


@settings(max_examples=12, deadline=None)
@given(seq=st.sampled_from([2048, 8192, 32768]), gpu=st.sampled_from(["h100", "h200", "b200"]))
def test_flash_on_hopper_plus_is_slower_than_auto_and_more_so_the_longer_the_sequence(seq, gpu):
    auto, flash, fused = _step(gpu, "auto", seq), _step(gpu, "flash", seq), _step(gpu, "fused", seq)
    assert fused == auto < flash
    assert flash / auto < _step(gpu, "flash", 2 * seq) / _step(gpu, "auto", 2 * seq)


def test_on_ampere_flash_is_what_auto_runs():
    assert _step("a100-80gb", "flash", 8192) == _step("a100-80gb", "auto", 8192)


def test_only_the_attention_core_moves_and_by_the_rate():
    """The step's compute differs between flash and auto on an H100 by exactly the fused kernel's time x (1/rate - 1):
    the one it predicts with attention_eff_max set so high that the core costs nothing is the same for both."""
    from costmodels.params import EfficiencyParams

    def compute_s(backend, e):
        p = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=16, seq_len=8192,
                              framework={"attention_backend": backend})
        plan = api.plan_from_text("tp=1,pp=1,dp=8,mbs=1,zero=1", p)
        return api.predict_plan(p, plan, params=e)["time_breakdown_s"]["compute"]
    e, free = EfficiencyParams(), EfficiencyParams(attn_eff_max=1e9)
    assert compute_s("flash", free) == pytest.approx(compute_s("auto", free), rel=1e-6)
    attn_auto = compute_s("auto", e) - compute_s("auto", free)
    attn_flash = compute_s("flash", e) - compute_s("flash", free)
    assert attn_flash / attn_auto == pytest.approx(1 / compute.FLASH_ATTN_2_RATE_ON_HOPPER_PLUS, rel=1e-3)


@pytest.mark.parametrize("target,text", [("megatron", "--attention-backend auto"),
                                         ("bridge", "model.attention_backend=auto")])
def test_exports_keep_megatrons_default(target, text):
    p = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=16, seq_len=4096)
    out = export(target, api.plan_from_text("tp=1,pp=1,dp=8,mbs=1,zero=1", p), p)
    assert text in out.text


def test_megatron_deepspeed_runs_flash_attention_2_and_the_cli_says_what_it_costs():
    p = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=16, seq_len=4096,
                          framework={"framework": "deepspeed", "gradient_accumulation_fusion": False})
    assert p.job.attention_kernel(p.cluster.gpu) is FA2
    args = ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "16",
            "--seq-len", "16384", "--plan", "tp=1,pp=1,dp=8,mbs=1,zero=1,recompute=full"]
    flash = CliRunner().invoke(app, args + ["--attention-backend", "flash"])
    auto = CliRunner().invoke(app, args)
    assert flash.exit_code == 0 and auto.exit_code == 0, flash.output + auto.output
    assert "runs FlashAttention-2" in flash.output and "FlashAttention-2" not in auto.output


def test_a_legacy_report_with_flash_attention_reads_as_auto():
    p = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=16, seq_len=4096)
    from autotune.report import problem_dict
    d = problem_dict(p)
    d["job"].pop("framework", None)
    d["job"]["flash_attention"] = True
    assert problem_from_report({"problem": d}).job.framework.attention_backend is A


# --- where FlashAttention-2 cannot run the model (Transformer Engine's filters, get_attention_backend v2.7-v2.14) ---

def test_gpt_oss_has_attention_sinks_and_the_others_do_not():
    from costmodels.presets import MODEL_PRESETS, model_from_hf_config
    assert MODEL_PRESETS["gpt-oss-120b"].attention_sinks
    for name in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b", "llama3-8b"):
        assert not MODEL_PRESETS[name].attention_sinks, name
    assert model_from_hf_config(tiny_gpt_oss_config(), "tiny-oss").attention_sinks


@pytest.mark.parametrize("model,framework,backend,gpu,why", [
    ("gpt-oss-120b", "megatron", "flash", "h100", "attention sinks"),        # softmax_type != vanilla
    ("gpt-oss-120b", "megatron", "flash", "a100-80gb", "attention sinks"),
    ("deepseek-v3", "megatron", "flash", "b200", "192 differs from its value head dim 128"),   # "does not support MLA"
    ("gpt-oss-120b", "deepspeed", "auto", "h100", "Megatron-DeepSpeed's attention has no sinks"),
    ("gpt-oss-120b", "deepspeed", "unfused", "h100", "Megatron-DeepSpeed's attention has no sinks"),
])
def test_a_backend_that_forces_flash_attention_2_on_a_model_it_cannot_run_is_refused(model, framework, backend,
                                                                                       gpu, why):
    with pytest.raises(SpecError, match=why) as err:
        api.build_problem(model=model, gpu=gpu, gpus=64, global_batch=64, seq_len=4096,
                          framework={"framework": framework, "attention_backend": backend})
    assert err.value.field == "attention_backend"


@pytest.mark.parametrize("model,framework,backend,gpu", [
    ("gpt-oss-120b", "megatron", "auto", "h100"), ("gpt-oss-120b", "megatron", "auto", "a100-80gb"),   # TE falls back
    ("gpt-oss-120b", "megatron", "fused", "h100"), ("gpt-oss-120b", "megatron", "unfused", "h100"),
    ("deepseek-v3", "megatron", "auto", "h100"), ("gpt-oss-120b", "jax", "flash", "h100"),            # XLA: cuDNN
    ("llama3-8b", "megatron", "flash", "h100"), ("llama3-8b", "deepspeed", "auto", "h100"),
])
def test_backends_that_can_run_the_model_are_kept(model, framework, backend, gpu):
    api.build_problem(model=model, gpu=gpu, gpus=64, global_batch=64, seq_len=4096,
                      framework={"framework": framework, "attention_backend": backend})


def test_the_cli_refuses_it_in_one_line_and_the_export_sets_the_sinks():
    args = ["predict", "--model", "gpt-oss-120b", "--gpu", "h100", "--gpus", "64", "--global-batch", "256",
            "--seq-len", "4096", "--plan", "tp=1,pp=4,dp=16,ep=8,mbs=1,zero=1"]
    bad = CliRunner().invoke(app, args + ["--attention-backend", "flash"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    lines = bad.output.strip().splitlines()
    assert len(lines) == 1 and "attention_backend" in lines[0] and "sinks" in lines[0]
    assert CliRunner().invoke(app, args).exit_code == 0
    p = api.build_problem(model="gpt-oss-120b", gpu="h100", gpus=64, global_batch=256, seq_len=4096)
    out = export("megatron", api.plan_from_text("tp=1,pp=4,dp=16,ep=8,mbs=1,zero=1", p), p).text
    assert "--softmax-type learnable" in out
    q = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=16, seq_len=4096)
    assert "--softmax-type" not in export("megatron", api.plan_from_text("tp=1,pp=1,dp=8,mbs=1,zero=1", q), q).text


# --- GPT-OSS's clamped quick GeGLU, as Megatron-Core names it (transformers' GptOssExperts: alpha 1.702,
# (up + 1) * gate * sigmoid(1.702 gate), the gate clamped to <= swiglu_limit and up to [-limit, limit]) ---

def test_gpt_oss_runs_a_clamped_quick_geglu_read_from_its_config():
    from costmodels.presets import MODEL_PRESETS, model_from_hf_config
    m = MODEL_PRESETS["gpt-oss-120b"]
    assert (m.glu_activation, m.activation_clamp, m.glu_linear_offset) == ("quick_gelu", 7.0, 1.0)
    assert MODEL_PRESETS["llama3-8b"].glu_activation == "silu" and not MODEL_PRESETS["llama3-8b"].activation_clamp
    assert model_from_hf_config(tiny_gpt_oss_config(swiglu_limit=5), "tiny-oss").activation_clamp == 5.0


@pytest.mark.parametrize("limit", ["7", -1.0, float("nan"), True, 1e300])
def test_a_bad_swiglu_limit_is_refused_naming_it(limit):
    from costmodels.presets import model_from_hf_config
    with pytest.raises(SpecError, match="swiglu_limit"):
        model_from_hf_config(tiny_gpt_oss_config(swiglu_limit=limit), "tiny-oss")


@pytest.mark.parametrize("field,value", [("glu_activation", "relu"), ("activation_clamp", -1.0),
                                         ("activation_clamp", float("inf")), ("glu_linear_offset", float("nan"))])
def test_the_model_spec_refuses_an_activation_it_does_not_know(field, value):
    import dataclasses
    from costmodels.presets import MODEL_PRESETS
    with pytest.raises(SpecError) as err:
        dataclasses.replace(MODEL_PRESETS["llama3-8b"], **{field: value})
    assert err.value.field == field


def test_the_megatron_export_names_the_activation_and_megatron_deepspeed_refuses_it():
    import dataclasses
    from autotune.export import ExportRefused
    from tests.test_export import NAMES
    p = api.build_problem(model="gpt-oss-120b", gpu="h100", gpus=64, global_batch=256, seq_len=4096)
    out = export("megatron", api.plan_from_text("tp=1,pp=4,dp=16,ep=8,mbs=1,zero=1", p), p)
    text = " ".join(out.text.split())
    assert "--quick-geglu" in text and "--swiglu" not in text
    assert "--activation-func-clamp-value 7 " in text and "--glu-linear-offset 1 " in text
    assert set(out.options) <= NAMES["megatron"]
    q = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=16, seq_len=4096)
    lt = export("megatron", api.plan_from_text("tp=1,pp=1,dp=8,mbs=1,zero=1", q), q).text
    assert "--swiglu" in lt and "--quick-geglu" not in lt and "--activation-func-clamp-value" not in lt
    ds = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=16, seq_len=4096,
                           framework={"framework": "deepspeed", "gradient_accumulation_fusion": False})
    ds = dataclasses.replace(ds, model=dataclasses.replace(ds.model, glu_activation="quick_gelu", activation_clamp=7.0))
    with pytest.raises(ExportRefused, match="quick_gelu GLU"):
        export("megatron-deepspeed", api.plan_from_text("tp=1,pp=1,dp=8,mbs=1,zero=1", ds), ds)


# --- what Transformer Engine's context parallelism and fp8 attention refuse (context_parallel.py
# attn_forward_func_with_cp asserts, v2.9-v2.18: sliding windows with cp_comm_type a2a / all_gather only, a softmax
# with sinks with a2a only; Megatron-Core's default and this model's only kind is the p2p ring) ---

@pytest.mark.parametrize("model,seq,refused", [
    ("gpt-oss-120b", 8192, "the sliding-window attention and the attention sinks of gpt-oss-120b only with "
                           "cp_comm_type a2a"),
    ("llama3-8b", 8192, None), ("deepseek-v3", 8192, None),            # MLA runs on the p2p ring
])
def test_the_p2p_ring_refuses_what_te_refuses(model, seq, refused):
    from search_spaces.space import check_plan, enumerate_legal
    p = api.build_problem(model=model, gpu="h100", gpus=256, global_batch=256, seq_len=seq)
    stream, _ = enumerate_legal(p)
    cps = {int(c) for batch in stream for c in np.asarray(batch["cp"])}
    text = "tp=1,cp=2,pp=1,dp=128" + (",ep=8" if p.model.is_moe else "") + ",mbs=1,zero=1"
    if refused:
        assert cps == {1}
        with pytest.raises(SpecError, match="cp_ring_attention") as err:
            check_plan(api.plan_from_text(text, p), p)
        assert refused in str(err.value)
    else:
        assert max(cps) > 1
        check_plan(api.plan_from_text(text, p), p)


@pytest.mark.parametrize("framework,refused", [("megatron", True), ("jax", False)])
def test_a_sliding_window_alone_asks_for_a2a_or_all_gather_under_megatron(framework, refused):
    import dataclasses
    from search_spaces.space import check_plan
    p = api.build_problem(model="llama3-8b", gpu="h100", gpus=16, global_batch=16, seq_len=8192,
                          framework={"framework": framework})
    p = dataclasses.replace(p, model=dataclasses.replace(p.model, sliding_window=4096))     # Mistral-style
    text = "tp=1,cp=2,pp=1,dp=8,mbs=1,zero=1"
    if refused:
        with pytest.raises(SpecError, match="sliding-window attention of llama3-8b only with cp_comm_type a2a or "
                                            "all_gather"):
            check_plan(api.plan_from_text(text, p), p)
    else:
        check_plan(api.plan_from_text(text, p), p)


@pytest.mark.parametrize("gpu,ok", [("h100", False), ("h200", False), ("b200", True), ("gb200", True)])
def test_fp8_attention_over_sinks_runs_on_blackwell_only(gpu, ok):
    fw = {"attention_backend": "fused", "fp8_dot_product_attention": True, "fp8_recipe": "delayed"}
    build = lambda: api.build_problem(model="gpt-oss-120b", gpu=gpu, gpus=64, global_batch=64, seq_len=4096,
                                      precision="fp8", framework=fw)
    if ok:
        assert build().job.fp8_attention
    else:
        with pytest.raises(SpecError, match="Blackwell only") as err:
            build()
        assert err.value.field == "fp8_dot_product_attention"
