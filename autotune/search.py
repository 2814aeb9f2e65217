"""Exhaustive search: score every legal plan in vectorized chunks; the ground-truth optimum."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from costmodels.params import EfficiencyParams
from costmodels.plan import PLAN_FIELDS, Plan, PlanBatch, format_plan
from costmodels.specs import SpecError
from search_spaces.space import Problem, binding_rules, enumerate_legal

from .scoring import Inputs, plan_report, prefetch_full, score_full, score_summary


class NoLegalPlan(SpecError):
    """No plan satisfies the legality rules (bad input: exit code 2)."""


class TooManyPlans(Exception):
    """An exhaustive search with `max_legal` met more legal plans than that (`legal`: counted so far)."""

    def __init__(self, legal: int, max_legal: int):
        super().__init__(f"more than {max_legal:,} legal plans")
        self.legal = legal
        self.max_legal = max_legal


class NothingFits(Exception):
    """Legal plans exist but none fits in memory (exit code 3). Carries the closest plan."""

    def __init__(self, message: str, closest: dict, space: dict):
        super().__init__(message)
        self.closest = closest
        self.space = space


@dataclass
class SearchResult:
    problem: Problem
    best: dict
    top: list
    space: dict
    elapsed_s: float
    strategy: str = "exhaustive"
    runner_up: dict | None = None        # best plan with a different parallel layout
    extra: dict = field(default_factory=dict)
    study: object | None = field(default=None, repr=False)   # the optuna.Study of an Optuna search (plots)


MESH = ("tp", "pp", "dp", "cp", "ep", "etp")


class _TopK:
    """Keep the K best (lowest key) rows seen across chunks, without a per-plan Python loop."""

    def __init__(self, k: int):
        self.k = k
        self.keys = np.empty(0, dtype=np.float64)
        self.rows = {f: np.empty(0, dtype=np.int32) for f in PLAN_FIELDS}
        self.layouts: tuple = ()              # every batch of one search shares its layout table

    def add(self, keys: np.ndarray, batch: PlanBatch, mask: np.ndarray) -> None:
        self.layouts = self.layouts or batch.layouts
        if not mask.any():
            return
        idx = np.flatnonzero(mask)
        if len(idx) > self.k:
            idx = idx[np.argpartition(keys[idx], self.k - 1)[: self.k]]
        self.keys = np.concatenate([self.keys, keys[idx].astype(np.float64)])
        for f in PLAN_FIELDS:
            self.rows[f] = np.concatenate([self.rows[f], np.asarray(batch[f])[idx]])
        if len(self.keys) > self.k:
            keep = np.argsort(self.keys, kind="stable")[: self.k]
            self.keys = self.keys[keep]
            self.rows = {f: v[keep] for f, v in self.rows.items()}

    def batch(self) -> PlanBatch:
        order = np.argsort(self.keys, kind="stable")
        return PlanBatch({f: v[order] for f, v in self.rows.items()}, self.layouts)


def _closest_message(rep: dict, limit_gb: float) -> str:
    mem = rep["memory_gb"]
    parts = sorted(((k, mem[k]) for k in ("weights", "gradients", "optimizer", "activations", "other")),
                   key=lambda kv: -kv[1])
    biggest = ", ".join(f"{k} {v:.1f} GB" for k, v in parts[:3])
    plan = format_plan(Plan.from_dict(rep["plan"]))        # the --plan text: pasteable, sp=true
    return (f"memory: no legal plan fits in {limit_gb:.1f} GB per GPU; the closest ({plan}) needs "
            f"{mem['total']:.1f} GB, {mem['total'] - limit_gb:.1f} GB over (largest: {biggest})")


def _no_legal_plan_message(problem: Problem, fixed: dict | None, total: int) -> str:
    rules = binding_rules(problem, fixed)
    always = [r for r in rules if r[1] >= 1.0]
    head = (f"no legal plan for {problem.cluster.num_gpus} GPUs x global batch {problem.job.global_batch} "
            f"(of {total} combinations)")
    if always:
        return f"{head}: every combination breaks {always[0][0]} (e.g. {always[0][2]})"
    top = "; ".join(f"{name} rejects {frac:.0%}" for name, frac, _ in rules[:3])
    return f"{head}: no combination passes all rules together ({top})"


def exhaustive(problem: Problem, params: EfficiencyParams | None = None, *, top_k: int = 10,
               memory_limit_gb: float | None = None, fixed: dict | None = None,
               max_legal: int | None = None) -> SearchResult:
    """Score every legal plan; return the fastest that fit, best first. With `max_legal`, raise TooManyPlans
    as soon as the enumeration passes that many (`search --strategy auto` then runs Optuna: one pass over the
    space instead of counting it first)."""
    params = params or EfficiencyParams()
    t0 = time.perf_counter()
    inp = Inputs(problem, memory_limit_gb)
    limit = inp.memory_limit_bytes
    stream, stats = enumerate_legal(problem, fixed)
    top = _TopK(max(top_k, 1) * 8)        # extra rows so a different-layout runner-up is in reach
    prefetch_full(inp, params, max(top_k, 1) * 8)   # the breakdown scorer compiles while the space is scored
    closest = _TopK(1)
    n_fit = 0
    for batch in stream:
        if max_legal is not None and stats.legal > max_legal:
            raise TooManyPlans(stats.legal, max_legal)
        steps, mems = score_summary(batch, inp, params)
        fits = mems <= limit
        n_fit += int(fits.sum())
        top.add(steps, batch, fits & np.isfinite(steps))
        closest.add(mems - limit, batch, ~fits)
    space = stats.as_dict()
    space["fitting"] = n_fit
    space["scored"] = stats.legal
    if stats.legal == 0:
        raise NoLegalPlan("plan space", _no_legal_plan_message(problem, fixed, stats.total))
    if n_fit == 0:
        cb = closest.batch()
        out = score_full(cb, inp, params)
        rep = plan_report(cb.plan(0), out, 0, inp)
        raise NothingFits(_closest_message(rep, limit / 1e9), rep, space)
    tb = top.batch()
    if len(tb) == 0:                   # plans fit, but no step time is finite (extreme hardware figures)
        raise SpecError("cluster", "the cost model gives no finite step time for any fitting plan; check the "
                        "bandwidths, latencies and memory limit for values far outside real hardware")
    out = score_full(tb, inp, params)
    reports = [plan_report(tb.plan(i), out, i, inp) for i in range(len(tb))]
    best = reports[0]
    mesh0 = tuple(best["plan"][k] for k in MESH)
    runner = next((r for r in reports[1:] if tuple(r["plan"][k] for k in MESH) != mesh0),
                  reports[1] if len(reports) > 1 else None)
    return SearchResult(problem=problem, best=best, top=reports[:top_k], space=space,
                        elapsed_s=time.perf_counter() - t0, runner_up=runner)


def predict(problem: Problem, plan: Plan, params: EfficiencyParams | None = None,
            memory_limit_gb: float | None = None) -> dict:
    """Score one plan (already checked for legality) and return its full breakdown."""
    params = params or EfficiencyParams()
    inp = Inputs(problem, memory_limit_gb)
    out = score_full(PlanBatch.from_plans([plan]), inp, params)
    return plan_report(plan, out, 0, inp)
