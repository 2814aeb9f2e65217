"""Run a plan with Megatron-LM for a few iterations (issue 14 item 3): the exact torchrun command for
`pretrain_gpt.py` on mock data, an sbatch script for SLURM, and, with a checkout at hand, the run
itself, its log parsed (autotune.measurements) into a measurement record in the schema of
`shared/validation` (so `calibrate` and `validate` read it).

The plan's flags are `autotune.export.megatron_args`, the same code as `autotune export --to megatron`.
Memory: Megatron-LM prints `[Rank r] (after N iterations) memory (MB) | allocated | max allocated |
reserved | max reserved` after the first iterations (training.py training_log, report_memory);
`--log-memory-interval 1` repeats it every iteration so the last line holds the run's peak.
"""
from __future__ import annotations

import datetime as _dt
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass

from costmodels.plan import Plan
from costmodels.specs import SpecError
from search_spaces.space import Problem

from .export import megatron_args

LAUNCHERS = ("torchrun", "slurm")
#: Megatron-LM needs one CUDA work queue per device for overlapping TP/SP communication
#: (its README: CUDA_DEVICE_MAX_CONNECTIONS=1)
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
RDZV_PORT = 29500


@dataclass(frozen=True)
class MegatronJob:
    """What `megatron_launch` runs: the training flags, the torchrun command and the sbatch script."""
    train_args: tuple
    torchrun: tuple
    sbatch: str
    nodes: int
    gpus_per_node: int
    log_path: str

    def as_dict(self) -> dict:
        return {"train_args": list(self.train_args), "torchrun": list(self.torchrun),
                "torchrun_text": command_text(self.torchrun, ENV), "sbatch": self.sbatch, "nodes": self.nodes,
                "gpus_per_node": self.gpus_per_node, "log_path": self.log_path}


def command_text(argv, env: dict | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + " ".join(_shell_word(str(a)) for a in argv)


def _shell_word(arg: str) -> str:
    """A quoted shell word; `${MASTER_ADDR}` (set on each node) stays expandable."""
    return arg if "${MASTER_ADDR}" in arg else shlex.quote(arg)


def run_args(train_iters: int) -> list:
    """The short-run flags: mock data, N iterations, a log line and a memory line per iteration,
    no evaluation or checkpoints, a constant learning rate."""
    if not isinstance(train_iters, int) or train_iters < 2:
        raise SpecError("train-iters", f"must be an integer >= 2 (the first iteration is warm-up), got {train_iters!r}")
    return ["--mock-data", "--train-iters", str(train_iters), "--log-interval", "1", "--log-memory-interval", "1",
            "--log-throughput", "--eval-iters", "0", "--lr", "1.0e-4", "--lr-decay-style", "constant"]


def nodes_of(cluster) -> tuple:
    """(nodes, GPUs per node): a node holds the GPU preset's GPUs per host, fewer when the NVLink
    domain is smaller (--gpus-per-node 4); NVL72 racks are 18 hosts of 4 GPUs."""
    per_node = min(cluster.nvlink_domain_size, cluster.gpu.gpus_per_node, cluster.num_gpus)
    if cluster.num_gpus % per_node:
        raise SpecError("gpus", f"{cluster.num_gpus} GPUs are not whole nodes of {per_node}")
    return cluster.num_gpus // per_node, per_node


def megatron_job(plan: Plan, problem: Problem, megatron_path: str, *, train_iters: int = 10,
                 log_path: str | None = None) -> MegatronJob:
    """The commands for the plan (nothing runs). A node holds the GPU preset's GPUs per host (fewer when
    the NVLink domain is smaller, e.g. --gpus-per-node 4)."""
    nodes, per_node = nodes_of(problem.cluster)
    train = megatron_args(plan, problem) + run_args(train_iters)
    script = os.path.join(megatron_path, "pretrain_gpt.py")
    log_path = log_path or f"megatron_{problem.model.name}_{problem.cluster.num_gpus}gpu.log"
    if nodes == 1:
        launcher = ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", str(per_node)]
    else:
        launcher = ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"${{MASTER_ADDR}}:{RDZV_PORT}"]
    argv = tuple(launcher + [script] + train)
    return MegatronJob(train_args=tuple(train), torchrun=argv, sbatch=sbatch_script(
        argv, nodes, per_node, log_path, problem), nodes=nodes, gpus_per_node=per_node, log_path=log_path)


def sbatch_script(torchrun_argv, nodes: int, per_node: int, log_path: str, problem: Problem) -> str:
    """A SLURM batch script: one torchrun per node (srun), rendezvous on the first node."""
    launch = " ".join(_shell_word(a) for a in torchrun_argv)
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name=autotune-{problem.model.name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={per_node}",
        "#SBATCH --exclusive",
        f"#SBATCH --output={log_path}",
        "set -euo pipefail",
        *(f"export {k}={v}" for k, v in ENV.items()),
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"srun --kill-on-bad-exit=1 {launch}",
        "",
    ])


class RunOutOfMemory(SpecError):
    """The run stopped with a CUDA out-of-memory error (its log says so)."""


#: what PyTorch's caching allocator raises when an allocation fails (torch.OutOfMemoryError, whose
#: message starts "CUDA out of memory."), and NCCL's own allocation failure
_OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "NCCL WARN Cuda failure 'out of memory'")


def out_of_memory_line(log_path: str) -> str | None:
    """The first line of the log that reports an out-of-memory error, or None."""
    try:
        with open(log_path, errors="replace") as fh:
            for line in fh:
                if any(m in line for m in _OOM_MARKERS):
                    return " ".join(line.split())[:200]
    except OSError:
        return None
    return None


def measurement_record(problem: Problem, plan: Plan, summary: dict, *, log_path: str, job: MegatronJob | None = None,
                       run_id: str | None = None) -> dict:
    """A measured run in the row schema of shared/validation (README there), from `log_summary`."""
    m = problem.model
    counts = m.param_counts()
    step = summary.get("step_time_s")
    tokens = problem.job.global_batch * problem.job.seq_len
    rec = {
        "id": run_id or f"megatron-{m.name}-{problem.cluster.num_gpus}x{problem.cluster.gpu.name}-"
                        f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y%m%dT%H%M%S')}",
        "source": {"title": "autotune launch (Megatron-LM, mock data)", "table": log_path, "group": "autotune launch"},
        "confidence": "high" if step else "low", "usable": bool(step),
        "model": {"name": m.name, "layers": m.num_layers, "hidden": m.hidden_size, "ffn_hidden": m.ffn_hidden_size,
                  "heads": m.num_attention_heads, "kv_heads": m.num_kv_heads, "vocab": m.vocab_size,
                  "seq_len": problem.job.seq_len, "num_experts": m.num_experts or None,
                  "top_k": m.experts_per_token or None, "moe_ffn_hidden": m.moe_ffn_hidden_size or None,
                  "params_billion": counts["total"] / 1e9},
        "hardware": {"gpu": problem.cluster.gpu.name, "gpu_key": problem.cluster.gpu.name,
                     "num_gpus": problem.cluster.num_gpus,
                     "gpus_per_node": job.gpus_per_node if job else problem.cluster.nvlink_domain_size},
        "plan": {"tp": plan.tp, "pp": plan.pp, "dp": plan.dp, "cp": plan.cp, "ep": plan.ep, "etp": plan.etp, "vpp": plan.vpp,
                 "micro_batch": plan.mbs, "global_batch": problem.job.global_batch, "sequence_parallel": plan.sp,
                 "recompute": plan.recompute.name.lower(), "distributed_optimizer_or_zero": plan.zero,
                 "precision": problem.job.precision.value, "precision_key": problem.job.precision.value,
                 "recompute_key": plan.recompute.name.lower(), "zero_key": plan.zero, "autotune_plan": str(plan)},
        "measured": {"iteration_time_s": step,
                     "tokens_per_s_per_gpu": tokens / step / problem.cluster.num_gpus if step else None,
                     "tflops_per_gpu": summary.get("tflops_per_gpu"), "mfu": None, "hfu": None,
                     "memory_gb": summary.get("max_allocated_gb")},
        "notes": (f"median of {summary['n_used']} iteration lines after the first (warm-up)" if step
                  else "the run did not finish: no measurement"),
        "derived_fields": ["measured.tokens_per_s_per_gpu"],
    }
    return rec


def check_checkout(megatron_path: str, launcher: str) -> None:
    """What a run needs on this machine: the checkout's pretrain_gpt.py and the launcher on PATH
    (one line naming what to install otherwise)."""
    if not os.path.isfile(os.path.join(megatron_path, "pretrain_gpt.py")):
        raise SpecError("megatron-path", f"no pretrain_gpt.py in {megatron_path}; give a Megatron-LM checkout "
                        "(git clone https://github.com/NVIDIA/Megatron-LM)")
    tool = "torchrun" if launcher == "torchrun" else "sbatch"
    if shutil.which(tool) is None:
        raise SpecError("launcher", f"{tool} is not on PATH; install {'PyTorch' if tool == 'torchrun' else 'SLURM'} "
                        "or use --dry-run to print the commands")


def megatron_launch(plan: Plan, problem: Problem, megatron_path: str, *, launcher: str = "torchrun",
                    train_iters: int = 10, dry_run: bool = False, log_path: str | None = None,
                    runner=subprocess.run) -> dict:
    """Build the commands; unless `dry_run`, run them (torchrun here, or `sbatch --wait`) and parse the
    log into a measurement record. Returns {"job": ..., "ran": bool, "measurement": record | None}.

    A missing checkout, launcher or failed run is a SpecError with one line naming what to fix."""
    from .measurements import log_summary, read_megatron_log

    if launcher not in LAUNCHERS:
        raise SpecError("launcher", f"unknown launcher {launcher!r}; choose {' or '.join(LAUNCHERS)}")
    job = megatron_job(plan, problem, megatron_path, train_iters=train_iters, log_path=log_path)
    out = {"job": job.as_dict(), "launcher": launcher, "ran": False, "measurement": None}
    if dry_run:
        return out
    check_checkout(megatron_path, launcher)
    env = {**os.environ, **ENV}
    if launcher == "torchrun":
        if job.nodes > 1:
            raise SpecError("launcher", f"the plan needs {job.nodes} nodes; torchrun here runs one node: use "
                            "--launcher slurm, or --dry-run and start torchrun on every node")
        with open(job.log_path, "w") as log:
            proc = runner(list(job.torchrun), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=megatron_path)
    else:
        script = job.log_path + ".sbatch"
        with open(script, "w") as fh:
            fh.write(job.sbatch)
        proc = runner(["sbatch", "--wait", script], env=env, cwd=megatron_path)
    out["ran"] = True
    if getattr(proc, "returncode", 0) != 0:
        oom = out_of_memory_line(job.log_path)
        if oom:
            raise RunOutOfMemory("megatron", f"out of memory (exit code {proc.returncode}): {oom}; see {job.log_path}")
        raise SpecError("megatron", f"the run exited with code {proc.returncode}; see {job.log_path}")
    summary = log_summary(read_megatron_log(job.log_path))
    out["measurement"] = measurement_record(problem, plan, summary, log_path=job.log_path, job=job)
    return out
