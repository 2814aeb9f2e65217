"""The vectorized cost model: a batch of plans -> step time, memory and their breakdowns.

Pure JAX, branch-free (jnp.where), differentiable in every continuous input. Every argument is a
dict of float arrays that broadcast against each other: plan knobs have shape [K] (one entry per
candidate); model, cluster (`hw`) and job values are scalars, or [K] when scoring a batch of
different runs (validation, calibration).

Symbols (per micro-batch, per GPU unless said otherwise)
  L layers, h hidden, a heads, g KV heads, f FFN hidden, V vocab, s sequence, b micro-batch,
  T = b*s/cp tokens on this context-parallel rank, E experts, k experts per token, f_e expert FFN,
  m = B/(dp*b) micro-batches per step, v virtual stages per rank, n_first/n_mid/n_last layers on
  the first, a middle and the last pipeline stage (even split unless first/last_layers are set).

Sources
  [N21] Narayanan et al. 2021, "Efficient Large-Scale LM Training on GPU Clusters" (SC'21):
        sec. 2.2 (1F1B and interleaved bubble (p-1)/(v*m)), sec. 3.2 eq. (FLOPs), appendix.
  [K22] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
        table 2 (activation bytes per layer: sbh(34 + 5as/h) split into replicated/TP-sharded parts),
        sec. 4.2.3 (interleaved schedule keeps pp*(1 + (pp-1)/(pp*v)) micro-batches in flight).
  [Z20] Rajbhandari et al. 2020, ZeRO: 2+2+12 bytes/param; stage 1/2/3 partitioning; 1.5x comm for 3.
  [MG]  Megatron-LM docs, distributed optimizer: bf16 params + fp32 main grads = 6 + 12/d bytes/param.
  [FA]  Dao 2023, FlashAttention-2: causal attention does half the s^2 work; backward ~2.5x forward.
  [DS]  DeepSeek-V2 (2024) sec. 2.1, multi-head latent attention projections.
  [GS]  Lepikhin et al. 2020 (GShard) / Megatron-Core MoE: two all-to-alls (dispatch, combine) per
        MoE layer forward and two backward; experts sharded by EP, tokens by TP (MoE needs SP).
  [RA]  Liu et al. 2023, Ring Attention; Megatron-Core CP: cp-1 KV block exchanges per layer,
        overlapped with the attention of the previous block; load-balanced causal chunks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import collectives as C
from .params import EfficiencyParams
from .plan import stage_layers

GB = 1e9


def _sat(x, half):
    """Saturating efficiency x/(x+half): 0 for tiny dims, -> 1 for large ones."""
    return x / (x + half)


def _safe(x):
    return jnp.maximum(x, 1e-30)


def gemm_s(m, n, k, peak, elem_bytes, hbm_bw, eff_max, e: EfficiencyParams):
    """One GEMM [m x k] @ [k x n]: roofline of compute at a size-dependent efficiency and HBM traffic."""
    flops = 2.0 * m * n * k
    eff = eff_max * _sat(m, e.gemm_dim_half) * _sat(n, e.gemm_dim_half) * _sat(k, e.gemm_dim_half)
    t_compute = flops / (peak * jnp.maximum(eff, 1e-6))
    t_memory = elem_bytes * (m * k + k * n) / (hbm_bw * e.hbm_eff) + 2.0 * m * n / (hbm_bw * e.hbm_eff)
    return jnp.where(flops > 0, jnp.maximum(t_compute, t_memory), 0.0)


def _plan_floats(plans: dict) -> dict:
    return {k: jnp.asarray(v, dtype=jnp.float32) for k, v in plans.items()}


def evaluate(plans: dict, model: dict, hw: dict, job: dict, e: EfficiencyParams) -> dict:
    """Score a batch of plans. Returns a flat dict of arrays (times in s, memory in bytes)."""
    P = _plan_floats(plans)
    M, H, J = model, hw, job
    tp, pp, dp, cp, ep, etp, v, b = P["tp"], P["pp"], P["dp"], P["cp"], P["ep"], P["etp"], P["vpp"], P["mbs"]
    sp = P["sp"]
    rec_sel = (P["recompute"] == 1).astype(jnp.float32)
    rec_full = (P["recompute"] == 2).astype(jnp.float32)
    zero = P["zero"]

    h, a, V, s = M["hidden"], M["heads"], M["vocab"], J["seq_len"]
    g_mlp = M["gated"]
    n_gpus = tp * pp * dp * cp
    m = J["global_batch"] / (dp * b)                       # micro-batches per step
    T = b * s / cp                                         # tokens per micro-batch on this rank
    T_elem = jnp.where(sp > 0, T / tp, T)                  # tokens of replicated (norm/residual) work
    peak, eb = J["peak_gemm"], J["gemm_bytes"]
    hbm = H["hbm_bw"]
    eff_max = jnp.where(J["low_precision"] > 0, e.gemm_eff_max_fp8, e.gemm_eff_max)
    link_eff = (e.intra_bw_eff, e.inter_bw_eff)

    def gemm(mm, nn, kk):
        return gemm_s(mm, nn, kk, peak, eb, hbm, eff_max, e)

    # ---------------- per-layer forward compute [N21 appendix; DS sec 2.1 for MLA] ----------------
    t_attn_proj = (gemm(T, M["q_down_n"], h) + gemm(T, M["kv_down_n"], h)          # MLA down (replicated)
                   + gemm(T, M["q_up_n"] / tp, M["q_up_k"])                         # QKV (or MLA q-up)
                   + gemm(T, M["kv_up_n"] / tp, M["kv_up_k"])                       # MLA kv-up
                   + gemm(T, h, M["attn_out_k"] / tp))                              # output projection
    # attention core: causal, so each query sees s/2 keys on average (also per CP rank when the
    # sequence is split into 2*cp load-balanced chunks [RA]); always bf16 tensor cores [FA]
    heads_local = a / tp
    attn_flops = 2.0 * T * (s / 2.0) * heads_local * (M["qk_head_dim"] + M["v_head_dim"])
    attn_eff = e.attn_eff_max * _sat(s / cp, e.attn_seq_half)
    t_flash = attn_flops / (H["peak_bf16"] * attn_eff)
    # unfused attention (pre-2022 Megatron, Megatron-DeepSpeed default): the full s x s score
    # matrix is computed (no causal skipping) by batched GEMMs and run through memory-bound
    # scale/mask/softmax/dropout kernels [K22 sec 4.1: 5 bytes of stored scores per element]
    scores = T * s * heads_local
    t_unfused = (2.0 * attn_flops / (H["peak_bf16"] * e.gemm_eff_max * _sat(M["qk_head_dim"], e.gemm_dim_half))
                 + scores * e.softmax_bytes_per_score / (hbm * e.hbm_eff))
    t_attn_core = jnp.where(J["flash"] > 0, t_flash, t_unfused)

    f = M["ffn"]
    t_mlp_dense = gemm(T, f * (1.0 + g_mlp) / tp, h) + gemm(T, h, f / tp)
    # MoE [GS]: T/tp tokens per GPU are dispatched k times; EP rank holds E/ep experts, each sees
    # M_e tokens (balanced, times the imbalance of the busiest rank); ETP shards the expert FFN.
    is_moe_model = (M["experts"] > 0).astype(jnp.float32)
    E_exp = jnp.maximum(M["experts"], 1.0)
    routed_tok = T / tp * M["top_k"] * e.moe_imbalance            # routed token copies per GPU
    m_e = routed_tok * ep * etp / E_exp
    fe = M["expert_ffn"]
    t_experts = (E_exp / ep) * (gemm(m_e, fe * (1.0 + g_mlp) / etp, h) + gemm(m_e, h, fe / etp))
    sf = M["shared_ffn"]
    t_shared = gemm(T, sf * (1.0 + g_mlp) / tp, h) + gemm(T, h, sf / tp)
    t_router = gemm(T / tp, M["experts"], h)
    t_mlp_moe = (t_experts + t_shared + t_router) * is_moe_model

    # memory-bound elementwise work (norms, residuals, rope, casts, activation functions)
    bw_hbm = hbm * e.hbm_eff
    t_elem_attn = T_elem * h * e.elementwise_bytes_h / bw_hbm
    t_elem_dense = T * f / tp * e.elementwise_bytes_f / bw_hbm
    t_elem_moe = (routed_tok * fe * e.elementwise_bytes_f + T / tp * sf * e.elementwise_bytes_f
                  + 4.0 * routed_tok * h * 2.0 + T / tp * M["experts"] * 4.0 * 2.0) / bw_hbm
    # fp8/fp4 GEMMs need their inputs cast (and transposed for wgrad) with amax bookkeeping:
    # memory-bound traffic per element of every GEMM input (Transformer Engine cast-transpose)
    t_elem_attn = t_elem_attn + J["low_precision"] * e.lp_cast_bytes * (T_elem * h + T * M["attn_out_k"] / tp) / bw_hbm
    t_elem_dense = t_elem_dense + J["low_precision"] * e.lp_cast_bytes * (T_elem * h + T * f / tp) / bw_hbm
    t_elem_moe = t_elem_moe + J["low_precision"] * e.lp_cast_bytes * (2.0 * routed_tok * h + routed_tok * fe) / bw_hbm
    kern = e.kernels_per_layer * e.kernel_overhead_s
    kern_moe = kern + 10.0 * e.kernel_overhead_s                  # router, top-k, (un)permute, a2a prep

    # ---------------- communication per layer forward ----------------
    act_bytes = T * h * 2.0                                       # activations move in bf16
    # TP [N21 sec 2.3, K22 sec 4.2.2]: 2 all-reduces per layer fwd, or with SP 2 all-gathers +
    # 2 reduce-scatters of the same volume. MoE layers keep only the attention block's pair.
    # With SP and TE userbuffers (job.tp_overlap) the collectives are split into chunks that run
    # under the neighbouring GEMMs: a fraction of them hides, bounded by the GEMM time itself.
    t_tp_pair = C.all_reduce_s(act_bytes, tp, 1.0, H, link_eff, e.collective_latency_s)
    can_overlap = J["tp_overlap"] * sp

    def tp_exposed(t_comm, t_gemm):
        hidden = jnp.minimum(e.tp_comm_overlap * t_comm, t_gemm)
        return t_comm - can_overlap * hidden

    t_tp_dense = tp_exposed(2.0 * t_tp_pair, t_attn_proj + t_mlp_dense)
    etp_bytes = routed_tok * etp * h * 2.0
    t_etp = 2.0 * C.reduce_scatter_s(etp_bytes, etp, 1.0, H, link_eff, e.collective_latency_s)
    t_tp_moe = tp_exposed(t_tp_pair + t_etp, t_attn_proj + t_mlp_moe)
    # CP ring attention [RA]: cp-1 exchanges of this rank's K,V block, hidden under attention
    kv_bytes = T * M["kv_exchange_elems"] / jnp.minimum(tp, M["kv_heads"]) * 2.0
    cp_bw, cp_lat = C.group_link(cp, tp, H, link_eff)
    t_cp_raw = jnp.where(cp > 1, (cp - 1.0) * (kv_bytes / cp_bw + cp_lat), 0.0)
    t_cp_f = jnp.maximum(t_cp_raw - e.cp_overlap * t_attn_core, (1.0 - e.cp_overlap) * t_cp_raw)
    t_cp_b = jnp.maximum(2.0 * t_cp_raw - e.cp_overlap * e.attn_bwd_ratio * t_attn_core,
                         (1.0 - e.cp_overlap) * 2.0 * t_cp_raw)
    # EP [GS]: dispatch + combine all-to-all per MoE layer forward (and the same backward)
    a2a_bytes = routed_tok * h * 2.0
    t_ep_f = 2.0 * C.all_to_all_s(a2a_bytes, ep, etp, H, link_eff, e.collective_latency_s) * (1.0 - e.ep_overlap) * is_moe_model

    # ---------------- layer times (fwd, bwd, recompute) ----------------
    c_f_dense = t_attn_proj + t_attn_core + t_mlp_dense + t_elem_attn + t_elem_dense + kern
    c_f_moe = t_attn_proj + t_attn_core + t_mlp_moe + t_elem_attn + t_elem_moe + kern_moe
    # backward: two GEMMs (dgrad, wgrad) per forward GEMM; flash backward ~2.5x [FA]
    c_b_dense = 2.0 * (c_f_dense - t_attn_core - kern) + e.attn_bwd_ratio * t_attn_core + 2.0 * kern
    c_b_moe = 2.0 * (c_f_moe - t_attn_core - kern_moe) + e.attn_bwd_ratio * t_attn_core + 2.0 * kern_moe
    # recomputation [K22 sec 5]: full replays the layer forward (with its communication);
    # selective replays the attention core and the activation function
    # selective = Megatron-Core's cheap recompute modules: core attention, layernorms, activation
    # functions (dense and MoE) and, for MLA, the up-projections from the cached latents
    mla = (M["q_down_n"] + M["kv_down_n"] > 0).astype(jnp.float32)
    t_mla_up = mla * (gemm(T, M["q_up_n"] / tp, M["q_up_k"]) + gemm(T, M["kv_up_n"] / tp, M["kv_up_k"]))
    r_sel_common = t_attn_core + 0.5 * t_elem_attn + t_mla_up

    frac_moe = M["moe_layers"] / M["layers"]
    frac_dense = 1.0 - frac_moe
    # per layer and micro-batch, averaged over dense and MoE layers: forward + backward compute,
    # communication, selective recompute, and what full recompute replays (compute + its comm)
    fb_layer = frac_dense * (c_f_dense + c_b_dense) + frac_moe * (c_f_moe + c_b_moe)
    comm_layer = {"tp": frac_dense * 2.0 * t_tp_dense + frac_moe * 2.0 * t_tp_moe,
                  "cp": t_cp_f + t_cp_b, "ep": frac_moe * 2.0 * t_ep_f}
    sel_layer = rec_sel * (r_sel_common + frac_dense * t_elem_dense + frac_moe * t_elem_moe)
    full_layer = frac_dense * c_f_dense + frac_moe * c_f_moe
    full_comm = {"tp": frac_dense * t_tp_dense + frac_moe * t_tp_moe, "cp": t_cp_f, "ep": frac_moe * t_ep_f}

    # ---------------- pipeline stages: first, middle, last [Megatron-Core uneven split] ----------
    n_first, n_mid, n_last = stage_layers(M["layers"], pp, v, P["first_layers"], P["last_layers"], jnp,
                                          acc_embedding=P["account_for_embedding"], acc_loss=P["account_for_loss"],
                                          layout=P["layout"])
    pp1 = (pp == 1).astype(jnp.float32)
    has_mid = (pp > 2).astype(jnp.float32)
    # block recompute: recompute_layers of each virtual chunk (0 = all of them) [Megatron
    # --recompute-method block]
    R = P["recompute_layers"]

    def recomputed(n):
        return rec_full * jnp.where(R > 0, jnp.minimum(R, n / v) * v, n)

    # logits + loss on the last stage (fp32 softmax cross-entropy), embedding on the first
    t_logits_f = gemm(T, V / tp, h)
    t_loss = T * V / tp * 16.0 / bw_hbm                           # 4 fp32 passes over the logits
    t_embed = T * h * 6.0 / bw_hbm                                # lookup + fp32 scatter-add of grads
    t_head_tp = 2.0 * t_tp_pair
    t_head_compute = 3.0 * t_logits_f + t_loss

    def stage(n, embed, head):
        """Per micro-batch time terms of a stage with n layers (embed/head: 0/1 flags)."""
        nr = recomputed(n)
        return {"compute": n * fb_layer + embed * t_embed + head * t_head_compute,
                "ends": embed * t_embed + head * (t_head_compute + t_head_tp),
                "recompute": n * sel_layer + nr * full_layer,
                "tp": n * comm_layer["tp"] + nr * full_comm["tp"] + head * t_head_tp,
                "cp": n * comm_layer["cp"] + nr * full_comm["cp"],
                "ep": n * comm_layer["ep"] + nr * full_comm["ep"]}

    st_first = stage(n_first, 1.0, pp1)
    st_mid = stage(n_mid, 0.0, 0.0)
    st_last = stage(n_last, pp1, 1.0)
    t_first, t_mid, t_last = (sum(v for k, v in x.items() if k != "ends") for x in (st_first, st_mid, st_last))
    t_mid_eff = has_mid * t_mid
    # the slowest stage sets the 1F1B steady state; the others' work fills and drains the pipe:
    # (m - 1) * t_max + sum_i t_i, i.e. the bubble (p-1)/v * t for equal stages [N21 sec 2.2]
    is_first = (t_first >= t_last) & (t_first >= t_mid_eff)
    is_last = ~is_first & (t_last >= t_mid_eff)

    def at_slowest(x_first, x_mid, x_last):
        return jnp.where(is_first, x_first, jnp.where(is_last, x_last, x_mid))

    t_max = at_slowest(t_first, t_mid, t_last)
    t_sum = jnp.where(pp > 1, t_first + t_last + jnp.maximum(pp - 2.0, 0.0) * t_mid, t_first)
    bubble = (t_sum - t_max) / v                                 # also m < pp (more slots than m)

    # ---------------- pipeline p2p [N21 sec 2.2, 4.1] ----------------
    pp_gt1 = (pp > 1).astype(jnp.float32)
    p2p_bytes = T * h * 2.0 / tp                                  # scatter/gather optimization [N21 4.1]
    t_p2p = C.p2p_s(p2p_bytes, tp * cp * dp, pp, H, link_eff)
    n_p2p = 2.0 * v * m + 2.0 * (pp - 1.0)
    chunk_fb = t_max / v
    pp_comm = n_p2p * t_p2p * (1.0 - e.pp_overlap) \
        + 2.0 * v * m * jnp.maximum(t_p2p - chunk_fb, 0.0) * e.pp_overlap
    pp_comm = pp_comm * pp_gt1

    # ---------------- parameters per stage ----------------
    # first stage holds the input embedding, last the output layer (a copy when tied); one rank
    # holds both when pp=1 (unless they are tied)
    emb_params = V * h / tp
    dense_layer_params = M["attn_params"] + frac_dense * M["dense_mlp_params"] \
        + frac_moe * (M["shared_ffn"] * h * (2.0 + g_mlp) + M["router_params"])
    emb_end = emb_params * (1.0 + pp1 * (1.0 - M["tied"]))

    def params_of(n, ends):
        return (n * dense_layer_params / tp + ends * emb_end,
                n * frac_moe * M["experts"] * M["expert_params"] / (ep * etp))

    pd_first, pe_first = params_of(n_first, 1.0)
    pd_mid, pe_mid = params_of(n_mid, 0.0)
    pd_last, pe_last = params_of(n_last, 1.0)
    # data-parallel traffic and the optimizer step of the stage with the most parameters
    big_first = (pd_first + pe_first >= pd_last + pe_last) & (pd_first + pe_first >= has_mid * (pd_mid + pe_mid))
    big_last = ~big_first & (pd_last + pe_last >= has_mid * (pd_mid + pe_mid))

    def at_biggest(x_first, x_mid, x_last):
        return jnp.where(big_first, x_first, jnp.where(big_last, x_last, x_mid))

    p_dense = at_biggest(pd_first, pd_mid, pd_last)
    p_expert = at_biggest(pe_first, pe_mid, pe_last)
    n_big = at_biggest(n_first, n_mid, n_last)
    n_dp_dense = dp * cp                                          # grads reduce over DP x CP
    n_dp_exp = tp * cp * dp / (ep * etp)                          # expert data parallel (folding)
    gbytes = e.grad_bytes_per_param

    # ---------------- data parallel [Z20; MG] ----------------
    z0 = (zero == 0).astype(jnp.float32)
    z12 = ((zero == 1) | (zero == 2)).astype(jnp.float32)
    z3 = (zero == 3).astype(jnp.float32)
    lat = e.collective_latency_s
    moe_on = is_moe_model                                         # dense models have no expert grads
    ar = C.all_reduce_s(gbytes * p_dense, n_dp_dense, tp, H, link_eff, lat) \
        + moe_on * C.all_reduce_s(gbytes * p_expert, n_dp_exp, ep * etp, H, link_eff, lat)
    rs = C.reduce_scatter_s(gbytes * p_dense, n_dp_dense, tp, H, link_eff, lat) \
        + moe_on * C.reduce_scatter_s(gbytes * p_expert, n_dp_exp, ep * etp, H, link_eff, lat)
    ag = C.all_gather_s(2.0 * p_dense, n_dp_dense, tp, H, link_eff, lat) \
        + moe_on * C.all_gather_s(2.0 * p_expert, n_dp_exp, ep * etp, H, link_eff, lat)
    win_b = n_big * (frac_dense * c_b_dense + frac_moe * c_b_moe)   # last micro-batch backward
    win_f = n_big * (frac_dense * c_f_dense + frac_moe * c_f_moe)   # first micro-batch forward

    def exposed(t, window):
        return t - jnp.minimum(e.dp_overlap * t, window)

    dp_z0 = exposed(ar, win_b)
    dp_z12 = exposed(rs, win_b) + exposed(ag, win_f)
    # ZeRO-3: gather params for forward and backward and reduce-scatter grads every micro-batch,
    # layer by layer (many smaller collectives competing with compute for SMs: zero3_bw_eff)
    # with prefetch they hide under the whole step's compute, except the first gather and the
    # last reduce-scatter, which have nothing to overlap with (about two layers' worth)
    t_z3 = m * (2.0 * ag + rs) / e.zero3_bw_eff
    # (the window is the whole stage time: compute already hides TP/CP traffic, and counting it
    # twice would make a faster GPU slower)
    # (only the layers' work: the embedding and output layer come before the first gather and
    # after the last reduce-scatter)
    t_layers = at_slowest(t_first - st_first["ends"], t_mid, t_last - st_last["ends"])
    dp_z3 = jnp.maximum(t_z3 - m * t_layers, 2.0 * t_z3 / (m * n_big))
    dp_comm = z0 * dp_z0 + z12 * dp_z12 + z3 * dp_z3

    # ---------------- optimizer (memory bound Adam step) ----------------
    shard_opt = jnp.where(zero >= 1, 1.0, 0.0)
    p_opt = p_dense / jnp.where(shard_opt > 0, n_dp_dense, 1.0) + p_expert / jnp.where(shard_opt > 0, n_dp_exp, 1.0)
    t_opt = p_opt * e.optimizer_bytes_per_param / bw_hbm

    # ---------------- step time ----------------
    overhead = e.step_overhead_s + m * e.microbatch_overhead_s
    step = m * t_max + bubble + pp_comm + dp_comm + t_opt + overhead

    # ---------------- FLOPs (model = useful, hardware = with recompute) [N21 eq. 3 generalized] ---
    fwd_attn_lin = 2.0 * M["attn_params"]
    fwd_core = 2.0 * (s / 2.0) * a * (M["qk_head_dim"] + M["v_head_dim"])     # causal
    fwd_dense = fwd_attn_lin + fwd_core + 2.0 * M["dense_mlp_params"]
    fwd_moe = fwd_attn_lin + fwd_core + 2.0 * (M["top_k"] * M["expert_params"]
                                               + M["shared_ffn"] * h * (2.0 + g_mlp) + M["router_params"])
    L = M["layers"]
    fwd_token = L * (frac_dense * fwd_dense + frac_moe * fwd_moe) + 2.0 * h * V
    tokens = J["global_batch"] * s
    model_flops = 3.0 * fwd_token * tokens
    n_mid_all = jnp.maximum(pp - 2.0, 0.0) * n_mid
    rf_share = jnp.where(pp > 1, (recomputed(n_first) + jnp.maximum(pp - 2.0, 0.0) * recomputed(n_mid)
                                  + recomputed(n_last)) / (n_first + n_mid_all + n_last),
                         recomputed(n_first) / n_first)               # share of layers replayed (full)
    rec_token = L * (rf_share * (frac_dense * fwd_dense + frac_moe * fwd_moe) + rec_sel * fwd_core)
    hw_flops = model_flops + rec_token * tokens

    # ---------------- memory on the first, second and last pipeline ranks ----------------
    wbytes = 2.0 + J["low_precision"] * e.low_precision_weight_bytes
    shard_w = jnp.where(zero >= 3, 1.0, 0.0)
    shard_g = jnp.where(zero >= 2, 1.0, 0.0)

    def shard(x_dense, x_exp, on):
        return x_dense / jnp.where(on > 0, n_dp_dense, 1.0) + x_exp / jnp.where(on > 0, n_dp_exp, 1.0)

    # ZeRO-3 gathers one weight matrix at a time and prefetches the next: two of the largest live
    largest_matrix = jnp.maximum(jnp.maximum(f, M["q_up_n"]) * h, M["expert_ffn"] * h * (1.0 + g_mlp)) / tp

    # activations per layer per micro-batch [K22 table 2], 2 bytes/element, flash attention
    repl = 4.0 * h + M["attn_act_repl"]                           # norm inputs + GEMM inputs
    sh_attn = M["attn_act_sharded"] + a * M["v_head_dim"]         # Q, K, V + attention output
    sh_dense = f * (1.0 + g_mlp) + f                              # fc1 output + activation output
    moe_tok = M["top_k"] * e.moe_imbalance * (etp * h + fe * (2.0 + g_mlp)) + sf * (2.0 + g_mlp) \
        + 2.0 * M["experts"]
    act_none = 2.0 * T * (repl / jnp.where(sp > 0, tp, 1.0) + sh_attn / tp
                          + frac_dense * sh_dense / tp + frac_moe * moe_tok / tp)
    act_scores = (1.0 - J["flash"]) * 5.0 * T * s * heads_local          # K22 table 2: 5as/h term
    act_sel = act_none - 2.0 * T * (
        2.0 * h / jnp.where(sp > 0, tp, 1.0)                               # layernorm outputs
        + mla * M["attn_act_sharded"] / tp                                  # MLA q, k, v from latents
        + (frac_dense * f + frac_moe * M["top_k"] * fe * e.moe_imbalance) / tp)   # activation outputs
    act_none = act_none + act_scores
    act_full = 2.0 * T * h / jnp.where(sp > 0, tp, 1.0)
    working = rec_full * act_none                                 # one layer re-materialized in backward
    logits_mem = T * V / tp * e.logits_bytes_per_elem
    tp_buf = jnp.where(tp > 1, 2.0 * T * h * 2.0, 0.0)           # gathered SP / TP comm buffers

    def rank_memory(n, pd, pe, rank, logits):
        """Memory of pipeline rank `rank` holding n layers and pd/pe dense/expert parameters."""
        nr = recomputed(n)
        act_stage = nr * act_full + (n - nr) * (rec_sel * act_sel + (1.0 - rec_sel) * act_none)
        # micro-batches in flight: 1F1B warm-up pp - rank - 1; interleaved, in chunks of 1/v stage:
        # 2*(pp - rank - 1) + (v - 1)*pp warm-up forwards (Megatron-Core schedules) [K22 4.2.3]
        inflight = jnp.where(v > 1, (2.0 * (pp - rank - 1.0) + (v - 1.0) * pp + 1.0) / v,
                             jnp.minimum(m, pp - rank))
        parts = {"weights": wbytes * shard(pd, pe, shard_w) + z3 * 2.0 * 2.0 * largest_matrix,
                 "gradients": gbytes * shard(pd, pe, shard_g),
                 "optimizer": 12.0 * shard(pd, pe, shard_opt),       # fp32 master + Adam m, v [Z20]
                 "activations": act_stage * inflight + working + logits * logits_mem}
        dynamic = sum(parts.values()) + tp_buf
        parts["total"] = dynamic * e.mem_fragmentation + e.mem_fixed_bytes
        return parts

    mem_first = rank_memory(n_first, pd_first, pe_first, 0.0, pp1)
    mem_mid = rank_memory(n_mid, pd_mid, pe_mid, 1.0, 0.0)
    mem_last = rank_memory(n_last, pd_last, pe_last, pp - 1.0, 1.0)
    mid_total = jnp.where(has_mid > 0, mem_mid["total"], 0.0)
    peak_first = (mem_first["total"] >= mem_last["total"]) & (mem_first["total"] >= mid_total)
    peak_last = ~peak_first & (mem_last["total"] >= mid_total)
    mem = {k: jnp.where(peak_first, mem_first[k], jnp.where(peak_last, mem_last[k], mem_mid[k]))
           for k in mem_first}
    total = mem["total"]
    weights_mem, grads_mem, opt_mem, activations = (mem[k] for k in ("weights", "gradients", "optimizer",
                                                                      "activations"))
    other = total - weights_mem - grads_mem - opt_mem - activations

    out = {
        "step_time_s": step,
        "tokens_per_s": tokens / step,
        "model_flops": model_flops, "hw_flops": hw_flops,
        "num_gpus": n_gpus, "micro_batches": m,
        "t_compute_s": m * at_slowest(st_first["compute"], st_mid["compute"], st_last["compute"]),
        "t_recompute_s": m * at_slowest(st_first["recompute"], st_mid["recompute"], st_last["recompute"]),
        "t_tp_comm_s": m * at_slowest(st_first["tp"], st_mid["tp"], st_last["tp"]),
        "t_cp_comm_s": m * at_slowest(st_first["cp"], st_mid["cp"], st_last["cp"]),
        "t_ep_comm_s": m * at_slowest(st_first["ep"], st_mid["ep"], st_last["ep"]),
        "t_pp_comm_s": pp_comm,
        "t_dp_comm_s": dp_comm,
        "t_bubble_s": bubble,
        "t_optimizer_s": t_opt,
        "t_overhead_s": overhead,
        "mem_weights": weights_mem, "mem_gradients": grads_mem, "mem_optimizer": opt_mem,
        "mem_activations": activations, "mem_other": other, "mem_total": total,
        "memory_limit": J["memory_limit"],
    }
    return {k: jnp.broadcast_to(v, step.shape) for k, v in out.items()}


#: the jitted scorer: one compiled function for every model, cluster and job of the same shapes
evaluate_jit = jax.jit(evaluate)


def _summary(plans, model, hw, job, e):
    out = evaluate(plans, model, hw, job, e)
    return out["step_time_s"], out["mem_total"]


summary_jit = jax.jit(_summary)
