"""`autotune verify --runner megatron` (issue 14): the plan run by Megatron-LM for a few iterations.

One exporter, used twice: the command is `autotune.launch.megatron_launch` (the flags of
`autotune export --to megatron`, torchrun on this node or an sbatch script), as `autotune launch`
runs it. Its log (training.py `training_log` and `report_memory` lines) becomes the same result and
the same measurement record as the jax runner's, so `verify`, `search --verify-top` and the
verification worker print, save, rank and calibrate both alike.

Megatron runs the whole plan (no proxy): every term of the step is measured, on the GPUs the job
gets. Peak memory is `torch.cuda.max_memory_allocated` (report_memory's "max allocated"): like XLA's
counter it excludes the CUDA context, NCCL buffers and allocator fragmentation, so it is compared
with the prediction without them (`verify.dynamic_memory_gb`).
"""
from __future__ import annotations

import datetime as _dt
import os
import platform as _platform
import statistics
import subprocess

from costmodels.plan import Plan
from costmodels.specs import SpecError
from search_spaces.space import Problem

from .launch import LAUNCHERS, RunOutOfMemory, check_checkout, measurement_record, megatron_launch
from .measurements import MIB, read_megatron_log
from .runner.measure import Measured
from .search import predict
from .verify import comparison, dynamic_memory_gb, plan_slug

MEMORY_SOURCE = "Megatron-LM report_memory: max allocated (torch.cuda.max_memory_allocated)"
MEASURED_TERMS = ("everything (all terms of the step), Megatron-LM pretrain_gpt.py on mock data",)
CHECKOUT_HINT = "a Megatron-LM checkout: git clone https://github.com/NVIDIA/Megatron-LM"


def check_megatron_options(megatron_path: str | None, launcher: str) -> None:
    if not megatron_path:
        raise SpecError("megatron-path", f"the megatron runner needs --megatron-path DIR ({CHECKOUT_HINT})")
    if launcher not in LAUNCHERS:
        raise SpecError("launcher", f"unknown launcher {launcher!r}; choose {' or '.join(LAUNCHERS)}")


def megatron_framework(problem: Problem) -> dict:
    """The framework options the exported command ran with (api.framework_spec's names), so that
    `validate` and `calibrate` predict the record as it ran."""
    fw = problem.job.framework
    return {"framework": fw.framework.value, "attention_backend": fw.attention_backend.value,
            "tp_comm_overlap": fw.tp_comm_overlap, "grad_reduce_in_fp32": fw.grad_reduce_in_fp32,
            "fp8_param_gather": fw.fp8_param_gather, "overlap_grad_reduce": fw.overlap_grad_reduce,
            "overlap_param_gather": fw.overlap_param_gather,
            "moe_token_dispatcher_type": fw.moe_token_dispatcher_type.value,
            "cuda_graph_impl": fw.cuda_graph_impl.value, "cuda_graph_modules": [m.value for m in fw.cuda_graph_modules],
            "overlap_moe_expert_parallel_comm": fw.overlap_moe_expert_parallel_comm,
            "gradient_accumulation_fusion": fw.gradient_accumulation_fusion,
            "moe_permute_fusion": fw.moe_permute_fusion, "cross_entropy_loss_fusion": fw.cross_entropy_loss_fusion,
            "cross_entropy_fusion_impl": fw.cross_entropy_fusion_impl.value, "fp8_recipe": fw.fp8_recipe.value}


def log_measurement(log_path: str, warmup: int) -> tuple[Measured, dict]:
    """The timed iterations of a finished run's log (the first `warmup` lines dropped, at least one)
    and the summary `launch.measurement_record` takes."""
    parsed = read_megatron_log(log_path)
    its = parsed["iterations"]
    steady = its[max(warmup, 1):] or its[-1:]
    times = tuple(i["elapsed_ms"] / 1e3 for i in steady)
    peak = max((m["max_allocated_mb"] for m in parsed["memory"]), default=None)
    meas = Measured(status="ok", step_times_s=times, peak_bytes_per_device=peak * MIB if peak else 0.0,
                    memory_source=MEMORY_SOURCE if peak else "none (no report_memory line in the log)")
    tf = [i["tflops_per_gpu"] for i in steady if "tflops_per_gpu" in i]
    summary = {"step_time_s": meas.step_time_s, "n_used": len(times),
               "tflops_per_gpu": statistics.median(tf) if tf else None,
               "max_allocated_gb": peak * MIB / 1e9 if peak else None}
    return meas, summary


def default_log_path(plan: Plan, folder: str = ".") -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return os.path.join(folder, f"megatron_{plan_slug(plan)}_{stamp}.log")


def verify_megatron(problem: Problem, plan: Plan, *, megatron_path: str | None, launcher: str = "torchrun",
                    steps: int = 5, warmup: int = 1, params=None, dry_run: bool = False,
                    log_path: str | None = None, log_dir: str = ".", runner=subprocess.run) -> dict:
    """Run `plan` with Megatron-LM (steps + warmup iterations; with `dry_run` only the commands) and
    return verify's result: status ok | oom | dry-run, the comparison with the prediction, the record."""
    check_megatron_options(megatron_path, launcher)
    if steps < 1:
        raise SpecError("steps", f"must be at least 1, got {steps}")
    if warmup < 0:
        raise SpecError("warmup", f"must be 0 or more, got {warmup}")
    # absolute: torchrun and sbatch run in the checkout, SLURM writes --output relative to it
    log_path = os.path.abspath(log_path or default_log_path(plan, log_dir))
    if not dry_run:         # bad input leaves nothing behind: the checkout is checked before the log's folder is made
        check_checkout(os.path.abspath(os.path.expanduser(megatron_path)), launcher)
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
    train_iters = steps + max(warmup, 1)          # Megatron's first iteration is warm-up (compilation, NCCL)
    base = {"runner": "megatron", "platform": "gpu", "proxy": False, "launcher": launcher,
            "run_plan": plan.as_dict(), "run_layers": problem.model.num_layers,
            "run_devices": problem.cluster.num_gpus, "run_global_batch": problem.job.global_batch,
            "attention": problem.job.framework.attention_backend.value,
            "measured_terms": list(MEASURED_TERMS), "predicted_terms": []}
    try:
        launched = megatron_launch(plan, problem, os.path.abspath(os.path.expanduser(megatron_path)),
                                   launcher=launcher, train_iters=train_iters, dry_run=dry_run,
                                   log_path=log_path, runner=runner)
    except RunOutOfMemory as exc:
        meas, summary, job = Measured(status="oom", error=exc.reason), {}, None
    else:
        job = launched["job"]
        if dry_run:
            return {**base, "status": "dry-run", "job": job, "error": None, "record": None}
        meas, summary = log_measurement(log_path, warmup)
    predicted = predict(problem, plan, params)
    predicted["memory_gb_dynamic"] = dynamic_memory_gb(predicted, params)
    record = megatron_record(problem, plan, summary, meas, predicted, log_path=log_path, launcher=launcher,
                             megatron_path=megatron_path, job=job)
    return {**base, "status": meas.status, "job": job, "comparison": comparison(predicted, meas, "gpu"),
            "predicted_full_plan": {"plan": plan.as_dict(), "step_time_s": predicted["step_time_s"],
                                    "memory_gb": predicted["memory_gb"]["total"]},
            "error": meas.error or None, "record": record}


def megatron_record(problem: Problem, plan: Plan, summary: dict, meas: Measured, predicted: dict, *,
                    log_path: str, launcher: str, megatron_path: str, job: dict | None) -> dict:
    """`launch.measurement_record` (the validation schema) plus verify's `run` and status fields."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    rec = measurement_record(problem, plan, summary, log_path=log_path,
                             run_id=f"verify-megatron-{problem.model.name}-{plan_slug(plan)}-{stamp}")
    rec["source"] = {"title": "autotune verify --runner megatron (Megatron-LM pretrain_gpt.py, mock data)",
                     "table": log_path, "group": "autotune verify (megatron runner)"}
    rec["hardware"]["gpus_per_node"] = (job or {}).get("gpus_per_node", rec["hardware"]["gpus_per_node"])
    rec["measured"]["extra"] = {"status": meas.status, "error": meas.error, "step_times_s": list(meas.step_times_s),
                                "spread": meas.spread, "memory_source": meas.memory_source}
    rec["run"] = {"runner": "megatron", "proxy": False, "framework": megatron_framework(problem),
                  "measured_terms": list(MEASURED_TERMS), "predicted_terms": [],
                  "machine": {"launcher": launcher, "megatron_path": os.path.abspath(os.path.expanduser(megatron_path)),
                              "host": _platform.node()},
                  "command": (job or {}).get("torchrun_text"),
                  "predicted": {"step_time_s": predicted["step_time_s"], "memory_gb": predicted["memory_gb"]["total"],
                                "memory_gb_without_fixed": predicted["memory_gb_dynamic"]["total"]}}
    return rec
