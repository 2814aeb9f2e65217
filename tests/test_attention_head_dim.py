"""Fused attention's rate by head dimension and GPU: the tensor cores' MMAs, the softmax's exponentials on the
special-function units and the backward's shared-memory reads, each at its own rate (compute.attention_core_fwd_bwd_s).

Golden values, none from this implementation:
- FlashAttention-3 (Shah et al. 2024, Fig. 5), forward on H100 at 4k tokens, head dim 64 vs 128: 476 vs 638 TFLOP/s
  = 0.746x.
- cuDNN 9.19 measured on the lent H100 and H200 (tests/data/gpu/*_microbench.json), sequences 4k-16k: head dim 64
  over 128, forward 0.73-0.76x, backward 0.78-0.87x.
- FlashAttention-4 (Zadouri, Dao et al. 2026): from H100 to B200 the tensor cores grow 1 -> 2.25 PFLOP/s, the SFU
  count and shared-memory bandwidth per SM do not.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from autotune.api import build_problem, predict_plan
from costmodels.params import EfficiencyParams
from costmodels.plan import Plan
from costmodels.presets import GPU_PRESETS

GPU_DATA = Path(__file__).parent / "data" / "gpu"
_SPEC = importlib.util.spec_from_file_location("compare_gpu", Path(__file__).parent / "gpu" / "compare_gpu.py")
cg = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cg)
FA3_H100_FWD_D64_OVER_D128 = 476 / 638


def _core(gpu: str, head_dim: float, *, seq=16384.0, heads=16.0, fp8=0.0, sm_cycles_x=1.0):
    """Forward and backward seconds of one sequence's attention core on a preset (no TP, CP or window), with the
    kernel's fixed cost per row out of the way."""
    return cg.attention_core_s(gpu, head_dim, heads, seq, fp8=fp8, sm_cycles_x=sm_cycles_x,
                               e=EfficiencyParams(attn_seq_half=16.0))


def _rate_ratio(gpu, which):
    """Throughput per FLOP at head dim 64 over head dim 128 (same width: twice the heads)."""
    small, large = _core(gpu, 64.0, heads=32.0), _core(gpu, 128.0, heads=16.0)
    pick = {"fwd": lambda t: t[0], "bwd": lambda t: t[1], "fwd+bwd": lambda t: t[0] + t[1]}[which]
    return pick(large) / pick(small)


def _measured_ratios(gpu):
    rows = json.loads((GPU_DATA / f"{gpu}_microbench.json").read_text())["attention"]
    by = {(r["head_dim"], r["seq"]): r for r in rows if r["backend"] == "cudnn" and r["seq"] >= 4096}
    seqs = [s for (d, s) in by if d == 64 and (128, s) in by]
    return {k: [by[(64, s)][f"{k}_tflops"] / by[(128, s)][f"{k}_tflops"] for s in seqs] for k in ("fwd", "bwd")}


def test_head_dim_64_forward_runs_at_fa3s_measured_fraction_on_h100():
    assert _rate_ratio("h100", "fwd") == pytest.approx(FA3_H100_FWD_D64_OVER_D128, abs=0.02)


@pytest.mark.parametrize("gpu", ["h100", "h200"])
@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_head_dim_ratio_within_the_lent_gpus_measured_range(gpu, which):
    measured = _measured_ratios(gpu)[which]
    model = _rate_ratio(gpu, which)
    assert min(measured) - 0.04 <= model <= max(measured) + 0.04, (model, measured)


def test_the_sm_side_terms_are_what_see_the_head_dim(tmp_path):
    """With SM-side work made free (a huge SM count), attention is its MMAs alone and two models of equal attention
    FLOPs (16 heads x 128 vs 32 x 64) take the same compute time; at H100's SM rate the small heads are slower."""
    def compute_s(heads, head_dim, kv_heads, gpu_override=None):
        cfg = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 2048, "intermediate_size": 5632,
               "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
               "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False}
        path = tmp_path / f"h{heads}x{head_dim}.json"
        path.write_text(json.dumps(cfg))
        problem = build_problem(model=str(path), gpu="h100", gpus=8, global_batch=8, seq_len=4096)
        if gpu_override:
            gpu = dataclasses.replace(problem.cluster.gpu, **gpu_override)
            problem = dataclasses.replace(problem, cluster=dataclasses.replace(problem.cluster, gpu=gpu))
        return predict_plan(problem, Plan(tp=1, pp=1, dp=8, mbs=1))["time_breakdown_s"]["compute"]

    free = {"sm_count": 4096, "sm_clock_hz": 1e10}
    assert compute_s(32, 64, 8, free) == pytest.approx(compute_s(16, 128, 4, free), rel=2e-3)
    assert compute_s(32, 64, 8) > compute_s(16, 128, 4) * 1.01


def test_b200_attention_gains_less_than_its_tensor_cores():
    """FA4: tensor cores 2.25x from H100 to B200, exponentials and shared memory per SM unchanged (148 vs 132 SMs at
    the same clock): the fused kernel gains between the SM ratio and the tensor-core ratio."""
    h100, b200 = sum(_core("h100", 128.0)), sum(_core("b200", 128.0))
    tensor_x = GPU_PRESETS["b200"].peak_flops_bf16 / GPU_PRESETS["h100"].peak_flops_bf16
    sm_x = GPU_PRESETS["b200"].sm_cycles_per_s / GPU_PRESETS["h100"].sm_cycles_per_s
    assert sm_x < h100 / b200 < tensor_x
    assert tensor_x == pytest.approx(2.27, abs=0.01) and sm_x == pytest.approx(148 / 132, rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(gpu=st.sampled_from(["a100-80gb", "h100", "b200", "gb300"]), head_dim=st.sampled_from([64.0, 128.0, 192.0]),
       x=st.floats(1.0, 8.0), fp8=st.sampled_from([0.0, 1.0]))
def test_more_sm_cycles_are_never_slower_and_never_beat_the_mma_bound(gpu, head_dim, x, fp8):
    slow, fast = _core(gpu, head_dim, fp8=fp8), _core(gpu, head_dim, fp8=fp8, sm_cycles_x=x)
    assert fast[0] <= slow[0] * (1 + 1e-6) and fast[1] <= slow[1] * (1 + 1e-6)
    infinite = _core(gpu, head_dim, fp8=fp8, sm_cycles_x=1e6)
    assert infinite[0] <= fast[0] * (1 + 1e-6) and infinite[1] <= fast[1] * (1 + 1e-6)


def test_larger_heads_run_closer_to_the_mma_bound():
    """The exponential is one per score whatever the head dim: larger heads spend less of their time on it (FA3's
    Fig. 5: head dim 256 the fastest per FLOP)."""
    assert _rate_ratio("h100", "fwd") < 1.0
    d128, d256 = _core("h100", 128.0, heads=16.0), _core("h100", 256.0, heads=8.0)
    assert d256[0] < d128[0] and d256[0] + d256[1] < d128[0] + d128[1]


def test_unfused_attention_does_not_use_the_fused_kernel_rate(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 2048, "intermediate_size": 5632,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000,
           "max_position_embeddings": 4096, "tie_word_embeddings": False}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(cfg))
    problem = build_problem(model=str(path), gpu="h100", gpus=8, global_batch=8, seq_len=4096,
                            framework={"attention_backend": "unfused"})

    def compute_s(eff):
        rep = predict_plan(problem, Plan(tp=1, pp=1, dp=8, mbs=1), params=EfficiencyParams(attn_eff_max=eff))
        return rep["time_breakdown_s"]["compute"]
    assert compute_s(0.4) == pytest.approx(compute_s(0.9), rel=1e-6)
