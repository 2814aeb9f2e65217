"""The plan knobs as Optuna distributions, sampled define-by-run so that no illegal plan is proposed.

Everything here derives from `search_spaces.space`: the knobs and their order (`KNOBS`, dp derived),
their candidate values (`domains`), and legality (`RULES`, through `enumerate_legal`). Nothing
restates a rule.

How a trial is sampled (one GPU count, or a GPU range where the count is the first knob):

1. Each knob has one fixed Optuna distribution for the whole study: `IntDistribution(low, high,
   log)` over the span of its domain (log scale when the domain spans a factor >= 4, e.g. tp 1..64;
   linear for recompute 0..2, sp 0..1, zero 0..3; recompute holds `Recompute` enum values). Fixed
   distributions keep multivariate TPE, NSGA-II and CMA-ES working on the whole space.
2. The knobs are suggested in `KNOBS` order (gpus first when it is a range): tp, cp, pp, ep, etp,
   vpp, mbs, recompute, sp, zero. Given the knobs chosen so far, the legal values of the next one
   are those that some legal plan has with the same prefix (so every prefix extends to a legal plan,
   never a dead end): a lookup in the lexicographically sorted table of legal plans.
3. `LegalSampler` wraps any Optuna sampler and projects each value it proposes onto the nearest legal
   value (in log space for log knobs) before Optuna records it. So every recorded trial parameter is
   a legal plan's value; the base sampler still learns from real knob values.

A GPU range ("256-2048") is a `GpuRange`: by default the counts in it that are whole nodes (a
multiple of the node size, or a divisor of it below one node); "256-2048:64" takes every 64th count
(a multiple of the node size); "256-2048:pow2" takes the powers of two in the range.
"""
from __future__ import annotations

import functools
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, IntDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial

from costmodels.plan import PLAN_FIELDS, PlanBatch
from costmodels.specs import SpecError

from .space import KNOBS, OPTUNA_ONLY_KNOBS, Problem, SpaceStats, domains, enumerate_legal, legal_values_of

#: The parameter name of the GPU count when it is a knob.
GPUS = "gpus"
#: The sampled plan knobs, in sampling order (dp is derived: gpus / (tp*cp*pp)).
SAMPLED = tuple(k for k in KNOBS if k != "dp")
#: the knobs held in the table of legal plans; the Optuna-only knobs come after them and their
#: legal values are found by the rules, given the rest of the plan
TABLE_KNOBS = tuple(k for k in SAMPLED if k not in OPTUNA_ONLY_KNOBS)
assert SAMPLED[:len(TABLE_KNOBS)] == TABLE_KNOBS
#: How far (in layers) a local move takes an Optuna-only knob (besides back to 0)
EXTRA_STEPS = 2
#: How many per-count tables of legal plans stay in memory (a GPU range may visit many counts).
TABLE_CACHE = 32


# ------------------------------------------------------------------------------------------------
# The GPU count: one number or a range
# ------------------------------------------------------------------------------------------------

_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*(?::\s*([A-Za-z0-9]+)\s*)?$")


@dataclass(frozen=True)
class GpuRange:
    """GPU counts from `low` to `high`: whole nodes, every `step`-th count, or the powers of two."""
    low: int
    high: int
    step: int | None = None          # None: whole nodes (multiples of the node size)
    pow2: bool = False

    def __str__(self) -> str:
        suffix = ":pow2" if self.pow2 else (f":{self.step}" if self.step else "")
        return f"{self.low}-{self.high}{suffix}"

    def counts(self, node_size: int) -> tuple[int, ...]:
        """The GPU counts of the range for nodes of `node_size` GPUs (an error names the field)."""
        if self.pow2:
            out = [1 << k for k in range(0, 31) if self.low <= (1 << k) <= self.high]
            rule = "powers of two"
        elif self.step:
            if self.step % node_size and self.high > node_size:
                raise SpecError("gpus", f"range step {self.step} must be a multiple of the node size "
                                f"{node_size} (whole nodes), e.g. {str(GpuRange(self.low, self.high, node_size))}")
            first = -(-self.low // self.step) * self.step
            out = list(range(max(first, self.step), self.high + 1, self.step))
            rule = f"multiples of {self.step}"
        else:
            out = [c for c in range(self.low, min(self.high, node_size - 1) + 1) if node_size % c == 0]
            first = -(-max(self.low, node_size) // node_size) * node_size
            out += list(range(first, self.high + 1, node_size))
            rule = f"whole nodes of {node_size} GPUs"
        if not out:
            raise SpecError("gpus", f"the range {self} holds no GPU count ({rule}); widen it, e.g. "
                            f"{self.low}-{max(self.high, self.low + 2 * node_size)}")
        return tuple(out)


def parse_gpus(text, field_name: str = "gpus") -> int | GpuRange:
    """An integer GPU count, or a range "LOW-HIGH", "LOW-HIGH:STEP" or "LOW-HIGH:pow2"."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise SpecError(field_name, f"must be a positive integer, got {text}")
        return text
    s = str(text).strip()
    if s.isdigit():
        return parse_gpus(int(s), field_name)
    m = _RANGE.match(s)
    if not m:
        raise SpecError(field_name, f"expected a GPU count (512) or a range (256-2048, 256-2048:64, "
                        f"256-2048:pow2), got {text!r}")
    low, high, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
    if low < 1 or low > high:
        raise SpecError(field_name, f"the range {s} is empty: give LOW-HIGH with 1 <= LOW <= HIGH")
    if suffix is None:
        return GpuRange(low, high)
    if suffix.lower() in ("pow2", "x2"):
        return GpuRange(low, high, pow2=True)
    if suffix.isdigit() and int(suffix) > 0:
        return GpuRange(low, high, step=int(suffix))
    raise SpecError(field_name, f"unknown range step {suffix!r} in {s}; use a positive integer or pow2")


# ------------------------------------------------------------------------------------------------
# Legal plans of one GPU count, sorted for prefix look-ups
# ------------------------------------------------------------------------------------------------

class _Table:
    """The legal plans of one problem as int16 rows in TABLE_KNOBS order, sorted lexicographically
    (the Optuna-only knobs at their enumeration value: 0, or the value the user fixed).

    With the first j knobs fixed, the rows form one contiguous slice and column j inside it is
    sorted, so the legal values of the next knob are the distinct values of that slice.
    """

    def __init__(self, problem: Problem, fixed: dict | None):
        stream, stats = enumerate_legal(problem, fixed)
        parts = [np.stack([np.asarray(b[k], dtype=np.int16) for k in TABLE_KNOBS], axis=1) for b in stream]
        rows = np.concatenate(parts) if parts else np.empty((0, len(TABLE_KNOBS)), dtype=np.int16)
        order = np.lexsort(rows.T[::-1]) if len(rows) else np.empty(0, dtype=np.int64)
        self.rows = rows[order]
        self.stats: SpaceStats = stats
        self._cache: dict = {}

    def __len__(self) -> int:
        return len(self.rows)

    def narrow(self, lo: int, hi: int, j: int, value: int) -> tuple[int, int]:
        col = self.rows[lo:hi, j]
        return lo + int(np.searchsorted(col, value, "left")), lo + int(np.searchsorted(col, value, "right"))

    def slice_of(self, prefix: tuple) -> tuple[int, int]:
        """Rows whose first len(prefix) knobs equal `prefix` (cached)."""
        if not prefix:
            return 0, len(self.rows)
        hit = self._cache.get(prefix)
        if hit is None:
            lo, hi = self.slice_of(prefix[:-1])
            hit = self.narrow(lo, hi, len(prefix) - 1, prefix[-1]) if hi > lo else (lo, lo)
            self._cache[prefix] = hit
        return hit

    def values(self, prefix: tuple) -> np.ndarray:
        """Legal values of knob number len(prefix) after `prefix`, sorted."""
        lo, hi = self.slice_of(prefix)
        col = self.rows[lo:hi, len(prefix)]
        if len(col) == 0:
            return col
        return col[np.concatenate(([True], col[1:] != col[:-1]))]

    def batch(self, gpus: int, extras: dict) -> PlanBatch:
        arrays = {k: self.rows[:, i].astype(np.int32) for i, k in enumerate(TABLE_KNOBS)}
        arrays.update({k: np.full(len(self.rows), int(v), dtype=np.int32) for k, v in extras.items()})
        arrays["dp"] = (gpus // (arrays["tp"] * arrays["cp"] * arrays["pp"])).astype(np.int32)
        return PlanBatch({f: arrays[f] if f in arrays else np.zeros(len(arrays["tp"]), dtype=np.int32) for f in PLAN_FIELDS})


def _nearest(values: np.ndarray, x: float, log: bool) -> int:
    """The element of sorted `values` nearest to x (in log space if `log`); ties go to the smaller."""
    v = values.astype(np.float64)
    if log:
        d = np.abs(np.log(np.maximum(v, 1e-9)) - math.log(max(float(x), 1e-9)))
    else:
        d = np.abs(v - float(x))
    return int(values[int(np.argmin(d))])


class IllegalParams(ValueError):
    """Trial parameters (e.g. enqueued by hand) that are not a legal plan."""


# ------------------------------------------------------------------------------------------------
# The space
# ------------------------------------------------------------------------------------------------

@dataclass
class PlanSpace:
    """The legal plans of one problem, or of one problem per GPU count of a range, for Optuna.

    `problem_for(n)` builds the problem for n GPUs; `counts` are the GPU counts (one for a fixed
    cluster); `fixed` pins knobs to one value (as in `enumerate_legal`).
    """
    problem_for: Callable[[int], Problem]
    counts: tuple
    fixed: dict = field(default_factory=dict)
    distributions: dict = field(init=False)      # param name -> IntDistribution (sampling order)
    constants: dict = field(init=False)          # knobs with a single value in every count
    _tables: OrderedDict = field(init=False, default_factory=OrderedDict)
    _problems: dict = field(init=False, default_factory=dict)
    _nonempty: dict = field(init=False, default_factory=dict)
    _neighbors: dict = field(init=False, default_factory=dict)
    _domain_cache: dict = field(init=False, default_factory=dict)
    _extra_cache: OrderedDict = field(init=False, default_factory=OrderedDict)

    def __post_init__(self):
        self.counts = tuple(sorted(set(int(c) for c in self.counts)))
        if not self.counts:
            raise SpecError("gpus", "no GPU count to search")
        values: dict = {k: set() for k in SAMPLED}
        for n in self.counts:
            for k, dom in domains(self.problem(n), self.fixed, optuna_only=True).items():
                values[k].update(dom)
        self.distributions = {}
        self.constants = {}
        if self.is_range:
            self.distributions[GPUS] = _int_distribution(self.counts)
        for k in SAMPLED:
            vals = sorted(values[k])
            if len(vals) == 1:
                self.constants[k] = vals[0]
            else:
                self.distributions[k] = _int_distribution(vals)

    @classmethod
    def single(cls, problem: Problem, fixed: dict | None = None) -> "PlanSpace":
        n = problem.cluster.num_gpus
        return cls(problem_for=lambda _n: problem, counts=(n,), fixed=dict(fixed or {}))

    # ---- problems and tables ----
    @property
    def is_range(self) -> bool:
        return len(self.counts) > 1

    def problem(self, n: int) -> Problem:
        if n not in self._problems:
            self._problems[n] = self.problem_for(n)
        return self._problems[n]

    def table(self, n: int) -> _Table:
        t = self._tables.get(n)
        if t is None:
            t = _Table(self.problem(n), self.fixed)
            self._tables[n] = t
            self._nonempty[n] = len(t) > 0
            while len(self._tables) > TABLE_CACHE:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(n)
        return t

    def has_legal(self, n: int) -> bool:
        if n not in self._nonempty:
            self.table(n)
        return self._nonempty[n]

    def stats(self, n: int) -> SpaceStats:
        return self.table(n).stats

    def legal_plans(self, n: int) -> PlanBatch:
        """Every legal plan for n GPUs (the same set as `enumerate_legal`), sorted."""
        return self.table(n).batch(n, self.enumerated_extras())

    def enumerated_extras(self) -> dict:
        """The Optuna-only knobs as enumeration holds them: fixed by the user, else 0."""
        return {k: int(self.fixed.get(k, 0)) for k in OPTUNA_ONLY_KNOBS}

    def known_stats(self) -> dict:
        """Space statistics summed over the GPU counts whose plans were enumerated so far."""
        total = legal = 0
        illegal: dict = {}
        seen = [n for n in self.counts if n in self._nonempty]
        for n in seen:
            if n in self._tables:
                st = self._tables[n].stats
                total += st.total
                legal += st.legal
                for k, v in (st.illegal or {}).items():
                    illegal[k] = illegal.get(k, 0) + v
        return {"total": total, "legal": legal, "illegal": dict(sorted(illegal.items())),
                "gpu_counts": len(self.counts), "gpu_counts_enumerated": len(seen)}

    # ---- legal values, projection, define-by-run ----
    def param_names(self) -> tuple:
        return tuple(self.distributions)

    def _split(self, params: dict) -> tuple[int | None, tuple]:
        """(gpu count or None, prefix of knob values in SAMPLED order) from partial params."""
        if self.is_range:
            if GPUS not in params:
                return None, ()
            n = int(params[GPUS])
        else:
            n = self.counts[0]
        prefix = []
        for k in SAMPLED:
            if k in self.constants:
                prefix.append(self.constants[k])
            elif k in params:
                prefix.append(int(params[k]))
            else:
                break
        return n, tuple(prefix)

    def legal_values(self, name: str, params: dict) -> np.ndarray:
        """Legal values of knob `name` given the knobs before it in `params` (sampling order)."""
        if name == GPUS:
            return np.array([n for n in self.counts if self.has_legal(n)], dtype=np.int64)
        n, prefix = self._split(params)
        j = SAMPLED.index(name)
        if n is None or len(prefix) < j:
            missing = [k for k in (((GPUS,) if self.is_range else ()) + SAMPLED[:j])
                       if k not in params and k not in self.constants]
            raise IllegalParams(f"{name} is sampled after {', '.join(missing)}")
        if name in OPTUNA_ONLY_KNOBS:
            return self._extra_values(n, name, prefix[:j])
        return self.table(n).values(prefix[:j]).astype(np.int64)

    def _extra_values(self, n: int, name: str, prefix: tuple) -> np.ndarray:
        """Legal values of an Optuna-only knob after a whole table plan and the extras before it:
        every rule checked on the candidates (later extras at 0, which is always legal)."""
        key = (n, name, prefix)
        hit = self._extra_cache.get(key)
        if hit is not None:
            return hit
        k = len(TABLE_KNOBS)
        lo, hi = self.table(n).slice_of(prefix[:k])
        if hi <= lo:
            out = np.empty(0, dtype=np.int64)
        else:
            plan = dict(zip(SAMPLED, prefix))
            plan.update({kn: 0 for kn in SAMPLED[len(prefix):]})
            plan["dp"] = n // (plan["tp"] * plan["cp"] * plan["pp"])
            out = legal_values_of(name, plan, self.problem(n), self._domain_values(name))
        self._extra_cache[key] = out
        while len(self._extra_cache) > 65536:
            self._extra_cache.popitem(last=False)
        return out

    def project(self, name: str, value, params: dict) -> int:
        """The legal value of `name` nearest to `value`, given the knobs before it."""
        if name == GPUS:
            return self._project_gpus(value)
        legal = self.legal_values(name, params)
        if len(legal) == 0:
            raise IllegalParams(f"no legal value of {name} after {params}")
        return _nearest(legal, value, self.distributions[name].log if name in self.distributions else False)

    def _project_gpus(self, value) -> int:
        order = sorted(self.counts, key=lambda c: (abs(math.log(c) - math.log(max(float(value), 1.0))), c))
        for n in order:
            if self.has_legal(n):
                return n
        raise IllegalParams("no GPU count of the range has a legal plan")

    def project_params(self, params: dict) -> dict:
        """Project a joint proposal knob by knob, in sampling order; stop at the first missing knob
        (the knobs after it depend on it and are sampled on their own)."""
        out: dict = {}
        for name in self.distributions:
            if name not in params:
                break
            out[name] = self.project(name, params[name], out)
        return out

    def suggest(self, trial: optuna.trial.BaseTrial) -> tuple[int, dict]:
        """Define-by-run: suggest every knob in order; returns (gpu count, plan knobs incl. dp).

        With `LegalSampler` every suggested value is legal already; a value that is not (a trial
        enqueued by hand) raises IllegalParams.
        """
        values: dict = {}
        for name, dist in self.distributions.items():
            values[name] = trial.suggest_int(name, dist.low, dist.high, log=dist.log)
            legal = self.legal_values(name, values)
            if int(values[name]) not in set(legal.tolist()):
                raise IllegalParams(f"{name}={values[name]} is not legal here; legal: {legal.tolist()}")
        return self.plan_from_params(values)

    def plan_from_params(self, params: dict) -> tuple[int, dict]:
        n = int(params[GPUS]) if self.is_range else self.counts[0]
        plan = {k: int(params[k]) if k in params else int(self.constants.get(k, 0)) for k in SAMPLED}
        plan["dp"] = n // (plan["tp"] * plan["cp"] * plan["pp"])
        return n, {f: plan.get(f, 0) for f in PLAN_FIELDS}

    def params_of(self, n: int, plan: dict) -> dict:
        """Trial parameters of a plan (the inverse of `plan_from_params`)."""
        out = {GPUS: int(n)} if self.is_range else {}
        out.update({k: int(plan.get(k, 0)) for k in SAMPLED if k in self.distributions})
        return out

    def is_legal(self, params: dict) -> bool:
        """Whether complete trial parameters are a legal plan."""
        n, prefix = self._split(params)
        if n is None or n not in self.counts or len(prefix) < len(SAMPLED) or not self.has_legal(n):
            return False
        lo, hi = self.table(n).slice_of(prefix[:len(TABLE_KNOBS)])
        if hi <= lo:
            return False
        return all(prefix[j] in set(self._extra_values(n, name, prefix[:j]).tolist())
                   for j, name in enumerate(SAMPLED) if name in OPTUNA_ONLY_KNOBS)

    def neighbors(self, params: dict) -> list[tuple[int, dict]]:
        """Legal plans reached by moving one or two knobs of `params`, with the move's distance.

        A move sets one or two knobs to other values of their domains; the knobs after them that
        the move made illegal are repaired to their nearest legal value (pp 2 -> 1 takes vpp to 1).
        The distance counts the domain steps of the moved knobs (tp 4 -> 8 is one step, mbs 8 -> 4
        two: 8, 6, 4) plus, as a tie-break fraction, the steps of the repairs. Two-knob moves reach
        plans no single move reaches (cp down with mbs down, pp down with zero up). Sorted by
        distance, one entry per plan (cached per plan)."""
        names = list(self.distributions)
        base = {k: int(params[k]) for k in names}
        key = tuple(base[k] for k in names)
        hit = self._neighbors.get(key)
        if hit is not None:
            return hit
        dom = {k: self._domain_values(k) for k in names}
        pos = {k: int(np.searchsorted(dom[k], base[k])) for k in names}
        best: dict = {}

        def consider(moved: dict, steps: int) -> None:
            got = self.move(base, moved)
            if got is None:
                return
            cand, repair = got
            ck = tuple(cand[k] for k in names)
            if ck == key:
                return
            d = steps + repair / 100.0
            if ck not in best or d < best[ck][0]:
                best[ck] = (d, cand)

        # the Optuna-only knobs (domains of ~L/2 layer counts, 0 = even split / every layer) move
        # alone: from 0 to the largest legal values (one chunk below the even split first), else
        # back to 0 or up to EXTRA_STEPS values either way; the table knobs move alone or in pairs
        for ka in names:
            if ka not in OPTUNA_ONLY_KNOBS:
                continue
            top = len(dom[ka]) - 1
            for ia, va in enumerate(dom[ka]):
                if ia == pos[ka]:
                    continue
                if base[ka] == 0:
                    consider({ka: int(va)}, 1 + (top - ia) / 10.0)
                elif va == 0 or abs(ia - pos[ka]) <= EXTRA_STEPS:
                    consider({ka: int(va)}, 1 if va == 0 else abs(ia - pos[ka]))
        table_names = [k for k in names if k not in OPTUNA_ONLY_KNOBS]
        for a, ka in enumerate(table_names):
            for ia, va in enumerate(dom[ka]):
                if ia == pos[ka]:
                    continue
                da = abs(ia - pos[ka])
                consider({ka: int(va)}, da)
                for kb in table_names[a + 1:]:
                    for ib, vb in enumerate(dom[kb]):
                        if ib != pos[kb]:
                            consider({ka: int(va), kb: int(vb)}, da + abs(ib - pos[kb]))
        out = sorted(best.values(), key=lambda dc: dc[0])
        if len(self._neighbors) > 4096:
            self._neighbors.clear()
        self._neighbors[key] = out
        return out

    def move(self, base: dict, moved: dict) -> tuple[dict, int] | None:
        """`base` with the knobs in `moved` set, and the later knobs this makes illegal repaired to
        their nearest legal value: (plan params, domain steps of the repairs), or None if a moved
        value is not legal there."""
        cand: dict = {}
        repair = 0
        for k in self.distributions:
            legal = self.legal_values(k, cand)
            if len(legal) == 0:
                return None
            if k in moved:
                if int(moved[k]) not in legal:
                    return None
                cand[k] = int(moved[k])
            elif int(base[k]) in legal:
                cand[k] = int(base[k])
            else:
                cand[k] = _nearest(legal, base[k], self.distributions[k].log)
                dom = self._domain_values(k)
                repair += abs(int(np.searchsorted(dom, cand[k])) - int(np.searchsorted(dom, int(base[k]))))
        return cand, repair

    def pattern_move(self, parent: dict, child: dict) -> dict | None:
        """Hooke-Jeeves' pattern move: repeat the step parent -> child once more (in domain steps)."""
        moved = {}
        for k in self.distributions:
            dom = self._domain_values(k)
            i0, i1 = int(np.searchsorted(dom, int(parent[k]))), int(np.searchsorted(dom, int(child[k])))
            if i1 != i0:
                moved[k] = int(dom[min(max(2 * i1 - i0, 0), len(dom) - 1)])
        if not moved:
            return None
        got = self.move(child, moved)
        return None if got is None else got[0]

    def _domain_values(self, name: str) -> np.ndarray:
        hit = self._domain_cache.get(name)
        if hit is not None:
            return hit
        self._domain_cache[name] = out = self._domain_values_uncached(name)
        return out

    def _domain_values_uncached(self, name: str) -> np.ndarray:
        if name == GPUS:
            return np.asarray(self.counts, dtype=np.int64)
        vals: set = set()
        for n in self.counts:
            vals.update(domains(self.problem(n), self.fixed, optuna_only=True)[name])
        return np.asarray(sorted(vals), dtype=np.int64)

    def iter_legal(self) -> Iterator[tuple[int, PlanBatch]]:
        for n in self.counts:
            if self.has_legal(n):
                yield n, self.legal_plans(n)


def _int_distribution(values) -> IntDistribution:
    lo, hi = int(min(values)), int(max(values))
    return IntDistribution(lo, hi, log=bool(lo >= 1 and hi >= 4 * lo))


# ------------------------------------------------------------------------------------------------
# Samplers that never propose an illegal plan
# ------------------------------------------------------------------------------------------------

class LegalSampler(BaseSampler):
    """Wraps an Optuna sampler; every value it proposes is projected onto the legal plans.

    Two additions make a model-based sampler (TPE) find the needle-like optima of plan spaces (a
    handful of plans within 1% of the best among 10^4..10^6, usually right at the memory limit):

    - `retries`: when the base sampler proposes a plan some trial already has, ask it again (up to
      `retries` times), then take a local move or a random untried legal plan instead.
    - `refine` (a fraction in [0, 1)): that share of the trials after the first `refine_after` is
      not asked from the base sampler but is a move from one of the `refine_incumbents` best
      feasible plans so far to an untried neighbour (`PlanSpace.neighbors`: one or two knobs moved,
      the nearest first, ranked by TPE's own acquisition l(x)/g(x) when the base is TPE); after a
      move that improved the best plan, the same move is repeated once more (a Hooke-Jeeves pattern
      move). It is a local search that finishes what the global model finds (single objective
      only).
    - `surrogate`: rank all the untried one- and two-knob moves from the incumbents (not only the
      nearest) by a local model of the values told so far (`_local_surrogate`: additive in the
      knob values, fitted on the trials weighted by how few knobs they differ from the incumbent,
      `surrogate_tau`; one model per incumbent with `surrogate_per_incumbent`): expected
      improvement of the objective times the probability that memory fits. A two-knob move whose
      halves were seen (tp down: faster but over memory; mbs down: slower, less memory) is
      predicted from them, and the headroom of a feasible plan steers moves toward the limit.
      `surrogate_model="gp"` uses Gaussian processes instead (`_local_gp`), which also see knob
      interactions (pp 4 good with ep 1, bad with ep 2). Which trials refine depends only on the trial number: reproducible, and it works
      across workers sharing a study.
    """

    def __init__(self, base: BaseSampler, space: PlanSpace, *, refine: float = 0.0,
                 refine_after: int = 0, refine_incumbents: int = 4, seed: int | None = None,
                 retries: int = 0, surrogate: bool = False, surrogate_tau: float = 2.0,
                 surrogate_per_incumbent: bool = True, surrogate_model: str = "linear"):
        self.base = base
        self.retries = int(retries)
        self.space = space
        self.refine = float(refine)
        self.refine_after = int(refine_after)
        self.refine_incumbents = int(refine_incumbents)
        self.seed = seed
        self.surrogate = bool(surrogate)
        self.surrogate_tau = float(surrogate_tau)
        self.surrogate_per_incumbent = bool(surrogate_per_incumbent)
        if surrogate_model not in ("linear", "gp"):
            raise ValueError(f"surrogate_model must be 'linear' or 'gp', got {surrogate_model!r}")
        self.surrogate_model = surrogate_model
        self._model = (_local_gp if surrogate_model == "gp"
                       else functools.partial(_local_surrogate, tau=self.surrogate_tau))
        self._proposals: dict = {}
        self._origin: dict = {}         # plan (tuple) -> the incumbent it is a local move from
        self._snapshot: tuple = (None, [])

    def __str__(self) -> str:
        return f"Legal({self.base})"

    def infer_relative_search_space(self, study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self.base.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial: FrozenTrial, search_space: dict) -> dict:
        local = self._proposals.get(trial.number)
        if local is not None:
            return {k: v for k, v in local.items() if k in search_space}
        projected: dict = {}
        for attempt in range(1 + self.retries):
            proposal = self.base.sample_relative(study, trial, search_space)
            if not proposal:
                return {}
            projected = self.space.project_params(proposal)
            if len(projected) < len(self.space.distributions) or not self._tried(study, trial.number, projected):
                break
        else:
            if self.retries:        # the base sampler keeps repeating itself: try something new
                fresh = self._local_proposal(study, trial.number) or self._random_untried(study, trial.number)
                if fresh is not None:
                    self._proposals[trial.number] = fresh
                    projected = fresh
        return {k: v for k, v in projected.items() if k in search_space}

    def _trials(self, study, number: int) -> list:
        """The study's trials, read once per trial being sampled (a database query on RDB storage)."""
        if self._snapshot[0] != number:
            self._snapshot = (number, study.get_trials(deepcopy=False))
        return self._snapshot[1]

    def _tried_keys(self, study, number: int) -> set:
        names = tuple(self.space.distributions)
        tried = {tuple(t.params.get(k) for k in names) for t in self._trials(study, number) if t.params}
        return tried | {tuple(p[k] for k in names) for p in self._proposals.values()}

    def _tried(self, study, number: int, params: dict) -> bool:
        names = tuple(self.space.distributions)
        return tuple(params[k] for k in names) in self._tried_keys(study, number)

    def _random_untried(self, study, number: int) -> dict | None:
        rng = np.random.default_rng(None if self.seed is None else [self.seed, number, 1])
        tried = self._tried_keys(study, number)
        names = tuple(self.space.distributions)
        for _ in range(64):
            n = int(rng.choice([c for c in self.space.counts if self.space.has_legal(c)]))
            rows = self.space.table(n).rows
            row = rows[int(rng.integers(len(rows)))]
            params = self.space.params_of(n, {**self.space.enumerated_extras(),
                                              **{k: int(v) for k, v in zip(TABLE_KNOBS, row)}})
            if tuple(params[k] for k in names) not in tried:
                return params
        return None

    def sample_independent(self, study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution):
        local = self._proposals.get(trial.number)
        if local is not None and param_name in local:
            return local[param_name]
        value = self.base.sample_independent(study, trial, param_name, param_distribution)
        if param_name not in self.space.distributions:
            return value
        return self.space.project(param_name, value, trial.params)

    def before_trial(self, study, trial: FrozenTrial) -> None:
        self.base.before_trial(study, trial)
        if self._refines(trial.number) and len(study.directions) == 1:
            proposal = self._local_proposal(study, trial.number)
            if proposal is not None:
                self._proposals[trial.number] = proposal

    def after_trial(self, study, trial: FrozenTrial, state, values) -> None:
        self._proposals.pop(trial.number, None)
        self.base.after_trial(study, trial, state, values)

    def _refines(self, number: int) -> bool:
        if self.refine <= 0 or number < self.refine_after:
            return False
        # an even spread: trial k refines when floor(k * refine) steps up
        return math.floor((number + 1) * self.refine) > math.floor(number * self.refine)

    def _local_proposal(self, study, number: int) -> dict | None:
        from optuna.trial import TrialState
        if len(study.directions) != 1:
            return None
        trials = self._trials(study, number)
        names = tuple(self.space.distributions)
        tried = self._tried_keys(study, number)
        done = [t for t in trials if t.state == TrialState.COMPLETE and t.values
                and all(c <= 0 for c in t.constraints.values()) and set(names) <= set(t.params)]
        if len(done) < 1:
            return None
        sign = -1.0 if study.direction == optuna.study.StudyDirection.MAXIMIZE else 1.0
        done.sort(key=lambda t: (sign * t.values[0], t.number))
        rng = np.random.default_rng(None if self.seed is None else [self.seed, number])
        top = tuple(done[0].params[k] for k in names)
        parent = self._origin.get(top)
        if parent is not None:          # the best plan came from a local move: repeat that move
            cand = self.space.pattern_move(parent, done[0].params)
            if cand is not None and tuple(cand[k] for k in names) not in tried:
                self._origin[tuple(cand[k] for k in names)] = dict(done[0].params)
                return cand
        seen_inc: set = set()
        options: list = []             # (distance + rank of the incumbent, plan, incumbent)
        all_options: list = []         # every untried move, for the surrogate
        for t in done:
            key = tuple(t.params[k] for k in names)
            if key in seen_inc:
                continue
            rank = len(seen_inc)
            seen_inc.add(key)
            if rank >= self.refine_incumbents:
                break
            fresh = [(int(d) + rank, c, t.params) for d, c in self.space.neighbors(t.params)
                     if tuple(c[k] for k in names) not in tried]
            if fresh:
                options += [o for o in fresh if o[0] == fresh[0][0]]
                all_options += fresh
        if options:
            low = min(o[0] for o in options)
            nearest = [o for o in options if o[0] == low]
            pick = int(rng.integers(len(nearest)))
            scores = None
            if self.surrogate:          # a local model of the told values ranks every untried neighbour
                scores = self._surrogate_scores(trials, names, sign, done[0].params, all_options)
                if scores is not None:
                    d = np.array([o[0] for o in all_options], dtype=float)
                    pick = int(np.lexsort((d, -scores))[0])
                    nearest = all_options
            if scores is None:
                scores = _tpe_acquisition(self.base, study, number, self.space.distributions,
                                          [c for _, c, _ in nearest])
                if scores is not None:      # TPE's model ranks the nearest untried neighbours
                    pick = int(np.argmax(scores))
            _, cand, inc = nearest[pick]
            self._origin[tuple(cand[k] for k in names)] = dict(inc)
            return cand
        return None

    def _surrogate_scores(self, trials: list, names: tuple, sign: float, best: dict,
                          options: list) -> np.ndarray | None:
        """The local model (`_local_gp` or `_local_surrogate`) for (distance, plan, incumbent) options: one model centred on each
        incumbent for the moves from it (or one centred on the best plan for all)."""
        if not self.surrogate_per_incumbent:
            return self._model(self.space, trials, names, sign, best, [c for _, c, _ in options])
        scores = np.zeros(len(options))
        groups: dict = {}
        for i, (_, _, inc) in enumerate(options):
            groups.setdefault(tuple(inc[k] for k in names), []).append(i)
        for ids in groups.values():
            got = self._model(self.space, trials, names, sign, options[ids[0]][2], [options[i][1] for i in ids])
            if got is None:
                return None
            scores[ids] = got
        return scores

    def reseed_rng(self) -> None:
        self.base.reseed_rng()


def _trial_targets(t, sign: float) -> tuple[float, float | None] | None:
    """(objective to minimize, log memory over its limit or None) of a complete trial."""
    v = float(t.values[0])
    if not math.isfinite(v):
        return None
    y = sign * (math.log(v) if v > 0 else v)
    m = (t.user_attrs or {}).get("metrics") or {}
    mem, lim = m.get("memory_gb"), m.get("memory_limit_gb")
    if mem is not None and lim and mem > 0 and lim > 0 and math.isfinite(mem):
        return y, math.log(mem / lim)
    return y, None


_ERF = np.frompyfunc(math.erf, 1, 1)


def _norm_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _ERF(np.asarray(z, dtype=np.float64) / math.sqrt(2.0)).astype(np.float64))


def _norm_pdf(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * np.asarray(z, dtype=np.float64) ** 2) / math.sqrt(2.0 * math.pi)


def _told(trials: list, names: tuple, sign: float) -> tuple | None:
    """(plans as int rows, objective to minimize, log memory over limit or nan) of the complete
    trials, or None when fewer than 4."""
    from optuna.trial import TrialState
    rows, ys, ms = [], [], []
    for t in trials:
        if t.state != TrialState.COMPLETE or not t.values or not set(names) <= set(t.params):
            continue
        got = _trial_targets(t, sign)
        if got is None:
            continue
        rows.append([int(t.params[k]) for k in names])
        ys.append(got[0])
        ms.append(np.nan if got[1] is None else got[1])
    if len(rows) < 4:
        return None
    return np.asarray(rows, dtype=np.int64), np.asarray(ys), np.asarray(ms)


def _ei_times_fit(fit, y: np.ndarray, mem: np.ndarray) -> np.ndarray | None:
    """Expected improvement over the best feasible told value times the probability that memory
    fits, from `fit(targets, mask) -> (mean, sd)` at the candidates (None: too little data)."""
    got = fit(y, np.ones(len(y), bool))
    if got is None:
        return None
    mean, sd = got
    feasible = np.nan_to_num(mem, nan=0.0) <= 0
    best = float(y[feasible].min()) if feasible.any() else float(y.min())
    z = (best - mean) / sd
    ei = sd * _norm_pdf(z) + (best - mean) * _norm_cdf(z)
    mem_fit = fit(np.nan_to_num(mem), ~np.isnan(mem))
    if mem_fit is not None:
        mm, msd = mem_fit
        ei = ei * _norm_cdf(-mm / msd)
    return np.asarray(ei)


def _local_surrogate(space: "PlanSpace", trials: list, names: tuple, sign: float, center: dict,
                     candidates: list, tau: float = 2.0, alpha: float = 1.0) -> np.ndarray | None:
    """Expected improvement x probability of fitting memory, for candidate plans near `center`.

    Two Bayesian linear models over one-hot knob values (one for the objective in log space, one
    for log(memory / limit)), fitted on the study's complete trials weighted by exp(-k / tau) where
    k is how many knobs differ from `center`: a local additive model, so a two-knob move is
    predicted from the one-knob moves seen around the incumbent (tp down costs memory, mbs down
    gives it back). Only told values are used. None when there is too little data."""
    told = _told(trials, names, sign)
    if told is None:
        return None
    R, y, mem = told
    doms = [space._domain_values(k) for k in names]
    offs = np.cumsum([0] + [len(d) for d in doms])

    def encode(R: np.ndarray) -> np.ndarray:
        X = np.zeros((len(R), int(offs[-1])))
        for j, d in enumerate(doms):
            X[np.arange(len(R)), offs[j] + np.clip(np.searchsorted(d, R[:, j]), 0, len(d) - 1)] = 1.0
        return X

    c = np.array([int(center[k]) for k in names])
    w = np.exp(-(R != c).sum(1) / tau)
    X = encode(R)
    C = np.asarray([[int(p[k]) for k in names] for p in candidates], dtype=np.int64)
    Xc = encode(C)

    def fit(y: np.ndarray, mask: np.ndarray):
        if mask.sum() < 4:
            return None
        Xm, ym, wm = X[mask], y[mask], w[mask]
        mu0 = float(np.sum(wm * ym) / np.sum(wm))
        A = (Xm * wm[:, None]).T @ Xm + alpha * np.eye(X.shape[1])
        Ainv = np.linalg.inv(A)
        beta = Ainv @ ((Xm * wm[:, None]).T @ (ym - mu0))
        res = ym - mu0 - Xm @ beta
        s2 = max(float(np.sum(wm * res ** 2) / max(np.sum(wm), 1e-9)), 1e-6)
        mean = mu0 + Xc @ beta
        var = s2 * np.einsum("ij,jk,ik->i", Xc, Ainv, Xc) + 1e-9
        return mean, np.sqrt(var)

    return _ei_times_fit(fit, y, mem)


def _tpe_acquisition(base, study, number: int, space: dict, candidates: list) -> np.ndarray | None:
    """TPE's acquisition l(x)/g(x) (log) at given candidates, or None when `base` is not TPE.

    Uses TPESampler internals (the Parzen estimators of the good and the bad trials); if a future
    Optuna changes them, refinement falls back to picking the nearest neighbour at random."""
    if not isinstance(base, optuna.samplers.TPESampler) or not candidates:
        return None
    try:
        from optuna.samplers._tpe.sampler import _split_trials, default_gamma, default_gamma_multiobjective
        from optuna.trial import TrialState
        trials = [t for t in study._get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED),
                                               use_cache=False) if t.number != number]
        gamma = base._gamma or (default_gamma if len(study.directions) <= 1 else default_gamma_multiobjective)
        below, above = _split_trials(study, trials, gamma(len(trials)))
        if not below or not above:
            return None
        mb = base._build_parzen_estimator(study, space, below, handle_below=True)
        ma = base._build_parzen_estimator(study, space, above, handle_below=False)
        samples = {k: np.array([float(c[k]) for c in candidates]) for k in space}
        return np.asarray(mb.log_pdf(samples) - ma.log_pdf(samples))
    except Exception:       # noqa: BLE001 - private API: any change means "no ranking"
        return None


class LegalGridSampler(BaseSampler):
    """The exhaustive grid over the legal plans (all GPU counts), in a seeded random order.

    Trial number i takes plan i of the permuted enumeration, so workers sharing a study never
    repeat a plan; `size` is the number of plans (the runner stops there).
    """

    def __init__(self, space: PlanSpace, seed: int | None = None):
        self.space = space
        self._offsets = []
        total = 0
        for n in space.counts:
            size = len(space.table(n)) if space.has_legal(n) else 0
            self._offsets.append((total, n, size))
            total += size
        self.size = total
        self._order = np.random.default_rng(seed).permutation(total) if total else np.empty(0, np.int64)

    def __str__(self) -> str:
        return "LegalGrid"

    def params_at(self, i: int) -> dict:
        k = int(self._order[i % max(self.size, 1)])
        for start, n, size in self._offsets:
            if start <= k < start + size:
                row = self.space.table(n).rows[k - start]
                return self.space.params_of(n, {**self.space.enumerated_extras(),
                                                **{name: int(v) for name, v in zip(TABLE_KNOBS, row)}})
        raise IndexError(i)

    def infer_relative_search_space(self, study, trial):
        return dict(self.space.distributions)

    def sample_relative(self, study, trial, search_space):
        if self.size == 0:
            return {}
        return {k: v for k, v in self.params_at(trial.number).items() if k in search_space}

    def sample_independent(self, study, trial, param_name, param_distribution):
        # only reached for a parameter outside the space (never, with PlanSpace.suggest)
        return self.space.project(param_name, param_distribution.low, trial.params)


def _local_gp(space: "PlanSpace", trials: list, names: tuple, sign: float, center: dict,
              candidates: list, length: float = 1.5, noise: float = 0.05,
              max_points: int = 256) -> np.ndarray | None:
    """Like `_local_surrogate`, with Gaussian processes instead of additive models, so that knob
    interactions (pp4 good with ep1, bad with ep2) are seen: kernel exp(-d/length) where d sums, over
    the knobs, min(domain steps apart, 2)/2; fitted on the `max_points` told trials nearest `center`."""
    told = _told(trials, names, sign)
    if told is None:
        return None
    R, y, mem = told
    doms = [space._domain_values(k) for k in names]

    def index(R: np.ndarray) -> np.ndarray:
        return np.stack([np.searchsorted(d, R[:, j]) for j, d in enumerate(doms)], axis=1).astype(np.float64)

    R = index(R)
    c = index(np.array([[int(center[k]) for k in names]]))[0]
    C = index(np.asarray([[int(p[k]) for k in names] for p in candidates], dtype=np.int64))

    def dist(A, B):
        return np.minimum(np.abs(A[:, None, :] - B[None, :, :]), 2.0).sum(-1) / 2.0

    near = np.argsort(dist(R, c[None, :])[:, 0], kind="stable")[:max_points]
    R, y, mem = R[near], y[near], mem[near]

    def fit(y: np.ndarray, mask: np.ndarray):
        if mask.sum() < 4:
            return None
        X, yy = R[mask], y[mask]
        mu, sd = float(yy.mean()), float(yy.std()) or 1.0
        K = np.exp(-dist(X, X) / length) + noise * np.eye(len(X))
        L = np.linalg.cholesky(K)
        alpha = np.linalg.solve(L.T, np.linalg.solve(L, (yy - mu) / sd))
        Ks = np.exp(-dist(C, X) / length)
        v = np.linalg.solve(L, Ks.T)
        mean = mu + sd * (Ks @ alpha)
        var = np.maximum(1.0 - (v * v).sum(0), 1e-9)
        return mean, sd * np.sqrt(var)

    return _ei_times_fit(fit, y, mem)
