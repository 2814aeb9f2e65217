"""The cost model against what two lent GPUs measured, an H200 SXM (2026-12-04) and an H100 SXM (2026-12-06)
(tests/data/gpu/, provenance in its README.md): kernel micro-benchmarks (tests/gpu/microbench*.py) and short
jax-runner runs (tests/gpu/verify_gpu.sh). No constant was fitted to the H100's files: they are a second,
held-out GPU. Golden values are the measurements; `tests/gpu/compare_gpu.py --gpu h200|h100` prints the same
comparisons, `--across` the H200 / H100 ratios."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from costmodels.params import LITERATURE_PRIOR, EfficiencyParams
from costmodels.presets import GPU_PRESETS

_SPEC = importlib.util.spec_from_file_location("compare_gpu", Path(__file__).parent / "gpu" / "compare_gpu.py")
cg = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cg)

GPUS = cg.MEASURED_GPUS


@pytest.fixture(scope="module", params=GPUS)
def gpu(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def bench(gpu) -> dict:
    return cg.load(cg.files(gpu)["microbench"])


@pytest.fixture(scope="module")
def moe(gpu) -> dict:
    return cg.moe_section(cg.load(cg.files(gpu)["moe"]), GPU_PRESETS[gpu])


@pytest.fixture(scope="module")
def runs(gpu) -> list:
    return cg.runs_section(cg.load(cg.files(gpu)["runs"]))


def test_gemm_shape_law_is_the_measured_one(gpu, bench):
    # at the GPU's maximum achievable matmul rate (eff_max = 1 of MAMF), the model's GEMM term with the
    # shipped size law (gemm_dim_half 46, measured on the H200) times the 72 training-sized shapes within 8 %
    # on both GPUs (H200 5.5 %, H100 6.2 %: their spread is power and tiling)
    m, n, k, t = cg.gemm_arrays(bench)
    e = EfficiencyParams()._replace(gemm_eff_max=1.0)
    train = cg.training_shapes(m, n, k)
    err = cg.error_figures(cg.model_gemm_s(m, n, k, e, GPU_PRESETS[gpu])[train], t[train])
    assert err["n"] >= 60 and err["mape_pct"] < 8.0, err


def test_gemm_size_constant_is_the_h200_fit():
    # the shipped size constant is what the H200's 224 shapes give (a fit of the model's own form: roofline
    # max of the saturating compute term and HBM traffic, plus a kernel's fixed time). The H100's shapes fit
    # 122 with eff_max 1.035 (the two trade against each other; its training shapes hold above)
    m, n, k, t = cg.gemm_arrays(cg.load(cg.files("h200")["microbench"]))
    fit = cg.fit_gemm(m, n, k, t, GPU_PRESETS["h200"])
    assert 0.7 < EfficiencyParams().gemm_dim_half / fit["gemm_dim_half"] < 1.4, fit


def test_mamf_presets_are_the_measured_rates():
    # the best bf16 / fp8 GEMM of the sweep against the preset's maximum achievable matmul fraction: the
    # H100 measured 797 / 989 = 0.806 (preset 0.803) and fp8 1,440 / 1,979 = 0.728 (preset 0.734, H200's:
    # not ml-engineering's H100 0.709); the H200 815 (its sweep ran into the 700 W limit) and fp8 1,482
    for gpu in GPUS:
        g = cg.load(cg.files(gpu)["microbench"])["gemm"]
        spec = GPU_PRESETS[gpu]
        bf16 = max(r["bf16_tflops"] for r in g) * 1e12 / spec.peak_flops_bf16
        fp8 = max(r["fp8_tflops"] for r in g if r.get("fp8_tflops")) * 1e12 / spec.peak_flops_fp8
        assert abs(bf16 / spec.matmul_frac_bf16 - 1.0) < 0.04, (gpu, bf16)
        assert abs(fp8 / spec.matmul_frac_fp8 - 1.0) < 0.04, (gpu, fp8)


def test_small_gemms_are_slower_per_flop(bench):
    # the physics the saturating law stands for, in the measurements themselves: at fixed n and k, a
    # GEMM with 8x fewer rows runs well below the large one's rate
    g = {(r["m"], r["n"], r["k"]): r["bf16_tflops"] for r in bench["gemm"]}
    for n, k in ((4096, 4096), (8192, 4096), (4096, 8192)):
        assert g[(256, n, k)] < 0.75 * g[(2048, n, k)], (n, k)


@pytest.mark.parametrize("backend", ["cudnn"])
def test_attention_head_dim_rate_matches_the_measured_ratio(gpu, bench, backend):
    # Transformer Engine's cuDNN fused attention on Hopper: head dim 64 vs 128 at the same width,
    # forward + backward, sequences >= 4096: the model's 0.82 (MMAs, exponentials and the backward's shared-memory
    # reads at the GPU's rates; compute.attention_core_fwd_bwd_s) against the H200's 0.78 and the H100's 0.80
    measured = cg.measured_head_dim_ratio(bench, backend)
    model = cg.attention_section(bench, GPU_PRESETS[gpu])["model head dim 64 / 128"]
    assert measured is not None and abs(measured - model) < 0.06, (measured, model)


def test_hbm_eff_is_inside_the_measured_range(gpu, bench):
    fr = cg.hbm_section(bench, GPU_PRESETS[gpu])["measured fraction of datasheet"]
    lo, hi = min(fr.values()), max(fr.values())
    assert 0.8 < lo <= hi < 1.0
    assert lo - 0.03 <= EfficiencyParams().hbm_eff <= hi + 0.03, (EfficiencyParams().hbm_eff, fr)


def test_streaming_kernels_scale_with_hbm_and_fused_ones_do_not():
    # the same 132 SMs at 1,980 MHz with 3.35 and 4.8 TB/s: a plain copy / add / fma runs in the datasheet
    # ratio (0.708 against 0.698), as the model's HBM terms assume; the 218 (kernel, shape) pairs of
    # activations, norms, rope, residual adds, permutes and the router barely gain (median 0.96: eager
    # 0.82-0.93, compiled 1.1-1.5). The model's element-wise work keeps HBM's ratio: bounding it by the
    # SMs' issue rate (12 B per SM per cycle) was tried and rejected (README "Measured on two GPUs")
    a = cg.across_section()
    assert a["copy / add / fma"] == pytest.approx(a["model"], rel=0.05)
    assert a["n"] >= 200 and a["median"] > a["model"] + 0.15


def test_memory_matches_the_verify_runs(runs):
    # 17 runs of a 1.1B and an 8B-shaped stage (no / selective / full recompute, micro-batch 1-8) per GPU:
    # predicted dynamic memory vs the allocator's peak_bytes_in_use
    err = np.array([r["memory_error_pct"] for r in runs])
    assert len(runs) == 17
    assert np.mean(np.abs(err)) < 5.0 and np.max(np.abs(err)) < 15.0, err


def test_the_runner_may_use_what_megatron_would():
    # the H100's first pass ran the 8B stage at micro-batch 2 out of memory at XLA's 58 GiB (JAX's 75 %
    # preallocation); with autotune.runner.claim_device_memory the same plan ran at 66.4 GB, as on the H200
    rows = cg.load(cg.files("h100")["runs"])
    same = [r for r in rows if "llama3-8b-L8-tp1-pp1-dp1-cp1-ep1-mbs2-none" in r["id"]]
    assert [r["usable"] for r in same] == [False, True]
    h200 = [r for r in cg.load(cg.files("h200")["runs"]) if "llama3-8b-L8-tp1-pp1-dp1-cp1-ep1-mbs2-none" in r["id"]]
    assert same[1]["measured"]["memory_gb"] == pytest.approx(h200[0]["measured"]["memory_gb"], rel=0.01)


def test_step_time_of_the_8b_stage_without_full_recompute(runs):
    # the GEMM-dominated 8B-shaped stage (h 4096, 8 layers, seq 4096) without full recompute: within 7 %
    # (H200 -5.8 / -5.6 / -3.3 %, H100 -4.7 / -4.2 / -0.9 %: the micro-batch-1 runs are a little too fast; before
    # fused attention was costed as MMAs + exponentials + shared memory with the backward's own fixed cost,
    # 2026-12-06, H200 -5.8 / -5.2 / -3.5 %, H100 -4.5 / -3.7 / -1.0 %)
    sel = [r for r in runs if r["model"] == "llama3-8b" and "full" not in r["plan"]]
    assert len(sel) == 3
    for r in sel:
        assert abs(r["step_error_pct"]) < 7.0, r


def test_step_time_of_every_run_without_full_recompute(runs):
    # the runner's step is one XLA program (Framework.JAX): no per-kernel host dispatch and no Megatron
    # per-step / per-micro-batch host work (with them: 1.1B runs +11..+26 %), and each micro-batch's gradients
    # are added to the fp32 accumulator by a kernel of their own (gradient_accumulation_fusion False: without
    # it the micro-batch-1 runs were -12 %). 11 runs, 1.1B and 8B, micro-batch 1-8, none / selective recompute:
    # H200 4.0 % MAPE (max 8.8 %), H100 4.2 % (max 11.7 %: the 1.1B at micro-batch 8, which gains more from the larger
    # micro-batch than the model says; 3.7 / 4.0 % before the attention term of 2026-12-06; over all 17 runs 7.3 ->
    # 7.1 % H200, 8.7 -> 8.5 % H100). (Not held: full recompute, +3..+27 %: the model charges a
    # layer's forward but its MLP's down projection per recomputed layer, where the runs measured +7-12 % of
    # the step; the rest is not explained yet.)
    sel = [r for r in runs if "full" not in r["plan"]]
    err = np.array([r["step_error_pct"] for r in sel])
    assert len(sel) == 11
    assert np.mean(np.abs(err)) < 6.0 and np.max(np.abs(err)) < 12.0, err


def test_expert_gemms_match_a_batched_gemm_at_every_size(moe):
    # an MoE layer's expert GEMMs (5 models' shapes, 1-32 local experts, 128-8192 tokens per expert): the
    # model's grouped GEMMs (fc1 and fc2 each one kernel over the local experts, rows saturating on all
    # experts' tokens) at eff_max = 1 of MAMF time one batched GEMM over the experts within 18 % at every size
    # on both GPUs (0.82-0.98; 0.87-0.99 until the refits of 2026-12-06 moved the fitted kernel_overhead_s from
    # 4.9 to 3.8 us, which the 128-token GEMMs of a few microseconds feel). The per-expert law it replaced is
    # 1.14-1.17x slower at 512 tokens per expert (fine-grained experts: Qwen3-30B-A3B and GPT-OSS dispatch
    # ~500-1000 per micro-batch), where the grouped one is the closer; at 128 the two are off by as much
    # (grouped 0.82-0.84, per expert 1.09-1.17; 1.11-1.17 until the alltoall sorts' refit of 2026-12-06 moved
    # kernel_overhead_s from 3.8 to 3.7 us)
    by_m = moe["expert GEMMs model / measured by m_e"]
    assert len(by_m) >= 4
    for m_e, v in by_m.items():
        assert 0.80 < v["batched"] < 1.05, (m_e, v)
        if int(m_e) <= 512:
            assert v["per_expert_law"] > 1.08, (m_e, v)
        if 128 < int(m_e) <= 512:
            assert abs(v["batched"] - 1.0) < abs(v["per_expert_law"] - 1.0), (m_e, v)


def test_token_permutation_moves_the_bytes_the_model_counts(moe):
    # gathering routed tokens into expert order: read + write of bf16 rows, the model's 4 B per routed
    # token per hidden unit (half of compute.PERMUTE_BYTES_PER_H); measured 3.5-5.3 on the two GPUs
    pb = moe["permute bytes per routed token per h"]
    assert 0.75 < pb["median"] / pb["model"] < 1.4, pb


def test_swiglu_costs_what_the_measured_kernels_move():
    # SwiGLU forward + backward on the H200 moves the equivalent of ~23-29 B per token per FFN unit per
    # forward at its datasheet bandwidth (eager, and compiled as Megatron-Core's jit_fuser does), 4-5x an
    # ideal fused kernel's 6 B; the prior is that measurement and the fitted value stays within 25 % of both
    # kernels. On the H100 the same kernels come to 18-19 B (they do not run at the H200's bandwidth:
    # test_streaming_kernels_scale_with_hbm_and_fused_ones_do_not): there the constant charges 1.5-1.6x the
    # activation alone, the FFN-proportional work beside it (fp8 casts, the README's lead) included
    measured = {}
    for gpu in GPUS:
        sw = cg.moe_section(cg.load(cg.files(gpu)["moe"]), GPU_PRESETS[gpu])["SwiGLU bytes per token per f"]
        assert sw["shapes"] >= 5
        measured[gpu] = (sw["eager (fwd + bwd) / 3"], sw["compiled (fwd + bwd) / 3"])
    for value in (EfficiencyParams().elementwise_bytes_f, LITERATURE_PRIOR.elementwise_bytes_f):
        assert all(0.75 < value / m < 1.35 for m in measured["h200"]), (value, measured)
        assert all(1.0 < value / m < 2.0 for m in measured["h100"]), (value, measured)
    assert min(measured["h200"] + measured["h100"]) > 2.5 * 6.0


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
