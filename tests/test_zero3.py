"""ZeRO-3 by framework: Megatron's FSDP gathers with the distributed optimizer's bucketed NCCL collectives
(bus bandwidth); DeepSpeed's stage 3 of 2021 reached only `zero3_bw_eff` of it (DeepSpeed issue #1174).

Golden values: Narayanan et al. 2021 (SC21) Table 2 measured DeepSpeed ZeRO-3 without model parallelism
(175B on 384-1536 A100s, 530B on 640-2240); the literature prior of `zero3_bw_eff` comes from another
measurement (a 5.1B model on one 8-GPU NVLink node), so predicting Narayanan's rows with it is out of sample.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from autotune.api import build_problem, predict_plan
from autotune.datasets import dataset_path
from autotune.search import exhaustive
from autotune.validate import case_from_row, load_runs, runs_deepspeed_zero
from costmodels.params import LITERATURE_PRIOR, EfficiencyParams
from costmodels.plan import Plan
from costmodels.specs import Framework

ZERO3_ROWS = [r for r in load_runs(dataset_path("public")) if "-zero3-" in r["id"]]


def test_the_published_zero3_runs_are_there():
    assert len(ZERO3_ROWS) == 6


@pytest.mark.parametrize("row", ZERO3_ROWS, ids=lambda r: r["id"])
def test_a_deepspeed_zero3_row_runs_deepspeed_with_half_precision_gradients(row):
    assert runs_deepspeed_zero(row)
    fw = case_from_row(row).problem.job.framework
    assert fw.framework is Framework.DEEPSPEED
    assert not fw.grad_reduce_in_fp32            # DeepSpeed reduces in the model's dtype by default


def test_a_megatron_row_is_not_deepspeed():
    row = next(r for r in load_runs(dataset_path("public")) if r["id"] == "nemotron4-15B-dp96")
    assert not runs_deepspeed_zero(row)
    assert case_from_row(row).problem.job.framework.framework is Framework.MEGATRON


def _error_pct(row, params):
    case = case_from_row(row)
    best = exhaustive(case.problem, params, top_k=1, fixed=case.fixed).best
    meas = case.measured_tokens_per_s_per_gpu
    return 100.0 * (best["tokens_per_s_per_gpu"] - meas) / meas


def test_the_literature_prior_predicts_narayanans_deepspeed_zero3_runs():
    """Out of sample: no fitted value. Before ZeRO-3 was told apart by framework, the prior (0.5 of the bus
    bandwidth for every ZeRO-3) predicted these runs 1.5-3.8x too fast."""
    errs = [_error_pct(r, LITERATURE_PRIOR) for r in ZERO3_ROWS]
    assert max(abs(e) for e in errs) < 30.0, errs
    assert sum(abs(e) for e in errs) / len(errs) < 16.0, errs


def _zero3(framework: str, gpus: int = 64):
    # both reduce gradients in bf16 (DeepSpeed's default; Megatron's --grad-reduce-in-bf16)
    problem = build_problem(model="llama3-8b", gpu="a100-80gb", gpus=gpus, global_batch=gpus, seq_len=2048,
                            framework={"framework": framework, "grad_reduce_in_fp32": False})
    return problem, Plan(tp=1, pp=1, dp=gpus, mbs=1, zero=3)


def _dp_comm(framework: str, params: EfficiencyParams, gpus: int = 64) -> float:
    problem, plan = _zero3(framework, gpus)
    return predict_plan(problem, plan, params=params)["time_breakdown_s"]["dp_comm"]


@settings(max_examples=12, deadline=None)
@given(lo=st.floats(0.05, 0.95), hi=st.floats(0.05, 0.95))
def test_zero3_bw_eff_moves_deepspeed_only(lo, hi):
    lo, hi = sorted((lo, hi))
    slow, fast = EfficiencyParams(zero3_bw_eff=lo), EfficiencyParams(zero3_bw_eff=hi)
    assert _dp_comm("deepspeed", fast) <= _dp_comm("deepspeed", slow) * (1 + 1e-6)
    assert _dp_comm("megatron", fast) == pytest.approx(_dp_comm("megatron", slow), rel=1e-6)


def test_exposed_zero3_traffic_scales_with_the_inverse_bandwidth_share():
    """Nothing hides (dp_overlap 0): DeepSpeed's exposed gathers and reduce-scatters go as 1 / zero3_bw_eff in their
    bytes, not in their rings' latency (a ring's n - 1 hops per layer's collective, collective_latency_s 0 here
    removes the launch part): with the latency as its own term, slow - lat = 2 (fast - lat)."""
    p = dict(dp_overlap=0.0, collective_latency_s=0.0)
    slow = _dp_comm("deepspeed", EfficiencyParams(zero3_bw_eff=0.1, **p))
    fast = _dp_comm("deepspeed", EfficiencyParams(zero3_bw_eff=0.2, **p))
    inf = _dp_comm("deepspeed", EfficiencyParams(zero3_bw_eff=1e9, **p))          # the latency alone
    assert slow - inf == pytest.approx(2.0 * (fast - inf), rel=1e-3)
    assert 0.0 < inf < fast


@pytest.mark.parametrize("dp_overlap", [0.0, 0.5131, 1.0])
def test_megatron_fsdp_hides_all_but_the_first_gather_and_the_last_reduce_scatter(dp_overlap):
    """Megatron's FSDP prefetches each layer's gather while the layer before it computes and reduce-scatters one
    layer behind, on a stream of its own, so on one NVLink node, where a layer's traffic is shorter than its work,
    only the two ends stay exposed: 2 of the 32 layers' traffic of Llama-3 8B, whatever dp_overlap (fitted on
    DeepSpeed's stage 3 and on the distributed optimizer's windows) says. DeepSpeed's stage 3 with nothing
    hidden and the full bandwidth exposes all of the same traffic."""
    megatron = _dp_comm("megatron", EfficiencyParams(dp_overlap=dp_overlap), gpus=8)
    everything = _dp_comm("deepspeed", EfficiencyParams(dp_overlap=0.0, zero3_bw_eff=1.0), gpus=8)
    assert megatron == pytest.approx(everything * 2.0 / 32.0, rel=1e-3)


def test_deepspeed_reduces_gradients_in_the_model_dtype_unless_told():
    """DeepSpeed's communication_data_type defaults to fp16 / bf16 (deepspeed/runtime/engine.py); Megatron's
    --accumulate-allreduce-grads-in-fp32 default stays fp32."""
    from autotune.api import framework_spec
    from autotune.export import export
    assert not framework_spec(framework="deepspeed").grad_reduce_in_fp32
    assert framework_spec(framework="megatron").grad_reduce_in_fp32
    assert framework_spec(framework="deepspeed", grad_reduce_in_fp32=True).grad_reduce_in_fp32
    problem, plan = _zero3("deepspeed")
    assert "communication_data_type" not in json.loads(export("deepspeed", plan, problem).text)
    fp32 = build_problem(model="llama3-8b", gpu="a100-80gb", gpus=64, global_batch=64, seq_len=2048,
                         framework={"framework": "deepspeed", "grad_reduce_in_fp32": True})
    assert json.loads(export("deepspeed", plan, fp32).text)["communication_data_type"] == "fp32"


@pytest.mark.parametrize("row_id, zero", [
    ("nemo-24.07-LLAMA2-7B-8g-SFT", 1),            # no FSDP column: NeMo's distributed optimizer
    ("nemo-24.07-Nemotron-8B-64g-pre", 1),
    ("nemo-24.07-LLAMA2-70B-16g-SFT", 0),           # dp 1: nothing to shard
    ("mbridge-cur-26.08-GPT_OSS_120B-DGX-GB300-64g-MXFP8-5", 1),   # Bridge's 26.08 page: no FSDP column either
])
def test_a_recipe_table_without_an_fsdp_column_ran_the_distributed_optimizer(row_id, zero):
    """NeMo's and Megatron-Bridge's performance recipes shard the optimizer and run FSDP only where a table's FSDP
    column says so; filled as the fastest legal stage instead, these runs read as Megatron FSDP once its
    prefetching made FSDP as fast as the distributed optimizer."""
    row = next(r for r in load_runs(dataset_path("public")) if r["id"] == row_id)
    case = case_from_row(row)
    assert case.fixed["zero"] == zero and "zero" not in case.filled


def test_the_megatron_lm_readme_runs_ran_the_distributed_optimizer():
    """The README's 2024 H100 runs name --overlap-param-gather (distributed optimizer only, arguments.py asserts it)
    and predate Megatron-Core's FSDP (2025-02): their source entry in launch_settings.json says zero 1."""
    row = next(r for r in load_runs(dataset_path("public")) if r["id"] == "megatronlm-readme-h100-weak-32B")
    case = case_from_row(row)
    assert case.fixed["zero"] == 1 and "zero" not in case.filled


# Megatron-FSDP's unsharded buffers. Golden: Llama-3 8B's parameters counted from its Hugging Face config
# (hidden 4096, 32 heads, 8 KV heads of 128, FFN 14336 SwiGLU, vocab 128256 untied, 32 layers): one layer is
# q 4096^2 + k, v 2 x 4096 x 1024 + o 4096^2 + MLP 3 x 4096 x 14336 + 2 norms of 4096 = 218,112,000; the model
# 32 layers + 2 embeddings of 128256 x 4096 + the final norm = 8,030,261,248. Megatron-FSDP gathers one FSDP unit
# per transformer layer and prefetches the next (mcore_fsdp_adapter.py: fsdp_unit_modules = [TransformerLayer,
# MoETransformerLayer, MambaLayer]): two layers' bf16 parameters and, in the backward, two layers' gradients
# (fp32 by default, bf16 with --grad-reduce-in-bf16) live beside the shards. The activation peak opens the
# backward with one unit's gradients; the second comes once a layer's backward has freed its activations, which
# without recomputation (~34 s h bytes per layer [K22], 1.1 GB here) outweigh a unit's gradients (0.9 GB).
LLAMA3_8B_LAYER, LLAMA3_8B_PARAMS = 218_112_000, 8_030_261_248


@pytest.mark.parametrize("grad_fp32, grad_bytes", [(True, 4.0), (False, 2.0)])
def test_megatron_fsdp_holds_two_layers_unsharded(grad_fp32, grad_bytes):
    gpus = 8
    problem = build_problem(model="llama3-8b", gpu="h100", gpus=gpus, global_batch=64, seq_len=8192,
                            framework={"grad_reduce_in_fp32": grad_fp32})
    mem = predict_plan(problem, Plan.from_dict(dict(tp=1, pp=1, dp=gpus, mbs=1, recompute="none", zero=3)),
                       memory_limit_gb=1e9)["memory_gb"]
    shards_w, shards_g = 2.0 * LLAMA3_8B_PARAMS / gpus, grad_bytes * LLAMA3_8B_PARAMS / gpus
    assert mem["weights"] * 1e9 == pytest.approx(shards_w + 2 * 2.0 * LLAMA3_8B_LAYER, rel=2e-3)
    assert mem["gradients"] * 1e9 == pytest.approx(shards_g + 1 * grad_bytes * LLAMA3_8B_LAYER, rel=2e-3)


def test_megatron_fsdp_units_hold_a_ranks_local_experts():
    """Mixtral 8x7B (8 experts of 3 x 4096 x 14336 = 176,160,768): a unit holds the experts of its EP rank, so
    EP 1 holds 7 experts more per unit than EP 8, two units of parameters (bf16) and of gradients (fp32: with full
    recomputation a layer's backward frees only its input, so both units' gradients count)."""
    def mem(ep):
        problem = build_problem(model="mixtral-8x7b", gpu="h100", gpus=64, global_batch=512, seq_len=4096,
                                framework={"grad_reduce_in_fp32": True})
        plan = Plan.from_dict(dict(tp=1, pp=1, dp=64, ep=ep, mbs=1, recompute="full", zero=3))
        return predict_plan(problem, plan, memory_limit_gb=1e9)["memory_gb"]
    one, eight = mem(1), mem(8)
    expert = 176_160_768
    # the shards do not depend on EP (all 64 ranks shard the experts either way: expert-DP 64 / ep x ep)
    assert (one["weights"] - eight["weights"]) * 1e9 == pytest.approx(2 * 2.0 * 7 * expert, rel=2e-3)
    assert (one["gradients"] - eight["gradients"]) * 1e9 == pytest.approx(2 * 4.0 * 7 * expert, rel=2e-3)
