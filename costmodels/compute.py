"""Compute of one transformer layer per micro-batch on one GPU: GEMMs, attention, MoE, memory-bound
work and kernel launches. Pure, branch-free JAX over a batch of plans.

Symbols (per micro-batch, per GPU unless said otherwise)
  h hidden, a heads, f FFN hidden, V vocab, s sequence, b micro-batch, T = b*s/cp tokens on this
  context-parallel rank, T_elem the tokens of replicated (norm/residual) work (T/tp with SP),
  E experts, k experts per token, f_e expert FFN, f_s shared-expert FFN, m = B/(dp*b) micro-batches.

Sources
  [N21] Narayanan et al. 2021 (SC'21), appendix: GEMM FLOPs of a layer; sec. 3.2.
  [K22] Korthikanti et al. 2022, sec. 4.1: unfused attention stores and moves s x s scores.
  [FA]  Dao 2023, FlashAttention-2: causal attention does half the s^2 work; backward ~2.5x forward.
  [FA3] Shah et al. 2024, FlashAttention-3, Fig. 5: forward TFLOP/s on H100 by head dimension.
  [DS]  DeepSeek-V2 (2024) sec. 2.1: multi-head latent attention projections.
  [GS]  Lepikhin et al. 2020 (GShard) / Megatron-Core MoE: tokens dispatched k times; EP shards
        experts, ETP shards each expert's FFN.
  [TE]  Transformer Engine fp8: inputs of every GEMM are cast (and transposed for wgrad).
  [LoRA] Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", sec. 4.1: W0 frozen,
        h = W0 x + B A x with A [r x k], B [d x r]; no gradients or optimizer states for W0.
  [cuDNN9] NVIDIA, "Accelerating Transformers with NVIDIA cuDNN 9" (2024): SDPA in bf16 and fp8 on H100 / H200.
  [BWU]  NVIDIA technical blog, "Making Softmax More Efficient with NVIDIA Blackwell Ultra" (2026): MUFU.EX2
        ~2x on GB300 over GB200, DeepSeek-V3 fp8 attention forward ~1.35x; "Inside NVIDIA Blackwell Ultra"
        (2025): doubled special-function-unit throughput for attention.
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from .params import EfficiencyParams
from .plan import microbatch_group_size
from .specs import CUDNN_PREFERRED_FAMILIES, AttentionKernel

#: kernels an MoE layer launches beyond a dense one (Megatron-Core moe_layer.py route -> preprocess ->
#: dispatch -> combine), by the region a CUDA graph can capture (--cuda-graph-modules): the router
#: (GEMM, softmax, top-k, load-balancing loss), the dispatcher's preprocess (tokens per expert, split
#: sizes) and the dispatch / combine side ((un)permute, chunk sorts), which only `moe` captures
MOE_ROUTER_KERNELS = 4.0
MOE_PREPROCESS_KERNELS = 2.0
MOE_DISPATCH_KERNELS = 4.0
MOE_EXTRA_KERNELS = MOE_ROUTER_KERNELS + MOE_PREPROCESS_KERNELS + MOE_DISPATCH_KERNELS
#: kernels per local expert per forward: Transformer Engine's GroupedLinear runs fc1 and fc2 as one
#: GEMM per expert, plus the activation; in fp8 / fp4 each expert's input is also cast (2 more)
KERNELS_PER_LOCAL_EXPERT = 3.0
#: experts with biases (GPT-OSS): Megatron-Core's TEGroupedMLP applies fc1's bias inside Transformer Engine's
#: GroupedLinear but returns fc2's (skip_bias_add=True) and adds it in Python, expert by expert, weighted by the
#: routing probability: torch.cat([t + b * p for each local expert's rows]) (TEGroupedMLP._apply_bias,
#: megatron/core/transformer/moe/experts.py, core_v0.15.0-core_v0.17.0). Per local expert a multiply and an add
#: forward and, backward, two multiply + sum reductions (the bias's and the probability's gradients): 6 kernels,
#: 2 per forward-equivalent (the model's backward is 2x its forward)
EXPERT_BIAS_KERNELS_PER_LOCAL_EXPERT = (2.0 + 4.0) / 3.0
#: HBM bytes per routed token per hidden unit of that loop, counted op by op in bf16: forward b * p writes 2, the
#: add reads 2 + 2 and writes 2, the cat reads 2 and writes 2 (12); backward grad * p and grad * b read 2 and write
#: 2 each and their sums read 2 each, the split's backward cat reads 2 and writes 2 (16); per forward-equivalent
EXPERT_BIAS_BYTES_PER_H = (12.0 + 16.0) / 3.0
KERNELS_PER_LOCAL_EXPERT_LOW_PRECISION = 2.0
#: --fp8-recipe tensorwise (Float8CurrentScaling) scales each tensor by its own amax: Transformer Engine's
#: quantizer runs nvte_compute_amax (a read of the bf16 input, 2 B per element), nvte_compute_scale_from_amax,
#: then the cast (pytorch/csrc/quantizer.cpp, v2.7-v2.12), where delayed scaling, MXFP8 and blockwise
#: scaling compute their scales inside the one cast(-transpose) kernel: 2 more bytes per cast element and 2
#: more kernels per cast. A layer block's GEMMs each cast their input (attention: QKV and output
#: projection; MLP: fc1 and fc2; each expert its fc1 and fc2)
FP8_AMAX_PASS_BYTES = 2.0
FP8_AMAX_PASS_KERNELS_PER_CAST = 2.0
GEMMS_PER_BLOCK = 2.0
#: bytes per routed token per hidden unit for (un)permuting tokens: read + write, to and from the
#: expert order, bf16 (Megatron-Core moe_utils.permute / unpermute)
PERMUTE_BYTES_PER_H = 4.0 * 2.0
#: the alltoall dispatcher with more than one local expert also sorts the received tokens by local expert after
#: the all-to-all and restores their order before the combine's (Megatron-Core MoEAlltoAllTokenDispatcher:
#: sort_chunks_by_idxs in dispatch_postprocess and combine_preprocess; with token dropping the same copy as a
#: transpose().contiguous()), and the backward sorts the gradients back: four passes that each read and write
#: every routed token (bf16, 4 B per element), 16 B per routed token per hidden unit over forward + backward, a
#: third of it per forward-equivalent (the model's backward is 2x its forward). DeepEP / HybridEP (flex) receive
#: tokens in expert order; the sorts' kernels are among MOE_DISPATCH_KERNELS
SORT_CHUNKS_BYTES_PER_H = 4.0 * 4.0 / 3.0
#: the same without --moe-permute-fusion, per routed token per hidden unit per forward (the model's
#: backward is 2x forward, so a third of forward + backward): moe_utils.permute's index_select (4.7 B
#: measured) and unpermute's weight-multiply + zeros + scatter_add_ (29.7 B) forward, a gather (4.7 B)
#: and an atomic index_add_ (50.7 B) backward, measured on an H200 (tests/data/gpu/h200_microbench_moe.json,
#: medians over five MoE models' shapes; `python tests/gpu/compare_gpu.py`): (4.7+29.7+4.7+50.7)/3
UNFUSED_PERMUTE_BYTES_PER_H = 29.9
#: bytes per token per expert of the router: logits, softmax and top-k over E experts (fp32 read
#: and write), bf16 elements
ROUTER_BYTES_PER_EXPERT = 4.0 * 2.0
#: kernels a dense layer launches forward with Transformer Engine (norms, GEMMs, attention, rope,
#: activation, residuals, casts); backward launches about twice as many. Split by the block a CUDA
#: graph captures (transformer_layer.py _forward_attention / _forward_mlp): attention = input norm, QKV
#: GEMM, rope of q and of k, fused attention, output GEMM, bias-dropout-add, a cast; MLP = pre-MLP
#: norm, fc1, activation, fc2, bias-dropout-add, a cast
KERNELS_ATTN_BLOCK = 8.0
KERNELS_MLP_BLOCK = 6.0
KERNELS_PER_LAYER = KERNELS_ATTN_BLOCK + KERNELS_MLP_BLOCK
#: the pre-MLP norm, which a moe_router graph captures with the router
NORM_KERNELS = 1.0
#: unfused attention runs baddbmm (QK^T), scale-mask-softmax, dropout, bmm (PV) and the context's
#: permute copy where a fused kernel runs one [K22 sec. 4.1; Megatron-LM legacy CoreAttention]
UNFUSED_ATTENTION_EXTRA_KERNELS = 4.0
#: Megatron's FusedScaleMaskSoftmax runs its fused kernel only for fp16/bf16 scores with 16 < sk <= 4096,
#: sq and sk multiples of 4, and b x np (micro-batch x heads per TP rank) a multiple of the kernel's batches
#: per block (4 for sk > 128, 8 below; is_kernel_available / get_batch_per_block in
#: megatron/core/fusions/fused_softmax.py, the same in Megatron-DeepSpeed, apex and TE). Otherwise its
#: forward_torch_softmax runs: an fp32 cast, the scale, masked_fill_, softmax and the cast back, five kernels
#: for one, each reading and writing the score matrix (in fp32 under --attention-softmax-in-fp32, which
#: query-key layer scaling forces): forward 36 B per score against the fused kernel's 4, backward 40
#: against 6 (counted from the ops; autograd replays each op's backward)
SOFTMAX_FALLBACK_EXTRA_KERNELS = 4.0
SOFTMAX_FALLBACK_EXTRA_BYTES_FWD, SOFTMAX_FALLBACK_EXTRA_BYTES_BWD = 36.0 - 4.0, 40.0 - 6.0
#: Megatron's unfused core attention, backward bytes per score element against the forward's [K22 sec. 4.1;
#: Megatron-LM legacy CoreAttention]. Forward: baddbmm writes the scores (2 B), the fused softmax reads and
#: writes them (4), dropout reads, writes and keeps its mask (5), the PV bmm reads the probabilities (2): 13 B,
#: the softmax_bytes_per_score prior. Backward: the PV bmm writes the probabilities' gradient (2) and reads the
#: probabilities for dV (2), dropout's backward reads the gradient and its mask and writes (5), the softmax
#: backward reads the gradient and its output and writes (6), the QK^T bmm's two backward GEMMs read the
#: scores' gradient (2 + 2): 19 B. (Flash attention's attn_bwd_ratio, 2.5, counts a fused kernel that
#: recomputes the scores; here the backward is two batched GEMMs per forward GEMM and these bytes.)
UNFUSED_SOFTMAX_BWD_PER_FWD = 19.0 / 13.0
#: collectives a layer forward launches per parallelism: TP 2 all-reduces (SP: 2 all-gathers +
#: 2 reduce-scatters) [N21 sec. 2.3, K22 sec. 4.2.2]; EP a dispatch and a combine all-to-all [GS]
TP_COLLECTIVES_PER_LAYER = 2.0
EP_COLLECTIVES_PER_MOE_LAYER = 2.0
#: host time of a layer's backward per unit of its forward's: autograd's C++ engine issues about two
#: kernels per forward op (dgrad, wgrad) without the forward's Python module calls
HOST_BWD_PER_FWD = 1.0
#: activations move in bf16
ACT_BYTES = 2.0
#: Fused attention's work outside the tensor cores, which did not grow with them: "from the Hopper H100 to the
#: Blackwell B200, BF16 tensor core throughput increases from 1 to 2.25 PFLOPs, while both the SFU count and shared
#: memory bandwidth remains unchanged"; B200's forward is bound by the softmax's exponentials, its backward by
#: shared-memory traffic [FA4]. Exponentials per SM per clock of the special-function units (MUFU.EX2): 16 on
#: compute capability 8.0-10.x [CUDA C++ Programming Guide, arithmetic instruction throughput] (AMD CDNA3: a quarter
#: of 64 lanes). H100 SXM: 132 x 16 x 1.98 GHz = 4.2e12/s beside 989 TFLOP/s of bf16 MMA ("989 TFLOPS of FP16
#: matmul but only 3.9 TFLOPS of special functions" [FA3 sec. 3.1])
EXP_PER_SM_CLOCK = 16.0
#: shared-memory bytes per SM per clock: 128 on Ampere, Hopper and Blackwell [FA4]
SMEM_BYTES_PER_SM_CLOCK = 128.0
#: the fused backward's tile of scores: 64 query rows x 128 key columns (FlashAttention-2/3's backward kernels for
#: head dims 64-128)
FLASH_BWD_TILE_Q, FLASH_BWD_TILE_K = 64.0, 128.0
#: the fused backward's fixed cost per query row (attn_seq_half / 2 keys' worth in the forward) is 3x the forward's:
#: its preprocessing (the row sums of dO * O) and its dQ accumulation. Fitted apart on the lent H100 and H200 (cuDNN
#: 9.19, head dims 64 / 128, 1k-16k tokens, tests/data/gpu): forward 512, backward 1536 keys, rms log error 0.015 /
#: 0.027 (H100), 0.027 / 0.052 (H200), against 0.108 / 0.071 with one cost for both
ATTN_BWD_ROW_COST_X = 3.0
#: fp8 attention's MMAs run at twice bf16's rate (every Hopper / Blackwell datasheet: dense FP8 = 2 x BF16); its
#: exponentials do not, so on H100 at head dim 128 the forward gains (0.52 + 0.24) / (0.26 + 0.24) = 1.5x (ps per
#: score), cuDNN 9's and FlashAttention-3's published fp8 over bf16 forward (1.2 vs ~0.74-0.8 PFLOP/s [cuDNN9, FA3])
FP8_MMA_X = 2.0
#: RoPE as Megatron-Core runs it unfused (rope_utils._apply_rotary_pos_emb_bshd, per query or key tensor
#: of N elements, bf16): forward cos, sin, two mscale products and two casts of the small frequency table,
#: then t*cos (read N, write N), the rotate-half's neg (N/2, N/2) and cat (N, N), *sin (N, N), the add
#: (2N, N) and the closing cat (N, N): 12 kernels, 24N bytes, against the fused kernel's 1 and 4N;
#: backward (autograd): two products (N, N each), the neg, the chunk's cat, the two paths' sum (2N, N) and
#: the slice's zeros + copy: 7 kernels, 26N bytes, against 1 and 4N. Extra per layer (query and key):
#: 22 + 12 launches and (20 + 22) bytes per rotated element. The layer's backward is costed as twice its
#: forward on the GPU and once on the host, so the constants are the forward equivalents of those totals
ROPE_UNFUSED_EXTRA_BYTES = (20.0 + 22.0) / 3.0
ROPE_UNFUSED_EXTRA_LAUNCHES = (22.0 + 12.0) / 2.0
#: FlashAttention-2's rate against cuDNN's fused attention on Hopper, forward + backward, causal, bf16: measured on an
#: H100 and an H200 (PyTorch 2.11's flash backend, FA2's kernels, against cuDNN 9.19; head dim 64 and 128, sequences
#: 1024-16384, 20 shapes: 0.54-0.69, geometric mean 0.61; tests/data/gpu/*_microbench.json, tests/test_attention_kernel.py).
#: FA2 issues Ampere's mma.sync, not Hopper's wgmma, and reaches ~35 % of H100's peak [FA3 sec. 1]. No Blackwell
#: figure is measured; FA2 has no Blackwell tensor-core path either, so the Hopper ratio stands for both. The fitted
#: fused-attention efficiency (attn_eff_max) is cuDNN's on Hopper / Blackwell and FlashAttention-2's on Ampere
FLASH_ATTN_2_RATE_ON_HOPPER_PLUS = 0.61


def attention_kernel_rate(kernel: AttentionKernel, gpu_family: str) -> float:
    """A fused attention kernel's rate relative to the one attn_eff_max stands for on the GPU family: Transformer
    Engine's default choice there (AttentionBackend.kernel with auto)."""
    if kernel is AttentionKernel.FLASH_ATTN_2 and gpu_family in CUDNN_PREFERRED_FAMILIES:
        return FLASH_ATTN_2_RATE_ON_HOPPER_PLUS
    return 1.0


#: elements per token Transformer Engine's fp8 attention casts to fp8, relative to the layer's: forward Q, K, V;
#: backward O and dO (DotProductAttention with fp8_dpa and not fp8_mha), each at lp_cast_bytes; the layer's
#: backward elementwise work is costed as twice its forward, so the charge sits in the forward as a third
FP8_ATTENTION_CASTS_PER_FWD = 1.0 / 3.0
#: kernels one LoRA adapter launches per forward: its down (A) and up (B) GEMMs and the add of its output
#: into the frozen linear's (Megatron-Bridge peft/lora.py LoRALinear: linear_output + adapter_output)
LORA_KERNELS_PER_ADAPTER = 3.0
#: HBM bytes per output element (in units of the activation dtype) of that add: read both, write one
LORA_ADD_BYTES_PER_ELEM = 3.0
#: keys per tile of the fused attention kernels: FlashAttention-2 picks key blocks of 64 or 128 by head
#: dimension [FA, sec. 3.3], FlashAttention-3 128 [FA3]; a sliding window's first and last key blocks
#: are computed whole and masked
FLASH_KEY_BLOCK = 128.0


def moe_load(J: dict, e: EfficiencyParams):
    """Routed token copies per token and expert choice on the busiest rank: the routing imbalance when
    dropless; with experts padded to capacity (Megatron --moe-expert-capacity-factor F
    --moe-pad-expert-input-to-capacity) every expert computes F x its mean share, filled or not."""
    return jnp.where(J["moe_capacity"] > 0, J["moe_capacity"], e.moe_imbalance)


def saturate(x, half):
    """Saturating efficiency x/(x+half): 0 for tiny dims, -> 1 for large ones."""
    return x / (x + half)


def gemm_s(m, n, k, peak, elem_bytes, hbm_bw, eff_max, e: EfficiencyParams, groups=1.0):
    """One GEMM [m x k] @ [k x n]: roofline of compute at a size-dependent efficiency and HBM traffic. With
    `groups`, one grouped GEMM over that many [m x k] @ [k x n] problems, each with its own weights
    (Transformer Engine's GroupedLinear over the local experts, Megatron-Core --moe-grouped-gemm): its tiles
    fill the GPU together, so the row dimension saturates on all groups' rows (groups x m), and it reads
    every group's weights."""
    flops = 2.0 * groups * m * n * k
    eff = eff_max * saturate(groups * m, e.gemm_dim_half) * saturate(n, e.gemm_dim_half) * saturate(k, e.gemm_dim_half)
    t_compute = flops / (peak * jnp.maximum(eff, 1e-6))
    t_memory = groups * (elem_bytes * (m * k + k * n) + 2.0 * m * n) / (hbm_bw * e.hbm_eff)
    return jnp.where(flops > 0, jnp.maximum(t_compute, t_memory), 0.0)


class RecomputeModules(NamedTuple):
    """Megatron-Core --recompute-modules of a selective plan, one 0/1 array each (0 unless
    recompute=selective); the order is costmodels.plan.RECOMPUTE_MODULES."""
    core_attn: object
    layernorm: object
    mlp: object
    moe_act: object
    moe: object
    shared_experts: object
    mla_up_proj: object


def recompute_modules(P: dict) -> RecomputeModules:
    """Bits of the plan's module mask; selective without modules is Megatron's default, core_attn."""
    sel = (P["recompute"] == 1).astype(jnp.float32)
    mask = jnp.where(P["recompute_modules"] > 0, P["recompute_modules"], 1.0)
    bits = [jnp.floor(mask / 2.0 ** i) % 2.0 for i in range(len(RecomputeModules._fields))]
    return RecomputeModules(*(sel * b for b in bits))


class Shapes(NamedTuple):
    """Per-plan quantities every term reads (arrays over candidates)."""
    tp: object
    pp: object
    dp: object
    cp: object
    ep: object
    etp: object
    vpp: object
    mbs: object
    sp: object
    zero: object
    rec_sel: object          # 1 with selective recompute
    rec_full: object         # 1 with full recompute
    rec_mod: RecomputeModules  # which modules selective recompute replays
    micro_batches: object    # m = B / (dp * b)
    mb_group: object         # micro-batches per virtual-stage group when interleaved (plan.microbatch_group_size)
    tokens: object           # T = b * s / cp
    tokens_elem: object      # T/tp with SP, else T
    routed_tokens: object    # routed token copies per GPU: T/tp * k * imbalance
    expert_tokens: object    # m_e: tokens each local expert sees
    is_moe: object           # 1 for a Mixture-of-Experts model
    frac_moe: object         # share of layers that are MoE
    is_mla: object           # 1 for multi-head latent attention
    softmax_fallback: object  # 1 where unfused attention misses Megatron's fused softmax kernel


def softmax_fallback(b, tp, M: dict, J: dict):
    """1 where an unfused-attention plan runs Megatron's PyTorch softmax instead of the fused kernel: the
    shape rules of the job (J["softmax_kernel_ok"]) hold but micro-batch x heads per TP rank is not a
    multiple of the kernel's batches per block, or they do not hold (see SOFTMAX_FALLBACK_EXTRA_KERNELS)."""
    batches = b * M["heads"] / tp
    fused = J["softmax_kernel_ok"] * (jnp.mod(batches, J["softmax_batch_block"]) == 0)
    return (1.0 - J["flash"]) * (1.0 - fused)


def shapes(P: dict, M: dict, J: dict, e: EfficiencyParams) -> Shapes:
    tp, dp, cp, ep, etp, b = P["tp"], P["dp"], P["cp"], P["ep"], P["etp"], P["mbs"]
    T = b * J["seq_len"] / cp
    routed = T / tp * M["top_k"] * moe_load(J, e)
    m = J["global_batch"] / (dp * b)
    # the interleaving groups: given by the caller (autotune.scoring.with_groups, on the host), else searched here
    group = P["mb_group"] if "mb_group" in P else microbatch_group_size(m, P["pp"], jnp)
    return Shapes(
        tp=tp, pp=P["pp"], dp=dp, cp=cp, ep=ep, etp=etp, vpp=P["vpp"], mbs=b, sp=P["sp"], zero=P["zero"],
        rec_sel=(P["recompute"] == 1).astype(jnp.float32), rec_full=(P["recompute"] == 2).astype(jnp.float32),
        rec_mod=recompute_modules(P),
        micro_batches=m, mb_group=group, tokens=T, tokens_elem=jnp.where(P["sp"] > 0, T / tp, T),
        routed_tokens=routed, expert_tokens=routed * ep * etp / jnp.maximum(M["experts"], 1.0),
        is_moe=(M["experts"] > 0).astype(jnp.float32), frac_moe=M["moe_layers"] / M["layers"],
        is_mla=(M["q_down_n"] + M["kv_down_n"] > 0).astype(jnp.float32),
        softmax_fallback=softmax_fallback(b, tp, M, J))


class LayerWork(NamedTuple):
    """Forward time of one layer's parts, per micro-batch (s)."""
    attn_proj: object        # QKV (or MLA down/up) and output projections
    attn_core: object        # softmax(QK^T)V
    attn_core_bwd: object    # its backward
    mla_up: object           # MLA up-projections (what mla_up_proj recompute replays)
    mlp_dense: object
    mlp_moe: object          # routed experts + shared experts + router GEMM
    mlp_moe_shared: object   # the shared experts' part of mlp_moe
    elem_attn: object        # memory-bound work around attention (norms, residual, fused rope, casts)
    rope: object             # RoPE run unfused, beyond the fused kernel elem_attn counts (rope_unfused_s)
    elem_dense: object       # activation function of a dense MLP (+ fp8 casts)
    elem_moe: object         # expert activations, (un)permute, router softmax/top-k (+ fp8 casts)
    kernels_dense: object    # launch + tail of a dense layer's kernels (GPU side)
    kernels_moe: object
    host_dense: object       # host time to issue a dense layer's forward ops (eager, or around CUDA graphs)
    host_moe: object
    remat_skip_dense: object  # forward work full recompute does not replay (an XLA remat: the MLP's last GEMM)
    remat_skip_moe: object
    host_moe_pre: object     # host time of an MoE layer's ops before its dispatcher waits for the token counts
    host_op: object          # the host's time per framework op: host_op_s on this system's CPU
    lora_dense: object       # LoRA adapters of a dense layer (their GEMMs and adds), forward
    lora_moe: object
    frozen_wgrad_dense: object  # weight-gradient GEMMs a LoRA job skips (frozen base weights): one forward's worth
    frozen_wgrad_moe: object


def _gemm(S: Shapes, H: dict, J: dict, e: EfficiencyParams):
    eff_max = jnp.where(J["low_precision"] > 0, e.gemm_eff_max_fp8, e.gemm_eff_max)

    def gemm(m, n, k, groups=1.0):
        return gemm_s(m, n, k, J["peak_gemm"] * J["matmul_frac"], J["gemm_bytes"], H["hbm_bw"], eff_max, e, groups)
    return gemm


def attention_projections_s(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams):
    """QKV and output projections [N21 appendix]; MLA down-projections are replicated across TP
    and the up-projections sharded [DS sec. 2.1]."""
    gemm, T, tp, h = _gemm(S, H, J, e), S.tokens, S.tp, M["hidden"]
    return (gemm(T, M["q_down_n"], h) + gemm(T, M["kv_down_n"], h)
            + gemm(T, M["q_up_n"] / tp, M["q_up_k"]) + gemm(T, M["kv_up_n"] / tp, M["kv_up_k"])
            + gemm(T, h, M["attn_out_k"] / tp))


def mla_up_projections_s(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams):
    gemm, T, tp = _gemm(S, H, J, e), S.tokens, S.tp
    return S.is_mla * (gemm(T, M["q_up_n"] / tp, M["q_up_k"]) + gemm(T, M["kv_up_n"] / tp, M["kv_up_k"]))


def fused_attention_keys_per_query(S: Shapes, M: dict, J: dict, e: EfficiencyParams):
    """Keys a fused (flash) attention kernel computes per query, averaged over the layers, with its fixed
    cost per query row counted as attn_seq_half / 2 keys. Causal: s/2 keys (also per CP rank with 2*cp
    load-balanced chunks), with the per-row cost of each of the cp ring steps: s/2 + cp * attn_seq_half / 2,
    which is s/2 / saturate(s/cp, attn_seq_half). A sliding-window layer: the kernel skips the key blocks
    outside the window [FA sec. 3.1 block tiling; TE/cuDNN window_size], so it computes
    ceil(w / block) + 1 blocks of FLASH_KEY_BLOCK keys per query block, of which the causal count above
    leaves out half a block (the diagonal one's masked half): block * ceil(w / block) + block / 2. Packed
    sequences (FrameworkSpec.packed_example_tokens = L): each example's own causal triangle, L/2 + block/2
    keys per query [FA, varlen kernels]."""
    s, w = J["seq_len"], M["window"]
    full = s / 2.0 + S.cp * e.attn_seq_half / 2.0
    # packed examples of L tokens (THD, cu_seqlens): the kernel runs each example's causal triangle of tiles, L/2
    # keys per query and half a key block on each diagonal tile
    L = J["packed_tokens"]
    full = jnp.where(L > 0, jnp.minimum(full, L / 2.0 + FLASH_KEY_BLOCK / 2.0 + S.cp * e.attn_seq_half / 2.0), full)
    in_window = FLASH_KEY_BLOCK * jnp.ceil(w / FLASH_KEY_BLOCK) + FLASH_KEY_BLOCK / 2.0 + e.attn_seq_half / 2.0
    return full + M["window_layer_frac"] * (jnp.minimum(in_window, full) - full)


def flash_bwd_smem_bytes_per_score(head_dim):
    """Shared-memory bytes a fused backward reads per score: its five GEMMs (S = QK^T, dP = dO V^T, dV += P^T dO,
    dK += dS^T Q, dQ += dS K [FA2 Alg. 2]) take their bf16 operands from shared memory: per tile of q query
    rows x k key columns, Q, dO, dO, Q (4 q x d elements), K, V, K (3 k x d) and P, dS, dS (3 q x k), i.e.
    2 d (4 / k + 3 / q) + 6 bytes per score (26 at head dim 128, 16 at 64)."""
    return 2.0 * head_dim * (4.0 / FLASH_BWD_TILE_K + 3.0 / FLASH_BWD_TILE_Q) + 6.0


def attention_core_fwd_bwd_s(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams):
    """Causal attention, forward and backward. Fused kernels compute fused_attention_keys_per_query scores per
    query: the tensor cores' MMAs (2 (d_qk + d_v) FLOPs per score forward, attn_bwd_ratio x that backward, at the
    bf16 peak or fp8's twice it), the softmax's exponential on the special-function units (one per score, forward
    and again in the backward's recomputation of P [FA2]; EXP_PER_SM_CLOCK per SM cycle, exp_x on Blackwell
    Ultra), and the backward's shared-memory reads (flash_bwd_smem_bytes_per_score at SMEM_BYTES_PER_SM_CLOCK),
    added, at attn_eff_max of that bound; the backward's fixed cost per query row is ATTN_BWD_ROW_COST_X the
    forward's (fused_attention_keys_per_query). The two SM-side terms scale with SMs x clock, not the tensor peak: at
    head dim 128 on H100 the exponentials add 46 % to the forward's MMA time, on B200 94 % [FA4]; smaller heads
    pay more per FLOP (head dim 64 on H100: 0.76x the forward rate, 0.85x the backward's, as measured on the lent
    H100 / H200: tests/test_attention_head_dim.py). Unfused attention computes the whole s x s score matrix (a
    sliding window only masks it) with batched GEMMs and memory-bound scale/mask/softmax/dropout kernels
    [K22 sec. 4.1]: backward two GEMMs per forward GEMM and UNFUSED_SOFTMAX_BWD_PER_FWD of the forward's bytes
    (Megatron's PyTorch softmax where its fused kernel does not take the shape: SOFTMAX_FALLBACK_*)."""
    s, T = J["seq_len"], S.tokens
    heads_local = M["heads"] / S.tp
    d_sum = M["qk_head_dim"] + M["v_head_dim"]
    flops = 2.0 * T * (s / 2.0) * heads_local * d_sum
    scores = T * fused_attention_keys_per_query(S, M, J, e) * heads_local
    scores_bwd = T * fused_attention_keys_per_query(
        S, M, J, e._replace(attn_seq_half=ATTN_BWD_ROW_COST_X * e.attn_seq_half)) * heads_local
    mma_rate = H["peak_bf16"] * jnp.where(J["fp8_attention"] > 0, FP8_MMA_X, 1.0)
    exp_rate = EXP_PER_SM_CLOCK * H["sm_cycles"] * H["exp_x"]
    t_mma, t_mma_bwd = 2.0 * scores * d_sum / mma_rate, 2.0 * scores_bwd * d_sum / mma_rate
    t_smem = scores_bwd * flash_bwd_smem_bytes_per_score(0.5 * d_sum) / (SMEM_BYTES_PER_SM_CLOCK * H["sm_cycles"])
    rate = e.attn_eff_max * J["attn_rate_x"]
    scores_per_bw = T * s * heads_local / (H["hbm_bw"] * e.hbm_eff)
    t_bmm = 2.0 * flops / (H["peak_bf16"] * H["matmul_frac_bf16"] * e.gemm_eff_max * saturate(M["qk_head_dim"], e.gemm_dim_half))
    fwd_bytes = e.softmax_bytes_per_score + S.softmax_fallback * SOFTMAX_FALLBACK_EXTRA_BYTES_FWD
    bwd_bytes = UNFUSED_SOFTMAX_BWD_PER_FWD * e.softmax_bytes_per_score + S.softmax_fallback * SOFTMAX_FALLBACK_EXTRA_BYTES_BWD
    fused = J["flash"] > 0
    return (jnp.where(fused, (t_mma + scores / exp_rate) / rate, t_bmm + scores_per_bw * fwd_bytes),
            jnp.where(fused, (e.attn_bwd_ratio * t_mma_bwd + scores_bwd / exp_rate + t_smem) / rate,
                      2.0 * t_bmm + scores_per_bw * bwd_bytes))


def dense_mlp_s(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams):
    """fc1 (two matrices when gated) and fc2, column/row parallel over TP."""
    gemm, T, tp, f, h = _gemm(S, H, J, e), S.tokens, S.tp, M["ffn"], M["hidden"]
    return gemm(T, f * (1.0 + M["gated"]) / tp, h) + gemm(T, h, f / tp)


def local_experts(S: Shapes, M: dict):
    """Experts per EP rank; a dense model counts as one expert (1 / ep: no sorts, and is_moe gates the rest)."""
    return jnp.maximum(M["experts"], 1.0) / S.ep


def expert_gemms_s(S: Shapes, M: dict, gemm):
    """The local experts' fc1 and fc2, each one grouped GEMM over them (moe_mlp_s); m_e tokens per expert."""
    n_local = local_experts(S, M)
    fe, m_e, h = M["expert_ffn"], S.expert_tokens, M["hidden"]
    return gemm(m_e, fe * (1.0 + M["gated"]) / S.etp, h, n_local), gemm(m_e, h, fe / S.etp, n_local)


def moe_mlp_s(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams):
    """[GS] The EP rank holds E/ep experts, each sees m_e tokens (the busiest rank's share); ETP
    shards the expert FFN. fc1 and fc2 are each one grouped GEMM over the local experts (Transformer Engine's
    GroupedLinear, Megatron-Core --moe-grouped-gemm, the recipes' setting): the measured kernels time one
    batched GEMM over the experts within 0.84-0.99 from 128 to 8192 tokens per expert on an H100 and an H200,
    where timing each expert's GEMMs alone was 1.14-1.22x slow below 2048 (tests/test_gpu_measured.py).
    Shared experts run on all T tokens, TP-sharded; the router is a [T/tp x h] @ [h x E] GEMM."""
    gemm, T, tp, h, g = _gemm(S, H, J, e), S.tokens, S.tp, M["hidden"], M["gated"]
    sf = M["shared_ffn"]
    fc1, fc2 = expert_gemms_s(S, M, gemm)
    experts = fc1 + fc2
    shared = gemm(T, sf * (1.0 + g) / tp, h) + gemm(T, h, sf / tp)
    router = gemm(T / tp, M["experts"], h)
    return (experts + shared + router) * S.is_moe, shared * S.is_moe


def elementwise_s(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams):
    """Memory-bound work at HBM bandwidth: (attention part, dense MLP part, MoE part). fp8/fp4
    GEMMs cast (and transpose) their inputs [TE]: lp_cast_bytes per GEMM-input element."""
    bw = H["hbm_bw"] * e.hbm_eff
    T, Te, tp, h = S.tokens, S.tokens_elem, S.tp, M["hidden"]
    f, fe, sf, routed = M["ffn"], M["expert_ffn"], M["shared_ffn"], S.routed_tokens
    lp = J["low_precision"] * e.lp_cast_bytes + J["fp8_amax_pass"] * FP8_AMAX_PASS_BYTES
    # fp8 attention's casts: Q, K, V forward (the fused QKV width; MLA's up-projected K and V), O and dO backward
    fp8_attn_elems = T * (M["q_up_n"] + M["kv_up_n"] + 2.0 * M["attn_out_k"]) / tp * FP8_ATTENTION_CASTS_PER_FWD
    attn = (Te * h * e.elementwise_bytes_h + lp * (Te * h + T * M["attn_out_k"] / tp)
            + J["fp8_attention"] * e.lp_cast_bytes * fp8_attn_elems) / bw
    dense = (T * f / tp * e.elementwise_bytes_f + lp * (Te * h + T * f / tp)) / bw
    moe = (routed * fe * e.elementwise_bytes_f + T / tp * sf * e.elementwise_bytes_f
           + jnp.where(J["permute_fusion"] > 0, PERMUTE_BYTES_PER_H, UNFUSED_PERMUTE_BYTES_PER_H) * routed * h
           + sorts_by_local_expert(S, M, J) * SORT_CHUNKS_BYTES_PER_H * routed * h
           + ROUTER_BYTES_PER_EXPERT * T / tp * M["experts"]
           + M["expert_bias"] * EXPERT_BIAS_BYTES_PER_H * routed * h
           + lp * (2.0 * routed * h + routed * fe)) / bw
    return attn, dense, moe


def sorts_by_local_expert(S: Shapes, M: dict, J: dict):
    """1 where the dispatcher sorts received tokens by local expert (alltoall with several local experts)."""
    alltoall = 1.0 - J["flex_dispatch"] - J["allgather_dispatch"]
    return alltoall * (local_experts(S, M) > 1.0)


def moe_kernels(S: Shapes, M: dict, J: dict):
    """Kernels an MoE layer launches beyond a dense one: the dispatcher's, and each local expert's
    GEMMs, activation and (in low precision) input casts."""
    local = local_experts(S, M)
    per_expert = (KERNELS_PER_LOCAL_EXPERT + J["low_precision"] * KERNELS_PER_LOCAL_EXPERT_LOW_PRECISION
                  + M["expert_bias"] * EXPERT_BIAS_KERNELS_PER_LOCAL_EXPERT)
    return MOE_EXTRA_KERNELS + local * per_expert


def fp8_amax_pass_kernels(S: Shapes, M: dict, J: dict):
    """GPU kernels the tensorwise fp8 recipe's amax passes add to a dense and to an MoE layer forward: per
    block of two GEMMs (attention, MLP, shared experts, each local expert). Transformer Engine launches
    them from C++ inside the one quantize call (multi_tensor_quantize_impl quantizes expert by expert), so
    they cost GPU time, not host ops."""
    per_block = J["fp8_amax_pass"] * FP8_AMAX_PASS_KERNELS_PER_CAST * GEMMS_PER_BLOCK
    moe_blocks = 1.0 + local_experts(S, M) + (M["shared_ffn"] > 0)
    return 2.0 * per_block, moe_blocks * per_block


def _tp_collectives(S: Shapes):
    return (S.tp > 1) * TP_COLLECTIVES_PER_LAYER * (1.0 + S.sp)


def unfused_rope(M: dict, J: dict):
    """1 where an eager framework runs RoPE as PyTorch ops (an XLA-compiled step fuses them)."""
    return M["rope_unfused"] * (1.0 - J["compiled_step"])


def rope_unfused_s(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams):
    """Memory-bound time of unfused RoPE beyond the fused kernel's, per layer forward (equivalent)."""
    return unfused_rope(M, J) * S.tokens * M["rope_elems"] / S.tp * ROPE_UNFUSED_EXTRA_BYTES / (H["hbm_bw"] * e.hbm_eff)


def unfused_attention_kernels(S: Shapes, J: dict):
    """Kernels unfused attention launches beyond a fused kernel's one, with Megatron's PyTorch softmax
    where the fused softmax kernel does not apply."""
    return (1.0 - J["flash"]) * UNFUSED_ATTENTION_EXTRA_KERNELS + S.softmax_fallback * SOFTMAX_FALLBACK_EXTRA_KERNELS


def attention_block_launches(S: Shapes, M: dict, J: dict):
    """Kernels of a layer's attention block (what an attn CUDA graph captures), with its half of the TP
    collectives (each block has one, or one pair with SP)."""
    return (KERNELS_ATTN_BLOCK + unfused_attention_kernels(S, J) + unfused_rope(M, J) * ROPE_UNFUSED_EXTRA_LAUNCHES
            + _tp_collectives(S) / 2.0)


def layer_kernels(S: Shapes, M: dict, J: dict):
    """Kernels (collectives included) a dense and an MoE layer launch forward, per micro-batch: the
    attention block and the MLP block, each with its half of the TP collectives."""
    dense = attention_block_launches(S, M, J) + KERNELS_MLP_BLOCK + _tp_collectives(S) / 2.0
    moe = dense + moe_kernels(S, M, J) + (S.ep > 1) * EP_COLLECTIVES_PER_MOE_LAYER
    return dense, moe


def host_kernels(S: Shapes, M: dict, J: dict, n_dense, n_moe):
    """Launches the host issues per dense and per MoE layer forward (of the `layer_kernels` counts) with
    the job's CUDA graphs (encode.cuda_graph_capture, 0/1 per region): a captured region's kernels are
    replayed by one graph launch; a full-iteration graph replays the whole forward-backward (no per-layer
    launch). The TP collectives split evenly between the attention and the MLP block (each has one, or
    one pair with SP); with moe_router only, an MoE layer's MLP-side collectives stay in its eager dispatch."""
    attn = attention_block_launches(S, M, J)
    router_side = J["cg_router"] * (NORM_KERNELS + MOE_ROUTER_KERNELS) + J["cg_preprocess"] * MOE_PREPROCESS_KERNELS
    moe_side = J["cg_moe"] * (n_moe - attn) + (1.0 - J["cg_moe"]) * router_side
    moe_graph = jnp.maximum(J["cg_moe"], jnp.maximum(J["cg_router"], J["cg_preprocess"]))
    # one launch per captured region; the whole layer is one graph
    dense = n_dense - J["cg_attn"] * attn - J["cg_mlp"] * (n_dense - attn) + J["cg_attn"] + J["cg_mlp"] - J["cg_whole"]
    moe = n_moe - J["cg_attn"] * attn - moe_side + J["cg_attn"] + moe_graph - J["cg_whole"]
    eager = 1.0 - J["cg_iteration"]
    return dense * eager, moe * eager


def mlp_down_s(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams):
    """The MLP's last GEMM (down projection, fc2) of a dense and of an MoE layer: an XLA remat of a layer
    (jax.checkpoint) never recomputes it, as the backward pass reads its input, not its output (counted in
    the jaxpr of the jax runner's gradient: tests/test_gpu_measured.py)."""
    gemm, T, tp, h = _gemm(S, H, J, e), S.tokens, S.tp, M["hidden"]
    moe = (expert_gemms_s(S, M, gemm)[1] + gemm(T, h, M["shared_ffn"] / tp)) * S.is_moe
    return gemm(T, h, M["ffn"] / tp), moe


def moe_pre_sync_launches(S: Shapes, M: dict, J: dict):
    """Launches the host issues in an MoE layer forward before the dispatcher's host-device synchronization
    (the attention block, the pre-MLP norm, the router and the preprocess), with the job's CUDA graphs."""
    attn = attention_block_launches(S, M, J)
    n = (attn * (1.0 - J["cg_attn"]) + J["cg_attn"] + (NORM_KERNELS + MOE_ROUTER_KERNELS) * (1.0 - J["cg_router"])
         + MOE_PREPROCESS_KERNELS * (1.0 - J["cg_preprocess"]) + jnp.maximum(J["cg_router"], J["cg_preprocess"])
         - J["cg_whole"])
    return n * (1.0 - J["cg_iteration"])


def lora_attention_linears(M: dict) -> tuple:
    """The attention block's linears LoRA can adapt, as (target flag of the job, input width, output width,
    column-parallel): linear_qkv (column-parallel: full input, TP-sharded output) and linear_proj (row-parallel)."""
    h = M["hidden"]
    return (("lora_qkv", h, M["q_up_n"], True), ("lora_proj", M["attn_out_k"], h, False))


def lora_mlp_linears(M: dict, f) -> tuple:
    """The same for an MLP of FFN width f (dense, a routed expert or the shared experts): linear_fc1, linear_fc2."""
    h = M["hidden"]
    return (("lora_fc1", h, f * (1.0 + M["gated"]), True), ("lora_fc2", f, h, False))


def lora_s(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams):
    """Forward time of a dense and of an MoE layer's LoRA adapters (0 without LoRA) [LoRA, sec. 4.1]: beside
    each target linear a rank-r down GEMM (A) reads the linear's input and an up GEMM (B) writes its output
    width, then the output is added into the linear's (thin GEMMs: memory-bound, gemm_s's roofline). They are
    TP-parallel like their linear (Megatron-Bridge's ParallelLinearAdapter): a column-parallel linear's
    (linear_qkv, linear_fc1) reads the full input and writes a sharded output, a row-parallel one's
    (linear_proj, linear_fc2) reads a sharded input and writes the full width. Routed experts' adapters act
    per local expert on the expert's tokens; MLA's projections count as one linear_qkv."""
    gemm, T, tp, r = _gemm(S, H, J, e), S.tokens, S.tp, J["lora_dim"]
    bw = H["hbm_bw"] * e.hbm_eff

    def adapters(linears, tokens, shard):
        t = 0.0
        for key, k, n, column in linears:
            k, n = (k, n / shard) if column else (k / shard, n)
            t = t + J[key] * (gemm(tokens, r, k) + gemm(tokens, n, r)
                              + LORA_ADD_BYTES_PER_ELEM * J["act_bytes"] * tokens * n / bw)
        return t

    def mlp(tokens, f, shard):
        return adapters(lora_mlp_linears(M, f), tokens, shard) * (f > 0)

    attn = adapters(lora_attention_linears(M), T, tp)
    n_local = local_experts(S, M)
    moe = n_local * mlp(S.expert_tokens, M["expert_ffn"], S.etp) + mlp(T, M["shared_ffn"], tp)
    return attn + mlp(T, M["ffn"], tp), attn + moe * S.is_moe


def lora_kernels(S: Shapes, M: dict, J: dict):
    """Kernels the adapters of a dense and of an MoE layer launch per forward (a grouped GEMM serves all
    local experts' adapters, as TE's GroupedLinear serves their linears)."""
    attn = sum(J[key] for key, *_ in lora_attention_linears(M))
    mlp = sum(J[key] for key, *_ in lora_mlp_linears(M, M["ffn"]))
    shared = (M["shared_ffn"] > 0) * mlp
    return LORA_KERNELS_PER_ADAPTER * (attn + mlp), LORA_KERNELS_PER_ADAPTER * (attn + mlp + shared)


def layer_work(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams) -> LayerWork:
    elem_attn, elem_dense, elem_moe = elementwise_s(S, M, H, J, e)
    mlp_moe, mlp_moe_shared = moe_mlp_s(S, M, H, J, e)
    n_dense, n_moe = layer_kernels(S, M, J)
    lora_k_dense, lora_k_moe = lora_kernels(S, M, J)
    n_dense, n_moe = n_dense + lora_k_dense, n_moe + lora_k_moe
    host_dense, host_moe = host_kernels(S, M, J, n_dense, n_moe)
    lora_dense, lora_moe = lora_s(S, M, H, J, e)
    attn_proj = attention_projections_s(S, M, H, J, e)
    mlp_dense = dense_mlp_s(S, M, H, J, e)
    amax_dense, amax_moe = fp8_amax_pass_kernels(S, M, J)
    down_dense, down_moe = mlp_down_s(S, M, H, J, e)
    core_fwd, core_bwd = attention_core_fwd_bwd_s(S, M, H, J, e)
    host_op = e.host_op_s * H["host_op_x"]
    return LayerWork(
        attn_proj=attn_proj, attn_core=core_fwd, attn_core_bwd=core_bwd,
        mla_up=mla_up_projections_s(S, M, H, J, e), mlp_dense=mlp_dense,
        mlp_moe=mlp_moe, mlp_moe_shared=mlp_moe_shared, elem_attn=elem_attn, rope=rope_unfused_s(S, M, H, J, e),
        elem_dense=elem_dense, elem_moe=elem_moe,
        kernels_dense=(n_dense + amax_dense) * e.kernel_overhead_s,
        kernels_moe=(n_moe + amax_moe) * e.kernel_overhead_s,
        host_dense=host_dense * host_op, host_moe=host_moe * host_op,
        remat_skip_dense=J["compiled_step"] * down_dense, remat_skip_moe=J["compiled_step"] * down_moe,
        host_moe_pre=moe_pre_sync_launches(S, M, J) * host_op, host_op=host_op,
        lora_dense=lora_dense, lora_moe=lora_moe,
        frozen_wgrad_dense=J["lora"] * (attn_proj + mlp_dense), frozen_wgrad_moe=J["lora"] * (attn_proj + mlp_moe))


class LayerTimes(NamedTuple):
    """Forward and backward compute of a dense and of an MoE layer, per micro-batch (s)."""
    fwd_dense: object
    fwd_moe: object
    bwd_dense: object
    bwd_moe: object


def layer_times(w: LayerWork, e: EfficiencyParams) -> LayerTimes:
    """Backward: two GEMMs (dgrad, wgrad) per forward GEMM and twice the memory-bound work; the core
    attention's own backward (attention_core_fwd_bwd_s); every kernel has a backward counterpart pair.
    LoRA's frozen linears compute only the input gradient (dgrad), their adapters both."""
    fwd_dense = (w.attn_proj + w.attn_core + w.mlp_dense + w.elem_attn + w.rope + w.elem_dense + w.kernels_dense
                 + w.lora_dense)
    fwd_moe = w.attn_proj + w.attn_core + w.mlp_moe + w.elem_attn + w.rope + w.elem_moe + w.kernels_moe + w.lora_moe
    bwd_dense = (2.0 * (fwd_dense - w.attn_core - w.kernels_dense) + w.attn_core_bwd + 2.0 * w.kernels_dense
                 - w.frozen_wgrad_dense)
    bwd_moe = 2.0 * (fwd_moe - w.attn_core - w.kernels_moe) + w.attn_core_bwd + 2.0 * w.kernels_moe - w.frozen_wgrad_moe
    return LayerTimes(fwd_dense, fwd_moe, bwd_dense, bwd_moe)


#: share of a layer's memory-bound attention-side work that is its two norms (RMSNorm/LayerNorm
#: read + write h per token each, of the ~11 bytes/h moved by norms, residuals, rope and casts)
NORM_SHARE_OF_ELEMENTWISE = 0.5


def selective_recompute_s(S: Shapes, w: LayerWork):
    """What selective recomputation replays per layer, module by module (Megatron-Core
    --recompute-modules; [K22 sec. 5] is core_attn): core attention, the norms, the dense MLP,
    the MoE activation function, the whole MoE layer (with its dispatch all-to-all), the shared
    experts, MLA's up-projections. Averaged over dense and MoE layers; the collectives replayed
    with them are charged in communication terms."""
    r, fm = S.rec_mod, S.frac_moe
    shared = w.mlp_moe_shared
    moe_block = w.mlp_moe + w.elem_moe                   # mlp_moe includes the shared experts
    return (r.core_attn * w.attn_core + r.layernorm * NORM_SHARE_OF_ELEMENTWISE * w.elem_attn
            + r.mla_up_proj * w.mla_up
            + (1.0 - fm) * r.mlp * (w.mlp_dense + w.elem_dense)
            + fm * (r.moe * moe_block + (1.0 - r.moe) * (r.moe_act * w.elem_moe + r.shared_experts * shared)))


#: HBM bytes per logit of the vocab-parallel cross entropy, forward + backward, counted op by op.
#: Unfused (Megatron's tensor_parallel/cross_entropy.py, also Megatron-DeepSpeed's): the fp32 copy
#: (read 2, write 4), max (4), subtract (4 + 4), exp (4 + 4), sum (4), divide (4 + 4) = 38 forward;
#: backward the multiply by the loss gradient (4 + 4) and the copy's gradient cast back (4 + 2) = 14.
#: Megatron-Core's fused "native" (core/fusions/fused_cross_entropy.py, jit-fused): the fp32 copy with
#: its max (2 + 4), subtract-exp-sum in one pass (4 + 4), divide (4 + 4); backward one pass to bf16
#: (4 + 2) = 28. Transformer Engine's (pytorch/triton/cross_entropy.py, v2.7-v2.17, the containers of
#: the Megatron-Bridge tables): an online-softmax pass (2), the loss pass writing the gradient into the
#: bf16 logits (2 + 2), backward the in-place multiply (2 + 2) = 10 (TE 2.18 keeps an fp32 gradient:
#: 22). An XLA-compiled step (the jax runner's fp32 logits): two reductions (4 + 4) and the fused
#: softmax-minus-one-hot gradient (4 + 2) = 14
LOSS_BYTES_PER_LOGIT = {"unfused": 52.0, "native": 28.0, "te": 10.0, "xla": 14.0}
#: bytes per token per hidden unit of the embedding: bf16 lookup (2) + fp32 scatter-add of its
#: gradient (4)
EMBEDDING_BYTES_PER_H = 2.0 + 4.0
#: the gradient scatter's share, which a frozen embedding (LoRA) does not run
EMBEDDING_GRAD_BYTES_PER_H = 4.0


class HeadWork(NamedTuple):
    logits_fwd: object       # output-layer GEMM forward
    logits_fwd_bwd: object   # that GEMM forward and backward: 3 x (2 x when frozen: no weight gradient)
    loss: object             # softmax cross-entropy over the vocabulary
    embedding: object        # lookup forward + gradient scatter (frozen: the lookup only)
    mtp: object              # the MTP modules' own work beside their layers (0 without MTP)
    outputs: object          # passes through the output layer: 1 + MTP modules


def head_work(S: Shapes, M: dict, H: dict, J: dict, e: EfficiencyParams) -> HeadWork:
    gemm, T, tp, h = _gemm(S, H, J, e), S.tokens, S.tp, M["hidden"]
    bw = H["hbm_bw"] * e.hbm_eff
    passes = 3.0 - J["lora"]
    logits = gemm(T, M["vocab"] / tp, h)
    loss = T * M["vocab"] / tp * J["loss_bytes"] / bw
    embedding = T * h * (EMBEDDING_BYTES_PER_H - J["lora"] * EMBEDDING_GRAD_BYTES_PER_H) / bw
    # each MTP module looks up the next tokens' embeddings, projects [norm(h); norm(emb)] 2h -> h (eh_proj,
    # column-parallel), and after its layer runs the shared output layer and a loss of its own [Megatron-Core
    # multi_token_prediction.py MultiTokenPredictionLayer.forward, process_mtp_loss]
    mtp = M["mtp_layers"] * (passes * (logits + gemm(T, h / tp, 2.0 * h)) + loss + embedding)
    return HeadWork(logits_fwd=logits, logits_fwd_bwd=passes * logits, loss=loss, embedding=embedding, mtp=mtp,
                    outputs=1.0 + M["mtp_layers"])
