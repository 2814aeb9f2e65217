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
3. `project` maps any value onto the nearest legal one (in log space for log knobs);
   `autotune.samplers.LegalSampler` uses it so that every recorded trial parameter is a legal
   plan's value while the base sampler still learns from real knob values.

A GPU range ("256-2048") is a `GpuRange`: by default the counts in it that are whole nodes (a
multiple of the node size, or a divisor of it below one node); "256-2048:64" takes every 64th count
(a multiple of the node size); "256-2048:pow2" takes the powers of two in the range.
"""
from __future__ import annotations

import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from costmodels.plan import PLAN_FIELDS, PlanBatch
from costmodels.specs import SpecError

from .space import (KNOBS, OPTUNA_ONLY_KNOBS, Problem, SpaceStats, check_rows, domains, enumerate_legal,
                    legal_values_of)

if TYPE_CHECKING:        # Optuna is imported where a study uses the space (0.1-0.3 s to import)
    import optuna
    from optuna.distributions import IntDistribution

#: The parameter name of the GPU count when it is a knob.
GPUS = "gpus"
#: The sampled plan knobs, in sampling order (dp is derived: gpus / (tp*cp*pp)).
SAMPLED = tuple(k for k in KNOBS if k != "dp")
#: the knobs held in the table of legal plans; the Optuna-only knobs come after them and their
#: legal values are found by the rules, given the rest of the plan
TABLE_KNOBS = tuple(k for k in SAMPLED if k not in OPTUNA_ONLY_KNOBS)
assert SAMPLED[:len(TABLE_KNOBS)] == TABLE_KNOBS
#: Optuna-only knobs sampled before a partner they are legal only with: a pipeline size that does not divide the
#: layers needs both end stages set (--decoder-first- and --decoder-last-pipeline-num-layers)
PAIRED_EXTRAS = {"first_layers": "last_layers"}
#: How far (in layers) a local move takes an Optuna-only knob (besides back to 0)
EXTRA_STEPS = 2
#: How many per-count tables of legal plans stay in memory (a GPU range may visit many counts).
TABLE_CACHE = 32
#: Entry bounds of the other look-up caches (prefix slices per table, legal values of the
#: Optuna-only knobs, neighbour lists per plan)
SLICE_CACHE = 1 << 16
EXTRA_CACHE = 1 << 16
NEIGHBOR_CACHE = 4096


class LRU:
    """The one cache policy of the plan space: a mapping bounded to `maxsize` entries that evicts
    the least recently used one. Values are results of pure functions of their key."""

    __slots__ = ("maxsize", "_d")

    def __init__(self, maxsize: int):
        self.maxsize = int(maxsize)
        self._d: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key) -> bool:
        return key in self._d

    def get(self, key, compute: Callable):
        """The cached value of `key`, else `compute()` stored under it."""
        try:
            self._d.move_to_end(key)
            return self._d[key]
        except KeyError:
            pass
        value = self._d[key] = compute()
        if len(self._d) > self.maxsize:
            self._d.popitem(last=False)
        return value


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
        width = len(TABLE_KNOBS) + len(OPTUNA_ONLY_KNOBS)
        parts = [np.stack([np.asarray(b[k], dtype=np.int16) for k in TABLE_KNOBS + OPTUNA_ONLY_KNOBS], axis=1)
                 for b in stream]
        both = np.concatenate(parts) if parts else np.empty((0, width), dtype=np.int16)
        rows = both[:, :len(TABLE_KNOBS)]
        order = np.lexsort(rows.T[::-1]) if len(rows) else np.empty(0, dtype=np.int64)
        self.rows = rows[order]
        # the Optuna-only knobs as enumeration set them, row by row: the value the user fixed, else 0, except the
        # uneven pipeline splits enumeration adds (space.uneven_splits), whose rows differ only there
        self.extras = {k: both[order, len(TABLE_KNOBS) + i] for i, k in enumerate(OPTUNA_ONLY_KNOBS)}
        self.stats: SpaceStats = stats
        self._slices = LRU(SLICE_CACHE)
        self._values = LRU(SLICE_CACHE)

    def __len__(self) -> int:
        return len(self.rows)

    def narrow(self, lo: int, hi: int, j: int, value: int) -> tuple[int, int]:
        col = self.rows[lo:hi, j]
        return lo + int(np.searchsorted(col, value, "left")), lo + int(np.searchsorted(col, value, "right"))

    def slice_of(self, prefix: tuple) -> tuple[int, int]:
        """Rows whose first len(prefix) knobs equal `prefix` (cached)."""
        if not prefix:
            return 0, len(self.rows)
        return self._slices.get(prefix, lambda: self._narrowed(prefix))

    def _narrowed(self, prefix: tuple) -> tuple[int, int]:
        lo, hi = self.slice_of(prefix[:-1])
        return self.narrow(lo, hi, len(prefix) - 1, prefix[-1]) if hi > lo else (lo, lo)

    def values(self, prefix: tuple) -> np.ndarray:
        """Legal values of knob number len(prefix) after `prefix`, sorted (cached: a short prefix
        spans most of the table, and every trial asks for it again); int64, read-only."""
        return self._values.get(prefix, lambda: self._distinct(prefix))

    def _distinct(self, prefix: tuple) -> np.ndarray:
        lo, hi = self.slice_of(prefix)
        col = self.rows[lo:hi, len(prefix)]
        out = col[np.concatenate(([True], col[1:] != col[:-1]))] if len(col) else col
        out = out.astype(np.int64)
        out.flags.writeable = False
        return out

    def extras_of(self, i: int) -> dict:
        """The Optuna-only knobs of row i as enumerated."""
        return {k: int(v[i]) for k, v in self.extras.items()}

    def batch(self, gpus: int, index=slice(None)) -> PlanBatch:
        """The rows (all, or a slice) as plans for `gpus` GPUs."""
        arrays = {k: self.rows[index, i].astype(np.int32) for i, k in enumerate(TABLE_KNOBS)}
        arrays.update({k: v[index].astype(np.int32) for k, v in self.extras.items()})
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
    # look-ups, all under one policy (`LRU`); `_stats` is a record (one entry per GPU count
    # enumerated so far: its space statistics outlive an evicted table), not a cache
    _tables: LRU = field(init=False, default_factory=lambda: LRU(TABLE_CACHE))
    _problems: LRU = field(init=False, default_factory=lambda: LRU(TABLE_CACHE))
    _neighbors: LRU = field(init=False, default_factory=lambda: LRU(NEIGHBOR_CACHE))
    _extras: LRU = field(init=False, default_factory=lambda: LRU(EXTRA_CACHE))
    _domains: LRU = field(init=False, default_factory=lambda: LRU(len(SAMPLED) + 1))
    _stats: dict = field(init=False, default_factory=dict)

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
        return self._problems.get(n, lambda: self.problem_for(n))

    def table(self, n: int) -> _Table:
        return self._tables.get(n, lambda: self._new_table(n))

    def _new_table(self, n: int) -> _Table:
        t = _Table(self.problem(n), self.fixed)
        self._stats[n] = t.stats
        return t

    def has_legal(self, n: int) -> bool:
        return self.stats(n).legal > 0

    def stats(self, n: int) -> SpaceStats:
        if n not in self._stats:
            self.table(n)
        return self._stats[n]

    def legal_plans(self, n: int) -> PlanBatch:
        """Every legal plan for n GPUs (the same set as `enumerate_legal`), sorted."""
        return self.table(n).batch(n)

    def known_stats(self) -> dict:
        """Space statistics summed over the GPU counts whose plans were enumerated so far."""
        total = legal = 0
        illegal: dict = {}
        seen = [n for n in self.counts if n in self._stats]
        for n in seen:
            st = self._stats[n]
            total += st.total
            legal += st.legal
            for k, v in (st.illegal or {}).items():
                illegal[k] = illegal.get(k, 0) + v
        return {"total": total, "legal": legal, "illegal": dict(sorted(illegal.items())),
                "gpu_counts": len(self.counts), "gpu_counts_enumerated": len(seen)}

    # ---- legal values, projection, define-by-run ----
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
        return self.table(n).values(prefix[:j])

    def _extra_values(self, n: int, name: str, prefix: tuple) -> np.ndarray:
        """Legal values of an Optuna-only knob after a whole table plan and the extras before it:
        every rule checked on the candidates (later extras at 0, which is always legal)."""
        return self._extras.get((n, name, prefix), lambda: self._extra_values_uncached(n, name, prefix))

    def _extra_values_uncached(self, n: int, name: str, prefix: tuple) -> np.ndarray:
        lo, hi = self.table(n).slice_of(prefix[:len(TABLE_KNOBS)])
        if hi <= lo:
            return np.empty(0, dtype=np.int64)
        plan = dict(zip(SAMPLED, prefix))
        plan.update({kn: 0 for kn in SAMPLED[len(prefix):]})
        plan["dp"] = n // (plan["tp"] * plan["cp"] * plan["pp"])
        values = self.domain_values(name)
        pair = PAIRED_EXTRAS.get(name)
        if pair is None or pair not in SAMPLED[len(prefix) + 1:]:
            return legal_values_of(name, plan, self.problem(n), values)
        # the first stage's size is legal where some last-stage size completes it (a layer count pp does not
        # divide needs both); each candidate against every value of its partner, in one check
        partner = self.domain_values(pair)
        grid = np.stack(np.meshgrid(values, partner, indexing="ij"), axis=-1).reshape(-1, 2)
        arrays = {f: np.full(len(grid), int(plan.get(f, 0)), dtype=np.int64) for f in PLAN_FIELDS}
        arrays[name], arrays[pair] = grid[:, 0], grid[:, 1]
        legal, _ = check_rows(arrays, self.problem(n))
        return np.unique(grid[legal, 0])

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

    def neighbors(self, params: dict, max_steps: int | None = None) -> list[tuple[int, dict]]:
        """Legal plans reached by moving one or two knobs of `params`, with the move's distance.

        A move sets one or two knobs to other values of their domains; the knobs after them that
        the move made illegal are repaired to their nearest legal value (pp 2 -> 1 takes vpp to 1).
        The distance counts the domain steps of the moved knobs (tp 4 -> 8 is one step, mbs 8 -> 4
        two: 8, 6, 4) plus, as a tie-break fraction, the steps of the repairs. Two-knob moves reach
        plans no single move reaches (cp down with mbs down, pp down with zero up). Sorted by
        distance, one entry per plan (cached per plan). With `max_steps`, only the moves of at most
        that many domain steps (exactly the plans nearer than max_steps + 1, much faster)."""
        names = list(self.distributions)
        key = tuple(int(params[k]) for k in names)
        return self._neighbors.get((key, max_steps), lambda: self._neighbors_uncached(key, max_steps))

    def _neighbors_uncached(self, key: tuple, max_steps: int | None) -> list[tuple[int, dict]]:
        names = list(self.distributions)
        base = dict(zip(names, key))
        dom = {k: self.domain_values(k) for k in names}
        pos = {k: int(np.searchsorted(dom[k], base[k])) for k in names}
        best: dict = {}

        def consider(moved: dict, steps: float) -> None:
            if max_steps is not None and int(steps) > max_steps:
                return
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
        return sorted(best.values(), key=lambda dc: dc[0])

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
                dom = self.domain_values(k)
                repair += abs(int(np.searchsorted(dom, cand[k])) - int(np.searchsorted(dom, int(base[k]))))
        return cand, repair

    def domain_values(self, name: str) -> np.ndarray:
        return self._domains.get(name, lambda: self._domain_values_uncached(name))

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
    from optuna.distributions import IntDistribution
    lo, hi = int(min(values)), int(max(values))
    return IntDistribution(lo, hi, log=bool(lo >= 1 and hi >= 4 * lo))
