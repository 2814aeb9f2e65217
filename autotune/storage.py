"""Optuna storages from a URL, with their faults turned into one-line errors and no password shown.

Storage URLs (Optuna's own storages, so the Optuna dashboard opens them):
    memory (or nothing)              in-process only, gone when the command ends
    sqlite:///results/studies.db     a local file, resumable (its folder is created)
    journal:results/study.log        Optuna's journal file (JournalStorage + JournalFileBackend),
                                     opened by its absolute path (a relative lock symlink dangles)
    postgresql://user:pw@host/db     PostgreSQL through Optuna's RDBStorage: many workers, many machines
                                     (also mysql://...; any SQLAlchemy URL Optuna supports)

Dead workers: an RDB storage records a heartbeat per running trial (`heartbeat_interval`) and
`optuna.storages.fail_stale_trials` fails the trials whose heartbeat is older than `grace_period`;
`RetryHeartbeatStaleTrialCallback` puts each failed trial's plan back in the queue (a WAITING trial).

A URL's password is never printed: every message and report shows `redact_url(url)`.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import time
import urllib.parse

import optuna
import warnings

from optuna.storages import BaseStorage, InMemoryStorage, JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

from costmodels.specs import SpecError

MEMORY = "memory"
CONNECT_TIMEOUT_S = 5
#: a running trial's heartbeat period and how long a silent one lives (Optuna's RDB heartbeat)
HEARTBEAT_INTERVAL_S = 10
HEARTBEAT_GRACE_S = 60
#: a PostgreSQL session left inside an open transaction (a worker cut off from the database mid-write: its
#: server-side backend keeps the transaction's row locks until TCP notices, hours later, and every other worker's
#: next write waits on them) is ended by the server after this long (idle_in_transaction_session_timeout, a
#: per-session setting); Optuna's own transactions last milliseconds
PG_IDLE_IN_TRANSACTION_S = 60
#: a journal lock left by a killed writer is broken after this long (a live append holds it for ms)
JOURNAL_LOCK_GRACE_S = 10
#: a stale trial's plan is queued again once
MAX_RETRY = 1
#: SQLAlchemy dialects Optuna's RDBStorage works with
_RDB_DIALECTS = ("postgresql", "postgres", "mysql", "mariadb", "sqlite", "oracle", "mssql")
_SECRET_KEYS = ("password", "passwd", "pwd", "secret", "token", "sslpassword")
#: concurrent first use of one new sqlite file: Optuna's schema creation races; try again
_CREATE_TRIES = 5


# ------------------------------------------------------------------------------------------------
# Passwords
# ------------------------------------------------------------------------------------------------

def redact_url(url: str | None) -> str:
    """The URL with its password (userinfo or query) replaced by ***; safe to print.

    SQLAlchemy's own parser reads the URL the way the engine will (a raw password may hold / ? #);
    a URL it cannot parse is masked from '://' up to its last '@'."""
    if not url:
        return MEMORY
    text = str(url)
    if "://" not in text:
        return text
    if text.split("://", 1)[1].count("@") > 1:
        return _mask_to_last_at(text)           # a raw '@' in the password: mask all of the userinfo
    try:
        from sqlalchemy.engine import make_url
        parsed = make_url(text)
        shown = parsed.render_as_string(hide_password=True)
        query = {k: ("***" if k.lower() in _SECRET_KEYS else v) for k, v in parsed.query.items()}
        if query != dict(parsed.query):
            shown = parsed.set(password="***" if parsed.password is not None else None,
                               query=query).render_as_string(hide_password=True)
        return shown.replace("%2A%2A%2A", "***")
    except Exception:  # noqa: BLE001 - any parse failure: mask conservatively
        return _mask_to_last_at(text)


def _mask_to_last_at(text: str) -> str:
    scheme, rest = text.split("://", 1)
    if "@" not in rest:
        return scheme + "://" + re.sub(r"(?i)(password|passwd|pwd|secret|token)=[^&]*", r"\1=***", rest)
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


def _passwords(url: str) -> set:
    """The password as SQLAlchemy reads it and as everything between the user and the last '@'
    (they differ when a raw password holds '@'), raw and URL-quoted/unquoted."""
    found = set()
    with contextlib.suppress(Exception):
        from sqlalchemy.engine import make_url
        found.add(make_url(url).password or "")
    userinfo = url.split("://", 1)[-1].rsplit("@", 1)[0] if "@" in url else ""
    if ":" in userinfo:
        found.add(userinfo.split(":", 1)[1])
    forms = set()
    for pw in found - {""}:
        forms |= {pw, urllib.parse.unquote(pw), urllib.parse.quote(pw, safe="")}
    return forms - {""}


def scrub(message, url: str | None) -> str:
    """A one-line message with the URL's password (raw or URL-quoted) removed."""
    text = str(message)
    if url:
        text = text.replace(str(url), redact_url(url))
        forms = _passwords(str(url))
        for form in sorted(forms | {" ".join(f.split()) for f in forms} - {""}, key=len, reverse=True):
            text = text.replace(form, "***")
    return " ".join(text.split())


def storage_error(exc: BaseException, url: str | None) -> SpecError:
    """A database / storage failure (SQLAlchemy, the driver, Optuna's StorageInternalError wrapping
    them) as one line naming the storage, without its password or SQLAlchemy's background link."""
    orig = exc
    while getattr(orig, "orig", None) is not None or (orig.__cause__ is not None and orig.__cause__ is not orig):
        nxt = getattr(orig, "orig", None) or orig.__cause__
        if nxt is None or nxt is orig:
            break
        orig = nxt
    lines = [ln for ln in str(orig).strip().splitlines() if ln.strip()]
    line = lines[0] if lines else type(orig).__name__
    line = re.sub(r"\(Background on this error at:.*\)", "", line).strip()
    return SpecError("storage", f"{redact_url(url)}: {scrub(line, url)}")


@contextlib.contextmanager
def storage_errors(url: str | None):
    """Turn a storage failure inside the block into one SpecError line naming the storage."""
    try:
        yield
    except Exception as exc:
        if is_storage_error(exc):
            raise storage_error(exc, url) from None
        raise


def is_storage_error(exc: BaseException) -> bool:
    """Whether an exception came from the storage (Optuna's wrapper, SQLAlchemy or a DB driver)."""
    if isinstance(exc, optuna.exceptions.StorageInternalError):
        return True
    mod = type(exc).__module__ or ""
    return mod.startswith(("sqlalchemy", "psycopg", "sqlite3", "pymysql"))


# ------------------------------------------------------------------------------------------------
# Opening a storage
# ------------------------------------------------------------------------------------------------

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


def storage_path(url: str | None) -> str | None:
    """The absolute path of a file storage (sqlite / journal), else None."""
    kind = storage_kind(url)
    u = str(url or "").strip()
    if kind == "journal":
        path = u[len("journal:"):] if u.startswith("journal:") else u
        path = path[2:] if path.startswith("//") else path
        return os.path.abspath(os.path.expanduser(path)) if path else None
    if kind == "sqlite" and u.startswith("sqlite:///"):
        path = u[len("sqlite:///"):].split("?", 1)[0]
        return os.path.abspath(os.path.expanduser(path)) if path and path != ":memory:" else None
    return None


def open_storage(url: str | None, *, must_exist: bool = False, grace_s: float | None = None) -> BaseStorage:
    """An Optuna storage for the URL; one that cannot be reached is a SpecError (one line).

    `must_exist` (read-only commands): a sqlite or journal file that does not exist is refused
    instead of created. `grace_s`: an RDB trial whose heartbeat is older is stale (default
    HEARTBEAT_GRACE_S)."""
    kind = storage_kind(url)
    if kind == "memory":
        return InMemoryStorage()
    u = str(url).strip()
    if kind == "unknown":
        raise SpecError("storage", f"unknown storage {redact_url(u)!r}; use sqlite:///FILE, journal:FILE, "
                        f"postgresql://USER:PASSWORD@HOST/DB or memory")
    path = storage_path(u)
    if kind == "journal" and path is None:
        raise SpecError("storage", "journal: needs a file path, e.g. journal:results/study.log")
    if must_exist and path is not None and not os.path.isfile(path):
        raise SpecError("storage", f"{path} does not exist (check the path; a read-only command creates "
                        f"no storage)")
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as exc:
            raise SpecError("storage", f"cannot create the folder of {path}: {exc.strerror or exc}") from None
    if kind == "journal":
        return _open_journal(path)
    return _open_rdb(u, kind, grace_s)


def _open_journal(path: str) -> JournalStorage:
    try:
        repair_journal(path)
        return JournalStorage(JournalFileBackend(path, lock_obj=JournalFileSymlinkLock(path, JOURNAL_LOCK_GRACE_S)))
    except OSError as exc:
        raise SpecError("storage", f"cannot open the journal file {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise SpecError("storage", f"the journal file {path} is not an Optuna journal ({exc})") from None


def repair_journal(path: str) -> int:
    """Cut a torn last line (a writer killed in mid-write) off a journal file, under the journal's
    own lock, so the next append does not glue onto it and make the file unreadable. The cut bytes
    are kept in PATH.torn-<time>. Returns how many bytes were cut."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return 0
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) == b"\n":
            return 0
    lock = JournalFileSymlinkLock(path, JOURNAL_LOCK_GRACE_S)
    lock.acquire()
    try:
        with open(path, "rb+") as fh:
            data = fh.read()
            if data.endswith(b"\n"):
                return 0                       # a writer finished the line meanwhile
            keep = data.rfind(b"\n") + 1
            with open(f"{path}.torn-{int(time.time())}", "wb") as torn:
                torn.write(data[keep:])
            fh.truncate(keep)
            return len(data) - keep
    finally:
        lock.release()


def _open_rdb(u: str, kind: str, grace_s: float | None) -> RDBStorage:
    grace = max(1, math.ceil(grace_s)) if grace_s is not None else HEARTBEAT_GRACE_S
    interval = max(1, min(HEARTBEAT_INTERVAL_S, grace // 2))
    engine_kwargs: dict = {}
    if kind == "sqlite":
        engine_kwargs = {"connect_args": {"timeout": 60}}
    elif u.startswith(("postgresql", "postgres", "mysql")):
        engine_kwargs = {"pool_pre_ping": True, "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
        if u.startswith("postgres") and "options" not in _url_query(u):    # a URL's own libpq options win
            engine_kwargs["connect_args"]["options"] = \
                f"-c idle_in_transaction_session_timeout={PG_IDLE_IN_TRANSACTION_S * 1000}"
    last: Exception | None = None
    for attempt in range(_CREATE_TRIES):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return RDBStorage(u, engine_kwargs=engine_kwargs, heartbeat_interval=interval,
                                  grace_period=grace,
                                  heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY))
        except ImportError as exc:
            raise SpecError("storage", f"{redact_url(u)} needs a database driver that is not installed "
                            f"({scrub(exc, u)}); for PostgreSQL: pip install 'psycopg[binary]'") from None
        except Exception as exc:  # noqa: BLE001 - sqlalchemy: unreachable host, credentials, races
            last = exc
            if kind != "sqlite" or not _is_creation_race(exc):
                break
            time.sleep(0.2 * (attempt + 1))
    raise SpecError("storage", f"cannot open {storage_error(last, u).reason}") from None


def _url_query(u: str) -> dict:
    """The query parameters of a database URL as SQLAlchemy reads them ({} when it cannot parse it: opening the
    storage then reports the URL)."""
    from sqlalchemy.engine import make_url
    try:
        return dict(make_url(u).query)
    except Exception:  # noqa: BLE001 - sqlalchemy's parse errors
        return {}


def _is_creation_race(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("unique constraint failed", "already exists", "database is locked"))


def load_study(storage: BaseStorage, name: str, url: str | None = None, sampler=None) -> optuna.Study:
    try:
        return optuna.load_study(study_name=name, storage=storage, sampler=sampler)
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
        hint = f"; studies there: {', '.join(names[:10])}" if names else "; the storage holds no study"
        raise SpecError("study", f"no study named {name!r} in {redact_url(url)}{hint}") from None


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (an existing file, or the same absolute path)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)
