"""Frozen specs: the model, the GPU, the cluster topology and the training job.

SI units inside (bytes, seconds, FLOP/s, bytes/s); GB, GB/s and TFLOP/s only in preset files, the
CLI and reports. Specs validate themselves on construction and raise `SpecError` (a ValueError)
whose message names the field, the value and the rule.
"""
from __future__ import annotations

import math
import re

import enum
from dataclasses import dataclass, fields


class SpecError(ValueError):
    """Bad user input: the message names the field and the reason (one line)."""

    def __init__(self, field_name: str, reason: str):
        self.field = field_name
        self.reason = reason
        super().__init__(f"{field_name}: {reason}")


class Precision(enum.Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    FP4 = "fp4"
    FP32 = "fp32"       # no mixed precision: fp32 weights, gradients and activations (Megatron without --bf16/--fp16)

    @classmethod
    def parse(cls, text: str, field_name: str = "precision") -> "Precision":
        try:
            return cls(str(text).strip().lower())
        except ValueError:
            raise SpecError(field_name, f"unknown precision {text!r}; choose one of "
                            f"{', '.join(p.value for p in cls)}") from None


class Recompute(enum.IntEnum):
    """Activation recomputation policy (Korthikanti et al. 2022, sec. 4 and 5)."""
    NONE = 0
    SELECTIVE = 1   # recompute cheap modules: core attention, layernorms, activation functions, MLA up-proj
    FULL = 2        # keep only each layer's input; recompute the whole layer forward in backward

    @classmethod
    def parse(cls, text: str, field_name: str = "recompute") -> "Recompute":
        t = str(text).strip().lower()
        for r in cls:
            if r.name.lower() == t:
                return r
        raise SpecError(field_name, f"unknown recompute policy {text!r}; choose none, selective or full")


#: Upper bounds of every size a user can give (model config, cluster file, flags): far above any
#: real model or cluster, low enough that products stay exact in float32 / int32 and no loop over
#: layers, GPUs or nodes runs away (the largest published models have ~128 layers, hidden 18,432,
#: vocabulary 256k, 256 experts; the largest clusters ~10^5 GPUs; NVLink domains 576 GPUs).
MAX_SIZE = {
    "num_layers": 4096, "hidden_size": 2 ** 20, "ffn_hidden_size": 2 ** 22, "num_attention_heads": 2 ** 14,
    "num_kv_heads": 2 ** 14, "vocab_size": 2 ** 24, "max_seq_len": 2 ** 24, "head_dim": 2 ** 16,
    "num_experts": 2 ** 16, "experts_per_token": 2 ** 16, "moe_ffn_hidden_size": 2 ** 22,
    "num_shared_experts": 2 ** 10, "shared_expert_ffn_hidden_size": 2 ** 22, "first_k_dense_layers": 4096,
    "moe_layer_freq": 4096, "q_lora_rank": 2 ** 20, "kv_lora_rank": 2 ** 20, "qk_nope_head_dim": 2 ** 16,
    "qk_rope_head_dim": 2 ** 16, "v_head_dim": 2 ** 16, "sliding_window": 2 ** 24, "sliding_window_layers": 4096,
    "gpus": 2 ** 24, "nvlink_domain_size": 2 ** 16, "gpus_per_node": 2 ** 16, "num_sites": 2 ** 10,
    "global_batch": 2 ** 31 - 1, "seq_len": 2 ** 24,
}


#: Megatron-Core GPTModel's position_embedding_type values the cost model tells apart
POSITION_EMBEDDINGS = ("rope", "yarn", "learned_absolute")
#: a gated MLP's activation (Megatron-Core TransformerConfig.activation_func with gated_linear_unit): SiLU (SwiGLU,
#: --swiglu) or quick GeLU, x * sigmoid(1.702 x) (GPT-OSS's, --quick-geglu; megatron/core/fusions/fused_bias_geglu.py)
GLU_ACTIVATIONS = ("silu", "quick_gelu")


def check_size(name: str, value, field_name: str | None = None) -> None:
    """SpecError (naming `field_name`, default `name`) when a size exceeds MAX_SIZE[name]."""
    limit = MAX_SIZE.get(name)
    if limit is not None and isinstance(value, (int, float)) and value > limit:
        raise SpecError(field_name or name, f"{value:,} is larger than the supported maximum {limit:,}")


def _positive(name: str, value, integer: bool = True) -> None:
    if integer and (not isinstance(value, int) or isinstance(value, bool)):
        raise SpecError(name, f"must be a positive integer, got {value!r}")
    if value is None or value <= 0:
        raise SpecError(name, f"must be positive, got {value!r}")
    check_size(name, value)


def _non_negative(name: str, value) -> None:
    if value is None or value < 0:
        raise SpecError(name, f"must be >= 0, got {value!r}")
    check_size(name, value)



#: byte units a memory size may carry (decimal SI and binary IEC prefixes)
BYTE_UNITS = {"B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
              "KIB": 2.0 ** 10, "MIB": 2.0 ** 20, "GIB": 2.0 ** 30, "TIB": 2.0 ** 40}


def parse_bytes(text, field: str, default_unit: str = "GB") -> float:
    """A memory size with its unit: "80GiB", "76GB", "76 GB", "0.5TiB"; a bare number is in
    `default_unit`. GB is 10^9 bytes, GiB 2^30 (an "80 GB" H100 holds 80 GiB = 85.9 GB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m:
        raise SpecError(field, f"must be a size such as 80GiB or 76GB, got {text!r}")
    value, unit = float(m.group(1)), (m.group(2) or default_unit).upper()
    if unit not in BYTE_UNITS:
        raise SpecError(field, f"unknown unit {m.group(2)!r} in {text!r}; use GB (10^9 bytes) or GiB (2^30)")
    size = value * BYTE_UNITS[unit]
    if not (size > 0 and size < 1e15):
        raise SpecError(field, f"must be a positive size below 1 PB, got {text!r}")
    return size

@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, dense or Mixture-of-Experts.

    Symbols used by the cost model: L layers, h hidden, a heads, g KV heads, d head dim,
    f FFN hidden, V vocab, E routed experts, k experts per token, f_e expert FFN hidden.
    """
    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int | None = None          # default h / a
    gated_mlp: bool = True               # SwiGLU (3 matrices) vs GeLU / squared-ReLU (2 matrices)
    tied_embeddings: bool = False
    max_seq_len: int = 4096
    # Mixture of Experts (num_experts == 0 means dense)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden_size: int = 0
    num_shared_experts: int = 0
    shared_expert_ffn_hidden_size: int = 0
    first_k_dense_layers: int = 0
    moe_layer_freq: int = 1              # every n-th layer (after the first dense ones) is MoE
    # Multi-head latent attention (DeepSeek-V2/V3); 0 = standard (GQA) attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Sliding-window attention (Mistral-7B-v0.1, Gemma-2/3 local layers, GPT-OSS): keys before each query
    # the window reaches, 0 = none; sliding_window_layers: how many layers use it (None: every layer, as in
    # Mistral; Gemma-2 and GPT-OSS alternate, Gemma-3 has 5 local layers per global one). The fused
    # attention kernels skip the key blocks outside the window (compute.fused_attention_keys_per_query).
    sliding_window: int = 0
    sliding_window_layers: int | None = None
    # Megatron --hidden-dropout (its default is 0.1; Llama-style recipes set 0): dropout masks are kept
    hidden_dropout: float = 0.0
    # Megatron's --position-embedding-type: rope, yarn (YaRN-scaled RoPE as its own embedding: GPT-OSS;
    # MLA models apply YaRN inside plain "rope") or learned_absolute (GPT-2/3)
    position_embedding: str = "rope"
    # the routed experts' linear layers carry biases (Megatron's --add-bias-linear on an MoE model: GPT-OSS);
    # Megatron-Core's TEGroupedMLP adds fc2's bias expert by expert in Python (compute.EXPERT_BIAS_*)
    expert_bias: bool = False
    # a learnable per-head softmax offset, the "attention sinks" (GPT-OSS: transformers' GptOssAttention.sinks;
    # Megatron-Core softmax_type="learnable", Megatron-Bridge's GPT-OSS bridge): Transformer Engine runs it on cuDNN's
    # fused or its unfused attention, never on FlashAttention (flash_attention_2_refusal)
    attention_sinks: bool = False
    # the gated MLP's activation (GLU_ACTIVATIONS) and GPT-OSS's clamp: the gate clamped to at most c, the linear half
    # to [-c, c], then act(gate) * (linear + offset) (Megatron-Core activation_func_clamp_value, glu_linear_offset;
    # transformers' GptOssExperts: swiglu_limit 7.0, offset 1). The same element-wise work as SwiGLU to the cost
    # model (one fused kernel: weighted_bias_quick_geglu_impl); the export names it. 0 = no clamp, no offset
    glu_activation: str = "silu"
    activation_clamp: float = 0.0
    glu_linear_offset: float = 0.0
    # multi-token prediction (DeepSeek-V3 sec. 2.2; Megatron --mtp-num-layers, HF num_nextn_predict_layers): D
    # sequential modules after the last layer, each a transformer layer of the last layer's kind (MoE when it is
    # MoE), two RMSNorms and a 2h -> h projection, with a second pass through the shared output layer and loss
    mtp_num_layers: int = 0
    source: str = ""

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_kv_heads", "vocab_size", "max_seq_len"):
            _positive(f, getattr(self, f))
        if self.head_dim is not None:
            _positive("head_dim", self.head_dim)
        elif self.hidden_size % self.num_attention_heads:
            raise SpecError("head_dim", f"hidden_size={self.hidden_size} is not divisible by "
                            f"num_attention_heads={self.num_attention_heads}; give head_dim")
        if self.num_attention_heads % self.num_kv_heads:
            raise SpecError("num_kv_heads", f"num_attention_heads={self.num_attention_heads} must be "
                            f"a multiple of num_kv_heads={self.num_kv_heads}")
        for f in ("num_experts", "experts_per_token", "moe_ffn_hidden_size", "num_shared_experts",
                  "shared_expert_ffn_hidden_size", "first_k_dense_layers", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "sliding_window",
                  "mtp_num_layers"):
            _non_negative(f, getattr(self, f))
        if self.mtp_num_layers > self.num_layers:
            raise SpecError("mtp_num_layers", f"must be at most num_layers={self.num_layers} (each MTP module is "
                            f"one more layer after the last), got {self.mtp_num_layers}")
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise SpecError("position_embedding", f"must be one of {', '.join(POSITION_EMBEDDINGS)}, "
                            f"got {self.position_embedding!r}")
        if self.glu_activation not in GLU_ACTIVATIONS:
            raise SpecError("glu_activation", f"must be one of {', '.join(GLU_ACTIVATIONS)}, got {self.glu_activation!r}")
        for f in ("activation_clamp", "glu_linear_offset"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > 1e6:
                raise SpecError(f, f"must be a finite number, got {v!r}")
        if self.activation_clamp < 0:
            raise SpecError("activation_clamp", f"must be >= 0 (0 = no clamp), got {self.activation_clamp!r}")
        if self.sliding_window_layers is not None:
            if not 0 <= self.sliding_window_layers <= self.num_layers:
                raise SpecError("sliding_window_layers", f"must be in 0..num_layers={self.num_layers}, "
                                f"got {self.sliding_window_layers}")
            if self.sliding_window_layers and not self.sliding_window:
                raise SpecError("sliding_window_layers", "needs a sliding_window (keys per query) > 0")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise SpecError("experts_per_token", f"must be in 1..num_experts={self.num_experts}, "
                                f"got {self.experts_per_token}")
            _positive("moe_ffn_hidden_size", self.moe_ffn_hidden_size)
            if self.first_k_dense_layers >= self.num_layers:
                raise SpecError("first_k_dense_layers", "must be smaller than num_layers")
            _positive("moe_layer_freq", self.moe_layer_freq)
        if self.kv_lora_rank and not (self.qk_nope_head_dim + self.qk_rope_head_dim and self.v_head_dim):
            raise SpecError("qk_nope_head_dim", "multi-head latent attention needs qk_nope_head_dim, "
                            "qk_rope_head_dim and v_head_dim")

    # ---- derived sizes (plain Python ints; the JAX model gets them as floats) ----
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_sliding_window_layers(self) -> int:
        """Layers whose attention is limited to the sliding window (0 without one)."""
        if not self.sliding_window:
            return 0
        return self.num_layers if self.sliding_window_layers is None else self.sliding_window_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def head_dim_eff(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def num_moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        rest = self.num_layers - self.first_k_dense_layers
        return (rest + self.moe_layer_freq - 1) // self.moe_layer_freq

    def attention_params(self) -> int:
        """Weights of one attention block (no biases, no norms)."""
        h, a = self.hidden_size, self.num_attention_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * a * qk) if self.q_lora_rank else h * a * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + \
                self.kv_lora_rank * a * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + a * self.v_head_dim * h
        d, g = self.head_dim_eff, self.num_kv_heads
        return h * (a + 2 * g) * d + a * d * h

    def mlp_params(self, ffn: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * ffn

    def expert_params_per_layer(self) -> int:
        """Routed-expert weights of one MoE layer (all experts)."""
        return self.num_experts * self.mlp_params(self.moe_ffn_hidden_size)

    def moe_dense_params_per_layer(self) -> int:
        """Non-expert weights of an MoE layer's MLP part: shared experts + router."""
        shared = self.num_shared_experts * self.mlp_params(
            self.shared_expert_ffn_hidden_size or self.moe_ffn_hidden_size)
        return shared + self.hidden_size * self.num_experts

    @property
    def mtp_layer_is_moe(self) -> bool:
        """An MTP module's transformer layer is of the last layer's kind (Megatron-Core's MTP block spec takes the
        decoder's last layer spec; training.py num_floating_point_operations: last_layer_is_moe)."""
        return self.is_moe and (self.num_layers - 1 - self.first_k_dense_layers) % self.moe_layer_freq == 0

    def mtp_params(self) -> int:
        """Unique weights of the MTP modules (the embedding and output layer are the main model's, shared):
        per module a transformer layer, enorm + hnorm + final norm (3h) and eh_proj (2h x h) [Megatron-Core
        multi_token_prediction.py MultiTokenPredictionLayer]. DeepSeek-V3: 11.5B (README_WEIGHTS.md)."""
        h = self.hidden_size
        mlp = (self.expert_params_per_layer() + self.moe_dense_params_per_layer() if self.mtp_layer_is_moe
               else self.mlp_params(self.ffn_hidden_size))
        layer = self.attention_params() + mlp + 2 * h
        return self.mtp_num_layers * (layer + 3 * h + 2 * h * h)

    def param_counts(self) -> dict:
        """Total and active (per token) parameters of the main model, embeddings included; "mtp": the MTP
        modules' own (not in the total, as published counts leave them out: DeepSeek-V3's 671B)."""
        L, h, V = self.num_layers, self.hidden_size, self.vocab_size
        n_moe = self.num_moe_layers
        n_dense = L - n_moe
        norms = 2 * h * L + h
        emb = V * h * (1 if self.tied_embeddings else 2)
        attn = self.attention_params() * L
        dense_mlp = self.mlp_params(self.ffn_hidden_size) * n_dense
        experts = self.expert_params_per_layer() * n_moe
        moe_dense = self.moe_dense_params_per_layer() * n_moe
        total = emb + attn + dense_mlp + experts + moe_dense + norms
        active_experts = (self.experts_per_token * self.mlp_params(self.moe_ffn_hidden_size) * n_moe
                          if self.is_moe else 0)
        active = emb + attn + dense_mlp + active_experts + moe_dense + norms
        return {"total": total, "active": active, "experts": experts, "embedding": emb, "mtp": self.mtp_params()}


#: H100 SXM's SM cycles per second per dense bf16 FLOP/s: 132 SMs x 1.98 GHz / 989.4 TFLOP/s [H100 whitepaper]; what a
#: GPU given without its SM count and clock is assumed to have
H100_SM_CYCLES_PER_BF16_FLOP = 132 * 1.98e9 / 989.4e12


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """One accelerator and its usual node. Figures from the vendor datasheets (see presets)."""
    name: str
    peak_flops_bf16: float               # dense, FLOP/s
    peak_flops_fp8: float = 0.0          # dense, FLOP/s; 0 = not supported
    peak_flops_fp4: float = 0.0          # dense, FLOP/s; 0 = not supported
    hbm_bytes: float = 80e9
    hbm_bandwidth_bytes_per_s: float = 2e12
    gpus_per_node: int = 8               # GPUs sharing one NVLink domain by default
    intra_node_bw_bytes_per_s: float = 300e9   # per GPU per direction (NVLink)
    inter_node_bw_bytes_per_s: float = 25e9    # per GPU per direction (NIC)
    # one peer's share of the scale-up link (send/recv to one GPU): all of it behind a switch
    # (NVSwitch), one link of a fully connected mesh (MI300X xGMI); 0 = the whole intra-node bandwidth
    intra_node_p2p_bw_bytes_per_s: float = 0.0
    # Maximum achievable matmul FLOP/s as a fraction of the dense peak (MAMF: the best large GEMM a
    # vendor BLAS reaches; ml-engineering's MAMF table, AMD's "max-achievable FLOPs"); the cost
    # model's GEMM efficiency is relative to it. Unmeasured parts: H100's 0.80.
    matmul_frac_bf16: float = 0.80
    matmul_frac_fp8: float = 0.80
    matmul_frac_fp4: float = 0.80
    # Streaming multiprocessors (AMD: compute units) and their boost clock: the rate of the work fused attention
    # does outside the tensor cores, the softmax's exponentials (16 per SM per clock) and the backward's
    # shared-memory reads (128 B per SM per clock), which did not grow with the tensor cores from H100 to B200
    # (compute.attention_core_fwd_bwd_s). 0 = not given: the GPU has H100's SM cycles per bf16 FLOP
    sm_count: int = 0
    sm_clock_hz: float = 0.0
    # The special-function units' exponential (MUFU.EX2) per SM per clock against the 16 of Ampere, Hopper and
    # Blackwell: 2 on Blackwell Ultra (B300, GB300), which doubles it at the same tensor-core peaks; 1 elsewhere
    exp_throughput_x: float = 1.0
    # the GPU's link to host memory, per direction (what --cpu-offloading's copies run over): PCIe, or NVLink-C2C
    # on Grace superchips; the default is PCIe Gen4 x16's 32 GB/s
    host_link_bw_bytes_per_s: float = 32e9
    # The host CPU's time per framework op (Python, autograd, the launch) against a DGX H100's Xeon Platinum
    # 8480C, on which host_op_s is measured: an eager framework issues every kernel from one CPU thread per GPU.
    # Grace superchips (GB200, GB300): torch.nn.Linear's forward takes 37.08 us of CPU on GB200 against 13.48 us
    # on DGX H100 (TransformerEngine issue #2053, 2025; GH200 33.17 us), 2.75x
    host_op_x: float = 1.0
    family: str = ""                     # calibration family, e.g. "ampere", "hopper"
    source: str = ""

    def __post_init__(self):
        for f in ("peak_flops_bf16", "hbm_bytes", "hbm_bandwidth_bytes_per_s",
                  "intra_node_bw_bytes_per_s", "inter_node_bw_bytes_per_s", "host_link_bw_bytes_per_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or v <= 0:
                raise SpecError(f, f"must be a positive number, got {v!r}")
        _positive("gpus_per_node", self.gpus_per_node)
        for f in ("matmul_frac_bf16", "matmul_frac_fp8", "matmul_frac_fp4"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not 0.1 <= v <= 1.0:
                raise SpecError(f, f"must be a fraction of the peak in [0.1, 1], got {v!r}")
        if not isinstance(self.exp_throughput_x, (int, float)) or not 0.25 <= self.exp_throughput_x <= 8.0:
            raise SpecError("exp_throughput_x", f"must be a rate ratio in [0.25, 8], got {self.exp_throughput_x!r}")
        if not isinstance(self.host_op_x, (int, float)) or isinstance(self.host_op_x, bool) \
                or not 0.1 <= self.host_op_x <= 10.0:
            raise SpecError("host_op_x", f"must be the host CPU's time per op against a DGX H100's, in [0.1, 10], "
                                         f"got {self.host_op_x!r}")
        if not isinstance(self.sm_count, int) or isinstance(self.sm_count, bool) or not 0 <= self.sm_count <= 4096:
            raise SpecError("sm_count",
                            f"must be a whole number of SMs in [0, 4096] (0: not given), got {self.sm_count!r}")
        if not isinstance(self.sm_clock_hz, (int, float)) or isinstance(self.sm_clock_hz, bool) \
                or not 0.0 <= self.sm_clock_hz <= 1e10:
            raise SpecError("sm_clock_hz", f"must be a clock in [0, 10] GHz (0: not given), got {self.sm_clock_hz!r}")
        if (self.sm_count > 0) != (self.sm_clock_hz > 0):
            raise SpecError("sm_count", "give the SM count and the SM clock together (or neither)")

    def matmul_frac(self, precision: Precision) -> float:
        """MAMF / dense peak for GEMMs in this precision (bf16, fp16 and TF32 take the bf16 measurement)."""
        if precision is Precision.FP8:
            return self.matmul_frac_fp8
        if precision is Precision.FP4:
            return self.matmul_frac_fp4
        return self.matmul_frac_bf16

    @property
    def sm_cycles_per_s(self) -> float:
        """SMs x clock (cycles per second over the whole GPU); when not given, H100's per bf16 FLOP."""
        if self.sm_count > 0:
            return float(self.sm_count) * float(self.sm_clock_hz)
        return self.peak_flops_bf16 * H100_SM_CYCLES_PER_BF16_FLOP

    @property
    def p2p_bw_bytes_per_s(self) -> float:
        return self.intra_node_p2p_bw_bytes_per_s or self.intra_node_bw_bytes_per_s

    def peak_flops(self, precision: Precision) -> float:
        if precision is Precision.FP8:
            return self.peak_flops_fp8
        if precision is Precision.FP4:
            return self.peak_flops_fp4
        if precision is Precision.FP32:
            # fp32 GEMMs run on the tensor cores as TF32, half the dense bf16 rate on Ampere, Hopper and
            # Blackwell (A100 datasheet: 156 vs 312 TFLOP/s; H100 SXM: 494.7 vs 989.4; B200: 1.1 vs 2.2 PFLOP/s)
            return self.peak_flops_bf16 / 2.0
        return self.peak_flops_bf16


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """GPUs and a three-level topology: NVLink domain < fabric (one site) < wide-area link.

    Groups are placed TP innermost, then CP, EP/DP, PP outermost (Megatron's rank order), so a
    group's stride decides which levels it crosses.
    """
    gpu: GPUSpec
    num_gpus: int
    nvlink_domain_size: int              # GPUs sharing NVLink (8 for DGX, 72 for NVL72)
    intra_node_bw_bytes_per_s: float
    inter_node_bw_bytes_per_s: float
    fabric_bw_factor: float = 1.0        # <1 for an oversubscribed fabric
    num_sites: int = 1
    wan_bw_bytes_per_s: float = 0.0      # per site, aggregate, per direction
    wan_latency_s: float = 0.0
    intra_node_latency_s: float = 3e-6   # NCCL-level per hop latency over NVLink
    inter_node_latency_s: float = 8e-6   # per hop over InfiniBand / RoCE
    name: str = ""

    def __post_init__(self):
        _positive("gpus", self.num_gpus)
        _positive("nvlink_domain_size", self.nvlink_domain_size)
        _positive("num_sites", self.num_sites)
        for f in ("intra_node_bw_bytes_per_s", "inter_node_bw_bytes_per_s", "fabric_bw_factor"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or v <= 0:
                raise SpecError(f, f"must be a positive number, got {v!r}")
        if self.num_gpus % self.num_sites:
            raise SpecError("sites", f"gpus={self.num_gpus} does not split evenly over "
                            f"{self.num_sites} sites")
        if self.num_sites > 1:
            if self.wan_bw_bytes_per_s <= 0:
                raise SpecError("wan_bandwidth_gbps", "a multi-site cluster needs a positive WAN bandwidth")
            if self.gpus_per_site % self.nvlink_domain_size:
                raise SpecError("gpus_per_site", f"{self.gpus_per_site} GPUs per site is not a multiple "
                                f"of the NVLink domain size {self.nvlink_domain_size}")

    @property
    def gpus_per_site(self) -> int:
        return self.num_gpus // self.num_sites


class Framework(enum.Enum):
    """The training framework a plan is run with (and exported to). Megatron-Core is the reference:
    its option names and defaults are the fields of `FrameworkSpec`."""
    MEGATRON = "megatron"       # Megatron-LM / Megatron-Core (and Megatron-Bridge, NeMo 2)
    DEEPSPEED = "deepspeed"     # Megatron-DeepSpeed: ZeRO stages 1-3 with DeepSpeed's communication
    # a JAX trainer (this project's jax runner, MaxText): XLA compiles the whole step, micro-batches
    # included, into one program, so no host issues kernels one by one and no Python runs per micro-batch
    JAX = "jax"

    @classmethod
    def parse(cls, text: str, field_name: str = "framework") -> "Framework":
        return _parse_enum(cls, text, field_name)

    @property
    def grad_reduce_in_fp32_default(self) -> bool:
        """Megatron reduces fp32 main gradients unless --grad-reduce-in-bf16; DeepSpeed reduces in the
        model's dtype unless its config says otherwise (deepspeed/runtime/engine.py, communication_data_type)."""
        return self is Framework.MEGATRON

    @property
    def gradient_accumulation_fusion_default(self) -> bool:
        """Megatron's wgrad GEMMs accumulate into the fp32 main gradients (--gradient-accumulation-fusion,
        on by default); a JAX trainer's gradient accumulation (a scan over micro-batches: this project's
        runner, MaxText's gradient_accumulation_steps) adds each micro-batch's gradients to the accumulator
        after its backward pass, in a kernel of its own; so does Megatron-DeepSpeed, whose linear layers hand
        the weight gradient to autograd (microsoft/Megatron-DeepSpeed@f4157bea core/tensor_parallel/layers.py:
        the fused wgrad_gemm_accum path is commented out) and whose DeepSpeed optimizer then accumulates it."""
        return self is Framework.MEGATRON


class AttentionKernel(enum.Enum):
    """The attention kernel a job runs, which its attention time depends on (compute.attention_kernel_rate)."""
    CUDNN = "cudnn"                  # cuDNN's fused attention (Transformer Engine's FusedAttention, JAX's "cudnn")
    FLASH_ATTN_2 = "flash-attn-2"    # FlashAttention-2 (the flash-attn package; PyTorch SDPA's flash backend)
    UNFUSED = "unfused"              # batched GEMMs and softmax kernels over the s x s scores


#: GPU families on which Transformer Engine prefers cuDNN's fused attention to FlashAttention when both can run
#: ("Disabling FlashAttention to give FusedAttention preference on Hopper+ for performance reasons":
#: dot_product_attention/utils.py get_attention_backend, v1.4-v2.14, device_compute_capability >= (9, 0));
#: on Ampere it keeps FlashAttention
CUDNN_PREFERRED_FAMILIES = frozenset({"hopper", "blackwell"})


def flash_attention_2_refusal(model: "ModelSpec") -> str:
    """Why FlashAttention-2 cannot run a model's attention ("" when it can): Transformer Engine's filters
    (dot_product_attention/utils.py get_attention_backend, v2.7-v2.14): no softmax_type but "vanilla" (attention
    sinks), no head_dim_qk != head_dim_v ("does not support MLA"), head dims a multiple of 8 and at most 256."""
    if model.attention_sinks:
        return "its attention sinks (a learnable softmax offset) run on cuDNN's fused or the unfused attention only"
    if model.is_mla:
        qk, v = model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
        if qk != v:
            return f"multi-head latent attention's query-key head dim {qk} differs from its value head dim {v}"
        d = qk
    else:
        d = model.head_dim_eff
    if d > 256 or d % 8:
        return f"head dim {d} (it takes multiples of 8 up to 256)"
    return ""


class AttentionBackend(enum.Enum):
    """Megatron-Core --attention-backend (megatron/core/transformer/enums.py AttnBackend; default auto): a fused
    kernel never stores the s x s scores; `unfused` (pre-2022 Megatron-LM, Megatron-DeepSpeed's default)
    computes them with batched GEMMs and memory-bound softmax kernels [K22 sec. 4.1]. Megatron-Core passes the
    choice to Transformer Engine as environment variables (language_module.py _set_attention_backend): flash sets
    NVTE_FLASH_ATTN=1 and NVTE_FUSED_ATTN=0 (FlashAttention only), fused the reverse (cuDNN only), auto leaves
    both on and Transformer Engine picks (`kernel`)."""
    AUTO = "auto"
    FLASH = "flash"
    FUSED = "fused"
    UNFUSED = "unfused"

    @classmethod
    def parse(cls, text: str, field_name: str = "attention_backend") -> "AttentionBackend":
        return _parse_enum(cls, text, field_name)

    @property
    def is_fused(self) -> bool:
        return self is not AttentionBackend.UNFUSED

    def kernel(self, framework: "Framework", gpu_family: str) -> AttentionKernel:
        """The kernel this backend runs with a framework on a GPU family. auto: Transformer Engine's choice,
        cuDNN on Hopper and Blackwell (CUDNN_PREFERRED_FAMILIES), FlashAttention-2 elsewhere; Megatron-
        DeepSpeed's one fused kernel is FlashAttention-2 (--use-flash-attn-v2); a JAX trainer's is cuDNN's,
        whichever fused backend is named (XLA has no FlashAttention-2: jax.nn.dot_product_attention,
        implementation="cudnn", this project's jax runner)."""
        if self is AttentionBackend.UNFUSED:
            return AttentionKernel.UNFUSED
        if self is AttentionBackend.FUSED or framework is Framework.JAX:
            return AttentionKernel.CUDNN
        if self is AttentionBackend.FLASH or framework is Framework.DEEPSPEED:
            return AttentionKernel.FLASH_ATTN_2
        if gpu_family in CUDNN_PREFERRED_FAMILIES:
            return AttentionKernel.CUDNN
        return AttentionKernel.FLASH_ATTN_2


class CrossEntropyImpl(enum.Enum):
    """Megatron-Core --cross-entropy-fusion-impl: which fused vocab-parallel cross entropy
    --cross-entropy-loss-fusion runs (model_parallel_config.py)."""
    NATIVE = "native"           # Megatron-Core's jit-fused PyTorch (core/fusions/fused_cross_entropy.py)
    TE = "te"                   # Transformer Engine's Triton kernels (pytorch/triton/cross_entropy.py)

    @classmethod
    def parse(cls, text: str, field_name: str = "cross_entropy_fusion_impl") -> "CrossEntropyImpl":
        return _parse_enum(cls, text, field_name)


class Fp8Recipe(enum.Enum):
    """Megatron-Core --fp8-recipe (transformer_config.py fp8_recipe, default "delayed"): how Transformer
    Engine scales the fp8 tensors. What each supports (TE quantization.py check_recipe_support): delayed and
    tensorwise on compute capability >= 8.9, blockwise on >= 9.0 with CUDA >= 12.9, mxfp8 on Blackwell
    (10.x) only."""
    DELAYED = "delayed"         # DelayedScaling: scales from an amax history, the cast fused with the transpose
    TENSORWISE = "tensorwise"   # Float8CurrentScaling: each tensor's own amax, a pass of its own before the cast
    MXFP8 = "mxfp8"             # MXFP8BlockScaling: an E8M0 scale per 32 elements, computed in the cast
    BLOCKWISE = "blockwise"     # Float8BlockScaling: 1x128 activation / 128x128 weight blocks (DeepSeek-V3's)

    @classmethod
    def parse(cls, text: str, field_name: str = "fp8_recipe") -> "Fp8Recipe":
        return _parse_enum(cls, text, field_name)


#: GPU families each fp8 recipe runs on (TE check_recipe_support; MXFP8 not on 12.x yet); a GPU of no
#: stated family is not checked
FP8_RECIPE_FAMILIES = {Fp8Recipe.MXFP8: ("blackwell",), Fp8Recipe.BLOCKWISE: ("hopper", "blackwell")}
#: GPU families whose cuDNN fused attention runs each recipe in fp8 (TE v2.18 dot_product_attention/utils.py
#: get_attention_backend: delayed scaling on Hopper and Blackwell, current scaling and MXFP8 on sm100+ only;
#: cuDNN's support matrix lists fp8 attention for Hopper and Blackwell). Megatron-Core passes no fp8_dpa to
#: block scaling (fp8_utils.get_fp8_recipe), so blockwise has none
FP8_ATTENTION_FAMILIES = {Fp8Recipe.DELAYED: ("hopper", "blackwell"), Fp8Recipe.TENSORWISE: ("blackwell",),
                          Fp8Recipe.MXFP8: ("blackwell",), Fp8Recipe.BLOCKWISE: ()}


class DispatcherType(enum.Enum):
    """Megatron-Core --moe-token-dispatcher-type: how MoE tokens reach their experts."""
    ALLTOALL = "alltoall"
    ALLGATHER = "allgather"
    FLEX = "flex"               # DeepEP / HybridEP kernels

    @classmethod
    def parse(cls, text: str, field_name: str = "moe_token_dispatcher_type") -> "DispatcherType":
        return _parse_enum(cls, text, field_name)


class PipelineSchedule(enum.Enum):
    """The pipeline schedule. `1f1b`: Megatron-Core's (interleaved) one-forward-one-backward, a stage
    holds at most pp - rank micro-batches' activations (Narayanan et al. 2021 sec. 2.2). `gpipe`:
    all forwards, then all backwards (Huang et al. 2019; torchtitan --parallelism.pipeline_parallel_schedule
    GPipe, DeepSpeed's PipelineModule without 1F1B): every micro-batch of the step is in flight at the
    end of the forwards. Both have the same bubble, (p - 1) / m of the ideal step."""
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"

    @classmethod
    def parse(cls, text: str, field_name: str = "pipeline_schedule") -> "PipelineSchedule":
        return _parse_enum(cls, text, field_name)


class CudaGraphImpl(enum.Enum):
    """Megatron-Core --cuda-graph-impl (transformer_config.py cuda_graph_impl, default "none"): who captures
    CUDA graphs in training. `local` (MCore CudaGraphManager) and `transformer_engine` (TE
    make_graphed_callables) capture per-layer graphs over the --cuda-graph-modules regions;
    `full_iteration` captures the whole forward-backward of a step (all micro-batches, not the optimizer)."""
    NONE = "none"
    LOCAL = "local"
    TRANSFORMER_ENGINE = "transformer_engine"
    FULL_ITERATION = "full_iteration"

    @classmethod
    def parse(cls, text: str, field_name: str = "cuda_graph_impl") -> "CudaGraphImpl":
        return _parse_enum(cls, text, field_name)

    @property
    def per_layer(self) -> bool:
        return self in (CudaGraphImpl.LOCAL, CudaGraphImpl.TRANSFORMER_ENGINE)


class CudaGraphModule(enum.Enum):
    """Megatron-Core --cuda-graph-modules (formerly --cuda-graph-scope; core/transformer/enums.py
    CudaGraphModule): the regions of a layer a per-layer graph captures; none given = the whole layer.
    attn: TransformerLayer._forward_attention (input norm, attention); mlp: a dense layer's
    _forward_mlp; moe: an MoE layer's _forward_mlp (drop-and-pad MoE only); moe_router: _forward_mlp up
    to MoELayer.router() (pre-MLP norm, router, shared experts unless overlapped); moe_preprocess:
    MoELayer.preprocess() (needs moe_router); mamba: a Mamba layer."""
    ATTN = "attn"
    MLP = "mlp"
    MOE = "moe"
    MOE_ROUTER = "moe_router"
    MOE_PREPROCESS = "moe_preprocess"
    MAMBA = "mamba"

    @classmethod
    def parse(cls, text: str, field_name: str = "cuda_graph_modules") -> "CudaGraphModule":
        return _parse_enum(cls, text, field_name)


class LoraModule(enum.Enum):
    """Megatron-Bridge's LoRA target_modules (peft/lora.py; its default is all four): the linears whose
    frozen weight gets a rank-`lora_dim` adapter. NeMo 1's names (attention_qkv, attention_dense, mlp_fc1,
    mlp_fc2; its default was attention_qkv alone) are read as the same modules."""
    LINEAR_QKV = "linear_qkv"
    LINEAR_PROJ = "linear_proj"
    LINEAR_FC1 = "linear_fc1"
    LINEAR_FC2 = "linear_fc2"

    @classmethod
    def parse(cls, text: str, field_name: str = "lora_target_modules") -> "LoraModule":
        return _parse_enum(cls, _NEMO1_LORA_NAMES.get(str(text).strip().lower(), text), field_name)


_NEMO1_LORA_NAMES = {"attention_qkv": "linear_qkv", "attention_dense": "linear_proj", "mlp_fc1": "linear_fc1",
                     "mlp_fc2": "linear_fc2"}
#: Megatron-Bridge's default LoRA targets
DEFAULT_LORA_MODULES = tuple(LoraModule)


def parse_lora_modules(values) -> tuple:
    """--lora-target-modules values (each may hold several, split at commas or spaces) -> modules in
    canonical order (none given: Megatron-Bridge's default, all four)."""
    names = [n for v in (values or ()) for n in re.split(r"[,\s]+", str(v).strip()) if n]
    if not names:
        if values:                                     # given, but blank: never all four silently
            raise SpecError("lora_target_modules", "names no module; choose from "
                            f"{', '.join(m.value for m in LoraModule)} (or leave it out for all four)")
        return DEFAULT_LORA_MODULES
    mods = {LoraModule.parse(n) for n in names}
    return tuple(m for m in LoraModule if m in mods)


def parse_cuda_graph_modules(values, impl: "CudaGraphImpl") -> tuple:
    """--cuda-graph-modules / the deprecated --cuda-graph-scope values (each may hold several, split at
    commas or spaces) -> (modules in canonical order, impl). Megatron's deprecated spellings
    (core/transformer/cuda_graph_config.py): "full" alone = the whole layer (no modules);
    "full_iteration" = --cuda-graph-impl full_iteration, accepted with impl none, local or full_iteration."""
    names = [n for v in (values or ()) for n in re.split(r"[,\s]+", str(v).strip()) if n]
    if "full" in names:
        if names != ["full"]:
            raise SpecError("cuda_graph_modules", "full (the whole layer) cannot be combined with other modules")
        return (), impl
    if "full_iteration" in names:
        if names != ["full_iteration"]:
            raise SpecError("cuda_graph_modules", "full_iteration cannot be combined with other modules")
        if impl not in (CudaGraphImpl.NONE, CudaGraphImpl.LOCAL, CudaGraphImpl.FULL_ITERATION):
            raise SpecError("cuda_graph_modules", f"full_iteration cannot be combined with "
                            f"cuda_graph_impl={impl.value}; use --cuda-graph-impl full_iteration")
        return (), CudaGraphImpl.FULL_ITERATION
    mods = {CudaGraphModule.parse(n) for n in names}
    return tuple(m for m in CudaGraphModule if m in mods), impl


def _parse_enum(cls, text, field_name: str):
    t = str(text).strip().lower().replace("_", "-")
    for member in cls:
        if member.value == t or member.value == t.replace("-", "_"):
            return member
    raise SpecError(field_name, f"unknown value {text!r}; choose one of {', '.join(m.value for m in cls)}")


#: the most tokens a packed example may have (the largest sequence length accepted anywhere)
MAX_SEQ_TOKENS = 2 ** 24
#: the largest LoRA rank accepted (adapters wider than this are no longer low-rank for any model here)
MAX_LORA_DIM = 65536


@dataclass(frozen=True, kw_only=True)
class FrameworkSpec:
    """How the framework runs the job: Megatron-Core's options, with its names and its defaults
    (megatron/training/arguments.py, core/transformer/transformer_config.py,
    core/distributed/distributed_data_parallel_config.py). These are configuration, not fitted
    efficiencies: calibration never moves them.

    grad_reduce_in_fp32: Megatron-LM keeps fp32 main gradients and all-reduces them in fp32 for
    bf16 training unless --grad-reduce-in-bf16 (arguments.py: accumulate_allreduce_grads_in_fp32);
    Megatron-Bridge / NeMo performance recipes set grad_reduce_in_fp32=False.
    """
    framework: Framework = Framework.MEGATRON
    attention_backend: AttentionBackend = AttentionBackend.AUTO    # --attention-backend
    tp_comm_overlap: bool = False         # --tp-comm-overlap (TE userbuffers; needs SP); off by default
    grad_reduce_in_fp32: bool = True      # off: --grad-reduce-in-bf16
    fp8_param_gather: bool = False        # --fp8-param-gather: fp8 primary weights, fp8 all-gathers
    overlap_grad_reduce: bool = True      # --overlap-grad-reduce (recipes' setting; Megatron default off)
    overlap_param_gather: bool = True     # --overlap-param-gather (distributed optimizer)
    # --no-gradient-accumulation-fusion turns it off (Megatron-LM since 2022: the weight-gradient GEMM
    # accumulates into the fp32 main gradient in its epilogue); off, each micro-batch's gradients are
    # written and then added into the main gradients by a separate kernel, as all 2021 Megatron-LM did
    gradient_accumulation_fusion: bool = True
    # Megatron-LM 2022-24's --no-async-tensor-model-parallel-allreduce; current Megatron-Core has no switch
    # (always asynchronous): the backward input-gradient collective of column-parallel layers runs under
    # their weight-gradient GEMM. False = Megatron-LM of 2021, which waited for it (export refuses it)
    async_tensor_model_parallel_allreduce: bool = True
    moe_token_dispatcher_type: DispatcherType = DispatcherType.ALLTOALL   # --moe-token-dispatcher-type
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B    # Megatron: 1F1B; torchtitan: GPipe too
    # A JAX/XLA trainer that scans over layers (the jax runner; MaxText's gradient accumulation) writes a
    # backward pass's weight gradients, in the weights' dtype and unsharded, into a buffer of their own
    # before adding them to the accumulated (or ZeRO-2/3 reduce-scattered) gradients; Megatron's gradient-
    # accumulation fusion writes into the fp32 main gradients as they are produced (False)
    microbatch_grad_buffer: bool = False
    # --moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity: every expert's buffer holds
    # capacity_factor x (tokens x top-k / experts) slots, filled or not; 0 = dropless (the default)
    moe_expert_capacity_factor: float = 0.0
    # --cuda-graph-impl and --cuda-graph-modules (transformer_config.py; the deprecated name of the
    # second is --cuda-graph-scope, Megatron-Bridge's recipes set model.cuda_graph_scope). Default: no
    # graphs; with a per-layer impl, no modules = the whole layer
    cuda_graph_impl: CudaGraphImpl = CudaGraphImpl.NONE
    cuda_graph_modules: tuple = ()
    # --overlap-moe-expert-parallel-comm (model_parallel_config.py, MCore 0.14 "batch-level overlapping"):
    # the forward of one micro-batch and the backward of another are merged layer by layer, so each one's
    # EP all-to-alls run under the other's compute. Off by default
    overlap_moe_expert_parallel_comm: bool = False
    # --moe-permute-fusion (transformer_config.py; Megatron-Core's default off, TE >= 2.1): Transformer
    # Engine's fused kernels put routed tokens into expert order and back. Unfused, moe_utils.permute
    # gathers with index_select (its backward an atomic index_add_) and unpermute scatter_add_s the
    # weighted expert outputs back (its backward a gather). On here: the NeMo / Megatron-Bridge MoE
    # providers set it (Qwen3, GPT-OSS, DeepSeek), and the exporter emits it
    moe_permute_fusion: bool = True
    # --cross-entropy-loss-fusion (Megatron-Core's default off; Megatron-Bridge's GPTModelProvider sets it on,
    # and its performance scripts pick --cross-entropy-fusion-impl te): the vocab-parallel cross entropy as
    # fused kernels instead of PyTorch ops over an fp32 copy of the logits (compute.LOSS_BYTES_PER_LOGIT).
    # On here: a tuner recommends the fast setting and the exporter emits it. A Megatron-Core option only:
    # Megatron-DeepSpeed always runs the unfused one and an XLA-compiled step fuses its own
    cross_entropy_loss_fusion: bool = True
    cross_entropy_fusion_impl: CrossEntropyImpl = CrossEntropyImpl.NATIVE
    # --fp8-recipe (Megatron-Core's default "delayed"), used when the job trains in fp8
    fp8_recipe: Fp8Recipe = Fp8Recipe.DELAYED
    # TransformerConfig.fp8_dot_product_attention (default off; Megatron-LM's pretrain scripts have no flag for it,
    # Megatron-Bridge sets mixed_precision.fp8_dot_product_attention): Transformer Engine runs the attention
    # core in fp8 on cuDNN's fused kernel (Q, K, V, dO quantized; compute.FP8_MMA_X)
    fp8_dot_product_attention: bool = False
    # Megatron-Bridge's PEFT LoRA(dim=N) (peft/lora.py; NeMo 2's llm.peft.LoRA, the same default dim 32): low-rank
    # adapters of rank N on linear_qkv, linear_proj, linear_fc1 and linear_fc2 (every attention and MLP linear,
    # the experts' included) train, the base weights, embedding and output layer stay frozen: no weight-
    # gradient GEMMs, main gradients, optimizer states or gradient reduction for them. 0 = every weight trains
    lora_dim: int = 0
    lora_target_modules: tuple = DEFAULT_LORA_MODULES
    # Sequence packing (Megatron-Bridge's packed_sequence_specs; NeMo's packed SFT / PEFT datasets): examples of this
    # many tokens on average are concatenated into each sequence and Transformer Engine's fused attention runs on the
    # THD layout with their boundaries (cu_seqlens), so a query attends only inside its own example. 0 = one document
    # per sequence: causal attention over the whole sequence (Megatron's pretraining datasets)
    packed_example_tokens: int = 0
    # --cpu-offloading-num-layers N (Megatron-Core model_parallel_config.py; arguments.py turns --cpu-offloading on
    # for N > 0): Transformer Engine's CPU offload context copies the activations of N transformer layers to host
    # memory after their forward and back before their backward (activations only: Megatron's default
    # cpu_offloading_activations=True, cpu_offloading_weights=False). Megatron-Bridge's Llama-3 70B FSDP recipes use
    # it (20-40 of 80 layers). 0 = off
    cpu_offloading_num_layers: int = 0

    def __post_init__(self):
        cf = self.moe_expert_capacity_factor
        if not isinstance(cf, (int, float)) or isinstance(cf, bool) or not 0.0 <= cf <= 2 ** 16:
            raise SpecError("moe_expert_capacity_factor", f"must be a number >= 0 (0 = dropless), got {cf!r}")
        self._check_cuda_graphs()
        for f in ("tp_comm_overlap", "grad_reduce_in_fp32", "fp8_param_gather", "overlap_grad_reduce",
                  "overlap_param_gather", "microbatch_grad_buffer", "overlap_moe_expert_parallel_comm",
                  "gradient_accumulation_fusion", "async_tensor_model_parallel_allreduce", "moe_permute_fusion",
                  "cross_entropy_loss_fusion", "fp8_dot_product_attention"):
            if not isinstance(getattr(self, f), bool):
                raise SpecError(f, f"must be true or false, got {getattr(self, f)!r}")
        r = self.lora_dim
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r <= MAX_LORA_DIM:
            raise SpecError("lora_dim", f"must be an integer in 0..{MAX_LORA_DIM} (0 = full training), got {r!r}")
        n = self.packed_example_tokens
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_SEQ_TOKENS:
            raise SpecError("packed_example_tokens", f"must be an integer number of tokens in 0..{MAX_SEQ_TOKENS} "
                            f"(0 = no packing), got {n!r}")
        if n and self.framework is not Framework.MEGATRON:
            raise SpecError("packed_example_tokens", f"sequence packing (THD attention) is a Megatron-Core / "
                            f"Megatron-Bridge path; {self.framework.value} has none here: use --framework megatron")
        if n and not self.attention_backend.is_fused:
            raise SpecError("packed_example_tokens", "packed sequences need a fused attention kernel (Transformer "
                            "Engine's THD layout); Megatron's unfused attention takes no example boundaries: use "
                            "attention_backend=flash or fused")
        self._check_cpu_offloading()
        mods = self.lora_target_modules
        if not isinstance(mods, tuple) or not mods or not all(isinstance(m, LoraModule) for m in mods) \
                or len(set(mods)) != len(mods):
            raise SpecError("lora_target_modules", f"must be a non-empty tuple of distinct LoraModule, got {mods!r}")
        if r and self.framework is not Framework.MEGATRON:
            raise SpecError("lora_dim", f"LoRA is Megatron-Bridge's PEFT (a Megatron-Core model); {self.framework.value} "
                            "has none here: use --framework megatron")
        if not isinstance(self.cross_entropy_fusion_impl, CrossEntropyImpl):
            raise SpecError("cross_entropy_fusion_impl",
                            f"must be a CrossEntropyImpl, got {self.cross_entropy_fusion_impl!r}")
        if not isinstance(self.fp8_recipe, Fp8Recipe):
            raise SpecError("fp8_recipe", f"must be an Fp8Recipe, got {self.fp8_recipe!r}")
        if self.fp8_dot_product_attention:
            if self.framework is not Framework.MEGATRON:
                raise SpecError("fp8_dot_product_attention", f"is a Megatron-Core option (Transformer Engine's fp8 "
                                f"attention); {self.framework.value} has none here")
            if self.attention_backend is not AttentionBackend.FUSED:
                raise SpecError("fp8_dot_product_attention", "runs on cuDNN's fused attention only (Transformer "
                                "Engine disables FlashAttention and unfused attention for fp8 training): use "
                                f"attention_backend=fused, got {self.attention_backend.value}")
        if self.moe_token_dispatcher_type is DispatcherType.FLEX and self.moe_expert_capacity_factor > 0:
            raise SpecError("moe_expert_capacity_factor", "the flex dispatcher does not pad experts to a capacity "
                            "(Megatron-Core: \"Flex token dispatcher does not support moe_pad_expert_input_to_capacity\" "
                            "with DeepEP, its default backend); use the alltoall dispatcher or a dropless MoE")
        if self.overlap_moe_expert_parallel_comm:
            if self.framework is not Framework.MEGATRON:
                raise SpecError("overlap_moe_expert_parallel_comm", f"is a Megatron-Core option; {self.framework.value} "
                                "has no batch-level EP overlap here")
            if self.moe_token_dispatcher_type is DispatcherType.ALLGATHER:
                raise SpecError("overlap_moe_expert_parallel_comm", "is supported with the alltoall or flex token "
                                "dispatcher only (Megatron-Core rule), not allgather")

    def _check_cuda_graphs(self) -> None:
        """Megatron's own refusals (transformer_config.py __post_init__, arguments.py validate_args),
        and modules without an impl (Megatron ignores them: "no effect when cuda_graph_impl=none")."""
        impl, mods = self.cuda_graph_impl, self.cuda_graph_modules
        if not isinstance(impl, CudaGraphImpl):
            raise SpecError("cuda_graph_impl", f"must be a CudaGraphImpl, got {impl!r}")
        if not isinstance(mods, tuple) or not all(isinstance(m, CudaGraphModule) for m in mods) \
                or len(set(mods)) != len(mods):
            raise SpecError("cuda_graph_modules", f"must be a tuple of distinct CudaGraphModule, got {mods!r}")
        names = "+".join(m.value for m in mods)
        if mods and impl is CudaGraphImpl.NONE:
            raise SpecError("cuda_graph_modules", f"{names} has no effect with cuda_graph_impl=none (Megatron's "
                            "default); add --cuda-graph-impl transformer_engine or local")
        if mods and impl is CudaGraphImpl.FULL_ITERATION:
            raise SpecError("cuda_graph_modules", f"must be empty with cuda_graph_impl=full_iteration (it captures "
                            f"the whole forward-backward), got {names}")
        if impl is not CudaGraphImpl.NONE and self.framework is not Framework.MEGATRON:
            raise SpecError("cuda_graph_impl", f"{impl.value} is a Megatron-Core option; "
                            f"{self.framework.value} has no CUDA-graph capture here, use none")
        if CudaGraphModule.MOE in mods and CudaGraphModule.MOE_ROUTER in mods:
            raise SpecError("cuda_graph_modules", "must not contain both moe and moe_router (Megatron-Core rule)")
        if impl is CudaGraphImpl.TRANSFORMER_ENGINE and CudaGraphModule.MOE_PREPROCESS in mods \
                and CudaGraphModule.MOE_ROUTER not in mods:
            raise SpecError("cuda_graph_modules", "moe_preprocess is only supported together with moe_router "
                            "(Megatron-Core rule); add moe_router")
        if CudaGraphModule.MOE in mods and self.moe_expert_capacity_factor <= 0:
            raise SpecError("cuda_graph_modules", "moe is only supported with drop-and-pad MoE (Megatron-Core rule): "
                            "set moe_expert_capacity_factor, or capture moe_router+moe_preprocess")
        if (self.moe_token_dispatcher_type is DispatcherType.ALLTOALL and self.moe_expert_capacity_factor > 0
                and CudaGraphModule.MOE_PREPROCESS in mods):
            raise SpecError("cuda_graph_modules", "moe_preprocess cannot be captured with the alltoall dispatcher and "
                            "an expert capacity factor (its preprocess copies to the host; Megatron-Core rule)")

    def _check_cpu_offloading(self) -> None:
        """--cpu-offloading-num-layers: a Megatron-Core option, and Megatron refuses it with per-layer CUDA graphs
        (transformer_config.py: "CUDA graphs not supported with CPU offloading" unless full_iteration)."""
        n = self.cpu_offloading_num_layers
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_SIZE["num_layers"]:
            raise SpecError("cpu_offloading_num_layers", f"must be an integer number of layers in "
                            f"0..{MAX_SIZE['num_layers']} (0 = off), got {n!r}")
        if not n:
            return
        if self.framework is not Framework.MEGATRON:
            raise SpecError("cpu_offloading_num_layers", f"activation CPU offloading is a Megatron-Core option "
                            f"(--cpu-offloading-num-layers); {self.framework.value} has none here: use 0")
        if self.cuda_graph_impl.per_layer:
            raise SpecError("cpu_offloading_num_layers", f"Megatron-Core refuses CPU offloading with per-layer CUDA "
                            f"graphs (cuda_graph_impl={self.cuda_graph_impl.value}); use none or full_iteration")

    def check_cpu_offloading_for(self, model: "ModelSpec") -> None:
        """Megatron-Core offloads fewer layers than the model has (transformer_config.py: "CPU offloading can be
        done only for layers less than num_layers")."""
        n = self.cpu_offloading_num_layers
        if n and n >= model.num_layers:
            raise SpecError("cpu_offloading_num_layers", f"must be less than the model's {model.num_layers} layers "
                            f"(Megatron-Core rule), got {n}")

    def check_cuda_graphs_for(self, model: "ModelSpec") -> None:
        """The modules a model must have for its --cuda-graph-modules (Megatron-Core asserts moe / moe_router
        only for MoE models, mlp only with dense layers; no model here has Mamba layers)."""
        mods = self.cuda_graph_modules
        moe_mods = [m.value for m in mods if m in (CudaGraphModule.MOE, CudaGraphModule.MOE_ROUTER,
                                                   CudaGraphModule.MOE_PREPROCESS)]
        if moe_mods and not model.is_moe:
            raise SpecError("cuda_graph_modules", f"{'+'.join(moe_mods)} capture MoE layers and {model.name} is dense")
        if CudaGraphModule.MLP in mods and model.is_moe and model.num_moe_layers == model.num_layers:
            raise SpecError("cuda_graph_modules", f"mlp captures dense layers and every layer of {model.name} is MoE; "
                            "use moe_router (+moe_preprocess) or moe")
        if CudaGraphModule.MAMBA in mods:
            raise SpecError("cuda_graph_modules", f"mamba captures Mamba layers and {model.name} has none")

    def check_attention_backend_for(self, model: "ModelSpec") -> None:
        """A backend that forces FlashAttention-2 on a model it cannot take: Megatron-Core's flash backend turns
        Transformer Engine's other backends off (NVTE_FUSED_ATTN=0, NVTE_UNFUSED_ATTN=0), so TE finds none and
        raises; Megatron-DeepSpeed's --use-flash-attn-v2 calls flash-attn itself. Under auto Transformer Engine
        falls back to cuDNN's fused attention where FlashAttention-2 cannot run (Ampere; the same modelled rate)."""
        if model.attention_sinks and self.framework is Framework.DEEPSPEED:
            raise SpecError("attention_backend", f"Megatron-DeepSpeed's attention has no sinks (a learnable softmax "
                            f"offset), which {model.name} has; use --framework megatron")
        forced = (self.attention_backend is AttentionBackend.FLASH and self.framework is Framework.MEGATRON) or (
            self.framework is Framework.DEEPSPEED and self.attention_backend.is_fused)
        why = forced and flash_attention_2_refusal(model)
        if why:
            fix = ("use --attention-backend unfused, or --framework megatron with auto" if self.framework is
                   Framework.DEEPSPEED else "use --attention-backend auto or fused (cuDNN)")
            raise SpecError("attention_backend", f"{self.attention_backend.value} runs FlashAttention-2 here, which "
                            f"cannot run {model.name}: {why}; {fix}")

    def check_mtp_for(self, model: "ModelSpec") -> None:
        """Multi-token prediction where the framework runs it: Megatron-Core takes it with RoPE (or no) position
        embeddings only (arguments.py validate_args) and at most one module under batch-level EP overlap
        (transformer_config.py); Megatron-DeepSpeed has none."""
        n = model.mtp_num_layers
        if not n:
            return
        if self.framework is Framework.DEEPSPEED:
            raise SpecError("mtp_num_layers", "Megatron-DeepSpeed has no multi-token prediction; use --mtp-num-layers 0")
        if self.framework is Framework.MEGATRON and model.position_embedding != "rope":
            raise SpecError("mtp_num_layers", f"Megatron-Core runs multi-token prediction with RoPE only; {model.name} "
                            f"uses {model.position_embedding} positions; use --mtp-num-layers 0")
        if self.overlap_moe_expert_parallel_comm and n > 1:
            raise SpecError("mtp_num_layers", f"Megatron-Core runs at most one MTP module with "
                            f"--overlap-moe-expert-parallel-comm, got {n}")

    @property
    def grad_bytes_per_param(self) -> float:
        """Main-gradient buffer bytes per parameter (also the bytes the DP reduction moves)."""
        return 4.0 if self.grad_reduce_in_fp32 else 2.0


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """The training job: what one optimizer step processes, and how the framework runs it."""
    global_batch: int                    # sequences per optimizer step
    seq_len: int                         # tokens per sequence
    precision: Precision = Precision.BF16
    framework: FrameworkSpec = FrameworkSpec()

    def __post_init__(self):
        _positive("global_batch", self.global_batch)
        _positive("seq_len", self.seq_len)
        if self.framework.packed_example_tokens > self.seq_len:
            raise SpecError("packed_example_tokens", f"examples of {self.framework.packed_example_tokens} tokens do not "
                            f"fit in sequences of seq_len={self.seq_len}; give their mean length, at most seq_len")
        if self.framework.fp8_param_gather and self.precision not in (Precision.FP8, Precision.FP4):
            raise SpecError("fp8_param_gather", f"needs fp8 (or fp4) training, got precision={self.precision.value}")
        if self.framework.fp8_dot_product_attention and self.precision is not Precision.FP8:
            raise SpecError("fp8_dot_product_attention", f"needs fp8 training (Transformer Engine has no fused "
                            f"attention for NVFP4), got precision={self.precision.value}")
        if self.framework.overlap_moe_expert_parallel_comm and self.precision is Precision.FP32:
            raise SpecError("overlap_moe_expert_parallel_comm", "is supported with a bf16 or fp16 model only "
                            "(Megatron-Core rule), got precision=fp32")

    @property
    def fp8_recipe(self) -> "Fp8Recipe | None":
        """The fp8 recipe Transformer Engine runs (None unless an eager framework trains in fp8; an
        XLA-compiled step scales its own)."""
        if self.precision is not Precision.FP8 or self.framework.framework is Framework.JAX:
            return None
        return self.framework.fp8_recipe

    @property
    def fp8_attention(self) -> bool:
        """Whether Transformer Engine runs the attention core in fp8 (--fp8-dot-product-attention, fp8 training)."""
        return self.fp8_recipe is not None and self.framework.fp8_dot_product_attention

    def check_fp8_recipe_for(self, gpu: "GPUSpec") -> None:
        """Transformer Engine refuses a recipe the GPU cannot run (quantization.py check_recipe_support), and
        has no fused fp8 attention for a recipe on a GPU outside FP8_ATTENTION_FAMILIES (no backend is left:
        it raises); Megatron-Core gives block scaling no fp8 attention at all."""
        families = FP8_RECIPE_FAMILIES.get(self.fp8_recipe, ())
        if families and gpu.family and gpu.family not in families:
            raise SpecError("fp8_recipe", f"{self.fp8_recipe.value} runs on {' / '.join(families)} GPUs only "
                            f"(Transformer Engine's recipe check); {gpu.name} is {gpu.family}: "
                            "use delayed or tensorwise")
        if not self.fp8_attention:
            return
        families = FP8_ATTENTION_FAMILIES[self.fp8_recipe]
        if not families:
            raise SpecError("fp8_dot_product_attention", f"has no effect with fp8_recipe={self.fp8_recipe.value} "
                            "(Megatron-Core passes no fp8_dpa to block scaling: the attention stays bf16); drop it")
        if gpu.family and gpu.family not in families:
            raise SpecError("fp8_dot_product_attention", f"with fp8_recipe={self.fp8_recipe.value} runs on "
                            f"{' / '.join(families)} GPUs only (Transformer Engine's fused fp8 attention); "
                            f"{gpu.name} is {gpu.family}" + (": use fp8_recipe=delayed" if gpu.family == "hopper" else ""))

    def check_fp8_attention_for(self, model: "ModelSpec", gpu: "GPUSpec") -> None:
        """Transformer Engine runs fp8 attention over a softmax with sinks on cuDNN only from Blackwell and cuDNN 9.21
        on (get_attention_backend v2.16-v2.18: "Disabling FusedAttention for softmax_type in FP8 on sm < 100", and the
        unfused attention for it in fp8 always); before that, or on Hopper, no backend is left."""
        if self.fp8_attention and model.attention_sinks and gpu.family and gpu.family != "blackwell":
            raise SpecError("fp8_dot_product_attention", f"{model.name}'s attention sinks run in fp8 on Blackwell only "
                            f"(Transformer Engine, cuDNN >= 9.21); {gpu.name} is {gpu.family}: drop it")

    @property
    def flash_attention(self) -> bool:
        return self.framework.attention_backend.is_fused

    def attention_kernel(self, gpu: "GPUSpec") -> AttentionKernel:
        """The attention kernel this job runs on the GPU (AttentionBackend.kernel)."""
        return self.framework.attention_backend.kernel(self.framework.framework, gpu.family)

    @property
    def tp_comm_overlap(self) -> bool:
        return self.framework.tp_comm_overlap

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def spec_dict(spec) -> dict:
    """A JSON-ready dict of a spec (enums as their values, nested specs as dicts)."""
    out = {}
    for f in fields(spec):
        v = getattr(spec, f.name)
        if isinstance(v, enum.Enum):
            v = v.value if not isinstance(v, enum.IntEnum) else v.name.lower()
        elif hasattr(v, "__dataclass_fields__"):
            v = spec_dict(v)
        elif isinstance(v, tuple) and all(isinstance(x, enum.Enum) for x in v):
            v = [x.value for x in v]
        out[f.name] = v
    return out
