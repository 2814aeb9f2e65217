"""`autotune capacity`: GPUs, days, cost and energy to train N tokens, per GPU type (a thin shell over
`autotune.capacity`). `register(app)` adds it to the root app.

Exit codes: 0 at least one GPU type meets the deadline (or no deadline given and a plan exists),
2 bad input, 3 nothing meets the deadline (the advice says what would).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from autotune.headroom import DEFAULT_MEMORY_HEADROOM_FRAC, parse_fraction
from costmodels.specs import SpecError
from cli.options import CalibrationOpt, GlobalBatchOpt, JsonOpt, ModelOpt, PrecisionOpt, SeqLenOpt

EXIT_OK, EXIT_NOTHING_FITS = 0, 3

# Spelled here so that building the CLI imports neither numpy nor JAX (autotune.capacity needs numpy);
# tests/test_capacity.py checks they equal autotune.capacity's.
DEFAULT_GPU_MTBF_HOURS = 54 * 24 * 16384 / 419      # Llama 3: 419 interruptions in 54 days on 16,384 GPUs
DEFAULT_CHECKPOINT_S = 60.0
DEFAULT_RESTART_S = 600.0
DEFAULT_MAX_GPUS = 32768

HeadroomOpt = Annotated[Optional[str], typer.Option(
    "--memory-headroom", help="Share of each GPU's memory kept free (default 5%).")]


def _console() -> Console:
    con = Console(highlight=False)
    return con if con.is_terminal else Console(highlight=False, width=max(con.width, 200))


def capacity(
    model: ModelOpt,
    tokens: Annotated[float, typer.Option("--tokens", help="Tokens to train, e.g. 15e12.")],
    gpu: Annotated[list[str], typer.Option("--gpu", help="GPU preset; repeat to compare (--gpu h100 --gpu b200).")],
    deadline: Annotated[Optional[str], typer.Option("--deadline", help="Wall-clock limit: 90d, 12w, 2160h.")] = None,
    price: Annotated[Optional[str], typer.Option("--price-per-gpu-hour", help="$ per GPU-hour: h100=2.5,b200=4.")] = None,
    power: Annotated[Optional[str], typer.Option("--power-w", help="W per GPU (default: datasheet TDP): h100=700.")] = None,
    mtbf_hours: Annotated[float, typer.Option("--mtbf-hours", help="Per-GPU hours between job-stopping failures "
                                              "(default: Llama 3's 419 interruptions in 54 days on 16,384 GPUs).")]
    = DEFAULT_GPU_MTBF_HOURS,
    checkpoint_s: Annotated[float, typer.Option("--checkpoint-s", help="Seconds to write a checkpoint.")]
    = DEFAULT_CHECKPOINT_S,
    restart_s: Annotated[float, typer.Option("--restart-s", help="Seconds lost to a restart after a failure.")]
    = DEFAULT_RESTART_S,
    objective: Annotated[str, typer.Option("--objective", help="cost (default) or energy.")] = "cost",
    min_gpus: Annotated[int, typer.Option("--min-gpus", help="Smallest GPU count tried.")] = 1,
    max_gpus: Annotated[int, typer.Option("--max-gpus", help="Largest GPU count tried.")] = DEFAULT_MAX_GPUS,
    global_batch: GlobalBatchOpt = None,
    seq_len: SeqLenOpt = None,
    precision: PrecisionOpt = "bf16",
    memory_headroom: HeadroomOpt = None,
    calibration: CalibrationOpt = None,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Write an HTML page with the time-vs-cost plot.")] = None,
    as_json: JsonOpt = False,
) -> int:
    """GPUs, days, cost and energy to train N tokens: per GPU type the count that meets the deadline at least cost."""
    from autotune import capacity as cap
    names = [g.strip().lower() for g in gpu]
    if plot:
        _check_plot(plot, [model, calibration])
    req = cap.CapacityRequest(
        model=model, tokens=tokens, gpus=tuple(names),
        deadline_s=None if deadline is None else cap.parse_duration_s(deadline),
        prices=cap.parse_per_gpu(price, "price_per_gpu_hour", names),
        power_w=cap.parse_per_gpu(power, "power_w", names),
        failures=cap.FailureModel(gpu_mtbf_hours=mtbf_hours, checkpoint_s=checkpoint_s, restart_s=restart_s),
        objective=objective, global_batch=global_batch, seq_len=seq_len, precision=precision,
        min_gpus=min_gpus, max_gpus=max_gpus,
        memory_headroom_frac=parse_fraction(memory_headroom, "memory_headroom", DEFAULT_MEMORY_HEADROOM_FRAC),
        calibration=calibration)
    err = Console(stderr=True)
    status = err.status("Searching every GPU count...") if err.is_terminal and not as_json else None
    if status:
        status.start()
    try:
        report = cap.capacity_plan(req)
    finally:
        if status:
            status.stop()
    if plot:
        from autotune.figures import capacity_page
        try:
            with open(plot, "w", encoding="utf-8") as fh:
                fh.write(capacity_page(report))
        except OSError as exc:
            raise SpecError("plot", f"cannot write {plot}: {exc.strerror or exc}") from None
        report["plot"] = plot
    code = EXIT_OK if report["best_gpu"] else EXIT_NOTHING_FITS
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        _print(report)
    if code != EXIT_OK:
        why = "; ".join(report["advice"]) or "no GPU count has a plan that fits"
        sys.stderr.write(f"error: deadline: nothing meets it. {' '.join(why.split())}\n")
    return code


def _check_plot(plot: str, inputs: list) -> None:
    """--plot names a file that can be written and is none of the command's input files (checked before the
    search, which takes seconds)."""
    folder = os.path.dirname(os.path.abspath(plot))
    if os.path.isdir(plot):
        raise SpecError("plot", f"cannot write {plot}: it is a folder; give a file name such as capacity.html")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise SpecError("plot", f"cannot write {plot}: its folder {folder} does not exist or is not writable")
    for path in inputs:
        if path and os.path.exists(plot) and os.path.isfile(path) and os.path.samefile(plot, path):
            raise SpecError("plot", f"{plot} is an input of this command; the plot would overwrite it")


def _money(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _print(report: dict) -> None:
    from autotune import capacity as cap
    from autotune.report import plan_text
    con = _console()
    table = Table(title="Capacity plan per GPU type", title_justify="left")
    for col in ("GPU", "GPUs", "days", "GPU-hours", "cost $", "kWh", "goodput", "ckpt every", "MFU", "plan"):
        table.add_column(col, justify="left" if col in ("GPU", "plan") else "right", overflow="fold")
    for g in report["per_gpu"]:
        p = g["pick"]
        if p is None:
            f = g["fastest"]
            table.add_row(g["gpu"], "-", "-" if f is None else f"(>= {f['wall_days']:.1f})", "-", "-", "-", "-",
                          "-", "-", "nothing meets the deadline")
            continue
        table.add_row(g["gpu"], f"{p['gpus']:,}", f"{p['wall_days']:.1f}", f"{p['gpu_hours']:,.0f}",
                      _money(p["cost"]), _money(p["energy_kwh"]), f"{p['goodput']:.1%}",
                      f"{p['checkpoint_interval_s'] / 60:.0f} min", f"{p['mfu']:.1%}", plan_text(p["plan"]))
    con.print(table)
    for line in cap.capacity_lines(report)[1 + len(report["per_gpu"]):]:
        con.print(Text(line))
    if report.get("plot"):
        con.print(Text(f"Plot saved to {report['plot']}"))


def register(app: typer.Typer) -> None:
    app.command("capacity")(capacity)


# search's --memory-headroom and ties (kept here so cli/main.py changes by a few lines only)

def headroom_of(gpu, cluster, memory_limit_gb, memory_headroom, gpu_count=None):
    from autotune.headroom import device_headroom
    # --memory-limit-gb is already the usable memory: the default headroom applies to the device's own
    frac = parse_fraction(memory_headroom, "memory_headroom", 0.0 if memory_limit_gb else DEFAULT_MEMORY_HEADROOM_FRAC)
    n = getattr(gpu_count, "low", gpu_count)           # a GPU range: its smallest count
    return device_headroom(gpu, cluster, memory_limit_gb, frac, n)


def annotate_headroom(report: dict, room) -> None:
    from autotune.headroom import annotate
    if room is not None:
        annotate(report, room)


def print_ties(con: Console, report: dict) -> None:
    from autotune.headroom import ties_sentence
    text = ties_sentence(report)
    if text:
        con.print(Text(text))
        flagged = [f"#{i}" for i, r in enumerate(report["top"], 1) if r.get("at_limit")]
        if flagged:
            con.print(Text(f"At the memory limit (above {report['headroom']['at_limit_frac']:.0%} of the device): "
                           + ", ".join(flagged)))
        con.print()


def flag_at_limit(rep: dict) -> str:
    """Mark a predicted plan above AT_LIMIT_FRAC of its memory limit (`at_limit`); the warning, or ""."""
    from autotune.headroom import AT_LIMIT_FRAC
    mem = rep["memory_gb"]
    rep["at_limit"] = bool(mem["total"] > AT_LIMIT_FRAC * mem["limit"])
    if rep["at_limit"] and rep["fits"]:
        return (f"Warning: {mem['total']:.1f} GB is {mem['total'] / mem['limit']:.1%} of the {mem['limit']:.1f} GB "
                f"limit: above {AT_LIMIT_FRAC:.0%}, allocator and framework changes can tip it over; keep ~5% free.")
    return ""
