"""The measured runs shipped with the package (`autotune/data/`, provenance and licence in its README).

`public` is a copy of shared/validation/public_runs.json (published large-model runs, each row citing
its source); `small-scale` of shared/validation/small_scale_runs.json (vTrain's Megatron-DeepSpeed
measurements, MIT licence, copyright 2024 VIA Research Group at KAIST). Bundling them lets any clone
reproduce the README's accuracy figures: `autotune validate --dataset public`. `korthikanti22` holds
the 8 end-to-end iteration times of Korthikanti et al. 2022 Table 5 (GPT 22B-1T on A100, full vs
selective recompute + sequence parallelism); no fit ever sees them (calibration and the shipped
defaults use `public` + `small-scale`), so they are an out-of-sample check.
"""
from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

from costmodels.specs import SpecError

#: dataset name -> file under autotune/data/
DATASETS = {"public": "public_runs.json", "small-scale": "small_scale_runs.json",
            "korthikanti22": "korthikanti22_table5.json"}

#: the datasets fits train on (fit_defaults, the cross-validation); the others are held out
TRAINING_DATASETS = ("public", "small-scale")

#: GPU generations for leave-one-generation-out evaluation (gpu_key -> generation)
GPU_GENERATIONS = {
    "a100-40gb": "A100", "a100-80gb": "A100",
    "h100": "H100/H200/H800", "h200": "H100/H200/H800", "h800": "H100/H200/H800",
    "b200": "B200/B300", "b300": "B200/B300",
    "gb200": "GB200/GB300", "gb300": "GB200/GB300",
}


def gpu_generation(gpu_key: str | None) -> str:
    return GPU_GENERATIONS.get(str(gpu_key), str(gpu_key))


def data_dir() -> Path:
    return Path(str(resources.files("autotune") / "data"))


def dataset_path(name: str) -> str:
    """The bundled file of a dataset name (`public`, `small-scale` or `korthikanti22`)."""
    if name not in DATASETS:
        raise SpecError("dataset", f"unknown dataset {name!r}; choose {', '.join(DATASETS)}")
    path = data_dir() / DATASETS[name]
    if not path.is_file():
        raise SpecError("dataset", f"the bundled file {path} is missing (a broken install?)")
    return str(path)


#: the Megatron-Bridge MoE rows' recipe settings (autotune/data/README.md, "recipe_settings.json")
RECIPE_SETTINGS = "recipe_settings.json"
#: the launch scripts' settings of rows that leave them null (autotune/data/README.md, "launch_settings.json")
LAUNCH_SETTINGS = "launch_settings.json"


def _rows_of(name: str, block: str = "rows") -> dict:
    path = data_dir() / name
    if not path.is_file():
        return {}
    with open(path) as fh:
        return json.load(fh).get(block, {})


@functools.lru_cache(maxsize=1)
def recipe_settings() -> dict:
    """Row id -> the MoE communication settings of the recipe that produced that published run."""
    return _rows_of(RECIPE_SETTINGS)


@functools.lru_cache(maxsize=1)
def launch_settings() -> dict:
    """Row id -> the settings its published launch script (or its framework's defaults of the time) ran with."""
    return _rows_of(LAUNCH_SETTINGS)


@functools.lru_cache(maxsize=1)
def launch_settings_by_source() -> dict:
    """Source group -> the settings all of its runs ran with (where the source states them once for all)."""
    return _rows_of(LAUNCH_SETTINGS, "sources")


def load_dataset(name: str) -> list:
    from .validate import load_runs
    return load_runs(dataset_path(name))
