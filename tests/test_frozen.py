"""The cost model's predictions for reference cases equal the frozen table (a regression table).

tests/data/frozen_predictions.json pins today's predictions (step time, its breakdown, memory, MFU)
for problems that exercise every term. A change of the physics regenerates it on purpose in the same
commit (python tests/benchmarks/freeze_predictions.py --write); a refactor must leave it unchanged.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))

import freeze_predictions as F       # noqa: E402

FROZEN = json.loads(F.TABLE.read_text())


def test_table_covers_every_case():
    assert [(r["problem"], r["plan"]) for r in FROZEN] == [(kw, plan) for kw, plan in F.CASES]


@pytest.fixture(scope="module")
def now():
    return F.predictions()


@pytest.mark.parametrize("i", range(len(FROZEN)), ids=[f"{r['problem']['model']}-{i}" for i, r in enumerate(FROZEN)])
def test_predictions_unchanged(now, i):
    old, new = FROZEN[i], now[i]
    assert new["step_time_s"] == pytest.approx(old["step_time_s"], rel=1e-4)
    for k, v in old["time_breakdown_s"].items():
        assert new["time_breakdown_s"][k] == pytest.approx(v, rel=1e-4, abs=1e-7), k
    for k, v in old["memory"].items():
        assert new["memory"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    assert new["mfu"] == pytest.approx(old["mfu"], rel=1e-4)
