"""MLP activation functions on one GPU with PyTorch: what `elementwise_bytes_f` stands for.

    python tests/gpu/microbench_activation.py OUT.json [--quick]

For m tokens x f FFN units (bf16), the activations Megatron-Core runs between fc1 and fc2:
  swiglu        silu(x1) * x2 on the [m x 2f] fc1 output (Llama, Qwen, DeepSeek: --swiglu)
  gelu          gelu(x + bias), tanh approximation (GPT-3 / Narayanan / vTrain: bias_gelu_impl)
  squared_relu  relu(x)^2 (Nemotron-4: --squared-relu)
each eager and compiled (torch.compile, as Megatron-Core's jit_fuser does), forward and forward + backward;
L2 flushed before each timed call, medians. Bytes per token per FFN unit at the datasheet bandwidth are
what `tests/gpu/compare_gpu.py` reports.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from microbench import DEV, GPU, QUICK, save_rows, time_eager_and_compiled  # noqa: E402

SHAPES = [(8192, 4096), (8192, 14336), (32768, 4096), (16384, 28672)]
if QUICK or not GPU:
    SHAPES = [(256, 128), (512, 256)]
BF16 = torch.bfloat16


def swiglu(x, bias=None):
    x1, x2 = x.chunk(2, dim=-1)
    return F.silu(x1) * x2


def gelu(x, bias):
    return F.gelu(x + bias, approximate="tanh")


def squared_relu(x, bias=None):
    return torch.pow(F.relu(x), 2)


FUNCS = {"swiglu": (swiglu, 2), "gelu": (gelu, 1), "squared_relu": (squared_relu, 1)}


def rows() -> list:
    out = []
    for m, f in SHAPES:
        for name, (fn, width) in FUNCS.items():
            x = torch.randn(m, width * f, device=DEV, dtype=BF16)
            xr = x.clone().requires_grad_(True)
            bias = torch.randn(width * f, device=DEV, dtype=BF16)
            dy = torch.randn(m, f, device=DEV, dtype=BF16)
            row = {"activation": name, "tokens": m, "ffn": f}

            def fwd_bwd(g):
                def run():
                    g(xr, bias).backward(dy)
                    xr.grad = None
                return run
            time_eager_and_compiled(row, fn, lambda g: g(x, bias), fwd_bwd)
            out.append(row)
            del x, xr, dy
    return out


def main() -> None:
    save_rows("activation", rows, "microbench_activation.json")

if __name__ == "__main__":
    main()
