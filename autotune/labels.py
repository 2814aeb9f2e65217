"""Words for the parts of a prediction and the --plan text of a plan, shared by the Markdown report,
the HTML page and the CLI (a module of its own so that the page's module does not import the report's)."""
from __future__ import annotations

from costmodels.plan import Plan, format_plan

#: the step-time breakdown's parts in words
TIME_LABELS = {
    "compute": "compute", "recompute": "recomputation", "tp_comm": "exposed TP communication",
    "cp_comm": "exposed CP (ring attention) exchange", "ep_comm": "exposed MoE all-to-all",
    "pp_comm": "exposed pipeline p2p", "dp_comm": "exposed DP gradient sync",
    "bubble": "pipeline bubble", "optimizer": "optimizer step",
    "host_wait": "GPU waiting for the host to issue kernels", "overhead": "fixed per-step overhead",
}


def plan_text(plan: dict) -> str:
    """The --plan text of a plan (the Optuna-only knobs left out when 0, i.e. unused)."""
    return format_plan(Plan.from_dict(plan))
