"""Words for the parts of a prediction and the --plan text of a plan, shared by the Markdown report,
the HTML page and the CLI (a module of its own so that the page's module does not import the report's)."""
from __future__ import annotations

from costmodels.plan import Plan, format_plan

#: the step-time breakdown's parts in words
TIME_LABELS = {
    "compute": "compute", "recompute": "recomputation",
    "offload": "exposed activation copies to host memory (CPU offloading)", "tp_comm": "exposed TP communication",
    "cp_comm": "exposed CP (ring attention) exchange", "ep_comm": "exposed MoE all-to-all",
    "pp_comm": "exposed pipeline p2p", "dp_comm": "exposed DP gradient sync",
    "bubble": "pipeline bubble", "optimizer": "optimizer step",
    "host_wait": "GPU waiting for the host to issue kernels", "overhead": "fixed per-step overhead",
}


def plan_text(plan: dict) -> str:
    """The --plan text of a plan (the Optuna-only knobs left out when 0, i.e. unused)."""
    return format_plan(Plan.from_dict(plan))


def training_text(job: dict) -> str:
    """What the job trains and on what data, when it is not full training on unpacked sequences ("" then): a saved
    report's job dict (its framework's lora_dim, lora_target_modules, packed_example_tokens)."""
    fw = job.get("framework") or {}
    parts = []
    if fw.get("lora_dim"):
        parts.append(f"LoRA rank {fw['lora_dim']} on {', '.join(fw.get('lora_target_modules') or [])} "
                     "(base weights frozen)")
    if fw.get("packed_example_tokens"):
        parts.append(f"packed examples of {fw['packed_example_tokens']:,} tokens (attention inside each)")
    return "".join(f", {x}" for x in parts)
