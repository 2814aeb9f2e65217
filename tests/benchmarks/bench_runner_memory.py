"""Per-device memory: the cost model's prediction vs XLA's compiled memory analysis of the jax runner's
training step for the very same plan, per plan kind, on 8 host CPU devices (nothing is run or
allocated: the step is lowered from sharded shapes and compiled).

    python tests/benchmarks/bench_runner_memory.py [--json]

The prediction is the dynamic part (weights, gradients, optimizer, activations, buffers): the fixed
framework bytes (CUDA context, NCCL) and the allocator's fragmentation factor are left out, since
XLA's buffer assignment has neither. The runner's attention is unfused on CPU, so the cost model is
asked for --attention-backend unfused. Its pipeline schedule is GPipe (every micro-batch's
activations live until the backward pass), and the cost model is asked for GPipe too (the run's
framework options, autotune/verify.py RUN_FRAMEWORK). Target: within 15 %.
"""
from __future__ import annotations

import os
import sys

import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

DUMP = tempfile.mkdtemp(prefix="bench_runner_memory_")
atexit.register(shutil.rmtree, DUMP, ignore_errors=True)
# XLA writes each compiled step's buffer live ranges to DUMP; the peak of live bytes is read from there
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 --xla_dump_to={DUMP} "
                      "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_fn")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import json  # noqa: E402

import jax  # noqa: E402

from autotune import api  # noqa: E402
from autotune.runner.measure import compiled_memory, live_peak_bytes  # noqa: E402
from autotune.runner.model import Dims  # noqa: E402
from autotune.runner.sharded import RunShape  # noqa: E402
from autotune.search import predict  # noqa: E402
from autotune.verify import _DTYPES, _attention, choose_run, dynamic_memory_gb, run_problem  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
#: model file, sequence length, global batch
MODELS = {"tiny (h64, L4)": ("tiny_llama_config.json", 64, 16), "small (h512, L4, V8192)": ("small_llama_config.json", 512, 16),
          "tiny MoE (E4 k2)": ("tiny_moe_config.json", 64, 16)}
PLANS = ["tp=1,dp=1,mbs=4", "tp=2,mbs=4", "tp=2,sp=true,mbs=4", "dp=2,mbs=4,zero=0", "dp=2,mbs=4,zero=1",
         "dp=4,mbs=2,zero=3", "cp=2,mbs=4", "tp=1,mbs=4,recompute=selective", "tp=1,mbs=4,recompute=full",
         "pp=2,mbs=2", "pp=2,tp=2,sp=true,mbs=2,recompute=full"]
MOE_PLANS = ["tp=1,mbs=4", "dp=2,ep=2,mbs=4", "tp=2,sp=true,mbs=4", "dp=4,ep=2,mbs=2,zero=1", "pp=2,dp=2,ep=2,mbs=2"]
#: XLA's CPU backend has no bf16 arithmetic: it computes bf16 in fp32 and keeps fp32 copies of the saved
#: activations (measured: the same peak within 2 % for bf16 and fp32 compute), so the CPU runs are fp32
#: training runs and are predicted as such (--precision fp32)
PRECISION = "fp32"


def row(model_file: str, seq: int, gb: int, plan_text: str) -> dict:
    plan_kw = dict(kv.split("=") for kv in plan_text.split(","))
    gpus = int(plan_kw.get("tp", 1)) * int(plan_kw.get("pp", 1)) * int(plan_kw.get("dp", 1)) * int(plan_kw.get("cp", 1))
    problem = api.build_problem(model=os.path.join(DATA, model_file), gpu="h100", gpus=gpus, global_batch=gb,
                                seq_len=seq, precision=PRECISION)
    plan = api.plan_from_text(plan_text, problem)
    choice = choose_run(problem, plan, len(jax.devices()))
    impl, backend = _attention("cpu", problem.job.precision)
    rp = run_problem(problem, choice, backend)
    shape = RunShape(dims=Dims.from_spec(rp.model), plan=choice.plan, seq_len=seq, global_batch=gb, attention=impl,
                     compute_dtype=_DTYPES[problem.job.precision])
    full = predict(rp, choice.plan)
    pred = dynamic_memory_gb(full, None)
    xla = compiled_memory(shape, jax.devices())
    live = live_peak_bytes(DUMP) / 1e9
    alloc = xla["peak"] / 1e9
    return {"plan": plan_text, "predicted_gb": pred["total"], "xla_live_gb": live, "xla_alloc_gb": alloc,
            "error_pct": 100 * (pred["total"] / live - 1), "error_vs_alloc_pct": 100 * (pred["total"] / alloc - 1),
            "predicted": pred, "xla": {k: v / 1e9 for k, v in xla.items()}}


def main() -> None:
    as_json = "--json" in sys.argv
    out = []
    for name, (f, seq, gb) in MODELS.items():
        for p in (MOE_PLANS if "MoE" in name else PLANS):
            r = row(f, seq, gb, p)
            r["model"] = name
            out.append(r)
            if not as_json:
                print(f"{name:18s} {p:38s} predicted {r['predicted_gb'] * 1e3:8.2f} MB  XLA live {r['xla_live_gb'] * 1e3:8.2f} MB"
                      f"  {r['error_pct']:+6.1f} %  allocated {r['xla_alloc_gb'] * 1e3:8.2f} MB {r['error_vs_alloc_pct']:+6.1f} %"
                      f"   (XLA args {r['xla']['argument_size'] * 1e3:.2f}, temp "
                      f"{r['xla']['temp_size'] * 1e3:.2f} MB; predicted states "
                      f"{sum(r['predicted'][k] for k in ('weights', 'gradients', 'optimizer')) * 1e3:.2f}, activations "
                      f"{r['predicted']['activations'] * 1e3:.2f}, other {r['predicted']['other'] * 1e3:.2f} MB)", flush=True)
    within = sum(abs(r["error_pct"]) <= 15 for r in out)
    under = sum(r["error_pct"] < -15 for r in out)
    summary = {"rows": out, "within_15pct": within, "n": len(out), "under_by_more_than_15pct": under,
               "mape_pct": sum(abs(r["error_pct"]) for r in out) / len(out),
               "mean_pct": sum(r["error_pct"] for r in out) / len(out),
               "within_15pct_of_allocated": sum(abs(r["error_vs_alloc_pct"]) <= 15 for r in out),
               "mean_vs_allocated_pct": sum(r["error_vs_alloc_pct"] for r in out) / len(out),
               "worst_pct": max((r["error_pct"] for r in out), key=abs)}
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"within 15 %: {within} of {len(out)}; below the measured peak by more than 15 %: {under}; mean abs error "
              f"{summary['mape_pct']:.1f} %, mean {summary['mean_pct']:+.1f} %, worst {summary['worst_pct']:+.1f} % (vs the live "
              f"peak); vs allocated: within 15 % {summary['within_15pct_of_allocated']} of {len(out)}, mean "
              f"{summary['mean_vs_allocated_pct']:+.1f} %")


if __name__ == "__main__":
    main()
