"""Runner `jax`: a real transformer sharded by a plan, run for a few steps (issue 14)."""
from __future__ import annotations

import os
from collections.abc import MutableMapping

#: share of each GPU's memory the jax runner's process may use. JAX preallocates 75 % by default [JAX docs, "GPU
#: memory allocation"], and XLA plans its buffers inside that: on the lent H100 (80 GB) the 8-layer Llama 3 8B
#: stage at micro-batch 2, which the cost model puts at 74 GB and which ran at 66 GB on an H200, ran out of
#: memory at XLA's 58 GiB limit (2026-12-06). Megatron's PyTorch allocator takes what the GPU has, so the
#: runner does too, less what the CUDA context and cuDNN's workspaces hold.
RUNNER_MEM_FRACTION = "0.95"
#: the variables by which a user already chose how JAX takes GPU memory (jaxlib refuses both fraction names
#: at once: XLA_CLIENT_MEM_FRACTION is the newer one, XLA_PYTHON_CLIENT_MEM_FRACTION its deprecated alias
#: that every version reads)
JAX_MEMORY_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
                   "XLA_PYTHON_CLIENT_ALLOCATOR")


def claim_device_memory(runner: str, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set how this process's JAX takes GPU memory before its GPU backend starts, unless the user chose
    (JAX_MEMORY_VARS): the jax runner may use RUNNER_MEM_FRACTION of each GPU; with the megatron runner JAX
    only scores plans here, so it preallocates nothing and leaves the GPUs to Megatron's ranks. Returns
    what it set."""
    if any(v in environ for v in JAX_MEMORY_VARS):
        return {}
    chosen = ({"XLA_PYTHON_CLIENT_MEM_FRACTION": RUNNER_MEM_FRACTION} if runner == "jax"
              else {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    environ.update(chosen)
    return chosen
