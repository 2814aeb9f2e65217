"""The cost model's efficiency constants: a small, named, documented pytree that calibration fits.

Each field is a physical quantity with a range; `PARAM_BOUNDS` gives it (calibration keeps the
parameters inside by construction). The defaults were fitted to the public validation runs (see
README "Accuracy"), starting from the literature values cited per field.
"""
from __future__ import annotations

import json
from typing import NamedTuple

import jax.numpy as jnp


class EfficiencyParams(NamedTuple):
    # --- compute ---
    gemm_eff_max: float = 0.9001          # large bf16 GEMM fraction of the GPU's max achievable matmul rate (GPUSpec MAMF)
    gemm_eff_max_fp8: float = 0.9287      # large fp8 GEMM fraction of the fp8 MAMF (TE/cuBLASLt, scaling included)
    gemm_dim_half: float = 46.0           # a GEMM dim of this size halves efficiency: eff ~ x/(x+x0) per dim;
    #                                       measured, not fitted (H200 sweep, tests/gpu/compare_gpu.py)
    attn_eff_max: float = 0.9507          # fused attention's fraction of its MMA + exponential (+ backward shared-memory) bound
    attn_seq_half: float = 512.0        # fused attention forward's fixed cost per query row, in keys x 2 (measured:
    #                                     cuDNN 9.19 on the lent H100 / H200; the backward's is compute.ATTN_BWD_ROW_COST_X of it)
    attn_bwd_ratio: float = 2.5         # fused attention backward MMAs / forward MMAs (5 vs 2 GEMMs)
    softmax_bytes_per_score: float = 11.95  # unfused attention: HBM bytes per score element fwd (write, read, mask, dropout)
    hbm_eff: float = 0.904               # achieved fraction of HBM bandwidth for memory-bound kernels
    elementwise_bytes_h: float = 24.45   # bytes moved per token per hidden unit per layer fwd (norms, residuals, rope, casts)
    elementwise_bytes_f: float = 28.56    # bytes moved per token per FFN unit per layer fwd (activation fn;
    #                                         H200: compiled SwiGLU 28.8, tests/gpu/compare_gpu.py)
    lp_cast_bytes: float = 3.112          # fp8/fp4: bytes moved per GEMM-input element to cast + transpose
    kernel_overhead_s: float = 3.659e-06     # launch + tail per kernel (dominates small models)
    host_op_s: float = 5.508e-05              # host time to issue one kernel from an eager framework (Python, autograd, launch)
    # --- communication ---
    intra_bw_eff: float = 0.6863          # achieved NVLink bus bandwidth fraction (NCCL busbw / link)
    inter_bw_eff: float = 0.7503          # achieved NIC bandwidth fraction
    tp_comm_overlap: float = 0.5981        # with TE userbuffers (job.tp_comm_overlap + SP): fraction of TP comm hidden under GEMMs
    dp_overlap: float = 0.5168             # fraction of DP grad reduce / param gather that may hide under compute
    cp_overlap: float = 0.9             # fraction of ring-attention KV exchange hidden under attention compute
    pp_overlap: float = 0.488             # fraction of pipeline p2p hidden under compute
    ep_overlap: float = 0.8062             # --overlap-moe-expert-parallel-comm: share of a merged fwd+bwd pair's compute the all-to-alls hide under
    moe_imbalance: float = 1.05         # busiest expert rank load / mean (force-balanced routing ~1.0)
    step_overhead_s: float = 0.01379       # per optimizer step fixed host work (logging, grad-norm, scheduler)
    microbatch_overhead_s: float = 0.00243  # per micro-batch host work (data, schedule bookkeeping)
    collective_latency_s: float = 1.48e-05  # fixed launch + synchronization cost of one NCCL collective
    zero3_bw_eff: float = 0.1136           # DeepSpeed ZeRO-3's per-module gathers: fraction of the bus bandwidth reached
    # --- memory ---
    mem_fragmentation: float = 1.01     # allocator overhead on dynamic memory (expandable_segments, as NeMo recipes set)


#: Physical ranges (low, high) of every field; calibration stays inside them.
PARAM_BOUNDS = {
    "gemm_eff_max": (0.5, 1.0), "gemm_eff_max_fp8": (0.4, 1.0), "gemm_dim_half": (1.0, 512.0),
    "attn_eff_max": (0.15, 1.0), "attn_seq_half": (16.0, 4096.0), "attn_bwd_ratio": (1.5, 4.0),
    "hbm_eff": (0.3, 0.95), "softmax_bytes_per_score": (8.0, 32.0), "elementwise_bytes_h": (4.0, 96.0), "elementwise_bytes_f": (1.0, 32.0),
    "kernel_overhead_s": (0.0, 5e-5), "host_op_s": (1e-6, 1.5e-4), "lp_cast_bytes": (0.0, 24.0),
    "intra_bw_eff": (0.3, 0.95), "inter_bw_eff": (0.3, 0.95), "tp_comm_overlap": (0.0, 0.95),
    "dp_overlap": (0.0, 1.0), "cp_overlap": (0.0, 1.0), "pp_overlap": (0.0, 1.0),
    "ep_overlap": (0.0, 0.95), "moe_imbalance": (1.0, 2.0), "step_overhead_s": (0.0, 1.0),
    "microbatch_overhead_s": (0.0, 0.05),
    "collective_latency_s": (0.0, 2e-4), "zero3_bw_eff": (0.05, 1.0),
    "mem_fragmentation": (1.0, 1.5),
}


def params_as_arrays(p: EfficiencyParams) -> EfficiencyParams:
    return EfficiencyParams(*(jnp.asarray(v, dtype=jnp.float32) for v in p))


def params_to_dict(p: EfficiencyParams) -> dict:
    return {k: float(v) for k, v in p._asdict().items()}


def params_from_dict(d: dict, base: EfficiencyParams | None = None) -> EfficiencyParams:
    base = base or EfficiencyParams()
    unknown = set(d) - set(EfficiencyParams._fields)
    if unknown:
        raise ValueError(f"calibration: unknown parameters {sorted(unknown)}")
    return base._replace(**{k: float(v) for k, v in d.items()})


def load_params_file(path: str) -> tuple[EfficiencyParams, dict]:
    """Read a calibration JSON: {"params": {...}, "gpu": ..., ...}; returns params and metadata."""
    with open(path) as fh:
        doc = json.load(fh)
    return params_from_dict(doc.get("params", {})), doc


#: The literature starting point of every parameter, before any fit: vendor GEMM and NCCL
#: benchmarks (a model's large GEMMs run near the GPU's maximum achievable matmul rate, MAMF, which
#: GPUSpec carries per GPU; fp8 GEMMs a little below it for their scaling; NCCL bus bandwidth ~75-80%
#: of link rate),
#: fused attention at 0.95 of its MMA + exponential (+ backward shared-memory) bound (cuDNN 9.19 on the lent H100 /
#: H200 at sequences of 4k-16k: 0.96, tests/test_attention_head_dim.py), backward 2.5x the forward's MMAs, K22's activation byte counts, fp8 casts at 6 B per
#: GEMM-input element (the first cost model's count; Transformer Engine's cast-transpose itself reads 2 and writes
#: 1 + 1, but a prior of 4 fitted worse out of sample: README "Accuracy"; tensorwise scaling's amax pass is
#: compute.FP8_AMAX_PASS_BYTES on top), ZeRO's
#: Adam traffic, PyTorch eager dispatch (~5-25 us of host work per op: Python, autograd recording,
#: the ATen dispatcher, cudaLaunchKernel; 25 us per kernel counts the module calls between them; TransformerEngine
#: issue #2053 measured one torch.nn.Linear forward at 13.48 us of CPU on a DGX H100, and TE's Linear at 99.66 us on
#: GB200, ~36 us on the DGX's Xeon at Grace's 2.75x: GPUSpec.host_op_x),
#: the EP batch-level overlap hiding all-to-alls under ~0.8 of the other micro-batch's compute (the
#: communication kernels hold ~20-24 of 132 SMs: DeepEP README).
#: DeepSpeed's ZeRO-3 of 2021 gathered ~21 GB/s per GPU inside one NVLink A100 node (DeepSpeed issue #1174:
#: a 5.1B model's forward 480 ms under stage 3 vs 60 ms under stage 2, 7/8 of 10.2 GB gathered in 0.42 s),
#: 0.095 of that node's NVLink bus bandwidth (300 GB/s x 0.75).
#: Measured on one H200 (tests/gpu/microbench.py, tests/data/gpu/; `python tests/gpu/compare_gpu.py`):
#: bf16 x @ W^T over 224 shapes fits gemm_dim_half 46 (the literature's 48; not fitted, the same in the
#: defaults) at 1.0 of MAMF; copy / add /
#: fused multiply-add reach 0.87-0.93 of the datasheet HBM bandwidth (hbm_eff 0.90). SwiGLU forward +
#: backward, compiled as Megatron-Core's jit_fuser does, moves the equivalent of 28.8 B per token per FFN
#: unit per forward at that bandwidth (tests/gpu/microbench_moe.py; an ideal fused kernel's byte count,
#: the earlier prior, is 6: read 2f, write f).
#: Calibration starts here; cross-validation measures fits against it.
LITERATURE_PRIOR = EfficiencyParams(
    gemm_eff_max=0.95, gemm_eff_max_fp8=0.90, gemm_dim_half=46.0, attn_eff_max=0.95, attn_seq_half=512.0,
    attn_bwd_ratio=2.5, softmax_bytes_per_score=13.0, hbm_eff=0.90, elementwise_bytes_h=24.0,
    elementwise_bytes_f=28.8, lp_cast_bytes=6.0, kernel_overhead_s=5e-6, host_op_s=2.5e-5,
    intra_bw_eff=0.75, inter_bw_eff=0.80, tp_comm_overlap=0.6, dp_overlap=0.8, cp_overlap=0.9,
    pp_overlap=0.5, ep_overlap=0.8, moe_imbalance=1.05, step_overhead_s=0.02, microbatch_overhead_s=2e-3,
    collective_latency_s=1.5e-5, zero3_bw_eff=0.095,
    mem_fragmentation=1.03,
)
