"""When nothing fits or no plan is legal: the advice names a change that really works (checked by
searching again with it), and the CLI keeps its one-line error."""
from __future__ import annotations

from dataclasses import replace

from typer.testing import CliRunner

from autotune import api
from autotune.advice import nearest_legal_batches, no_legal_plan_advice, nothing_fits_advice
from cli.main import app
from search_spaces.space import count_legal

runner = CliRunner()


def test_smallest_gpu_count_that_fits():
    # Llama 3 70B in bf16 with Adam needs 70.6e9 x 16 B = 1.13 TB of weights, gradients and optimizer
    # state (ZeRO paper: 16 bytes per parameter): more than 8 x 80 GiB = 687 GB, so 8 H100 cannot fit
    # it, and 16 (1.37 TB) is the first whole-node count that can
    problem = api.build_problem(model="llama3-70b", gpu="h100", gpus=8, global_batch=64, seq_len=8192)
    advice = nothing_fits_advice(problem)
    assert advice["smallest_gpus"]["gpus"] == 16
    assert advice["smallest_gpus"]["memory_gb"] <= problem.cluster.gpu.hbm_bytes / 1e9
    # and the count is real: a search at 16 finds a plan, at 8 it does not
    bigger = replace(problem, cluster=replace(problem.cluster, num_gpus=16))
    assert api.search(bigger, top_k=1).best["fits"]
    assert "16 GPUs" in advice["sentence"]


def test_nearest_batches_have_legal_plans():
    # 1024 GPUs, batch 1, sequence 2: at most tp x pp = 8 x 32 GPUs usable (see test_cli); batches that are
    # multiples of 4 let dp = 4 use the rest
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=1024, global_batch=1, seq_len=2)
    assert count_legal(problem).legal == 0
    near = nearest_legal_batches(problem)
    assert near["below"] is None and near["above"] is not None
    fixed = replace(problem, job=replace(problem.job, global_batch=near["above"]))
    assert count_legal(fixed).legal > 0
    before = replace(problem, job=replace(problem.job, global_batch=near["above"] - 1))
    assert near["above"] - 1 == 1 or count_legal(before).legal == 0
    assert str(near["above"]) in no_legal_plan_advice(problem)["sentence"]


def test_cli_no_legal_plan_names_batches():
    res = runner.invoke(app, ["search", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "1024",
                              "--global-batch", "1", "--seq-len", "2", "--no-save"])
    assert res.exit_code == 2
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: plan space:") and "nearest global batches with legal plans" in line
