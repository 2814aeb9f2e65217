"""Reading finished trials of an autotune study: metrics, the best plans, the Pareto front.

Below both the search (`optuna_search`) and the study commands (`studies`), so neither imports
the other.
"""
from __future__ import annotations

import math
from collections import Counter

import optuna
from optuna.trial import TrialState

from .objectives import OBJECTIVES


def metrics(t) -> dict:
    """A trial's metrics (user attribute "metrics": gpus, step_time_s, tokens_per_s,
    tokens_per_s_per_gpu, cost_gpu_h, memory_gb, memory_limit_gb, fits, memory_gb_over)."""
    return t.user_attrs.get("metrics") or {}


def feasible(trials) -> list:
    return [t for t in trials if t.state == TrialState.COMPLETE and metrics(t).get("fits")
            and "plan" in t.user_attrs]


def plan_key(t) -> tuple:
    return (metrics(t).get("gpus"),) + tuple(sorted((k, str(v)) for k, v in t.user_attrs["plan"].items()))


def one_per_plan(trials: list) -> list:
    """The first trial of each distinct plan, in the given order."""
    out, seen = [], set()
    for t in trials:
        key = plan_key(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def best_trials(study: optuna.Study, objectives, k: int = 10) -> list:
    """The k best feasible trials by the first objective, one per distinct plan."""
    obj = OBJECTIVES[objectives[0]] if objectives and objectives[0] in OBJECTIVES else OBJECTIVES["tokens_per_s"]
    trials = feasible(study.get_trials(deepcopy=False))
    sign = -1.0 if obj.direction == "maximize" else 1.0
    trials.sort(key=lambda t: (sign * float(metrics(t).get(obj.metric, math.nan)), t.number))
    return one_per_plan(trials)[:k]


def pareto_trials(study: optuna.Study) -> list:
    """Optuna's Pareto front (feasible trials only), one trial per distinct plan."""
    front = [t for t in study.best_trials if metrics(t).get("fits")]
    front.sort(key=lambda t: tuple(t.values))
    return one_per_plan(front)


def count_states(study: optuna.Study) -> dict:
    c = Counter(t.state for t in study.get_trials(deepcopy=False))
    return {s.name.lower(): c.get(s, 0) for s in (TrialState.COMPLETE, TrialState.RUNNING,
                                                   TrialState.FAIL, TrialState.PRUNED, TrialState.WAITING)}
