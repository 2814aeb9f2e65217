"""Real runs as an Optuna study (issue 14 item 5): `search --verify-top K --storage URL` and
`autotune worker --runner jax|megatron`.

A verification study minimizes the measured step time. `search --verify-top K --storage URL`
creates it (or joins it), stores its problem in the study (user attribute "autotune", as a cost-model
study does: `StudySpec`) and how to run a plan ("autotune_verify": runner, steps, Megatron options),
and queues the cost model's top K plans (`study.enqueue_trial`). Any machine then runs
`autotune worker --storage URL --study NAME`: `study.ask()` hands out the queued (WAITING) trials
first; when none are left the study's sampler (Optuna's TPE inside `LegalSampler`, which proposes
legal plans only) proposes the next plan from what was measured. Before a plan runs, the cost model
predicts it: a plan predicted not to fit is told PRUNED with the reason, never run. A plan the runner
refuses (too many devices even for a proxy, a knob it does not build, a missing checkout) or that
runs out of memory is told FAIL with user attribute `status` (refused | oom) and the reason; the
worker goes on. Ctrl-C: the trial in flight is failed (status interrupted), its plan queued again for
another worker, and every finished trial stays in the storage.

A trial's value is the step time the ranking uses: on GPUs the full plan's predicted step scaled by
measured / predicted of the run (a full run: its measured time; a proxy: the missing terms stay
predicted), on a CPU the run's own measured time (a CPU cannot stand in for the GPU preset).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from costmodels.plan import Plan
from costmodels.specs import SpecError
from search_spaces.optuna_space import IllegalParams

from .ask_tell import STALE_AFTER_S, Heartbeat, fail_stale, worker_id
from .files import dumps_json, write_text_atomic
from .samplers import make_sampler
from .runner import claim_device_memory
from .search import predict
from .storage import is_storage_error, load_study, open_storage, redact_url, storage_error
from .studies import STUDY_ATTR, VERIFY_ATTR
from .study_spec import StudySpec, default_study_name
from .verify import RUNNERS, plan_slug, verify_plan

OBJECTIVE = "step_time"
#: the sampler proposing plans once the queue is empty (Optuna's TPE inside LegalSampler)
SAMPLER = "tpe"
#: plans asked per run at most: predicted-not-to-fit proposals are pruned without a run, so a
#: worker asked for N runs stops after N * this many proposals
MAX_PROPOSALS_PER_RUN = 20


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """How a verification study runs a plan (stored in the study, so workers need nothing else)."""
    runner: str = "jax"
    steps: int = 3
    warmup: int = 1
    megatron_path: str | None = None
    launcher: str = "torchrun"

    def checked(self) -> "RunnerConfig":
        if self.runner not in RUNNERS:
            raise SpecError("runner", f"unknown runner {self.runner!r}; this build has: {', '.join(RUNNERS)}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise SpecError("steps", f"must be at least 1, got {self.steps!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise SpecError("warmup", f"must be 0 or more, got {self.warmup!r}")
        if self.runner != "megatron":
            return dataclasses.replace(self, megatron_path=None)
        from .verify_megatron import check_megatron_options
        check_megatron_options(self.megatron_path, self.launcher)
        return dataclasses.replace(self, megatron_path=os.path.abspath(os.path.expanduser(self.megatron_path)))

    def megatron(self, log_dir: str) -> dict | None:
        if self.runner != "megatron":
            return None
        return {"megatron_path": self.megatron_path, "launcher": self.launcher, "log_dir": log_dir}

    def to_attrs(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_attrs(cls, d: dict) -> "RunnerConfig":
        keys = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in keys})


def verification_spec(spec: StudySpec) -> StudySpec:
    """The search problem as a verification study stores it: one objective, the measured step time."""
    if spec.gpus is None or "-" in str(spec.gpus):
        raise SpecError("gpus", "a verification study measures plans of one GPU count; give --gpus N")
    return dataclasses.replace(spec, objectives=(OBJECTIVE,), sampler=SAMPLER).resolved()


def default_name(spec: StudySpec) -> str:
    return "verify-" + default_study_name(spec)


# ------------------------------------------------------------------------------------------------
# Creating and seeding
# ------------------------------------------------------------------------------------------------

def open_verification_study(spec: StudySpec, run: RunnerConfig, *, storage_url: str, study_name: str | None,
                            top: list, k: int) -> tuple[str, int, bool]:
    """Create (or join) the verification study of `spec` and queue the first k plans of `top` (the
    search's plan reports) that it does not hold yet. Returns (study name, plans queued, joined)."""
    spec = verification_spec(spec)
    run = run.checked()
    if k < 1:
        raise SpecError("verify-top", f"must be at least 1, got {k}")
    name = study_name or default_name(spec)
    storage = open_storage(storage_url)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    space = spec.build_space()
    try:
        study, joined = _create_or_join(storage, storage_url, name, spec, run)
        n = space.counts[0]
        before = len(study.get_trials(deepcopy=False))
        for rank, rep in enumerate(top[:k], 1):
            params = space.params_of(n, Plan.from_dict(rep["plan"]).row())
            study.enqueue_trial(params, user_attrs={"seeded": f"cost model #{rank}", "predicted_rank": rank},
                                skip_if_exists=True)
        queued = len(study.get_trials(deepcopy=False)) - before
    except Exception as exc:
        if is_storage_error(exc):
            raise storage_error(exc, storage_url) from None
        raise
    return name, queued, joined


def _create_or_join(storage, url: str, name: str, spec: StudySpec, run: RunnerConfig):
    existing = None
    with contextlib.suppress(KeyError):
        existing = optuna.load_study(study_name=name, storage=storage)
    if existing is not None:
        attrs = existing.user_attrs
        if VERIFY_ATTR not in attrs:
            raise SpecError("study", f"study {name!r} in {redact_url(url)} is not a verification study (a cost-model "
                            f"search?); choose another --study name")
        old = StudySpec.from_attrs(attrs.get(STUDY_ATTR))
        if old.problem_attrs() != spec.problem_attrs():
            raise SpecError("study", f"study {name!r} in {redact_url(url)} verifies another problem "
                            f"({old.model} on {old.gpus} x {old.gpu}); choose another --study name")
        old_run = RunnerConfig.from_attrs(attrs[VERIFY_ATTR])
        if old_run.runner != run.runner:
            raise SpecError("runner", f"study {name!r} measures with the {old_run.runner} runner, not {run.runner}")
        return existing, True
    try:
        study = optuna.create_study(storage=storage, study_name=name, direction="minimize")
    except optuna.exceptions.DuplicatedStudyError:            # another machine created it meanwhile
        return _create_or_join(storage, url, name, spec, run)
    study.set_user_attr(STUDY_ATTR, spec.to_attrs())
    study.set_user_attr(VERIFY_ATTR, run.to_attrs())
    return study, False


def is_verification_study(storage_url: str, study_name: str) -> bool:
    """Whether the named study of the storage is a verification study (else a cost-model search)."""
    storage = open_storage(storage_url, must_exist=True)
    try:
        return VERIFY_ATTR in load_study(storage, study_name, storage_url).user_attrs
    except Exception as exc:
        if is_storage_error(exc):
            raise storage_error(exc, storage_url) from None
        raise


# ------------------------------------------------------------------------------------------------
# The worker
# ------------------------------------------------------------------------------------------------

def study_value(res: dict, predicted_full_step_s: float) -> float | None:
    """The trial's value (see the module docstring); None when nothing was timed."""
    st = res["comparison"]["step_time_s"]
    if not st["measured"]:
        return None
    if res["platform"] == "gpu":
        return predicted_full_step_s * st["measured"] / st["predicted"]
    return st["measured"]


@contextlib.contextmanager
def _heartbeat(storage, study, trial):
    """Beat the trial's heartbeat (RDB storages) while it runs, so no other worker takes a long real
    run for a dead worker's (Optuna's optimize() does the same in a thread)."""
    heart = Heartbeat.of(storage, study)
    if heart is None:
        yield
        return
    stop = threading.Event()
    period = max(1.0, storage.get_heartbeat_interval() / 2)

    def beat():
        while not stop.is_set():
            with contextlib.suppress(Exception):
                heart.beat([trial])
            stop.wait(period)

    th = threading.Thread(target=beat, name="verify-heartbeat", daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


@contextlib.contextmanager
def _sigint_raises():
    """SIGINT raises KeyboardInterrupt while the worker runs, also in a process started with it ignored (a
    background `cmd &` without job control, where Python installs no handler), as the cost-model worker's own
    handler does (ask_tell._Interrupt); the old disposition comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def run_verification_worker(storage_url: str, study_name: str, *, n_trials: int | None = None,
                            runner: str | None = None, megatron_path: str | None = None,
                            launcher: str | None = None, seed: int | None = None, waiting_only: bool = False,
                            devices=None, out: str | None = None, on_result=None,
                            stale_after_s: float = STALE_AFTER_S) -> dict:
    """Measure plans of a verification study: queued ones first, then the sampler's proposals, until
    n_trials plans ran (or, with `waiting_only`, the queue is empty). Records are written to
    OUT/verify_<study>_<time>.json after each run. Returns this worker's entries and counts."""
    if n_trials is not None and n_trials < 1:
        raise SpecError("trials", f"must be a positive integer, got {n_trials}")
    if n_trials is None and not waiting_only:
        raise SpecError("trials", "give --trials N (the plans this worker measures)")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = open_storage(storage_url, must_exist=True,
                           grace_s=stale_after_s if stale_after_s < STALE_AFTER_S else None)
    try:
        attrs = load_study(storage, study_name, storage_url).user_attrs
        if VERIFY_ATTR not in attrs:
            raise SpecError("study", f"study {study_name!r} is a cost-model search study; a worker with --runner "
                            f"measures the studies of `autotune search --verify-top K --storage URL`")
        spec = StudySpec.from_attrs(attrs.get(STUDY_ATTR))
        run = RunnerConfig.from_attrs(attrs[VERIFY_ATTR])
        if runner is not None and runner != run.runner:
            raise SpecError("runner", f"study {study_name!r} measures with the {run.runner} runner, not {runner} "
                            f"(its values would not compare)")
        run = dataclasses.replace(run, megatron_path=megatron_path or run.megatron_path,
                                  launcher=launcher or run.launcher).checked()
        claim_device_memory(run.runner)            # before this process's JAX starts a GPU backend
        space = spec.build_space()
        study = load_study(storage, study_name, storage_url, sampler=make_sampler(SAMPLER, seed, space, 1))
        zombies = fail_stale(study, storage, stale_after_s)
    except Exception as exc:
        if is_storage_error(exc):
            raise storage_error(exc, storage_url) from None
        raise
    n = space.counts[0]
    problem = space.problem(n)
    params = spec.params()
    if run.runner == "jax":
        import jax
        devices = list(devices or jax.devices())
    else:                   # a worker without a checkout or torchrun takes no trial (it would fail them all)
        from .launch import check_checkout
        check_checkout(run.megatron_path, run.launcher)
    me = worker_id()
    entries, records, saved = [], [], None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    log_dir = out or "measurements"
    runs = proposals = 0
    interrupted = False
    t0 = time.perf_counter()
    with _sigint_raises():       # kill -INT stops a worker started with SIGINT ignored (`cmd &`) too
        try:
            while (n_trials is None or runs < n_trials) and (
                    n_trials is None or proposals < n_trials * MAX_PROPOSALS_PER_RUN):
                if waiting_only and not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
                    break
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")     # "heartbeat is supposed to be used with optimize": we beat
                    trial = study.ask()
                proposals += 1
                try:
                    entry = _run_trial(study, storage, trial, space, problem, params, spec.memory_limit_gb, run,
                                       devices, log_dir, me, waiting_only)
                except KeyboardInterrupt:           # before or after the run itself (predicting, telling)
                    _interrupted(study, trial, space)
                    interrupted = True
                    break
                if entry is None:
                    continue
                if entry.get("ran"):
                    runs += 1
                if entry.get("record") is not None:
                    records.append(entry.pop("record"))
                    if out:     # a name of its own first (workers sharing a folder), then rewritten in place
                        saved = write_text_atomic(saved or os.path.join(out, f"verify_{study_name}_{stamp}.json"),
                                                  dumps_json(records) + "\n", "out", exclusive=saved is None)
                entries.append(entry)
                if on_result:
                    on_result(entry)
                if entry["status"] == "interrupted":
                    interrupted = True
                    break
        except KeyboardInterrupt:
            interrupted = True
        except Exception as exc:
            if is_storage_error(exc):
                raise storage_error(exc, storage_url) from None
            raise
    return {"study": study_name, "storage": redact_url(storage_url), "worker": me, "runner": run.runner,
            "steps": run.steps, "runs": runs, "proposals": proposals, "interrupted": interrupted,
            "zombies_failed": zombies, "elapsed_s": time.perf_counter() - t0, "entries": entries, "saved": saved,
            "study_trials": {s.name.lower(): len(study.get_trials(deepcopy=False, states=(s,)))
                             for s in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED, TrialState.RUNNING,
                                       TrialState.WAITING)}}


def _tell_fail(study, trial, status: str, reason: str, state=TrialState.FAIL) -> None:
    trial.set_user_attr("status", status)
    trial.set_user_attr("reason", reason)
    study.tell(trial, state=state)


def _run_trial(study, storage, trial, space, problem, params, memory_limit_gb, run: RunnerConfig, devices,
               log_dir: str, me: str, waiting_only: bool) -> dict | None:
    """Suggest, check, run and tell one trial; the entry this worker reports (None: not a plan)."""
    trial.set_user_attr("worker", me)
    trial.set_user_attr("runner", run.runner)
    seeded = trial.user_attrs.get("seeded")
    if waiting_only and not seeded:            # another worker took the last queued plan meanwhile
        _tell_fail(study, trial, "not-run", "no queued plan left for this worker")
        return None
    entry = {"trial": trial.number, "seeded": seeded, "predicted_rank": trial.user_attrs.get("predicted_rank")}
    try:
        _, row = space.suggest(trial)
    except IllegalParams as exc:
        _tell_fail(study, trial, "illegal", str(exc))
        return {**entry, "plan": dict(trial.params), "status": "illegal", "reason": str(exc)}
    plan = Plan.from_dict(row)
    pred = predict(problem, plan, params, memory_limit_gb)
    plan_d = plan.as_dict()
    trial.set_user_attr("plan", plan_d)
    trial.set_user_attr("predicted_step_time_s", pred["step_time_s"])
    entry.update(plan=plan_d, predicted_step_time_s=pred["step_time_s"])
    mem = pred["memory_gb"]
    if not pred["fits"]:
        reason = f"predicted {mem['total']:.2f} GB per GPU > the {mem['limit']:.2f} GB limit: not run"
        _tell_fail(study, trial, "predicted-oom", reason, state=TrialState.PRUNED)
        return {**entry, "status": "predicted-oom", "reason": reason}
    try:
        with _heartbeat(storage, study, trial):
            res = verify_plan(problem, plan, gpu_key=problem.cluster.gpu.name, steps=run.steps, warmup=run.warmup,
                              proxy=run.runner == "jax" and plan.num_gpus > len(devices), params=params,
                              devices=devices, runner=run.runner, megatron=run.megatron(log_dir))
    except SpecError as exc:
        _tell_fail(study, trial, "refused", str(exc))
        return {**entry, "status": "refused", "reason": str(exc)}
    except KeyboardInterrupt:
        _interrupted(study, trial, space)
        return {**entry, "status": "interrupted", "reason": "stopped by Ctrl-C; the plan is queued again"}
    st = res["comparison"]["step_time_s"]
    value = study_value(res, pred["step_time_s"])
    mm = res["comparison"]["memory_gb"]
    entry.update(ran=res["status"] != "interrupted", status=res["status"], proxy=res["proxy"], measured_run_step_time_s=st["measured"],
                 predicted_run_step_time_s=st["predicted"], value=value, memory_gb_measured=mm["measured"],
                 memory_gb_predicted=mm["predicted"], record=res["record"],
                 record_id=(res["record"] or {}).get("id"), reason=res.get("error") or None)
    for key in ("proxy", "measured_run_step_time_s", "predicted_run_step_time_s", "memory_gb_measured",
                "memory_gb_predicted", "record_id"):
        trial.set_user_attr(key, entry[key])
    if res["status"] == "interrupted":
        _interrupted(study, trial, space)
        entry["reason"] = "stopped by Ctrl-C; the plan is queued again"
    elif res["status"] == "ok" and value:
        trial.set_user_attr("status", "ok")
        study.tell(trial, value)
    else:
        _tell_fail(study, trial, res["status"], res.get("error") or res["status"])
    return entry


def _interrupted(study, trial, space) -> None:
    """Fail the trial in flight and queue its plan again (another worker, or the next run, measures it).
    A queued plan stopped before its knobs were suggested gets them now (suggest returns the queued
    ones); a sampler's trial stopped that early had no plan yet and is not queued."""
    keep = {k: v for k, v in trial.user_attrs.items() if k in ("seeded", "predicted_rank")}
    if not trial.params and keep.get("seeded"):
        with contextlib.suppress(IllegalParams):
            space.suggest(trial)
    params = dict(trial.params)
    try:
        _tell_fail(study, trial, "interrupted", "stopped by Ctrl-C")
    except optuna.exceptions.UpdateFinishedTrialError:
        return                                  # already told (the stop came after it): nothing in flight
    if params:
        study.enqueue_trial(params, user_attrs={**keep, "requeued": "interrupted"})


# ------------------------------------------------------------------------------------------------
# What the study holds
# ------------------------------------------------------------------------------------------------

def verification_summary(storage_url: str, study_name: str) -> dict:
    """Every plan of the study with its status and values, ranked by the study's value (measured
    step time); the best plan measured; counts by state."""
    storage = open_storage(storage_url, must_exist=True)
    try:
        study = load_study(storage, study_name, storage_url)
        trials = study.get_trials(deepcopy=False)
    except Exception as exc:
        if is_storage_error(exc):
            raise storage_error(exc, storage_url) from None
        raise
    run = RunnerConfig.from_attrs(study.user_attrs.get(VERIFY_ATTR))
    rows = []
    for t in trials:
        a = t.user_attrs
        if "plan" not in a and t.state != TrialState.WAITING:
            continue
        rows.append({"trial": t.number, "state": t.state.name, "status": a.get("status", t.state.name.lower()),
                     "reason": a.get("reason"), "plan": a.get("plan") or dict(t.params),
                     "seeded": a.get("seeded"), "predicted_rank": a.get("predicted_rank"),
                     "predicted_step_time_s": a.get("predicted_step_time_s"), "proxy": a.get("proxy"),
                     "measured_run_step_time_s": a.get("measured_run_step_time_s"),
                     "predicted_run_step_time_s": a.get("predicted_run_step_time_s"),
                     "memory_gb_measured": a.get("memory_gb_measured"),
                     "memory_gb_predicted": a.get("memory_gb_predicted"), "value": t.value,
                     "worker": a.get("worker"), "record_id": a.get("record_id")})
    done = sorted((r for r in rows if r["value"] is not None), key=lambda r: r["value"])
    for i, r in enumerate(done, 1):
        r["measured_rank"] = i
    best = done[0] if done else None
    return {"study": study_name, "storage": redact_url(storage_url), "runner": run.runner, "steps": run.steps,
            "plans": rows, "best": best,
            "counts": {s: sum(1 for r in rows if r["state"] == s) for s in
                       ("COMPLETE", "FAIL", "PRUNED", "RUNNING", "WAITING")}}
