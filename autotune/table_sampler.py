"""`TableSampler`: a Parzen-estimator sampler (Bergstra et al., "Algorithms for Hyper-Parameter
Optimization", NeurIPS 2011) that scores candidate plans drawn straight from the table of legal plans.

Optuna's TPESampler proposes each knob from a continuous kernel density, and its truncated-normal
arithmetic is scalar Python (~20-30 ms per trial on a 2-core machine); the proposal must then be
projected onto a legal plan. Here every candidate already is a legal plan (a row of
`PlanSpace.table`), and each knob is categorical over its domain, so one trial is a few numpy
operations over thousands of candidate rows (~1 ms):

1. the finished trials are split into "good" (the best `gamma` share of the feasible ones, by the
   objective, or by Pareto rank with several objectives) and "bad" (the rest, infeasible ones included);
2. per knob, l(v) and g(v) are the smoothed frequencies of value v among the good and the bad
   trials (each count spread over the neighbouring domain values, plus a uniform prior);
3. of up to `candidates` untried legal plans drawn at random, the one maximizing
   sum over knobs of log l(v) - log g(v) is proposed (ties broken at random).

The first `n_startup_trials` trials are untried legal plans drawn uniformly. Trials still running
(a batch asked before it is told) count as tried, so a batch never repeats a plan. The knobs
only Optuna samples (first/last stage layers, block recompute) are proposed at their enumeration
value; `LegalSampler`'s local moves explore them. Plans that move one or two knobs of the best
ones are `LegalSampler`'s job (`refine`), not this sampler's.
"""
from __future__ import annotations

import math

import numpy as np
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from search_spaces.optuna_space import GPUS, TABLE_KNOBS, PlanSpace

#: defaults (tests/benchmarks/bench_optuna.py --sampler table)
STARTUP_TRIALS = 16
GAMMA = 0.1                 # share of the feasible trials taken as good (Optuna's TPE: 10 %, at most 25)
MAX_GOOD = 25
CANDIDATES = 4096           # candidate plans scored per trial
PRIOR_WEIGHT = 1.0          # pseudo-trials spread uniformly over each knob's domain
NEIGHBOUR_SHARE = 0.5       # share of a trial's weight given to each adjacent domain value
RIDGE = 1e-2                # ridge penalty of the surrogate's regressions
NOISE_FLOOR = 1e-3          # least residual variance of log step time assumed by Thompson sampling



def pinned_params(trial: FrozenTrial, names) -> dict:
    """The knobs a trial starts with: enqueue_trial's fixed params and params a re-queued trial carries."""
    given = {**(trial.system_attrs.get("fixed_params") or {}), **trial.params}
    return {k: v for k, v in given.items() if k in names}


class TableSampler(BaseSampler):
    """Proposes the untried legal plan with the best Parzen ratio l/g (see the module docstring)."""

    def __init__(self, space: PlanSpace, *, seed: int | None = None, n_startup_trials: int = STARTUP_TRIALS,
                 gamma: float = GAMMA, candidates: int = CANDIDATES, surrogate: bool = True, thompson: bool = True):
        if not 0.0 < gamma < 1.0:
            raise ValueError(f"gamma must be in (0, 1), got {gamma}")
        self.space = space
        self.seed = seed
        self.n_startup_trials = int(n_startup_trials)
        self.gamma = float(gamma)
        self.candidates = int(candidates)
        self.surrogate = bool(surrogate)
        self.thompson = bool(thompson)
        self.names = list(space.distributions)
        self._domains = [space.domain_values(k) for k in self.names]
        self._vecs: dict = {}        # trial number -> knob vector, once its plan is complete
        self._done: dict = {}        # trial number -> (knob vector, values, violation, log metrics) once finished
        self._fitted: tuple | None = None   # (key of the finished trials, surrogate) of the last fit

    def __str__(self) -> str:
        return "TableSampler"

    # ---- BaseSampler ----
    def infer_relative_search_space(self, study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return dict(self.space.distributions)

    def sample_relative(self, study, trial: FrozenTrial, search_space: dict) -> dict:
        if not search_space:
            return {}
        rng = np.random.default_rng(None if self.seed is None else [self.seed, trial.number])
        tried, done = self._history(study)
        # a queued trial (study.enqueue_trial, or a dead trial's plan re-queued by RetryFailedTrialCallback,
        # possibly only the knobs it had suggested before it died) keeps its fixed knobs: draw the rest
        # from the legal plans that agree with them, so that the whole plan stays legal
        fixed = {k: int(v) for k, v in pinned_params(trial, self.names).items()}
        cands = self._candidates(rng, tried, fixed)
        if cands is None:
            return {}
        if len(done[0]) < self.n_startup_trials:
            i = int(rng.integers(len(cands)))
        elif done[3] is not None and len(study.directions) == 1 and self.surrogate:
            score = self._ridge_score(cands, done[0], done[3], rng if self.thompson else None)
            best = np.flatnonzero(score >= score.max() - 1e-9)
            i = int(best[rng.integers(len(best))])
        else:
            score = self._log_ratio(cands, *done[:3], study.directions)
            best = np.flatnonzero(score >= score.max() - 1e-9)
            i = int(best[rng.integers(len(best))])
        return {k: int(v) for k, v in zip(self.names, cands[i]) if k in search_space}

    def sample_independent(self, study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution):
        # only reached for a knob the relative proposal left out (none with PlanSpace.suggest)
        rng = np.random.default_rng(None if self.seed is None else [self.seed, trial.number, 2])
        return self.space.project(param_name, rng.uniform(param_distribution.low, param_distribution.high),
                                  trial.params)

    # ---- history ----
    def _history(self, study) -> tuple[np.ndarray, tuple]:
        """(keys of every plan a trial holds, (vectors [n, K], values [n, m], violation [n], log step
        time / memory / limit [n, 3] or None) of the finished ones). A trial is read once its plan is
        complete (its knob vector) and once more when it has finished (its results)."""
        for t in study.get_trials(deepcopy=False):
            if t.number in self._done:
                continue
            if t.number not in self._vecs:
                if not t.params or any(k not in t.params for k in self.names):
                    continue
                self._vecs[t.number] = np.array([int(t.params[k]) for k in self.names], dtype=np.int64)
            if t.state != TrialState.COMPLETE or not t.values:
                continue
            cons = t.constraints or {}
            over = sum(max(float(c), 0.0) for c in (cons.values() if isinstance(cons, dict) else cons))
            m = t.user_attrs.get("metrics") or {}
            fit = (math.log(m["step_time_s"]), math.log(m["memory_gb"]), math.log(m["memory_limit_gb"])) \
                if all(m.get(k, 0) > 0 for k in ("step_time_s", "memory_gb", "memory_limit_gb")) else None
            self._done[t.number] = (self._vecs[t.number], tuple(float(v) for v in t.values), over, fit)
        tried = self._keys(np.array(list(self._vecs.values()), dtype=np.int64).reshape(-1, len(self.names)))
        rows = list(self._done.values())
        if not rows:
            return tried, (np.empty((0, len(self.names)), np.int64), np.empty((0, 1)), np.empty(0), None)
        fits = None if any(r[3] is None for r in rows) else np.array([r[3] for r in rows])
        return tried, (np.array([r[0] for r in rows], dtype=np.int64), np.array([r[1] for r in rows]),
                       np.array([r[2] for r in rows]), fits)

    # ---- candidates ----
    def _candidates(self, rng: np.random.Generator, tried: np.ndarray, fixed: dict | None = None) -> np.ndarray | None:
        """Up to `candidates` untried legal plans as knob vectors [C, K] (None when all were tried), only
        those agreeing with `fixed` (knob -> value) on the table's knobs and the GPU count."""
        fixed = fixed or {}
        counts = [n for n in self.space.counts if self.space.has_legal(n) and fixed.get(GPUS, n) == n]
        if not counts:
            return None
        pinned = [(TABLE_KNOBS.index(k), v) for k, v in fixed.items() if k in TABLE_KNOBS]

        def allowed(n):
            rows = self.space.table(n).rows
            if not pinned:
                return None, len(rows)
            ok = np.flatnonzero(np.all([rows[:, c] == v for c, v in pinned], axis=0))
            return ok, len(ok)
        subsets = [allowed(n) for n in counts]
        sizes = np.array([sz for _, sz in subsets], dtype=np.float64)
        if sizes.sum() == 0:
            return None
        per = rng.multinomial(self.candidates, sizes / sizes.sum()) if len(counts) > 1 else [self.candidates]
        parts = []
        for n, k, size, (ok, _) in zip(counts, per, sizes.astype(int), subsets):
            if k == 0 or size == 0:
                continue
            table = self.space.table(n)
            rows = table.rows
            idx = rng.permutation(size)[:k] if size <= 4 * k else rng.integers(size, size=k)
            if ok is not None:
                idx = ok[idx]
            cols = []
            for name in self.names:
                if name == GPUS:
                    cols.append(np.full(len(idx), n, dtype=np.int64))
                elif name in TABLE_KNOBS:
                    cols.append(rows[idx, TABLE_KNOBS.index(name)].astype(np.int64))
                else:                  # an Optuna-only knob as enumeration set it (0, fixed, an uneven split)
                    cols.append(table.extras[name][idx].astype(np.int64))
            parts.append(np.stack(cols, axis=1))
        cands = np.concatenate(parts)
        keys = self._keys(cands)
        _, first = np.unique(keys, return_index=True)
        cands, keys = cands[first], keys[first]
        if len(tried):
            cands = cands[~np.isin(keys, tried)]
        return cands if len(cands) else None

    def _keys(self, vecs: np.ndarray) -> np.ndarray:
        """One int64 per plan: its domain positions in mixed radix (< 2^63 for every knob set here)."""
        key = np.zeros(len(vecs), dtype=np.int64)
        for j, dom in enumerate(self._domains):
            key = key * len(dom) + np.searchsorted(dom, vecs[:, j])
        return key

    # ---- the Parzen ratio ----
    def _log_ratio(self, cands: np.ndarray, vecs: np.ndarray, values: np.ndarray, over: np.ndarray,
                   directions) -> np.ndarray:
        good = self._good(values, over, directions)
        score = np.zeros(len(cands))
        for j, dom in enumerate(self._domains):
            pos_c = np.searchsorted(dom, cands[:, j])
            pos_t = np.searchsorted(dom, vecs[:, j])
            score += np.log(self._density(pos_t[good], len(dom)))[pos_c]
            score -= np.log(self._density(pos_t[~good], len(dom)))[pos_c]
        return score

    def _features(self, vecs: np.ndarray) -> np.ndarray:
        """One-hot domain position of every knob, plus log2 of each knob with positive values."""
        cols = [np.ones((len(vecs), 1))]
        for j, dom in enumerate(self._domains):
            pos = np.searchsorted(dom, vecs[:, j])
            cols.append(np.eye(len(dom))[pos])
            if dom[0] > 0:
                cols.append(np.log2(vecs[:, j:j + 1].astype(np.float64)))
        return np.concatenate(cols, axis=1)

    def _fit(self, vecs: np.ndarray, fits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Ridge coefficients [features, (log step, log memory)] and the factor S with S S^T the
        posterior covariance of the step-time ones (sigma^2 (X^T X + R)^-1). Fitted once per set of
        finished trials: the trials of one batch are asked before any is told, so they share it."""
        key = (len(vecs), float(fits[:, 0].sum()))
        if self._fitted is not None and self._fitted[0] == key:
            return self._fitted[1]
        x = self._features(vecs)
        reg = RIDGE * np.eye(x.shape[1])
        reg[0, 0] = 0.0
        a = x.T @ x + reg
        coef = np.linalg.solve(a, x.T @ fits[:, :2])
        sigma = math.sqrt(max(float(np.mean((x @ coef[:, 0] - fits[:, 0]) ** 2)), NOISE_FLOOR))
        draw = sigma * np.linalg.inv(np.linalg.cholesky(a + 1e-9 * np.eye(len(a)))).T
        self._fitted = (key, (coef, draw))
        return coef, draw

    def _ridge_score(self, cands: np.ndarray, vecs: np.ndarray, fits: np.ndarray,
                     rng: np.random.Generator | None = None) -> np.ndarray:
        """Minus the predicted log step time of each candidate, with those predicted not to fit
        (log memory above the limit) ranked after all others: two ridge regressions on the
        features of the finished trials, applied to the candidates by look-ups (no feature matrix)."""
        coef, draw = self._fit(vecs, fits)
        if rng is not None:         # Thompson sampling: step-time coefficients drawn from their posterior
            coef = coef.copy()
            coef[:, 0] += draw @ rng.standard_normal(len(draw))
        pred = np.broadcast_to(coef[0], (len(cands), 2)).copy()
        at = 1
        for j, dom in enumerate(self._domains):
            pred += coef[at + np.searchsorted(dom, cands[:, j])]
            at += len(dom)
            if dom[0] > 0:
                pred += np.log2(cands[:, j:j + 1].astype(np.float64)) * coef[at]
                at += 1
        fits_mem = pred[:, 1] <= fits[0, 2]
        return np.where(fits_mem, -pred[:, 0], -pred[:, 0] - 1e3)

    @staticmethod
    def _density(pos: np.ndarray, size: int) -> np.ndarray:
        """Smoothed frequency of each domain position: each trial's unit weight plus NEIGHBOUR_SHARE
        on either adjacent value, and PRIOR_WEIGHT spread uniformly (a categorical Parzen estimator
        whose kernel reaches one domain step)."""
        w = np.bincount(pos, minlength=size).astype(np.float64)
        spread = w.copy()
        spread[1:] += NEIGHBOUR_SHARE * w[:-1]
        spread[:-1] += NEIGHBOUR_SHARE * w[1:]
        spread += PRIOR_WEIGHT / size
        return spread / spread.sum()

    def _good(self, values: np.ndarray, over: np.ndarray, directions) -> np.ndarray:
        """Mask of the good trials: the best ceil(gamma * feasible) feasible ones (at most MAX_GOOD),
        or, with none feasible, the least infeasible ones."""
        n = len(values)
        feasible = over <= 0
        n_good = min(max(1, math.ceil(self.gamma * max(int(feasible.sum()), 1))), MAX_GOOD, n)
        sign = np.array([1.0 if d == StudyDirection.MINIMIZE else -1.0 for d in directions])
        loss = values * sign
        if loss.shape[1] == 1:
            key = loss[:, 0]
        else:                       # Pareto rank: how many trials dominate each one
            le = (loss[:, None, :] <= loss[None, :, :]).all(-1)
            lt = (loss[:, None, :] < loss[None, :, :]).any(-1)
            key = (le & lt).sum(0).astype(np.float64)
        key = np.where(feasible, key, np.inf)
        order = np.lexsort((over, key)) if feasible.any() else np.argsort(over, kind="stable")
        mask = np.zeros(n, dtype=bool)
        mask[order[:n_good]] = True
        return mask
