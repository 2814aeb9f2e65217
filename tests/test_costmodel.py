"""The JAX cost model: hand-computed values, contracts, properties, differentiability.

Three layers of checks (STYLE.md points 6 and 7):

1. Hand-computed values of the pieces that have closed forms (collectives and group placement,
   parameter counts, model FLOPs, weight / gradient / optimizer bytes by ZeRO stage), on a tiny
   model and a hand-written topology. Tuned constants are read from the `EfficiencyParams` object,
   never written here as literals, so re-tuning does not break these tests.
2. Contract tests over random samples of legal plans of real problems: every term is finite and
   >= 0, the breakdown adds up, absent parallelism costs nothing, batching does not change a
   plan's score, and exhaustive search returns the fastest plan that fits.
3. Hypothesis properties (faster hardware is never slower; more TP never raises weight memory;
   full recomputation never uses more activation memory) and finite gradients everywhere.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.api import build_problem
from autotune.scoring import MEM_KEYS, TIME_KEYS, Inputs, score_summary
from autotune.search import exhaustive
from costmodels import collectives as C
from costmodels import model as cm
from costmodels.breakdown import flatten
from costmodels.encode import encode_cluster, encode_job, encode_model
from costmodels.params import EfficiencyParams, params_as_arrays
from costmodels.plan import PLAN_FIELDS, RECOMPUTE_MODULES, Plan, PlanBatch, stage_layers
from costmodels.presets import load_gpu
from costmodels.specs import ClusterSpec, FrameworkSpec, JobSpec, ModelSpec, Precision, Recompute
from search_spaces.space import KNOBS, OPTUNA_ONLY_KNOBS, Problem, check_rows, enumerate_legal

E = EfficiencyParams()                     # whatever the lead has tuned them to


def _np(out: dict) -> dict:
    return {k: np.asarray(v) for k, v in out.items()}


def _evaluate(plans: dict, model: dict, hw: dict, job: dict, e: EfficiencyParams = None) -> dict:
    """evaluate_jit with the batch padded to a few fixed sizes (1, 64, multiples of 1024), so the
    whole module compiles the cost model a handful of times; returns numpy arrays."""
    n = len(plans["tp"])
    size = 1 if n == 1 else 64 if n <= 64 else 1024 * math.ceil(n / 1024)
    idx = np.concatenate([np.arange(n), np.zeros(size - n, dtype=np.int64)])
    padded = {k: np.asarray(v, dtype=np.int32)[idx] for k, v in plans.items()}
    out = flatten(cm.evaluate_jit(padded, model, hw, job, E if e is None else e))
    return {k: np.asarray(v)[:n] for k, v in out.items()}


def _arrays(plans) -> dict:
    return {k: np.asarray(v, dtype=np.int32) for k, v in PlanBatch.from_plans(plans).arrays.items()}


# =============================================================================================
# 1. Hand-computed values
# =============================================================================================

# ---- a hand-written topology: NVLink domains of 8, a fabric, optionally two sites ----

B0, B1, W = 400e9, 50e9, 100e9             # NVLink, NIC per GPU, WAN per site (bytes/s)
LAT0, LAT1, LATW = 2e-6, 10e-6, 5e-3
EFF = (0.5, 0.25)                          # (NVLink, fabric) efficiency, chosen for the test


def _hw(num_gpus=64, sites=1) -> dict:
    c = ClusterSpec(gpu=load_gpu("h100"), num_gpus=num_gpus, nvlink_domain_size=8,
                    intra_node_bw_bytes_per_s=B0, inter_node_bw_bytes_per_s=B1,
                    num_sites=sites, wan_bw_bytes_per_s=W if sites > 1 else 0.0,
                    wan_latency_s=LATW if sites > 1 else 0.0,
                    intra_node_latency_s=LAT0, inter_node_latency_s=LAT1)
    return {k: jnp.asarray(v) for k, v in encode_cluster(c).items()}


def _f(x) -> float:
    return float(np.asarray(x))


@pytest.mark.parametrize("n, stride, sites, bw, lat, crosses", [
    # TP of 8 at stride 1 fills one NVLink domain
    (8, 1, 1, B0 * EFF[0], LAT0, (False, False)),
    # 4 ranks 2 apart still sit in one domain of 8
    (4, 2, 1, B0 * EFF[0], LAT0, (False, False)),
    # a DP group at stride 8 (after tp=8) has one member per domain: one NIC each
    (4, 8, 1, min(B0 * EFF[0], 1 * B1 * EFF[1]), LAT1, (True, False)),
    # 16 ranks at stride 1: 8 per domain share 8 NICs -> min(B0, 8 B1)
    (16, 1, 1, min(B0 * EFF[0], 8 * B1 * EFF[1]), LAT1, (True, False)),
    # 8 ranks at stride 2: 4 per domain -> min(B0, 4 B1)
    (8, 2, 1, min(B0 * EFF[0], 4 * B1 * EFF[1]), LAT1, (True, False)),
    # two sites of 32 GPUs: a group at stride 32 crosses the WAN; one GPU's share of it is W/32
    (2, 32, 2, min(B0 * EFF[0], B1 * EFF[1], W / 32 * EFF[1]), LATW, (True, True)),
    # 8 ranks at stride 8 over two sites of 32: 4 per site, so the WAN share is 4 x W/32
    (8, 8, 2, min(B0 * EFF[0], B1 * EFF[1], 4 * W / 32 * EFF[1]), LATW, (True, True)),
    # inside one site of a two-site cluster nothing crosses the WAN
    (4, 8, 2, min(B0 * EFF[0], B1 * EFF[1]), LAT1, (True, False)),
])
def test_group_link_placement(n, stride, sites, bw, lat, crosses):
    hw = _hw(sites=sites)
    got_bw, got_lat = C.group_link(jnp.float32(n), jnp.float32(stride), hw, EFF)
    assert _f(got_bw) == pytest.approx(bw, rel=1e-6)
    assert _f(got_lat) == pytest.approx(lat, rel=1e-6)
    c0, c1 = C.crosses_levels(jnp.float32(n), jnp.float32(stride), hw)
    assert (bool(c0), bool(c1)) == crosses


def _zero_latency_hw(**kw) -> dict:
    hw = _hw(**kw)
    hw.update(intra_lat=jnp.float32(0), inter_lat=jnp.float32(0), wan_lat=jnp.float32(0))
    return hw


S = 1e9                                    # bytes per rank


@pytest.mark.parametrize("n, stride", [(2, 1), (8, 1), (4, 8), (16, 1), (64, 1), (8, 2)])
def test_all_reduce_and_reduce_scatter_bandwidth_terms(n, stride):
    hw = _zero_latency_hw()
    bw, _ = C.group_link(jnp.float32(n), jnp.float32(stride), hw, EFF)
    bw = _f(bw)
    ar = _f(C.all_reduce_s(S, jnp.float32(n), jnp.float32(stride), hw, EFF))
    rs = _f(C.reduce_scatter_s(S, jnp.float32(n), jnp.float32(stride), hw, EFF))
    ag = _f(C.all_gather_s(S, jnp.float32(n), jnp.float32(stride), hw, EFF))
    # ring all-reduce moves 2(n-1)/n of the buffer; reduce-scatter / all-gather (n-1)/n [Thakur 2005]
    assert ar == pytest.approx(2.0 * (n - 1) / n * S / bw, rel=1e-5)
    assert rs == pytest.approx((n - 1) / n * S / bw, rel=1e-5)
    assert ag == pytest.approx(rs, rel=1e-6)
    assert ar == pytest.approx(2 * rs, rel=1e-5)
    # a fixed per-collective cost is added as is
    base = 7e-4
    assert _f(C.all_reduce_s(S, jnp.float32(n), jnp.float32(stride), hw, EFF, base)) == \
        pytest.approx(ar + base, rel=1e-5)


@pytest.mark.parametrize("fn", [C.all_reduce_s, C.reduce_scatter_s, C.all_to_all_s])
@pytest.mark.parametrize("n, stride, lat", [(8, 1, LAT0), (4, 8, LAT1), (16, 1, LAT1)])
def test_latency_terms_are_size_independent_and_at_least_one_hop(fn, n, stride, lat):
    hw = _hw()
    t0 = _f(fn(0.0, jnp.float32(n), jnp.float32(stride), hw, EFF))
    hw0 = _zero_latency_hw()
    for size in (1e3, 1e6, 1e9):
        t = _f(fn(size, jnp.float32(n), jnp.float32(stride), hw, EFF))
        t_bw = _f(fn(size, jnp.float32(n), jnp.float32(stride), hw0, EFF))
        assert t == pytest.approx(t_bw + t0, rel=1e-5)
    assert t0 >= lat * (1 - 1e-6)                 # at least one hop of the slowest level crossed
    assert t0 <= lat * 4 * n                      # and not absurd


@pytest.mark.parametrize("fn", [C.all_reduce_s, C.reduce_scatter_s, C.all_to_all_s])
def test_group_of_one_costs_nothing(fn):
    hw = _hw()
    assert _f(fn(S, jnp.float32(1), jnp.float32(1), hw, EFF, 1e-3)) == 0.0
    assert _f(C.p2p_s(S, jnp.float32(8), jnp.float32(1), hw, EFF)) == 0.0


@pytest.mark.parametrize("n, stride, sites, expect", [
    # inside one domain: each rank sends (n-1)/n of its buffer over NVLink
    (8, 1, 1, 7 / 8 * S / (B0 * EFF[0])),
    (4, 2, 1, 3 / 4 * S / (B0 * EFF[0])),
    # 16 at stride 1: 7/16 stays in the domain, 8/16 leaves it over the NIC; the slower part counts
    (16, 1, 1, max(7 / 16 * S / (B0 * EFF[0]), 8 / 16 * S / (B1 * EFF[1]))),
    # 4 at stride 8: 3/4 of the data over NICs
    (4, 8, 1, 3 / 4 * S / (B1 * EFF[1])),
    # 2 at stride 32 over two sites: half the data over the GPU's WAN share
    (2, 32, 2, 1 / 2 * S / (W / 32 * EFF[1])),
])
def test_all_to_all_bandwidth_term(n, stride, sites, expect):
    hw = _zero_latency_hw(sites=sites)
    got = _f(C.all_to_all_s(S, jnp.float32(n), jnp.float32(stride), hw, EFF))
    assert got == pytest.approx(expect, rel=1e-5)


@pytest.mark.parametrize("pp, stride, sites, bw, lat", [
    (4, 2, 1, B0 * EFF[0], LAT0),      # 4 stages x 2 ranks inside one domain: NVLink
    (2, 8, 1, B1 * EFF[1], LAT1),      # stages 8 ranks apart: across nodes, one NIC
    (8, 4, 1, B1 * EFF[1], LAT1),
    # two sites of 32, stages 32 apart: 32 senders share the WAN link
    (2, 32, 2, min(B1 * EFF[1], W / 32 * EFF[1]), LATW),
])
def test_p2p(pp, stride, sites, bw, lat):
    hw = _hw(sites=sites)
    got = _f(C.p2p_s(S, jnp.float32(stride), jnp.float32(pp), hw, EFF))
    assert got == pytest.approx(S / bw + lat, rel=1e-5)


def test_collectives_are_vectorized():
    hw = _hw()
    n = jnp.array([1.0, 2.0, 8.0, 16.0])
    stride = jnp.array([1.0, 1.0, 1.0, 1.0])
    out = np.asarray(C.all_reduce_s(S, n, stride, hw, EFF))
    one = [_f(C.all_reduce_s(S, n[i], stride[i], hw, EFF)) for i in range(4)]
    np.testing.assert_allclose(out, one, rtol=1e-6)
    assert out[0] == 0 and np.all(np.diff(out) > 0)


# ---- a tiny model whose every count fits on paper ----
# L=2, h=64, a=4 heads of d=16, g KV heads, f=256, V=128, plain (2-matrix) MLP

def _tiny(kv_heads=4, gated=False, tied=False, **kw) -> ModelSpec:
    return ModelSpec(name="tiny", num_layers=2, hidden_size=64, ffn_hidden_size=256,
                     num_attention_heads=4, num_kv_heads=kv_heads, vocab_size=128,
                     gated_mlp=gated, tied_embeddings=tied, **kw)


TINY_MOE = dict(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=32, num_shared_experts=1,
                first_k_dense_layers=1)


def test_param_counts_dense_tiny():
    m = _tiny()
    attn = 64 * (4 + 2 * 4) * 16 + 4 * 16 * 64          # QKV + output = 4 h^2 for MHA
    assert attn == 4 * 64 * 64 == m.attention_params() == 16384
    assert m.mlp_params(256) == 2 * 64 * 256 == 32768
    norms = 2 * 64 * 2 + 64
    emb = 2 * 128 * 64                                    # input embedding + untied output layer
    pc = m.param_counts()
    assert pc["embedding"] == emb
    assert pc["total"] == pc["active"] == 2 * (attn + 32768) + norms + emb == 115008
    assert pc["experts"] == 0
    # tied embeddings store one matrix
    assert _tiny(tied=True).param_counts()["total"] == 115008 - 128 * 64
    # GQA: 2 KV heads shrink K and V
    assert _tiny(kv_heads=2).attention_params() == 64 * (4 + 4) * 16 + 4 * 16 * 64 == 12288
    # SwiGLU: three matrices
    assert _tiny(gated=True).mlp_params(256) == 3 * 64 * 256


def test_param_counts_moe_tiny():
    m = _tiny(**TINY_MOE)                       # layer 0 dense, layer 1 MoE
    assert m.num_moe_layers == 1
    expert = 2 * 64 * 32
    experts = 4 * expert                        # one MoE layer, 4 routed experts
    shared = 1 * expert
    router = 64 * 4
    attn = 2 * 16384
    dense_mlp = 32768
    norms = 2 * 64 * 2 + 64
    emb = 2 * 128 * 64
    pc = m.param_counts()
    assert pc["experts"] == experts
    assert pc["total"] == attn + dense_mlp + experts + shared + router + norms + emb == 102976
    assert pc["active"] == attn + dense_mlp + 2 * expert + shared + router + norms + emb


# ---- the tiny problem: 16 H100 (two nodes), batch 16 x 32 tokens ----

TINY_JOB = JobSpec(global_batch=16, seq_len=32)


def _tiny_inputs(model: ModelSpec, job: JobSpec = TINY_JOB, num_gpus: int = 16):
    c = ClusterSpec(gpu=load_gpu("h100"), num_gpus=num_gpus, nvlink_domain_size=8,
                    intra_node_bw_bytes_per_s=B0, inter_node_bw_bytes_per_s=B1)
    return encode_model(model), encode_cluster(c), encode_job(job, c)


def _eval_tiny(model, plans, job=TINY_JOB, num_gpus=16, e=E) -> dict:
    M, H, J = _tiny_inputs(model, job, num_gpus)
    return _evaluate(_arrays(plans), M, H, J, e)


def _fwd_flops_per_token(m: ModelSpec, s: int) -> float:
    """2 x (matmul weights a token meets) + causal attention core; no FLOPs for the lookup."""
    pc = m.param_counts()
    h, L, V = m.hidden_size, m.num_layers, m.vocab_size
    norms = 2 * h * L + h
    lookup = V * h if not m.tied_embeddings else 0      # the input embedding is a gather
    matmul = pc["active"] - norms - lookup
    if m.tied_embeddings:                               # the tied matrix is used as the output layer
        matmul = pc["active"] - norms
    d = m.head_dim_eff
    core = 2 * (s / 2) * m.num_attention_heads * (d + d)   # QK^T and AV, half of them (causal)
    return 2 * matmul + L * core


TINY_PLANS = [Plan(tp=1, pp=1, dp=16), Plan(tp=2, pp=1, dp=8, sp=True), Plan(tp=1, pp=2, dp=8),
              Plan(tp=4, pp=2, dp=2, recompute=Recompute.FULL), Plan(tp=1, cp=2, dp=8, zero=1),
              Plan(tp=2, pp=2, dp=4, vpp=1, mbs=2, recompute=Recompute.SELECTIVE)]


@pytest.mark.parametrize("model", [_tiny(), _tiny(kv_heads=2, gated=True), _tiny(**TINY_MOE)],
                         ids=["dense", "gqa-swiglu", "moe"])
def test_model_flops_tiny(model):
    out = _eval_tiny(model, TINY_PLANS)
    s, tokens = TINY_JOB.seq_len, TINY_JOB.tokens_per_step
    expect = 3 * tokens * _fwd_flops_per_token(model, s)
    np.testing.assert_allclose(out["model_flops"], expect, rtol=1e-5)
    if not model.is_moe and model.num_kv_heads == model.num_attention_heads:
        # the brief's closed form: 3 T (L (2 attn + 2 mlp + 2 (s/2) a (d + d)) + 2 h V)
        L, h, a, d, V = 2, 64, 4, 16, 128
        closed = 3 * tokens * (L * (2 * 16384 + 2 * 32768 + 2 * (s / 2) * a * (d + d)) + 2 * h * V)
        assert closed == 339738624
        np.testing.assert_allclose(out["model_flops"], closed, rtol=1e-6)


def test_hardware_flops_count_recomputation():
    m = _tiny()
    plans = [Plan(tp=1, dp=16, recompute=r) for r in Recompute]
    out = _eval_tiny(m, plans)
    s, tokens, L = TINY_JOB.seq_len, TINY_JOB.tokens_per_step, 2
    layer_fwd = 2 * (16384 + 32768) + 2 * (s / 2) * 4 * 32
    core = 2 * (s / 2) * 4 * 32
    mf = out["model_flops"][0]
    np.testing.assert_allclose(out["hw_flops"], [mf, mf + tokens * L * core, mf + tokens * L * layer_fwd],
                               rtol=1e-5)


def _params_on_rank(m: ModelSpec, plan: Plan) -> float:
    """Weights one GPU of the busiest (first or last) stage holds, biases and norms aside."""
    L, h, V = m.num_layers, m.hidden_size, m.vocab_size
    n_stage = math.ceil(L / (plan.pp * plan.vpp)) * plan.vpp
    layer = m.attention_params() + m.mlp_params(m.ffn_hidden_size)
    # pp=1: one rank holds the input embedding and the output layer (one matrix when tied);
    # pp>1: the first stage holds the embedding, the last the output layer (Megatron keeps a
    # copy of a tied embedding on the last stage), so either holds one V x h matrix
    copies = 1 if (plan.pp > 1 or m.tied_embeddings) else 2
    return (n_stage * layer + copies * V * h) / plan.tp


#: norms (2h per layer) may or may not be counted: 0.3% of the tiny model's layer weights
MEM_RTOL = 5e-3

MEM_CASES = [
    pytest.param(False, Plan(tp=1, pp=1, dp=16, zero=0), id="untied-tp1-pp1-z0"),
    pytest.param(False, Plan(tp=2, pp=1, dp=8, sp=True, zero=1), id="untied-tp2-pp1-z1"),
    pytest.param(False, Plan(tp=1, pp=2, dp=8, zero=0), id="untied-pp2-z0"),
    pytest.param(False, Plan(tp=2, pp=2, dp=4, zero=1), id="untied-tp2-pp2-z1"),
    pytest.param(False, Plan(tp=4, pp=2, dp=2, zero=1, recompute=Recompute.FULL), id="untied-tp4-pp2-z1"),
    pytest.param(True, Plan(tp=1, pp=1, dp=16, zero=0), id="tied-pp1-z0"),
    pytest.param(True, Plan(tp=1, pp=1, dp=16, zero=1), id="tied-pp1-z1"),
    pytest.param(True, Plan(tp=2, pp=1, dp=8, zero=2), id="tied-tp2-z2"),
    pytest.param(True, Plan(tp=1, pp=1, cp=2, dp=8, zero=2), id="tied-cp2-z2"),
    pytest.param(True, Plan(tp=4, pp=1, dp=4, zero=3), id="tied-tp4-z3"),
    pytest.param(True, Plan(tp=1, pp=1, cp=4, dp=4, zero=3), id="tied-cp4-z3"),
    pytest.param(True, Plan(tp=1, pp=2, dp=8, zero=1), id="tied-pp2-z1"),
]


@pytest.mark.parametrize("tied, plan", MEM_CASES)
def test_static_memory_by_zero_stage(tied, plan):
    """bf16 weights 2 B/param, fp32 main gradients 4 B/param (Megatron's default with bf16), Adam
    12 B/param [ZeRO paper];
    ZeRO-1 shards the optimizer, ZeRO-2 also gradients, ZeRO-3 also weights, over dp*cp."""
    m = _tiny(tied=tied)
    out = _eval_tiny(m, [plan])
    p = _params_on_rank(m, plan)
    shards = plan.dp * plan.cp
    opt = 12.0 * p / (shards if plan.zero >= 1 else 1)
    grads = 4.0 * p / (shards if plan.zero >= 2 else 1)
    # Megatron-FSDP gathers one transformer layer per FSDP unit and prefetches the next: two layers' bf16 weights
    # and, before their reduce-scatter, two layers' fp32 gradients live unsharded (mcore_fsdp_adapter.py)
    layer = (m.attention_params() + m.mlp_params(m.ffn_hidden_size)) / plan.tp
    units = 2.0 * layer if plan.zero == 3 else 0.0
    assert out["memory.optimizer"][0] == pytest.approx(opt, rel=MEM_RTOL)
    # (the second unit's gradients only where they outgrow the activations a layer's backward frees: one to two)
    g = out["memory.gradients"][0]
    assert (grads + 2.0 * units) * (1 - MEM_RTOL) <= g <= (grads + 4.0 * units) * (1 + MEM_RTOL)
    if plan.zero < 3:
        assert out["memory.weights"][0] == pytest.approx(2.0 * p, rel=MEM_RTOL)
    else:
        assert out["memory.weights"][0] == pytest.approx(2.0 * p / shards + 2.0 * units, rel=MEM_RTOL)


def test_low_precision_weights_add_a_cached_copy():
    m = _tiny(tied=True)
    plan = Plan(tp=1, pp=2, dp=8)
    c = ClusterSpec(gpu=load_gpu("h100"), num_gpus=16, nvlink_domain_size=8,
                    intra_node_bw_bytes_per_s=B0, inter_node_bw_bytes_per_s=B1)
    J8 = encode_job(JobSpec(global_batch=16, seq_len=32, precision=Precision.FP8), c)
    out8 = _evaluate(_arrays([plan, plan]), encode_model(m), encode_cluster(c), J8)
    out16 = _eval_tiny(m, [plan])
    p = _params_on_rank(m, plan)
    # Transformer Engine keeps a 1-byte fp8 copy beside the bf16 weight
    assert out8["memory.weights"][0] == pytest.approx(3.0 * p, rel=MEM_RTOL)
    assert out16["memory.weights"][0] == pytest.approx(2.0 * p, rel=MEM_RTOL)
    # --fp8-param-gather: the primary weight itself is fp8 (1 byte) beside its cached copy;
    # --grad-reduce-in-bf16: 2-byte main gradients instead of fp32
    fw = FrameworkSpec(fp8_param_gather=True, grad_reduce_in_fp32=False)
    Jp = encode_job(JobSpec(global_batch=16, seq_len=32, precision=Precision.FP8, framework=fw), c)
    outp = _evaluate(_arrays([plan, plan]), encode_model(m), encode_cluster(c), Jp)
    assert outp["memory.weights"][0] == pytest.approx(2.0 * p, rel=MEM_RTOL)
    assert outp["memory.gradients"][0] == pytest.approx(2.0 * p, rel=MEM_RTOL)
    assert out8["memory.gradients"][0] == pytest.approx(4.0 * p, rel=MEM_RTOL)


def test_expert_weights_divide_by_ep():
    m = _tiny(**TINY_MOE)
    plans = [Plan(dp=16, ep=1), Plan(dp=16, ep=2), Plan(dp=16, ep=4), Plan(dp=16, ep=2, etp=2)]
    out = _eval_tiny(m, plans)
    experts = m.param_counts()["experts"]            # pp=1: every expert of the one MoE layer
    w = out["memory.weights"]
    for i, div in enumerate([1, 2, 4, 4]):
        assert w[0] - w[i] == pytest.approx(2.0 * experts * (1 - 1 / div), rel=1e-4)
    # the optimizer shards experts over expert-data-parallel ranks tp*cp*dp/(ep*etp) with ZeRO-1
    z = _eval_tiny(m, [Plan(dp=16, ep=4, zero=1), Plan(dp=16, ep=4, zero=0)])
    dense_part = z["memory.optimizer"][1] - 12.0 * experts / 4
    assert z["memory.optimizer"][0] == pytest.approx(dense_part / 16 + 12.0 * experts / 4 / 4, rel=1e-4)


# ---- activation memory ordering, on a model where activations matter ----

@pytest.fixture(scope="module")
def llama8b_inputs():
    return Inputs(build_problem(model="llama3-8b", gpu="h100", gpus=64, global_batch=512, seq_len=8192))


def _act(inp, plans, e=E):
    return _evaluate(_arrays(plans), inp.model, inp.hw, inp.job, e)["memory.activations"]


def test_activation_memory_ordering(llama8b_inputs):
    inp = llama8b_inputs
    base = dict(tp=4, pp=2, dp=8, mbs=1, sp=True)
    none, sel, full = _act(inp, [Plan(**base, recompute=r) for r in Recompute])
    # Megatron-Core's default selective set is core_attn alone: with flash attention (no s x s
    # scores stored) it saves nothing [K22 table 2 with the 5as/h term gone]
    assert full < sel <= none
    assert sel == pytest.approx(none, rel=1e-6)
    # recomputing the norms and the MLP drops their outputs
    more = _act(inp, [Plan(**base, recompute=Recompute.SELECTIVE,
                           recompute_modules=("core_attn", "layernorm", "mlp"))])[0]
    assert full < more < sel
    # sequence parallelism shards the replicated part over TP
    on, off = _act(inp, [Plan(**base), Plan(**{**base, "sp": False})])
    assert on < off
    # more TP, more CP: fewer activations per GPU; a bigger micro-batch: more
    a_tp = _act(inp, [Plan(tp=2, pp=2, dp=16, sp=True), Plan(tp=4, pp=2, dp=8, sp=True),
                      Plan(tp=8, pp=2, dp=4, sp=True)])
    assert a_tp[0] > a_tp[1] > a_tp[2]
    a_cp = _act(inp, [Plan(tp=4, pp=2, dp=8, sp=True), Plan(tp=4, pp=2, cp=2, dp=4, sp=True)])
    assert a_cp[1] < a_cp[0]
    a_mbs = _act(inp, [Plan(**{**base, "mbs": 1}), Plan(**{**base, "mbs": 2}), Plan(**{**base, "mbs": 4})])
    assert a_mbs[0] < a_mbs[1] < a_mbs[2]
    assert a_mbs[2] == pytest.approx(4 * a_mbs[0], rel=0.05)    # linear in micro-batch tokens


# ---- pipeline stages: uneven first/last stages, block recompute ----

@pytest.mark.parametrize("layers, pp, vpp, first, last, expect", [
    (126, 16, 1, 0, 0, (8, 8, 8)),          # even split: the busiest stage has ceil(126/16) layers
    (126, 16, 1, 7, 7, (7, 8, 7)),          # Llama 3 405B: lighter end stages, 112 / 14 in the middle
    (32, 4, 1, 0, 6, (9, 9, 6)),            # 26 layers over 3 stages: the busiest gets 9
    (32, 4, 2, 0, 0, (8, 8, 8)),            # 2 chunks of 4
    (30, 4, 2, 6, 0, (6, 8, 8)),            # 24 over 3 stages x 2 chunks: chunks of 4
    (32, 2, 1, 10, 0, (10, 22, 22)),        # two stages: the last holds the rest
    (32, 1, 1, 0, 0, (32, 32, 32)),         # one stage holds every layer
])
def test_stage_layers(layers, pp, vpp, first, last, expect):
    got = stage_layers(layers, np.float64(pp), np.float64(vpp), np.float64(first), np.float64(last))
    assert tuple(int(x) for x in got) == expect
    got_jax = stage_layers(layers, jnp.float32(pp), jnp.float32(vpp), jnp.float32(first), jnp.float32(last), jnp)
    assert tuple(int(x) for x in got_jax) == expect


@pytest.fixture(scope="module")
def llama405b_inputs():
    return Inputs(build_problem(model="llama3.1-405b", gpu="h100", gpus=1024, global_batch=2048, seq_len=8192))


def _eval_plans(inp, plans):
    return _evaluate(_arrays(plans), inp.model, inp.hw, inp.job)


def test_lighter_end_stages_shorten_the_pipeline(llama405b_inputs):
    """126 layers on 16 stages: the even split puts 8 layers and the output layer + loss on the last
    stage; 7 + 8*14 + 7 takes the loss off the critical stage and a layer off the first stage's
    pp in-flight micro-batches (what Llama 3 405B ran)."""
    base = dict(tp=8, pp=16, dp=8, sp=True, zero=1)
    even, lighter, last_only = (_eval_plans(llama405b_inputs, [p])
                                for p in (Plan(**base), Plan(**base, first_layers=7, last_layers=7),
                                          Plan(**base, last_layers=7)))
    assert lighter["step_time_s"][0] < even["step_time_s"][0]
    assert lighter["time.bubble"][0] < even["time.bubble"][0]
    assert lighter["memory.activations"][0] < even["memory.activations"][0]
    assert lighter["memory.total"][0] < even["memory.total"][0]
    # lightening only the last stage: 119 layers over 15 stages -> 8 per stage, same first stage
    assert last_only["step_time_s"][0] < even["step_time_s"][0]
    assert last_only["memory.total"][0] == pytest.approx(even["memory.total"][0], rel=1e-6)
    # the step is the slowest stage's m micro-batches plus the others' fill and drain: making the
    # first stage lighter still does not shorten the steady state when the middle stages bind
    first_only = _eval_plans(llama405b_inputs, [Plan(**base, first_layers=6)])
    assert first_only["step_time_s"][0] == pytest.approx(even["step_time_s"][0], rel=0.02)


def test_block_recompute_trades_time_for_memory(llama405b_inputs):
    """recompute=full with recompute_layers=N replays N of the 8 layers of each stage: time and
    activation memory lie between no recompute (N=0 of recompute=none) and full (N=all), monotone."""
    base = dict(tp=8, pp=16, dp=8, sp=True, zero=1)
    plans = [Plan(**base)] + [Plan(**base, recompute=Recompute.FULL, recompute_layers=n) for n in (1, 3, 5, 7)] \
        + [Plan(**base, recompute=Recompute.FULL)]
    o = _eval_plans(llama405b_inputs, plans)
    assert np.all(np.diff(o["time.recompute"]) > 0)
    assert np.all(np.diff(o["memory.activations"]) < 0)
    assert np.all(np.diff(o["hw_flops"]) > 0)
    assert o["time.recompute"][0] == 0
    # N layers of 8 replay N/8 of the full recompute's work (and its TP communication)
    np.testing.assert_allclose(o["time.recompute"][1:5], o["time.recompute"][5] * np.array([1, 3, 5, 7]) / 8, rtol=1e-5)


def test_memory_peak_moves_off_a_lightened_first_stage(llama8b_inputs):
    """Megatron-Core's interleaved schedule runs 2*(pp-rank-1) + (v-1)*pp warm-up chunk forwards:
    rank r holds (2*(pp-r-1) + (v-1)*pp + 1)/v micro-batches of its layers (first 4.75, second 4.25,
    last 3.25 for pp=4, v=4). Lighten the first stage and a rank with more layers becomes the peak."""
    inp = llama8b_inputs
    base = dict(tp=4, pp=4, dp=4, vpp=4, sp=True)
    even, light_first = (_eval_plans(inp, [p]) for p in (Plan(**base), Plan(**base, first_layers=4)))
    # even: 8 layers x 4.75 on the first rank; lightened: 28 layers over 3 stages x 4 chunks -> 12
    # layers (chunks of ceil(28/12) = 3) on the other ranks, the last holding 3.25 + the logits,
    # the second 4.25 micro-batches
    ratio = float(light_first["memory.activations"][0] / even["memory.activations"][0])
    assert 12 * 3.25 / (8 * 4.75) <= ratio <= 12 * 4.25 / (8 * 4.75) * 1.001
    assert light_first["memory.total"][0] > even["memory.total"][0]


# =============================================================================================
# 2. Contracts over random samples of legal plans (STYLE point 7)
# =============================================================================================

CONTRACT_PROBLEMS = {
    "llama3-8b@64xh100": dict(model="llama3-8b", gpu="h100", gpus=64, global_batch=512, seq_len=8192),
    "gpt3-175b@1024xa100": dict(model="gpt3-175b", gpu="a100-80gb", gpus=1024, global_batch=1536,
                                seq_len=2048),
    "mixtral-8x7b@64xh100": dict(model="mixtral-8x7b", gpu="h100", gpus=64, global_batch=512, seq_len=4096),
}
SAMPLE = 1024


class Case:
    def __init__(self, kw):
        self.problem = build_problem(**kw)
        self.inp = Inputs(self.problem)
        stream, self.stats = enumerate_legal(self.problem)
        batches = list(stream)
        self.rows = {f: np.concatenate([np.asarray(b[f]) for b in batches]).astype(np.int32)
                     for f in PLAN_FIELDS}
        self.n = len(self.rows["tp"])
        idx = np.sort(np.random.default_rng(1234).choice(self.n, size=min(SAMPLE, self.n), replace=False))
        self.idx = idx
        self.sample = self._with_optuna_knobs({k: v[idx] for k, v in self.rows.items()})
        self.out = self.evaluate(self.sample)

    def _with_optuna_knobs(self, sample: dict) -> dict:
        """About half the sampled plans get random legal values of the Optuna-only knobs (uneven
        end stages, block recompute), so every contract also covers them."""
        rng = np.random.default_rng(4321)
        size = len(sample["tp"])
        for knob in OPTUNA_ONLY_KNOBS:
            trial = dict(sample)
            trial[knob] = rng.choice(np.asarray(KNOBS[knob].domain(self.problem)), size=size).astype(np.int32)
            legal, _ = check_rows({k: v.astype(np.int64) for k, v in trial.items()}, self.problem)
            sample[knob] = np.where(legal & (rng.random(size) < 0.7), trial[knob], sample[knob]).astype(np.int32)
        return sample

    def evaluate(self, arrays, hw=None, job=None, e=E) -> dict:
        return _evaluate(arrays, self.inp.model, hw or self.inp.hw, job or self.inp.job, e)


_CASES: dict = {}


def _case(name) -> Case:
    if name not in _CASES:
        _CASES[name] = Case(CONTRACT_PROBLEMS[name])
    return _CASES[name]


@pytest.fixture(scope="module", params=sorted(CONTRACT_PROBLEMS))
def case(request) -> Case:
    return _case(request.param)


def test_terms_finite_and_non_negative(case):
    for k, v in case.out.items():
        assert np.all(np.isfinite(v)), k
        assert np.all(v >= 0), (k, float(v.min()))
    assert np.all(case.out["step_time_s"] > 0)
    assert np.all(case.out["memory.total"] > 0)
    # time and memory keys the reports read all exist
    assert set(TIME_KEYS.values()) <= set(case.out)
    assert set(MEM_KEYS.values()) <= set(case.out)


def test_sample_covers_the_optuna_only_knobs(case):
    s = case.sample
    legal, _ = check_rows({k: v.astype(np.int64) for k, v in s.items()}, case.problem)
    assert legal.all()
    for knob in OPTUNA_ONLY_KNOBS:
        _nonvacuous(s[knob] > 0)


def test_breakdowns_sum_to_totals(case):
    o = case.out
    t = sum(o[k].astype(np.float64) for k in TIME_KEYS.values())
    np.testing.assert_allclose(t, o["step_time_s"], rtol=1e-4)
    mem = sum(o[k].astype(np.float64) for k in MEM_KEYS.values())
    np.testing.assert_allclose(mem, o["memory.total"], rtol=1e-4)


def test_derived_quantities(case):
    o, s, job = case.out, case.sample, case.problem.job
    np.testing.assert_array_equal(o["num_gpus"], case.problem.cluster.num_gpus)
    np.testing.assert_allclose(o["micro_batches"], job.global_batch / (s["dp"] * s["mbs"]), rtol=1e-6)
    np.testing.assert_allclose(o["tokens_per_s"] * o["step_time_s"], job.tokens_per_step, rtol=1e-5)
    # model FLOPs do not depend on the plan; hardware FLOPs add recomputation only
    np.testing.assert_allclose(o["model_flops"], o["model_flops"][0], rtol=1e-6)
    assert np.all(o["hw_flops"] >= o["model_flops"] * (1 - 1e-6))
    none = s["recompute"] == int(Recompute.NONE)
    np.testing.assert_allclose(o["hw_flops"][none], o["model_flops"][none], rtol=1e-6)
    assert np.all(o["hw_flops"][~none] > o["model_flops"][~none])


def _nonvacuous(mask):
    assert mask.any(), "the sample holds no plan of this kind"
    return mask


def test_absent_parallelism_costs_nothing(case):
    o, s = case.out, case.sample
    # tp=1 (and, for MoE, expert-TP etp=1): no tensor-parallel communication
    m = _nonvacuous((s["tp"] == 1) & (s["etp"] == 1))
    assert np.all(o["time.tp_comm"][m] == 0)
    m = _nonvacuous(s["pp"] == 1)
    assert np.all(o["time.bubble"][m] == 0)
    assert np.all(o["time.pp_comm"][m] == 0)
    m = _nonvacuous(s["cp"] == 1)
    assert np.all(o["time.cp_comm"][m] == 0)
    m = s["ep"] == 1
    if case.problem.model.is_moe:
        assert np.all(o["time.ep_comm"][m] == 0)
    else:
        assert np.all(o["time.ep_comm"] == 0)
    # and present parallelism costs something
    assert np.all(o["time.tp_comm"][_nonvacuous(s["tp"] > 1)] > 0)
    assert np.all(o["time.bubble"][_nonvacuous(s["pp"] > 1)] > 0)
    if E.cp_overlap < 1:
        assert np.all(o["time.cp_comm"][_nonvacuous(s["cp"] > 1)] > 0)
    if case.problem.model.is_moe:
        assert np.all(o["time.ep_comm"][_nonvacuous(s["ep"] > 1)] > 0)
    assert np.all(o["time.recompute"][s["recompute"] == 0] == 0)
    assert np.all(o["time.recompute"][s["recompute"] > 0] > 0)


def test_dense_model_without_data_parallelism_has_no_dp_comm():
    case = _case("llama3-8b@64xh100")
    m = (case.rows["dp"] * case.rows["cp"] == 1)
    assert m.any()
    sub = {k: v[m] for k, v in case.rows.items()}
    out = case.evaluate(sub)
    bad = out["time.dp_comm"] > 0
    assert not bad.any(), {k: int(sub[k][np.argmax(bad)]) for k in PLAN_FIELDS}


def test_batched_equals_one_at_a_time(case):
    """The same plan scored alone (a batch of 1) and inside the big batch agree."""
    picks = np.random.default_rng(7).choice(len(case.idx), size=12, replace=False)
    for i in picks:
        one = case.evaluate({k: v[i:i + 1] for k, v in case.sample.items()})
        for k, v in one.items():
            np.testing.assert_allclose(v[0], case.out[k][i], rtol=1e-5, atol=1e-30, err_msg=k)


def test_padding_and_chunking_do_not_change_scores(case):
    steps, mems = score_summary(PlanBatch(case.sample), case.inp, E)
    np.testing.assert_allclose(steps, case.out["step_time_s"], rtol=1e-5)
    np.testing.assert_allclose(mems, case.out["memory.total"], rtol=1e-5)


def test_exhaustive_best_is_fastest_fitting_plan(case):
    res = exhaustive(case.problem, E, top_k=5)
    steps, mems = score_summary(PlanBatch(case.rows), case.inp, E)
    limit = case.inp.memory_limit_bytes
    fits = mems <= limit
    assert res.space["legal"] == res.space["scored"] == case.n
    assert res.space["fitting"] == int(fits.sum())
    assert fits.any()
    best = res.best
    assert best["fits"] is True
    assert best["memory_gb"]["total"] * 1e9 <= limit * (1 + 1e-6)
    assert best["step_time_s"] <= float(steps[fits].min()) * (1 + 1e-5)
    # and it is one of the scored, fitting plans
    tops = [r["step_time_s"] for r in res.top]
    assert tops == sorted(tops)
    assert all(r["fits"] for r in res.top)
    assert best["plan"]["tp"] * best["plan"]["pp"] * best["plan"]["dp"] * best["plan"]["cp"] == \
        case.problem.cluster.num_gpus


# =============================================================================================
# 3. Hypothesis properties
# =============================================================================================

K = 64                                        # plans per example (one compiled shape)
PROP_PROBLEMS = ["llama3-8b@64xh100", "mixtral-8x7b@64xh100"]
PROPERTY = settings(max_examples=30, deadline=None, derandomize=True)
indices = st.lists(st.integers(min_value=0, max_value=2 ** 31 - 1), min_size=K, max_size=K)
factors = st.floats(min_value=1.0, max_value=8.0, allow_nan=False)


def _pick(case: Case, idx) -> dict:
    i = np.asarray(idx) % case.n
    return {k: v[i] for k, v in case.rows.items()}


def _never_slower(case, plans, hw2=None, job2=None):
    base = case.evaluate(plans)["step_time_s"]
    new = case.evaluate(plans, hw=hw2, job=job2)["step_time_s"]
    worse = new > base * (1 + 1e-5)
    if worse.any():
        i = int(np.argmax(new / base))
        plan = {k: int(plans[k][i]) for k in PLAN_FIELDS}
        raise AssertionError(f"{int(worse.sum())} of {len(base)} plans got slower; worst {plan}: "
                             f"{base[i]:.6g} s -> {new[i]:.6g} s")


def _scaled(d: dict, key: str, k: float) -> dict:
    out = dict(d)
    out[key] = np.float32(d[key] * k)
    return out


@pytest.mark.parametrize("name", PROP_PROBLEMS)
@PROPERTY
@given(idx=indices, k=factors)
def test_more_inter_node_bandwidth_never_slower(name, idx, k):
    case = _case(name)
    _never_slower(case, _pick(case, idx), hw2=_scaled(case.inp.hw, "inter_bw", k))


@pytest.mark.parametrize("name", PROP_PROBLEMS)
@PROPERTY
@given(idx=indices, k=factors)
def test_more_intra_node_bandwidth_never_slower(name, idx, k):
    case = _case(name)
    _never_slower(case, _pick(case, idx), hw2=_scaled(case.inp.hw, "intra_bw", k))


@pytest.mark.parametrize("name", PROP_PROBLEMS)
@PROPERTY
@given(idx=indices, k=factors)
def test_more_hbm_bandwidth_never_slower(name, idx, k):
    case = _case(name)
    _never_slower(case, _pick(case, idx), hw2=_scaled(case.inp.hw, "hbm_bw", k))


@pytest.mark.parametrize("name", PROP_PROBLEMS)
@PROPERTY
@given(idx=indices, k=factors)
def test_more_peak_flops_never_slower(name, idx, k):
    case = _case(name)
    _never_slower(case, _pick(case, idx), hw2=_scaled(case.inp.hw, "peak_bf16", k),
                  job2=_scaled(case.inp.job, "peak_gemm", k))


def _tp_pairs(case: Case):
    """Index pairs (i, j): plan j is plan i with tp doubled and dp halved, both legal."""
    if not hasattr(case, "_pairs"):
        keys = {tuple(int(case.rows[f][i]) for f in PLAN_FIELDS): i for i in range(case.n)}
        ti, di = PLAN_FIELDS.index("tp"), PLAN_FIELDS.index("dp")
        pairs = []
        for key, i in keys.items():
            if key[di] % 2:
                continue
            other = list(key)
            other[ti] *= 2
            other[di] //= 2
            j = keys.get(tuple(other))
            if j is not None:
                pairs.append((i, j))
        case._pairs = np.array(pairs, dtype=np.int64)
    return case._pairs


@pytest.mark.parametrize("name", PROP_PROBLEMS)
@PROPERTY
@given(idx=indices)
def test_more_tp_never_raises_weight_memory(name, idx):
    case = _case(name)
    pairs = _tp_pairs(case)
    assert len(pairs) > 100
    sel = pairs[np.asarray(idx) % len(pairs)]
    lo = case.evaluate({k: v[sel[:, 0]] for k, v in case.rows.items()})
    hi = case.evaluate({k: v[sel[:, 1]] for k, v in case.rows.items()})
    assert np.all(hi["memory.weights"] <= lo["memory.weights"] * (1 + 1e-6))


@pytest.mark.parametrize("name", PROP_PROBLEMS)
@PROPERTY
@given(idx=indices)
def test_full_recompute_never_uses_more_activation_memory(name, idx):
    case = _case(name)
    plans = _pick(case, idx)
    no_modules = np.zeros(K, dtype=np.int32)    # modules go with selective recompute only
    none = dict(plans, recompute=np.full(K, int(Recompute.NONE), dtype=np.int32), recompute_modules=no_modules)
    full = dict(plans, recompute=np.full(K, int(Recompute.FULL), dtype=np.int32), recompute_modules=no_modules)
    legal, _ = check_rows({k: v.astype(np.int64) for k, v in full.items()}, case.problem)
    assert legal.all()                          # recompute is in no other legality rule
    a_none = case.evaluate(none)["memory.activations"]
    a_full = case.evaluate(full)["memory.activations"]
    assert np.all(a_full <= a_none * (1 + 1e-6))


# =============================================================================================
# 4. Differentiability
# =============================================================================================

def _step_sum(hw, e, plans, model, job):
    return jnp.sum(cm.evaluate(plans, model, hw, job, e).step_time_s)


_grad_step = jax.jit(jax.grad(_step_sum, argnums=(0, 1)))


@pytest.mark.parametrize("name, flash", [("llama3-8b@64xh100", 1.0), ("llama3-8b@64xh100", 0.0),
                                         ("gpt3-175b@1024xa100", 1.0), ("mixtral-8x7b@64xh100", 1.0)])
def test_gradients_are_finite(name, flash):
    case = _case(name)
    plans = _pick(case, np.random.default_rng(3).integers(0, case.n, size=K))
    hw = {k: jnp.asarray(v) for k, v in case.inp.hw.items()}
    job = dict(case.inp.job)
    job["flash"] = np.float32(flash)
    g_hw, g_e = _grad_step(hw, params_as_arrays(E), plans, case.inp.model, job)
    for k, v in g_hw.items():
        assert np.all(np.isfinite(np.asarray(v))), f"d step / d hw[{k}] is not finite"
    for k, v in g_e._asdict().items():
        assert np.all(np.isfinite(np.asarray(v))), f"d step / d params.{k} is not finite"
    # and they carry information: step time depends on the GPU and on the efficiencies
    assert float(g_hw["hbm_bw"]) != 0
    assert float(g_hw["peak_bf16"]) != 0
    assert float(g_e.gemm_eff_max) != 0


def test_leading_dense_layers_sit_on_the_first_stage():
    """DeepSeek-style first_k_dense_replace: with pp=2 and 2 of 4 layers dense, rank 0 holds the
    two dense layers and rank 1 the two MoE layers (Megatron builds layers in order), so the peak
    rank's weights are two whole MoE layers, not two averaged half-MoE layers."""
    m = ModelSpec(
        name="tiny-ds", num_layers=4, hidden_size=64, ffn_hidden_size=64, num_attention_heads=4,
        num_kv_heads=4, vocab_size=128, gated_mlp=False, **{**TINY_MOE, "first_k_dense_layers": 2})
    plan = Plan(tp=1, pp=2, dp=8, zero=0)
    out = _eval_tiny(m, [plan])
    h = m.hidden_size
    moe_layer = (m.attention_params() + m.num_experts * m.mlp_params(m.moe_ffn_hidden_size)
                 + m.num_shared_experts * m.mlp_params(m.moe_ffn_hidden_size) + h * m.num_experts)
    dense_layer = m.attention_params() + m.mlp_params(m.ffn_hidden_size)
    output_layer = m.vocab_size * h
    rank1 = 2 * moe_layer + output_layer
    rank0 = 2 * dense_layer + m.vocab_size * h
    assert rank1 > rank0                       # the MoE stage is the peak
    assert out["memory.weights"][0] == pytest.approx(2.0 * rank1, rel=MEM_RTOL)


def _with(plans: dict, **fields) -> dict:
    out = dict(plans)
    for k, v in fields.items():
        out[k] = np.broadcast_to(np.asarray(v, dtype=np.int32), plans["tp"].shape).copy()
    return out


_MODULE_BITS = {name: 1 << i for i, name in enumerate(RECOMPUTE_MODULES)}


@pytest.mark.parametrize("name", PROP_PROBLEMS)
@PROPERTY
@given(idx=indices, extra=st.sets(st.sampled_from(RECOMPUTE_MODULES), min_size=1))
def test_recomputing_more_modules_never_raises_memory_nor_saves_time(name, idx, extra):
    """Adding modules to a selective set never raises activation memory and never makes the step
    faster (the cost model is evaluated directly: these are physics properties, not legality)."""
    case = _case(name)
    plans = _with(_pick(case, idx), recompute=1, recompute_modules=_MODULE_BITS["core_attn"])
    more_mask = _MODULE_BITS["core_attn"] | sum(_MODULE_BITS[m] for m in extra)
    base = case.evaluate(plans)
    more = case.evaluate(_with(plans, recompute_modules=more_mask))
    assert np.all(more["memory.activations"] <= base["memory.activations"] * (1 + 1e-6))
    assert np.all(more["step_time_s"] >= base["step_time_s"] * (1 - 1e-6))


@pytest.mark.parametrize("name", PROP_PROBLEMS)
@PROPERTY
@given(idx=indices)
def test_grad_reduce_in_bf16_never_uses_more_memory_or_time(name, idx):
    case = _case(name)
    plans = _pick(case, idx)
    fp32 = case.evaluate(plans)
    bf16 = case.evaluate(plans, job=_scaled(case.inp.job, "grad_bytes", 0.5))
    assert np.all(bf16["memory.gradients"] <= fp32["memory.gradients"] * (1 + 1e-6))
    assert np.all(bf16["step_time_s"] <= fp32["step_time_s"] * (1 + 1e-6))


@pytest.mark.parametrize("layers, pp, vpp", [(126, 16, 1), (126, 8, 2), (94, 32, 3), (80, 4, 5), (62, 8, 1)])
def test_accounting_the_embedding_and_loss_makes_end_stages_lighter(layers, pp, vpp):
    """Megatron's --account-for-embedding/loss-in-pipeline-split count the embedding and the loss
    as a layer each: in a legal split the first (last) stage holds one transformer layer
    fewer than a middle stage, and the layers are conserved."""
    checked = 0
    for acc_e in (False, True):
        for acc_l in (False, True):
            units = layers + acc_e + acc_l
            if units % (pp * vpp):
                continue
            checked += 1
            first, mid, last = (float(x) for x in stage_layers(layers, pp, vpp, 0, 0, np,
                                                               acc_embedding=acc_e, acc_loss=acc_l))
            assert first + (pp - 2) * mid + last == layers
            assert first == mid - acc_e          # the unit sits in the first (last) chunk only
            assert last == mid - acc_l
    assert checked >= 1


def test_zero2_reduces_gradients_every_micro_batch(llama8b_inputs):
    """DeepSpeed ZeRO-2 keeps only a gradient shard, so it reduce-scatters each micro-batch's
    gradients [ZeRO sec. 5.2]; Megatron's distributed optimizer (ZeRO-1) reduces once per step.
    ZeRO-2 therefore saves gradient memory and never time."""
    inp = llama8b_inputs
    plans = [Plan(tp=1, pp=1, dp=64, mbs=1, zero=z) for z in (1, 2)]
    out = _evaluate(_arrays(plans), inp.model, inp.hw, inp.job)
    assert out["memory.gradients"][1] < out["memory.gradients"][0]
    assert out["time.dp_comm"][1] > out["time.dp_comm"][0]
    assert out["step_time_s"][1] >= out["step_time_s"][0]
