"""Optuna search (issue 4): legal define-by-run sampling, batched ask/tell, constraints, seeding,
resume, the Pareto front against the exhaustive scorer, storages, the CLI, and bad input.

Problems are small (8..32 GPUs, some knobs pinned) so the whole file runs in well under a minute.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optuna
import pytest
from typer.testing import CliRunner

from autotune import optuna_search as osr
from autotune.api import build_problem
from autotune.optuna_search import BatchScorer, StudySpec, optuna_search
from autotune.search import NothingFits, exhaustive
from autotune.samplers import LegalSampler
from autotune.storage import open_storage, redact_url, scrub
from cli.main import app
from costmodels.plan import PLAN_FIELDS, PlanBatch
from costmodels.specs import SpecError
from search_spaces.optuna_space import GPUS, GpuRange, PlanSpace, parse_gpus
from search_spaces.space import check_rows, count_legal, enumerate_legal

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(model="llama3-8b", gpu="h100", gpus="8", global_batch=16, seq_len=4096)
SMALL_CLI = ["--model", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--global-batch", "16", "--seq-len", "4096"]
runner = CliRunner()

optuna.logging.set_verbosity(optuna.logging.WARNING)


def run_cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(result, code: int, *needles: str) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    assert "Traceback" not in result.stdout + result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------------------------
# The space: one definition, legal sampling
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_space():
    spec = StudySpec(**SMALL).resolved()
    return spec, spec.build_space()


def test_table_is_the_legal_enumeration(small_space):
    spec, space = small_space
    problem = space.problem(8)
    plans = space.legal_plans(8)
    assert len(plans) == count_legal(problem).legal
    legal, _ = check_rows({f: np.asarray(plans[f]) for f in PLAN_FIELDS}, problem)
    assert legal.all()
    stream, _ = enumerate_legal(problem)
    ref = {tuple(int(b[f][i]) for f in PLAN_FIELDS) for b in stream for i in range(len(b))}
    got = {tuple(int(plans[f][i]) for f in PLAN_FIELDS) for i in range(len(plans))}
    assert got == ref


def test_distributions_derive_from_the_knob_domains(small_space):
    _, space = small_space
    # dense model: ep and etp have one value each, so they are constants, not parameters
    assert space.constants == {"ep": 1, "etp": 1}
    # the Optuna-only knobs (uneven end stages, block recompute) come last
    assert list(space.distributions) == ["tp", "cp", "pp", "vpp", "mbs", "recompute", "recompute_modules", "sp",
                                         "zero", "account_for_embedding", "account_for_loss",
                                         "first_layers", "last_layers", "recompute_layers"]
    assert space.distributions["tp"].log and not space.distributions["recompute"].log
    assert (space.distributions["zero"].low, space.distributions["zero"].high) == (0, 3)


def assert_trials_legal(space, n: int, sampler: str, trials: int, seed: int) -> None:
    """Ask `trials` trials of `sampler` (told random values) and check each plan against every rule."""
    study = optuna.create_study(sampler=osr.make_sampler(sampler, seed, space, 1), direction="maximize")
    problem = space.problem(n)
    for _ in range(trials):
        trial = study.ask()
        _, plan = space.suggest(trial)
        legal, counts = check_rows({f: np.array([plan[f]]) for f in PLAN_FIELDS}, problem)
        assert legal[0], (plan, counts)
        study.tell(trial, float(np.random.default_rng(trial.number).random()))


@pytest.mark.parametrize("sampler", ["table", "tpe", "random", "nsga2", "cmaes"])
def test_every_trial_is_a_legal_plan(small_space, sampler):
    assert_trials_legal(small_space[1], 8, sampler, trials=60, seed=3)


def test_projection_picks_the_nearest_legal_value(small_space):
    _, space = small_space
    legal_pp = space.legal_values("pp", {"tp": 8, "cp": 1})
    assert list(legal_pp) == [1]                       # 8 GPUs, tp=8: pp must be 1
    assert space.project("pp", 4, {"tp": 8, "cp": 1}) == 1
    assert space.project("tp", 3, {}) in (2, 4)


def test_gpu_range_is_the_first_knob_and_counts_are_whole_nodes():
    r = parse_gpus("256-2048")
    assert isinstance(r, GpuRange) and r.counts(8)[:3] == (256, 264, 272) and r.counts(8)[-1] == 2048
    assert parse_gpus("256-2048:pow2").counts(8) == (256, 512, 1024, 2048)
    assert parse_gpus("16-64:16").counts(8) == (16, 32, 48, 64)
    assert parse_gpus("1-16").counts(8) == (1, 2, 4, 8, 16)
    assert parse_gpus("512") == 512
    spec = StudySpec(**{**SMALL, "gpus": "8-32:pow2"}).resolved()
    space = spec.build_space()
    assert space.is_range and list(space.distributions)[0] == GPUS and space.counts == (8, 16, 32)


@pytest.mark.parametrize("text,needle", [("300-303", "holds no GPU count"), ("64-8", "empty"),
                                         ("8-64:12", "multiple of the node size"), ("a-b", "expected"),
                                         ("8-64:xyz", "unknown range step")])
def test_bad_gpu_ranges_name_the_field(text, needle):
    with pytest.raises(SpecError) as exc:
        parse_gpus(text).counts(8)
    assert exc.value.field == "gpus" and needle in str(exc.value)


def test_neighbors_are_legal_and_sorted(small_space):
    _, space = small_space
    plans = space.legal_plans(8)
    params = space.params_of(8, {f: int(plans[f][len(plans) // 2]) for f in PLAN_FIELDS})
    nb = space.neighbors(params)
    assert nb and all(space.is_legal(c) for _, c in nb)
    assert [d for d, _ in nb] == sorted(d for d, _ in nb)


# ---------------------------------------------------------------------------------------------
# Search: the exhaustive optimum, constraints, seeding, resume
# ---------------------------------------------------------------------------------------------

PINNED = {"zero": 1, "recompute": 0, "sp": 1, "first_layers": 0, "last_layers": 0}   # 67 legal plans


def test_tpe_reaches_the_exhaustive_optimum_on_a_small_space():
    problem = build_problem(**{**SMALL, "gpus": 8})
    ref = exhaustive(problem, fixed=PINNED)
    res = optuna_search(StudySpec(**SMALL, fixed=PINNED, seed=0), n_trials=120, seed_best=False)
    assert res.best["plan"] == ref.best["plan"]
    assert res.best["step_time_s"] == pytest.approx(ref.best["step_time_s"], rel=1e-5)
    assert res.strategy == "optuna" and res.extra["optuna"]["n_trials"] == 120


MESH = {"tp": 2, "cp": 1, "pp": 4, "vpp": 1, "mbs": 1, "sp": 1, "zero": 1}
MESH_PROBLEM = dict(model="llama3-8b", gpu="h100", gpus="16", global_batch=64, seq_len=4096)


def test_optuna_only_knobs_are_searched_and_beat_the_even_split():
    """Uneven end stages and block recompute exist only in the Optuna space: with the mesh pinned,
    the search over recompute x first_layers x last_layers x recompute_layers finds the best of a
    brute-force scoring of every legal combination, which is not the even split (llama3-8b's output
    layer over a 128k vocabulary costs ~2 layers on the last stage)."""
    from autotune.scoring import Inputs, score_summary
    from costmodels.params import EfficiencyParams
    from costmodels.plan import PlanBatch
    from search_spaces.space import domains

    problem = build_problem(**{**MESH_PROBLEM, "gpus": 16})
    dom = domains(problem, MESH, optuna_only=True)
    grid = np.meshgrid(*[np.asarray(dom[k]) for k in dom], indexing="ij")
    arrays = {k: g.reshape(-1).astype(np.int64) for k, g in zip(dom, grid)}
    arrays["dp"] = 16 // (arrays["tp"] * arrays["cp"] * arrays["pp"])
    arrays["layout"] = np.zeros_like(arrays["tp"])
    legal, _ = check_rows(arrays, problem)
    batch = PlanBatch({f: arrays[f][legal].astype(np.int32) for f in PLAN_FIELDS})
    steps, mems = score_summary(batch, Inputs(problem), EfficiencyParams())
    fits = mems <= Inputs(problem).memory_limit_bytes
    best = int(np.argmin(np.where(fits, steps, np.inf)))
    even = exhaustive(problem, fixed=MESH).best["step_time_s"]
    assert batch["last_layers"][best] > 0 and steps[best] < even * 0.97

    res = optuna_search(StudySpec(**MESH_PROBLEM, fixed=MESH, seed=0), n_trials=150)
    assert res.best["step_time_s"] <= steps[best] * 1.01
    assert res.best["plan"]["last_layers"] > 0
    assert len(batch) > 150                        # the search did not just score every combination


def test_local_moves_are_legal_and_reach_the_optimum():
    """LegalSampler's local moves (the nearest untried neighbours of the best plans, then the pattern
    move) only ever propose legal plans and find the exhaustive optimum of a small space."""
    spec = StudySpec(**SMALL, fixed=PINNED, seed=2).resolved()
    space = spec.build_space()
    base = optuna.samplers.TPESampler(seed=2, multivariate=True, n_startup_trials=8, constant_liar=True)
    sampler = LegalSampler(base, space, refine=0.7, refine_after=8, incumbents=3, retries=3, seed=2)
    study = optuna.create_study(sampler=sampler, direction="minimize")
    scorer = BatchScorer(space, spec.params(), None)
    problem = space.problem(8)
    for _ in range(60):
        trial = study.ask()
        n, plan = space.suggest(trial)
        legal, _ = check_rows({f: np.array([plan[f]]) for f in PLAN_FIELDS}, problem)
        assert legal[0]
        step, mem = scorer.score(np.array([n]), PlanBatch({f: np.array([plan[f]], dtype=np.int32) for f in PLAN_FIELDS}))
        trial.set_constraint(osr.CONSTRAINT, float(mem[0] - scorer.limit_bytes(n)) / 1e9)
        study.tell(trial, float(step[0]))
    ref = exhaustive(build_problem(**{**SMALL, "gpus": 8}), fixed=PINNED)
    best = min(t.value for t in study.trials if t.constraints[osr.CONSTRAINT] <= 0)
    assert best == pytest.approx(ref.best["step_time_s"], rel=1e-5)
    with pytest.raises(ValueError):
        LegalSampler(base, space, refine=1.5)


def test_a_new_study_starts_from_the_exhaustive_best():
    """`enqueue_best`: trial 0 of a new study is the exhaustive table's best plan (study.enqueue_trial)."""
    ref = exhaustive(build_problem(**{**SMALL, "gpus": 8}), fixed=PINNED)
    res = optuna_search(StudySpec(**SMALL, fixed=PINNED, seed=0), n_trials=4)
    assert res.extra["optuna"]["seeded"] and res.best["plan"] == ref.best["plan"] and res.best["trial"] == 0


def test_infeasible_plans_are_never_reported_as_best():
    # a tight memory limit: most plans do not fit, and Optuna is told so by a constraint
    spec = StudySpec(**SMALL, memory_limit_gb=40.0, seed=1)
    res = optuna_search(spec, n_trials=60)
    assert res.best["fits"] and all(r["fits"] for r in res.top)
    assert res.best["memory_gb"]["total"] <= 40.0
    ref = exhaustive(build_problem(**{**SMALL, "gpus": 8}), memory_limit_gb=40.0)
    assert res.best["step_time_s"] >= ref.best["step_time_s"] * (1 - 1e-6)
    assert res.extra["optuna"]["n_feasible"] < res.extra["optuna"]["n_trials"]


def test_nothing_fits_is_exit_3_material():
    with pytest.raises(NothingFits) as exc:
        optuna_search(StudySpec(**SMALL, memory_limit_gb=2.0, seed=0), n_trials=16)
    assert exc.value.closest["fits"] is False and "memory" in str(exc.value)


def _trials(seed: int, sampler: str, n: int = 40) -> list[dict]:
    """The parameters of n trials of an in-memory study (the batched ask/tell loop of `search`)."""
    spec = StudySpec(**SMALL, seed=seed, sampler=sampler).resolved()
    space = spec.build_space()
    study, _ = osr.create_study(spec, storage_url=None, study_name=None,
                                sampler=osr.make_sampler(sampler, seed, space, 1))
    osr.run_batches(study, space, BatchScorer(space, spec.params(), None), spec.objectives, n_trials=n,
                    timeout_s=None, batch_size=spec.batch_size, sampler_name=sampler)
    return [t.params for t in study.trials]


@pytest.mark.parametrize("sampler", ["table", "tpe", "random", "nsga2", "cmaes"])
def test_same_seed_same_trials(sampler):
    a = _trials(7, sampler)
    assert a == _trials(7, sampler)
    assert a != _trials(8, sampler)


def test_resume_sqlite_50_plus_50(tmp_path):
    url = f"sqlite:///{tmp_path}/studies.db"
    spec = StudySpec(**SMALL, seed=3)
    r1 = optuna_search(spec, n_trials=50, storage_url=url, study_name="resume")
    assert r1.extra["optuna"]["n_trials"] == 50 and not r1.extra["optuna"]["resumed"]
    r2 = optuna_search(spec, n_trials=50, storage_url=url, study_name="resume")
    assert r2.extra["optuna"]["resumed"] and r2.extra["optuna"]["n_trials"] == 100
    study = optuna.load_study(study_name="resume", storage=url)
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials) == 100
    assert sorted(t.number for t in study.trials) == list(range(100))
    # the best never gets worse by resuming
    assert r2.best["tokens_per_s"] >= r1.best["tokens_per_s"]
    # another problem under the same study name is refused
    with pytest.raises(SpecError) as exc:
        optuna_search(StudySpec(**{**SMALL, "global_batch": 32}), n_trials=5, storage_url=url, study_name="resume")
    assert exc.value.field == "study"


def test_study_remembers_its_problem_and_trials_hold_plans(tmp_path):
    url = f"sqlite:///{tmp_path}/attrs.db"
    optuna_search(StudySpec(**SMALL, seed=0), n_trials=8, storage_url=url, study_name="attrs")
    study = optuna.load_study(study_name="attrs", storage=url)
    spec = StudySpec.from_attrs(study.user_attrs["autotune"])
    assert spec.model == "llama3-8b" and spec.gpus == "8" and spec.global_batch == 16
    t = study.trials[0]
    assert set(t.user_attrs["plan"]) == set(PLAN_FIELDS)
    assert {"plan", "metrics", "worker"} <= set(t.user_attrs) <= {"plan", "metrics", "worker", "seeded"}
    for key in ("step_time_s", "tokens_per_s", "memory_gb", "fits", "gpus", "cost_gpu_h", osr.CONSTRAINT):
        assert key in t.user_attrs["metrics"]
    assert set(t.constraints) == {osr.CONSTRAINT}


def test_journal_storage_and_grid_sampler_cover_every_plan_once(tmp_path):
    url = f"journal:{tmp_path}/study.log"
    spec = StudySpec(**SMALL, fixed=PINNED, sampler="grid", seed=0)
    res = optuna_search(spec, n_trials=1000, storage_url=url, study_name="grid")
    assert res.extra["optuna"]["n_trials"] == 67             # the grid stops at the legal space
    study = optuna.load_study(study_name="grid", storage=open_storage(url))
    keys = {tuple(sorted(t.params.items())) for t in study.trials}
    assert len(keys) == 67
    ref = exhaustive(build_problem(**{**SMALL, "gpus": 8}), fixed=PINNED)
    assert res.best["plan"] == ref.best["plan"]


# ---------------------------------------------------------------------------------------------
# Multi-objective: the Pareto front, confirmed by the exhaustive scorer
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampler", ["tpe", "table"])
def test_pareto_front_is_non_dominated_among_all_legal_plans(sampler):
    spec = StudySpec(**{**SMALL, "gpus": "8-32:pow2"}, fixed=PINNED, objectives=("tokens_per_s", "gpus"),
                     sampler=sampler, seed=0, batch_size=16)
    res = optuna_search(spec, n_trials=300)
    front = res.extra["optuna"]["pareto_front"]
    assert front and all(f["fits"] for f in front)
    # every legal plan of every GPU count of the range, scored exhaustively
    space = spec.resolved().build_space()
    scorer = BatchScorer(space, spec.params(), None)
    all_tps, all_gpus = [], []
    for n, batch in space.iter_legal():
        steps, mems = scorer.score(np.full(len(batch), n), batch)
        fits = mems <= scorer.limit_bytes(n)
        tokens = space.problem(n).job.tokens_per_step
        all_tps.append(tokens / steps[fits])
        all_gpus.append(np.full(int(fits.sum()), n))
    tps, gpus = np.concatenate(all_tps), np.concatenate(all_gpus)
    for f in front:
        v_tps, v_gpus = f["values"]["tokens_per_s"], f["values"]["gpus"]
        dominated = ((tps >= v_tps * (1 + 1e-5)) & (gpus <= v_gpus)) | ((tps >= v_tps * (1 - 1e-5)) & (gpus < v_gpus))
        assert not dominated.any(), (f["plan"], f["values"])
    # and the front covers the best throughput of every GPU count that improves on fewer GPUs
    assert {int(f["values"]["gpus"]) for f in front} == {8, 16, 32}


# ---------------------------------------------------------------------------------------------
# auto, storage URLs
# ---------------------------------------------------------------------------------------------

def test_auto_picks_exhaustive_for_small_spaces_and_optuna_for_ranges():
    small = osr.choose_strategy("auto", gpus=8, count_legal=lambda: 2775)
    assert small.strategy == "exhaustive" and "2,775 legal plans" in small.reason
    big = osr.choose_strategy("auto", gpus=8, count_legal=lambda: 10 ** 7)
    assert big.strategy == "optuna"
    # a range: exhaustive when the legal plans of all its counts together are few enough
    rng = osr.choose_strategy("auto", gpus=parse_gpus("256-2048"), count_legal=lambda: 150_000)
    assert rng.strategy == "exhaustive" and "over the GPU counts of 256-2048" in rng.reason
    big = osr.choose_strategy("auto", gpus=parse_gpus("256-2048"), count_legal=lambda: 10 ** 8)
    assert big.strategy == "optuna"
    multi = osr.choose_strategy("auto", gpus=8, objectives=["tokens_per_s", "gpus"], count_legal=lambda: 10)
    assert multi.strategy == "optuna"
    with pytest.raises(SpecError):
        osr.choose_strategy("exhaustive", gpus=parse_gpus("8-64"), objectives=["tokens_per_s", "gpus", "memory"])


@pytest.mark.parametrize("url,shown", [
    ("postgresql://alice:s3cr%40t@db.example:5432/studies", "postgresql://alice:***@db.example:5432/studies"),
    ("postgresql+psycopg2://bob:pw@host/db?sslmode=require", "postgresql+psycopg2://bob:***@host/db?sslmode=require"),
    ("postgresql://host/db?user=u&password=hunter2", "postgresql://host/db?password=***&user=u"),   # SQLAlchemy sorts the query
    ("sqlite:///results/studies.db", "sqlite:///results/studies.db"),
    (None, "memory"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_scrub_removes_raw_and_quoted_passwords():
    url = "postgresql://alice:s3cr%40t@db/x"
    msg = scrub("FATAL: password authentication failed for s3cr@t (s3cr%40t) at postgresql://alice:s3cr%40t@db/x", url)
    assert "s3cr" not in msg and "***" in msg


# ---------------------------------------------------------------------------------------------
# CLI with --json
# ---------------------------------------------------------------------------------------------

def test_cli_search_optuna_json(tmp_path):
    r = run_cli("search", *SMALL_CLI, "--strategy", "optuna", "--trials", "40", "--seed", "1", "--json",
                "--out", tmp_path)
    assert r.exit_code == 0, (r.stderr, r.exception)
    rep = json.loads(r.stdout)
    for key in ("best", "top", "space", "elapsed_s", "explanation", "optuna", "strategy_choice"):
        assert key in rep
    o = rep["optuna"]
    assert rep["strategy"] == "optuna" and o["sampler"] == "table" and o["seed"] == 1 and o["n_trials"] == 40
    assert o["storage"] == "memory" and o["objectives"][0]["name"] == "tokens_per_s"
    assert rep["best"]["fits"]
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".html", ".json", ".md"]



def _no_constants(token):
    raise ValueError(f"non-standard JSON token {token}")


def test_cli_search_optuna_json_is_strict(tmp_path, monkeypatch):
    """--json on the Optuna path goes through cli.common's printer: a non-finite number is null,
    never a NaN / Infinity token (RFC 8259)."""
    import autotune.report as report_mod
    original = report_mod.search_report

    def with_non_finite(*args, **kwargs):
        rep = original(*args, **kwargs)
        rep["probe"] = {"nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"),
                        "np": np.float64("nan")}
        return rep

    monkeypatch.setattr(report_mod, "search_report", with_non_finite)
    r = run_cli("search", *SMALL_CLI, "--strategy", "optuna", "--trials", "5", "--json", "--no-save")
    assert r.exit_code == 0, (r.stderr, r.exception)
    rep = json.loads(r.stdout, parse_constant=_no_constants)
    assert rep["strategy"] == "optuna" and rep["optuna"]["n_trials"] == 5
    assert rep["probe"] == {"nan": None, "inf": None, "ninf": None, "np": None}


@pytest.mark.parametrize("as_json", [True, False])
def test_cli_optuna_report_not_saved_still_prints_then_one_error_line(tmp_path, monkeypatch, as_json):
    """The folder went away (or filled up) after the up-front check: the result is printed anyway,
    then one `error:` line and exit 2, as on the exhaustive path."""
    import autotune.report as report_mod

    def refuse(report, out_dir, **kwargs):
        raise SpecError("out", f"cannot write into {out_dir}: No space left on device")

    monkeypatch.setattr(report_mod, "save_report", refuse)
    r = run_cli("search", *SMALL_CLI, "--strategy", "optuna", "--trials", "5", "--seed", "0", "--out", tmp_path,
                *(["--json"] if as_json else []))
    one_error_line(r, 2, "out", "cannot write", "No space left")
    if as_json:
        rep = json.loads(r.stdout, parse_constant=_no_constants)
        assert rep["strategy"] == "optuna" and rep["best"]["fits"]
    else:
        assert "Best plans found" in r.stdout and "Report not saved." in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_cli_optuna_plot_write_failure_is_one_line(tmp_path, monkeypatch):
    """An OSError while drawing the report page (plotly, Optuna's plots): the report is printed, one
    `error:` line, exit 2."""
    import autotune.figures as figures_mod

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(figures_mod, "search_page", refuse)
    r = run_cli("search", *SMALL_CLI, "--strategy", "optuna", "--objective", "tokens_per_s", "--objective", "gpus",
                "--trials", "8", "--seed", "0", "--json", "--out", tmp_path)
    one_error_line(r, 2, "out", "No space left")
    rep = json.loads(r.stdout, parse_constant=_no_constants)
    assert rep["optuna"]["pareto_front"] and "pareto_plot" not in rep["optuna"]


def test_cli_search_auto_says_which(tmp_path):
    r = run_cli("search", *SMALL_CLI, "--json", "--no-save")
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["strategy"] == "exhaustive"
    assert rep["strategy_choice"]["requested"] == "auto" and rep["strategy_choice"]["chosen"] == "exhaustive"
    r = run_cli("search", *SMALL_CLI, "--no-save")
    assert r.exit_code == 0 and "Strategy: exhaustive (" in r.stdout


def test_cli_pareto_front_and_plot(tmp_path):
    r = run_cli("search", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8-32:pow2", "--global-batch", "16",
                "--seq-len", "4096", "--objective", "tokens_per_s", "--objective", "gpus", "--sampler", "nsga2",
                "--trials", "60", "--seed", "0", "--json", "--out", tmp_path)
    assert r.exit_code == 0, (r.stderr, r.exception)
    rep = json.loads(r.stdout)
    assert rep["strategy_choice"]["chosen"] == "optuna" and "--sampler" in rep["strategy_choice"]["reason"]
    front = rep["optuna"]["pareto_front"]
    assert front and all(set(f["values"]) == {"tokens_per_s", "gpus"} for f in front)
    page = next(tmp_path.glob("*.html")).read_text()
    # Optuna's own plots (optuna.visualization), drawn by plotly: history, Pareto front, importances
    for heading in ("Optimisation history: tokens_per_s", "Optimisation history: gpus", "Pareto front",
                    "Parameter importances"):
        assert heading in page, heading
    assert page.count("Plotly.newPlot") >= 6
    md = next(tmp_path.glob("*.md")).read_text()
    assert "Pareto" in md and page and next(tmp_path.glob("*.html")).name in md


def test_cli_range_is_scored_exhaustively_when_small(tmp_path):
    """auto on a GPU range whose counts hold few legal plans scores them all: the exact Pareto front,
    which no scored plan dominates, and the best plan of each count on it."""
    r = run_cli("search", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8-32:pow2", "--global-batch", "16",
                "--seq-len", "4096", "--objective", "tokens_per_s", "--objective", "gpus", "--json", "--no-save",
                "--no-sensitivity", "--memory-headroom", "0%")       # the brute force below uses the whole GPU
    assert r.exit_code == 0, (r.stderr, r.exception)
    rep = json.loads(r.stdout)
    assert rep["strategy"] == "exhaustive" and rep["strategy_choice"]["chosen"] == "exhaustive"
    assert "over the GPU counts of 8-32:pow2" in rep["strategy_choice"]["reason"]
    assert rep["space"]["scored"] == rep["space"]["legal"] == rep["strategy_choice"]["legal_plans"]
    front = rep["range"]["pareto_front"]
    assert [f["values"]["gpus"] for f in front] == [8, 16, 32]
    spec = StudySpec(**{**SMALL, "gpus": "8-32:pow2"}).resolved()
    space = spec.build_space()
    scorer = BatchScorer(space, spec.params(), None)
    for f in front:
        n = int(f["values"]["gpus"])
        steps, mems = scorer.score(np.full(len(space.legal_plans(n)), n), space.legal_plans(n))
        best = float(steps[mems <= scorer.limit_bytes(n)].min())
        assert f["step_time_s"] == pytest.approx(best, rel=1e-5)
    assert rep["best"]["num_gpus"] == 32                 # the most throughput is on the most GPUs here


def test_cli_worker_and_studies_json(tmp_path):
    url = f"sqlite:///{tmp_path}/w.db"
    r = run_cli("search", *SMALL_CLI, "--strategy", "optuna", "--trials", "16", "--storage", url, "--study", "s1",
                "--json", "--no-save")
    assert r.exit_code == 0, r.stderr
    r = run_cli("worker", "--storage", url, "--study", "s1", "--trials", "24", "--json")
    assert r.exit_code == 0, (r.stderr, r.exception)
    w = json.loads(r.stdout)
    assert w["run"]["trials"] == 24 and w["study_trials"]["complete"] == 40 and w["best"]["fits"]
    r = run_cli("studies", "--storage", url, "--json")
    assert r.exit_code == 0, r.stderr
    lst = json.loads(r.stdout)
    assert [s["name"] for s in lst["studies"]] == ["s1"] and lst["studies"][0]["trials"] == {"complete": 40}
    r = run_cli("studies", "--storage", url, "--study", "s1", "--json")
    show = json.loads(r.stdout)
    assert show["n_trials"] == 40 and show["problem"]["model"] == "llama3-8b" and show["best"]
    for ext in ("csv", "json"):
        out = tmp_path / f"trials.{ext}"
        r = run_cli("studies", "--storage", url, "--study", "s1", "--export", out, "--json")
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["trials"] == 40
    assert len((tmp_path / "trials.csv").read_text().splitlines()) == 41
    assert len(json.loads((tmp_path / "trials.json").read_text())["trials"]) == 40


@pytest.mark.parametrize("options,framework", [
    (["--lora-dim", "16"], {"lora_dim": 16}),
    (["--lora-dim", "8", "--lora-target-modules", "linear_qkv", "--packed-example-tokens", "256"],
     {"lora_dim": 8, "lora_target_modules": ["linear_qkv"], "packed_example_tokens": 256}),
])
def test_a_study_keeps_its_framework_options_and_workers_score_them(tmp_path, options, framework):
    """`studies` shows the options the study was created with; a worker's trials are scored with them."""
    from autotune import api
    from costmodels.plan import Plan
    url = f"sqlite:///{tmp_path}/s.db"
    r = run_cli("search", *SMALL_CLI, "--strategy", "optuna", "--trials", "6", "--storage", url, "--study", "s",
                *options, "--json", "--no-save")
    assert r.exit_code == 0, r.stderr
    r = run_cli("worker", "--storage", url, "--study", "s", "--trials", "4", "--json")
    assert r.exit_code == 0, (r.stderr, r.exception)
    r = run_cli("studies", "--storage", url, "--study", "s", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["problem"]["framework"] == framework
    human = run_cli("studies", "--storage", url, "--study", "s").stdout
    assert all(f"{k}=" in " ".join(human.split()) for k in framework)
    problem = build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=16, seq_len=4096, framework=framework)
    trials = optuna.load_study(study_name="s", storage=url).trials[6:]
    assert len(trials) == 4
    for t in trials:
        if "plan" in t.user_attrs:
            want = api.predict_plan(problem, Plan.from_dict(t.user_attrs["plan"]))["step_time_s"]
            assert t.user_attrs["metrics"]["step_time_s"] == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, the field named, no password echoed
# ---------------------------------------------------------------------------------------------

BAD = {
    "unknown sampler": (["--strategy", "optuna", "--sampler", "annealing"], ("sampler", "annealing", "tpe")),
    "unknown objective": (["--strategy", "optuna", "--objective", "speed"], ("objective", "speed", "tokens_per_s")),
    "cmaes with two objectives": (["--sampler", "cmaes", "--objective", "tokens_per_s", "--objective", "gpus"],
                                  ("sampler", "cmaes")),
    "empty gpu range": (["--gpus", "300-303"], ("gpus", "300-303")),
    "reversed gpu range": (["--gpus", "64-8"], ("gpus", "empty")),
    "range with exhaustive, 3 objectives": (["--gpus", "8-64", "--strategy", "exhaustive", "--objective", "tokens_per_s",
                                             "--objective", "gpus", "--objective", "memory"], ("objective", "optuna")),
    "optuna option with exhaustive": (["--strategy", "exhaustive", "--trials", "5"], ("--trials",)),
    "zero trials": (["--strategy", "optuna", "--trials", "0"], ("trials",)),
    "batch size zero": (["--strategy", "optuna", "--batch-size", "0"], ("batch_size",)),
    "unknown storage": (["--storage", "redis://x"], ("storage", "sqlite")),
    "negative seed": (["--strategy", "optuna", "--seed", "-1"], ("--seed",)),    # was an internal error (numpy)
}


@pytest.mark.parametrize("case", list(BAD))
def test_search_bad_optuna_input(case, tmp_path):
    extra, needles = BAD[case]
    base = [a for a in SMALL_CLI]
    if "--gpus" in extra:
        i = base.index("--gpus")
        del base[i:i + 2]
    r = run_cli("search", *base, *extra, "--out", tmp_path)
    one_error_line(r, 2, *needles)
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


def test_worker_refuses_a_negative_seed(tmp_path):
    url = f"sqlite:///{tmp_path}/seed.db"
    assert run_cli("search", *SMALL_CLI, "--strategy", "optuna", "--trials", "4", "--storage", url, "--study", "s",
                   "--no-save").exit_code == 0
    one_error_line(run_cli("worker", "--storage", url, "--study", "s", "--trials", "2", "--seed", "-1"), 2, "--seed")


def test_unreachable_storage_one_line_no_password(tmp_path):
    url = "postgresql://autotune:TopSecret99@127.0.0.1:9/autotune"
    r = run_cli("search", *SMALL_CLI, "--strategy", "optuna", "--trials", "5", "--storage", url, "--no-save")
    line = one_error_line(r, 2, "storage", "postgresql://autotune:***@127.0.0.1:9/autotune")
    assert "TopSecret99" not in r.stdout + r.stderr
    r = run_cli("worker", "--storage", url, "--study", "x", "--trials", "5")
    one_error_line(r, 2, "storage")
    assert "TopSecret99" not in r.stdout + r.stderr
    r = run_cli("studies", "--storage", url)
    one_error_line(r, 2, "storage")
    assert "TopSecret99" not in r.stdout + r.stderr + line


def test_worker_needs_an_autotune_study(tmp_path):
    url = f"sqlite:///{tmp_path}/x.db"
    r = run_cli("worker", "--storage", url, "--study", "missing", "--trials", "5")
    one_error_line(r, 2, "storage", "does not exist")          # a worker creates no database
    assert not (tmp_path / "x.db").exists()
    optuna.create_study(storage=url, study_name="foreign")
    r = run_cli("worker", "--storage", url, "--study", "missing", "--trials", "5")
    one_error_line(r, 2, "study", "missing")
    r = run_cli("worker", "--storage", url, "--study", "foreign", "--trials", "5")
    one_error_line(r, 2, "study", "autotune")


# ---------------------------------------------------------------------------------------------
# Ctrl-C: stop cleanly, keep every finished trial
# ---------------------------------------------------------------------------------------------

def _autotune(*args) -> list[str]:
    return [sys.executable, "-c", "from cli.main import app; app()", *[str(a) for a in args]]


def test_ctrl_c_keeps_finished_trials(tmp_path):
    url = f"sqlite:///{tmp_path}/int.db"
    optuna_search(StudySpec(**SMALL, seed=0), n_trials=8, storage_url=url, study_name="int")
    proc = subprocess.Popen(_autotune("worker", "--storage", url, "--study", "int", "--trials", "100000",
                                      "--json"), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    study = optuna.load_study(study_name="int", storage=url)
    deadline = time.time() + 60
    while len(study.get_trials(deepcopy=False)) < 40 and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    w = json.loads(out)
    assert w["run"]["interrupted"] and w["run"]["trials"] >= 32
    states = [t.state for t in optuna.load_study(study_name="int", storage=url).trials]
    assert optuna.trial.TrialState.RUNNING not in states
    assert states.count(optuna.trial.TrialState.COMPLETE) == 8 + w["run"]["trials"]


def test_api_search_is_one_path_for_every_strategy():
    """api.search takes a Problem or a StudySpec: exhaustive on one count, exhaustive on a range, Optuna."""
    from autotune import api
    problem = build_problem(**{**SMALL, "gpus": 8})
    ref = api.search(problem, fixed=PINNED)
    spec = StudySpec(**SMALL, fixed=PINNED, seed=0)
    assert api.search(spec).best["plan"] == ref.best["plan"]
    rng = api.search(StudySpec(**{**SMALL, "gpus": "8-16:pow2"}, fixed=PINNED))
    assert rng.strategy == "exhaustive" and rng.space["gpu_counts"] == 2 and rng.space["scored"] == rng.space["legal"]
    opt = api.search(spec, strategy="optuna", run=api.OptunaRun(n_trials=6))
    assert opt.strategy == "optuna" and opt.best["plan"] == ref.best["plan"]
    with pytest.raises(SpecError):
        api.search(problem, strategy="optuna")


# ---------------------------------------------------------------------------------------------
# The table sampler (autotune/table_sampler.py)
# ---------------------------------------------------------------------------------------------

def _table_run(sampler: str) -> list:
    spec = StudySpec(**{**SMALL, "gpus": "64", "global_batch": 256}, seed=0, sampler=sampler,
                     fixed={"first_layers": 0, "last_layers": 0, "recompute_layers": 0}).resolved()
    space = spec.build_space()                              # 18,980 legal plans
    study, _ = osr.create_study(spec, storage_url=None, study_name=None,
                                sampler=osr.make_sampler(sampler, 0, space, 1))
    osr.run_batches(study, space, BatchScorer(space, spec.params(), None), spec.objectives, n_trials=96,
                    timeout_s=None, batch_size=8, sampler_name=sampler)
    return study.trials


def test_table_sampler_never_repeats_a_plan_and_its_surrogate_learns():
    """Every trial of a batched run is a different legal plan; after the start-up trials the
    surrogate's picks are far better than random plans (median tokens/s; 3.6x when written)."""
    trials = _table_run("table")
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    keys = [tuple(sorted(t.params.items())) for t in trials]
    assert len(done) == 96 and len(set(keys)) == len(keys)
    random = [t.values[0] for t in _table_run("random") if t.state == optuna.trial.TrialState.COMPLETE]
    assert np.median([t.values[0] for t in done[48:]]) > 2 * np.median(random)


def test_table_sampler_lookup_prediction_equals_the_feature_matrix():
    from autotune.table_sampler import RIDGE, TableSampler
    spec = StudySpec(model="mixtral-8x7b", gpu="h100", gpus="64", global_batch=256, seq_len=4096).resolved()
    space = spec.build_space()
    ts = TableSampler(space, seed=0)
    rng = np.random.default_rng(0)
    cands = ts._candidates(rng, np.empty(0, np.int64))
    vecs = cands[:40]
    fits = np.stack([rng.normal(size=40), rng.normal(size=40), np.full(40, 0.2)], axis=1)
    x = ts._features(vecs)
    reg = RIDGE * np.eye(x.shape[1])
    reg[0, 0] = 0.0
    pred = ts._features(cands) @ np.linalg.solve(x.T @ x + reg, x.T @ fits[:, :2])
    want = np.where(pred[:, 1] <= 0.2, -pred[:, 0], -pred[:, 0] - 1e3)
    np.testing.assert_allclose(ts._ridge_score(cands, vecs, fits), want, atol=1e-9)


def test_table_sampler_with_two_objectives_proposes_legal_untried_plans(small_space):
    spec, space = small_space
    study = optuna.create_study(sampler=osr.make_sampler("table", 1, space, 2), directions=["maximize", "minimize"])
    problem = space.problem(8)
    seen = set()
    for _ in range(40):
        trial = study.ask()
        n, plan = space.suggest(trial)
        legal, counts = check_rows({f: np.array([plan[f]]) for f in PLAN_FIELDS}, problem)
        assert legal[0], (plan, counts)
        key = tuple(sorted(trial.params.items()))
        assert key not in seen
        seen.add(key)
        rng = np.random.default_rng(trial.number)
        study.tell(trial, [float(rng.random()), float(rng.random())])


@pytest.mark.parametrize("kind", ["table", "tpe"])
def test_a_requeued_partial_plan_is_completed_legally(kind):
    """A dead worker's trial is re-queued by RetryFailedTrialCallback with only the knobs it had
    suggested (a prefix in sampling order): the samplers pin them and make the rest legal around them
    (a sigkilled-worker test once failed 1 run in 4 on an illegal completion)."""
    from autotune.table_sampler import TableSampler
    spec = StudySpec(**SMALL, seed=0).resolved()
    space = spec.build_space()
    base = TableSampler(space, seed=0) if kind == "table" else \
        optuna.samplers.TPESampler(seed=0, multivariate=True, n_startup_trials=4)
    study = optuna.create_study(sampler=LegalSampler(base, space, refine=0.4, seed=0), direction="minimize")
    scorer = BatchScorer(space, spec.params(), None)
    problem = space.problem(8)
    names = list(space.distributions)
    rng = np.random.default_rng(0)
    for i in range(24):
        if i >= 8 and i % 2 == 0:                # a prefix of a finished plan whose tail differs from the best
            donor = study.trials[int(rng.integers(len(study.trials)))]
            cut = int(rng.integers(1, len(names) - 1))
            prefix = {k: donor.params[k] for k in names[:cut]}
            study.add_trial(optuna.trial.create_trial(
                state=optuna.trial.TrialState.WAITING, params=prefix,
                distributions={k: donor.distributions[k] for k in prefix}))
        trial = study.ask()
        n, plan = space.suggest(trial)
        legal, _ = check_rows({f: np.array([plan[f]]) for f in PLAN_FIELDS}, problem)
        assert legal[0], (trial.number, trial.params)
        step, _ = scorer.score(np.array([n]), PlanBatch({f: np.array([plan[f]], dtype=np.int32) for f in PLAN_FIELDS}))
        study.tell(trial, float(step[0]))


# ---------------------------------------------------------------------------------------------
# Uneven pipeline splits in the Optuna table (enumeration adds them where pp does not divide the layers)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def odd_space(tmp_path_factory):
    """A 7-layer model on 4 GPUs: pp 4 exists only with uneven end stages (2 + 2 x 2 + 1 or 1 + 2 x 2 + 2) or
    with the embedding or the loss taking a layer's slot."""
    cfg = json.loads((REPO / "tests" / "data" / "tiny_llama_config.json").read_text())
    cfg["num_hidden_layers"] = 7
    path = tmp_path_factory.mktemp("odd") / "odd_llama.json"
    path.write_text(json.dumps(cfg))
    kw = dict(model=str(path), gpu="h100", gpus="4", global_batch=16, seq_len=64)
    spec = StudySpec(**kw).resolved()
    return kw, spec, spec.build_space()


def test_the_optuna_table_holds_the_uneven_splits(odd_space):
    _, _, space = odd_space
    problem = space.problem(4)
    plans = space.legal_plans(4)
    stream, _ = enumerate_legal(problem)
    ref = {tuple(int(b[f][i]) for f in PLAN_FIELDS) for b in stream for i in range(len(b))}
    got = {tuple(int(plans[f][i]) for f in PLAN_FIELDS) for i in range(len(plans))}
    assert got == ref and len(got) == len(plans)
    legal, _ = check_rows({f: np.asarray(plans[f]) for f in PLAN_FIELDS}, problem)
    assert legal.all()
    pp4 = np.asarray(plans["pp"]) == 4
    uneven = np.asarray(plans["first_layers"]) > 0
    accounted = (np.asarray(plans["account_for_embedding"]) + np.asarray(plans["account_for_loss"])) > 0
    assert (pp4 & uneven).any() and (uneven | accounted)[pp4].all()     # 7 (+1 accounted) layers on 4 ranks
    # after a pp 4 prefix the first stage's legal sizes are those a last-stage size completes
    prefix = {k: int(plans[k][np.flatnonzero(pp4)[0]]) for k in space.distributions
              if k not in ("first_layers", "last_layers", "recompute_layers")}
    assert set(space.legal_values("first_layers", prefix).tolist()) >= {1, 2}
    # 2 first: 1 last leaves 2 x 2 in the middle, 3 last 2 x 1 (Optuna also tries heavier end stages)
    assert space.legal_values("last_layers", {**prefix, "first_layers": 2}).tolist() == [1, 3]


@pytest.mark.parametrize("sampler", ["table", "tpe", "random"])
def test_every_trial_is_legal_where_pp_needs_uneven_stages(odd_space, sampler):
    assert_trials_legal(odd_space[2], 4, sampler, trials=40, seed=5)


def test_a_study_is_seeded_with_the_exhaustive_best_uneven_split_included(odd_space):
    kw, _, _ = odd_space
    kw4 = {**kw, "gpus": 4}
    ref = exhaustive(build_problem(**kw4))
    res = optuna_search(StudySpec(**kw, seed=0), n_trials=4)
    assert res.extra["optuna"]["seeded"]
    assert res.best["step_time_s"] <= ref.best["step_time_s"] * (1 + 1e-6)


def test_cli_auto_scores_in_one_pass_and_falls_back_to_optuna_past_the_limit(monkeypatch):
    """`auto` on one GPU count runs the exhaustive search with the limit and no counting pass first; past the limit it
    stops and runs Optuna, saying so."""
    import autotune.strategy as strategy
    r = run_cli("search", *SMALL_CLI, "--json", "--no-save")
    rep = json.loads(r.stdout)
    assert rep["strategy_choice"]["chosen"] == "exhaustive"
    assert rep["strategy_choice"]["legal_plans"] == rep["space"]["legal"] > 1000
    monkeypatch.setattr(strategy, "AUTO_EXHAUSTIVE_MAX", 1000)
    r = run_cli("search", *SMALL_CLI, "--json", "--no-save")
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["strategy"] == "optuna" and rep["strategy_choice"]["chosen"] == "optuna"
    assert "more than 1,000 legal plans" in rep["strategy_choice"]["reason"]
