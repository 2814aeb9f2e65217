"""`validate` names runs the cost model cannot tell apart (one case: the same problem, framework options and
published knobs) that were measured differently, and the MAPE floor they set: no prediction can score lower."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from autotune.validate import repeated_cases, validate_rows
from tests.test_cli import run


def _row(rid: str, tokens: float, tp: int = 2) -> dict:
    return {"id": rid, "source": {"title": "a 2024 Megatron-Core run", "group": "g"}, "usable": True,
            "model": {"name": "t", "layers": 16, "hidden": 2048, "ffn_hidden": 8192, "heads": 16, "kv_heads": 16,
                      "vocab": 32000, "seq_len": 2048},
            "hardware": {"gpu_key": "h100", "num_gpus": 8, "gpus_per_node": 8},
            "plan": {"tp": tp, "pp": 1, "micro_batch": 1, "global_batch": 64, "precision_key": "bf16",
                     "recompute_key": "none", "zero_key": 1, "sequence_parallel": True},
            "measured": {"tokens_per_s_per_gpu": tokens}}


def test_one_case_measured_twice_sets_the_floor():
    """Measured 100 and 200: the best single prediction is 100 (errors 0 and 50 %), so over three scored runs the
    MAPE cannot go below 50 / 3 %."""
    out = validate_rows([_row("a", 100.0), _row("b", 200.0), _row("c", 150.0, tp=4)])
    rep = out["repeats"]
    assert [g["ids"] for g in rep["groups"]] == [["a", "b"]]
    assert rep["groups"][0]["spread_pct"] == pytest.approx(100.0)
    assert rep["floor_mape_pct"] == pytest.approx(50.0 / 3.0)
    assert rep["floor_by_source_pct"] == {"g": pytest.approx(50.0 / 3.0)}
    assert out["mape_pct"] >= rep["floor_mape_pct"]
    ids = {r["id"]: r["case_id"] for r in out["runs"]}
    assert ids["a"] == ids["b"] != ids["c"]


@given(st.lists(st.floats(min_value=1.0, max_value=1e5), min_size=2, max_size=6),
       st.floats(min_value=0.5, max_value=2e5))
def test_no_single_prediction_beats_the_floor(measured, guess):
    """The floor is the minimum over all predictions, not only over the measured values (convexity)."""
    scored = [{"id": str(i), "case_id": "x", "group": "g", "measured_tokens_per_s_per_gpu": m}
              for i, m in enumerate(measured)]
    floor = repeated_cases(scored)["floor_mape_pct"]
    mape = 100.0 * sum(abs(guess / m - 1.0) for m in measured) / len(measured)
    assert mape >= floor - 1e-9


def test_bundled_release_conflict_is_named():
    """Megatron-Bridge's archive lists Qwen3-30B-A3B on 16 H100 (fp8) at 9,058 tokens/s per GPU in 26.02.01 and
    5,113 in 26.02 with one plan and one recipe: one case, 77 % apart."""
    r = run("validate", "--dataset", "public", "--json")
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)["repeats"]
    pair = {"mbridge-arch-26.02.01-Qwen3_30B_a3B-DGX-H100-16g-FP8-173",
            "mbridge-arch-26.02-Qwen3_30B_a3B-DGX-H100-16g-FP8-210"}
    group = next(g for g in rep["groups"] if pair <= set(g["ids"]))
    assert group["spread_pct"] == pytest.approx(100.0 * (9058 / 5113 - 1.0), abs=0.5)
    assert 0.0 < rep["floor_mape_pct"] < 2.0


def test_cli_prints_the_repeated_cases(tmp_path):
    f = tmp_path / "runs.json"
    f.write_text(json.dumps([_row("a", 100.0), _row("b", 200.0)]))
    r = run("validate", str(f))
    assert r.exit_code == 0, r.stderr
    line = " ".join(r.stdout.split())
    assert "Repeated cases: 2 runs in 1 group" in line and "100.0 % apart (a, b)" in line and "floor of 25.00 %" in line


def test_calibrate_warns_that_no_fit_matches_both(tmp_path):
    """`calibrate` on a file holding one case measured twice says so: its fit cannot match both runs."""
    f, out = tmp_path / "runs.json", tmp_path / "cal.json"
    f.write_text(json.dumps([_row("a", 100.0), _row("b", 200.0), _row("c", 150.0, tp=4)]))
    r = run("calibrate", str(f), "--gpu", "h100", "-o", str(out), "--holdout-frac", "0", "--rounds", "1",
            "--steps", "5")
    assert r.exit_code == 0, r.stderr
    line = " ".join(r.stdout.split())
    assert "warning: 2 runs in 1 group are one case each to the cost model" in line and "(a, b)" in line
    doc = json.loads(out.read_text())
    assert [g["ids"] for g in doc["fit"]["repeats"]["groups"]] == [["a", "b"]]
    assert doc["fit"]["repeats"]["floor_mape_pct"] == pytest.approx(50.0 / 3.0)
