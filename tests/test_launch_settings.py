"""Published runs read with the settings of their published launch scripts (autotune/data/launch_settings.json),
and Megatron's --overlap-grad-reduce / --overlap-param-gather in the cost model."""
from __future__ import annotations

import pytest

from autotune import api
from autotune.datasets import launch_settings, load_dataset
from autotune.validate import case_from_row, with_launch_settings
from costmodels.params import EfficiencyParams

ROWS = {r["id"]: r for r in load_dataset("public")}


def test_every_entry_names_a_bundled_row_and_agrees_with_what_the_row_publishes():
    entries = launch_settings()
    assert len(entries) >= 20
    for rid, entry in entries.items():
        assert rid in ROWS, rid
        prov = entry["provenance"]
        assert (prov.get("repo") == "NVIDIA/Megatron-LM" and prov["commit"]) or prov.get("paper")
        assert prov["files"] and prov["reading"]
        for key, val in (entry.get("model") or {}).items():        # never overrides a published value
            assert ROWS[rid]["model"].get(key) in (None, val), (rid, key)
        plan = ROWS[rid]["plan"]
        for key, val in (entry.get("checks") or {}).items():       # published values the script must repeat
            assert plan[key] == val, (rid, key)
        for key, val in (entry.get("plan") or {}).items():         # never overrides a published value
            assert plan.get(key) in (None, val), (rid, key)


# examples/sc21/run_table_1.sh @ 6985e58938 (Narayanan et al. 2021, Table 1): MBS, virtual stages
# (--num-layers-per-virtual-pipeline-stage L gives layers / pp / L), --DDP-impl torch (overlapped) or local
@pytest.mark.parametrize("name,mbs,vpp,overlap", [
    ("1.7B", 16, 1, True), ("18.4B", 8, 1, True), ("39.1B", 4, 1, False), ("76.1B", 2, 3, False),
    ("145.6B", 2, 2, False), ("310.1B", 1, 2, False), ("529.6B", 1, 3, False), ("1008.0B", 1, 1, False)])
def test_table_1_runs_use_the_sc21_scripts_settings(name, mbs, vpp, overlap):
    case = case_from_row(ROWS[f"narayanan21-t1-{name}"])
    assert case.fixed["mbs"] == mbs and case.fixed["vpp"] == vpp and case.fixed["zero"] == 0
    assert not {"mbs", "vpp", "zero"} & set(case.filled)
    fw = case.problem.job.framework
    assert fw.overlap_grad_reduce is overlap and fw.tp_comm_overlap is False
    assert fw.attention_backend.value == "unfused" and fw.grad_reduce_in_fp32 is False


def test_the_readme_175b_run_is_the_2021_script_not_the_best_plan():
    # examples/pretrain_gpt3_175B.sh @ 152aab304d: --micro-batch-size 1, --fp16, --checkpoint-activations,
    # no interleaving, no sequence parallelism (both came later)
    case = case_from_row(ROWS["megatronlm-readme-gpt3-175b-1024a100"])
    assert (case.fixed["mbs"], case.fixed["vpp"], case.fixed["recompute"], case.fixed["sp"]) == (1, 1, 2, 0)
    assert case.problem.job.precision.value == "fp16" and case.filled == []


def test_rows_without_an_entry_are_untouched():
    row = ROWS["nemo-24.07-LLAMA2-7B-8g-pre"]
    assert with_launch_settings(row) == (row, {})


def test_nemotron_4_has_the_untied_embeddings_of_its_paper():
    # Parmar et al. 2024 sec. 2: "untied input-output embeddings", 3.2B embedding parameters (2 x 256,000 x 6,144)
    model = case_from_row(ROWS["nemotron4-15B-dp96"]).problem.model
    assert model.tied_embeddings is False and not model.gated_mlp and model.vocab_size == 256_000


def _dp_comm(fw: dict, zero: int) -> float:
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=64, global_batch=64, seq_len=4096, framework=fw)
    pred = api.predict_plan(problem, api.plan_from_text(f"tp=1,pp=1,mbs=1,zero={zero}", problem))
    return pred["time_breakdown_s"]["dp_comm"]


@pytest.mark.parametrize("zero", [0, 1])
def test_without_overlap_grad_reduce_the_data_parallel_traffic_is_exposed(zero):
    """GA 1: one backward to hide the gradient reduction under; without --overlap-grad-reduce (Megatron's
    default, and Megatron-LM's only behaviour before 2023) none of it hides."""
    on = _dp_comm({}, zero)
    off = _dp_comm({"overlap_grad_reduce": False, "overlap_param_gather": False}, zero)
    assert off > on > 0
    # with a backward long enough to hide under, the share dp_overlap of the traffic hides
    assert on == pytest.approx(off * (1.0 - EfficiencyParams().dp_overlap), rel=1e-3)
    if zero:    # the parameter all-gather alone
        assert on < _dp_comm({"overlap_param_gather": False}, zero) < off
        # Megatron asserts --overlap-param-gather needs --overlap-grad-reduce: the flag alone hides nothing
        assert _dp_comm({"overlap_grad_reduce": False}, zero) == pytest.approx(off, rel=1e-6)


def test_cli_takes_megatrons_overlap_flags_and_exports_them():
    import json

    from typer.testing import CliRunner

    from cli.main import app
    args = ["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "64", "--global-batch", "64",
            "--seq-len", "4096", "--plan", "tp=1,pp=1,mbs=1,zero=1", "--json"]
    runs = [CliRunner().invoke(app, args + extra) for extra in ([], ["--no-overlap-grad-reduce"])]
    assert all(r.exit_code == 0 for r in runs), runs[-1].output
    on, off = (json.loads(r.stdout)["time_breakdown_s"]["dp_comm"] for r in runs)
    assert off > on
    r = CliRunner().invoke(app, ["export", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "64", "--global-batch",
                                 "64", "--seq-len", "4096", "--plan", "tp=1,pp=1,mbs=1,zero=1", "--to",
                                 "megatron", "--no-overlap-grad-reduce"])
    assert r.exit_code == 0, r.output
    assert "--overlap-grad-reduce" not in r.output and "--use-distributed-optimizer" in r.output


def test_a_nemotron_research_run_is_not_read_as_a_nemo_benchmark_recipe():
    """Only NeMo / Megatron-Bridge benchmark tables reduce gradients in bf16 (their recipes' setting): the
    Nemotron-4 report's run keeps Megatron-LM's fp32 gradient reduction ("nemo" inside "Nemotron" is not NeMo)."""
    from autotune.validate import is_nemo_recipe
    assert not is_nemo_recipe(ROWS["nemotron4-15B-dp96"])
    assert case_from_row(ROWS["nemotron4-15B-dp96"]).problem.job.framework.grad_reduce_in_fp32 is True
    nemo = next(r for r in ROWS.values() if r["id"].startswith("nemo-24.07"))
    assert is_nemo_recipe(nemo) and case_from_row(nemo).problem.job.framework.grad_reduce_in_fp32 is False
