"""Megatron-Core's --moe-permute-fusion (FrameworkSpec.moe_permute_fusion): with it, Transformer Engine's
fused kernels move routed tokens into expert order and back; without it (Megatron's default) moe_utils
gathers with index_select and returns them with scatter_add_, whose backward is an atomic index_add_.

Golden byte counts are the H200 measurements bundled in tests/data/gpu/h200_microbench_moe.json (medians
over five MoE models' shapes); the golden step-time difference is hand-computed from them.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from autotune import api
from autotune.export import bridge_overrides, export, megatron_args
from autotune.report import problem_dict
from autotune.saved import problem_from_report
from cli.main import app
from costmodels import compute
from costmodels.params import EfficiencyParams
from costmodels.presets import GPU_PRESETS

_SPEC = importlib.util.spec_from_file_location("compare_gpu", Path(__file__).parent / "gpu" / "compare_gpu.py")
h200 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(h200)

#: Qwen3-30B-A3B (48 MoE layers, hidden 2048, 128 experts, top-8) on two H100 nodes, one stage
JOB = dict(model="qwen3-30b-a3b", gpu="h100", gpus=16, global_batch=256, seq_len=4096)
PLAN = "tp=1,pp=1,ep=16,mbs=1,zero=1"


def _predict(fusion: bool, plan: str = PLAN, **job):
    problem = api.build_problem(**{**JOB, **job}, framework={"moe_permute_fusion": fusion})
    return problem, api.predict_plan(problem, api.plan_from_text(plan, problem))


def test_unfused_bytes_are_the_measured_kernels():
    # forward: index_select + (weight multiply, zeros, scatter_add_); backward: a gather + an atomic
    # index_add_; a third of the sum is the model's per-forward unit (its backward is 2x forward)
    mo = h200.moe_section(h200.load(h200.files("h200")["moe"]), GPU_PRESETS["h200"])
    gather = mo["permute bytes per routed token per h"]["median"]
    un = mo["unpermute bytes per routed token per h"]
    measured = (gather + un["scatter_add_ (Megatron-Core unfused)"]["median"] + gather + un["index_add_"]["median"]) / 3.0
    assert compute.UNFUSED_PERMUTE_BYTES_PER_H == pytest.approx(measured, rel=0.03)
    assert compute.UNFUSED_PERMUTE_BYTES_PER_H > 3.0 * compute.PERMUTE_BYTES_PER_H


def test_unfused_permutation_costs_the_byte_difference():
    problem, fused = _predict(True)
    _, unfused = _predict(False)
    e, m = EfficiencyParams(), problem.model
    # per micro-batch and MoE layer: routed copies = tokens x top-k x imbalance (dropless), forward + 2 x
    # backward of (29.9 - 8) B per routed token per hidden unit at the achieved HBM bandwidth
    routed = JOB["seq_len"] * m.experts_per_token * e.moe_imbalance
    per_layer = 3.0 * (compute.UNFUSED_PERMUTE_BYTES_PER_H - compute.PERMUTE_BYTES_PER_H) * routed * m.hidden_size \
        / (problem.cluster.gpu.hbm_bandwidth_bytes_per_s * e.hbm_eff)
    micro_batches = JOB["global_batch"] // 16
    expected = micro_batches * m.num_layers * per_layer
    got = unfused["time_breakdown_s"]["compute"] - fused["time_breakdown_s"]["compute"]
    assert got == pytest.approx(expected, rel=1e-3)
    assert unfused["step_time_s"] > fused["step_time_s"]


def test_dense_models_do_not_care():
    _, a = _predict(True, "tp=1,pp=1,mbs=1,zero=1", model="llama3-8b")
    _, b = _predict(False, "tp=1,pp=1,mbs=1,zero=1", model="llama3-8b")
    assert a["step_time_s"] == b["step_time_s"]


def test_exports_and_saved_reports_carry_it():
    for fusion in (True, False):
        problem = api.build_problem(**JOB, framework={"moe_permute_fusion": fusion})
        plan = api.plan_from_text(PLAN, problem)
        assert ("--moe-permute-fusion" in megatron_args(plan, problem)) is fusion
        assert f"model.moe_permute_fusion={'true' if fusion else 'false'}" in bridge_overrides(plan, problem)
        from tests.test_export import _check_names      # names Megatron-LM / Megatron-Bridge document
        for target in ("megatron", "bridge"):
            _check_names(target, export(target, plan, problem))
        again = problem_from_report({"problem": problem_dict(problem)})
        assert again.job.framework.moe_permute_fusion is fusion
    dense = api.build_problem(**{**JOB, "model": "llama3-8b"})
    assert "--moe-permute-fusion" not in megatron_args(api.plan_from_text("tp=1,pp=1,mbs=1", dense), dense)


def test_cli_option():
    base = ["predict", "--model", "qwen3-30b-a3b", "--gpu", "h100", "--gpus", "16", "--global-batch", "256",
            "--seq-len", "4096", "--plan", PLAN, "--json"]
    import json
    steps = []
    for flag in ("--moe-permute-fusion", "--no-moe-permute-fusion"):
        r = CliRunner().invoke(app, base + [flag])
        assert r.exit_code == 0, r.output
        steps.append(json.loads(r.output)["step_time_s"])
    assert steps[1] > steps[0]
    r = CliRunner().invoke(app, ["export", "--model", "qwen3-30b-a3b", "--gpu", "h100", "--gpus", "16",
                                 "--global-batch", "256", "--seq-len", "4096", "--plan", PLAN, "--to", "megatron",
                                 "--no-moe-permute-fusion"])
    assert r.exit_code == 0, r.output
    assert "--moe-permute-fusion" not in r.output and "--moe-token-dispatcher-type" in r.output
    assert np.isfinite(steps).all()


@pytest.mark.parametrize("ep, local_experts", [(4, 2), (8, 1)])
def test_alltoall_sorts_received_tokens_by_local_expert(ep, local_experts):
    """Megatron-Core's MoEAlltoAllTokenDispatcher with more than one local expert sorts the tokens it receives by
    local expert (sort_chunks_by_idxs after the all-to-all) and restores their order before the combine's; the
    backward sorts the gradients back. Four passes, each reading and writing every routed token in bf16: 16 B per
    routed token per hidden unit over forward + backward, counted from the code. DeepEP / HybridEP (flex) receive
    tokens in expert order, and one local expert needs no sort."""
    job = dict(model="mixtral-8x7b", gpu="h100", gpus=8, global_batch=64, seq_len=4096)
    plan = f"tp=1,pp=1,ep={ep},mbs=1,zero=1"
    problem = api.build_problem(**job)
    flex_problem = api.build_problem(**job, framework={"moe_token_dispatcher_type": "flex"})
    plain = api.predict_plan(problem, api.plan_from_text(plan, problem))
    flex = api.predict_plan(flex_problem, api.plan_from_text(plan, flex_problem))
    e, m = EfficiencyParams(), problem.model
    routed = job["seq_len"] * m.experts_per_token * e.moe_imbalance
    per_layer = 16.0 * routed * m.hidden_size / (problem.cluster.gpu.hbm_bandwidth_bytes_per_s * e.hbm_eff)
    micro_batches = job["global_batch"] // 8
    expected = micro_batches * m.num_layers * per_layer * (local_experts > 1)
    got = plain["time_breakdown_s"]["compute"] - flex["time_breakdown_s"]["compute"]
    assert got == pytest.approx(expected, rel=1e-3, abs=1e-9)
