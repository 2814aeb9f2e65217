"""Measured runs for calibration: public-runs JSON split by GPU, and Megatron-LM training logs.

Fitting itself is `autotune.calibrate` (Adam through the cost model); this module prepares its
inputs, holds out a split, reports MAPE before and after, and writes/reads calibration files
({"gpu": ..., "params": {...}, "fit": {...}}).

Megatron-LM log format (megatron/training/training.py, `training_log` and `report_memory`):

    [2024-05-01 10:00:00] iteration       20/    1000 | consumed samples:        10240 |
        elapsed time per iteration (ms): 7350.2 | throughput per GPU (TFLOP/s/GPU): 402.7 |
        learning rate: 1.5E-05 | global batch size:   512 | lm loss: 7.9E+00 | ...
    [Rank 0] (after 10 iterations) memory (MB) | allocated: 18234.5 | max allocated: 61234.7 |
        reserved: 64000.0 | max reserved: 64000.0

(one line each). Other lines are ignored.
"""
from __future__ import annotations

import math
import random
import re
import statistics

from costmodels.encode import encode_cluster, encode_job, encode_model
from costmodels.params import PARAM_BOUNDS, EfficiencyParams, params_from_dict, params_to_dict
from costmodels.plan import Plan
from costmodels.specs import SpecError
from search_spaces.space import Problem

from costmodels.files import read_text

from .files import dumps_json, read_json, write_text_atomic
from .calibrate import DEFAULT_FIT, FitCase, build_cases, calibrate, fit, mape_pct, parameter_report
from .validate import repeated_runs, repeats_warning

# ------------------------------------------------------------------------------------------------
# Megatron-LM logs
# ------------------------------------------------------------------------------------------------

_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_MEM = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\)")
_NUM = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def _fields(line: str, start: int) -> dict:
    out = {}
    for part in line[start:].split("|"):
        if ":" in part:
            k, v = part.split(":", 1)
            out[k.strip()] = v.strip()
    return out


def _number(text: str | None, what: str, path: str, lineno: int) -> float:
    if text is None:
        raise SpecError("megatron-log", f"{path}:{lineno}: {what} missing from the line")
    if not _NUM.match(text):
        raise SpecError("megatron-log", f"{path}:{lineno}: {what} is not a number ({text!r})")
    x = float(text)
    if not math.isfinite(x) or x < 0:
        raise SpecError("megatron-log", f"{path}:{lineno}: {what} must be a non-negative number ({text!r})")
    return x


def parse_megatron_log(text: str, path: str = "log") -> dict:
    """Iteration and memory lines of a Megatron-LM log -> {"iterations": [...], "memory": [...]}.

    A line that starts like an iteration or memory line but lacks a field or has a non-number raises
    SpecError naming the line number; a log with no iteration line at all is an error too."""
    iters, mems = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        m = _ITER.search(line)
        if m:
            f = _fields(line, m.end())
            it = {"line": lineno, "iteration": int(m.group(1)), "train_iters": int(m.group(2)),
                  "elapsed_ms": _number(f.get("elapsed time per iteration (ms)"),
                                        "'elapsed time per iteration (ms)'", path, lineno)}
            if "throughput per GPU (TFLOP/s/GPU)" in f:
                it["tflops_per_gpu"] = _number(f["throughput per GPU (TFLOP/s/GPU)"],
                                               "'throughput per GPU (TFLOP/s/GPU)'", path, lineno)
            if "global batch size" in f:
                it["global_batch"] = int(_number(f["global batch size"], "'global batch size'", path, lineno))
            if it["elapsed_ms"] <= 0:
                raise SpecError("megatron-log", f"{path}:{lineno}: elapsed time per iteration must be > 0")
            iters.append(it)
            continue
        m = _MEM.search(line)
        if m:
            f = _fields(line, m.end())
            mem = {"line": lineno, "rank": int(m.group(1)), "after_iterations": int(m.group(2))}
            for key in ("allocated", "max allocated", "reserved", "max reserved"):
                if key in ("allocated", "max allocated") or key in f:
                    mem[key.replace(" ", "_") + "_mb"] = _number(f.get(key), f"'{key}'", path, lineno)
            mems.append(mem)
    if not iters:
        raise SpecError("megatron-log", f"{path}: no iteration lines ('iteration N/ M | ... | "
                        "elapsed time per iteration (ms): X | ...') found")
    return {"iterations": iters, "memory": mems}


def read_megatron_log(path: str) -> dict:
    return parse_megatron_log(read_text(path, "megatron-log", errors="replace"), path)


def log_summary(parsed: dict) -> dict:
    """Steady-state numbers: the median over iteration lines after the first (warm-up) one."""
    its = parsed["iterations"]
    steady = its[1:] if len(its) > 1 else its
    out = {"n_iteration_lines": len(its), "n_used": len(steady),
           "step_time_s": statistics.median(i["elapsed_ms"] for i in steady) / 1e3}
    tf = [i["tflops_per_gpu"] for i in steady if "tflops_per_gpu" in i]
    if tf:
        out["tflops_per_gpu"] = statistics.median(tf)
    gb = {i["global_batch"] for i in its if "global_batch" in i}
    if gb:
        out["global_batch"] = sorted(gb)[-1]
    if parsed["memory"]:       # report_memory prints MiB (utils: mega_bytes = 1024 * 1024); GB = 1e9 bytes
        out["max_reserved_gb"] = max((m.get("max_reserved_mb", 0.0) for m in parsed["memory"]), default=0.0) * MIB / 1e9
        out["max_allocated_gb"] = max(m["max_allocated_mb"] for m in parsed["memory"]) * MIB / 1e9
    return out


def case_from_log(problem: Problem, plan: Plan, step_time_s: float, name: str = "megatron-log") -> FitCase:
    return FitCase(id=name, group=name, plan=plan.row(), model=encode_model(problem.model),
                   hw=encode_cluster(problem.cluster), job=encode_job(problem.job, problem.cluster),
                   measured_step_s=float(step_time_s))


def calibrate_from_log(problem: Problem, plan: Plan, parsed: dict, params: EfficiencyParams | None = None,
                       *, steps: int = 400, log_path: str = "log") -> dict:
    """Fit to one measured plan (the log's steady step time). One run pins one number, so the
    prior of `fit` keeps the parameters that it cannot identify at their starting values."""
    params = params or EfficiencyParams()
    summ = log_summary(parsed)
    if "global_batch" in summ and summ["global_batch"] != problem.job.global_batch:
        raise SpecError("global-batch", f"the log says global batch size {summ['global_batch']}, "
                        f"but --global-batch is {problem.job.global_batch}")
    cases = [case_from_log(problem, plan, summ["step_time_s"])]
    before = mape_pct(cases, params)
    fitted = fit(cases, params, DEFAULT_FIT, steps=steps)
    after = mape_pct(cases, fitted)
    return {"gpu": problem.cluster.gpu.name, "params": params_to_dict(fitted),
            "fit": {"source": log_path, "kind": "megatron-log", "log": summ, "plan": plan.as_dict(),
                    "n_train": 1, "n_holdout": 0, "mape_train_before_pct": before,
                    "mape_train_after_pct": after, "mape_holdout_before_pct": None,
                    "mape_holdout_after_pct": None, "fitted": list(DEFAULT_FIT)},
            **_honesty(fitted, params)}


# ------------------------------------------------------------------------------------------------
# Public-runs JSON
# ------------------------------------------------------------------------------------------------

def rows_for_gpu(rows: list, gpu: str) -> list:
    return [r for r in rows if isinstance(r, dict) and (r.get("hardware") or {}).get("gpu_key") == gpu]


def split_rows(rows: list, holdout_frac: float, seed: int) -> tuple[list, list]:
    if not 0.0 <= holdout_frac < 1.0:
        raise SpecError("holdout-frac", f"must be in [0, 1), got {holdout_frac!r}")
    idx = list(range(len(rows)))
    random.Random(seed).shuffle(idx)
    n_hold = int(round(holdout_frac * len(rows)))
    if n_hold >= len(rows):
        n_hold = len(rows) - 1
    hold = sorted(idx[:n_hold])
    train = sorted(idx[n_hold:])
    return [rows[i] for i in train], [rows[i] for i in hold]


def calibrate_runs(rows: list, gpu: str, *, holdout_frac: float = 0.2, seed: int = 0,
                   params: EfficiencyParams | None = None, rounds: int = 2, steps: int = 400,
                   source: str = "measurements") -> dict:
    """Fit on the runs of one GPU (a held-out share kept aside) and report MAPE before and after."""
    params = params or EfficiencyParams()
    mine = [r for r in rows_for_gpu(rows, gpu) if r.get("usable", True)]
    if not mine:
        gpus = sorted({(r.get("hardware") or {}).get("gpu_key") for r in rows if isinstance(r, dict)} - {None})
        raise SpecError("gpu", f"no usable run for GPU {gpu!r} in {source} (GPUs there: {', '.join(gpus) or 'none'})")
    train, hold = split_rows(mine, holdout_frac, seed)
    fitted, train_cases = calibrate(train, params, rounds=rounds, steps=steps)
    before_train = mape_pct(build_cases(train, params), params)
    after_train = mape_pct(train_cases, fitted)
    before_hold = mape_pct(build_cases(hold, params), params) if hold else None
    after_hold = mape_pct(build_cases(hold, fitted), fitted) if hold else None
    clean = lambda x: None if x is None or (isinstance(x, float) and math.isnan(x)) else x   # noqa: E731
    repeats = repeated_runs(mine)        # runs no calibration can fit together
    honesty = _honesty(fitted, params)
    if warning := repeats_warning(repeats):
        honesty["warnings"].append(warning)
    return {"gpu": gpu, "params": params_to_dict(fitted),
            "fit": {"source": source, "kind": "runs", "holdout_frac": holdout_frac, "seed": seed,
                    "rounds": rounds, "steps": steps,
                    "n_train": len(train_cases), "n_holdout": len(build_cases(hold, fitted)) if hold else 0,
                    "train_ids": [r.get("id") for r in train], "holdout_ids": [r.get("id") for r in hold],
                    "mape_train_before_pct": clean(before_train), "mape_train_after_pct": clean(after_train),
                    "mape_holdout_before_pct": clean(before_hold), "mape_holdout_after_pct": clean(after_hold),
                    "fitted": list(DEFAULT_FIT), "repeats": repeats},
            **honesty}


def _honesty(fitted: EfficiencyParams, start: EfficiencyParams) -> dict:
    """`parameters`: each fitted parameter with its literature prior, bound, start, fitted value and
    ratio to the prior; `warnings`: one line per parameter that moved far (see parameter_report)."""
    report = parameter_report(fitted, DEFAULT_FIT, start)
    return {"parameters": report, "warnings": [e["warning"] for e in report if e["warning"]]}


# ------------------------------------------------------------------------------------------------
# Calibration files
# ------------------------------------------------------------------------------------------------

def write_calibration(doc: dict, path: str) -> None:
    write_text_atomic(path, dumps_json(doc) + "\n", "out")


def read_calibration(path: str) -> tuple[EfficiencyParams, dict]:
    doc = read_json(path, "calibration")
    if not isinstance(doc, dict) or not isinstance(doc.get("params", {}), dict):
        raise SpecError("calibration", f"{path} must hold an object with a \"params\" object")
    for name, value in doc.get("params", {}).items():
        check_param_value(name, value, path)
    try:
        return params_from_dict(doc.get("params", {})), doc
    except (ValueError, TypeError) as exc:
        raise SpecError("calibration", f"{path}: {exc}") from None


def check_param_value(name: str, value, path: str) -> None:
    """A calibration value must be a finite number inside the parameter's physical range
    (`PARAM_BOUNDS`): `gemm_eff_max: 0` or `mem_fixed_bytes: -1e15` would be silently wrong answers."""
    field = f"calibration.params.{name}"
    if name not in PARAM_BOUNDS:
        raise SpecError(field, f"{path}: unknown parameter; known: {', '.join(PARAM_BOUNDS)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(field, f"{path}: must be a finite number, got {value!r}")
    lo, hi = PARAM_BOUNDS[name]
    slack = 1e-6 * max(abs(lo), abs(hi), 1e-12)           # float rounding of a fitted value at a bound
    if not lo - slack <= value <= hi + slack:
        raise SpecError(field, f"{path}: {value!r} is outside the physical range [{lo:g}, {hi:g}]")


def calibration_for_gpu(path: str | None, gpu: str) -> tuple[EfficiencyParams, str]:
    """Parameters from a calibration file, refused when it was fitted for another GPU."""
    if not path:
        return EfficiencyParams(), "defaults"
    params, doc = read_calibration(path)
    file_gpu = doc.get("gpu")
    if file_gpu is not None and str(file_gpu).lower() != str(gpu).lower():
        raise SpecError("calibration", f"{path} was fitted for GPU {file_gpu!r}, but this problem runs on "
                        f"{gpu!r}; fit one for {gpu} with `autotune calibrate RUNS.json --gpu {gpu} -o FILE`")
    return params, path



# ------------------------------------------------------------------------------------------------
# What a Megatron-LM log says about its own job (calibrate --megatron-log; issue 13)
# ------------------------------------------------------------------------------------------------

MIB = 2 ** 20
#: relative gap between the log's peak memory and the plan's prediction above which calibrate warns
#: (issue 14's memory target: within 15 %)
MEMORY_WARN_FRAC = 0.15


_WORLD = re.compile(r"using world size: (\d+), data-parallel size: (\d+), context-parallel size: (\d+), .*?"
                    r"tensor-model-parallel size: (\d+), pipeline-model-parallel size: (\d+)")


def megatron_log_job(text: str) -> dict:
    """World size, TP, PP, DP, CP, global batch and sequence length from the top of a Megatron-LM log:
    the "using world size: ..." line and the argument dump (arguments.py _print_args); the keys it
    lacks are absent. `args` holds the dump ({} without one)."""
    from .export import parse_megatron_arg_dump

    args = parse_megatron_arg_dump(text)
    out: dict = {"args": args}
    m = _WORLD.search(text)
    if m:       # initialize's summary line (arguments.py validate_args), also in logs without the dump
        out.update(world_size=int(m.group(1)), dp=int(m.group(2)), cp=int(m.group(3)), tp=int(m.group(4)),
                   pp=int(m.group(5)))
    for key, name in (("world_size", "world_size"), ("tp", "tensor_model_parallel_size"),
                      ("pp", "pipeline_model_parallel_size"), ("dp", "data_parallel_size"),
                      ("cp", "context_parallel_size"), ("global_batch", "global_batch_size"),
                      ("seq_len", "seq_length")):
        v = args.get(name)
        if v is not None and re.fullmatch(r"\d+", v.strip()):
            out[key] = int(v)
    # the MTP modules the run built (Megatron's default None: none)
    mtp = args.get("mtp_num_layers")
    if mtp is not None and (mtp.strip() == "None" or re.fullmatch(r"\d+", mtp.strip())):
        out["mtp_num_layers"] = 0 if mtp.strip() == "None" else int(mtp)
    # the layers whose activations it offloaded to host memory (Megatron's default 0: none)
    off = args.get("cpu_offloading_num_layers")
    if off is not None and re.fullmatch(r"\d+", off.strip()):
        out["cpu_offloading_num_layers"] = int(off)
    return out


def peak_memory_gb(parsed: dict) -> tuple[float, str] | None:
    """(GB = 1e9 bytes, which figure) of the log's peak: max reserved when logged, else max allocated
    (Megatron's report_memory prints MiB)."""
    mems = parsed.get("memory") or []
    if not mems:
        return None
    if any("max_reserved_mb" in m for m in mems):
        return max(m.get("max_reserved_mb", 0.0) for m in mems) * MIB / 1e9, "max reserved"
    return max(m["max_allocated_mb"] for m in mems) * MIB / 1e9, "max allocated"


def memory_warning(parsed: dict, predicted_gb: float, tolerance: float = MEMORY_WARN_FRAC) -> str | None:
    """A warning line when the log's peak memory and the plan's predicted memory differ by more than
    `tolerance` (None when they agree or the log has no memory line)."""
    peak = peak_memory_gb(parsed)
    if peak is None or peak[0] <= 0:
        return None
    gap = predicted_gb / peak[0] - 1.0
    if abs(gap) <= tolerance:
        return None
    return (f"the log's peak memory ({peak[1]} {peak[0]:.1f} GB) and the plan's predicted {predicted_gb:.1f} GB differ "
            f"by {gap:+.0%} (more than {tolerance:.0%}): check that --plan is the plan that ran")


def calibrate_megatron_log(path: str, *, model: str, gpu: str, gpus: int | None = None,
                           global_batch: int | None = None, seq_len: int | None = None, precision: str = "bf16",
                           gpus_per_node: int | None = None, plan: str | None = None, steps: int = 400) -> dict:
    """`calibrate --megatron-log`: the world size, TP, PP, DP, global batch and sequence length come
    from the log's argument dump when it has one (a flag given too must agree with it), the plan from
    its parallelism arguments unless --plan is given; the fit is `calibrate_from_log`. The result's
    `memory_warning` says when the log's peak memory disagrees with the plan's predicted memory."""
    from .export import plan_from_megatron_args
    from .problem import build_problem, plan_from_text
    from .search import predict

    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError as exc:
        raise SpecError("megatron-log", f"cannot read {path}: {exc.strerror or exc}") from None
    parsed = parse_megatron_log(text, path)
    job = megatron_log_job(text)
    read = []
    for name, given, key in (("gpus", gpus, "world_size"), ("global-batch", global_batch, "global_batch"),
                             ("seq-len", seq_len, "seq_len")):
        if key in job and given is not None and given != job[key]:
            raise SpecError(name, f"--{name} is {given}, but the log ran with {key.replace('_', ' ')} {job[key]}")
        if key in job and given is None:
            read.append(key)
    gpus = gpus if gpus is not None else job.get("world_size")
    if gpus is None:
        raise SpecError("gpus", f"{path} has no argument dump (world_size); give --gpus")
    if global_batch is None:
        gbs = [i["global_batch"] for i in parsed["iterations"] if "global_batch" in i]
        global_batch = job.get("global_batch", gbs[-1] if gbs else None)
    problem = build_problem(model=model, gpu=gpu, gpus=gpus, global_batch=global_batch,
                            seq_len=seq_len if seq_len is not None else job.get("seq_len"), precision=precision,
                            gpus_per_node=gpus_per_node, framework={"mtp_num_layers": job.get("mtp_num_layers"),
                                                                    "cpu_offloading_num_layers":
                                                                        job.get("cpu_offloading_num_layers")})
    read += [key for key in ("mtp_num_layers", "cpu_offloading_num_layers") if key in job]
    if plan:
        the_plan = plan_from_text(plan, problem)
        for knob in ("tp", "pp", "dp", "cp"):
            if knob in job and getattr(the_plan, knob) != job[knob]:
                raise SpecError(f"plan.{knob}", f"--plan has {knob}={getattr(the_plan, knob)}, but the log ran with "
                                f"{knob}={job[knob]}")
    elif job["args"]:
        the_plan = plan_from_text(str(plan_from_megatron_args(job["args"], gpus, problem.model.num_layers,
                                                              problem.model.is_moe)), problem)
        read.append("plan")
    else:
        raise SpecError("plan", f"{path} has no argument dump to read the plan from; give --plan")
    doc = calibrate_from_log(problem, the_plan, parsed, steps=steps, log_path=path)
    doc["fit"]["read_from_log"] = read
    predicted = predict(problem, the_plan)["memory_gb"]["total"]
    peak = peak_memory_gb(parsed)
    doc["fit"]["memory"] = {"predicted_gb": predicted, "log_peak_gb": peak[0] if peak else None,
                            "log_figure": peak[1] if peak else None}
    doc["memory_warning"] = memory_warning(parsed, predicted)
    return doc


def load_params(calibration: str | None, gpu: str | None = None) -> tuple[EfficiencyParams, str]:
    """Efficiency parameters: a calibration file if given, else the shipped defaults. With `gpu`,
    a file fitted for another GPU is refused (one-line SpecError naming the fix)."""
    if not calibration:
        return EfficiencyParams(), "defaults"
    if gpu is not None:
        return calibration_for_gpu(calibration, gpu)
    return read_calibration(calibration)[0], calibration
