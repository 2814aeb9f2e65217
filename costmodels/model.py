"""The vectorized cost model: a batch of plans -> step time, memory and their breakdowns.

Pure JAX, branch-free (jnp.where), differentiable in every continuous input. Every argument is a
dict of float arrays that broadcast against each other: plan fields have shape [K] (one entry per
candidate); model, cluster (`hw`) and job values are scalars, or [K] when scoring a batch of
different runs (validation, calibration). The terms live in small modules:

  compute.py        one layer's GEMMs, attention, MoE, memory-bound work, kernel launches
  communication.py  TP / CP / EP per layer, pipeline p2p, data-parallel collectives
  collectives.py    ring / tree / all-to-all / p2p costs over the NVLink-fabric-WAN topology
  pipeline.py       stage layer counts, the 1F1B composition and bubble, in-flight micro-batches
  memory.py         weights, gradients, optimizer, activations, logits, buffers per rank
  flops.py          model and hardware FLOPs
  breakdown.py      the typed result (Prediction, StepTime, Memory)
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import communication as comm
from . import compute, memory, pipeline
from .breakdown import Memory, Prediction, StepTime, broadcast
from .flops import step_flops
from .params import EfficiencyParams


#: the MLP's share of a layer's TP collectives (one all-gather / reduce-scatter pair of two)
MLP_SHARE_OF_TP_COMM = 0.5


def _stage_time(S, n, n_rec, embed, head, w, lt, lc, hw_head, sync, offload):
    """Per micro-batch time terms of a stage with n layers (embed / head: 0/1 flags); S.frac_moe is
    this stage's share of MoE layers; offload(S, n, fwd, bwd): the exposed CPU-offloading copies."""
    fm, r = S.frac_moe, S.rec_mod
    fb_layer = (1.0 - fm) * (lt.fwd_dense + lt.bwd_dense) + fm * (lt.fwd_moe + lt.bwd_moe)
    fwd_layer, bwd_layer = (1.0 - fm) * lt.fwd_dense + fm * lt.fwd_moe, (1.0 - fm) * lt.bwd_dense + fm * lt.bwd_moe
    full_layer = (1.0 - fm) * (lt.fwd_dense - w.remat_skip_dense) + fm * (lt.fwd_moe - w.remat_skip_moe)
    head_tp = 2.0 * lc.tp_pair * hw_head.outputs         # the output layer's TP collectives, per pass through it
    head_compute = hw_head.logits_fwd_bwd + hw_head.loss + hw_head.mtp
    return dict(
        compute=n * fb_layer + embed * hw_head.embedding + head * head_compute,
        ends=embed * hw_head.embedding + head * (head_compute + head_tp),
        recompute=n * compute.selective_recompute_s(S, w) + n_rec * full_layer,
        offload=offload(S, n, fwd_layer, bwd_layer),
        tp=n * ((1.0 - fm) * (lc.tp_dense + lc.tp_dense_bwd) + fm * (lc.tp_moe + lc.tp_moe_bwd))
        + n_rec * ((1.0 - fm) * lc.tp_dense + fm * lc.tp_moe) + head * head_tp
        + n * ((1.0 - fm) * r.mlp * MLP_SHARE_OF_TP_COMM * lc.tp_dense
               + fm * r.moe * MLP_SHARE_OF_TP_COMM * lc.tp_moe),
        cp=n * (lc.cp_fwd + lc.cp_bwd) + n_rec * lc.cp_fwd,
        ep=n * fm * 2.0 * lc.ep_fwd + (n_rec + n * r.moe) * fm * lc.ep_fwd,
        host=(n * (1.0 + compute.HOST_BWD_PER_FWD) + n_rec) * ((1.0 - fm) * w.host_dense + fm * w.host_moe),
        sync_cycle=n * fm * sync.cycle, sync_gpu=n * fm * sync.gpu, sync_host=n * fm * sync.host)


class MoeSync(NamedTuple):
    """Per MoE layer forward (s): the cycle after the dispatcher's wait, and the GPU and host time it replaces."""
    cycle: object
    gpu: object
    host: object


def moe_host_sync(S, w, lt, lc, J, e) -> MoeSync:
    """A dropless MoE layer's dispatcher must learn on the host how many tokens each expert receives
    (Megatron-Core's alltoall cuda_sync_point, DeepEP's received-token count, TEGroupedMLP's
    tokens_per_expert.tolist()): the host waits for the GPU to finish the layer's attention and router
    (P), then issues the dispatch, experts and combine (Q) and the next layer's P. Slack the host gained
    while the GPU ran P cannot carry past the wait, so a forward layer takes max(host_Q + host_P,
    max(host_Q, gpu_Q) + gpu_P) plus one host op for the first launch, against max of the sums without
    the wait. Padded experts (static sizes) and full-iteration graphs do not wait."""
    # the ring-attention exchange belongs to the attention block: kept with it, a faster attention kernel that
    # hides less of it never lengthens the step (hypothesis found the case when it sat outside the cycle)
    g_f = lt.fwd_moe + lc.tp_moe + lc.ep_fwd + lc.cp_fwd
    h_f = w.host_moe
    g_p = w.attn_proj + w.attn_core + w.elem_attn + w.rope + lc.cp_fwd + compute.KERNELS_ATTN_BLOCK * e.kernel_overhead_s
    h_p = w.host_moe_pre
    cycle = jnp.maximum(h_f, jnp.maximum(h_f - h_p, g_f - g_p) + g_p) + w.host_op
    on = S.is_moe * (J["moe_capacity"] <= 0).astype(jnp.float32) * (1.0 - J["cg_iteration"])
    return MoeSync(on * cycle, on * g_f, on * h_f)


def _moe_shares(S, M, st):
    """(first stage, other stages) shares of MoE layers. Leading dense layers (DeepSeek's
    first_k_dense_replace) sit in the first stage's first chunk, not spread over all stages;
    interleaved dense/MoE patterns are spread evenly."""
    fm, dense_first = S.frac_moe, M["dense_first"]
    d1 = jnp.minimum(dense_first, st.first / S.vpp)
    fm1 = jnp.where(dense_first > 0, 1.0 - d1 / st.first, fm)
    # MTP layers (of the last layer's kind) count with the ranks after the first
    rest = jnp.maximum(M["layers"] + M["mtp_layers"] - st.first, 1.0)
    fm_rest = jnp.clip((M["moe_layers"] + M["mtp_layers"] * M["mtp_moe"] - (st.first - d1)) / rest, 0.0, 1.0)
    return fm1, jnp.where((dense_first > 0) & (S.pp > 1), fm_rest, fm)


def _gpu(st: dict):
    return st["compute"] + st["recompute"] + st["offload"] + st["tp"] + st["cp"] + st["ep"]


def _total(st: dict):
    """A stage's micro-batch: an eager framework's host issues the kernels asynchronously, so the
    GPU's work hides the host's dispatch time, and the GPU waits when the host is slower (small
    layers, many kernels: the reason for CUDA graphs)."""
    # a dropless MoE layer's forward waits on the host for its token counts: its ops after the wait run as a
    # cycle of their own, the rest of the micro-batch as before
    return st["sync_cycle"] + jnp.maximum(_gpu(st) - st["sync_gpu"], st["host"] - st["sync_host"])


def evaluate(plans: dict, model: dict, hw: dict, job: dict, e: EfficiencyParams) -> Prediction:
    """Score a batch of plans (times in s per step, memory in bytes per GPU)."""
    P = {k: jnp.asarray(v, dtype=jnp.float32) for k, v in plans.items()}
    M, H, J = model, hw, job
    S = compute.shapes(P, M, J, e)

    # ---- one layer: compute, communication, recomputation ----
    w = compute.layer_work(S, M, H, J, e)
    lt = compute.layer_times(w, e)
    lc = comm.layer_comm(S, w, lt, M, H, J, e)
    head = compute.head_work(S, M, H, J, e)
    sync = moe_host_sync(S, w, lt, lc, J, e)

    # ---- pipeline stages: first, middle, last (the first with its own share of MoE layers) ----
    st = pipeline.stages(S, P, M)
    fm1, fm_rest = _moe_shares(S, M, st)
    whole = S                                            # the model's average, for FLOPs
    S1, S = S._replace(frac_moe=fm1), S._replace(frac_moe=fm_rest)
    n_rec = [pipeline.recomputed_layers(S, P, n) for n in (st.first, st.mid, st.last)]

    def offload(Sx, n, fwd, bwd):
        return memory.offload_copy_s(Sx, M, H, J, e, n, fwd, bwd)
    first = _stage_time(S1, st.first, n_rec[0], 1.0, st.single, w, lt, lc, head, sync, offload)
    mid = _stage_time(S, st.mid, n_rec[1], 0.0, 0.0, w, lt, lc, head, sync, offload)
    last = _stage_time(S, st.last, n_rec[2], st.single, 1.0, w, lt, lc, head, sync, offload)
    t_first, t_mid, t_last = _total(first), _total(mid), _total(last)
    slowest = pipeline.largest(t_first, t_mid, t_last, st.has_mid)
    t_max = slowest.pick(t_first, t_mid, t_last)
    bubble = pipeline.bubble_s(S, t_first, t_mid, t_last, slowest)
    pp_comm = comm.pipeline_p2p_s(S, M, H, t_max, e)

    # ---- parameters per stage; data parallelism and the optimizer of the biggest one ----
    params = [memory.stage_params(Sx, M, n, ends, mtp) for Sx, n, ends, mtp in ((S1, st.first, 1.0, st.single),
                                                                                (S, st.mid, 0.0, 0.0),
                                                                                (S, st.last, 1.0, 1.0))]
    biggest = pipeline.largest(*(p.dense + p.expert for p in params), st.has_mid)
    # what gets gradients (with LoRA the adapters only; the base is frozen: memory.trainable_params)
    trained = [memory.trainable_params(Sx, M, J, n, p) for Sx, n, p in zip((S1, S, S), (st.first, st.mid, st.last),
                                                                          params)]
    p_dense = biggest.pick(*(p.dense for p in trained))
    p_expert = biggest.pick(*(p.expert for p in trained))
    # FSDP also gathers the frozen weights
    frozen = J["lora"] * (biggest.pick(*(p.dense for p in params)) + biggest.pick(*(p.expert for p in params)))
    groups = comm.dp_groups(S)
    layers_s = slowest.pick(t_first - first["ends"], t_mid, t_last - last["ends"])
    # the GPU's idle time in a host-bound micro-batch, and the time its passes wait on their own exposed
    # TP / CP / EP collectives, are wall time the bucketed gradient / parameter traffic can run under too
    idle = t_max - slowest.pick(_gpu(first), _gpu(mid), _gpu(last))
    waits = slowest.pick(*(x["tp"] + x["cp"] + x["ep"] for x in (first, mid, last)))
    # DeepSpeed's pipeline engine reduces gradients (and ZeRO-1 gathers parameters) only after the schedule's
    # last backward (runtime/pipe/schedule.py TrainSchedule: ReduceTiedGrads, ReduceGrads, OptimizerStep
    # after the final micro-batch): none of that traffic hides under the passes
    dp_hides = 1.0 - J["deepspeed"] * (S.pp > 1.0)
    dp_comm = comm.data_parallel_s(S, groups, p_dense, p_expert, biggest.pick(st.first, st.mid, st.last), lt,
                                   layers_s, H, J["grad_bytes"], e, idle_s=idle + waits,
                                   grad_overlap=J["dp_grad_overlap"] * dp_hides,
                                   param_overlap=J["dp_param_overlap"] * dp_hides,
                                   deepspeed_zero3=J["deepspeed"], param_bytes=J["primary_weight_bytes"],
                                   frozen_params=frozen)
    # the optimizer step is memory bound: bytes moved per local parameter (sharded with ZeRO >= 1)
    p_opt = memory.sharded(memory.StageParams(p_dense, p_expert), groups, S.zero >= 1)
    t_opt = p_opt * memory.OPTIMIZER_STEP_BYTES / (H["hbm_bw"] * e.hbm_eff)

    # without gradient-accumulation fusion each micro-batch's weight gradients are written, then added into
    # the main gradients by their own kernel (2021 LocalDDP's hook: main_grad.add_(grad)): a read of the new
    # gradient and a read + write of the main one per local parameter; fused, the wgrad GEMM's epilogue does it
    # (with ZeRO-2/3 each micro-batch's gradients are reduce-scattered first: only the local shard is accumulated)
    p_acc = memory.sharded(memory.StageParams(p_dense, p_expert), groups, S.zero >= 2)
    t_acc = (1.0 - J["grad_acc_fusion"]) * p_acc * (J["weight_bytes"] + 2.0 * J["grad_bytes"]) \
        / (H["hbm_bw"] * e.hbm_eff)

    # ---- the step ----
    m = S.micro_batches
    # an eager framework's per-step and per-micro-batch host work (an XLA-compiled step has none)
    overhead = (e.step_overhead_s + m * e.microbatch_overhead_s) * (1.0 - J["compiled_step"])
    step = m * (t_max + t_acc) + bubble + pp_comm + dp_comm + t_opt + overhead
    time = StepTime(compute=m * (slowest.pick(first["compute"], mid["compute"], last["compute"]) + t_acc),
                    recompute=m * slowest.pick(first["recompute"], mid["recompute"], last["recompute"]),
                    offload=m * slowest.pick(first["offload"], mid["offload"], last["offload"]),
                    tp_comm=m * slowest.pick(first["tp"], mid["tp"], last["tp"]),
                    cp_comm=m * slowest.pick(first["cp"], mid["cp"], last["cp"]),
                    ep_comm=m * slowest.pick(first["ep"], mid["ep"], last["ep"]),
                    pp_comm=pp_comm, dp_comm=dp_comm, bubble=bubble, optimizer=t_opt,
                    host_wait=m * idle, overhead=overhead)

    # ---- FLOPs ----
    n_mid_all = jnp.maximum(S.pp - 2.0, 0.0)
    rf_share = jnp.where(S.pp > 1, (n_rec[0] + n_mid_all * n_rec[1] + n_rec[2]) / (st.first + n_mid_all * st.mid + st.last),
                         n_rec[0] / st.first)
    model_flops, hw_flops = step_flops(whole, M, J, rf_share)

    # ---- memory on the first, second and last pipeline ranks; the peak is the largest ----
    ranks = [memory.rank_memory(Sx, M, J, e, groups, n, nr, p, rank, logits, memory.activation_bytes(Sx, M, J, e))
             for Sx, n, nr, p, rank, logits in ((S1, st.first, n_rec[0], params[0], 0.0, st.single),
                                                (S, st.mid, n_rec[1], params[1], 1.0, 0.0),
                                                (S, st.last, n_rec[2], params[2], S.pp - 1.0, 1.0))]
    peak = pipeline.largest(*(r.total for r in ranks), st.has_mid)
    mem = Memory(*(peak.pick(*parts) for parts in zip(*ranks)))

    tokens = J["global_batch"] * J["seq_len"]
    pred = Prediction(step_time_s=step, tokens_per_s=tokens / step, model_flops=model_flops, hw_flops=hw_flops,
                      num_gpus=S.tp * S.pp * S.dp * S.cp, micro_batches=m, time=time, memory=mem,
                      memory_limit_bytes=J["memory_limit"])
    return broadcast(pred, step.shape)


#: the jitted scorer: one compiled function for every model, cluster and job of the same shapes
evaluate_jit = jax.jit(evaluate)


def _summary(plans, model, hw, job, e):
    out = evaluate(plans, model, hw, job, e)
    return out.step_time_s, out.memory.total


#: step time and peak memory only (the search's hot path)
summary_jit = jax.jit(_summary)
