"""The studies in an Optuna storage: list them, show one, export its trials.

Read-only: a sqlite or journal file that does not exist is refused, not created, and an export
never writes over the storage it reads.
"""
from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from collections import Counter

import optuna

from costmodels.specs import SpecError

from .storage import load_study, open_storage, redact_url, same_file, storage_errors, storage_path
from .trials import best_trials, pareto_trials

#: The study user attribute that holds the problem (see study_spec.StudySpec).
STUDY_ATTR = "autotune"
#: a verification study (real runs, autotune.verify_study) holds how it runs a plan under this key
VERIFY_ATTR = "autotune_verify"
_PROBLEM_KEYS = ("model", "gpu", "gpus", "global_batch", "seq_len", "precision", "gpus_per_node", "intra_node_bw",
                 "inter_node_bw", "cluster_file", "memory_limit_gb", "calibration", "fixed", "framework")
_CSV_ATTRS = ("gpus", "step_time_s", "tokens_per_s", "memory_gb", "fits", "cost_gpu_h")


def _objectives(study_attrs: dict, directions) -> list:
    spec = study_attrs.get(STUDY_ATTR) or {}
    return list(spec.get("objectives") or [f"objective{i}" for i in range(len(directions))])


def list_studies(url: str | None) -> list[dict]:
    """One summary per study: name, objectives, problem, trials by state, started."""
    with storage_errors(url):
        return _list_studies(url)


def _list_studies(url: str | None) -> list[dict]:
    storage = open_storage(url, must_exist=True)
    out = []
    for s in optuna.get_all_study_summaries(storage, include_best_trial=False):
        spec = s.user_attrs.get(STUDY_ATTR) or {}
        study_id = storage.get_study_id_from_name(s.study_name)
        states = Counter(t.state.name.lower() for t in storage.get_all_trials(study_id, deepcopy=False))
        out.append({
            "name": s.study_name,
            "objectives": _objectives(s.user_attrs, s.directions),
            "directions": [d.name.lower() for d in s.directions],
            "problem": _problem_line(spec),
            "sampler": spec.get("sampler"),
            "trials": dict(sorted(states.items())),
            "n_trials": s.n_trials,
            "started": s.datetime_start.isoformat(timespec="seconds") if s.datetime_start else None,
        })
    return out


def _problem_line(spec: dict) -> str:
    p = spec or {}
    if not p.get("model"):
        return "(not an autotune study)"
    return (f"{p.get('model')} on {p.get('gpus')} x {p.get('gpu') or p.get('cluster_file')}, "
            f"batch {p.get('global_batch')} x {p.get('seq_len')}")


def trial_row(t) -> dict:
    """One trial as a JSON-able dict: number, state, params, values, plan and metrics."""
    return {
        "number": t.number, "state": t.state.name.lower(), "values": t.values,
        "params": dict(t.params), "constraints": dict(t.constraints) if t.constraints else {},
        "user_attrs": dict(t.user_attrs),
        "datetime_start": t.datetime_start.isoformat() if t.datetime_start else None,
        "datetime_complete": t.datetime_complete.isoformat() if t.datetime_complete else None,
    }


def show_study(url: str | None, name: str, top: int = 10) -> dict:
    """The study's problem, settings, trial counts, best feasible plans and Pareto front."""
    with storage_errors(url):
        return _show_study(url, name, top)


def _show_study(url: str | None, name: str, top: int) -> dict:
    study = load_study(open_storage(url, must_exist=True), name, url)
    trials = study.get_trials(deepcopy=False)
    spec = study.user_attrs.get(STUDY_ATTR) or {}
    objectives = _objectives(study.user_attrs, study.directions)
    out = {
        "name": name, "storage": redact_url(url), "objectives": objectives,
        "directions": [d.name.lower() for d in study.directions],
        "problem": {k: spec.get(k) for k in _PROBLEM_KEYS} if spec.get("model") else None,
        "sampler": spec.get("sampler"), "seed": spec.get("seed"),
        "trials": dict(sorted(Counter(t.state.name.lower() for t in trials).items())), "n_trials": len(trials),
        "best": [trial_row(t) for t in best_trials(study, objectives, top)],
    }
    if VERIFY_ATTR in study.user_attrs:          # real runs: how they ran (autotune.verify_study)
        out["verification"] = study.user_attrs[VERIFY_ATTR]
    if len(study.directions) > 1:
        out["pareto_front"] = [trial_row(t) for t in pareto_trials(study)]
    return out


def export_study(url: str | None, name: str, path: str) -> dict:
    """Write every trial to `path`: JSON (a list of trial rows) or CSV (by the file suffix).
    Refuses to write over the storage itself; writes a temporary file, then renames it."""
    store = storage_path(url)
    if store is not None and same_file(path, store):
        raise SpecError("export", f"{path} is the study's storage; export to another file")
    with storage_errors(url):
        study = load_study(open_storage(url, must_exist=True), name, url)
        rows = [trial_row(t) for t in study.get_trials(deepcopy=False)]
    fmt = "csv" if path.lower().endswith(".csv") else "json"
    if fmt == "json":
        text = json.dumps({"study": name, "storage": redact_url(url),
                           "objectives": _objectives(study.user_attrs, study.directions),
                           "user_attrs": study.user_attrs, "trials": rows}, indent=2, default=str)
    else:
        text = _csv(rows)
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise SpecError("export", f"cannot write {path}: {exc.strerror or exc}") from None
    return {"study": name, "path": path, "format": fmt, "trials": len(rows)}


def _csv(rows: list) -> str:
    params = sorted({k for r in rows for k in r["params"]})
    n_values = max((len(r["values"] or []) for r in rows), default=0)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["number", "state"] + [f"value_{i}" for i in range(n_values)] + params + ["dp"] + list(_CSV_ATTRS))
    for r in rows:
        vals = list(r["values"] or []) + [""] * (n_values - len(r["values"] or []))
        plan = r["user_attrs"].get("plan") or {}
        met = r["user_attrs"].get("metrics") or {}
        w.writerow([r["number"], r["state"]] + vals + [r["params"].get(p, "") for p in params]
                   + [plan.get("dp", "")] + [met.get(a, "") for a in _CSV_ATTRS])
    return buf.getvalue()


def write_atomic(path: str, text: str) -> None:
    """Write `text` to a temporary file next to `path`, then rename it over `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".export-")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
