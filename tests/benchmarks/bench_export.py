"""Figures of the exporters (README "Runnable output"): for legal plans spread over a space, the share
each target can express, the commonest refusals, the Megatron-LM round trip and the time per export.

    python tests/benchmarks/bench_export.py [--plans 2000] [--json]
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np

from autotune import api
from autotune.export import TARGETS, ExportRefused, export, megatron_args, parse_megatron_args
from search_spaces.space import enumerate_legal

CASES = (dict(model="llama3-70b", gpu="h100", gpus=512, global_batch=1024, seq_len=8192),
         dict(model="mixtral-8x7b", gpu="h100", gpus=256, global_batch=1024, seq_len=4096),
         # a job scored as Megatron-DeepSpeed runs it: its own space (no interleaving or CP) and exporter
         dict(model="llama3-70b", gpu="a100-80gb", gpus=512, global_batch=1024, seq_len=4096,
              framework={"framework": "deepspeed"}))


def spread(problem, n_plans: int) -> tuple:
    """About n_plans legal plans, evenly spaced in each enumerated chunk (chunks weighted by size)."""
    stream, _ = enumerate_legal(problem)
    batches = list(stream)
    total = sum(len(b) for b in batches)
    plans = []
    for b in batches:
        k = max(1, int(round(len(b) * n_plans / total)))
        plans += [b.plan(int(i)) for i in np.unique(np.linspace(0, len(b) - 1, k).astype(int))]
    return total, plans


def bench(case: dict, n_plans: int) -> dict:
    problem = api.build_problem(**case)
    mds = "framework" in case          # Megatron-LM's flags refuse such a job: no Megatron round trip
    total, plans = spread(problem, n_plans)
    ok, refusals = collections.Counter(), collections.Counter()
    round_trip = tried = 0
    t0 = time.perf_counter()
    for p in plans:
        for target in TARGETS:
            try:
                export(target, p, problem)
                ok[target] += 1
            except ExportRefused as exc:
                refusals[f"{target}: {str(exc).split(': ')[1]}"] += 1
        if p.zero != 2 and not mds:
            tried += 1
            back = parse_megatron_args(megatron_args(p, problem), problem.cluster.num_gpus,
                                       problem.model.num_layers, problem.model.is_moe)
            round_trip += back == p
    dt = time.perf_counter() - t0
    fw = f" (--framework {case['framework']['framework']})" if mds else ""
    return {"case": f"{case['model']} / {case['gpus']} {case['gpu']}{fw}", "legal": total, "sampled": len(plans),
            "expressible": {t: ok[t] / len(plans) for t in TARGETS}, "round_trip": [round_trip, tried],
            "ms_per_export": dt / len(plans) / len(TARGETS) * 1e3,
            "top_refusals": {k: v / len(plans) for k, v in refusals.most_common(6)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--plans", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [bench(c, args.plans) for c in CASES]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        share = ", ".join(f"{t} {v:.0%}" for t, v in r["expressible"].items())
        print(f"{r['case']}: {r['legal']:,} legal, {r['sampled']} sampled; expressible: {share}; Megatron round trip "
              f"{r['round_trip'][0]}/{r['round_trip'][1]}; {r['ms_per_export']:.2f} ms per export")
        for k, v in r["top_refusals"].items():
            print(f"    {v:.0%}  {k}")


if __name__ == "__main__":
    main()
