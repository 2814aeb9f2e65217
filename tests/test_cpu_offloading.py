"""Activation CPU offloading (Megatron --cpu-offloading-num-layers): Megatron's rules, the memory it frees, the
copies it exposes, the CLI option and the exports.

Goldens come from Megatron-Core's checks (transformer_config.py) and from Megatron-Bridge's Llama-3 70B FSDP
recipes, whose authors offload 20 of 80 layers on GB300 (288 GB) and 40 on GB200 (186 GB) at micro-batch 2
(scripts/performance/configs/llama/llama3_workload_base_configs.py, v0.4.2): the least that fits each GPU.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings, strategies as st

from autotune.api import build_problem, predict_plan
from autotune.export import ExportRefused, export
from costmodels.plan import Plan
from costmodels.specs import Recompute, SpecError
from search_spaces.space import check_plan, enumerate_legal
from tests.test_cli import assert_one_line_error, run
from tests.test_export import NAMES, megatron_arg_dump

FP8_CS = {"grad_reduce_in_fp32": False, "fp8_recipe": "tensorwise", "fp8_param_gather": True}
FSDP_70B = Plan(tp=1, pp=1, dp=64, mbs=2, zero=3)


def _llama70b(gpu: str, layers: int, **framework):
    return build_problem(model="llama3-70b", gpu=gpu, gpus=64, global_batch=256, seq_len=8192, precision="fp8",
                         framework={**FP8_CS, "cpu_offloading_num_layers": layers, **framework})


@pytest.mark.parametrize("value", [-1, 1.5, True, "4"])
def test_a_bad_layer_count_is_refused_by_name(value):
    with pytest.raises(SpecError, match="cpu_offloading_num_layers"):
        build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096,
                      framework={"cpu_offloading_num_layers": value})


def test_megatrons_own_refusals():
    # transformer_config.py: fewer layers than the model has
    with pytest.raises(SpecError, match="less than the model's 32 layers"):
        build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096,
                      framework={"cpu_offloading_num_layers": 32})
    # ... no per-layer CUDA graphs ("CUDA graphs not supported with CPU offloading"); full_iteration is allowed
    with pytest.raises(SpecError, match="per-layer CUDA graphs"):
        build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096,
                      framework={"cpu_offloading_num_layers": 4, "cuda_graph_impl": "transformer_engine"})
    build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096,
                  framework={"cpu_offloading_num_layers": 4, "cuda_graph_impl": "full_iteration"})
    # ... and it is a Megatron-Core option
    with pytest.raises(SpecError, match="Megatron-Core option"):
        build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096,
                      framework={"cpu_offloading_num_layers": 4, "framework": "deepspeed"})


@pytest.mark.parametrize("plan,rule", [
    (Plan(tp=1, pp=2, dp=4, mbs=1, zero=1), "cpu_offloading_no_pp"),
    (Plan(tp=1, pp=1, dp=8, mbs=1, zero=1, recompute=Recompute.FULL), "cpu_offloading_no_recompute"),
])
def test_plans_megatron_refuses_with_offloading_are_illegal(plan, rule):
    """transformer_config.py: "no support for Pipeline parallelism with CPU offloading", "CPU offloading does not
    work when activation recomputation is enabled"."""
    problem = build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096,
                            framework={"cpu_offloading_num_layers": 4})
    with pytest.raises(SpecError, match=rule):
        check_plan(plan, problem)
    check_plan(plan, dataclasses.replace(problem, job=dataclasses.replace(
        problem.job, framework=dataclasses.replace(problem.job.framework, cpu_offloading_num_layers=0))))


def test_the_search_keeps_to_what_megatron_runs():
    problem = build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096,
                            framework={"cpu_offloading_num_layers": 8})
    stream, stats = enumerate_legal(problem)
    rows = list(stream)
    assert stats.legal > 0
    for batch in rows:
        assert set(batch["pp"].tolist()) == {1}
        assert set(batch["recompute"].tolist()) == {0}


def test_bridges_offload_counts_are_the_least_that_fit():
    """Megatron-Bridge offloads 20 of Llama-3 70B's 80 layers on GB300 and 40 on GB200 (FSDP, micro-batch 2,
    8,192 tokens, no recomputation): without offloading neither fits; GB300 fits with 20, GB200 needs 40."""
    fits = {(gpu, n): predict_plan(_llama70b(gpu, n), FSDP_70B)["fits"]
            for gpu in ("gb300", "gb200") for n in (0, 20, 40)}
    assert not fits["gb300", 0] and fits["gb300", 20]
    assert not fits["gb200", 0] and not fits["gb200", 20] and fits["gb200", 40]


def test_each_offloaded_layer_frees_one_layers_activations():
    """N layers offloaded leave N - 1 layers' activations off the GPU (one copy is still in flight): equal
    steps in N, and offloading one layer frees nothing."""
    act = [predict_plan(_llama70b("gb300", n), FSDP_70B)["memory_gb"]["activations"] for n in (0, 1, 11, 21, 31)]
    assert act[1] == pytest.approx(act[0], rel=1e-6)
    steps = [act[i] - act[i + 1] for i in range(1, 4)]
    assert steps[0] > 0
    assert steps[1] == pytest.approx(steps[0], rel=1e-4) and steps[2] == pytest.approx(steps[0], rel=1e-4)
    # one layer's activations of Llama-3 70B at 16,384 tokens per micro-batch without TP: K22's 34 s b h bytes of a
    # bf16 GPT layer are 4.6 GB; fp8 saves the GEMM inputs at 1 B, SwiGLU keeps a wider fc1 output: 3.5-5 GB
    per_layer_gb = steps[0] / 10
    assert 3.5 < per_layer_gb < 5.0


def test_copies_hide_under_the_layers_on_a_fast_host_link_and_not_on_a_slow_one():
    fast = predict_plan(_llama70b("gb300", 20), FSDP_70B)["time_breakdown_s"]["offload"]
    off = predict_plan(_llama70b("gb300", 0), FSDP_70B)["time_breakdown_s"]["offload"]
    assert off == 0.0
    h100 = build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=8192,
                         framework={"cpu_offloading_num_layers": 16})
    slow = predict_plan(h100, Plan(tp=1, pp=1, dp=8, mbs=4, zero=1))["time_breakdown_s"]["offload"]
    assert slow > 0.0
    # over PCIe Gen5 (64 GB/s a direction at 0.8 of it) a layer's copy of Llama-3 8B at 32,768 tokens (~2.5 GB)
    # takes ~50 ms, longer than the layer's forward on an H100: exposed
    assert slow > fast


@settings(max_examples=10, deadline=None)
@given(lo=st.floats(8.0, 400.0), hi=st.floats(8.0, 400.0), layers=st.integers(2, 30))
def test_more_host_bandwidth_never_makes_offloading_slower(lo, hi, layers):
    from costmodels.presets import GPU_PRESETS
    from costmodels.specs import ClusterSpec
    lo, hi = sorted((lo, hi))
    times = []
    for gbps in (lo, hi):
        gpu = dataclasses.replace(GPU_PRESETS["h100"], host_link_bw_bytes_per_s=gbps * 1e9)
        p = build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096,
                          framework={"cpu_offloading_num_layers": layers})
        p = dataclasses.replace(p, cluster=dataclasses.replace(p.cluster, gpu=gpu))
        assert isinstance(p.cluster, ClusterSpec)
        times.append(predict_plan(p, Plan(tp=1, pp=1, dp=8, mbs=2, zero=1))["step_time_s"])
    assert times[1] <= times[0] * (1 + 1e-6)


def test_exports_name_the_option_or_refuse():
    problem = _llama70b("gb300", 20)
    argv = export("megatron", FSDP_70B, problem).text.split()
    assert argv[argv.index("--cpu-offloading-num-layers") + 1] == "20"
    assert "--cpu-offloading-num-layers" in NAMES["megatron"]
    bridge = export("bridge", FSDP_70B, problem).text.split()
    assert "model.cpu_offloading=true" in bridge and "model.cpu_offloading_num_layers=20" in bridge
    assert {"model.cpu_offloading", "model.cpu_offloading_num_layers"} <= NAMES["bridge"]
    none = export("megatron", FSDP_70B, _llama70b("gb300", 0)).text
    assert "cpu-offloading" not in none and "cpu_offloading" not in export("bridge", FSDP_70B, _llama70b("gb300", 0)).text
    for target in ("torchtitan", "maxtext"):
        with pytest.raises(ExportRefused, match="cpu_offloading_num_layers=20"):
            export(target, FSDP_70B, problem)


def test_the_cli_option_and_its_one_line_error():
    args = ["predict", "--model", "llama3-70b", "--gpu", "gb300", "--gpus", "64", "--global-batch", "256",
            "--seq-len", "8192", "--precision", "fp8", "--fp8-recipe", "tensorwise", "--fp8-param-gather",
            "--plan", "tp=1,pp=1,mbs=2,zero=3"]
    out = run(*args, "--cpu-offloading-num-layers", "20", "--json")
    assert out.exit_code == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["time_breakdown_s"]["offload"] >= 0.0 and doc["fits"]
    assert not json.loads(run(*args, "--json").stdout)["fits"]
    text = run(*args, "--cpu-offloading-num-layers", "20")
    assert "activations of 20 layers offloaded to host memory" in text.stdout.split("Problem:")[1].splitlines()[0]
    assert_one_line_error(run(*args, "--cpu-offloading-num-layers", "80"), 2, "cpu_offloading_num_layers")
    assert_one_line_error(run(*args, "--cpu-offloading-num-layers", "20", "--plan", "tp=1,pp=2,mbs=2,zero=3"), 2,
                          "cpu_offloading_no_pp")


@pytest.mark.parametrize("value, expected", [("20", 20), ("0", 0)])
def test_a_megatron_log_says_how_many_layers_it_offloaded(value, expected):
    """calibrate --megatron-log reads --cpu-offloading-num-layers from the log's argument dump (arguments.py
    _print_args), as it reads the parallelism and the MTP modules."""
    from autotune.measurements import megatron_log_job
    job = megatron_log_job(megatron_arg_dump(cpu_offloading_num_layers=value, world_size=64))
    assert job["cpu_offloading_num_layers"] == expected and job["world_size"] == 64
