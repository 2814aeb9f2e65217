"""What every command shares, defined once: the error boundary and exit codes, the JSON printer,
the consoles, option checks and the plan table (columns from `search_spaces.space.KNOBS`).

This module imports neither JAX nor Optuna (nor `autotune.api`), so `autotune --help` and the
error paths start in a fraction of a second; commands import what they score with inside.

Exit codes (the contract; README "Guarantees"):
    0  a plan was found / scored and fits / the file was read
    1  an internal error (a bug): one line with a bug-report hint; AUTOTUNE_DEBUG=1 shows the traceback
    2  bad input: one line `error: <field>: <reason>` on stderr, never a traceback
    3  legal plans exist but none fits in memory (the line names the limit and the closest plan)
    130 interrupted (Ctrl-C)
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Any, Optional, Sequence

import typer
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from typer.core import TyperGroup

from costmodels.specs import SpecError

EXIT_OK, EXIT_BUG, EXIT_BAD_INPUT, EXIT_NOTHING_FITS, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

#: Set to 1 to see the traceback of an internal error (a bug, not bad input).
DEBUG_ENV = "AUTOTUNE_DEBUG"
BUG_HINT = "this is a bug in autotune; please report it with the command line (AUTOTUNE_DEBUG=1 shows the traceback)"
#: the widest table printed when stdout is not a terminal (pipes, logs, CI)
PIPE_WIDTH = 200


# ---------------------------------------------------------------------------------------------
# Errors: one line on stderr, a fixed exit code
# ---------------------------------------------------------------------------------------------

def one_line(text: Any, limit: int = 600) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit - 3] + "..."


def error_line(message: str) -> None:
    sys.stderr.write(f"error: {one_line(message)}\n")
    sys.stderr.flush()


def _nothing_fits_class():
    """autotune.search.NothingFits if that module is loaded (importing it would import JAX)."""
    mod = sys.modules.get("autotune.search")
    return getattr(mod, "NothingFits", None)


def exit_code_for(exc: BaseException) -> tuple[int, str]:
    """(exit code, the one error line) for any exception a command lets out."""
    nothing_fits = _nothing_fits_class()
    if nothing_fits is not None and isinstance(exc, nothing_fits):
        return EXIT_NOTHING_FITS, str(exc)
    if isinstance(exc, SpecError):
        return EXIT_BAD_INPUT, str(exc)
    if isinstance(exc, OverflowError):
        return EXIT_BAD_INPUT, f"input: a number is too large to compute with ({one_line(exc, 120)})"
    if isinstance(exc, RecursionError):
        return EXIT_BAD_INPUT, "input: nested too deeply to read"
    if isinstance(exc, MemoryError):
        return EXIT_BAD_INPUT, "input: too large to fit in this machine's memory"
    if isinstance(exc, UnicodeError):
        return EXIT_BAD_INPUT, f"input: not valid UTF-8 text ({one_line(exc, 120)})"
    if isinstance(exc, OSError):
        where = exc.filename if exc.filename is not None else "file"
        return EXIT_BAD_INPUT, f"{where}: {exc.strerror or one_line(exc, 200)}"
    return EXIT_BUG, f"internal error: {type(exc).__name__}: {one_line(exc, 300)} ({BUG_HINT})"


class OneLineErrors(TyperGroup):
    """The root group, the CLI's one error boundary: usage errors, bad input and anything a command
    lets out become one `error:` line and a fixed exit code.

    Overriding `main` (not wrapping the app) keeps `cli.main:app` as the console script and makes
    `typer.testing.CliRunner` see exactly what a user sees.
    """

    def main(self, args: Optional[Sequence[str]] = None, prog_name: Optional[str] = None,
             complete_var: Optional[str] = None, standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        try:
            if not argv:                                         # bare `autotune`: show the help
                sys.stdout.write(typer.Context(self, info_name=prog_name or self.name).get_help() + "\n")
                rv = EXIT_OK
            else:
                rv = super().main(args=argv, prog_name=prog_name, complete_var=complete_var,
                                  standalone_mode=False, **extra)
        except typer.TyperException as exc:                     # usage: missing option, bad int, ...
            error_line(exc.format_message())
            rv = EXIT_BAD_INPUT
        except (typer.Abort, KeyboardInterrupt):
            error_line("interrupted")
            rv = EXIT_INTERRUPTED
        except Exception as exc:                                 # noqa: BLE001 (the boundary)
            rv, message = exit_code_for(exc)
            if rv == EXIT_BUG and os.environ.get(DEBUG_ENV):
                raise
            error_line(message)
        code = rv if isinstance(rv, int) else EXIT_OK
        if standalone_mode:
            sys.exit(code)
        return code


# ---------------------------------------------------------------------------------------------
# JAX's persistent compilation cache, configured without importing JAX
# ---------------------------------------------------------------------------------------------

CACHE_ENV = "AUTOTUNE_JAX_CACHE"


def configure_compile_cache() -> Optional[str]:
    """Keep XLA's compiled scorer on disk between runs (AUTOTUNE_JAX_CACHE, default
    ~/.cache/autotune/jax; empty disables it). Set through JAX's environment variables so JAX is
    imported only by commands that score; a folder that cannot be written (read-only) disables
    the cache quietly instead of a JAX warning per compilation."""
    from autotune.files import writable_dir
    path = os.environ.get(CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "autotune", "jax"))
    if not path or not writable_dir(path):
        return None
    if "jax" in sys.modules:                       # already imported (tests, notebooks): configure it
        from autotune.scoring import enable_compile_cache
        return enable_compile_cache()
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", path)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return path


# ---------------------------------------------------------------------------------------------
# Option checks (the API checks sizes too; these catch what typer's types let through)
# ---------------------------------------------------------------------------------------------

def check_positive(field: str, value: Optional[float], unit: str = "", maximum: float = 1e9) -> None:
    """A number the user typed must be finite and in (0, maximum] (`inf`, `nan`, 0 and 1e-300 GB/s
    are refused here rather than turning into a NaN score)."""
    if value is None:
        return
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= maximum):
        raise SpecError(field, f"must be a positive number{f' of {unit}' if unit else ''} up to {maximum:g}, "
                        f"got {value!r}")


#: the smallest bandwidth accepted (1 MB/s per GPU; below it a step takes years)
MIN_BW_GBPS = 1e-3


def check_bandwidth(field: str, value: Optional[float]) -> None:
    check_positive(field, value, "GB/s", maximum=1e6)
    if value is not None and value < MIN_BW_GBPS:
        raise SpecError(field, f"{value:g} GB/s is below the smallest supported bandwidth {MIN_BW_GBPS:g} GB/s")


def check_memory_limit(memory_limit_gb: Optional[float]) -> None:
    # The API reads 0 as "use the GPU's memory"; a limit the user typed must be a positive size.
    check_positive("memory_limit_gb", memory_limit_gb, "GB", maximum=1e6)


def check_distinct(field: str, values) -> None:
    """A repeated option must not repeat a value (`--gpu h100 --gpu h100` would print the same row twice)."""
    seen = [str(v).strip().lower() for v in values or []]
    twice = sorted({v for v in seen if seen.count(v) > 1})
    if twice:
        raise SpecError(field, f"{', '.join(twice)} given twice")


def check_problem_options(*, memory_limit_gb=None, intra_node_bw=None, inter_node_bw=None) -> None:
    check_memory_limit(memory_limit_gb)
    check_bandwidth("intra_node_bw_gbps", intra_node_bw)
    for bw in inter_node_bw if isinstance(inter_node_bw, (list, tuple)) else [inter_node_bw]:
        check_bandwidth("inter_node_bw_gbps", bw)


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

def print_json(obj: Any) -> None:
    """Strict JSON on stdout: non-finite numbers as null, never `NaN` / `Infinity`."""
    from autotune.files import dumps_json
    sys.stdout.write(dumps_json(obj) + "\n")
    sys.stdout.flush()


def stdout_console() -> Console:
    """A console on stdout: the terminal's width on a terminal (tables fold to fit, 80 columns
    included), PIPE_WIDTH in pipes and logs so wide tables are not squeezed."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=max(console.width, PIPE_WIDTH))
    return console


def spinner(message: str, enabled: bool):
    """A status spinner on stderr, only when stderr is a terminal (never in --json mode)."""
    err = Console(stderr=True)
    return err.status(message) if enabled and err.is_terminal else contextlib.nullcontext()


def print_table(con: Console, table: Table) -> None:
    """On a terminal too narrow for the bordered table, drop borders and padding and let cells
    fold over lines, so no value is cut to an ellipsis (an 80-column terminal included)."""
    if Measurement.get(con, con.options.update_width(10_000), table).maximum > con.width:
        table.box, table.pad_edge, table.padding = box.SIMPLE_HEAD, False, (0, 0)
        for column in table.columns:
            if isinstance(column.header, str):
                column.header = _stacked(column.header)
            column.overflow = "fold"
    con.print(table)


def _stacked(header: str) -> str:
    """A header over several short lines: at spaces, and after '/' in long words."""
    lines = []
    for word in header.split():
        parts = word.split("/")
        chunks = [p + "/" for p in parts[:-1]] + [parts[-1]]
        line = ""
        for chunk in chunks:
            if line and len(line) + len(chunk) > 6:
                lines.append(line)
                line = ""
            line += chunk
        lines.append(line)
    return "\n".join(lines)


def thousands(x: Optional[float], digits: int = 0) -> str:
    """12,345 (thousands separators) or '-' for a missing value."""
    return "-" if x is None else f"{x:,.{digits}f}"


# ---------------------------------------------------------------------------------------------
# The plan table: knob columns from search_spaces.space.KNOBS (label, fmt)
# ---------------------------------------------------------------------------------------------

#: knob columns holding words (left-aligned, may fold on a narrow terminal)
TEXT_KNOBS = ("recompute", "sp", "recompute_modules", "account_for_embedding", "account_for_loss")


def plans_table(reports: list, title: str = "Best plans", *, lead: tuple = (), fits_column: bool = True,
                compact: bool = False) -> Table:
    """A table of scored plans: '#', optional lead columns ((header, key) pairs read from each
    report), one column per knob (header Knob.label, cells Knob.fmt), then the metrics. `compact`
    puts the knobs in one "plan" column that wraps between knobs (for 80-column terminals)."""
    from autotune.report import knob_cell, knob_label, table_knobs
    knobs = table_knobs(reports)
    metrics = [("step (s)", "right"), ("tokens/s/GPU", "right"), ("TFLOP/s/GPU", "right"), ("MFU", "right"),
               ("mem GB", "right")] + ([("fits", "left")] if fits_column else [])
    if compact:
        knob_columns = [("plan", "left")]
    else:
        knob_columns = [(knob_label(k), "left" if k in TEXT_KNOBS else "right") for k in knobs]
    table = Table(title=title, title_justify="left")
    for header, justify in [("#", "right"), *((h, "right") for h, _ in lead), *knob_columns, *metrics]:
        table.add_column(header, justify=justify)
    for i, r in enumerate(reports, 1):
        p = r["plan"]
        cells = [knob_cell(k, p) for k in knobs]
        if compact:
            cells = [" ".join(f"{knob_label(k).replace(' ', '')}{'=' if k in TEXT_KNOBS else ''}{c}"
                              for k, c in zip(knobs, cells))]
        row = [str(i), *(str(r.get(key, "")) for _, key in lead), *cells,
               f"{r['step_time_s']:.3f}", thousands(r["tokens_per_s_per_gpu"]),
               thousands(r.get("model_tflops_per_gpu")), f"{r['mfu']:.1%}", f"{r['memory_gb']['total']:.1f}"]
        if fits_column:
            row.append("yes" if r.get("fits", True) else "NO")
        table.add_row(*row)
    return table


def print_plans(con: Console, reports: list, title: str = "Best plans", **kw) -> None:
    """The plan table, one column per knob when the terminal is wide enough, else one wrapped
    "plan" column (an 80-column terminal), so no value is cut."""
    table = plans_table(reports, title, **kw)
    if Measurement.get(con, con.options.update_width(10_000), table).maximum > con.width:
        table = plans_table(reports, title, compact=True, **kw)
    print_table(con, table)
