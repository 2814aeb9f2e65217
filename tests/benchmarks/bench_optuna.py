"""Search quality of the Optuna strategy against the exhaustive optimum (issue 4, "measured").

For each reference case (legal space of 10^4..10^6 plans, dense and MoE) it finds the exhaustive
optimum, then runs the default sampler (TPE, batched ask/tell) with 5 seeds and prints the number of
trials until a feasible plan within 1% of the optimum's step time was told, the median over seeds
(target: <= 300), Optuna's wall time per trial and the share of it spent in the cost model.

    python tests/benchmarks/bench_optuna.py                    # all cases, 5 seeds
    python tests/benchmarks/bench_optuna.py --seeds 3 --case llama3-70b --batch-size 16

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
from autotune.optuna_search import BatchScorer, StudySpec, create_study, make_sampler, run_batches  # noqa: E402

CASES = [
    # name, StudySpec arguments (dense and MoE; legal spaces 10^4..10^6)
    ("llama3-70b", dict(model="llama3-70b", gpu="h100", gpus="512", global_batch=1024, seq_len=8192)),
    ("gpt3-175b", dict(model="gpt3-175b", gpu="a100-80gb", gpus="1024", global_batch=1536, seq_len=2048)),
    ("mixtral-8x7b", dict(model="mixtral-8x7b", gpu="h100", gpus="256")),
    ("qwen3-30b-a3b", dict(model="qwen3-30b-a3b", gpu="h100", gpus="256")),
]


def exhaustive_optimum(space, scorer) -> tuple[float, int, int]:
    n = space.counts[0]
    batch = space.legal_plans(n)
    steps, mems = scorer.score(np.full(len(batch), n), batch)
    fits = mems <= scorer.limit_bytes(n)
    return float(steps[fits].min()), len(batch), int(fits.sum())


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
    args = ap.parse_args(argv)

    rows = []
    print(f"sampler={args.sampler} batch={args.batch_size} seeds={args.seeds} max_trials={args.max_trials} "
          f"tpe_startup={osr.TPE_STARTUP_TRIALS} ei_candidates={osr.TPE_EI_CANDIDATES} refine={osr.TPE_REFINE} "
          f"incumbents={osr.TPE_REFINE_INCUMBENTS} retries={osr.TPE_RETRIES}")
    for name, kw in CASES:
        if args.case and name not in args.case:
            continue
        spec0 = StudySpec(**kw, sampler=args.sampler, batch_size=args.batch_size).resolved()
        space = spec0.build_space()
        scorer = BatchScorer(space, spec0.params(), spec0.memory_limit_gb)
        t0 = time.perf_counter()
        opt, n_legal, n_fit = exhaustive_optimum(space, scorer)
        t_exh = time.perf_counter() - t0
        target = opt * (1.0 + args.tolerance)
        got, walls, shares = [], [], []
        for seed in range(args.seeds):
            spec = StudySpec(**{**kw, "seed": seed}, sampler=args.sampler, batch_size=args.batch_size).resolved()
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
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
