"""The plan: one point of the parallelism space, and a batch of them as a struct of arrays.

Knob symbols: tp tensor, pp pipeline, dp data, cp context, ep expert, etp expert-tensor parallel,
vpp virtual pipeline stages per rank, mbs micro-batch size (sequences), recompute policy,
sp sequence parallelism, zero ZeRO stage (1 = Megatron's distributed optimizer).

Three knobs that only the Optuna search samples (exhaustive enumeration keeps them at 0):
first_layers / last_layers, the layers on the first / last pipeline stage (0 = the even split;
Megatron-Core --decoder-first/last-pipeline-num-layers), and recompute_layers, the layers per
virtual-pipeline chunk that full recomputation replays (0 = all; Megatron --recompute-method block
--recompute-num-layers).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .specs import Recompute, SpecError

#: The plan fields in the order they are stored in a PlanBatch and shown in reports.
PLAN_FIELDS = ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "mbs", "recompute", "sp", "zero",
               "first_layers", "last_layers", "recompute_layers")
#: fields whose default 0 means "not used" (even pipeline split, recompute every layer); plan
#: texts leave them out when 0
OPTIONAL_FIELDS = ("first_layers", "last_layers", "recompute_layers")


@dataclass(frozen=True, kw_only=True)
class Plan:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    mbs: int = 1
    recompute: Recompute = Recompute.NONE
    sp: bool = False
    zero: int = 0
    first_layers: int = 0
    last_layers: int = 0
    recompute_layers: int = 0

    def __post_init__(self):
        for f in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "mbs"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"plan.{f}", f"must be a positive integer, got {v!r}")
        for f in OPTIONAL_FIELDS:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SpecError(f"plan.{f}", f"must be a non-negative integer (0 = not used), got {v!r}")
        if self.zero not in (0, 1, 2, 3):
            raise SpecError("plan.zero", f"must be 0, 1, 2 or 3, got {self.zero!r}")

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["recompute"] = self.recompute.name.lower()
        return d

    def __str__(self) -> str:
        return format_plan(self)


def format_plan(p: Plan) -> str:
    d = p.as_dict()
    d["sp"] = "true" if p.sp else "false"
    return ",".join(f"{k}={d[k]}" for k in PLAN_FIELDS if k not in OPTIONAL_FIELDS or d[k])


def stage_layers(layers, pp, vpp, first_layers, last_layers, xp=np):
    """Transformer layers on the first, a middle and the last pipeline stage (numpy or jax.numpy).

    Megatron-Core: the first/last stage hold `first_layers`/`last_layers` when given (> 0); the other
    stages share the rest evenly. A stage's layers split into `vpp` virtual chunks; when they do not
    divide evenly the busiest chunk has ceil(rest / (stages * vpp)) layers, and that is what a middle
    stage is charged for. pp = 1: one stage holds every layer.
    """
    f_on = (first_layers > 0) * 1.0
    l_on = (last_layers > 0) * 1.0
    others = pp - f_on - l_on
    rest = layers - first_layers * f_on - last_layers * l_on
    n_mid = xp.ceil(rest / xp.maximum(others * vpp, 1.0)) * vpp
    n_mid = xp.where(others > 0, n_mid, 0.0)
    n_first = xp.where(f_on > 0, first_layers * 1.0, n_mid)
    n_last = xp.where(l_on > 0, last_layers * 1.0, n_mid)
    return n_first, n_mid, n_last


_BOOL = {"true": True, "1": True, "yes": True, "on": True,
         "false": False, "0": False, "no": False, "off": False}


def parse_plan_text(text: str) -> dict:
    """Parse "tp=8,pp=16,recompute=full,sp=false" into typed knob values (absent keys omitted)."""
    out: dict = {}
    for part in filter(None, (s.strip() for s in str(text).split(","))):
        if "=" not in part:
            raise SpecError("plan", f"expected key=value, got {part!r}")
        key, value = (s.strip() for s in part.split("=", 1))
        key = key.lower()
        if key not in PLAN_FIELDS:
            raise SpecError("plan", f"unknown key {key!r}; known keys: {', '.join(PLAN_FIELDS)}")
        if key in out:
            raise SpecError(f"plan.{key}", "given twice")
        if key == "recompute":
            out[key] = Recompute.parse(value, f"plan.{key}")
        elif key == "sp":
            if value.lower() not in _BOOL:
                raise SpecError("plan.sp", f"expected true or false, got {value!r}")
            out[key] = _BOOL[value.lower()]
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise SpecError(f"plan.{key}", f"expected an integer, got {value!r}") from None
    return out


@dataclass(frozen=True)
class PlanBatch:
    """K plans as parallel numpy int32 arrays (one per knob), the cost model's input."""
    arrays: dict

    def __post_init__(self):
        missing = [f for f in PLAN_FIELDS if f not in self.arrays]
        if missing:
            raise ValueError(f"PlanBatch is missing {missing}")

    def __len__(self) -> int:
        return int(np.asarray(self.arrays["tp"]).shape[0])

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    @classmethod
    def from_plans(cls, plans) -> "PlanBatch":
        plans = list(plans)
        arrays = {f: np.array([int(getattr(p, f)) for p in plans], dtype=np.int32) for f in PLAN_FIELDS}
        return cls(arrays)

    def select(self, index) -> "PlanBatch":
        return PlanBatch({k: np.asarray(v)[index] for k, v in self.arrays.items()})

    def plan(self, i: int) -> Plan:
        v = {f: int(np.asarray(self.arrays[f])[i]) for f in PLAN_FIELDS}
        v["recompute"] = Recompute(v["recompute"])
        v["sp"] = bool(v["sp"])
        return Plan(**v)
