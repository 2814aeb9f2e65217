"""MoE, context parallelism and topology: legality, hand-computed costs, placement, search behaviour."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from autotune import api
from autotune.scoring import Inputs, score_full
from autotune.search import exhaustive, predict
from costmodels import collectives as C
from costmodels import model as cm
from costmodels.encode import encode_cluster, encode_job, encode_model
from costmodels.params import EfficiencyParams
from costmodels.plan import Plan, PlanBatch
from costmodels.specs import Recompute, SpecError
from search_spaces.space import check_plan, enumerate_legal

E = EfficiencyParams()


@pytest.fixture(scope="module")
def mixtral():
    return api.build_problem(model="mixtral-8x7b", gpu="h100", gpus=64, global_batch=256, seq_len=4096)


@pytest.mark.parametrize("gpus, plan, rule", [
    (64, "tp=1,pp=1,ep=3", "ep_experts"),                 # 8 experts, ep=3
    (64, "tp=1,pp=2,ep=16", "ep_experts"),                # more EP ranks than experts
    (64, "tp=2,pp=8,ep=8,etp=2,sp=true", "ep_fold"),      # ep*etp=16 does not fold into tp*cp*dp=8
    (48, "tp=1,pp=1,etp=3", "etp_ffn"),                   # 14336 is not divisible by 3
    (64, "tp=2,pp=1,sp=false", "moe_tp_needs_sp"),
    (64, "tp=1,pp=1,cp=3", "gpus"),                       # 3 does not divide 64 GPUs
])
def test_moe_and_cp_legality_rules_name_the_rule(gpus, plan, rule):
    prob = api.build_problem(model="mixtral-8x7b", gpu="h100", gpus=gpus, global_batch=192, seq_len=4096)
    with pytest.raises(SpecError) as exc:
        api.plan_from_text(plan, prob)
    assert rule in str(exc.value)


def test_cp_needs_the_sequence_in_2cp_chunks():
    prob = api.build_problem(model="llama3-8b", gpu="h100", gpus=16, global_batch=16, seq_len=4100)
    with pytest.raises(SpecError) as exc:
        api.plan_from_text("tp=1,pp=1,cp=4", prob)
    assert "cp_seq" in str(exc.value) and "2*cp=8" in str(exc.value)


def test_ep_on_a_dense_model_is_illegal():
    prob = api.build_problem(model="llama3-8b", gpu="h100", gpus=16, global_batch=64, seq_len=4096)
    with pytest.raises(SpecError) as exc:
        api.plan_from_text("tp=1,pp=1,ep=2", prob)
    assert "ep_experts" in str(exc.value) and "dense" in str(exc.value)


def test_published_moe_plans_are_legal():
    p = api.build_problem(model="deepseek-v3", gpu="h800", gpus=2048, global_batch=15360, seq_len=4096)
    # DeepSeek-V3's 61 layers do not split over pp=16: Megatron-Bridge gives it a layout
    check_plan(Plan(tp=1, pp=16, dp=128, ep=64, mbs=1, zero=1, layout="Et*4|(t*4|)*14tmL"), p)
    q = api.build_problem(model="qwen3-235b-a22b", gpu="gb200", gpus=256, global_batch=8192, seq_len=4096)
    # Qwen3-235B's 94 layers + embedding + loss over pp=8 x vpp=3 (Megatron-Bridge's accounting)
    check_plan(Plan(tp=1, pp=8, dp=32, ep=32, vpp=3, mbs=1, zero=1, account_for_embedding=True,
                    account_for_loss=True), q)


# ------------------------------------------------------------------ hand-computed costs

HW = {"domain": 8.0, "site": 1024.0, "sites": 1.0, "intra_bw": 450e9, "inter_bw": 50e9, "wan_bw": 1e30,
      "intra_lat": 3e-6, "inter_lat": 8e-6, "wan_lat": 8e-6}
EFF = (0.8, 0.5)


def test_all_to_all_inside_a_domain():
    S = 64e6
    t = float(C.all_to_all_s(S, 8.0, 1.0, HW, EFF))
    expect = S * 7 / 8 / (450e9 * 0.8) + 2 * math.log2(8) * 3e-6
    assert t == pytest.approx(expect, rel=1e-5)


def test_all_to_all_across_nodes_splits_traffic_by_link():
    S = 64e6
    # ep=32 at stride 1: 8 ranks per node; 7/32 of the data over NVLink, 24/32 over the NICs
    t = float(C.all_to_all_s(S, 32.0, 1.0, HW, EFF))
    expect = max(S * 7 / 32 / (450e9 * 0.8), S * 24 / 32 / (50e9 * 0.5)) + 2 * math.log2(32) * 8e-6
    assert t == pytest.approx(expect, rel=1e-5)


def test_ring_attention_exchange_matches_hand_computation():
    prob = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=8, seq_len=8192)
    params = E._replace(cp_overlap=0.0)
    inp = Inputs(prob)
    plan = Plan(tp=1, pp=1, cp=2, dp=4, mbs=1)
    out = score_full(PlanBatch.from_plans([plan]), inp, params)
    T = 1 * 8192 / 2
    kv_bytes = T * 2 * 8 * 128 * 2.0                      # K and V of 8 KV heads x 128, bf16
    bw, lat = C.group_link(jnp.float32(2.0), jnp.float32(1.0), inp.hw, (params.intra_bw_eff, params.inter_bw_eff))
    raw = (2 - 1) * (kv_bytes / float(bw) + float(lat))
    per_layer = raw + 2 * raw                             # forward, backward (K, V and their grads)
    m = 8 / (4 * 1)
    assert float(out["time.cp_comm"][0]) == pytest.approx(m * 32 * per_layer, rel=1e-4)


# ------------------------------------------------------------------ topology placement

@pytest.mark.parametrize("n, stride, domain, crosses_domain", [
    (8, 1, 8, False),      # TP=8 inside a DGX node
    (16, 1, 8, True),      # TP=16 spans two nodes
    (4, 8, 8, True),       # a DP group of stride 8 (TP=8 inside) crosses nodes
    (8, 8, 72, False),     # EP=8 at stride 8 fits in one NVL72 rack (64 GPUs)
    (16, 8, 72, True),     # 128 GPUs do not
])
def test_group_placement_chooses_the_link(n, stride, domain, crosses_domain):
    hw = dict(HW, domain=float(domain))
    c0, c1 = C.crosses_levels(jnp.float32(n), jnp.float32(stride), hw)
    assert bool(c0) == crosses_domain and not bool(c1)
    bw, _ = C.group_link(jnp.float32(n), jnp.float32(stride), hw, EFF)
    k0 = min(max(domain // stride, 1), n)
    expect = 450e9 * 0.8 if not crosses_domain else min(450e9 * 0.8, k0 * 50e9 * 0.5)
    assert float(bw) == pytest.approx(expect, rel=1e-6)


@pytest.fixture(scope="module")
def two_sites():
    return api.build_problem(model="llama3-70b", gpu="h100", gpus=1024, cluster_file="two-sites.yaml",
                             global_batch=1024, seq_len=8192)


def test_two_sites_pipeline_spans_the_wan_and_nothing_else(two_sites):
    res = exhaustive(two_sites, top_k=5)
    inp = Inputs(two_sites)
    for rep in res.top:
        pl = rep["plan"]
        assert pl["pp"] % two_sites.cluster.num_sites == 0
        for n, stride in ((pl["tp"], 1), (pl["cp"], pl["tp"]), (pl["ep"], pl["etp"])):
            _, crosses_site = C.crosses_levels(jnp.float32(n), jnp.float32(stride), inp.hw)
            assert not bool(crosses_site)
    assert "pipeline stages span" in api_explanation(res, two_sites)


def api_explanation(res, problem):
    from autotune.report import explain
    return explain(res.best, res.runner_up, problem)


def test_dp_across_sites_is_much_slower_than_pp_across_sites(two_sites):
    pp_plan = predict(two_sites, Plan(tp=8, pp=2, dp=64, mbs=1, sp=True, zero=1, recompute=Recompute.FULL))
    dp_plan = predict(two_sites, Plan(tp=8, pp=1, dp=128, mbs=1, sp=True, zero=1, recompute=Recompute.FULL))
    # all gradients over the WAN vs inside each site (fp32 gradient reduction, Megatron's default,
    # in both)
    assert dp_plan["time_breakdown_s"]["dp_comm"] > 5 * pp_plan["time_breakdown_s"]["dp_comm"]
    assert pp_plan["step_time_s"] < dp_plan["step_time_s"]


# ------------------------------------------------------------------ search behaviour

@pytest.mark.slow
def test_deepseek_v3_on_h800_prefers_expert_parallelism():
    p = api.build_problem(model="deepseek-v3", gpu="h800", gpus=2048, global_batch=15360, seq_len=4096)
    best = exhaustive(p, top_k=1).best
    best_ep1 = exhaustive(p, top_k=1, fixed={"ep": 1}).best
    assert best["plan"]["ep"] > 1 and best["step_time_s"] < best_ep1["step_time_s"]
    published = predict(p, Plan(tp=1, pp=16, dp=128, ep=64, mbs=1, zero=1))
    assert published["step_time_s"] > 0 and math.isfinite(published["step_time_s"])


# ------------------------------------------------------------------ properties

def _legal_sample(problem, n=400, seed=0):
    it, _ = enumerate_legal(problem)
    batch = next(it)
    rng = np.random.default_rng(seed)
    return batch.select(rng.choice(len(batch), size=min(n, len(batch)), replace=False))


@settings(max_examples=25, deadline=None)
@given(i=st.integers(0, 399))
def test_more_ep_never_raises_expert_weight_memory(mixtral, i):
    batch = _legal_sample(mixtral)
    plan = batch.plan(i % len(batch))
    bigger = [Plan(**{**plan.as_dict(), "recompute": plan.recompute, "ep": e})
              for e in (2 * plan.ep, 4 * plan.ep)]
    legal = []
    for b in bigger:
        try:
            check_plan(b, mixtral)
            legal.append(b)
        except SpecError:
            pass
    if not legal:
        return
    out = score_full(PlanBatch.from_plans([plan] + legal), Inputs(mixtral), E)
    w = out["memory.weights"]
    assert all(w[k] <= w[0] * (1 + 1e-6) for k in range(1, len(w)))


@settings(max_examples=20, deadline=None)
@given(i=st.integers(0, 399), k=st.floats(1.0, 100.0))
def test_a_faster_wan_is_never_slower(two_sites, i, k):
    batch = _legal_sample(two_sites)
    sub = batch.select(np.array([i % len(batch)]))
    m = encode_model(two_sites.model)
    hw = encode_cluster(two_sites.cluster)
    job = encode_job(two_sites.job, two_sites.cluster)
    faster = dict(hw, wan_bw=np.float32(hw["wan_bw"] * k))
    t0 = float(cm.evaluate_jit(sub.arrays, m, hw, job, E).step_time_s[0])
    t1 = float(cm.evaluate_jit(sub.arrays, m, faster, job, E).step_time_s[0])
    assert t1 <= t0 * (1 + 1e-5)


# ------------------------------------------------------------------ bad input through the CLI

@pytest.mark.parametrize("args, field", [
    (["predict", "--model", "mixtral-8x7b", "--gpu", "h100", "--gpus", "64", "--global-batch", "256",
      "--plan", "tp=1,pp=1,ep=3"], "ep_experts"),
    (["predict", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "16", "--global-batch", "16",
      "--seq-len", "4100", "--plan", "tp=1,pp=1,cp=4"], "cp_seq"),
])
def test_moe_and_cp_bad_plans_exit_2_with_one_line(args, field):
    from typer.testing import CliRunner
    from cli.main import app
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    err = (res.stderr if hasattr(res, "stderr") else res.output).strip().splitlines()
    assert len(err) == 1 and field in err[0] and "Traceback" not in res.output


def test_cluster_file_with_inconsistent_gpu_counts_exits_2(tmp_path):
    from typer.testing import CliRunner
    from cli.main import app
    f = tmp_path / "bad.yaml"
    f.write_text("gpu: h100\ngpus: 1024\nsites: {count: 2, gpus_per_site: 256, wan_bandwidth_gb_per_s: 100, "
                 "wan_latency_ms: 10}\n")
    res = CliRunner().invoke(app, ["search", "--model", "llama3-8b", "--cluster", str(f), "--no-save"])
    assert res.exit_code == 2
    err = (res.stderr if hasattr(res, "stderr") else res.output).strip().splitlines()
    assert len(err) == 1 and "gpus_per_site" in err[0]


def test_shared_experts_pay_their_own_tp_collectives():
    """Shared experts are column/row-parallel over TP (Megatron-Core SharedExpertMLP): with TP > 1
    an MoE layer with shared experts does one more all-gather / reduce-scatter pair per forward."""
    import dataclasses
    from search_spaces.space import Problem
    p = api.build_problem(model="deepseek-v2-lite", gpu="h100", gpus=16, global_batch=64, seq_len=4096)
    assert p.model.num_shared_experts > 0
    no_shared = Problem(dataclasses.replace(p.model, num_shared_experts=0), p.cluster, p.job)
    plan = Plan(tp=2, dp=8, ep=2, mbs=1, sp=True, zero=1)
    with_s = predict(p, plan)["time_breakdown_s"]["tp_comm"]
    without = predict(no_shared, plan)["time_breakdown_s"]["tp_comm"]
    assert with_s > 1.3 * without


def test_p2p_inside_an_mi300x_node_uses_one_xgmi_link():
    """MI300X's 8 GPUs are a fully connected xGMI mesh: 7 links of 64 GB/s per direction (448 GB/s in
    all, AMD datasheet); a send/recv to one peer gets one link. Behind NVSwitch one peer gets all of
    NVLink (H100: 450 GB/s)."""
    from costmodels.presets import build_cluster
    eff = (1.0, 1.0)
    for gpu, peer_bw in (("mi300x", 64e9), ("h100", 450e9)):
        hw = encode_cluster(build_cluster(gpu=gpu, num_gpus=8))
        t = float(C.p2p_s(1e9, 1.0, 2.0, hw, eff))
        assert t == pytest.approx(1e9 / peer_bw + float(hw["intra_lat"]), rel=1e-4), gpu


def test_cp_ring_between_nodes_runs_at_one_nic():
    """Ring attention across nodes: each step every rank sends its K/V block to the next; the hop
    between nodes goes over one NIC, so a CP group that leaves the node is NIC-bound per step."""
    from costmodels.presets import build_cluster
    hw = encode_cluster(build_cluster(gpu="h100", num_gpus=16))
    eff = (1.0, 1.0)
    inside = float(C.p2p_s(1e8, 1.0, 8.0, hw, eff))        # cp 8 at stride 1: one node
    across = float(C.p2p_s(1e8, 2.0, 8.0, hw, eff))        # cp 8 at stride 2 (tp 2): two nodes
    assert inside == pytest.approx(1e8 / float(hw["intra_p2p_bw"]) + float(hw["intra_lat"]), rel=1e-4)
    assert across == pytest.approx(1e8 / float(hw["inter_bw"]) + float(hw["inter_lat"]), rel=1e-4)
