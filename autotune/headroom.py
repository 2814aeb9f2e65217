"""Memory headroom and ties: which plans the cost model cannot tell apart, and which to prefer.

A plan whose predicted peak memory is a hair under the limit is a gamble (allocator behaviour, NCCL
buffers and framework versions move peak memory by a few per cent), and two plans whose predicted step
times differ by less than the model's error are, for the model, equally fast. So the search keeps a
default headroom below the device's memory, marks the plans that tie with the fastest, and among those
recommends the one with the most memory to spare.
"""
from __future__ import annotations

from dataclasses import dataclass

#: Out-of-sample error of the cost model when it compares plans of one job: the mean regret of the
#: plan predicted fastest, leave-one-source-out (README "Accuracy", Ranking table: vTrain jobs with
#: >= 3 measured plans, LOSO mean regret 3.7 %, median 0.0 %). Per-run absolute errors are larger
#: (8-20 % LOSO MAPE) but are dominated by a per-source bias shared by all plans of a job, which
#: cancels when two plans of the same job are compared; the ranking regret is what does not cancel.
STEP_TIME_TIE_FRAC = 0.0373

#: Default share of the device memory kept free (`--memory-headroom 5%`).
DEFAULT_MEMORY_HEADROOM_FRAC = 0.05

#: A plan above this share of the device memory is flagged as at the limit.
AT_LIMIT_FRAC = 0.99


@dataclass(frozen=True)
class Headroom:
    """The device's usable memory and the limit a plan must fit in after keeping `frac` free."""
    device_limit_gb: float
    frac: float

    @property
    def limit_gb(self) -> float:
        return self.device_limit_gb * (1.0 - self.frac)

    def as_dict(self) -> dict:
        return {"headroom_frac": self.frac, "device_limit_gb": self.device_limit_gb, "limit_gb": self.limit_gb,
                "at_limit_frac": AT_LIMIT_FRAC}


def parse_fraction(text: str | float | None, field: str, default: float) -> float:
    """'5%', '5 %', '0.05' or 5 (read as per cent when > 1) -> 0.05; a one-line SpecError otherwise."""
    from costmodels.specs import SpecError
    if text is None:
        return default
    raw = str(text).strip()
    try:
        value = float(raw[:-1].strip()) / 100.0 if raw.endswith("%") else float(raw)
    except ValueError:
        raise SpecError(field, f"expected a share such as 5% or 0.05, got {text!r}") from None
    if not raw.endswith("%") and value > 1.0:
        value /= 100.0
    if not 0.0 <= value < 1.0:
        raise SpecError(field, f"must be in [0 %, 100 %), got {text!r}")
    return value


def headroom_for(device_limit_gb: float, frac: float = DEFAULT_MEMORY_HEADROOM_FRAC) -> Headroom:
    return Headroom(device_limit_gb=float(device_limit_gb), frac=float(frac))


def tie_group(step_times_s: list[float], tie_frac: float = STEP_TIME_TIE_FRAC) -> list[bool]:
    """For each plan, whether its step time is within `tie_frac` of the fastest (the first is the fastest
    only if the list is sorted; the minimum is used either way)."""
    if not step_times_s:
        return []
    best = min(step_times_s)
    return [t <= best * (1.0 + tie_frac) for t in step_times_s]


def annotate(report: dict, headroom: Headroom, tie_frac: float = STEP_TIME_TIE_FRAC) -> dict:
    """Mark ties and memory headroom on a search report (in place) and pick the recommended plan.

    Each plan of `top` gains `headroom_gb` (device memory minus its peak), `at_limit` (above AT_LIMIT_FRAC
    of the device memory) and `tie_with_best`; the report gains `headroom` and `ties`: the tolerance,
    the plans tied with the fastest and the recommended one (of the tied plans, the most headroom)."""
    top = report.get("top") or []
    ties = tie_group([r["step_time_s"] for r in top], tie_frac)
    for r, tied in zip(top, ties):
        _mark(r, headroom)
        r["tie_with_best"] = bool(tied)
    for key in ("best", "runner_up"):
        if report.get(key):
            _mark(report[key], headroom)
    tied_idx = [i for i, t in enumerate(ties) if t]
    rec = max(tied_idx, key=lambda i: (top[i]["headroom_gb"], -top[i]["step_time_s"])) if tied_idx else None
    report["headroom"] = headroom.as_dict()
    report["ties"] = {
        "tolerance_frac": tie_frac,
        "source": "README Accuracy, Ranking: LOSO mean regret of the predicted-fastest plan",
        "tied_with_best": tied_idx,
        "recommended_index": rec,
        "recommended": top[rec] if rec is not None else None,
    }
    return report


def _mark(r: dict, headroom: Headroom) -> None:
    total = r["memory_gb"]["total"]
    r["headroom_gb"] = headroom.device_limit_gb - total
    r["at_limit"] = bool(total > AT_LIMIT_FRAC * headroom.device_limit_gb)


def ties_sentence(report: dict) -> str:
    """One sentence for people: how many plans tie with the fastest and which one is recommended."""
    ties = report.get("ties")
    if not ties or not ties["tied_with_best"]:
        return ""
    n = len(ties["tied_with_best"])
    tol = ties["tolerance_frac"]
    rec_i = ties["recommended_index"]
    h = report["headroom"]
    head = (f"Memory headroom {h['headroom_frac']:.0%}: plans must fit in {h['limit_gb']:.1f} of "
            f"{h['device_limit_gb']:.1f} GB.")
    if n == 1:
        return head + f" No other listed plan is within the model's error ({tol:.1%}) of the fastest."
    rec = ties["recommended"]
    best = report["top"][0]
    if rec_i == 0:
        return (head + f" Plans 1-{max(ties['tied_with_best']) + 1} lie within the model's error ({tol:.1%}) of "
                f"the fastest, which also has the most memory headroom ({rec['headroom_gb']:.1f} GB): recommended.")
    return (head + f" {n} plans lie within the model's error ({tol:.1%}) of the fastest and are indistinguishable "
            f"(marked ≈ in the Markdown table); "
            f"recommended: #{rec_i + 1} ({rec['step_time_s'] / best['step_time_s'] - 1:+.1%} step time, "
            f"{rec['headroom_gb']:.1f} GB headroom vs {best['headroom_gb']:.1f} GB).")


def device_headroom(gpu: str | None, cluster_file: str | None, memory_limit_gb: float | None,
                    frac: float, num_gpus: int | None = None) -> Headroom | None:
    """The headroom of a problem given as CLI flags: the device memory is --memory-limit-gb if given,
    else the GPU preset's (or the cluster file's GPU's) memory. None when neither names a GPU (the
    problem's own check then reports the missing flag)."""
    from costmodels.presets import build_cluster, load_gpu
    if memory_limit_gb:
        return headroom_for(memory_limit_gb, frac)
    if gpu:
        return headroom_for(load_gpu(gpu).hbm_bytes / 1e9, frac)
    if cluster_file:       # the file's GPU; the count (--gpus, when the file has none) only to read it
        return headroom_for(build_cluster(cluster_file=cluster_file, num_gpus=num_gpus).gpu.hbm_bytes / 1e9, frac)
    return None
