"""A decoder-only transformer built from a `ModelSpec`: pure functions over a parameter pytree.

Symbols (as in costmodels): b micro-batch, s sequence, h hidden, a heads, g KV heads, d head dim,
f FFN hidden, V vocab, E routed experts, k experts per token, f_e expert FFN hidden, L layers.

Blocks: RMSNorm (Zhang & Sennrich 2019), rotary position embedding (Su et al. 2021, eq. 34),
grouped-query attention (Ainslie et al. 2023), SwiGLU MLP (Shazeer 2020), MoE with softmax top-k
routing renormalised over the k chosen experts (Mixtral / Qwen3 `norm_topk_prob`) and always-on
shared experts (DeepSeekMoE, Dai et al. 2024). Pre-norm residual blocks, untied output head unless
the spec ties them.

Sharding is not decided here: every activation passes through `shard(x, kind)`, a callback that the
runner fills with `jax.lax.with_sharding_constraint` for the plan (identity when unsharded), and the
MoE dispatch goes through `moe_dispatch`, which the runner replaces by an expert-parallel shard_map.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from costmodels.specs import ModelSpec

#: RMSNorm epsilon (Llama / Qwen configs: rms_norm_eps 1e-5 or 1e-6)
RMS_EPS = 1e-5
#: RoPE base frequency (Llama 2: rope_theta 10000)
ROPE_THETA = 10000.0


@dataclass(frozen=True, kw_only=True)
class Dims:
    """The sizes the runner builds (a ModelSpec's, possibly with fewer layers for a proxy run)."""
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    num_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    num_shared_experts: int = 0
    shared_ffn: int = 0
    first_dense_layers: int = 0
    tied_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_spec(cls, spec: ModelSpec, num_layers: int | None = None) -> "Dims":
        return cls(num_layers=num_layers or spec.num_layers, hidden=spec.hidden_size,
                   heads=spec.num_attention_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim_eff,
                   ffn=spec.ffn_hidden_size, vocab=spec.vocab_size, num_experts=spec.num_experts,
                   top_k=spec.experts_per_token, expert_ffn=spec.moe_ffn_hidden_size,
                   num_shared_experts=spec.num_shared_experts,
                   shared_ffn=spec.shared_expert_ffn_hidden_size or spec.moe_ffn_hidden_size,
                   first_dense_layers=0, tied_embeddings=spec.tied_embeddings)


def layer_param_shapes(dm: Dims) -> dict:
    """Shapes of one layer's weights. A MoE model is all-MoE here (first_k_dense_layers are not
    built: the stacked layers of a scan must share one structure)."""
    h, d = dm.hidden, dm.head_dim
    shapes = {"attn_norm": (h,), "wq": (h, dm.heads * d), "wk": (h, dm.kv_heads * d),
              "wv": (h, dm.kv_heads * d), "wo": (dm.heads * d, h), "mlp_norm": (h,)}
    if dm.is_moe:
        e, fe = dm.num_experts, dm.expert_ffn
        shapes.update({"router": (h, e), "e_gate": (e, h, fe), "e_up": (e, h, fe), "e_down": (e, fe, h)})
        if dm.num_shared_experts:
            fs = dm.num_shared_experts * dm.shared_ffn
            shapes.update({"w_gate": (h, fs), "w_up": (h, fs), "w_down": (fs, h)})
    else:
        shapes.update({"w_gate": (h, dm.ffn), "w_up": (h, dm.ffn), "w_down": (dm.ffn, h)})
    return shapes


def init_params(dm: Dims, key: jax.Array, dtype=jnp.float32) -> dict:
    """Parameters with layers stacked on a leading [L] axis: {"embed", "final_norm", "head"?, "layers"}.
    Normal(0, 0.02) weights (GPT-2 / Megatron --init-method-std default), output projections scaled
    by 1/sqrt(2L) (Megatron's scaled_init_method_normal), norms at 1."""
    std = 0.02
    shapes = layer_param_shapes(dm)
    keys = jax.random.split(key, len(shapes) + 2)
    layers = {}
    for i, (name, shp) in enumerate(sorted(shapes.items())):
        full = (dm.num_layers, *shp)
        if name.endswith("norm"):
            layers[name] = jnp.ones(full, dtype)
        else:
            scale = std / math.sqrt(2 * dm.num_layers) if name in ("wo", "w_down", "e_down") else std
            layers[name] = (scale * jax.random.normal(keys[i], full, jnp.float32)).astype(dtype)
    params = {"embed": (std * jax.random.normal(keys[-2], (dm.vocab, dm.hidden), jnp.float32)).astype(dtype),
              "final_norm": jnp.ones((dm.hidden,), dtype), "layers": layers}
    if not dm.tied_embeddings:
        params["head"] = (std * jax.random.normal(keys[-1], (dm.hidden, dm.vocab), jnp.float32)).astype(dtype)
    return params


def no_shard(x, kind):
    return x


def _rms_norm(x, w):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + RMS_EPS)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


#: RMSNorm that keeps only its input for the backward pass and recomputes the rest, as the fused
#: norm kernels Megatron uses do (Apex FusedRMSNormAffineFunction / TE RMSNorm save the input and the
#: per-token 1/rms); without it autodiff would also keep the fp32 upcast and the normalised product
#: (Korthikanti et al. 2022 sec. 4.1 count the norm's input only: 2sbh per norm)
rms_norm = jax.checkpoint(_rms_norm, policy=jax.checkpoint_policies.nothing_saveable)


@jax.custom_vjp
def softmax_keep_output(x):
    """Softmax over the last axis in fp32, returned in x's dtype; the backward pass uses only that
    output, dx = y (dy - sum(dy y)), as Megatron's fused (scaled masked) softmax kernels do: the
    unfused attention keeps one s x s tensor per head, the softmax output, in the activation dtype
    (Korthikanti et al. 2022 sec. 4.1: 2as^2b bytes; the other 3as^2b of their 5as/h are dropout's)."""
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def _softmax_fwd(x):
    y = softmax_keep_output(x)
    return y, y


def _softmax_bwd(y, dy):
    y32, dy32 = y.astype(jnp.float32), dy.astype(jnp.float32)
    return ((y32 * (dy32 - jnp.sum(dy32 * y32, axis=-1, keepdims=True))).astype(y.dtype),)


softmax_keep_output.defvjp(_softmax_fwd, _softmax_bwd)


def rope(x, positions):
    """Rotary embedding on the last axis of x [b, s, heads, d] (halves rotated, as in Llama/NeoX)."""
    d = x.shape[-1]
    inv = ROPE_THETA ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    ang = positions[:, None].astype(jnp.float32) * inv[None, :]          # [s, d/2]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def unfused_attention(q, k, v):
    """Causal softmax(q k^T / sqrt(d)) v with grouped KV heads, the s x s scores materialised (Megatron's
    unfused core attention: baddbmm, masked softmax, bmm): what backward keeps is q, k, v and the
    softmax output. The r = a/g query heads of a KV group are folded into the rows, [b, g, r*s, s], the
    shape both of the softmax output's consumers (the value bmm and its gradient) read: with [b, g, r, s, s]
    XLA's CPU fusion wrote a re-materialized softmax output twice, once per shape (full recompute: 0.26 MB
    of the tiny model's 6.24 MB peak)."""
    b, s, a, d = q.shape
    g = k.shape[2]
    r = a // g
    qg = jnp.transpose(q.reshape(b, s, g, r, d), (0, 2, 3, 1, 4)).reshape(b, g, r * s, d)
    scores = jnp.einsum("bgqd,bkgd->bgqk", qg, k) / jnp.asarray(math.sqrt(d), q.dtype)
    causal = jnp.tile(jnp.arange(s)[:, None] >= jnp.arange(s)[None, :], (r, 1))
    probs = softmax_keep_output(jnp.where(causal, scores, jnp.asarray(-1e30, jnp.float32).astype(q.dtype)))
    out = jnp.einsum("bgqk,bkgd->bgqd", probs, v).reshape(b, g, r, s, d)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, a, d)


def attention_core(q, k, v, implementation: str = "xla"):
    """Causal softmax(q k^T / sqrt(d)) v with grouped KV heads: q [b,s,a,d], k/v [b,s,g,d].
    "xla" materialises the s x s scores (unfused attention); "cudnn" is cuDNN's fused (flash)
    attention kernel, GPU only."""
    if implementation == "xla":
        return unfused_attention(q, k, v)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def ring_attention_block(q, k, v, *, axis: str, axis_size: int):
    """Causal ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Megatron
    CP without load balancing) inside shard_map: this rank holds sequence block r of q, k, v; K/V blocks
    travel around the ring with ppermute while an online softmax (Milakov & Gimelshein 2018) folds in
    one block per hop. The diagonal block comes first, so every query row has a finite running max
    before fully masked blocks arrive."""
    b, sq, a, d = q.shape
    g = k.shape[2]
    r = jax.lax.axis_index(axis)
    qg = q.reshape(b, sq, g, a // g, d)
    qpos = r * sq + jnp.arange(sq)
    m = jnp.full((b, g, a // g, sq), -1e30, jnp.float32)
    l = jnp.zeros((b, g, a // g, sq), jnp.float32)
    o = jnp.zeros((b, sq, g, a // g, d), jnp.float32)
    perm = [(j, (j + 1) % axis_size) for j in range(axis_size)]
    for i in range(axis_size):
        kpos = ((r - i) % axis_size) * sq + jnp.arange(sq)
        s = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k).astype(jnp.float32) / math.sqrt(d)
        s = jnp.where(qpos[:, None] >= kpos[None, :], s, -1e30)
        # the running max only keeps exp() finite: the output does not depend on it, so it takes no
        # gradient (as in flash attention); differentiating it would keep an s x s f32 indicator of
        # the max's location per hop beside the probabilities
        m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1)))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=-1)
        o = (o * jnp.moveaxis(alpha, -1, 1)[..., None]
             + jnp.einsum("bgrqk,bkgd->bqgrd", p.astype(v.dtype), v).astype(jnp.float32))
        m = m_new
        if i + 1 < axis_size:
            k = jax.lax.ppermute(k, axis, perm)
            v = jax.lax.ppermute(v, axis, perm)
    out = o / jnp.moveaxis(l, -1, 1)[..., None]
    return out.reshape(b, sq, a, d).astype(q.dtype)


#: silu(gate) * up keeping only its inputs (the fc1 outputs) for backward, as Megatron's fused
#: bias_swiglu autograd function does; the product is kept once more as fc2's input [K22 sec. 4.1]
@jax.custom_vjp
def swiglu_act(gate, up):
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu_act(gate, up), (gate, up)


def _swiglu_bwd(res, dy):
    gate, up = res
    g32, u32, dy32 = gate.astype(jnp.float32), up.astype(jnp.float32), dy.astype(jnp.float32)
    sig = jax.nn.sigmoid(g32)
    d_gate = dy32 * u32 * sig * (1.0 + g32 * (1.0 - sig))          # d silu(x) / dx = s (1 + x (1 - s))
    return d_gate.astype(gate.dtype), (dy32 * g32 * sig).astype(up.dtype)


swiglu_act.defvjp(_swiglu_fwd, _swiglu_bwd)


def swiglu(x, w_gate, w_up, w_down, shard=no_shard):
    hid = shard(swiglu_act(x @ w_gate, x @ w_up), "ffn")
    return hid @ w_down


def route(x_tokens, router, top_k):
    """Softmax router, top-k, weights renormalised over the chosen experts: ([T,k] gates, [T,k] ids)."""
    probs = jax.nn.softmax((x_tokens @ router).astype(jnp.float32), axis=-1)
    gates, ids = jax.lax.top_k(probs, top_k)
    return (gates / jnp.sum(gates, axis=-1, keepdims=True)), ids


@jax.custom_vjp
def weighted_swiglu_act(gate, up, prob):
    """prob * silu(gate) * up, the router probability of each expert slot applied inside the experts'
    activation, keeping only the fc1 outputs and the probabilities for backward: Megatron-Core's
    TEGroupedMLP with `weighted_bias_swiglu_impl` (megatron/core/transformer/moe/experts.py,
    fused_weighted_bias_swiglu), so the combine (unpermute without probs) keeps nothing."""
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32) * prob[..., None]).astype(gate.dtype)


def _wswiglu_fwd(gate, up, prob):
    return weighted_swiglu_act(gate, up, prob), (gate, up, prob)


def _wswiglu_bwd(res, dy):
    gate, up, prob = res
    g32, u32, dy32 = gate.astype(jnp.float32), up.astype(jnp.float32), dy.astype(jnp.float32)
    sig = jax.nn.sigmoid(g32)
    act = g32 * sig * u32                                          # silu(gate) * up, recomputed
    dact = dy32 * prob[..., None]
    d_gate = dact * u32 * sig * (1.0 + g32 * (1.0 - sig))
    return d_gate.astype(gate.dtype), (dact * g32 * sig).astype(up.dtype), jnp.sum(dy32 * act, axis=-1).astype(prob.dtype)


weighted_swiglu_act.defvjp(_wswiglu_fwd, _wswiglu_bwd)


def experts_local(buf, prob, e_gate, e_up, e_down):
    """SwiGLU of each expert on its token buffer, weighted by each slot's router probability:
    buf [E, C, h], prob [E, C] -> [E, C, h]."""
    hid = weighted_swiglu_act(jnp.einsum("ech,ehf->ecf", buf, e_gate), jnp.einsum("ech,ehf->ecf", buf, e_up), prob)
    return jnp.einsum("ecf,efh->ech", hid, e_down)


def moe_permute(x_tokens, router, *, num_experts, top_k):
    """Route T tokens [T, h] and scatter each (token, choice) and its gate into per-expert buffers
    [E, C=T, h] and [E, C] (an expert sees a token at most once, so every slot is written at most once
    and the scatter is a linear add). Returns (buffer, probabilities, expert ids [T, k], slots [T, k])."""
    t, h = x_tokens.shape
    gates, ids = route(x_tokens, router, top_k)
    flat_ids = ids.reshape(-1)
    onehot = jax.nn.one_hot(flat_ids, num_experts, dtype=jnp.int32)                  # [T*k, E]
    pos = (jnp.cumsum(onehot, axis=0) - 1)[jnp.arange(t * top_k), flat_ids]          # slot in its expert
    tok = jnp.repeat(jnp.arange(t), top_k)
    buf = jnp.zeros((num_experts, t, h), x_tokens.dtype).at[flat_ids, pos].add(x_tokens[tok], unique_indices=True)
    prob = jnp.zeros((num_experts, t), jnp.float32).at[flat_ids, pos].add(gates.reshape(-1), unique_indices=True)
    return buf, prob, ids, pos.reshape(t, top_k)


def moe_unpermute(out_buf, ids, pos, dtype):
    """Gather each token's k expert outputs [E, C, h] -> [T, h] and sum them (the gates were applied in
    the experts: Megatron-Core's unpermute without probs keeps nothing for backward)."""
    picked = out_buf[ids, pos]                                                       # [T, k, h]
    return jnp.sum(picked.astype(jnp.float32), axis=1).astype(dtype)


def moe_tokens(x_tokens, router, e_gate, e_up, e_down, *, num_experts, top_k):
    """Dropless top-k MoE of T tokens [T, h] on one device: permute, experts (the gates applied in their
    activation, as Megatron-Core does), unpermute. The expert-parallel runner splits the same steps
    around two all_to_alls."""
    buf, prob, ids, pos = moe_permute(x_tokens, router, num_experts=num_experts, top_k=top_k)
    return moe_unpermute(experts_local(buf, prob, e_gate, e_up, e_down), ids, pos, x_tokens.dtype)


def moe_block(x, p, dm: Dims, moe_dispatch=None):
    """x [b, s, h] -> routed experts (+ shared experts added by the caller)."""
    if moe_dispatch is not None:
        return moe_dispatch(x, p["router"], p["e_gate"], p["e_up"], p["e_down"])
    b, s, h = x.shape
    y = moe_tokens(x.reshape(b * s, h), p["router"], p["e_gate"], p["e_up"], p["e_down"],
                   num_experts=dm.num_experts, top_k=dm.top_k)
    return y.reshape(b, s, h)


def layer(x, p, positions, dm: Dims, *, shard=no_shard, recompute: str = "none", moe_dispatch=None,
          attention: str = "xla", attention_fn=None):
    """One pre-norm block. recompute="selective" recomputes the attention core in backward (only its
    inputs q, k, v are saved: Korthikanti et al. 2022 sec. 4.2); "full" is applied by the caller."""
    b, s, _ = x.shape
    hn = shard(rms_norm(x, p["attn_norm"]), "hidden_full")
    q = shard((hn @ p["wq"]).reshape(b, s, dm.heads, dm.head_dim), "heads")
    k = shard((hn @ p["wk"]).reshape(b, s, dm.kv_heads, dm.head_dim), "heads")
    v = shard((hn @ p["wv"]).reshape(b, s, dm.kv_heads, dm.head_dim), "heads")
    q, k = rope(q, positions), rope(k, positions)
    if attention_fn is None:
        k, v = shard(k, "kv_full"), shard(v, "kv_full")      # context parallel without a ring: all-gather K/V
    core = attention_fn or partial(attention_core, implementation=attention)
    if recompute == "selective":
        core = jax.checkpoint(core, policy=jax.checkpoint_policies.nothing_saveable)
    att = shard(core(q, k, v), "heads").reshape(b, s, dm.heads * dm.head_dim)
    x = shard(x + att @ p["wo"], "hidden")
    hn = shard(rms_norm(x, p["mlp_norm"]), "hidden_full")
    if dm.is_moe:
        y = moe_block(hn, p, dm, moe_dispatch)
        if dm.num_shared_experts:
            y = y + swiglu(hn, p["w_gate"], p["w_up"], p["w_down"], shard)
    else:
        y = swiglu(hn, p["w_gate"], p["w_up"], p["w_down"], shard)
    return shard(x + y, "hidden")


def regather_policy(gather_shardings) -> Callable[..., bool]:
    """The jax.checkpoint policy of a ZeRO-3 layer: save everything for backward except the all-gathered
    weights, which the backward pass gathers again from the shards (Rajbhandari et al. 2020 sec. 5.3;
    torch FSDP's reshard_after_forward, Megatron-FSDP, DeepSpeed ZeRO-3 free a layer's gathered weights
    after its forward). The gather is the `with_sharding_constraint` of a shard to one of
    `gather_shardings` (the compute specs of the layer's weights; no activation has one: theirs all
    split the batch), so that constraint is what must not be saved: refusing only a name put on its
    output would save the constraint's output instead (the name is then recomputed from it). jax 0.10's
    `save_anything_except_these_names` cannot be used either: it saves everything (its body is
    `return True`)."""
    refused = tuple(gather_shardings)

    def saveable(prim, *_, **params):          # the primitive by its public name (no private import)
        return not (prim.name == "sharding_constraint" and any(params.get("sharding") == g for g in refused))
    return saveable


def layers_scan(x, layer_params, positions, dm: Dims, *, shard=no_shard, recompute="none",
                moe_dispatch=None, cast=None, attention="xla", attention_fn=None, regather=None):
    """Run a stack of layers ([n, ...] leading axis) with lax.scan. `cast(p)` turns a layer's stored
    weights into compute weights (bf16 cast, and the ZeRO-3 all-gather) inside the scan, so gathered
    weights live one layer at a time. `regather` (ZeRO-3: `regather_policy(...)`) checkpoints each
    layer with that policy, so the backward pass gathers the weights again instead of keeping every
    layer's gathered copy in the scan's residual stack."""
    def run(h_, p_):
        if cast is not None:
            p_ = cast(p_)
        return layer(h_, p_, positions, dm, shard=shard, recompute=recompute, moe_dispatch=moe_dispatch,
                     attention=attention, attention_fn=attention_fn)

    def body(h, p):
        fn = run
        if recompute == "full":
            fn = jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
        elif regather is not None:
            fn = jax.checkpoint(fn, policy=regather)
        return fn(h, p), None
    x, _ = jax.lax.scan(body, x, layer_params)
    return x


def embed(tokens, params, shard=no_shard, dtype=jnp.float32):
    return shard(jnp.take(params["embed"].astype(dtype), tokens, axis=0), "hidden")


def head_loss(x, targets, params, shard=no_shard, dtype=jnp.float32):
    """Mean token cross-entropy of the final norm + output head, logits in fp32."""
    x = shard(rms_norm(x, params["final_norm"].astype(dtype)), "hidden_full")
    w = params["head"] if "head" in params else params["embed"].T
    logits = shard((x @ w.astype(dtype)).astype(jnp.float32), "logits")
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - gold)


def head_loss_rows(x, targets, final_norm, head_rows, shard=no_shard):
    """`head_loss` with the output layer stored as rows [V, h] (the pipeline's last stage keeps it in its
    slot of the embedding-shaped "ends" stack) and the weights already in the compute dtype: the logits
    contract `head_rows` as stored, so the backward pass needs the weight itself, not a transposed copy."""
    x = shard(rms_norm(x, final_norm), "hidden_full")
    logits = shard(jnp.einsum("bsh,vh->bsv", x, head_rows).astype(jnp.float32), "logits")
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - gold)


def reference_loss(params, tokens, targets, dm: Dims, recompute="none", dtype=jnp.float32):
    """The unsharded model: one device, the whole batch at once (the equivalence tests' oracle)."""
    positions = jnp.arange(tokens.shape[1])
    cast = lambda p: jax.tree.map(lambda w: w.astype(dtype), p)                          # noqa: E731
    x = embed(tokens, params, dtype=dtype)
    x = layers_scan(x, params["layers"], positions, dm, recompute=recompute, cast=cast)
    return head_loss(x, targets, params, dtype=dtype)
