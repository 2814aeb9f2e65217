"""`autotune explain`, `autotune calibrate` and `autotune whatif` (issue 5): thin shells over
`autotune.sensitivity` and `autotune.measurements`. `register(app)` adds them to the root app.

Errors follow the root group's contract: a SpecError becomes one `error:` line and exit code 2.
"""
from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from autotune import api
from autotune.measurements import (calibrate_megatron_log, calibrate_runs, calibration_for_gpu,
                                   write_calibration)
from autotune.report import plan_text, problem_dict
from autotune.search import NoLegalPlan, NothingFits, exhaustive
from autotune.sensitivity import sensitivity
from autotune.validate import load_runs
from costmodels.specs import SpecError

EXIT_OK, EXIT_NOTHING_FITS = 0, 3

from cli.options import ModelOpt, GpuOpt, GpusOpt, GlobalBatchOpt, SeqLenOpt, PrecisionOpt, GpusPerNodeOpt, MemLimitOpt, CalibrationOpt, JsonOpt  # noqa: E402



def _console() -> Console:
    con = Console(highlight=False)
    if not con.is_terminal:
        con = Console(highlight=False, width=max(con.width, 200))
    return con


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    sys.stdout.flush()


def _check_limit(memory_limit_gb: Optional[float]) -> None:
    if memory_limit_gb is not None and not memory_limit_gb > 0:
        raise SpecError("memory_limit_gb", f"must be a positive number of GB, got {memory_limit_gb!r}")


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
    intra_node_bw: Annotated[Optional[float], typer.Option("--intra-node-bw", help="Intra-node GB/s per GPU per direction.")] = None,
    inter_node_bw: Annotated[Optional[float], typer.Option("--inter-node-bw", help="Inter-node GB/s per GPU per direction.")] = None,
    memory_limit_gb: MemLimitOpt = None,
    as_json: JsonOpt = False,
    calibration: CalibrationOpt = None,
) -> int:
    """What limits a plan and what would help: elasticities of step time, tokens/s and memory."""
    _check_limit(memory_limit_gb)
    problem = api.build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                                precision=precision, gpus_per_node=gpus_per_node, intra_node_bw=intra_node_bw,
                                inter_node_bw=inter_node_bw)
    params, _ = calibration_for_gpu(calibration, problem.cluster.gpu.name)
    if plan:
        the_plan = api.plan_from_text(plan, problem)
    else:
        try:
            best = exhaustive(problem, params, top_k=1, memory_limit_gb=memory_limit_gb).best
        except NothingFits as exc:
            raise SpecError("memory", str(exc)) from None
        the_plan = api.plan_from_text(",".join(f"{k}={v}" for k, v in best["plan"].items()), problem)
    res = sensitivity(problem, the_plan, params, memory_limit_gb=memory_limit_gb)
    if as_json:
        _print_json({**res, "problem": problem_dict(problem)})
        return EXIT_OK
    con = _console()
    con.print(Text(f"{problem.model.name} on {problem.cluster.num_gpus} x {problem.cluster.gpu.name}, "
                   f"plan {plan_text(res['plan'])}: {res['step_time_s']:.3f} s per step, "
                   f"{res['peak_memory_gb']:.1f} GB per GPU."))
    con.print(Text("What would change the step time (elasticities by jax.jacfwd through the cost model):"))
    for s in res["sentences"]:
        con.print(Text(f"  - {s}"))
    if res.get("neighbours"):
        t = Table(title="Neighbouring plans (one knob moved)", title_justify="left")
        for col in ("knob", "change", "step time s", "vs this plan", "memory GB", "fits"):
            t.add_column(col, justify="right" if col in ("step time s", "vs this plan", "memory GB") else "left")
        for r in res["neighbours"][:8]:
            t.add_row(r["knob"], f"{r['from']} -> {r['to']}", f"{r['step_time_s']:.3f}",
                      f"{r['step_time_change_pct']:+.1f}%", f"{r['memory_gb']:.1f}", "yes" if r["fits"] else "NO")
        con.print(t)
    return EXIT_OK


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
    holdout_frac: Annotated[float, typer.Option("--holdout-frac", help="Share of runs held out to measure the error on unseen runs.")] = 0.2,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the train/held-out split.")] = 0,
    rounds: Annotated[int, typer.Option("--rounds", help="Plan re-selection rounds.")] = 2,
    steps: Annotated[int, typer.Option("--steps", help="Adam steps per round.")] = 400,
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
    if not gpu:
        raise SpecError("gpu", "--gpu is required (a calibration is fitted for one GPU)")
    if not out:
        raise SpecError("out", "-o/--out is required (where to write the calibration)")
    if bool(measurements) == bool(megatron_log):
        raise SpecError("MEASUREMENTS", "give either a runs file or --megatron-log, not both or neither")
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
        _print_json(doc)
        return EXIT_OK
    f = doc["fit"]
    con = _console()
    t = Table(title=f"Calibration for {gpu} ({f['source']})", title_justify="left")
    for col in ("split", "runs", "MAPE before", "MAPE after"):
        t.add_column(col, justify="left" if col == "split" else "right")
    t.add_row("train", str(f["n_train"]), _fmt(f["mape_train_before_pct"]), _fmt(f["mape_train_after_pct"]))
    t.add_row("held out", str(f["n_holdout"]), _fmt(f["mape_holdout_before_pct"]), _fmt(f["mape_holdout_after_pct"]))
    con.print(t)
    pt = Table(title="Fitted parameters vs their literature priors (LITERATURE_PRIOR, PARAM_BOUNDS)",
               title_justify="left")
    for col in ("parameter", "prior", "bound", "start", "fitted", "x prior", "flag"):
        pt.add_column(col, justify="left" if col in ("parameter", "bound", "flag") else "right", overflow="fold")
    for e in doc.get("parameters", []):
        lo, hi = e["bound"]
        pt.add_row(e["name"], _num(e["prior"]), "-" if lo is None else f"[{lo:.4g}, {hi:.4g}]", _num(e["start"]),
                   _num(e["fitted"]), "-" if e["ratio_to_prior"] is None else f"{e['ratio_to_prior']:.2f}",
                   "; ".join(e["flags"]) or "-")
    con.print(pt)
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
    gpus_per_node: GpusPerNodeOpt = None,
    memory_limit_gb: MemLimitOpt = None,
    as_json: JsonOpt = False,
) -> int:
    """Best plan for the same model and job on several GPUs and fabrics, side by side."""
    _check_limit(memory_limit_gb)
    bws = list(inter_node_bw or []) or [None]
    for b in bws:
        if b is not None and not b > 0:
            raise SpecError("inter-node-bw", f"must be a positive GB/s, got {b!r}")
    rows = []
    for g in gpu:
        for bw in bws:
            problem = api.build_problem(model=model, gpu=g, gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                                        precision=precision, gpus_per_node=gpus_per_node, inter_node_bw=bw)
            row = {"gpu": problem.cluster.gpu.name,
                   "inter_node_bw_gbps": problem.cluster.inter_node_bw_bytes_per_s / 1e9,
                   "best": None, "error": None}
            try:
                row["best"] = exhaustive(problem, None, top_k=1, memory_limit_gb=memory_limit_gb).best
            except NothingFits as exc:
                row["error"] = str(exc)
            except NoLegalPlan as exc:
                row["error"] = str(exc)
            rows.append(row)
    ref = next((r["best"]["step_time_s"] for r in rows if r["best"]), None)
    for r in rows:
        r["speedup_vs_first"] = ref / r["best"]["step_time_s"] if (r["best"] and ref) else None
    if as_json:
        _print_json({"variants": rows})
        return EXIT_OK
    con = _console()
    t = Table(title=f"What if: {model}, {gpus} GPUs", title_justify="left")
    for col in ("GPU", "inter-node GB/s", "best plan", "step s", "tokens/s/GPU", "MFU", "memory GB", "speed-up"):
        t.add_column(col, justify="left" if col in ("GPU", "best plan") else "right", overflow="fold")
    for r in rows:
        b = r["best"]
        if b is None:
            t.add_row(r["gpu"], f"{r['inter_node_bw_gbps']:.0f}", r["error"], "-", "-", "-", "-", "-")
            continue
        t.add_row(r["gpu"], f"{r['inter_node_bw_gbps']:.0f}", plan_text(b["plan"]), f"{b['step_time_s']:.3f}",
                  f"{b['tokens_per_s_per_gpu']:,.0f}", f"{b['mfu']:.1%}", f"{b['memory_gb']['total']:.1f}",
                  f"{r['speedup_vs_first']:.2f}x")
    con.print(t)
    return EXIT_OK


def register(app: typer.Typer) -> None:
    app.command("explain")(explain)
    app.command("calibrate")(calibrate_cmd)
    app.command("whatif")(whatif)
