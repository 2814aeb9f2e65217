"""Start-up time of the CLI: `--help`, the listing commands and bad-input errors (issue 9: < 0.5 s).

Each command runs in a fresh interpreter (what a user waits for), N times; the median and the
best wall time are printed, and whether JAX or Optuna was imported on the way (they must not be:
they are imported inside the commands that score).

    python tests/benchmarks/bench_startup.py [--repeat 7]
    python tests/benchmarks/bench_startup.py --search [--repeat 3] [--sensitivity] [--code DIR]

`--search` times the issue's end-to-end command instead (`autotune search --model llama3.1-405b --gpu h100
--gpus 16384 --global-batch 2048 --seq-len 8192 --json --no-save`, process start included): once with an
empty JAX compilation cache (a machine's first run: XLA compiles), then `--repeat` times with that cache
warm. `--code DIR` runs another checkout's code (e.g. the commit before a change, for a ratio measured in
the same session).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--gpu", "h100", "--gpus", "8"]
CASES = {
    "autotune --help": ["--help"],
    "autotune --version": ["--version"],
    "autotune models": ["models"],
    "autotune search (unknown model)": ["search", "--model", "nope", *SMALL],
    "autotune search (bad --gpus)": ["search", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "0x8"],
    "autotune predict (bad --plan)": ["predict", "--model", "llama3-8b", *SMALL, "--plan", "tp=3"],
    "autotune explain (missing --model)": ["explain", *SMALL],
    "autotune search (YAML alias bomb)": ["search", "--model", "llama3-8b", *SMALL, "--cluster", "{laughs}"],
}
PROBE = ("import sys; sys.argv = ['autotune'] + sys.argv[1:]\n"
         "try:\n    from cli.main import app; app()\n"
         "finally:\n    sys.stderr.write('\\nIMPORTED ' + ' '.join(m for m in ('jax', 'optuna') if m in sys.modules) + '\\n')\n")


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_case(args: list[str], repeat: int) -> tuple[float, float, float, str, int]:
    """Median and best wall seconds, median CPU seconds (steadier on a shared machine), what was
    imported, the exit code."""
    times, cpu, imported, code = [], [], "", 0
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), _children_cpu_s()
        proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "AUTOTUNE_JAX_CACHE": ""})
        times.append(time.perf_counter() - t0)
        cpu.append(_children_cpu_s() - c0)
        code = proc.returncode
        imported = proc.stderr.rsplit("IMPORTED", 1)[-1].strip()
    return statistics.median(times), min(times), statistics.median(cpu), imported or "-", code


SEARCH = ["search", "--model", "llama3.1-405b", "--gpu", "h100", "--gpus", "16384", "--global-batch", "2048",
          "--seq-len", "8192", "--json", "--no-save"]


def time_search(repeat: int, sensitivity: bool, code: Path) -> None:
    """Cold (empty compilation cache) then warm runs of SEARCH: wall and CPU seconds of each."""
    import tempfile
    args = SEARCH + (["--sensitivity"] if sensitivity else [])
    with tempfile.TemporaryDirectory(prefix="autotune_jax_") as cache:
        env = {**os.environ, "AUTOTUNE_JAX_CACHE": cache, "PYTHONPATH": str(code)}
        print(f"{' '.join(args)}  (code: {code})")
        for i in range(repeat + 1):
            t0, c0 = time.perf_counter(), _children_cpu_s()
            proc = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True,
                                  cwd=code, env=env)
            wall, cpu = time.perf_counter() - t0, _children_cpu_s() - c0
            if proc.returncode:
                raise SystemExit(proc.stderr[-2000:])
            elapsed = json.loads(proc.stdout)["elapsed_s"]
            print(f"  {'cold (empty cache)' if i == 0 else f'warm {i}':<20} wall {wall:6.2f} s  CPU {cpu:6.2f} s  "
                  f"(reported search elapsed {elapsed:.2f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--search", action="store_true", help="time the 405B search end to end, cold and warm")
    ap.add_argument("--sensitivity", action="store_true", help="with --search: ask for the sensitivity section")
    ap.add_argument("--code", type=Path, default=REPO, help="with --search: the checkout whose code runs")
    opts = ap.parse_args()
    if opts.search:
        time_search(opts.repeat, opts.sensitivity, opts.code.resolve())
        return
    laughs = REPO / "results" / ".bench_laughs.yaml"
    laughs.parent.mkdir(exist_ok=True)
    laughs.write_text("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n")
    try:
        print(f"{'command':<40} {'median s':>9} {'best s':>7} {'CPU s':>6} {'exit':>5}  imported")
        for name, args in CASES.items():
            args = [a.replace("{laughs}", str(laughs)) for a in args]
            med, best, cpu, imported, code = time_case(args, opts.repeat)
            print(f"{name:<40} {med:>9.3f} {best:>7.3f} {cpu:>6.3f} {code:>5}  {imported}")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        print(f"{'(bare python interpreter)':<40} {time.perf_counter() - t0:>9.3f}")
    finally:
        laughs.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
