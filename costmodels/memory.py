"""Peak memory per GPU: parameters, gradients and optimizer states by ZeRO stage, activations of
the in-flight micro-batches, logits, communication buffers, fragmentation and fixed overhead.

Symbols as in compute.py; n layers of a pipeline rank, pd / pe its dense / expert parameters.

Sources
  [Z20] Rajbhandari et al. 2020 (ZeRO), sec. 3: mixed-precision Adam keeps 2 (bf16 weights) + 2
        (gradients) + 12 (fp32 master, momentum, variance) bytes per parameter; stage 1 shards the
        12, stage 2 also the gradients, stage 3 also the weights.
  [MG]  Megatron-LM distributed optimizer: fp32 main gradients (4 bytes) unless reduced in bf16.
  [K22] Korthikanti et al. 2022, table 2: activation bytes per layer sbh(34 + 5as/h) split into
        replicated and TP-sharded parts; with SP the replicated part is sharded too; full
        recompute keeps 2sbh per layer.
  [AG]  PyTorch autograd (torch/csrc/autograd/engine.cpp, Node::release_variables) frees a node's
        saved tensors once its backward has run, and a gradient once its consumers have run: what a
        layer's backward holds at a given moment (Megatron's full recompute re-runs the layer's forward
        under autograd, then its backward).
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from .breakdown import Memory
from .communication import DataParallelGroups
from .compute import Shapes, local_experts, lora_attention_linears, lora_mlp_linears, moe_load
from .params import EfficiencyParams
from .pipeline import in_flight_micro_batches
from .specs import Precision

# optimizer state (12 bytes per parameter [Z20], 8 in fp32 training), weight (2, 4 in fp32) and activation
# bytes per element (2, 4 in fp32) come with the job: costmodels.encode.encode_job
#: HBM bytes the Adam step moves per local parameter: fp32 master, momentum, variance read and
#: written (24), the fp32 gradient read (4), the bf16 weight written (2) [Z20]
OPTIMIZER_STEP_BYTES = 30.0


class StageParams(NamedTuple):
    dense: object            # this rank's share of non-expert parameters
    expert: object           # this rank's share of expert parameters


def layer_params(M: dict):
    """(a dense layer's, an MoE layer's) parameters outside the routed experts: attention and the MLP, or attention,
    the shared experts and the router."""
    moe = M["attn_params"] + M["shared_ffn"] * M["hidden"] * (2.0 + M["gated"]) + M["router_params"]
    return M["attn_params"] + M["dense_mlp_params"], moe


def stage_params(S: Shapes, M: dict, n, holds_ends, holds_mtp=0.0) -> StageParams:
    """Parameters of a rank with n layers: layers / tp (experts / (ep*etp)), plus the embedding on
    the first rank and the output layer on the last (a copy when tied; one rank holds both when
    pp = 1, unless they are tied). The rank of the MTP modules (n counts their layers) adds their
    eh_proj (2h x h, column-parallel) and, apart from the first rank, an embedding of its own for the
    next tokens (Megatron-Core GPTModel builds one where mtp_process; tied, it is the output layer's)."""
    h, fm = M["hidden"], S.frac_moe
    dense_layer, moe_layer = layer_params(M)
    layer = (1.0 - fm) * dense_layer + fm * moe_layer
    single = (S.pp == 1).astype(jnp.float32)
    emb = M["vocab"] * h / S.tp * (1.0 + single * (1.0 - M["tied"]))
    mtp = holds_mtp * (M["mtp_layers"] * 2.0 * h * h / S.tp
                       + (M["mtp_layers"] > 0) * (1.0 - single) * (1.0 - M["tied"]) * M["vocab"] * h / S.tp)
    return StageParams(n * layer / S.tp + holds_ends * emb + mtp,
                       n * fm * M["experts"] * M["expert_params"] / (S.ep * S.etp))


def lora_params(S: Shapes, M: dict, J: dict, n) -> StageParams:
    """A rank's LoRA adapter parameters: r x (k + n) per target linear [LoRA], TP-sharded like the linear
    (compute.lora_s), routed experts' per expert like theirs."""
    r, fm = J["lora_dim"], S.frac_moe

    def widths(linears):
        return sum(J[key] * (k + n) for key, k, n, _ in linears)

    def mlp(f):
        return widths(lora_mlp_linears(M, f)) * (f > 0)

    attn = widths(lora_attention_linears(M))
    layer = attn + (1.0 - fm) * mlp(M["ffn"]) + fm * mlp(M["shared_ffn"])
    return StageParams(n * r * layer / S.tp, n * fm * M["experts"] * r * mlp(M["expert_ffn"]) / (S.ep * S.etp))


def trainable_params(S: Shapes, M: dict, J: dict, n, params: StageParams) -> StageParams:
    """The parameters that get gradients, optimizer states and gradient reduction: all of them, or with LoRA
    only the adapters (the base weights, embedding and output layer frozen)."""
    adapters = lora_params(S, M, J, n)
    on = J["lora"]
    return StageParams(jnp.where(on > 0, adapters.dense, params.dense), jnp.where(on > 0, adapters.expert, params.expert))


def sharded(x: StageParams, groups: DataParallelGroups, on):
    """Parameters' bytes-per-parameter share when a ZeRO stage shards them over data parallelism."""
    return (x.dense / jnp.where(on > 0, groups.dense, 1.0) + x.expert / jnp.where(on > 0, groups.expert, 1.0))


class ActivationBytes(NamedTuple):
    """Activation bytes of one layer per micro-batch (averaged over dense and MoE layers)."""
    none: object             # no recompute (with the s x s scores when attention is unfused)
    selective: object        # what the plan's --recompute-modules leave stored
    full: object             # only the layer input kept
    working: object          # one layer re-materialized during backward with full recompute
    backward: object         # that layer's gradients live beside it at the peak of its backward [AG]


#: bytes of a dropout mask element (Megatron keeps a uint8/bool mask per dropped element)
DROPOUT_MASK_BYTES = 1.0


def activation_bytes(S: Shapes, M: dict, J: dict, e: EfficiencyParams) -> ActivationBytes:
    """[K22 table 2] generalized to GQA, gated MLPs, MoE and MLA, per token of one layer:
    norm inputs (2h), GEMM inputs (QKV / fc1: the norm outputs, 2h; fc2: the activation output),
    Q, K, V and the attention output kept for the fused attention backward, the fc1 output, dropout
    masks where dropout is on, and with unfused attention the 5as/h score terms. Transformer Engine
    saves GEMM inputs already cast to fp8 / fp4 (gemm_bytes per element, 2 in bf16), and in
    low precision the output projection's input is a second, quantized copy of the attention output.
    With SP the replicated part is sharded over TP; MLA's latents come from a replicated (not TP-
    sharded) down-projection and stay whole. Recompute modules (Megatron-Core) drop what they replay:
    core_attn the scores, layernorm the norm outputs, mlp the dense MLP's fc1 and activation outputs,
    moe_act the experts' activation output, moe the whole MoE block, shared_experts their
    activations, mla_up_proj MLA's up-projected q, k, v."""
    T, tp, h = S.tokens, S.tp, M["hidden"]
    ACT_BYTES = J["act_bytes"]                                     # 2 (bf16 / fp16), 4 in fp32 training
    g, f, fe, sf = M["gated"], M["ffn"], M["expert_ffn"], M["shared_ffn"]
    fm, r, q = S.frac_moe, S.rec_mod, J["gemm_bytes"]
    lowp = J["low_precision"]
    rd = jnp.where(S.sp > 0, tp, 1.0)
    # replicated per token (divided by tp with SP)
    norm_in = 2.0 * h * ACT_BYTES
    norm_out = 2.0 * h * q                                         # saved as QKV / fc1 inputs
    dropout = jnp.where(M["hidden_dropout"] > 0, 2.0 * h * DROPOUT_MASK_BYTES, 0.0)
    latents = M["attn_act_repl"] * ACT_BYTES                       # MLA: not sharded by TP
    # TP-sharded per token
    qkv = M["attn_act_sharded"] * ACT_BYTES
    attn_out = M["heads"] * M["v_head_dim"] * (ACT_BYTES + lowp * q)
    # unfused attention's s x s tensors per token [K22 sec. 4.1]: the softmax output (2as bytes in bf16),
    # and with dropout its mask (as) and output (2as): 5as with dropout, 2as without (Llama-style
    # recipes; Megatron's --attention-dropout is taken to follow the model's dropout)
    drop_on = (M["hidden_dropout"] > 0).astype(jnp.float32)
    probs = (1.0 - J["flash"]) * J["seq_len"] * M["heads"] * ACT_BYTES
    attn_dropout = probs * drop_on * (DROPOUT_MASK_BYTES + ACT_BYTES) / ACT_BYTES
    scores = probs + attn_dropout
    fc1_out, act_out = f * (1.0 + g) * ACT_BYTES, f * q
    k_imb = M["top_k"] * moe_load(J, e)
    routed_in = k_imb * S.etp * h * q                              # permuted tokens: fc1 input
    routed_act = k_imb * (fe * (1.0 + g) * ACT_BYTES + fe * q)
    shared = sf * (1.0 + g) * ACT_BYTES + sf * q
    router = 2.0 * M["experts"] * ACT_BYTES
    moe = routed_in + routed_act + shared + router

    def per_token(keep_norm_out, keep_scores, keep_qkv, keep_mlp, moe_kept):
        repl = (norm_in + keep_norm_out * norm_out + dropout) / rd + latents
        attn = keep_qkv * qkv + attn_out + keep_scores * scores
        return repl + (attn + (1.0 - fm) * keep_mlp * (fc1_out + act_out) + fm * moe_kept) / tp

    none = T * per_token(1.0, 1.0, 1.0, 1.0, moe)
    qkv_kept = 1.0 - S.is_mla * r.mla_up_proj
    moe_kept = (1.0 - r.moe) * (moe - r.moe_act * k_imb * fe * q - r.shared_experts * shared)
    selective = T * per_token(1.0 - r.layernorm, 1.0 - r.core_attn, qkv_kept, 1.0 - r.mlp, moe_kept)
    full = T * h * ACT_BYTES / rd
    # the re-materialized layer's backward: its gradients beside it (fc1's output gradient, the unfused
    # softmax's input gradient) and what the backward has freed by the softmax (the MLP's saved tensors,
    # its norm's, the hidden and attention dropouts')
    d_fc1 = ((1.0 - fm) * f + fm * (k_imb * fe + sf)) * (1.0 + g) * ACT_BYTES
    freed = (0.5 * (norm_in + norm_out) + dropout) / rd + ((1.0 - fm) * (fc1_out + act_out) + fm * moe + attn_dropout) / tp
    backward = backward_peak_bytes_per_token(h * ACT_BYTES / rd, d_fc1 / tp, probs / tp, freed)
    return ActivationBytes(none, selective, full, S.rec_full * none, S.rec_full * T * backward)


def backward_peak_bytes_per_token(d_resid, d_fc1, d_probs, freed_by_softmax):
    """Gradient bytes per token live beside a re-materialized layer at the peak of its backward (autograd
    frees a node's saved tensors once its backward has run), the larger of two moments: the MLP
    activation's backward holds the residual stream's gradient d_resid and fc1's output gradient d_fc1
    (fc2's input is freed as its own gradient, the same size, is made); an unfused softmax's backward
    holds d_resid and the probabilities' gradient d_probs beside the saved softmax output, the tensors
    `freed_by_softmax` gone (the attention output is freed as its gradient is made)."""
    return jnp.maximum(d_resid + d_fc1, d_resid + d_probs - freed_by_softmax)


#: bytes per logit of the fp32 copy the cross-entropy computes in (Megatron's vocab-parallel cross
#: entropy casts the logits to fp32 and keeps the softmax, computed in place, for backward) [MG]
LOGITS_FP32_BYTES = 4.0
#: Transformer Engine's cached fp8 / fp4 copy of each weight (beside the bf16 primary weight)
LOW_PRECISION_WEIGHT_COPY_BYTES = 1.0
#: low-precision primary weights (Megatron's --fp8-param-gather / --fp4-param-gather): the bf16 weight is replaced
#: by its fp8 form, or its NVFP4 form: 4-bit values with an E4M3 scale per 16 (Transformer Engine NVFP4BlockScaling)
FP8_PRIMARY_WEIGHT_BYTES = 1.0
FP4_PRIMARY_WEIGHT_BYTES = 0.5 + 1.0 / 16.0


def primary_weight_bytes(precision: Precision, weight_bytes: float, low_precision_params: bool) -> float:
    """Bytes per parameter of the primary weights, which the distributed optimizer / FSDP also all-gathers."""
    if low_precision_params and precision is Precision.FP8:
        return FP8_PRIMARY_WEIGHT_BYTES
    if low_precision_params and precision is Precision.FP4:
        return FP4_PRIMARY_WEIGHT_BYTES
    return weight_bytes
#: CUDA context, NCCL and framework buffers, TE workspaces per GPU
FIXED_BYTES = 3.0e9


def logits_bytes(S: Shapes, M: dict, J: dict):
    """Logits kept for the loss on the last rank: bf16 logits + fp32 copy (6 bytes per element); in
    fp32 training the GEMM's output is already fp32 and no copy is made (4); Transformer Engine's fused
    cross entropy computes in registers and writes the gradient into the bf16 logits (2)."""
    copy = J["logits_fp32_copy"] * LOGITS_FP32_BYTES
    per_elem = jnp.where(J["act_bytes"] >= LOGITS_FP32_BYTES, LOGITS_FP32_BYTES, J["act_bytes"] + copy)
    return S.tokens * M["vocab"] / S.tp * per_elem


def tp_buffer_bytes(S: Shapes, M: dict, J: dict):
    """Gathered SP / TP communication buffers."""
    return jnp.where(S.tp > 1, 2.0 * S.tokens * M["hidden"] * J["act_bytes"], 0.0)


#: achieved share of the host link for activation copies from and to pinned host memory (cudaMemcpyAsync:
#: NVIDIA's bandwidthTest reaches ~26 of PCIe Gen4 x16's 32 GB/s and ~52 of Gen5's 64 per direction)
HOST_COPY_EFF = 0.8


def offloaded_layers(J: dict, n):
    """Layers of a rank whose activations are in host memory at the peak, with --cpu-offloading-num-layers N:
    Transformer Engine's offload handler frees a layer's saved tensors once their copy out has finished, which it
    waits for at the end of the next layer's forward, so one offloaded layer is still on the GPU (N - 1 are not)."""
    return jnp.clip(J["offload_layers"] - 1.0, 0.0, jnp.maximum(n - 1.0, 0.0))


def offload_copy_s(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams, n, fwd, bwd):
    """Exposed time per micro-batch of a rank's activation copies with --cpu-offloading-num-layers: each of the
    offloaded layers' saved tensors go to host memory while the next layer's forward runs and come back while the
    next layer's backward runs (prefetched one layer ahead), over the host link (PCIe, or NVLink-C2C on Grace
    superchips); a copy longer than that layer's work holds the compute stream for the rest. fwd / bwd: one
    layer's forward / backward time. Recomputation is off with offloading (Megatron-Core rule)."""
    n_off = jnp.minimum(J["offload_layers"], n)
    t_copy = activation_bytes(S, M, J, e).none / (H["host_bw"] * HOST_COPY_EFF)
    return n_off * (jnp.maximum(t_copy - fwd, 0.0) + jnp.maximum(t_copy - bwd, 0.0))


class Zero3Buffers(NamedTuple):
    params: object           # bytes of unsharded parameters live at once (two units)
    unit_grads: object       # bytes of one unit's unsharded gradients, before their reduce-scatter


def zero3_unit_bytes(S: Shapes, M: dict, J: dict) -> Zero3Buffers:
    """What ZeRO-3 / FSDP holds unsharded beside the shards.

    Megatron-FSDP gathers and reduce-scatters whole FSDP units, one per transformer layer (mcore_fsdp_adapter.py:
    fsdp_unit_modules = [TransformerLayer, MoETransformerLayer, MambaLayer] with data_parallel_sharding_strategy
    optim_grads_params), and prefetches the next unit while one computes: two layers' parameters live at once
    (the gathered dtype: bf16, or fp8 with --fp8-param-gather), and in the backward two layers' gradients before
    their reduce-scatter (the reduction dtype; rank_memory counts the second where it outgrows the activations
    its layer's backward freed). A layer is this rank's share of it: its attention and MLP / shared
    experts over tp, its routed experts over ep x etp; the larger of a dense and an MoE layer. An XLA-compiled
    step gathers per layer of its scan alike. DeepSpeed's stage 3 gathers module by module, prefetching the next
    (stage3_prefetch_bucket_size): two of the largest weight matrices, and its gradients reduce per module."""
    h, g, tp = M["hidden"], M["gated"], S.tp
    largest_matrix = jnp.maximum(jnp.maximum(M["ffn"], M["q_up_n"]) * h, M["expert_ffn"] * h * (1.0 + g)) / tp
    dense, moe = layer_params(M)
    moe = moe / tp + local_experts(S, M) * M["expert_params"] / S.etp
    fm = S.frac_moe
    layer = jnp.where(fm > 0, jnp.maximum(jnp.where(fm < 1, dense / tp, 0.0), moe), dense / tp)
    deepspeed = J["deepspeed"] > 0
    params = jnp.where(deepspeed, 2.0 * J["weight_bytes"] * largest_matrix, 2.0 * J["primary_weight_bytes"] * layer)
    unit_grads = jnp.where(deepspeed, 0.0, J["grad_bytes"] * layer * (1.0 - J["lora"]))
    return Zero3Buffers(params, unit_grads)


def rank_memory(S: Shapes, M: dict, J: dict, e: EfficiencyParams, groups: DataParallelGroups,
                n, n_recomputed, params: StageParams, rank, holds_logits, acts: ActivationBytes) -> Memory:
    """Memory of pipeline rank `rank` holding n layers (n_recomputed of them fully recomputed). With LoRA the
    frozen base keeps its weights only; gradients and optimizer states are the adapters' (trainable_params),
    whose weights come on top."""
    trained = trainable_params(S, M, J, n, params)
    adapters = J["lora"] * (trained.dense + trained.expert)
    z = S.zero
    z3 = (z == 3).astype(jnp.float32)
    wbytes = J["primary_weight_bytes"] + J["low_precision"] * LOW_PRECISION_WEIGHT_COPY_BYTES
    per_layer = jnp.where(S.rec_sel > 0, acts.selective, acts.none)
    act_stage = n_recomputed * acts.full + (n - n_recomputed - offloaded_layers(J, n)) * per_layer
    fsdp = zero3_unit_bytes(S, M, J)
    # the activation peak opens the backward: one unit's gradients are live there; the second appears one layer
    # later, once that layer's stored activations are freed, so it adds only what exceeds them
    freed = jnp.where(n_recomputed > 0, acts.full, per_layer)
    weights = (wbytes * sharded(params, groups, z >= 3) + z3 * fsdp.params + J["weight_bytes"] * adapters)
    gradients = (J["grad_bytes"] * sharded(trained, groups, z >= 2)
                 + z3 * (fsdp.unit_grads + jnp.maximum(fsdp.unit_grads - freed, 0.0)))
    # a backward pass's own gradient buffer (FrameworkSpec.microbatch_grad_buffer): beside an accumulator
    # (several micro-batches without a pipeline) or a ZeRO-2/3 shard; else it is the gradient itself
    own_buffer = ((S.micro_batches > 1) & (S.pp == 1)) | (z >= 2)
    gradients = gradients + J["mb_grad_buffer"] * own_buffer * J["weight_bytes"] * (trained.dense + trained.expert)
    optimizer = J["optimizer_bytes"] * sharded(trained, groups, z >= 1)
    in_flight = in_flight_micro_batches(S, rank, J["gpipe"])
    # the last rank keeps the logits of each micro-batch in flight: one with 1F1B, all m with GPipe
    logits_in_flight = jnp.where((J["gpipe"] > 0) & (S.pp > 1), in_flight, 1.0)
    # one micro-batch's logits are freed after the output layer's backward, before the backward reaches
    # the layers, so they are never live with a re-materialized layer and its gradients
    # each MTP module's loss keeps logits of its own until the backward [MC process_mtp_loss]
    logits = holds_logits * logits_bytes(S, M, J) * (1.0 + M["mtp_layers"])
    activations = act_stage * in_flight + (logits_in_flight - 1.0) * logits \
        + jnp.maximum(logits, acts.working + acts.backward)
    dynamic = weights + gradients + optimizer + activations + tp_buffer_bytes(S, M, J)
    total = dynamic * e.mem_fragmentation + FIXED_BYTES
    return Memory(weights, gradients, optimizer, activations, total - weights - gradients - optimizer - activations,
                  total)
