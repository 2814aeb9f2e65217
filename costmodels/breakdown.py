"""The cost model's typed results: pytrees of arrays (one entry per candidate plan).

`evaluate` returns a `Prediction`; reports, tests and calibration read its named parts instead of
string keys. NamedTuples are JAX pytrees, so a Prediction passes through jit, grad and jacfwd.
Times in seconds per optimizer step, memory in bytes per GPU (the peak pipeline rank).
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


class StepTime(NamedTuple):
    """Where one optimizer step's time goes; the parts sum to the step time."""
    compute: object        # forward + backward work of the slowest stage, m micro-batches
    recompute: object      # activation recomputation (selective modules, full / block)
    offload: object        # exposed activation copies to and from host memory (--cpu-offloading-num-layers)
    tp_comm: object        # exposed tensor-parallel (and expert-TP) collectives
    cp_comm: object        # exposed context-parallel ring exchanges
    ep_comm: object        # exposed MoE all-to-alls
    pp_comm: object        # exposed pipeline p2p
    dp_comm: object        # exposed data-parallel gradient / parameter collectives
    bubble: object         # pipeline fill and drain
    optimizer: object      # the (memory-bound) optimizer step
    host_wait: object      # GPU idle while the host issues the kernels (host-bound stages)
    overhead: object       # per-step and per-micro-batch host work


class Memory(NamedTuple):
    """Peak memory per GPU (the pipeline rank that needs most); total includes fragmentation and
    the framework's fixed overhead, which `other` also holds."""
    weights: object
    gradients: object
    optimizer: object
    activations: object
    other: object
    total: object


class Prediction(NamedTuple):
    step_time_s: object
    tokens_per_s: object
    model_flops: object    # useful FLOPs per step [N21 eq. 3]
    hw_flops: object       # with recomputation
    num_gpus: object
    micro_batches: object
    time: StepTime
    memory: Memory
    memory_limit_bytes: object


def broadcast(pred: Prediction, shape) -> Prediction:
    """Every leaf broadcast to the batch shape (scalars in the model become per-plan arrays)."""
    import jax
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, shape), pred)


def flatten(pred: Prediction) -> dict:
    """A flat dict of the prediction's leaves: "step_time_s", ..., "time.compute", "memory.total"."""
    out = {k: v for k, v in pred._asdict().items() if k not in ("time", "memory")}
    out.update({f"time.{k}": v for k, v in pred.time._asdict().items()})
    out.update({f"memory.{k}": v for k, v in pred.memory._asdict().items()})
    return out
