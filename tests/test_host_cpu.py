"""The host CPU's speed: an eager framework issues every kernel from one CPU thread per GPU, so a Grace
superchip (GB200, GB300), whose Arm cores run PyTorch's per-op Python, autograd and launch path slower than a
DGX H100's Xeon, spends more host time per op (`GPUSpec.host_op_x`, against the Xeon on which `host_op_s`
is measured).

Golden facts, from the source:
- TransformerEngine issue #2053, "High CPU overhead on Grace systems" (2025): CPU time of one torch.nn.Linear
  forward (bf16, hidden 2048, 8192 tokens) 37.08 us on GB200, 33.17 us on GH200, 13.48 us on a DGX H100
  (Xeon Platinum 8480C).
- CUDA graphs replay captured kernels without the host: a full-iteration graph leaves no host time to scale.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from autotune import api
from cli.main import app
from costmodels.presets import GPU_PRESETS
from costmodels.specs import GPUSpec, SpecError

GB200_LINEAR_CPU_US, DGX_H100_LINEAR_CPU_US = 37.08, 13.48      # TE issue #2053


def _step_s(host_op_x, framework=None, mbs=1):
    problem = api.build_problem(model="qwen3-30b-a3b", gpu="gb200", gpus=8, global_batch=64, seq_len=4096,
                                precision="fp8", framework=framework or {})
    plan = api.plan_from_text(f"tp=1,pp=1,ep=8,mbs={mbs}", problem)
    gpu = dataclasses.replace(problem.cluster.gpu, host_op_x=host_op_x)
    p = dataclasses.replace(problem, cluster=dataclasses.replace(problem.cluster, gpu=gpu))
    return api.predict_plan(p, plan)["step_time_s"]


def test_grace_presets_carry_the_measured_cpu_ratio():
    for name in ("gb200", "gb300"):
        assert GPU_PRESETS[name].host_op_x == pytest.approx(GB200_LINEAR_CPU_US / DGX_H100_LINEAR_CPU_US, rel=0.01)
    for name in ("a100-80gb", "h100", "h200", "h800", "b200", "b300", "mi300x"):   # x86 hosts
        assert GPU_PRESETS[name].host_op_x == 1.0


def test_a_host_bound_eager_step_slows_on_grace_but_never_beyond_the_cpu_ratio():
    """Qwen3-30B-A3B, one 4k sequence per micro-batch, dropless, eager: the host issues ~100 ops per MoE layer
    and waits for each layer's token counts, so a slower CPU lengthens the step, by at most the CPU's ratio."""
    x86, grace = _step_s(1.0), _step_s(2.75)
    assert 1.2 < grace / x86 < 2.75


def test_a_full_iteration_graph_leaves_nothing_for_the_cpu():
    graph = {"cuda_graph_impl": "full_iteration"}
    assert _step_s(2.75, graph) == pytest.approx(_step_s(1.0, graph), rel=1e-6)


@settings(max_examples=8, deadline=None)
@given(lo=st.floats(0.25, 4.0), step=st.floats(0.0, 4.0), mbs=st.sampled_from([1, 4]))
def test_a_slower_host_is_never_faster(lo, step, mbs):
    assert _step_s(lo + step, mbs=mbs) >= _step_s(lo, mbs=mbs) * (1 - 1e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, 0.05, 11.0, float("nan"), float("inf"), True, "2"])
def test_host_op_x_out_of_range_is_named(bad):
    with pytest.raises(SpecError) as err:
        GPUSpec(name="x", peak_flops_bf16=1e15, hbm_bytes=80e9, hbm_bandwidth_bytes_per_s=3e12,
                intra_node_bw_bytes_per_s=450e9, inter_node_bw_bytes_per_s=50e9, host_op_x=bad)
    assert err.value.field == "host_op_x"


def test_a_cluster_file_names_its_hosts_cpu(tmp_path):
    """Hopper GPUs on GH200 nodes (Grace hosts): the cluster file's host_op_x replaces the preset's x86 1.0, and the
    saved problem carries it."""
    from costmodels.presets import build_cluster
    path = tmp_path / "gh200.yaml"
    path.write_text("gpu: h200\ngpus: 8\nhost_op_x: 2.46\n")
    assert build_cluster(cluster_file=str(path)).gpu.host_op_x == 2.46
    assert build_cluster(gpu="h200", num_gpus=8).gpu.host_op_x == 1.0
    job = ["--global-batch", "64", "--seq-len", "4096", "--precision", "fp8", "--plan", "tp=1,pp=1,ep=8,mbs=1",
           "--json"]
    grace = CliRunner().invoke(app, ["predict", "--model", "qwen3-30b-a3b", "--cluster", str(path), *job])
    x86 = CliRunner().invoke(app, ["predict", "--model", "qwen3-30b-a3b", "--gpu", "h200", "--gpus", "8", *job])
    assert grace.exit_code == x86.exit_code == 0
    assert json.loads(grace.stdout)["step_time_s"] > json.loads(x86.stdout)["step_time_s"]


def test_the_explanation_names_a_slow_host_cpu():
    """A host-bound best plan on GB200 says why the host is slow there, and what removes the wait."""
    from autotune.report import explain
    from autotune.search import exhaustive
    from costmodels.params import EfficiencyParams
    problem = api.build_problem(model="qwen3-30b-a3b", gpu="gb200", gpus=8, global_batch=64, seq_len=4096,
                                precision="fp8")
    res = exhaustive(problem, EfficiencyParams(), top_k=2)
    text = explain(res.best, res.runner_up, problem)
    assert "2.75x a DGX H100's Xeon" in text and "--cuda-graph-impl" in text
    x86 = api.build_problem(model="qwen3-30b-a3b", gpu="b200", gpus=8, global_batch=64, seq_len=4096,
                            precision="fp8")
    res = exhaustive(x86, EfficiencyParams(), top_k=2)
    assert "Xeon" not in explain(res.best, res.runner_up, x86)
