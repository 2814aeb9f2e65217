"""What an Optuna study optimizes: the objectives, and one trial's metrics from its score.

Objectives (`OBJECTIVES`):
    tokens_per_s  maximize   training throughput of the whole cluster
    step_time     minimize   seconds per optimizer step
    gpus          minimize   the GPU count (a knob when --gpus is a range)
    cost          minimize   GPU-hours per optimizer step (gpus * step_time / 3600); every plan of a
                             study processes the same tokens per step, so this is GPU-hours per token
                             up to a constant. No price: multiply by your $ per GPU-hour.
    memory        minimize   peak memory per GPU in GB
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from costmodels.specs import SpecError

#: the constraint told to Optuna (`Trial.set_constraint`): peak memory minus the limit, GB (> 0 = infeasible)
CONSTRAINT = "memory_gb_over"
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class Objective:
    name: str
    direction: str          # "maximize" or "minimize"
    unit: str
    label: str
    metric: str             # key of the trial metrics

    def better(self, a: float, b: float) -> bool:
        return a > b if self.direction == "maximize" else a < b


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("tokens_per_s", "maximize", "tokens/s", "throughput (tokens/s)", "tokens_per_s"),
    Objective("step_time", "minimize", "s", "step time (s)", "step_time_s"),
    Objective("gpus", "minimize", "GPUs", "GPUs", "gpus"),
    Objective("cost", "minimize", "GPU-h/step", "cost (GPU-hours per step)", "cost_gpu_h"),
    Objective("memory", "minimize", "GB", "peak memory per GPU (GB)", "memory_gb"),
)}
_ALIASES = {"throughput": "tokens_per_s", "tokens": "tokens_per_s", "step_time_s": "step_time",
            "mem": "memory", "gpu": "gpus"}


def parse_objectives(names) -> tuple[str, ...]:
    out = []
    for n in names or ("tokens_per_s",):
        key = str(n).strip().lower().replace("-", "_")
        key = _ALIASES.get(key, key)
        if key not in OBJECTIVES:
            raise SpecError("objective", f"unknown objective {n!r}; choose from {', '.join(OBJECTIVES)}")
        if key in out:
            raise SpecError("objective", f"{key} given twice")
        out.append(key)
    if "tokens_per_s" in out and "step_time" in out:
        raise SpecError("objective", "tokens_per_s and step_time are the same objective (tokens per step "
                        "is fixed); keep one")
    return tuple(out)


def directions(objectives) -> list[str]:
    return [OBJECTIVES[o].direction for o in objectives]


def trial_metrics(n: int, step_s: float, mem_bytes: float, limit_bytes: float, tokens: int) -> dict:
    """One plan's metrics as a trial stores them (user attribute "metrics")."""
    finite = math.isfinite(step_s) and step_s > 0
    mem_gb, limit_gb = float(mem_bytes) / 1e9, float(limit_bytes) / 1e9
    return {
        "gpus": int(n),
        "step_time_s": float(step_s),
        "tokens_per_s": tokens / step_s if finite else 0.0,
        "tokens_per_s_per_gpu": tokens / step_s / n if finite else 0.0,
        "cost_gpu_h": n * step_s / SECONDS_PER_HOUR if finite else math.inf,
        "memory_gb": mem_gb,
        "memory_limit_gb": limit_gb,
        "fits": bool(mem_bytes <= limit_bytes),
        CONSTRAINT: mem_gb - limit_gb,
    }
