"""Golden tests against published, measured training runs (shared/validation).

These fail when the cost model drifts: the accuracy targets of the core issue, no false
out-of-memory call on a run that really ran, and search optimality on the published problems.
"""
from __future__ import annotations

import json
import os

import pytest

from autotune.search import exhaustive
from autotune.validate import case_from_row, load_runs, validate_rows

VALIDATION = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "validation")
PUBLIC = os.path.join(VALIDATION, "public_runs.json")
SMALL = os.path.join(VALIDATION, "small_scale_runs.json")

needs_data = pytest.mark.skipif(not os.path.exists(PUBLIC), reason="shared/validation not present")


@pytest.fixture(scope="module")
def public_result():
    return validate_rows(load_runs(PUBLIC))


@needs_data
def test_dense_public_runs_accuracy(public_result):
    dense = [r for r in public_result["runs"] if r.get("error_pct") is not None and not r["moe"]]
    assert len(dense) >= 40
    assert public_result["mape_dense_pct"] <= 15.0
    assert public_result["max_abs_error_dense_pct"] <= 30.0


@needs_data
def test_every_scored_published_run_is_predicted_to_fit(public_result):
    scored = [r for r in public_result["runs"] if r.get("error_pct") is not None]
    assert scored and all(r["predicted_fits"] for r in scored), \
        [r["id"] for r in scored if not r["predicted_fits"]]


@needs_data
def test_usable_rows_are_scored_or_skipped_with_a_reason(public_result):
    for r in public_result["runs"]:
        assert (r["error_pct"] is None) == (r["skipped"] is not None), r["id"]
        if r["skipped"]:
            assert isinstance(r["skipped"], str) and r["skipped"]


@needs_data
def test_small_scale_runs_accuracy():
    out = validate_rows(load_runs(SMALL))
    assert out["n_scored"] == len(out["runs"])          # every vTrain plan is in the legal space
    assert out["mape_pct"] <= 30.0
    assert out["n_predicted_oom"] == 0


@needs_data
@pytest.mark.parametrize("row_id", [
    "narayanan21-t2-ptdp-175B-384gpu", "narayanan21-t1-529.6B", "nemo-24.07-LLAMA3-70B-64g-pre",
    "nemo-24.07-GPT3-175B-512g-pre", "nemotron4-15B-dp96", "nemo-24.07-LLAMA2-13B-16g-pre",
])
def test_search_beats_or_matches_the_published_plan(row_id):
    row = next(r for r in load_runs(PUBLIC) if r["id"] == row_id)
    case = case_from_row(row)
    published = exhaustive(case.problem, top_k=1, fixed=case.fixed).best
    free = exhaustive(case.problem, top_k=1).best
    assert free["fits"]
    assert free["step_time_s"] <= published["step_time_s"] * (1 + 1e-6)


def test_validate_never_crashes_on_bad_rows(tmp_path):
    rows = [{"id": "empty"}, {"id": "no-gpu", "model": {"layers": 2, "hidden": 64, "heads": 4}},
            {"id": "garbage", "model": "x", "hardware": 3, "plan": None}, "not a dict"]
    out = validate_rows([r if isinstance(r, dict) else {"id": r} for r in rows], only_usable=False)
    assert out["n_scored"] == 0 and out["n_skipped"] == len(rows)
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(rows[:2]))
    assert len(load_runs(str(path))) == 2
