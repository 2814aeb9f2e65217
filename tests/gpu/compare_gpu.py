"""The cost model's compute terms and the verify runs against what one lent GPU measured (H200, H100).

    python tests/gpu/compare_gpu.py [--gpu h200|h100] [--microbench FILE] [--runs FILE] [--json]
    python tests/gpu/compare_gpu.py --across       # the same kernels on the H100 and the H200

Reads the bundled measurements (tests/data/gpu/GPU_*.json: `microbench*.py` and `verify_gpu.sh` output of
2026-12-04 (H200) and 2026-12-06 (H100), provenance in tests/data/gpu/README.md) and prints, beside the
cost model's own terms:
  * GEMM: measured time of each x @ W^T shape vs `costmodels.compute.gemm_s` + one kernel's overhead
    with the shipped defaults and with the literature prior; then the (gemm_eff_max, gemm_dim_half,
    kernel overhead) that fit the measurements themselves (a grid, least squares in log time).
  * attention: per backend and head dim, the forward efficiency eff_max x s/(s + seq_half) fitted to
    the measurements and the backward/forward time ratio, beside the model's constants.
  * HBM: achieved fraction of the datasheet bandwidth vs `hbm_eff`.
  * verify runs: each bundled jax-runner run, predicted now vs measured (step time and memory).
  * MoE (`microbench_moe.py`): one MoE layer's expert GEMMs as the cost model times them (each local
    expert's fc1 and fc2 at eff_max = 1 of MAMF, plus a kernel's overhead each) vs one batched GEMM over
    the experts and vs a GEMM per expert; token permutation, and an eager SwiGLU, in bytes moved per
    element at the datasheet bandwidth, beside the model's byte counts.
  * activations (`microbench_activation.py`): SwiGLU, GeLU and squared ReLU forward + backward in bytes
    per token per FFN unit per forward-equivalent, beside `elementwise_bytes_f`.
  * a layer's other memory-bound work (`microbench_layer_elementwise.py`): norms, rope, residual adds and
    their chain, bytes per token per hidden unit per forward-equivalent, beside `elementwise_bytes_h`.
  * --across: each memory-bound kernel's time on the H200 over the H100 (the same 132 SMs at 1,980 MHz,
    4.8 against 3.35 TB/s) beside a plain copy's and the cost model's (HBM's ratio).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)

from types import SimpleNamespace  # noqa: E402

from costmodels.compute import PERMUTE_BYTES_PER_H, attention_core_fwd_bwd_s, gemm_s, saturate  # noqa: E402
from costmodels.encode import encode_cluster  # noqa: E402
from costmodels.params import LITERATURE_PRIOR, EfficiencyParams  # noqa: E402
from costmodels.presets import GPU_PRESETS, build_cluster  # noqa: E402
from costmodels.specs import GPUSpec  # noqa: E402

DATA = os.path.join(ROOT, "tests", "data", "gpu")
#: the lent GPUs whose measurements are bundled (tests/data/gpu/GPU_*.json)
MEASURED_GPUS = ("h200", "h100")
#: SwiGLU outputs at least this large time their bytes, not launches and host dispatch
SWIGLU_MIN_ELEMENTS = 2.5e7


def files(gpu: str) -> dict:
    """The bundled measurement files of one lent GPU."""
    return {"microbench": os.path.join(DATA, f"{gpu}_microbench.json"),
            "runs": os.path.join(DATA, f"{gpu}_verify_runs.json"),
            "moe": os.path.join(DATA, f"{gpu}_microbench_moe.json"),
            "activation": os.path.join(DATA, f"{gpu}_microbench_activation.json"),
            "layer_elementwise": os.path.join(DATA, f"{gpu}_microbench_layer_elementwise.json")}


def load(path: str):
    with open(path) as fh:
        return json.load(fh)


def gemm_arrays(doc: dict) -> tuple:
    g = doc["gemm"]
    return tuple(np.array([r[k] for r in g], dtype=float) for k in ("m", "n", "k", "bf16_s"))


def training_shapes(m, n, k):
    """The shapes a transformer's projections take at training sizes: >= 2048 tokens per micro-batch,
    >= 1024 outputs and >= 2048 inputs per GPU (smaller ones are MoE experts or heavy TP)."""
    return (m >= 2048) & (n >= 1024) & (k >= 2048)


def model_gemm_s(m, n, k, e: EfficiencyParams, gpu: GPUSpec) -> np.ndarray:
    """The cost model's bf16 GEMM on the GPU's preset, plus the one kernel it launches."""
    t = gemm_s(m, n, k, gpu.peak_flops_bf16 * gpu.matmul_frac_bf16, 2.0, gpu.hbm_bandwidth_bytes_per_s,
               e.gemm_eff_max, e)
    return np.asarray(t) + e.kernel_overhead_s


def fit_gemm(m, n, k, t, gpu: GPUSpec, mask=None) -> dict:
    """(eff_max, dim_half, kernel overhead) minimizing the squared log error of the model's GEMM form
    (roofline max of the saturating compute term and HBM traffic, plus a fixed per-kernel time)."""
    mask = np.ones_like(m, dtype=bool) if mask is None else mask
    m, n, k, t = m[mask], n[mask], k[mask], t[mask]
    peak = gpu.peak_flops_bf16 * gpu.matmul_frac_bf16
    bw = gpu.hbm_bandwidth_bytes_per_s * EfficiencyParams().hbm_eff
    t_mem = (2.0 * (m * k + k * n) + 2.0 * m * n) / bw
    best = None
    for half in np.concatenate([np.arange(1.0, 20.0, 1.0), np.arange(20.0, 300.0, 2.0)]):
        shape = (m / (m + half)) * (n / (n + half)) * (k / (k + half))
        ideal = 2.0 * m * n * k / (peak * shape)                     # at eff_max = 1
        for ko in np.arange(0.0, 15.01, 0.25) * 1e-6:
            eff = np.arange(0.5, 1.3, 0.005)[:, None]
            pred = np.maximum(ideal[None, :] / eff, t_mem[None, :]) + ko
            loss = np.mean(np.log(pred / t[None, :]) ** 2, axis=1)
            i = int(np.argmin(loss))
            if best is None or loss[i] < best[0]:
                best = (float(loss[i]), float(eff[i, 0]), float(half), float(ko))
    return {"gemm_eff_max": best[1], "gemm_dim_half": best[2], "kernel_overhead_s": best[3]}


def error_figures(pred, meas) -> dict:
    err = pred / meas - 1.0
    return {"n": int(err.size), "mape_pct": float(100 * np.mean(np.abs(err))),
            "median_pct": float(100 * np.median(err)), "max_abs_pct": float(100 * np.max(np.abs(err)))}


def gemm_section(doc: dict, gpu: GPUSpec) -> dict:
    m, n, k, t = gemm_arrays(doc)
    train = training_shapes(m, n, k)
    out = {}
    for name, e in (("shipped defaults", EfficiencyParams()), ("literature prior", LITERATURE_PRIOR)):
        pred = model_gemm_s(m, n, k, e, gpu)
        out[name] = {"all": error_figures(pred, t), "training shapes": error_figures(pred[train], t[train])}
    out["fit to these measurements"] = fit_gemm(m, n, k, t, gpu=gpu)
    tflops = 2 * m * n * k / t / 1e12
    out["training shapes TFLOP/s"] = {"median": float(np.median(tflops[train])), "max": float(tflops.max()),
                                      "of MAMF (median)": float(np.median(tflops[train]) * 1e12
                                                                / (gpu.peak_flops_bf16 * gpu.matmul_frac_bf16))}
    return out


def fit_attention(rows: list, gpu: GPUSpec) -> dict:
    """eff_max and seq_half of the forward efficiency eff_max x s/(s+seq_half) (fraction of bf16 peak),
    least squares in log throughput over a grid; and the median backward/forward time ratio."""
    s = np.array([r["seq"] for r in rows], dtype=float)
    f = np.array([r["fwd_tflops"] for r in rows]) * 1e12 / gpu.peak_flops_bf16
    best = None
    for half in np.arange(16.0, 4096.0, 2.0):
        sat = s / (s + half)
        eff = float(np.exp(np.mean(np.log(f / sat))))           # closed form in log space
        loss = float(np.mean(np.log(eff * sat / f) ** 2))
        if best is None or loss < best[0]:
            best = (loss, eff, float(half))
    ratio = [r["fwd_bwd_s"] / r["fwd_s"] - 1.0 for r in rows]
    return {"attn_eff_max": best[1], "attn_seq_half": best[2], "attn_bwd_ratio": float(np.median(ratio)),
            "rms_log_error": float(np.sqrt(best[0]))}


def attention_section(doc: dict, gpu: GPUSpec) -> dict:
    out = {}
    for backend in sorted({r["backend"] for r in doc["attention"]}):
        for d in (64, 128):
            rows = [r for r in doc["attention"] if r["backend"] == backend and r["head_dim"] == d and "fwd_s" in r]
            if rows:
                out[f"{backend} d={d}"] = fit_attention(rows, gpu)
    for backend in sorted({r["backend"] for r in doc["attention"]}):
        ratio = measured_head_dim_ratio(doc, backend)
        if ratio is not None:
            out[f"{backend} head dim 64 / 128"] = ratio
    out["model head dim 64 / 128"] = model_head_dim_ratio(gpu)
    e, p = EfficiencyParams(), LITERATURE_PRIOR
    out["model (shipped defaults)"] = {"attn_eff_max": e.attn_eff_max, "attn_seq_half": e.attn_seq_half,
                                       "attn_bwd_ratio": e.attn_bwd_ratio}
    out["model (literature prior)"] = {"attn_eff_max": p.attn_eff_max, "attn_seq_half": p.attn_seq_half,
                                       "attn_bwd_ratio": p.attn_bwd_ratio}
    return out


def attention_core_s(gpu: str, head_dim: float, heads: float, seq: float, *, fp8: float = 0.0, tp: float = 1.0,
                     window: float = 0.0, sm_cycles_x: float = 1.0, e: EfficiencyParams | None = None) -> tuple:
    """Forward and backward seconds of one sequence's fused attention core on a GPU preset, as the cost model
    prices it (compute.attention_core_fwd_bwd_s with the preset encoded as the scorer encodes it); a window
    applies to half the layers; sm_cycles_x scales the SMs' rate (exponentials, shared memory)."""
    H = encode_cluster(build_cluster(gpu=gpu, num_gpus=8))
    H = {**H, "sm_cycles": H["sm_cycles"] * np.float32(sm_cycles_x)}
    S = SimpleNamespace(tokens=np.float32(seq), tokens_elem=np.float32(seq), tp=np.float32(tp), cp=np.float32(1.0),
                        routed_tokens=np.float32(0.0), softmax_fallback=np.float32(0.0))
    M = {"heads": heads, "qk_head_dim": head_dim, "v_head_dim": head_dim, "window": window,
         "window_layer_frac": 0.5 if window else 0.0}
    J = {"seq_len": float(seq), "flash": 1.0, "fp8_attention": fp8, "packed_tokens": 0.0, "attn_rate_x": 1.0}
    f, b = attention_core_fwd_bwd_s(S, M, H, J, e or EfficiencyParams())
    return float(f), float(b)


def model_head_dim_ratio(gpu: GPUSpec, seq: float = 16384.0) -> float:
    """The cost model's fused attention forward+backward throughput at head dim 64 over head dim 128 (same width):
    its MMAs, exponentials and backward shared-memory reads at the GPU's rates (compute.attention_core_fwd_bwd_s)."""
    return sum(attention_core_s(gpu.name, 128.0, 16.0, seq)) / sum(attention_core_s(gpu.name, 64.0, 32.0, seq))


def measured_head_dim_ratio(doc: dict, backend: str, min_seq: int = 4096) -> float | None:
    """Forward+backward throughput at head dim 64 over head dim 128 (same width, causal), the median
    over sequences >= min_seq (where the sequence term has saturated)."""
    by = {(r["head_dim"], r["seq"]): r["fwd_bwd_tflops"] for r in doc["attention"]
          if r["backend"] == backend and "fwd_bwd_tflops" in r and r["seq"] >= min_seq}
    ratios = [by[(64, s)] / by[(128, s)] for (d, s) in by if d == 64 and (128, s) in by]
    return float(np.median(ratios)) if ratios else None


def hbm_section(doc: dict, gpu: GPUSpec) -> dict:
    fr = {r["kernel"]: r["tbps"] * 1e12 / gpu.hbm_bandwidth_bytes_per_s for r in doc["hbm"]}
    return {"measured fraction of datasheet": fr, "mean": float(np.mean(list(fr.values()))),
            "model hbm_eff (shipped)": EfficiencyParams().hbm_eff, "model hbm_eff (prior)": LITERATURE_PRIOR.hbm_eff}


def runs_section(rows: list) -> list:
    """Each usable verify run predicted now (its own problem and plan, the runner's framework) vs measured
    (a run that ran out of memory has no step time: `oom_runs`)."""
    from autotune.search import exhaustive
    from autotune.validate import case_from_row
    from autotune.verify import dynamic_memory_gb
    out = []
    e = EfficiencyParams()
    for row in (r for r in rows if r["usable"]):
        case = case_from_row(row)
        best = exhaustive(case.problem, e, top_k=1, fixed=case.fixed).best
        meas, mem = row["measured"], dynamic_memory_gb(best, e)["total"]
        out.append({"id": row["id"], "model": row["model"]["name"], "plan": row["id"].split("-L")[1][:-17],
                    "step_predicted_s": best["step_time_s"], "step_measured_s": meas["iteration_time_s"],
                    "step_error_pct": 100 * (best["step_time_s"] / meas["iteration_time_s"] - 1),
                    "overhead_predicted_s": best["time_breakdown_s"].get("overhead", 0.0),
                    "recompute_predicted_s": best["time_breakdown_s"].get("recompute", 0.0),
                    "memory_predicted_gb": mem, "memory_measured_gb": meas["memory_gb"],
                    "memory_error_pct": 100 * (mem / meas["memory_gb"] - 1)})
    return out


def model_expert_gemms_s(r: dict, e: EfficiencyParams, gpu: GPUSpec, grouped: bool = True) -> float:
    """The cost model's expert GEMMs of one MoE layer forward on the GPU's preset (compute.moe_mlp_s with
    every expert at m_e tokens): fc1 and fc2 each one grouped GEMM over the local experts, plus a kernel's
    overhead each; `grouped=False`: the law before 2026-12-06, each expert's GEMMs timed on their own."""
    m, h, fe, n = r["m_e"], r["h"], r["fe"], r["n_local"]
    peak, bw = gpu.peak_flops_bf16 * gpu.matmul_frac_bf16, gpu.hbm_bandwidth_bytes_per_s
    if grouped:
        t = (gemm_s(m, 2 * fe, h, peak, 2.0, bw, e.gemm_eff_max, e, n)
             + gemm_s(m, h, fe, peak, 2.0, bw, e.gemm_eff_max, e, n))
        return float(t) + 2.0 * e.kernel_overhead_s
    t = gemm_s(m, 2 * fe, h, peak, 2.0, bw, e.gemm_eff_max, e) + gemm_s(m, h, fe, peak, 2.0, bw, e.gemm_eff_max, e)
    return n * (float(t) + 2.0 * e.kernel_overhead_s)


def moe_section(doc: dict, gpu: GPUSpec) -> dict:
    """Model / measured time of the expert GEMMs by tokens per expert (medians over models and local
    expert counts), at eff_max = 1 (isolated kernels, as the GEMM sweep found); bytes per element of
    the memory-bound MoE kernels at the datasheet bandwidth."""
    e = EfficiencyParams()._replace(gemm_eff_max=1.0)
    by_m: dict = {}
    for r in doc["experts"]:
        p = model_expert_gemms_s(r, e, gpu)
        d = by_m.setdefault(r["m_e"], {"batched": [], "per_expert_law": [], "per_expert": [], "fp8_over_bf16": []})
        d["batched"].append(p / r["bmm_s"])
        d["per_expert_law"].append(model_expert_gemms_s(r, e, gpu, grouped=False) / r["bmm_s"])
        d["per_expert"].append(p / r["loop_s"])
        if "loop_fp8_s" in r:
            d["fp8_over_bf16"].append(r["loop_fp8_s"] / r["loop_s"])
    gemms = {m: {k: float(np.median(v)) for k, v in d.items() if v} for m, d in sorted(by_m.items())}
    bw = gpu.hbm_bandwidth_bytes_per_s
    mb = doc["memory_bound"]

    def per_routed(key):
        v = [r[key] * bw / (r["tokens"] * r["top_k"] * r["h"]) for r in mb if key in r]
        return {"median": float(np.median(v)), "min": float(min(v)), "max": float(max(v))} if v else None

    # SwiGLU: forward and (forward + backward) / 3, the model's unit (backward = 2 x forward), on the
    # shapes large enough that launch and host time do not count (>= 25 M elements of the output)
    big = [r for r in mb if r["swiglu_tokens"] * r["fe"] >= SWIGLU_MIN_ELEMENTS]

    def per_f(key, div=1.0):
        v = [r[key] * bw / (r["swiglu_tokens"] * r["fe"]) / div for r in big if key in r]
        return float(np.median(v)) if v else None
    return {"expert GEMMs model / measured by m_e": gemms,
            "permute bytes per routed token per h": {**per_routed("permute_s"), "model": PERMUTE_BYTES_PER_H / 2.0},
            "unpermute bytes per routed token per h": {
                "index_add_": per_routed("unpermute_s"), "scatter_add_ (Megatron-Core unfused)": per_routed("unpermute_scatter_s"),
                "sorted gather + weighted sum": per_routed("unpermute_sorted_s"), "model": PERMUTE_BYTES_PER_H / 2.0},
            "SwiGLU bytes per token per f": {
                "shapes": len(big), "eager forward": per_f("swiglu_s"), "eager (fwd + bwd) / 3": per_f("swiglu_fwd_bwd_s", 3.0),
                "compiled forward": per_f("swiglu_compiled_s"),
                "compiled (fwd + bwd) / 3": per_f("swiglu_compiled_fwd_bwd_s", 3.0),
                "model elementwise_bytes_f (shipped)": EfficiencyParams().elementwise_bytes_f,
                "model elementwise_bytes_f (prior)": LITERATURE_PRIOR.elementwise_bytes_f}}


def activation_section(doc: dict, gpu: GPUSpec) -> dict:
    """Per activation: median over the shapes of (forward + backward) / 3 and forward alone, bytes per token
    per FFN unit at the datasheet bandwidth, eager and compiled."""
    bw = gpu.hbm_bandwidth_bytes_per_s
    out = {}
    for name in sorted({r["activation"] for r in doc["activation"]}):
        rows = [r for r in doc["activation"] if r["activation"] == name]
        out[name] = {}
        for kind in ("eager", "compiled"):
            fb = [r[f"{kind}_fwd_bwd_s"] * bw / (r["tokens"] * r["ffn"]) / 3.0 for r in rows if f"{kind}_fwd_bwd_s" in r]
            fw = [r[f"{kind}_fwd_s"] * bw / (r["tokens"] * r["ffn"]) for r in rows if f"{kind}_fwd_s" in r]
            if fb:
                out[name][kind] = {"(fwd + bwd) / 3": float(np.median(fb)), "fwd": float(np.median(fw))}
    out["model elementwise_bytes_f (shipped)"] = EfficiencyParams().elementwise_bytes_f
    return out


def layer_elementwise_section(doc: dict, gpu: GPUSpec) -> dict:
    """Per kernel (and the whole chain, `layer`): median over the shapes of (forward + backward) / 3 and of
    the forward, bytes per token per hidden unit at the datasheet bandwidth, eager and compiled."""
    bw = gpu.hbm_bandwidth_bytes_per_s
    out = {}
    for name in ("norm_rms", "norm_ln", "rope", "residual", "layer"):
        rows = [r for r in doc["layer_elementwise"] if r["kernel"] == name]
        out[name] = {kind: {"(fwd + bwd) / 3": float(np.median([r[f"{kind}_fwd_bwd_s"] * bw / (r["tokens"] * r["hidden"]) / 3
                                                             for r in rows])),
                            "fwd": float(np.median([r[f"{kind}_fwd_s"] * bw / (r["tokens"] * r["hidden"]) for r in rows]))}
                     for kind in ("eager", "compiled") if all(f"{kind}_fwd_bwd_s" in r for r in rows)}
    out["model elementwise_bytes_h (shipped)"] = EfficiencyParams().elementwise_bytes_h
    out["model elementwise_bytes_h (prior)"] = LITERATURE_PRIOR.elementwise_bytes_h
    return out


#: the memory-bound kernels measured on both GPUs: (file, list key, identity fields, timed fields)
ACROSS_KERNELS = (
    ("activation", "activation", ("activation", "tokens", "ffn"),
     ("eager_fwd_s", "eager_fwd_bwd_s", "compiled_fwd_s", "compiled_fwd_bwd_s")),
    ("layer_elementwise", "layer_elementwise", ("kernel", "tokens", "hidden"),
     ("eager_fwd_s", "eager_fwd_bwd_s", "compiled_fwd_s", "compiled_fwd_bwd_s")),
    ("moe", "memory_bound", ("model", "tokens"),
     ("permute_s", "unpermute_s", "unpermute_scatter_s", "unpermute_sorted_s", "swiglu_s", "swiglu_fwd_bwd_s",
      "swiglu_compiled_s", "swiglu_compiled_fwd_bwd_s", "router_s")),
)


def across_section(slow: str = "h100", fast: str = "h200") -> dict:
    """Each memory-bound kernel (and shape) measured on both GPUs: its time on `fast` over `slow`, by
    kernel family, beside a plain copy's ratio and the cost model's (memory-bound work at HBM x hbm_eff:
    the datasheet bandwidths' ratio)."""
    ratios: dict = {}
    for key, field, ident, timed in ACROSS_KERNELS:
        a = {tuple(r.get(k) for k in ident): r for r in load(files(slow)[key])[field]}
        for r in load(files(fast)[key])[field]:
            other = a.get(tuple(r.get(k) for k in ident))
            for t in timed:
                if other is not None and r.get(t) and other.get(t):
                    ratios.setdefault(f"{key}: {t}", []).append(r[t] / other[t])
    hbm = {x["kernel"]: x["s"] for x in load(files(slow)["microbench"])["hbm"]}
    copy = [x["s"] / hbm[x["kernel"]] for x in load(files(fast)["microbench"])["hbm"] if x["kernel"] in hbm]
    every = np.concatenate([np.asarray(v) for v in ratios.values()])
    model = GPU_PRESETS[slow].hbm_bandwidth_bytes_per_s / GPU_PRESETS[fast].hbm_bandwidth_bytes_per_s
    return {"pair": f"{fast} / {slow}", "by kernel": {k: {"n": len(v), "median": float(np.median(v))}
                                                      for k, v in ratios.items()},
            "n": int(every.size), "median": float(np.median(every)),
            "geometric mean": float(np.exp(np.mean(np.log(every)))),
            "copy / add / fma": float(np.median(copy)), "model": model}


def print_across(a: dict) -> None:
    print(f"Memory-bound kernels, time {a['pair']} (the same 132 SMs at 1,980 MHz; bundled microbench files)")
    for k, v in a["by kernel"].items():
        print(f"  {k:48s} n={v['n']:3d}  median {v['median']:.2f}")
    print(f"  all {a['n']} (kernel, shape) pairs: median {a['median']:.3f}, geometric mean {a['geometric mean']:.3f}; "
          f"a plain copy / add / fma {a['copy / add / fma']:.3f}")
    print(f"  cost model (memory-bound work at HBM x hbm_eff): {a['model']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h200", choices=MEASURED_GPUS)
    ap.add_argument("--across", action="store_true", help="memory-bound kernels, H200 over H100")
    for key in ("microbench", "runs", "moe", "activation", "layer-elementwise"):
        ap.add_argument(f"--{key}", default=None, help="default: the bundled file of --gpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.across:
        a = across_section()
        print(json.dumps(a, indent=1)) if args.json else print_across(a)
        return
    gpu, path = GPU_PRESETS[args.gpu], files(args.gpu)
    path.update({k: v for k, v in (("microbench", args.microbench), ("runs", args.runs), ("moe", args.moe),
                                   ("activation", args.activation), ("layer_elementwise", args.layer_elementwise))
                 if v})
    doc = load(path["microbench"])
    runs = load(path["runs"])
    report = {"device": doc["device"], "gemm": gemm_section(doc, gpu), "attention": attention_section(doc, gpu),
              "hbm": hbm_section(doc, gpu), "launch": doc.get("launch"), "runs": runs_section(runs),
              "oom runs": [r["id"] for r in runs if not r["usable"]],
              "moe": moe_section(load(path["moe"]), gpu), "activation": activation_section(load(path["activation"]), gpu),
              "layer elementwise": layer_elementwise_section(load(path["layer_elementwise"]), gpu)}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    dev = doc["device"]
    print(f"{dev.get('name')} ({dev.get('sm_count')} SMs), torch {dev.get('torch')}, CUDA {dev.get('cuda')}, "
          f"cuDNN {dev.get('cudnn')}; nvidia-smi before/after: {dev.get('nvidia_smi')} / {dev.get('nvidia_smi_after')}")
    print("\nGEMM (bf16 x @ W^T, L2 flushed): cost model vs measured")
    for name in ("shipped defaults", "literature prior"):
        for sel, f in report["gemm"][name].items():
            print(f"  {name:17s} {sel:16s} n={f['n']:3d}  MAPE {f['mape_pct']:5.1f} %  median {f['median_pct']:+6.1f} %  "
                  f"max {f['max_abs_pct']:5.0f} %")
    fit = report["gemm"]["fit to these measurements"]
    ts = report["gemm"]["training shapes TFLOP/s"]
    print(f"  fit to the measurements: gemm_eff_max {fit['gemm_eff_max']:.3f}, gemm_dim_half {fit['gemm_dim_half']:.0f}, "
          f"kernel overhead {fit['kernel_overhead_s'] * 1e6:.2f} us  (shipped {EfficiencyParams().gemm_eff_max:.3f}, "
          f"{EfficiencyParams().gemm_dim_half:.1f}, {EfficiencyParams().kernel_overhead_s * 1e6:.2f} us; prior "
          f"{LITERATURE_PRIOR.gemm_eff_max}, {LITERATURE_PRIOR.gemm_dim_half:.0f}, {LITERATURE_PRIOR.kernel_overhead_s * 1e6:.0f} us)")
    print(f"  training shapes: median {ts['median']:.0f} TFLOP/s = {ts['of MAMF (median)']:.3f} of MAMF; max {ts['max']:.0f}")
    print("\nattention (causal SDPA, bf16): forward eff_max x s/(s + seq_half) of bf16 peak; backward / forward time")
    for key, v in report["attention"].items():
        if isinstance(v, dict):
            print(f"  {key:26s} eff_max {v['attn_eff_max']:.3f}  seq_half {v['attn_seq_half']:6.0f}  bwd/fwd {v['attn_bwd_ratio']:.2f}")
        else:
            print(f"  {key:26s} {v:.3f}")
    h = report["hbm"]
    print("\nHBM: " + ", ".join(f"{k} {v:.3f}" for k, v in h["measured fraction of datasheet"].items())
          + f" of {gpu.hbm_bandwidth_bytes_per_s / 1e12:.1f} TB/s; hbm_eff shipped {h['model hbm_eff (shipped)']:.3f}, "
          f"prior {h['model hbm_eff (prior)']}")
    if report["launch"]:
        la = report["launch"]
        print(f"launch: {la.get('graph_gpu_s_per_kernel', 0) * 1e6:.2f} us per tiny kernel in a CUDA graph, "
              f"{la.get('eager_host_s_per_op', 0) * 1e6:.2f} us host time per eager PyTorch op")
    print(f"\nverify runs (jax runner, one {args.gpu.upper()}, proxies of 8-GPU plans): predicted now vs measured")
    print(f"  {'model':18s} {'plan':42s} {'pred s':>7s} {'meas s':>7s} {'err %':>6s} {'ovh s':>6s} {'rec s':>6s} "
          f"{'pred GB':>7s} {'meas GB':>7s} {'err %':>6s}")
    for r in report["runs"]:
        print(f"  {r['model'][:18]:18s} {r['plan'][:42]:42s} {r['step_predicted_s']:7.3f} {r['step_measured_s']:7.3f} "
              f"{r['step_error_pct']:+6.1f} {r['overhead_predicted_s']:6.3f} {r['recompute_predicted_s']:6.3f} "
              f"{r['memory_predicted_gb']:7.2f} {r['memory_measured_gb']:7.2f} {r['memory_error_pct']:+6.1f}")
    se = np.array([r["step_error_pct"] for r in report["runs"]])
    me = np.array([r["memory_error_pct"] for r in report["runs"]])
    print(f"  step time MAPE {np.mean(np.abs(se)):.1f} % (max {np.max(np.abs(se)):.1f} %); "
          f"memory MAPE {np.mean(np.abs(me)):.1f} % (max {np.max(np.abs(me)):.1f} %)")
    for rid in report["oom runs"]:
        print(f"  out of memory (no step time): {rid}")
    mo = report["moe"]
    print("\nMoE expert GEMMs (bf16, one layer forward): cost model (grouped GEMMs) at eff_max 1 / measured, median over 5 "
          "models x 1-32 local experts")
    for m_e, v in mo["expert GEMMs model / measured by m_e"].items():
        print(f"  m_e {m_e:5d} tokens per expert: vs one batched GEMM {v['batched']:.2f} (the per-expert law "
              f"{v['per_expert_law']:.2f}), vs a GEMM per expert {v['per_expert']:.2f}; fp8 / bf16 time (per expert) "
              f"{v.get('fp8_over_bf16', float('nan')):.2f}")
    pb, ub, sw = (mo["permute bytes per routed token per h"], mo["unpermute bytes per routed token per h"],
                  mo["SwiGLU bytes per token per f"])
    print(f"  permute (gather into expert order): {pb['median']:.1f} B per routed token per h ({pb['min']:.1f}-{pb['max']:.1f}); "
          f"model {pb['model']:.0f}")
    print("  unpermute, B per routed token per h: " + ", ".join(f"{k} {v['median']:.1f}" for k, v in ub.items() if isinstance(v, dict))
          + f"; model {ub['model']:.0f}")
    print(f"  SwiGLU over {sw['shapes']} large shapes, B per token per f: eager forward {sw['eager forward']:.1f}, "
          f"(fwd + bwd) / 3 {sw['eager (fwd + bwd) / 3']:.1f}; compiled forward {sw['compiled forward']:.1f}, "
          f"(fwd + bwd) / 3 {sw['compiled (fwd + bwd) / 3']:.1f}; model elementwise_bytes_f "
          f"{sw['model elementwise_bytes_f (shipped)']:.1f} (prior {sw['model elementwise_bytes_f (prior)']:.1f})")
    print_bytes_table("MLP activations (bf16, 4 shapes): B per token per FFN unit", report["activation"], 13)
    print(f"  model elementwise_bytes_f {report['activation']['model elementwise_bytes_f (shipped)']:.1f} for every "
          "activation")
    le = report["layer elementwise"]
    print_bytes_table("A layer's norms, rope and residual adds (bf16, 4 shapes): B per token per hidden unit", le, 9)
    print(f"  model elementwise_bytes_h {le['model elementwise_bytes_h (shipped)']:.1f} (prior "
          f"{le['model elementwise_bytes_h (prior)']:.0f})")


def print_bytes_table(title: str, section: dict, width: int) -> None:
    """One line per kernel of an activation / element-wise section: (fwd + bwd) / 3 [fwd], eager | compiled."""
    print(f"\n{title}, (fwd + bwd) / 3 [fwd], eager | compiled")
    for name, v in section.items():
        if isinstance(v, dict):
            print(f"  {name:{width}s} " + " | ".join(f"{k} {x['(fwd + bwd) / 3']:6.1f} [{x['fwd']:5.1f}]"
                                                  for k, x in v.items()))

if __name__ == "__main__":
    main()
