"""Does the search reach the plans practitioners run? Search each published run's job, compare with its plan.

    python tests/benchmarks/bench_recipes.py [--json] [--datasets public bridge-dense ...] [--limit N]

For every usable row of the bundled datasets (default: `public` and `bridge-dense`, the published runs of
Megatron-LM, NeMo and Megatron-Bridge on A100 to GB300), the job is built as `autotune validate` builds it
(model, cluster, global batch, sequence, precision and the recipe's framework options), then:

* the published plan is scored by the cost model (its knobs fixed; those the source omits filled with the best
  value, as `validate` does), and
* the exhaustive search runs on the same job with no plan knob fixed.

The ratio search-best / published (both the same model's step times) is at most 1 when the search space holds
the published plan or a plan the model scores at least as fast; above 1 it misses something practitioners
run (a knob value, a pipeline split, a layout). Rows whose published plan the model says does not fit are
counted apart (a memory over-estimate or a misread row, not a search miss). This compares the search with the
model's own score of the recipe, not with the measurement: `bench_accuracy.py` measures the model.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from autotune.datasets import load_dataset  # noqa: E402
from autotune.scoring import enable_compile_cache  # noqa: E402
from autotune.search import NothingFits, exhaustive  # noqa: E402
from autotune.validate import case_from_row  # noqa: E402
from costmodels.params import EfficiencyParams  # noqa: E402
from costmodels.specs import SpecError  # noqa: E402

SCHEMA = "autotune.bench_recipes/1"
#: a search best slower than the published plan by more than this is a miss (float rounding aside)
TOLERANCE = 1e-3


def _knobs(plan: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in plan.items() if v not in (0, False, "", [], None))


def compare_rows(datasets, limit=None) -> dict:
    e = EfficiencyParams()
    rows, unfit, skipped = [], [], []
    for ds in datasets:
        for r in load_dataset(ds)[:limit]:
            if not r.get("usable", True):
                continue
            try:
                case = case_from_row(r)
            except SpecError as err:
                skipped.append({"id": r["id"], "reason": str(err)})
                continue
            try:
                pub = exhaustive(case.problem, e, top_k=1, fixed=case.fixed).best
            except NothingFits as err:
                unfit.append({"id": r["id"], "reason": str(err)})
                continue
            t0 = time.perf_counter()
            free = exhaustive(case.problem, e, top_k=1).best
            rows.append({"dataset": ds, "id": r["id"], "ratio": free["step_time_s"] / pub["step_time_s"],
                         "published_step_s": pub["step_time_s"], "search_step_s": free["step_time_s"],
                         "published_plan": _knobs(pub["plan"]), "search_plan": _knobs(free["plan"]),
                         "search_s": time.perf_counter() - t0})
    misses = [r for r in rows if r["ratio"] > 1 + TOLERANCE]
    ratios = sorted(r["ratio"] for r in rows)
    return {"schema": SCHEMA, "datasets": list(datasets), "rows": rows, "unfit_published": unfit, "skipped": skipped,
            "summary": {"rows": len(rows), "search_at_least_as_fast": len(rows) - len(misses), "misses": len(misses),
                        "worst_ratio": ratios[-1] if ratios else None,
                        "median_ratio": ratios[len(ratios) // 2] if ratios else None,
                        "published_plan_does_not_fit": len(unfit), "skipped": len(skipped),
                        "mean_search_s": sum(r["search_s"] for r in rows) / max(len(rows), 1)}}


def print_doc(doc: dict) -> None:
    s = doc["summary"]
    print(f"datasets: {', '.join(doc['datasets'])}")
    print(f"rows searched: {s['rows']}; search at least as fast as the published plan (by the model): "
          f"{s['search_at_least_as_fast']}; misses: {s['misses']}; median search / published {s['median_ratio']:.3f}, "
          f"worst {s['worst_ratio']:.3f}; mean search time {s['mean_search_s']:.2f} s")
    for r in sorted(doc["rows"], key=lambda r: -r["ratio"]):
        if r["ratio"] > 1 + TOLERANCE:
            print(f"  miss {r['ratio']:.3f}  {r['id']}: published {r['published_step_s']:.2f} s ({r['published_plan']}), "
                  f"search {r['search_step_s']:.2f} s ({r['search_plan']})")
    print(f"published plans the model says do not fit: {s['published_plan_does_not_fit']}")
    for u in doc["unfit_published"]:
        print(f"  {u['id']}: {u['reason'][:160]}")
    if doc["skipped"]:
        print(f"rows skipped (not scorable): {s['skipped']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=["public", "bridge-dense"])
    ap.add_argument("--limit", type=int, default=None, help="first N rows of each dataset")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args()
    enable_compile_cache()
    doc = compare_rows(args.datasets, args.limit)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print_doc(doc)


if __name__ == "__main__":
    main()
