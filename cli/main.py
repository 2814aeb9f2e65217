"""The `autotune` command line: a thin shell over `autotune.api` (STYLE.md point 10).

Each command calls one Python API function and renders what it returns: rich tables for people,
the API's own dicts as JSON (`--json`) for scripts. Nothing here computes a cost.

Exit codes and the error boundary: `cli/common.py` (0 ok, 2 bad input, 3 nothing fits, one
`error:` line on stderr, never a traceback). JAX and Optuna are imported inside the commands that
score, so `--help` and bad-input errors start fast (tests/benchmarks/bench_startup.py).
"""
from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from autotune import __version__
from cli import capacity_cmds, export_cmds, optuna_cmds, verify_cmds
from cli.common import (EXIT_BAD_INPUT, EXIT_NOTHING_FITS, EXIT_OK, OneLineErrors, check_problem_options,
                        configure_compile_cache, error_line, print_json, print_plans, print_table, spinner,
                        stdout_console, thousands)
from cli.options import (  # shared flags
    ModelOpt, GpuOpt, GpusOpt, GlobalBatchOpt, SeqLenOpt, PrecisionOpt, GpusPerNodeOpt, IntraBwOpt, InterBwOpt, ClusterOpt, MemLimitOpt, CalibrationOpt, JsonOpt,
    FrameworkOpt, AttentionBackendOpt, TpCommOverlapOpt, GradReduceBf16Opt, Fp8ParamGatherOpt, DispatcherOpt, EpOverlapOpt,
    OverlapGradReduceOpt, OverlapParamGatherOpt, GradAccFusionOpt, MoePermuteFusionOpt,
    CrossEntropyFusionOpt, CrossEntropyImplOpt, Fp8AttentionOpt, LoraDimOpt, LoraModulesOpt, PackedExampleTokensOpt, Fp8RecipeOpt,
    MtpNumLayersOpt, CpuOffloadingOpt,
    CudaGraphImplOpt, CudaGraphModulesOpt,
    framework_options_of,
)
from cli.notes import problem_notes
from costmodels.specs import SpecError

#: the most plans `search --top` lists: each costs a row of the scorer's top-K buffer (8 per plan asked for),
#: so 10^11 ran out of memory and 2^63 overflowed numpy; a report of 10,000 plans already takes ~1 GB to build
MAX_TOP = 10_000

app = typer.Typer(
    name="autotune",
    cls=OneLineErrors,
    help="Parallelism auto-tuner for large-model training: score every legal plan with a "
         "vectorized cost model and pick the fastest that fits.",
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,
    no_args_is_help=True,
)


def _version_callback(value: bool) -> None:
    if value:
        sys.stdout.write(f"autotune {__version__}\n")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Parallelism auto-tuner for large-model training."""
    configure_compile_cache()


def _problem(model, gpu, gpus, global_batch, seq_len, precision, gpus_per_node, intra_node_bw,
             inter_node_bw, cluster, framework=None):
    from autotune.problem import build_problem       # numpy only: bad input is refused before JAX loads
    return build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                             precision=precision, gpus_per_node=gpus_per_node, intra_node_bw=intra_node_bw,
                             inter_node_bw=inter_node_bw, cluster_file=cluster, framework=framework)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------

def _space_line(space: dict, elapsed_s: float) -> str:
    illegal = space.get("illegal") or {}
    reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(illegal.items(), key=lambda kv: -kv[1]))
    n_illegal = sum(illegal.values())
    return (f"Space: {space['total']:,} combinations, {space['legal']:,} legal, {n_illegal:,} illegal"
            f"{f' ({reasons})' if reasons else ''}, {space['fitting']:,} fit in memory, "
            f"{space['scored']:,} scored in {elapsed_s:.2f} s.")


def over_limit_line(rep: dict) -> str:
    mem = rep["memory_gb"]
    terms = sorted(((k, mem[k]) for k in ("weights", "gradients", "optimizer", "activations", "other")),
                   key=lambda kv: -kv[1])
    largest = ", ".join(f"{k} {v:.1f} GB" for k, v in terms[:3])
    return (f"memory: the plan needs {mem['total']:.1f} GB per GPU, {mem['total'] - mem['limit']:.1f} GB "
            f"over the {mem['limit']:.1f} GB limit (largest: {largest})")


def _time_table(rep: dict) -> Table:
    from autotune.report import TIME_LABELS
    step = rep["step_time_s"]
    table = Table(title="Time per step", title_justify="left")
    table.add_column("term")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for k, v in rep["time_breakdown_s"].items():
        table.add_row(TIME_LABELS.get(k, k), f"{v:.4f}", f"{v / step:.1%}" if step > 0 else "-")
    table.add_row("step", f"{step:.4f}", "100.0%", style="bold")
    return table


def _memory_table(rep: dict) -> Table:
    mem = rep["memory_gb"]
    table = Table(title="Peak memory per GPU", title_justify="left")
    table.add_column("term")
    table.add_column("GB", justify="right")
    table.add_column("share", justify="right")
    for k in ("weights", "gradients", "optimizer", "activations", "other"):
        table.add_row(k, f"{mem[k]:.2f}", f"{mem[k] / mem['total']:.1%}" if mem["total"] > 0 else "-")
    table.add_row("total", f"{mem['total']:.2f}", "100.0%", style="bold")
    table.add_row("limit", f"{mem['limit']:.2f}", "")
    return table


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}%"


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------

@app.command()
def search(
    model: ModelOpt,
    gpu: GpuOpt = None,
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="Number of GPUs; for --strategy optuna/auto also "
                                                "a range: 256-2048 (whole nodes), 256-2048:64, 256-2048:pow2.")] = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = "bf16",
    gpus_per_node: GpusPerNodeOpt = None,
    intra_node_bw: IntraBwOpt = None,
    inter_node_bw: InterBwOpt = None,
    cluster: ClusterOpt = None,
    strategy: Annotated[str, typer.Option("--strategy", help="exhaustive, optuna, or auto (exhaustive when the "
                                          "legal space is small enough, else optuna; says which).")] = "auto",
    top: Annotated[int, typer.Option("--top", min=1, max=MAX_TOP, help="How many plans to list.")] = 10,
    memory_limit_gb: MemLimitOpt = None,
    out: Annotated[str, typer.Option("--out", help="Folder for the JSON + Markdown report.")] = "results",
    no_save: Annotated[bool, typer.Option("--no-save", help="Do not write the report.")] = False,
    as_json: JsonOpt = False,
    calibration: CalibrationOpt = None,
    trials: optuna_cmds.TrialsOpt = None,
    timeout: optuna_cmds.TimeoutOpt = None,
    sampler: Annotated[Optional[str], typer.Option("--sampler", help="Optuna sampler: table (default: legal "
                                                   "plans ranked by a surrogate), tpe, nsga2, gp, cmaes, random, grid.")] = None,
    seed: optuna_cmds.SeedOpt = None,
    objective: Annotated[Optional[list[str]], typer.Option("--objective", help="tokens_per_s (default), "
                         "step_time, gpus, cost, memory; repeat for a Pareto front.")] = None,
    storage: optuna_cmds.StorageOpt = None,
    study: optuna_cmds.StudyOpt = None,
    batch_size: optuna_cmds.BatchOpt = None,
    with_sensitivity: Annotated[bool, typer.Option(
        "--sensitivity/--no-sensitivity",
        help="Add the best plan's elasticities (jax.jacfwd through the cost model) to the report: off by "
             "default, it costs ~2-3 s more (~8 s in a fresh compilation cache).")] = False,
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
    export_to: export_cmds.ExportOpt = None,
    verify_top: verify_cmds.VerifyTopOpt = None,
    runner: verify_cmds.RunnerOpt = "jax",
    megatron_path: verify_cmds.MegatronPathOpt = None,
    launcher: verify_cmds.LauncherOpt = "torchrun",
    dry_run: verify_cmds.DryRunOpt = False,
    memory_headroom: capacity_cmds.HeadroomOpt = None,
) -> int:
    """Find the fastest plan that fits in memory: every legal plan (exhaustive) or an Optuna study."""
    from autotune.files import check_writable_folder     # JAX and Optuna only once the input is checked

    fw = framework_options_of(locals())
    check_problem_options(memory_limit_gb=memory_limit_gb, intra_node_bw=intra_node_bw, inter_node_bw=inter_node_bw)
    export_to = export_to and export_cmds.parse_target(export_to)
    gpu_count = optuna_cmds.parse_search_gpus(gpus)
    verify_cmds.check_verify_options(verify_top, runner, megatron_path, launcher, dry_run, gpu_count)
    room = capacity_cmds.headroom_of(gpu, cluster, memory_limit_gb, memory_headroom, gpu_count)
    memory_limit_gb = room.limit_gb if room else memory_limit_gb
    # with --verify-top, --storage/--study hold the verification study (the cost-model search runs in memory)
    verify_storage, verify_study = (storage, study) if verify_top else (None, None)
    storage, study = (None, None) if verify_top else (storage, study)
    given = [name for name, value in zip(optuna_cmds.OPTUNA_OPTIONS, (trials, timeout, sampler, seed,
                                                                      storage, study, batch_size)) if value is not None]
    verification = None
    if verify_top:
        def verification(the_problem, report, params):
            spec = None
            if verify_storage:
                from autotune.study_spec import StudySpec
                spec = StudySpec(model=model, gpu=gpu, gpus=str(the_problem.cluster.num_gpus),
                                 global_batch=the_problem.job.global_batch, seq_len=the_problem.job.seq_len,
                                 precision=precision, gpus_per_node=gpus_per_node, intra_node_bw=intra_node_bw,
                                 inter_node_bw=inter_node_bw, cluster_file=cluster, memory_limit_gb=memory_limit_gb,
                                 calibration=calibration, framework={k: v for k, v in fw.items() if v is not None})
            return verify_cmds.search_verification(the_problem, report, verify_top, params, as_json, out, no_save,
                                                   runner=runner, megatron_path=megatron_path, launcher=launcher,
                                                   dry_run=dry_run, storage=verify_storage, study=verify_study,
                                                   spec=spec)
    problem = None
    if gpu_count is None or isinstance(gpu_count, int):      # check the input before importing JAX/Optuna
        problem = _problem(model, gpu, gpu_count, global_batch, seq_len, precision, gpus_per_node, intra_node_bw,
                           inter_node_bw, cluster, fw)
    if not no_save:
        check_writable_folder(out, "out")          # before the search (after the input is checked), not after it
    # `auto` on one GPU count counts nothing first: an exhaustive choice it makes is checked by the search itself,
    # which stops once it passes the limit
    choice = optuna_cmds.choose(strategy, gpus=gpu_count, objectives=objective, optuna_options=given,
                                count_legal=None)
    deferred = strategy.strip().lower() == "auto" and choice.strategy == "exhaustive"

    def run_optuna(choice):
        return optuna_cmds.run_optuna_search(
            model=model, gpu=gpu, gpus=gpu_count, global_batch=global_batch, seq_len=seq_len, precision=precision,
            gpus_per_node=gpus_per_node, intra_node_bw=intra_node_bw, inter_node_bw=inter_node_bw, cluster=cluster,
            top=top, memory_limit_gb=memory_limit_gb, out=out, no_save=no_save, as_json=as_json,
            calibration=calibration, trials=trials, timeout=timeout, sampler=sampler, seed=seed,
            objectives=objective, storage=storage, study=study, batch_size=batch_size, choice=choice,
            requested=strategy, with_sensitivity=with_sensitivity, framework=fw, export_to=export_to,
            headroom=room, verification=verification)
    if choice.strategy == "optuna" or optuna_cmds.is_gpu_range(gpu_count):
        return run_optuna(choice)
    from autotune import api
    from autotune.advice import no_legal_plan_advice, nothing_fits_advice
    from autotune.report import save_report, search_report
    from autotune.search import NoLegalPlan, NothingFits, TooManyPlans
    from autotune.strategy import AUTO_EXHAUSTIVE_MAX, StrategyChoice
    params, params_source = api.load_params(calibration, problem.cluster.gpu.name)
    try:
        with spinner("Scoring every legal plan...", enabled=not as_json):
            result = api.search(problem, strategy="exhaustive", top_k=top, memory_limit_gb=memory_limit_gb,
                                params=params, max_legal=AUTO_EXHAUSTIVE_MAX if deferred else None)
        if deferred:
            n = int(result.space["legal"])
            choice = StrategyChoice("exhaustive", f"{n:,} legal plans <= {AUTO_EXHAUSTIVE_MAX:,}: scored in a few "
                                    "seconds", n)
    except TooManyPlans as exc:
        return run_optuna(StrategyChoice("optuna", f"more than {exc.max_legal:,} legal plans (stopped counting at "
                                         f"{exc.legal:,})", exc.legal))
    except NothingFits as exc:
        advice = nothing_fits_advice(problem, params, memory_limit_gb)
        if as_json:
            print_json({"error": str(exc), "closest": exc.closest, "space": exc.space, "advice": advice})
        error_line(f"{exc}; {advice['sentence']}")
        return EXIT_NOTHING_FITS
    except NoLegalPlan as exc:
        raise NoLegalPlan(exc.field, f"{str(exc).split(': ', 1)[1]}; {no_legal_plan_advice(problem)['sentence']}") from None
    report = search_report(result, params_source)
    report["strategy_choice"] = {"requested": strategy, **choice.as_dict()}
    capacity_cmds.annotate_headroom(report, room)
    if with_sensitivity:
        from autotune.sensitivity import add_sensitivity
        with spinner("Differentiating the best plan...", enabled=not as_json):
            add_sensitivity(report, problem, params, memory_limit_gb)
    export_cmds.finish_report(report, problem, export_to)
    if verification is not None:
        report["verification"] = verification(problem, report, params)
    saved, save_error = None, None
    if not no_save:
        try:
            saved = save_report(report, out)
        except SpecError as exc:                   # the folder went away mid-search: print anyway
            save_error = str(exc)
    if as_json:
        print_json(report)
    else:
        _print_search(report, problem, strategy, choice, saved)
    if save_error:
        error_line(save_error)
        return EXIT_BAD_INPUT
    return export_cmds.export_exit(report)


def _print_search(report: dict, problem, strategy: str, choice, saved) -> None:
    con = stdout_console()
    print_plans(con, report["top"])
    con.print()
    con.print(Text(report["explanation"]))
    con.print()
    capacity_cmds.print_ties(con, report)
    if report.get("sensitivity"):
        con.print(Text("What would help the best plan (elasticities through the cost model):"))
        for sentence in report["sensitivity"]["sentences"][:5]:
            con.print(Text(f"  - {sentence}"))
        con.print()
    else:
        con.print(Text("What limits the best plan and what would help: add --sensitivity (or run "
                       "`autotune explain` with the plan's --plan)."))
    con.print(Text(_space_line(report["space"], report["elapsed_s"])))
    if report.get("verification"):
        verify_cmds.print_verification(con, report["verification"])
    if strategy != "exhaustive":
        con.print(Text(f"Strategy: exhaustive ({choice.reason})."))
    con.print(Text(f"Report saved to {', '.join(saved)}" if saved else "Report not saved."))
    export_cmds.print_plan_lines(con, report)
    for note in problem_notes(problem):
        con.print(Text(note))


@app.command()
def predict(
    model: ModelOpt,
    plan: Annotated[str, typer.Option("--plan", help='Knobs, e.g. "tp=8,pp=16,vpp=1,mbs=1,recompute=full,sp=false,zero=0".')],
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = "bf16",
    gpus_per_node: GpusPerNodeOpt = None,
    intra_node_bw: IntraBwOpt = None,
    inter_node_bw: InterBwOpt = None,
    cluster: ClusterOpt = None,
    memory_limit_gb: MemLimitOpt = None,
    as_json: JsonOpt = False,
    calibration: CalibrationOpt = None,
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
    """Score one plan and print its time and memory breakdown."""
    from autotune.problem import plan_from_text

    check_problem_options(memory_limit_gb=memory_limit_gb, intra_node_bw=intra_node_bw, inter_node_bw=inter_node_bw)
    problem = _problem(model, gpu, gpus, global_batch, seq_len, precision, gpus_per_node, intra_node_bw,
                       inter_node_bw, cluster, framework_options_of(locals()))
    the_plan = plan_from_text(plan, problem)
    from autotune import api                          # JAX: only once the problem and the plan are checked
    from autotune.report import plan_text, problem_dict
    params, params_source = api.load_params(calibration, problem.cluster.gpu.name)
    rep = api.predict_plan(problem, the_plan, memory_limit_gb=memory_limit_gb, params=params)
    at_limit = capacity_cmds.flag_at_limit(rep)
    code = EXIT_OK if rep["fits"] else EXIT_NOTHING_FITS
    if as_json:
        print_json({**rep, "problem": problem_dict(problem), "calibration": params_source,
                    "problem_text": export_cmds.problem_text(problem), "plan_text": plan_text(rep["plan"])})
    else:
        mem = rep["memory_gb"]
        con = stdout_console()
        con.print(Text(f"Problem: {export_cmds.problem_text(problem)}."))
        for line in problem_notes(problem):
            con.print(Text(line))
        con.print(Text(f"Plan: --plan \"{plan_text(rep['plan'])}\""))
        con.print(Text(f"Plan {plan_text(rep['plan'])}: {rep['step_time_s']:.3f} s per step, "
                       f"{thousands(rep['tokens_per_s_per_gpu'])} tokens/s per GPU, "
                       f"{rep['model_tflops_per_gpu']:,.0f} model TFLOP/s per GPU, MFU {rep['mfu']:.1%}, "
                       f"HFU {rep['hfu']:.1%}; {mem['total']:.1f} of {mem['limit']:.1f} GB per GPU "
                       f"({'fits' if rep['fits'] else 'does NOT fit'})."))
        print_table(con, _time_table(rep))
        print_table(con, _memory_table(rep))
        if at_limit:
            con.print(Text(at_limit))
    if not rep["fits"]:
        error_line(over_limit_line(rep))
    return code


@app.command()
def validate(
    file: Annotated[Optional[str], typer.Argument(metavar="FILE", help="Runs file (schema: shared/validation/README.md).")] = None,
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="A bundled dataset instead of FILE: public, small-scale, korthikanti22 (K22 Table 5), vtrain-multi (vTrain multi-node) or bridge-dense (Megatron-Bridge's dense Llama-3 runs); the last three are held out of every fit.")] = None,
    as_json: JsonOpt = False,
    all_rows: Annotated[bool, typer.Option("--all", help="Also predict rows marked usable=false.")] = False,
    calibration: CalibrationOpt = None,
) -> int:
    """Predict published, measured runs and report the error per run and the MAPE."""
    from autotune import api
    from autotune.validate import on_tflops, repeats_warning
    with spinner("Predicting runs...", enabled=not as_json):
        summary = api.validate(file, dataset=dataset, calibration=calibration, only_usable=not all_rows)
    if as_json:
        print_json(summary)
        return _none_scored(summary)
    con = stdout_console()
    table = Table(title=f"Predicted vs measured tokens/s per GPU: {summary['source']}", title_justify="left")
    for col in ("id", "measured tok/s/GPU", "predicted", "error %", "fits", "filled knobs", "skipped reason"):
        table.add_column(col, justify="right" if col in ("measured tok/s/GPU", "predicted", "error %") else "left",
                         overflow="fold")
    for r in summary["runs"]:
        meas, pred, fits = (r.get("measured_tokens_per_s_per_gpu"), r.get("predicted_tokens_per_s_per_gpu"),
                            r.get("predicted_fits"))
        # a run compared on its source's model TFLOP/s: its tokens/s derived from that figure, marked
        mark = " *" if on_tflops(r) and meas is not None else ""
        table.add_row(str(r.get("id")), "-" if meas is None else f"{meas:,.0f}{mark}",
                      "-" if pred is None else f"{pred:,.0f}",
                      "-" if r.get("error_pct") is None else f"{r['error_pct']:+.1f}",
                      "-" if fits is None else ("yes" if fits else "NO"),
                      ",".join(r.get("filled") or []) or "-", r.get("skipped") or "")
    print_table(con, table)
    con.print(Text(f"MAPE {_pct(summary['mape_pct'])} overall, {_pct(summary.get('mape_dense_pct'))} dense "
                   f"({summary.get('n_scored_dense', 0)} runs), {_pct(summary.get('mape_moe_pct'))} MoE "
                   f"({summary.get('n_scored_moe', 0)} runs); max abs error {_pct(summary['max_abs_error_pct'])}; "
                   f"{summary['n_scored']} scored, {summary['n_skipped']} skipped, "
                   f"{summary.get('n_predicted_oom', 0)} predicted not to fit, "
                   f"{summary.get('n_not_in_space', 0)} not in the legal space."))
    tf = summary.get("tflops") or {}
    if tf.get("n"):
        con.print(Text(f"* {tf['n']} run{'s' if tf['n'] > 1 else ''} give only a model TFLOP/s figure: their tokens/s "
                       f"is that figure over the FLOPs per token their source counts (attention causal or full, as "
                       f"listed in the JSON's compared_on), a convention in between, so they are summed up apart: "
                       f"MAPE {_pct(tf['mape_pct'])}, max abs error {_pct(tf['max_abs_error_pct'])}."))
    for r in summary.get("not_in_space", []):
        rules = "; ".join(f"{b['rule']}: {b['reason']}" for b in r["rules"])
        con.print(Text(f"  not in the legal space: {r['id']}: {rules}"))
    repeats = repeats_warning(summary.get("repeats") or {})
    if repeats:
        con.print(Text(f"Repeated cases: {repeats} above (no prediction can score lower)."))
    if summary.get("calibration_gpu"):
        con.print(Text(f"Calibration {summary['calibration']} (fitted for {summary['calibration_gpu']}) applied to "
                       f"that GPU's runs only; the others are skipped."))
    return _none_scored(summary)


def _none_scored(summary: dict) -> int:
    """A validation that scored no run measured nothing: say so and exit 2, so that a CI gate on it fails."""
    if summary["n_scored"] or (summary.get("tflops") or {}).get("n"):
        return EXIT_OK
    error_line(f"FILE: none of the {summary['n_skipped']} runs of {summary['source']} could be scored "
               "(each one's reason is in the skipped column / field)")
    return EXIT_BAD_INPUT


# issue 5: explain / calibrate / whatif
from cli.analysis_cmds import register as _register_analysis  # noqa: E402

_register_analysis(app)
# issue 4: worker / studies (search --strategy optuna|auto goes through optuna_cmds.run_optuna_search)
optuna_cmds.register(app)
# issue 13/14: export / check / launch (search --export goes through export_cmds.finish_report)
export_cmds.register(app)
verify_cmds.register(app)   # issue 14: verify (search --verify-top: cli/verify_cmds.py)
from cli import list_cmds  # noqa: E402  (issue 13: models / gpus / clusters)

list_cmds.register(app)
capacity_cmds.register(app)   # issue 13: capacity planning


if __name__ == "__main__":
    app()
