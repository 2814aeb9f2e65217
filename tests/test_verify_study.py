"""Real runs as an Optuna study (issue 14 item 5): `search --verify-top K --storage URL --study NAME`
queues the cost model's top K plans in a verification study (sqlite here; any RDB or journal storage),
and `autotune worker --storage URL --study NAME` on any machine measures them, then the sampler's
proposals. The study holds the problem, so a worker needs only --storage and --study.

Megatron runs use tests/data/fake_megatron (Megatron-LM's log lines, no GPU; see its docstring); jax
runs use the tiny model on host CPU devices (1 in this process, 2 in a subprocess via XLA_FLAGS)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from optuna.trial import TrialState
from typer.testing import CliRunner

from autotune import api
from autotune.study_spec import StudySpec
from autotune.verify_study import (RunnerConfig, open_verification_study, run_verification_worker,
                                   verification_summary)
from cli.main import app

from tests.test_verify import one_line_error  # noqa: E402  (one helper for the verify tests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = os.path.join(ROOT, "tests", "data", "fake_megatron")
TINY = os.path.join(ROOT, "tests", "data", "tiny_llama_config.json")
runner = CliRunner()
BIG = dict(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096)


@pytest.fixture
def checkout(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", os.path.join(FAKE, "bin") + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("FAKE_MEGATRON_ARGV", str(tmp_path / "runs.jsonl"))     # one line per real run
    monkeypatch.chdir(tmp_path)
    return FAKE


def _top(problem, *texts):
    """Plan reports (what the search's `top` holds) for the given plans."""
    out = []
    for text in texts:
        plan = api.plan_from_text(text, problem)
        out.append({"plan": plan.as_dict(), "step_time_s": api.predict_plan(problem, plan)["step_time_s"]})
    return out


def _spec(**kw) -> StudySpec:
    return StudySpec(**{**kw, "gpus": str(kw["gpus"])})


def _trials(url: str, name: str) -> list:
    return optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)


def test_two_workers_measure_distinct_plans_of_one_study(checkout, tmp_path, monkeypatch):
    """Queued plans first (a plan predicted not to fit is pruned, never run; an OOM is a FAIL trial and
    the worker goes on), then the sampler's proposals; two workers never measure the same plan."""
    monkeypatch.setenv("FAKE_MEGATRON_OOM_MBS", "4")          # the fake runs out of memory at mbs >= 4
    problem = api.build_problem(**BIG)
    fits = "tp=2,pp=1,mbs=1,recompute=selective,zero=1"
    oom = "tp=2,pp=2,mbs=4,recompute=full"
    too_big = "tp=1,pp=1,mbs=8,recompute=none"
    preds = {t: api.predict_plan(problem, api.plan_from_text(t, problem)) for t in (fits, oom, too_big)}
    assert preds[fits]["fits"] and preds[oom]["fits"] and not preds[too_big]["fits"]
    url = f"sqlite:///{tmp_path}/v.db"
    run = RunnerConfig(runner="megatron", megatron_path=checkout, steps=2)
    name, queued, joined = open_verification_study(_spec(**BIG), run, storage_url=url, study_name="v",
                                                   top=_top(problem, fits, oom, too_big), k=3)
    assert (name, queued, joined) == ("v", 3, False)
    a = runner.invoke(app, ["worker", "--storage", url, "--study", "v", "--trials", "1", "--json", "--seed", "0"])
    assert a.exit_code == 0, a.stderr
    a = json.loads(a.stdout)
    assert [(e["seeded"], e["status"]) for e in a["entries"]] == [("cost model #1", "ok")]
    b = runner.invoke(app, ["worker", "--storage", url, "--study", "v", "--trials", "3", "--json", "--seed", "0",
                            "--runner", "megatron"])
    assert b.exit_code == 0, b.stderr
    b = json.loads(b.stdout)
    assert [(e["seeded"], e["status"]) for e in b["entries"][:2]] == [("cost model #2", "oom"),
                                                                      ("cost model #3", "predicted-oom")]
    assert "CUDA out of memory" in b["entries"][0]["reason"] and "limit: not run" in b["entries"][1]["reason"]
    proposed = [e for e in b["entries"][2:] if e["status"] in ("ok", "oom")]
    assert proposed and all(e["seeded"] is None for e in b["entries"][2:])   # the sampler's
    assert b["runs"] == 3 and len(proposed) == 2
    trials = _trials(url, "v")
    plans = [json.dumps(t.user_attrs["plan"], sort_keys=True) for t in trials if "plan" in t.user_attrs]
    assert len(plans) == len(set(plans))                       # distinct plans
    with open(tmp_path / "runs.jsonl") as fh:                   # 1 + 3 real runs; the pruned plan never ran
        assert len(fh.readlines()) == 4
    by_status = {}
    for t in trials:
        by_status.setdefault(t.user_attrs.get("status"), []).append(t.state)
    assert set(by_status["predicted-oom"]) == {TrialState.PRUNED} and set(by_status["oom"]) == {TrialState.FAIL}
    assert set(by_status["ok"]) == {TrialState.COMPLETE}
    best = min((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    assert best.value == pytest.approx(best.user_attrs["measured_run_step_time_s"])     # a full run: measured
    summ = verification_summary(url, "v")
    assert summ["best"]["trial"] == best.number and summ["counts"]["PRUNED"] == len(by_status["predicted-oom"])
    shown = runner.invoke(app, ["studies", "--storage", url, "--study", "v", "--json"])
    assert shown.exit_code == 0, shown.stderr
    ranked = [r for r in json.loads(shown.stdout)["plans"] if r.get("measured_rank")]
    assert ranked and min(ranked, key=lambda r: r["measured_rank"])["trial"] == best.number
    files = sorted(f for f in os.listdir("measurements") if f.startswith("verify_v_") and f.endswith(".json"))
    records = [r for f in files for r in json.load(open(os.path.join("measurements", f)))]
    assert len(records) == 4 and all(r["run"]["runner"] == "megatron" for r in records)   # OOM runs recorded too


def test_search_verify_top_with_a_storage_queues_and_measures(checkout, tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    args = ["search", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "64", "--seq-len",
            "4096", "--no-sensitivity", "--out", str(tmp_path / "out"), "--verify-top", "2", "--runner", "megatron",
            "--megatron-path", checkout, "--storage", url, "--study", "s"]
    res = runner.invoke(app, args + ["--json"])
    assert res.exit_code == 0, res.stderr
    rep = json.loads(res.stdout)
    ver = rep["verification"]
    assert rep["strategy_choice"]["chosen"] == "exhaustive"    # --storage names the verification study here
    assert ver["optuna"]["study"] == "s" and ver["optuna"]["queued"] == 2 and ver["optuna"]["this_process_runs"] == 2
    assert {e["status"] for e in ver["plans"]} == {"ok"} and ver["reranked"] is True
    assert [e["plan"] for e in sorted(ver["plans"], key=lambda e: e["predicted_rank"])] == \
        [t["plan"] for t in rep["top"][:2]]
    # the study holds the problem: a worker needs only the storage and the name
    attrs = optuna.load_study(study_name="s", storage=url).user_attrs
    assert attrs["autotune"]["global_batch"] == 64 and attrs["autotune_verify"]["runner"] == "megatron"
    res = runner.invoke(app, args)                              # again: joins, queues nothing new
    assert res.exit_code == 0, res.stderr
    assert "0 plans queued (joined an existing study)" in " ".join(res.stdout.split())
    one_line_error(runner.invoke(app, args[:-2] + ["--study", "s", "--gpus", "16"]), 2, "study", "another problem")


def test_ctrl_c_keeps_finished_trials_and_queues_the_plan_in_flight_again(checkout, tmp_path, monkeypatch):
    import autotune.verify_study as VS
    problem = api.build_problem(**BIG)
    url = f"sqlite:///{tmp_path}/c.db"
    open_verification_study(_spec(**BIG), RunnerConfig(runner="megatron", megatron_path=checkout, steps=2),
                            storage_url=url, study_name="c", k=3,
                            top=_top(problem, "tp=2,mbs=1,recompute=selective,zero=1", "tp=4,mbs=1", "tp=2,pp=2,mbs=2"))
    real, calls = VS.verify_plan, []

    def stop_on_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(VS, "verify_plan", stop_on_second)
    res = runner.invoke(app, ["worker", "--storage", url, "--study", "c", "--trials", "3", "--out", "m"])
    assert res.exit_code == 130, res.stderr
    assert res.stderr.strip().startswith("error: interrupted: 1 finished runs kept in study c")
    trials = _trials(url, "c")
    states = [(t.state, t.user_attrs.get("status")) for t in trials]
    assert states[:2] == [(TrialState.COMPLETE, "ok"), (TrialState.FAIL, "interrupted")]
    assert sum(t.state == TrialState.WAITING for t in trials) == 2       # the plan in flight + the one never started
    files = [f for f in os.listdir("m") if f.endswith(".json")]
    assert len(files) == 1 and len(json.load(open(os.path.join("m", files[0])))) == 1     # the finished record
    monkeypatch.setattr(VS, "verify_plan", real)
    res = runner.invoke(app, ["worker", "--storage", url, "--study", "c", "--trials", "2", "--json"])
    assert res.exit_code == 0, res.stderr
    again = json.loads(res.stdout)["entries"]
    assert [e["status"] for e in again] == ["ok", "ok"] and {e["seeded"] for e in again} == {"cost model #2",
                                                                                             "cost model #3"}
    assert trials[1].user_attrs["plan"] in [e["plan"] for e in again]     # the interrupted plan, measured now


def test_jax_worker_fails_a_refused_plan_and_goes_on(tmp_path):
    """1 CPU device here: tp=2 needs 2 devices even as a proxy, so it is refused (FAIL); the dp=2 plans
    run as proxies (one DP rank) on the one device."""
    tiny = dict(model=TINY, gpu="h100", gpus=2, global_batch=8, seq_len=32)
    problem = api.build_problem(**tiny)
    url = f"sqlite:///{tmp_path}/j.db"
    open_verification_study(_spec(**tiny), RunnerConfig(runner="jax", steps=2), storage_url=url, study_name="j",
                            top=_top(problem, "tp=2,mbs=1", "dp=2,mbs=1", "dp=2,mbs=2"), k=3)
    out = run_verification_worker(url, "j", n_trials=2, out=str(tmp_path / "m"))
    assert [e["status"] for e in out["entries"]] == ["refused", "ok", "ok"]
    assert "needs tp*cp*ep = 2 devices" in out["entries"][0]["reason"]
    assert all(e["proxy"] for e in out["entries"][1:])
    trials = _trials(url, "j")
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert trials[1].value == pytest.approx(trials[1].user_attrs["measured_run_step_time_s"])  # CPU: the run's time
    assert len(json.load(open(out["saved"]))) == 2


def test_worker_flags_and_studies_of_the_wrong_kind_are_one_line(tmp_path):
    url = f"sqlite:///{tmp_path}/w.db"
    res = runner.invoke(app, ["search", "--model", TINY, "--gpu", "h100", "--gpus", "2", "--global-batch", "8",
                              "--seq-len", "32", "--strategy", "optuna", "--trials", "5", "--storage", url,
                              "--study", "cost", "--no-save", "--no-sensitivity", "--json"])
    assert res.exit_code == 0, res.stderr
    one_line_error(runner.invoke(app, ["worker", "--storage", url, "--study", "cost", "--trials", "1", "--runner",
                                       "jax"]), 2, "study", "cost-model search study")
    one_line_error(runner.invoke(app, ["worker", "--storage", url, "--study", "cost", "--trials", "1",
                                       "--launcher", "slurm"]), 2, "--launcher")
    tiny = dict(model=TINY, gpu="h100", gpus=2, global_batch=8, seq_len=32)
    problem = api.build_problem(**tiny)
    open_verification_study(_spec(**tiny), RunnerConfig(), storage_url=url, study_name="ver",
                            top=_top(problem, "tp=2"), k=1)
    one_line_error(runner.invoke(app, ["worker", "--storage", url, "--study", "ver", "--trials", "1", "--runner",
                                       "megatron"]), 2, "runner", "jax runner")
    open_verification_study(_spec(**tiny), RunnerConfig(runner="megatron", megatron_path=str(tmp_path)),
                            storage_url=url, study_name="meg", top=_top(problem, "tp=2"), k=1)
    one_line_error(runner.invoke(app, ["worker", "--storage", url, "--study", "meg", "--trials", "1"]), 2,
                   "megatron-path", "pretrain_gpt.py")        # no checkout here: the queued plan is not taken
    assert [t.state for t in _trials(url, "meg")] == [TrialState.WAITING]
    one_line_error(runner.invoke(app, ["worker", "--storage", url, "--study", "ver", "--timeout", "5"]), 2, "--timeout")
    one_line_error(runner.invoke(app, ["worker", "--storage", url, "--study", "ver"]), 2, "--trials")
    one_line_error(runner.invoke(app, ["search", "--model", TINY, "--gpu", "h100", "--gpus", "2", "--global-batch", "8",
                                       "--seq-len", "32", "--strategy", "optuna", "--trials", "5", "--storage", url,
                                       "--study", "ver", "--no-save"]), 2, "study", "is a verification study")


def test_two_jax_workers_in_turn_one_in_another_process_on_two_host_devices(tmp_path):
    """The distributed case for real, tiny model: the study is made here and this process's worker (1
    CPU device) measures the first queued plan (dp=2 as a proxy: one DP rank); then a separate
    `autotune worker` process (2 host CPU devices via XLA_FLAGS, set before JAX starts there) takes the
    other queued plan (tp=2, a full run on both devices). (The sampler's proposals after the queue:
    test_two_workers_measure_distinct_plans_of_one_study.)"""
    tiny = dict(model=TINY, gpu="h100", gpus=2, global_batch=8, seq_len=32)
    problem = api.build_problem(**tiny)
    url = f"sqlite:///{tmp_path}/p.db"
    open_verification_study(_spec(**tiny), RunnerConfig(runner="jax", steps=2), storage_url=url, study_name="p",
                            top=_top(problem, "dp=2,mbs=1", "tp=2,mbs=1"), k=2)
    first = run_verification_worker(url, "p", n_trials=1)
    assert [(e["seeded"], e["status"], e["proxy"]) for e in first["entries"]] == [("cost model #1", "ok", True)]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "cli.main", "worker", "--storage", url, "--study", "p", "--trials",
                           "1", "--seed", "0", "--json", "--out", str(tmp_path / "m")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    ran = [e for e in out["entries"] if e.get("ran")]
    assert out["runs"] == 1 and ran[0]["seeded"] == "cost model #2" and ran[0]["status"] == "ok"
    assert ran[0]["plan"]["tp"] == 2 and ran[0]["proxy"] is False       # the whole plan on the 2 devices
    assert out["worker"] != first["worker"]
    trials = _trials(url, "p")
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert trials[0].user_attrs["worker"] != trials[1].user_attrs["worker"]
    assert trials[0].user_attrs["plan"] != trials[1].user_attrs["plan"]


def test_sigint_to_a_worker_process_keeps_the_finished_run(checkout, tmp_path):
    """A real Ctrl-C (SIGINT to the worker process) during its second run: exit 130, the first run's
    trial stays COMPLETE with its record saved, the run in flight is FAIL and its plan queued again."""
    problem = api.build_problem(**BIG)
    url = f"sqlite:///{tmp_path}/s.db"
    open_verification_study(_spec(**BIG), RunnerConfig(runner="megatron", megatron_path=checkout, steps=2),
                            storage_url=url, study_name="s", k=3,
                            top=_top(problem, "tp=2,mbs=1,recompute=selective,zero=1", "tp=4,mbs=1", "tp=2,pp=2,mbs=2"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               FAKE_MEGATRON_SLEEP_S="0.5", JAX_PLATFORMS="cpu")
    # started from a suite run in the background (`cmd &`), the worker inherits SIGINT ignored: it must stop anyway
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "worker", "--storage", url, "--study", "s", "--trials",
                             "3", "--out", str(tmp_path / "m")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=str(tmp_path))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:          # wait until the first run is told and the second one runs
        states = [t.state for t in _trials(url, "s")]
        if states.count(TrialState.COMPLETE) == 1 and TrialState.RUNNING in states:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail(f"the worker did not reach its second run: {proc.communicate()[1][-2000:]}")
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: interrupted: 1 finished runs kept in study s")
    trials = _trials(url, "s")
    assert [(t.state, t.user_attrs.get("status")) for t in trials[:2]] == [
        (TrialState.COMPLETE, "ok"), (TrialState.FAIL, "interrupted")]
    assert sum(t.state == TrialState.WAITING for t in trials) == 2       # the interrupted plan + the third
    saved = [f for f in os.listdir(tmp_path / "m") if f.endswith(".json")]
    assert len(saved) == 1 and len(json.load(open(tmp_path / "m" / saved[0]))) == 1
