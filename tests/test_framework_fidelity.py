"""Plans NVIDIA published as run must be predicted to fit, and the search must never do worse than
them on the same problem.

Source of the plans: Megatron-Bridge docs/performance-summary-archive.md (the 26.04.01 NeMo
container's pre-training table: system, GPUs, precision, global batch, micro-batch, sequence,
TP, PP, CP, VP) and the recipes that produced them (src/megatron/bridge/perf_recipes/llama/*):
no recomputation, SP with TP > 1, the distributed optimizer, gradients reduced in bf16
(perf_recipes/_common.py), TE TP-communication overlap, fp8 primary weights for MXFP8
(training/mixed_precision.py: bf16_with_mxfp8_mixed sets fp8_param_gather), and Llama-3.1 405B's
126 layers split with the embedding and the loss accounted as a layer each.
"""
from __future__ import annotations

import pytest

from autotune.api import build_problem, predict_plan, search
from costmodels.plan import Plan

# model, gpu, gpus, precision (recipe), global batch, seq, tp, pp, cp, vpp
PUBLISHED = [
    ("llama3-70b", "gb300", 64, "mxfp8", 256, 8192, 1, 4, 1, 5),
    ("llama3-70b", "gb300", 64, "nvfp4", 256, 8192, 1, 4, 1, 5),
    ("llama3-70b", "gb200", 64, "mxfp8", 256, 8192, 2, 4, 1, 5),
    ("llama3-70b", "h100", 64, "fp8_cs", 256, 8192, 4, 8, 1, 5),
    ("llama3.1-405b", "gb300", 256, "fp8_cs", 1536, 8192, 4, 8, 1, 4),
    ("llama3.1-405b", "gb300", 256, "mxfp8", 1536, 8192, 2, 8, 2, 4),
    ("llama3.1-405b", "gb200", 256, "fp8_cs", 1536, 8192, 4, 16, 1, 4),
    ("llama3.1-405b", "gb200", 256, "mxfp8", 1536, 8192, 4, 16, 1, 8),
    ("llama3.1-405b", "h100", 1024, "fp8_cs", 1536, 8192, 8, 8, 2, 8),
]


def _problem(model, gpu, gpus, recipe, gbs, seq):
    precision = "fp4" if recipe == "nvfp4" else "fp8"
    framework = {"grad_reduce_in_fp32": False, "tp_comm_overlap": True, "fp8_param_gather": recipe == "mxfp8"}
    return build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=gbs, seq_len=seq, precision=precision,
                         framework=framework)


def _plan(problem, tp, pp, cp, vpp):
    layers = problem.model.num_layers
    accounted = layers % (pp * vpp) != 0           # 405B: 126 + 2 = 128 units
    return Plan.from_dict(dict(tp=tp, pp=pp, cp=cp, dp=problem.cluster.num_gpus // (tp * pp * cp), vpp=vpp, mbs=1,
                               recompute="none", sp=tp > 1, zero=1, account_for_embedding=accounted,
                               account_for_loss=accounted))


@pytest.mark.parametrize("case", PUBLISHED, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-{c[3]}")
def test_published_plans_fit(case):
    model, gpu, gpus, recipe, gbs, seq, tp, pp, cp, vpp = case
    problem = _problem(model, gpu, gpus, recipe, gbs, seq)
    rep = predict_plan(problem, _plan(problem, tp, pp, cp, vpp))
    assert rep["fits"], f"{rep['memory_gb']['total']:.1f} GB > {rep['memory_gb']['limit']:.1f} GB"


@pytest.mark.slow
def test_search_never_slower_than_the_published_405b_gb200_plan():
    model, gpu, gpus, recipe, gbs, seq, tp, pp, cp, vpp = PUBLISHED[6]
    problem = _problem(model, gpu, gpus, recipe, gbs, seq)
    published = predict_plan(problem, _plan(problem, tp, pp, cp, vpp))
    best = search(problem, top_k=1).best
    assert best["step_time_s"] <= published["step_time_s"] * (1 + 1e-6)
