"""`autotune export`, `check`, `launch`, `search --export` and `calibrate --megatron-log` end to end
(issues 13 and 14): exit codes 0 / 1 (a check fails) / 2 (bad input, refused export), one line per
failed condition, commands that carry the plan's flags, and Megatron-LM log lines read back."""
from __future__ import annotations

import json
import subprocess

import pytest

from autotune import api
from autotune.launch import megatron_launch
from autotune.measurements import megatron_log_job, memory_warning, parse_megatron_log, peak_memory_gb
from tests.test_cli import REPO, SMALL, assert_one_line_error, run

PLAN = "tp=2,pp=2,mbs=1,recompute=selective,sp=true,zero=1"


def test_export_plan_to_megatron_prints_the_flags():
    r = run("export", "--to", "megatron", "--plan", PLAN, *SMALL)
    assert r.exit_code == 0, r.stderr
    for flag in ("--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2", "--sequence-parallel",
                 "--recompute-granularity selective", "--use-distributed-optimizer", "--global-batch-size 64"):
        assert flag in r.stdout


def test_export_refusal_and_bad_format_are_one_line_errors():
    r = run("export", "--to", "deepspeed", "--plan", PLAN, *SMALL)
    assert_one_line_error(r, 2, "export --to deepspeed", "pp=2")
    assert_one_line_error(run("export", "--to", "jax", "--plan", PLAN, *SMALL), 2, "to", "jax")
    assert_one_line_error(run("export", "--to", "megatron", *SMALL), 2, "--report", "--plan")


def test_search_export_and_report_export_top(tmp_path):
    r = run("search", *SMALL, "--top", "3", "--json", "--out", str(tmp_path), "--no-sensitivity",
            "--export", "megatron")
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["export"]["to"] == "megatron" and "--tensor-model-parallel-size" in report["export"]["text"]
    assert report["plan_text"].startswith("tp=") and "8 x h100 (1 nodes of 8" in report["problem_text"]
    assert "8.0 B parameters" in report["problem_text"] and "global batch 64 x 4096 tokens, bf16" in report["problem_text"]
    saved = sorted(tmp_path.glob("*.json"))[0]
    out = tmp_path / "exports"
    r = run("export", "--to", "bridge", "--report", str(saved), "--top", "2", "--out", str(out))
    assert r.exit_code == 0, r.stderr
    files = sorted(out.iterdir())
    assert len(files) == 2 and all(f.suffix == ".overrides" for f in files)
    assert "model.tensor_model_parallel_size=" in files[0].read_text()
    # the report carries its problem: a problem flag beside it is an error, never silently ignored
    assert_one_line_error(run("export", "--to", "megatron", "--report", str(saved), "--gpus", "16"), 2,
                          "report", "--gpus")
    assert_one_line_error(run("check", str(saved), "--gpus", "16"), 2, "model", "--gpus")


def test_predict_prints_problem_and_plan_string():
    r = run("predict", *SMALL, "--plan", PLAN)
    assert r.exit_code in (0, 3), r.stderr
    assert "Problem: llama3-8b (8.0 B parameters) on 8 x h100" in r.stdout
    assert 'Plan: --plan "tp=2,pp=2,dp=2,' in r.stdout


# ------------------------------------------------------------------------------------------------
# check
# ------------------------------------------------------------------------------------------------

def test_check_passes_fails_with_numbers_and_compares_to_a_baseline(tmp_path):
    ok = run("check", PLAN, *SMALL, "--json")
    assert ok.exit_code == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["ok"] and [c["name"] for c in doc["conditions"]] == ["memory"]
    # an MFU floor above the prediction and a memory fraction below it: exit 1, one line each
    r = run("check", PLAN, *SMALL, "--min-mfu", "0.99", "--max-memory-frac", "0.05")
    assert r.exit_code == 1
    failed = [ln for ln in r.stderr.splitlines() if ln.startswith("check failed: ")]
    assert len(failed) == 2 and "below --min-mfu 99.0%" in failed[1] and "GB per GPU is" in failed[0]
    # a baseline 10 % faster than today's prediction is a 9.1 % regression: beyond 3 %, within 10 %
    base = dict(doc)
    base["prediction"] = {**doc["prediction"], "tokens_per_s": doc["prediction"]["tokens_per_s"] * 1.1}
    path = tmp_path / "base.json"
    path.write_text(json.dumps(base))
    r = run("check", PLAN, *SMALL, "--baseline", str(path))
    assert r.exit_code == 1 and "(-9.1%; beyond --max-regression 3.0%)" in r.stderr
    assert run("check", PLAN, *SMALL, "--baseline", str(path), "--max-regression", "10%").exit_code == 0
    # the check of its own output as baseline holds
    path.write_text(ok.stdout)
    assert run("check", PLAN, *SMALL, "--baseline", str(path), "--max-regression", "0").exit_code == 0


def test_check_a_saved_report_on_its_own_problem_and_on_another():
    report = "results/reference/dense_llama3-70b_h100x512.json"
    best = json.loads((REPO / report).read_text())["best"]["plan"]
    mesh = f"tp={best['tp']},pp={best['pp']},dp={{}},cp={best['cp']},"
    r = run("check", report, "--json")
    own = json.loads(r.stdout)
    assert own["plan"].startswith(mesh.format(best["dp"])) and own["conditions"][0]["name"] == "memory"
    assert r.exit_code == (0 if own["ok"] else 1)       # today's cost model decides, not the saved numbers
    other = run("check", report, "--model", "llama3-70b", "--gpu", "h100", "--gpus", "1024", "--global-batch", "1024",
                "--seq-len", "8192", "--json")
    assert other.exit_code in (0, 1), other.stderr
    assert json.loads(other.stdout)["plan"].startswith(mesh.format(2 * best["dp"]))     # dp from --gpus


@pytest.mark.parametrize("key,entry,needle", [
    ("best", "garbage", "'best'"),                                   # were ignored: top[0] was checked
    ("best", [1], "'best'"),
    ("best", 0, "'best'"),
    ("best", {"step_time_s": 1.0}, "'best'"),
    ("best", {"plan": {"tp": "x"}}, "plan.tp"),
    ("best", {"plan": {"recompute": "bogus"}}, "plan.recompute"),
    ("top", [{"plan": {"recompute": 9}}], "Recompute"),              # was an internal error
    ("top", ["garbage"], "plan entry"),
])
@pytest.mark.parametrize("command", [["check"], ["export", "--to", "bridge", "--report"]])
def test_a_report_with_a_malformed_plan_entry_is_refused(tmp_path, command, key, entry, needle):
    doc = json.loads((REPO / "results/reference/dense_llama3-70b_h100x512.json").read_text())
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**doc, key: entry}))
    assert_one_line_error(run(*command, path), 2, "report", needle)


def test_check_takes_the_framework_flags():
    # the CI gate predicts the framework the job runs: without gradient-accumulation fusion the step is slower
    fused = json.loads(run("check", PLAN, *SMALL, "--json").stdout)
    unfused = run("check", PLAN, *SMALL, "--no-gradient-accumulation-fusion", "--json")
    assert unfused.exit_code in (0, 1), unfused.stderr
    assert json.loads(unfused.stdout)["prediction"]["tokens_per_s"] < fused["prediction"]["tokens_per_s"]
    # a saved report carries its own framework: flags that would change it need --model (another problem)
    assert_one_line_error(run("check", "results/reference/dense_llama3-70b_h100x512.json", "--tp-comm-overlap"), 2,
                          "model", "--tp-comm-overlap")


def test_check_bad_input_exits_2():
    assert_one_line_error(run("check", PLAN, *SMALL, "--max-regression", "abc"), 2, "max-regression")
    # without --baseline the regression gate never ran, and the check passed (exit 0)
    assert_one_line_error(run("check", PLAN, *SMALL, "--max-regression", "3%"), 2, "max-regression", "--baseline")
    assert_one_line_error(run("check", PLAN, *SMALL, "--max-memory-frac", "1.5"), 2, "max-memory-frac")
    assert_one_line_error(run("check", PLAN), 2, "model")
    assert_one_line_error(run("check", "missing.json"), 2, "report", "missing.json")
    assert_one_line_error(run("check", PLAN, *SMALL, "--baseline", "missing.json"), 2, "baseline")


def test_check_api_matches_the_cli():
    from autotune.check import check_plan
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096)
    res = check_plan(problem, api.plan_from_text(PLAN, problem), min_mfu=0.99)
    assert not res.ok and [c.name for c in res.failed] == ["mfu"]
    assert res.as_dict()["failed"][0].startswith("mfu: ")


# ------------------------------------------------------------------------------------------------
# launch
# ------------------------------------------------------------------------------------------------

def test_launch_dry_run_prints_torchrun_and_sbatch(tmp_path):
    r = run("launch", "--plan", PLAN, *SMALL, "--megatron-path", "/opt/Megatron-LM", "--dry-run", "--json")
    assert r.exit_code == 0, r.stderr
    job = json.loads(r.stdout)["job"]
    argv = job["torchrun"]
    assert argv[:2] == ["torchrun", "--standalone"] and "/opt/Megatron-LM/pretrain_gpt.py" in argv
    for flag in ("--mock-data", "--train-iters", "--log-interval", "--log-memory-interval",
                 "--tensor-model-parallel-size", "--sequence-parallel"):
        assert flag in argv
    assert job["torchrun_text"].startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun")
    r = run("launch", "--plan", "tp=8,pp=2", "--model", "llama3-70b", "--gpu", "h100", "--gpus", "64",
            "--global-batch", "128", "--seq-len", "4096", "--megatron-path", "/opt/Megatron-LM", "--dry-run",
            "--launcher", "slurm")
    assert r.exit_code == 0, r.stderr
    assert "#SBATCH --nodes=8" in r.stdout and "#SBATCH --gpus-per-node=8" in r.stdout
    assert "--nnodes 8 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint ${MASTER_ADDR}:29500" in r.stdout


def test_launch_without_a_checkout_is_bad_input(tmp_path):
    assert_one_line_error(run("launch", "--plan", PLAN, *SMALL, "--megatron-path", str(tmp_path)), 2,
                          "megatron-path", "pretrain_gpt.py")
    assert_one_line_error(run("launch", "--plan", PLAN, *SMALL, "--megatron-path", str(tmp_path), "--dry-run",
                              "--launcher", "mpirun"), 2, "launcher")


@pytest.mark.parametrize("command", [["launch"], ["verify", "--runner", "megatron"]])
@pytest.mark.parametrize("option,field", [(["--lora-dim", "16"], "lora_dim=16"),
                                          (["--packed-example-tokens", "256"], "packed_example_tokens=256"),
                                          (["--framework", "jax"], "framework=jax")])
def test_megatron_lm_commands_refuse_plans_only_bridge_or_a_jax_trainer_runs(command, option, field):
    """Megatron-LM's pretrain_gpt.py has no LoRA or packed-sequence path: a dry run must not print a full-training,
    unpacked command for a plan scored otherwise (export --to megatron refuses the same plans)."""
    r = run(*command, "--plan", "tp=1,pp=1,mbs=1,zero=1", *SMALL, *option, "--megatron-path", "/opt/Megatron-LM",
            "--dry-run")
    assert_one_line_error(r, 2, "export --to megatron", field)

# Real Megatron-LM output: Mixtral 8x7B on 16 H100, https://github.com/NVIDIA/Megatron-LM/issues/756
# (a memory line and three iteration lines, as posted)
REAL_LINES = """\
[Rank 1] (after 1 iterations) memory (MB) | allocated: 54250.97802734375 | max allocated: 54250.98583984375 | reserved: 61480.0 | max reserved: 61480.0
 [2024-04-06 02:55:45] iteration        2/     100 | consumed samples:          256 | elapsed time per iteration (ms): 5630.1 | throughput per GPU (TFLOP/s/GPU): 231.9 | learning rate: 4.000000E-07 | global batch size:   128 | lm loss: 2.021530E+00 | load_balancing_loss: 1.087362E+00 | loss scale: 1.0 | grad norm: 6.895 | num zeros: 0.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2024-04-06 02:55:50] iteration        3/     100 | consumed samples:          384 | elapsed time per iteration (ms): 5410.6 | throughput per GPU (TFLOP/s/GPU): 241.4 | learning rate: 6.000000E-07 | global batch size:   128 | lm loss: 2.003316E+00 | load_balancing_loss: 1.085377E+00 | loss scale: 1.0 | grad norm: 6.603 | num zeros: 0.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2024-04-06 02:55:55] iteration        4/     100 | consumed samples:          512 | elapsed time per iteration (ms): 5364.1 | throughput per GPU (TFLOP/s/GPU): 243.5 | learning rate: 8.000000E-07 | global batch size:   128 | lm loss: 2.009657E+00 | load_balancing_loss: 1.091695E+00 | loss scale: 1.0 | grad norm: 6.619 | num zeros: 0.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
"""
# lines of the same issue's argument dump
REAL_DUMP = """\
------------------------ arguments ------------------------
  expert_model_parallel_size ...................... 8
  ffn_hidden_size ................................. 14336
  global_batch_size ............................... 128
  recompute_granularity ........................... None
  recompute_method ................................ None
-------------------- end of arguments ---------------------
"""


def test_real_megatron_lines_parse():
    parsed = parse_megatron_log(REAL_LINES)
    assert [i["iteration"] for i in parsed["iterations"]] == [2, 3, 4]
    assert parsed["iterations"][1]["elapsed_ms"] == 5410.6 and parsed["iterations"][2]["global_batch"] == 128
    assert parsed["memory"][0]["rank"] == 1 and parsed["memory"][0]["max_reserved_mb"] == 61480.0
    gb, what = peak_memory_gb(parsed)
    assert what == "max reserved" and gb == pytest.approx(61480 * 2**20 / 1e9)     # 64.47 GB
    assert memory_warning(parsed, 64.0) is None
    assert "differ by -22%" in memory_warning(parsed, 50.0)
    job = megatron_log_job(REAL_DUMP + REAL_LINES)
    assert job["global_batch"] == 128 and job["args"]["expert_model_parallel_size"] == "8"
    line = ("using world size: 16, data-parallel size: 8, context-parallel size: 1, hierarchical context-parallel "
            "sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 1")
    job = megatron_log_job(line + "\n" + REAL_LINES)
    assert (job["world_size"], job["dp"], job["tp"], job["pp"], job["cp"]) == (16, 8, 2, 1, 1)


def test_megatron_launch_runs_and_records_a_measurement(tmp_path, monkeypatch):
    """With a checkout and torchrun (stubbed here: no GPU), the log is parsed into a record."""
    (tmp_path / "pretrain_gpt.py").write_text("# stand-in\n")
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    calls = []

    def fake_run(argv, stdout=None, **kw):
        calls.append(argv)
        stdout.write(REAL_LINES)
        return subprocess.CompletedProcess(argv, 0)

    problem = api.build_problem(model="mixtral-8x7b", gpu="h100", gpus=8, global_batch=128, seq_len=4096)
    plan = api.plan_from_text("tp=2,ep=4,sp=true,zero=1,recompute=full", problem)
    res = megatron_launch(plan, problem, str(tmp_path), log_path=str(tmp_path / "run.log"), runner=fake_run)
    assert calls and calls[0][0] == "torchrun" and res["ran"]
    rec = res["measurement"]
    assert rec["measured"]["iteration_time_s"] == pytest.approx((5.4106 + 5.3641) / 2)    # median of the lines after the first
    assert rec["measured"]["tokens_per_s_per_gpu"] == pytest.approx(128 * 4096 / 5.38735 / 8)
    assert rec["plan"]["tp"] == 2 and rec["plan"]["ep"] == 4 and rec["hardware"]["num_gpus"] == 8
    # the record is a row of the validation schema: `validate` scores it against the prediction
    path = tmp_path / "m.json"
    path.write_text(json.dumps([rec]))
    summary = api.validate(str(path))
    assert summary["n_scored"] == 1 and summary["runs"][0]["measured_tokens_per_s_per_gpu"] == pytest.approx(
        rec["measured"]["tokens_per_s_per_gpu"])


def test_megatron_launch_through_slurm_waits_for_sbatch_and_reads_its_log(tmp_path, monkeypatch):
    (tmp_path / "pretrain_gpt.py").write_text("# stand-in\n")
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    log = tmp_path / "run.log"

    def fake_sbatch(argv, **kw):
        assert argv[:2] == ["sbatch", "--wait"]
        script = open(argv[2]).read()
        assert f"#SBATCH --output={log}" in script and "srun --kill-on-bad-exit=1 torchrun" in script
        log.write_text(REAL_LINES)             # what SLURM's --output collects from the job
        return subprocess.CompletedProcess(argv, 0)

    problem = api.build_problem(model="llama3-70b", gpu="h100", gpus=16, global_batch=128, seq_len=4096)
    plan = api.plan_from_text("tp=8,pp=2,sp=true,zero=0", problem)
    res = megatron_launch(plan, problem, str(tmp_path), launcher="slurm", log_path=str(log), runner=fake_sbatch)
    assert res["job"]["nodes"] == 2 and res["measurement"]["hardware"]["gpus_per_node"] == 8
    failed = lambda argv, **kw: subprocess.CompletedProcess(argv, 1)      # noqa: E731
    with pytest.raises(ValueError, match="megatron: the run exited with code 1"):
        megatron_launch(plan, problem, str(tmp_path), launcher="slurm", log_path=str(log), runner=failed)


def test_calibrate_megatron_log_checks_flags_against_the_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("using world size: 64, data-parallel size: 4, context-parallel size: 1, tensor-model-parallel "
                   "size: 8, pipeline-model-parallel size: 2\n" + REAL_LINES)
    base = ["calibrate", "--megatron-log", str(log), "--model", "llama3-70b", "--gpu", "h100", "-o",
            str(tmp_path / "c.json"), "--steps", "2"]
    assert_one_line_error(run(*base, "--gpus", "32", "--plan", "tp=8,pp=2"), 2, "gpus", "world size 64")
    assert_one_line_error(run(*base, "--plan", "tp=4,pp=2"), 2, "plan.tp", "tp=8")
    assert_one_line_error(run(*base), 2, "plan", "no argument dump")
