"""The cost model against what one H200 measured (tests/data/gpu/, provenance in its README.md):
kernel micro-benchmarks (tests/gpu/microbench.py) and short jax-runner runs (tests/gpu/verify_gpu.sh).
Golden values are the measurements; `tests/gpu/compare_h200.py` prints the same comparisons."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from costmodels.params import LITERATURE_PRIOR, EfficiencyParams

_SPEC = importlib.util.spec_from_file_location("compare_h200", Path(__file__).parent / "gpu" / "compare_h200.py")
h200 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(h200)


@pytest.fixture(scope="module")
def bench() -> dict:
    return h200.load(h200.MICROBENCH)


@pytest.fixture(scope="module")
def moe() -> dict:
    return h200.moe_section(h200.load(h200.MOE_MICROBENCH))


@pytest.fixture(scope="module")
def runs() -> list:
    return h200.runs_section(h200.load(h200.RUNS))


def test_gemm_shape_law_is_the_measured_one(bench):
    # the shipped size constant is the one the 224 measured shapes give (a fit of the model's own
    # form: roofline max of the saturating compute term and HBM traffic, plus a kernel's fixed time)
    m, n, k, t = h200.gemm_arrays(bench)
    fit = h200.fit_gemm(m, n, k, t)
    assert 0.7 < EfficiencyParams().gemm_dim_half / fit["gemm_dim_half"] < 1.4, fit
    # at the GPU's maximum achievable matmul rate (eff_max = 1 of MAMF), the model's GEMM term with the
    # shipped size law times the training-sized shapes within 8 % (their spread is power and tiling)
    e = EfficiencyParams()._replace(gemm_eff_max=1.0)
    train = h200.training_shapes(m, n, k)
    err = h200.error_figures(h200.model_gemm_s(m, n, k, e)[train], t[train])
    assert err["n"] >= 60 and err["mape_pct"] < 8.0, err


def test_small_gemms_are_slower_per_flop(bench):
    # the physics the saturating law stands for, in the measurements themselves: at fixed n and k, a
    # GEMM with 8x fewer rows runs well below the large one's rate
    g = {(r["m"], r["n"], r["k"]): r["bf16_tflops"] for r in bench["gemm"]}
    for n, k in ((4096, 4096), (8192, 4096), (4096, 8192)):
        assert g[(256, n, k)] < 0.75 * g[(2048, n, k)], (n, k)


@pytest.mark.parametrize("backend", ["cudnn"])
def test_attention_head_dim_rate_matches_the_measured_ratio(bench, backend):
    # Transformer Engine's cuDNN fused attention on Hopper: head dim 64 vs 128 at the same width,
    # forward + backward, sequences >= 4096: the model's d/(d+64) ratio (compute.ATTN_HEAD_DIM_HALF)
    measured = h200.measured_head_dim_ratio(bench, backend)
    model = h200.attention_section(bench)["model head dim 64 / 128"]
    assert measured is not None and abs(measured - model) < 0.05, (measured, model)


def test_hbm_eff_is_inside_the_measured_range(bench):
    fr = h200.hbm_section(bench)["measured fraction of datasheet"]
    lo, hi = min(fr.values()), max(fr.values())
    assert 0.8 < lo <= hi < 1.0
    assert lo - 0.03 <= EfficiencyParams().hbm_eff <= hi + 0.03, (EfficiencyParams().hbm_eff, fr)


def test_memory_matches_the_h200_runs(runs):
    # 17 runs of a 1.1B and an 8B-shaped stage (no / selective / full recompute, micro-batch 1-8):
    # predicted dynamic memory vs the allocator's peak_bytes_in_use
    err = np.array([r["memory_error_pct"] for r in runs])
    assert len(runs) == 17
    assert np.mean(np.abs(err)) < 5.0 and np.max(np.abs(err)) < 15.0, err


def test_step_time_of_the_8b_stage_without_full_recompute(runs):
    # the GEMM-dominated 8B-shaped stage (h 4096, 8 layers, seq 4096) without full recompute: within 7 %
    # (-5.0, -4.3, -2.6 %: the micro-batch-1 runs are a little too fast)
    sel = [r for r in runs if r["model"] == "llama3-8b" and "full" not in r["plan"]]
    assert len(sel) == 3
    for r in sel:
        assert abs(r["step_error_pct"]) < 7.0, r


def test_step_time_of_every_run_without_full_recompute(runs):
    # the runner's step is one XLA program (Framework.JAX): no per-kernel host dispatch and no Megatron
    # per-step / per-micro-batch host work (with them: 1.1B runs +11..+26 %), and each micro-batch's gradients
    # are added to the fp32 accumulator by a kernel of their own (gradient_accumulation_fusion False: without
    # it the micro-batch-1 runs were -12 %). 11 runs, 1.1B and 8B, micro-batch 1-8, none / selective recompute:
    # 3.4 % MAPE, max 7 %. (Not held: full recompute, +3..+21 %: the model charges a layer's forward but its
    # MLP's down projection per recomputed layer, where the runs measured +7-12 % of the step; the rest is
    # not explained yet.)
    sel = [r for r in runs if "full" not in r["plan"]]
    err = np.array([r["step_error_pct"] for r in sel])
    assert len(sel) == 11
    assert np.mean(np.abs(err)) < 6.0 and np.max(np.abs(err)) < 10.0, err


def test_expert_gemms_match_a_batched_gemm_at_training_sizes(moe):
    # an MoE layer's expert GEMMs (5 models' shapes, 1-32 local experts): the model's per-expert GEMMs at
    # eff_max = 1 of MAMF time one batched GEMM over the experts within 10 % from 2048 tokens per expert
    # (the dispatch of the validation runs gives ~2000-5000); below that the model is slower than one
    # grouped kernel (per-expert saturation and kernel overheads), never faster
    by_m = moe["expert GEMMs model / measured by m_e"]
    for m_e, v in by_m.items():
        if int(m_e) >= 2048:
            assert 0.9 < v["batched"] < 1.1, (m_e, v)
        else:
            assert v["batched"] > 1.0, (m_e, v)


def test_token_permutation_moves_the_bytes_the_model_counts(moe):
    # gathering routed tokens into expert order: read + write of bf16 rows, the model's 4 B per routed
    # token per hidden unit (half of compute.PERMUTE_BYTES_PER_H); measured 3.9-5.3
    pb = moe["permute bytes per routed token per h"]
    assert 0.75 < pb["median"] / pb["model"] < 1.4, pb


def test_swiglu_costs_what_the_measured_kernels_move(moe):
    # SwiGLU forward + backward on the H200 moves the equivalent of ~23-29 B per token per FFN unit per
    # forward (eager, and compiled as Megatron-Core's jit_fuser does), 4-5x an ideal fused kernel's 6 B;
    # the prior is the measurement and the fitted value stays within 25 % of both kernels
    sw = moe["SwiGLU bytes per token per f"]
    assert sw["shapes"] >= 5
    measured = (sw["eager (fwd + bwd) / 3"], sw["compiled (fwd + bwd) / 3"])
    for value in (EfficiencyParams().elementwise_bytes_f, LITERATURE_PRIOR.elementwise_bytes_f):
        assert all(0.75 < value / m < 1.35 for m in measured), (value, measured)
    assert min(measured) > 3.0 * 6.0


def _dot_shapes(jaxpr, out: list) -> list:
    """(lhs shape, rhs shape) of every dot_general in a jaxpr and the jaxprs nested in its equations."""
    from jax.extend.core import jaxprs_in_params
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append((tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape)))
        for sub in jaxprs_in_params(eqn.params):
            _dot_shapes(sub, out)
    return out


def test_jax_full_recompute_skips_the_mlp_down_projection():
    # The README's account of the runner's cheap full recompute: the gradient of a remat'ed layer
    # recomputes q, k, v, o, gate, up and the two attention products, not the down projection (its
    # output is never read by the backward pass), so XLA's "full" is ~3/4 of a layer's forward GEMMs.
    import collections

    import jax
    import jax.numpy as jnp

    from autotune.runner.model import Dims, init_params, reference_loss
    dm = Dims(num_layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=704, vocab=512)
    params = init_params(dm, jax.random.key(0))
    tokens = jnp.zeros((2, 128), jnp.int32)

    def dots(recompute):
        grad = jax.grad(lambda p: reference_loss(p, tokens, tokens, dm, recompute=recompute))
        return collections.Counter(_dot_shapes(jax.make_jaxpr(grad)(params).jaxpr, []))
    extra = dots("full") - dots("none")
    x = (2, 128, 256)
    assert extra[(x, (256, 704))] == 2                    # gate and up recomputed
    assert extra[(x, (256, 128))] == 2                    # k and v (2 KV heads x 64)
    assert extra[(x, (256, 256))] == 2                    # q and the output projection
    assert not any(rhs == (704, 256) for _, rhs in extra)  # the down projection is not
    assert sum(extra.values()) == 8
