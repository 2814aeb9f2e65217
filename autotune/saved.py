"""Saved search reports read back: the problem they solved and their plans (for export and check).

A report's `problem` holds the spec dicts of `report.problem_dict`; reports written before the
framework options existed hold `flash_attention` / `tp_comm_overlap` in `job` instead, and are read
the same way (unknown keys are ignored, missing ones take the spec defaults).
"""
from __future__ import annotations

from dataclasses import fields

from costmodels.plan import DEFAULT_RECOMPUTE_MODULES, Plan
from costmodels.specs import (AttentionBackend, ClusterSpec, CrossEntropyImpl, CudaGraphImpl, CudaGraphModule,
                              DispatcherType, Fp8Recipe, Framework, FrameworkSpec, GPUSpec, JobSpec, ModelSpec,
                              PipelineSchedule, Precision, Recompute, SpecError, parse_lora_modules)
from search_spaces.space import Problem

from .files import read_json

def _known(cls, d: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}

def _framework(job: dict) -> FrameworkSpec:
    fw = dict(job.get("framework") or {})
    if "flash_attention" in job and "attention_backend" not in fw:
        # that key meant "a fused kernel", whichever Transformer Engine picks: Megatron-Core's auto
        fw["attention_backend"] = "auto" if job["flash_attention"] else "unfused"
    if "tp_comm_overlap" in job and "tp_comm_overlap" not in fw:
        fw["tp_comm_overlap"] = bool(job["tp_comm_overlap"])
    v = _known(FrameworkSpec, fw)
    if "framework" in v:
        v["framework"] = Framework.parse(v["framework"])
    if "attention_backend" in v:
        v["attention_backend"] = AttentionBackend.parse(v["attention_backend"])
    if "moe_token_dispatcher_type" in v:
        v["moe_token_dispatcher_type"] = DispatcherType.parse(v["moe_token_dispatcher_type"])
    if "pipeline_schedule" in v:
        v["pipeline_schedule"] = PipelineSchedule.parse(v["pipeline_schedule"])
    if "cross_entropy_fusion_impl" in v:
        v["cross_entropy_fusion_impl"] = CrossEntropyImpl.parse(v["cross_entropy_fusion_impl"])
    if "fp8_recipe" in v:
        v["fp8_recipe"] = Fp8Recipe.parse(v["fp8_recipe"])
    if "cuda_graph_impl" in v:
        v["cuda_graph_impl"] = CudaGraphImpl.parse(v["cuda_graph_impl"])
    if "lora_target_modules" in v:
        v["lora_target_modules"] = parse_lora_modules(v["lora_target_modules"])
    if "cuda_graph_modules" in v:
        mods = {CudaGraphModule.parse(m) for m in v["cuda_graph_modules"] or ()}
        v["cuda_graph_modules"] = tuple(m for m in CudaGraphModule if m in mods)
    return FrameworkSpec(**v)

def problem_from_report(report: dict, source: str = "report") -> Problem:
    """The Problem a saved report solved (model, GPU, cluster and job specs as saved)."""
    p = report.get("problem") if isinstance(report, dict) else None
    if not isinstance(p, dict) or not all(isinstance(p.get(k), dict) for k in ("model", "gpu", "cluster", "job")):
        raise SpecError("report", f"{source} has no problem (model, gpu, cluster, job); is it an autotune report?")
    try:
        model = ModelSpec(**_known(ModelSpec, p["model"]))
        gpu = GPUSpec(**_known(GPUSpec, p["gpu"]))
        cluster = ClusterSpec(gpu=gpu, **_known(ClusterSpec, {k: v for k, v in p["cluster"].items() if k != "gpu"}))
        job = p["job"]
        spec = JobSpec(global_batch=job["global_batch"], seq_len=job["seq_len"],
                       precision=Precision.parse(job.get("precision", "bf16")), framework=_framework(job))
    except (KeyError, TypeError) as exc:
        raise SpecError("report", f"{source}: problem is incomplete ({exc})") from None
    return Problem(model, cluster, spec)

def _entry_plan(entry, source: str, what: str = "a plan entry") -> Plan:
    """The plan of one report entry ({"plan": {...}, ...}), or a SpecError naming the report."""
    if not isinstance(entry, dict) or not isinstance(entry.get("plan"), dict):
        raise SpecError("report", f"{source}: {what} is malformed (not an object with a 'plan' object)")
    try:
        return Plan.from_dict(entry["plan"])
    except (KeyError, TypeError, ValueError, SpecError) as exc:
        raise SpecError("report", f"{source}: {what} is malformed ({exc})") from None


def report_plans(report: dict, top: int = 1, source: str = "report") -> list:
    """The best plan and the next ones of a report's `top` list (at most `top`, best first). A `best` entry
    that is there is checked too, though `top` supplies the plans: a damaged report is refused, not half read."""
    if report.get("best") is not None:
        _entry_plan(report["best"], source, "'best'")
    rows = report.get("top") or ([report["best"]] if report.get("best") else [])
    if not rows:
        raise SpecError("report", f"{source} lists no plan ('best' / 'top')")
    try:
        plans = [_entry_plan(r, source) for r in rows[:max(1, top)]]
    except (KeyError, TypeError) as exc:
        raise SpecError("report", f"{source}: a plan entry is malformed ({exc})") from None
    # reports written before recompute_modules existed: selective meant Megatron's default set
    return [p.replace(recompute_modules=DEFAULT_RECOMPUTE_MODULES)
            if p.recompute is Recompute.SELECTIVE and not p.recompute_modules else p for p in plans]

def read_report(path: str) -> dict:
    doc = read_json(path, "report")
    if not isinstance(doc, dict):
        raise SpecError("report", f"{path} must hold a JSON object (an autotune report)")
    return doc
