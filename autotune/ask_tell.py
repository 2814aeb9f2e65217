"""The batched ask/tell loop: ask the sampler for a batch of trials (each a legal plan), score the
batch in one cost-model call, tell the results; and the clean-up of trials left by dead workers.

A plan that does not fit in memory is told with its true objective values and a constraint
(`Trial.set_constraint("memory_gb_over", peak - limit)`, > 0 = infeasible), which TPE, NSGA-II and
GP read. CMA-ES ignores constraints, so it is told a penalized value.

Dead workers: on an RDB storage every asked trial gets a heartbeat (`record_heartbeat`) and a new
worker first runs `optuna.storages.fail_stale_trials`; on any storage a trial RUNNING for longer than
`stale_after_s` is failed too. Either way `RetryHeartbeatStaleTrialCallback` queues its plan again, so a
killed worker loses nothing.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import numpy as np
import optuna
from optuna.storages import BaseStorage, RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.trial import TrialState

from costmodels.params import EfficiencyParams
from costmodels.plan import PLAN_FIELDS, Plan, PlanBatch
from search_spaces.optuna_space import IllegalParams, PlanSpace

from .objectives import CONSTRAINT, OBJECTIVES, Objective, trial_metrics
from .samplers import CONSTRAINT_AWARE, LegalGridSampler
from .scoring import SMALL_CHUNK, Inputs, plan_report, score_full, score_summary
from .storage import MAX_RETRY, is_storage_error, storage_error

#: RUNNING trials older than this (seconds) are taken as left by a dead worker
STALE_AFTER_S = 600.0


# ------------------------------------------------------------------------------------------------
# Scoring a batch of trials
# ------------------------------------------------------------------------------------------------

class _RowInputs:
    """Inputs whose cluster values differ per row (a batch mixing GPU counts)."""

    def __init__(self, base: Inputs, hw_rows: dict):
        self.problem = base.problem
        self.model = base.model
        self.job = base.job
        self.hw = hw_rows


class BatchScorer:
    """Scores plans of any GPU count of a space: one `score_summary` call per batch."""

    def __init__(self, space: PlanSpace, params: EfficiencyParams, memory_limit_gb: float | None):
        self.space = space
        self.params = params
        self.memory_limit_gb = memory_limit_gb
        self._inputs: dict = {}
        self.model_s = 0.0          # wall time inside the cost model

    def inputs(self, n: int) -> Inputs:
        if n not in self._inputs:
            self._inputs[n] = Inputs(self.space.problem(n), self.memory_limit_gb)
        return self._inputs[n]

    def limit_bytes(self, n: int) -> float:
        return self.inputs(n).memory_limit_bytes

    def warm_up(self) -> None:
        """Compile the scorer before any trial is asked, so a trial's RUNNING time is milliseconds
        (a worker sharing the study never takes it for a dead one's while XLA compiles)."""
        n = next((c for c in self.space.counts if self.space.has_legal(c)), None)
        if n is not None:
            batch = self.space.legal_plans(n).select(np.zeros(1, dtype=np.int64))
            self.score(np.array([n]), batch)

    def score(self, counts: np.ndarray, batch: PlanBatch) -> tuple[np.ndarray, np.ndarray]:
        """(step time s, peak memory bytes) per plan; `counts[i]` is plan i's GPU count."""
        t0 = time.perf_counter()
        counts = np.asarray(counts)
        uniq = np.unique(counts)
        if len(uniq) == 1:
            out = score_summary(batch, self.inputs(int(uniq[0])), self.params)
        else:
            steps = np.empty(len(batch), dtype=np.float32)
            mems = np.empty(len(batch), dtype=np.float32)
            for start in range(0, len(batch), SMALL_CHUNK):
                stop = min(start + SMALL_CHUNK, len(batch))
                idx = np.concatenate([np.arange(start, stop), np.full(SMALL_CHUNK - (stop - start), start)])
                hws = {int(n): self.inputs(int(n)).hw for n in np.unique(counts[start:stop])}
                rows = counts[idx]
                hw = {k: np.array([hws[int(n)][k] for n in rows], dtype=np.float32) for k in hws[int(rows[0])]}
                s, m = score_summary(batch.select(idx), _RowInputs(self.inputs(int(rows[0])), hw), self.params)
                steps[start:stop] = s[: stop - start]
                mems[start:stop] = m[: stop - start]
            out = (steps, mems)
        self.model_s += time.perf_counter() - t0
        return out

    def reports(self, entries: list[tuple[int, dict]]) -> list[dict]:
        """Full plan reports (the JSON of `predict`) for (gpu count, plan) pairs, in order."""
        out: list = [None] * len(entries)
        by_n: dict = {}
        for i, (n, _) in enumerate(entries):
            by_n.setdefault(n, []).append(i)
        for n, idx in by_n.items():
            batch = PlanBatch({f: np.array([Plan.from_dict(entries[i][1]).row()[f] for i in idx], dtype=np.int32)
                               for f in PLAN_FIELDS})
            inp = self.inputs(n)
            full = score_full(batch, inp, self.params)
            for j, i in enumerate(idx):
                out[i] = {**plan_report(batch.plan(j), full, j, inp), "num_gpus": int(n)}
        return out


def plan_dict(plan: dict) -> dict:
    """A plan of ints as the report shows it (recompute by name, modules as a list, booleans)."""
    return Plan.from_dict(plan).as_dict()


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------

@dataclass
class RunStats:
    trials: int = 0                  # trials this run told COMPLETE
    failed: int = 0                  # trials this run told FAIL (illegal params, non-finite score)
    lost: int = 0                    # trials another worker failed as stale before this one told them
    interrupted: bool = False
    elapsed_s: float = 0.0           # the whole run, warm-up included
    warmup_s: float = 0.0            # compiling (or loading) the scorer before the first trial
    model_s: float = 0.0             # inside the cost model, after the warm-up
    zombies_failed: int = 0

    def as_dict(self) -> dict:
        """`wall_per_trial_ms` and `model_share` are of the trials alone (elapsed minus warm-up):
        the per-trial overhead, which the one-off compile of a fresh process would otherwise hide."""
        trials_s = max(self.elapsed_s - self.warmup_s, 0.0)
        return {"trials": self.trials, "failed": self.failed, "lost": self.lost, "interrupted": self.interrupted,
                "elapsed_s": self.elapsed_s, "warmup_s": self.warmup_s, "model_s": self.model_s,
                "zombies_failed": self.zombies_failed,
                "wall_per_trial_ms": 1e3 * trials_s / max(self.trials + self.failed, 1),
                "model_share": self.model_s / trials_s if trials_s > 0 else 0.0}


class _Interrupt:
    """First Ctrl-C: finish the batch in flight, then stop. A second one interrupts at once."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.getsignal(signal.SIGINT)

            def handler(signum, frame):
                if self.requested:
                    raise KeyboardInterrupt
                self.requested = True

            signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Heartbeat:
    """Records a heartbeat for each asked trial on storages that keep them (Optuna's RDBStorage)."""
    storage: BaseStorage
    study_id: int

    @classmethod
    def of(cls, storage: BaseStorage, study: optuna.Study) -> "Heartbeat | None":
        if not callable(getattr(storage, "record_heartbeat", None)) or not storage.get_heartbeat_interval():
            return None
        return cls(storage, storage.get_study_id_from_name(study.study_name))

    def beat(self, trials: list) -> None:
        for t in trials:
            self.storage.record_heartbeat(self.storage.get_trial_id_from_study_id_trial_number(self.study_id, t.number))


def run_batches(study: optuna.Study, space: PlanSpace, scorer: BatchScorer, objectives: tuple,
                *, n_trials: int | None, timeout_s: float | None, batch_size: int,
                sampler_name: str, progress: Callable[[int, "RunStats", dict | None], None] | None = None,
                url: str | None = None, storage: BaseStorage | None = None) -> RunStats:
    """Ask/score/tell in batches until n_trials trials are told, the timeout, or Ctrl-C."""
    stats = RunStats()
    objs = [OBJECTIVES[o] for o in objectives]
    penalize = sampler_name not in CONSTRAINT_AWARE + ("grid", "random")
    heart = Heartbeat.of(storage, study) if storage is not None else None
    me = worker_id()
    t0 = time.perf_counter()
    best: dict | None = None
    pending: list = []
    limit = n_trials
    if isinstance(study.sampler, LegalGridSampler):
        left = max(study.sampler.size - len(study.get_trials(deepcopy=False)), 0)
        limit = left if limit is None else min(limit, left)
    scorer.warm_up()
    stats.warmup_s = time.perf_counter() - t0
    model0 = scorer.model_s
    try:
        with _Interrupt() as intr, warnings.catch_warnings():
            warnings.simplefilter("ignore")     # "heartbeat is supposed to be used with optimize"
            while limit is None or stats.trials + stats.failed < limit:
                if intr.requested:
                    stats.interrupted = True
                    break
                if timeout_s is not None and time.perf_counter() - t0 >= timeout_s:
                    break
                k = batch_size if limit is None else min(batch_size, limit - stats.trials - stats.failed)
                pending, asked = _ask_batch(study, space, k, me, stats)
                if heart is not None:
                    heart.beat(pending)
                if not pending:
                    continue
                counts = np.array([asked[t.number][0] for t in pending])
                batch = PlanBatch({f: np.array([asked[t.number][1][f] for t in pending], dtype=np.int32)
                                   for f in PLAN_FIELDS})
                steps, mems = scorer.score(counts, batch)
                for i, trial in enumerate(list(pending)):
                    n, plan = asked[trial.number]
                    m = trial_metrics(n, float(steps[i]), float(mems[i]), scorer.limit_bytes(n),
                                      space.problem(n).job.tokens_per_step)
                    pending.remove(trial)
                    if _tell(study, trial, plan, m, objs, penalize, stats) and m["fits"] and (
                            best is None or objs[0].better(m[objs[0].metric], best[objs[0].metric])):
                        best = {**m, "plan": plan_dict(plan)}
                stats.elapsed_s = time.perf_counter() - t0
                stats.model_s = scorer.model_s - model0
                if progress is not None and progress(stats.trials + stats.failed, stats, best) is True:
                    break                                   # the callback asked to stop
    except KeyboardInterrupt:
        stats.interrupted = True
    except Exception as exc:
        _fail_pending(study, pending)
        if is_storage_error(exc):
            raise storage_error(exc, url) from None
        raise
    _fail_pending(study, pending)
    stats.elapsed_s = time.perf_counter() - t0
    stats.model_s = scorer.model_s - model0
    return stats


def _ask_batch(study: optuna.Study, space: PlanSpace, k: int, owner: str, stats: RunStats) -> tuple[list, dict]:
    """Ask k trials and suggest their plans; a trial whose (enqueued) params are illegal is failed."""
    pending, asked = [], {}
    for _ in range(k):
        trial = study.ask()
        try:
            trial.set_user_attr("worker", owner)
            asked[trial.number] = space.suggest(trial)
        except IllegalParams as exc:
            trial.set_user_attr("illegal", str(exc))
            study.tell(trial, state=TrialState.FAIL)
            stats.failed += 1
            continue
        except optuna.exceptions.UpdateFinishedTrialError:
            stats.lost += 1                 # another worker failed it as stale meanwhile
            continue
        pending.append(trial)
    return pending, asked


def _tell(study: optuna.Study, trial, plan: dict, m: dict, objs: list, penalize: bool, stats: RunStats) -> bool:
    """Tell one scored trial; False when it failed (non-finite score) or was failed by another worker."""
    try:
        trial.set_user_attr("plan", plan_dict(plan))
        trial.set_user_attr("metrics", m)
        if not math.isfinite(m["step_time_s"]):
            study.tell(trial, state=TrialState.FAIL)
            stats.failed += 1
            return False
        trial.set_constraint(CONSTRAINT, m[CONSTRAINT])
        values = [m[o.metric] for o in objs]
        if penalize and not m["fits"]:
            values = [_penalized(v, o, m[CONSTRAINT], m["memory_limit_gb"]) for v, o in zip(values, objs)]
        study.tell(trial, values)
    except optuna.exceptions.UpdateFinishedTrialError:
        stats.lost += 1                     # another worker took it for a dead one's: its plan is queued again
        return False
    stats.trials += 1
    return True


def _penalized(value: float, obj: Objective, over_gb: float, limit_gb: float) -> float:
    factor = 2.0 + max(over_gb, 0.0) / max(limit_gb, 1e-9)
    return value / factor if obj.direction == "maximize" else value * factor


def _fail_pending(study: optuna.Study, pending: list) -> None:
    for trial in pending:
        with contextlib.suppress(Exception):
            study.tell(trial, state=TrialState.FAIL)
    pending.clear()


# ------------------------------------------------------------------------------------------------
# Trials left by dead workers
# ------------------------------------------------------------------------------------------------

def fail_stale(study: optuna.Study, storage: BaseStorage, stale_after_s: float = STALE_AFTER_S) -> int:
    """Fail the RUNNING trials of dead workers and queue their plans again; returns how many.

    Stale = the storage's heartbeat is older than its grace period (`fail_stale_trials`, RDB), or the
    trial has been RUNNING for longer than `stale_after_s` (any storage)."""
    before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if callable(getattr(storage, "get_heartbeat_interval", None)) and storage.get_heartbeat_interval():
            fail_stale_trials(study)
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    failed = len(before - {t.number for t in running})
    study_id = storage.get_study_id_from_name(study.study_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
    for t in running:
        if t.datetime_start is None or _age_s(t.datetime_start) <= stale_after_s:
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        try:
            storage.set_trial_user_attr(trial_id, "failed_reason",
                                        f"worker {t.user_attrs.get('worker', '?')} stopped (stale)")
            if storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                failed += 1
                retry(study, storage.get_trial(trial_id))
        except optuna.exceptions.UpdateFinishedTrialError:
            pass            # another worker failed it first
    return failed


def _age_s(started: datetime) -> float:
    now = datetime.now(timezone.utc) if started.tzinfo else datetime.now()
    return (now - started).total_seconds()
