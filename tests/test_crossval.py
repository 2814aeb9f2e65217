"""Out-of-sample and ranking machinery (autotune.crossval) on hand-checked cases."""
from __future__ import annotations

import pytest

from autotune import crossval as cv
from autotune.crossval import Run, error_figures, job_key, load_runs_of, predict_rows, rank_jobs
from costmodels.params import EfficiencyParams


def _run(rid, plan, step, gpus=8, dataset="small-scale"):
    row = {"id": rid, "source": {"group": "g"}, "hardware": {"gpu_key": "a100-80gb", "num_gpus": gpus},
           "model": {"name": "m", "layers": 2, "hidden": 64, "seq_len": 128},
           "plan": {"tp": plan[0], "pp": plan[1], "global_batch": 8, "precision_key": "fp16"}}
    return Run(row, dataset), step


def _preds(pairs):
    return {r.id: {"measured_step_s": meas, "predicted_step_s": pred, "error_pct": 100 * (meas / pred - 1)}
            for (r, meas), pred in pairs}


def test_ranking_figures_by_hand():
    a, b, c, d = _run("a", (1, 1), 1.0), _run("b", (2, 1), 1.2), _run("c", (4, 1), 1.5), _run("d", (8, 1), 2.0)
    # predicted order c < b < a < d: the pick (c) ran 1.5 s against the best 1.0 s -> regret 50 %;
    # the measured best (a) is third in the predicted order
    preds = _preds([(a, 0.9), (b, 0.8), (c, 0.7), (d, 1.0)])
    res = rank_jobs([a[0], b[0], c[0], d[0]], preds, min_plans=3)
    (job,) = res["jobs"]
    assert job["regret_pct"] == pytest.approx(50.0)
    assert not job["predicted_best_is_measured_best"] and job["measured_best_in_predicted_top3"]
    assert job["predicted_rank_of_measured_best"] == 3 and job["predicted_pick"]["ids"] == ["c"]
    assert res["summary"] == pytest.approx({"n_jobs": 1, "share_best": 0.0, "share_top3": 1.0,
                                            "mean_regret_pct": 50.0, "median_regret_pct": 50.0,
                                            "worst_regret_pct": 50.0})


def test_repeated_measurements_of_one_plan_merge_and_small_jobs_drop():
    a1, a2, b = _run("a1", (1, 1), 1.0), _run("a2", (1, 1), 3.0), _run("b", (2, 1), 1.5)
    preds = _preds([(a1, 1.0), (a2, 1.0), (b, 2.0)])
    assert rank_jobs([a1[0], a2[0], b[0]], preds, min_plans=3)["n_jobs"] == 0     # two distinct plans
    (job,) = rank_jobs([a1[0], a2[0], b[0]], preds, min_plans=2)["jobs"]
    assert job["n_plans"] == 2 and job["n_runs"] == 3
    # plan a's measurements merge at their median (2.0 s): b (1.5 s) is the measured best
    assert job["measured_best"]["ids"] == ["b"] and job["regret_pct"] == pytest.approx(100 * (2.0 / 1.5 - 1))
    other = _run("x", (1, 1), 1.0, gpus=16)[0]
    assert job_key(other.row) != job_key(a1[0].row)
    lora = _run("x-LoRA", (1, 1), 1.0)[0]          # fine-tuning adapters is another job than full training
    assert job_key(lora.row) != job_key(a1[0].row)


def test_a_perfect_predictor_ranks_every_small_scale_job_right():
    runs = [r for r in load_runs_of(("small-scale",))]
    from autotune.validate import case_from_row
    preds = {}
    for r in runs:
        it = r.row["measured"]["iteration_time_s"]
        preds[r.id] = {"measured_step_s": it, "predicted_step_s": it, "error_pct": 0.0}
    res = rank_jobs(runs, preds, min_plans=3)
    assert res["n_jobs"] == 68              # issue 11: 68 jobs with 3 or more measured plans
    assert res["summary"]["share_best"] == 1.0 and res["summary"]["worst_regret_pct"] == 0.0
    assert case_from_row(runs[0].row).problem.cluster.num_gpus == runs[0].row["hardware"]["num_gpus"]


def test_held_out_multi_node_jobs_are_ranked_near_their_measured_order():
    """vTrain's multi-node runs (never fitted; GPT 3.6B-175B, 4 jobs of 15-47 measured plans) ranked by the shipped
    defaults: the pick ran 1.3 % slower than the measured best on average, 4.5 % at worst, when this guard was
    set; the benchmark (bench_ranking.py) prints the per-job detail."""
    runs = load_runs_of(("vtrain-multi",))
    res = rank_jobs(runs, predict_rows(runs, EfficiencyParams()), min_plans=3)
    assert res["n_jobs"] == 4 and sorted(j["n_plans"] for j in res["jobs"]) == [15, 20, 26, 47]
    assert res["summary"]["mean_regret_pct"] < 2.5 and res["summary"]["worst_regret_pct"] < 6.0, res["summary"]


def test_error_figures_skip_non_finite():
    f = error_figures([10.0, -30.0, None, float("nan")])
    assert f == {"n": 2, "mape_pct": 20.0, "max_abs_error_pct": 30.0, "bias_pct": -10.0}


def test_every_run_is_held_out_once_and_never_trained_on(monkeypatch):
    runs = [_run(f"r{i}", (1, 1), 1.0)[0] for i in range(6)]
    groups = {r.id: ["x", "y", "z"][i % 3] for i, r in enumerate(runs)}
    seen_train = []

    def fake_calibrate(rows, start, **kw):
        seen_train.append({r["id"] for r in rows})
        return start, []

    monkeypatch.setattr(cv, "calibrate", fake_calibrate)
    monkeypatch.setattr(cv, "predict_steps", lambda cases, p: [])
    monkeypatch.setattr(cv, "predict_rows", lambda held, p: {r.id: {"error_pct": 0.0} for r in held})
    folds = cv.leave_one_group_out(runs, lambda r: groups[r.id])
    assert [f["held_out"] for f in folds] == ["x", "y", "z"]
    held = [set(f["predictions"]) for f in folds]
    assert sorted(i for h in held for i in h) == sorted(r.id for r in runs)
    for h, train in zip(held, seen_train):
        assert not h & train and h | train == {r.id for r in runs}


def _job(best_plan, regret, in_top3=True):
    return {"regret_pct": regret, "measured_best_in_predicted_top3": in_top3, "measured_best": {"plan": best_plan}}


def test_regret_by_measured_best_groups_and_shares_by_hand():
    jobs = [_job({"tp": 2, "micro_batch": 4}, 12.0, False), _job({"tp": 2, "micro_batch": 4}, 6.0),
            _job({"tp": 1, "micro_batch": 2}, 2.0), _job({"tp": 1, "micro_batch": 8}, 0.0)]
    groups = cv.regret_by_measured_best(jobs)
    assert [g["measured_best"] for g in groups] == [{"tp": 2, "micro_batch": 4}, {"tp": 1, "micro_batch": 2},
                                                    {"tp": 1, "micro_batch": 8}]
    assert [g["n_jobs"] for g in groups] == [2, 1, 1] and [g["top3_misses"] for g in groups] == [1, 0, 0]
    assert [g["regret_share"] for g in groups] == pytest.approx([0.9, 0.1, 0.0])
    # no regret at all: every share 0, never a division by zero
    assert all(g["regret_share"] == 0.0 for g in cv.regret_by_measured_best([_job({"tp": 1}, 0.0)]))
    # rank_jobs carries the breakdown; its shares add up to 1 when there is regret
    a, b, c = _run("a", (1, 1), 1.0), _run("b", (2, 1), 1.2), _run("c", (4, 1), 1.5)
    res = rank_jobs([a[0], b[0], c[0]], _preds([(a, 0.9), (b, 0.8), (c, 0.7)]), min_plans=3)
    assert sum(g["regret_share"] for g in res["by_measured_best"]) == pytest.approx(1.0)


def _timed_row(dp, mbs, gbs, step_s, layers=2):
    return {"hardware": {"gpu_key": "a100-80gb", "num_gpus": 2 * dp},
            "model": {"name": "m", "layers": layers, "hidden": 64, "seq_len": 128},
            "plan": {"tp": 2, "pp": 1, "dp": dp, "micro_batch": mbs, "global_batch": gbs, "precision_key": "fp16"},
            "measured": {"iteration_time_s": step_s}}


@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_micro_batch_structure_tells_composed_times_from_separate_runs(noise):
    """Step = fixed + m x per-micro-batch exactly (and the same per-micro-batch time at every dp) is what
    composed step times look like; a 1 % scatter, what separate runs give."""
    rows = []
    for dp in (1, 2):
        for i, m in enumerate((2, 4, 8, 16)):
            wobble = noise * (1 if (i + dp) % 2 else -1)
            rows.append(_timed_row(dp, 2, dp * 2 * m, (0.005 * dp + 0.040 * m) * (1 + wobble)))
    rows.append(_timed_row(1, 2, 8, float("nan")))           # unusable measurements are skipped
    rows.append({"plan": {}, "measured": {}})
    st = cv.micro_batch_structure(rows)
    assert st["plans_fitted"] == 2 and st["dp_groups"] == 1
    if noise:
        assert st["max_residual"] > 1e-3 and st["max_dp_spread"] > 1e-3
    else:
        assert st["max_residual"] < 1e-12 and st["max_dp_spread"] < 1e-12


def test_micro_batch_structure_needs_three_micro_batch_counts():
    rows = [_timed_row(1, 2, 2 * m, 0.01 + 0.04 * m) for m in (2, 4)]
    assert cv.micro_batch_structure(rows) == {"plans_fitted": 0, "max_residual": None, "median_residual": None,
                                              "dp_groups": 0, "max_dp_spread": None, "median_dp_spread": None}
