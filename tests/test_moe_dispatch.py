"""How MoE tokens travel, as Megatron-Core runs them (issue 11: "the dispatcher ... shared-expert overlap"):

* `--moe-token-dispatcher-type flex` (DeepEP / HybridEP) sends a token to another NVLink domain once,
  however many of its top-k experts live there [DeepEP README, normal kernels], and inside its domain once
  per destination rank (DeepEP intranode.cu: a copy per rank where `is_token_in_rank`); the plain `alltoall`
  sends one copy per expert. Golden shares are the combinatorics of uniform (force-balanced) routing; the
  flex kernels' NVLink rate is HybridEP's measured one on 8 B200 (DeepEP hybrid-ep branch).
* `--overlap-moe-expert-parallel-comm` (MCore 0.14 "batch-level overlapping") merges the forward of one
  micro-batch with the backward of another so each one's all-to-alls run under the other's compute;
  Megatron-Core refuses it without EP, with a pipeline but no interleaving, with full or moe recompute,
  with the allgather dispatcher and in fp32 (transformer_config.py __post_init__).
Both default off: tests/test_frozen.py holds the default predictions.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from autotune import api
from autotune.export import ExportRefused, bridge_overrides, export, megatron_args
from autotune.report import problem_dict
from autotune.saved import problem_from_report
from cli.main import app
from costmodels import collectives as C
from costmodels.specs import FrameworkSpec, SpecError

#: Qwen3-235B-A22B (128 experts, top-8) on 32 H100 nodes: EP 32 spans 4 NVLink domains of 8
JOB = dict(model="qwen3-235b-a22b", gpu="h100", gpus=256, global_batch=2048, seq_len=4096)
PLAN = "tp=2,pp=8,vpp=4,ep=32,sp=true,mbs=1,zero=1,account_for_embedding=true,account_for_loss=true"
HW = {"domain": jnp.float32(8.0)}


@pytest.mark.parametrize("k, n, expected", [
    # D = n / 8 domains; a token reaches (D-1)(1-(1-1/D)^k) other domains, against k(D-1)/D copies
    (8, 32, 4 * (1 - 0.75 ** 8) / 8),          # Qwen3 top-8 over 4 nodes: 0.450
    (8, 16, 2 * (1 - 0.5 ** 8) / 8),           # over 2 nodes: 0.249
    (8, 64, 1 - (7 / 8) ** 8),                 # DeepSeek-V3 top-8 over 8 nodes: 0.656
    (1, 64, 1.0),                              # top-1: nothing to deduplicate
    (8, 8, 1.0),                               # one node: nothing leaves it
])
def test_node_dedup_share(k, n, expected):
    got = float(C.node_dedup_share(jnp.float32(k), jnp.float32(n), jnp.float32(1.0), HW))
    assert got == pytest.approx(expected, rel=1e-5)


@given(k=st.integers(1, 16), domains=st.integers(2, 64))
@settings(max_examples=60, deadline=None)
def test_dedup_never_sends_more_and_more_experts_dedup_more(k, domains):
    share = float(C.node_dedup_share(jnp.float32(k), jnp.float32(8 * domains), jnp.float32(1.0), HW))
    more_k = float(C.node_dedup_share(jnp.float32(k + 1), jnp.float32(8 * domains), jnp.float32(1.0), HW))
    assert 0.0 < share <= 1.0 + 1e-6
    assert more_k <= share + 1e-6


@pytest.mark.parametrize("k, n, expected", [
    (8, 8, 8 * (1 - (7 / 8) ** 8) / 8),        # Qwen3-30B-A3B top-8 on EP 8: 5.25 ranks of 8 copies, 0.656
    (4, 8, 8 * (1 - (7 / 8) ** 4) / 4),        # GPT-OSS top-4 on EP 8: 0.826
    (2, 8, 8 * (1 - (7 / 8) ** 2) / 2),        # Mixtral top-2 on EP 8: 0.938
    (1, 8, 1.0),                               # top-1: one rank, one copy
    (8, 1, 1.0),                               # no EP
])
def test_rank_dedup_share(k, n, expected):
    assert float(C.rank_dedup_share(jnp.float32(k), jnp.float32(n))) == pytest.approx(expected, rel=1e-5)


def test_flex_inside_a_node_matches_hybridep_measured_on_b200():
    """DeepEP's hybrid-ep branch (Hybrid-EP_Intra-node_Implementation.md) measured HybridEP on 8 B200: 4096 tokens
    of hidden 7168, top-8 of 64 experts (8 per rank), uniform routing, 16 SMs, through the Torch API: dispatch 536
    GB/s of algorithm bandwidth (the bytes a rank receives, its own tokens included). A rank receives each token
    once if any of its 8 experts is among the token's 8: 8 x (1 - C(56,8)/C(64,8)) = 5.43 of 8 ranks per token."""
    from costmodels.communication import FLEX_NVL_EFF
    from costmodels.encode import encode_cluster
    from costmodels.presets import build_cluster
    hw = encode_cluster(build_cluster(gpu="b200", num_gpus=8))
    tokens, hidden, k, n = 4096, 7168, 8, 8
    ranks_hit = n * (1.0 - math.comb(56, 8) / math.comb(64, 8))
    measured_s = tokens * ranks_hit * hidden * 2 / 536e9
    share = C.rank_dedup_share(jnp.float32(k), jnp.float32(n))
    got = float(C.all_to_all_s(jnp.float32(tokens * k * hidden * 2), jnp.float32(n), jnp.float32(1.0), hw,
                               (FLEX_NVL_EFF, 0.7), local_share=share))
    assert got == pytest.approx(measured_s, rel=0.08)


def _predict(fw: dict, plan: str = PLAN, **job):
    problem = api.build_problem(**{**JOB, **job}, framework=fw)
    return api.predict_plan(problem, api.plan_from_text(plan, problem))


def test_flex_sends_less_between_nodes():
    plain, flex = _predict({}), _predict({"moe_token_dispatcher_type": "flex"})
    ep_plain, ep_flex = plain["time_breakdown_s"]["ep_comm"], flex["time_breakdown_s"]["ep_comm"]
    assert ep_flex < 0.7 * ep_plain                     # 4 nodes, top-8: inter-node bytes x 0.45
    assert flex["step_time_s"] < plain["step_time_s"]


@pytest.mark.parametrize("model, flex_faster", [
    ("qwen3-30b-a3b", True),        # top-8 of 128 on 8 ranks: 5.25 copies instead of 8 outweigh the slower kernels
    ("mixtral-8x7b", False),        # top-2 of 8: 1.88 copies instead of 2 do not
])
def test_flex_inside_one_node_deduplicates_per_rank(model, flex_faster):
    one_node = dict(plan="tp=1,pp=1,ep=8,mbs=1,zero=1", gpus=8, model=model, global_batch=64)
    a, b = _predict({}, **one_node), _predict({"moe_token_dispatcher_type": "flex"}, **one_node)
    plain, flex = a["time_breakdown_s"]["ep_comm"], b["time_breakdown_s"]["ep_comm"]
    assert (flex < plain) == flex_faster


def test_allgather_dispatcher_moves_every_token():
    """MoEAllGatherTokenDispatcher gathers all ep ranks' tokens ((ep-1) T h bytes in per rank) where the
    all-to-all moves only the routed copies (k (ep-1)/ep T h x imbalance): for Mixtral (top-2) on ep 8
    the gather moves ep / (k x imbalance) times the bytes (large messages: latency < 2 % of the time)."""
    one_node = dict(plan="tp=1,pp=1,ep=8,mbs=8,zero=1", gpus=8, model="mixtral-8x7b", global_batch=64, seq_len=4096)
    a2a, ag = _predict({}, **one_node), _predict({"moe_token_dispatcher_type": "allgather"}, **one_node)
    from costmodels.params import EfficiencyParams
    ratio = 8 / (2 * EfficiencyParams().moe_imbalance)
    got = ag["time_breakdown_s"]["ep_comm"] / a2a["time_breakdown_s"]["ep_comm"]
    assert got == pytest.approx(ratio, rel=0.03)


def test_batch_level_overlap_hides_all_to_alls():
    off, on = _predict({}), _predict({"overlap_moe_expert_parallel_comm": True})
    assert on["time_breakdown_s"]["ep_comm"] < 0.8 * off["time_breakdown_s"]["ep_comm"]
    assert on["step_time_s"] < off["step_time_s"]
    # nothing unrelated moves (compute and the TP collectives may: both are the slowest pipeline stage's, which
    # can change; with one stage the TP collectives stay)
    for k in ("optimizer", "overhead"):
        assert on["time_breakdown_s"][k] == pytest.approx(off["time_breakdown_s"][k], rel=1e-6)
    one_stage = "tp=2,pp=1,ep=32,sp=true,mbs=1,zero=1"
    off1, on1 = _predict({}, one_stage), _predict({"overlap_moe_expert_parallel_comm": True}, one_stage)
    assert on1["time_breakdown_s"]["ep_comm"] < 0.8 * off1["time_breakdown_s"]["ep_comm"]
    assert on1["time_breakdown_s"]["tp_comm"] == pytest.approx(off1["time_breakdown_s"]["tp_comm"], rel=1e-6)


def test_overlap_cannot_hide_more_than_the_other_micro_batch_computes():
    """With the all-to-alls far longer than compute (a slow network), the merged pairs hide at most
    `ep_overlap` of their compute: the exposed time falls by no more than the compute time."""
    slow = dict(inter_node_bw=1.0)                       # GB/s per GPU
    off, on = _predict({}, **slow), _predict({"overlap_moe_expert_parallel_comm": True}, **slow)
    saved = off["time_breakdown_s"]["ep_comm"] - on["time_breakdown_s"]["ep_comm"]
    assert 0.0 < saved <= off["time_breakdown_s"]["compute"] + 1e-6


@pytest.mark.parametrize("fw, plan, field", [
    ({"overlap_moe_expert_parallel_comm": True}, PLAN.replace("ep=32", "ep=1"), "ep_overlap_needs_ep"),
    ({"overlap_moe_expert_parallel_comm": True}, "tp=2,pp=8,vpp=1,ep=32,sp=true,mbs=1,zero=1,first_layers=10,last_layers=12", "ep_overlap_pp_needs_vpp"),
    ({"overlap_moe_expert_parallel_comm": True}, PLAN + ",recompute=full",
     "ep_overlap_recompute"),
    # token_dispatcher.py MoEFlexTokenDispatcher: "Flex token dispatcher requires TPxEP > 1"
    ({"moe_token_dispatcher_type": "flex"}, PLAN.replace("ep=32", "ep=1"), "flex_needs_ep"),
])
def test_megatron_refusals_are_plan_rules(fw, plan, field):
    problem = api.build_problem(**JOB, framework=fw)
    with pytest.raises(SpecError) as info:
        api.plan_from_text(plan, problem)
    assert field in info.value.field


@pytest.mark.parametrize("fw, job, field", [
    ({"overlap_moe_expert_parallel_comm": True, "moe_token_dispatcher_type": "allgather"}, {},
     "overlap_moe_expert_parallel_comm"),
    ({"overlap_moe_expert_parallel_comm": True}, {"precision": "fp32"}, "overlap_moe_expert_parallel_comm"),
    ({"overlap_moe_expert_parallel_comm": True, "framework": "deepspeed"}, {}, "overlap_moe_expert_parallel_comm"),
    # transformer_config.py: "Flex token dispatcher does not support moe_pad_expert_input_to_capacity" (DeepEP)
    ({"moe_token_dispatcher_type": "flex", "moe_expert_capacity_factor": 1.0}, {}, "moe_expert_capacity_factor"),
])
def test_megatron_refusals_of_the_job(fw, job, field):
    with pytest.raises(SpecError) as info:
        api.build_problem(**{**JOB, **job}, framework=fw)
    assert info.value.field == field


def test_search_obeys_the_rules():
    problem = api.build_problem(model="qwen3-30b-a3b", gpu="h100", gpus=16, global_batch=256, seq_len=4096,
                                framework={"overlap_moe_expert_parallel_comm": True})
    res = api.search(problem, top_k=20)
    plans = [r["plan"] for r in res.top]
    assert plans
    for p in plans:
        assert p["ep"] > 1 and p["recompute"] != "full"
        assert p["pp"] == 1 or p["vpp"] > 1


def test_exports_and_saved_reports_carry_it():
    problem = api.build_problem(**JOB, framework={"overlap_moe_expert_parallel_comm": True,
                                                  "moe_token_dispatcher_type": "flex"})
    plan = api.plan_from_text(PLAN, problem)
    args = megatron_args(plan, problem)
    assert "--overlap-moe-expert-parallel-comm" in args
    assert args[args.index("--moe-token-dispatcher-type") + 1] == "flex"
    assert "comm_overlap.overlap_moe_expert_parallel_comm=true" in bridge_overrides(plan, problem)
    from tests.test_export import _check_names      # every emitted name is one Megatron-LM / Bridge documents
    for target in ("megatron", "bridge"):
        _check_names(target, export(target, plan, problem))
    with pytest.raises(ExportRefused):
        export("torchtitan", plan, problem)
    again = problem_from_report({"problem": problem_dict(problem)})
    assert again.job.framework.overlap_moe_expert_parallel_comm is True


def test_cli_option():
    r = CliRunner().invoke(app, ["predict", "--model", "qwen3-235b-a22b", "--gpu", "h100", "--gpus", "256",
                                 "--global-batch", "2048", "--seq-len", "4096", "--plan", PLAN, "--overlap-moe-expert-parallel-comm",
                                 "--moe-token-dispatcher-type", "flex", "--json"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["predict", "--model", "qwen3-235b-a22b", "--gpu", "h100", "--gpus", "256",
                                 "--global-batch", "2048", "--seq-len", "4096", "--plan", PLAN.replace("vpp=4", "vpp=1"),
                                 "--overlap-moe-expert-parallel-comm"])
    assert r.exit_code == 2
    assert "vpp" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("row_id, dispatcher, overlap", [
    # Megatron-Bridge v0.4.0 qwen3_workload_base_configs.py: H100 Qwen3-235B moe_a2a_overlap=True, alltoall
    ("mbridge-arch-26.04-Qwen3_235B_a22B-DGX-H100-256g-FP8-133", "alltoall", True),
    # v0.4.0: Qwen3-30B on 16 H100 with moe_flex_dispatcher_backend="hybridep", no a2a overlap
    ("mbridge-arch-26.04-Qwen3_30B_a3B-DGX-H100-16g-FP8-129", "flex", False),
    # v0.6.0 perf_recipes: DeepSeek-V3 on GB300, hybridep + batch-level overlap
    ("mbridge-cur-26.08-DeepSeekV3-DGX-GB300-256g-MXFP8-1", "flex", True),
    # 25.11 GPT-OSS on H100 matches no recipe's parallelism: Megatron's defaults
    ("mbridge-arch-25.11-GPT_OSS_120B-DGX-H100-64g-BF16-245", "alltoall", False),
    ("nemo-24.07-LLAMA3-70B-64g-pre", "alltoall", False),             # dense, not a Bridge MoE row
])
def test_validation_runs_each_bridge_row_with_its_recipe(row_id, dispatcher, overlap):
    from autotune.datasets import load_dataset
    from autotune.validate import case_from_row
    row = next(r for r in load_dataset("public") if r.get("id") == row_id)
    fw = case_from_row(row).problem.job.framework
    assert fw.moe_token_dispatcher_type.value == dispatcher
    assert fw.overlap_moe_expert_parallel_comm is overlap


@pytest.mark.parametrize("row_id, recompute, modules", [
    # v0.4.0 gpt_oss_workload_base_configs.py: recompute_modules=["layernorm", "moe_act"]
    ("mbridge-arch-26.04-GPT_OSS_120B-DGX-H100-64g-BF16-124", "selective", ("layernorm", "moe_act")),
    # v0.4.0 set_qwen3_common_configs: recompute_granularity=None
    ("mbridge-arch-26.04-Qwen3_235B_a22B-DGX-H100-256g-FP8-133", "none", ()),
    # v0.6.0 perf_recipes: selective with an explicit empty module list recomputes nothing
    ("mbridge-cur-26.08-DeepSeekV3-DGX-GB300-256g-MXFP8-1", "none", ()),
    ("mbridge-arch-26.04-DeepSeekV3-DGX-B200-256g-MXFP8-119", "selective", ("mla_up_proj",)),
])
def test_validation_recomputes_as_the_recipe_did(row_id, recompute, modules):
    from autotune.datasets import load_dataset
    from autotune.validate import case_from_row
    from costmodels.plan import modules_of_mask
    from costmodels.specs import Recompute
    row = next(r for r in load_dataset("public") if r.get("id") == row_id)
    case = case_from_row(row)
    assert Recompute(case.fixed["recompute"]).name.lower() == recompute
    assert modules_of_mask(case.fixed.get("recompute_modules", 0)) == modules
    assert "recompute" not in case.filled


def test_validation_runs_the_25_09_token_drop_recipe_as_it_ran():
    """25.09's YAML recipes (Megatron-Bridge v0.1.0rc4): token drop = Bridge's apply_moe_token_drop
    (capacity factor 1.0, padded), and the deprecated enable_cuda_graph = cuda_graph_impl local."""
    from autotune.datasets import load_dataset
    from autotune.validate import case_from_row
    row = next(r for r in load_dataset("public")
               if r.get("id") == "mbridge-arch-25.09-Qwen3_30B_a3B_tokendrop_-DGX-B200-8g-primary-266")
    fw = case_from_row(row).problem.job.framework
    assert fw.moe_expert_capacity_factor == 1.0
    assert fw.cuda_graph_impl.value == "local" and fw.cuda_graph_modules == ()


@pytest.mark.parametrize("row_id, vpp", [
    # v0.4.0 gpt_oss_workload_base_configs.py: H100 pp 4 with virtual_pipeline_model_parallel_size=None (no
    # interleaving); the table's VP column is blank, and the row was scored with the fastest legal vpp (3)
    ("mbridge-arch-26.04-GPT_OSS_120B-DGX-H100-64g-BF16-124", 1),
    ("mbridge-arch-26.02-Qwen3_235B_a22B-DGX-B200-256g-MXFP8-214", 1),
    # the table states VP 4 for the H100 Qwen3-235B rows, and the recipe agrees
    ("mbridge-arch-26.04-Qwen3_235B_a22B-DGX-H100-256g-FP8-133", 4),
])
def test_a_blank_vp_column_runs_the_matched_recipes_virtual_pipeline(row_id, vpp):
    from autotune.datasets import load_dataset
    from autotune.validate import case_from_row
    row = next(r for r in load_dataset("public") if r.get("id") == row_id)
    case = case_from_row(row)
    assert case.fixed["vpp"] == vpp and "vpp" not in case.filled


def test_a_row_no_recipe_matched_still_fills_its_blank_vp():
    from autotune.datasets import load_dataset
    from autotune.validate import case_from_row
    row = next(r for r in load_dataset("public") if r.get("id") == "narayanan21-t2-ptdp-175B-384gpu")
    assert row["plan"].get("vpp") is None
    assert "vpp" in case_from_row(row).filled


@pytest.mark.parametrize("row_id, overlap", [
    # v0.4.0 configs/qwen/qwen3_llm_pretrain.py qwen3_235b_a22b_pretrain_config_h100:
    # cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False)
    ("mbridge-arch-26.04-Qwen3_235B_a22B-DGX-H100-256g-FP8-133", False),
    # v0.2.0 configs/qwen3/qwen3_llm_pretrain.py qwen3_235b_a22b_h100_config: tp_comm_overlap=False
    ("mbridge-arch-25.11-Qwen3_235B_a22B-DGX-H100-256g-FP8CS-247", False),
    # v0.1.0rc3: run_script.py passes DeepSeek-V3 no comm-overlap config; the library recipe's default is off
    ("mbridge-arch-25.09-DeepSeekV3_dropless_-DGX-H100-1024g-primary-272", False),
    # v0.1.0rc3 run_script.py, qwen3 235b_a22b: CommOverlapConfig(tp_comm_overlap=True)
    ("mbridge-arch-25.09-Qwen3_235B_a22B_tokendrop_-DGX-H100-256g-primary-275", True),
])
def test_a_bridge_row_with_tensor_parallelism_overlaps_tp_as_its_recipe_did(row_id, overlap):
    from autotune.datasets import load_dataset
    from autotune.validate import case_from_row
    row = next(r for r in load_dataset("public") if r.get("id") == row_id)
    assert row["plan"]["tp"] == 2
    assert case_from_row(row).problem.job.framework.tp_comm_overlap is overlap


#: Qwen3-30B-A3B on one 8-GPU B200 node, EP 8: the all-to-alls are a fifth of the step
ONE_NODE = dict(model="qwen3-30b-a3b", gpu="b200", gpus=8, global_batch=256, seq_len=4096)
ONE_NODE_PLAN = "tp=1,pp=1,ep=8,mbs=4,zero=1"


def _explained(gpu: str = "b200", **fw):
    from autotune.report import explain
    problem = api.build_problem(**{**ONE_NODE, "gpu": gpu}, framework=fw)
    best = api.predict_plan(problem, api.plan_from_text(ONE_NODE_PLAN, problem))
    return problem, best, explain(best, None, problem)


def test_explanation_suggests_flex_when_the_all_to_alls_weigh_and_flex_saves():
    problem, best, text = _explained()
    assert best["time_breakdown_s"]["ep_comm"] > 0.1 * best["step_time_s"]
    flex_problem = api.build_problem(**ONE_NODE, framework={"moe_token_dispatcher_type": "flex"})
    flex = api.predict_plan(flex_problem, api.plan_from_text(ONE_NODE_PLAN, flex_problem))
    assert flex["step_time_s"] < 0.97 * best["step_time_s"]
    assert "--moe-token-dispatcher-type flex" in text
    assert f"{flex['step_time_s']:.3g} s per step" in text


@pytest.mark.parametrize("gpu, fw", [
    ("b200", {"moe_token_dispatcher_type": "flex"}),   # already flex
    ("a100-80gb", {}),                                  # DeepEP / HybridEP run on Hopper and Blackwell only
])
def test_explanation_does_not_suggest_flex_where_it_cannot_help(gpu, fw):
    _, _, text = _explained(gpu, **fw)
    assert "--moe-token-dispatcher-type flex" not in text
