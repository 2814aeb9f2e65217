"""Write (or check) the frozen table of cost-model predictions for reference cases.

A regression table, not a golden one: it pins what the model predicts today so that a refactor
that must not change the numbers can prove it (tests/test_frozen.py compares against it). When the
physics changes on purpose, regenerate it in the same commit and say why:

    python tests/benchmarks/freeze_predictions.py --write
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autotune import api                          # noqa: E402

TABLE = ROOT / "tests" / "data" / "frozen_predictions.json"

#: (problem, plan) pairs covering every term: dense and MoE, MLA, TP with SP and overlap, PP with
#: vpp and uneven or accounted stages, CP, EP with ETP, ZeRO 0/1/3, recompute kinds, fp8, unfused
#: attention, a cluster file with a WAN link.
CASES = [
    (dict(model="llama3-70b", gpu="h100", gpus=512, global_batch=1024, seq_len=8192),
     "tp=8,pp=4,vpp=5,mbs=1,recompute=selective,sp=true,zero=1"),
    (dict(model="llama3-70b", gpu="h100", gpus=512, global_batch=1024, seq_len=8192,
          framework={"tp_comm_overlap": True, "grad_reduce_in_fp32": False}),
     "tp=4,pp=8,cp=2,vpp=5,mbs=1,recompute=none,sp=true,zero=1"),
    (dict(model="gpt3-175b", gpu="a100-80gb", gpus=1024, global_batch=1536, seq_len=2048,
          framework={"attention_backend": "unfused"}),
     "tp=8,pp=16,mbs=1,recompute=full,sp=false,zero=0"),
    (dict(model="llama3.1-405b", gpu="h100", gpus=1024, global_batch=2048, seq_len=8192),
     "tp=8,pp=16,mbs=1,recompute=full,recompute_layers=2,sp=true,zero=1,first_layers=7,last_layers=7"),
    (dict(model="llama3.1-405b", gpu="gb200", gpus=256, global_batch=64, seq_len=8192, precision="fp8"),
     "tp=4,pp=16,vpp=8,cp=2,mbs=1,recompute=selective,recompute_modules=core_attn,sp=true,zero=1,"
     "account_for_embedding=true,account_for_loss=true"),
    (dict(model="llama3-8b", gpu="h100", gpus=64, global_batch=128, seq_len=8192),
     "tp=1,pp=1,mbs=2,recompute=none,zero=3"),
    (dict(model="mixtral-8x7b", gpu="h100", gpus=256, global_batch=512, seq_len=4096),
     "tp=2,pp=4,ep=8,etp=1,vpp=4,mbs=1,recompute=selective,sp=true,zero=1"),
    (dict(model="qwen3-30b-a3b", gpu="h100", gpus=256, global_batch=512, seq_len=4096, precision="fp8"),
     "tp=1,pp=2,ep=8,mbs=2,recompute=full,zero=1,account_for_embedding=true,account_for_loss=true"),
    # DeepSeek-V3's own fp8 recipe (1x128 / 128x128 blocks): Megatron-Core refuses layernorm and moe_act recompute
    # under delayed scaling, its default
    (dict(model="deepseek-v3", gpu="h800", gpus=2048, global_batch=15360, seq_len=4096, precision="fp8",
          framework={"fp8_recipe": "blockwise"}),
     "tp=1,pp=16,ep=64,mbs=1,recompute=selective,recompute_modules=core_attn+layernorm+moe_act,zero=1,"
     "layout=Et*4|(t*4|)*14tmL"),
    (dict(model="llama3-70b", gpu="h100", gpus=1024, global_batch=1024, seq_len=8192, cluster_file="two-sites"),
     "tp=8,pp=8,mbs=1,recompute=selective,sp=true,zero=1"),
    (dict(model="llama2-7b", gpu="a100-80gb", gpus=8, global_batch=64, seq_len=4096),
     "tp=2,pp=2,mbs=4,recompute=none,sp=false,zero=0"),
]


def predictions() -> list[dict]:
    out = []
    for kw, plan_text in CASES:
        problem = api.build_problem(**kw)
        rep = api.predict_plan(problem, api.plan_from_text(plan_text, problem))
        out.append({"problem": {k: v for k, v in kw.items()}, "plan": plan_text,
                    "step_time_s": rep["step_time_s"], "time_breakdown_s": rep["time_breakdown_s"],
                    "memory": {k: v for k, v in rep[next(k for k in rep if k.startswith("memory_g"))].items()},
                    "mfu": rep["mfu"], "hfu": rep["hfu"]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="overwrite the table with today's predictions")
    args = ap.parse_args()
    rows = predictions()
    if args.write:
        TABLE.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {len(rows)} cases to {TABLE}")
        return 0
    old = json.loads(TABLE.read_text())
    worst = 0.0
    for a, b in zip(old, rows):
        rel = abs(b["step_time_s"] / a["step_time_s"] - 1.0)
        mem = abs(b["memory"]["total"] / a["memory"]["total"] - 1.0)
        worst = max(worst, rel, mem)
        print(f"{a['problem']['model']:<14} {a['plan'][:60]:<60} step {a['step_time_s']:.4f} -> "
              f"{b['step_time_s']:.4f} ({rel:+.2%})  mem {a['memory']['total']:.2f} -> {b['memory']['total']:.2f}")
    print(f"largest relative change: {worst:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
