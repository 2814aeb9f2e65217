"""Which search strategy runs: exhaustive when the legal space is small enough, Optuna otherwise.

No Optuna import here: the CLI decides before importing it (0.1-0.3 s), so an exhaustive search never
loads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from costmodels.specs import SpecError
from search_spaces.optuna_space import GpuRange, parse_gpus

from .objectives import parse_objectives

#: `auto` searches exhaustively up to this many legal plans (enumerating and scoring take ~0.8 s per 10^6 plans on
#: 2 CPU cores; one GPU count is not counted first: the exhaustive search stops past the limit), for one GPU count
#: or summed over the counts of a range. 3 M until the exhaustive search took
#: uneven pipeline stages: DeepSeek-V3 on 2,048 H800 then had 4.1 M legal plans, scored in 4.1 s, where the
#: Optuna search it fell back to found a plan 53 % slower than the exhaustive best (45.8 s against 29.9 s)
AUTO_EXHAUSTIVE_MAX = 5_000_000
#: the objectives whose best plan the exhaustive table gives (seeded into a new study)
THROUGHPUT = (("tokens_per_s",), ("step_time",))


@dataclass(frozen=True)
class StrategyChoice:
    strategy: str            # "exhaustive" or "optuna"
    reason: str
    legal: int | None = None

    def as_dict(self) -> dict:
        return {"chosen": self.strategy, "reason": self.reason, "legal_plans": self.legal}


def choose_strategy(requested: str, *, gpus, objectives=("tokens_per_s",), persistent: bool = False,
                    sampler_given: bool = False, count_legal: Callable[[], int] | None = None,
                    threshold: int = AUTO_EXHAUSTIVE_MAX) -> StrategyChoice:
    """exhaustive | optuna | auto -> the strategy to run, and why.

    auto picks exhaustive with no study storage and a legal space of at most `threshold` plans
    (scored in a few seconds): one GPU count with the throughput objective, or every count of a range
    with one or two objectives (`count_legal` sums the range); Optuna otherwise."""
    req = str(requested).strip().lower()
    if req not in ("exhaustive", "optuna", "auto"):
        raise SpecError("strategy", f"unknown strategy {requested!r}; choose exhaustive, optuna or auto")
    g = parse_gpus(gpus) if gpus is not None else None
    objs = parse_objectives(objectives)
    is_range = isinstance(g, GpuRange)
    if req == "exhaustive":
        if is_range and len(objs) > 2:
            raise SpecError("objective", "an exhaustive range search takes one or two objectives; use --strategy optuna")
        if not is_range and objs not in THROUGHPUT:
            raise SpecError("objective", "exhaustive ranks plans by throughput only; use --strategy optuna "
                            "for other or several objectives")
        return StrategyChoice("exhaustive", "requested")
    if req == "optuna":
        return StrategyChoice("optuna", "requested")
    if persistent:
        return StrategyChoice("optuna", "a study storage or name was given")
    if sampler_given:
        return StrategyChoice("optuna", "a sampler was given")
    if is_range and len(objs) > 2:
        return StrategyChoice("optuna", f"the GPU count is a range ({g}) and {len(objs)} objectives")
    if not is_range and objs not in THROUGHPUT:
        return StrategyChoice("optuna", f"objectives {', '.join(objs)} (exhaustive ranks by throughput only)")
    n = count_legal() if count_legal is not None else 0
    what = f"{n:,} legal plans" + (f" over the GPU counts of {g}" if is_range else "")
    if n <= threshold:
        return StrategyChoice("exhaustive", f"{what} <= {threshold:,}: scored in a few seconds", n)
    return StrategyChoice("optuna", f"{what} > {threshold:,}", n)
