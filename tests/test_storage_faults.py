"""Storage faults (issue 12): passwords never shown, read-only commands create nothing, an export
never overwrites its storage, a torn journal line loses nothing, concurrent first use of a new sqlite
file works, and a worker SIGKILLed on sqlite / journal (relative and absolute path) is resumed with
nothing lost or duplicated.

Unreachable storages are a closed port on 127.0.0.1 only.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optuna.trial import TrialState
from typer.testing import CliRunner

from autotune.optuna_search import StudySpec, optuna_search, run_worker
from autotune.storage import open_storage, redact_url, repair_journal, scrub
from cli.main import app

from tests.test_optuna import one_error_line  # noqa: E402  (one helper for both files)

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(model="llama3-8b", gpu="h100", gpus="8", global_batch=16, seq_len=4096)
runner = CliRunner()
optuna.logging.set_verbosity(optuna.logging.WARNING)


# ---------------------------------------------------------------------------------------------
# Passwords
# ---------------------------------------------------------------------------------------------

#: a marker at both ends keeps a short password from matching the user or host by chance
PASSWORDS = st.text(alphabet="abcXYZ019/?#@:%!&=+ ", min_size=1, max_size=16).map(lambda s: f"Qz{s}Jk")


@settings(max_examples=200, deadline=None)
@given(pw=PASSWORDS, dialect=st.sampled_from(["postgresql", "postgresql+psycopg", "mysql+pymysql"]))
def test_a_raw_password_with_url_delimiters_is_never_shown(pw, dialect):
    url = f"{dialect}://alice:{pw}@db.invalid:5432/studies"
    shown = redact_url(url)
    assert pw not in shown and "Qz" not in shown and "db.invalid" in shown
    msg = scrub(f'connection to {url} failed: password "{pw}" rejected', url)
    assert "Qz" not in msg and "Jk" not in msg


def test_cli_never_prints_a_password_with_a_slash():
    url = "postgresql://alice:Sup3r/S3cret@127.0.0.1:9/db"
    for args in (["studies", "--json", "--storage", url], ["worker", "--storage", url, "--study", "x", "--trials", "1"]):
        r = runner.invoke(app, args)
        one_error_line(r, 2, "storage", "postgresql://alice:***@127.0.0.1:9/db")
        assert "S3cret" not in r.stdout + r.stderr and "Sup3r" not in r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# Read-only commands, exports
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["sqlite:///{d}/typo.db", "journal:{d}/typo.log"])
def test_studies_on_a_missing_file_creates_nothing(tmp_path, url):
    url = url.format(d=tmp_path)
    r = runner.invoke(app, ["studies", "--storage", url])
    one_error_line(r, 2, "storage", "does not exist")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def small_study(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    urls = {"sqlite": f"sqlite:///{d}/s.db", "journal": f"journal:{d}/s.log"}
    for url in urls.values():
        optuna_search(StudySpec(**SMALL, seed=0), n_trials=8, storage_url=url, study_name="s")
    return d, urls


@pytest.mark.parametrize("kind,file", [("sqlite", "s.db"), ("journal", "s.log")])
def test_export_onto_the_storage_is_refused(small_study, kind, file):
    d, urls = small_study
    before = hashlib.sha256((d / file).read_bytes()).hexdigest()
    for target in (str(d / file), os.path.relpath(d / file)):
        r = runner.invoke(app, ["studies", "--storage", urls[kind], "--study", "s", "--export", target])
        one_error_line(r, 2, "export", "storage")
    assert hashlib.sha256((d / file).read_bytes()).hexdigest() == before
    r = runner.invoke(app, ["studies", "--storage", urls[kind], "--study", "s", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["n_trials"] == 8


# ---------------------------------------------------------------------------------------------
# Journal: a torn last line
# ---------------------------------------------------------------------------------------------

def test_a_torn_last_journal_line_loses_nothing(tmp_path):
    path = tmp_path / "torn.log"
    optuna_search(StudySpec(**SMALL, seed=0), n_trials=12, storage_url=f"journal:{path}", study_name="t")
    size = path.stat().st_size
    with open(path, "ab") as fh:                  # a writer killed in mid-line
        fh.write(b'{"op_code": 5, "worker_id": "dead", "trial_id": 3, "par')
    out = run_worker(f"journal:{path}", "t", n_trials=6)
    assert out["run"]["trials"] == 6 and out["study_trials"]["complete"] == 18
    study = optuna.load_study(study_name="t", storage=open_storage(f"journal:{path}"))
    assert sum(t.state == TrialState.COMPLETE for t in study.trials) == 18
    torn = list(tmp_path.glob("torn.log.torn-*"))
    assert len(torn) == 1 and torn[0].read_bytes().startswith(b'{"op_code": 5') and path.stat().st_size > size
    assert repair_journal(str(path)) == 0         # a whole file is left alone


# ---------------------------------------------------------------------------------------------
# Concurrency and SIGKILL
# ---------------------------------------------------------------------------------------------

def _python(cwd, *args, out=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", *args], cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=out, stderr=out, text=True)


def test_concurrent_first_use_of_a_new_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path}/new.db"
    code = ("import sys, optuna; from autotune.storage import open_storage; "
            f"s = open_storage({url!r}); optuna.create_study(storage=s, study_name='w' + sys.argv[-1])")
    procs = [_python(tmp_path, code, str(i)) for i in range(4)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), errs
    names = {s.study_name for s in optuna.get_all_study_summaries(open_storage(url))}
    assert names >= {"w0", "w1", "w2", "w3"}


@pytest.mark.parametrize("where", ["sqlite", "journal-absolute", "journal-relative"])
def test_a_sigkilled_worker_is_resumed_with_nothing_lost(tmp_path, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    url = {"sqlite": f"sqlite:///{tmp_path}/k.db", "journal-absolute": f"journal:{tmp_path}/k.log",
           "journal-relative": "journal:runs/k.log"}[where]
    optuna_search(StudySpec(**SMALL, seed=0), n_trials=4, storage_url=url, study_name="k")
    victim = _python(tmp_path, "from cli.main import app; app()", "worker", "--storage", url, "--study", "k",
                     "--trials", "100000", "--batch-size", "4", "--json", out=subprocess.DEVNULL)

    def trials():
        return optuna.load_study(study_name="k", storage=open_storage(url)).get_trials(deepcopy=False)

    deadline = time.time() + 120
    while sum(t.state == TrialState.COMPLETE for t in trials()) < 24 and time.time() < deadline:
        time.sleep(0.1)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    before = trials()
    done = {t.number for t in before if t.state == TrialState.COMPLETE}
    running = {t.number for t in before if t.state == TrialState.RUNNING}
    assert len(done) >= 24
    time.sleep(1.5)

    out = run_worker(url, "k", n_trials=8 + len(running), stale_after_s=1.0)
    after = trials()
    assert out["run"]["zombies_failed"] == len(running)
    assert sorted(t.number for t in after) == list(range(len(after)))            # no trial lost or doubled
    complete = [t for t in after if t.state == TrialState.COMPLETE]
    assert {t.number for t in complete} >= done and len(complete) == len(done) + 8 + len(running), (
        out["run"], [(t.number, t.state.name, t.params, t.user_attrs) for t in after if t.state != TrialState.COMPLETE])
    assert {t.number for t in after if t.state == TrialState.FAIL} == running
    assert not [t for t in after if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert running <= {t.system_attrs.get("failed_trial") for t in complete}   # each dead plan scored again
    if where.startswith("journal"):
        assert not Path(str(Path(url[len("journal:"):]).resolve()) + ".lock").exists()


def test_stale_after_must_be_positive(small_study):
    _, urls = small_study
    r = runner.invoke(app, ["worker", "--storage", urls["sqlite"], "--study", "s", "--trials", "1", "--stale-after", "-1"])
    one_error_line(r, 2, "stale_after", "positive")
