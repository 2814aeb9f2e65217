"""`autotune export`, `autotune check` and `autotune launch` (issues 13 and 14): thin shells over
autotune.export, autotune.check and autotune.launch.

Exit codes: 0 done / every condition holds; 1 a check condition fails (one line each, with the
numbers); 2 bad input or a plan the target cannot express (one `error:` line). Export and launch do
not judge memory (a short real run is how a doubtful prediction is checked); `check` does.
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Annotated, Optional

import typer
from rich.text import Text

from cli.common import print_json as _print_json, stdout_console as _console
from cli.options import (AttentionBackendOpt, CalibrationOpt, ClusterOpt, CudaGraphImplOpt, CudaGraphModulesOpt,
                         DispatcherOpt, EpOverlapOpt, OverlapGradReduceOpt, OverlapParamGatherOpt, GradAccFusionOpt,
                         MoePermuteFusionOpt, CrossEntropyFusionOpt, CrossEntropyImplOpt, Fp8ParamGatherOpt,
                         Fp8AttentionOpt, LoraDimOpt, LoraModulesOpt, PackedExampleTokensOpt, Fp8RecipeOpt,
                         MtpNumLayersOpt, CpuOffloadingOpt,
                         FrameworkOpt, GlobalBatchOpt, GpuOpt, GpusOpt, GpusPerNodeOpt, GradReduceBf16Opt, InterBwOpt,
                         IntraBwOpt, JsonOpt, MemLimitOpt, PrecisionOpt, SeqLenOpt, TpCommOverlapOpt,
                         framework_options_of)
from costmodels.specs import SpecError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

# Spelled here so that building the CLI (`autotune --help`, any bad-input error) imports neither
# numpy nor JAX; tests/test_fuzz_cli.py checks they equal autotune.export.TARGETS,
# autotune.launch.LAUNCHERS and autotune.check.DEFAULT_MAX_MEMORY_FRAC.
TARGETS = ("megatron", "bridge", "torchtitan", "maxtext", "deepspeed", "megatron-deepspeed")
LAUNCHERS = ("torchrun", "slurm")
DEFAULT_MAX_MEMORY_FRAC = 0.95


def parse_target(text: str) -> str:
    from autotune.export import parse_target as parse
    return parse(text)

ExportOpt = Annotated[Optional[str], typer.Option("--export", help=f"Also write the best plan for: {', '.join(TARGETS)}.")]
ToOpt = Annotated[str, typer.Option("--to", help=f"Target: {', '.join(TARGETS)}.")]
ReportOpt = Annotated[Optional[str], typer.Option("--report", help="A saved search report (JSON) to export from.")]
PlanOpt = Annotated[Optional[str], typer.Option("--plan", help='A plan, e.g. "tp=8,pp=4,vpp=5,recompute=selective,sp=true,zero=1".')]
ModelOpt = Annotated[Optional[str], typer.Option("--model", help="Model preset or config.json (with --plan).")]


def _problem_and_plans(report, plan, model, gpu, gpus, global_batch, seq_len, precision, gpus_per_node,
                       intra_node_bw, inter_node_bw, cluster, framework, top=1):
    """(problem, plans, source): a saved report's problem and its top plans, or --plan + problem options."""
    from autotune import api
    from autotune.saved import problem_from_report, read_report, report_plans
    if bool(report) == bool(plan):
        raise SpecError("plan", "give either --report FILE or --plan TEXT (with --model and the GPUs)")
    if report:
        given = [n for n, v in (("--model", model), ("--gpu", gpu), ("--gpus", gpus), ("--global-batch", global_batch),
                                ("--seq-len", seq_len), ("--gpus-per-node", gpus_per_node),
                                ("--intra-node-bw", intra_node_bw), ("--inter-node-bw", inter_node_bw),
                                ("--cluster", cluster)) if v is not None]
        given += [f"--{k.replace('_', '-')}" for k, v in (framework or {}).items() if v is not None]
        if given:
            raise SpecError("report", f"the report carries its own problem; leave out {', '.join(given)} "
                            "(or export a --plan for another problem)")
        doc = read_report(report)
        return problem_from_report(doc, report), report_plans(doc, top, report), report
    if not model:
        raise SpecError("model", "--model is required with --plan")
    problem = api.build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                                precision=precision, gpus_per_node=gpus_per_node, intra_node_bw=intra_node_bw,
                                inter_node_bw=inter_node_bw, cluster_file=cluster, framework=framework)
    return problem, [api.plan_from_text(plan, problem)], "--plan"


def problem_text(problem) -> str:
    """The problem solved, in one line: model and parameter count, GPUs and nodes, NVLink domain,
    global batch x sequence, precision, CPU-offloaded layers."""
    from autotune.launch import nodes_of

    counts = problem.model.param_counts()
    active = (f", {counts['active'] / 1e9:.1f} B active" if problem.model.is_moe else "")
    n_mtp = problem.model.mtp_num_layers
    if n_mtp:
        active += f", {n_mtp} MTP module{'s' if n_mtp > 1 else ''} of {counts['mtp'] / 1e9:.1f} B more"
    nodes, per_node = nodes_of(problem.cluster)
    n_off = problem.job.framework.cpu_offloading_num_layers
    offload = f", activations of {n_off} layers offloaded to host memory" if n_off else ""
    return (f"{problem.model.name} ({counts['total'] / 1e9:.1f} B parameters{active}) on {problem.cluster.num_gpus} x "
            f"{problem.cluster.gpu.name} ({nodes} nodes of {per_node}, NVLink domain {problem.cluster.nvlink_domain_size} "
            f"GPUs), global batch {problem.job.global_batch} x {problem.job.seq_len} tokens, "
            f"{problem.job.precision.value}{offload}")


def finish_report(report: dict, problem, export_to: str | None = None) -> dict:
    """Add the problem line, the best plan as a --plan string and (with `export_to`) its export to a
    search report: keys `problem_text`, `plan_text`, `export` ({to, plan, text})."""
    from autotune.export import ExportRefused, export
    from autotune.report import plan_text
    from costmodels.plan import Plan

    report["problem_text"] = problem_text(problem)
    report["plan_text"] = plan_text(report["best"]["plan"])
    if export_to:
        try:
            e = export(export_to, Plan.from_dict(report["best"]["plan"]), problem)
            report["export"] = {"to": e.target, "plan": report["plan_text"], "text": e.text}
            if e.companions:        # the files the text names (Megatron-DeepSpeed's DeepSpeed config)
                report["export"]["companions"] = [{"file": f, "text": t} for f, t in e.companions]
        except ExportRefused as exc:
            report["export"] = {"to": export_to, "plan": report["plan_text"], "refused": str(exc)}
    return report


def export_exit(report: dict) -> int:
    """0, or 2 with the one-line refusal on stderr when `search --export` could not express the best plan."""
    refused = (report.get("export") or {}).get("refused")
    if refused:
        sys.stderr.write(f"error: {refused}\n")
        return EXIT_BAD_INPUT
    return EXIT_OK


def print_plan_lines(con, report: dict) -> None:
    """`search` / `predict` in table mode: the problem, the plan to paste, the export if asked."""
    con.print(Text(f"Problem: {report['problem_text']}."))
    con.print(Text(f"Plan: --plan \"{report['plan_text']}\""))
    if report.get("export", {}).get("text"):
        con.print(Text(f"As {report['export']['to']} (autotune export --to {report['export']['to']}):"))
        con.print(Text(report["export"]["text"].rstrip("\n")))
        for comp in report["export"].get("companions", []):
            con.print(Text(f"and {comp['file']}, which it names:"))
            con.print(Text(comp["text"].rstrip("\n")))


def export_cmd(
    to: ToOpt,
    report: ReportOpt = None,
    plan: PlanOpt = None,
    top: Annotated[int, typer.Option("--top", min=1, help="With --report: export the best N plans.")] = 1,
    out: Annotated[Optional[str], typer.Option("--out", help="Folder to write one file per plan (else stdout).")] = None,
    model: ModelOpt = None,
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = "bf16",
    gpus_per_node: GpusPerNodeOpt = None,
    intra_node_bw: IntraBwOpt = None,
    inter_node_bw: InterBwOpt = None,
    cluster: ClusterOpt = None,
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
    as_json: JsonOpt = False,
) -> int:
    """Write a plan as Megatron-LM arguments, Megatron-Bridge overrides, torchtitan TOML, MaxText YAML, DeepSpeed JSON or
    Megatron-DeepSpeed arguments (with --out, and its DeepSpeed config beside them)."""
    from autotune.export import export
    target = parse_target(to)
    problem, plans, _ = _problem_and_plans(
        report, plan, model, gpu, gpus, global_batch, seq_len, precision, gpus_per_node, intra_node_bw, inter_node_bw,
        cluster, framework_options_of(locals()), top)
    stems = [f"{problem.model.name}_{problem.cluster.num_gpus}gpu_plan{i}_{target}" for i in range(1, len(plans) + 1)]
    # any refusal stops before writing; with --out each companion file (Megatron-DeepSpeed's DeepSpeed config) is
    # named after its plan's file
    exported = [export(target, p, problem, name=stem if out else None) for p, stem in zip(plans, stems)]
    paths = []
    if out:
        try:
            os.makedirs(out, exist_ok=True)
            for stem, e in zip(stems, exported):
                path = os.path.join(out, f"{stem}{e.suffix}")
                with open(path, "w") as fh:
                    fh.write(e.text)
                for fname, text in e.companions:
                    with open(os.path.join(out, fname), "w") as fh:
                        fh.write(text)
                paths.append(path)
        except OSError as exc:
            raise SpecError("out", f"cannot write to {out}: {exc.strerror or exc}") from None
    if as_json:
        _print_json({"to": target, "exports": [{"plan": str(p), "text": e.text, "options": list(e.options),
                                                "path": paths[i] if paths else None,
                                                "companions": [{"file": f, "text": t} for f, t in e.companions]}
                                               for i, (p, e) in enumerate(zip(plans, exported))]})
        return EXIT_OK
    for i, (p, e) in enumerate(zip(plans, exported)):
        if paths:
            also = "".join(f", {os.path.join(out, f)}" for f, _ in e.companions)
            sys.stdout.write(f"plan {i + 1} ({p}): {paths[i]}{also}\n")
        else:
            if len(plans) > 1:
                sys.stdout.write(f"# plan {i + 1}: {p}\n")
            sys.stdout.write(e.text)
    return EXIT_OK


def check_cmd(
    plan_or_report: Annotated[str, typer.Argument(metavar="PLAN_OR_REPORT", help="A --plan text or a saved report (JSON).")],
    model: ModelOpt = None,
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = "bf16",
    gpus_per_node: GpusPerNodeOpt = None,
    cluster: ClusterOpt = None,
    max_memory_frac: Annotated[float, typer.Option("--max-memory-frac", help="Largest share of the GPU memory the plan may use.")] = DEFAULT_MAX_MEMORY_FRAC,
    min_mfu: Annotated[Optional[float], typer.Option("--min-mfu", help="Smallest model FLOP utilisation (0-1).")] = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="A saved report or check --json output to compare throughput with.")] = None,
    max_regression: Annotated[Optional[str], typer.Option("--max-regression", help="Largest throughput loss vs --baseline: 3% or 0.03 (default 3%).")] = None,
    memory_limit_gb: MemLimitOpt = None,
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
    as_json: JsonOpt = False,
) -> int:
    """CI gate: exit 0 when the plan fits under --max-memory-frac (and --min-mfu, --baseline hold), 1 when one fails."""
    from autotune import api
    from autotune.check import DEFAULT_MAX_REGRESSION, check_plan, parse_fraction
    from autotune.files import read_json
    from autotune.saved import read_report, report_plans
    if max_regression is not None and not baseline:     # else the gate the user asked for silently never runs
        raise SpecError("max-regression", "compares with a baseline: give --baseline FILE (a saved report or "
                        "check --json output)")
    regression = parse_fraction(max_regression or DEFAULT_MAX_REGRESSION, "max-regression")
    is_file = plan_or_report.endswith(".json") or os.path.isfile(plan_or_report)
    fw = framework_options_of(locals())
    if is_file and not model:
        given = [n for n, v in (("--gpu", gpu), ("--gpus", gpus), ("--global-batch", global_batch), ("--seq-len", seq_len),
                                ("--gpus-per-node", gpus_per_node), ("--cluster", cluster)) if v is not None]
        given += [f"--{k.replace('_', '-')}" for k, v in fw.items() if v is not None]
        if given:
            raise SpecError("model", f"{', '.join(given)} describe another problem: give --model too, or leave them "
                            "out to check the report on its own problem")
        problem, plans, _ = _problem_and_plans(plan_or_report, None, None, None, None, None, None, precision, None,
                                               None, None, None, None)
    else:
        if not model:
            raise SpecError("model", "--model is required when PLAN_OR_REPORT is a plan")
        problem = api.build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                                    precision=precision, gpus_per_node=gpus_per_node, cluster_file=cluster, framework=fw)
        text = plan_or_report
        if is_file:         # a saved plan checked against this problem: its knobs, dp from --gpus
            text = re.sub(r"(^|,)dp=\d+", "", str(report_plans(read_report(text), 1, text)[0])).lstrip(",")
        plans = [api.plan_from_text(text, problem)]
    base = read_json(baseline, "baseline") if baseline else None
    params, _ = api.load_params(calibration, problem.cluster.gpu.name)
    result = check_plan(problem, plans[0], max_memory_frac=max_memory_frac, min_mfu=min_mfu, baseline=base,
                        max_regression=regression, params=params, memory_limit_gb=memory_limit_gb,
                        baseline_source=baseline or "baseline")
    if as_json:
        _print_json(result.as_dict())
    else:
        con = _console()
        con.print(Text(f"{problem.model.name} on {problem.cluster.num_gpus} x {problem.cluster.gpu.name}, plan "
                       f"{result.plan}: {'all conditions hold' if result.ok else f'{len(result.failed)} condition(s) fail'}"))
        for c in result.conditions:
            con.print(Text(f"  {'ok  ' if c.ok else 'FAIL'} {c.message}"))
    for c in result.failed:
        sys.stderr.write(f"check failed: {c.message}\n")
    return EXIT_OK if result.ok else EXIT_FAILED


def launch_cmd(
    plan: Annotated[str, typer.Option("--plan", help="The plan to run.")],
    model: Annotated[str, typer.Option("--model", help="Model preset or config.json.")],
    megatron_path: Annotated[str, typer.Option("--megatron-path", help="A Megatron-LM checkout (holds pretrain_gpt.py).")],
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = "bf16",
    gpus_per_node: GpusPerNodeOpt = None,
    cluster: ClusterOpt = None,
    launcher: Annotated[str, typer.Option("--launcher", help=f"{' or '.join(LAUNCHERS)} (an sbatch script).")] = "torchrun",
    train_iters: Annotated[int, typer.Option("--train-iters", help="Iterations to run (the first is warm-up).")] = 10,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the commands, run nothing.")] = False,
    log: Annotated[Optional[str], typer.Option("--log", help="Where the run's log goes.")] = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Write the measurement record (JSON list) here.")] = None,
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
    as_json: JsonOpt = False,
) -> int:
    """Run a plan with Megatron-LM for a few iterations (torchrun or SLURM) and record the measurement."""
    from autotune import api
    from autotune.launch import megatron_launch
    fw = framework_options_of(locals())
    problem = api.build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                                precision=precision, gpus_per_node=gpus_per_node, cluster_file=cluster, framework=fw)
    the_plan = api.plan_from_text(plan, problem)
    res = megatron_launch(the_plan, problem, megatron_path, launcher=launcher, train_iters=train_iters,
                          dry_run=dry_run, log_path=log)
    if out and res["measurement"] is not None:
        try:
            with open(out, "w") as fh:
                json.dump([res["measurement"]], fh, indent=2)
        except OSError as exc:
            raise SpecError("out", f"cannot write {out}: {exc.strerror or exc}") from None
    if as_json:
        _print_json(res)
        return EXIT_OK
    job = res["job"]
    if launcher == "slurm":
        sys.stdout.write(job["sbatch"])
    else:
        sys.stdout.write(job["torchrun_text"] + "\n")
    m = res["measurement"]
    if m is not None:
        meas = m["measured"]
        sys.stdout.write(f"measured: {meas['iteration_time_s']:.3f} s per iteration, "
                         f"{meas['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, peak allocated "
                         f"{meas['memory_gb'] or 0:.1f} GB{f'; record written to {out}' if out else ''}\n")
    return EXIT_OK


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
    app.command("check")(check_cmd)
    app.command("launch")(launch_cmd)
