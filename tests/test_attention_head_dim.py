"""Fused attention's rate by head dimension. Golden: FlashAttention-3 (Shah et al. 2024, Fig. 5), forward on
H100 at 4k tokens, head dim 64 vs 128: 476 vs 638 TFLOP/s = 0.746x; never above the head-dim-128 rate.

Two models with the same attention FLOPs and GEMM shapes (16 heads x 128 vs 32 heads x 64, kv heads in the
same proportion) differ only in the attention kernel's head dimension, so their compute times agree exactly
when the head-dim-64 model's attention efficiency is raised by 1/0.75."""
from __future__ import annotations

import json

import pytest

from autotune.api import build_problem, predict_plan
from costmodels.compute import ATTN_HEAD_DIM_HALF, saturate
from costmodels.params import EfficiencyParams
from costmodels.plan import Plan


def _model(tmp_path, heads: int, head_dim: int, kv_heads: int) -> str:
    cfg = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 2048, "intermediate_size": 5632,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
           "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    path = tmp_path / f"h{heads}x{head_dim}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _compute_s(tmp_path, heads, head_dim, kv_heads, attn_eff_max, framework=None):
    problem = build_problem(model=_model(tmp_path, heads, head_dim, kv_heads), gpu="h100", gpus=8,
                            global_batch=8, seq_len=4096, framework=framework)
    rep = predict_plan(problem, Plan(tp=1, pp=1, dp=8, mbs=1), params=EfficiencyParams(attn_eff_max=attn_eff_max))
    return rep["time_breakdown_s"]["compute"]


def test_head_dim_64_runs_at_three_quarters_of_the_head_dim_128_rate():
    assert saturate(64.0, ATTN_HEAD_DIM_HALF) / saturate(128.0, ATTN_HEAD_DIM_HALF) == pytest.approx(476 / 638, abs=0.01)


def test_only_the_attention_kernel_sees_the_head_dim(tmp_path):
    small = _compute_s(tmp_path, 32, 64, 8, attn_eff_max=0.4 / 0.75)
    large = _compute_s(tmp_path, 16, 128, 4, attn_eff_max=0.4)
    assert small == pytest.approx(large, rel=1e-5)
    assert _compute_s(tmp_path, 32, 64, 8, attn_eff_max=0.4) > large


def test_larger_heads_are_not_faster_than_head_dim_128(tmp_path):
    large = _compute_s(tmp_path, 16, 128, 4, attn_eff_max=0.4)
    assert _compute_s(tmp_path, 8, 256, 2, attn_eff_max=0.4) == pytest.approx(large, rel=1e-5)


def test_unfused_attention_does_not_use_the_fused_kernel_rate(tmp_path):
    unfused = {"attention_backend": "unfused"}
    assert _compute_s(tmp_path, 32, 64, 8, 0.4, unfused) == pytest.approx(_compute_s(tmp_path, 32, 64, 8, 0.7, unfused),
                                                                            rel=1e-6)
