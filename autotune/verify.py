"""`autotune verify`: run a plan for a few steps with a real runner and compare with the prediction.

The run is the plan itself when enough devices are present, else (with proxy=True) a proxy that keeps
the plan's per-device shapes: one pipeline stage's layers (pp -> 1, L/pp layers), the TP/CP/EP group
and the per-rank micro-batch count (dp -> ep, the global batch scaled to keep each rank's share).
What the proxy measures and what stays predicted is listed in the result. Both the run and the full
plan are predicted by the cost model: the run's prediction is compared with the measurement, the
full plan's is shown beside it.

Every run becomes one record of the validation schema (shared/validation/README.md) plus `run`
(machine, software versions, what ran), so `autotune calibrate` takes verify's files as input. A
record is `usable` for calibration only when it measured a GPU (a CPU's step time says nothing
about a GPU preset; its memory still checks the memory model).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import platform as _platform
from dataclasses import dataclass

import jax

from costmodels.memory import FIXED_BYTES
from costmodels.params import EfficiencyParams
from costmodels.plan import Plan
from costmodels.specs import AttentionBackend, ModelSpec, Precision, Recompute, SpecError
from search_spaces.space import Problem

from .runner import JAX_MEMORY_VARS, claim_device_memory
from .search import predict

#: runners this build has: the built-in JAX transformer, and Megatron-LM through the exporter
#: (`autotune.verify_megatron`: a checkout and torchrun or SLURM)
RUNNERS = ("jax", "megatron")
_DTYPES = {Precision.BF16: "bfloat16", Precision.FP16: "float16", Precision.FP32: "float32"}
#: what the jax runner does, in Megatron's option names: one XLA program per step (Framework.JAX: no
#: per-kernel host dispatch, no per-micro-batch Python), no TP-communication overlap (no TE userbuffers),
#: fp32 gradient accumulation in a kernel of its own after each micro-batch's backward pass (sharded.py:
#: loss_and_grads' scan adds the bf16 gradients to an fp32 accumulator), XLA schedules the DP collectives
#: (not Megatron's bucketed overlap), and the pipeline is GPipe (sharded.py: every micro-batch's activations
#: live until the backward pass)
RUN_FRAMEWORK = {"framework": "jax", "tp_comm_overlap": False, "grad_reduce_in_fp32": True, "overlap_grad_reduce": False,
                 "overlap_param_gather": False, "pipeline_schedule": "gpipe", "microbatch_grad_buffer": True,
                 "gradient_accumulation_fusion": False}


@dataclass(frozen=True, kw_only=True)
class RunChoice:
    """What runs: the plan, the layers built, the global batch, and which terms it measures."""
    plan: Plan
    num_layers: int
    global_batch: int
    proxy: bool
    measured_terms: tuple
    predicted_terms: tuple

    @property
    def num_devices(self) -> int:
        return self.plan.num_gpus


def runner_spec(spec: ModelSpec, num_layers: int) -> ModelSpec:
    """The model the jax runner builds: `num_layers` identical layers (a MoE model is MoE in every
    layer: first_k_dense_layers and moe_layer_freq are not built)."""
    if spec.is_mla:
        raise SpecError("model", f"{spec.name} uses multi-head latent attention, which the jax runner does not build")
    if spec.mtp_num_layers:
        raise SpecError("mtp_num_layers", f"the jax runner builds no multi-token prediction modules; verify with "
                        f"--mtp-num-layers 0, or run {spec.name} with Megatron (--runner megatron)")
    extra = {"first_k_dense_layers": 0, "moe_layer_freq": 1} if spec.is_moe else {}
    return dataclasses.replace(spec, num_layers=num_layers, **extra)


def choose_run(problem: Problem, plan: Plan, n_devices: int, *, proxy: bool = False,
               layers: int | None = None) -> RunChoice:
    """The run for `plan` on `n_devices`; SpecError (one line) when it cannot be run."""
    need = plan.num_gpus
    if layers is not None and layers < 1:
        raise SpecError("layers", f"must be a positive number of layers, got {layers}")
    if not proxy:
        if need > n_devices:
            raise SpecError("gpus", f"the plan needs {need} devices but {n_devices} "
                            f"{jax.default_backend()} device(s) are present; add --proxy to run its per-device "
                            f"shapes (one pipeline stage, one DP rank) on the devices at hand")
        n_layers = layers or problem.model.num_layers
        measured = ("everything (all terms of the step)",) if n_layers == problem.model.num_layers else (
            f"every term, with {n_layers} of {problem.model.num_layers} layers",)
        return RunChoice(plan=plan, num_layers=n_layers, global_batch=problem.job.global_batch, proxy=False,
                         measured_terms=measured, predicted_terms=())
    dp_run = plan.ep
    run_plan = dataclasses.replace(plan, pp=1, dp=dp_run, vpp=1, first_layers=0, last_layers=0, layout="",
                                   zero=plan.zero if dp_run > 1 else 0)
    if run_plan.num_gpus > n_devices:
        raise SpecError("gpus", f"even the proxy needs tp*cp*ep = {run_plan.num_gpus} devices (one stage, one "
                        f"DP rank); {n_devices} present")
    n_layers = layers or -(-problem.model.num_layers // plan.pp)
    gb = problem.job.global_batch // plan.dp * dp_run
    measured = ["per-layer compute, forward and backward"]
    measured += [t for ok, t in ((plan.tp > 1, "TP collectives" + (" (SP)" if plan.sp else "")),
                                 (plan.cp > 1, "CP K/V exchange"), (plan.ep > 1, "EP all-to-all"),
                                 (plan.recompute != Recompute.NONE, "recomputation"),
                                 (True, "memory of one stage's layers: weights, gradients, optimizer, activations"))
                 if ok]
    predicted = [t for ok, t in ((plan.pp > 1, "pipeline bubble and stage-to-stage p2p"),
                                 (plan.dp > dp_run, "DP gradient reduction"),
                                 (plan.zero and plan.dp > dp_run, f"ZeRO-{plan.zero} sharding over dp={plan.dp}"),
                                 (plan.pp > 1, "embedding / head on the first / last stage only"))
                 if ok]
    return RunChoice(plan=run_plan, num_layers=n_layers, global_batch=gb, proxy=True,
                     measured_terms=tuple(measured), predicted_terms=tuple(predicted))


def run_problem(problem: Problem, choice: RunChoice, attention_backend: AttentionBackend) -> Problem:
    """The problem the run solves (its layers, devices, batch, attention kernel), for the cost model."""
    from .problem import framework_spec
    m = problem.model
    # the runner's dropless MoE gives every expert a buffer of all T tokens (model.moe_tokens): capacity
    # factor E / k, padded
    cap = {"moe_expert_capacity_factor": m.num_experts / m.experts_per_token} if m.is_moe else {}
    fw = framework_spec(attention_backend=attention_backend.value, **RUN_FRAMEWORK, **cap)
    job = dataclasses.replace(problem.job, global_batch=choice.global_batch, framework=fw)
    cluster = dataclasses.replace(problem.cluster, num_gpus=choice.num_devices, num_sites=1)
    return Problem(runner_spec(problem.model, choice.num_layers), cluster, job)


def _attention(platform: str, precision: Precision) -> tuple[str, AttentionBackend]:
    if platform == "gpu" and precision in (Precision.BF16, Precision.FP16):
        return "cudnn", AttentionBackend.FUSED
    return "xla", AttentionBackend.UNFUSED


def machine_info(devices) -> dict:
    import jaxlib
    import numpy
    d0 = devices[0]
    return {"platform": d0.platform, "device_kind": getattr(d0, "device_kind", ""), "devices_present": len(devices),
            "host": _platform.node(), "cpu": _platform.processor() or _platform.machine(),
            "cpu_count": os.cpu_count(), "os": _platform.platform(), "python": _platform.python_version(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": numpy.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            # how this process's JAX took GPU memory (runner.claim_device_memory or the user's): an OOM depends on it
            "jax_memory_env": {v: os.environ[v] for v in JAX_MEMORY_VARS if v in os.environ}}


def verify_plan(problem: Problem, plan: Plan, *, gpu_key: str, steps: int = 5, warmup: int = 1,
                proxy: bool = False, layers: int | None = None, runner: str = "jax", params=None,
                devices=None, on_step=None, megatron: dict | None = None) -> dict:
    """Run `plan` (or its proxy), measure it, predict the same run, and return both with the record.
    `megatron`: verify_megatron's options (megatron_path, launcher, dry_run, log_path) for that runner."""
    from .runner.measure import measure, model_flops_per_step
    from .runner.model import Dims
    from .runner.sharded import RunShape, unsupported_reason

    # a Python caller gets the CLI's GPU memory setting too, where this process's JAX has not started its GPU yet
    claim_device_memory(runner)
    if runner == "megatron":
        from .verify_megatron import verify_megatron
        if proxy or layers is not None:
            raise SpecError("proxy" if proxy else "layers", "the megatron runner runs the whole plan on the GPUs "
                            "the job gets (torchrun or SLURM); --proxy and --layers are the jax runner's")
        return verify_megatron(problem, plan, steps=steps, warmup=warmup, params=params, **(megatron or {}))
    if runner not in RUNNERS:
        raise SpecError("runner", f"unknown runner {runner!r}; this build has: {', '.join(RUNNERS)}")
    if problem.job.framework.packed_example_tokens:
        raise SpecError("packed_example_tokens", "the jax runner trains on unpacked sequences (full causal attention); "
                        "verify the plan without --packed-example-tokens")
    if problem.job.framework.lora_dim:
        raise SpecError("lora_dim", "the jax runner trains every weight (it has no LoRA adapters); verify the "
                        "plan without --lora-dim, or run it with Megatron-Bridge (export --to bridge)")
    if problem.job.framework.cpu_offloading_num_layers:
        raise SpecError("cpu_offloading_num_layers", "the jax runner keeps every activation on the GPU (no CPU "
                        "offloading); verify the plan without --cpu-offloading-num-layers, or run it with Megatron "
                        "(--runner megatron)")
    if steps < 1:
        raise SpecError("steps", f"must be at least 1, got {steps}")
    prec = problem.job.precision
    if prec not in _DTYPES:
        raise SpecError("precision", f"the jax runner computes in bf16, fp16 or fp32, not {prec.value}")
    devices = list(devices or jax.devices())
    choice = choose_run(problem, plan, len(devices), proxy=proxy, layers=layers)
    platform = devices[0].platform
    attn_impl, backend = _attention(platform, prec)
    rp = run_problem(problem, choice, backend)
    dims = Dims.from_spec(rp.model)
    shape = RunShape(dims=dims, plan=choice.plan, seq_len=problem.job.seq_len, global_batch=choice.global_batch,
                     compute_dtype=_DTYPES[prec], attention=attn_impl)
    reason = unsupported_reason(shape)
    if reason:
        raise SpecError("plan", f"the jax runner cannot run this plan: {reason}")
    predicted_run = predict(rp, choice.plan, params)
    predicted_run["memory_gb_dynamic"] = dynamic_memory_gb(predicted_run, params)
    predicted_full = predict(problem, plan, params)
    try:
        meas = measure(shape, devices, steps=steps, warmup=warmup, on_step=on_step)
    except Exception as exc:              # noqa: BLE001  (XLA's runtime errors; OOM is handled inside)
        if attn_impl != "cudnn":
            raise SpecError("runner", f"the run failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
        # cuDNN's fused attention refused these shapes: run XLA's attention and predict that instead
        attn_impl, backend = "xla", AttentionBackend.UNFUSED
        shape = dataclasses.replace(shape, attention=attn_impl)
        rp = run_problem(problem, choice, backend)
        predicted_run = predict(rp, choice.plan, params)
        predicted_run["memory_gb_dynamic"] = dynamic_memory_gb(predicted_run, params)
        meas = measure(shape, devices, steps=steps, warmup=warmup, on_step=on_step)
    flops = model_flops_per_step(dims, shape.seq_len, shape.global_batch)
    record = make_record(problem, rp, choice, shape, meas, flops, gpu_key=gpu_key, platform=platform,
                         machine=machine_info(devices), predicted_run=predicted_run)
    return {"runner": runner, "platform": platform, "status": meas.status, "proxy": choice.proxy,
            "run_plan": choice.plan.as_dict(), "run_layers": choice.num_layers, "run_devices": choice.num_devices,
            "run_global_batch": choice.global_batch, "attention": attn_impl,
            "measured_terms": list(choice.measured_terms), "predicted_terms": list(choice.predicted_terms),
            "comparison": comparison(predicted_run, meas, platform),
            "predicted_full_plan": {"plan": plan.as_dict(), "step_time_s": predicted_full["step_time_s"],
                                    "memory_gb": predicted_full["memory_gb"]["total"]},
            "error": meas.error, "record": record}


def dynamic_memory_gb(pred: dict, params: EfficiencyParams | None) -> dict:
    """The predicted memory without the framework's fixed bytes (CUDA context, NCCL buffers) and the
    allocator's fragmentation factor: what XLA's buffer assignment and the BFC allocator's
    peak_bytes_in_use count, so the memory terms are compared like for like."""
    mem = pred["memory_gb"]
    frag = (params or EfficiencyParams()).mem_fragmentation
    dynamic = (mem["total"] - FIXED_BYTES / 1e9) / frag
    return {"total": dynamic, **{k: mem[k] for k in ("weights", "gradients", "optimizer", "activations")},
            "other": dynamic - sum(mem[k] for k in ("weights", "gradients", "optimizer", "activations"))}


def _err(pred: float | None, meas: float | None):
    if pred is None or meas is None or not meas:
        return None
    return 100.0 * (pred / meas - 1.0)


def comparison(pred: dict, meas, platform: str) -> dict:
    """Predicted vs measured for the run (error = predicted / measured - 1, in %). On a CPU the step
    time is not comparable (the cost model predicts the GPU preset), so it has no error."""
    comparable = platform == "gpu"
    step = meas.step_time_s
    mem = meas.peak_bytes_per_device / 1e9 if meas.peak_bytes_per_device else None
    tok = pred["tokens_per_s"] * pred["step_time_s"] / step if step else None
    return {
        "step_time_s": {"predicted": pred["step_time_s"], "measured": step,
                        "error_pct": _err(pred["step_time_s"], step) if comparable else None,
                        "spread": meas.spread, "n_steps": len(meas.step_times_s)},
        "tokens_per_s": {"predicted": pred["tokens_per_s"], "measured": tok,
                         "error_pct": _err(pred["tokens_per_s"], tok) if comparable else None},
        "memory_gb": {"predicted": pred["memory_gb_dynamic"]["total"], "measured": mem,
                      "error_pct": _err(pred["memory_gb_dynamic"]["total"], mem), "source": meas.memory_source,
                      "predicted_breakdown": pred["memory_gb_dynamic"],
                      "predicted_with_fixed_overhead": pred["memory_gb"]["total"]},
        "fits_predicted": pred["fits"],
    }


def make_record(problem: Problem, rp: Problem, choice: RunChoice, shape, meas, flops: float, *, gpu_key: str,
                platform: str, machine: dict, predicted_run: dict) -> dict:
    """One measurement in the schema of shared/validation/README.md (+ `run`)."""
    m, p, n = rp.model, choice.plan, choice.num_devices
    step = meas.step_time_s
    tokens = shape.global_batch * shape.seq_len
    on_gpu = platform == "gpu"
    gpu = problem.cluster.gpu
    tflops = flops / step / n / 1e12 if step else None
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return {
        "id": f"verify-jax-{m.name}-L{m.num_layers}-{plan_slug(p)}-{stamp}",
        "source": {"title": "autotune verify --runner jax (built-in JAX transformer, synthetic tokens)",
                   "table": f"{machine['device_kind']} x{n}", "group": "autotune verify (jax runner)"},
        "confidence": "high" if meas.status == "ok" and len(meas.step_times_s) >= 3 else "low",
        "usable": bool(on_gpu and meas.status == "ok" and step),
        "model": {"name": m.name, "layers": m.num_layers, "hidden": m.hidden_size, "ffn_hidden": m.ffn_hidden_size,
                  "heads": m.num_attention_heads, "kv_heads": m.num_kv_heads, "vocab": m.vocab_size,
                  "seq_len": shape.seq_len, "num_experts": m.num_experts or None,
                  "top_k": m.experts_per_token or None, "moe_ffn_hidden": m.moe_ffn_hidden_size or None,
                  "params_billion": m.param_counts()["total"] / 1e9},
        "hardware": {"gpu": machine["device_kind"], "gpu_key": gpu_key if on_gpu else platform, "num_gpus": n,
                     "gpus_per_node": machine["devices_present"],
                     "interconnect": f"one host, {machine['devices_present']} {platform} device(s)"},
        "plan": {"tp": p.tp, "pp": p.pp, "dp": p.dp, "cp": p.cp, "ep": p.ep, "vpp": p.vpp, "micro_batch": p.mbs,
                 "global_batch": shape.global_batch, "sequence_parallel": p.sp,
                 "recompute": shape.recompute, "distributed_optimizer_or_zero": p.zero,
                 "precision": shape.compute_dtype, "precision_key": problem.job.precision.value,
                 "recompute_key": shape.recompute, "zero_key": p.zero},
        "measured": {"tflops_per_gpu": tflops,
                     "mfu": tflops * 1e12 / gpu.peak_flops(problem.job.precision) if (tflops and on_gpu) else None,
                     "hfu": None, "iteration_time_s": step,
                     "tokens_per_s_per_gpu": tokens / step / n if step else None,
                     "memory_gb": meas.peak_bytes_per_device / 1e9 if meas.peak_bytes_per_device else None,
                     "extra": {"status": meas.status, "error": meas.error, "step_times_s": list(meas.step_times_s),
                               "spread": meas.spread, "compile_s": meas.compile_s, "losses": list(meas.losses),
                               "memory_source": meas.memory_source, "xla_memory_bytes": meas.xla_memory}},
        "notes": (f"Measured by autotune verify on {machine['device_kind']} ({platform}); attention "
                  f"{shape.attention}; GPipe schedule when pp > 1; synthetic tokens. "
                  + ("Proxy run of a larger plan: " + "; ".join(choice.predicted_terms) + " not measured."
                     if choice.proxy else "")),
        "derived_fields": ["measured.tflops_per_gpu", "measured.mfu", "measured.tokens_per_s_per_gpu"],
        "run": {"runner": "jax", "proxy": choice.proxy, "framework": run_framework(rp), "measured_terms": list(choice.measured_terms),
                "predicted_terms": list(choice.predicted_terms), "machine": machine,
                "predicted": {"step_time_s": predicted_run["step_time_s"],
                              "memory_gb": predicted_run["memory_gb"]["total"],
                              "memory_gb_without_fixed": predicted_run["memory_gb_dynamic"]["total"]}},
    }


def run_framework(rp: Problem) -> dict:
    """The framework options the run had (api.framework_spec's names), so calibration predicts it
    as it ran: the attention kernel used, no TP-communication overlap, fp32 gradient reduction."""
    fw = rp.job.framework
    cap = {"moe_expert_capacity_factor": fw.moe_expert_capacity_factor} if fw.moe_expert_capacity_factor else {}
    return {"attention_backend": fw.attention_backend.value, **RUN_FRAMEWORK, **cap}


def plan_slug(p: Plan) -> str:
    rec = {Recompute.NONE: "none", Recompute.SELECTIVE: "sel", Recompute.FULL: "full"}[p.recompute]
    return (f"tp{p.tp}-pp{p.pp}-dp{p.dp}-cp{p.cp}-ep{p.ep}-mbs{p.mbs}-{rec}"
            f"{'-sp' if p.sp else ''}-z{p.zero}")


def verify_top(problem: Problem, top: list, k: int, *, gpu_key: str, steps: int = 3, params=None, devices=None,
               on_result=None, runner: str = "jax", megatron: dict | None = None) -> dict:
    """Measure the first k plans of a search (`top`: its plan reports), each as a full run when the
    devices suffice, else as a proxy; re-rank them by the measured step time. A proxy (or a --layers
    run) does not measure the whole step, so its plan is ranked by the full plan's prediction scaled by
    the run's measured / predicted ratio (a full run's scaled value is its measured time). On a CPU
    times are not comparable with the GPU preset, so the predicted order is kept and said so. A plan
    the runner cannot build, or one that runs out of memory, is recorded and the others still run;
    Ctrl-C stops and keeps the finished ones."""
    if k < 1:
        raise SpecError("verify-top", f"must be at least 1, got {k}")
    devices = list(devices or jax.devices())
    entries, interrupted = [], False
    for rank, rep in enumerate(top[:k], 1):
        plan = Plan.from_dict(rep["plan"])
        entry = {"predicted_rank": rank, "plan": rep["plan"], "predicted_step_time_s": rep["step_time_s"]}
        try:
            res = verify_plan(problem, plan, gpu_key=gpu_key, steps=steps,
                              proxy=runner == "jax" and plan.num_gpus > len(devices), params=params,
                              devices=devices, runner=runner, megatron=megatron)
        except SpecError as exc:
            entry.update(status="skipped", reason=str(exc))
        except KeyboardInterrupt:
            interrupted = True
            break
        else:
            st = res["comparison"]["step_time_s"]
            ratio = st["measured"] / st["predicted"] if st["measured"] else None
            entry.update(status=res["status"], proxy=res["proxy"], run=res, measured_run_step_time_s=st["measured"],
                         predicted_run_step_time_s=st["predicted"],
                         corrected_step_time_s=rep["step_time_s"] * ratio if ratio else None)
            if res["status"] == "interrupted":
                interrupted = True
        entries.append(entry)
        if on_result:
            on_result(entry)
        if interrupted:
            break
    on_gpu = runner == "megatron" or devices[0].platform == "gpu"
    timed = [e for e in entries if e.get("corrected_step_time_s")]
    order = sorted(timed, key=lambda e: e["corrected_step_time_s"]) if on_gpu else timed
    for i, e in enumerate(order, 1):
        e["measured_rank"] = i if on_gpu else None
    return {"k": k, "steps": steps, "platform": "gpu" if runner == "megatron" else devices[0].platform,
            "runner": runner, "interrupted": interrupted,
            "reranked": on_gpu, "plans": entries,
            "note": ("re-ranked by measured step time (proxies: the full plan's prediction x measured/predicted "
                     "of the run)") if on_gpu else
                    "measured on CPU: step times are not comparable with the GPU preset, predicted order kept"}


#: plan knobs a verification trial records (Plan.as_dict names)
TRIAL_KNOBS = ("tp", "pp", "dp", "cp", "ep", "etp", "vpp", "mbs", "recompute", "recompute_modules", "sp", "zero")


def record_trials(verification: dict, study=None):
    """Each verified plan as a finished trial of an Optuna study (in memory unless `study` is given,
    e.g. one on an RDB storage that other machines share), seeded with `study.enqueue_trial` so that
    the trial's parameters are the plan's knobs. The value is the step time the re-ranking used (the
    corrected full-plan time on GPUs, the run's own time elsewhere); a run that did not finish is a
    FAIL trial with its status. Returns the study."""
    import optuna
    if study is None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(direction="minimize", study_name="verify-top")
    rows = [{k: ("+".join(v) if isinstance(v, (list, tuple)) else v) for k, v in e["plan"].items()
             if k in TRIAL_KNOBS} for e in verification["plans"]]
    # one categorical distribution per knob for the whole study (Optuna needs a fixed value space)
    choices = {k: sorted({r[k] for r in rows}, key=str) for k in TRIAL_KNOBS if rows and k in rows[0]}
    for e, knobs in zip(verification["plans"], rows):
        study.enqueue_trial(knobs)
        trial = study.ask()
        for k in choices:
            trial.suggest_categorical(k, choices[k])
        trial.set_user_attr("status", e["status"])
        trial.set_user_attr("predicted_step_time_s", e["predicted_step_time_s"])
        trial.set_user_attr("proxy", bool(e.get("proxy")))
        value = e.get("corrected_step_time_s") if verification["reranked"] else e.get("measured_run_step_time_s")
        if e["status"] == "ok" and value:
            study.tell(trial, value)
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return study
