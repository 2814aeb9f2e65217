"""The model of `runner.model` sharded on a device mesh by a `Plan`, with its training step.

Mesh axes, outermost first (Megatron's rank order: TP innermost, then CP, EP/DP, PP outermost):
("pp", "dp", "ep", "cp", "tp"); the data-parallel group is ("dp", "ep") (EP folds into DP, so
dp_mesh = plan.dp / plan.ep). Sharding is GSPMD (`with_sharding_constraint`), except the MoE
token exchange, which is an explicit `shard_map` with two `all_to_all`s over "ep".

* TP, Megatron-style (Shoeybi et al. 2019 sec. 3): wq/wk/wv and the MLP's gate/up column-parallel,
  wo and down row-parallel, vocab-parallel embedding and head. SP (Korthikanti et al. 2022 sec.
  4.2.2): the residual stream is sharded over tp on the sequence between blocks.
* DP: the batch over ("dp", "ep"); ZeRO-1 shards the fp32 master weights and Adam moments over it,
  ZeRO-2 also the accumulated gradients, ZeRO-3 keeps no full bf16 copy and gathers each layer's
  weights inside the layer scan, and again in its backward (Rajbhandari et al. 2020).
* CP: the sequence over "cp" in cp contiguous blocks; ring attention (shard_map, K/V blocks sent
  around the ring with ppermute, online softmax). No load balancing: a rank still computes the
  fully masked blocks (Megatron's 2*cp zig-zag split would skip them).
* EP: expert weights over "ep"; tokens sent to their experts' ranks with all_to_all and back.
* PP: layers over "pp" as [pp, L/pp] stacks, GPipe schedule (Huang et al. 2019): each tick every
  stage runs its layers on its buffer (vmap with spmd_axis_name="pp"), then the buffers shift one
  stage (a collective permute); pp - 1 bubble ticks. The forward and backward are written out: each
  stage stores the residuals of its `jax.vjp` in m slots, one per micro-batch (GPipe's memory, not
  1F1B's; bubble ticks store nothing), and the backward ticks run in reverse on them. The embedding
  and the output layer are one [pp, V, h] stack over "pp": the first rank holds the embedding, the
  last the output layer, and only the last computes a loss that counts. vpp > 1: [pp, vpp, L/(pp vpp)]
  stacks in Megatron's interleaved placement (stage s holds chunks s, s + pp, ...), run as vpp GPipe
  passes round the ring.
* Recompute: "selective" checkpoints the attention core, "full" whole layers (jax.checkpoint with
  nothing_saveable).
* Gradient accumulation over micro-batches (lax.scan) without PP (one backward pass when m = 1); AdamW
  (Loshchilov & Hutter 2019) on fp32 master weights; compute in `compute_dtype` (bf16 by default; in fp32
  the weights are the master weights, no second copy).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from costmodels.plan import Plan
from costmodels.specs import Recompute

from . import model as M

MESH_AXES = ("pp", "dp", "ep", "cp", "tp")
BATCH = ("dp", "ep")

#: AdamW hyper-parameters (Llama 2 paper sec. 2.2: beta2 0.95, eps 1e-5 there; weight decay 0.1)
ADAM_B1, ADAM_B2, ADAM_EPS, WEIGHT_DECAY = 0.9, 0.95, 1e-8, 0.1


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """What one run builds: the model sizes, the plan and the batch of one optimizer step."""
    dims: M.Dims
    plan: Plan
    seq_len: int
    global_batch: int                 # sequences per optimizer step
    compute_dtype: str = "bfloat16"
    learning_rate: float = 1e-3
    attention: str = "xla"            # "xla" (unfused, any device) or "cudnn" (fused, GPU)

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch // (self.plan.dp * self.plan.mbs)

    @property
    def recompute(self) -> str:
        return {Recompute.NONE: "none", Recompute.SELECTIVE: "selective", Recompute.FULL: "full"}[self.plan.recompute]


def unsupported_reason(shape: RunShape) -> str | None:
    """None when the runner can build this plan, else a one-line reason."""
    p, dm, s = shape.plan, shape.dims, shape.seq_len
    checks = [
        (p.etp == 1, f"etp={p.etp}: expert tensor parallelism is not implemented in the jax runner"),
        (not (p.first_layers or p.last_layers or p.layout), "uneven pipeline splits are not implemented in the jax runner"),
        (p.recompute_layers == 0, "recompute_layers (block recomputation) is not implemented in the jax runner"),
        (p.ep == 1 or dm.is_moe, f"ep={p.ep} needs a MoE model"),
        (p.dp % p.ep == 0, f"ep={p.ep} must divide dp={p.dp} in the jax runner (EP folds into DP only)"),
        (not dm.is_moe or dm.num_experts % p.ep == 0, f"ep={p.ep} must divide num_experts={dm.num_experts}"),
        (dm.num_layers % (p.pp * p.vpp) == 0, f"pp*vpp={p.pp * p.vpp} must divide the {dm.num_layers} layers built"),
        (dm.heads % p.tp == 0 and dm.kv_heads % p.tp == 0,
         f"tp={p.tp} must divide heads={dm.heads} and kv_heads={dm.kv_heads}"),
        (dm.vocab % p.tp == 0, f"tp={p.tp} must divide vocab={dm.vocab}"),
        (s % (p.cp * (p.tp if (p.sp or dm.is_moe) else 1)) == 0,
         f"seq_len={s} must be divisible by cp*tp={p.cp * p.tp} (sequence parallel / MoE tokens)"),
        (shape.global_batch % (p.dp * p.mbs) == 0,
         f"global_batch={shape.global_batch} must be a multiple of dp*mbs={p.dp * p.mbs}"),
    ]
    for ok, reason in checks:
        if not ok:
            return reason
    return None


def make_mesh(plan: Plan, devices) -> Mesh:
    shape = (plan.pp, plan.dp // plan.ep, plan.ep, plan.cp, plan.tp)
    return Mesh(np.asarray(devices[:int(np.prod(shape))]).reshape(shape), MESH_AXES)


# ------------------------------------------------------------------------------------------------
# Partition specs
# ------------------------------------------------------------------------------------------------

def activation_specs(sp: bool) -> dict:
    """Spec of each named activation kind of `model.layer` (per stage; vmap adds "pp")."""
    seq = ("cp", "tp") if sp else "cp"
    return {"hidden": P(BATCH, seq, None), "hidden_full": P(BATCH, "cp", None),
            "heads": P(BATCH, "cp", "tp", None), "kv_full": P(BATCH, None, "tp", None),
            "ffn": P(BATCH, "cp", "tp"), "logits": P(BATCH, "cp", "tp")}


#: compute-time spec of each weight (without the stacked-layer axes): column / row parallel
_WEIGHT_SPECS = {"attn_norm": P(None), "mlp_norm": P(None), "final_norm": P(None),
                 "wq": P(None, "tp"), "wk": P(None, "tp"), "wv": P(None, "tp"), "wo": P("tp", None),
                 "w_gate": P(None, "tp"), "w_up": P(None, "tp"), "w_down": P("tp", None),
                 "router": P(None, None), "e_gate": P("ep", None, None), "e_up": P("ep", None, None),
                 "e_down": P("ep", None, None), "embed": P("tp", None), "head": P(None, "tp"),
                 "ends": P("tp", None)}


def zero_spec(name: str, spec: P, shape: tuple, plan: Plan) -> P:
    """Shard a weight over the data-parallel group on its first free dimension that divides evenly
    (expert weights, already split over "ep", over "dp" only); unchanged when none does."""
    group = ("dp",) if name.startswith("e_") else BATCH
    size = plan.dp // plan.ep if name.startswith("e_") else plan.dp
    if size == 1:
        return spec
    parts = list(spec) + [None] * (len(shape) - len(spec))
    for i, (dim, ax) in enumerate(zip(shape, parts)):
        if ax is None and dim % size == 0:
            parts[i] = group if len(group) > 1 else group[0]
            return P(*parts)
    return spec


def _prefix(plan: Plan) -> tuple:
    if plan.pp == 1:
        return (None,)
    return ("pp", None, None) if plan.vpp > 1 else ("pp", None)


def param_specs(params: dict, plan: Plan, zero: bool) -> dict:
    """Specs of the stored parameter pytree (layers stacked [L] or [pp, L/pp])."""
    pre = _prefix(plan)

    def one(name, arr, stacked):
        base = _WEIGHT_SPECS[name]
        n = len(pre) if stacked else 0
        spec = P(*pre, *base) if stacked else base
        if zero:
            inner = zero_spec(name, base, arr.shape[n:], plan)
            spec = P(*pre, *inner) if stacked else inner
        return spec

    out = {k: one(k, v, False) for k, v in params.items() if k not in ("layers", "ends")}
    out["layers"] = {k: one(k, v, True) for k, v in params["layers"].items()}
    if "ends" in params:                 # [pp, V, h]: one stage's slot per pipeline rank
        base = zero_spec("ends", _WEIGHT_SPECS["ends"], params["ends"].shape[1:], plan) if zero \
            else _WEIGHT_SPECS["ends"]
        out["ends"] = P("pp", *base)
    return out


def stack_for_pipeline(params: dict, plan: Plan) -> dict:
    """Layers [L] -> [pp, L/pp] (stage s: layers s*L/pp ...), or with vpp > 1 -> [pp, vpp, L/(pp*vpp)]
    in Megatron's interleaved placement: stage s holds model chunks s, s + pp, s + 2 pp, ...
    The embedding and the output layer become one [pp, V, h] stack sharded over "pp" ("ends"): the
    first stage's slot holds the embedding, the last stage's the output layer as rows (head^T; with
    tied embeddings a copy of the embedding, as Megatron keeps one on the last stage), the middle
    stages' slots are zeros (an SPMD program gives every rank buffers of one shape)."""
    if plan.pp == 1:
        return params
    embed = params["embed"]
    rows = embed if "head" not in params else params["head"].T
    ends = jnp.stack([embed] + [jnp.zeros_like(embed)] * (plan.pp - 2) + [rows])
    params = {**{k: v for k, v in params.items() if k not in ("embed", "head")}, "ends": ends}
    if plan.vpp == 1:
        lay = {k: v.reshape(plan.pp, v.shape[0] // plan.pp, *v.shape[1:]) for k, v in params["layers"].items()}
    else:
        per = plan.pp * plan.vpp
        lay = {k: jnp.swapaxes(v.reshape(plan.vpp, plan.pp, v.shape[0] // per, *v.shape[1:]), 0, 1)
               for k, v in params["layers"].items()}
    return {**params, "layers": lay}


def unstack_pipeline(params: dict, tied: bool = False) -> dict:
    """The inverse of stack_for_pipeline: layers back to [L] in model order, the embedding (and the
    output layer unless `tied`) out of the "ends" stack."""
    if "ends" in params:
        ends = params["ends"]
        params = {**{k: v for k, v in params.items() if k != "ends"}, "embed": ends[0],
                  **({} if tied else {"head": ends[-1].T})}
    extra = params["layers"]["attn_norm"].ndim - 1        # stacked axes: 1 (L), 2 (pp, L/pp), 3 (pp, vpp, .)
    if extra == 1:
        return params
    if extra == 2:
        lay = {k: v.reshape(-1, *v.shape[2:]) for k, v in params["layers"].items()}
    else:
        lay = {k: jnp.swapaxes(v, 0, 1).reshape(-1, *v.shape[3:]) for k, v in params["layers"].items()}
    return {**params, "layers": lay}


# ------------------------------------------------------------------------------------------------
# The sharded model and its training step
# ------------------------------------------------------------------------------------------------

class ShardedModel:
    """Holds the mesh, the specs and the jitted init / train step of one RunShape."""

    def __init__(self, shape: RunShape, devices):
        reason = unsupported_reason(shape)
        if reason:
            raise ValueError(reason)
        self.shape, self.plan, self.dm = shape, shape.plan, shape.dims
        self.mesh = make_mesh(shape.plan, devices)
        self.cdt = jnp.dtype(shape.compute_dtype)
        self.act = activation_specs(shape.plan.sp)
        abstract = jax.eval_shape(lambda k: stack_for_pipeline(M.init_params(self.dm, k), self.plan),
                                  jax.random.key(0))
        z = shape.plan.zero
        # fp32 training keeps no separate master copy: the weights are the optimizer's parameters
        # (Megatron-LM's FP32Optimizer; its distributed optimizer shards views of the fp32 params)
        self.separate_master = not (self.cdt == jnp.float32 and z < 3)
        self.compute_specs = param_specs(abstract, self.plan, zero=False)
        self.master_specs = param_specs(abstract, self.plan, zero=z >= 1)
        self.grad_specs = param_specs(abstract, self.plan, zero=z >= 2)
        self.state_specs = {"m": self.master_specs, "v": self.master_specs, "step": P()}
        if self.separate_master:
            self.state_specs["master"] = self.master_specs
        if z < 3:
            self.state_specs["params"] = self.compute_specs
        self.data_spec = P(None, BATCH, "cp")          # [micro-batches, dp*mbs, s]

    # -- helpers ---------------------------------------------------------------------------------
    def _ns(self, spec):
        return NamedSharding(self.mesh, spec)

    def _tree_ns(self, specs):
        return jax.tree.map(self._ns, specs, is_leaf=lambda x: isinstance(x, P))

    def wsc(self, x, spec: P):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def shard(self, x, kind):
        return self.wsc(x, self.act[kind])

    def _constrain_tree(self, tree, specs):
        return jax.tree.map(lambda x, s: self.wsc(x, s), tree, specs, is_leaf=lambda x: isinstance(x, P))

    def _layer_cast(self):
        """Stored per-layer weights -> compute weights (cast; ZeRO-3: all-gather to the TP spec)."""
        specs = {k: _WEIGHT_SPECS[k] for k in M.layer_param_shapes(self.dm)}
        cdt = self.cdt
        if self.plan.zero >= 3:
            return lambda p: {k: self.wsc(v.astype(cdt), specs[k]) for k, v in p.items()}
        return lambda p: {k: v.astype(cdt) for k, v in p.items()}

    def _regather(self):
        """ZeRO-3: the policy that keeps each layer's gathered weights out of its saved residuals."""
        if self.plan.zero < 3:
            return None
        return M.regather_policy({self._ns(_WEIGHT_SPECS[k]) for k in M.layer_param_shapes(self.dm)})

    def _ring_attention(self):
        """CP > 1: ring attention over "cp" (K/V blocks passed with ppermute), else None (plain attention)."""
        if self.plan.cp == 1:
            return None
        spec = P(BATCH, "cp", "tp", None)
        fn = partial(M.ring_attention_block, axis="cp", axis_size=self.plan.cp)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(spec, spec, spec), out_specs=spec)

    def _moe_dispatch(self):
        if not self.dm.is_moe:
            return None
        dm = self.dm
        tok = P(BATCH, ("cp", "tp"), None)
        # the experts' buffers after the exchange: experts over "ep", the slots of the other ranks' tokens
        slots = ("dp", "cp", "tp")
        ebuf, eprob = P("ep", slots, None), P("ep", slots)

        def dispatch(x, router):
            # tokens [E, C, h] -> [E/ep, ep*C, h] and their probabilities [E, C] -> [E/ep, ep*C]
            # (Megatron-Core's AllToAll dispatcher sends both: token_dispatch's tokens and probs A2A)
            b, s, h = x.shape
            buf, prob, ids, pos = M.moe_permute(x.reshape(b * s, h), router, num_experts=dm.num_experts, top_k=dm.top_k)
            buf, prob = (jax.lax.all_to_all(a, "ep", 0, 1, tiled=True) for a in (buf, prob))
            return buf, prob, ids.reshape(b, s, -1), pos.reshape(b, s, -1)

        def combine(out, ids, pos):
            b, s, k = ids.shape
            out = jax.lax.all_to_all(out, "ep", 1, 0, tiled=True)        # back to [E, C, h]
            y = M.moe_unpermute(out, ids.reshape(b * s, k), pos.reshape(b * s, k), out.dtype)
            return y.reshape(b, s, -1)

        send = jax.shard_map(dispatch, mesh=self.mesh, in_specs=(tok, P()), out_specs=(ebuf, eprob, tok, tok))
        receive = jax.shard_map(combine, mesh=self.mesh, in_specs=(ebuf, tok, tok), out_specs=tok)

        def moe(x, router, eg, eu, ed):
            # the experts run outside the shard_maps, on their "ep" shards (no communication): as a
            # shard_map's inputs, autodiff would return the weights as new residual buffers, and XLA
            # would copy each layer's expert weights into the layer scan's residual stack
            buf, prob, ids, pos = send(x, router)
            out = self.wsc(M.experts_local(buf, prob, eg, eu, ed), ebuf)
            return receive(out, ids, pos)

        return moe

    # -- forward / loss --------------------------------------------------------------------------
    def _stack_fn(self):
        positions = jnp.arange(self.shape.seq_len)
        return partial(M.layers_scan, positions=positions, dm=self.dm, shard=self.shard,
                       recompute=self.shape.recompute, moe_dispatch=self._moe_dispatch(),
                       cast=self._layer_cast(), attention=self.shape.attention, regather=self._regather(),
                       attention_fn=self._ring_attention())

    def _outer(self, weights):
        """Embedding, final norm and head weights in the compute dtype and their TP specs."""
        out = {}
        for k, v in weights.items():
            if k != "layers":
                out[k] = self.wsc(v.astype(self.cdt), _WEIGHT_SPECS[k])
        return out

    def micro_batch_loss(self, weights, tokens, targets):
        """Loss of one micro-batch without pipelining: tokens [dp*mbs, s]."""
        outer = self._outer(weights)
        x = M.embed(tokens, outer, self.shard, self.cdt)
        x = self._stack_fn()(x, weights["layers"])
        return M.head_loss(x, targets, outer, self.shard, self.cdt)

    # -- the pipeline: GPipe written out, forward and backward -------------------------------------
    # Every tick each stage runs its function on its buffer (vmap over the stages' slots with
    # spmd_axis_name="pp": one SPMD program, stage s on the "pp" rank s), then the buffers shift one
    # stage (a collective permute). Stage s runs micro-batch j = t - s at tick t; the other ticks are
    # its bubble. A stage's forward is `jax.vjp` of its function, and the residuals it returns are
    # stored explicitly in the stage's m slots, one per micro-batch (GPipe keeps m in flight [Huang
    # et al. 2019 sec. 2.3]); bubble ticks write nothing. The stage's weights, which autodiff returns
    # among the residuals, are not stored: the backward pass passes them in again. The backward pass
    # runs the ticks in reverse, each stage applying the stored residuals of the micro-batch it ran
    # at that tick to the gradient the next stage sent, and accumulating its weights' gradient.

    def _stage_fn(self, first: bool, last: bool):
        """One stage's work on one micro-batch: (embedding on stage 0 of the first pass), its layers,
        (final norm, output layer and loss on the last stage of the last pass). Every rank of the
        SPMD program computes the same ops; the embedding's and the loss's are kept (selected) only
        on the stage that owns them, so the other ranks' results carry no gradient."""
        stack, pp = self._stack_fn(), self.plan.pp

        def fn(x_in, w, tok, tgt, s):
            x = x_in
            if first:
                x = jnp.where(s == 0, M.embed(tok, {"embed": w["end"]}, self.shard, self.cdt), x_in)
            y = stack(x, w["layers"])
            loss = M.head_loss_rows(y, tgt, w["final_norm"], w["end"], self.shard) if last else \
                jnp.zeros((), jnp.float32)
            return y, jnp.where(s == pp - 1, loss, 0.0)
        return fn

    @staticmethod
    def _w_axes(w: dict) -> dict:
        return {k: (None if k == "final_norm" else 0) for k in w}

    def _forward_pass(self, w, tokens, targets, feed, *, first: bool, last: bool):
        """GPipe's forward of the m micro-batches through one chunk of every stage. Returns the stored
        residuals ([pp, m, ...] per leaf), how to rebuild the backward functions from them, the loss
        summed over micro-batches (last pass) and the last stage's outputs [m, b, s, h] (not the last
        pass: the next chunk's inputs)."""
        pp, m = self.plan.pp, tokens.shape[0]
        ticks, stage_ids = m + pp - 1, jnp.arange(pp)
        fn, meta = self._stage_fn(first, last), {}

        def fwd_stage(x_in, w_, tok, tgt, s):
            (y, loss), vjp = jax.vjp(lambda x, ww: fn(x, ww, tok, tgt, s), x_in, w_)
            leaves, meta["tree"] = jax.tree.flatten(vjp)
            wl = jax.tree.leaves(w_)
            # a residual that is one of the stage's weights is passed in again at backward, not stored
            meta["weight_of"] = tuple(next((i for i, q in enumerate(wl) if r is q), None) for r in leaves)
            return y, loss, [r for r, i in zip(leaves, meta["weight_of"]) if i is None]

        stage = jax.vmap(fwd_stage, in_axes=(0, self._w_axes(w), 0, 0, 0), spmd_axis_name="pp")
        buf_spec = P("pp", *self.act["hidden"])
        b, s_len = tokens.shape[1:]
        buf0 = self.wsc(jnp.zeros((pp, b, s_len, self.dm.hidden), self.cdt), buf_spec)

        def inputs(t):
            j = t - stage_ids
            jc = jnp.clip(j, 0, m - 1)
            return (j >= 0) & (j < m), tokens[jc], targets[jc]

        shapes = jax.eval_shape(lambda bb, ww: stage(bb, ww, *inputs(0)[1:], stage_ids)[2], buf0, w)
        store0 = [jnp.zeros((pp, m, *r.shape[1:]), r.dtype) for r in shapes]

        def tick(carry, t):
            buf, store, loss_sum = carry
            if feed is not None:
                buf = buf.at[0].set(feed[jnp.minimum(t, m - 1)])
            valid, tok, tgt = inputs(t)
            y, loss, kept = stage(self.wsc(buf, buf_spec), w, tok, tgt, stage_ids)
            slot = t % m           # stage s runs micro-batches 0..m-1 at ticks s..s+m-1: one slot each
            # dynamic_update_slice, in place in the loop's buffer (`.at[:, slot].set` would be a scatter,
            # which XLA's CPU backend copies whole)
            store = [jax.lax.dynamic_update_index_in_dim(
                st, jnp.where(valid.reshape(-1, *[1] * (r.ndim - 1)), r, jax.lax.dynamic_index_in_dim(st, slot, 1, False)),
                slot, 1) for st, r in zip(store, kept)]
            loss_sum = loss_sum + jnp.sum(jnp.where(valid, loss, 0.0))
            out = self.wsc(y, buf_spec)
            return (jnp.roll(out, 1, axis=0), store, loss_sum), (None if last else out[pp - 1])

        (_, store, loss_sum), outs = jax.lax.scan(tick, (buf0, store0, jnp.zeros((), jnp.float32)),
                                                  jnp.arange(ticks))
        return store, meta, loss_sum, (None if last else outs[pp - 1:])

    def _backward_pass(self, w, store, meta, d_outs, batch_shape, *, first: bool, last: bool):
        """The forward pass's ticks in reverse: stage s applies the residuals of the micro-batch it ran
        at tick t to the gradient stage s + 1 sent. Returns the weights' fp32 gradients (per stage:
        [pp, ...], the final norm's too) and, unless `first`, the gradient of the pass's inputs
        [m, b, s, h] (the previous chunk's outputs)."""
        pp, m = self.plan.pp, store[0].shape[1]
        ticks, stage_ids = m + pp - 1, jnp.arange(pp)
        axes = self._w_axes(w)

        def bwd_stage(kept, w_, dy, dloss):
            wl, it = jax.tree.leaves(w_), iter(kept)
            leaves = [next(it) if i is None else wl[i] for i in meta["weight_of"]]
            return jax.tree.unflatten(meta["tree"], leaves)((dy, dloss))

        stage = jax.vmap(bwd_stage, in_axes=(0, axes, 0, 0), spmd_axis_name="pp")
        buf_spec = P("pp", *self.act["hidden"])
        acc0 = {k: jax.tree.map(lambda a, k=k: jnp.zeros((pp, *(a.shape if axes[k] is None else a.shape[1:])),
                                                          jnp.float32), v) for k, v in w.items()}
        dbuf0 = self.wsc(jnp.zeros((pp, *batch_shape, self.dm.hidden), self.cdt), buf_spec)

        def tick(carry, t):
            dbuf, acc = carry
            j = t - stage_ids
            valid = (j >= 0) & (j < m)
            # the last stage's output goes to the next chunk (its gradient comes back from there) or,
            # on the last pass, only into the loss
            d_last = jnp.zeros_like(dbuf[pp - 1]) if d_outs is None else d_outs[jnp.clip(t - (pp - 1), 0, m - 1)]
            dbuf = dbuf.at[pp - 1].set(d_last)
            dy = jnp.where(valid.reshape(-1, 1, 1, 1), dbuf, jnp.zeros_like(dbuf))
            dloss = jnp.where(valid & (stage_ids == pp - 1), 1.0 / m, 0.0) if last else jnp.zeros((pp,), jnp.float32)
            kept = [jax.lax.dynamic_index_in_dim(st, t % m, 1, False) for st in store]
            dx, dw = stage(kept, w, self.wsc(dy, buf_spec), dloss)
            acc = jax.tree.map(lambda a_, g: a_ + g.astype(jnp.float32), acc, dw)
            dx = self.wsc(dx, buf_spec)
            return (jnp.roll(dx, -1, axis=0), acc), (None if first else dx[0])

        (_, grads), d_in = jax.lax.scan(tick, (dbuf0, acc0), jnp.arange(ticks), reverse=True)
        return grads, (None if first else d_in[:m])

    def pipeline_loss_and_grads(self, weights, tokens, targets):
        """GPipe over "pp": tokens [m, dp*mbs, s]; the mean loss over the m micro-batches and the fp32
        gradient. With vpp > 1 the stages hold Megatron's interleaved chunks and the micro-batches go
        round the ring vpp times, one GPipe pass per chunk (the same math and placement as the
        interleaved schedule; its timing is GPipe's: a (pp-1)-tick bubble per pass, not Megatron's
        (pp-1)/vpp; between passes the last stage's outputs of all m micro-batches wait in one
        [m, b, s, h] buffer, which Megatron's schedule sends on at once)."""
        v, m = self.plan.vpp, tokens.shape[0]
        ends = self.wsc(weights["ends"].astype(self.cdt), P("pp", *_WEIGHT_SPECS["ends"]))
        fnorm = self.wsc(weights["final_norm"].astype(self.cdt), _WEIGHT_SPECS["final_norm"])
        chunk = (lambda c: weights["layers"]) if v == 1 else \
            (lambda c: jax.tree.map(lambda x: x[:, c], weights["layers"]))         # noqa: E731

        def stage_weights(c):
            w = {"layers": chunk(c)}
            if c in (0, v - 1):
                w["end"] = ends
            if c == v - 1:
                w["final_norm"] = fnorm
            return w

        feed, passes, loss_sum = None, [], None
        for c in range(v):
            store, meta, loss_sum, feed = self._forward_pass(stage_weights(c), tokens, targets, feed,
                                                             first=c == 0, last=c == v - 1)
            passes.append((store, meta))
        d_outs, g_layers, g_end, g_norm = None, [None] * v, 0.0, None
        for c in reversed(range(v)):
            store, meta = passes[c]
            g, d_outs = self._backward_pass(stage_weights(c), store, meta, d_outs, tokens.shape[1:],
                                            first=c == 0, last=c == v - 1)
            g_layers[c] = g["layers"]
            g_end = g_end + g.get("end", 0.0)
            if "final_norm" in g:
                g_norm = jnp.sum(g["final_norm"], axis=0)
            passes[c] = None
        if self.dm.tied_embeddings:
            # the first stage's embedding and the last stage's copy take the sum of both gradients (Megatron
            # all-reduces the word-embedding gradient between them), so the two copies stay equal
            g_end = g_end + jnp.flip(g_end, axis=0)
        layers = g_layers[0] if v == 1 else jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *g_layers)
        return loss_sum / m, {"layers": layers, "ends": g_end, "final_norm": g_norm}

    def loss_and_grads(self, weights, tokens, targets):
        """Mean loss over the step's micro-batches and the fp32 gradient (accumulated in the
        gradient spec: replicated over DP, or sharded with ZeRO-2/3)."""
        if self.plan.pp > 1:
            loss, g = self.pipeline_loss_and_grads(weights, tokens, targets)
            return loss, self._constrain_tree(g, self.grad_specs)
        if tokens.shape[0] == 1:
            # one backward pass produces the step's gradient
            loss, g = jax.value_and_grad(lambda w, t, y: self.micro_batch_loss(w, t[0], y[0]))(weights, tokens, targets)
            return loss, self._constrain_tree(jax.tree.map(lambda x: x.astype(jnp.float32), g), self.grad_specs)
        m = tokens.shape[0]
        acc0 = self._constrain_tree(jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), weights),
                                    self.grad_specs)

        def body(carry, batch):
            loss_sum, acc = carry
            loss, g = jax.value_and_grad(self.micro_batch_loss)(weights, *batch)
            acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32) / m, acc, g)
            return (loss_sum + loss / m, self._constrain_tree(acc, self.grad_specs)), None

        (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), acc0), (tokens, targets))
        return loss, grads

    def master_weights(self, state):
        """The fp32 weights the optimizer updates (the compute weights themselves in fp32 training)."""
        return state["master"] if self.separate_master else state["params"]

    def train_step(self, state, tokens, targets):
        weights = state["master"] if self.plan.zero >= 3 else state["params"]
        loss, grads = self.loss_and_grads(weights, tokens, targets)
        grads = self._constrain_tree(grads, self.master_specs)
        step = state["step"] + 1
        master = self._constrain_tree(self.master_weights(state), self.master_specs)
        master, mom, vel = adamw(master, state["m"], state["v"], grads, step, self.shape.learning_rate)
        new = {"m": mom, "v": vel, "step": step}
        if self.separate_master:
            new["master"] = master
        if self.plan.zero < 3:
            new["params"] = self._constrain_tree(jax.tree.map(lambda w: w.astype(self.cdt), master),
                                                 self.compute_specs)
        return new, {"loss": loss, "grads": grads}

    # -- jitted entry points -----------------------------------------------------------------------
    def _state_from(self, params: dict) -> dict:
        st = stack_for_pipeline(params, self.plan)
        out = {"m": jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), st),
               "v": jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), st), "step": jnp.zeros((), jnp.int32)}
        if self.separate_master:
            out["master"] = jax.tree.map(lambda w: w.astype(jnp.float32), st)
        if self.plan.zero < 3:
            out["params"] = jax.tree.map(lambda w: w.astype(self.cdt), st)
        return out

    def init_state(self, params: dict):
        """Sharded state from given fp32 params (the reference model's, in the equivalence tests)."""
        return jax.jit(self._state_from, out_shardings=self._tree_ns(self.state_specs))(params)

    def init_state_random(self, seed: int = 0):
        """State initialised on the devices, already sharded (no host copy of the full model)."""
        build = lambda key: self._state_from(M.init_params(self.dm, key))   # noqa: E731
        return jax.jit(build, out_shardings=self._tree_ns(self.state_specs))(jax.random.key(seed))

    def abstract_inputs(self):
        """(state, tokens, targets) as sharded ShapeDtypeStructs: lower and compile without allocating."""
        st = jax.eval_shape(self._state_from, jax.eval_shape(lambda k: M.init_params(self.dm, k), jax.random.key(0)))
        shard = self._tree_ns(self.state_specs)
        state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), st, shard)
        m, b = self.shape.num_micro_batches, self.plan.dp * self.plan.mbs
        data = jax.ShapeDtypeStruct((m, b, self.shape.seq_len), jnp.int32, sharding=self._ns(self.data_spec))
        return state, data, data

    def jitted_step(self, with_grads: bool = False):
        data = self._ns(self.data_spec)
        out_metrics = {"loss": self._ns(P())}
        if with_grads:
            out_metrics["grads"] = self._tree_ns(self.master_specs)

        def fn(state, tokens, targets):
            new, met = self.train_step(state, tokens, targets)
            return new, {k: met[k] for k in out_metrics}

        return jax.jit(fn, in_shardings=(self._tree_ns(self.state_specs), data, data),
                       out_shardings=(self._tree_ns(self.state_specs), out_metrics), donate_argnums=(0,))

    def split_batch(self, tokens, targets):
        """[global_batch, s] -> [micro-batches, dp*mbs, s], placed on the mesh. Micro-batch j holds
        every DP rank's j-th micro-batch (rank r gets rows r*mbs*m + j*mbs ...)."""
        p, m = self.plan, self.shape.num_micro_batches

        def split(a):
            a = a.reshape(p.dp, m, p.mbs, a.shape[-1]).transpose(1, 0, 2, 3)
            return a.reshape(m, p.dp * p.mbs, a.shape[-1])
        data = self._ns(self.data_spec)
        return jax.device_put(split(tokens), data), jax.device_put(split(targets), data)


def adamw(master, m, v, grads, step, lr):
    """AdamW with bias correction (Loshchilov & Hutter 2019, Algorithm 2); decoupled weight decay
    on weight matrices, not on norm weights (as Megatron's get_param_groups)."""
    t = step.astype(jnp.float32)
    c1, c2 = 1 - ADAM_B1 ** t, 1 - ADAM_B2 ** t

    def one(path, w, m_, v_, g):
        m2 = ADAM_B1 * m_ + (1 - ADAM_B1) * g
        v2 = ADAM_B2 * v_ + (1 - ADAM_B2) * g * g
        upd = (m2 / c1) / (jnp.sqrt(v2 / c2) + ADAM_EPS)
        name = str(getattr(path[-1], "key", ""))
        decay = 0.0 if name.endswith("norm") else WEIGHT_DECAY * w
        return w - lr * (upd + decay), m2, v2

    out = jax.tree_util.tree_map_with_path(one, master, m, v, grads)
    pick = lambda i: jax.tree.map(lambda t3: t3[i], out, is_leaf=lambda x: isinstance(x, tuple))  # noqa: E731
    return pick(0), pick(1), pick(2)
