"""Golden tests against published, measured training runs (the bundled copy of shared/validation).

These fail when the cost model drifts: the accuracy targets of the core issue, no false
out-of-memory call on a run that really ran, every published plan inside the legal space, and
search optimality on the published problems. The data ship with the package (autotune/data/), so
these run in any clone; tests/test_datasets.py keeps the copy equal to ../shared/validation.
"""
from __future__ import annotations

import copy
import json
import math
import re

import pytest

from autotune import api
from autotune.calibrate import build_cases
from autotune.datasets import dataset_path, load_dataset
from autotune.search import exhaustive
from autotune.validate import case_from_row, framework_is_modern, load_runs, model_from_row, validate_rows
from costmodels.params import EfficiencyParams
from costmodels.specs import SpecError

PUBLIC = dataset_path("public")
SMALL = dataset_path("small-scale")
PUBLIC_ROWS = load_runs(PUBLIC)
_LORA = re.compile(r"\blora\b", re.I)


def _row(row_id: str) -> dict:
    return copy.deepcopy(next(r for r in PUBLIC_ROWS if r["id"] == row_id))


@pytest.fixture(scope="module")
def public_result():
    return validate_rows(load_runs(PUBLIC))


def test_dense_public_runs_accuracy(public_result):
    dense = [r for r in public_result["runs"] if r.get("error_pct") is not None and not r["moe"]]
    assert len(dense) >= 40
    assert public_result["mape_dense_pct"] <= 15.0
    assert public_result["max_abs_error_dense_pct"] <= 30.0


def test_every_scored_published_run_is_predicted_to_fit(public_result):
    scored = [r for r in public_result["runs"] if r.get("error_pct") is not None]
    assert scored and all(r["predicted_fits"] for r in scored), \
        [r["id"] for r in scored if not r["predicted_fits"]]


def test_usable_rows_are_scored_or_skipped_with_a_reason(public_result):
    for r in public_result["runs"]:
        assert (r["error_pct"] is None) == (r["skipped"] is not None), r["id"]
        if r["skipped"]:
            assert isinstance(r["skipped"], str) and r["skipped"]


def test_moe_public_runs_accuracy(public_result):
    # a regression guard at today's level (16.8 % MAPE over 51 MoE runs with the shipped defaults,
    # in-sample, each Bridge run with its recipe's dispatcher and EP overlap; 15.4 % when the defaults were
    # a warm-started chain of fits, before they became the fit from the literature prior; issue 11's target
    # is 20 % out of sample (17.9 % LOSO), 15 % in-sample)
    assert public_result["n_scored_moe"] == sum(1 for r in PUBLIC_ROWS if r["usable"] and r["model"]["num_experts"])
    assert public_result["mape_moe_pct"] <= 17.0


def test_every_usable_published_run_is_scored_and_inside_the_legal_space(public_result):
    # counted from the data: every usable row, the LoRA fine-tuning runs included (tests/test_lora.py)
    expected = [r["id"] for r in PUBLIC_ROWS if r["usable"]]
    assert any(_LORA.search(i) for i in expected)
    scored = [r["id"] for r in public_result["runs"] if r["error_pct"] is not None]
    assert scored == expected
    assert public_result["n_not_in_space"] == 0, public_result["not_in_space"]
    assert public_result["n_predicted_oom"] == 0


def test_public_errors_by_source_and_gpu_generation_add_up(public_result):
    for key in ("by_source", "by_gpu_generation"):
        groups = public_result[key]
        assert sum(g["n"] for g in groups.values()) == public_result["n_scored"]
        assert max(g["max_abs_error_pct"] for g in groups.values()) == pytest.approx(public_result["max_abs_error_pct"])
    assert set(public_result["by_gpu_generation"]) <= {"A100", "H100/H200/H800", "B200/B300", "GB200/GB300"}


def test_small_scale_runs_accuracy():
    out = validate_rows(load_runs(SMALL))
    assert out["n_scored"] == len(out["runs"]) == 720    # every vTrain plan is in the legal space
    assert out["n_not_in_space"] == 0
    assert out["mape_pct"] <= 30.0
    assert out["n_predicted_oom"] == 0


@pytest.mark.parametrize("row_id", [
    "narayanan21-t2-ptdp-175B-384gpu", "narayanan21-t1-529.6B", "nemo-24.07-LLAMA3-70B-64g-pre",
    "nemo-24.07-GPT3-175B-512g-pre", "nemotron4-15B-dp96", "nemo-24.07-LLAMA2-13B-16g-pre",
])
def test_search_beats_or_matches_the_published_plan(row_id):
    row = _row(row_id)
    case = case_from_row(row)
    published = exhaustive(case.problem, top_k=1, fixed=case.fixed).best
    free = exhaustive(case.problem, top_k=1).best
    assert free["fits"]
    assert free["step_time_s"] <= published["step_time_s"] * (1 + 1e-6)


def test_validate_never_crashes_on_bad_rows(tmp_path):
    rows = [{"id": "empty"}, {"id": "no-gpu", "model": {"layers": 2, "hidden": 64, "heads": 4}},
            {"id": "garbage", "model": "x", "hardware": 3, "plan": None}, "not a dict"]
    rows.append({"id": "list-plan", "hardware": {"gpu_key": "h100", "num_gpus": 8}, "plan": [1], "measured": "fast"})
    out = validate_rows([r if isinstance(r, dict) else {"id": r} for r in rows], only_usable=False)
    assert out["n_scored"] == 0 and out["n_skipped"] == len(rows)
    # each reason names the field, never "internal error"
    reasons = {r["id"]: r["skipped"] for r in out["runs"]}
    assert not any(why.startswith("internal error") for why in reasons.values()), reasons
    assert reasons["garbage"].startswith("hardware: must be an object") and reasons["list-plan"].startswith("plan: ")
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(rows[:2]))
    assert len(load_runs(str(path))) == 2


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_2021_megatron_row_without_a_launch_script_runs_2021_megatron(precision):
    """Megatron-LM@6985e58938 (2021-08-18): LocalDDP (--DDP-impl local), no distributed optimizer, no
    gradient-accumulation fusion, a synchronous backward TP all-reduce, fp32 gradient reduction only for bf16.
    A row with a published launch script keeps that script's values (Narayanan's 1.7B ran --DDP-impl torch)."""
    row = _row("narayanan21-t1-1.7B")
    row["id"] = "a-2021-row-without-launch-settings"
    row["plan"]["precision_key"] = precision
    fw = case_from_row(row).problem.job.framework
    assert (fw.overlap_grad_reduce, fw.overlap_param_gather, fw.gradient_accumulation_fusion,
            fw.async_tensor_model_parallel_allreduce) == (False, False, False, False)
    assert fw.grad_reduce_in_fp32 == (precision == "bf16")
    scripted = case_from_row(_row("narayanan21-t1-1.7B")).problem.job.framework
    assert scripted.overlap_grad_reduce and not scripted.gradient_accumulation_fusion
    modern = _row("narayanan21-t1-1.7B")
    modern.update(id="a-2024-row", source={"title": "a 2024 Megatron-Core run", "group": "g"})
    fw = case_from_row(modern).problem.job.framework
    assert fw.gradient_accumulation_fusion and fw.async_tensor_model_parallel_allreduce and fw.overlap_grad_reduce


@pytest.mark.parametrize("source", ["Narayanan et al. 2021 (SC21)", 5, ["a", "list"], None])
def test_a_source_that_is_not_an_object_is_read_not_crashed_on(source):
    """A hand-written runs file may give `source` as a bare title (read as the title: its year and framework
    count) or as anything else (read as no source); the row is scored either way, never an internal error."""
    row = _row("narayanan21-t1-1.7B")
    row["source"] = source
    res = validate_rows([row])["runs"][0]
    assert res["skipped"] is None and res["error_pct"] is not None
    assert (res["group"] is None) and (framework_is_modern(row) == (source != "Narayanan et al. 2021 (SC21)"))


# ---------------------------------------------------------------------------------------------
# issue 10: a row's own fields win over a preset's; defects that must not spoil a whole validation
# ---------------------------------------------------------------------------------------------

def test_a_preset_fills_only_what_agrees_with_the_row():
    # 96 layers and hidden 12288 like GPT-3 175B, but 128 heads and no KV-head count: another model,
    # so the preset's 96 KV heads must not be taken (MHA: KV heads = heads)
    row = _row("narayanan21-t2-ptdp-175B-384gpu")
    row["model"].update(heads=128, kv_heads=None)
    spec = model_from_row(row["model"])
    assert (spec.num_attention_heads, spec.num_kv_heads) == (128, 128)
    out = validate_rows([row])
    assert out["n_scored"] == 1, out["runs"][0]["skipped"]


def test_a_row_matches_the_preset_of_its_own_dimensions():
    # Llama 3 8B has Llama 2 7B's layers and hidden size but 8 KV heads and a 14336 FFN
    row = next(r for r in PUBLIC_ROWS if r["model"]["name"].startswith("Llama 3 8B"))
    spec = model_from_row(row["model"])
    assert (spec.num_kv_heads, spec.ffn_hidden_size, spec.vocab_size) == (8, 14336, 128256)
    assert spec.gated_mlp
    # Nemotron-3 8B (ffn 16384 = 4h, squared ReLU, 256k vocabulary; NeMo's Nemotron3Config8B) is no
    # Llama 2 7B although the layers and hidden size agree: the family's facts apply
    nemotron = model_from_row(_row("nemo-24.07-Nemotron-8B-64g-pre")["model"])
    assert not nemotron.gated_mlp and nemotron.vocab_size == 256000 and nemotron.ffn_hidden_size == 16384


def test_a_published_plan_outside_the_legal_space_is_counted_with_its_rule():
    row = _row("narayanan21-t1-1.7B")        # 24 heads, 32 GPUs
    row["plan"].update(tp=16, dp=2)          # 16 does not divide 24 heads
    good = _row("narayanan21-t1-1.7B")
    out = validate_rows([good, row])
    assert out["n_scored"] == 1 and out["n_not_in_space"] == 1
    (entry,) = out["not_in_space"]
    assert entry["id"] == row["id"] and [b["rule"] for b in entry["rules"]] == ["tp_heads"]
    assert "tp_heads" in out["runs"][1]["skipped"] and "num_attention_heads=24" in out["runs"][1]["skipped"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -5.0, 0, "fast"])
def test_a_non_finite_measurement_is_skipped_not_averaged(bad):
    rows = [_row("narayanan21-t1-1.7B"), _row("nemotron4-15B-dp96")]
    alone = validate_rows(rows[:1])
    rows[1]["measured"]["tokens_per_s_per_gpu"] = bad
    out = validate_rows(rows)
    assert out["n_scored"] == 1 and math.isfinite(out["mape_pct"])
    assert out["mape_pct"] == pytest.approx(alone["mape_pct"])
    assert out["runs"][1]["skipped"].startswith("measured.tokens_per_s_per_gpu: not a")
    json.dumps(out, allow_nan=False)      # the --json output stays strict JSON


def test_a_calibration_applies_only_to_its_gpu(tmp_path):
    rows = [_row("narayanan21-t1-1.7B"), _row("nemo-24.07-LLAMA3-8B-8g-pre")]
    assert [r["hardware"]["gpu_key"] for r in rows] == ["a100-80gb", "h100"]
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps(rows))
    cal = tmp_path / "h100.json"
    cal.write_text(json.dumps({"gpu": "h100", "params": {"gemm_eff_max": 0.7}}))
    out = api.validate(str(runs), calibration=str(cal))
    a100, h100 = out["runs"]
    assert h100["error_pct"] is not None and a100["error_pct"] is None
    assert "fitted for GPU 'h100'" in a100["skipped"] and "a100-80gb" in a100["skipped"]
    assert out["calibration_gpu"] == "h100"
    cal.write_text(json.dumps({"gpu": "b300", "params": {}}))
    with pytest.raises(SpecError, match="fitted for GPU 'b300'.*no run"):
        api.validate(str(runs), calibration=str(cal))


def test_validate_a_bundled_dataset_by_name():
    with pytest.raises(SpecError, match="one of them"):
        api.validate(PUBLIC, dataset="public")
    with pytest.raises(SpecError, match="dataset"):
        api.validate(dataset="nope")


def test_korthikanti_table5_from_the_literature_and_measured_constants():
    # Korthikanti et al. 2022 Table 5 (8 Megatron-LM runs of GPT 22B-1T on 8-512 A100, iteration times as
    # published), never in any fit: with the literature prior alone (its measured H200 constants included)
    # the cost model is within issue 11's 3 % MAPE, Calculon's level (3.65 %, max 8.9 %)
    from autotune.validate import validate_runs
    from costmodels.params import LITERATURE_PRIOR
    res = validate_runs(dataset="korthikanti22", params=LITERATURE_PRIOR)
    assert res["n_scored"] == 8
    assert res["mape_pct"] < 3.0 and res["max_abs_error_pct"] < 6.0, res["mape_pct"]


def test_korthikanti_table5_with_the_shipped_defaults():
    # the same 8 never-fitted runs with the shipped constants, which are the fit of the other sources started
    # from the literature prior (tests/benchmarks/fit_defaults.py): 3.21 %, max 6.3 %, every run too slow
    # (issue 11's target is 3 %: 2.98 % before unfused attention's backward was counted op by op, which
    # improved every leave-one-source-out and leave-one-generation-out figure but moved the shared
    # gemm_eff_max fit 0.914 -> 0.900; 5.95 % while the defaults were a chain of warm-started fits)
    from autotune.validate import validate_runs
    res = validate_runs(dataset="korthikanti22")
    assert res["n_scored"] == 8
    assert res["mape_pct"] < 3.5 and res["max_abs_error_pct"] < 7.0, res["mape_pct"]


def test_vtrain_multi_node_runs_held_out_with_the_shipped_defaults():
    # vTrain's 109 multi-node Megatron-DeepSpeed runs (GPT 3.6B-175B on 64-512 A100, 3-47 plans per job), never in
    # any fit: 8.7 % MAPE with the shipped defaults when this guard was set (max 86 %: 3.6B at tp 8 with one
    # micro-batch of 64 sequences); with the DGX A100 NIC (25 GB/s) instead of the 12.5 GB/s per GPU of vTrain's
    # own configs, 10.1 %
    from autotune.validate import validate_runs
    res = validate_runs(dataset="vtrain-multi")
    assert res["n_scored"] == 109 and res["n_skipped"] == 0
    assert res["n_predicted_oom"] == 0 and res["n_not_in_space"] == 0
    assert res["mape_pct"] < 10.0, res["mape_pct"]


@pytest.mark.parametrize("nic", [0, -5, "fast", float("nan"), float("inf"), 1e12, True])
def test_a_bad_stated_nic_bandwidth_is_named(nic):
    row = json.loads(json.dumps(load_dataset("vtrain-multi")[0]))
    row["hardware"]["inter_node_gb_per_s"] = nic
    with pytest.raises(SpecError, match="hardware.inter_node_gb_per_s"):
        case_from_row(row)


def test_a_stated_nic_bandwidth_is_the_clusters():
    row = load_dataset("vtrain-multi")[0]
    assert case_from_row(row).problem.cluster.inter_node_bw_bytes_per_s == pytest.approx(12.5e9)
    plain = json.loads(json.dumps(row))
    del plain["hardware"]["inter_node_gb_per_s"]
    assert case_from_row(plain).problem.cluster.inter_node_bw_bytes_per_s == pytest.approx(25e9)    # DGX A100


def _iteration_time(row: dict) -> float:
    """The step time a row's tokens/s per GPU stands for: global batch x sequence / (GPUs x tokens/s)."""
    return (row["plan"]["global_batch"] * row["model"]["seq_len"]
            / (row["hardware"]["num_gpus"] * row["measured"]["tokens_per_s_per_gpu"]))


def test_a_run_given_by_its_iteration_time_alone_is_scored_like_its_throughput():
    """A user's runs file often has Megatron's "elapsed time per iteration" and no tokens/s: validate and
    calibrate read the same throughput from it (validate.measured_throughput, one definition)."""
    row = _row("nemo-24.07-LLAMA3-8B-8g-pre")
    timed = copy.deepcopy(row)
    timed["measured"] = {"iteration_time_s": _iteration_time(row)}
    a, b = validate_rows([row]), validate_rows([timed])
    assert b["n_scored"] == 1 and b["mape_pct"] == pytest.approx(a["mape_pct"], rel=1e-6)
    assert b["runs"][0]["measured_tokens_per_s_per_gpu"] == pytest.approx(row["measured"]["tokens_per_s_per_gpu"])
    (case_a,), (case_b,) = build_cases([row], EfficiencyParams()), build_cases([timed], EfficiencyParams())
    assert case_b.measured_step_s == pytest.approx(case_a.measured_step_s, rel=1e-6)


@pytest.mark.parametrize("factor, scored", [(1.03, True), (0.97, True), (1.2, False), (0.5, False)])
def test_throughput_and_iteration_time_that_contradict_each_other_are_refused(factor, scored):
    """Both given: they must agree within validate.MEASURED_AGREEMENT_FRAC (5 %), else the run is skipped by
    validate and left out of calibrate, with the reason naming both fields."""
    row = _row("nemo-24.07-LLAMA3-8B-8g-pre")
    row["measured"]["iteration_time_s"] = _iteration_time(row) * factor
    out = validate_rows([row])
    assert out["n_scored"] == int(scored)
    assert len(build_cases([row], EfficiencyParams())) == int(scored)
    if not scored:
        why = out["runs"][0]["skipped"]
        assert "measured.tokens_per_s_per_gpu" in why and "measured.iteration_time_s" in why and "disagree" in why


@pytest.mark.parametrize("bad", [float("nan"), -1.0, "slow"])
def test_an_unusable_iteration_time_is_named_not_ignored(bad):
    row = _row("nemo-24.07-LLAMA3-8B-8g-pre")
    row["measured"]["iteration_time_s"] = bad
    out = validate_rows([row])
    assert out["n_scored"] == 0 and out["runs"][0]["skipped"].startswith("measured.iteration_time_s: not a")
    json.dumps(out, allow_nan=False)


def test_a_run_without_any_measurement_is_skipped_with_the_fields_named():
    row = _row("nemo-24.07-LLAMA3-8B-8g-pre")
    row["measured"] = {"memory_gb": 71.0}        # no throughput, time or FLOP rate (tests/test_tflops_rows.py: those)
    out = validate_rows([row])
    assert out["n_scored"] == 0
    assert "tokens_per_s_per_gpu" in out["runs"][0]["skipped"] and "iteration_time_s" in out["runs"][0]["skipped"]
