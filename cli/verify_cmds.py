"""`autotune verify` (issue 14) and the `--verify-top K` step of `autotune search`: thin shells over
`autotune.verify`. Exit codes: 0 measured, 2 bad input (one line), 3 the run ran out of memory,
130 stopped by Ctrl-C (the finished measurements are kept and saved).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from costmodels.specs import SpecError

from cli.options import (AttentionBackendOpt, CalibrationOpt, CudaGraphImplOpt, CudaGraphModulesOpt, DispatcherOpt,
                         EpOverlapOpt, Fp8ParamGatherOpt, FrameworkOpt, GlobalBatchOpt, GpuOpt, GpusOpt,
                         GradAccFusionOpt, GradReduceBf16Opt, JsonOpt, ModelOpt, MoePermuteFusionOpt,
                         CrossEntropyFusionOpt, CrossEntropyImplOpt, Fp8AttentionOpt, LoraDimOpt, LoraModulesOpt, PackedExampleTokensOpt, Fp8RecipeOpt,
                         MtpNumLayersOpt, CpuOffloadingOpt,
                         OverlapGradReduceOpt, OverlapParamGatherOpt, PrecisionOpt, SeqLenOpt, TpCommOverlapOpt,
                         framework_options_of)

EXIT_OK, EXIT_OOM, EXIT_INTERRUPTED = 0, 3, 130
#: autotune.verify.RUNNERS, spelled here so that checking the flags imports no JAX (tests check they agree)
RUNNERS = ("jax", "megatron")

StepsOpt = Annotated[int, typer.Option("--steps", min=1, help="Timed optimizer steps (after --warmup).")]
RunnerOpt = Annotated[str, typer.Option("--runner", help="jax (the built-in JAX transformer) or megatron (Megatron-LM: "
                                        "--megatron-path, torchrun or SLURM).")]
MegatronPathOpt = Annotated[Optional[str], typer.Option("--megatron-path", help="A Megatron-LM checkout (holds "
                                                        "pretrain_gpt.py), for --runner megatron.")]
LauncherOpt = Annotated[str, typer.Option("--launcher", help="torchrun (this node) or slurm (sbatch --wait), for "
                                          "--runner megatron.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="--runner megatron: print the torchrun command (or the "
                                         "sbatch script) and run nothing.")]
ProxyOpt = Annotated[bool, typer.Option("--proxy", help="Run the plan's per-device shapes on fewer devices: one "
                                        "pipeline stage, one DP rank (says which terms stay predicted).")]
LayersOpt = Annotated[Optional[int], typer.Option("--layers", help="Build this many layers (default: the model's, "
                                                  "or L/pp with --proxy).")]
OutOpt = Annotated[str, typer.Option("--out", help="Folder for the measurement records (validation schema).")]


def _console(as_json: bool) -> Console:
    con = Console(highlight=False, stderr=as_json)
    return con if con.is_terminal else Console(highlight=False, stderr=as_json, width=max(con.width, 160))


def save_records(records: list, out: str, name: str) -> str:
    """A runs file (a list of records) that `autotune calibrate` reads."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(out, f"{name}_{stamp}.json")
    try:
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as fh:
            json.dump(records, fh, indent=1)
            fh.write("\n")
    except OSError as exc:
        raise SpecError("out", f"cannot write the measurements to {out}: {exc.strerror or exc}") from None
    return path


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def comparison_table(res: dict, title: str) -> Table:
    cmp = res["comparison"]
    t = Table(title=title, title_justify="left")
    for col in ("", "predicted", "measured", "error %"):
        t.add_column(col, justify="left" if not col else "right")
    st = cmp["step_time_s"]
    t.add_row("step time (s)", _fmt(st["predicted"], ".4f"), _fmt(st["measured"], ".4f"), _fmt(st["error_pct"], "+.1f"))
    tk = cmp["tokens_per_s"]
    t.add_row("tokens/s", _fmt(tk["predicted"], ",.0f"), _fmt(tk["measured"], ",.0f"), _fmt(tk["error_pct"], "+.1f"))
    mm = cmp["memory_gb"]
    t.add_row("peak memory per device (GB, no fixed overhead)", _fmt(mm["predicted"], ".3f"), _fmt(mm["measured"], ".3f"),
              _fmt(mm["error_pct"], "+.1f"))
    return t


def print_result(con: Console, res: dict) -> None:
    from autotune.verify import plan_slug
    from costmodels.plan import Plan
    run = Plan.from_dict(res["run_plan"])
    head = (f"{'Proxy run' if res['proxy'] else 'Run'}: {plan_slug(run)}, {res['run_layers']} layers, "
            f"{res['run_devices']} {res['platform']} device(s), global batch {res['run_global_batch']}, "
            f"attention {res['attention']}: {res['status']}")
    con.print(Text(head))
    con.print(comparison_table(res, "Predicted vs measured (the run)"))
    st = res["comparison"]["step_time_s"]
    if st["spread"] is not None:
        con.print(Text(f"  {st['n_steps']} timed steps, spread (max-min)/median {st['spread']:.1%}; memory from "
                       f"{res['comparison']['memory_gb']['source']}"))
    if res["platform"] != "gpu":
        con.print(Text("  Step time is not comparable on a CPU (the cost model predicts the GPU preset); "
                       "memory is."))
    con.print(Text("  measured: " + "; ".join(res["measured_terms"])))
    if res["predicted_terms"]:
        con.print(Text("  still predicted: " + "; ".join(res["predicted_terms"])))
    full = res["predicted_full_plan"]
    con.print(Text(f"  full plan predicted: {full['step_time_s']:.4f} s per step, {full['memory_gb']:.2f} GB per GPU"))
    if res.get("job"):
        con.print(Text(f"  command: {res['job']['torchrun_text']}"), soft_wrap=True)
    if res["error"]:
        con.print(Text(f"  {res['status']}: {res['error']}"))


def verify(
    model: ModelOpt,
    plan: Annotated[str, typer.Option("--plan", help='Knobs, e.g. "tp=2,pp=2,mbs=1,recompute=selective".')],
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = "bf16",
    steps: StepsOpt = 5,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed steps after compilation.")] = 1,
    runner: RunnerOpt = "jax",
    proxy: ProxyOpt = False,
    layers: LayersOpt = None,
    out: OutOpt = "measurements",
    no_save: Annotated[bool, typer.Option("--no-save", help="Do not write the measurement record.")] = False,
    as_json: JsonOpt = False,
    calibration: CalibrationOpt = None,
    megatron_path: MegatronPathOpt = None,
    launcher: LauncherOpt = "torchrun",
    dry_run: DryRunOpt = False,
    framework: FrameworkOpt = None,
    attention_backend: AttentionBackendOpt = None,
    tp_comm_overlap: TpCommOverlapOpt = None,
    grad_reduce_in_bf16: GradReduceBf16Opt = None,
    fp8_param_gather: Fp8ParamGatherOpt = None,
    moe_token_dispatcher_type: DispatcherOpt = None,
    overlap_moe_expert_parallel_comm: EpOverlapOpt = None,
    overlap_grad_reduce: OverlapGradReduceOpt = None,
    overlap_param_gather: OverlapParamGatherOpt = None,
    gradient_accumulation_fusion: GradAccFusionOpt = None,
    moe_permute_fusion: MoePermuteFusionOpt = None,
    cross_entropy_loss_fusion: CrossEntropyFusionOpt = None,
    cross_entropy_fusion_impl: CrossEntropyImplOpt = None,
    fp8_recipe: Fp8RecipeOpt = None,
    fp8_dot_product_attention: Fp8AttentionOpt = None,
    lora_dim: LoraDimOpt = None,
    lora_target_modules: LoraModulesOpt = None,
    packed_example_tokens: PackedExampleTokensOpt = None,
    mtp_num_layers: MtpNumLayersOpt = None,
    cpu_offloading_num_layers: CpuOffloadingOpt = None,
    cuda_graph_impl: CudaGraphImplOpt = None,
    cuda_graph_modules: CudaGraphModulesOpt = None,
) -> int:
    """Run a plan for a few steps with a real runner; print predicted vs measured; save the record."""
    from autotune.runner import claim_device_memory
    claim_device_memory(runner)                    # before anything here starts JAX's GPU backend
    from autotune import api
    from autotune.verify import plan_slug, verify_plan
    megatron = megatron_options(runner, megatron_path, launcher, dry_run, out)
    fw = framework_options_of(locals())
    given = [k for k, v in fw.items() if v is not None]
    if given and runner != "megatron":
        raise SpecError(f"--{given[0].replace('_', '-')}", "applies to --runner megatron (the jax runner runs its "
                        "own framework: autotune.verify.RUN_FRAMEWORK)")
    problem = api.build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                                precision=precision, framework=fw)
    params, _ = api.load_params(calibration, problem.cluster.gpu.name)
    the_plan = api.plan_from_text(plan, problem)
    con = _console(as_json)
    res = verify_plan(problem, the_plan, gpu_key=problem.cluster.gpu.name, steps=steps, warmup=warmup, proxy=proxy,
                      layers=layers, runner=runner, params=params, megatron=megatron,
                      on_step=None if as_json else lambda i, dt: con.print(Text(f"  step {i}: {dt:.4f} s")))
    if res["status"] == "dry-run":
        if as_json:
            sys.stdout.write(json.dumps(res, indent=2) + "\n")
        else:
            sys.stdout.write(command_of(res["job"], launcher))
        return EXIT_OK
    res["saved"] = None if no_save else save_records([res["record"]], out, f"verify_{plan_slug(the_plan)}")
    if as_json:
        sys.stdout.write(json.dumps(res, indent=2) + "\n")
    else:
        print_result(con, res)
        con.print(Text(f"Measurement saved to {res['saved']}" if res["saved"] else "Measurement not saved (--no-save)."))
    if res["status"] == "oom":
        sys.stderr.write(f"error: out of memory: the run of {plan_slug(the_plan)} did not fit (recorded)\n")
        return EXIT_OOM
    return EXIT_INTERRUPTED if res["status"] == "interrupted" else EXIT_OK


def megatron_options(runner: str, megatron_path: Optional[str], launcher: str, dry_run: bool, out: str) -> dict | None:
    """verify_plan's `megatron` options; the Megatron-only flags are refused with the jax runner."""
    if runner != "megatron":
        for flag, given in (("--megatron-path", megatron_path), ("--dry-run", dry_run),
                            ("--launcher", launcher != "torchrun")):
            if given:
                raise SpecError(flag, "applies to --runner megatron")
        return None
    from autotune.verify_megatron import check_megatron_options
    check_megatron_options(megatron_path, launcher)
    return {"megatron_path": megatron_path, "launcher": launcher, "dry_run": dry_run, "log_dir": out}


def command_of(job: dict, launcher: str) -> str:
    """What --dry-run prints: the torchrun command line, or the sbatch script."""
    return job["sbatch"] if launcher == "slurm" else job["torchrun_text"] + "\n"


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)


VerifyTopOpt = Annotated[Optional[int], typer.Option("--verify-top", min=1, help="Measure the best K plans with "
                                                     "--runner (proxies when devices are few) and re-rank them; with "
                                                     "--storage/--study they are queued in a verification study that "
                                                     "`autotune worker` on other machines joins.")]


def check_verify_options(verify_top: Optional[int], runner: str, megatron_path: Optional[str], launcher: str,
                         dry_run: bool, gpus) -> None:
    """The --verify-top flags of `search`, checked before any search runs."""
    from cli.optuna_cmds import is_gpu_range
    if not verify_top:
        for flag, given in (("--runner", runner != "jax"), ("--megatron-path", megatron_path),
                            ("--launcher", launcher != "torchrun"), ("--dry-run", dry_run)):
            if given:
                raise SpecError(flag, "applies to --verify-top K")
        return
    if runner not in RUNNERS:
        raise SpecError("runner", f"unknown runner {runner!r}; this build has: {', '.join(RUNNERS)}")
    if is_gpu_range(gpus):
        raise SpecError("verify-top", "measures plans of one GPU count; give --gpus N, not a range")
    if dry_run and runner != "megatron":
        raise SpecError("--dry-run", "applies to --runner megatron")
    megatron_options(runner, megatron_path, launcher, dry_run, ".")
    from autotune.runner import claim_device_memory
    claim_device_memory(runner)                    # before the search starts JAX's GPU backend


def search_verification(problem, report: dict, k: int, params, as_json: bool, out: str, no_save: bool, *,
                        runner: str = "jax", megatron_path: Optional[str] = None, launcher: str = "torchrun",
                        dry_run: bool = False, storage: Optional[str] = None, study: Optional[str] = None,
                        spec=None) -> dict:
    """`search --verify-top K`: measure the report's top plans (records saved in OUT/measurements).
    In memory by default; with `storage` the plans are queued in a verification study (spec: the search
    problem as a StudySpec) and this process measures queued plans until none is left."""
    con = _console(as_json)
    meas_dir = os.path.join(out, "measurements")
    if dry_run:
        return _dry_run_commands(problem, report["top"][:k], megatron_path, launcher, meas_dir)
    if storage:
        return _study_verification(report, k, as_json, meas_dir, no_save, runner=runner, megatron_path=megatron_path,
                                   launcher=launcher, storage=storage, study=study, spec=spec)
    from autotune.verify import record_trials, verify_top
    show = lambda e: con.print(Text(f"  verified #{e['predicted_rank']}: {e['status']}"))   # noqa: E731
    ver = verify_top(problem, report["top"], k, gpu_key=problem.cluster.gpu.name, params=params,
                     on_result=None if as_json else show, runner=runner,
                     megatron=megatron_options(runner, megatron_path, launcher, False, meas_dir))
    study_obj = record_trials(ver)
    done = [t for t in study_obj.trials if t.value is not None]
    ver["optuna"] = {"study": study_obj.study_name, "storage": "memory", "n_trials": len(study_obj.trials),
                     "n_complete": len(done), "best_params": min(done, key=lambda t: t.value).params if done else None}
    records = [e["run"]["record"] for e in ver["plans"] if "run" in e]
    ver["saved"] = save_records(records, meas_dir, "verify_top") if records and not no_save else None
    return ver


def _dry_run_commands(problem, top: list, megatron_path: str, launcher: str, log_dir: str) -> dict:
    from autotune.verify_megatron import verify_megatron
    from costmodels.plan import Plan
    cmds = []
    for rank, rep in enumerate(top, 1):
        res = verify_megatron(problem, Plan.from_dict(rep["plan"]), megatron_path=megatron_path, launcher=launcher,
                              dry_run=True, log_dir=log_dir)
        cmds.append({"predicted_rank": rank, "plan": rep["plan"], "command": command_of(res["job"], launcher),
                     "job": res["job"]})
    return {"dry_run": True, "runner": "megatron", "launcher": launcher, "k": len(top), "commands": cmds}


def _study_verification(report: dict, k: int, as_json: bool, meas_dir: str, no_save: bool, *, runner: str,
                        megatron_path, launcher: str, storage: str, study, spec) -> dict:
    from autotune.verify_study import (RunnerConfig, open_verification_study, run_verification_worker,
                                       verification_summary)
    con = _console(as_json)
    run = RunnerConfig(runner=runner, megatron_path=megatron_path, launcher=launcher)
    name, queued, joined = open_verification_study(spec, run, storage_url=storage, study_name=study,
                                                   top=report["top"], k=k)
    show = lambda e: con.print(Text(f"  trial {e['trial']} (predicted #{e.get('predicted_rank') or '-'}): "  # noqa: E731
                                    f"{e['status']}" + (f": {e['reason']}" if e.get("reason") else "")))
    wres = run_verification_worker(storage, name, waiting_only=True, runner=runner, megatron_path=megatron_path,
                                   launcher=launcher, out=None if no_save else meas_dir,
                                   on_result=None if as_json else show)
    summ = verification_summary(storage, name)
    platform = "gpu" if runner == "megatron" else _jax_platform()
    reranked = platform == "gpu"
    for e in summ["plans"]:
        e["measured_rank"] = e.get("measured_rank") if reranked else None
    best = summ["best"]
    return {"k": k, "steps": summ["steps"], "platform": platform, "runner": runner, "interrupted": wres["interrupted"],
            "reranked": reranked, "plans": summ["plans"], "saved": wres["saved"],
            "note": ("re-ranked by measured step time (study values)" if reranked else
                     "measured on CPU: step times are not comparable with the GPU preset, predicted order kept"),
            "optuna": {"study": name, "storage": summ["storage"], "queued": queued, "joined": joined,
                       "n_trials": len(summ["plans"]), "n_complete": summ["counts"]["COMPLETE"],
                       "counts": summ["counts"], "this_process_runs": wres["runs"],
                       "best_params": best["plan"] if best else None,
                       "join": f"autotune worker --storage {summ['storage']} --study {name} --trials N"}}


def _jax_platform() -> str:
    import jax
    return jax.default_backend()


def print_verification(con: Console, ver: dict) -> None:
    from autotune.verify import plan_slug
    from costmodels.plan import Plan
    if ver.get("dry_run"):
        con.print(Text(f"Dry run: the Megatron-LM commands of the top {ver['k']} plans ({ver['launcher']}):"))
        for c in ver["commands"]:
            con.print(Text(f"# predicted #{c['predicted_rank']}: {plan_slug(Plan.from_dict(c['plan']))}"))
            con.print(Text(c["command"].rstrip("\n")), soft_wrap=True)
        return
    t = Table(title=f"Verified top {ver['k']} ({ver.get('runner', 'jax')} runner, {ver['platform']}, {ver['steps']} "
                    f"steps each): {ver['note']}", title_justify="left")
    for col in ("predicted #", "measured #", "plan", "run", "predicted s", "measured s (run)", "predicted s (run)",
                "mem pred GB", "mem meas GB", "status"):
        t.add_column(col, justify="left" if col in ("plan", "run", "status") else "right")
    for e in ver["plans"]:
        run = e.get("run") or {}
        mem = (run.get("comparison") or {}).get("memory_gb") or {}
        ran = run or e.get("measured_run_step_time_s") is not None
        t.add_row(_fmt(e.get("predicted_rank"), "d"), _fmt(e.get("measured_rank"), "d"),
                  plan_slug(Plan.from_dict(e["plan"])) if "tp" in e["plan"] else str(e["plan"]),
                  ("proxy" if e.get("proxy") else "full") if ran else "-", _fmt(e.get("predicted_step_time_s"), ".4f"),
                  _fmt(e.get("measured_run_step_time_s"), ".4f"), _fmt(e.get("predicted_run_step_time_s"), ".4f"),
                  _fmt(e.get("memory_gb_predicted", mem.get("predicted")), ".3f"),
                  _fmt(e.get("memory_gb_measured", mem.get("measured")), ".3f"),
                  e["status"] + (f": {e['reason']}" if e.get("reason") else ""))
    con.print(t)
    o = ver.get("optuna") or {}
    if o.get("storage", "memory") != "memory":
        con.print(Text(f"Verification study {o['study']} in {o['storage']}: {o['queued']} plans queued"
                       f"{' (joined an existing study)' if o['joined'] else ''}, this process ran {o['this_process_runs']}; "
                       f"trials {', '.join(f'{k.lower()} {v}' for k, v in o['counts'].items() if v)}. "
                       f"Other machines join with: {o['join']}"))
    if ver.get("saved"):
        con.print(Text(f"Measurements saved to {ver['saved']}"))
