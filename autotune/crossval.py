"""Judging the cost model out of sample and by ranking (DESIGN.md "Calibrate"; issue 11).

* `predict_rows`: every measured run predicted the way `autotune validate` does (the published plan,
  knobs the source omits filled with the best value among plans that fit), all runs scored in one
  call of the jitted cost model.
* `leave_one_group_out`: for each group (a source, a GPU generation), fit the efficiency parameters
  on the other groups with `autotune.calibrate.calibrate`, starting from the literature prior, and
  predict the held-out group. The shipped defaults were fitted on every run, so only these
  predictions are out of sample.
* `rank_jobs`: group measured runs of the same job (model, GPU type and count, global batch,
  sequence, precision) and ask whether the plan predicted fastest was the one measured fastest,
  whether the measured fastest is in the predicted top 3, and how much slower the predicted pick
  really ran than the measured best (the regret).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from costmodels.params import LITERATURE_PRIOR, EfficiencyParams

from .calibrate import DEFAULT_FIT, build_cases, calibrate, parameter_report, predict_steps
from .datasets import gpu_generation
from .validate import is_lora, source_of

#: subsets reported separately
SUBSETS = ("public-dense", "public-moe", "small-scale")


@dataclass(frozen=True)
class Run:
    """A measured run and where it comes from."""
    row: dict
    dataset: str            # "public" | "small-scale" | a file name

    @property
    def id(self) -> str:
        return self.row.get("id", "?")

    @property
    def source(self) -> str:
        return source_of(self.row).get("group") or "?"

    @property
    def generation(self) -> str:
        return gpu_generation((self.row.get("hardware") or {}).get("gpu_key"))

    @property
    def subset(self) -> str:
        if self.dataset == "small-scale":
            return "small-scale"
        return "public-moe" if (self.row.get("model") or {}).get("num_experts") else "public-dense"


def load_runs_of(datasets=("public", "small-scale"), only_usable: bool = True) -> list[Run]:
    from .datasets import load_dataset
    runs = []
    for name in datasets:
        runs += [Run(r, name) for r in load_dataset(name)
                 if isinstance(r, dict) and (r.get("usable", True) or not only_usable)]
    return runs


def predict_rows(runs: list[Run], params: EfficiencyParams) -> dict:
    """id -> {"measured_step_s", "predicted_step_s", "error_pct" (tokens/s, signed), "plan"}; runs
    that cannot be expressed or have no finite measurement are absent."""
    cases = build_cases([r.row for r in runs], params)
    if not cases:
        return {}
    pred = predict_steps(cases, params)
    out = {}
    for c, p in zip(cases, pred):
        p = float(p)
        out[c.id] = {"measured_step_s": c.measured_step_s, "predicted_step_s": p,
                     "error_pct": 100.0 * (c.measured_step_s / p - 1.0) if math.isfinite(p) and p > 0 else None,
                     "plan": dict(c.plan)}
    return out


def error_figures(errors) -> dict:
    """n, MAPE, max abs error and mean signed error (bias: > 0 predicts too fast) in percent."""
    e = np.array([x for x in errors if x is not None and math.isfinite(x)], dtype=float)
    if not len(e):
        return {"n": 0, "mape_pct": None, "max_abs_error_pct": None, "bias_pct": None}
    return {"n": int(len(e)), "mape_pct": float(np.mean(np.abs(e))),
            "max_abs_error_pct": float(np.max(np.abs(e))), "bias_pct": float(np.mean(e))}


def figures_by(runs: list[Run], preds: dict, key) -> dict:
    groups: dict = {}
    for r in runs:
        if r.id in preds:
            groups.setdefault(key(r), []).append(preds[r.id]["error_pct"])
    return {g: error_figures(e) for g, e in sorted(groups.items())}


def leave_one_group_out(runs: list[Run], group_of, *, start: EfficiencyParams = LITERATURE_PRIOR,
                        rounds: int = 2, steps: int = 400, lr: float = 0.05, pull: float = 0.02,
                        names=DEFAULT_FIT, progress=None) -> list[dict]:
    """For each group: fit on the runs of every other group (calibrate, from `start`), predict the
    held-out group. Returns one fold per group with its predictions and the fitted parameters'
    report (which moved far from the literature). `lr`, `pull` (the pull towards `start`), `rounds`
    and `steps` are calibrate's; a group_of that puts every run in one group gives the in-sample
    refit with the same procedure (held out = trained on)."""
    groups = sorted({group_of(r) for r in runs})
    folds = []
    for g in groups:
        held = [r for r in runs if group_of(r) == g]
        train = [r for r in runs if group_of(r) != g] or (held if len(groups) == 1 else [])
        if progress:
            progress(f"fold {g!r}: fit on {len(train)} runs, predict {len(held)}")
        if not train:
            continue
        fitted, cases = calibrate([r.row for r in train], start, names=names, rounds=rounds, steps=steps,
                                  lr=lr, prior=pull)
        train_err = [100.0 * (c.measured_step_s / float(p) - 1.0)
                     for c, p in zip(cases, predict_steps(cases, fitted))]
        folds.append({"held_out": g, "n_train_runs": len(train), "params": fitted,
                      "train": error_figures(train_err), "predictions": predict_rows(held, fitted),
                      "flagged": [e["name"] for e in parameter_report(fitted, names, start) if e["flags"]]})
    return folds


# ------------------------------------------------------------------------------------------------
# Ranking
# ------------------------------------------------------------------------------------------------

_JOB_MODEL = ("name", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "num_experts", "top_k",
              "moe_ffn_hidden")
_PLAN = ("tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch", "recompute_key", "sequence_parallel", "zero_key")


def job_key(row: dict) -> tuple:
    """Runs of the same job: same model (its full name, so variants such as token-dropping are
    apart), GPU type and count, global batch, sequence length and precision, and what trains (a LoRA
    run is another job than full training of the same shape)."""
    m, hw, p = row.get("model") or {}, row.get("hardware") or {}, row.get("plan") or {}
    return (tuple(m.get(k) for k in _JOB_MODEL), hw.get("gpu_key"), hw.get("num_gpus"), p.get("global_batch"),
            m.get("seq_len"), p.get("precision_key"), is_lora(row))


def plan_key(row: dict) -> tuple:
    """The published plan (None where the source omits a knob)."""
    p = row.get("plan") or {}
    return tuple(p.get(k) for k in _PLAN)


def _job_label(row: dict) -> str:
    m, hw, p = row.get("model") or {}, row.get("hardware") or {}, row.get("plan") or {}
    return (f"{m.get('name')} / {hw.get('num_gpus')} x {hw.get('gpu_key')} / GBS {p.get('global_batch')} x "
            f"{m.get('seq_len')} / {p.get('precision_key')}")


def rank_jobs(runs: list[Run], preds: dict, min_plans: int = 3) -> dict:
    """Per job with at least `min_plans` distinct published plans (repeated measurements of one
    plan are merged at their median): is the predicted-fastest plan the measured-fastest, is the
    measured-fastest in the predicted top 3, and the regret = measured step of the predicted pick
    / best measured step - 1. Summary: share best, share top-3, mean / median / worst regret."""
    jobs: dict = {}
    for r in runs:
        if r.id in preds and preds[r.id]["error_pct"] is not None:
            jobs.setdefault(job_key(r.row), []).append(r)
    results = []
    for key, members in jobs.items():
        plans: dict = {}
        for r in members:
            plans.setdefault(plan_key(r.row), []).append(r)
        if len(plans) < min_plans:
            continue
        entries = []
        for pk, rs in plans.items():
            meas = float(np.median([preds[r.id]["measured_step_s"] for r in rs]))
            entries.append({"ids": [r.id for r in rs], "measured_step_s": meas,
                            "predicted_step_s": float(preds[rs[0].id]["predicted_step_s"]),
                            "plan": dict(zip(_PLAN, pk))})
        meas = np.array([e["measured_step_s"] for e in entries])
        pred = np.array([e["predicted_step_s"] for e in entries])
        best_meas = int(np.argmin(meas))
        order = np.argsort(pred, kind="stable")
        pick = int(order[0])
        results.append({
            "job": _job_label(members[0].row), "source": members[0].source, "dataset": members[0].dataset,
            "n_plans": len(entries), "n_runs": len(members),
            "predicted_best_is_measured_best": bool(meas[pick] <= meas[best_meas]),
            "measured_best_in_predicted_top3": bool(best_meas in order[:3].tolist()
                                                    or meas[pick] <= meas[best_meas]),
            "regret_pct": float(100.0 * (meas[pick] / meas[best_meas] - 1.0)),
            "measured_best": entries[best_meas], "predicted_pick": entries[pick],
            "predicted_rank_of_measured_best": int(np.where(order == best_meas)[0][0]) + 1,
        })
    results.sort(key=lambda j: -j["regret_pct"])
    return {"min_plans": min_plans, "n_jobs": len(results), "summary": ranking_summary(results),
            "by_measured_best": regret_by_measured_best(results), "jobs": results}


def regret_by_measured_best(jobs: list[dict], knobs=("tp", "micro_batch")) -> list[dict]:
    """Where a ranking's regret comes from: the jobs grouped by their measured-fastest plan's knobs, each
    group with its number of jobs, its share of the summed regret and its top-3 misses, the largest share
    first. Regret that one group carries points at that group's measurements or at one term of the model,
    not at the ranking as a whole."""
    total = float(sum(j["regret_pct"] for j in jobs))
    groups: dict = {}
    for j in jobs:
        groups.setdefault(tuple(j["measured_best"]["plan"].get(k) for k in knobs), []).append(j)
    out = [{"measured_best": dict(zip(knobs, key)), "n_jobs": len(js),
            "regret_share": float(sum(j["regret_pct"] for j in js)) / total if total > 0 else 0.0,
            "top3_misses": sum(not j["measured_best_in_predicted_top3"] for j in js)}
           for key, js in groups.items()]
    return sorted(out, key=lambda g: (-g["regret_share"], -g["n_jobs"]))


def micro_batch_structure(rows: list[dict]) -> dict:
    """How a dataset's step times depend on the number of micro-batches m = global batch / (dp x
    micro-batch). For every plan measured at three or more m (same model, GPUs, sequence, precision and
    plan): the least-squares line step = fixed + m x per-micro-batch and its largest residual relative to
    the mean step. For plans that differ only in data parallelism (and so in GPU count): the spread of
    their per-micro-batch times, (max - min) / mean. Separate runs scatter by their run-to-run noise (two
    runs of one 175B plan in vTrain's multi-node set differ by 5e-4); residuals and spreads at floating-point
    rounding say the step times were composed from fewer measurements (one per micro-batch and plan cell,
    say), so the rows are not independent evidence and a ranking over them weighs each such cell by how many
    jobs it appears in."""
    by_plan: dict = {}
    for r in rows:
        p, hw, m = r.get("plan") or {}, r.get("hardware") or {}, r.get("model") or {}
        step = ((r.get("measured") or {}).get("iteration_time_s"))
        try:
            n_mb = int(p["global_batch"]) // (int(p["dp"]) * int(p["micro_batch"]))
            step = float(step)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            continue
        if not (math.isfinite(step) and step > 0 and n_mb > 0):
            continue
        key = (tuple(m.get(k) for k in _JOB_MODEL), hw.get("gpu_key"), hw.get("num_gpus"), m.get("seq_len"),
               p.get("precision_key"), plan_key(r))
        by_plan.setdefault(key, []).append((n_mb, step))
    residuals, slopes = [], {}
    for key, pts in by_plan.items():
        pts = sorted(set(pts))
        if len({n for n, _ in pts}) < 3:
            continue
        n, t = np.array(pts, dtype=float).T
        coef = np.polyfit(n, t, 1)
        residuals.append(float(np.max(np.abs(t - np.polyval(coef, n))) / t.mean()))
        dp_free = key[:2] + key[3:5] + tuple(v for k, v in zip(_PLAN, key[5]) if k != "dp")
        slopes.setdefault(dp_free, []).append(float(coef[0]))
    spreads = [(max(v) - min(v)) / float(np.mean(v)) for v in slopes.values() if len(v) > 1]
    return {"plans_fitted": len(residuals),
            "max_residual": max(residuals) if residuals else None,
            "median_residual": float(np.median(residuals)) if residuals else None,
            "dp_groups": len(spreads), "max_dp_spread": max(spreads) if spreads else None,
            "median_dp_spread": float(np.median(spreads)) if spreads else None}


def ranking_summary(jobs: list[dict]) -> dict:
    if not jobs:
        return {"n_jobs": 0, "share_best": None, "share_top3": None, "mean_regret_pct": None,
                "median_regret_pct": None, "worst_regret_pct": None}
    reg = np.array([j["regret_pct"] for j in jobs])
    return {"n_jobs": len(jobs),
            "share_best": float(np.mean([j["predicted_best_is_measured_best"] for j in jobs])),
            "share_top3": float(np.mean([j["measured_best_in_predicted_top3"] for j in jobs])),
            "mean_regret_pct": float(reg.mean()), "median_regret_pct": float(np.median(reg)),
            "worst_regret_pct": float(reg.max())}
