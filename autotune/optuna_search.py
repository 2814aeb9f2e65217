"""Optuna search: create or resume a study, seed it with the cost model's best plan, run the batched
ask/tell loop, and summarize the study as a search result; plus `auto`'s choice of strategy and the
exhaustive scoring of a GPU range whose every count is small enough to enumerate.

The jobs live in small modules: `objectives` (what is optimized), `samplers` (which Optuna sampler,
legal plans only), `study_spec` (the problem a study stores), `ask_tell` (the loop, dead workers),
`storage` (URLs, faults, passwords), `trials` (reading results), `plots` (optuna.visualization).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import optuna
from optuna.trial import TrialState

from costmodels.plan import PLAN_FIELDS
from costmodels.specs import SpecError
from search_spaces.optuna_space import PlanSpace

from .ask_tell import STALE_AFTER_S, BatchScorer, RunStats, fail_stale, run_batches, worker_id
from .objectives import CONSTRAINT, OBJECTIVES, directions, parse_objectives, trial_metrics
from .samplers import DEFAULT_SAMPLER, make_sampler
from .search import MESH, NoLegalPlan, NothingFits, SearchResult, _closest_message
from .strategy import AUTO_EXHAUSTIVE_MAX, StrategyChoice, choose_strategy
from .strategy import THROUGHPUT as _THROUGHPUT
from .storage import is_storage_error, load_study, open_storage, redact_url, storage_error
from .studies import STUDY_ATTR, VERIFY_ATTR
from .study_spec import DEFAULT_BATCH, MAX_BATCH, StudySpec, default_study_name, spec_line
from .trials import best_trials, count_states, feasible, metrics, pareto_trials

DEFAULT_TRIALS = 300

__all__ = ["AUTO_EXHAUSTIVE_MAX", "BatchScorer", "CONSTRAINT", "DEFAULT_BATCH", "DEFAULT_SAMPLER", "DEFAULT_TRIALS",
           "MAX_BATCH",
           "OBJECTIVES", "RunStats", "STALE_AFTER_S", "StrategyChoice", "StudySpec", "best_trials", "choose_strategy",
           "create_study", "exhaustive_range", "make_sampler", "optuna_search", "parse_objectives", "pareto_trials",
           "run_batches", "run_worker"]


# ------------------------------------------------------------------------------------------------
# Studies
# ------------------------------------------------------------------------------------------------

def create_study(spec: StudySpec, *, storage_url: str | None, study_name: str | None,
                 sampler: optuna.samplers.BaseSampler, storage=None) -> tuple[optuna.Study, bool]:
    """Create the study, or load it when the storage has one of that name with the same problem.
    Returns (study, resumed)."""
    storage = storage if storage is not None else open_storage(storage_url)
    name = study_name or (default_study_name(spec) if storage_url else None)
    optuna.logging.set_verbosity(optuna.logging.ERROR)   # its warnings would break the one-line error contract
    existing = None
    if name is not None:
        with contextlib.suppress(KeyError):
            existing = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    if existing is not None:
        old = existing.user_attrs.get(STUDY_ATTR)
        if VERIFY_ATTR in existing.user_attrs:
            raise SpecError("study", f"study {name!r} in {redact_url(storage_url)} is a verification study (real "
                            f"runs: `autotune worker --runner`); choose another --study name")
        if not old:
            raise SpecError("study", f"study {name!r} in {redact_url(storage_url)} was not made by autotune; "
                            f"choose another --study name")
        old_spec = StudySpec.from_attrs(old)
        if old_spec.problem_attrs() != spec.problem_attrs() or tuple(old_spec.objectives) != tuple(spec.objectives):
            raise SpecError("study", f"study {name!r} in {redact_url(storage_url)} holds another problem or "
                            f"objectives ({spec_line(old_spec)}); choose another --study name")
        return existing, True
    try:
        study = optuna.create_study(storage=storage, study_name=name, sampler=sampler,
                                    directions=directions(spec.objectives))
    except optuna.exceptions.DuplicatedStudyError:       # another process created it meanwhile
        return optuna.load_study(study_name=name, storage=storage, sampler=sampler), True
    study.set_user_attr(STUDY_ATTR, spec.to_attrs())
    return study, False


#: enqueue_best scores the table in slices of this many plans (bounded memory; ~15 M plans/s scored)
SEED_SLICE = 2_000_000


def enqueue_best(study: optuna.Study, space: PlanSpace, scorer: BatchScorer, objectives: tuple) -> dict | None:
    """Seed a new single-count study with the best fitting plan of the exhaustive table (the Optuna-only
    knobs as enumeration sets them: the even split or one of its balanced uneven splits, no block
    recompute); Optuna then searches around it (every uneven split, block recompute, other objectives).
    The table is built for the sampler anyway, and scoring it costs less than building it: every size
    is scored. (Until 2026-12-06 only tables of at most AUTO_EXHAUSTIVE_MAX plans were: DeepSeek-V3 on
    2,048 H800 was then not seeded, and 300 trials ended 53 % slower than the exhaustive best.)"""
    if space.is_range or tuple(objectives[:1]) not in _THROUGHPUT:
        return None
    n = space.counts[0]
    if not space.has_legal(n):
        return None
    table = space.table(n)
    best, best_step = None, np.inf
    for start in range(0, len(table), SEED_SLICE):
        batch = table.batch(n, slice(start, start + SEED_SLICE))
        steps, mems = scorer.score(np.full(len(batch), n), batch)
        ok = (mems <= scorer.limit_bytes(n)) & np.isfinite(steps)
        if ok.any():
            i = int(np.argmin(np.where(ok, steps, np.inf)))
            if steps[i] < best_step:
                best, best_step = {f: int(batch[f][i]) for f in PLAN_FIELDS}, float(steps[i])
    if best is None:
        return None
    params = space.params_of(n, best)
    study.enqueue_trial(params, user_attrs={"seeded": "exhaustive best"}, skip_if_exists=True)
    return params


# ------------------------------------------------------------------------------------------------
# Summaries
# ------------------------------------------------------------------------------------------------

def _trial_entry(t) -> tuple[int, dict]:
    return int(metrics(t)["gpus"]), dict(t.user_attrs["plan"])


def summarize(study: optuna.Study, spec: StudySpec, space: PlanSpace, scorer: BatchScorer, *,
              top_k: int, elapsed_s: float, run: RunStats | None, storage_url: str | None) -> SearchResult:
    """A SearchResult with the same keys as exhaustive (best, top, space, ...) plus `extra["optuna"]`."""
    objectives = tuple(spec.objectives)
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE and "plan" in t.user_attrs]
    feas = feasible(trials)
    known = space.known_stats()
    space_d = {"total": known["total"], "legal": known["legal"], "illegal": known["illegal"],
               "fitting": len(feas), "scored": len(complete), "trials": len(trials),
               "gpu_counts": known["gpu_counts"], "gpu_counts_enumerated": known["gpu_counts_enumerated"]}
    if not complete:
        if known["legal"] == 0 and known["gpu_counts_enumerated"] == known["gpu_counts"]:
            raise NoLegalPlan("gpus", f"no legal plan for {spec.gpus} GPUs with this model and job")
        raise SpecError("trials", "no trial finished; give more --trials or a longer --timeout")
    if not feas:
        closest = min(complete, key=lambda t: float(metrics(t).get(CONSTRAINT, math.inf)))
        rep = scorer.reports([_trial_entry(closest)])[0]
        raise NothingFits(_closest_message(rep, rep["memory_gb"]["limit"]), rep, space_d)
    top_t = best_trials(study, objectives, max(top_k, 1) * 4)
    reports = scorer.reports([_trial_entry(t) for t in top_t])
    for rep, t in zip(reports, top_t):
        rep["trial"] = t.number
    info = {
        "sampler": spec.sampler, "seed": spec.seed, "n_trials": len(trials),
        "n_complete": len(complete), "n_feasible": len(feas),
        "storage": redact_url(storage_url), "study": study.study_name,
        "objectives": _objective_rows(objectives), "gpus": spec.gpus, "batch_size": spec.batch_size,
        "cost_unit": "GPU-hours per optimizer step (gpus * step_time_s / 3600)",
    }
    if run is not None:
        info["run"] = run.as_dict()
    if len(objectives) > 1:
        front = pareto_trials(study)
        info["pareto_front"] = [
            {"trial": t.number, "values": {o: float(v) for o, v in zip(objectives, t.values)}, **rep}
            for t, rep in zip(front, scorer.reports([_trial_entry(t) for t in front]))]
    return SearchResult(problem=space.problem(reports[0]["num_gpus"]), best=reports[0], top=reports[:top_k],
                        space=space_d, elapsed_s=elapsed_s, strategy="optuna", runner_up=_runner_up(reports),
                        extra={"optuna": info}, study=study)


def _objective_rows(objectives) -> list:
    return [{"name": o, "direction": OBJECTIVES[o].direction, "unit": OBJECTIVES[o].unit} for o in objectives]


def _runner_up(reports: list) -> dict | None:
    """The best plan with another parallel layout (mesh and GPU count) than the best."""
    def mesh(r):
        return tuple(r["plan"][k] for k in MESH) + (r["num_gpus"],)
    return next((r for r in reports[1:] if mesh(r) != mesh(reports[0])), reports[1] if len(reports) > 1 else None)


# ------------------------------------------------------------------------------------------------
# search and worker
# ------------------------------------------------------------------------------------------------

def optuna_search(spec: StudySpec, *, n_trials: int | None = DEFAULT_TRIALS, timeout_s: float | None = None,
                  storage_url: str | None = None, study_name: str | None = None, top_k: int = 10,
                  progress: Callable | None = None, space: PlanSpace | None = None,
                  seed_best: bool = True) -> SearchResult:
    """Run (or resume) a study of `spec` for n_trials more trials; the best plans found so far.
    A new study starts from the exhaustive table's best plan (`enqueue_best`) unless `seed_best` is off."""
    t0 = time.perf_counter()
    spec = spec.resolved()
    _check_run(n_trials, timeout_s)
    space = space or spec.build_space()
    _require_legal(space, spec)
    scorer = BatchScorer(space, spec.params(), spec.memory_limit_gb)
    sampler = make_sampler(spec.sampler, spec.seed, space, len(spec.objectives))
    storage = open_storage(storage_url)
    try:
        study, resumed = create_study(spec, storage_url=storage_url, study_name=study_name, sampler=sampler,
                                      storage=storage)
        zombies = fail_stale(study, storage) if resumed else 0
        seeded = None if resumed or not seed_best or spec.sampler == "grid" else \
            enqueue_best(study, space, scorer, spec.objectives)
    except Exception as exc:
        if is_storage_error(exc):
            raise storage_error(exc, storage_url) from None
        raise
    run = run_batches(study, space, scorer, spec.objectives, n_trials=n_trials, timeout_s=timeout_s,
                      batch_size=spec.batch_size, sampler_name=spec.sampler, progress=progress, url=storage_url,
                      storage=storage)
    run.zombies_failed = zombies
    result = summarize(study, spec, space, scorer, top_k=top_k, elapsed_s=time.perf_counter() - t0, run=run,
                       storage_url=storage_url)
    result.extra["optuna"].update(resumed=resumed, interrupted=run.interrupted, seeded=seeded is not None)
    result.study = study                  # for the report's Optuna plots (not part of the JSON)
    return result


def _check_run(n_trials: int | None, timeout_s: float | None, batch_size: int | None = None) -> None:
    if n_trials is not None and n_trials < 1:
        raise SpecError("trials", f"must be a positive integer, got {n_trials}")
    if timeout_s is not None and not timeout_s > 0:
        raise SpecError("timeout", f"must be a positive number of seconds, got {timeout_s}")
    if batch_size is not None and not 1 <= batch_size <= MAX_BATCH:
        raise SpecError("batch_size", f"must be an integer in 1..{MAX_BATCH}, got {batch_size}")


def _require_legal(space: PlanSpace, spec: StudySpec) -> None:
    if not space.is_range:
        n = space.counts[0]
        if not space.has_legal(n):
            st = space.stats(n)
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted((st.illegal or {}).items(), key=lambda kv: -kv[1])[:3])
            raise NoLegalPlan("gpus", f"no legal plan for {n} GPUs with this model and job (of {st.total} "
                              f"combinations; most common violations: {reasons})")
    elif not any(space.has_legal(n) for n in _probe_order(space.counts)):
        raise NoLegalPlan("gpus", f"no GPU count in {spec.gpus} has a legal plan for this model and job")


def _probe_order(counts):
    """Counts to probe for a legal plan: a few spread over the range first, then all."""
    counts = list(counts)
    picks = [counts[i] for i in np.linspace(0, len(counts) - 1, min(len(counts), 5)).astype(int)]
    return picks + [c for c in counts if c not in picks]


def run_worker(storage_url: str, study_name: str, *, n_trials: int | None, timeout_s: float | None = None,
               batch_size: int | None = None, seed: int | None = None, stale_after_s: float = STALE_AFTER_S,
               progress: Callable | None = None) -> dict:
    """Run n_trials more trials of an existing study (its problem comes from the study itself)."""
    _check_run(n_trials, timeout_s, batch_size)
    if not stale_after_s > 0:
        raise SpecError("stale_after", f"must be a positive number of seconds, got {stale_after_s}")
    t0 = time.perf_counter()
    optuna.logging.set_verbosity(optuna.logging.ERROR)   # its warnings would break the one-line error contract
    storage = open_storage(storage_url, must_exist=True, grace_s=stale_after_s if stale_after_s < STALE_AFTER_S else None)
    try:
        spec = StudySpec.from_attrs(load_study(storage, study_name, storage_url).user_attrs.get(STUDY_ATTR))
        space = spec.build_space()
        study = load_study(storage, study_name, storage_url,
                           sampler=make_sampler(spec.sampler, seed, space, len(spec.objectives)))
        zombies = fail_stale(study, storage, stale_after_s)
    except Exception as exc:
        if is_storage_error(exc):
            raise storage_error(exc, storage_url) from None
        raise
    scorer = BatchScorer(space, spec.params(), spec.memory_limit_gb)
    run = run_batches(study, space, scorer, spec.objectives, n_trials=n_trials, timeout_s=timeout_s,
                      batch_size=batch_size or spec.batch_size, sampler_name=spec.sampler, progress=progress,
                      url=storage_url, storage=storage)
    run.zombies_failed = zombies
    out = {"study": study_name, "storage": redact_url(storage_url), "worker": worker_id(),
           "sampler": spec.sampler, "seed": seed, "objectives": list(spec.objectives),
           "run": run.as_dict(), "study_trials": count_states(study), "elapsed_s": time.perf_counter() - t0}
    best = best_trials(study, spec.objectives, 1)
    if best:
        out["best"] = {**scorer.reports([_trial_entry(best[0])])[0], "trial": best[0].number}
    return out


# ------------------------------------------------------------------------------------------------
# A GPU range scored exhaustively
# ------------------------------------------------------------------------------------------------

def range_legal_count(spec: StudySpec, space: PlanSpace | None = None) -> int:
    """Legal plans summed over the GPU counts of the range (each count's table is enumerated)."""
    space = space or spec.build_space()
    return sum(len(space.table(n)) for n in space.counts if space.has_legal(n))


def exhaustive_range(spec: StudySpec, *, top_k: int = 10, space: PlanSpace | None = None) -> SearchResult:
    """Every legal plan of every GPU count of the range, scored; the best by the objective (one), or
    the exact Pareto front (two objectives)."""
    t0 = time.perf_counter()
    spec = spec.resolved()
    objectives = tuple(spec.objectives)
    if len(objectives) > 2:
        raise SpecError("objective", "an exhaustive range search takes one or two objectives; use --strategy optuna")
    space = space or spec.build_space()
    _require_legal(space, spec)
    scorer = BatchScorer(space, spec.params(), spec.memory_limit_gb)
    rows = []                                  # per count: (n, batch, metric arrays, fits)
    for n in space.counts:
        if not space.has_legal(n):
            continue
        batch = space.legal_plans(n)
        steps, mems = scorer.score(np.full(len(batch), n), batch)
        rows.append((n, batch, _metric_arrays(n, steps, mems, space.problem(n).job.tokens_per_step),
                     (mems <= scorer.limit_bytes(n)) & np.isfinite(steps)))
    known = space.known_stats()
    fitting = int(sum(r[3].sum() for r in rows))
    space_d = {"total": known["total"], "legal": known["legal"], "illegal": known["illegal"], "fitting": fitting,
               "scored": known["legal"], "gpu_counts": known["gpu_counts"],
               "gpu_counts_enumerated": known["gpu_counts_enumerated"]}
    where = [(n, batch, i) for n, batch, _, fits in rows for i in np.flatnonzero(fits)]
    if not where:
        n, batch, m, _ = min(rows, key=lambda r: float(np.min(r[2]["memory_gb"])))
        i = int(np.argmin(m["memory_gb"]))
        rep = scorer.reports([(n, batch.plan(i).as_dict())])[0]
        raise NothingFits(_closest_message(rep, rep["memory_gb"]["limit"]), rep, space_d)
    values = np.stack([np.concatenate([r[2][OBJECTIVES[o].metric][r[3]] for r in rows]) for o in objectives], 1)
    signs = np.array([-1.0 if OBJECTIVES[o].direction == "maximize" else 1.0 for o in objectives])
    keyed = values * signs                                     # lower is better in every column
    order = np.lexsort(keyed[:, ::-1].T)                       # by the first objective, then the next
    top_idx = [int(i) for i in order[:max(top_k, 1) * 4]]
    reports = scorer.reports([(where[i][0], where[i][1].plan(int(where[i][2])).as_dict()) for i in top_idx])
    info = {"objectives": _objective_rows(objectives), "gpus": spec.gpus,
            "scored_per_s": known["legal"] / max(time.perf_counter() - t0, 1e-9)}
    if len(objectives) == 2:
        front = sorted(_pareto_2d(keyed), key=lambda i: tuple(values[i]))     # as Optuna sorts its front
        front_reports = scorer.reports([(where[i][0], where[i][1].plan(int(where[i][2])).as_dict()) for i in front])
        info["pareto_front"] = [{"values": {o: float(values[i, j]) for j, o in enumerate(objectives)}, **rep}
                                for i, rep in zip(front, front_reports)]
    return SearchResult(problem=space.problem(reports[0]["num_gpus"]), best=reports[0], top=reports[:top_k],
                        space=space_d, elapsed_s=time.perf_counter() - t0, strategy="exhaustive",
                        runner_up=_runner_up(reports), extra={"range": info})


def _metric_arrays(n: int, steps: np.ndarray, mems: np.ndarray, tokens: int) -> dict:
    """`trial_metrics` over arrays (the same formulas, vectorized)."""
    steps = steps.astype(np.float64)
    ok = np.isfinite(steps) & (steps > 0)
    safe = np.where(ok, steps, 1.0)
    one = trial_metrics(n, 1.0, 0.0, 1.0, tokens)          # the per-step constants, once
    return {"gpus": np.full(len(steps), float(n)), "step_time_s": steps,
            "tokens_per_s": np.where(ok, one["tokens_per_s"] / safe, 0.0),
            "cost_gpu_h": np.where(ok, one["cost_gpu_h"] * safe, np.inf),
            "memory_gb": mems.astype(np.float64) / 1e9}


def _pareto_2d(keyed: np.ndarray) -> list:
    """Indices of the non-dominated rows of a (N, 2) array (lower is better), sorted by column 0."""
    order = np.lexsort((keyed[:, 1], keyed[:, 0]))
    out, best1 = [], math.inf
    for i in order:
        if keyed[i, 1] < best1:
            out.append(int(i))
            best1 = keyed[i, 1]
    return out


