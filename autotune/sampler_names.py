"""The samplers' names and the check of a requested one, without importing Optuna (a study spec
is checked before a study is made; an exhaustive search never imports Optuna)."""
from __future__ import annotations

import importlib.util

from costmodels.specs import SpecError

SAMPLERS = ("tpe", "table", "nsga2", "gp", "cmaes", "random", "grid")
#: samplers that read `Trial.set_constraint` (Optuna 5 replaced `constraints_func` by it); CMA-ES
#: does not, so it is told a penalized value
CONSTRAINT_AWARE = ("tpe", "table", "nsga2", "gp")
DEFAULT_SAMPLER = "table"
_ALIASES = {"nsgaii": "nsga2", "cma": "cmaes", "bruteforce": "grid"}


def check_sampler(name: str, n_objectives: int) -> str:
    key = str(name).strip().lower().replace("-", "").replace("_", "")
    key = _ALIASES.get(key, key)
    if key not in SAMPLERS:
        raise SpecError("sampler", f"unknown sampler {name!r}; choose from {', '.join(SAMPLERS)}")
    if key == "cmaes":
        if n_objectives > 1:
            raise SpecError("sampler", "cmaes optimizes one objective; use tpe or nsga2 for several")
        if importlib.util.find_spec("cmaes") is None:
            raise SpecError("sampler", "cmaes needs the cmaes package: pip install cmaes")
    if key == "gp" and importlib.util.find_spec("torch") is None:
        raise SpecError("sampler", "gp (Optuna's GPSampler) needs PyTorch: pip install torch; or use tpe")
    return key
