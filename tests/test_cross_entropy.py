"""The vocab-parallel cross entropy: Megatron-Core's --cross-entropy-loss-fusion / --cross-entropy-fusion-impl.

Golden byte counts per logit (forward + backward), read op by op from the code:
unfused  Megatron's tensor_parallel/cross_entropy.py (and Megatron-DeepSpeed's): .float() copy (read 2, write 4),
         max (4), subtract (4 + 4), exp in place (4 + 4), sum (4), divide in place (4 + 4); backward
         multiply by the loss gradient (4 + 4) and the copy's gradient cast back to bf16 (4 + 2)
native   core/fusions/fused_cross_entropy.py (jit-fused): fp32 copy with its max (2 + 4), subtract-exp-sum
         (4 + 4), divide (4 + 4); backward one pass from fp32 to bf16 (4 + 2)
te       Transformer Engine pytorch/triton/cross_entropy.py (v2.7-v2.17): online softmax (2), the loss
         kernel writing the gradient into the bf16 logits (2 + 2); backward in-place multiply (2 + 2)
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from autotune.api import build_problem, predict_plan
from autotune.export import ExportRefused, export
from autotune.validate import case_from_row
from costmodels import compute
from costmodels.encode import encode_job
from costmodels.params import EfficiencyParams
from costmodels.plan import Plan
from costmodels.presets import build_cluster

UNFUSED = (2 + 4) + 4 + (4 + 4) + (4 + 4) + 4 + (4 + 4) + (4 + 4) + (4 + 2)
NATIVE = (2 + 4) + (4 + 4) + (4 + 4) + (4 + 2)
TE = 2 + (2 + 2) + (2 + 2)


def _job(**fw):
    problem = build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096, framework=fw)
    return problem, encode_job(problem.job, build_cluster(gpu="h100", num_gpus=8))


@pytest.mark.parametrize("fw, golden", [
    ({"cross_entropy_loss_fusion": False}, UNFUSED),
    ({}, NATIVE),                                       # the default here: fused, Megatron-Core's native impl
    ({"cross_entropy_fusion_impl": "te"}, TE),
    ({"framework": "deepspeed"}, UNFUSED),              # Megatron-DeepSpeed has only the unfused one
    ({"framework": "deepspeed", "cross_entropy_loss_fusion": True}, UNFUSED),
])
def test_the_loss_moves_the_counted_bytes(fw, golden):
    _, J = _job(**fw)
    assert float(J["loss_bytes"]) == golden
    S = SimpleNamespace(tokens=np.float32(4096.0), tp=np.float32(2.0))
    M, H, e = {"vocab": 128256.0, "hidden": 4096.0, "mtp_layers": 0.0}, {"hbm_bw": 3.35e12}, EfficiencyParams(hbm_eff=0.9)
    gemm = {"peak_gemm": 989e12, "matmul_frac": 0.8, "gemm_bytes": 2.0, "low_precision": 0.0}
    loss = float(compute.head_work(S, M, H, {**J, **gemm}, e).loss)
    assert loss == pytest.approx(4096 * 128256 / 2 * golden / (3.35e12 * 0.9), rel=1e-5)


def test_an_xla_step_fuses_its_own_loss():
    _, J = _job(framework="jax")
    assert float(J["loss_bytes"]) == compute.LOSS_BYTES_PER_LOGIT["xla"] == (4 + 4) + (4 + 2)


def _predict(model="llama3-8b", **fw):
    problem = build_problem(model=model, gpu="h100", gpus=8, global_batch=64, seq_len=4096, framework=fw)
    return predict_plan(problem, Plan(tp=1, pp=1, dp=8, mbs=1, zero=1))


def test_fused_is_faster_and_te_keeps_no_fp32_logits():
    unfused, native, te = (_predict(cross_entropy_loss_fusion=False), _predict(),
                           _predict(cross_entropy_fusion_impl="te"))
    assert unfused["step_time_s"] > native["step_time_s"] > te["step_time_s"]
    # the last rank's logits: bf16 + an fp32 copy (6 B per logit) unless TE's kernel computes in place (2 B)
    saved_gb = 4096 * 128256 * 4 / 1e9
    assert native["memory_gb"]["total"] - te["memory_gb"]["total"] == pytest.approx(saved_gb, rel=0.02)
    assert unfused["memory_gb"]["total"] == pytest.approx(native["memory_gb"]["total"], rel=1e-6)


@settings(max_examples=25, deadline=None)
@given(vocab=st.integers(1000, 300_000), extra=st.integers(1, 200_000))
def test_a_larger_vocabulary_never_costs_less(vocab, extra):
    S = SimpleNamespace(tokens=np.float32(2048.0), tp=np.float32(1.0))
    H, e = {"hbm_bw": 2.0e12}, EfficiencyParams()
    for kind, b in compute.LOSS_BYTES_PER_LOGIT.items():
        J = {"loss_bytes": np.float32(b), "peak_gemm": 312e12, "matmul_frac": 0.86, "gemm_bytes": 2.0,
             "low_precision": 0.0, "lora": 0.0}
        small = compute.head_work(S, {"vocab": float(vocab), "hidden": 1024.0, "mtp_layers": 1.0}, H, J, e)
        large = compute.head_work(S, {"vocab": float(vocab + extra), "hidden": 1024.0, "mtp_layers": 1.0}, H, J, e)
        assert float(large.loss) >= float(small.loss) and float(large.logits_fwd) >= float(small.logits_fwd)
        assert float(large.mtp) >= float(small.mtp)


def _args(**fw):
    problem = build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096, framework=fw)
    return " ".join(t for t in export("megatron", Plan(tp=1, pp=1, dp=8, mbs=1, zero=1), problem).text.split()
                    if t != "\\")


def test_the_exports_launch_the_cross_entropy_the_plan_was_scored_with():
    assert "--cross-entropy-loss-fusion" in _args() and "--cross-entropy-fusion-impl" not in _args()
    assert "--cross-entropy-loss-fusion" not in _args(cross_entropy_loss_fusion=False)
    with pytest.raises(ExportRefused, match="cross_entropy_fusion_impl=te"):
        _args(cross_entropy_fusion_impl="te")
    problem = build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096,
                            framework={"cross_entropy_fusion_impl": "te"})
    bridge = export("bridge", Plan(tp=1, pp=1, dp=8, mbs=1, zero=1), problem).text
    assert "model.cross_entropy_loss_fusion=true" in bridge.lower() and "model.cross_entropy_fusion_impl=te" in bridge


def _row(title):
    return {"id": "x", "source": {"title": title, "group": "g"}, "model": {"name": "Llama-3 8B", "layers": 32,
            "hidden": 4096, "ffn_hidden": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256, "seq_len": 8192},
            "hardware": {"gpu_key": "h100", "num_gpus": 8, "gpus_per_node": 8},
            "plan": {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "micro_batch": 1, "global_batch": 128,
                     "precision_key": "bf16"}, "measured": {"iteration_time_s": 10.0}}


@pytest.mark.parametrize("title, fused, impl", [
    ("Megatron-Bridge performance summary (NVIDIA-NeMo/Megatron-Bridge docs)", True, "te"),
    ("Narayanan et al. 2021 (SC21)", False, None),
    ("NeMo 24.07 performance summary", False, None),
])
def test_validation_runs_each_source_with_its_cross_entropy(title, fused, impl):
    fw = case_from_row(_row(title)).problem.job.framework
    assert fw.cross_entropy_loss_fusion is fused
    if impl:
        assert fw.cross_entropy_fusion_impl.value == impl


def test_cli_takes_the_flags_and_names_a_bad_impl():
    from typer.testing import CliRunner
    from cli.main import app
    base = ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "64",
            "--seq-len", "4096", "--plan", "tp=1,pp=1,dp=8,mbs=1,zero=1", "--json"]
    import json
    fused = json.loads(CliRunner().invoke(app, base).stdout)["step_time_s"]
    unfused = json.loads(CliRunner().invoke(app, base + ["--no-cross-entropy-loss-fusion"]).stdout)["step_time_s"]
    assert unfused > fused
    bad = CliRunner().invoke(app, base + ["--cross-entropy-fusion-impl", "apex"])
    assert bad.exit_code == 2 and "cross_entropy_fusion_impl" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("flags, says", [
    ([], None),
    (["--no-cross-entropy-loss-fusion"], "--cross-entropy-loss-fusion moves 28"),
    (["--framework", "deepspeed"], "Megatron-DeepSpeed has no fused one"),
    (["--framework", "jax"], None),
])
def test_predict_says_when_the_loss_runs_unfused(flags, says):
    from typer.testing import CliRunner
    from cli.main import app
    out = CliRunner().invoke(app, ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch",
                                   "64", "--seq-len", "4096", "--plan", "tp=1,pp=1,dp=8,mbs=1,zero=1", *flags])
    assert out.exit_code in (0, 3), out.stdout
    if says:
        assert "the loss runs unfused" in out.stdout and "128,256-wide" in out.stdout and says in out.stdout
    else:
        assert "the loss runs unfused" not in out.stdout
