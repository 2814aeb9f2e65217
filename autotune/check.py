"""A gate for CI (issue 13): does this plan still fit with headroom, reach an MFU floor, and keep the
throughput of a saved baseline? `check_plan` scores the plan with the current cost model and returns
one Condition per rule; the CLI (`autotune check`) exits 0 when all hold, 1 when one fails.

Baselines are saved search reports (their `best` plan) or `autotune check --json` outputs (their
`prediction`); throughput is compared as tokens/s of the whole job.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from typing import TYPE_CHECKING

from costmodels.plan import Plan, format_plan
from costmodels.specs import SpecError
from search_spaces.space import Problem

if TYPE_CHECKING:                  # JAX is imported when a plan is scored, not by the CLI's start-up
    from costmodels.params import EfficiencyParams

#: the share of GPU memory a plan may use: 1 - search's default memory headroom (autotune.headroom, 5 %),
#: so what `search` recommends passes `check` on defaults
DEFAULT_MAX_MEMORY_FRAC = 0.95
DEFAULT_MAX_REGRESSION = 0.03


@dataclass(frozen=True)
class Condition:
    name: str            # memory | fits | mfu | regression
    ok: bool
    value: float
    threshold: float
    message: str         # one line with the numbers

    def as_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, "value": self.value, "threshold": self.threshold,
                "message": self.message}


@dataclass(frozen=True)
class CheckResult:
    plan: str
    conditions: tuple
    prediction: dict

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.conditions)

    @property
    def failed(self) -> tuple:
        return tuple(c for c in self.conditions if not c.ok)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "plan": self.plan, "conditions": [c.as_dict() for c in self.conditions],
                "failed": [c.message for c in self.failed], "prediction": self.prediction}


def parse_fraction(text, field_name: str) -> float:
    """'3%' or '0.03' -> 0.03; a fraction in [0, 1)."""
    s = str(text).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(%?)", s)
    if not m:
        raise SpecError(field_name, f"expected a fraction such as 0.03 or a percentage such as 3%, got {s!r}")
    x = float(m.group(1)) / (100.0 if m.group(2) else 1.0)
    if not 0.0 <= x < 1.0:
        raise SpecError(field_name, f"must be in [0, 1) (or 0-100 %), got {s!r}")
    return x


def baseline_tokens_per_s(doc: dict, source: str = "baseline") -> float:
    """Throughput of a baseline: a search report's best plan or a check output's prediction."""
    for key in ("prediction", "best"):
        entry = doc.get(key) if isinstance(doc, dict) else None
        if isinstance(entry, dict) and isinstance(entry.get("tokens_per_s"), (int, float)):
            if entry["tokens_per_s"] > 0:
                return float(entry["tokens_per_s"])
    raise SpecError("baseline", f"{source} has no positive tokens_per_s under 'best' (a search report) or "
                    "'prediction' (an `autotune check --json` output)")


def _memory_condition(rep: dict, max_frac: float) -> Condition:
    mem = rep["memory_gb"]
    frac = mem["total"] / mem["limit"] if mem["limit"] > 0 else float("inf")
    ok = frac <= max_frac
    msg = (f"memory: {mem['total']:.1f} GB per GPU is {frac:.1%} of the {mem['limit']:.1f} GB limit "
           f"({'within' if ok else 'above'} --max-memory-frac {max_frac:.2f} = {max_frac * mem['limit']:.1f} GB)")
    return Condition("memory", ok, frac, max_frac, msg)


def _mfu_condition(rep: dict, min_mfu: float) -> Condition:
    ok = rep["mfu"] >= min_mfu
    return Condition("mfu", ok, rep["mfu"], min_mfu,
                     f"mfu: {rep['mfu']:.1%} is {'at or above' if ok else 'below'} --min-mfu {min_mfu:.1%}")


def _regression_condition(rep: dict, base_tps: float, max_regression: float) -> Condition:
    change = rep["tokens_per_s"] / base_tps - 1.0
    ok = -change <= max_regression
    return Condition("regression", ok, -change, max_regression,
                     f"regression: {rep['tokens_per_s']:,.0f} tokens/s vs baseline {base_tps:,.0f} ({change:+.1%}; "
                     f"{'within' if ok else 'beyond'} --max-regression {max_regression:.1%})")


def check_plan(problem: Problem, plan: Plan, *, max_memory_frac: float = DEFAULT_MAX_MEMORY_FRAC,
               min_mfu: float | None = None, baseline: dict | None = None,
               max_regression: float = DEFAULT_MAX_REGRESSION, params: EfficiencyParams | None = None,
               memory_limit_gb: float | None = None, baseline_source: str = "baseline") -> CheckResult:
    """Score `plan` (already legal for `problem`) and test each condition."""
    if not 0.0 < max_memory_frac <= 1.0:
        raise SpecError("max-memory-frac", f"must be in (0, 1], got {max_memory_frac!r}")
    if min_mfu is not None and not 0.0 <= min_mfu < 1.0:
        raise SpecError("min-mfu", f"must be in [0, 1), got {min_mfu!r}")
    base_tps = baseline_tokens_per_s(baseline, baseline_source) if baseline is not None else None
    from .search import predict
    rep = predict(problem, plan, params, memory_limit_gb)
    conds = [_memory_condition(rep, max_memory_frac)]
    if min_mfu is not None:
        conds.append(_mfu_condition(rep, min_mfu))
    if base_tps is not None:
        conds.append(_regression_condition(rep, base_tps, max_regression))
    return CheckResult(plan=format_plan(plan), conditions=tuple(conds), prediction=rep)
