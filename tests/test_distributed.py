"""Distributed Optuna search on PostgreSQL, for real (issue 4, "measured" 3).

Worker processes (`autotune worker`) share one study in a PostgreSQL database through Optuna's RDB
storage. The server comes from `.ci/services.sh` (CI runs it before pytest); the URL is
AUTOTUNE_TEST_PG_URL, else postgresql://autotune:autotune@127.0.0.1:5432/autotune_test.
Without a reachable server these tests skip, saying why; under CI (CI=true) they fail instead, so
CI can never pass by skipping them.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune import optuna_search as osr
from autotune.api import build_problem
from autotune.search import exhaustive
from autotune.storage import redact_url

REPO = Path(__file__).resolve().parents[1]
PG_URL = os.environ.get("AUTOTUNE_TEST_PG_URL", "postgresql://autotune:autotune@127.0.0.1:5432/autotune_test")
SMALL = dict(model="llama3-8b", gpu="h100", gpus="8", global_batch=16, seq_len=4096)
PINNED = {"zero": 1, "recompute": 0, "sp": 1, "vpp": 1}   # 30 legal plans: 48 trials reach the optimum

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _unreachable(url: str) -> str | None:
    """Why the server cannot be used, or None."""
    try:
        import sqlalchemy
        engine = sqlalchemy.create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("select 1"))
        engine.dispose()
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means "no server for the tests"
        orig = getattr(exc, "orig", None) or exc
        return " ".join(str(orig).split())[:200] or type(orig).__name__


@pytest.fixture(scope="module")
def pg() -> str:
    why = _unreachable(PG_URL)
    if why is not None:
        where = redact_url(PG_URL)
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(f"CI: PostgreSQL at {where} is unreachable ({why}); .ci/services.sh must start it")
        pytest.skip(f"no PostgreSQL reachable at {where} ({why}); run `bash .ci/services.sh` "
                    f"or set AUTOTUNE_TEST_PG_URL")
    return PG_URL


@pytest.fixture
def study_name(pg):
    names: list = []

    def make(tag: str) -> str:
        names.append(f"test-{tag}-{uuid.uuid4().hex[:8]}")
        return names[-1]

    yield make
    for name in names:
        try:
            optuna.delete_study(study_name=name, storage=pg)
        except KeyError:
            pass


def _create(pg: str, name: str, **kw) -> None:
    """A study holding its problem, with no trial yet (what `search --storage` leaves behind)."""
    spec = osr.StudySpec(**SMALL, **kw).resolved()
    space = spec.build_space()
    osr.create_study(spec, storage_url=pg, study_name=name, sampler=osr.make_sampler(spec.sampler, None, space, 1))


def _worker(pg: str, name: str, trials: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", "from cli.main import app; app()", "worker", "--storage", pg, "--study", name,
           "--trials", str(trials), "--json", *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    assert "autotune:autotune@" not in out + err            # the password is never printed
    return json.loads(out)


def _states(pg: str, name: str) -> list:
    return optuna.load_study(study_name=name, storage=pg).get_trials(deepcopy=False)


def test_four_workers_share_one_study(pg, study_name):
    shared, single = study_name("shared"), study_name("single")
    _create(pg, shared, fixed=PINNED)
    _create(pg, single, fixed=PINNED)
    procs = [_worker(pg, shared, 12) for _ in range(4)]
    outs = [_finish(p) for p in procs]
    assert [o["run"]["trials"] for o in outs] == [12, 12, 12, 12]
    assert len({o["worker"] for o in outs}) == 4
    assert all(o["storage"] == redact_url(pg) for o in outs)

    trials = _states(pg, shared)
    # exactly the requested number of finished trials: none lost, none duplicated
    assert len(trials) == 48
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert sorted(t.number for t in trials) == list(range(48))
    storage = optuna.storages.get_storage(pg)
    sid = storage.get_study_id_from_name(shared)
    assert len({storage.get_trial_id_from_study_id_trial_number(sid, t.number) for t in trials}) == 48
    assert len({t.user_attrs["worker"] for t in trials}) == 4

    one = _finish(_worker(pg, single, 48))
    assert one["run"]["trials"] == 48
    ref = exhaustive(build_problem(**{**SMALL, "gpus": 8}), fixed=PINNED)
    best_shared = osr.best_trials(optuna.load_study(study_name=shared, storage=pg), ("tokens_per_s",), 1)[0]
    assert best_shared.user_attrs["plan"] == ref.best["plan"]
    # each worker reports the study's best when it finishes; the one finishing last saw all 48 trials (the
    # fourth started need not be that one: comparing outs[-1] alone failed once under load)
    last_seen = min(outs, key=lambda o: o["best"]["step_time_s"])
    assert one["best"]["plan"] == ref.best["plan"] == last_seen["best"]["plan"]
    assert one["best"]["step_time_s"] == pytest.approx(ref.best["step_time_s"], rel=1e-5)


def test_a_killed_worker_is_resumed(pg, study_name):
    """SIGKILL a worker: its RUNNING trials have heartbeats that stop; the next worker (grace 1 s)
    fails them with `fail_stale_trials`, and RetryHeartbeatStaleTrialCallback queues their plans again,
    so every plan the dead worker had asked for is scored. A trial asked without any heartbeat is
    failed by its age (--stale-after)."""
    name = study_name("kill")
    _create(pg, name)
    victim = _worker(pg, name, 100_000, "--batch-size", "4")
    deadline = time.time() + 120
    while time.time() < deadline:
        if sum(t.state == TrialState.COMPLETE for t in _states(pg, name)) >= 12:
            break
        time.sleep(0.2)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    study = optuna.load_study(study_name=name, storage=pg)
    zombie = study.ask()                          # asked, never told, no heartbeat
    zombie.set_user_attr("worker", f"{socket.gethostname()}:{victim.pid}")
    before = _states(pg, name)
    done_before = sum(t.state == TrialState.COMPLETE for t in before)
    running_before = [t for t in before if t.state == TrialState.RUNNING]
    assert done_before >= 12 and running_before
    time.sleep(2.0)

    out = _finish(_worker(pg, name, 12, "--stale-after", "1"))
    assert out["run"]["trials"] == 12
    assert out["run"]["zombies_failed"] == len(running_before)
    after = _states(pg, name)
    assert sum(t.state == TrialState.COMPLETE for t in after) == done_before + 12
    assert not [t for t in after if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    failed = {t.number for t in after if t.state == TrialState.FAIL}
    assert failed == {t.number for t in running_before}
    retried = {t.system_attrs.get("failed_trial") for t in after if t.state == TrialState.COMPLETE}
    assert failed <= retried                       # every plan of a dead trial was scored again
    assert sorted(t.number for t in after) == list(range(len(after)))
    assert out["best"]["fits"]


def test_search_command_creates_a_study_workers_can_join(pg, study_name, tmp_path):
    name = study_name("cli")
    cmd = [sys.executable, "-c", "from cli.main import app; app()", "search", "--model", "llama3-8b", "--gpu", "h100",
           "--gpus", "8", "--global-batch", "16", "--seq-len", "4096", "--strategy", "optuna", "--trials", "8",
           "--storage", pg, "--study", name, "--json", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["optuna"]["storage"] == redact_url(pg) and rep["optuna"]["study"] == name
    saved = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "autotune:autotune@" not in res.stdout + res.stderr + saved
    out = _finish(_worker(pg, name, 8))
    assert out["study_trials"]["complete"] == 16


class _Proxy:
    """A TCP proxy on a free port of 127.0.0.1 to the PostgreSQL server; `stop()` closes it and every
    connection through it: the database stops for the clients that use the proxy, and for no one else."""

    def __init__(self, host: str, port: int):
        import threading
        self.upstream = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.socks: list = []
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import threading
        while not self.stopped:
            try:
                client, _ = self.listener.accept()
                server = socket.create_connection(self.upstream)
            except OSError:
                return
            self.socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass

    def stop(self):
        self.stopped = True
        self.listener.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass


def test_database_stopped_under_a_running_worker(pg, study_name):
    """The database goes away under a running worker: it exits 2 with one line naming the storage
    (no traceback, no password), and the trials it left RUNNING are failed and re-queued by the
    next worker, so none stays RUNNING forever."""
    from sqlalchemy.engine import make_url
    url = make_url(PG_URL)
    name = study_name("stopped")
    _create(pg, name)
    proxy = _Proxy(url.host, url.port or 5432)
    via_proxy = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    victim = _worker(via_proxy, name, 100_000, "--batch-size", "4")
    deadline = time.time() + 120
    while sum(t.state == TrialState.COMPLETE for t in _states(pg, name)) < 12 and time.time() < deadline:
        time.sleep(0.2)
    proxy.stop()
    out, err = victim.communicate(timeout=120)
    assert victim.returncode == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: storage: ") and "Traceback" not in err, err
    assert redact_url(via_proxy) in lines[0] and "autotune:autotune@" not in out + err
    time.sleep(1.5)
    done = _finish(_worker(pg, name, 8, "--stale-after", "1"))
    assert done["run"]["trials"] == 8
    assert not [t for t in _states(pg, name) if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def test_a_study_name_the_database_refuses_is_one_line(pg):
    """A 600-character study name (PostgreSQL's column holds 512): Optuna's StorageInternalError
    becomes one line naming the storage, exit 2, no traceback, no password."""
    from typer.testing import CliRunner

    from cli.main import app
    r = CliRunner().invoke(app, ["search", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch",
                                 "16", "--seq-len", "4096", "--strategy", "optuna", "--trials", "2", "--storage", pg,
                                 "--study", "x" * 600, "--no-save", "--no-sensitivity"])
    assert r.exit_code == 2, (r.stdout, r.stderr, r.exception)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: storage: {redact_url(pg)}"), r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "autotune:autotune@" not in r.stdout + r.stderr


@pytest.mark.parametrize("query, idle, statement", [
    ("", "1min", "0"),
    # a URL's own libpq options are kept as given (and then the server default, no timeout, holds)
    ("?options=-c%20statement_timeout%3D5000", "0", "5s"),
])
def test_a_session_cut_off_inside_a_transaction_is_ended_by_the_server(pg, query, idle, statement):
    """A worker cut off from the database mid-write leaves its server-side session inside an open transaction,
    holding row locks every other worker's next write waits on (until TCP notices, hours later): the storage
    asks the server to end such a session after PG_IDLE_IN_TRANSACTION_S."""
    import sqlalchemy
    from autotune.storage import PG_IDLE_IN_TRANSACTION_S, open_storage
    assert PG_IDLE_IN_TRANSACTION_S == 60
    storage = open_storage(pg + query)
    with storage.engine.connect() as conn:
        show = lambda name: conn.execute(sqlalchemy.text(f"SHOW {name}")).scalar()   # noqa: E731
        assert (show("idle_in_transaction_session_timeout"), show("statement_timeout")) == (idle, statement)
