"""Specs -> dicts of float arrays, the cost model's traced inputs.

Model, cluster and job enter the jitted scorer as arrays (not static Python values) so that one
compiled function serves every model and cluster, and so that a batch of runs (validation,
calibration) can be scored in one call by giving them a leading axis.
"""
from __future__ import annotations

import numpy as np

from . import compute, memory
from .specs import (ClusterSpec, CudaGraphImpl, CudaGraphModule, DispatcherType, Fp8Recipe, Framework, FrameworkSpec,
                    JobSpec, LoraModule, ModelSpec, PipelineSchedule, Precision)


def encode_model(m: ModelSpec) -> dict:
    h, a, g = m.hidden_size, m.num_attention_heads, m.num_kv_heads
    d = m.head_dim_eff
    if m.is_mla:
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        dv = m.v_head_dim
        # Megatron MLA GEMMs (DeepSeek-V2 sec. 2.1): q down/up, kv down (latent + rope key), kv up, out.
        q_down_n = m.q_lora_rank
        q_up_n, q_up_k = a * qk, (m.q_lora_rank or h)
        kv_down_n = m.kv_lora_rank + m.qk_rope_head_dim
        kv_up_n, kv_up_k = a * (m.qk_nope_head_dim + dv), m.kv_lora_rank
        attn_q_heads_dim, attn_v_dim, kv_heads = qk, dv, a
        # activations kept per token (elements): latents, q, k, v (expanded per head)
        attn_act_sharded = a * qk * 2 + a * dv
        attn_act_repl = m.q_lora_rank + kv_down_n
        kv_exchange_elems = a * (qk + dv)        # CP ring passes expanded K and V
    else:
        q_down_n = 0
        q_up_n, q_up_k = (a + 2 * g) * d, h       # fused QKV projection
        kv_down_n, kv_up_n, kv_up_k = 0, 0, 0
        attn_q_heads_dim, attn_v_dim, kv_heads = d, d, g
        attn_act_sharded = (a + 2 * g) * d        # Q, K, V kept for attention backward
        attn_act_repl = 0
        kv_exchange_elems = 2 * g * d
    pc = m.param_counts()
    n_moe = m.num_moe_layers
    shared_ffn = m.num_shared_experts * (m.shared_expert_ffn_hidden_size or m.moe_ffn_hidden_size)
    vals = dict(
        layers=m.num_layers, moe_layers=n_moe,
        # leading dense layers that sit together on the first stage (DeepSeek's first_k_dense_replace)
        dense_first=m.first_k_dense_layers if m.is_moe and m.moe_layer_freq == 1 else 0, hidden=h, heads=a, kv_heads=kv_heads,
        qk_head_dim=attn_q_heads_dim, v_head_dim=attn_v_dim,
        window=m.sliding_window, window_layer_frac=m.num_sliding_window_layers / m.num_layers,
        # elements per token RoPE rotates (all query and key heads; MLA: the decoupled rope parts), and whether
        # Megatron must run it unfused (fused RoPE takes plain "rope" only: Megatron-Bridge's
        # validate_rope_fusion_compatibility; Megatron-LM's GPT-OSS example passes --no-rope-fusion)
        rope_elems=(a * m.qk_rope_head_dim + m.qk_rope_head_dim) if m.is_mla else (a + g) * d,
        rope_unfused=float(rope_runs_unfused(m)),
        expert_bias=float(m.expert_bias and m.is_moe),  # fc2's bias added expert by expert (compute.EXPERT_BIAS_*)
        ffn=m.ffn_hidden_size, vocab=m.vocab_size, gated=float(m.gated_mlp),
        tied=float(m.tied_embeddings),
        q_down_n=q_down_n, q_up_n=q_up_n, q_up_k=q_up_k, kv_down_n=kv_down_n, kv_up_n=kv_up_n,
        kv_up_k=kv_up_k, attn_out_k=a * attn_v_dim,
        attn_act_sharded=attn_act_sharded, attn_act_repl=attn_act_repl,
        hidden_dropout=m.hidden_dropout,
        kv_exchange_elems=kv_exchange_elems,
        attn_params=m.attention_params(),
        dense_mlp_params=m.mlp_params(m.ffn_hidden_size),
        experts=m.num_experts, top_k=m.experts_per_token, expert_ffn=m.moe_ffn_hidden_size,
        expert_params=m.mlp_params(m.moe_ffn_hidden_size) if m.is_moe else 0,
        shared_ffn=shared_ffn, router_params=h * m.num_experts,
        total_params=pc["total"], active_params=pc["active"],
        # multi-token prediction: modules after the last layer, each a layer of its kind (MoE or dense)
        mtp_layers=m.mtp_num_layers, mtp_moe=float(m.mtp_layer_is_moe),
    )
    return {k: np.float32(v) for k, v in vals.items()}


def encode_cluster(c: ClusterSpec) -> dict:
    gps = c.gpus_per_site
    vals = dict(
        num_gpus=c.num_gpus, domain=c.nvlink_domain_size, site=gps, sites=c.num_sites,
        intra_bw=c.intra_node_bw_bytes_per_s,
        intra_p2p_bw=c.intra_node_bw_bytes_per_s * c.gpu.p2p_bw_bytes_per_s / c.gpu.intra_node_bw_bytes_per_s,
        inter_bw=c.inter_node_bw_bytes_per_s * c.fabric_bw_factor,
        wan_bw=c.wan_bw_bytes_per_s if c.num_sites > 1 else 1e30,
        intra_lat=c.intra_node_latency_s, inter_lat=c.inter_node_latency_s,
        wan_lat=c.wan_latency_s if c.num_sites > 1 else c.inter_node_latency_s,
        hbm_bytes=c.gpu.hbm_bytes, hbm_bw=c.gpu.hbm_bandwidth_bytes_per_s,
        peak_bf16=c.gpu.peak_flops_bf16,
        matmul_frac_bf16=c.gpu.matmul_frac_bf16,   # MAMF / peak: unfused attention's batched GEMMs
        sm_cycles=c.gpu.sm_cycles_per_s,            # SMs x clock: fused attention's exponentials and shared memory
        exp_x=c.gpu.exp_throughput_x,               # softmax exponential rate (2: Blackwell Ultra)
        host_bw=c.gpu.host_link_bw_bytes_per_s,     # to host memory, per direction (CPU offloading's copies)
        host_op_x=c.gpu.host_op_x,                  # the host CPU's time per framework op (Grace: 2.75)
    )
    return {k: np.float32(v) for k, v in vals.items()}


def cuda_graph_capture(fw: FrameworkSpec) -> dict:
    """Which regions of a layer the job's CUDA graphs replay (1) instead of the host issuing their kernels
    one by one (0): Megatron-Core transformer_layer.py _get_submodules_under_cudagraphs and
    _te_cuda_graph_capture. Without modules a per-layer impl captures the whole layer; a dropless MoE
    layer's dispatch cannot be captured (its token counts go to the host: moe_utils.py
    maybe_skip_or_early_return_by_cudagraph), so whole-layer capture of an MoE layer covers the router and
    the preprocess (token_dispatcher.py moves the host copy past the preprocess, as for moe_preprocess),
    the whole MoE block only with drop-and-pad experts. The local impl captures moe_router and
    moe_preprocess together (transformer_config.py: "local impl doesn't distinguish")."""
    per_layer = fw.cuda_graph_impl.per_layer
    mods = set(fw.cuda_graph_modules)
    whole = per_layer and not mods
    local = fw.cuda_graph_impl is CudaGraphImpl.LOCAL
    router = CudaGraphModule.MOE_ROUTER in mods or (local and CudaGraphModule.MOE_PREPROCESS in mods)
    preprocess = CudaGraphModule.MOE_PREPROCESS in mods or (local and CudaGraphModule.MOE_ROUTER in mods)
    padded = fw.moe_expert_capacity_factor > 0
    vals = dict(
        cg_whole=whole,
        cg_attn=whole or CudaGraphModule.ATTN in mods,
        cg_mlp=whole or CudaGraphModule.MLP in mods,
        cg_moe=(whole and padded) or CudaGraphModule.MOE in mods,
        cg_router=whole or router,
        cg_preprocess=whole or preprocess,
        # an XLA-compiled step (Framework.JAX) launches no kernel from the host either
        cg_iteration=fw.cuda_graph_impl is CudaGraphImpl.FULL_ITERATION or fw.framework is Framework.JAX,
    )
    return {k: float(v) for k, v in vals.items()}


def lora_targets(fw: FrameworkSpec) -> dict:
    """0/1 per linear with a LoRA adapter (FrameworkSpec.lora_target_modules; all 0 without LoRA)."""
    on = fw.lora_dim > 0
    mods = set(fw.lora_target_modules)
    return {f"lora_{m.value.removeprefix('linear_')}": float(on and m in mods) for m in LoraModule}


def rope_runs_unfused(m: ModelSpec) -> bool:
    """Megatron's fused RoPE takes position_embedding "rope" only; YaRN as its own type runs as PyTorch ops
    (an XLA-compiled step fuses them anyway: compute.unfused_rope)."""
    return m.position_embedding == "yarn"


def cross_entropy_kind(fw: FrameworkSpec) -> str:
    """The cross entropy the framework runs (a key of compute.LOSS_BYTES_PER_LOGIT): Megatron-Core's
    --cross-entropy-loss-fusion / --cross-entropy-fusion-impl; Megatron-DeepSpeed has only the unfused
    one; an XLA-compiled step fuses its own."""
    if fw.framework is Framework.JAX:
        return "xla"
    if fw.framework is Framework.MEGATRON and fw.cross_entropy_loss_fusion:
        return fw.cross_entropy_fusion_impl.value
    return "unfused"


def encode_job(j: JobSpec, c: ClusterSpec, memory_limit_bytes: float | None = None) -> dict:
    prec = j.precision
    peak = c.gpu.peak_flops(prec)
    loss = cross_entropy_kind(j.framework)
    weight_bytes = 4.0 if prec is Precision.FP32 else 2.0     # fp32 without mixed precision, else bf16 / fp16
    vals = dict(
        global_batch=j.global_batch, seq_len=j.seq_len,
        peak_gemm=peak if peak > 0 else c.gpu.peak_flops_bf16,     # the datasheet peak (MFU is against it)
        # GEMMs run against the GPU's maximum achievable matmul rate (MAMF), a fraction of that peak
        matmul_frac=c.gpu.matmul_frac(prec) if peak > 0 else c.gpu.matmul_frac_bf16,
        gemm_bytes={Precision.FP8: 1.0, Precision.FP4: 0.5, Precision.FP32: 4.0}.get(prec, 2.0),
        # activations and weights in fp32 without mixed precision, else bf16 / fp16
        act_bytes=4.0 if prec is Precision.FP32 else 2.0,
        weight_bytes=weight_bytes,
        # Adam state per parameter: fp32 master + momentum + variance (12) under mixed precision; in fp32
        # training the weights are the master, only momentum + variance (8) (Megatron FP32Optimizer)
        optimizer_bytes=8.0 if prec is Precision.FP32 else 12.0,
        low_precision=float(prec in (Precision.FP8, Precision.FP4)),
        # --fp8-recipe tensorwise measures each tensor's amax in a pass of its own before the cast
        fp8_amax_pass=float(j.fp8_recipe is Fp8Recipe.TENSORWISE),
        flash=float(j.flash_attention),
        # the fused kernel's rate against the one attn_eff_max stands for (FlashAttention-2 on Hopper+: 0.61)
        attn_rate_x=compute.attention_kernel_rate(j.attention_kernel(c.gpu), c.gpu.family),
        # --fp8-dot-product-attention: cuDNN's fused attention in fp8 (compute.attention_core_fwd_bwd_s)
        fp8_attention=float(j.fp8_attention),
        # Megatron's fused scale-mask-softmax: the job's shape rules (fp16/bf16 scores, 16 < sk <= 4096, sq and
        # sk multiples of 4) and the kernel's batches per block, 8 for sk <= 128 (two rows per warp), else 4;
        # the plan's micro-batch x heads per rank decides the rest (compute.softmax_fallback)
        softmax_kernel_ok=float(prec is not Precision.FP32 and 16 < j.seq_len <= 4096 and j.seq_len % 4 == 0),
        softmax_batch_block=8.0 if j.seq_len <= 128 else 4.0,
        tp_overlap=float(j.tp_comm_overlap),
        grad_bytes=j.framework.grad_bytes_per_param,
        # --overlap-grad-reduce / --overlap-param-gather (the second needs the first: Megatron asserts it)
        dp_grad_overlap=float(j.framework.overlap_grad_reduce),
        dp_param_overlap=float(j.framework.overlap_param_gather and j.framework.overlap_grad_reduce),
        grad_acc_fusion=float(j.framework.gradient_accumulation_fusion),
        tp_async=float(j.framework.async_tensor_model_parallel_allreduce),
        gpipe=float(j.framework.pipeline_schedule is PipelineSchedule.GPIPE),
        deepspeed=float(j.framework.framework is Framework.DEEPSPEED),
        compiled_step=float(j.framework.framework is Framework.JAX),
        mb_grad_buffer=float(j.framework.microbatch_grad_buffer),
        moe_capacity=float(j.framework.moe_expert_capacity_factor),
        # the primary weights' bytes, which ZeRO-1 / FSDP all-gather (fp8 / NVFP4 with --fp8-param-gather)
        primary_weight_bytes=memory.primary_weight_bytes(prec, weight_bytes, j.framework.fp8_param_gather),
        ep_a2a_overlap=float(j.framework.overlap_moe_expert_parallel_comm),
        permute_fusion=float(j.framework.moe_permute_fusion),
        loss_bytes=compute.LOSS_BYTES_PER_LOGIT[loss],
        # TE's fused cross entropy writes the gradient into the bf16 logits: no fp32 copy is kept
        logits_fp32_copy=float(loss != "te"),
        flex_dispatch=float(j.framework.moe_token_dispatcher_type is DispatcherType.FLEX),
        # LoRA fine-tuning (FrameworkSpec.lora_dim): 1 when the base weights are frozen, and the adapters' rank
        lora=float(j.framework.lora_dim > 0), lora_dim=float(j.framework.lora_dim),
        **lora_targets(j.framework),
        # sequence packing: the mean example length attention stays inside (0: the whole sequence)
        packed_tokens=float(j.framework.packed_example_tokens),
        allgather_dispatch=float(j.framework.moe_token_dispatcher_type is DispatcherType.ALLGATHER),
        # --cpu-offloading-num-layers: layers whose activations go to host memory between forward and backward
        offload_layers=float(j.framework.cpu_offloading_num_layers),
        memory_limit=memory_limit_bytes if memory_limit_bytes else c.gpu.hbm_bytes,
        **cuda_graph_capture(j.framework),     # 0/1 per captured region (costmodels/compute.py host_kernels)
    )
    return {k: np.float32(v) for k, v in vals.items()}


def stack_inputs(dicts: list[dict]) -> dict:
    """Stack per-run input dicts into one dict of [K] arrays (for batched validation/calibration)."""
    return {k: np.array([d[k] for d in dicts], dtype=np.float32) for k in dicts[0]}
