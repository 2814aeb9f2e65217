"""Optuna search: batched ask/tell over the vectorized cost model, one or several objectives.

A run asks the sampler for a batch of trials (define-by-run over `PlanSpace`, so every trial is a
legal plan), scores the whole batch in one `score_summary` call, and tells the results. Plans that
do not fit in memory are told with their true objective values and a constraint
(`Trial.set_constraint("memory_gb_over", peak - limit)`, > 0 = infeasible), which TPE, NSGA-II and
GP read (Optuna 5 replaced the samplers' `constraints_func` by `Trial.set_constraint`; the value is
also in the trial's user attributes). CMA-ES ignores constraints, so it is told a penalized value.

A study keeps its problem in the user attribute "autotune" (`StudySpec.to_attrs()`), so a worker
needs only the storage and the study name. Each trial's user attributes hold the plan and its
metrics, for the Optuna dashboard and for `autotune studies`.

Objectives (`OBJECTIVES`):
    tokens_per_s  maximize   training throughput of the whole cluster
    step_time     minimize   seconds per optimizer step
    gpus          minimize   the GPU count (a knob when --gpus is a range)
    cost          minimize   GPU-hours per optimizer step (gpus * step_time / 3600); every plan of a
                             study processes the same tokens per step, so this is GPU-hours per token
                             up to a constant. No price: multiply by your $ per GPU-hour.
    memory        minimize   peak memory per GPU in GB
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import signal
import socket
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np
import optuna
from optuna.trial import TrialState

from costmodels.params import EfficiencyParams
from costmodels.plan import PLAN_FIELDS, Plan, PlanBatch
from costmodels.specs import Recompute, SpecError
from search_spaces.optuna_space import (
    GPUS, GpuRange, IllegalParams, LegalGridSampler, LegalSampler, PlanSpace, parse_gpus,
)
from search_spaces.space import Problem

from .scoring import SMALL_CHUNK, Inputs, plan_report, score_full, score_summary
from .search import MESH, NoLegalPlan, NothingFits, SearchResult, _closest_message
from .studies import STUDY_ATTR, count_states, load_study, open_storage, redact_url, scrub

# ------------------------------------------------------------------------------------------------
# Objectives and samplers
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Objective:
    name: str
    direction: str          # "maximize" or "minimize"
    unit: str
    label: str
    metric: str             # key of the trial metrics

    def better(self, a: float, b: float) -> bool:
        return a > b if self.direction == "maximize" else a < b


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("tokens_per_s", "maximize", "tokens/s", "throughput (tokens/s)", "tokens_per_s"),
    Objective("step_time", "minimize", "s", "step time (s)", "step_time_s"),
    Objective("gpus", "minimize", "GPUs", "GPUs", "gpus"),
    Objective("cost", "minimize", "GPU-h/step", "cost (GPU-hours per step)", "cost_gpu_h"),
    Objective("memory", "minimize", "GB", "peak memory per GPU (GB)", "memory_gb"),
)}

SAMPLERS = ("tpe", "nsga2", "gp", "cmaes", "random", "grid")
#: samplers that read `Trial.set_constraint` (the others see penalized or raw values)
CONSTRAINT_AWARE = ("tpe", "nsga2", "gp")
DEFAULT_SAMPLER = "tpe"
DEFAULT_BATCH = 8
DEFAULT_TRIALS = 300
MAX_BATCH = SMALL_CHUNK
#: TPE settings tuned on tests/benchmarks/bench_optuna.py (trials to reach 1% of the optimum):
#: 16 random start-up trials, 48 candidates per acquisition, then 70% of the trials refine the
#: best 3 plans locally and the rest come from multivariate TPE (constant liar for the batch),
#: re-asked up to 3 times when it repeats a plan (see search_spaces.optuna_space.LegalSampler).
#: The local moves are ranked by a local model of the told values (expected improvement times the
#: probability of fitting memory, `TPE_SURROGATE`); without it, TPE's l(x)/g(x) ranks the nearest.
TPE_STARTUP_TRIALS = 16
TPE_EI_CANDIDATES = 48
TPE_REFINE = 0.7
TPE_REFINE_INCUMBENTS = 3
TPE_RETRIES = 3
TPE_SURROGATE = True
#: "gp" (Gaussian processes on a Hamming-like kernel: sees knob interactions) or "linear" (additive)
TPE_SURROGATE_MODEL = "gp"
#: `auto` searches exhaustively up to this many legal plans (~1 s per 10^6 plans on 2 CPU cores)
AUTO_EXHAUSTIVE_MAX = 3_000_000
#: RUNNING trials older than this (seconds) are taken as left by a dead worker
STALE_AFTER_S = 600.0
CONSTRAINT = "memory_gb_over"


def parse_objectives(names) -> tuple[str, ...]:
    out = []
    for n in names or ("tokens_per_s",):
        key = str(n).strip().lower().replace("-", "_")
        key = {"throughput": "tokens_per_s", "tokens": "tokens_per_s", "step_time_s": "step_time",
               "mem": "memory", "gpu": "gpus"}.get(key, key)
        if key not in OBJECTIVES:
            raise SpecError("objective", f"unknown objective {n!r}; choose from {', '.join(OBJECTIVES)}")
        if key in out:
            raise SpecError("objective", f"{key} given twice")
        out.append(key)
    if "tokens_per_s" in out and "step_time" in out:
        raise SpecError("objective", "tokens_per_s and step_time are the same objective (tokens per step "
                        "is fixed); keep one")
    return tuple(out)


def check_sampler(name: str, n_objectives: int) -> str:
    key = str(name).strip().lower().replace("-", "").replace("_", "")
    key = {"nsgaii": "nsga2", "cmaes": "cmaes", "cma": "cmaes", "bruteforce": "grid"}.get(key, key)
    if key not in SAMPLERS:
        raise SpecError("sampler", f"unknown sampler {name!r}; choose from {', '.join(SAMPLERS)}")
    if key == "cmaes":
        if n_objectives > 1:
            raise SpecError("sampler", "cmaes optimizes one objective; use tpe or nsga2 for several")
        if importlib.util.find_spec("cmaes") is None:
            raise SpecError("sampler", "cmaes needs the cmaes package: pip install cmaes")
    if key == "gp" and importlib.util.find_spec("torch") is None:
        raise SpecError("sampler", "gp (Optuna's GPSampler) needs PyTorch: pip install torch; or use tpe")
    return key


def make_sampler(name: str, seed: int | None, space: PlanSpace, n_objectives: int) -> optuna.samplers.BaseSampler:
    """The named sampler, wrapped so it proposes legal plans only (grid enumerates them)."""
    key = check_sampler(name, n_objectives)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if key == "grid":
            return LegalGridSampler(space, seed=seed)
        if key == "tpe":
            base = optuna.samplers.TPESampler(
                seed=seed, multivariate=True, n_startup_trials=TPE_STARTUP_TRIALS,
                n_ei_candidates=TPE_EI_CANDIDATES, constant_liar=True)
            return LegalSampler(base, space, refine=TPE_REFINE if n_objectives == 1 else 0.0,
                                refine_after=TPE_STARTUP_TRIALS, refine_incumbents=TPE_REFINE_INCUMBENTS,
                                retries=TPE_RETRIES, seed=seed, surrogate=TPE_SURROGATE,
                                surrogate_model=TPE_SURROGATE_MODEL)
        elif key == "nsga2":
            base = optuna.samplers.NSGAIISampler(seed=seed, population_size=max(20, 2 * len(space.distributions)))
        elif key == "gp":
            base = optuna.samplers.GPSampler(seed=seed)
        elif key == "cmaes":
            base = optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=10,
                                                independent_sampler=optuna.samplers.RandomSampler(seed=seed),
                                                warn_independent_sampling=False)
        else:
            base = optuna.samplers.RandomSampler(seed=seed)
    return LegalSampler(base, space)


# ------------------------------------------------------------------------------------------------
# What a study searches (stored in the study, so workers can rebuild it)
# ------------------------------------------------------------------------------------------------

SPEC_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class StudySpec:
    """The problem and settings of a study, as JSON-able values (`autotune.api.build_problem`'s
    arguments; `gpus` is a count or a range text). A config.json model is stored as its absolute
    path: workers on other machines need the file at the same path."""
    model: str
    gpu: str | None = None
    gpus: str | None = None
    global_batch: int | None = None
    seq_len: int | None = None
    precision: str = "bf16"
    gpus_per_node: int | None = None
    intra_node_bw: float | None = None
    inter_node_bw: float | None = None
    cluster_file: str | None = None
    memory_limit_gb: float | None = None
    calibration: str | None = None
    fixed: dict = field(default_factory=dict)
    framework: dict = field(default_factory=dict)      # Megatron-Core options (FrameworkSpec fields)
    objectives: tuple = ("tokens_per_s",)
    sampler: str = DEFAULT_SAMPLER
    seed: int | None = None
    batch_size: int = DEFAULT_BATCH

    # ---- problem(s) ----
    def _build(self, n: int | None) -> Problem:
        from .api import build_problem
        return build_problem(model=self.model, gpu=self.gpu, gpus=n, global_batch=self.global_batch,
                             seq_len=self.seq_len, precision=self.precision, gpus_per_node=self.gpus_per_node,
                             intra_node_bw=self.intra_node_bw, inter_node_bw=self.inter_node_bw,
                             cluster_file=self.cluster_file, framework=self.framework)

    def gpu_spec(self) -> int | GpuRange | None:
        return None if self.gpus is None else parse_gpus(self.gpus)

    def counts(self) -> tuple[int, ...]:
        g = self.gpu_spec()
        if isinstance(g, GpuRange):
            return g.counts(self._node_size())
        return (self._build(g).cluster.num_gpus,)

    def _node_size(self) -> int:
        """GPUs per node (NVLink domain): --gpus-per-node, else the cluster file's, else the GPU preset's."""
        if self.gpus_per_node is not None:
            return int(self.gpus_per_node)
        from costmodels.presets import build_cluster, load_gpu
        if self.cluster_file is None:
            return load_gpu(self.gpu).gpus_per_node if self.gpu else 8
        try:
            return build_cluster(gpu=self.gpu, num_gpus=1 << 20, cluster_file=self.cluster_file).nvlink_domain_size
        except SpecError:
            return load_gpu(self.gpu).gpus_per_node if self.gpu else 8

    def resolved(self) -> "StudySpec":
        """The same spec with defaults made explicit (batch, sequence, model path), checked."""
        self.check()
        counts = self.counts()
        first = self._build(counts[0])
        model = self.model
        path = Path(model).expanduser()
        if path.exists():
            model = str(path.resolve())
        return replace(self, model=model, global_batch=first.job.global_batch, seq_len=first.job.seq_len,
                       objectives=parse_objectives(self.objectives),
                       sampler=check_sampler(self.sampler, len(self.objectives)))

    def check(self) -> None:
        parse_objectives(self.objectives)
        check_sampler(self.sampler, len(self.objectives))
        if not isinstance(self.batch_size, int) or not 1 <= self.batch_size <= MAX_BATCH:
            raise SpecError("batch_size", f"must be an integer in 1..{MAX_BATCH}, got {self.batch_size!r}")
        if self.memory_limit_gb is not None and not self.memory_limit_gb > 0:
            raise SpecError("memory_limit_gb", f"must be a positive number of GB, got {self.memory_limit_gb!r}")
        if self.gpus is not None:
            parse_gpus(self.gpus)

    def build_space(self) -> PlanSpace:
        counts = self.counts()
        if len(counts) == 1:
            return PlanSpace.single(self._build(counts[0]), self.fixed)
        return PlanSpace(problem_for=self._build, counts=counts, fixed=dict(self.fixed))

    def params(self) -> EfficiencyParams:
        from .api import load_params
        return load_params(self.calibration)[0]

    # ---- storage ----
    def to_attrs(self) -> dict:
        d = asdict(self)
        d["objectives"] = list(self.objectives)
        return {"version": SPEC_VERSION, **d}

    def problem_attrs(self) -> dict:
        d = self.to_attrs()
        return {k: d[k] for k in ("model", "gpu", "gpus", "global_batch", "seq_len", "precision",
                                  "gpus_per_node", "intra_node_bw", "inter_node_bw", "cluster_file",
                                  "memory_limit_gb", "calibration", "fixed")}

    @classmethod
    def from_attrs(cls, d: dict) -> "StudySpec":
        if not isinstance(d, dict) or "model" not in d:
            raise SpecError("study", "the study holds no autotune problem in its user attributes "
                            "(create it with `autotune search --strategy optuna --storage ... --study ...`)")
        keys = {f for f in cls.__dataclass_fields__}
        vals = {k: v for k, v in d.items() if k in keys}
        vals["objectives"] = tuple(vals.get("objectives") or ("tokens_per_s",))
        vals["fixed"] = dict(vals.get("fixed") or {})
        return cls(**vals)


# ------------------------------------------------------------------------------------------------
# Scoring a batch of trials
# ------------------------------------------------------------------------------------------------

class _RowInputs:
    """Inputs whose cluster values differ per row (a batch mixing GPU counts), padded to the
    fixed chunk size `score_summary` uses, so one call scores the batch."""

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

    def score(self, counts: np.ndarray, batch: PlanBatch) -> tuple[np.ndarray, np.ndarray]:
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
                part = batch.select(idx)
                hws = {int(n): self.inputs(int(n)).hw for n in np.unique(counts[start:stop])}
                rows = counts[idx]
                hw = {k: np.array([hws[int(n)][k] for n in rows], dtype=np.float32) for k in hws[int(rows[0])]}
                s, m = score_summary(part, _RowInputs(self.inputs(int(rows[0])), hw), self.params)
                steps[start:stop] = s[: stop - start]
                mems[start:stop] = m[: stop - start]
            out = (steps, mems)
        self.model_s += time.perf_counter() - t0
        return out

    def reports(self, entries: list[tuple[int, dict]]) -> list[dict]:
        """Full plan reports (the JSON of `predict`) for (gpu count, plan) pairs, in order."""
        out: list = [None] * len(entries)
        by_n: dict = {}
        for i, (n, plan) in enumerate(entries):
            by_n.setdefault(n, []).append(i)
        for n, idx in by_n.items():
            batch = PlanBatch({f: np.array([_plan_int(entries[i][1], f) for i in idx], dtype=np.int32)
                               for f in PLAN_FIELDS})
            inp = self.inputs(n)
            full = score_full(batch, inp, self.params)
            for j, i in enumerate(idx):
                rep = plan_report(batch.plan(j), full, j, inp)
                rep["num_gpus"] = int(n)
                out[i] = rep
        return out


def _plan_int(plan: dict, f: str) -> int:
    return Plan.from_dict(plan).row()[f]


def plan_dict(plan: dict) -> dict:
    """A plan of ints as the report shows it (recompute by name, modules as a list, booleans)."""
    return Plan.from_dict(plan).as_dict()


def _metrics(n: int, step: float, mem_bytes: float, limit_bytes: float, tokens: int) -> dict:
    finite = math.isfinite(step) and step > 0
    return {
        "gpus": int(n),
        "step_time_s": float(step),
        "tokens_per_s": tokens / step if finite else 0.0,
        "tokens_per_s_per_gpu": tokens / step / n if finite else 0.0,
        "cost_gpu_h": n * step / 3600.0 if finite else math.inf,
        "memory_gb": float(mem_bytes) / 1e9,
        "memory_limit_gb": float(limit_bytes) / 1e9,
        "fits": bool(mem_bytes <= limit_bytes),
    }


# ------------------------------------------------------------------------------------------------
# The batched ask/tell loop
# ------------------------------------------------------------------------------------------------

@dataclass
class RunStats:
    trials: int = 0                  # trials this run told COMPLETE
    failed: int = 0                  # trials this run told FAIL (illegal params, non-finite score)
    interrupted: bool = False
    elapsed_s: float = 0.0
    model_s: float = 0.0
    zombies_failed: int = 0

    def as_dict(self) -> dict:
        return {"trials": self.trials, "failed": self.failed, "interrupted": self.interrupted,
                "elapsed_s": self.elapsed_s, "model_s": self.model_s, "zombies_failed": self.zombies_failed,
                "wall_per_trial_ms": 1e3 * self.elapsed_s / max(self.trials, 1),
                "model_share": self.model_s / self.elapsed_s if self.elapsed_s > 0 else 0.0}


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


def run_batches(study: optuna.Study, space: PlanSpace, scorer: BatchScorer, objectives: tuple,
                *, n_trials: int | None, timeout_s: float | None, batch_size: int,
                sampler_name: str, progress: Callable[[int, "RunStats", dict | None], None] | None = None,
                url: str | None = None) -> RunStats:
    """Ask/score/tell in batches until n_trials trials are told, the timeout, or Ctrl-C."""
    stats = RunStats()
    objs = [OBJECTIVES[o] for o in objectives]
    penalize = sampler_name not in CONSTRAINT_AWARE and sampler_name != "grid" and sampler_name != "random"
    me = worker_id()
    t0 = time.perf_counter()
    model0 = scorer.model_s
    best: dict | None = None
    pending: list = []
    limit = n_trials
    if isinstance(study.sampler, LegalGridSampler):
        left = max(study.sampler.size - len(study.get_trials(deepcopy=False)), 0)
        limit = left if limit is None else min(limit, left)
    try:
        with _Interrupt() as intr, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while limit is None or stats.trials + stats.failed < limit:
                if intr.requested:
                    stats.interrupted = True
                    break
                if timeout_s is not None and time.perf_counter() - t0 >= timeout_s:
                    break
                k = batch_size if limit is None else min(batch_size, limit - stats.trials - stats.failed)
                pending = []
                asked: dict = {}
                for _ in range(k):
                    trial = _ask(study, me)
                    pending.append(trial)
                    try:
                        n, plan = space.suggest(trial)
                    except IllegalParams as exc:
                        trial.set_user_attr("illegal", str(exc))
                        study.tell(trial, state=TrialState.FAIL)
                        pending.pop()
                        stats.failed += 1
                        continue
                    asked[trial.number] = (n, plan)
                if not pending:
                    continue
                counts = np.array([asked[t.number][0] for t in pending])
                batch = PlanBatch({f: np.array([asked[t.number][1][f] for t in pending], dtype=np.int32)
                                   for f in PLAN_FIELDS})
                steps, mems = scorer.score(counts, batch)
                for i, trial in enumerate(list(pending)):
                    n, plan = asked[trial.number]
                    tokens = space.problem(n).job.tokens_per_step
                    m = _metrics(n, float(steps[i]), float(mems[i]), scorer.limit_bytes(n), tokens)
                    over = m["memory_gb"] - m["memory_limit_gb"]
                    trial.set_user_attr("plan", plan_dict(plan))
                    trial.set_user_attr("metrics", {**m, CONSTRAINT: over})
                    if not math.isfinite(m["step_time_s"]):
                        study.tell(trial, state=TrialState.FAIL)
                        stats.failed += 1
                        pending.remove(trial)
                        continue
                    trial.set_constraint(CONSTRAINT, over)
                    values = [m[o.metric] for o in objs]
                    if penalize and not m["fits"]:
                        values = [_penalized(v, o, over, m["memory_limit_gb"]) for v, o in zip(values, objs)]
                    study.tell(trial, values)
                    pending.remove(trial)
                    stats.trials += 1
                    if m["fits"] and (best is None or objs[0].better(m[objs[0].metric], best[objs[0].metric])):
                        best = {**m, "plan": plan_dict(plan)}
                stats.elapsed_s = time.perf_counter() - t0
                stats.model_s = scorer.model_s - model0
                if progress is not None and progress(stats.trials + stats.failed, stats, best) is True:
                    break                                   # the callback asked to stop
    except KeyboardInterrupt:
        stats.interrupted = True
    except Exception as exc:
        _fail_pending(study, pending)
        if _is_db_error(exc):
            raise SpecError("storage", f"{redact_url(url)}: {scrub(_first_line(exc), url)}") from None
        raise
    _fail_pending(study, pending)
    stats.elapsed_s = time.perf_counter() - t0
    stats.model_s = scorer.model_s - model0
    return stats


def _ask(study: optuna.Study, owner: str) -> optuna.Trial:
    """`study.ask()`, with the "worker" user attribute written in the same transaction that creates
    the trial, so a worker killed at any moment never leaves a RUNNING trial without its owner
    (which `fail_zombies` needs). Falls back to ask + set_user_attr if Optuna's internals change."""
    try:
        template = optuna.trial.FrozenTrial(
            number=-1, state=TrialState.RUNNING, value=None, datetime_start=datetime.now(),
            datetime_complete=None, params={}, distributions={}, user_attrs={"worker": owner},
            system_attrs={}, intermediate_values={}, trial_id=-1)
        trial_id = study._storage.create_new_trial(study._study_id, template_trial=template)
        study._thread_local.cached_all_trials = None
        return optuna.Trial(study, trial_id)
    except AttributeError:
        trial = study.ask()
        trial.set_user_attr("worker", owner)
        return trial


def _penalized(value: float, obj: Objective, over_gb: float, limit_gb: float) -> float:
    factor = 2.0 + max(over_gb, 0.0) / max(limit_gb, 1e-9)
    return value / factor if obj.direction == "maximize" else value * factor


def _fail_pending(study: optuna.Study, pending: list) -> None:
    for trial in pending:
        with contextlib.suppress(Exception):
            study.tell(trial, state=TrialState.FAIL)
    pending.clear()


def _is_db_error(exc: BaseException) -> bool:
    mod = type(exc).__module__ or ""
    return mod.startswith(("sqlalchemy", "psycopg", "sqlite3", "pymysql"))


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    lines = [ln for ln in str(orig).splitlines() if ln.strip()]
    return lines[0] if lines else type(orig).__name__


def fail_zombies(study: optuna.Study, stale_after_s: float = STALE_AFTER_S) -> int:
    """Fail RUNNING trials left by dead workers: a worker on this host whose process is gone, or
    any trial RUNNING for longer than `stale_after_s`. Returns how many were failed."""
    host = socket.gethostname()
    now = datetime.now()
    failed = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = str(t.user_attrs.get("worker", ""))
        dead = False
        if owner.rsplit(":", 1)[0] == host and owner.rsplit(":", 1)[-1].isdigit():
            pid = int(owner.rsplit(":", 1)[-1])
            dead = pid != os.getpid() and not _pid_alive(pid)
        started = t.datetime_start
        if started is not None:
            ref = datetime.now(timezone.utc) if started.tzinfo else now
            dead = dead or (ref - started).total_seconds() > stale_after_s
        if not dead:
            continue
        try:
            study._storage.set_trial_user_attr(t._trial_id, "failed_reason", f"worker {owner or '?'} stopped")
            if study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                failed += 1
        except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError):
            pass            # another worker failed it first
    return failed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie process (killed, not yet reaped by its parent) is dead for our purpose
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


# ------------------------------------------------------------------------------------------------
# Studies and results
# ------------------------------------------------------------------------------------------------

def _directions(objectives) -> list[str]:
    return [OBJECTIVES[o].direction for o in objectives]


def default_study_name(spec: StudySpec) -> str:
    import re
    model = Path(spec.model).parent.name if spec.model.endswith("config.json") else Path(spec.model).stem
    base = f"{model}-{spec.gpu or 'cluster'}-{spec.gpus}-{'-'.join(spec.objectives)}"
    return re.sub(r"[^A-Za-z0-9.:+-]+", "-", base).strip("-").lower()


def create_study(spec: StudySpec, *, storage_url: str | None, study_name: str | None,
                 sampler: optuna.samplers.BaseSampler) -> tuple[optuna.Study, bool]:
    """Create the study, or load it when the storage has one of that name with the same problem.
    Returns (study, resumed)."""
    storage = open_storage(storage_url)
    name = study_name or (default_study_name(spec) if storage_url else None)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    existing = None
    if name is not None:
        with contextlib.suppress(KeyError):
            existing = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    if existing is not None:
        old = existing.user_attrs.get(STUDY_ATTR)
        if not old:
            raise SpecError("study", f"study {name!r} in {redact_url(storage_url)} was not made by autotune; "
                            f"choose another --study name")
        old_spec = StudySpec.from_attrs(old)
        if old_spec.problem_attrs() != spec.problem_attrs() or tuple(old_spec.objectives) != tuple(spec.objectives):
            raise SpecError("study", f"study {name!r} in {redact_url(storage_url)} holds another problem or "
                            f"objectives ({_spec_line(old_spec)}); choose another --study name")
        return existing, True
    try:
        study = optuna.create_study(storage=storage, study_name=name, sampler=sampler,
                                    directions=_directions(spec.objectives))
    except optuna.exceptions.DuplicatedStudyError:       # another process created it meanwhile
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
        return study, True
    study.set_user_attr(STUDY_ATTR, spec.to_attrs())
    return study, False


def _spec_line(spec: StudySpec) -> str:
    return f"{spec.model} on {spec.gpus} x {spec.gpu}, objectives {', '.join(spec.objectives)}"


def metrics(t) -> dict:
    """A trial's metrics (user attribute "metrics": gpus, step_time_s, tokens_per_s,
    tokens_per_s_per_gpu, cost_gpu_h, memory_gb, memory_limit_gb, fits, memory_gb_over)."""
    return t.user_attrs.get("metrics") or {}


def _feasible(trials) -> list:
    return [t for t in trials if t.state == TrialState.COMPLETE and metrics(t).get("fits")
            and "plan" in t.user_attrs]


def _key(t) -> tuple:
    return (metrics(t).get("gpus"),) + tuple(sorted((k, str(v)) for k, v in t.user_attrs["plan"].items()))


def best_trials(study: optuna.Study, objectives, k: int = 10) -> list:
    """The k best feasible trials by the first objective, one per distinct plan."""
    obj = OBJECTIVES[objectives[0]] if objectives and objectives[0] in OBJECTIVES else OBJECTIVES["tokens_per_s"]
    trials = _feasible(study.get_trials(deepcopy=False))
    sign = -1.0 if obj.direction == "maximize" else 1.0
    trials.sort(key=lambda t: (sign * float(metrics(t).get(obj.metric, math.nan)), t.number))
    return _one_per_plan(trials)[:k]


def _one_per_plan(trials: list) -> list:
    """The first trial of each distinct plan, in the given order."""
    out, seen = [], set()
    for t in trials:
        key = _key(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def pareto_trials(study: optuna.Study) -> list:
    """Optuna's Pareto front (feasible trials only), one trial per distinct plan."""
    front = [t for t in study.best_trials if metrics(t).get("fits")]
    front.sort(key=lambda t: tuple(t.values))
    return _one_per_plan(front)


def _trial_entry(t) -> tuple[int, dict]:
    return int(metrics(t)["gpus"]), dict(t.user_attrs["plan"])


def summarize(study: optuna.Study, spec: StudySpec, space: PlanSpace, scorer: BatchScorer, *,
              top_k: int, elapsed_s: float, run: RunStats | None, storage_url: str | None) -> SearchResult:
    """A SearchResult with the same keys as exhaustive (best, top, space, ...) plus `extra["optuna"]`."""
    objectives = tuple(spec.objectives)
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE and "plan" in t.user_attrs]
    feas = _feasible(trials)
    known = space.known_stats()
    legal_total = known["legal"]
    space_d = {"total": known["total"], "legal": legal_total, "illegal": known["illegal"],
               "fitting": len(feas), "scored": len(complete), "trials": len(trials),
               "gpu_counts": known["gpu_counts"], "gpu_counts_enumerated": known["gpu_counts_enumerated"]}
    if not complete:
        if legal_total == 0 and known["gpu_counts_enumerated"] == known["gpu_counts"]:
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
    best = reports[0]
    mesh0 = tuple(best["plan"][k] for k in MESH) + (best["num_gpus"],)
    runner = next((r for r in reports[1:] if tuple(r["plan"][k] for k in MESH) + (r["num_gpus"],) != mesh0),
                  reports[1] if len(reports) > 1 else None)
    info = {
        "sampler": spec.sampler, "seed": spec.seed, "n_trials": len(trials),
        "n_complete": len(complete), "n_feasible": len(feas),
        "storage": redact_url(storage_url), "study": study.study_name,
        "objectives": [{"name": o, "direction": OBJECTIVES[o].direction, "unit": OBJECTIVES[o].unit}
                       for o in objectives],
        "gpus": spec.gpus, "batch_size": spec.batch_size,
        "cost_unit": "GPU-hours per optimizer step (gpus * step_time_s / 3600)",
    }
    if run is not None:
        info["run"] = run.as_dict()
    if len(objectives) > 1:
        front = pareto_trials(study)
        front_reports = scorer.reports([_trial_entry(t) for t in front])
        info["pareto_front"] = [
            {"trial": t.number, "values": {o: float(v) for o, v in zip(objectives, t.values)}, **rep}
            for t, rep in zip(front, front_reports)]
        info["pareto_points"] = [[float(v) for v in t.values] for t in feas]
    problem = space.problem(best["num_gpus"])
    return SearchResult(problem=problem, best=best, top=reports[:top_k], space=space_d, elapsed_s=elapsed_s,
                        strategy="optuna", runner_up=runner, extra={"optuna": info})


def optuna_search(spec: StudySpec, *, n_trials: int | None = DEFAULT_TRIALS, timeout_s: float | None = None,
                  storage_url: str | None = None, study_name: str | None = None, top_k: int = 10,
                  progress: Callable | None = None, space: PlanSpace | None = None) -> SearchResult:
    """Run (or resume) a study of `spec` for n_trials more trials; the best plans found so far."""
    t0 = time.perf_counter()
    spec = spec.resolved()
    if n_trials is not None and n_trials < 1:
        raise SpecError("trials", f"must be a positive integer, got {n_trials}")
    if timeout_s is not None and not timeout_s > 0:
        raise SpecError("timeout", f"must be a positive number of seconds, got {timeout_s}")
    space = space or spec.build_space()
    _require_legal(space, spec)
    scorer = BatchScorer(space, spec.params(), spec.memory_limit_gb)
    sampler = make_sampler(spec.sampler, spec.seed, space, len(spec.objectives))
    study, resumed = create_study(spec, storage_url=storage_url, study_name=study_name, sampler=sampler)
    zombies = fail_zombies(study) if resumed else 0
    run = run_batches(study, space, scorer, spec.objectives, n_trials=n_trials, timeout_s=timeout_s,
                      batch_size=spec.batch_size, sampler_name=spec.sampler, progress=progress, url=storage_url)
    run.zombies_failed = zombies
    result = summarize(study, spec, space, scorer, top_k=top_k, elapsed_s=time.perf_counter() - t0, run=run,
                       storage_url=storage_url)
    result.extra["optuna"]["resumed"] = resumed
    result.extra["optuna"]["interrupted"] = run.interrupted
    result.study = study                  # for the report's Optuna plots (not part of the JSON)
    return result


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
    if n_trials is not None and n_trials < 1:
        raise SpecError("trials", f"must be a positive integer, got {n_trials}")
    if timeout_s is not None and not timeout_s > 0:
        raise SpecError("timeout", f"must be a positive number of seconds, got {timeout_s}")
    if batch_size is not None and not 1 <= batch_size <= MAX_BATCH:
        raise SpecError("batch_size", f"must be an integer in 1..{MAX_BATCH}, got {batch_size}")
    t0 = time.perf_counter()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(storage_url)
    study = load_study(storage, study_name, storage_url)
    spec = StudySpec.from_attrs(study.user_attrs.get(STUDY_ATTR))
    space = spec.build_space()
    sampler = make_sampler(spec.sampler, seed, space, len(spec.objectives))
    study = optuna.load_study(study_name=study_name, storage=storage, sampler=sampler)
    zombies = fail_zombies(study, stale_after_s)
    scorer = BatchScorer(space, spec.params(), spec.memory_limit_gb)
    run = run_batches(study, space, scorer, spec.objectives, n_trials=n_trials, timeout_s=timeout_s,
                      batch_size=batch_size or spec.batch_size, sampler_name=spec.sampler, progress=progress,
                      url=storage_url)
    run.zombies_failed = zombies
    out = {"study": study_name, "storage": redact_url(storage_url), "worker": worker_id(),
           "sampler": spec.sampler, "seed": seed, "objectives": list(spec.objectives),
           "run": run.as_dict(), "study_trials": count_states(study),
           "elapsed_s": time.perf_counter() - t0}
    best = best_trials(study, spec.objectives, 1)
    if best:
        rep = scorer.reports([_trial_entry(best[0])])[0]
        rep["trial"] = best[0].number
        out["best"] = rep
    return out


# ------------------------------------------------------------------------------------------------
# auto: exhaustive when the space is small enough
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StrategyChoice:
    strategy: str            # "exhaustive" or "optuna"
    reason: str
    legal: int | None = None

    def as_dict(self) -> dict:
        return {"chosen": self.strategy, "reason": self.reason, "legal_plans": self.legal}


def choose_strategy(requested: str, *, gpus, objectives=("tokens_per_s",), persistent: bool = False,
                    sampler_given: bool = False, count_legal: Callable[[], int] | None = None,
                    threshold: int = AUTO_EXHAUSTIVE_MAX) -> StrategyChoice:
    """exhaustive | optuna | auto -> the strategy to run, and why.

    auto picks exhaustive for one GPU count, the throughput objective, no study storage, and a legal
    space of at most `threshold` plans (scored in a few seconds); Optuna otherwise."""
    req = str(requested).strip().lower()
    if req not in ("exhaustive", "optuna", "auto"):
        raise SpecError("strategy", f"unknown strategy {requested!r}; choose exhaustive, optuna or auto")
    g = parse_gpus(gpus) if gpus is not None else None
    objs = parse_objectives(objectives)
    if req == "exhaustive":
        if isinstance(g, GpuRange):
            raise SpecError("gpus", f"a GPU range ({g}) needs --strategy optuna or auto")
        if objs not in (("tokens_per_s",), ("step_time",)):
            raise SpecError("objective", "exhaustive ranks plans by throughput only; use --strategy optuna "
                            "for other or several objectives")
        return StrategyChoice("exhaustive", "requested")
    if req == "optuna":
        return StrategyChoice("optuna", "requested")
    if isinstance(g, GpuRange):
        return StrategyChoice("optuna", f"the GPU count is a range ({g})")
    if objs not in (("tokens_per_s",), ("step_time",)):
        return StrategyChoice("optuna", f"objectives {', '.join(objs)} (exhaustive ranks by throughput only)")
    if persistent:
        return StrategyChoice("optuna", "a study storage or name was given")
    if sampler_given:
        return StrategyChoice("optuna", "a sampler was given")
    n = count_legal() if count_legal is not None else 0
    if n <= threshold:
        return StrategyChoice("exhaustive", f"{n:,} legal plans <= {threshold:,}: scored in a few seconds", n)
    return StrategyChoice("optuna", f"{n:,} legal plans > {threshold:,}", n)
