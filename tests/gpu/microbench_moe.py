"""MoE micro-benchmarks: the expert GEMMs, token (un)permutation, the router and the SwiGLU activation
of the MoE models the validation runs train, measured on one GPU with PyTorch.

    python tests/gpu/microbench_moe.py OUT.json [--quick]

Per model (hidden h, expert FFN f_e, experts E, top-k), local experts n_l and tokens per expert m_e
(balanced: every expert gets m_e), the time of one MoE layer's expert GEMMs forward (fc1 [m_e x h] @
[h x 2 f_e] and fc2 [m_e x f_e] @ [f_e x h] per expert) run three ways:
  loop      one cuBLAS GEMM per expert, one stream (Transformer Engine's GroupedLinear issues a
            GEMM per expert; it spreads them over a few streams)
  bmm       one batched GEMM over the n_l experts (what a grouped GEMM reaches with equal splits)
and, fp8 where torch has cuBLASLt fp8, the loop in fp8 (per-tensor scales, casts not timed).
Memory-bound parts at T tokens: gather into expert order (index_select), back to the token order with
the routing weights (index_add_; Megatron-Core's unfused scatter_add_; a sorted gather + weighted sum as
a fused kernel would), the router (logits GEMM, fp32 softmax, top-k) and SwiGLU on [m x 2 f_e], eager
and compiled (torch.compile, as Megatron-Core's jit_fuser), forward and forward + backward.
L2 flushed before each timed call; medians. `tests/gpu/compare_gpu.py` compares them with the cost model.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from microbench import DEV, GPU, QUICK, device_info, timed  # noqa: E402

#: (name, hidden, expert FFN, experts, top-k): costmodels/presets/models.yaml
MODELS = [("qwen3-30b-a3b", 2048, 768, 128, 8), ("gpt-oss-120b", 2880, 2880, 128, 4),
          ("qwen3-235b-a22b", 4096, 1536, 128, 8), ("deepseek-v3", 7168, 2048, 256, 8),
          ("mixtral-8x7b", 4096, 14336, 8, 2)]
TOKENS_PER_EXPERT = [128, 512, 2048, 8192]
LOCAL_EXPERTS = [1, 4, 16, 32]
TOKENS = [4096, 16384]
if QUICK or not GPU:
    MODELS, TOKENS_PER_EXPERT, LOCAL_EXPERTS, TOKENS = [("tiny", 128, 64, 8, 2)], [16, 64], [1, 4], [256]

BF16 = torch.bfloat16


def _fp8_ok() -> bool:
    return GPU and hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm") \
        and torch.cuda.get_device_capability() >= (8, 9)


def expert_rows() -> list:
    rows, fp8 = [], _fp8_ok()
    for name, h, fe, E, k in MODELS:
        for n_l in LOCAL_EXPERTS:
            if n_l > E:
                continue
            w1 = torch.randn(n_l, 2 * fe, h, device=DEV, dtype=BF16) * 0.02
            w2 = torch.randn(n_l, h, fe, device=DEV, dtype=BF16) * 0.02
            for m_e in TOKENS_PER_EXPERT:
                if n_l * m_e * max(h, 2 * fe) * 2 > 6e9:
                    continue
                x = torch.randn(n_l, m_e, h, device=DEV, dtype=BF16)
                a = torch.randn(n_l, m_e, fe, device=DEV, dtype=BF16)

                def loop():
                    for i in range(n_l):
                        F.linear(x[i], w1[i])
                        F.linear(a[i], w2[i])

                def bmm():
                    torch.bmm(x, w1.transpose(1, 2))
                    torch.bmm(a, w2.transpose(1, 2))

                row = {"model": name, "h": h, "fe": fe, "n_local": n_l, "m_e": m_e,
                       "flops_fwd": 2.0 * n_l * m_e * (2 * fe * h + fe * h),
                       "loop_s": timed(loop), "bmm_s": timed(bmm)}
                if fp8:
                    try:
                        xf, af = x.to(torch.float8_e4m3fn), a.to(torch.float8_e4m3fn)
                        w1f, w2f = w1.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
                        one = torch.ones((), device=DEV, dtype=torch.float32)

                        def loop_fp8():
                            for i in range(n_l):
                                torch._scaled_mm(xf[i], w1f[i].t(), scale_a=one, scale_b=one, out_dtype=BF16)
                                torch._scaled_mm(af[i], w2f[i].t(), scale_a=one, scale_b=one, out_dtype=BF16)
                        row["loop_fp8_s"] = timed(loop_fp8)
                    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
                        row["fp8_error"] = str(exc)[:120]
                        fp8 = False
                rows.append(row)
                del x, a
            print(f"experts {name} n_l={n_l}: " + " ".join(
                f"m{r['m_e']}:{r['flops_fwd'] / r['loop_s'] / 1e12:.0f}/{r['flops_fwd'] / r['bmm_s'] / 1e12:.0f}"
                for r in rows if r["model"] == name and r["n_local"] == n_l), flush=True)
            del w1, w2
    return rows


def memory_bound_rows() -> list:
    rows = []
    for name, h, fe, E, k in MODELS:
        for T in TOKENS:
            x = torch.randn(T, h, device=DEV, dtype=BF16)
            idx = torch.randint(0, T, (T * k,), device=DEV)
            probs = torch.rand(T * k, 1, device=DEV, dtype=BF16)
            y = torch.randn(T * k, h, device=DEV, dtype=BF16)
            out = torch.zeros(T, h, device=DEV, dtype=BF16)
            wr = torch.randn(E, h, device=DEV, dtype=BF16)
            m = T * k // 4
            g = torch.randn(m, 2 * fe, device=DEV, dtype=BF16)

            def router():
                logits = F.linear(x, wr).float()
                torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)

            def swiglu_fn(t):
                u, v = t.chunk(2, dim=-1)
                return F.silu(u) * v

            def swiglu():
                swiglu_fn(g)
            gr = g.clone().requires_grad_(True)
            dy = torch.randn(m, fe, device=DEV, dtype=BF16)

            def swiglu_fb(fn=swiglu_fn):
                fn(gr).backward(dy)
                gr.grad = None
            # Megatron-Core fuses it (jit_fuser: torch.compile where it works)
            compiled = None
            if GPU:
                try:
                    compiled = torch.compile(swiglu_fn)
                    compiled(g), compiled(gr).backward(dy)
                except Exception as exc:  # noqa: BLE001 - recorded, not fatal
                    compiled = None
                    print("torch.compile unavailable:", str(exc)[:120], flush=True)
            # Megatron-Core's unfused unpermute (moe_utils.unpermute without --moe-permute-fusion):
            # zeros, then scatter_add_ of the weighted expert outputs back to the token order
            sorted_idx = idx.unsqueeze(1).expand(-1, h)

            def unpermute_scatter():
                torch.zeros(T, h, device=DEV, dtype=BF16).scatter_add_(0, sorted_idx, y * probs)

            def unpermute_sorted():       # what a fused kernel reaches: gather k rows per token, weighted sum
                (y.view(T, k, h) * probs.view(T, k, 1)).sum(dim=1)
            rows.append({"model": name, "h": h, "fe": fe, "experts": E, "top_k": k, "tokens": T,
                         "permute_s": timed(lambda: x.index_select(0, idx)),
                         "unpermute_s": timed(lambda: out.index_add_(0, idx, y * probs)),
                         "router_s": timed(router),
                         "router_gemm_s": timed(lambda: F.linear(x, wr)),
                         "unpermute_scatter_s": timed(unpermute_scatter), "unpermute_sorted_s": timed(unpermute_sorted),
                         "swiglu_tokens": m, "swiglu_s": timed(swiglu), "swiglu_fwd_bwd_s": timed(swiglu_fb)})
            if compiled is not None:
                rows[-1].update(swiglu_compiled_s=timed(lambda: compiled(g)),
                                swiglu_compiled_fwd_bwd_s=timed(lambda: swiglu_fb(compiled)))
            r = rows[-1]
            print(f"memory-bound {name} T={T}: " + " ".join(f"{key[:-2]}={r[key] * 1e6:.0f}us" for key in r if key.endswith("_s")),
                  flush=True)
    return rows


def main() -> None:
    out = next((a for a in sys.argv[1:] if not a.startswith("--")), "microbench_moe.json")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    doc = {"device": device_info()}
    t0 = time.perf_counter()
    for key, fn in (("memory_bound", memory_bound_rows), ("experts", expert_rows)):
        doc[key] = fn()
        doc.setdefault("seconds", {})[key] = time.perf_counter() - t0
        json.dump(doc, open(out, "w"), indent=1)
    if GPU:
        doc["device"]["nvidia_smi_after"] = device_info().get("nvidia_smi")
    json.dump(doc, open(out, "w"), indent=1)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
