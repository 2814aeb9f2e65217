"""Capacity planning: how many GPUs of each type, how long, how much money and energy to train N tokens.

For every GPU type and a geometric grid of GPU counts (whole nodes), the exhaustive search finds the
fastest plan that fits; the training-time, cost, energy and failure arithmetic then runs over all counts
at once (numpy arrays over counts), and the count that meets the deadline at the least cost (or energy)
is picked.

Symbols (units in names):
    D        tokens to train                        N      GPUs
    t_step   predicted step time (s)                B*S    tokens per step (global batch x sequence)
    W        failure-free compute time = ceil(D / (B*S)) * t_step
    M        job MTBF = per-GPU MTBF / N (failures of independent GPUs add up)
    C        time to write a checkpoint (s)         R      time to restart after a failure (s)
    tau      checkpoint interval, Young's rule tau = sqrt(2 C M) (Young 1974, "A first order
             approximation to the optimum checkpoint interval", CACM 17(9); Daly 2006, FGCS 22(3), eq. 11
             as its first-order term)
    wall     expected wall time with failures, first-order model (Daly 2006 sec. 3): every tau of work
             pays C, and each failure (rate 1/M of wall time) loses on average tau/2 of work plus R:
             wall = W (1 + C/tau) / (1 - (tau/2 + R) / M);  goodput = W / wall
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from costmodels.specs import SpecError, check_size

#: Per-GPU mean time between job-interrupting failures. Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of
#: Models", sec. 3.3.4): 419 unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100s
#: -> 54 * 24 * 16,384 / 419 = 50,677 GPU-hours per interruption.
LLAMA3_INTERRUPTIONS, LLAMA3_SNAPSHOT_DAYS, LLAMA3_GPUS = 419, 54, 16384
DEFAULT_GPU_MTBF_HOURS = LLAMA3_SNAPSHOT_DAYS * 24 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS

#: Assumed time to write a checkpoint and to restart after a failure (reschedule, reload, warm up);
#: both are inputs (--checkpoint-s, --restart-s): storage and schedulers differ by an order of magnitude.
DEFAULT_CHECKPOINT_S = 60.0
DEFAULT_RESTART_S = 600.0

#: Board power (maximum TDP) per GPU in W, from the vendors' datasheets; GPU power only (no host, network
#: or cooling): --power-w overrides it per GPU type.
GPU_POWER_W = {
    "a100-40gb": 400.0,   # NVIDIA A100 datasheet, SXM: max TDP 400 W
    "a100-80gb": 400.0,   # same
    "h100": 700.0,        # NVIDIA H100 datasheet, SXM: max TDP up to 700 W
    "h200": 700.0,        # NVIDIA H200 datasheet, SXM: max TDP up to 700 W
    "h800": 700.0,        # H800 SXM5: the H100 SXM board, 700 W
    "b200": 1000.0,       # NVIDIA HGX B200 datasheet: up to 1,000 W per GPU
    "b300": 1100.0,       # NVIDIA HGX B300 datasheet: up to 1,100 W per GPU
    "gb200": 1200.0,      # NVIDIA GB200 NVL72: 1,200 W per Blackwell GPU
    "gb300": 1400.0,      # NVIDIA GB300 NVL72: 1,400 W per Blackwell Ultra GPU
    "mi300x": 750.0,      # AMD Instinct MI300X datasheet: 750 W peak board power
}

SECONDS_PER = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
OBJECTIVES = ("cost", "energy")
#: GPU counts per octave of the grid: n, 1.25n, 1.5n, 1.75n for n a power-of-two number of nodes
GRID_STEPS = (1.0, 1.25, 1.5, 1.75)
DEFAULT_MAX_GPUS = 32768
#: The most tokens a capacity plan takes: 10^18, ~10^4 times the largest published pre-training runs (a few
#: 10^13 tokens); above it the figures are day counts hundreds of digits long, not a plan.
MAX_TOKENS = 1e18


# ---------------------------------------------------------------------------------------------
# Parsing at the edge
# ---------------------------------------------------------------------------------------------

def parse_duration_s(text: str, field: str = "deadline") -> float:
    """'90d', '12w', '2160h', '1.5e6s' or a bare number of days -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(s|min|m|h|d|w)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise SpecError(field, f"expected a duration such as 90d, 12w or 2160h, got {text!r}")
    value = float(m.group(1)) * SECONDS_PER[(m.group(2) or "d").lower()]
    if not (value > 0 and math.isfinite(value)):
        raise SpecError(field, f"must be a positive, finite duration, got {text!r}")
    return value


def parse_per_gpu(text: str | None, field: str, gpus: list[str]) -> dict:
    """'h100=2.5,b200=4' (or one bare number for every GPU type) -> {gpu: float}; names must be among `gpus`."""
    if not text:
        return {}
    out = {}
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep:
            name, value = "*", name
        try:
            number = float(value)
        except ValueError:
            raise SpecError(field, f"{value!r} is not a number (expected e.g. h100=2.5)") from None
        if not number > 0 or not math.isfinite(number):
            raise SpecError(field, f"{name.strip()}={value} must be a positive number")
        name = name.strip().lower()
        if name != "*" and name not in gpus:
            raise SpecError(field, f"{name!r} is not one of the GPU types asked for ({', '.join(gpus)})")
        if name in out:
            raise SpecError(field, f"{'the bare value' if name == '*' else repr(name)} is given twice")
        out[name] = number
    if "*" in out:
        star = out.pop("*")
        out = {g: out.get(g, star) for g in gpus}
    return out


# ---------------------------------------------------------------------------------------------
# The arithmetic (pure functions over arrays of GPU counts)
# ---------------------------------------------------------------------------------------------

def young_daly_interval_s(checkpoint_s, job_mtbf_s):
    """Young's optimum checkpoint interval sqrt(2 C M) (Young 1974; Daly 2006 first-order term)."""
    return np.sqrt(2.0 * np.asarray(checkpoint_s, dtype=float) * np.asarray(job_mtbf_s, dtype=float))


def goodput(checkpoint_s, restart_s, job_mtbf_s, interval_s=None):
    """Useful work / wall time under the first-order failure model (module docstring); 0 where the job
    would never finish (a failure every interval)."""
    c, r, m = (np.asarray(x, dtype=float) for x in (checkpoint_s, restart_s, job_mtbf_s))
    tau = young_daly_interval_s(c, m) if interval_s is None else np.asarray(interval_s, dtype=float)
    lost = 1.0 - (tau / 2.0 + r) / m
    return np.where(lost > 0, lost / (1.0 + c / tau), 0.0)


@dataclass(frozen=True)
class FailureModel:
    gpu_mtbf_hours: float = DEFAULT_GPU_MTBF_HOURS
    checkpoint_s: float = DEFAULT_CHECKPOINT_S
    restart_s: float = DEFAULT_RESTART_S

    def __post_init__(self):
        for name, flag in (("gpu_mtbf_hours", "mtbf_hours"), ("checkpoint_s", "checkpoint_s")):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise SpecError(flag, f"must be a positive number, got {value!r}")
        if not (self.restart_s >= 0 and math.isfinite(self.restart_s)):
            raise SpecError("restart_s", f"must be a number >= 0, got {self.restart_s!r}")
        mtbf_s = self.gpu_mtbf_hours * 3600.0        # the job MTBF of one GPU, the longest any job has
        if not goodput(self.checkpoint_s, self.restart_s, mtbf_s) > 0:
            culprit = ("mtbf_hours" if mtbf_s < DEFAULT_CHECKPOINT_S + DEFAULT_RESTART_S else
                       "checkpoint_s" if self.checkpoint_s >= self.restart_s else "restart_s")
            raise SpecError(culprit, f"a failure every {self.gpu_mtbf_hours:g} h per GPU leaves no time for a "
                            f"{self.checkpoint_s:g} s checkpoint and a {self.restart_s:g} s restart: even on one "
                            f"GPU no training would finish (goodput 0)")


def training_figures(gpus, step_time_s, *, tokens: float, tokens_per_step: float, failures: FailureModel,
                     price_per_gpu_hour: float | None, power_w: float | None) -> dict:
    """Time, GPU-hours, cost, energy and goodput for arrays of (GPU count, step time)."""
    n = np.asarray(gpus, dtype=float)
    t_step = np.asarray(step_time_s, dtype=float)
    steps = math.ceil(tokens / tokens_per_step)
    compute_s = steps * t_step
    job_mtbf_s = failures.gpu_mtbf_hours * 3600.0 / n
    tau = young_daly_interval_s(failures.checkpoint_s, job_mtbf_s)
    good = goodput(failures.checkpoint_s, failures.restart_s, job_mtbf_s, tau)
    wall_s = np.where(good > 0, compute_s / np.where(good > 0, good, 1.0), np.inf)
    gpu_hours = n * wall_s / 3600.0
    return {
        "steps": steps,
        "compute_days": compute_s / 86400.0,
        "wall_days": wall_s / 86400.0,
        "gpu_hours": gpu_hours,
        "cost": gpu_hours * price_per_gpu_hour if price_per_gpu_hour else np.full_like(n, np.nan),
        "energy_kwh": gpu_hours * power_w / 1000.0 if power_w else np.full_like(n, np.nan),
        "job_mtbf_hours": job_mtbf_s / 3600.0,
        "checkpoint_interval_s": tau,
        "goodput": good,
    }


def gpu_count_grid(gpus_per_node: int, min_gpus: int, max_gpus: int) -> list[int]:
    """Whole nodes on a geometric grid (4 counts per doubling), within [min_gpus, max_gpus]."""
    counts, nodes = set(), 1
    while nodes * gpus_per_node <= max_gpus:
        for f in GRID_STEPS:
            n = int(round(nodes * f)) * gpus_per_node
            if min_gpus <= n <= max_gpus:
                counts.add(n)
        nodes *= 2
    return sorted(counts)


# ---------------------------------------------------------------------------------------------
# The plan per GPU type
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CapacityRequest:
    model: str
    tokens: float
    gpus: tuple
    deadline_s: float | None = None
    prices: dict = field(default_factory=dict)          # $ per GPU-hour by GPU type
    power_w: dict = field(default_factory=dict)         # W per GPU by GPU type (default GPU_POWER_W)
    failures: FailureModel = FailureModel()
    objective: str = "cost"
    global_batch: int | None = None
    seq_len: int | None = None
    precision: str = "bf16"
    min_gpus: int = 1
    max_gpus: int = DEFAULT_MAX_GPUS
    memory_headroom_frac: float = 0.05
    calibration: str | None = None

    def __post_init__(self):
        if not (self.tokens > 0 and math.isfinite(self.tokens)):
            raise SpecError("tokens", f"must be a positive number of tokens, got {self.tokens!r}")
        if self.tokens > MAX_TOKENS:
            raise SpecError("tokens", f"{self.tokens:g} is larger than the supported maximum {MAX_TOKENS:g}")
        if not self.gpus:
            raise SpecError("gpu", "give at least one GPU type (--gpu h100 --gpu b200 ...)")
        twice = sorted({g for g in self.gpus if self.gpus.count(g) > 1})
        if twice:
            raise SpecError("gpu", f"{', '.join(twice)} given twice")
        if self.objective not in OBJECTIVES:
            raise SpecError("objective", f"unknown objective {self.objective!r}; choose cost or energy")
        if not self.min_gpus >= 1:
            raise SpecError("min_gpus", f"must be a positive number of GPUs, got {self.min_gpus!r}")
        if not self.min_gpus <= self.max_gpus:
            raise SpecError("max_gpus", f"need 1 <= min_gpus ({self.min_gpus}) <= max_gpus ({self.max_gpus})")
        check_size("gpus", self.max_gpus, "max_gpus")


def _rank_key(objective: str, row: dict) -> tuple:
    cost = row["cost"] if row["cost"] is not None else row["gpu_hours"]
    energy = row["energy_kwh"] if row["energy_kwh"] is not None else row["gpu_hours"]
    primary = cost if objective == "cost" else energy
    return (primary, row["wall_days"])


def _num(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def plan_gpu_type(req: CapacityRequest, gpu: str) -> dict:
    """Every GPU count of the grid for one GPU type: the best plan, the training figures; and the pick."""
    from .measurements import load_params
    from .problem import build_problem
    from .search import exhaustive
    from .headroom import headroom_for
    from .scoring import Inputs
    from .search import NoLegalPlan, NothingFits
    from costmodels.presets import RACK_SCALE_DOMAIN, load_gpu

    # whole nodes; a rack-scale NVLink domain (NVL72) is shared by jobs in steps of RACK_SCALE_DOMAIN GPUs
    per_node = load_gpu(gpu).gpus_per_node
    step = per_node if per_node <= RACK_SCALE_DOMAIN else RACK_SCALE_DOMAIN
    probe = build_problem(model=req.model, gpu=gpu, gpus=per_node, global_batch=req.global_batch,
                              seq_len=req.seq_len, precision=req.precision)
    params, _ = load_params(req.calibration, probe.cluster.gpu.name)
    counts = gpu_count_grid(step, req.min_gpus, req.max_gpus)
    rows, skipped = [], {"no legal plan": [], "nothing fits": []}
    for n in counts:
        problem = build_problem(model=req.model, gpu=gpu, gpus=n, global_batch=req.global_batch,
                                    seq_len=req.seq_len, precision=req.precision)
        room = headroom_for(Inputs(problem).memory_limit_bytes / 1e9, req.memory_headroom_frac)
        try:
            res = exhaustive(problem, params, top_k=1, memory_limit_gb=room.limit_gb)
        except NoLegalPlan:
            skipped["no legal plan"].append(n)
            continue
        except NothingFits:
            skipped["nothing fits"].append(n)
            continue
        rows.append({"gpus": n, "plan": res.best["plan"], "step_time_s": res.best["step_time_s"],
                     "mfu": res.best["mfu"], "memory_gb": res.best["memory_gb"]["total"],
                     "memory_limit_gb": room.limit_gb})
    price = req.prices.get(gpu)
    power = req.power_w.get(gpu, GPU_POWER_W.get(probe.cluster.gpu.name))
    tokens_per_step = probe.job.global_batch * probe.job.seq_len
    if rows:
        figs = training_figures([r["gpus"] for r in rows], [r["step_time_s"] for r in rows], tokens=req.tokens,
                                tokens_per_step=tokens_per_step, failures=req.failures,
                                price_per_gpu_hour=price, power_w=power)
        for i, r in enumerate(rows):
            r.update({k: (_num(v[i]) if isinstance(v, np.ndarray) else v) for k, v in figs.items()})
    finite = [r for r in rows if r["wall_days"] is not None]
    meets = [r for r in finite if req.deadline_s is None or r["wall_days"] * 86400.0 <= req.deadline_s]
    pick = min(meets, key=lambda r: _rank_key(req.objective, r)) if meets else None
    fastest = min(finite, key=lambda r: r["wall_days"]) if finite else None
    return {"gpu": probe.cluster.gpu.name, "gpus_per_node": per_node,
            "price_per_gpu_hour": price, "power_w": power, "global_batch": probe.job.global_batch,
            "seq_len": probe.job.seq_len, "tokens_per_step": tokens_per_step, "counts_tried": counts,
            "skipped": skipped, "rows": rows, "pick": pick, "fastest": fastest,
            "meets_deadline": pick is not None}


def what_would_help(req: CapacityRequest, per_gpu: list[dict]) -> list[str]:
    """Sentences for a deadline nothing (or not every GPU type) meets: other GPU types, more GPUs, a batch."""
    if req.deadline_s is None:
        return []
    days = req.deadline_s / 86400.0
    out = []
    winners = [g["gpu"] for g in per_gpu if g["meets_deadline"]]
    for g in per_gpu:
        if g["meets_deadline"]:
            continue
        f = g["fastest"]
        if f is None:
            why = ("no legal plan" if not g["skipped"]["nothing fits"] else
                   f"no plan fits in memory (legal plans exist at {', '.join(map(str, g['skipped']['nothing fits'][:4]))}"
                   f"{' ...' if len(g['skipped']['nothing fits']) > 4 else ''} GPUs)")
            out.append(f"{g['gpu']}: {why} at any GPU count from {req.min_gpus} to {req.max_gpus} tried "
                       f"({len(g['counts_tried'])} counts).")
            continue
        text = (f"{g['gpu']}: the fastest is {f['wall_days']:.1f} days on {f['gpus']} GPUs "
                f"({f['wall_days'] / days:.2f}x the {days:g}-day deadline)")
        largest = max(r["gpus"] for r in g["rows"])
        above = [n for n in g["counts_tried"] if n > largest]
        scaling = f["gpus"] == largest
        if scaling and not above:
            need = f["gpus"] * f["wall_days"] / days
            text += (f"; it still speeds up at --max-gpus {req.max_gpus}: try more GPUs (linear scaling "
                     f"would need >= {need:,.0f})")
        elif scaling and above:
            text += (f"; no legal plan above {largest} GPUs: the global batch of {g['global_batch']} sequences "
                     f"caps data parallelism")
            bigger = _larger_batch(req, g, largest)
            if bigger is not None and bigger["wall_days"] < f["wall_days"]:
                text += (f"; with global batch {2 * g['global_batch']}: {bigger['wall_days']:.1f} days on "
                         f"{bigger['gpus']} GPUs{' (meets it)' if bigger['wall_days'] <= days else ''}")
        else:
            text += f"; more GPUs do not help (slower above {f['gpus']} GPUs)"
            bigger = _larger_batch(req, g, f["gpus"] - 1)
            if bigger is not None and bigger["wall_days"] < f["wall_days"]:
                text += (f"; a larger global batch does ({2 * g['global_batch']}: {bigger['wall_days']:.1f} days on "
                         f"{bigger['gpus']} GPUs{', meets it' if bigger['wall_days'] <= days else ''})")
        if winners:
            text += f"; {', '.join(winners)} meet{'s' if len(winners) == 1 else ''} it"
        out.append(text + ".")
    return out


def _larger_batch(req: CapacityRequest, g: dict, largest: int) -> dict | None:
    """The fastest row with twice the global batch, on up to 4x the GPU counts the batch capped (a check of
    the advice, not a guess); None when that has no plan either."""
    from dataclasses import replace
    wider = replace(req, global_batch=2 * g["global_batch"], seq_len=g["seq_len"], min_gpus=largest + 1,
                    max_gpus=min(req.max_gpus, 4 * largest))
    return plan_gpu_type(wider, g["gpu"])["fastest"]


def capacity_plan(req: CapacityRequest) -> dict:
    """The capacity report (JSON-ready): per GPU type the grid of counts and the pick, and the advice."""
    per_gpu = [plan_gpu_type(req, g) for g in req.gpus]
    picks = [g for g in per_gpu if g["pick"] is not None]
    overall = min(picks, key=lambda g: _rank_key(req.objective, g["pick"])) if picks else None
    return {
        "kind": "capacity",
        "model": req.model,
        "tokens": req.tokens,
        "deadline_days": None if req.deadline_s is None else req.deadline_s / 86400.0,
        "objective": req.objective,
        "failures": {"gpu_mtbf_hours": req.failures.gpu_mtbf_hours, "checkpoint_s": req.failures.checkpoint_s,
                     "restart_s": req.failures.restart_s,
                     "rule": "checkpoint interval sqrt(2 * checkpoint_s * job MTBF) (Young/Daly); job MTBF = "
                             "GPU MTBF / GPUs"},
        "memory_headroom_frac": req.memory_headroom_frac,
        "per_gpu": per_gpu,
        "best_gpu": overall["gpu"] if overall else None,
        "advice": what_would_help(req, per_gpu),
    }


def capacity_lines(report: dict) -> list[str]:
    """The capacity report in plain sentences (the Markdown/HTML summary and the CLI's footer)."""
    f = report["failures"]
    lines = [f"{report['model']}: {report['tokens']:.3g} tokens"
             + (f", deadline {report['deadline_days']:g} days" if report["deadline_days"] else "")
             + f", least {report['objective']}; memory headroom {report['memory_headroom_frac']:.0%}; failures: "
               f"GPU MTBF {f['gpu_mtbf_hours']:,.0f} h, checkpoint {f['checkpoint_s']:g} s, restart {f['restart_s']:g} s "
               f"(interval sqrt(2 x checkpoint x job MTBF))."]
    for g in report["per_gpu"]:
        pick = g["pick"]
        if pick is None:
            lines.append(f"{g['gpu']}: nothing meets the deadline.")
            continue
        cost = f"${pick['cost']:,.0f}" if pick["cost"] is not None else "no price given"
        energy = f"{pick['energy_kwh']:,.0f} kWh" if pick["energy_kwh"] is not None else "no power given"
        lines.append(f"{g['gpu']}: {pick['gpus']} GPUs, {pick['wall_days']:.1f} days ({pick['compute_days']:.1f} "
                     f"failure-free), {pick['gpu_hours']:,.0f} GPU-hours, {cost}, {energy}, goodput "
                     f"{pick['goodput']:.1%} (checkpoint every {pick['checkpoint_interval_s'] / 60:.0f} min, job "
                     f"MTBF {pick['job_mtbf_hours']:.1f} h), MFU {pick['mfu']:.1%}, plan {_plan_str(pick['plan'])}.")
    if report["best_gpu"]:
        lines.append(f"Least {report['objective']}: {report['best_gpu']}.")
    lines += report["advice"]
    return lines


def _plan_str(plan: dict) -> str:
    from .labels import plan_text
    return plan_text(plan)


def render_markdown(report: dict) -> str:
    lines = [f"# Capacity plan: {report['model']}", ""] + [f"- {s}" for s in capacity_lines(report)] + [""]
    for g in report["per_gpu"]:
        lines += [f"## {g['gpu']}", "", "| GPUs | days | GPU-hours | cost | kWh | goodput | MFU | plan |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in g["rows"]:
            mark = " **(pick)**" if g["pick"] is r else ""
            lines.append(f"| {r['gpus']}{mark} | {_fmt(r['wall_days'], '.1f')} | {_fmt(r['gpu_hours'], ',.0f')} | "
                         f"{_fmt(r['cost'], ',.0f')} | {_fmt(r['energy_kwh'], ',.0f')} | {r['goodput']:.1%} | "
                         f"{r['mfu']:.1%} | `{_plan_str(r['plan'])}` |")
        lines.append("")
    return "\n".join(lines)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)
