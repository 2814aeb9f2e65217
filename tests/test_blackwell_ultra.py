"""Blackwell Ultra's softmax exponentials: B300 / GB300 run the special-function units' MUFU.EX2 at twice
Blackwell's rate at the same tensor-core rate, and fused attention waits on them.

Golden facts, from the sources:
- NVIDIA, "Making Softmax More Efficient with NVIDIA Blackwell Ultra" (2026): MUFU.EX2 ~2x on GB300 over GB200;
  DeepSeek-V3's fp8 attention forward ~1.35x faster.
- NVIDIA, "Inside NVIDIA Blackwell Ultra" (2025): doubled special-function-unit throughput for attention; the
  B300 / GB300 datasheets print the same dense bf16 / fp8 tensor-core peaks as B200 / GB200.
- FlashAttention's backward recomputes P = exp(S - LSE): the same exponentials as the forward.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from autotune import api
from costmodels import compute
from costmodels.params import EfficiencyParams
from costmodels.presets import GPU_PRESETS
from costmodels.specs import GPUSpec, SpecError

GB300_OVER_GB200_FP8_ATTENTION_FWD = 1.35     # NVIDIA's Blackwell Ultra softmax post, DeepSeek-V3 fp8 FPROP


def _shapes(T, tp=1.0):
    return SimpleNamespace(tokens=np.float32(T), tokens_elem=np.float32(T), tp=np.float32(tp), cp=np.float32(1.0),
                           routed_tokens=np.float32(0.0), softmax_fallback=np.float32(0.0))


def _attention(exp_x, *, fp8=1.0, flash=1.0, seq=4096, heads=128, qk=192, v=128):
    M = {"heads": heads, "qk_head_dim": qk, "v_head_dim": v, "window": 0, "window_layer_frac": 0.0}
    H = {"peak_bf16": 2.5e15, "matmul_frac_bf16": 0.776, "hbm_bw": 8e12, "exp_x": exp_x,
         "sm_cycles": GPU_PRESETS["gb200"].sm_cycles_per_s}
    J = {"seq_len": float(seq), "flash": flash, "fp8_attention": fp8, "packed_tokens": 0.0, "attn_rate_x": 1.0}
    fwd, bwd = compute.attention_core_fwd_bwd_s(_shapes(float(seq)), M, H, J, EfficiencyParams())
    return float(fwd), float(bwd)


@pytest.mark.parametrize("name, expected", [("b300", 2.0), ("gb300", 2.0), ("b200", 1.0), ("gb200", 1.0),
                                            ("h100", 1.0), ("a100-80gb", 1.0)])
def test_blackwell_ultra_presets_double_the_exponential_rate(name, expected):
    assert GPU_PRESETS[name].exp_throughput_x == expected


def test_blackwell_ultra_keeps_blackwells_tensor_core_peaks():
    for ultra, base in (("b300", "b200"), ("gb300", "gb200")):
        u, b = GPU_PRESETS[ultra], GPU_PRESETS[base]
        assert (u.peak_flops_bf16, u.peak_flops_fp8) == (b.peak_flops_bf16, b.peak_flops_fp8)


def test_gb300_runs_deepseek_fp8_attention_forward_near_nvidias_measured_speedup():
    """The MMAs (640 fp8 FLOPs per score at 5 PFLOP/s) and the exponentials (16 per SM per clock on GB200's SM
    cycles, twice that on GB300's equal ones) add: 1.43x against NVIDIA's measured 1.35x (the kernel hides a
    little of the exponentials' time that the sum does not)."""
    gb200, _ = _attention(1.0)
    gb300, _ = _attention(2.0)
    assert gb200 / gb300 == pytest.approx(GB300_OVER_GB200_FP8_ATTENTION_FWD, rel=0.07)
    assert GPU_PRESETS["gb300"].sm_cycles_per_s == pytest.approx(GPU_PRESETS["gb200"].sm_cycles_per_s, rel=1e-3)


@settings(max_examples=25, deadline=None)
@given(exp_x=st.floats(0.5, 8.0), fp8=st.sampled_from([0.0, 1.0]), seq=st.sampled_from([1024, 4096, 16384]),
       qk=st.sampled_from([64, 128, 192]))
def test_backward_saves_the_forwards_exponential_time(exp_x, fp8, seq, qk):
    """The backward recomputes the forward's exponentials: it saves (or loses) as many seconds, and its larger fixed
    cost per query row (compute.ATTN_BWD_ROW_COST_X, counted as keys) a little more."""
    f1, b1 = _attention(1.0, fp8=fp8, seq=seq, qk=qk, v=qk)
    fx, bx = _attention(exp_x, fp8=fp8, seq=seq, qk=qk, v=qk)
    half = EfficiencyParams().attn_seq_half
    rows = (seq / 2 + compute.ATTN_BWD_ROW_COST_X * half / 2) / (seq / 2 + half / 2)
    # float32: the differences cancel to ~1e-7 of the backward's time where exp_x is near 1
    assert b1 - bx == pytest.approx((f1 - fx) * rows, rel=1e-3, abs=1e-6 * b1)


def test_bf16_attention_gains_less_than_fp8():
    """bf16 runs the same exponentials under tensor-core work twice as long, so its share of them is smaller."""
    fp8 = _attention(1.0, fp8=1.0)[0] / _attention(2.0, fp8=1.0)[0]
    bf16 = _attention(1.0, fp8=0.0)[0] / _attention(2.0, fp8=0.0)[0]
    assert 1.0 < bf16 < fp8


def test_unfused_attention_does_not_use_the_fused_kernels_exponential_rate():
    assert _attention(1.0, flash=0.0, fp8=0.0) == _attention(2.0, flash=0.0, fp8=0.0)


@settings(max_examples=10, deadline=None)
@given(lo=st.floats(0.25, 4.0), step=st.floats(0.0, 4.0))
def test_faster_exponentials_are_never_slower(lo, step):
    """Property on the whole model: a GB200 with faster special-function units never predicts a slower step."""
    problem = api.build_problem(model="qwen3-30b-a3b", gpu="gb200", gpus=8, global_batch=64, seq_len=4096,
                                precision="fp8", framework={"attention_backend": "fused"})
    plan = api.plan_from_text("tp=1,pp=1,ep=8,mbs=1", problem)

    def step_s(x):
        gpu = dataclasses.replace(problem.cluster.gpu, exp_throughput_x=x)
        p = dataclasses.replace(problem, cluster=dataclasses.replace(problem.cluster, gpu=gpu))
        return api.predict_plan(p, plan)["step_time_s"]

    assert step_s(lo + step) <= step_s(lo) * (1 + 1e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, 100.0, "2"])
def test_exp_throughput_out_of_range_is_named(bad):
    with pytest.raises(SpecError, match="exp_throughput_x"):
        GPUSpec(name="x", peak_flops_bf16=1e15, hbm_bytes=80e9, hbm_bandwidth_bytes_per_s=3e12,
                intra_node_bw_bytes_per_s=450e9, inter_node_bw_bytes_per_s=50e9, exp_throughput_x=bad)


def test_cli_prices_gb300_attention_below_gb200():
    """Same plan, same peaks: GB300 is faster than GB200 only by its exponentials (and NIC / memory, unused here)."""
    steps = {}
    for gpu in ("gb200", "gb300"):
        problem = api.build_problem(model="llama3-8b", gpu=gpu, gpus=8, global_batch=64, seq_len=8192,
                                    precision="bf16", framework={"attention_backend": "fused"})
        steps[gpu] = api.predict_plan(problem, api.plan_from_text("tp=1,pp=1,dp=8,mbs=1", problem))["step_time_s"]
    assert steps["gb300"] < steps["gb200"]


@pytest.mark.parametrize("name, sms, mhz", [("a100-80gb", 108, 1410), ("h100", 132, 1980), ("h200", 132, 1980),
                                            ("b200", 148, 1980), ("gb200", 148, 2200), ("b300", 160, 1831),
                                            ("gb300", 160, 2035), ("mi300x", 304, 2100)])
def test_presets_carry_their_sms_and_clock(name, sms, mhz):
    g = GPU_PRESETS[name]
    assert (g.sm_count, g.sm_clock_hz) == (sms, mhz * 1e6)


def test_blackwell_ultra_keeps_its_base_chips_sm_cycles():
    """Equal dense tensor-core peaks from 160 SMs instead of 148: the same SM cycles per second."""
    for ultra, base in (("b300", "b200"), ("gb300", "gb200")):
        assert GPU_PRESETS[ultra].sm_cycles_per_s == pytest.approx(GPU_PRESETS[base].sm_cycles_per_s, rel=1e-3)


def test_a_gpu_without_sms_has_h100s_balance():
    g = GPUSpec(name="x", peak_flops_bf16=2 * 989.4e12, hbm_bytes=80e9, hbm_bandwidth_bytes_per_s=3e12,
                intra_node_bw_bytes_per_s=450e9, inter_node_bw_bytes_per_s=50e9)
    assert g.sm_cycles_per_s == pytest.approx(2 * GPU_PRESETS["h100"].sm_cycles_per_s, rel=1e-6)


@pytest.mark.parametrize("fields, named", [({"sm_count": -1, "sm_clock_hz": 1e9}, "sm_count"),
                                           ({"sm_count": 1.5, "sm_clock_hz": 1e9}, "sm_count"),
                                           ({"sm_count": True, "sm_clock_hz": 1e9}, "sm_count"),
                                           ({"sm_count": 10 ** 6, "sm_clock_hz": 1e9}, "sm_count"),
                                           ({"sm_count": 132, "sm_clock_hz": float("nan")}, "sm_clock_hz"),
                                           ({"sm_count": 132, "sm_clock_hz": -1.0}, "sm_clock_hz"),
                                           ({"sm_count": 132, "sm_clock_hz": "1.98e9"}, "sm_clock_hz"),
                                           ({"sm_count": 132}, "sm_count"), ({"sm_clock_hz": 1.98e9}, "sm_count")])
def test_bad_sm_figures_are_named(fields, named):
    with pytest.raises(SpecError) as err:
        GPUSpec(name="x", peak_flops_bf16=1e15, hbm_bytes=80e9, hbm_bandwidth_bytes_per_s=3e12,
                intra_node_bw_bytes_per_s=450e9, inter_node_bw_bytes_per_s=50e9, **fields)
    assert err.value.field == named
