"""`autotune explain`, `autotune calibrate` and `autotune whatif` (issue 5): thin shells over
`autotune.sensitivity` and `autotune.measurements`. `register(app)` adds them to the root app.

Errors follow the root group's contract: a SpecError becomes one `error:` line and exit code 2.
"""
from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from cli.common import (EXIT_NOTHING_FITS, EXIT_OK, check_distinct, check_problem_options, error_line, print_json,
                        print_table, stdout_console, thousands)
from cli.options import (ModelOpt, GpuOpt, GpusOpt, GlobalBatchOpt, SeqLenOpt, PrecisionOpt, GpusPerNodeOpt,  # noqa: E402
                         IntraBwOpt, InterBwOpt, ClusterOpt, MemLimitOpt, CalibrationOpt, JsonOpt,
                         FrameworkOpt, AttentionBackendOpt, TpCommOverlapOpt, GradReduceBf16Opt, Fp8ParamGatherOpt,
                         DispatcherOpt, EpOverlapOpt, OverlapGradReduceOpt, OverlapParamGatherOpt, GradAccFusionOpt,
                         MoePermuteFusionOpt, CrossEntropyFusionOpt, CrossEntropyImplOpt, CudaGraphImplOpt,
                         Fp8AttentionOpt, LoraDimOpt, LoraModulesOpt, PackedExampleTokensOpt, Fp8RecipeOpt,
                         MtpNumLayersOpt, CpuOffloadingOpt,
                         CudaGraphModulesOpt, framework_options_of)
from cli.notes import problem_notes
from costmodels.specs import SpecError


def _change(value) -> str:
    """A knob value in a sentence: booleans as on/off, like the plan tables."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


# ------------------------------------------------------------------------------------------------
# explain
# ------------------------------------------------------------------------------------------------

def explain(
    model: ModelOpt,
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = "bf16",
    plan: Annotated[Optional[str], typer.Option("--plan", help="Plan to explain (default: the best plan of an exhaustive search).")] = None,
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
    """What limits a plan and what would help: elasticities of step time, tokens/s and memory.
    Exit code 3 when the plan (or, without --plan, every legal plan) does not fit."""
    from autotune import api
    from autotune.report import plan_text, problem_dict
    from autotune.search import exhaustive
    from autotune.sensitivity import sensitivity
    from costmodels.plan import Plan

    check_problem_options(memory_limit_gb=memory_limit_gb, intra_node_bw=intra_node_bw, inter_node_bw=inter_node_bw)
    problem = api.build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                                precision=precision, gpus_per_node=gpus_per_node, intra_node_bw=intra_node_bw,
                                inter_node_bw=inter_node_bw, cluster_file=cluster,
                                framework=framework_options_of(locals()))
    params, _ = api.load_params(calibration, problem.cluster.gpu.name)
    if plan:
        the_plan = api.plan_from_text(plan, problem)
    else:                                            # NothingFits -> exit 3 at the error boundary
        the_plan = Plan.from_dict(exhaustive(problem, params, top_k=1, memory_limit_gb=memory_limit_gb).best["plan"])
    fits = api.predict_plan(problem, the_plan, memory_limit_gb=memory_limit_gb, params=params)
    res = sensitivity(problem, the_plan, params, memory_limit_gb=memory_limit_gb)
    code = EXIT_OK if fits["fits"] else EXIT_NOTHING_FITS
    if as_json:
        print_json({**res, "fits": fits["fits"], "memory_gb": fits["memory_gb"], "problem": problem_dict(problem)})
    else:
        con = stdout_console()
        con.print(Text(f"{problem.model.name} on {problem.cluster.num_gpus:,} x {problem.cluster.gpu.name}, "
                       f"plan {plan_text(res['plan'])}: {res['step_time_s']:.3f} s per step, "
                       f"{res['peak_memory_gb']:.1f} GB per GPU ({'fits' if fits['fits'] else 'does NOT fit'})."))
        for note in problem_notes(problem):
            con.print(Text(note))
        con.print(Text("What would change the step time (elasticities by jax.jacfwd through the cost model):"))
        for s in res["sentences"]:
            con.print(Text(f"  - {s}"))
        if res.get("neighbours"):
            t = Table(title="Neighbouring plans (one knob moved)", title_justify="left")
            for col in ("knob", "change", "step time s", "vs this plan", "memory GB", "fits"):
                t.add_column(col, justify="right" if col in ("step time s", "vs this plan", "memory GB") else "left")
            for r in res["neighbours"][:8]:
                t.add_row(r["knob"], f"{_change(r['from'])} -> {_change(r['to'])}", f"{r['step_time_s']:.3f}",
                          f"{r['step_time_change_pct']:+.1f}%", f"{r['memory_gb']:.1f}", "yes" if r["fits"] else "NO")
            print_table(con, t)
    if code == EXIT_NOTHING_FITS:
        mem = fits["memory_gb"]
        error_line(f"memory: the plan needs {mem['total']:.1f} GB per GPU, {mem['total'] - mem['limit']:.1f} GB "
                   f"over the {mem['limit']:.1f} GB limit")
    return code


# ------------------------------------------------------------------------------------------------
# calibrate
# ------------------------------------------------------------------------------------------------

def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}%"


def _num(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def calibrate_cmd(
    measurements: Annotated[Optional[str], typer.Argument(metavar="MEASUREMENTS", help="Runs file (schema: shared/validation/README.md).")] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="Fit on the runs of this GPU preset only.")] = None,
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Where to write the calibration JSON.")] = None,
    holdout_frac: Annotated[float, typer.Option("--holdout-frac", min=0.0, max=0.9, help="Share of runs held out to measure the error on unseen runs.")] = 0.2,
    seed: Annotated[int, typer.Option("--seed", min=0, max=2 ** 32 - 1, help="Seed of the train/held-out split.")] = 0,
    rounds: Annotated[int, typer.Option("--rounds", min=1, max=100, help="Plan re-selection rounds.")] = 2,
    steps: Annotated[int, typer.Option("--steps", min=1, max=100_000, help="Adam steps per round.")] = 400,
    megatron_log: Annotated[Optional[str], typer.Option("--megatron-log", help="A Megatron-LM training log to fit instead of a runs file.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="With --megatron-log: the model trained.")] = None,
    gpus: GpusOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = "bf16",
    gpus_per_node: GpusPerNodeOpt = None,
    plan: Annotated[Optional[str], typer.Option("--plan", help="With --megatron-log: the plan that ran (default: read from the log's arguments).")] = None,
    as_json: JsonOpt = False,
) -> int:
    """Fit the efficiency parameters to measured runs (runs file or Megatron-LM log) of one GPU."""
    from autotune.files import refuse_overwriting_inputs
    from autotune.measurements import calibrate_megatron_log, calibrate_runs, write_calibration
    from autotune.validate import load_runs

    if not gpu:
        raise SpecError("gpu", "--gpu is required (a calibration is fitted for one GPU)")
    if not out:
        raise SpecError("out", "-o/--out is required (where to write the calibration)")
    if bool(measurements) == bool(megatron_log):
        raise SpecError("MEASUREMENTS", "give either a runs file or --megatron-log, not both or neither")
    refuse_overwriting_inputs(out, "out", {"MEASUREMENTS": measurements, "--megatron-log": megatron_log})
    if megatron_log:
        if not model:
            raise SpecError("megatron-log", "--model is required with --megatron-log")
        doc = calibrate_megatron_log(megatron_log, model=model, gpu=gpu, gpus=gpus, global_batch=global_batch,
                                     seq_len=seq_len, precision=precision, gpus_per_node=gpus_per_node, plan=plan,
                                     steps=steps)
    else:
        rows = load_runs(measurements)
        doc = calibrate_runs(rows, gpu, holdout_frac=holdout_frac, seed=seed, rounds=rounds, steps=steps,
                             source=measurements)
    write_calibration(doc, out)
    if as_json:
        print_json(doc)
        return EXIT_OK
    f = doc["fit"]
    con = stdout_console()
    t = Table(title=f"Calibration for {gpu} ({f['source']})", title_justify="left")
    for col in ("split", "runs", "MAPE before", "MAPE after"):
        t.add_column(col, justify="left" if col == "split" else "right")
    t.add_row("train", str(f["n_train"]), _fmt(f["mape_train_before_pct"]), _fmt(f["mape_train_after_pct"]))
    t.add_row("held out", str(f["n_holdout"]), _fmt(f["mape_holdout_before_pct"]), _fmt(f["mape_holdout_after_pct"]))
    print_table(con, t)
    pt = Table(title="Fitted parameters vs their literature priors (LITERATURE_PRIOR, PARAM_BOUNDS)",
               title_justify="left")
    for col in ("parameter", "prior", "bound", "start", "fitted", "x prior", "flag"):
        pt.add_column(col, justify="left" if col in ("parameter", "bound", "flag") else "right", overflow="fold")
    for e in doc.get("parameters", []):
        lo, hi = e["bound"]
        pt.add_row(e["name"], _num(e["prior"]), "-" if lo is None else f"[{lo:.4g}, {hi:.4g}]", _num(e["start"]),
                   _num(e["fitted"]), "-" if e["ratio_to_prior"] is None else f"{e['ratio_to_prior']:.2f}",
                   "; ".join(e["flags"]) or "-")
    print_table(con, pt)
    for w in doc.get("warnings", []) + ([doc["memory_warning"]] if doc.get("memory_warning") else []):
        con.print(Text(f"warning: {w}"))
    if doc["fit"].get("read_from_log"):
        con.print(Text(f"Read from the log: {', '.join(doc['fit']['read_from_log'])}."))
    con.print(Text(f"Calibration written to {out}"))
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# whatif
# ------------------------------------------------------------------------------------------------

def whatif(
    model: ModelOpt,
    gpu: Annotated[list[str], typer.Option("--gpu", help="GPU preset to compare (repeat the option).")],
    gpus: GpusOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = "bf16",
    inter_node_bw: Annotated[Optional[list[float]], typer.Option("--inter-node-bw", help="Inter-node GB/s per GPU per direction to compare (repeat; default: each GPU's preset).")] = None,
    intra_node_bw: IntraBwOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    cluster: ClusterOpt = None,
    memory_limit_gb: MemLimitOpt = None,
    calibration: Annotated[Optional[str], typer.Option("--calibration", help="Efficiency-parameter file, applied to the GPU it was fitted for (the others use the defaults).")] = None,
    as_json: JsonOpt = False,
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
    """Best plan for the same model and job on several GPUs and fabrics, side by side.
    Exit code 3 when no variant has a plan that fits."""
    from autotune import api
    from autotune.report import plan_text
    from autotune.search import NothingFits, exhaustive

    check_problem_options(memory_limit_gb=memory_limit_gb, intra_node_bw=intra_node_bw,
                          inter_node_bw=list(inter_node_bw or []))
    check_distinct("gpu", gpu)
    check_distinct("inter_node_bw_gbps", [float(bw) for bw in inter_node_bw or []])
    calibrated_gpu = None
    if calibration:
        from autotune.measurements import read_calibration
        calibrated_gpu = str(read_calibration(calibration)[1].get("gpu") or "").lower() or None
    fw = framework_options_of(locals())
    rows = []
    for g in gpu:
        for bw in list(inter_node_bw or []) or [None]:
            problem = api.build_problem(model=model, gpu=g, gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                                        precision=precision, gpus_per_node=gpus_per_node, intra_node_bw=intra_node_bw,
                                        inter_node_bw=bw, cluster_file=cluster, framework=fw)
            name = problem.cluster.gpu.name
            use_file = calibration if calibration and calibrated_gpu in (None, name.lower()) else None
            params, source = api.load_params(use_file, name)
            row = {"gpu": name, "inter_node_bw_gbps": problem.cluster.inter_node_bw_bytes_per_s / 1e9,
                   "calibration": source, "best": None, "error": None}
            try:
                row["best"] = exhaustive(problem, params, top_k=1, memory_limit_gb=memory_limit_gb).best
            except (NothingFits, SpecError) as exc:      # SpecError: no legal plan on this variant
                row["error"] = str(exc)
            rows.append(row)
    ref = next((r["best"]["step_time_s"] for r in rows if r["best"]), None)
    for r in rows:
        r["speedup_vs_first"] = ref / r["best"]["step_time_s"] if (r["best"] and ref) else None
    code = EXIT_OK if ref is not None else EXIT_NOTHING_FITS
    if as_json:                 # the job (its framework options too) is the same in every variant
        from autotune.report import problem_dict
        print_json({"variants": rows, "job": problem_dict(problem)["job"]})
    else:
        con = stdout_console()
        t = Table(title=f"What if: {model}, {gpus if gpus else 'cluster'} GPUs", title_justify="left")
        for col in ("GPU", "inter-node GB/s", "best plan", "step s", "tokens/s/GPU", "MFU", "memory GB", "speed-up"):
            t.add_column(col, justify="left" if col in ("GPU", "best plan") else "right", overflow="fold")
        for r in rows:
            b = r["best"]
            if b is None:
                t.add_row(r["gpu"], thousands(r["inter_node_bw_gbps"]), r["error"], "-", "-", "-", "-", "-")
                continue
            t.add_row(r["gpu"], thousands(r["inter_node_bw_gbps"]), plan_text(b["plan"]), f"{b['step_time_s']:.3f}",
                      thousands(b["tokens_per_s_per_gpu"]), f"{b['mfu']:.1%}", f"{b['memory_gb']['total']:.1f}",
                      f"{r['speedup_vs_first']:.2f}x")
        print_table(con, t)
        for note in problem_notes(problem):
            con.print(Text(note))
    if code == EXIT_NOTHING_FITS:
        error_line(f"memory: no variant has a plan that fits ({rows[0]['error']})")
    return code


def register(app: typer.Typer) -> None:
    app.command("explain")(explain)
    app.command("calibrate")(calibrate_cmd)
    app.command("whatif")(whatif)
