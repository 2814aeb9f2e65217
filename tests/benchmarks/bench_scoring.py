#!/usr/bin/env python
"""Speed of the exhaustive scorer: plans/s, JIT compile time, end-to-end `autotune search`.

Not a pytest module (no `test_` prefix; pytest's default discovery skips it). Run it:

    python tests/benchmarks/bench_scoring.py            # human-readable figures
    python tests/benchmarks/bench_scoring.py --json     # the same figures as one JSON document

Figures (issue 2, "Measured, not assumed", item 3):
  a. plans scored per second by `autotune.scoring.score_summary` in steady state (after compile):
     the legal plans of llama3.1-405b on 16,384 H100 (global batch 2048 x 8192 tokens), tiled to
     at least --min-rows rows, scored --reps times; best and median.
  b. JIT compile time of the summary scorer: first call minus steady call, in a fresh process
     (cold in-memory cache, persistent cache off), plus the same with JAX's on-disk cache warm.
  c. wall time of the whole `autotune search ... --no-save --json`, process start included, with
     the persistent compile cache cold and warm (the CLI turns it on).
  d. the same scoring as a plain Python loop, one plan per call of the cost model (jitted with a
     batch of 1, and un-jitted), extrapolated to plans/s; the vectorized / loop ratio.
  e. what the compiled scorer does per plan, from XLA's own cost analysis of one chunk: floating-point
     operations, bytes accessed, transcendentals, and the program's instruction and fusion counts. These are
     properties of the compiled program, not timings: they do not move with the machine's load, so two
     versions of the cost model compare exactly where (a)'s plans/s need interleaved runs to see past the
     noise of a shared machine (+-15 %). Beside them, (a)'s process CPU time per million plans.
  MoE: deepseek-v3 on 2048 H800 (global batch 15360 x 4096): plans/s and end-to-end search time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

DENSE = dict(model="llama3.1-405b", gpu="h100", gpus=16384, global_batch=2048, seq_len=8192)
MOE = dict(model="deepseek-v3", gpu="h800", gpus=2048, global_batch=15360, seq_len=4096)


def _cli_args(p: dict) -> list:
    return ["search", "--model", p["model"], "--gpu", p["gpu"], "--gpus", str(p["gpus"]),
            "--global-batch", str(p["global_batch"]), "--seq-len", str(p["seq_len"]), "--no-save", "--json"]


# --------------------------------------------------------------------------------------------
# helpers that run in this process
# --------------------------------------------------------------------------------------------

def machine_info() -> dict:
    import jax
    import numpy as np

    try:
        import jaxlib
        jaxlib_version = jaxlib.__version__
    except Exception:  # pragma: no cover
        jaxlib_version = None
    return {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib_version,
        "numpy": np.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def legal_rows(problem) -> tuple[dict, dict]:
    import numpy as np
    from costmodels.plan import PLAN_FIELDS
    from search_spaces.space import enumerate_legal

    t0 = time.perf_counter()
    stream, stats = enumerate_legal(problem)
    batches = list(stream)
    rows = {f: np.concatenate([np.asarray(b[f]) for b in batches]).astype(np.int32) for f in PLAN_FIELDS}
    return rows, {"legal": stats.legal, "total": stats.total, "enumerate_s": time.perf_counter() - t0}


def tile(rows: dict, min_rows: int) -> dict:
    import numpy as np
    n = len(rows["tp"])
    reps = max(1, -(-min_rows // n))
    return {k: np.tile(v, reps) for k, v in rows.items()}


def steady_plans_per_s(problem, rows: dict, reps: int) -> dict:
    """score_summary over `rows`, once to compile, then `reps` timed runs."""
    from autotune.scoring import Inputs, score_summary
    from costmodels.params import EfficiencyParams
    from costmodels.plan import PlanBatch

    inp, params, batch = Inputs(problem), EfficiencyParams(), PlanBatch(rows)
    n = len(batch)
    t0 = time.perf_counter()
    score_summary(batch, inp, params)                      # compile (and a first pass)
    first_s = time.perf_counter() - t0
    times = []
    cpu0 = time.process_time()
    for _ in range(reps):
        t0 = time.perf_counter()
        steps, mems = score_summary(batch, inp, params)    # returns numpy: synchronous
        times.append(time.perf_counter() - t0)
    cpu_s = time.process_time() - cpu0
    return {
        "cpu_s_per_million_plans": cpu_s / (reps * n) * 1e6,
        "rows": n,
        "reps": reps,
        "first_call_s": first_s,
        "times_s": times,
        "best_plans_per_s": n / min(times),
        "median_plans_per_s": n / statistics.median(times),
    }


def compiled_cost(problem, rows: dict) -> dict:
    """XLA's cost analysis of the summary scorer compiled for one chunk (autotune.scoring.CHUNK rows), per plan:
    flops, bytes accessed and transcendentals (jax `Compiled.cost_analysis`), and the optimized program's
    instruction and fusion counts (`Compiled.as_text`). Deterministic for a given jax version and cost model."""
    import numpy as np
    from autotune.scoring import CHUNK, Inputs, with_groups
    from costmodels import model as cm
    from costmodels.params import EfficiencyParams
    from costmodels.plan import PLAN_FIELDS

    inp = Inputs(problem)
    rows = tile(rows, CHUNK)
    arrays = with_groups({f: np.asarray(rows[f][:CHUNK], dtype=np.int32) for f in PLAN_FIELDS}, inp)
    exe = cm.summary_jit.lower(arrays, inp.model, inp.hw, inp.job, EfficiencyParams()).compile()
    cost = exe.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost          # older jax: one dict per device
    lines = [ln for ln in exe.as_text().splitlines() if " = " in ln]
    fusions = sum(1 for ln in lines if " fusion(" in ln)
    return {
        "chunk_rows": CHUNK,
        "flops_per_plan": float(cost.get("flops", 0.0)) / CHUNK,
        "bytes_accessed_per_plan": float(cost.get("bytes accessed", 0.0)) / CHUNK,
        "transcendentals_per_plan": float(cost.get("transcendentals", 0.0)) / CHUNK,
        "hlo_instructions": len(lines),
        "hlo_fusions": fusions,
    }


def python_loop(problem, rows: dict, n_jit: int, n_eager: int) -> dict:
    """One plan per cost-model call: jitted with a batch of 1 (after warm-up), and un-jitted."""
    import jax
    import numpy as np
    from autotune.scoring import Inputs
    from costmodels import model as cm
    from costmodels.params import EfficiencyParams

    inp, params = Inputs(problem), EfficiencyParams()
    n = len(rows["tp"])
    rng = np.random.default_rng(0)
    idx = rng.choice(n, size=min(n_jit, n), replace=False)

    def one(i):
        return {k: v[i:i + 1] for k, v in rows.items()}

    out = cm.evaluate_jit(one(idx[0]), inp.model, inp.hw, inp.job, params)     # compile
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for i in idx:
        out = cm.evaluate_jit(one(i), inp.model, inp.hw, inp.job, params)
        step = float(out.step_time_s[0])                                    # to the host, per plan
    jit_s = time.perf_counter() - t0

    eager_idx = idx[:max(1, n_eager)]
    out = cm.evaluate(one(eager_idx[0]), inp.model, inp.hw, inp.job, params)   # warm op caches
    float(out.step_time_s[0])
    t0 = time.perf_counter()
    for i in eager_idx:
        out = cm.evaluate(one(i), inp.model, inp.hw, inp.job, params)
        step = float(out.step_time_s[0])
    eager_s = time.perf_counter() - t0
    del step
    return {
        "jit_batch1": {"plans": len(idx), "seconds": jit_s, "plans_per_s": len(idx) / jit_s},
        "eager": {"plans": len(eager_idx), "seconds": eager_s, "plans_per_s": len(eager_idx) / eager_s},
    }


def run_cli(problem_kw: dict, cache_dir: str | None, label: str) -> dict:
    """Wall time of `autotune search ... --json` in a new process (process start included).
    Falls back to `python -c` over the Python API when the CLI does not run."""
    env = dict(os.environ)
    env["AUTOTUNE_JAX_CACHE"] = cache_dir or ""
    exe = shutil.which("autotune") or str(Path(sys.executable).with_name("autotune"))
    cmd = [exe, *_cli_args(problem_kw)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    res = {"label": label, "how": "autotune CLI", "command": " ".join(["autotune", *_cli_args(problem_kw)]),
           "exit_code": proc.returncode, "wall_s": wall}
    try:
        doc = json.loads(proc.stdout)
        res["elapsed_s_reported"] = doc.get("elapsed_s")
        best = doc.get("best") or {}
        res["best_plan"] = best.get("plan")
        res["best_step_time_s"] = best.get("step_time_s")
        res["space"] = doc.get("space")
    except (json.JSONDecodeError, AttributeError):
        res["stderr_tail"] = proc.stderr.strip().splitlines()[-3:]
    if proc.returncode == 0 and "best_plan" in res:
        return res
    # fallback: the Python API in a fresh interpreter
    code = ("import json,time;t=time.perf_counter();"
            "from autotune.api import build_problem, search;"
            f"r=search(build_problem(**{problem_kw!r}));"
            "print(json.dumps({'best':r.best,'space':r.space,'elapsed_s':r.elapsed_s}))")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    fb = {"label": label, "how": "python -c (autotune.api.build_problem + search): CLI failed",
          "cli_exit_code": res["exit_code"], "exit_code": proc.returncode, "wall_s": wall}
    try:
        doc = json.loads(proc.stdout)
        fb.update(elapsed_s_reported=doc["elapsed_s"], best_plan=doc["best"]["plan"],
                  best_step_time_s=doc["best"]["step_time_s"], space=doc["space"])
    except (json.JSONDecodeError, KeyError, TypeError):
        fb["stderr_tail"] = proc.stderr.strip().splitlines()[-3:]
    return fb


def compile_probe_in_subprocess(problem_kw: dict, cache_dir: str | None) -> dict:
    env = dict(os.environ)
    env["AUTOTUNE_JAX_CACHE"] = cache_dir or ""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_compile-probe", json.dumps(problem_kw)]
    if cache_dir:
        cmd += ["--_cache", cache_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": proc.stderr.strip().splitlines()[-3:]}


def _compile_probe(problem_kw: dict, cache_dir: str | None) -> None:
    """Runs in a fresh interpreter: first call (trace + compile + run) minus a steady call."""
    t_import = time.perf_counter()
    import jax
    if cache_dir:
        from autotune.scoring import enable_compile_cache
        os.environ["AUTOTUNE_JAX_CACHE"] = cache_dir
        enable_compile_cache()
    from autotune.api import build_problem
    from autotune.scoring import CHUNK, Inputs, score_summary
    from costmodels.params import EfficiencyParams
    from costmodels.plan import PlanBatch
    import_s = time.perf_counter() - t_import

    problem = build_problem(**problem_kw)
    rows, _ = legal_rows(problem)
    rows = tile(rows, CHUNK)
    rows = {k: v[:CHUNK] for k, v in rows.items()}           # exactly one full chunk
    inp, params, batch = Inputs(problem), EfficiencyParams(), PlanBatch(rows)
    t0 = time.perf_counter()
    score_summary(batch, inp, params)
    first = time.perf_counter() - t0
    steady = []
    for _ in range(3):
        t0 = time.perf_counter()
        score_summary(batch, inp, params)
        steady.append(time.perf_counter() - t0)
    print(json.dumps({"chunk_rows": CHUNK, "import_s": import_s, "first_call_s": first,
                      "steady_call_s": min(steady), "compile_s": first - min(steady),
                      "persistent_cache": bool(cache_dir), "jax": jax.__version__}))


# --------------------------------------------------------------------------------------------

def bench_problem(kw: dict, min_rows: int, reps: int, loop: bool, n_jit: int, n_eager: int) -> dict:
    from autotune.api import build_problem

    problem = build_problem(**kw)
    rows, space = legal_rows(problem)
    out = {"problem": kw, "space": space}
    tiled = tile(rows, min_rows) if len(rows["tp"]) < min_rows else rows
    out["vectorized"] = steady_plans_per_s(problem, tiled, reps)
    out["vectorized"]["tiled_from"] = len(rows["tp"])
    if loop:
        out["loop"] = python_loop(problem, rows, n_jit, n_eager)
        v = out["vectorized"]["median_plans_per_s"]
        out["ratio_vectorized_over_loop_jit_batch1"] = v / out["loop"]["jit_batch1"]["plans_per_s"]
        out["ratio_vectorized_over_loop_eager"] = v / out["loop"]["eager"]["plans_per_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions of the vectorized scorer")
    ap.add_argument("--min-rows", type=int, default=1 << 20, help="tile the legal plans to at least this many rows")
    ap.add_argument("--loop-plans", type=int, default=200, help="plans in the jitted batch-of-1 loop")
    ap.add_argument("--eager-plans", type=int, default=10, help="plans in the un-jitted loop")
    ap.add_argument("--cli-runs", type=int, default=3, help="end-to-end runs with a warm compile cache")
    ap.add_argument("--skip-moe", action="store_true", help="skip the deepseek-v3 section")
    ap.add_argument("--_compile-probe", dest="probe", help=argparse.SUPPRESS)
    ap.add_argument("--_cache", dest="cache", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        _compile_probe(json.loads(args.probe), args.cache)
        return 0

    report: dict = {"machine": machine_info()}
    report["dense"] = bench_problem(DENSE, args.min_rows, args.reps, True, args.loop_plans, args.eager_plans)
    from autotune.api import build_problem
    problem = build_problem(**DENSE)
    report["dense"]["compiled_cost"] = compiled_cost(problem, legal_rows(problem)[0])   # the same program for any problem

    cache = tempfile.mkdtemp(prefix="autotune-bench-jax-")
    try:
        report["compile"] = {
            "cold": compile_probe_in_subprocess(DENSE, None),
        }
        # end-to-end: persistent cache off, then a fresh cache (first run fills it), then warm
        e2e = [run_cli(DENSE, None, "no persistent cache")]
        e2e.append(run_cli(DENSE, cache, "persistent cache cold (fills it)"))
        for i in range(max(0, args.cli_runs)):
            e2e.append(run_cli(DENSE, cache, f"persistent cache warm #{i + 1}"))
        report["compile"]["disk_cache_warm"] = compile_probe_in_subprocess(DENSE, cache)
        report["end_to_end_dense"] = e2e
        if not args.skip_moe:
            from costmodels.presets import GPU_PRESETS, MODEL_PRESETS
            if MOE["model"] in MODEL_PRESETS and MOE["gpu"] in GPU_PRESETS:
                moe = bench_problem(MOE, 0, max(2, args.reps // 2), False, 0, 0)
                moe["end_to_end"] = [run_cli(MOE, cache, "persistent cache warm")]
                report["moe"] = moe
            else:
                report["moe"] = {"skipped": f"preset {MOE['model']} or {MOE['gpu']} not found"}
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    if args.json:
        print(json.dumps(report, indent=2, default=float))
    else:
        print_report(report)
    return 0


def _f(x, unit="", digits=3):
    if x is None:
        return "n/a"
    if abs(x) >= 1e6:
        return f"{x / 1e6:.{digits}g} M{unit}"
    if abs(x) >= 1e3:
        return f"{x / 1e3:.{digits}g} k{unit}"
    return f"{x:.{digits}g} {unit}".rstrip()


def _print_cost(prefix: str, c: dict) -> None:
    print(f"{prefix} compiled scorer per plan (XLA cost analysis of one {c['chunk_rows']}-row chunk): "
          f"{c['flops_per_plan']:,.0f} flops, {c['bytes_accessed_per_plan']:,.0f} bytes accessed, "
          f"{c['transcendentals_per_plan']:.2f} transcendentals; {c['hlo_instructions']:,} HLO instructions, "
          f"{c['hlo_fusions']} fusions")


def print_report(r: dict) -> None:
    m = r["machine"]
    print(f"machine: {m['cpu_count']} CPUs ({m['affinity_cpus']} usable), {m['processor']}, {m['platform']}; "
          f"python {m['python']}, jax {m['jax']} ({m['jax_backend']}), numpy {m['numpy']}; load {m['load_avg_1m']:.2f}")
    d = r["dense"]
    p = d["problem"]
    v = d["vectorized"]
    print(f"\n[dense] {p['model']} on {p['gpus']} x {p['gpu']}, global batch {p['global_batch']} x {p['seq_len']}")
    print(f"  legal plans: {d['space']['legal']} of {d['space']['total']} (enumerated in {d['space']['enumerate_s']:.2f} s)")
    print(f"  (a) vectorized score_summary, {v['rows']} rows (tiled from {v['tiled_from']}), {v['reps']} reps: "
          f"best {_f(v['best_plans_per_s'], 'plans/s')}, median {_f(v['median_plans_per_s'], 'plans/s')} "
          f"(first call incl. compile {v['first_call_s']:.2f} s); process CPU "
          f"{v['cpu_s_per_million_plans']:.3f} s per million plans")
    c = r["compile"]
    for key, label in (("cold", "fresh process, no persistent cache"), ("disk_cache_warm", "fresh process, warm disk cache")):
        x = c.get(key, {})
        if "compile_s" in x:
            print(f"  (b) JIT compile of the summary scorer ({label}): {x['compile_s']:.2f} s "
                  f"(first call {x['first_call_s']:.2f} s - steady {x['steady_call_s']:.3f} s, "
                  f"{x['chunk_rows']} rows)")
        else:
            print(f"  (b) compile probe ({label}) failed: {x}")
    print("  (c) end-to-end `autotune search ... --no-save --json`, process start included:")
    for e in r["end_to_end_dense"]:
        extra = f", reported elapsed {e['elapsed_s_reported']:.2f} s" if e.get("elapsed_s_reported") is not None else ""
        print(f"      {e['label']:<36} {e['wall_s']:6.2f} s  exit {e['exit_code']}  [{e['how']}]{extra}")
    lp = d["loop"]
    print(f"  (d) Python loop, one plan per call: jitted batch-of-1 {_f(lp['jit_batch1']['plans_per_s'], 'plans/s')} "
          f"({lp['jit_batch1']['plans']} plans), un-jitted {_f(lp['eager']['plans_per_s'], 'plans/s')} "
          f"({lp['eager']['plans']} plans)")
    print(f"      vectorized / loop: {d['ratio_vectorized_over_loop_jit_batch1']:,.0f}x (vs jitted batch-of-1), "
          f"{d['ratio_vectorized_over_loop_eager']:,.0f}x (vs un-jitted)")
    _print_cost("  (e)", d["compiled_cost"])
    best = next((e for e in r["end_to_end_dense"] if e.get("best_plan")), None)
    if best:
        print(f"      best plan: {best['best_plan']}  step {best['best_step_time_s']:.3f} s")
    moe = r.get("moe")
    if moe:
        if "skipped" in moe:
            print(f"\n[moe] skipped: {moe['skipped']}")
        else:
            p, v = moe["problem"], moe["vectorized"]
            print(f"\n[moe] {p['model']} on {p['gpus']} x {p['gpu']}, global batch {p['global_batch']} x {p['seq_len']}")
            print(f"  legal plans: {moe['space']['legal']} of {moe['space']['total']} "
                  f"(enumerated in {moe['space']['enumerate_s']:.2f} s)")
            print(f"  vectorized score_summary over all legal plans, {v['reps']} reps: best "
                  f"{_f(v['best_plans_per_s'], 'plans/s')}, median {_f(v['median_plans_per_s'], 'plans/s')}")
            for e in moe["end_to_end"]:
                extra = f", reported elapsed {e['elapsed_s_reported']:.2f} s" if e.get("elapsed_s_reported") is not None else ""
                print(f"  end-to-end search ({e['label']}): {e['wall_s']:.2f} s  exit {e['exit_code']}  [{e['how']}]{extra}")


if __name__ == "__main__":
    sys.exit(main())
