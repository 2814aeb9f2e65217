"""Multi-token prediction (DeepSeek-V3 sec. 2.2; Megatron-Core --mtp-num-layers): the modules' parameters, FLOPs,
time, memory, layout rules, the CLI option and the exporters. Goldens: DeepSeek-V3's README_WEIGHTS.md, Megatron-LM's
FLOPs formula and Megatron-Bridge's published DeepSeek-V3 runs (TFLOP/s beside tokens/s)."""
from __future__ import annotations

import dataclasses
import json
import statistics

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from autotune import api
from autotune.datasets import dataset_path
from autotune.export import ExportRefused, export
from autotune.search import exhaustive
from autotune.validate import case_from_row
from costmodels.params import EfficiencyParams
from costmodels.plan import Plan, parse_layout
from costmodels.presets import load_model, model_from_hf_config
from costmodels.specs import SpecError
from tests.test_cli import assert_one_line_error, run
from tests.test_export import NAMES, megatron_arg_dump


def test_deepseek_v3_mtp_module_parameters_match_the_published_count():
    m = load_model("deepseek-v3")
    assert m.mtp_num_layers == 1                       # config.json num_nextn_predict_layers
    # README_WEIGHTS.md: "MTP modules: 11.5B unique parameters" (the embedding and output head are shared)
    assert m.mtp_params() == pytest.approx(11.5e9, rel=0.015)
    # the published 671B main model leaves the MTP module out
    assert m.param_counts()["total"] == pytest.approx(671e9, rel=0.01)
    assert m.param_counts()["mtp"] == m.mtp_params()


@pytest.mark.parametrize("key, expected", [(None, 0), (1, 1), (2, 2)])
def test_hf_config_num_nextn_predict_layers(key, expected):
    cfg = dict(model_type="deepseek_v3", num_hidden_layers=4, hidden_size=256, intermediate_size=512,
               moe_intermediate_size=64, num_attention_heads=4, n_routed_experts=8, n_shared_experts=1,
               num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, vocab_size=1000)
    if key is not None:
        cfg["num_nextn_predict_layers"] = key
    m = model_from_hf_config(cfg, "tiny-v3")
    assert m.mtp_num_layers == expected
    assert m.mtp_layer_is_moe                          # the last layer is MoE, so the MTP layer is too


def test_mtp_num_layers_is_checked():
    m = load_model("llama3-8b")
    with pytest.raises(SpecError, match="mtp_num_layers"):
        dataclasses.replace(m, mtp_num_layers=-1)
    with pytest.raises(SpecError, match="mtp_num_layers"):
        dataclasses.replace(m, mtp_num_layers=m.num_layers + 1)


def _predict(model, plan: Plan, **job):
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=plan.num_gpus, **job)
    problem = dataclasses.replace(problem, model=model)
    return api.predict(problem, plan)


PLANS = [Plan(tp=1, pp=1, dp=8, mbs=1), Plan(tp=2, pp=2, dp=2, mbs=1, sp=True),
         Plan(tp=1, pp=4, dp=2, vpp=2, mbs=1)]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"pp{p.pp}")
def test_mtp_flops_follow_megatron_lm_and_cost_time(plan):
    """Megatron-LM num_floating_point_operations: an MTP module adds a layer of the last layer's kind,
    3 x 2 x (2h x h) for its projection (its norms' 3h aside) and the logits once more, 3 x 2 x h x V per token."""
    base = load_model("llama3-8b")
    h, V = base.hidden_size, base.vocab_size
    job = dict(global_batch=64, seq_len=4096)
    p0 = _predict(base, plan, **job)
    p1 = _predict(dataclasses.replace(base, mtp_num_layers=1), plan, **job)
    longer = _predict(dataclasses.replace(base, num_layers=base.num_layers + 4), plan, **job)
    one_layer = (longer["model_tflops_per_gpu"] / longer["tokens_per_s_per_gpu"]
                 - p0["model_tflops_per_gpu"] / p0["tokens_per_s_per_gpu"]) * 1e12 / 4
    added = (p1["model_tflops_per_gpu"] / p1["tokens_per_s_per_gpu"]
             - p0["model_tflops_per_gpu"] / p0["tokens_per_s_per_gpu"]) * 1e12
    assert added == pytest.approx(one_layer + 3 * 2 * 2 * h * h + 3 * 2 * h * V, rel=2e-3)
    assert p1["step_time_s"] > p0["step_time_s"]
    assert p1["memory_gb"]["total"] >= p0["memory_gb"]["total"]


def test_mtp_sits_on_the_last_rank():
    """Without a layout Megatron-Core builds the MTP modules on the last pipeline stage: with pp = 4 the last
    stage gains a layer, the output layer again and an embedding of its own."""
    from costmodels import encode, pipeline
    from costmodels.compute import shapes
    from costmodels.memory import stage_params
    m = dataclasses.replace(load_model("llama3-8b"), mtp_num_layers=1)
    problem = dataclasses.replace(api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64,
                                                    seq_len=4096), model=m)
    from costmodels.plan import PlanBatch
    plans = PlanBatch.from_plans([Plan(tp=1, pp=4, dp=2, mbs=1)])
    P = {k: plans[k].astype("float32") for k in plans.arrays}
    M = encode.encode_model(m)
    J = encode.encode_job(problem.job, problem.cluster)
    S = shapes(P, M, J, EfficiencyParams())
    st = pipeline.stages(S, P, M)
    assert (float(st.first[0]), float(st.mid[0]), float(st.last[0])) == (8.0, 8.0, 9.0)
    last = stage_params(S, M, 8.0, 1.0, 1.0).dense - stage_params(S, M, 8.0, 1.0, 0.0).dense
    h, V = m.hidden_size, m.vocab_size
    assert float(last[0]) == pytest.approx(2 * h * h + V * h, rel=1e-6)   # eh_proj + the embedding copy


@pytest.mark.parametrize("layout, pp, mtp, error", [
    ("Et*4|(t*4|)*14tmL", 16, 1, None),
    ("Et*4|(t*4|)*14tL", 16, 1, "holds 0 MTP layers"),
    ("Et*4|(t*4|)*14tmL", 16, 0, "holds 1 MTP layers"),
])
def test_layout_holds_the_model_mtp_layers(layout, pp, mtp, error):
    if error is None:
        assert parse_layout(layout, pp, 61, mtp).last == 2        # the last rank: a layer and the MTP layer
    else:
        with pytest.raises(SpecError, match=error):
            parse_layout(layout, pp, 61, mtp)


def test_layout_mtp_placement_rules():
    # pp = 2, vpp = 2: stages in order (rank 0, v0), (rank 1, v0), (rank 0, v1), (rank 1, v1)
    with pytest.raises(SpecError, match="last virtual stage"):
        parse_layout("Et|ttm||L", 2, 3, 1)
    with pytest.raises(SpecError, match="one virtual stage"):
        parse_layout("Et|t|tm|mL", 2, 3, 2)
    assert parse_layout("Et|t|t|mL", 2, 3, 1).layers_per_rank == (2, 2)   # rank 1: a layer and the MTP layer


BRIDGE_DEEPSEEK = [r for r in json.loads(open(dataset_path("public")).read())
                   if "DeepSeekV3" in r["id"] and r["id"].startswith("mbridge")
                   and (r.get("measured") or {}).get("tflops_per_gpu") and r["measured"].get("tokens_per_s_per_gpu")]


def test_bridge_deepseek_v3_published_flops_count_the_mtp_module():
    """Megatron-Bridge's DeepSeek-V3 tables give TFLOP/s beside tokens/s; their ratio is the FLOPs per token the
    runs counted, MTP included (Bridge's DeepSeek-V3 provider: mtp_num_layers 1). Without the module this model's
    count falls 3.8 % short; with it the median agrees within 0.5 %."""
    assert len(BRIDGE_DEEPSEEK) >= 8
    ratios, ratios_without = [], []
    for row in BRIDGE_DEEPSEEK:
        case = case_from_row(row)
        theirs = row["measured"]["tflops_per_gpu"] / row["measured"]["tokens_per_s_per_gpu"]
        for model, out in ((case.problem.model, ratios), (dataclasses.replace(case.problem.model, mtp_num_layers=0),
                                                          ratios_without)):
            fixed = dict(case.fixed)
            if model.mtp_num_layers == 0 and "layout" in fixed:
                fixed["layout"] = fixed["layout"].replace("m", "")
            best = exhaustive(dataclasses.replace(case.problem, model=model), EfficiencyParams(), top_k=1,
                              fixed=fixed).best
            out.append(theirs / (best["model_tflops_per_gpu"] / best["tokens_per_s_per_gpu"]))
    assert abs(statistics.median(ratios) - 1.0) < 0.005
    assert statistics.median(ratios_without) > 1.03


def test_cli_mtp_option_and_problem_line():
    args = ["predict", "--model", "deepseek-v3", "--gpu", "h100", "--gpus", "256", "--global-batch", "512",
            "--seq-len", "4096", "--precision", "fp8", "--plan", "tp=1,pp=2,ep=32,mbs=1,zero=1,recompute=full,account_for_embedding=true"]
    on = run(*args)
    assert on.exit_code in (0, 3), on.stderr
    assert "1 MTP module of 11.6 B more" in on.stdout
    off = run(*args, "--mtp-num-layers", "0")
    assert off.exit_code in (0, 3), off.stderr
    assert "MTP" not in off.stdout.split("Problem:")[1].splitlines()[0]
    assert_one_line_error(run(*args, "--mtp-num-layers", "-1"), 2, "mtp_num_layers")


def test_exports_carry_or_refuse_mtp():
    problem = api.build_problem(model="deepseek-v3", gpu="h100", gpus=256, global_batch=512, seq_len=4096,
                                precision="bf16")
    plan = Plan(tp=1, pp=2, dp=128, ep=32, mbs=1, zero=1, account_for_embedding=True)
    assert "--mtp-num-layers 1" in export("megatron", plan, problem).text
    bridge = export("bridge", plan, problem)
    assert "model.mtp_num_layers=1" in bridge.text
    # no layout in the plan: the recipe's own (Bridge's DeepSeek-V3 recipe builds one) is switched off
    assert "model.pipeline_model_parallel_layout=null" in bridge.text
    assert "model.account_for_embedding_in_pipeline_split=true" in bridge.text      # the plan's split, as given
    # every option name exists in the framework (the name lists read from its sources)
    for target in ("megatron", "bridge"):
        assert set(export(target, plan, problem).options) <= NAMES[target]
    maxtext = export("maxtext", Plan(tp=1, pp=1, dp=256, ep=32, mbs=1, zero=1), problem)
    assert "mtp_num_layers: 1" in maxtext.text and set(maxtext.options) <= NAMES["maxtext"]
    with pytest.raises(ExportRefused, match="mtp_num_layers"):
        export("torchtitan", Plan(tp=1, pp=1, dp=256, ep=32, mbs=1, zero=3), problem)
    off = api.build_problem(model="deepseek-v3", gpu="h100", gpus=256, global_batch=512, seq_len=4096,
                            precision="bf16", framework={"mtp_num_layers": 0})
    assert off.model.mtp_num_layers == 0
    assert "--mtp-num-layers" not in export("megatron", plan, off).text
    assert "model.mtp_num_layers=null" in export("bridge", plan, off).text


@pytest.mark.parametrize("value, expected", [("1", 1), ("None", 0)])
def test_a_megatron_log_says_whether_the_run_built_mtp(value, expected):
    from autotune.measurements import megatron_log_job
    job = megatron_log_job(megatron_arg_dump(mtp_num_layers=value, world_size=8))
    assert job["mtp_num_layers"] == expected and job["world_size"] == 8


@pytest.mark.parametrize("model, framework, needle", [
    ("gpt-oss-120b", {"mtp_num_layers": 1}, "RoPE only"),
    ("gpt3-175b", {"mtp_num_layers": 1}, "RoPE only"),
    ("llama3-8b", {"mtp_num_layers": 1, "framework": "deepspeed"}, "Megatron-DeepSpeed"),
    ("deepseek-v3", {"mtp_num_layers": 2, "overlap_moe_expert_parallel_comm": True}, "at most one MTP module"),
])
def test_mtp_where_megatron_refuses_it(model, framework, needle):
    """Megatron-LM's validate_args and TransformerConfig refuse these; so does the problem, naming the field."""
    with pytest.raises(SpecError, match=needle) as err:
        api.build_problem(model=model, gpu="h100", gpus=64, global_batch=256, seq_len=4096, framework=framework)
    assert err.value.field == "mtp_num_layers"


def test_mtp_with_ep_overlap_and_one_module_is_fine():
    problem = api.build_problem(model="deepseek-v3", gpu="h100", gpus=256, global_batch=512, seq_len=4096,
                                framework={"overlap_moe_expert_parallel_comm": True})
    assert problem.model.mtp_num_layers == 1


def _legal_sample(problem, n=400, seed=0):
    from search_spaces.space import enumerate_legal
    batches = list(enumerate_legal(problem)[0])
    plans = [b.plan(int(i)) for b in batches for i in range(len(b))]
    rng = np.random.default_rng(seed)
    return [plans[i] for i in rng.choice(len(plans), size=min(n, len(plans)), replace=False)]


@settings(max_examples=12, deadline=None)
@given(model=st.sampled_from(["deepseek-v2-lite", "qwen3-30b-a3b", "llama3-8b"]), gpus=st.sampled_from([8, 16, 32]),
       k=st.integers(1, 2), seed=st.integers(0, 2 ** 16))
def test_an_mtp_module_never_makes_a_plan_faster_or_smaller(model, gpus, k, seed):
    """Whatever the plan, adding MTP modules adds work and memory on one rank: never a shorter step, a smaller peak
    or fewer FLOPs (the others' stages keep their layers and their MoE share)."""
    from autotune.problem import build_problem
    from autotune.scoring import Inputs, score_full
    from costmodels.plan import PlanBatch
    base = build_problem(model=model, gpu="h100", gpus=gpus, global_batch=64, seq_len=2048)
    plans = PlanBatch.from_plans(_legal_sample(base, 200, seed))
    with_mtp = dataclasses.replace(base, model=dataclasses.replace(base.model, mtp_num_layers=k))
    p0 = score_full(plans, Inputs(base), EfficiencyParams())
    p1 = score_full(plans, Inputs(with_mtp), EfficiencyParams())
    assert np.all(p1["step_time_s"] >= p0["step_time_s"] * (1 - 1e-6))
    assert np.all(p1["memory.total"] >= p0["memory.total"] * (1 - 1e-6))
    assert np.all(p1["model_flops"] > p0["model_flops"])
