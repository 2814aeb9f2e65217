"""Framework.JAX: a JAX trainer (the jax runner of `autotune verify`, MaxText) compiles the whole step,
micro-batches included, into one XLA program. No host issues kernels one by one, and no Python runs per
step or per micro-batch, so the cost model charges neither the host-dispatch floor nor Megatron's per-step
and per-micro-batch host work. Golden overheads are the shipped constants' own sums (the terms are the
constants: step_overhead_s + m x microbatch_overhead_s); the verify runs that motivate it are
tests/test_gpu_measured.py's.
"""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from autotune import api
from autotune.export import ExportRefused, export
from autotune.validate import case_from_row
from cli.main import app
from costmodels.params import EfficiencyParams
from costmodels.specs import Framework

#: Llama 3 8B at tp 8 on one H100 node, one sequence per micro-batch: small per-GPU kernels, host-bound eagerly
JOB = dict(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=2048)
PLAN = "tp=8,pp=1,mbs=1,zero=0,sp=true"


def _predict(framework: str):
    problem = api.build_problem(**JOB, framework={"framework": framework})
    return problem, api.predict_plan(problem, api.plan_from_text(PLAN, problem))


def test_no_host_dispatch_and_no_python_overheads():
    _, eager = _predict("megatron")
    problem, jax = _predict("jax")
    e, m = EfficiencyParams(), JOB["global_batch"] // 1       # dp = 1: 64 micro-batches of one sequence
    assert eager["time_breakdown_s"]["overhead"] == pytest.approx(e.step_overhead_s + m * e.microbatch_overhead_s,
                                                                  rel=1e-5)
    assert jax["time_breakdown_s"]["overhead"] == 0.0
    assert jax["time_breakdown_s"]["host_wait"] == 0.0
    assert jax["step_time_s"] < eager["step_time_s"]
    # the GPU's own work is the same but for the gradient accumulation: a JAX trainer adds each micro-batch's
    # gradients to the accumulator (here bf16: --framework jax reduces in the model's dtype) in a kernel of its
    # own (read 2 + 2, write 2 bytes per parameter), where Megatron's wgrad GEMMs accumulate into the main
    # gradients as they are produced (--gradient-accumulation-fusion); and XLA's fused cross entropy moves
    # 14 B per logit where Megatron-Core's native fused one moves 28 (tests/test_cross_entropy.py)
    fw = problem.job.framework
    assert fw.framework is Framework.JAX and not fw.gradient_accumulation_fusion and fw.grad_bytes_per_param == 2.0
    params = problem.model.param_counts()["total"] / 8           # tp 8, pp 1: every rank holds 1/8 of the weights
    bw = problem.cluster.gpu.hbm_bandwidth_bytes_per_s * e.hbm_eff
    acc_s = m * params * (2 + 2 * 2) / bw
    loss_s = m * JOB["seq_len"] * problem.model.vocab_size / 8 * (14 - 28) / bw
    assert jax["time_breakdown_s"]["compute"] == pytest.approx(eager["time_breakdown_s"]["compute"] + acc_s + loss_s,
                                                               rel=2e-3)


def test_exports_only_to_a_jax_trainer():
    problem, _ = _predict("jax")
    plan = api.plan_from_text(PLAN, problem)
    for target in ("megatron", "bridge", "torchtitan", "deepspeed"):
        with pytest.raises(ExportRefused) as info:
            export(target, plan, problem)
        assert "framework=jax" in str(info.value)
    assert export("maxtext", plan, problem).text


def test_jax_runner_records_are_read_as_jax():
    # records written before the runner named its framework: run.runner == "jax" says it
    row = json.load(open("tests/data/gpu/h200_verify_runs.json"))[0]
    assert "framework" not in row["run"]["framework"]
    fw = case_from_row(row).problem.job.framework
    assert fw.framework is Framework.JAX and not fw.gradient_accumulation_fusion


def test_cli_and_refusals():
    base = ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "64",
            "--seq-len", "2048", "--plan", PLAN, "--json"]
    r = CliRunner().invoke(app, base + ["--framework", "jax"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["time_breakdown_s"]["overhead"] == 0.0
    r = CliRunner().invoke(app, base + ["--framework", "jax", "--cuda-graph-impl", "local"])
    assert r.exit_code == 2 and "cuda_graph_impl" in r.output and "Traceback" not in r.output


def test_full_recompute_under_jax_skips_the_mlp_down_projection():
    # an XLA remat replays a layer's forward but not its last GEMM (the backward reads fc2's input, not its
    # output: tests/test_gpu_measured.py counts it in the jaxpr); Megatron replays the whole forward
    from costmodels.compute import gemm_s
    plan = "tp=8,pp=1,mbs=1,zero=0,sp=true,recompute=full"
    out = {}
    for fw in ("megatron", "jax"):
        problem = api.build_problem(**JOB, framework={"framework": fw})
        out[fw] = api.predict_plan(problem, api.plan_from_text(plan, problem))["time_breakdown_s"]["recompute"]
    m, e, gpu = problem.model, EfficiencyParams(), problem.cluster.gpu
    fc2 = float(gemm_s(JOB["seq_len"], m.hidden_size, m.ffn_hidden_size / 8, gpu.peak_flops_bf16 * gpu.matmul_frac_bf16,
                       2.0, gpu.hbm_bandwidth_bytes_per_s, e.gemm_eff_max, e))
    micro_batches = JOB["global_batch"]
    assert out["megatron"] - out["jax"] == pytest.approx(micro_batches * m.num_layers * fc2, rel=1e-3)
