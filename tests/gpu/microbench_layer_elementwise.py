"""A transformer layer's memory-bound work outside the MLP activation, on one GPU with PyTorch: what
`elementwise_bytes_h` stands for.

    python tests/gpu/microbench_layer_elementwise.py OUT.json [--quick]

For T tokens of hidden size h (bf16; attention heads of 128, grouped query attention with h/8 keys and
values), the chain a Llama-style layer runs around its GEMMs and its attention kernel, timed forward and
forward + backward:
  norm_rms      RMSNorm (fp32 statistics)
  norm_ln       LayerNorm with weight and bias
  rope          rotary embedding of q [T x h] and k [T x h/8] (x cos + rotate_half(x) sin)
  residual      a residual add
  layer         the whole chain of one layer: norm, rope on q and k, residual add, norm, residual add
each eager and compiled (torch.compile: Megatron-Core's jit_fuser / Transformer Engine fuse such chains);
L2 flushed before each timed call, medians. `tests/gpu/compare_gpu.py` reports bytes per token per hidden
unit per forward-equivalent ((forward + backward) / 3) at the datasheet bandwidth.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from microbench import DEV, GPU, QUICK, save_rows, time_eager_and_compiled  # noqa: E402

SHAPES = [(16384, 4096), (8192, 8192), (32768, 2048), (8192, 16384)]
if QUICK or not GPU:
    SHAPES = [(256, 256), (512, 512)]
BF16 = torch.bfloat16
HEAD = 128


def rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


def ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def chain(x, q, k, a, m, w, cos, sin):
    """One layer's non-GEMM memory-bound work: pre-attention norm, rope on q and k, residual add of the
    attention output a, pre-MLP norm, residual add of the MLP output m."""
    n1 = rms(x, w)
    qr, kr = rope(q, k, cos, sin)
    h1 = x + a
    n2 = rms(h1, w)
    return n1, qr, kr, n2, h1 + m


def _cases(T, h):
    x = torch.randn(T, h, device=DEV, dtype=BF16)
    w = torch.randn(h, device=DEV, dtype=BF16)
    b = torch.randn(h, device=DEV, dtype=BF16)
    heads, kv = h // HEAD, max(1, h // HEAD // 8)
    q = torch.randn(T, heads, HEAD, device=DEV, dtype=BF16)
    k = torch.randn(T, kv, HEAD, device=DEV, dtype=BF16)
    cos = torch.randn(T, 1, HEAD, device=DEV, dtype=BF16)     # broadcast over heads, as Megatron's tables
    sin = torch.randn(T, 1, HEAD, device=DEV, dtype=BF16)
    a, m = torch.randn_like(x), torch.randn_like(x)
    return {"norm_rms": (rms, (x, w)), "norm_ln": (ln, (x, w, b)), "rope": (rope, (q, k, cos, sin)),
            "residual": (torch.add, (x, a)), "layer": (chain, (x, q, k, a, m, w, cos, sin))}


def _fwd_bwd(fn, args):
    """A closure running fn forward and backward with a gradient for every output (inputs that are
    activations get gradients; weights and the rope tables do not)."""
    grads_for = [i for i, t in enumerate(args) if t.dim() >= 2 and t.shape[0] == args[0].shape[0]
                 and not (fn is rope and i >= 2) and not (fn is chain and i >= 6)]
    leaves = [t.detach().clone().requires_grad_(i in grads_for) for i, t in enumerate(args)]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    dys = [torch.randn_like(o) for o in outs]

    def run():
        res = fn(*leaves)
        res = res if isinstance(res, tuple) else (res,)
        torch.autograd.backward(res, dys)
        for t in leaves:
            t.grad = None
    return run


def rows() -> list:
    out = []
    for T, h in SHAPES:
        for name, (fn, args) in _cases(T, h).items():
            row = {"kernel": name, "tokens": T, "hidden": h}
            time_eager_and_compiled(row, fn, lambda g, args=args: g(*args), lambda g, args=args: _fwd_bwd(g, args))
            out.append(row)
    return out


def main() -> None:
    save_rows("layer_elementwise", rows, "microbench_layer_elementwise.json")

if __name__ == "__main__":
    main()
