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

from autotune import api
from autotune.verify import plan_slug, verify_plan
from costmodels.plan import Plan
from costmodels.specs import SpecError

from cli.options import (CalibrationOpt, GlobalBatchOpt, GpuOpt, GpusOpt, JsonOpt, ModelOpt, PrecisionOpt,
                         SeqLenOpt)

EXIT_OK, EXIT_OOM, EXIT_INTERRUPTED = 0, 3, 130

StepsOpt = Annotated[int, typer.Option("--steps", min=1, help="Timed optimizer steps (after --warmup).")]
RunnerOpt = Annotated[str, typer.Option("--runner", help="jax (built in).")]
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
) -> int:
    """Run a plan for a few steps with a real runner; print predicted vs measured; save the record."""
    problem = api.build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                                precision=precision)
    params, _ = api.load_params(calibration, problem.cluster.gpu.name)
    the_plan = api.plan_from_text(plan, problem)
    con = _console(as_json)
    res = verify_plan(problem, the_plan, gpu_key=problem.cluster.gpu.name, steps=steps, warmup=warmup, proxy=proxy,
                      layers=layers, runner=runner, params=params,
                      on_step=None if as_json else lambda i, dt: con.print(Text(f"  step {i}: {dt:.4f} s")))
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


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)


VerifyTopOpt = Annotated[Optional[int], typer.Option("--verify-top", min=1, help="Measure the best K plans with the "
                                                     "jax runner (proxies when devices are few) and re-rank them.")]


def search_verification(problem, report: dict, k: int, params, as_json: bool, out: str, no_save: bool) -> dict:
    """`search --verify-top K`: measure the report's top plans; their records saved in OUT/measurements."""
    from autotune.verify import record_trials, verify_top
    con = _console(as_json)
    show = lambda e: con.print(Text(f"  verified #{e['predicted_rank']}: {e['status']}"))   # noqa: E731
    ver = verify_top(problem, report["top"], k, gpu_key=problem.cluster.gpu.name, params=params,
                     on_result=None if as_json else show)
    study = record_trials(ver)
    done = [t for t in study.trials if t.value is not None]
    ver["optuna"] = {"study": study.study_name, "n_trials": len(study.trials), "n_complete": len(done),
                     "best_params": min(done, key=lambda t: t.value).params if done else None}
    records = [e["run"]["record"] for e in ver["plans"] if "run" in e]
    ver["saved"] = save_records(records, os.path.join(out, "measurements"), "verify_top") if records and not no_save else None
    return ver


def print_verification(con: Console, ver: dict) -> None:
    t = Table(title=f"Verified top {ver['k']} ({ver['platform']}, {ver['steps']} steps each): {ver['note']}",
              title_justify="left")
    for col in ("predicted #", "measured #", "plan", "run", "predicted s", "measured s (run)", "predicted s (run)",
                "mem pred GB", "mem meas GB", "status"):
        t.add_column(col, justify="left" if col in ("plan", "run", "status") else "right")
    for e in ver["plans"]:
        run = e.get("run") or {}
        mem = (run.get("comparison") or {}).get("memory_gb") or {}
        t.add_row(str(e["predicted_rank"]), _fmt(e.get("measured_rank"), "d"), plan_slug(Plan.from_dict(e["plan"])),
                  ("proxy" if e.get("proxy") else "full") if run else "-", _fmt(e["predicted_step_time_s"], ".4f"),
                  _fmt(e.get("measured_run_step_time_s"), ".4f"), _fmt(e.get("predicted_run_step_time_s"), ".4f"),
                  _fmt(mem.get("predicted"), ".3f"), _fmt(mem.get("measured"), ".3f"),
                  e["status"] + (f": {e['reason']}" if e.get("reason") else ""))
    con.print(t)
    if ver.get("saved"):
        con.print(Text(f"Measurements saved to {ver['saved']}"))


def refuse_with_optuna(verify_top: Optional[int]) -> None:
    if verify_top:
        raise SpecError("verify-top", "works with the exhaustive search only; add --strategy exhaustive")
