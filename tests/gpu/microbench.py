"""Kernel micro-benchmarks behind the cost model's compute constants, measured on one GPU with PyTorch.

    python tests/gpu/microbench.py OUT.json [--quick]

Writes one JSON document: the device (name, SM count, clocks, versions) and, per kernel class, the
measured time of each shape:
  gemm       bf16 (and fp8 where torch has it) x @ W^T, the shapes of a transformer's projections and
             MLP (m tokens x k in -> n out); L2 flushed before each timed product, the median of the
             timed repeats; TFLOP/s = 2 m n k / t.
  attention  causal scaled-dot-product attention per backend (cuDNN = what Transformer Engine runs on
             Hopper, flash = FlashAttention-2 in PyTorch), head dims 64 and 128, forward and
             forward+backward; FLOPs 4 b a s^2 d / 2 forward, 2.5x that backward [FA2].
  hbm        copy and a fused multiply-add over 2 GiB: bytes read + written / t.
  launch     a tiny kernel repeated: GPU time per kernel replayed from a CUDA graph (launch + tail)
             and host wall time per eager op (dispatch).
`tests/gpu/fit_microbench.py` then compares each figure with the cost model's own term. --quick (or
no GPU) runs a few small shapes on whatever device there is, to check the script itself.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

QUICK = "--quick" in sys.argv
DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEV == "cuda"

GEMM_M = [256, 512, 1024, 2048, 4096, 8192, 16384]
GEMM_N = [256, 512, 1024, 2048, 4096, 8192, 16384, 28672]
GEMM_K = [512, 2048, 4096, 8192]
ATTN_SEQ = [1024, 2048, 4096, 8192, 16384]
ATTN_TOKENS = 16384            # b x s per attention call
ATTN_WIDTH = 4096              # heads x head dim
if QUICK or not GPU:
    GEMM_M, GEMM_N, GEMM_K = [64, 256], [128, 512], [256]
    ATTN_SEQ, ATTN_TOKENS, ATTN_WIDTH = [128, 256], 512, 256


def sync():
    if GPU:
        torch.cuda.synchronize()


class Timer:
    """GPU time of one call between CUDA events (wall time on a CPU)."""

    def __enter__(self):
        if GPU:
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if GPU:
            self.b.record()
        else:
            self.s = time.perf_counter() - self.t0

    def seconds(self) -> float:
        if GPU:
            self.b.synchronize()
            return self.a.elapsed_time(self.b) / 1e3
        return self.s


_FLUSH = torch.empty(256 * 2**20 if GPU else 2**20, dtype=torch.uint8, device=DEV)


def timed(fn, reps: int = 7, warmup: int = 2, flush: bool = True, budget_s: float = 0.5) -> float:
    """Median GPU seconds of fn() over reps calls (fewer when each is long), L2 flushed before each."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    t_start = time.perf_counter()
    for _ in range(reps):
        if flush:
            _FLUSH.zero_()
        with Timer() as t:
            fn()
        times.append(t.seconds())
        if len(times) >= 3 and time.perf_counter() - t_start > budget_s:
            break
    return statistics.median(times)


def time_eager_and_compiled(row: dict, fn, fwd, fwd_bwd) -> None:
    """Time fn eager and under torch.compile (as Megatron-Core's jit_fuser fuses such chains), forward
    (`fwd(g)`) and forward + backward (`fwd_bwd(g)()`), into row[f"{kind}_fwd_s"] / row[f"{kind}_fwd_bwd_s"];
    a compile failure is recorded in the row, not fatal."""
    variants = {"eager": fn}
    if GPU:
        try:
            compiled = torch.compile(fn)
            fwd(compiled)
            fwd_bwd(compiled)()
            variants["compiled"] = compiled
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            row["compile_error"] = str(exc)[:120]
    for kind, g in variants.items():
        row[f"{kind}_fwd_s"] = timed(lambda g=g: fwd(g))
        row[f"{kind}_fwd_bwd_s"] = timed(fwd_bwd(g))
    print(" ".join(f"{k}={v}" for k, v in row.items() if not k.endswith("_s")) + ": "
          + " ".join(f"{k}={v * 1e6:.0f}us" for k, v in row.items() if k.endswith("_s")), flush=True)


def save_rows(key: str, rows_fn, default_out: str) -> None:
    """A micro-benchmark script's main: the device, then rows_fn()'s rows under `key`, written to the
    first non-flag argument (or default_out)."""
    out = next((a for a in sys.argv[1:] if not a.startswith("--")), default_out)
    doc = {"device": device_info()}
    t0 = time.perf_counter()
    doc[key] = rows_fn()
    doc["seconds"] = time.perf_counter() - t0
    if GPU:
        doc["device"]["nvidia_smi_after"] = device_info().get("nvidia_smi")
    json.dump(doc, open(out, "w"), indent=1)
    print(f"wrote {out} in {doc['seconds']:.1f} s")


def gemm_rows() -> list:
    rows = []
    fp8 = GPU and hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9)
    for m in GEMM_M:
        for k in GEMM_K:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            for n in GEMM_N:
                w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
                t = timed(lambda: F.linear(x, w))
                row = {"m": m, "n": n, "k": k, "bf16_s": t, "bf16_tflops": 2 * m * n * k / t / 1e12}
                if fp8:
                    try:
                        xf, wf = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
                        one = torch.ones((), device=DEV, dtype=torch.float32)
                        # cuBLASLt fp8: A row-major, B column-major (W^T of a row-major W), per-tensor scales
                        tf = timed(lambda: torch._scaled_mm(xf, wf.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
                        row.update(fp8_s=tf, fp8_tflops=2 * m * n * k / tf / 1e12)
                    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
                        row["fp8_error"] = str(exc)[:120]
                        fp8 = False
                rows.append(row)
                del w
            print(f"gemm m={m} k={k}: " + " ".join(f"{r['bf16_tflops']:.0f}" for r in rows[-len(GEMM_N):]), flush=True)
    return rows


def attention_rows() -> list:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION} if GPU else {"math": SDPBackend.MATH}
    rows = []
    for d in (64, 128):
        heads = ATTN_WIDTH // d
        for s in ATTN_SEQ:
            b = max(ATTN_TOKENS // s, 1)
            q, k, v = (torch.randn(b, heads, s, d, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            grad = torch.randn(b, heads, s, d, device=DEV, dtype=torch.bfloat16)
            fwd_flops = 4.0 * b * heads * s * s * d / 2.0
            for name, backend in backends.items():
                row = {"backend": name, "head_dim": d, "heads": heads, "seq": s, "batch": b}
                try:
                    with sdpa_kernel(backend):
                        def fwd():
                            with torch.no_grad():
                                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                        def fwd_bwd():
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                            o.backward(grad)
                        tf = timed(fwd, flush=False)
                        tfb = timed(fwd_bwd, flush=False)
                    row.update(fwd_s=tf, fwd_bwd_s=tfb, fwd_tflops=fwd_flops / tf / 1e12,
                               bwd_tflops=2.5 * fwd_flops / max(tfb - tf, 1e-9) / 1e12,
                               fwd_bwd_tflops=3.5 * fwd_flops / tfb / 1e12)
                except Exception as exc:  # noqa: BLE001 - a backend this build lacks is recorded
                    row["error"] = str(exc)[:160]
                rows.append(row)
                print(f"attention {name} d={d} s={s}: " + (f"fwd {row['fwd_tflops']:.0f} fwd+bwd {row['fwd_bwd_tflops']:.0f} TFLOP/s"
                                                          if "fwd_s" in row else row["error"][:80]), flush=True)
            del q, k, v, grad
    return rows


def hbm_rows() -> list:
    n = (2 * 2**30 if GPU else 2**24) // 2
    a, b, c = (torch.randn(n, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(a)
    rows = []
    for name, fn, bytes_moved in (("copy", lambda: out.copy_(a), 4 * n),
                                  ("fma", lambda: torch.addcmul(c, a, b, out=out), 8 * n),
                                  ("add", lambda: torch.add(a, b, out=out), 6 * n)):
        t = timed(fn, flush=False)
        rows.append({"kernel": name, "bytes": bytes_moved, "s": t, "tbps": bytes_moved / t / 1e12})
        print(f"hbm {name}: {bytes_moved / t / 1e12:.2f} TB/s", flush=True)
    return rows


def launch_rows() -> dict:
    x = torch.zeros(1024, device=DEV)
    n = 2000
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    host_s = (time.perf_counter() - t0) / n
    sync()
    res = {"eager_host_s_per_op": host_s, "ops": n}
    if GPU:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(1.0)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(n):
                x.add_(1.0)
        g.replay()
        sync()
        t = timed(g.replay, reps=5, flush=False)
        res["graph_gpu_s_per_kernel"] = t / n
        t = timed(lambda: [x.add_(1.0) for _ in range(n)], reps=5, flush=False)
        res["eager_gpu_s_per_kernel"] = t / n
    print("launch:", {k: (f"{v * 1e6:.2f} us" if k.endswith("_s_per_op") or k.endswith("_kernel") else v) for k, v in res.items()}, flush=True)
    return res


def device_info() -> dict:
    info = {"torch": torch.__version__, "device": DEV, "quick": QUICK}
    if GPU:
        p = torch.cuda.get_device_properties(0)
        info.update(name=p.name, sm_count=p.multi_processor_count, memory_gb=p.total_memory / 1e9,
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = q.stdout.strip()
        except Exception as exc:  # noqa: BLE001
            info["nvidia_smi"] = f"unavailable: {exc}"
    return info


def main() -> None:
    out = next((a for a in sys.argv[1:] if not a.startswith("--")), "microbench.json")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    doc = {"device": device_info()}
    t0 = time.perf_counter()
    for key, fn in (("hbm", hbm_rows), ("launch", launch_rows), ("attention", attention_rows), ("gemm", gemm_rows)):
        doc[key] = fn()
        doc.setdefault("seconds", {})[key] = time.perf_counter() - t0
        json.dump(doc, open(out, "w"), indent=1)   # kept after each section: a timeout loses only the rest
    if GPU:
        doc["device"]["nvidia_smi_after"] = device_info().get("nvidia_smi")
    json.dump(doc, open(out, "w"), indent=1)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
