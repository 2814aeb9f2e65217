"""The bundled measured runs (autotune/data/) are the shared validation data, byte for byte."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from autotune.datasets import DATASETS, dataset_path, load_dataset
from costmodels.specs import SpecError

#: ../shared/validation next to the repository (a git worktree elsewhere can point here with
#: AUTOTUNE_SHARED_VALIDATION=/path/to/shared/validation)
SHARED = Path(os.environ.get("AUTOTUNE_SHARED_VALIDATION")
              or Path(__file__).resolve().parents[2] / "shared" / "validation")


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_bundled_copy_equals_shared_validation(name):
    shared = SHARED / DATASETS[name]
    if not shared.exists():
        pytest.skip(f"{shared} not present (a clone outside the workspace): nothing to compare with")
    bundled = Path(dataset_path(name)).read_bytes()
    assert bundled == shared.read_bytes(), (
        f"autotune/data/{DATASETS[name]} differs from {shared}: copy the shared file into autotune/data/")


def test_bundled_datasets_hold_the_documented_rows():
    # counts from shared/validation/README.md: 148 public runs, 720 vTrain measurements
    public, small = load_dataset("public"), load_dataset("small-scale")
    assert len(public) == 148 and len(small) == 720
    assert len({r["id"] for r in public}) == 148 and len({r["id"] for r in small}) == 720
    assert all(r["source"]["group"] == "vTrain measurements" for r in small)


def test_bundled_provenance_and_licence_ship_with_the_data():
    folder = Path(dataset_path("public")).parent
    readme = (folder / "README.md").read_text()
    assert "VIA Research Group at KAIST" in readme and "MIT" in readme
    licence = (folder / "LICENSE-vTrain.txt").read_text()
    assert "Copyright (c) 2024 VIA Research Group at KAIST" in licence


def test_unknown_dataset_is_a_one_line_error():
    with pytest.raises(SpecError, match="dataset.*public or small-scale"):
        dataset_path("private")
    json.dumps(DATASETS)   # the names are plain strings (they appear in --json output)
