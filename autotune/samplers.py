"""Optuna samplers for the plan space: `table` (the default: `autotune.table_sampler.TableSampler`,
which proposes rows of the table of legal plans by a surrogate of the finished trials), Optuna's own
(TPE, NSGA-II, GP, CMA-ES, random), each wrapped in `LegalSampler` so that it only ever proposes legal
plans, and `LegalGridSampler` (every legal plan once, in a seeded order).

`LegalSampler` is a public `optuna.samplers.BaseSampler` subclass. It maps every value the base
sampler proposes onto the nearest legal value (`PlanSpace.project`, knob by knob in sampling order)
before Optuna records it, so the base sampler learns from real, legal knob values. Two additions help
a model-based sampler on plan spaces, where the few plans within 1 % of the best sit in a needle-like
region at the memory limit:

- `retries`: when the base sampler proposes a plan some trial already has, ask it again (up to
  `retries` times), then take a local move or a random untried legal plan instead;
- `refine` (a fraction in [0, 1), single objective only): that share of the trials after
  `refine_after` is a move from one of the `incumbents` best feasible plans to an untried neighbour
  (`PlanSpace.neighbors`: one or two knobs moved, the nearest first, ties broken at random); after a
  move that improved the best plan the same move is repeated once more (Hooke & Jeeves' pattern move,
  J. ACM 8(2), 1961). Which trials refine depends only on the trial number, so it is reproducible and
  works across workers sharing a study.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from search_spaces.optuna_space import TABLE_KNOBS, PlanSpace

from .sampler_names import CONSTRAINT_AWARE, DEFAULT_SAMPLER, SAMPLERS, check_sampler  # noqa: F401 (re-exported)
from .table_sampler import pinned_params

#: TPE settings (tests/benchmarks/bench_optuna.py): 16 random start-up trials, 48 candidates per
#: acquisition, multivariate with a constant liar for the batch; 70 % of the later trials are local
#: moves from the 3 best plans; a repeated plan is re-asked up to 3 times
TPE_STARTUP_TRIALS = 16
TPE_EI_CANDIDATES = 48
TPE_REFINE = 0.7
TPE_INCUMBENTS = 3
TPE_RETRIES = 3
#: the table sampler's share of local moves after its start-up trials (bench_optuna.py, 5 seeds: 0.4 beat
#: 0.7; after the host-dispatch floor changed the landscape, median trials to 1 % of the optimum with
#: 0.3 / 0.4 / 0.5 / 0.6: qwen3-30b-a3b 241 / 313 / 230 / 241, mixtral 320 / 218 / 188 / 240)
TABLE_REFINE = 0.5
CMAES_STARTUP_TRIALS = 10
NSGA2_MIN_POPULATION = 20
#: local moves are looked for among the moves of at most 1, then 2, 4 domain steps, then all
_MOVE_STEPS = (1, 2, 4, None)


def make_sampler(name: str, seed: int | None, space: PlanSpace, n_objectives: int) -> BaseSampler:
    """The named Optuna sampler, wrapped so that it proposes legal plans only (grid enumerates them)."""
    key = check_sampler(name, n_objectives)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # Optuna's ExperimentalWarning for some options
        if key == "grid":
            return LegalGridSampler(space, seed=seed)
        if key == "tpe":
            base = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=TPE_STARTUP_TRIALS,
                                              n_ei_candidates=TPE_EI_CANDIDATES, constant_liar=True)
            return LegalSampler(base, space, refine=TPE_REFINE if n_objectives == 1 else 0.0,
                                refine_after=TPE_STARTUP_TRIALS, incumbents=TPE_INCUMBENTS,
                                retries=TPE_RETRIES, seed=seed)
        if key == "table":
            from .table_sampler import STARTUP_TRIALS, TableSampler
            return LegalSampler(TableSampler(space, seed=seed), space,
                                refine=TABLE_REFINE if n_objectives == 1 else 0.0, refine_after=STARTUP_TRIALS,
                                incumbents=TPE_INCUMBENTS, seed=seed)
        if key == "nsga2":
            base = optuna.samplers.NSGAIISampler(
                seed=seed, population_size=max(NSGA2_MIN_POPULATION, 2 * len(space.distributions)))
        elif key == "gp":
            base = optuna.samplers.GPSampler(seed=seed)
        elif key == "cmaes":
            base = optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=CMAES_STARTUP_TRIALS,
                                                independent_sampler=optuna.samplers.RandomSampler(seed=seed),
                                                warn_independent_sampling=False)
        else:
            base = optuna.samplers.RandomSampler(seed=seed)
    return LegalSampler(base, space)


class LegalSampler(BaseSampler):
    """Wraps an Optuna sampler; every value it proposes is projected onto the legal plans."""

    def __init__(self, base: BaseSampler, space: PlanSpace, *, refine: float = 0.0, refine_after: int = 0,
                 incumbents: int = 3, retries: int = 0, seed: int | None = None):
        if not 0.0 <= refine < 1.0:
            raise ValueError(f"refine must be in [0, 1), got {refine}")
        self.base = base
        self.space = space
        self.refine = float(refine)
        self.refine_after = int(refine_after)
        self.incumbents = int(incumbents)
        self.retries = int(retries)
        self.seed = seed
        self._proposals: dict = {}           # trial number -> params chosen before the base sampler
        self._origin: dict = {}              # plan key -> the incumbent it is a local move from
        self._keyed: dict = {}               # trial number -> plan key, once its plan is complete
        self._snapshot: tuple = (None, [], None)   # (trial number, the study's trials read for it, their keys)

    def __str__(self) -> str:
        return f"Legal({self.base})"

    # ---- BaseSampler ----
    def infer_relative_search_space(self, study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self.base.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial: FrozenTrial, search_space: dict) -> dict:
        local = self._proposals.get(trial.number)
        if local is not None:
            return {k: v for k, v in local.items() if k in search_space}
        projected: dict = {}
        # a queued trial's knobs (study.enqueue_trial's fixed params; a dead trial re-queued by
        # RetryFailedTrialCallback carries the params it had suggested before it died: a prefix in
        # sampling order) are pinned before the projection, so the rest is made legal around them
        fixed = pinned_params(trial, self.space.distributions)
        for _ in range(1 + self.retries):
            proposal = self.base.sample_relative(study, trial, search_space)
            if not proposal:
                return {}
            projected = self.space.project_params({**proposal, **fixed})
            if len(projected) < len(self.space.distributions) or self._key(projected) not in self._tried(study, trial.number):
                break
        else:
            if self.retries:                 # the base sampler keeps repeating itself: try something new
                fresh = self._local_move(study, trial.number) or self._random_untried(study, trial.number)
                if fresh is not None:
                    self._proposals[trial.number] = projected = fresh
        return {k: v for k, v in projected.items() if k in search_space}

    def sample_independent(self, study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution):
        local = self._proposals.get(trial.number)
        if local is not None and param_name in local:
            return local[param_name]
        value = self.base.sample_independent(study, trial, param_name, param_distribution)
        if param_name not in self.space.distributions:
            return value
        return self.space.project(param_name, value, trial.params)

    def before_trial(self, study, trial: FrozenTrial) -> None:
        self.base.before_trial(study, trial)
        # a queued trial's fixed knobs win over a local move (a move elsewhere could make them illegal)
        if self._refines(trial.number) and len(study.directions) == 1 and not pinned_params(trial, self.space.distributions):
            move = self._local_move(study, trial.number)
            if move is not None:
                self._proposals[trial.number] = move

    def after_trial(self, study, trial: FrozenTrial, state, values) -> None:
        self._proposals.pop(trial.number, None)
        self.base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.base.reseed_rng()

    # ---- helpers ----
    def _key(self, params: dict) -> tuple:
        return tuple(params.get(k) for k in self.space.distributions)

    def _trials(self, study, number: int) -> list:
        """The study's trials, read once per trial being sampled (a database query on RDB storage)."""
        if self._snapshot[0] != number:
            self._snapshot = (number, study.get_trials(deepcopy=False), None)
        return self._snapshot[1]

    def _tried(self, study, number: int) -> set:
        trials = self._trials(study, number)
        if self._snapshot[2] is None:            # the plans of that snapshot, each keyed once
            for t in trials:
                if t.number not in self._keyed and t.params and len(t.params) >= len(self.space.distributions):
                    self._keyed[t.number] = self._key(t.params)
            self._snapshot = (number, trials, set(self._keyed.values())
                              | {self._key(t.params) for t in trials if t.params and t.number not in self._keyed})
        return self._snapshot[2] | {self._key(p) for p in self._proposals.values()}

    def _refines(self, number: int) -> bool:
        if self.refine <= 0 or number < self.refine_after:
            return False
        return math.floor((number + 1) * self.refine) > math.floor(number * self.refine)   # an even spread

    def _local_move(self, study, number: int) -> dict | None:
        """An untried neighbour of one of the best feasible plans (or the pattern move of the best)."""
        if len(study.directions) != 1:
            return None
        names = set(self.space.distributions)
        done = [t for t in self._trials(study, number) if t.state == TrialState.COMPLETE and t.values
                and all(c <= 0 for c in (t.constraints or {}).values()) and names <= set(t.params)]
        if not done:
            return None
        sign = -1.0 if study.direction == StudyDirection.MAXIMIZE else 1.0
        done.sort(key=lambda t: (sign * t.values[0], t.number))
        tried = self._tried(study, number)
        best = done[0].params
        parent = self._origin.get(self._key(best))
        if parent is not None:               # the best plan came from a local move: repeat that move
            cand = pattern_move(self.space, parent, best)
            if cand is not None and self._key(cand) not in tried:
                self._origin[self._key(cand)] = dict(best)
                return cand
        for max_steps in _MOVE_STEPS:          # the nearest moves first: most are found at one step
            options = self._moves(done, tried, max_steps)
            if options:
                break
        if not options:
            return None
        low = min(o[0] for o in options)
        nearest = [o for o in options if o[0] == low]
        rng = np.random.default_rng(None if self.seed is None else [self.seed, number])
        _, cand, incumbent = nearest[int(rng.integers(len(nearest)))]
        self._origin[self._key(cand)] = dict(incumbent)
        return cand

    def _moves(self, done: list, tried: set, max_steps: int | None) -> list:
        """(distance + rank of the incumbent, plan, incumbent) of the nearest untried moves from each
        of the best `incumbents` distinct plans."""
        options: list = []
        seen: set = set()
        for t in done:
            key = self._key(t.params)
            if key in seen:
                continue
            rank = len(seen)
            seen.add(key)
            if rank >= self.incumbents:
                break
            fresh = [(d + rank, c, t.params) for d, c in self.space.neighbors(t.params, max_steps)
                     if self._key(c) not in tried]
            options += [o for o in fresh if o[0] == fresh[0][0]]
        return options

    def _random_untried(self, study, number: int) -> dict | None:
        rng = np.random.default_rng(None if self.seed is None else [self.seed, number, 1])
        tried = self._tried(study, number)
        counts = [c for c in self.space.counts if self.space.has_legal(c)]
        for _ in range(64):
            n = int(rng.choice(counts))
            table = self.space.table(n)
            i = int(rng.integers(len(table.rows)))
            params = self.space.params_of(n, {**table.extras_of(i),
                                              **{k: int(v) for k, v in zip(TABLE_KNOBS, table.rows[i])}})
            if self._key(params) not in tried:
                return params
        return None


def pattern_move(space: PlanSpace, parent: dict, child: dict) -> dict | None:
    """Hooke-Jeeves' pattern move: repeat the step parent -> child once more (in domain steps)."""
    moved = {}
    for k in space.distributions:
        dom = space.domain_values(k)
        i0, i1 = int(np.searchsorted(dom, int(parent[k]))), int(np.searchsorted(dom, int(child[k])))
        if i1 != i0:
            moved[k] = int(dom[min(max(2 * i1 - i0, 0), len(dom) - 1)])
    if not moved:
        return None
    got = space.move(child, moved)
    return None if got is None else got[0]


class LegalGridSampler(BaseSampler):
    """The exhaustive grid over the legal plans (all GPU counts), in a seeded random order.

    Trial number i takes plan i of the permuted enumeration, so workers sharing a study never repeat
    a plan; `size` is the number of plans (the runner stops there)."""

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
                table = self.space.table(n)
                return self.space.params_of(n, {**table.extras_of(k - start),
                                                **{name: int(v) for name, v in zip(TABLE_KNOBS, table.rows[k - start])}})
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
