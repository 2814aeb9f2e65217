"""`autotune verify --runner megatron` and `search --verify-top K --runner megatron` (issue 14): the
commands come from the exporter (`autotune.launch.megatron_launch`); with a checkout the run's log is
parsed into the same measurement record as the jax runner's.

The checkout is tests/data/fake_megatron: a pretrain_gpt.py that prints Megatron-LM's own log lines
(format strings copied from megatron/training/training.py and report_memory, see its docstring) and a
torchrun stand-in on PATH. No GPU, no torch: what is tested is the wiring and the parsing."""
from __future__ import annotations

import json
import os
import statistics

import pytest
from typer.testing import CliRunner

from autotune.calibrate import build_cases
from cli.main import app
from costmodels.params import EfficiencyParams

from tests.test_verify import one_line_error  # noqa: E402  (one helper for the verify tests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE = os.path.join(ROOT, "tests", "data", "fake_megatron")
SMALL = ["--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "64", "--seq-len", "4096"]
runner = CliRunner()


@pytest.fixture
def checkout(monkeypatch, tmp_path):
    """The fake checkout with its torchrun first on PATH; the working folder is a fresh tmp_path."""
    monkeypatch.setenv("PATH", os.path.join(FAKE, "bin") + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FAKE_MEGATRON_OOM_MBS", raising=False)
    return FAKE


def fake_ms(tp: int, pp: int, mbs: int, iteration: int) -> float:
    """What the fake's log line says for an iteration (its formula, printed with Megatron's {:.1f})."""
    ms = 1000.0 * (1 + 0.25 * (tp - 1) + 0.5 * (pp - 1)) / (1 + 0.1 * (mbs - 1))
    return float(f"{ms * (3.0 if iteration == 1 else 1.0 + 0.001 * (iteration % 3)):.1f}")


def test_dry_run_prints_the_exported_command_of_a_tp_pp_vpp_ep_plan():
    plan = "tp=2,pp=4,vpp=2,ep=8,mbs=1,sp=true,zero=1"
    base = ["verify", "--model", "mixtral-8x7b", "--gpu", "h100", "--gpus", "64", "--global-batch", "256",
            "--seq-len", "4096", "--plan", plan, "--runner", "megatron", "--megatron-path", "/opt/Megatron-LM",
            "--dry-run", "--steps", "5"]
    res = runner.invoke(app, base)
    assert res.exit_code == 0, res.stderr
    line = res.stdout.strip()
    assert line.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nnodes 8 --nproc-per-node 8 ")
    assert "--rdzv-endpoint ${MASTER_ADDR}:29500 /opt/Megatron-LM/pretrain_gpt.py" in line   # expanded on each node
    for flags in ("--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 4",
                  "--num-layers-per-virtual-pipeline-stage 4",        # 32 layers / (pp 4 x vpp 2)
                  "--expert-model-parallel-size 8", "--sequence-parallel", "--use-distributed-optimizer",
                  "--num-experts 8", "--moe-router-topk 2", "--micro-batch-size 1", "--global-batch-size 256",
                  "--mock-data", "--train-iters 6"):                  # 5 timed + 1 warm-up iteration
        assert flags in line, flags
    res = runner.invoke(app, base + ["--launcher", "slurm", "--json"])
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["status"] == "dry-run" and out["record"] is None
    sbatch = out["job"]["sbatch"]
    assert "#SBATCH --nodes=8" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch
    assert "srun --kill-on-bad-exit=1 torchrun --nnodes 8" in sbatch
    assert os.path.isabs(out["job"]["log_path"])         # SLURM writes --output relative to the checkout


@pytest.mark.parametrize("command", ["verify", "launch"])
def test_framework_options_reach_the_launched_command(command):
    # what search / predict / export take, verify --runner megatron and launch take too: the command runs
    # the framework the prediction assumed
    base = [command, "--model", "mixtral-8x7b", "--gpu", "h100", "--gpus", "64", "--global-batch", "256",
            "--seq-len", "4096", "--plan", "tp=2,pp=4,vpp=2,ep=8,mbs=1,sp=true,zero=1", "--megatron-path",
            "/opt/Megatron-LM", "--dry-run"] + (["--runner", "megatron", "--no-save"] if command == "verify" else [])
    plain = runner.invoke(app, base)
    assert plain.exit_code == 0, plain.stderr
    assert "--moe-permute-fusion" in plain.stdout and "--tp-comm-overlap" not in plain.stdout
    res = runner.invoke(app, base + ["--moe-token-dispatcher-type", "flex", "--no-moe-permute-fusion",
                                     "--tp-comm-overlap", "--cuda-graph-impl", "transformer_engine",
                                     "--cuda-graph-modules", "attn"])
    assert res.exit_code == 0, res.stderr
    line = res.stdout
    for flag in ("--moe-token-dispatcher-type flex", "--tp-comm-overlap", "--cuda-graph-impl transformer_engine",
                 "--cuda-graph-modules attn"):
        assert flag in line, flag
    assert "--moe-permute-fusion" not in line


def test_framework_options_are_refused_with_the_jax_runner():
    one_line_error(runner.invoke(app, ["verify", *SMALL, "--plan", "tp=2", "--no-save", "--tp-comm-overlap"]), 2,
                   "--tp-comm-overlap", "--runner megatron")


def test_a_run_on_a_checkout_is_parsed_into_a_measurement_record(checkout, tmp_path):
    res = runner.invoke(app, ["verify", *SMALL, "--plan", "tp=2,pp=2,mbs=1,recompute=selective", "--steps", "3",
                              "--runner", "megatron", "--megatron-path", checkout, "--json", "--out", "meas"])
    assert res.exit_code == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["status"] == "ok" and out["runner"] == "megatron" and out["proxy"] is False
    want = [fake_ms(2, 2, 1, i) / 1e3 for i in (2, 3, 4)]          # 3 timed after the warm-up iteration
    st = out["comparison"]["step_time_s"]
    assert st["n_steps"] == 3 and st["measured"] == pytest.approx(statistics.median(want))
    assert st["error_pct"] == pytest.approx(100 * (st["predicted"] / st["measured"] - 1))
    # report_memory prints MiB: 20e9 * 1.1 / (tp 2 * pp 2) bytes, printed with {:.2f}
    peak_mb = float(f"{20e9 * 1.1 / 4 / 2**20:.2f}")
    assert out["comparison"]["memory_gb"]["measured"] == pytest.approx(peak_mb * 2**20 / 1e9)
    rec = out["record"]
    assert rec["usable"] is True and rec["measured"]["iteration_time_s"] == pytest.approx(st["measured"])
    assert rec["measured"]["tokens_per_s_per_gpu"] == pytest.approx(64 * 4096 / st["measured"] / 8)
    assert rec["plan"]["tp"] == 2 and rec["plan"]["pp"] == 2 and rec["run"]["runner"] == "megatron"
    assert rec["run"]["framework"]["attention_backend"] == "auto"
    assert "--recompute-granularity selective" in rec["run"]["command"]
    with open(out["saved"]) as fh:
        assert json.load(fh)[0]["id"] == rec["id"]
    assert os.path.isfile(out["job"]["log_path"]) and str(tmp_path) in out["job"]["log_path"]
    cases = build_cases([rec], EfficiencyParams())          # what `autotune calibrate RUNS` reads
    assert len(cases) == 1 and cases[0].measured_step_s == pytest.approx(st["measured"], rel=1e-6)
    assert cases[0].plan["tp"] == 2 and cases[0].plan["pp"] == 2


def test_out_of_memory_in_the_run_is_a_measured_oom(checkout, monkeypatch):
    monkeypatch.setenv("FAKE_MEGATRON_OOM_MBS", "1")
    res = runner.invoke(app, ["verify", *SMALL, "--plan", "tp=2,pp=2", "--runner", "megatron", "--megatron-path",
                              checkout, "--json"])
    assert res.exit_code == 3, res.stderr
    out = json.loads(res.stdout)
    assert out["status"] == "oom" and "CUDA out of memory" in out["error"]
    assert out["record"]["usable"] is False and out["record"]["measured"]["extra"]["status"] == "oom"
    assert res.stderr.strip().startswith("error: out of memory")


def test_missing_checkout_or_torchrun_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = ["verify", *SMALL, "--plan", "tp=2,pp=2", "--runner", "megatron", "--no-save"]
    one_line_error(runner.invoke(app, base), 2, "megatron-path", "git clone https://github.com/NVIDIA/Megatron-LM")
    one_line_error(runner.invoke(app, base + ["--megatron-path", str(tmp_path)]), 2, "megatron-path", "pretrain_gpt.py")
    monkeypatch.setenv("PATH", str(tmp_path))               # a checkout, but no torchrun
    one_line_error(runner.invoke(app, base + ["--megatron-path", FAKE]), 2, "torchrun is not on PATH", "PyTorch")
    one_line_error(runner.invoke(app, base + ["--megatron-path", FAKE, "--launcher", "mpirun"]), 2, "launcher")
    one_line_error(runner.invoke(app, ["verify", *SMALL, "--plan", "tp=2", "--dry-run", "--no-save"]), 2,
                   "--dry-run", "--runner megatron")
    one_line_error(runner.invoke(app, base + ["--megatron-path", FAKE, "--proxy"]), 2, "proxy", "whole plan")
    assert os.listdir(tmp_path) == []                        # bad input left nothing behind


SEARCH = ["search", *SMALL, "--no-save", "--no-sensitivity", "--json"]


def test_search_verify_top_dry_run_prints_k_commands():
    res = runner.invoke(app, [*SEARCH, "--verify-top", "3", "--runner", "megatron", "--megatron-path",
                              "/opt/Megatron-LM", "--dry-run"])
    assert res.exit_code == 0, res.stderr
    rep = json.loads(res.stdout)
    cmds = rep["verification"]["commands"]
    assert len(cmds) == 3
    for c, top in zip(cmds, rep["top"]):
        assert c["plan"] == top["plan"]
        assert f"--tensor-model-parallel-size {top['plan']['tp']} " in c["command"]
        assert "/opt/Megatron-LM/pretrain_gpt.py" in c["command"]


def test_search_verify_top_runs_megatron_and_reranks_by_measured_time(checkout):
    res = runner.invoke(app, [*SEARCH[:-1], "--verify-top", "3", "--runner", "megatron", "--megatron-path", checkout])
    assert res.exit_code == 0, res.stderr
    res = runner.invoke(app, [*SEARCH, "--verify-top", "3", "--runner", "megatron", "--megatron-path", checkout])
    assert res.exit_code == 0, res.stderr
    ver = json.loads(res.stdout)["verification"]
    assert ver["reranked"] is True and [e["status"] for e in ver["plans"]] == ["ok"] * 3
    for e in ver["plans"]:
        p = e["plan"]
        want = statistics.median(fake_ms(p["tp"], p["pp"], p["mbs"], i) for i in (2, 3, 4)) / 1e3
        assert e["measured_run_step_time_s"] == pytest.approx(want)
    order = sorted(ver["plans"], key=lambda e: e["corrected_step_time_s"])
    assert [e["measured_rank"] for e in order] == [1, 2, 3]
    assert ver["optuna"]["n_complete"] == 3


def test_search_refuses_an_unknown_runner_before_searching():
    import autotune.verify
    from cli import verify_cmds
    assert verify_cmds.RUNNERS == autotune.verify.RUNNERS
    one_line_error(runner.invoke(app, [*SEARCH, "--verify-top", "2", "--runner", "pytorch"]), 2, "runner", "pytorch")


def test_verify_top_with_the_optuna_strategy():
    res = runner.invoke(app, [*SEARCH, "--strategy", "optuna", "--trials", "40", "--seed", "1", "--verify-top", "2",
                              "--runner", "megatron", "--megatron-path", "/opt/Megatron-LM", "--dry-run"])
    assert res.exit_code == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["strategy_choice"]["chosen"] == "optuna"
    assert [c["plan"] for c in rep["verification"]["commands"]] == [t["plan"] for t in rep["top"][:2]]
