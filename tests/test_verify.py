"""`autotune verify` and `search --verify-top` (issue 14): bad input in this process (no run starts),
one real proxy run in a subprocess with 4 host CPU devices, and its record read by `calibrate`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from autotune.calibrate import build_cases
from costmodels.params import EfficiencyParams
from cli.main import app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "tiny_llama_config.json")
PROBLEM = ["--model", TINY, "--gpu", "h100", "--global-batch", "16", "--seq-len", "32"]
runner = CliRunner()


def one_line_error(result, code: int, *needles: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_plan_larger_than_the_devices_suggests_proxy():
    res = runner.invoke(app, ["verify", *PROBLEM, "--gpus", "64", "--plan", "tp=2,pp=2", "--no-save"])
    one_line_error(res, 2, "gpus", "needs 64 devices", "present", "--proxy")


def test_proxy_needing_more_devices_than_present_is_refused():
    res = runner.invoke(app, ["verify", *PROBLEM, "--gpus", "64", "--plan", "tp=2,pp=2", "--proxy", "--no-save"])
    one_line_error(res, 2, "proxy needs tp*cp*ep = 2 devices", "1 present")     # this process has 1 CPU device


def test_unknown_runner_is_refused():
    res = runner.invoke(app, ["verify", *PROBLEM, "--gpus", "1", "--plan", "tp=1", "--runner", "pytorch", "--no-save"])
    one_line_error(res, 2, "runner", "pytorch", "jax, megatron")


def test_verify_top_refused_for_a_gpu_range_and_its_flags_without_it():
    res = runner.invoke(app, ["search", *PROBLEM, "--gpus", "8-16", "--strategy", "optuna", "--trials", "5",
                              "--verify-top", "2", "--no-save"])
    one_line_error(res, 2, "verify-top", "one GPU count")
    res = runner.invoke(app, ["search", *PROBLEM, "--gpus", "8", "--runner", "megatron", "--no-save"])
    one_line_error(res, 2, "--runner", "--verify-top")


@pytest.fixture(scope="module")
def proxy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("meas")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "cli.main", "verify", *PROBLEM, "--gpus", "32", "--plan", "tp=2,pp=4,mbs=1",
           "--proxy", "--steps", "3", "--json", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_proxy_run_keeps_per_device_shapes_and_says_what_is_predicted(proxy_run):
    r = proxy_run
    assert r["status"] == "ok" and r["proxy"] is True
    assert r["run_plan"]["tp"] == 2 and r["run_plan"]["pp"] == 1 and r["run_plan"]["dp"] == 1
    assert r["run_layers"] == 1                       # 4 layers / pp=4
    assert r["run_global_batch"] == 16 // 4           # dp=4 in the plan -> one DP rank's share
    assert any("bubble" in t for t in r["predicted_terms"])
    assert any("DP gradient" in t for t in r["predicted_terms"])
    assert any("TP collectives" in t for t in r["measured_terms"])
    cmp = r["comparison"]
    assert cmp["step_time_s"]["n_steps"] == 3 and cmp["step_time_s"]["measured"] > 0
    assert cmp["step_time_s"]["error_pct"] is None    # CPU time vs an H100 prediction: not compared
    assert cmp["memory_gb"]["measured"] > 0 and cmp["memory_gb"]["source"] == "XLA compiled memory analysis"


def test_record_follows_the_validation_schema(proxy_run):
    rec = proxy_run["record"]
    for key in ("id", "source", "confidence", "usable", "model", "hardware", "plan", "measured", "notes",
                "derived_fields"):
        assert key in rec
    assert rec["usable"] is False and rec["hardware"]["gpu_key"] == "cpu"   # CPU times never calibrate a GPU
    m = rec["measured"]
    assert m["iteration_time_s"] == proxy_run["comparison"]["step_time_s"]["measured"]
    assert m["tokens_per_s_per_gpu"] == pytest.approx(4 * 32 / m["iteration_time_s"] / 2)
    assert rec["run"]["machine"]["jax"] and rec["run"]["machine"]["devices_present"] == 4
    with open(proxy_run["saved"]) as fh:
        assert json.load(fh)[0]["id"] == rec["id"]


def test_calibration_reads_the_record(proxy_run, tmp_path):
    """A record measured on a GPU is a calibration case whose measured step is the run's median."""
    rec = json.loads(json.dumps(proxy_run["record"]))
    rec["hardware"]["gpu_key"], rec["usable"] = "h100", True
    cases = build_cases([rec], EfficiencyParams())
    assert len(cases) == 1
    assert cases[0].measured_step_s == pytest.approx(rec["measured"]["iteration_time_s"], rel=1e-6)
    assert cases[0].plan["tp"] == 2 and cases[0].plan["pp"] == 1
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([rec, rec]))
    res = runner.invoke(app, ["calibrate", str(runs), "--gpu", "h100", "-o", str(tmp_path / "cal.json"),
                              "--holdout-frac", "0", "--rounds", "1", "--steps", "5", "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads((tmp_path / "cal.json").read_text())["fit"]["n_train"] == 2


def test_verified_plans_become_optuna_trials_seeded_by_enqueue():
    from autotune.verify import record_trials
    from costmodels.plan import Plan
    ver = {"reranked": True, "plans": [
        {"plan": Plan(tp=2, mbs=2).as_dict(), "status": "ok", "predicted_step_time_s": 1.0,
         "corrected_step_time_s": 1.25, "proxy": True},
        {"plan": Plan(pp=2).as_dict(), "status": "oom", "predicted_step_time_s": 0.9},
        {"plan": Plan(dp=2).as_dict(), "status": "ok", "predicted_step_time_s": 1.1, "corrected_step_time_s": 1.1}]}
    study = record_trials(ver)
    states = [t.state.name for t in study.trials]
    assert states == ["COMPLETE", "FAIL", "COMPLETE"]
    assert study.trials[0].params["tp"] == 2 and study.trials[0].params["mbs"] == 2
    assert study.trials[1].params["pp"] == 2 and study.trials[1].user_attrs["status"] == "oom"
    assert study.best_trial.params["dp"] == 2 and study.best_value == 1.1


def test_oom_is_recognised_from_xla_messages():
    from autotune.runner.measure import is_oom
    assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 81.23GiB."))
    assert not is_oom(RuntimeError("INVALID_ARGUMENT: shapes do not match"))


def _fake_top(n):
    from costmodels.plan import Plan
    return [{"plan": Plan(tp=1, mbs=i + 1).as_dict(), "step_time_s": 1.0 + i} for i in range(n)]


def test_verify_top_goes_on_after_oom_and_keeps_finished_runs_on_ctrl_c(monkeypatch):
    """An OOM is recorded and the next plan still runs; Ctrl-C stops and keeps what finished."""
    import autotune.verify as V
    from autotune import api
    calls = []

    def fake(problem, plan, **kw):
        calls.append(plan.mbs)
        if plan.mbs == 3:
            raise KeyboardInterrupt
        status = "oom" if plan.mbs == 1 else "ok"
        st = {"measured": 0.5 if status == "ok" else None, "predicted": 0.25}
        return {"status": status, "proxy": False, "comparison": {"step_time_s": st}, "record": {}}

    monkeypatch.setattr(V, "verify_plan", fake)
    problem = api.build_problem(model=TINY, gpu="h100", gpus=1, global_batch=16, seq_len=32)
    ver = V.verify_top(problem, _fake_top(4), 4, gpu_key="h100")
    assert calls == [1, 2, 3]                         # the 4th never started
    assert ver["interrupted"] is True
    assert [e["status"] for e in ver["plans"]] == ["oom", "ok"]
    assert ver["plans"][1]["corrected_step_time_s"] == pytest.approx(2.0 * 0.5 / 0.25)


@pytest.mark.parametrize("runner, expected", [
    ("jax", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}),         # the runner may use what Megatron would
    ("megatron", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),    # JAX only scores: the GPUs are Megatron's
])
def test_runner_claims_device_memory_before_jax_starts(runner, expected):
    from autotune.runner import claim_device_memory
    env = {"PATH": "/usr/bin"}
    assert claim_device_memory(runner, env) == expected
    assert env == {"PATH": "/usr/bin", **expected}


@pytest.mark.parametrize("chosen", ["XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                    "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR"])
@pytest.mark.parametrize("runner", ["jax", "megatron"])
def test_a_users_jax_memory_setting_is_kept(chosen, runner):
    # jaxlib refuses both fraction names at once: never add one beside the user's
    from autotune.runner import claim_device_memory
    env = {chosen: "0.5"}
    assert claim_device_memory(runner, env) == {}
    assert env == {chosen: "0.5"}


def test_the_record_says_how_jax_took_gpu_memory(monkeypatch):
    # an out-of-memory run depends on it: the H100's first pass ran out at JAX's default 75 %
    import jax

    from autotune.verify import machine_info
    for v in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert machine_info(jax.devices())["jax_memory_env"] == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert machine_info(jax.devices())["jax_memory_env"] == {}
