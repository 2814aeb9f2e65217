"""The jax runner (issue 14): every plan kind trains exactly like the unsharded model.

One subprocess (8 host CPU devices via XLA_FLAGS, set before JAX starts there; this pytest process is
not affected) runs all cases; each case is one test. Tolerance, fp32 compute: the 3-step losses within
1e-5 absolute, gradients of step 1 and step 3 within 1e-4 of the reference's largest entry per tensor
(observed <= 3e-5: reduction order only), weights after step 3 within 1e-3 (Adam divides each entry
by its own RMS, so reduction-order noise in near-zero gradient entries becomes noise of size lr;
observed <= 2e-4). Compiled programs are cached on disk (JAX's persistent cache), so reruns are fast.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autotune.runner import model as M
from autotune.runner.sharded import RunShape, unsupported_reason
from costmodels.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "runner", "equivalence_worker.py")

CASES = [
    ("dense", {"tp": 2, "dp": 2, "mbs": 2, "zero": 1}),                     # TP (no SP), DP, 2 micro-batches, ZeRO-1
    ("dense", {"tp": 2, "sp": True, "cp": 2, "dp": 2, "zero": 2, "recompute": "selective"}),  # SP, CP, ZeRO-2
    ("dense", {"dp": 4, "zero": 3, "recompute": "full"}),                    # ZeRO-3 + full recompute
    ("dense", {"dp": 4, "zero": 3, "mbs": 1}),                               # ZeRO-3 gathering again in backward, 2 micro-batches
    ("dense", {"pp": 2, "tp": 2, "dp": 2, "sp": True, "zero": 1, "recompute": "full"}),
    ("moe", {"tp": 2, "sp": True, "dp": 4, "ep": 2}),                        # EP all_to_all + TP
    ("moe", {"pp": 2, "dp": 2, "ep": 2, "zero": 3, "mbs": 2}),               # PP + EP + ZeRO-3
    ("dense", {"pp": 2, "vpp": 2, "tp": 2, "dp": 2, "mbs": 1, "zero": 1}),   # interleaved chunks (vpp 2)
]
LOSS_TOL, GRAD_TOL, WEIGHT_TOL = 1e-5, 1e-4, 1e-3


@pytest.fixture(scope="module")
def results():
    cache = os.environ.get("AUTOTUNE_JAX_CACHE", os.path.expanduser("~/.cache/autotune/jax"))
    # optimisation level 0 of XLA's CPU backend: compiles in ~60 % of the time, same numerics within tolerance
    flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
               **({"JAX_COMPILATION_CACHE_DIR": cache} if cache else {}),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return worker_json_lines([WORKER, json.dumps(CASES)], len(CASES), env, timeout=900)


def worker_json_lines(argv: list, n: int, env: dict, timeout: float) -> list:
    """Run `python argv...` in its own process (its XLA_FLAGS set before JAX starts) and return the n
    JSON lines it prints, one per case; fail with the end of its stderr when it printed fewer."""
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == n, f"worker failed (rc={proc.returncode}): {proc.stderr[-2000:]}"
    return lines


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{k}-{'-'.join(f'{a}{b}' for a, b in p.items())}"
                                                      for k, p in CASES])
def test_sharded_training_equals_unsharded(results, i):
    r = results[i]
    assert "error" not in r, r.get("error")
    assert r["loss_drop"] > 0.0, "the reference did not learn: the comparison would be vacuous"
    assert r["loss_abs_err"] <= LOSS_TOL, r
    assert r["grad_rel_err_step1"] <= GRAD_TOL, r
    assert r["grad_rel_err_step3"] <= GRAD_TOL, r
    assert r["weights_rel_err_step3"] <= WEIGHT_TOL, r


DENSE = M.Dims(num_layers=4, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=64)


@pytest.mark.parametrize("plan, needle", [
    (Plan(pp=2, vpp=4), "pp*vpp=8 must divide the 4 layers"),
    (Plan(ep=2, dp=2), "needs a MoE model"),
    (Plan(tp=8), "tp=8 must divide heads=4"),
    (Plan(pp=3), "pp*vpp=3 must divide the 4 layers"),
    (Plan(dp=3), "global_batch=8 must be a multiple of dp*mbs=3"),
    (Plan(first_layers=1, pp=2), "uneven pipeline"),
])
def test_unsupported_plans_are_refused_with_a_reason(plan, needle):
    reason = unsupported_reason(RunShape(dims=DENSE, plan=plan, seq_len=16, global_batch=8))
    assert reason and needle in reason and "\n" not in reason
