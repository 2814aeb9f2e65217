"""FLOPs per optimizer step: model FLOPs (useful work, for MFU) and hardware FLOPs (with the
recomputation forward, for HFU).

Source: [N21] Narayanan et al. 2021, eq. 3 generalized: 2 FLOPs per parameter per token forward for
every GEMM (GQA, gated MLPs, top-k experts, shared experts and the router counted by their weights),
causal attention 2 * (s/2) * a * (d_qk + d_v) per token and layer forward (a sliding-window layer: the
mask's w(w+1)/2 + (s-w)w visible pairs per sequence, as Megatron-Bridge's GPT-OSS FLOPs count them), the
output layer 2hV (per MTP module a layer, a 2h x h projection and the output layer once more); backward = 2x
forward. Full recomputation replays the layers' forward, selective the --recompute-modules it names.
LoRA (frozen base weights) skips the weight-gradient half of every GEMM's backward: 4 FLOPs per parameter per
token, as NeMo's performance tables count LoRA runs (the adapters' FLOPs, well under 1 %, are left out).
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from .compute import Shapes


class LayerFlops(NamedTuple):
    """Forward FLOPs per token of one layer."""
    dense: object
    moe: object
    core_attention: object


def attended_keys_per_query(M: dict, J: dict):
    """Keys each query attends to, averaged over the layers: s/2 causal, w - w(w-1)/(2s) in a window of
    w < s keys (the mask's visible pairs per sequence / s), (L+1)/2 in packed examples of L tokens."""
    s, w = J["seq_len"], M["window"]
    in_window = jnp.where((w > 0) & (w < s), w - w * (w - 1.0) / (2.0 * s), s / 2.0)
    # packed examples of L tokens: each one's own L(L+1)/2 visible pairs, (L+1)/2 per query
    L = J["packed_tokens"]
    causal = jnp.where(L > 0, jnp.minimum((L + 1.0) / 2.0, s / 2.0), s / 2.0)
    return causal + M["window_layer_frac"] * (jnp.minimum(in_window, causal) - causal)


def layer_flops(S: Shapes, M: dict, J: dict) -> LayerFlops:
    h = M["hidden"]
    proj = 2.0 * M["attn_params"]
    core = 2.0 * attended_keys_per_query(M, J) * M["heads"] * (M["qk_head_dim"] + M["v_head_dim"])
    dense = proj + core + 2.0 * M["dense_mlp_params"]
    moe = proj + core + 2.0 * (M["top_k"] * M["expert_params"] + M["shared_ffn"] * h * (2.0 + M["gated"])
                               + M["router_params"])
    return LayerFlops(dense, moe, core)


def full_attention_extra_per_token(M: dict, J: dict, passes=3.0):
    """FLOPs per token a count with full (non-causal) attention scores adds to this module's causal one: the causal
    core once more in every pass over it (forward and backward: 3; with the recomputation forward: 4) of every
    layer. NVIDIA's formulas counted attention that way until 2025 (Megatron-LM num_floating_point_operations: the
    s/h term, halved for the causal mask in 8873b55d6a, 2025-03-06; NeMo's flops_formulas 12 s/h before their
    causal_self_attn factor; [N21] eq. 3's s/6h, 4 passes)."""
    return passes * (M["layers"] + M["mtp_layers"]) * layer_flops(None, M, J).core_attention


def step_flops(S: Shapes, M: dict, J: dict, recomputed_share):
    """(model FLOPs, hardware FLOPs) per step; `recomputed_share` is the share of layers that full
    recomputation replays."""
    lf = layer_flops(S, M, J)
    fm, h_ = S.frac_moe, M["hidden"]
    per_layer = (1.0 - fm) * lf.dense + fm * lf.moe
    tokens = J["global_batch"] * J["seq_len"]
    core = lf.core_attention
    gemm_passes = 3.0 - J["lora"]                  # forward, input gradient, weight gradient (frozen: none)
    # each MTP module: a layer of the last layer's kind, its 2h -> h projection and one more pass through the
    # output layer (Megatron-LM num_floating_point_operations: logits x (1 + mtp_num_layers); its norms' 3h left out)
    mtp_layer = M["mtp_moe"] * lf.moe + (1.0 - M["mtp_moe"]) * lf.dense
    mtp = M["mtp_layers"] * (gemm_passes * (mtp_layer - core + 4.0 * h_ * h_) + 3.0 * core)
    model = (M["layers"] * (gemm_passes * (per_layer - core) + 3.0 * core) + mtp
             + gemm_passes * 2.0 * M["hidden"] * M["vocab"] * (1.0 + M["mtp_layers"])) * tokens
    r = S.rec_mod
    shared = 2.0 * M["shared_ffn"] * h_ * (2.0 + M["gated"])
    selective = (r.core_attn * lf.core_attention + (1.0 - fm) * r.mlp * 2.0 * M["dense_mlp_params"]
                 + fm * (r.moe * (lf.moe - lf.dense + 2.0 * M["dense_mlp_params"])
                         + (1.0 - r.moe) * r.shared_experts * shared))
    replay = (M["layers"] + M["mtp_layers"]) * (recomputed_share * per_layer + selective)
    return model, model + replay * tokens
