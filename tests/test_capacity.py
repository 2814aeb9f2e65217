"""Capacity planning: the failure arithmetic against hand-computed Young/Daly values, training time against
6 N D / (GPUs x peak x MFU) (Kaplan et al. 2020; Narayanan et al. 2021), Llama 3 405B against its
published run, the pick against every other count, and the CLI's exit codes and one-line errors."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from autotune import capacity as cap
from cli.main import app
from costmodels.presets import load_gpu, load_model

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


# ---------------------------------------------------------------------------------------------
# Failure model, by hand
# ---------------------------------------------------------------------------------------------

def test_young_daly_interval_by_hand():
    # C = 60 s, M = 10,000 s: sqrt(2 * 60 * 10,000) = sqrt(1.2e6) = 1095.445 s
    assert cap.young_daly_interval_s(60.0, 10_000.0) == pytest.approx(1095.445, abs=1e-3)
    # C = 300 s, M = 3 h = 10,800 s: sqrt(6.48e6) = 2545.58 s
    assert cap.young_daly_interval_s(300.0, 10_800.0) == pytest.approx(2545.58, abs=1e-2)


def test_goodput_by_hand():
    # C = 60, R = 600, M = 10,000: tau = 1095.445; lost share (547.72 + 600) / 10,000 = 0.114772;
    # goodput = (1 - 0.114772) / (1 + 60 / 1095.445) = 0.885228 / 1.054772 = 0.839261
    assert cap.goodput(60.0, 600.0, 10_000.0) == pytest.approx(0.839261, abs=1e-5)
    # a failure more often than a checkpoint interval plus a restart: the job never finishes
    assert cap.goodput(600.0, 3600.0, 3000.0) == 0.0
    # Young's interval minimises the first-order waste: a 20 % longer or shorter interval is worse
    tau = cap.young_daly_interval_s(60.0, 1e6)
    g = cap.goodput(60.0, 0.0, 1e6, tau)
    assert g > cap.goodput(60.0, 0.0, 1e6, 1.2 * tau) and g > cap.goodput(60.0, 0.0, 1e6, 0.8 * tau)


def test_default_mtbf_is_llama3s():
    # Dubey et al. 2024 sec. 3.3.4: 419 unexpected interruptions in 54 days on 16,384 H100
    assert cap.DEFAULT_GPU_MTBF_HOURS == pytest.approx(54 * 24 * 16384 / 419)
    assert 50_000 < cap.DEFAULT_GPU_MTBF_HOURS < 51_000
    # which makes the job MTBF of the 16K-GPU run about 3.1 h, as the paper's figures imply
    assert cap.DEFAULT_GPU_MTBF_HOURS / 16384 == pytest.approx(54 * 24 / 419)


def test_training_figures_by_hand():
    # 1e12 tokens, 4M tokens per step -> ceil(238,418.6) = 238,419 steps of 2 s on 1,000 GPUs;
    # failures switched off (MTBF 1e12 h): wall = 476,838 s = 5.5190 days, 132,455 GPU-hours
    f = cap.training_figures([1000], [2.0], tokens=1e12, tokens_per_step=4 * 2**20,
                             failures=cap.FailureModel(gpu_mtbf_hours=1e12, checkpoint_s=1e-9, restart_s=0.0),
                             price_per_gpu_hour=2.0, power_w=700.0)
    assert f["steps"] == 238_419
    assert f["wall_days"][0] == pytest.approx(476_838 / 86400, rel=1e-5)
    assert f["gpu_hours"][0] == pytest.approx(1000 * 476_838 / 3600, rel=1e-5)
    assert f["cost"][0] == pytest.approx(2.0 * f["gpu_hours"][0])
    assert f["energy_kwh"][0] == pytest.approx(0.7 * f["gpu_hours"][0])


def test_gpu_count_grid_whole_nodes():
    grid = cap.gpu_count_grid(8, 1, 256)
    assert grid == [8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert all(n % 72 == 0 for n in cap.gpu_count_grid(72, 1, 4096))


def test_parsing_at_the_edge():
    assert cap.parse_duration_s("90d") == 90 * 86400
    assert cap.parse_duration_s("12w") == 12 * 7 * 86400
    assert cap.parse_duration_s("36") == 36 * 86400
    assert cap.parse_per_gpu("h100=2.5, b200=4", "price", ["h100", "b200"]) == {"h100": 2.5, "b200": 4.0}
    assert cap.parse_per_gpu("3", "price", ["h100", "b200"]) == {"h100": 3.0, "b200": 3.0}
    for bad in ("soon", "-3d", "0h", "1e400d"):
        with pytest.raises(ValueError, match="deadline"):
            cap.parse_duration_s(bad)
    with pytest.raises(ValueError, match="price"):
        cap.parse_per_gpu("a100-80gb=2", "price", ["h100"])


# ---------------------------------------------------------------------------------------------
# Against first principles and a published run
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_plan():
    req = cap.CapacityRequest(model="llama3-8b", tokens=1e12, gpus=("h100",), min_gpus=64, max_gpus=256,
                              seq_len=4096, global_batch=1024, deadline_s=cap.parse_duration_s("60d"),
                              prices={"h100": 2.0})
    return req, cap.capacity_plan(req)


def test_time_matches_6nd(small_plan):
    """Failure-free time x GPUs x peak x MFU = model FLOPs = 6 N D plus attention (Narayanan et al. 2021
    eq. 3: the attention scores add 6 s h L per token of 6 N... a few per cent at 4k tokens)."""
    req, rep = small_plan
    n_params = load_model("llama3-8b").param_counts()["total"]
    peak = load_gpu("h100").peak_flops_bf16
    rows = rep["per_gpu"][0]["rows"]
    assert len(rows) >= 3
    for r in rows:
        flops = r["compute_days"] * 86400 * r["gpus"] * peak * r["mfu"]
        ratio = flops / (6 * n_params * r["steps"] * 1024 * 4096)
        assert 1.0 <= ratio <= 1.15, (r["gpus"], ratio)


def test_pick_is_cheapest_meeting_deadline(small_plan):
    req, rep = small_plan
    g = rep["per_gpu"][0]
    assert g["pick"] is not None and g["pick"]["wall_days"] <= 60
    for r in g["rows"]:
        if r["wall_days"] <= 60:
            assert r["cost"] >= g["pick"]["cost"] - 1e-6
        assert r["cost"] == pytest.approx(r["gpu_hours"] * 2.0)
        assert r["goodput"] < 1.0 and r["wall_days"] > r["compute_days"]
        assert r["memory_gb"] <= r["memory_limit_gb"] + 1e-6


def test_llama3_405b_against_the_published_run():
    """Llama 3 405B (Dubey et al. 2024, sec. 3.3): 15.6T tokens on 16,384 H100 at 38-43 % BF16 MFU, batch
    16M tokens at 8,192: 6 x 405e9 x 15.6e12 / (16,384 x 989 TFLOP/s x 0.43..0.38) = 68-77 days of compute."""
    req = cap.CapacityRequest(model="llama3.1-405b", tokens=15.6e12, gpus=("h100",), min_gpus=16384,
                              max_gpus=16384, seq_len=8192, global_batch=2048)
    g = cap.capacity_plan(req)["per_gpu"][0]
    (row,) = g["rows"]
    assert 0.30 <= row["mfu"] <= 0.50
    assert 50 <= row["compute_days"] <= 100
    assert 0.80 <= row["goodput"] <= 0.97     # Meta reports > 90 % effective training time


def test_deadline_nothing_meets_says_what_would():
    req = cap.CapacityRequest(model="llama3-8b", tokens=1e12, gpus=("h100", "b200"), min_gpus=8, max_gpus=64,
                              seq_len=4096, global_batch=1024, deadline_s=cap.parse_duration_s("2d"))
    rep = cap.capacity_plan(req)
    assert rep["best_gpu"] is None
    assert len(rep["advice"]) == 2
    assert all("more GPUs" in a for a in rep["advice"]), rep["advice"]
    h100, b200 = rep["per_gpu"]
    assert h100["fastest"]["gpus"] == 64 and h100["fastest"]["wall_days"] > 2
    # a deadline between the two GPU types' fastest runs: the slower type is told the other meets it
    between = (h100["fastest"]["wall_days"] + b200["fastest"]["wall_days"]) / 2
    assert b200["fastest"]["wall_days"] < between < h100["fastest"]["wall_days"]
    rep2 = cap.capacity_plan(cap.CapacityRequest(**{**req.__dict__, "deadline_s": between * 86400}))
    assert rep2["best_gpu"] == "b200"
    (advice,) = rep2["advice"]
    assert advice.startswith("h100:") and "b200 meets it" in advice


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

ARGS = ["--model", "llama3-8b", "--tokens", "1e12", "--gpu", "h100", "--seq-len", "4096", "--global-batch", "1024",
        "--min-gpus", "64", "--max-gpus", "128"]


def test_cli_json_and_plot(tmp_path):
    plot = tmp_path / "cap.html"
    res = run("capacity", *ARGS, "--deadline", "120d", "--price-per-gpu-hour", "h100=2.5", "--plot", plot, "--json")
    assert res.exit_code == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["best_gpu"] == "h100" and rep["per_gpu"][0]["pick"]["cost"] > 0
    page = plot.read_text()
    assert page.startswith("<!DOCTYPE html>") and "Plotly.newPlot" in page and "<script src=" not in page


def test_cli_deadline_nothing_meets_exit_3():
    res = run("capacity", *ARGS, "--deadline", "1d")
    assert res.exit_code == 3
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: deadline:") and "more GPUs" in lines[0]


@pytest.mark.parametrize("extra,field", [(["--deadline", "soon"], "deadline"),
                                         (["--price-per-gpu-hour", "a100-80gb=2"], "price_per_gpu_hour"),
                                         (["--checkpoint-s", "0"], "checkpoint_s"),
                                         (["--checkpoint-s", "inf"], "checkpoint_s"),
                                         (["--mtbf-hours", "0"], "mtbf_hours"),
                                         (["--restart-s", "-1"], "restart_s"),
                                         (["--objective", "speed"], "objective"),
                                         (["--min-gpus", "0"], "min_gpus"),
                                         (["--min-gpus", "512"], "max_gpus"),
                                         (["--tokens", "-1"], "tokens"),
                                         (["--gpu", "tpu-v9"], "gpu"),
                                         (["--memory-headroom", "150%"], "memory_headroom"),
                                         # were accepted: 300-digit day counts, a row per repeat, the last price
                                         (["--tokens", "1e300"], "tokens"),
                                         (["--gpu", "H100"], "gpu"),
                                         (["--price-per-gpu-hour", "h100=2,h100=3"], "price_per_gpu_hour"),
                                         # were exit 3 "no GPU count has a plan that fits" (goodput 0 everywhere)
                                         (["--mtbf-hours", "1e-300"], "mtbf_hours"),
                                         (["--checkpoint-s", "1e12"], "checkpoint_s"),
                                         (["--restart-s", "1e12"], "restart_s"),
                                         # was refused after the search, naming gpus
                                         (["--max-gpus", "100000000000"], "max_gpus"),
                                         # were refused after the search, naming no field
                                         (["--plot", "/"], "plot"),
                                         (["--plot", "/nonexistent-folder/cap.html"], "plot")])
def test_cli_bad_input_one_line(extra, field):
    res = run("capacity", *ARGS, *extra)
    assert res.exit_code == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}:"), res.stderr
    assert "Traceback" not in res.stdout + res.stderr


def test_plot_never_overwrites_an_input(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"gpu": "h100", "params": {}}))
    before = cal.read_bytes()
    res = run("capacity", *ARGS, "--calibration", cal, "--plot", tmp_path / "." / "cal.json")
    assert res.exit_code == 2 and res.stderr.startswith("error: plot:") and len(res.stderr.splitlines()) == 1
    assert cal.read_bytes() == before


def test_energy_objective_picks_least_kwh():
    res = run("capacity", *ARGS, "--gpu", "b200", "--power-w", "h100=700,b200=1000", "--objective", "energy",
              "--json")
    assert res.exit_code == 0, res.stderr
    rep = json.loads(res.stdout)
    picks = {g["gpu"]: g["pick"] for g in rep["per_gpu"]}
    for g in rep["per_gpu"]:
        assert all(r["energy_kwh"] >= g["pick"]["energy_kwh"] - 1e-6 for r in g["rows"])
        assert g["pick"]["energy_kwh"] == pytest.approx(g["pick"]["gpu_hours"] * g["power_w"] / 1000)
    assert rep["best_gpu"] == min(picks, key=lambda k: picks[k]["energy_kwh"])


def test_rack_scale_counts_are_shares_of_racks():
    # NVL72: a job takes an equal share of each rack (costmodels.presets), so counts step by 8, not 72
    req = cap.CapacityRequest(model="llama3-8b", tokens=1e12, gpus=("gb200",), min_gpus=64, max_gpus=128,
                              seq_len=4096, global_batch=1024)
    g = cap.capacity_plan(req)["per_gpu"][0]
    assert g["counts_tried"] == [64, 80, 96, 112, 128]
    assert {r["gpus"] for r in g["rows"]} >= {64, 128} and g["pick"] is not None


def test_larger_batch_advice_is_checked():
    """When more GPUs stop helping, the advice tries twice the global batch and quotes what it measured."""
    req = cap.CapacityRequest(model="llama3-8b", tokens=1e13, gpus=("h100",), global_batch=64, seq_len=4096,
                              min_gpus=8192, max_gpus=32768, deadline_s=cap.parse_duration_s("3d"))
    rep = cap.capacity_plan(req)
    (advice,) = rep["advice"]
    assert "global batch 128" in advice or "(128:" in advice, advice
    quoted = advice.split("128: ")[1]            # "28.1 days on 16384 GPUs)": the advice quotes another count first
    days = float(quoted.split(" days on ")[0])
    gpus = int(quoted.split(" days on ")[1].split(" GPUs")[0])
    again = cap.capacity_plan(cap.CapacityRequest(model="llama3-8b", tokens=1e13, gpus=("h100",), global_batch=128,
                                                  seq_len=4096, min_gpus=gpus, max_gpus=gpus))
    assert again["per_gpu"][0]["rows"][0]["wall_days"] == pytest.approx(days, abs=0.05)
    assert days < rep["per_gpu"][0]["fastest"]["wall_days"]


def test_cli_defaults_spelled_for_start_up_match_the_module():
    """cli/capacity_cmds.py spells the defaults so that building the CLI needs no numpy."""
    from autotune import capacity as cap
    from cli import capacity_cmds
    for name in ("DEFAULT_GPU_MTBF_HOURS", "DEFAULT_CHECKPOINT_S", "DEFAULT_RESTART_S", "DEFAULT_MAX_GPUS"):
        assert getattr(capacity_cmds, name) == pytest.approx(getattr(cap, name), rel=1e-12), name
