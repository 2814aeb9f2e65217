"""Reproduce the shipped default efficiency parameters (costmodels/params.py).

Starts from the literature prior (costmodels.params.LITERATURE_PRIOR), fits by gradient descent
through the cost model (autotune.calibrate.calibrate: each source weighted equally, plans for
unknown knobs re-chosen between rounds) on the usable public runs plus the small-scale runs, and
prints the fitted parameters (paste them into EfficiencyParams) and the MAPE per source.

    python tests/benchmarks/fit_defaults.py [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from autotune.calibrate import build_cases, calibrate, predict_steps  # noqa: E402
from autotune.datasets import load_dataset  # noqa: E402
from costmodels.params import LITERATURE_PRIOR, EfficiencyParams, params_to_dict  # noqa: E402



def per_source(cases, params) -> dict:
    pred = predict_steps(cases, params)
    err = np.abs(np.array([c.measured_step_s for c in cases]) / pred - 1.0) * 100.0
    out = {}
    for g in sorted({c.group for c in cases}):
        e = err[[c.group == g for c in cases]]
        out[g] = {"n": int(len(e)), "mape_pct": float(e.mean()), "max_abs_error_pct": float(e.max())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--lr", type=float, default=0.08)
    ap.add_argument("--prior", type=float, default=1e-3, help="pull towards the starting values")
    ap.add_argument("--start", choices=("prior", "defaults"), default="prior",
                    help="start from the literature prior (how the shipped defaults are made, and how every "
                         "out-of-sample fit of bench_accuracy.py starts) or from the shipped defaults")
    args = ap.parse_args()
    rows = load_dataset("public") + load_dataset("small-scale")     # the bundled copies of shared/validation
    t0 = time.perf_counter()
    start = LITERATURE_PRIOR if args.start == "prior" else EfficiencyParams()
    fitted, cases = calibrate(rows, start, rounds=2, steps=args.steps, lr=args.lr,
                              prior=args.prior)
    doc = {"params": params_to_dict(fitted), "elapsed_s": time.perf_counter() - t0, "start": args.start,
           "before": per_source(build_cases(rows, start), start),
           "after": per_source(cases, fitted)}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    for k, v in doc["params"].items():
        print(f"    {k} = {v:.4g}")
    print(f"\nfit in {doc['elapsed_s']:.0f} s; MAPE per source, start ({args.start}) -> fitted:")
    for g, a in doc["after"].items():
        b = doc["before"].get(g, {})
        print(f"  {g[:50]:50s} n={a['n']:4d}  {b.get('mape_pct', float('nan')):6.1f}% -> {a['mape_pct']:6.1f}%"
              f"  (max {a['max_abs_error_pct']:.1f}%)")


if __name__ == "__main__":
    main()
