"""What would make an impossible job possible: the smallest GPU count (or a lower precision) at which a
plan fits, and the nearest global batches that admit a legal plan.

Recomputation (none / selective / full / block) and the ZeRO stage are knobs of the searched space, so
when nothing fits they have already been tried at every setting; what is left to change is the job:
more GPUs, a lower precision, a smaller sequence, or the batch.
"""
from __future__ import annotations

from dataclasses import replace

from costmodels.params import EfficiencyParams
from search_spaces.space import Problem, count_legal

#: How far the GPU-count search for a fitting plan goes: up to this many times the GPUs asked for
MAX_GPU_FACTOR = 16
#: Global batches tried around the given one, nearest first, before giving up
MAX_BATCH_CANDIDATES = 24


def _with_gpus(problem: Problem, n: int) -> Problem:
    return replace(problem, cluster=replace(problem.cluster, num_gpus=n))


def _fits_at(problem: Problem, params, memory_limit_gb) -> dict | None:
    from .search import NoLegalPlan, NothingFits, exhaustive
    try:
        return exhaustive(problem, params, top_k=1, memory_limit_gb=memory_limit_gb).best
    except (NoLegalPlan, NothingFits):
        return None


def smallest_fitting_gpus(problem: Problem, params: EfficiencyParams | None = None,
                          memory_limit_gb: float | None = None) -> dict | None:
    """The smallest whole-node GPU count above the problem's (up to MAX_GPU_FACTOR x) with a plan that
    fits, assuming that fitting is monotone in the count between doublings: {"gpus", "plan", "memory_gb"},
    or None."""
    from .capacity import gpu_count_grid
    node = problem.cluster.nvlink_domain_size
    n0 = problem.cluster.num_gpus
    if problem.cluster.num_sites > 1:
        return None                       # a multi-site cluster's size is fixed by its file
    # doublings first (memory per GPU falls about as 1/N), then the whole-node counts of the grid between
    # the last doubling that does not fit and the first that does: ~7 searches instead of ~16
    lo, hit = n0, None
    k = 2
    while k <= MAX_GPU_FACTOR and hit is None:
        best = _fits_at(_with_gpus(problem, n0 * k), params, memory_limit_gb)
        if best is not None:
            hit = (n0 * k, best)
        else:
            lo = n0 * k
        k *= 2
    if hit is None:
        return None
    for n in gpu_count_grid(node, lo + 1, hit[0] - 1):
        best = _fits_at(_with_gpus(problem, n), params, memory_limit_gb)
        if best is not None:
            hit = (n, best)
            break
    n, best = hit
    return {"gpus": n, "plan": best["plan"], "memory_gb": best["memory_gb"]["total"]}


def lower_precision_fit(problem: Problem, params: EfficiencyParams | None = None,
                        memory_limit_gb: float | None = None) -> dict | None:
    """fp8 (then fp4) at the same GPU count, where the GPU has the tensor cores and a plan then fits."""
    from costmodels.specs import Precision
    order = [Precision.FP8, Precision.FP4]
    if problem.job.precision not in (Precision.BF16, Precision.FP16, Precision.FP8):
        return None
    for prec in order[order.index(problem.job.precision) + 1 if problem.job.precision in order else 0:]:
        if problem.cluster.gpu.peak_flops(prec) <= 0:
            continue
        best = _fits_at(replace(problem, job=replace(problem.job, precision=prec)), params, memory_limit_gb)
        if best is not None:
            return {"precision": prec.value, "plan": best["plan"], "memory_gb": best["memory_gb"]["total"]}
    return None


def nearest_legal_batches(problem: Problem, fixed: dict | None = None) -> dict:
    """The nearest global batches below and above the problem's with at least one legal plan
    ({"below": b or None, "above": b or None}); candidates are multiples of the largest powers of two
    that divide the GPU count, nearest first."""
    b0 = problem.job.global_batch
    cands = set()
    n = problem.cluster.num_gpus
    for k in sorted({d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if n % d == 0} | {n}):
        lo = (b0 // k) * k
        cands |= {lo, lo + k}
    for d in range(1, 9):
        cands |= {b0 - d, b0 + d}
    ordered = sorted((c for c in cands if c >= 1 and c != b0), key=lambda c: (abs(c - b0), c))
    found: dict = {"below": None, "above": None}
    for c in ordered[:MAX_BATCH_CANDIDATES]:
        side = "below" if c < b0 else "above"
        if found[side] is not None:
            continue
        if count_legal(replace(problem, job=replace(problem.job, global_batch=c)), fixed).legal > 0:
            found[side] = c
        if found["below"] is not None and found["above"] is not None:
            break
    return found


def nothing_fits_advice(problem: Problem, params: EfficiencyParams | None = None,
                        memory_limit_gb: float | None = None) -> dict:
    """Everything above for a problem whose legal plans all exceed the memory limit, with one sentence."""
    gpus = smallest_fitting_gpus(problem, params, memory_limit_gb)
    prec = lower_precision_fit(problem, params, memory_limit_gb)
    parts = []
    if gpus:
        parts.append(f"{gpus['gpus']} GPUs ({_plan(gpus['plan'])}, {gpus['memory_gb']:.1f} GB)")
    if prec:
        parts.append(f"{prec['precision']} on {problem.cluster.num_gpus} GPUs ({_plan(prec['plan'])}, "
                     f"{prec['memory_gb']:.1f} GB)")
    if not parts:
        parts.append(f"no count up to {MAX_GPU_FACTOR}x the GPUs and no lower precision fits; try a shorter "
                     f"sequence or a GPU with more memory")
    text = "would fit: " + "; or ".join(parts) + " (recomputation and ZeRO stages were all tried)"
    return {"smallest_gpus": gpus, "lower_precision": prec, "sentence": text}


def no_legal_plan_advice(problem: Problem, fixed: dict | None = None) -> dict:
    near = nearest_legal_batches(problem, fixed)
    got = [str(b) for b in (near["below"], near["above"]) if b is not None]
    text = (f"nearest global batches with legal plans: {' and '.join(got)}" if got
            else "no nearby global batch has a legal plan either")
    return {"nearest_batches": near, "sentence": text}


def _plan(plan: dict) -> str:
    from .report import plan_text
    return plan_text(plan)
