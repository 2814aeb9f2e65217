"""Issue 5 benchmark: sensitivity speed, calibration speed, leave-one-source-out cross-validation.

    python tests/benchmarks/bench_sensitivity.py [--runs FILE (default: the bundled public runs)]

1. one plan's sensitivity (jacfwd through the cost model + neighbouring plans) after the first call
   (target < 1 s);
2. `autotune.calibrate.calibrate` on every usable public run (target < 60 s);
3. leave-one-source-out over the public runs only, before and after calibration (the fuller
   out-of-sample report, with the small-scale runs, GPU generations and per-run errors, is
   tests/benchmarks/bench_accuracy.py).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from autotune import api
from autotune.calibrate import build_cases, calibrate, mape_pct
from autotune.datasets import dataset_path
from autotune.search import exhaustive
from autotune.sensitivity import sensitivity
from autotune.validate import load_runs
from costmodels.params import LITERATURE_PRIOR, EfficiencyParams

RUNS = dataset_path("public")      # the bundled copy of shared/validation/public_runs.json


def bench_sensitivity() -> None:
    problem = api.build_problem(model="llama3-70b", gpu="h100", gpus=256, global_batch=512, seq_len=8192)
    best = exhaustive(problem, top_k=1).best
    plan = api.plan_from_text(",".join(f"{k}={v}" for k, v in best["plan"].items()), problem)
    t0 = time.perf_counter()
    sensitivity(problem, plan)
    first = time.perf_counter() - t0
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        res = sensitivity(problem, plan)
        times.append(time.perf_counter() - t0)
    print(f"sensitivity of one plan (llama3-70b, 256 x h100, {len(res['elasticities']['step_time_s'])} inputs x 3 "
          f"outputs + {len(res['neighbours'])} neighbours): first call {first:.2f} s, after compile "
          f"median {np.median(times):.3f} s (target < 1 s) {'OK' if np.median(times) < 1 else 'SLOW'}")


def bench_calibration(rows: list) -> None:
    usable = [r for r in rows if r.get("usable", True)]
    t0 = time.perf_counter()
    params, cases = calibrate(usable, EfficiencyParams())
    dt = time.perf_counter() - t0
    before = mape_pct(build_cases(usable, EfficiencyParams()), EfficiencyParams())
    print(f"calibration on {len(usable)} usable public runs ({len(cases)} fitted cases, rounds=2, steps=400): "
          f"{dt:.1f} s (target < 60 s) {'OK' if dt < 60 else 'SLOW'}; MAPE {before:.1f}% -> {mape_pct(cases, params):.1f}%")


def leave_one_source_out(rows: list) -> None:
    usable = [r for r in rows if r.get("usable", True)]
    groups = sorted({(r.get("source") or {}).get("group") or "?" for r in usable})
    base = LITERATURE_PRIOR      # the shipped defaults saw every source; start from the literature values
    print()
    print("Leave-one-source-out cross-validation (start: literature prior; fit on the other sources, "
          "rounds=2, steps=400; before = prior, after = fitted, both on the held-out source)")
    print(f"| {'held-out source':<46} | runs | MAPE before | MAPE after | change |")
    print(f"|{'-' * 48}|------|-------------|------------|--------|")
    deltas = []
    t0 = time.perf_counter()
    for g in groups:
        held = [r for r in usable if ((r.get("source") or {}).get("group") or "?") == g]
        train = [r for r in usable if ((r.get("source") or {}).get("group") or "?") != g]
        fitted, _ = calibrate(train, base, rounds=2, steps=400)
        before = mape_pct(build_cases(held, base), base)
        after = mape_pct(build_cases(held, fitted), fitted)
        deltas.append(after - before)
        print(f"| {g:<46} | {len(held):>4} | {before:>10.1f}% | {after:>9.1f}% | {after - before:>+5.1f} |")
    print(f"mean change {np.mean(deltas):+.2f} points; worst {max(deltas):+.2f} points "
          f"(target: mean < 0, none > +2); {time.perf_counter() - t0:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default=str(RUNS))
    ap.add_argument("--skip-cv", action="store_true")
    args = ap.parse_args()
    rows = load_runs(args.runs)
    bench_sensitivity()
    bench_calibration(rows)
    if not args.skip_cv:
        leave_one_source_out(rows)


if __name__ == "__main__":
    main()
