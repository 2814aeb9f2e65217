"""Calibration honesty (issue 11 item 5): every fitted parameter is reported with its literature
prior, its bound and its change, and one that moved far is flagged with a warning."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.calibrate import DEFAULT_FIT, parameter_report
from cli.main import app
from costmodels.params import LITERATURE_PRIOR, PARAM_BOUNDS

SAMPLE_LOG = Path(__file__).parent / "data" / "megatron_sample.log"


def _by_name(report):
    return {e["name"]: e for e in report}


def test_parameter_report_reads_prior_bound_and_ratio():
    report = _by_name(parameter_report(LITERATURE_PRIOR, DEFAULT_FIT, start=LITERATURE_PRIOR))
    assert list(report) == list(DEFAULT_FIT)
    for name, e in report.items():
        assert e["prior"] == getattr(LITERATURE_PRIOR, name) == e["fitted"] == e["start"]
        assert tuple(e["bound"]) == PARAM_BOUNDS[name]
        assert e["flags"] == [] and e["warning"] is None        # the prior itself is never "far"


def test_far_moves_are_flagged_with_a_warning():
    # gemm_dim_half: prior 46, bound [1, 512]; kernel_overhead_s: prior 5 us, bound [0, 50 us];
    # inter_bw_eff: prior 0.8, bound [0.3, 0.95]; hbm_eff: prior 0.90, bound [0.3, 0.95]
    # (gemm_dim_half is measured, not in DEFAULT_FIT, but a report may name any parameter)
    names = DEFAULT_FIT + ("gemm_dim_half",)
    fitted = LITERATURE_PRIOR._replace(gemm_dim_half=30.0,        # 0.65x the prior: fine
                                       kernel_overhead_s=48e-6,   # 9.6x and next to the upper bound
                                       inter_bw_eff=0.45,         # 0.56x, but 54 % of its range
                                       hbm_eff=0.75)              # 0.83x, 23 % of its range: fine
    r = _by_name(parameter_report(fitted, names))
    assert r["gemm_dim_half"]["ratio_to_prior"] == 30.0 / 46.0 and r["gemm_dim_half"]["flags"] == []
    r = _by_name(parameter_report(fitted._replace(gemm_dim_half=100.0), names))
    assert r["gemm_dim_half"]["flags"] == ["2.2x its literature prior 46"]
    assert "9.6x its literature prior" in r["kernel_overhead_s"]["flags"][0]
    assert any("upper bound" in f for f in r["kernel_overhead_s"]["flags"])
    assert "of its range" in r["inter_bw_eff"]["flags"][0]
    assert r["hbm_eff"]["flags"] == [] and r["hbm_eff"]["warning"] is None
    assert r["gemm_dim_half"]["warning"].startswith("gemm_dim_half = 100: 2.2x its literature prior 46")
    assert "structural error" in r["gemm_dim_half"]["warning"]
    # a parameter whose prior sits at a bound is not flagged for staying near it
    # (a prior of 0.0 = ep_overlap's lower bound)
    at_bound = LITERATURE_PRIOR._replace(ep_overlap=0.0)
    r = _by_name(parameter_report(at_bound._replace(ep_overlap=0.02), prior=at_bound))
    assert r["ep_overlap"]["flags"] == []


def test_calibrate_cli_reports_parameters_and_warnings(tmp_path):
    out = tmp_path / "h100.json"
    args = ["calibrate", "--megatron-log", str(SAMPLE_LOG), "--model", "llama3-70b", "--gpu", "h100",
            "--gpus", "64", "--seq-len", "8192", "--steps", "5",
            "--plan", "tp=8,pp=2,recompute=selective,sp=true,zero=1", "-o", str(out)]
    r = CliRunner().invoke(app, args + ["--json"])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    entries = _by_name(doc["parameters"])
    assert list(entries) == list(DEFAULT_FIT)
    for name, e in entries.items():
        assert e["prior"] == getattr(LITERATURE_PRIOR, name) and e["fitted"] == doc["params"][name]
    # it starts from the shipped defaults, some of which sit far from the literature already
    assert doc["warnings"] == [e["warning"] for e in doc["parameters"] if e["warning"]]
    assert doc["warnings"]
    first = doc["warnings"][0].split(" = ")[0]
    human = CliRunner().invoke(app, args)
    assert human.exit_code == 0, human.stderr
    assert "literature prior" in human.stdout and f"warning: {first}" in human.stdout


def test_a_fit_without_steps_returns_its_start():
    """The sigmoid reparametrization keeps every start off the bounds; it must not move one that sits near a
    bound (the shipped step_overhead_s is 1.6 % of its range): zero Adam steps give the start back."""
    from autotune.calibrate import build_cases, fit
    from autotune.datasets import load_dataset
    from costmodels.params import EfficiencyParams

    start = EfficiencyParams()
    assert (start.step_overhead_s - PARAM_BOUNDS["step_overhead_s"][0]) / (
        PARAM_BOUNDS["step_overhead_s"][1] - PARAM_BOUNDS["step_overhead_s"][0]) < 0.02
    cases = build_cases(load_dataset("public")[:4], start)
    same = fit(cases, start, DEFAULT_FIT, steps=0)
    for name in DEFAULT_FIT:
        assert getattr(same, name) == pytest.approx(getattr(start, name), rel=1e-4), name
