"""Optuna storages and the studies in them: open a storage URL, list, show and export studies.

Storage URLs (Optuna's own storages, so the Optuna dashboard opens them):
    memory (or nothing)              in-process only, gone when the command ends
    sqlite:///results/studies.db     a local file, resumable (its folder is created)
    journal:results/study.log        Optuna's journal file (JournalStorage + JournalFileBackend)
    postgresql://user:pw@host/db     PostgreSQL through Optuna's RDBStorage: many workers, many machines
                                     (also mysql://...; any SQLAlchemy URL Optuna supports)

A URL's password is never printed: every message and report shows `redact_url(url)`.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import urllib.parse
from collections import Counter

import optuna
from optuna.storages import BaseStorage, InMemoryStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from costmodels.specs import SpecError

#: The study user attribute that holds the problem (see optuna_search.StudySpec).
STUDY_ATTR = "autotune"
MEMORY = "memory"
_SECRET_KEYS = ("password", "passwd", "pwd", "secret", "token", "sslpassword")
CONNECT_TIMEOUT_S = 5
#: SQLAlchemy dialects Optuna's RDBStorage works with
_RDB_DIALECTS = ("postgresql", "postgres", "mysql", "mariadb", "sqlite", "oracle", "mssql")


def redact_url(url: str | None) -> str:
    """The URL with any password (userinfo or query) replaced by ***; safe to print."""
    if not url:
        return MEMORY
    text = str(url)
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError:
        return re.sub(r"(://[^/@:]*:)[^@/]*@", r"\1***@", text)
    netloc = parts.netloc
    secret_query = any(k.lower() in _SECRET_KEYS for k, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    if not secret_query and not ("@" in netloc and ":" in netloc.rsplit("@", 1)[0]):
        return text
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
        netloc = f"{userinfo}@{host}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = "&".join(f"{k}={'***' if k.lower() in _SECRET_KEYS else v}" for k, v in pairs)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _password(url: str) -> str | None:
    try:
        return urllib.parse.urlsplit(url).password
    except ValueError:
        return None


def scrub(message: str, url: str | None) -> str:
    """A one-line message with the URL's password (raw or URL-quoted) removed."""
    text = " ".join(str(message).split())
    if url:
        text = text.replace(str(url), redact_url(url))
        pw = _password(str(url))
        if pw:
            for form in {pw, urllib.parse.unquote(pw), urllib.parse.quote(pw, safe="")}:
                if form:
                    text = text.replace(form, "***")
    return text


def _db_error(exc: BaseException) -> str:
    """The driver's first line of a database error, without SQLAlchemy's background link."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    line = next((ln for ln in text if ln.strip()), type(orig).__name__)
    return re.sub(r"\(Background on this error at:.*\)", "", line).strip()


def storage_kind(url: str | None) -> str:
    if not url or str(url).strip().lower() in (MEMORY, ":memory:"):
        return "memory"
    u = str(url).strip()
    if u.startswith("journal:") or u.endswith((".log", ".journal")) and "://" not in u:
        return "journal"
    if u.startswith("sqlite:"):
        return "sqlite"
    if u.split("://", 1)[0].split("+", 1)[0].lower() in _RDB_DIALECTS and "://" in u:
        return "rdb"
    return "unknown"


def open_storage(url: str | None) -> BaseStorage:
    """An Optuna storage for the URL; a storage that cannot be reached is a SpecError (one line)."""
    kind = storage_kind(url)
    if kind == "memory":
        return InMemoryStorage()
    u = str(url).strip()
    if kind == "journal":
        path = u[len("journal:"):] if u.startswith("journal:") else u
        path = path[2:] if path.startswith("//") else path
        if not path:
            raise SpecError("storage", "journal: needs a file path, e.g. journal:results/study.log")
        try:
            _ensure_parent(path)
            return JournalStorage(JournalFileBackend(path))
        except OSError as exc:
            raise SpecError("storage", f"cannot open the journal file {path}: {exc.strerror or exc}") from None
    if kind == "unknown":
        raise SpecError("storage", f"unknown storage {redact_url(u)!r}; use sqlite:///FILE, journal:FILE, "
                        f"postgresql://USER:PASSWORD@HOST/DB or memory")
    engine_kwargs: dict = {}
    if kind == "sqlite":
        path = u.split("sqlite:///", 1)[1] if u.startswith("sqlite:///") else ""
        if path and path != ":memory:":
            try:
                _ensure_parent(path)
            except OSError as exc:
                raise SpecError("storage", f"cannot create the folder of {path}: {exc.strerror or exc}") from None
        engine_kwargs = {"connect_args": {"timeout": 60}}
    elif u.startswith(("postgresql", "postgres")):
        engine_kwargs = {"pool_pre_ping": True, "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    elif u.startswith("mysql"):
        engine_kwargs = {"pool_pre_ping": True, "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    try:
        return RDBStorage(u, engine_kwargs=engine_kwargs)
    except ImportError as exc:
        raise SpecError("storage", f"{redact_url(u)} needs a database driver that is not installed "
                        f"({scrub(exc, u)}); for PostgreSQL: pip install 'psycopg[binary]'") from None
    except Exception as exc:  # sqlalchemy errors: unreachable host, bad credentials, missing db
        raise SpecError("storage", f"cannot open {redact_url(u)}: {scrub(_db_error(exc), u)}") from None


def _ensure_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def load_study(storage: BaseStorage, name: str, url: str | None = None) -> optuna.Study:
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
        hint = f"; studies there: {', '.join(names[:10])}" if names else "; the storage holds no study"
        raise SpecError("study", f"no study named {name!r} in {redact_url(url)}{hint}") from None


# ------------------------------------------------------------------------------------------------
# list / show / export
# ------------------------------------------------------------------------------------------------

def _objectives(study_attrs: dict, directions) -> list:
    spec = study_attrs.get(STUDY_ATTR) or {}
    names = spec.get("objectives") or [f"objective{i}" for i in range(len(directions))]
    return list(names)


def list_studies(url: str | None) -> list[dict]:
    """One summary per study: name, objectives, problem, trials by state, started."""
    storage = open_storage(url)
    out = []
    for s in optuna.get_all_study_summaries(storage, include_best_trial=False):
        spec = s.user_attrs.get(STUDY_ATTR) or {}
        states = Counter(t.state.name.lower() for t in
                         storage.get_all_trials(s._study_id, deepcopy=False))
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


def _problem_of(spec: dict) -> dict | None:
    keys = ("model", "gpu", "gpus", "global_batch", "seq_len", "precision", "gpus_per_node", "intra_node_bw",
            "inter_node_bw", "cluster_file", "memory_limit_gb", "calibration", "fixed")
    return {k: spec.get(k) for k in keys} if spec.get("model") else None


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
    from .optuna_search import best_trials, pareto_trials

    storage = open_storage(url)
    study = load_study(storage, name, url)
    trials = study.get_trials(deepcopy=False)
    spec = study.user_attrs.get(STUDY_ATTR) or {}
    objectives = _objectives(study.user_attrs, study.directions)
    states = Counter(t.state.name.lower() for t in trials)
    out = {
        "name": name, "storage": redact_url(url), "objectives": objectives,
        "directions": [d.name.lower() for d in study.directions],
        "problem": _problem_of(spec), "sampler": spec.get("sampler"), "seed": spec.get("seed"),
        "trials": dict(sorted(states.items())), "n_trials": len(trials),
        "best": [trial_row(t) for t in best_trials(study, objectives, top)],
    }
    if len(study.directions) > 1:
        out["pareto_front"] = [trial_row(t) for t in pareto_trials(study)]
    return out


_CSV_ATTRS = ("gpus", "step_time_s", "tokens_per_s", "memory_gb", "fits", "cost_gpu_h")


def export_study(url: str | None, name: str, path: str) -> dict:
    """Write every trial to `path`: JSON (a list of trial rows) or CSV (by the file suffix)."""
    storage = open_storage(url)
    study = load_study(storage, name, url)
    rows = [trial_row(t) for t in study.get_trials(deepcopy=False)]
    fmt = "csv" if path.lower().endswith(".csv") else "json"
    if fmt == "json":
        text = json.dumps({"study": name, "storage": redact_url(url),
                           "objectives": _objectives(study.user_attrs, study.directions),
                           "user_attrs": study.user_attrs, "trials": rows}, indent=2)
    else:
        params = sorted({k for r in rows for k in r["params"]})
        n_values = max((len(r["values"] or []) for r in rows), default=0)
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["number", "state"] + [f"value_{i}" for i in range(n_values)] + params
                   + ["dp"] + list(_CSV_ATTRS))
        for r in rows:
            vals = list(r["values"] or []) + [""] * (n_values - len(r["values"] or []))
            plan = r["user_attrs"].get("plan") or {}
            met = r["user_attrs"].get("metrics") or {}
            w.writerow([r["number"], r["state"]] + vals + [r["params"].get(p, "") for p in params]
                       + [plan.get("dp", "")] + [met.get(a, "") for a in _CSV_ATTRS])
        text = buf.getvalue()
    try:
        _ensure_parent(path)
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as exc:
        raise SpecError("export", f"cannot write {path}: {exc.strerror or exc}") from None
    return {"study": name, "path": path, "format": fmt, "trials": len(rows)}


def count_states(study: optuna.Study) -> dict:
    c = Counter(t.state for t in study.get_trials(deepcopy=False))
    return {s.name.lower(): c.get(s, 0) for s in (TrialState.COMPLETE, TrialState.RUNNING,
                                                   TrialState.FAIL, TrialState.PRUNED, TrialState.WAITING)}
