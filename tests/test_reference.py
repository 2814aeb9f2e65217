"""results/reference/ is current: its stored plans, scored again by today's cost model, give the stored
step times and memory (python -m autotune.reference regenerates them), and the check can fail."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from autotune import reference

REF = Path(__file__).resolve().parents[1] / "results" / "reference"


def test_reference_reports_are_current():
    problems = reference.check(str(REF))
    assert problems == [], "results/reference is stale; run `python -m autotune.reference`:\n" + "\n".join(problems)


def test_every_case_has_its_three_files():
    manifest = json.loads((REF / reference.MANIFEST).read_text())
    kinds = {c["kind"] for c in manifest["cases"].values()}
    assert kinds == {"search", "capacity"} and len(manifest["cases"]) == 5
    for entry in manifest["cases"].values():
        assert sorted(Path(f).suffix for f in entry["files"]) == [".html", ".json", ".md"]
        assert entry["plans"]


def test_check_catches_a_moved_figure_and_changed_inputs(tmp_path):
    for f in REF.iterdir():
        if f.suffix != ".js":
            shutil.copy(f, tmp_path / f.name)
    manifest = json.loads((tmp_path / reference.MANIFEST).read_text())
    name = next(iter(manifest["cases"]))
    manifest["cases"][name]["plans"][0]["step_time_s"] *= 1.01
    (tmp_path / reference.MANIFEST).write_text(json.dumps(manifest))
    problems = reference.check(str(tmp_path))
    assert len(problems) == 1 and name in problems[0] and "step time" in problems[0]
    manifest["cases"][name]["inputs_hash"] = "0" * 16
    (tmp_path / reference.MANIFEST).write_text(json.dumps(manifest))
    assert reference.check(str(tmp_path)) == [f"{name}: its inputs changed"]
