"""Megatron-Core's --fp8-recipe: what each recipe costs, where it runs, how it is exported and read.

Golden facts, from the code:
- Transformer Engine's current-scaling quantizer (Megatron's "tensorwise") runs nvte_compute_amax, a read of the
  bf16 input (2 B per element), and nvte_compute_scale_from_amax before the cast (pytorch/csrc/quantizer.cpp,
  v2.7-v2.12); delayed scaling, MXFP8 and block scaling compute their scales inside the one cast kernel.
- TE's check_recipe_support: MXFP8 needs compute capability 10.x (Blackwell), block scaling >= 9.0.
- Megatron-Bridge's presets (training/mixed_precision.py): delayed and MXFP8 set fp8_param_gather=True, current
  scaling and subchannel (blockwise) set it False, and the preset is applied over model / ddp at runtime.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from autotune import api
from autotune.datasets import load_dataset
from autotune.export import ExportRefused, export
from autotune.validate import case_from_row, fp8_recipe_of
from cli.main import app
from costmodels import compute
from costmodels.encode import encode_job
from costmodels.params import EfficiencyParams
from costmodels.plan import Plan
from costmodels.presets import build_cluster
from costmodels.specs import Fp8Recipe, SpecError

AMAX_READ_BYTES = 2.0                 # the amax pass reads the bf16 input once


def _problem(recipe=None, gpu="h100", precision="fp8", model="llama3-8b", gpus=8, **fw):
    if recipe is not None:
        fw["fp8_recipe"] = recipe
    return api.build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=64, seq_len=4096, precision=precision,
                             framework=fw)


def _step(problem, plan="tp=1,pp=1,dp=8,mbs=1,zero=1"):
    return api.predict_plan(problem, api.plan_from_text(plan, problem))["step_time_s"]


def test_the_amax_pass_reads_each_cast_input_once_more():
    """The elementwise time of tensorwise minus delayed is 2 B per GEMM-input element, dense and MoE."""
    T, h, f, fe, E, ep, tp = 4096.0, 4096.0, 14336.0, 1536.0, 64.0, 8.0, 2.0
    routed = T / tp * 8.0
    S = SimpleNamespace(tokens=np.float32(T), tokens_elem=np.float32(T), tp=np.float32(tp), ep=np.float32(ep),
                        routed_tokens=np.float32(routed))
    M = {"hidden": h, "ffn": f, "expert_ffn": fe, "shared_ffn": 0.0, "attn_out_k": 4096.0, "experts": E,
         "q_up_n": 6144.0, "kv_up_n": 0.0, "expert_bias": 0.0}
    H, e = {"hbm_bw": 3.35e12}, EfficiencyParams()
    bw = 3.35e12 * e.hbm_eff
    base = {"low_precision": 1.0, "permute_fusion": 1.0, "fp8_amax_pass": 0.0, "fp8_attention": 0.0,
            "flex_dispatch": 0.0, "allgather_dispatch": 0.0}
    delayed = compute.elementwise_s(S, M, H, base, e)
    current = compute.elementwise_s(S, M, H, {**base, "fp8_amax_pass": 1.0}, e)
    cast_elems = (T * h + T * 4096.0 / tp, T * h + T * f / tp, 2.0 * routed * h + routed * fe)
    for d, c, n in zip(delayed, current, cast_elems):
        assert float(c - d) == pytest.approx(AMAX_READ_BYTES * n / bw, rel=1e-5)
    # and two more kernels per cast (amax, scale) on the GPU: 2 GEMMs per block, a dense layer has 2 blocks,
    # an MoE layer its attention block and each local expert (no shared expert here)
    dense, moe = compute.fp8_amax_pass_kernels(SimpleNamespace(ep=np.float32(ep)), M, {"fp8_amax_pass": 1.0})
    assert float(dense) == 2 * 2 * 2
    assert float(moe) == (1 + E / ep) * 2 * 2


@pytest.mark.parametrize("precision,recipe,framework,expected", [
    ("fp8", None, "megatron", Fp8Recipe.DELAYED),          # Megatron-Core's default
    ("fp8", "tensorwise", "megatron", Fp8Recipe.TENSORWISE),
    ("fp8", "tensorwise", "deepspeed", Fp8Recipe.TENSORWISE),
    ("bf16", "tensorwise", "megatron", None),              # no fp8, no recipe
    ("fp8", "tensorwise", "jax", None),                    # an XLA step scales its own
])
def test_the_recipe_applies_to_fp8_training_in_an_eager_framework(precision, recipe, framework, expected):
    problem = _problem(recipe, precision=precision, framework=framework)
    assert problem.job.fp8_recipe is expected
    J = encode_job(problem.job, build_cluster(gpu="h100", num_gpus=8))
    assert float(J["fp8_amax_pass"]) == float(expected is Fp8Recipe.TENSORWISE)


def test_only_current_scaling_costs_more():
    delayed, tensorwise, blockwise = (_step(_problem(r)) for r in ("delayed", "tensorwise", "blockwise"))
    assert tensorwise > delayed
    assert blockwise == pytest.approx(delayed, rel=1e-6)
    assert _step(_problem("mxfp8", gpu="b200")) == pytest.approx(_step(_problem("delayed", gpu="b200")), rel=1e-6)
    # a bf16 job does not depend on the recipe
    assert _step(_problem("tensorwise", precision="bf16")) == pytest.approx(_step(_problem(precision="bf16")), rel=1e-6)


@pytest.mark.parametrize("recipe,gpu,ok", [
    ("mxfp8", "b200", True), ("mxfp8", "gb300", True), ("mxfp8", "h100", False), ("mxfp8", "h200", False),
    ("blockwise", "h100", True), ("blockwise", "b200", True), ("tensorwise", "h100", True),
    ("delayed", "h800", True),
])
def test_te_refuses_a_recipe_the_gpu_cannot_run(recipe, gpu, ok):
    if ok:
        assert _problem(recipe, gpu=gpu).job.fp8_recipe is Fp8Recipe(recipe)
    else:
        with pytest.raises(SpecError, match="fp8_recipe"):
            _problem(recipe, gpu=gpu)


@pytest.mark.parametrize("args,field", [
    (["--fp8-recipe", "mxfp8"], "fp8_recipe"),             # Hopper has no MXFP8
    (["--fp8-recipe", "per-block"], "fp8_recipe"),          # not a recipe
])
def test_the_cli_answers_a_bad_recipe_in_one_line(args, field):
    r = CliRunner().invoke(app, ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--precision",
                                 "fp8", "--global-batch", "64", "--seq-len", "4096", "--plan", "tp=1,dp=8", *args])
    assert r.exit_code == 2
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in r.output


def test_the_cli_prices_the_recipe():
    def step(*extra):
        r = CliRunner().invoke(app, ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--precision",
                                     "fp8", "--global-batch", "64", "--seq-len", "4096", "--plan", "tp=2,dp=4,zero=1",
                                     "--json", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["step_time_s"]
    assert step("--fp8-recipe", "tensorwise") > step()


@pytest.mark.parametrize("args,note", [
    (["--precision", "bf16", "--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8 has no effect: the job trains in bf16"),
    (["--precision", "fp8", "--fp8-recipe", "tensorwise"], "amax in a kernel of its own"),
    (["--precision", "fp8"], None),
])
def test_predict_says_what_the_recipe_does(args, note):
    r = CliRunner().invoke(app, ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch",
                                 "64", "--seq-len", "4096", "--plan", "tp=2,dp=4,zero=1", *args])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    if note:
        assert note in text
    else:
        assert "fp8-recipe" not in text and "current scaling" not in text


def test_megatron_export_names_the_recipe():
    plan = Plan(tp=1, pp=1, dp=8, mbs=1, zero=1)
    argv = export("megatron", plan, _problem("tensorwise")).text.split()
    assert argv[argv.index("--fp8-recipe") + 1] == "tensorwise"
    assert "--fp8-recipe" not in export("megatron", plan, _problem()).text     # delayed: Megatron's default
    assert "--fp8-recipe" not in export("megatron", plan, _problem(precision="bf16")).text


@pytest.mark.parametrize("recipe,gpu,gather,preset", [
    ("delayed", "h100", True, "bf16_with_fp8_delayed_scaling_mixed"),
    ("tensorwise", "h100", True, "bf16_with_fp8_current_scaling_mixed"),     # fp8_param_gather = True in its preset
    ("mxfp8", "b200", True, "bf16_with_mxfp8_mixed"),
    ("blockwise", "h100", False, "bf16_with_fp8_subchannel_scaling_mixed"),
])
def test_bridge_export_picks_the_recipes_preset(recipe, gpu, gather, preset):
    plan = Plan(tp=1, pp=1, dp=8, mbs=1, zero=1)
    text = export("bridge", plan, _problem(recipe, gpu=gpu, fp8_param_gather=gather)).text
    assert f"mixed_precision={preset}" in text.split()
    # the preset sets fp8_param_gather over model / ddp at runtime: a plan that differs is refused, by name
    with pytest.raises(ExportRefused, match="fp8_param_gather"):
        export("bridge", plan, _problem(recipe, gpu=gpu, fp8_param_gather=not gather))


@pytest.mark.parametrize("group,gpu,precision,expected", [
    ("NeMo 24.07 perf summary", "h100", "FP8", Fp8Recipe.DELAYED),
    ("Megatron-Bridge perf summary archive (25.09-26.06.01)", "h100", "FP8", Fp8Recipe.TENSORWISE),
    ("Megatron-Bridge perf summary archive (25.09-26.06.01)", "h100", "FP8-CS", Fp8Recipe.TENSORWISE),
    ("Megatron-Bridge perf summary archive (25.09-26.06.01)", "b200", "FP8 (per-tensor, presumably current scaling)",
     Fp8Recipe.TENSORWISE),
    ("Megatron-Bridge perf summary archive (25.09-26.06.01)", "b200", "MXFP8", Fp8Recipe.MXFP8),
    ("Megatron-Bridge perf summary archive (25.09-26.06.01)", "b200", "FP8 (MX/blockwise granularity variant)",
     Fp8Recipe.MXFP8),
    ("Megatron-Bridge perf summary archive (25.09-26.06.01)", "h100", "FP8 (MX/blockwise granularity variant)",
     Fp8Recipe.BLOCKWISE),
])
def test_validation_rows_read_their_recipe(group, gpu, precision, expected):
    title = ("NVIDIA NeMo Megatron-Bridge 'Performance' summary" if "Bridge" in group else "NeMo perf summary")
    row = {"source": {"title": title, "group": group}, "hardware": {"gpu_key": gpu},
           "plan": {"precision": precision, "precision_key": "fp8"}}
    assert fp8_recipe_of(row) is expected


def test_a_bundled_bridge_h100_row_runs_current_scaling():
    rows = [r for r in load_dataset("public") if r["id"] == "mbridge-arch-26.04-Qwen3_30B_a3B-DGX-H100-16g-FP8-129"]
    assert rows, "the bundled row moved"
    assert case_from_row(rows[0]).problem.job.fp8_recipe is Fp8Recipe.TENSORWISE


@settings(max_examples=12, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), mbs=st.sampled_from([1, 2]), recompute=st.sampled_from(["none", "full"]),
       model=st.sampled_from(["llama3-8b", "mixtral-8x7b"]))
def test_an_amax_pass_never_makes_a_step_faster(tp, mbs, recompute, model):
    plan = f"tp={tp},pp=1,dp={8 // tp},mbs={mbs},recompute={recompute},zero={int(tp < 8)}"
    delayed = _problem("delayed", model=model, gpus=8)
    tensorwise = _problem("tensorwise", model=model, gpus=8)
    assert _step(tensorwise, plan) >= _step(delayed, plan)


@pytest.mark.parametrize("row_id, gather", [
    # Megatron-Bridge v0.1.0rc3 get_precision_config("fp8", "ss") -> bf16_with_fp8_subchannel_scaling_mixed:
    # fp8_param_gather=False (the label says "MX/blockwise", which once read as fp8 weights)
    ("mbridge-arch-25.09-DeepSeekV3_dropless_-DGX-H100-1024g-alt-273", False),
    # bf16_with_fp8_current_scaling_mixed (get_precision_config("fp8_cs")): fp8_param_gather=True in every tag
    ("mbridge-arch-26.04-Qwen3_30B_a3B-DGX-H100-16g-FP8-129", True),
    ("mbridge-cur-26.08-DeepSeekV3-DGX-GB200-256g-MXFP8-2", True),             # bf16_with_mxfp8_mixed
])
def test_a_bridge_row_keeps_fp8_weights_as_its_recipes_preset_does(row_id, gather):
    rows = [r for r in load_dataset("public") if r["id"] == row_id]
    assert rows, "the bundled row moved"
    assert case_from_row(rows[0]).problem.job.framework.fp8_param_gather is gather


@pytest.mark.parametrize("recipe,precision,framework,refused", [
    ("delayed", "fp8", "megatron", True),         # transformer_config.py, core_v0.14-v0.18
    ("tensorwise", "fp8", "megatron", False), ("blockwise", "fp8", "megatron", False),
    ("delayed", "bf16", "megatron", False),       # no fp8, no amax histories
])
def test_delayed_scaling_refuses_layernorm_and_moe_act_recompute(recipe, precision, framework, refused):
    """Megatron-Core: "Delayed scaling does not support moe_act and layernorm recompute for fp8"; the search keeps
    to it and a plan naming them is refused naming the rule."""
    problem = _problem(recipe=recipe, precision=precision, model="qwen3-30b-a3b", gpus=16)
    text = "tp=1,pp=1,dp=16,ep=8,mbs=1,zero=1,recompute=selective,recompute_modules=core_attn+layernorm+moe_act"
    if refused:
        with pytest.raises(SpecError, match="fp8_delayed_recompute"):
            api.plan_from_text(text, problem)
        top = api.search(problem, top_k=30).top
        assert top and all(not {"layernorm", "moe_act"} & set(r["plan"]["recompute_modules"] or ()) for r in top)
    else:
        api.plan_from_text(text, problem)
