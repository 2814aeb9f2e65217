"""The plan space: legality rules, published plans, enumeration counts, derived dp.

Each rule of `search_spaces.space.RULES` gets a plan that breaks it (and only it) and the same plan
fixed; the published runs of ../shared/validation/public_runs.json must lie in the legal space; the
blocked, vectorized enumeration must agree with a brute-force loop over the knob domains that checks
every plan one at a time with `check_plan`.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from autotune.api import build_problem
from autotune.datasets import dataset_path
from costmodels.plan import PLAN_FIELDS, Plan, PlanBatch, modules_of_mask
from costmodels.presets import build_cluster
from costmodels.specs import (CudaGraphImpl, CudaGraphModule, DispatcherType, Framework, FrameworkSpec, JobSpec, ModelSpec, Precision,
                              Recompute, SpecError)
from search_spaces.space import (RULES, Problem, check_plan, check_rows, count_legal, domains,
                                 enumerate_legal, uneven_splits)

RUNS_FILE = Path(dataset_path("public"))      # the bundled copy of shared/validation/public_runs.json

# ---------------------------------------------------------------------------------------------
# Small problems whose every rule can be broken by hand
# ---------------------------------------------------------------------------------------------

DENSE = ModelSpec(name="dense-8l", num_layers=8, hidden_size=256, ffn_hidden_size=1024,
                  num_attention_heads=8, num_kv_heads=4, vocab_size=1000, gated_mlp=False)
MOE = ModelSpec(name="moe-8l", num_layers=8, hidden_size=256, ffn_hidden_size=1024,
                num_attention_heads=8, num_kv_heads=8, vocab_size=1000, num_experts=8,
                experts_per_token=2, moe_ffn_hidden_size=100)
CLUSTER16 = build_cluster(gpu="h100", num_gpus=16)
JOB = JobSpec(global_batch=32, seq_len=1024)


def _problem(model=DENSE, job=JOB, cluster=CLUSTER16) -> Problem:
    return Problem(model, cluster, job)


# (rule, why, problem, plan that breaks the rule, the same plan fixed[, rules it must also break])
_DS = JobSpec(global_batch=32, seq_len=1024, framework=FrameworkSpec(framework=Framework.DEEPSPEED))
_JAX = JobSpec(global_batch=32, seq_len=1024, framework=FrameworkSpec(framework=Framework.JAX))
_FLEX = JobSpec(global_batch=32, seq_len=1024, framework=FrameworkSpec(moe_token_dispatcher_type=DispatcherType.FLEX))
_EP_OVERLAP = JobSpec(global_batch=32, seq_len=1024, framework=FrameworkSpec(overlap_moe_expert_parallel_comm=True))
_OFFLOAD = JobSpec(global_batch=32, seq_len=1024, framework=FrameworkSpec(cpu_offloading_num_layers=2))

_CASES = [
    ("gpus", "tp*pp*dp != gpus", _problem(),
     Plan(tp=2, pp=2, dp=2), Plan(tp=2, pp=2, dp=4)),
    ("tp_heads", "tp divides heads but not kv heads", _problem(),
     Plan(tp=8, dp=2), Plan(tp=4, dp=4)),
    ("cp_seq", "seq not divisible by 2*cp", _problem(job=JobSpec(global_batch=32, seq_len=1000)),
     Plan(cp=8, dp=2), Plan(cp=4, dp=4)),
    ("cp_ring_attention", "a sliding window on Megatron's p2p context-parallel ring (TE asserts a2a / all_gather)",
     _problem(model=replace(DENSE, sliding_window=256)), Plan(cp=2, dp=8), Plan(dp=16)),
    ("pp_split", "a rank's layers not divisible by vpp", _problem(),
     Plan(pp=4, dp=4, vpp=4), Plan(pp=4, dp=4, vpp=2)),
    ("pp_split", "pp does not divide the layers (Megatron-Core's even split)", _problem(),
     Plan(pp=16, dp=1), Plan(pp=8, dp=2)),
    ("pp_split", "pp does not divide layers + embedding + loss", _problem(),
     Plan(pp=4, dp=4, account_for_embedding=True, account_for_loss=True),
     Plan(pp=2, dp=8, account_for_embedding=True, account_for_loss=True)),
    ("account_needs_pp", "embedding accounted without a pipeline", _problem(),
     Plan(dp=16, account_for_embedding=True), Plan(dp=16)),
    ("account_not_uneven", "accounting with an explicit first stage", _problem(),
     Plan(pp=2, dp=8, first_layers=3, account_for_embedding=True), Plan(pp=2, dp=8, first_layers=3)),
    ("recompute_modules_selective", "selective recompute without modules", _problem(),
     Plan(dp=16, recompute=Recompute.SELECTIVE),
     Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("core_attn",))),
    ("recompute_modules_selective", "modules without selective recompute", _problem(),
     Plan(dp=16, recompute_modules=("core_attn",)), Plan(dp=16)),
    ("recompute_modules_model", "MoE modules on a dense model", _problem(),
     Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("core_attn", "moe_act")),
     Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("core_attn",))),
    ("tp_overlap_needs_sp", "--tp-comm-overlap without sequence parallelism",
     _problem(job=JobSpec(global_batch=32, seq_len=1024, framework=FrameworkSpec(tp_comm_overlap=True))),
     Plan(tp=2, dp=8), Plan(tp=2, dp=8, sp=True)),
    ("zero_framework", "ZeRO-2 in Megatron-Core", _problem(),
     Plan(dp=16, zero=2), Plan(dp=16, zero=1)),
    ("vpp_needs_pp", "interleaving without a pipeline", _problem(),
     Plan(dp=16, vpp=2), Plan(dp=16, vpp=1)),
    ("batch_divisible", "global batch not divisible by dp*mbs", _problem(),
     Plan(tp=4, dp=4, mbs=3), Plan(tp=4, dp=4, mbs=2)),
    # no whole micro-batch (dp*mbs > global batch) also leaves a remainder, which is checked first
    ("microbatches", "dp*mbs exceeds the global batch", _problem(),
     Plan(dp=16, mbs=4), Plan(dp=16, mbs=2), ("batch_divisible",)),
    ("interleave_microbatches", "fewer micro-batches than pp when interleaving",
     _problem(job=JobSpec(global_batch=8, seq_len=1024)),
     Plan(pp=4, dp=4, vpp=2), Plan(pp=4, dp=4, vpp=1)),
    ("sp_needs_tp", "sequence parallel without TP", _problem(),
     Plan(dp=16, sp=True), Plan(dp=16, sp=False)),
    ("moe_tp_needs_sp", "MoE with tp>1 and no SP", _problem(MOE),
     Plan(tp=2, dp=8, sp=False), Plan(tp=2, dp=8, sp=True)),
    ("zero_needs_dp", "ZeRO with dp*cp == 1", _problem(),
     Plan(tp=4, pp=4, dp=1, zero=1), Plan(tp=4, pp=4, dp=1, zero=0)),
    ("zero23_no_pp", "FSDP with a pipeline", _problem(),
     Plan(pp=2, dp=8, zero=3), Plan(pp=2, dp=8, zero=1)),
    ("param_gather_needs_sharding", "fp8 primary weights without the distributed optimizer (Megatron's arguments.py)",
     _problem(job=JobSpec(global_batch=32, seq_len=1024, precision=Precision.FP8,
                          framework=FrameworkSpec(fp8_param_gather=True))),
     Plan(dp=16, zero=0), Plan(dp=16, zero=1)),
    ("lora_no_fsdp", "Megatron-FSDP with LoRA (unvalidated in Megatron-Bridge, its issue #4246)",
     _problem(job=JobSpec(global_batch=32, seq_len=1024, framework=FrameworkSpec(lora_dim=16))),
     Plan(dp=16, zero=3), Plan(dp=16, zero=1)),
    ("ep_experts", "ep does not divide the experts", _problem(MOE),
     Plan(dp=16, ep=16), Plan(dp=16, ep=8)),
    ("ep_experts", "ep on a dense model", _problem(),
     Plan(dp=16, ep=2), Plan(dp=16, ep=1)),
    ("ep_fold", "ep*etp does not divide tp*cp*dp", _problem(MOE),
     Plan(pp=4, dp=4, ep=8), Plan(pp=4, dp=4, ep=4)),
    ("etp_ffn", "etp does not divide the expert FFN", _problem(MOE),
     Plan(dp=16, etp=8), Plan(dp=16, etp=4)),
    ("etp_ffn", "etp on a dense model", _problem(),
     Plan(dp=16, etp=2), Plan(dp=16, etp=1)),
    # one stage cannot be uneven (and its layers no longer add up)
    ("stage_layers_need_pp", "first stage size without a pipeline", _problem(),
     Plan(dp=16, first_layers=1), Plan(dp=16), ("stage_layers_rest",)),
    ("stage_layers_vpp", "first stage not a multiple of vpp", _problem(),
     Plan(pp=2, dp=8, vpp=2, first_layers=1, last_layers=7), Plan(pp=2, dp=8, vpp=2, first_layers=2, last_layers=6)),
    ("stage_layers_rest", "two stages whose layers do not add up", _problem(),
     Plan(pp=2, dp=8, first_layers=3, last_layers=3), Plan(pp=2, dp=8, first_layers=3)),
    ("stage_layers_rest", "middle stages that do not split evenly", _problem(),
     Plan(pp=4, dp=4, first_layers=1), Plan(pp=4, dp=4, first_layers=2)),
    ("recompute_layers_full", "block recompute without full recompute", _problem(),
     Plan(dp=16, recompute_layers=2), Plan(dp=16, recompute=Recompute.FULL, recompute_layers=2)),
    ("cuda_graph_full_recompute", "full recompute with per-layer CUDA graphs",
     _problem(job=JobSpec(global_batch=32, seq_len=1024,
                          framework=FrameworkSpec(cuda_graph_impl=CudaGraphImpl.TRANSFORMER_ENGINE))),
     Plan(dp=16, recompute=Recompute.FULL), Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("core_attn",))),
    ("cuda_graph_moe_recompute", "moe recompute under a transformer_engine moe_router graph",
     _problem(MOE, job=JobSpec(global_batch=32, seq_len=1024, framework=FrameworkSpec(
         cuda_graph_impl=CudaGraphImpl.TRANSFORMER_ENGINE, cuda_graph_modules=(CudaGraphModule.MOE_ROUTER,)))),
     Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("moe",)),
     Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("core_attn",))),
    ("cuda_graph_dropout_recompute", "hidden dropout with a graphed MLP that selective recompute replays",
     _problem(replace(DENSE, hidden_dropout=0.1), job=JobSpec(global_batch=32, seq_len=1024, framework=FrameworkSpec(
         cuda_graph_impl=CudaGraphImpl.TRANSFORMER_ENGINE, cuda_graph_modules=(CudaGraphModule.MLP,)))),
     Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("mlp",)),
     Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("core_attn",))),
    ("fp8_delayed_recompute", "layernorm recompute under fp8 delayed scaling (Megatron-Core refuses it)",
     _problem(job=JobSpec(global_batch=32, seq_len=1024, precision=Precision.FP8)),
     Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("core_attn", "layernorm")),
     Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("core_attn",))),
    ("flex_needs_ep", "the flex dispatcher on an expert group of one rank", _problem(MOE, job=_FLEX),
     Plan(dp=16), Plan(dp=16, ep=2)),
    ("ep_overlap_needs_ep", "batch-level EP overlap without expert parallelism", _problem(MOE, job=_EP_OVERLAP),
     Plan(dp=16, ep=1), Plan(dp=16, ep=8)),
    ("ep_overlap_pp_needs_vpp", "batch-level EP overlap with a pipeline and no interleaving",
     _problem(MOE, job=_EP_OVERLAP), Plan(pp=2, dp=8, ep=8, vpp=1), Plan(pp=2, dp=8, ep=8, vpp=2)),
    ("ep_overlap_recompute", "batch-level EP overlap with full recompute", _problem(MOE, job=_EP_OVERLAP),
     Plan(dp=16, ep=8, recompute=Recompute.FULL), Plan(dp=16, ep=8, recompute=Recompute.NONE)),
    ("ep_overlap_recompute", "batch-level EP overlap with the moe module recomputed", _problem(MOE, job=_EP_OVERLAP),
     Plan(dp=16, ep=8, recompute=Recompute.SELECTIVE, recompute_modules=("moe",)),
     Plan(dp=16, ep=8, recompute=Recompute.SELECTIVE, recompute_modules=("core_attn",))),
    # Megatron-DeepSpeed (--framework deepspeed): DeepSpeed's pipeline engine and Megatron-DeepSpeed's arguments
    ("deepspeed_no_interleave", "interleaving on DeepSpeed's pipeline engine", _problem(job=_DS),
     Plan(pp=2, dp=8, vpp=2), Plan(pp=2, dp=8, vpp=1)),
    ("deepspeed_no_cp", "context parallelism in Megatron-DeepSpeed", _problem(job=_DS),
     Plan(cp=2, dp=8), Plan(tp=2, dp=8)),
    ("deepspeed_split", "Megatron-Core's account-for flags on DeepSpeed's PipelineModule", _problem(job=_DS),
     Plan(pp=2, dp=8, account_for_embedding=True, account_for_loss=True), Plan(pp=2, dp=8)),
    ("jax_split", "a Megatron pipeline split on MaxText, which splits evenly", _problem(job=_JAX),
     Plan(pp=2, dp=8, first_layers=3, last_layers=5), Plan(pp=2, dp=8)),
    ("deepspeed_recompute", "selective recompute of more than the core attention in Megatron-DeepSpeed",
     _problem(job=_DS), Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("core_attn", "layernorm")),
     Plan(dp=16, recompute=Recompute.SELECTIVE, recompute_modules=("core_attn",))),
    ("deepspeed_recompute", "block recompute on DeepSpeed's pipeline engine", _problem(job=_DS),
     Plan(pp=2, dp=8, recompute=Recompute.FULL, recompute_layers=2), Plan(dp=16, recompute=Recompute.FULL,
                                                                           recompute_layers=2)),
    # --cpu-offloading-num-layers (transformer_config.py): no pipeline, no recomputation
    ("cpu_offloading_no_pp", "CPU offloading with a pipeline", _problem(job=_OFFLOAD),
     Plan(pp=2, dp=8), Plan(tp=2, dp=8)),
    ("cpu_offloading_no_recompute", "CPU offloading with full recompute", _problem(job=_OFFLOAD),
     Plan(dp=16, recompute=Recompute.FULL), Plan(dp=16, recompute=Recompute.NONE)),
    ("recompute_layers_chunk", "block recompute of a whole chunk", _problem(),
     Plan(pp=2, dp=8, recompute=Recompute.FULL, recompute_layers=4),
     Plan(pp=2, dp=8, recompute=Recompute.FULL, recompute_layers=3)),
]


RULE_CASES = [c if len(c) == 6 else (*c, ()) for c in _CASES]
RULE_IDS = [f"{c[0]}-{c[1].replace(' ', '_')}" for c in RULE_CASES]


def _arrays(plan: Plan) -> dict:
    batch = PlanBatch.from_plans([plan])
    return {f: np.asarray(batch[f], dtype=np.int64) for f in PLAN_FIELDS}


def _broken_rules(plan: Plan, problem: Problem) -> list[str]:
    a = _arrays(plan)
    return [r.name for r in RULES if not bool(np.asarray(r.ok(a, problem)).reshape(-1)[0])]


def test_every_rule_has_a_case():
    """A new rule must come with a plan that breaks it (add it to RULE_CASES)."""
    assert {c[0] for c in RULE_CASES} == {r.name for r in RULES}


@pytest.mark.parametrize("rule, why, problem, bad, good, also", RULE_CASES, ids=RULE_IDS)
def test_rule_is_enforced(rule, why, problem, bad, good, also):
    # the bad plan breaks this rule and nothing else (but the rules it cannot be broken without)
    broken = _broken_rules(bad, problem)
    assert sorted(broken) == sorted([rule, *also])
    with pytest.raises(SpecError) as info:
        check_plan(bad, problem)
    err = info.value
    first = broken[0]                            # check_plan names the first rule broken
    assert first in err.field                    # the field names the rule: "plan (tp_heads)"
    assert first in str(err)
    assert "\n" not in str(err)                  # one line, for the CLI
    if first != rule:                            # the rule's own message, for enumeration reports
        rule_obj = next(r for r in RULES if r.name == rule)
        err = SpecError(f"plan ({rule})", rule_obj.explain(_arrays(bad), problem))
    # the message names the knob that the fix changes, and quotes values
    changed = [f for f in PLAN_FIELDS if getattr(bad, f) != getattr(good, f)]
    assert any(f in err.reason for f in changed), (changed, err.reason)
    assert any(ch.isdigit() for ch in err.reason)
    # the same plan fixed is legal
    check_plan(good, problem)
    assert _broken_rules(good, problem) == []


@pytest.mark.parametrize("rule, why, problem, bad, good, also", RULE_CASES, ids=RULE_IDS)
def test_rule_agrees_with_enumeration(rule, why, problem, bad, good, also):
    """The vectorized enumeration keeps the fixed plan and drops the bad one."""
    def listed(plan):
        fixed = {f: int(v[0]) for f, v in _arrays(plan).items() if f != "layout"}
        rows = [b for b in enumerate_legal(problem, fixed=fixed)[0]]
        return sum(len(b) for b in rows)
    assert listed(good) == 1
    assert listed(bad) == 0


def test_check_plan_reports_the_first_broken_rule():
    """A plan breaking several rules is reported by the first rule in RULES order."""
    p = _problem()
    plan = Plan(tp=8, dp=2, vpp=2, sp=False)     # tp_heads and vpp_needs_pp
    broken = _broken_rules(plan, p)
    assert broken == ["tp_heads", "vpp_needs_pp"]
    with pytest.raises(SpecError, match="tp_heads"):
        check_plan(plan, p)


# ---------------------------------------------------------------------------------------------
# Published plans are legal
# ---------------------------------------------------------------------------------------------

def _usable_rows() -> list:
    if not RUNS_FILE.exists():
        return []
    data = json.loads(RUNS_FILE.read_text())
    if isinstance(data, dict):
        data = data["runs"]
    return [r for r in data if r.get("usable")]


USABLE_ROWS = _usable_rows()

#: Usable published runs that the tool cannot express yet, with the reason (a real gap: the run
#: ran). Strict xfail, so the entry must be removed when the gap is closed.
KNOWN_UNEXPRESSIBLE: dict = {
    # "row id": "reason",
}


def _row_params():
    out = []
    for r in USABLE_ROWS:
        marks = ()
        if r["id"] in KNOWN_UNEXPRESSIBLE:
            marks = (pytest.mark.xfail(reason=KNOWN_UNEXPRESSIBLE[r["id"]], strict=True),)
        out.append(pytest.param(r, id=r["id"], marks=marks))
    return out


@pytest.mark.skipif(not USABLE_ROWS, reason=f"{RUNS_FILE} not found")
@pytest.mark.parametrize("row", _row_params())
def test_published_plan_is_legal(row):
    from autotune.validate import case_from_row

    try:
        case = case_from_row(row)
    except SpecError as exc:
        if "not modeled yet" in str(exc):         # a training mode the tool declares unsupported
            pytest.skip(str(exc))
        raise
    stream, stats = enumerate_legal(case.problem, fixed=case.fixed)
    batches = list(stream)
    n = sum(len(b) for b in batches)
    assert n >= 1, f"published plan {case.fixed} is not legal: {stats.as_dict()}"
    plan = row["plan"]
    for b in batches:
        for knob in ("tp", "pp", "dp", "cp", "ep", "vpp"):
            if plan.get(knob) is not None:
                assert np.all(np.asarray(b[knob]) == plan[knob]), knob
        if plan.get("micro_batch") is not None:
            assert np.all(np.asarray(b["mbs"]) == plan["micro_batch"])
        g = case.problem.cluster.num_gpus
        assert np.all(b["tp"] * b["cp"] * b["pp"] * b["dp"] == g)
    # and the single-plan check agrees on one of them
    check_plan(batches[0].plan(0), case.problem)


SMALL_RUNS_FILE = RUNS_FILE.with_name("small_scale_runs.json")


@pytest.mark.skipif(not SMALL_RUNS_FILE.exists(), reason=f"{SMALL_RUNS_FILE} not found")
def test_small_scale_published_plans_are_legal():
    """The 720 measured one-node runs (vTrain): every usable plan is in the legal space."""
    from autotune.validate import case_from_row

    data = json.loads(SMALL_RUNS_FILE.read_text())
    rows = [r for r in (data["runs"] if isinstance(data, dict) else data) if r.get("usable")]
    assert rows
    illegal = []
    for row in rows:
        case = case_from_row(row)
        stream, stats = enumerate_legal(case.problem, fixed=case.fixed)
        if sum(len(b) for b in stream) == 0:
            illegal.append((row["id"], case.fixed, stats.as_dict()["illegal"]))
    assert not illegal, f"{len(illegal)} published plans are illegal, e.g. {illegal[:3]}"


def test_usable_rows_are_many():
    if not USABLE_ROWS:
        pytest.skip(f"{RUNS_FILE} not found")
    assert len(USABLE_ROWS) >= 20


# ---------------------------------------------------------------------------------------------
# Enumeration counts and dp
# ---------------------------------------------------------------------------------------------

COUNT_PROBLEMS = {
    "llama3-8b@64xh100": dict(model="llama3-8b", gpu="h100", gpus=64, global_batch=512, seq_len=8192),
    "gpt3-175b@1024xa100": dict(model="gpt3-175b", gpu="a100-80gb", gpus=1024, global_batch=1536,
                                seq_len=2048),
    "mixtral-8x7b@64xh100": dict(model="mixtral-8x7b", gpu="h100", gpus=64, global_batch=512, seq_len=4096),
    "llama2-7b@24xa100": dict(model="llama2-7b", gpu="a100-80gb", gpus=24, global_batch=96, seq_len=4096),
}


@pytest.fixture(scope="module", params=sorted(COUNT_PROBLEMS))
def enumerated(request):
    problem = build_problem(**COUNT_PROBLEMS[request.param])
    stream, stats = enumerate_legal(problem)
    batches = list(stream)
    return problem, batches, stats


def test_counts_add_up(enumerated):
    problem, batches, stats = enumerated
    dom = domains(problem)
    raw = int(np.prod([len(v) for v in dom.values()]))
    # plus the uneven pipeline splits: every (pp, vpp)'s (first, last) pairs times the other knobs
    pairs = sum(len(uneven_splits(problem.model.num_layers, pp, v)) for pp in dom["pp"] for v in dom["vpp"])
    others = int(np.prod([len(v) for k, v in dom.items() if k not in (
        "pp", "vpp", "first_layers", "last_layers", "account_for_embedding", "account_for_loss")]))
    assert stats.total == raw + pairs * others
    assert stats.legal == sum(len(b) for b in batches) > 0
    assert stats.legal + sum(stats.illegal.values()) == stats.total
    assert all(c > 0 for c in stats.illegal.values())
    assert set(stats.illegal) <= {r.name for r in RULES}
    assert stats.as_dict()["legal"] == stats.legal
    again = count_legal(problem)
    assert again.as_dict() == stats.as_dict()


def test_enumerated_plans_are_legal_and_dp_is_derived(enumerated):
    problem, batches, _ = enumerated
    n = problem.cluster.num_gpus
    rows = {f: np.concatenate([np.asarray(b[f]) for b in batches]) for f in PLAN_FIELDS}
    assert np.all(rows["tp"] * rows["cp"] * rows["pp"] * rows["dp"] == n)
    assert np.all(rows["dp"] >= 1)
    legal, counts = check_rows({k: v.astype(np.int64) for k, v in rows.items()}, problem)
    assert legal.all() and not counts
    # no duplicates
    keys = np.stack([rows[f] for f in PLAN_FIELDS], axis=1)
    assert len(np.unique(keys, axis=0)) == len(keys)
    # every enumerated value comes from its knob's domain (the Optuna one for the stage sizes, which enumeration
    # takes from the uneven splits of the plan's own pp and vpp)
    dom = domains(problem, optuna_only=True)
    for f, values in dom.items():
        assert set(np.unique(rows[f]).tolist()) <= set(values), f
    uneven = (rows["first_layers"] > 0) | (rows["last_layers"] > 0)
    for pp, v, first, last in set(zip(*(rows[f][uneven].tolist() for f in ("pp", "vpp", "first_layers", "last_layers")))):
        assert (first, last) in uneven_splits(problem.model.num_layers, pp, v)


def test_fixed_knobs_pin_the_space(enumerated):
    problem, batches, _ = enumerated
    first = batches[0].plan(0)
    fixed = {"tp": first.tp, "pp": first.pp, "dp": first.dp}
    stream, stats = enumerate_legal(problem, fixed=fixed)
    rows = list(stream)
    assert stats.legal == sum(len(b) for b in rows) >= 1
    assert stats.legal + sum(stats.illegal.values()) == stats.total
    for b in rows:
        for k, v in fixed.items():
            assert np.all(np.asarray(b[k]) == v)


def test_fixed_dp_that_no_mesh_gives_is_illegal():
    problem = build_problem(**COUNT_PROBLEMS["llama3-8b@64xh100"])
    stream, stats = enumerate_legal(problem, fixed={"dp": 3})
    assert sum(len(b) for b in stream) == 0
    assert stats.legal == 0
    assert stats.illegal.get("gpus") == stats.total


def _brute_force(problem: Problem, fixed: dict | None = None):
    """Loop over the product of the knob domains, one plan at a time through check_plan."""
    dom = domains(problem, fixed)
    names = list(dom)
    n = problem.cluster.num_gpus
    legal, reasons, total = set(), Counter(), 0
    for values in itertools.product(*(dom[k] for k in names)):
        total += 1
        v = dict(zip(names, values))
        prod = v["tp"] * v["cp"] * v["pp"]
        if n % prod:
            reasons["gpus"] += 1
            continue
        v["dp"] = n // prod
        if fixed and "dp" in fixed and v["dp"] != fixed["dp"]:
            reasons["gpus"] += 1
            continue
        for f in ("sp", "account_for_embedding", "account_for_loss"):
            v[f] = bool(v[f])
        v["recompute"] = Recompute(v["recompute"])
        v["recompute_modules"] = modules_of_mask(v["recompute_modules"])
        plan = Plan(**v)
        try:
            check_plan(plan, problem)
        except SpecError as exc:
            reasons[exc.field.removeprefix("plan (").removesuffix(")")] += 1
            continue
        legal.add(tuple(int(v[0]) for v in PlanBatch.from_plans([plan]).arrays.values()))
    return legal, dict(reasons), total


TINY_DENSE = ModelSpec(name="tiny-4l", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                       num_attention_heads=4, num_kv_heads=2, vocab_size=100, gated_mlp=False)
TINY_MOE = ModelSpec(name="tiny-moe", num_layers=4, hidden_size=64, ffn_hidden_size=128,
                     num_attention_heads=4, num_kv_heads=4, vocab_size=100, num_experts=4,
                     experts_per_token=2, moe_ffn_hidden_size=64)


@pytest.mark.parametrize("model, fixed", [
    (TINY_DENSE, None),
    (TINY_MOE, {"recompute": 0}),                 # recompute is in no rule: pin it to keep it small
], ids=["dense", "moe"])
def test_enumeration_matches_brute_force(model, fixed):
    # seq 12: cp=2 splits it into 4 chunks, cp=4 cannot (8 chunks); batch 6: uneven micro-batches
    problem = Problem(model, build_cluster(gpu="h100", num_gpus=4), JobSpec(global_batch=6, seq_len=12))
    legal_bf, reasons_bf, total_bf = _brute_force(problem, fixed)
    stream, stats = enumerate_legal(problem, fixed=fixed)
    rows = [tuple(int(v) for v in t) for b in stream
            for t in zip(*(np.asarray(b[f]) for f in PLAN_FIELDS))]
    assert stats.total == total_bf
    assert len(rows) == len(set(rows)) == stats.legal == len(legal_bf)
    assert set(rows) == legal_bf
    assert dict(sorted(stats.illegal.items())) == dict(sorted(reasons_bf.items()))
    # the tiny problems exercise most rules (so the comparison is not vacuous)
    assert len(reasons_bf) >= 8


def test_domains_exclude_dp_and_respect_fixed():
    problem = _problem()
    dom = domains(problem)
    assert "dp" not in dom
    assert set(dom) == set(PLAN_FIELDS) - {"dp", "layout"}
    assert domains(problem, {"tp": 2})["tp"] == (2,)
    assert all(problem.model.num_attention_heads >= t for t in dom["tp"])
    assert dom["ep"] == (1,) and dom["etp"] == (1,)          # dense model
    assert max(domains(_problem(MOE))["ep"]) <= MOE.num_experts


def test_an_impossible_fixed_dp_is_named_as_given_in_the_no_legal_plan_message():
    # a published row's dp that no tp*cp*pp reaches on its GPU count (NeMo's B200 long-sequence table: 8 GPUs, dp 2)
    from autotune.search import NoLegalPlan, exhaustive
    problem = build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096)
    with pytest.raises(NoLegalPlan, match=r"tp\*cp\*pp\*dp = 1\*1\*1\*2 must equal gpus=8"):
        exhaustive(problem, fixed={"tp": 1, "pp": 1, "cp": 1, "dp": 2})


@pytest.mark.parametrize("m, pp, group", [(8, 4, 4), (6, 4, 6), (120, 16, 20), (33, 8, 11), (17, 16, 17), (48, 16, 16)])
def test_interleaving_takes_a_micro_batch_group_where_pp_does_not_divide(m, pp, group):
    """Megatron-Core's interleaved schedule (schedules.py): a group N in [pp, m] with m % N == 0 or m % N >= pp;
    the smallest such N, checked here against that rule written out, and the plan is legal."""
    from costmodels.plan import microbatch_group_size
    assert microbatch_group_size(m, pp) == group
    legal = [n for n in range(pp, m + 1) if m % n == 0 or m % n >= pp]
    assert group == min(legal)


def test_interleaving_six_micro_batches_over_four_stages_is_legal():
    # 24 sequences over dp 4: 6 micro-batches, which pp 4 does not divide; Megatron-Core runs them in one group of 6
    check_plan(Plan(pp=4, dp=4, vpp=2), _problem(job=JobSpec(global_batch=24, seq_len=1024)))


def test_the_distributed_optimizer_at_dp_1_is_legal_only_for_fp8_primary_weights():
    """zero=1 over one rank equals zero=0, so the space keeps one of the two; with --fp8-param-gather Megatron needs
    the distributed optimizer even there (Megatron-Bridge's Llama-3 70B LoRA recipe on 8 H100: tp 2, pp 4, dp 1)."""
    cluster8 = build_cluster(gpu="h100", num_gpus=8)
    fp8 = JobSpec(global_batch=32, seq_len=1024, precision=Precision.FP8,
                  framework=FrameworkSpec(fp8_param_gather=True))
    plan = Plan(tp=2, pp=4, dp=1, zero=1)
    check_plan(plan, Problem(DENSE, cluster8, fp8))
    with pytest.raises(SpecError, match="zero_needs_dp"):
        check_plan(plan, Problem(DENSE, cluster8, JobSpec(global_batch=32, seq_len=1024)))


# ---------------------------------------------------------------------------------------------
# Uneven pipeline stages in the exhaustive search (--decoder-first/last-pipeline-num-layers)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layers, pp, vpp, expected, source", [
    # DeepSeek-V3's 61 layers on 16 ranks: Megatron-Bridge's 26.02 recipe runs the layout Et*4|(t*4|)*14t*1mL,
    # i.e. 4 layers first, 14 ranks of 4, 1 layer last (and the MTP module, which first/last do not count)
    (61, 16, 1, (4, 1), "Megatron-Bridge DeepSeek-V3 recipe, 26.02"),
    # Llama 3 405B's 126 layers on 16 stages: "we reduce one Transformer layer each from the first and the last
    # stages" (Llama Team, The Llama 3 Herd of Models, 2024, sec. 3.3.2)
    (126, 16, 1, (7, 7), "Llama 3 paper, sec. 3.3.2"),
])
def test_uneven_splits_contain_the_published_pipelines(layers, pp, vpp, expected, source):
    assert expected in uneven_splits(layers, pp, vpp), source


def test_uneven_splits_never_repeat_the_even_split():
    assert uneven_splits(32, 4, 1) == ()
    assert uneven_splits(80, 4, 2) == ()
    assert uneven_splits(61, 1, 1) == ()


@pytest.mark.parametrize("layers", [24, 36, 61, 80, 94, 96, 126])
@pytest.mark.parametrize("pp", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("vpp", [1, 2, 3, 4])
def test_uneven_splits_are_balanced_and_legal(layers, pp, vpp):
    """Each pair leaves the middle ranks ceil(L / pp) layers rounded up to vpp, every stage a multiple of vpp
    and no stage heavier than a middle one; Megatron's rules (check_plan) accept every pair."""
    pairs = uneven_splits(layers, pp, vpp)
    assert len(pairs) <= 4
    k = -(-layers // (pp * vpp)) * vpp
    problem = build_problem(model="llama3-8b", gpu="h100", gpus=pp, global_batch=64, seq_len=2048)
    problem = replace(problem, model=replace(problem.model, num_layers=layers))
    for first, last in pairs:
        assert first + last + (pp - 2) * k == layers
        assert first % vpp == 0 and last % vpp == 0
        assert vpp <= first <= k and vpp <= last <= k
        check_plan(Plan(pp=pp, vpp=vpp, dp=1, first_layers=first, last_layers=last), problem)


def test_the_search_finds_deepseek_v3s_pipeline():
    """DeepSeek-V3 (61 layers) on 256 B200: no even split exists for pp 4-16, and the search used to recommend
    a ZeRO-3 plan without a pipeline at 1.4x the step the model itself gives the recipe's 16-stage pipeline.
    The best plan must be at least as fast as the Megatron-Bridge recipe's (26.02: TP1 PP16 EP8, 4 layers
    first and 1 last) scored by the same model, and so has a pipeline."""
    from autotune import api
    problem = api.build_problem(model="deepseek-v3", gpu="b200", gpus=256, global_batch=4096, seq_len=4096,
                                precision="fp8")
    recipe = api.plan_from_text("tp=1,pp=16,ep=8,mbs=1,recompute=none,zero=1,first_layers=4,last_layers=1", problem)
    best = api.search(problem, top_k=1).best
    assert best["plan"]["pp"] > 1 and (best["plan"]["first_layers"] or best["plan"]["last_layers"])
    assert best["step_time_s"] <= api.predict_plan(problem, recipe)["step_time_s"] * (1 + 1e-6)
