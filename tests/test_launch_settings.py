"""Published runs read with the settings of their published launch scripts (autotune/data/launch_settings.json),
and Megatron's --overlap-grad-reduce / --overlap-param-gather in the cost model."""
from __future__ import annotations

import pytest

from autotune import api
from autotune.datasets import DATASETS, launch_settings, launch_settings_by_source, load_dataset
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


def test_every_source_entry_names_a_bundled_source_and_its_evidence():
    rows = [r for name in DATASETS for r in load_dataset(name)]
    entries = launch_settings_by_source()
    assert entries
    for group, entry in entries.items():
        members = [r for r in rows if (r.get("source") or {}).get("group") == group]
        assert members, group
        prov = entry["provenance"]
        assert prov["repo"] and len(prov["commit"]) == 40 and prov["files"] and prov["reading"]
        assert set(entry) <= {"framework", "plan", "provenance"}
        for row in members:
            for key, val in (entry.get("plan") or {}).items():      # never overrides a published value
                assert row["plan"].get(key) in (None, val), (row["id"], key)


def test_vtrain_runs_reduce_fp16_gradients_once_after_the_backward():
    # VIA-Research/vTrain @ f8dda847: all 1,548 validation configs set "use_gradient_bucket": false, and its
    # simulator adds one fp16 all-reduce of each stage's parameters after the stage's last backward
    row = load_dataset("small-scale")[0]
    case = case_from_row(row)
    fw = case.problem.job.framework
    assert fw.overlap_grad_reduce is False and fw.grad_reduce_in_fp32 is False
    assert case.fixed["zero"] == 0 and case.fixed["sp"] == 0 and not {"zero", "sp"} & set(case.filled)
    assert with_launch_settings(row)[1] == launch_settings_by_source()["vTrain measurements"]


def test_rows_without_an_entry_are_untouched():
    row = ROWS["narayanan21-t2-zero3-175B-384gpu"]
    assert with_launch_settings(row) == (row, {})


@pytest.mark.parametrize("rid,lora", [("nemo-24.07-LLAMA2-7B-8g-SFT", False), ("nemo-24.07-LLAMA2-70B-16g-SFT", False),
                                      ("nemo-24.07-LLAMA2-13B-8g-LoRA", True), ("nemo-24.07-LLAMA2-70B-8g-LoRA", True)])
def test_nemo_2407_fine_tuning_ran_packed_squad_and_nemo1s_lora_targets(rid, lora):
    # "SQuAD v1.1 packed to 4096" (the row's notes); NeMo 1's megatron_gpt_finetuning_config.yaml:
    # lora_tuning.target_modules ['attention_qkv'], adapter_dim 32 (NVIDIA/NeMo@0078023)
    fw = case_from_row(ROWS[rid]).problem.job.framework
    assert fw.packed_example_tokens == 240 and "packed to 4096" in ROWS[rid]["notes"]
    assert (fw.lora_dim, [m.value for m in fw.lora_target_modules][:1]) == ((32, ["linear_qkv"]) if lora else
                                                                          (0, ["linear_qkv"]))
    pre = case_from_row(ROWS["nemo-24.07-LLAMA2-7B-8g-pre"]).problem.job.framework      # pretraining: neither
    assert pre.packed_example_tokens == 0 and pre.lora_dim == 0


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


def _predict(fw: dict, plan: str, **job):
    problem = api.build_problem(**{"model": "llama3-8b", "gpu": "h100", "gpus": 8, "global_batch": 32,
                                   "seq_len": 4096, **job}, framework=fw)
    return api.predict_plan(problem, api.plan_from_text(plan, problem))


def test_without_gradient_accumulation_fusion_each_micro_batch_adds_its_gradients_in_memory():
    """Llama-3 8B (8.03B parameters, Meta) on one H100 rank per replica, 4 micro-batches: unfused, each
    micro-batch reads its bf16 gradient and reads + writes the fp32 main gradient (2 + 4 + 4 bytes per
    parameter) at the H100's 3.35 TB/s x hbm_eff; nothing else moves."""
    from costmodels.presets import GPU_PRESETS
    plan = "tp=1,pp=1,mbs=1,zero=1,recompute=full"
    fused, unfused = _predict({}, plan), _predict({"gradient_accumulation_fusion": False}, plan)
    per_mb = 8.03e9 * (2 + 4 + 4) / (GPU_PRESETS["h100"].hbm_bandwidth_bytes_per_s * EfficiencyParams().hbm_eff)
    got = unfused["step_time_s"] - fused["step_time_s"]
    assert got == pytest.approx(4 * per_mb, rel=0.02)
    assert unfused["time_breakdown_s"]["compute"] - fused["time_breakdown_s"]["compute"] == pytest.approx(got, rel=1e-4)
    # bf16 gradient reduction keeps bf16 main gradients: 2 + 2 + 2 bytes
    bf16 = {"grad_reduce_in_fp32": False}
    d16 = (_predict({**bf16, "gradient_accumulation_fusion": False}, plan)["step_time_s"]
           - _predict(bf16, plan)["step_time_s"])
    assert d16 == pytest.approx(got * 6 / 10, rel=0.02)


def test_gradient_accumulation_fusion_exports_as_megatrons_flag():
    from autotune.export import bridge_overrides, megatron_args
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=32, seq_len=4096,
                                framework={"gradient_accumulation_fusion": False})
    plan = api.plan_from_text("tp=1,pp=1,mbs=1,zero=1", problem)
    assert "--no-gradient-accumulation-fusion" in [str(a) for a in megatron_args(plan, problem)]
    assert "model.gradient_accumulation_fusion=false" in bridge_overrides(plan, problem)
    on = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=32, seq_len=4096)
    assert "--no-gradient-accumulation-fusion" not in [str(a) for a in megatron_args(plan, on)]


@pytest.mark.parametrize("rid", ["narayanan21-t1-1.7B", "narayanan21-t1-1008.0B", "narayanan21-t2-ptdp-175B-384gpu",
                                 "megatronlm-readme-gpt3-175b-1024a100"])
def test_2021_megatron_runs_had_no_gradient_accumulation_fusion(rid):
    # added to Megatron-LM on 2022-02-13 (commit 83b1e42f30), after every 2021 run
    assert case_from_row(ROWS[rid]).problem.job.framework.gradient_accumulation_fusion is False


@pytest.mark.parametrize("sp", [False, True])
def test_the_backward_tp_collective_hides_under_the_weight_gradient_gemm_since_2022(sp):
    """Megatron-LM's column-parallel backward issues its input-gradient collective asynchronously and
    computes the weight gradient meanwhile (all of the backward TP traffic without SP, the reduce-scatter
    half with SP); 2021's code waited for it. Forward collectives are never hidden this way."""
    plan = f"tp=8,pp=1,mbs=1,zero=1,sp={str(sp).lower()}"
    job = dict(model="llama3-70b", gpus=64, global_batch=64)
    on = _predict({}, plan, **job)["time_breakdown_s"]["tp_comm"]
    off = _predict({"async_tensor_model_parallel_allreduce": False}, plan, **job)["time_breakdown_s"]["tp_comm"]
    assert off > on
    assert off - on <= (0.25 if sp else 0.5) * off * (1 + 1e-5)     # at most the backward (half of it with SP)
    # with TE userbuffers (--tp-comm-overlap, SP) the collectives are chunked under the GEMMs anyway
    if sp:
        ub = {"tp_comm_overlap": True}
        assert _predict(ub, plan, **job)["time_breakdown_s"]["tp_comm"] == pytest.approx(
            _predict({**ub, "async_tensor_model_parallel_allreduce": False}, plan, **job)["time_breakdown_s"]["tp_comm"])


def test_a_plan_scored_with_the_2021_synchronous_tp_all_reduce_is_not_exported():
    from autotune.export import ExportRefused, export
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=32, seq_len=4096,
                                framework={"async_tensor_model_parallel_allreduce": False})
    plan = api.plan_from_text("tp=2,pp=1,mbs=1,zero=1", problem)
    for target in ("megatron", "bridge", "torchtitan"):
        with pytest.raises(ExportRefused, match="async_tensor_model_parallel_allreduce"):
            export(target, plan, problem)


# examples/moe_recipes/*.yaml @ 8a2ac1fdc7 (NVIDIA/Megatron-LM): the ARGS each recipe-index run was launched with
@pytest.mark.parametrize("rid,dispatcher,overlap,vpp,recompute,modules,layout", [
    # deepseek_v3/b200/mxfp8_256GPU_TP1PP8EP32.yaml: flex (deepep), EP overlap, selective [mla_up_proj, mlp], a layout
    # of 16 virtual stages on pp 8
    ("DeepSeekV3-B200_MXFP8-256g", "flex", True, 2, 1, {"mlp", "mla_up_proj"}, "Et*4|(tttt|)*14tmL"),
    # qwen3_235b/h100/bf16_256GPU_TP2PP8EP32.yaml: num_layers_per_virtual_pipeline_stage 3 with both account-for flags:
    # (94 + 2) / 8 / 3 = 4 virtual stages; recompute_modules "moe_act layernorm"
    ("Qwen3_235B-H100_BF16-256g", "flex", True, 4, 1, {"moe_act", "layernorm"}, ""),
    # qwen3_30b/h100/bf16_32GPU_TP1PP1EP8.yaml: flex (hybridep) without EP overlap, no recompute
    ("Qwen3_30B-H100_BF16-32g", "flex", False, 1, 0, set(), ""),
])
def test_moe_recipe_index_runs_use_their_yaml_args(rid, dispatcher, overlap, vpp, recompute, modules, layout):
    from costmodels.plan import RECOMPUTE_MODULES
    case = case_from_row(ROWS[f"mcore-moe-recipes-{rid}"])
    fw = case.problem.job.framework
    assert fw.moe_token_dispatcher_type.value == dispatcher and fw.overlap_moe_expert_parallel_comm is overlap
    assert fw.tp_comm_overlap is False                   # Megatron-LM's default; no recipe sets it
    assert case.fixed["vpp"] == vpp and case.fixed["recompute"] == recompute
    assert {m for i, m in enumerate(RECOMPUTE_MODULES) if case.fixed.get("recompute_modules", 0) >> i & 1} == modules
    assert case.fixed.get("layout", "") == layout and "vpp" not in case.filled


def test_a_recipes_deprecated_external_cuda_graph_is_te_graphs():
    # qwen3_30b/gb200/mxfp8_16GPU_TP1PP1EP16_partial_cg.yaml sets external_cuda_graph: true, which Megatron-LM's
    # arguments.py (@8a2ac1fdc7) turns into --cuda-graph-impl transformer_engine, over its cuda_graph_scope
    fw = case_from_row(ROWS["mcore-moe-recipes-Qwen3_30B-GB200_MXFP8_partial_CG-16g"]).problem.job.framework
    assert fw.cuda_graph_impl.value == "transformer_engine"
    assert [m.value for m in fw.cuda_graph_modules] == ["attn", "moe_router", "moe_preprocess"]
