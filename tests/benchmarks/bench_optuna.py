"""Search quality of the Optuna strategy against the exhaustive optimum (issue 4, "measured").

For each reference case (legal space of 10^4..10^6 plans, dense and MoE) it finds the exhaustive
optimum, then runs the default sampler (`table`, batched ask/tell; `--sampler tpe` for Optuna's TPE) with
5 seeds and prints the number of trials until a feasible plan within 1% of the optimum's step time was
told, the median over seeds (target: <= 300), the wall time per trial (the scorer's one-off compile
excluded) and the share of it spent in the cost model.

    python tests/benchmarks/bench_optuna.py                    # all cases, 5 seeds
    python tests/benchmarks/bench_optuna.py --seeds 3 --case llama3-70b --batch-size 16
    python tests/benchmarks/bench_optuna.py --space full       # Optuna-only knobs free as well

By default the Optuna-only knobs (first/last stage layers, block recompute) are pinned to 0, so
Optuna searches exactly the exhaustive space; `--space full` lets it search them too (a larger space,
same target). Each case also prints what those knobs add: the best step time over every legal value
of them on the exhaustive top plans, against the exhaustive optimum.

The numbers move when the cost model changes (the optimum and its neighbourhood change with it).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

from autotune import optuna_search as osr                                   # noqa: E402
from autotune import samplers                                               # noqa: E402
from autotune.optuna_search import BatchScorer, StudySpec, create_study, make_sampler, run_batches  # noqa: E402
from costmodels.plan import PLAN_FIELDS, PlanBatch                                      # noqa: E402
from search_spaces.space import KNOBS, OPTUNA_ONLY_KNOBS, RULES, check_rows             # noqa: E402

PINNED = {k: 0 for k in OPTUNA_ONLY_KNOBS}

CASES = [
    # name, StudySpec arguments (dense and MoE; legal spaces 10^4..10^6)
    ("llama3-70b", dict(model="llama3-70b", gpu="h100", gpus="512", global_batch=1024, seq_len=8192)),
    ("gpt3-175b", dict(model="gpt3-175b", gpu="a100-80gb", gpus="1024", global_batch=1536, seq_len=2048)),
    ("mixtral-8x7b", dict(model="mixtral-8x7b", gpu="h100", gpus="256")),
    ("qwen3-30b-a3b", dict(model="qwen3-30b-a3b", gpu="h100", gpus="256")),
]
#: a case where the Optuna-only knobs pay (126 layers on 16 stages), for the "what they add" lines
#: (and a trials case with --case llama3.1-405b)
GAIN_CASES = [
    ("llama3.1-405b", dict(model="llama3.1-405b", gpu="h100", gpus="1024", global_batch=2048, seq_len=8192)),
]


def exhaustive_optimum(space, scorer) -> tuple[float, int, int]:
    n = space.counts[0]
    batch = space.legal_plans(n)
    steps, mems = scorer.score(np.full(len(batch), n), batch)
    fits = mems <= scorer.limit_bytes(n)
    return float(steps[fits].min()), len(batch), int(fits.sum())


def extras_gain(space, scorer, top: int = 128) -> tuple[float, dict]:
    """Best step time over every legal value of the Optuna-only knobs (and of recompute, which block
    recompute needs) on the `top` fastest fitting plans of the exhaustive space (a lower bound on
    what the knobs can give), and that plan."""
    n = space.counts[0]
    batch = space.legal_plans(n)
    steps, mems = scorer.score(np.full(len(batch), n), batch)
    order = np.argsort(np.where(mems <= scorer.limit_bytes(n), steps, np.inf))[:top]
    problem = space.problem(n)
    varied = ("recompute",) + OPTUNA_ONLY_KNOBS
    doms = [np.asarray(KNOBS[k].domain(problem)) for k in varied]
    grid = [g.reshape(-1) for g in np.meshgrid(*doms, indexing="ij")]
    rows = {f: np.repeat(np.asarray(batch[f])[order], len(grid[0])).astype(np.int64) for f in PLAN_FIELDS}
    for k, g in zip(varied, grid):
        rows[k] = np.tile(g, len(order)).astype(np.int64)
    legal, _ = check_rows(rows, problem, RULES)
    cand = PlanBatch({f: rows[f][legal].astype(np.int32) for f in PLAN_FIELDS})
    st, me = scorer.score(np.full(len(cand), n), cand)
    st = np.where(me <= scorer.limit_bytes(n), st, np.inf)
    i = int(np.argmin(st))
    return float(st[i]), cand.plan(i).as_dict()


def trials_to_target(spec: StudySpec, space, scorer, target_step: float, max_trials: int) -> tuple[int | None, dict]:
    sampler = make_sampler(spec.sampler, spec.seed, space, len(spec.objectives))
    study, _ = create_study(spec, storage_url=None, study_name=None, sampler=sampler)
    hit: list = []

    def progress(done, stats, best):
        if best is not None and best["step_time_s"] <= target_step:
            hit.append(done)
            return True
        return False

    run = run_batches(study, space, scorer, spec.objectives, n_trials=max_trials, timeout_s=None,
                      batch_size=spec.batch_size, sampler_name=spec.sampler, progress=progress)
    if not hit:
        return None, run.as_dict()
    # the exact trial (within the last batch) that first reached the target
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs.get("metrics") or {}
        if a.get("fits") and a.get("step_time_s", np.inf) <= target_step:
            return t.number + 1, run.as_dict()
    return hit[0], run.as_dict()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--max-trials", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=osr.DEFAULT_BATCH)
    ap.add_argument("--sampler", default=osr.DEFAULT_SAMPLER)
    ap.add_argument("--case", action="append", help="only these cases (by name)")
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--space", choices=("pinned", "full"), default="pinned",
                    help="pinned: Optuna-only knobs at 0 (the exhaustive space); full: searched too")
    ap.add_argument("--no-gain", action="store_true", help="skip the 'what the Optuna-only knobs add' lines")
    args = ap.parse_args(argv)
    fixed = PINNED if args.space == "pinned" else {}

    rows, gains = [], []
    print(f"sampler={args.sampler} batch={args.batch_size} seeds={args.seeds} max_trials={args.max_trials} "
          f"tpe_startup={samplers.TPE_STARTUP_TRIALS} ei_candidates={samplers.TPE_EI_CANDIDATES} "
          f"refine={samplers.TPE_REFINE} table_refine={samplers.TABLE_REFINE} incumbents={samplers.TPE_INCUMBENTS} retries={samplers.TPE_RETRIES} "
          f"space={args.space}")
    for name, kw in CASES + GAIN_CASES:
        if (args.case and name not in args.case) or (not args.case and (name, kw) in GAIN_CASES):
            if (name, kw) in GAIN_CASES and not args.case and not args.no_gain:
                spec0 = StudySpec(**kw, fixed=fixed).resolved()
                space = spec0.build_space()
                scorer = BatchScorer(space, spec0.params(), spec0.memory_limit_gb)
                opt, _, _ = exhaustive_optimum(space, scorer)
                gains.append((name, opt, *extras_gain(space, scorer)))
            continue
        spec0 = StudySpec(**kw, fixed=fixed, sampler=args.sampler, batch_size=args.batch_size).resolved()
        space = spec0.build_space()
        scorer = BatchScorer(space, spec0.params(), spec0.memory_limit_gb)
        t0 = time.perf_counter()
        opt, n_legal, n_fit = exhaustive_optimum(space, scorer)
        t_exh = time.perf_counter() - t0
        target = opt * (1.0 + args.tolerance)
        if not args.no_gain:
            gains.append((name, opt, *extras_gain(space, scorer)))
        got, walls, shares = [], [], []
        for seed in range(args.seeds):
            spec = StudySpec(**{**kw, "seed": seed}, fixed=fixed, sampler=args.sampler,
                             batch_size=args.batch_size).resolved()
            scorer = BatchScorer(space, spec.params(), spec.memory_limit_gb)
            n, run = trials_to_target(spec, space, scorer, target, args.max_trials)
            got.append(n)
            walls.append(run["wall_per_trial_ms"])
            shares.append(run["model_share"])
            print(f"  {name:14s} seed {seed}: {n if n is not None else f'>{args.max_trials}':>6} trials  "
                  f"({run['wall_per_trial_ms']:.1f} ms/trial, cost model {run['model_share']:.0%})", flush=True)
        finite = [g if g is not None else args.max_trials + 1 for g in got]
        med = statistics.median(finite)
        rows.append((name, n_legal, n_fit, opt, t_exh, med, finite, statistics.median(walls), statistics.median(shares)))

    print()
    print(f"{'case':14s} {'legal':>8s} {'fit':>8s} {'optimum s':>10s} {'exh. s':>7s} {'median trials':>14s} "
          f"{'per seed':24s} {'ms/trial':>9s} {'model share':>12s}  target")
    ok_all = True
    for name, n_legal, n_fit, opt, t_exh, med, finite, wall, share in rows:
        ok = med <= 300
        ok_all &= ok
        per = ",".join(str(x) if x <= args.max_trials else f">{args.max_trials}" for x in finite)
        print(f"{name:14s} {n_legal:8d} {n_fit:8d} {opt:10.3f} {t_exh:7.2f} {med:14.0f} {per:24s} {wall:9.1f} "
              f"{share:12.0%}  {'ok' if ok else 'MISSED'} (<= 300)")
    print()
    print("What the Optuna-only knobs add (every legal first/last stage size and block recompute on the "
          "128 best exhaustive plans):")
    for name, opt, g, plan in gains:
        extra = {k: plan[k] for k in ("pp", "vpp", "recompute") + OPTUNA_ONLY_KNOBS if plan[k]}
        print(f"  {name:14s} exhaustive {opt:.3f} s -> {g:.3f} s ({(g / opt - 1) * 100:+.1f} %) "
              f"{extra or '(none helps)'}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
