"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set by the test before
JAX starts): train the sharded model and the unsharded reference for 3 steps from the same weights on
the same batches, and print one JSON line per case with the worst differences.

The reference is `model.reference_loss` on the whole global batch at once (no micro-batches, no
mesh), differentiated by jax.value_and_grad, then the same AdamW. Compute is fp32 so that the
tolerance can be tight.
"""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from autotune.runner import model as M
from autotune.runner.sharded import RunShape, ShardedModel, adamw, unstack_pipeline
from costmodels.plan import Plan
from costmodels.specs import Recompute

SEQ, GLOBAL_BATCH, STEPS, LR = 16, 8, 3, 1e-2
DIMS = {
    "dense": M.Dims(num_layers=4, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=64),
    "moe": M.Dims(num_layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=64, num_experts=4,
                  top_k=2, expert_ffn=32, num_shared_experts=1, shared_ffn=32),
}


def batches(vocab: int):
    """The same batch every step, so that the loss must fall (a check that training happens)."""
    tok = np.random.default_rng(0).integers(0, vocab, (GLOBAL_BATCH, SEQ + 1), dtype=np.int32)
    return [(jnp.asarray(tok[:, :-1]), jnp.asarray(tok[:, 1:]))] * STEPS


def reference(dm: M.Dims, params, data):
    """Losses, step-1 and step-3 gradients and final weights of the unsharded model."""
    @jax.jit
    def step(w, m, v, t, tokens, targets):
        loss, g = jax.value_and_grad(M.reference_loss)(w, tokens, targets, dm)
        w2, m2, v2 = adamw(w, m, v, g, t, LR)
        return w2, m2, v2, loss, g
    w, m, v = params, jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params)
    losses, grads = [], []
    for i, (tk, tg) in enumerate(data):
        w, m, v, loss, g = step(w, m, v, jnp.int32(i + 1), tk, tg)
        losses.append(float(loss))
        grads.append(g)
    return losses, grads, w


def rel(a, b) -> float:
    """Worst |a - b| over a pytree, relative to the reference's largest |b| per leaf."""
    errs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)), a, b)
    return max(jax.tree.leaves(errs))


def run_case(kind: str, plan_kw: dict, refs: dict) -> dict:
    dm = DIMS[kind]
    kw = dict(plan_kw)
    if "recompute" in kw:
        kw["recompute"] = Recompute[kw["recompute"].upper()]
    shape = RunShape(dims=dm, plan=Plan(**kw), seq_len=SEQ, global_batch=GLOBAL_BATCH, compute_dtype="float32",
                     learning_rate=LR)
    params, data, (ref_losses, ref_grads, ref_w) = refs[kind]
    sm = ShardedModel(shape, jax.devices())
    state = sm.init_state(params)
    step = sm.jitted_step(with_grads=True)
    losses, grads = [], []
    for tk, tg in data:
        state, met = step(state, *sm.split_batch(tk, tg))
        losses.append(float(met["loss"]))
        grads.append(unstack_pipeline(jax.device_get(met["grads"])))
    final = unstack_pipeline(jax.device_get(sm.master_weights(state)))
    return {"case": f"{kind}:{','.join(f'{k}={v}' for k, v in plan_kw.items())}",
            "loss_abs_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "grad_rel_err_step1": rel(grads[0], ref_grads[0]), "grad_rel_err_step3": rel(grads[-1], ref_grads[-1]),
            "weights_rel_err_step3": rel(final, ref_w), "loss_drop": ref_losses[0] - ref_losses[-1]}


def main(cases: list) -> None:
    refs = {}
    for kind, dm in DIMS.items():
        params = M.init_params(dm, jax.random.key(7))
        data = batches(dm.vocab)
        refs[kind] = (params, data, reference(dm, params, data))
    for kind, plan_kw in cases:
        try:
            out = run_case(kind, plan_kw, refs)
        except Exception as exc:          # noqa: BLE001  (reported to the test, which fails)
            out = {"case": f"{kind}:{plan_kw}", "error": f"{type(exc).__name__}: {exc}"[:500]}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
