"""The `autotune` CLI end to end: search, predict, validate, every bad-input case, the frozen surface.

Bad input must give exit code 2 and exactly one `error: <field>: <reason>` line on stderr, never a
traceback; "legal plans exist but none fits" gives exit code 3 (issue 2, "Bad input").
The problems are small (8 GPUs) and shared, so the whole file compiles the cost model once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from autotune import __version__
from autotune.datasets import dataset_path
from cli.main import app
from costmodels.specs import SpecError

REPO = Path(__file__).resolve().parents[1]
PUBLIC_RUNS = Path(dataset_path("public"))        # the bundled copy of shared/validation/public_runs.json

SMALL = ["--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "64", "--seq-len", "4096"]
PLAN_KNOBS = {"tp", "pp", "dp", "cp", "ep", "etp", "vpp", "mbs", "recompute", "recompute_modules", "sp", "zero",
              "account_for_embedding", "account_for_loss", "first_layers", "last_layers", "recompute_layers",
              "layout"}
PLAN_REPORT_KEYS = {"plan", "step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu",
                    "mfu", "hfu", "fits", "memory_gb", "time_breakdown_s"}
MEMORY_KEYS = {"total", "weights", "gradients", "optimizer", "activations", "other", "limit"}

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, code: int, *needles: str) -> str:
    """Exit `code`, exactly one non-empty `error:` line on stderr naming every needle, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: ") and len(line) > len("error: ")
    for needle in needles:
        assert needle in line, (needle, line)
    return line


# ---------------------------------------------------------------------------------------------
# The CLI surface: an accidental change of a command or option name fails here
# ---------------------------------------------------------------------------------------------

PROBLEM_OPTIONS = {"--model", "--gpu", "--gpus", "--global-batch", "--seq-len", "--precision", "--gpus-per-node",
                   "--intra-node-bw", "--inter-node-bw", "--cluster", "--memory-limit-gb", "--memory-limit", "--json",
                   "--calibration"}
FRAMEWORK_OPTIONS = {"--framework", "--attention-backend", "--tp-comm-overlap", "--no-tp-comm-overlap",
                     "--grad-reduce-in-bf16", "--grad-reduce-in-fp32", "--fp8-param-gather", "--no-fp8-param-gather",
                     "--moe-token-dispatcher-type", "--overlap-moe-expert-parallel-comm", "--no-overlap-moe-expert-parallel-comm", "--cuda-graph-impl", "--cuda-graph-modules", "--cuda-graph-scope",
                     "--overlap-grad-reduce", "--no-overlap-grad-reduce", "--overlap-param-gather",
                     "--no-overlap-param-gather", "--gradient-accumulation-fusion", "--no-gradient-accumulation-fusion",
                     "--moe-permute-fusion", "--no-moe-permute-fusion", "--cross-entropy-loss-fusion",
                     "--no-cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "--fp8-recipe",
                     "--fp8-dot-product-attention", "--no-fp8-dot-product-attention", "--lora-dim",
                     "--lora-target-modules", "--packed-example-tokens", "--mtp-num-layers", "--cpu-offloading-num-layers"}
SURFACE = {
    "": {"--version"},
    "search": PROBLEM_OPTIONS | FRAMEWORK_OPTIONS | {"--strategy", "--top", "--out", "--no-save", "--trials", "--timeout", "--sampler",
                                 "--seed", "--objective", "--storage", "--study", "--batch-size",
                                 "--sensitivity", "--no-sensitivity", "--export", "--verify-top", "--memory-headroom",
                                 "--runner", "--megatron-path", "--launcher", "--dry-run"},
    "predict": PROBLEM_OPTIONS | FRAMEWORK_OPTIONS | {"--plan"},
    "validate": {"file", "--dataset", "--json", "--all", "--calibration"},
    "explain": PROBLEM_OPTIONS | FRAMEWORK_OPTIONS | {"--plan"},
    "calibrate": {"measurements", "--gpu", "--out", "-o", "--holdout-frac", "--seed", "--rounds", "--steps",
                  "--megatron-log", "--model", "--gpus", "--global-batch", "--seq-len", "--precision",
                  "--gpus-per-node", "--plan", "--json"},
    "whatif": {"--model", "--gpu", "--gpus", "--global-batch", "--seq-len", "--precision", "--inter-node-bw",
               "--intra-node-bw", "--gpus-per-node", "--cluster", "--memory-limit-gb", "--memory-limit", "--calibration",
               "--json"} | FRAMEWORK_OPTIONS,
    "worker": {"--storage", "--study", "--trials", "--timeout", "--batch-size", "--seed", "--stale-after", "--json",
               "--runner", "--megatron-path", "--launcher", "--out"},
    "studies": {"--storage", "--study", "--export", "--top", "--json"},
    "capacity": {"--model", "--tokens", "--gpu", "--deadline", "--price-per-gpu-hour", "--power-w", "--mtbf-hours",
                 "--checkpoint-s", "--restart-s", "--objective", "--min-gpus", "--max-gpus", "--global-batch",
                 "--seq-len", "--precision", "--memory-headroom", "--calibration", "--plot", "--json"},
    "export": (PROBLEM_OPTIONS - {"--memory-limit-gb", "--memory-limit", "--calibration"}) | FRAMEWORK_OPTIONS
    | {"--to", "--report", "--plan", "--top", "--out"},
    "check": {"plan_or_report", "--model", "--gpu", "--gpus", "--global-batch", "--seq-len", "--precision",
              "--gpus-per-node", "--cluster", "--max-memory-frac", "--min-mfu", "--baseline", "--max-regression",
              "--memory-limit-gb", "--memory-limit", "--calibration", "--json"} | FRAMEWORK_OPTIONS,
    "launch": {"--plan", "--model", "--megatron-path", "--gpu", "--gpus", "--global-batch", "--seq-len", "--precision",
               "--gpus-per-node", "--cluster", "--launcher", "--train-iters", "--dry-run", "--log", "--out", "--json"}
    | FRAMEWORK_OPTIONS,
    "models": {"--json"},
    "gpus": {"--json"},
    "clusters": {"--json"},
    "verify": {"--model", "--plan", "--gpu", "--gpus", "--global-batch", "--seq-len", "--precision", "--steps",
               "--warmup", "--runner", "--proxy", "--layers", "--out", "--no-save", "--json", "--calibration",
               "--megatron-path", "--launcher", "--dry-run"} | FRAMEWORK_OPTIONS,
}


def _names(command) -> set:
    return {name for p in command.params for name in (*p.opts, *p.secondary_opts)}


def test_cli_surface_snapshot():
    group = get_command(app)
    surface = {"": _names(group)} | {name: _names(cmd) for name, cmd in group.commands.items()}
    assert surface == SURFACE



def test_building_the_cli_imports_neither_jax_nor_optuna():
    """`autotune --help` and bad-input errors start fast: cli.main and every command module import
    JAX, Optuna and autotune.api inside the commands that score (tests/benchmarks/bench_startup.py)."""
    probe = subprocess.run([sys.executable, "-c", "import cli.main, sys; print(sorted(m for m in ('jax', 'optuna', "
                            "'autotune.api', 'autotune.optuna_search') if m in sys.modules))"],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr


@pytest.mark.parametrize("args", [
    ["search", "--model", "nope", "--gpu", "h100", "--gpus", "8"],
    ["search", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "0x8"],
    ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--plan", "tp=3"],
])
def test_bad_input_is_refused_before_jax_is_imported(args):
    probe = ("import sys\nfrom cli.main import app\ntry:\n    app(sys.argv[1:])\nfinally:\n"
             "    sys.stderr.write('IMPORTED ' + ' '.join(m for m in ('jax', 'optuna') if m in sys.modules) + '\\n')\n")
    proc = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "AUTOTUNE_JAX_CACHE": ""})
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 2 and lines[0].startswith("error: "), proc.stderr
    assert lines[1].strip() == "IMPORTED", proc.stderr


def test_an_exhaustive_search_never_imports_optuna():
    """The default search of a small space is exhaustive: it needs JAX, not Optuna (0.1-0.3 s to import)."""
    probe = ("import sys\nfrom cli.main import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "finally:\n    sys.stderr.write('IMPORTED ' + ' '.join(m for m in ('jax', 'optuna') if m in sys.modules) + '\\n')\n")
    proc = subprocess.run([sys.executable, "-c", probe, "search", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8",
                           "--json", "--no-save"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert '"strategy_choice"' in proc.stdout or '"best"' in proc.stdout, proc.stdout[-500:] + proc.stderr[-500:]
    assert proc.stderr.strip().splitlines()[-1] == "IMPORTED jax", proc.stderr


def test_version():
    result = run("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"autotune {__version__}"


def test_no_command_shows_help():
    result = run()
    assert result.exit_code == 0
    assert "search" in result.stdout and "predict" in result.stdout and "validate" in result.stdout


# ---------------------------------------------------------------------------------------------
# search
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def search_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    result = run("search", *SMALL, "--top", "3", "--json", "--out", out)
    assert result.exit_code == 0, (result.stderr, result.exception)
    return json.loads(result.stdout), out


def test_search_json_schema(search_json):
    report, _ = search_json
    assert {"best", "top", "space", "elapsed_s", "explanation"} <= set(report)
    assert set(report["best"]["plan"]) == PLAN_KNOBS
    assert PLAN_REPORT_KEYS <= set(report["best"])
    assert MEMORY_KEYS <= set(report["best"]["memory_gb"])
    assert {"total", "legal", "illegal", "fitting", "scored"} <= set(report["space"])
    assert isinstance(report["space"]["illegal"], dict)
    assert len(report["top"]) == 3
    assert report["top"][0] == report["best"]
    assert report["best"]["fits"] and report["best"]["plan"]["dp"] * report["best"]["plan"]["tp"] \
        * report["best"]["plan"]["pp"] * report["best"]["plan"]["cp"] == 8
    steps = [r["step_time_s"] for r in report["top"]]
    assert steps == sorted(steps)


def test_search_json_saves_the_same_report(search_json):
    report, out = search_json
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 3 and [f.rsplit(".", 1)[1] for f in files] == ["html", "json", "md"]
    files = files[1:] + files[:1]
    assert json.loads((out / files[0]).read_text()) == report
    # the HTML page is self-contained (plotly.js inline, no external script) and holds the plots
    page = (out / files[2]).read_text()
    assert "<script src=" not in page and page.count("Plotly.newPlot") >= 3
    assert "Peak memory per GPU by plan" in page and "Step time by plan and term" in page
    # the 5 % default headroom is applied and reported, ties are marked
    assert report["headroom"]["headroom_frac"] == 0.05
    assert report["best"]["memory_gb"]["limit"] == pytest.approx(0.95 * report["headroom"]["device_limit_gb"], rel=1e-4)
    assert report["ties"]["tied_with_best"][0] == 0
    assert "llama3-8b" in files[0]


def test_search_human(tmp_path):
    result = run("search", *SMALL, "--top", "3", "--out", tmp_path / "out")
    assert result.exit_code == 0, (result.stderr, result.exception)
    text = result.stdout
    for header in ("TP", "PP", "DP", "CP", "EP", "VPP", "MBS", "recompute", "SP", "ZeRO", "step (s)",
                   "tokens/s/GPU", "TFLOP/s/GPU", "MFU", "mem GB", "fits"):
        assert header in text
    assert "The fastest plan" in text                    # the explanation paragraph
    assert "legal" in text and "fit in memory" in text   # the space summary
    assert "Report saved to" in text
    assert len(list((tmp_path / "out").iterdir())) == 3
    assert "Memory headroom 5%" in text
    assert result.stderr == ""


def test_search_no_save(tmp_path):
    out = tmp_path / "never"
    result = run("search", *SMALL, "--top", "1", "--json", "--no-save", "--out", out)
    assert result.exit_code == 0
    assert len(json.loads(result.stdout)["top"]) == 1
    assert not out.exists()


def test_search_unwritable_out(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = run("search", *SMALL, "--json", "--out", blocker)
    assert_one_line_error(result, 2, "out", "cannot write")
    assert result.stdout == ""

def test_search_report_not_saved_still_prints_then_one_error_line(tmp_path, monkeypatch):
    """The exhaustive path's contract (the Optuna path's twin is in tests/test_optuna.py): the folder
    went away after the up-front check, the result is printed anyway, then one error line, exit 2."""
    import autotune.report as report_mod

    def refuse(report, out_dir):
        raise SpecError("out", f"cannot write into {out_dir}: No such file or directory")

    monkeypatch.setattr(report_mod, "save_report", refuse)
    result = run("search", *SMALL, "--strategy", "exhaustive", "--no-sensitivity", "--json", "--out", tmp_path)
    assert_one_line_error(result, 2, "out", "cannot write")
    assert json.loads(result.stdout)["best"]["fits"]


def test_search_nothing_fits_json(tmp_path):
    result = run("search", *SMALL, "--memory-limit-gb", "1", "--json", "--out", tmp_path)
    line = assert_one_line_error(result, 3, "memory", "closest", "GB over")
    data = json.loads(result.stdout)
    assert set(data) == {"error", "closest", "space", "advice"}
    assert data["error"] in line and data["advice"]["sentence"] in line
    assert set(data["closest"]["plan"]) == PLAN_KNOBS and data["closest"]["fits"] is False
    assert data["space"]["fitting"] == 0 and data["space"]["legal"] > 0
    assert list(tmp_path.iterdir()) == []


def test_search_nothing_fits_human(tmp_path):
    result = run("search", *SMALL, "--memory-limit-gb", "1", "--out", tmp_path)
    assert_one_line_error(result, 3, "memory", "closest", "1.0 GB")
    assert result.stdout == ""


# ---------------------------------------------------------------------------------------------
# predict
# ---------------------------------------------------------------------------------------------

def test_predict_json_schema():
    result = run("predict", *SMALL, "--plan", "tp=2,pp=2,vpp=2,mbs=1,recompute=selective,sp=true,zero=1",
                 "--json")
    assert result.exit_code == 0, (result.stderr, result.exception)
    rep = json.loads(result.stdout)
    assert PLAN_REPORT_KEYS | {"problem"} <= set(rep)
    assert rep["plan"] == {"tp": 2, "pp": 2, "dp": 2, "cp": 1, "ep": 1, "etp": 1, "vpp": 2, "mbs": 1,
                           "recompute": "selective", "recompute_modules": ["core_attn"], "sp": True, "zero": 1,
                           "account_for_embedding": False, "account_for_loss": False,
                           "first_layers": 0, "last_layers": 0, "recompute_layers": 0, "layout": ""}
    assert MEMORY_KEYS <= set(rep["memory_gb"])
    assert {"compute", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer"} <= set(rep["time_breakdown_s"])
    assert {"model", "gpu", "cluster", "job"} <= set(rep["problem"])
    assert rep["fits"] is True and result.stderr == ""


def test_predict_human():
    result = run("predict", *SMALL, "--plan", "tp=2,pp=1,mbs=1,recompute=none,sp=true,zero=1")
    assert result.exit_code == 0, (result.stderr, result.exception)
    for word in ("Time per step", "Peak memory per GPU", "compute", "activations", "tokens/s per GPU", "fits"):
        assert word in result.stdout


def test_predict_uneven_stages_and_block_recompute():
    """The Optuna-only knobs through --plan: echoed in the plan text, scored, and the JSON holds them."""
    plan = "tp=2,pp=4,mbs=1,recompute=full,recompute_layers=3,sp=true,zero=0,first_layers=6,last_layers=6"
    human = run("predict", *SMALL, "--plan", plan)
    assert human.exit_code == 0, (human.stderr, human.exception)
    assert "first_layers=6,last_layers=6,recompute_layers=3" in human.stdout.replace("\n", "")
    data = json.loads(run("predict", *SMALL, "--plan", plan, "--json").stdout)
    assert (data["plan"]["first_layers"], data["plan"]["last_layers"], data["plan"]["recompute_layers"]) == (6, 6, 3)
    even = json.loads(run("predict", *SMALL, "--plan", "tp=2,pp=4,mbs=1,recompute=full,sp=true,zero=0",
                          "--json").stdout)
    assert data["step_time_s"] < even["step_time_s"]               # 3 of 8 layers replayed, not 8
    assert data["memory_gb"]["activations"] > even["memory_gb"]["activations"]


LLAMA70B_ON_8 = ["--model", "llama3-70b", "--gpu", "h100", "--gpus", "8", "--global-batch", "64",
                 "--seq-len", "4096", "--plan", "tp=1,pp=1", "--memory-limit-gb", "80"]


def test_predict_does_not_fit_exit_3():
    result = run("predict", *LLAMA70B_ON_8)
    assert_one_line_error(result, 3, "memory", "over the 80.0 GB limit", "optimizer")
    assert "Peak memory per GPU" in result.stdout


def test_predict_does_not_fit_json_exit_3():
    result = run("predict", *LLAMA70B_ON_8, "--json")
    assert_one_line_error(result, 3, "memory")
    rep = json.loads(result.stdout)
    assert rep["fits"] is False and rep["memory_gb"]["limit"] == pytest.approx(80.0)


# ---------------------------------------------------------------------------------------------
# validate
# ---------------------------------------------------------------------------------------------

VALIDATION_IDS = ("nemo-24.07-LLAMA3-8B-8g-pre", "nemo-24.07-LLAMA2-7B-8g-pre", "narayanan21-t1-1.7B")


@pytest.fixture(scope="module")
def runs_file(tmp_path_factory):
    rows = {r["id"]: r for r in json.loads(PUBLIC_RUNS.read_text())}
    picked = [rows[i] for i in VALIDATION_IDS]
    broken = json.loads(json.dumps(picked[0]))
    broken["id"] = "broken-row"
    broken["model"]["layers"] = "many"              # not an integer: the row is skipped, not fatal
    path = tmp_path_factory.mktemp("runs") / "runs.json"
    path.write_text(json.dumps(picked + [broken]))
    return path


@pytest.fixture(scope="module")
def validate_json(runs_file):
    result = run("validate", runs_file, "--json")
    assert result.exit_code == 0, (result.stderr, result.exception)
    return json.loads(result.stdout)


def test_validate_json(validate_json):
    out = validate_json
    assert {"runs", "mape_pct", "max_abs_error_pct", "n_scored", "n_skipped"} <= set(out)
    assert [r["id"] for r in out["runs"]] == [*VALIDATION_IDS, "broken-row"]
    assert out["n_scored"] == 3 and out["n_skipped"] == 1
    for r in out["runs"]:
        assert {"id", "measured_tokens_per_s_per_gpu", "predicted_tokens_per_s_per_gpu", "predicted_step_time_s",
                "predicted_fits", "predicted_memory_gb", "error_pct", "skipped"} <= set(r)
    scored = out["runs"][:3]
    assert all(r["skipped"] is None and r["error_pct"] is not None for r in scored)
    assert out["runs"][3]["skipped"] and out["runs"][3]["error_pct"] is None
    assert out["mape_pct"] == pytest.approx(sum(abs(r["error_pct"]) for r in scored) / 3)


def test_validate_human(runs_file, validate_json):
    result = run("validate", runs_file)
    assert result.exit_code == 0, (result.stderr, result.exception)
    for word in (*VALIDATION_IDS, "broken-row", "measured", "predicted", "error %", "MAPE", "skipped"):
        assert word in result.stdout
    assert f"{validate_json['mape_pct']:.1f}%" in result.stdout


def test_validate_missing_file(tmp_path):
    assert_one_line_error(run("validate", tmp_path / "nope.json"), 2, "FILE", "nope.json")


def test_validate_bundled_dataset():
    result = run("validate", "--dataset", "public", "--json")
    assert result.exit_code == 0, (result.stderr, result.exception)
    out = json.loads(result.stdout)
    assert out["source"] == "public" and out["n_not_in_space"] == 0 and out["n_scored"] > 0


def test_validate_needs_a_file_or_a_dataset(runs_file):
    assert_one_line_error(run("validate"), 2, "FILE", "--dataset")
    assert_one_line_error(run("validate", runs_file, "--dataset", "public"), 2, "FILE", "one of them")
    assert_one_line_error(run("validate", "--dataset", "private"), 2, "dataset", "public, small-scale, korthikanti22")


def test_validate_invalid_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("[{'id': 1,")
    assert_one_line_error(run("validate", path), 2, "FILE", "not valid JSON")


def test_validate_that_scores_nothing_fails(tmp_path):
    """An empty runs file, or one whose every run is skipped, measured nothing: one line, exit 2 (a CI gate
    on `autotune validate` must not pass on it), after the table (or JSON) that says why each was skipped."""
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    assert_one_line_error(run("validate", empty), 2, "FILE", "holds no runs")
    skipped = tmp_path / "skipped.json"
    skipped.write_text(json.dumps([{"id": "no-model"}, {"id": "no-gpu", "model": {"layers": 2, "hidden": 64}}]))
    for extra in ((), ("--json",)):
        result = run("validate", skipped, *extra)
        assert result.exit_code == 2, (result.stderr, result.exception)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "none of the 2 runs" in lines[0] and "Traceback" not in result.stderr
        assert "no-model" in result.stdout


def test_validate_not_a_list_of_objects(tmp_path):
    path = tmp_path / "scalars.json"
    path.write_text("[1, 2]")
    assert_one_line_error(run("validate", path), 2, "FILE", "run 0")


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 2 (or 3), the field named, no traceback
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("configs")
    no_hidden = d / "no-hidden" / "config.json"
    no_hidden.parent.mkdir()
    no_hidden.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8,
                                     "intermediate_size": 1024, "vocab_size": 1000}))
    bert = d / "bert.json"
    bert.write_text(json.dumps({"model_type": "bert", "hidden_size": 768}))
    broken = d / "broken.json"
    broken.write_text("{not json")
    return {"no_hidden": no_hidden, "bert": bert, "broken": broken}


def _problem(model="llama3-8b", gpu="h100", gpus="8", batch="64", seq="4096"):
    return ["--model", model, "--gpu", gpu, "--gpus", gpus, "--global-batch", batch, "--seq-len", seq]


BAD_SEARCH = {
    "unknown model preset": (_problem(model="llama9-1t"), ("model", "unknown preset", "llama3-8b", "gpt3-175b")),
    "unknown gpu preset": (_problem(gpu="tpu-v9"), ("gpu", "tpu-v9", "h100", "a100-80gb")),
    "zero gpus": (_problem(gpus="0"), ("gpus",)),
    "negative gpus": (_problem(gpus="-8"), ("gpus",)),
    "gpus not whole nodes": (_problem(gpus="12"), ("gpus", "NVLink")),
    # global batch 1 forces dp=1, seq_len 2 forces cp=1, so at most tp*pp = 8*32 of the 1024 GPUs are usable
    "no plan can use the gpus": (_problem(gpus="1024", batch="1", seq="2"), ("plan space", "no legal plan", "rejects")),
    "zero global batch": (_problem(batch="0"), ("global_batch",)),
    "zero seq len": (_problem(seq="0"), ("seq_len",)),
    "unknown precision": (_problem() + ["--precision", "int3"], ("precision", "int3")),
    "precision the gpu lacks": (_problem() + ["--precision", "fp4"], ("precision", "fp4")),
    "zero memory limit": (_problem() + ["--memory-limit", "0"], ("--memory-limit",)),
    "unknown strategy": (_problem() + ["--strategy", "annealing"], ("strategy", "exhaustive")),
    "missing cluster file": (_problem() + ["--cluster", "/nonexistent/cluster.yaml"], ("cluster_file",)),
    "missing calibration file": (_problem() + ["--calibration", "/nonexistent/params.json"], ("calibration",)),
    "top zero": (_problem() + ["--top", "0"], ("--top",)),
    "missing --model": (["--gpu", "h100", "--gpus", "8"], ("--model",)),
    "gpus not an int": (_problem(gpus="eight"), ("--gpus",)),
    "unknown option": (_problem() + ["--bogus"], ("--bogus",)),
}


@pytest.mark.parametrize("case", list(BAD_SEARCH))
def test_search_bad_input(case, tmp_path):
    args, needles = BAD_SEARCH[case]
    result = run("search", *args, "--out", tmp_path)
    assert_one_line_error(result, 2, *needles)
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("as_json", [False, True])
def test_bad_input_json_mode_keeps_stdout_empty(as_json):
    result = run("search", *_problem(model="llama9-1t"), "--no-save", *(["--json"] if as_json else []))
    assert_one_line_error(result, 2, "model")
    assert result.stdout == ""


@pytest.mark.parametrize("which,needles", [
    ("no_hidden", ("model", "missing key", "hidden_size")),
    ("bert", ("model", "model_type", "bert", "llama")),
    ("broken", ("model", "not valid JSON")),
])
def test_bad_config_json(configs, which, needles):
    result = run("search", *_problem(model=str(configs[which])), "--no-save")
    assert_one_line_error(result, 2, *needles)


BAD_PLANS = {
    "tp does not divide gpus": ("8", "tp=3", ("plan", "tp*cp*pp = 3", "gpus=8")),
    "tp does not divide heads": ("16", "tp=16", ("plan (tp_heads)", "num_kv_heads=8")),
    "global batch not divisible": ("8", "dp=8,mbs=3", ("plan (batch_divisible)", "global_batch=64")),
    "interleaving needs whole rounds": ("8", "pp=2,vpp=2,mbs=16", ("plan (interleave_microbatches)",)),
    "sp without tp": ("8", "tp=1,sp=true", ("plan (sp_needs_tp)",)),
    "unknown key": ("8", "tp=1,foo=2", ("plan", "foo", "known keys")),
    "not an integer": ("8", "tp=two", ("plan.tp",)),
    "bad recompute": ("8", "recompute=some", ("plan.recompute",)),
    "zero stage 4": ("8", "zero=4", ("plan.zero",)),
    "uneven stages without a pipeline": ("8", "pp=1,first_layers=4", ("plan (stage_layers_need_pp)",)),
    "middle stages uneven": ("8", "pp=4,first_layers=6", ("plan (stage_layers_rest)", "middle stages")),
    "layers not divisible by pp": ("8", "pp=8,vpp=3", ("plan (pp_split)", "split evenly")),
    "selective with a module the model lacks": ("8", "recompute=selective,recompute_modules=moe_act",
                                                ("plan (recompute_modules_model)", "moe_act")),
    "block recompute without full": ("8", "pp=2,recompute_layers=2", ("plan (recompute_layers_full)",)),
    "negative stage layers": ("8", "pp=2,last_layers=-1", ("plan.last_layers", "non-negative")),
    "no equals sign": ("8", "tp8", ("plan", "key=value")),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_predict_illegal_plan(case):
    gpus, plan, needles = BAD_PLANS[case]
    result = run("predict", *_problem(gpus=gpus), "--plan", plan, "--json")
    assert_one_line_error(result, 2, *needles)
    assert result.stdout == ""


def test_predict_missing_plan():
    assert_one_line_error(run("predict", *_problem()), 2, "--plan")


# ---------------------------------------------------------------------------------------------
# The installed console script, in a fresh process
# ---------------------------------------------------------------------------------------------

def test_console_script_json(tmp_path):
    script = Path(sys.executable).with_name("autotune")
    if not script.exists():
        pytest.skip("the autotune console script is not installed next to this Python")
    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run([str(script), "search", *SMALL, "--json", "--no-save"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    assert set(report["best"]["plan"]) == PLAN_KNOBS and len(report["top"]) == 10
    assert list(tmp_path.iterdir()) == []


def test_console_script_bad_input_one_line(tmp_path):
    script = Path(sys.executable).with_name("autotune")
    if not script.exists():
        pytest.skip("the autotune console script is not installed next to this Python")
    proc = subprocess.run([str(script), "search", "--gpu", "h100"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == "" and proc.stderr.strip() == "error: Missing option '--model'."


@pytest.mark.parametrize("text, gb", [("80GiB", 80 * 2**30 / 1e9), ("76GB", 76.0), ("76", 76.0), ("76 gb", 76.0),
                                      ("0.5TiB", 0.5 * 2**40 / 1e9), ("81559MiB", 81559 * 2**20 / 1e9)])
def test_memory_limit_takes_units(text, gb):
    """--memory-limit: GB = 10^9 bytes, GiB = 2^30 (an "80 GB" H100 holds 80 GiB = 85.9 GB)."""
    res = runner.invoke(app, ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--plan",
                              "tp=1,pp=1,mbs=1,recompute=full,zero=1", "--memory-limit", text, "--json"])
    out = json.loads(res.stdout)
    assert out["memory_gb"]["limit"] == pytest.approx(gb, rel=1e-6)


@pytest.mark.parametrize("text", ["80XB", "-5", "abc", "0GB", "1e30GB"])
def test_memory_limit_rejects_bad_sizes(text):
    res = runner.invoke(app, ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--plan",
                              "tp=1,pp=1,mbs=1,recompute=full,zero=1", "--memory-limit", text])
    assert res.exit_code == 2
    assert "--memory-limit" in res.output and "Traceback" not in res.output


# ---------------------------------------------------------------------------------------------
# explain / whatif take the Megatron-Core options of predict and search
# ---------------------------------------------------------------------------------------------

def test_explain_grad_reduce_in_bf16_halves_the_gradient_memory():
    """No ZeRO: every GPU holds its shard's whole gradient buffer, 4 bytes a parameter in fp32
    (Megatron-LM's default), 2 in bf16 (--grad-reduce-in-bf16); only that term changes."""
    plan = ["--plan", "tp=8,pp=1,mbs=1,zero=0"]
    mem = {}
    for flag in ("", "--grad-reduce-in-bf16", "--grad-reduce-in-fp32"):
        result = run("explain", *SMALL, *plan, "--json", *([flag] if flag else []))
        assert result.exit_code == 0, (result.stderr, result.exception)
        data = json.loads(result.stdout)
        assert data["plan"]["zero"] == 0 and set(data["memory_gb"]) == MEMORY_KEYS
        mem[flag] = data["memory_gb"]
    assert mem["--grad-reduce-in-fp32"] == mem[""]                       # fp32 is the default
    assert mem["--grad-reduce-in-bf16"]["gradients"] == pytest.approx(mem[""]["gradients"] / 2, rel=1e-9)
    for term in ("weights", "optimizer", "activations"):
        assert mem["--grad-reduce-in-bf16"][term] == mem[""][term]
    assert mem["--grad-reduce-in-bf16"]["total"] < mem[""]["total"]


@pytest.mark.parametrize("command", ["explain", "whatif"])
def test_explain_and_whatif_check_the_framework_options(command):
    result = run(command, *SMALL, "--framework", "nope")
    assert_one_line_error(result, 2, "framework", "megatron")
    result = run(command, *SMALL, "--attention-backend", "nope")
    assert_one_line_error(result, 2, "attention")


@pytest.mark.parametrize("extra, field", [(["--gpu", "H100"], "gpu"),        # was the same row printed twice
                                          (["--inter-node-bw", "25", "--inter-node-bw", "25.0"], "inter_node_bw")])
def test_whatif_refuses_a_variant_given_twice(extra, field):
    assert_one_line_error(run("whatif", *SMALL, *extra), 2, field, "twice")
