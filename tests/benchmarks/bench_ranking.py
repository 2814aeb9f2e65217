"""Issue 11 item 3: does the cost model rank published plans of the same job in the measured order?

    python tests/benchmarks/bench_ranking.py [--json] [--out FILE] [--compare OLD.json]
                                             [--accuracy ACCURACY.json] [--calibration FILE]

Jobs: measured runs of the same model, GPU type and count, global batch, sequence length and
precision (autotune.crossval.job_key), from the bundled data: the small-scale runs (vTrain, 68 jobs
with 3 or more plans) and the public runs (jobs with 2 or more distinct published plans; repeated
measurements of one plan, e.g. across software releases, merged at their median), and vTrain's multi-node
runs (`vtrain-multi`: GPT 3.6B-175B on 64-512 A100, 4 jobs of 15-47 plans; no fit sees them). Each published
plan is scored as `autotune validate` scores it: exactly the published knobs, the ones the source
omits filled with the best value among plans that fit; all runs in one call of the jitted model.

Per job: is the plan predicted fastest the one measured fastest, is the measured fastest in the
predicted top 3, and the regret = measured step time of the predicted pick / best measured - 1.
Summary: share best, share top-3, mean / median / worst regret.

Predictions: the shipped defaults (in-sample: fitted on these runs), the literature prior, a
calibration file (--calibration), and, with --accuracy (a bench_accuracy.py --out document), the
out-of-sample LOSO and LOGO predictions of every run. `--json` prints one document (schema
"autotune.bench_ranking/1") that `--compare` diffs against.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from autotune.crossval import load_runs_of, micro_batch_structure, predict_rows, rank_jobs  # noqa: E402
from autotune.datasets import TRAINING_DATASETS  # noqa: E402
from autotune.measurements import read_calibration  # noqa: E402
from autotune.scoring import enable_compile_cache  # noqa: E402
from costmodels.params import LITERATURE_PRIOR, EfficiencyParams  # noqa: E402

SCHEMA = "autotune.bench_ranking/1"
#: (dataset, minimum distinct plans per job); vtrain-multi is held out of every fit, so its "in-sample
#: (defaults)" predictions are out of sample too
SETS = (("small-scale", 3), ("public", 2), ("vtrain-multi", 3))
LABEL = {"in_sample": "in-sample (defaults)", "prior": "prior only", "calibration": "calibration file",
         "loso": "LOSO (out of sample)", "logo": "LOGO (out of sample)"}


def _label(dataset: str, scheme: str) -> str:
    """A dataset no fit trains on is out of sample under the shipped defaults too."""
    if scheme == "in_sample" and dataset not in TRAINING_DATASETS:
        return "defaults (held out: out of sample)"
    return LABEL[scheme]


def _from_accuracy(doc: dict, scheme: str, runs) -> dict:
    """Per-run predictions of a bench_accuracy document: predicted step = measured / (1 + error)."""
    out = {}
    for r in runs:
        e = doc.get("runs", {}).get(r.id, {})
        err = e.get(f"{scheme}_error_pct")
        if err is not None:
            m = e["measured_step_s"]
            out[r.id] = {"measured_step_s": m, "predicted_step_s": m / (1.0 + err / 100.0), "error_pct": err}
    return out


def run_benchmark(accuracy: dict | None = None, calibration: str | None = None) -> dict:
    enable_compile_cache()
    t0 = time.perf_counter()
    runs = load_runs_of(tuple(name for name, _ in SETS))
    preds = {"in_sample": predict_rows(runs, EfficiencyParams()), "prior": predict_rows(runs, LITERATURE_PRIOR)}
    if calibration:
        preds["calibration"] = predict_rows(runs, read_calibration(calibration)[0])
    if accuracy:
        for scheme in ("loso", "logo"):
            p = _from_accuracy(accuracy, scheme, runs)
            if p:
                preds[scheme] = p
    out = {"schema": SCHEMA, "sets": {}, "structure": {}, "calibration": calibration,
           "accuracy_config": (accuracy or {}).get("config")}
    for dataset, min_plans in SETS:
        mine = [r for r in runs if r.dataset == dataset]
        out["sets"][dataset] = {scheme: rank_jobs(mine, p, min_plans=min_plans) for scheme, p in preds.items()}
        out["structure"][dataset] = micro_batch_structure([r.row for r in mine])
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return out


def _plan_text(plan: dict) -> str:
    names = {"micro_batch": "mbs", "recompute_key": "rec", "sequence_parallel": "sp", "zero_key": "zero"}
    return " ".join(f"{names.get(k, k)}={v}" for k, v in plan.items() if v is not None and k != "dp")


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def print_tables(doc: dict, worst: int = 5) -> None:
    print("Ranking of published plans within a job (predicted-fastest vs measured-fastest)\n")
    print("| jobs | scheme | n jobs | predicted best = measured best | measured best in predicted top 3 | "
          "mean regret | median | worst |")
    print("|---|---|---|---|---|---|---|---|")
    for dataset, min_plans in SETS:
        for scheme, res in doc["sets"][dataset].items():
            s = res["summary"]
            if not s["n_jobs"]:
                continue
            print(f"| {dataset} (>= {min_plans} plans) | {_label(dataset, scheme)} | {s['n_jobs']} | "
                  f"{_pct(s['share_best'])} | {_pct(s['share_top3'])} | {s['mean_regret_pct']:.1f} % | "
                  f"{s['median_regret_pct']:.1f} % | {s['worst_regret_pct']:.1f} % |")
    for dataset, _ in SETS:
        for scheme in ("in_sample", "loso"):
            res = doc["sets"][dataset].get(scheme)
            if not res or not res["jobs"]:
                continue
            print(f"\n{worst} worst jobs of {dataset}, {_label(dataset, scheme)} "
                  "(regret; the predicted pick vs the measured best):")
            for j in res["jobs"][:worst]:
                pick, best = j["predicted_pick"], j["measured_best"]
                print(f"  {j['regret_pct']:5.1f} %  {j['job']} ({j['n_plans']} plans): picked "
                      f"[{_plan_text(pick['plan'])}] measured {pick['measured_step_s']:.3f} s (predicted "
                      f"{pick['predicted_step_s']:.3f} s); best [{_plan_text(best['plan'])}] measured "
                      f"{best['measured_step_s']:.3f} s (predicted {best['predicted_step_s']:.3f} s, rank "
                      f"{j['predicted_rank_of_measured_best']})")
    for dataset, _ in SETS:
        for scheme in ("in_sample", "loso"):
            groups = (doc["sets"][dataset].get(scheme) or {}).get("by_measured_best") or []
            if not groups or not any(g["regret_share"] > 0 for g in groups):
                continue
            print(f"\nWhere the regret of {dataset}, {_label(dataset, scheme)}, comes from (jobs by their "
                  "measured-best tp and micro-batch; the largest shares):")
            for g in groups[:3]:
                best = " ".join(f"{k}={v}" for k, v in g["measured_best"].items())
                print(f"  best {best}: {g['n_jobs']} jobs, {100 * g['regret_share']:.1f} % of the summed regret, "
                      f"{g['top3_misses']} outside the predicted top 3")
    for dataset, st in doc.get("structure", {}).items():
        if st.get("plans_fitted"):
            print(f"\n{dataset} step times against the number of micro-batches m: {st['plans_fitted']} plans "
                  f"measured at 3 or more m, largest residual from fixed + m x per-micro-batch "
                  f"{st['max_residual']:.1e} of the step; per-micro-batch time across data-parallel sizes "
                  f"({st['dp_groups']} groups) spread at most {st['max_dp_spread']:.1e}"
                  + (" (composed, not separate runs: see micro_batch_structure)"
                     if st["max_residual"] < 1e-6 and (st["max_dp_spread"] or 0) < 1e-6 else ""))
    print(f"\nelapsed: {doc['elapsed_s']} s")


def print_comparison(old: dict, new: dict) -> None:
    print("\nComparison with the earlier run (old -> new)")
    for dataset, _ in SETS:
        for scheme, res in new["sets"][dataset].items():
            o = old.get("sets", {}).get(dataset, {}).get(scheme, {}).get("summary")
            n = res["summary"]
            if not o or not o.get("n_jobs") or not n["n_jobs"]:
                continue
            print(f"  {dataset:<12} {_label(dataset, scheme):<22} best {_pct(o['share_best'])} -> "
                  f"{_pct(n['share_best'])}, "
                  f"top-3 {_pct(o['share_top3'])} -> {_pct(n['share_top3'])}, mean regret "
                  f"{o['mean_regret_pct']:.1f} -> {n['mean_regret_pct']:.1f} %, worst {o['worst_regret_pct']:.1f} -> "
                  f"{n['worst_regret_pct']:.1f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the JSON document instead of the tables")
    ap.add_argument("--out", help="also write the JSON document to this file")
    ap.add_argument("--compare", help="an earlier --json/--out document to diff against")
    ap.add_argument("--accuracy", help="a bench_accuracy.py --out document: rank with its LOSO/LOGO predictions too")
    ap.add_argument("--calibration", help="also rank with this calibration file's parameters")
    args = ap.parse_args()
    accuracy = None
    if args.accuracy:
        with open(args.accuracy) as fh:
            accuracy = json.load(fh)
    doc = run_benchmark(accuracy, args.calibration)
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    if args.json:
        print(text)
        return
    print_tables(doc)
    if args.compare:
        with open(args.compare) as fh:
            print_comparison(json.load(fh), doc)


if __name__ == "__main__":
    main()
