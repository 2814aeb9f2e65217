"""Optuna on the command line (issue 4): `autotune worker`, `autotune studies`, and the Optuna path
of `autotune search` (`run_optuna_search`, called for --strategy optuna, or auto when it picks
Optuna). Thin shells over `autotune.optuna_search` and `autotune.studies`; `register(app)` adds the
two commands to the root app.

Errors follow the root group's contract: a SpecError becomes one `error:` line and exit code 2;
no plan fits gives exit code 3; Ctrl-C stops after the batch in flight, keeps every finished trial,
prints what was found and exits 130. A storage URL's password is never printed.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import TYPE_CHECKING, Annotated, Callable, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from cli.common import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NOTHING_FITS, EXIT_OK
from cli.common import error_line as _error_line, print_json as _print_json, stdout_console as _console
from cli.export_cmds import export_exit, finish_report, print_plan_lines
from cli.notes import problem_notes
from cli.options import JsonOpt
from costmodels.specs import SpecError

if TYPE_CHECKING:       # imported inside the functions: they import Optuna, numpy and JAX (slow to start)
    from autotune import optuna_search as osr
    from search_spaces.optuna_space import GpuRange

#: spelled here so that building the CLI imports neither Optuna nor JAX; tests/test_fuzz_cli.py checks
#: it equals autotune.ask_tell.STALE_AFTER_S (the default of `worker --stale-after`)
STALE_AFTER_S = 600.0


def _osr():
    from autotune import optuna_search
    return optuna_search


def is_gpu_range(value) -> bool:
    """True for a `--gpus` range (a GpuRange); never imports Optuna (no range exists before its module is loaded)."""
    mod = sys.modules.get("search_spaces.optuna_space")
    return mod is not None and isinstance(value, mod.GpuRange)


def __getattr__(name: str):
    if name == "GpuRange":              # `optuna_cmds.GpuRange`, loaded on first use
        from search_spaces.optuna_space import GpuRange
        return GpuRange
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: search options that only Optuna uses; giving one makes `--strategy auto` pick Optuna
#: (--objective is not one: an exhaustive range search takes one or two objectives)
OPTUNA_OPTIONS = ("--trials", "--timeout", "--sampler", "--seed", "--storage", "--study", "--batch-size")

StorageOpt = Annotated[Optional[str], typer.Option(
    "--storage", help="Optuna storage: sqlite:///FILE, journal:FILE, postgresql://USER:PASSWORD@HOST/DB "
                      "(default: in memory). The password is never printed.")]
StudyOpt = Annotated[Optional[str], typer.Option("--study", help="Study name in the storage.")]
TrialsOpt = Annotated[Optional[int], typer.Option("--trials", help="Trials to run (this worker's share).")]
TimeoutOpt = Annotated[Optional[float], typer.Option("--timeout", help="Stop after this many seconds.")]
BatchOpt = Annotated[Optional[int], typer.Option("--batch-size", help="Trials asked and scored together.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", min=0, help="Sampler seed (same seed, same trials).")]


# ------------------------------------------------------------------------------------------------
# search --strategy optuna | auto
# ------------------------------------------------------------------------------------------------

def parse_search_gpus(text: Optional[str]) -> int | GpuRange | None:
    """--gpus of `search`: a count, or a range (256-2048, 256-2048:64, 256-2048:pow2)."""
    if text is None:
        return None
    from costmodels.specs import check_size
    s = str(text).strip()
    if s.isascii() and s.lstrip("+-").isdigit() and len(s) <= 12:
        n = int(s)
        if n <= 0:
            raise SpecError("gpus", f"must be a positive integer, got {n}")
        check_size("gpus", n)
        return n
    if not re.fullmatch(r"\d{1,9}\s*-\s*\d{1,9}(\s*:\s*\w{1,9})?", s):     # a range, or refused here
        raise SpecError("--gpus", f"expected a GPU count (512) or a range (256-2048, 256-2048:64, "
                        f"256-2048:pow2), got {s[:20]!r}")
    from search_spaces.optuna_space import parse_gpus
    parsed = parse_gpus(s, "--gpus")
    check_size("gpus", getattr(parsed, "high", parsed))
    return parsed


#: the choice for a GPU range under `auto`, made final by `run_optuna_search` once the range is counted
RANGE_PENDING = "the GPU count is a range"


def choose(strategy: str, *, gpus, objectives, optuna_options: list[str],
           count_legal: Callable[[], int] | None) -> osr.StrategyChoice:
    """Which strategy `search` runs, and why (`--strategy auto` is the default). Without `count_legal`, `auto` on
    one GPU count chooses exhaustive and leaves the limit to the search (`exhaustive(max_legal=...)`)."""
    req = str(strategy).strip().lower()
    if req == "exhaustive" and optuna_options:
        raise SpecError(optuna_options[0], "applies to --strategy optuna or auto, not exhaustive")
    from autotune import strategy as osr            # the choice without importing Optuna
    if req == "auto" and optuna_options:
        osr.choose_strategy("optuna", gpus=gpus, objectives=objectives)      # checks the arguments
        return osr.StrategyChoice("optuna", f"Optuna options given ({', '.join(optuna_options)})")
    if is_gpu_range(gpus):
        chosen = osr.choose_strategy(req, gpus=gpus, objectives=objectives, count_legal=lambda: 0)
        return chosen if req != "auto" or chosen.strategy == "optuna" else osr.StrategyChoice("auto", RANGE_PENDING)
    return osr.choose_strategy(req, gpus=gpus, objectives=objectives, count_legal=count_legal)


class _ProgressBar:
    """A rich progress bar on stderr with the best plan so far (only when stderr is a terminal)."""

    def __init__(self, total: int | None, label: str, enabled: bool):
        err = Console(stderr=True)
        self.bar = None
        if enabled and err.is_terminal:
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=err, transient=True)
            self.task = self.bar.add_task(label, total=total)
            self.label = label
        self._cm = self.bar if self.bar is not None else contextlib.nullcontext()

    def __enter__(self):
        self._cm.__enter__()
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        return False

    def __call__(self, done: int, stats, best: dict | None):
        if self.bar is None:
            return None
        desc = self.label
        if best is not None:
            p = best["plan"]
            desc = (f"best {best['tokens_per_s'] / best['gpus']:,.0f} tok/s/GPU on {best['gpus']} GPUs "
                    f"(tp{p['tp']} pp{p['pp']} dp{p['dp']} cp{p['cp']} ep{p['ep']} mbs{p['mbs']})")
        self.bar.update(self.task, completed=done, description=desc)
        return None


def _plans_table(reports: list, title: str = "Best plans found") -> Table:
    from autotune.report import extras_text, uses_extras
    table = Table(title=title, title_justify="left")
    extras = uses_extras(reports)
    for col in ("#", "trial", "GPUs", "TP", "PP", "DP", "CP", "EP", "VPP", "MBS", "recompute", "SP", "ZeRO",
                "step (s)", "tokens/s/GPU", "MFU", "mem GB") + (("stages / block recompute",) if extras else ()):
        table.add_column(col, justify="left" if col in ("recompute", "SP", "stages / block recompute") else "right")
    for i, r in enumerate(reports, 1):
        p = r["plan"]
        table.add_row(str(i), str(r.get("trial", "")), str(r.get("num_gpus", "")), str(p["tp"]), str(p["pp"]),
                      str(p["dp"]), str(p["cp"]), str(p["ep"]), str(p["vpp"]), str(p["mbs"]), str(p["recompute"]),
                      "on" if p["sp"] else "off", str(p["zero"]), f"{r['step_time_s']:.3f}",
                      f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['mfu']:.1%}", f"{r['memory_gb']['total']:.1f}",
                      *((extras_text(p) or "-",) if extras else ()))
    return table


def _pareto_table(front: list, objectives: list) -> Table:
    from autotune.report import extras_text
    table = Table(title="Pareto front (feasible trials no other trial beats on every objective)",
                  title_justify="left")
    for col in ["#", "trial"] + [f"{o['name']} ({o['direction'][:3]})" for o in objectives] + ["plan"]:
        table.add_column(col, justify="left" if col == "plan" else "right")
    for i, f in enumerate(front, 1):
        p = f["plan"]
        vals = [_fmt(f["values"][o["name"]]) for o in objectives]
        table.add_row(str(i), str(f.get("trial", "")), *vals,
                      f"tp{p['tp']} pp{p['pp']} dp{p['dp']} cp{p['cp']} ep{p['ep']} vpp{p['vpp']} mbs{p['mbs']} "
                      f"{p['recompute']} sp={'on' if p['sp'] else 'off'} zero{p['zero']}"
                      + (f" ({extras_text(p)})" if extras_text(p) else ""))
    return table


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}"


def _markdown_section(report: dict) -> str:
    from autotune.report import report_basename
    o = report.get("optuna") or report["range"]
    objectives = ", ".join(f"{x['name']} ({x['direction']})" for x in o["objectives"])
    if "optuna" in report:
        lines = [f"Sampler {o['sampler']} (seed {o['seed']}), {o['n_trials']} trials ({o['n_feasible']} feasible) "
                 f"in study `{o['study']}` of storage `{o['storage']}`; objectives {objectives}."]
    else:
        lines = [f"Every legal plan of every GPU count of {o['gpus']} scored; objectives {objectives}."]
    front = o.get("pareto_front")
    if front:
        names = [x["name"] for x in o["objectives"]]
        lines += ["", "| # | trial | " + " | ".join(names) + " | plan |",
                  "|---|---|" + "---|" * len(names) + "---|"]
        for i, f in enumerate(front, 1):
            lines.append(f"| {i} | {f.get('trial', '')} | " + " | ".join(_fmt(f["values"][n]) for n in names)
                         + f" | {','.join(f'{k}={v}' for k, v in f['plan'].items())} |")
        lines += ["", f"Plots (Optuna's history, Pareto front, parameter importances): "
                      f"[{report_basename(report)}.html]({report_basename(report)}.html)"]
    return "\n".join(lines)


def run_optuna_search(*, model: str, gpu: Optional[str], gpus, global_batch: Optional[int],
                      seq_len: Optional[int], precision: str, gpus_per_node: Optional[int],
                      intra_node_bw: Optional[float], inter_node_bw: Optional[float], cluster: Optional[str],
                      top: int, memory_limit_gb: Optional[float], out: str, no_save: bool, as_json: bool,
                      calibration: Optional[str], trials: Optional[int], timeout: Optional[float],
                      sampler: Optional[str], seed: Optional[int], objectives: Optional[list],
                      storage: Optional[str], study: Optional[str], batch_size: Optional[int],
                      choice: osr.StrategyChoice | None = None, requested: str = "optuna",
                      with_sensitivity: bool = False, framework: Optional[dict] = None,
                      export_to: str | None = None, headroom=None, verification: Callable | None = None) -> int:
    """`search` with Optuna: run (or resume) the study, print and save the report. An exit code.
    A report that cannot be saved (the folder went away, the disk is full) is still printed; then one
    `error:` line and exit code 2, as the exhaustive path does."""
    from autotune import api
    from autotune.headroom import annotate
    from autotune.report import save_report, search_report
    from autotune.search import NothingFits
    osr = _osr()
    if is_gpu_range(gpus) or gpus is None:
        gpus_text = None if gpus is None else str(gpus)
    else:
        gpus_text = str(int(gpus))
    spec = osr.StudySpec(
        model=model, gpu=gpu, gpus=gpus_text, global_batch=global_batch, seq_len=seq_len, precision=precision,
        gpus_per_node=gpus_per_node, intra_node_bw=intra_node_bw, inter_node_bw=inter_node_bw,
        cluster_file=cluster, memory_limit_gb=memory_limit_gb, calibration=calibration,
        framework={k: v for k, v in (framework or {}).items() if v is not None},
        objectives=osr.parse_objectives(objectives or ()), sampler=sampler or osr.DEFAULT_SAMPLER, seed=seed,
        batch_size=osr.DEFAULT_BATCH if batch_size is None else batch_size)
    if trials is None and timeout is None:
        trials = osr.DEFAULT_TRIALS
    choice = choice or osr.StrategyChoice("optuna", "requested")
    space = None
    if choice.reason == RANGE_PENDING:      # auto on a range: exhaustive when all its counts are small
        resolved = spec.resolved()
        space = resolved.build_space()
        choice = osr.choose_strategy("auto", gpus=gpus, objectives=spec.objectives,
                                     count_legal=lambda: osr.range_legal_count(resolved, space))
    label = f"optuna {spec.sampler}: scoring trials"
    try:
        with _ProgressBar(trials if choice.strategy == "optuna" else None, label,
                          enabled=not as_json and choice.strategy == "optuna") as bar:
            result = api.search(spec, strategy=choice.strategy, top_k=top, progress=bar, space=space,
                                run=api.OptunaRun(n_trials=trials, timeout_s=timeout, storage_url=storage,
                                                  study_name=study))
    except NothingFits as exc:
        if as_json:
            _print_json({"error": str(exc), "closest": exc.closest, "space": exc.space})
        _error_line(str(exc))
        return EXIT_NOTHING_FITS
    (result.extra.get("optuna") or {}).pop("pareto_points", None)   # the HTML page plots the front from the study
    report = search_report(result, calibration or "defaults")
    report["strategy_choice"] = {"requested": requested, **(choice or osr.StrategyChoice("optuna", "requested")).as_dict()}
    if headroom is not None:
        annotate(report, headroom)
    if with_sensitivity and getattr(result, "problem", None) is not None:
        from autotune.sensitivity import add_sensitivity
        params, _ = api.load_params(calibration, result.problem.cluster.gpu.name)
        add_sensitivity(report, result.problem, params, memory_limit_gb)
    finish_report(report, result.problem, export_to)
    if verification is not None:          # search --verify-top K: measure the study's top plans
        params, _ = api.load_params(calibration, result.problem.cluster.gpu.name)
        report["verification"] = verification(result.problem, report, params)
    saved, save_error = None, None
    if not no_save:
        try:
            report.setdefault("sections", []).insert(0, {"title": "Optuna" if "optuna" in report else "GPU range",
                                                         "markdown": _markdown_section(report)})
            saved = save_report(report, out, study=getattr(result, "study", None))
        except SpecError as exc:                   # the folder went away mid-search: print anyway
            save_error = str(exc)
        except OSError as exc:                     # a plot written with plotly's own open()
            save_error = str(SpecError("out", f"cannot write the report to {out}: {exc.strerror or exc}"))
    info = report.get("optuna") or {}
    code = EXIT_INTERRUPTED if info.get("interrupted") else EXIT_OK
    if as_json:
        _print_json(report)
    else:
        _print_human(report, choice, saved, out, save_error, problem=result.problem)
    if code == EXIT_INTERRUPTED:                   # the trials are kept in the study either way
        _error_line(f"interrupted: {info['n_trials']} trials kept in study {info['study']}")
        return code
    if save_error:
        _error_line(save_error)
        return EXIT_BAD_INPUT
    return export_exit(report)


def _print_human(report: dict, choice: osr.StrategyChoice, saved, out: str, save_error: str | None = None,
                 problem=None) -> None:
    con = _console()
    info = report.get("optuna") or report.get("range") or {}
    if "optuna" in report:
        con.print(Text(f"Strategy: optuna ({choice.reason}); sampler {info['sampler']}, seed {info['seed']}, "
                       f"batch {info['batch_size']}."))
    else:
        con.print(Text(f"Strategy: exhaustive over the GPU range ({choice.reason})."))
    con.print(_plans_table(report["top"]))
    if report.get("verification"):
        from cli.verify_cmds import print_verification
        print_verification(con, report["verification"])
    if info.get("pareto_front"):
        con.print(_pareto_table(info["pareto_front"], info["objectives"]))
    con.print()
    con.print(Text(report["explanation"]))
    con.print()
    if "optuna" in report:
        run = info.get("run", {})
        con.print(Text(f"Study {info['study']} in {info['storage']}: {info['n_trials']} trials, {info['n_feasible']} "
                       f"feasible; this run {run.get('trials', 0)} trials in {run.get('elapsed_s', 0):.2f} s "
                       f"({run.get('wall_per_trial_ms', 0):.1f} ms per trial, {run.get('model_share', 0):.0%} in "
                       f"the cost model){'; resumed' if info.get('resumed') else ''}."))
    else:
        sp = report["space"]
        con.print(Text(f"{sp['legal']:,} legal plans over {sp['gpu_counts']} GPU counts, {sp['fitting']:,} fit; "
                       f"scored in {report['elapsed_s']:.2f} s."))
    if saved:
        con.print(Text(f"Report saved to {', '.join(saved)} (plots: Optuna's history, Pareto front, importances)"))
    else:
        con.print(Text("Report not saved." if save_error else "Report not saved (--no-save)."))
    print_plan_lines(con, report)
    if problem is not None:             # what the cost model counts for the job, as the exhaustive search says
        for note in problem_notes(problem):
            con.print(Text(note))


# ------------------------------------------------------------------------------------------------
# worker
# ------------------------------------------------------------------------------------------------

def worker(
    storage: Annotated[str, typer.Option("--storage", help="The study's storage URL (sqlite:///..., "
                                         "journal:..., postgresql://...). The password is never printed.")],
    study: Annotated[str, typer.Option("--study", help="Study name (created by `autotune search --strategy optuna`).")],
    trials: TrialsOpt = None,
    timeout: TimeoutOpt = None,
    batch_size: BatchOpt = None,
    seed: SeedOpt = None,
    stale_after: Annotated[float, typer.Option("--stale-after", help="Fail RUNNING trials older than this "
                                               "many seconds (left by a dead worker).")] = STALE_AFTER_S,
    as_json: JsonOpt = False,
    runner: Annotated[Optional[str], typer.Option("--runner", help="Measure plans of a verification study "
                      "(`search --verify-top K --storage`) with jax or megatron (default: the study's runner).")] = None,
    megatron_path: Annotated[Optional[str], typer.Option("--megatron-path", help="This machine's Megatron-LM "
                             "checkout (default: the study's).")] = None,
    launcher: Annotated[Optional[str], typer.Option("--launcher", help="torchrun or slurm (default: the "
                        "study's).")] = None,
    out: Annotated[str, typer.Option("--out", help="Folder for the measurement records of a verification "
                                     "worker.")] = "measurements",
) -> int:
    """Run trials of a shared study: its problem comes from the study; --trials is this worker's share.
    On a verification study (`search --verify-top K --storage`) each trial is a real run (--runner)."""
    from autotune.verify_study import is_verification_study
    if runner is not None or is_verification_study(storage, study):
        return _verification_worker(storage, study, trials=trials, timeout=timeout, batch_size=batch_size,
                                    seed=seed, stale_after=stale_after, as_json=as_json, runner=runner,
                                    megatron_path=megatron_path, launcher=launcher, out=out)
    for flag, given in (("--megatron-path", megatron_path), ("--launcher", launcher)):
        if given is not None:
            raise SpecError(flag, "applies to a verification study (autotune worker --runner ...)")
    osr = _osr()
    if trials is None and timeout is None:
        raise SpecError("--trials", "give --trials N (this worker's share) or --timeout SECONDS")
    with _ProgressBar(trials, f"worker on {study}", enabled=not as_json) as bar:
        out = osr.run_worker(storage, study, n_trials=trials, timeout_s=timeout, batch_size=batch_size, seed=seed,
                             stale_after_s=stale_after, progress=bar)
    code = EXIT_INTERRUPTED if out["run"]["interrupted"] else EXIT_OK
    if as_json:
        _print_json(out)
    else:
        con = _console()
        run, st = out["run"], out["study_trials"]
        zombies = f"; failed {run['zombies_failed']} stale RUNNING trials" if run["zombies_failed"] else ""
        con.print(Text(f"Worker {out['worker']} ran {run['trials']} trials of study {out['study']} in "
                       f"{out['storage']} ({run['elapsed_s']:.2f} s, {run['wall_per_trial_ms']:.1f} ms per trial); "
                       f"the study holds {st['complete']} complete, {st['running']} running, {st['fail']} failed "
                       f"trials{zombies}."))
        best = out.get("best")
        if best:
            con.print(_plans_table([best], title="Best plan of the study"))
    if code == EXIT_INTERRUPTED:
        _error_line(f"interrupted: {out['run']['trials']} trials of this worker kept in study {study}")
    return code


def _verification_worker(storage: str, study: str, *, trials, timeout, batch_size, seed, stale_after, as_json: bool,
                         runner, megatron_path, launcher, out: str) -> int:
    """`autotune worker` on a verification study: each trial a real run; OOM / refused plans are FAIL
    trials and the worker goes on; Ctrl-C fails the run in flight, queues its plan again, exits 130."""
    from autotune.verify import plan_slug
    from autotune.verify_study import run_verification_worker
    from costmodels.plan import Plan
    for flag, given in (("--timeout", timeout), ("--batch-size", batch_size)):
        if given is not None:
            raise SpecError(flag, "applies to cost-model studies; a verification worker takes --trials N")
    if trials is None:
        raise SpecError("--trials", "give --trials N (the plans this worker measures)")
    con = _console()

    def show(e: dict) -> None:
        plan = plan_slug(Plan.from_dict(e["plan"])) if "tp" in (e.get("plan") or {}) else str(e.get("plan"))
        value = f", value {e['value']:.4f} s" if e.get("value") else ""
        how = f" [{e['seeded']}]" if e.get("seeded") else " [sampler]"
        con.print(Text(f"  trial {e['trial']}{how} {plan}: {e['status']}{value}"
                       + (f" ({e['reason']})" if e.get("reason") and e["status"] != "ok" else "")))

    res = run_verification_worker(storage, study, n_trials=trials, runner=runner, megatron_path=megatron_path,
                                  launcher=launcher, seed=seed, out=out, stale_after_s=stale_after,
                                  on_result=None if as_json else show)
    if as_json:
        _print_json(res)
    else:
        st = res["study_trials"]
        con.print(Text(f"Worker {res['worker']} ran {res['runs']} plans ({res['runner']} runner, {res['steps']} steps "
                       f"each) of verification study {res['study']} in {res['storage']} in {res['elapsed_s']:.1f} s; "
                       f"the study holds {', '.join(f'{k} {v}' for k, v in st.items() if v)} trials."
                       + (f" Records: {res['saved']}" if res["saved"] else "")))
    if res["interrupted"]:
        _error_line(f"interrupted: {res['runs']} finished runs kept in study {study}; the run in flight is queued again")
        return EXIT_INTERRUPTED
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# studies
# ------------------------------------------------------------------------------------------------

def studies(
    storage: Annotated[str, typer.Option("--storage", help="Storage URL to read.")],
    study: Annotated[Optional[str], typer.Option("--study", help="Show this study (default: list them all).")] = None,
    export: Annotated[Optional[str], typer.Option("--export", help="Write the study's trials to FILE "
                                                  "(.csv or .json); needs --study.")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Best plans to show.")] = 5,
    as_json: JsonOpt = False,
) -> int:
    """List the studies of a storage, show one (--study), or export its trials (--export FILE)."""
    from autotune.storage import redact_url
    from autotune.studies import export_study, list_studies, show_study
    if export and not study:
        raise SpecError("--export", "needs --study NAME")
    if export:
        out = export_study(storage, study, export)
        if as_json:
            _print_json(out)
        else:
            _console().print(Text(f"Exported {out['trials']} trials of {study} to {out['path']} ({out['format']})."))
        return EXIT_OK
    if study:
        out = show_study(storage, study, top=top)
        if out.get("verification"):
            return _show_verification(storage, study, top, as_json)
        if as_json:
            _print_json(out)
            return EXIT_OK
        con = _console()
        p = out.get("problem") or {}
        fw = "".join(f", {k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                     for k, v in (p.get("framework") or {}).items())
        con.print(Text(f"Study {out['name']} in {out['storage']}: {p.get('model')} on {p.get('gpus')} x "
                       f"{p.get('gpu')}{fw}, objectives {', '.join(out['objectives'])}, sampler {out.get('sampler')}; "
                       f"trials {out['trials']}."))
        table = Table(title="Best feasible trials", title_justify="left")
        for col in ("trial", "values", "GPUs", "plan", "step (s)", "mem GB"):
            table.add_column(col)
        for t in out["best"]:
            plan = t["user_attrs"].get("plan") or {}
            a = t["user_attrs"].get("metrics") or {}
            table.add_row(str(t["number"]), ", ".join(_fmt(v) for v in (t["values"] or [])), str(a.get("gpus")),
                          ",".join(f"{k}={v}" for k, v in plan.items()), f"{a.get('step_time_s', 0):.3f}",
                          f"{a.get('memory_gb', 0):.1f}")
        con.print(table)
        return EXIT_OK
    rows = list_studies(storage)
    if as_json:
        _print_json({"storage": redact_url(storage), "studies": rows})
        return EXIT_OK
    con = _console()
    table = Table(title=f"Studies in {redact_url(storage)}", title_justify="left")
    for col in ("name", "problem", "objectives", "sampler", "trials", "started"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["problem"], ", ".join(r["objectives"]), str(r["sampler"]),
                      ", ".join(f"{k} {v}" for k, v in r["trials"].items()), str(r["started"]))
    con.print(table)
    return EXIT_OK


def _show_verification(storage: str, study: str, top: int, as_json: bool) -> int:
    """`studies --study NAME` of a verification study: its plans ranked by measured step time."""
    from autotune.verify import plan_slug
    from autotune.verify_study import verification_summary
    from costmodels.plan import Plan
    summ = verification_summary(storage, study)
    if as_json:
        _print_json(summ)
        return EXIT_OK
    con = _console()
    con.print(Text(f"Verification study {study} in {summ['storage']} ({summ['runner']} runner, {summ['steps']} steps "
                   f"per run): {', '.join(f'{k.lower()} {v}' for k, v in summ['counts'].items() if v)} trials."))
    table = Table(title="Plans by measured step time (the study's value)", title_justify="left")
    for col in ("#", "trial", "plan", "queued as", "status", "value (s)", "measured s (run)", "predicted s", "worker"):
        table.add_column(col, justify="right" if col in ("#", "trial") or " s" in col or "(s)" in col else "left")
    rows = sorted(summ["plans"], key=lambda r: (r.get("measured_rank") or 1e9, r["trial"]))[:max(top, 1) * 4]
    for r in rows:
        plan = plan_slug(Plan.from_dict(r["plan"])) if "tp" in r["plan"] else "-"
        table.add_row(str(r.get("measured_rank") or "-"), str(r["trial"]), plan, r.get("seeded") or "sampler",
                      r["status"], "-" if r["value"] is None else f"{r['value']:.4f}",
                      "-" if r["measured_run_step_time_s"] is None else f"{r['measured_run_step_time_s']:.4f}",
                      "-" if r["predicted_step_time_s"] is None else f"{r['predicted_step_time_s']:.4f}",
                      str(r.get("worker") or "-"))
    con.print(table)
    return EXIT_OK


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
    app.command("studies")(studies)
