"""Issue 5: sensitivity (elasticities by jax.jacfwd), the Megatron-LM log parser, calibration files.

Gradient check: every reported elasticity is compared with a central finite difference of the same
model in log space. The cost model runs in float32 and this test must not flip jax's global x64
switch (other tests share the process), so the step is h = 1e-2 in log space: the truncation error
of a central difference, ~h^2/6 * f''', stays far below 1e-3 relative for these smooth power-law
terms, while float32 rounding of log(output) (~1e-7 * |log y| ~ 1e-6) divided by 2h stays ~1e-4.
Hence the tolerance |jac - fd| <= 1e-3 * |fd| + 1e-4 (relative 1e-3, with an absolute floor for
elasticities that are ~0). Smaller steps (3e-3) are dominated by float32 noise; larger ones by
curvature.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from typer.testing import CliRunner

from autotune import api
from costmodels.plan import Plan, format_plan
from autotune import sensitivity as S
from autotune.datasets import dataset_path
from autotune.measurements import (calibration_for_gpu, log_summary, parse_megatron_log, read_calibration,
                                   read_megatron_log, write_calibration)
from autotune.scoring import Inputs
from costmodels.params import EfficiencyParams, load_params_file, params_to_dict
from costmodels.specs import SpecError
from cli.main import app

DATA = Path(__file__).resolve().parent / "data"
SAMPLE_LOG = DATA / "megatron_sample.log"
H = 1e-2
REL, ABS = 1e-3, 1e-4

# 16 GPUs on two 8-GPU nodes, so DP (and some p2p) crosses the inter-node fabric
PROBLEM = dict(model="llama3-8b", gpu="h100", gpus=16, global_batch=64, seq_len=4096)
PLANS = [
    "tp=2,pp=2,vpp=2,mbs=1,recompute=selective,sp=true,zero=1",
    "tp=1,pp=1,mbs=2,zero=0",
    "tp=2,cp=2,zero=3,recompute=full",
]

runner = CliRunner()


@pytest.fixture(scope="module")
def problem():
    return api.build_problem(**PROBLEM)


@pytest.mark.parametrize("plan_text", PLANS)
def test_elasticities_match_central_differences(problem, plan_text):
    plan = api.plan_from_text(plan_text, problem)
    inp, par = Inputs(problem), EfficiencyParams()
    jac, _ = S.jacobian(plan, inp, par)
    pa, pf = S.plan_arrays(plan), S._params_f32(par)
    n = len(S.INPUT_NAMES)
    bad = []
    for i, name in enumerate(S.INPUT_NAMES):
        e = np.zeros(n, np.float32)
        e[i] = H
        fp = np.asarray(S.outputs_jit(jnp.asarray(e), pa, inp.model, inp.hw, inp.job, pf), np.float64)[:3]
        fm = np.asarray(S.outputs_jit(jnp.asarray(-e), pa, inp.model, inp.hw, inp.job, pf), np.float64)[:3]
        fd = (fp - fm) / (2 * H)
        for k, out in enumerate(S.OUTPUTS):
            if abs(fd[k] - jac[k, i]) > REL * abs(fd[k]) + ABS:
                bad.append((out, name, jac[k, i], fd[k]))
    assert not bad, bad


def test_report_shape_and_consistency(problem):
    plan = api.plan_from_text(PLANS[0], problem)
    res = S.sensitivity(problem, plan)
    assert set(res["elasticities"]) == {"step_time_s", "tokens_per_s", "peak_memory_gb"}
    for out in res["elasticities"].values():
        assert set(out) == set(S.INPUT_NAMES)
        assert {"peak_flops", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"} <= set(out)
    st, tp = res["elasticities"]["step_time_s"], res["elasticities"]["tokens_per_s"]
    # tokens/s = global_batch * seq / step: the hardware elasticities are the negatives of each other
    for k in ("peak_flops", "inter_node_bandwidth", "gemm_eff_max"):
        assert tp[k] == pytest.approx(-st[k], abs=1e-6)
    assert tp["global_batch"] == pytest.approx(1.0 - st["global_batch"], abs=1e-5)
    assert res["sentences"] and all(isinstance(s, str) for s in res["sentences"])
    assert res["sentences"][0].startswith("1.00 -> 1.10x ")
    assert "% of the step" in res["sentences"][0]
    json.dumps(res)                                  # JSON-serializable


def test_sentence_what_if_uses_elasticity(problem):
    plan = api.plan_from_text(PLANS[1], problem)
    res = S.sensitivity(problem, plan, neighbours=False)
    e = res["elasticities"]["step_time_s"]["peak_flops"]
    line = next(s for s in res["sentences"] if "peak FLOP/s" in s)
    assert f"{(1.1 ** e - 1) * 100:+.1f}% step time" in line


@pytest.mark.parametrize("plan_text", PLANS)
def test_physics_signs(problem, plan_text):
    plan = api.plan_from_text(plan_text, problem)
    st = S.sensitivity(problem, plan, neighbours=False)["elasticities"]["step_time_s"]
    for more_is_faster in ("peak_flops", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth",
                           "gemm_eff_max", "hbm_eff", "intra_bw_eff", "inter_bw_eff"):
        assert st[more_is_faster] <= 1e-6, (more_is_faster, st[more_is_faster])
    for more_is_slower in ("intra_node_latency", "inter_node_latency", "step_overhead_s", "kernel_overhead_s"):
        assert st[more_is_slower] >= -1e-6, (more_is_slower, st[more_is_slower])
    assert st["peak_flops"] < 0                      # more FLOP/s always helps a little


def test_neighbours_are_legal_and_one_knob_apart(problem):
    plan = api.plan_from_text(PLANS[0], problem)
    res = S.sensitivity(problem, plan)
    assert res["neighbours"]
    base = plan.as_dict()
    for r in res["neighbours"]:
        diff = {k for k in base if base[k] != r["plan"][k]} - {"dp"}
        # recompute moves with its modules (selective <-> Megatron's default core_attn)
        assert diff == {r["knob"]} or (r["knob"] == "recompute" and diff == {"recompute", "recompute_modules"})
        api.plan_from_text(format_plan(Plan.from_dict(r["plan"])), problem)   # legal
    best = res["best_neighbour"]
    assert best is None or best["fits"]
    assert best is None or any(s.startswith("best neighbouring plan") for s in res["sentences"])


# ------------------------------------------------------------------------------------------------
# Megatron-LM logs
# ------------------------------------------------------------------------------------------------

def test_parse_sample_log():
    parsed = read_megatron_log(str(SAMPLE_LOG))
    its = parsed["iterations"]
    assert [i["iteration"] for i in its] == [10, 20, 30, 40]
    assert its[0]["elapsed_ms"] == pytest.approx(7912.4)
    assert its[1]["tflops_per_gpu"] == pytest.approx(399.8)
    assert its[0]["global_batch"] == 128
    assert parsed["memory"][0]["max_allocated_mb"] == pytest.approx(61234.71)
    s = log_summary(parsed)
    assert s["step_time_s"] == pytest.approx(7.3518)         # median after the warm-up line
    assert s["n_used"] == 3 and s["global_batch"] == 128
    assert s["max_allocated_gb"] == pytest.approx(61234.71 * 2**20 / 1e9)   # report_memory prints MiB: 64.21 GB


GOOD = (" [2024-05-01 09:59:34] iteration       10/    1000 | consumed samples:         1280 | "
        "elapsed time per iteration (ms): 7912.4 | throughput per GPU (TFLOP/s/GPU): 371.5 | "
        "global batch size:   128 | lm loss: 1.05E+01 |")


@pytest.mark.parametrize("text,line,needle", [
    ("junk\n" + GOOD.replace("7912.4", "abc"), 2, "not a number"),
    ("a\nb\n" + GOOD.replace("elapsed time per iteration (ms): 7912.4 | ", ""), 3, "missing"),
    (GOOD + "\n[Rank 0] (after 10 iterations) memory (MB) | allocated: 1.0 | reserved: 3.0", 2, "max allocated"),
    (GOOD + "\n" + GOOD.replace("7912.4", "-5"), 2, "non-negative"),
])
def test_malformed_log_names_the_line(text, line, needle):
    with pytest.raises(SpecError) as exc:
        parse_megatron_log(text, "train.log")
    msg = str(exc.value)
    assert f"train.log:{line}:" in msg and needle in msg and "\n" not in msg


def test_log_without_iterations():
    with pytest.raises(SpecError, match="no iteration lines"):
        parse_megatron_log("hello\nworld\n", "x.log")


# ------------------------------------------------------------------------------------------------
# Calibration files and the commands
# ------------------------------------------------------------------------------------------------

def test_calibration_file_round_trip(tmp_path):
    p = EfficiencyParams()._replace(gemm_eff_max=0.61, inter_bw_eff=0.44)
    doc = {"gpu": "h100", "params": params_to_dict(p), "fit": {"n_train": 3}}
    path = tmp_path / "cal.json"
    write_calibration(doc, str(path))
    back, meta = read_calibration(str(path))
    assert back == EfficiencyParams(*(float(v) for v in p))
    assert meta["gpu"] == "h100" and meta["fit"] == {"n_train": 3}
    assert load_params_file(str(path))[0] == back      # what every --calibration reads
    assert calibration_for_gpu(str(path), "h100")[0] == back


def test_wrong_gpu_calibration_refused(tmp_path):
    path = tmp_path / "cal.json"
    write_calibration({"gpu": "h100", "params": {}}, str(path))
    with pytest.raises(SpecError, match="fitted for GPU 'h100'.*'b200'"):
        calibration_for_gpu(str(path), "b200")
    r = runner.invoke(app, ["explain", "--model", "llama3-8b", "--gpu", "b200", "--gpus", "8", "--global-batch",
                            "64", "--seq-len", "4096", "--plan", "tp=1", "--calibration", str(path)])
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and "error: calibration:" in r.stderr and "b200" in r.stderr


def test_calibrate_megatron_log_cli_round_trip(tmp_path):
    out = tmp_path / "h100.json"
    r = runner.invoke(app, ["calibrate", "--megatron-log", str(SAMPLE_LOG), "--model", "llama3-70b", "--gpu", "h100",
                            "--gpus", "64", "--seq-len", "8192", "--steps", "30",
                            "--plan", "tp=8,pp=2,recompute=selective,sp=true,zero=1", "-o", str(out), "--json"])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert doc["gpu"] == "h100" and doc == json.loads(out.read_text())
    assert doc["fit"]["log"]["step_time_s"] == pytest.approx(7.3518)
    assert doc["fit"]["mape_train_after_pct"] <= doc["fit"]["mape_train_before_pct"]
    params, _ = load_params_file(str(out))
    assert params_to_dict(params) == doc["params"]
    r2 = runner.invoke(app, ["explain", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch",
                             "64", "--seq-len", "4096", "--plan", "tp=2,zero=1,recompute=full", "--calibration",
                             str(out), "--json"])
    assert r2.exit_code == 0, r2.stderr        # (a plan that does not fit exits 3, as predict does)
    assert set(json.loads(r2.stdout)["elasticities"]) == {"step_time_s", "tokens_per_s", "peak_memory_gb"}


def test_calibrate_malformed_log_cli(tmp_path):
    bad = tmp_path / "bad.log"
    bad.write_text("x\n" + GOOD.replace("7912.4", "n/a") + "\n")
    r = runner.invoke(app, ["calibrate", "--megatron-log", str(bad), "--model", "llama3-8b", "--gpu", "h100",
                            "--gpus", "8", "--plan", "tp=1", "-o", str(tmp_path / "o.json")])
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and f"{bad}:2:" in r.stderr


def test_whatif_json():
    r = runner.invoke(app, ["whatif", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--seq-len",
                            "4096", "--gpu", "h100", "--gpu", "h200", "--json"])
    assert r.exit_code == 0, r.stderr
    rows = json.loads(r.stdout)["variants"]
    assert [v["gpu"] for v in rows] == ["h100", "h200"]
    assert all(v["best"] and v["best"]["fits"] for v in rows)
    assert rows[1]["best"]["step_time_s"] <= rows[0]["best"]["step_time_s"]     # H200: more HBM bandwidth


@pytest.mark.parametrize("options,framework", [
    ([], {"lora_dim": 0, "packed_example_tokens": 0}),
    (["--lora-dim", "16", "--lora-target-modules", "linear_qkv", "--packed-example-tokens", "256"],
     {"lora_dim": 16, "lora_target_modules": ["linear_qkv"], "packed_example_tokens": 256}),
])
def test_whatif_json_names_the_jobs_framework_options(options, framework):
    r = runner.invoke(app, ["whatif", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "32", "--seq-len",
                            "4096", "--gpu", "h100", "--json", *options])
    assert r.exit_code == 0, r.stderr
    job = json.loads(r.stdout)["job"]
    assert job["seq_len"] == 4096 and framework.items() <= job["framework"].items()


PUBLIC_RUNS = Path(dataset_path("public"))     # the bundled copy of shared/validation/public_runs.json


@pytest.mark.skipif(not PUBLIC_RUNS.exists(), reason="public runs not present")
def test_calibrate_runs_file_cli(tmp_path):
    """Runs of one GPU only, a held-out split, MAPE before/after, a file every --calibration reads."""
    rows = json.loads(PUBLIC_RUNS.read_text())
    mine = [r for r in rows if (r.get("hardware") or {}).get("gpu_key") == "gb200" and r.get("usable")][:2]
    other = [r for r in rows if (r.get("hardware") or {}).get("gpu_key") == "h100" and r.get("usable")][:1]
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps(mine + other))
    out = tmp_path / "gb200.json"
    r = runner.invoke(app, ["calibrate", str(runs), "--gpu", "gb200", "-o", str(out), "--holdout-frac", "0.5",
                            "--rounds", "1", "--steps", "20", "--json"])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "gb200" and doc == json.loads(r.stdout)
    f = doc["fit"]
    assert len(f["train_ids"]) == 1 and len(f["holdout_ids"]) == 1
    assert set(f["train_ids"] + f["holdout_ids"]) == {row["id"] for row in mine}     # h100 row left out
    for k in ("mape_train_before_pct", "mape_train_after_pct", "mape_holdout_before_pct", "mape_holdout_after_pct"):
        assert f[k] is not None and f[k] >= 0
    assert f["mape_train_after_pct"] <= f["mape_train_before_pct"] + 1e-6
    assert load_params_file(str(out))[0] == EfficiencyParams(**doc["params"])
