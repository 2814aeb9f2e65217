"""Famous published runs that no bundled dataset holds, predicted as `autotune validate` predicts a row.

Not a dataset: the rows below are written by hand from the papers (section and figure in each), some of their
knobs are unknown (filled as `validate` fills them) and BLOOM's throughput is read from its TFLOP/s figure, so
they serve as a sanity check out of sample, never as a fit target. README "Megatron-DeepSpeed" quotes them.

    python tests/benchmarks/bench_famous_runs.py [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from autotune.validate import validate_rows  # noqa: E402

A100 = {"gpu": "A100-SXM4-80GB", "gpu_key": "a100-80gb", "gpus_per_node": 8}
H100 = {"gpu": "H100-SXM5-80GB", "gpu_key": "h100", "gpus_per_node": 8}


def _row(rid: str, title: str, model: dict, hardware: dict, plan: dict, measured: dict, notes: str) -> dict:
    full_plan = {"tp": None, "pp": None, "dp": None, "cp": 1, "ep": None, "vpp": None, "micro_batch": None,
                 "global_batch": None, "sequence_parallel": None, "recompute_key": None, "zero_key": None,
                 "distributed_optimizer_or_zero": None, "precision_key": "bf16"}
    full_plan.update(plan)
    return {"id": rid, "source": {"title": title, "group": title.split(",")[0]}, "usable": True, "confidence": "medium",
            "model": {"name": rid, "num_experts": None, "top_k": None, "moe_ffn_hidden": None, **model},
            "hardware": hardware, "plan": full_plan, "measured": measured,
            "notes": notes}


def rows() -> list:
    out = []
    # Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv:2201.11990),
    # section 2.4: global batch 1920 on 280 / 350 / 420 DGX A100 nodes, 60.1 / 50.2 / 44.4 s per iteration
    # (126 / 121 / 113 TFLOP/s per GPU); 8-way tensor slicing, 35-way pipeline; micro-batch not stated
    mtnlg = {"layers": 105, "hidden": 20480, "ffn_hidden": 81920, "heads": 128, "kv_heads": 128, "vocab": 51200,
             "seq_len": 2048}
    for nodes, step_s in ((280, 60.1), (350, 50.2), (420, 44.4)):
        n = nodes * 8
        out.append(_row(f"mt-nlg-530b-{n}gpu", "Smith et al. 2022, Megatron-Turing NLG 530B (Megatron-DeepSpeed), "
                        "section 2.4", mtnlg, {**A100, "num_gpus": n},
                        {"tp": 8, "pp": 35, "dp": n // 280, "global_batch": 1920, "recompute_key": "full", "zero_key": 1,
                         "distributed_optimizer_or_zero": "DeepSpeed ZeRO stage 1"},
                        {"tokens_per_s_per_gpu": 1920 * 2048 / step_s / n},
                        "Megatron-DeepSpeed; tokens/s from the iteration time"))
    # BigScience 2022, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model" (arXiv:2211.05100) and its
    # training page (bigscience.notion.site, "BigScience 176B Model"): 384 A100 80GB on Jean Zay (48 nodes; four
    # Omni-Path 100 Gb/s links per node: 50 GB/s per 8-GPU node, 6.25 GB/s per GPU), tp 4, pp 12, dp 8,
    # micro-batch 2, global batch 2048, bf16, ZeRO stage 1, vocabulary 250,680, "about 150 TFLOPs" per GPU counted
    # with recomputation (Eq. 3): the iteration time is derived from it
    bloom = {"layers": 70, "hidden": 14336, "ffn_hidden": 57344, "heads": 112, "kv_heads": 112, "vocab": 250680,
             "seq_len": 2048}
    out.append(_row("bloom-176b-384gpu", "BigScience 2022, BLOOM 176B (Megatron-DeepSpeed), Jean Zay", bloom,
                    {**A100, "num_gpus": 384, "inter_node_gb_per_s": 6.25},
                    {"tp": 4, "pp": 12, "dp": 8, "micro_batch": 2, "global_batch": 2048, "recompute_key": "full",
                     "zero_key": 1, "distributed_optimizer_or_zero": "DeepSpeed ZeRO stage 1"},
                    # "about 150 TFLOPs" per GPU counted as eq. 3 does (recomputation, every attention score): validate
                    # reads such a figure with the hardware FLOPs per token (validate.measured_from_tflops)
                    {"tflops_per_gpu": 150.0, "hfu": 150.0 / 312.0},
                    "Megatron-DeepSpeed; 150 TFLOP/s counted with recomputation (Eq. 3)"))
    return out


#: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv:2412.19437): 2048 H800 (sec. 3.1), 16-way pipeline, 64-way
#: expert parallelism over 8 nodes, ZeRO-1 data parallelism, no tensor parallelism (sec. 3.2), DualPipe, RMSNorm and
#: MLA up-projections recomputed (sec. 3.2.3), fine-grained fp8 (1 x 128 / 128 x 128 scales, sec. 3.3: Megatron's
#: blockwise recipe), global batch 15,360 x 4,096 after a ramp over the first 469B tokens (sec. 4.2), one MTP module;
#: "each trillion tokens requires only 180K H800 GPU hours" (sec. 1): 1e12 / (180e3 x 3600) tokens/s per GPU, the
#: ramp and every stall included
DEEPSEEK_V3_TOKENS_PER_S_PER_GPU = 1e12 / (180e3 * 3600)
DEEPSEEK_V3_PLAN = "tp=1,pp=16,ep=64,mbs=1,zero=1,recompute=selective,recompute_modules=layernorm+mla_up_proj"
#: HAI-LLM is not Megatron-Core: scored with Megatron-Core's defaults, with DeepEP (which DeepSeek released) as its
#: flex dispatcher, and with its nearest form of DualPipe, which overlaps the all-to-alls and runs two model chunks
#: per rank: --overlap-moe-expert-parallel-comm (which Megatron-Core allows with pp > 1 only interleaved), flex, vpp 2
#: (120 micro-batches per rank interleave over pp 16 in groups of 20: plan.microbatch_group_size)
DEEPSEEK_V3_READINGS = {"Megatron-Core defaults (alltoall)": ({}, 1),
                        "DeepEP (flex dispatcher)": ({"moe_token_dispatcher_type": "flex"}, 1),
                        "DualPipe's nearest: flex + EP overlap + vpp 2": (
                            {"moe_token_dispatcher_type": "flex", "overlap_moe_expert_parallel_comm": True}, 2)}


def deepseek_v3() -> list:
    """DeepSeek-V3's own pretraining, predicted with its published plan (the layout Megatron-Bridge builds for 61
    layers on pp 16 and the reading's vpp: the MTP module beside the last layer) under each Megatron-Core reading."""
    from autotune import api
    from autotune.problem import plan_from_text
    from costmodels.plan import balanced_layout

    out = []
    for reading, (fw, vpp) in DEEPSEEK_V3_READINGS.items():
        problem = api.build_problem(model="deepseek-v3", gpu="h800", gpus=2048, global_batch=15360, seq_len=4096,
                                    precision="fp8", framework={"fp8_recipe": "blockwise", **fw})
        plan = plan_from_text(f"{DEEPSEEK_V3_PLAN},layout={balanced_layout(61, 16, vpp, 1)}", problem)
        p = api.predict(problem, plan)
        out.append({"id": "deepseek-v3-2048gpu", "reading": reading, "plan": str(plan),
                    "measured_tokens_per_s_per_gpu": DEEPSEEK_V3_TOKENS_PER_S_PER_GPU,
                    "predicted_tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"], "memory_gb": p["memory_gb"]["total"],
                    "error_pct": 100.0 * (p["tokens_per_s_per_gpu"] / DEEPSEEK_V3_TOKENS_PER_S_PER_GPU - 1.0)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = validate_rows(rows())
    out["deepseek_v3"] = deepseek_v3()
    if args.json:
        print(json.dumps(out, indent=1, default=str))
        return
    for r in out["runs"]:
        err = "-" if r["error_pct"] is None else f"{r['error_pct']:+.1f} %"
        print(f"{r['id']:22s} measured {r['measured_tokens_per_s_per_gpu']:8.1f} tokens/s/GPU, predicted "
              f"{(r['predicted_tokens_per_s_per_gpu'] or float('nan')):8.1f}, error {err:>8s}, filled "
              f"{','.join(r['filled']) or '-'}{'; skipped: ' + r['skipped'] if r['skipped'] else ''}")
    errs = [abs(r["error_pct"]) for r in out["runs"] if r["error_pct"] is not None]
    print(f"MAPE {sum(errs) / len(errs):.1f} % over {len(errs)} runs ({out['tflops']['n']} read from a TFLOP/s figure)")
    for r in out["deepseek_v3"]:
        print(f"{r['id']:22s} measured {r['measured_tokens_per_s_per_gpu']:8.1f} tokens/s/GPU, predicted "
              f"{r['predicted_tokens_per_s_per_gpu']:8.1f}, error {r['error_pct']:+.1f} % ({r['reading']}; "
              f"{r['memory_gb']:.1f} GB per GPU)")


if __name__ == "__main__":
    main()
