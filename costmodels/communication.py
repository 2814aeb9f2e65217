"""Communication of each parallelism, on top of the collective costs of `collectives.py`.

Per layer and micro-batch: TP (and expert-TP) collectives, the CP ring exchange, the MoE
all-to-alls. Per step: pipeline p2p and the data-parallel gradient / parameter collectives.
Symbols as in compute.py; groups are placed TP innermost, then CP, EP/DP, PP outermost.

Sources
  [N21] Narayanan et al. 2021, sec. 2.2-2.3 (TP all-reduces; pipeline p2p), sec. 4.1 (scatter/
        gather of the p2p tensor over the TP group).
  [K22] Korthikanti et al. 2022, sec. 4.2.2: with SP, all-gather + reduce-scatter of the same volume.
  [RA]  Liu et al. 2023, Ring Attention; Megatron-Core CP: cp-1 KV block exchanges per layer,
        overlapped with the attention of the previous block.
  [GS]  GShard / Megatron-Core MoE: dispatch + combine all-to-all per MoE layer forward, the same
        backward.
  [EPO] Megatron-Core MoE README, "EP A2A Overlap" (--overlap-moe-expert-parallel-comm, MCore 0.14):
        the forward of one micro-batch and the backward of another merged layer by layer, each one's
        all-to-alls under the other's compute; schedules.py: warm-up / cool-down passes stay unmerged.
  [DEP] DeepEP README (normal kernels): a token crosses to another node once, then NVLink forwards it;
        inside a node it goes once to each rank holding one of its experts (csrc/kernels/intranode.cu).
  [HEP] DeepEP hybrid-ep branch, Hybrid-EP_Intra-node_Implementation.md: HybridEP's measured intra-node
        dispatch / combine bandwidth on B200 and GB200 (FLEX_NVL_EFF).
  [Z20] Rajbhandari et al. 2020 (ZeRO): stage 1/2 reduce-scatter + all-gather; stage 3 gathers
        parameters for forward and backward and reduce-scatters gradients (1.5x the traffic).
  [MG]  Megatron-LM distributed optimizer: reduce-scatter of gradients, all-gather of parameters,
        overlapped with backward / forward (--overlap-grad-reduce / --overlap-param-gather).
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from . import collectives as C
from .compute import ACT_BYTES, LayerTimes, LayerWork, Shapes
from .params import EfficiencyParams

#: NVLink efficiency of the flex dispatcher's own kernels, per byte a rank sends after deduplication: HybridEP's
#: measured intra-node bandwidth on 8 B200 (hidden 7168, top-8, 16 SMs, through the Torch API: dispatch 536,
#: combine 531 GB/s of "algorithm bandwidth", which counts a rank's copy to itself) is 7/8 x 534 = 467 GB/s of
#: NVLink 5's 900 [HEP]; on GB200, 8 ranks 0.53,
#: 36 ranks 0.51. DeepEP's normal kernels on B200 reach 0.34-0.53 at 16-24 SMs (same table).
FLEX_NVL_EFF = 0.52


def _links(e: EfficiencyParams):
    return (e.intra_bw_eff, e.inter_bw_eff)


class LayerComm(NamedTuple):
    """Exposed communication of one layer forward, per micro-batch (s)."""
    tp_pair: object          # one all-reduce (or AG + RS pair) of the activations over TP
    tp_dense: object         # a dense layer's TP collectives, after overlap with its GEMMs
    tp_moe: object           # an MoE layer's: the attention pair + expert-TP reduce-scatters
    tp_dense_bwd: object     # the same collectives in the backward pass (some run under weight-gradient GEMMs)
    tp_moe_bwd: object
    cp_fwd: object
    cp_bwd: object
    ep_fwd: object           # dispatch + combine


def layer_comm(S: Shapes, w: LayerWork, lt: LayerTimes, M: dict, H: dict, J: dict,
               e: EfficiencyParams) -> LayerComm:
    link, lat, h = _links(e), e.collective_latency_s, M["hidden"]
    act_bytes = S.tokens * h * J["act_bytes"]
    # TP [N21 sec 2.3, K22 sec 4.2.2]: 2 all-reduces per layer forward, or with SP 2 all-gathers +
    # 2 reduce-scatters of the same volume; MoE layers keep only the attention block's pair. With
    # SP and TE userbuffers (--tp-comm-overlap) the collectives run in chunks under the
    # neighbouring GEMMs: a fraction hides, bounded by the GEMM time itself.
    tp_pair = C.all_reduce_s(act_bytes, S.tp, 1.0, H, link, lat)
    can_overlap = J["tp_overlap"] * S.sp

    def exposed(t_comm, t_gemm):
        return t_comm - can_overlap * jnp.minimum(e.tp_comm_overlap * t_comm, t_gemm)

    # Backward, without userbuffers: the column-parallel layers' collective on the input gradient (all-reduce;
    # with SP the reduce-scatter, while the row-parallel layers' all-gather of the output gradient stays
    # synchronous: half) is issued asynchronously and runs under the weight-gradient GEMM (Megatron-LM since
    # 2022, tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication; 2021 code waited)
    async_share = J["tp_async"] * (1.0 - 0.5 * S.sp) * (1.0 - can_overlap)

    def exposed_bwd(t_comm, t_gemm):
        return exposed(t_comm, t_gemm) - async_share * jnp.minimum(e.tp_comm_overlap * t_comm, t_gemm)

    # With SP a column-parallel layer does not keep its all-gathered input: its backward gathers it again for
    # the weight gradient, issued before the input-gradient GEMM and run under it (Megatron-Core
    # LinearWithGradAccumulationAndAsyncCommunication.backward; TE's layers the same): one all-gather (half a
    # pair) per column-parallel layer, QKV and fc1 in a dense layer, QKV (and a shared expert's fc1) in an MoE one
    regather = S.sp * 0.5 * tp_pair

    def exposed_regather(n_layers, t_gemm):
        t = n_layers * regather
        return t - jnp.minimum(e.tp_comm_overlap * t, t_gemm)

    tp_dense = exposed(2.0 * tp_pair, w.attn_proj + w.mlp_dense)
    tp_dense_bwd = exposed_bwd(2.0 * tp_pair, w.attn_proj + w.mlp_dense) + exposed_regather(2.0, w.attn_proj + w.mlp_dense)
    etp_bytes = S.routed_tokens * S.etp * h * J["act_bytes"]
    t_etp = 2.0 * C.reduce_scatter_s(etp_bytes, S.etp, 1.0, H, link, lat)
    # shared experts are column/row-parallel over TP like a dense MLP: their own AG + RS pair
    has_shared = (M["shared_ffn"] > 0).astype(jnp.float32)
    tp_moe = exposed(tp_pair * (1.0 + has_shared) + t_etp, w.attn_proj + w.mlp_moe)
    tp_moe_bwd = (exposed_bwd(tp_pair * (1.0 + has_shared) + t_etp, w.attn_proj + w.mlp_moe)
                  + exposed_regather(1.0 + has_shared, w.attn_proj + w.mlp_moe_shared))
    # CP ring attention [RA]: cp-1 exchanges of this rank's K,V block, hidden under attention
    kv_bytes = S.tokens * M["kv_exchange_elems"] / jnp.minimum(S.tp, M["kv_heads"]) * J["act_bytes"]
    # each step every rank sends its block to the next: a hop between nodes goes over one NIC
    # (not the group's aggregate), so the ring runs at its slowest hop (a point-to-point)
    cp_raw = jnp.where(S.cp > 1, (S.cp - 1.0) * C.p2p_s(kv_bytes, S.tp, S.cp, H, link), 0.0)
    cp_fwd = jnp.maximum(cp_raw - e.cp_overlap * w.attn_core, (1.0 - e.cp_overlap) * cp_raw)
    cp_bwd = jnp.maximum(2.0 * cp_raw - e.cp_overlap * w.attn_core_bwd,
                         (1.0 - e.cp_overlap) * 2.0 * cp_raw)
    # EP [GS]: dispatch + combine all-to-all per MoE layer forward (and the same backward); the flex
    # dispatcher sends a token to another node once, not once per expert there [DEP]
    # inside the domain it sends a token once per destination rank, at the NVLink efficiency its kernels reach
    # (FLEX_NVL_EFF) rather than NCCL's
    a2a_bytes = S.routed_tokens * h * J["act_bytes"]
    flex = J["flex_dispatch"] > 0
    remote = jnp.where(flex, C.node_dedup_share(M["top_k"], S.ep, S.etp, H), 1.0)
    local = jnp.where(flex, C.rank_dedup_share(M["top_k"], S.ep), 1.0)
    a2a_link = (jnp.where(flex, FLEX_NVL_EFF, link[0]), link[1])
    t_a2a = 2.0 * C.all_to_all_s(a2a_bytes, S.ep, S.etp, H, a2a_link, lat, remote_share=remote,
                                 local_share=local) * S.is_moe
    # the allgather dispatcher (Megatron-Core's default type) gathers every EP rank's tokens, whatever
    # their experts, and reduce-scatters the outputs back [MoEAllGatherTokenDispatcher]
    gathered_bytes = S.ep * S.tokens / S.tp * h * J["act_bytes"]
    t_ag = 2.0 * C.all_gather_s(gathered_bytes, S.ep, S.etp, H, link, lat) * S.is_moe
    t_a2a = jnp.where(J["allgather_dispatch"] > 0, t_ag, t_a2a)
    ep_fwd = jnp.where(J["ep_a2a_overlap"] > 0, merged_ep_exposed_s(S, t_a2a, lt, e), t_a2a)
    return LayerComm(tp_pair, tp_dense, tp_moe, tp_dense_bwd, tp_moe_bwd, cp_fwd, cp_bwd, ep_fwd)


def unmerged_share(S: Shapes):
    """Share of a rank's forward chunk passes that the merged schedule cannot pair with a backward:
    the warm-up of Megatron-Core's interleaved schedule on the first rank, (pp-1)*2 + (vpp-1)*N
    chunks (schedules.py get_pp_rank_microbatches; N the micro-batch group S.mb_group, pp by default), of
    m*vpp; without a pipeline the first forward and the last backward, one of m."""
    warm = jnp.where(S.pp > 1, (S.pp - 1.0) * 2.0 + (S.vpp - 1.0) * S.mb_group, 1.0)
    return jnp.clip(warm / (S.micro_batches * S.vpp), 0.0, 1.0)


def merged_ep_exposed_s(S: Shapes, t_a2a, lt: LayerTimes, e: EfficiencyParams):
    """Exposed all-to-all per MoE layer pass with --overlap-moe-expert-parallel-comm [EPO]: a merged
    forward + backward pair hides its 2 t_a2a under `ep_overlap` of the pair's compute; unmerged passes
    expose theirs."""
    hidden = jnp.minimum(2.0 * t_a2a, e.ep_overlap * (lt.fwd_moe + lt.bwd_moe))
    u = unmerged_share(S)
    return u * t_a2a + (1.0 - u) * (t_a2a - 0.5 * hidden)


def pipeline_p2p_s(S: Shapes, M: dict, H: dict, slowest_stage_s, e: EfficiencyParams):
    """Send/recv of the activations at every stage boundary, per micro-batch and virtual chunk,
    forward and backward, plus the pipeline fill; hidden under compute except the share that
    cannot overlap [N21 sec. 2.2, 4.1: only 1/tp of the tensor crosses, then an all-gather]."""
    pp, v, m = S.pp, S.vpp, S.micro_batches
    p2p_bytes = S.tokens * M["hidden"] * ACT_BYTES / S.tp
    t_p2p = C.p2p_s(p2p_bytes, S.tp * S.cp * S.dp, pp, H, _links(e))
    n_p2p = 2.0 * v * m + 2.0 * (pp - 1.0)
    chunk_fb = slowest_stage_s / v
    t = n_p2p * t_p2p * (1.0 - e.pp_overlap) + 2.0 * v * m * jnp.maximum(t_p2p - chunk_fb, 0.0) * e.pp_overlap
    return t * (pp > 1).astype(jnp.float32)


class DataParallelGroups(NamedTuple):
    dense: object            # ranks that reduce dense gradients: dp * cp
    expert: object           # ranks that reduce expert gradients: tp*cp*dp / (ep*etp) (folding)


def dp_groups(S: Shapes) -> DataParallelGroups:
    return DataParallelGroups(S.dp * S.cp, S.tp * S.cp * S.dp / (S.ep * S.etp))


#: Megatron-Core's default gradient bucket: max(40M, 1M x data-parallel size) parameters
#: (distributed_data_parallel.py; training.py resolve_ddp_bucket_size)
BUCKET_MIN_PARAMS = 4e7
BUCKET_PARAMS_PER_DP_RANK = 1e6


def bucket_share(params, dp_size):
    """The share of a rank's gradient buffer in one default-sized bucket (1 when it all fits in one)."""
    bucket = jnp.maximum(BUCKET_MIN_PARAMS, BUCKET_PARAMS_PER_DP_RANK * dp_size)
    return jnp.clip(bucket / jnp.maximum(params, 1.0), 0.0, 1.0)


def data_parallel_s(S: Shapes, groups: DataParallelGroups, params_dense, params_expert, layers,
                    lt: LayerTimes, stage_layers_s, H: dict, grad_bytes, e: EfficiencyParams, idle_s=0.0,
                    grad_overlap=1.0, param_overlap=1.0, deepspeed_zero3=0.0, param_bytes=2.0, frozen_params=0.0):
    """Exposed gradient / parameter traffic per step of the stage with most parameters.

    ZeRO 0: all-reduce of gradients, overlapped with the last micro-batch's backward. ZeRO 1
    (Megatron's distributed optimizer): gradients accumulate in a full buffer, one reduce-scatter
    under the last backward + one all-gather under the first forward [MG, Z20]. ZeRO 2 (DeepSpeed;
    Megatron has none): each rank keeps only its gradient shard, so every micro-batch's backward
    reduce-scatters its gradients [Z20 sec. 5.2]. ZeRO 3 / FSDP: per micro-batch two gathers of parameters (forward,
    backward) and a reduce-scatter of gradients, layer by layer, never hiding the first gather and the last
    reduce-scatter (about two layers' worth). Megatron's FSDP runs them as bucketed NCCL collectives at the group's
    bus bandwidth on a communication stream of its own, each layer's gather prefetched while the layer before it
    computes and each reduce-scatter run while the next one does (megatron_fsdp's default prefetching): the traffic
    hides under the layers' work up to that work's length. DeepSpeed's stage 3
    (`deepspeed_zero3`, 0/1) fetched each module's parameters with its own synchronous gathers and copies, reached
    only `zero3_bw_eff` of the bandwidth, on NVLink as over InfiniBand (DeepSpeed issue #1174: ~21 GB/s per A100
    inside one NVLink node, 2021), and hid at most `dp_overlap` of it, as the other stages' overlap does (the only
    ZeRO-3 runs fitted are DeepSpeed's: Narayanan et al. 2021's). Before this distinction Megatron's FSDP was capped
    by the same `dp_overlap`: Megatron-Bridge's FSDP runs (Llama-3 8B on 8 H100, 70B on 64 GB200 / GB300, held out
    in `bridge-dense`) were 10-17 points too slow.

    params_dense / params_expert are the parameters that get gradients; with LoRA the adapters, and the frozen
    base (`frozen_params`, which gets none) is gathered by ZeRO-3 / FSDP only (its layers need it whole).

    param_bytes: bytes per parameter the gathers move, the primary weights' (memory.primary_weight_bytes: bf16,
    fp32 without mixed precision, fp8 / NVFP4 with --fp8-param-gather).

    grad_overlap / param_overlap (0 or 1): Megatron's --overlap-grad-reduce and --overlap-param-gather.
    Without the first, gradients are reduced after the whole backward pass (Megatron-LM's only behaviour
    before the option came in 2023: its `local` DDP all-reduced its buffer after backward); without the
    second, the distributed optimizer all-gathers the updated parameters after its step, not under the
    next forward (distributed_data_parallel_config.py). With them, the last gradient bucket (and the
    first parameter bucket) stays exposed: `bucket_share` of the traffic, which grows with the DP size
    because Megatron's buckets do (max(40M, 1M x dp) parameters)."""
    link, lat = _links(e), e.collective_latency_s
    moe_on = S.is_moe                                        # dense models have no expert grads
    pd, pe = params_dense, params_expert
    ar_d = C.all_reduce_s(grad_bytes * pd, groups.dense, S.tp, H, link, lat)
    ar_e = moe_on * C.all_reduce_s(grad_bytes * pe, groups.expert, S.ep * S.etp, H, link, lat)
    rs_d = C.reduce_scatter_s(grad_bytes * pd, groups.dense, S.tp, H, link, lat)
    rs_e = moe_on * C.reduce_scatter_s(grad_bytes * pe, groups.expert, S.ep * S.etp, H, link, lat)
    ag_d = C.all_gather_s(param_bytes * pd, groups.dense, S.tp, H, link, lat)
    ag_e = moe_on * C.all_gather_s(param_bytes * pe, groups.expert, S.ep * S.etp, H, link, lat)
    ar, rs, ag = ar_d + ar_e, rs_d + rs_e, ag_d + ag_e
    # Megatron's gradient buckets hold max(40M, 1M x dp) parameters (distributed_data_parallel.py); the
    # last bucket's reduction starts only when the backward pass ends, and the first bucket's gather
    # must end before the first layer's forward: that bucket's share of the traffic never hides
    tail_d = bucket_share(pd, groups.dense)
    tail_e = bucket_share(pe, groups.expert)

    def tail(t_d, t_e, allowed):
        return allowed * (tail_d * t_d + tail_e * t_e)

    fm = S.frac_moe
    # last micro-batch backward, first micro-batch forward; the GPU's idle time in a host-bound
    # micro-batch and its waits on exposed TP / CP / EP collectives (idle_s) lengthen whichever pass
    # they fall in: counted in both (an upper bound, and the form under which a faster GPU never
    # exposes more traffic than it saves: hypothesis found the case where it did)
    win_b = layers * ((1.0 - fm) * lt.bwd_dense + fm * lt.bwd_moe) + idle_s
    win_f = layers * ((1.0 - fm) * lt.fwd_dense + fm * lt.fwd_moe) + idle_s

    def exposed(t, window, allowed, floor=0.0):
        return jnp.maximum(t - jnp.minimum(allowed * e.dp_overlap * t, window), floor)

    m = S.micro_batches
    z0 = exposed(ar, win_b, grad_overlap, tail(ar_d, ar_e, grad_overlap))
    z1 = exposed(rs, win_b, grad_overlap, tail(rs_d, rs_e, grad_overlap)) \
        + exposed(ag, win_f, param_overlap, tail(ag_d, ag_e, param_overlap))
    z2 = m * exposed(rs, win_b, grad_overlap) + exposed(ag, win_f, param_overlap)
    # ZeRO-3 / FSDP issues its collectives layer by layer (one FSDP unit per transformer layer; DeepSpeed: per
    # module): the bytes of the whole stage, but a ring's latency per layer, (n - 1) hops each; DeepSpeed's stage 3
    # reaches zero3_bw_eff of the bandwidth (its bytes count 1 / zero3_bw_eff times), at the same latency
    n_l = jnp.maximum(layers, 1.0)
    per_layer = 1.0 / (n_l * jnp.where(deepspeed_zero3 > 0, e.zero3_bw_eff, 1.0))
    ag_l = (C.all_gather_s(param_bytes * (pd + frozen_params) * per_layer, groups.dense, S.tp, H, link, lat)
            + moe_on * C.all_gather_s(param_bytes * pe * per_layer, groups.expert, S.ep * S.etp, H, link, lat))
    rs_l = (C.reduce_scatter_s(grad_bytes * pd * per_layer, groups.dense, S.tp, H, link, lat)
            + moe_on * C.reduce_scatter_s(grad_bytes * pe * per_layer, groups.expert, S.ep * S.etp, H, link, lat))
    t_z3 = m * n_l * (2.0 * ag_l + rs_l)
    # the window is the layers' work only: the embedding and output layer come before the first
    # gather and after the last reduce-scatter, and compute already hides TP/CP traffic
    # the share that may hide: all of it with Megatron's prefetching FSDP, dp_overlap with DeepSpeed's stage 3
    z3_cap = jnp.where(deepspeed_zero3 > 0, e.dp_overlap, 1.0)
    z3 = jnp.maximum(t_z3 - jnp.minimum(z3_cap * t_z3, m * stage_layers_s), 2.0 * t_z3 / (m * layers))
    return jnp.where(S.zero == 0, z0, jnp.where(S.zero >= 3, z3, jnp.where(S.zero == 2, z2, z1)))
