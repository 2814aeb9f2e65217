"""Exporters (autotune/export.py): every emitted option name is one the target documents
(tests/data/export_names/, written from each framework's source and docs, commits in their headers),
Megatron arguments parse back to the same plan for legal plans drawn from the search space, and
plans a target cannot express are refused with a reason naming the field."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from autotune import api
from autotune.export import (TARGETS, ExportRefused, export, megatron_args, parse_megatron_arg_dump,
                             parse_megatron_args, plan_from_megatron_args)
from costmodels.plan import Plan
from costmodels.specs import SpecError
from search_spaces.space import enumerate_legal

NAMES_DIR = os.path.join(os.path.dirname(__file__), "data", "export_names")


def _names(target: str) -> set:
    fname = {"megatron": "megatron_lm.txt", "bridge": "megatron_bridge.txt",
             "megatron-deepspeed": "megatron_deepspeed.txt"}.get(target, f"{target}.txt")
    with open(os.path.join(NAMES_DIR, fname)) as fh:
        return {ln.strip() for ln in fh if ln.strip() and not ln.startswith("#")}


NAMES = {t: _names(t) for t in TARGETS}


def megatron_arg_dump(**args) -> str:
    """A Megatron-LM log's argument dump (arguments.py _print_args) holding these arguments."""
    lines = "".join(f"  {k} {'.' * max(3, 48 - len(k))} {v}\n" for k, v in sorted(args.items()))
    return ("------------------------ arguments ------------------------\n" + lines
            + "-------------------- end of arguments ---------------------\n")

PROBLEMS = {
    "dense": dict(model="llama3-8b", gpu="h100", gpus=64, global_batch=256, seq_len=4096),
    "moe": dict(model="mixtral-8x7b", gpu="h100", gpus=64, global_batch=256, seq_len=4096),
    "mla": dict(model="deepseek-v2-lite", gpu="h100", gpus=32, global_batch=128, seq_len=4096),
}


def spread_plans(problem, n_plans: int) -> list:
    """About n_plans legal plans of a problem, evenly spread over its whole enumeration."""
    batches = list(enumerate_legal(problem)[0])
    total = sum(len(b) for b in batches)
    plans = []
    for batch in batches:
        k = max(1, round(len(batch) * n_plans / total))
        plans += [batch.plan(int(i)) for i in np.unique(np.linspace(0, len(batch) - 1, k).astype(int))]
    return plans


@pytest.fixture(scope="module")
def spaces():
    """About 3,000 legal plans of each problem."""
    out = {}
    for key, kw in PROBLEMS.items():
        problem = api.build_problem(**kw)
        out[key] = (problem, spread_plans(problem, 3000))
    return out


def _check_names(target, exported):
    names = NAMES[target]
    if target == "deepspeed":          # key paths: every level is a documented key name
        bad = [p for p in exported.options if p.split(".")[-1] not in names]
    else:
        bad = [o for o in exported.options if o not in names]
    assert not bad, f"{target} emitted undocumented option names {bad}"


def _export_or_refusal(target, plan, problem):
    try:
        return export(target, plan, problem)
    except ExportRefused as exc:
        assert str(exc).startswith(f"export --to {target}: ") and "\n" not in str(exc)
        return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(sorted(PROBLEMS)), pick=st.integers(min_value=0, max_value=10**9))
def test_megatron_args_round_trip_and_every_name_documented(spaces, key, pick):
    problem, plans = spaces[key]
    plan = plans[pick % len(plans)]
    argv = megatron_args(plan, problem) if plan.zero != 2 else None
    if argv is None:
        return
    assert parse_megatron_args(argv, problem.cluster.num_gpus, problem.model.num_layers) == plan
    for target in TARGETS:
        exported = _export_or_refusal(target, plan, problem)
        if exported is not None:
            _check_names(target, exported)


UNEVEN = [
    ("llama3.1-405b", 1024, "tp=8,pp=16,sp=true,zero=1,first_layers=7,last_layers=7"),
    ("llama3.1-405b", 1024, "tp=8,pp=8,vpp=2,sp=true,zero=1,first_layers=16,last_layers=14"),
    ("llama3.1-405b", 1024, "tp=8,pp=16,sp=true,zero=1,account_for_embedding=true,account_for_loss=true"),
    ("llama3-70b", 512, "tp=8,pp=4,vpp=5,sp=true,zero=1,recompute=full,recompute_layers=2"),
    ("llama3-70b", 512, "tp=4,cp=2,sp=true,zero=3,recompute=selective,recompute_modules=core_attn+layernorm+mlp"),
    ("deepseek-v3", 1024, "tp=2,pp=16,ep=64,sp=true,zero=1,layout=Et*4|(t*4|)*14tmL"),
]


@pytest.mark.parametrize("model,gpus,text", UNEVEN)
def test_round_trip_of_uneven_splits_layouts_and_block_recompute(model, gpus, text):
    problem = api.build_problem(model=model, gpu="h100", gpus=gpus, global_batch=2048, seq_len=4096)
    plan = api.plan_from_text(text, problem)
    argv = megatron_args(plan, problem)
    assert parse_megatron_args(argv, gpus, problem.model.num_layers) == plan
    for target in TARGETS:
        exported = _export_or_refusal(target, plan, problem)
        if exported is not None:
            _check_names(target, exported)


def test_megatron_flags_follow_megatron_rules():
    """Megatron-LM validate_args: virtual stages with uneven PP need --num-virtual-stages-per-pipeline-rank;
    at most one of the three virtual-stage flags; full recompute needs a method."""
    problem = api.build_problem(model="llama3.1-405b", gpu="h100", gpus=1024, global_batch=2048, seq_len=8192)
    plan = api.plan_from_text("tp=8,pp=8,vpp=2,sp=true,zero=1,first_layers=16,last_layers=14", problem)
    argv = megatron_args(plan, problem)
    assert "--num-virtual-stages-per-pipeline-rank" in argv and "--num-layers-per-virtual-pipeline-stage" not in argv
    seven = api.build_problem(model="llama3.1-405b", gpu="h100", gpus=896, global_batch=1792, seq_len=8192)
    argv = megatron_args(api.plan_from_text("tp=8,pp=7,vpp=2,sp=true,zero=1", seven), seven)
    i = argv.index("--num-layers-per-virtual-pipeline-stage")
    assert argv[i + 1] == "9"               # 126 layers / 7 ranks / 2 chunks


def test_megatron_precision_and_framework_flags():
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096, precision="fp8",
                                framework={"tp_comm_overlap": True, "grad_reduce_in_fp32": False,
                                           "fp8_param_gather": True})
    plan = api.plan_from_text("tp=2,sp=true,zero=1", problem)
    argv = megatron_args(plan, problem)
    for flag in ("--bf16", "--fp8-format", "--tp-comm-overlap", "--grad-reduce-in-bf16", "--fp8-param-gather"):
        assert flag in argv
    assert argv[argv.index("--fp8-format") + 1] == "hybrid"
    assert "--tp-comm-overlap" not in megatron_args(plan, api.build_problem(
        model="llama3-8b", gpu="h100", gpus=8, global_batch=64, seq_len=4096))


@pytest.mark.parametrize("target,text,field,framework", [
    ("megatron", "zero=2", "zero=2", "deepspeed"),
    ("bridge", "zero=2", "zero=2", "deepspeed"),
    ("megatron", "tp=2,pp=2", "framework=deepspeed", "deepspeed"),
    ("bridge", "tp=2", "framework=deepspeed", "deepspeed"),
    ("torchtitan", "zero=1", "zero=1", "deepspeed"),
    ("torchtitan", "tp=2,sp=false", "sp=false", "deepspeed"),
    ("torchtitan", "recompute=selective", "recompute=selective", "deepspeed"),
    ("maxtext", "pp=2,first_layers=12", "pipeline split", "megatron"),
    ("maxtext", "tp=2,pp=8,mbs=64", "mbs", "deepspeed"),
    # plain DeepSpeed (a plan scored for Megatron-Core, exported as DeepSpeed's own JSON)
    ("deepspeed", "pp=2", "pp=2", "megatron"),
    ("deepspeed", "cp=2", "cp=2", "megatron"),
    ("deepspeed", "recompute=selective", "recompute", "megatron"),
    # Megatron-DeepSpeed
    ("megatron-deepspeed", "tp=2,pp=2", "framework=megatron", "megatron"),
    ("megatron-deepspeed", "pp=3,layout=Et*11|t*11|t*10L", "layout=Et*11|t*11|t*10L", "deepspeed"),
])
def test_refusals_name_the_field(target, text, field, framework):
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=48 if "pp=3" in text else 16, global_batch=64,
                                seq_len=4096, framework={"framework": framework})
    plan = api.plan_from_text(text, problem)
    with pytest.raises(ExportRefused) as exc:
        export(target, plan, problem)
    assert f"export --to {target}: {field}:" in str(exc.value)


def test_torchtitan_takes_expert_ranks_from_sharded_data_parallel_ranks():
    """torchtitan v0.2.2 parallel_dims.py: efsdp = dp_shard * cp * tp / (etp * ep) must be whole."""
    problem = api.build_problem(model="mixtral-8x7b", gpu="h100", gpus=64, global_batch=256, seq_len=4096)
    replicated = api.plan_from_text("tp=2,ep=8,sp=true,zero=0", problem)
    with pytest.raises(ExportRefused, match="export --to torchtitan: ep=8: .* dp_shard\\*cp\\*tp = 2"):
        export("torchtitan", replicated, problem)
    cfg = export("torchtitan", replicated.replace(zero=3), problem).text
    assert "data_parallel_shard_degree = 32" in cfg and "expert_parallel_degree = 8" in cfg
    # MaxText's expert axis is cut from the data-parallel ranks only
    folded = api.plan_from_text("tp=8,pp=2,ep=8,sp=true,zero=1", problem)
    with pytest.raises(ExportRefused, match="export --to maxtext: ep=8: .*dp=4"):
        export("maxtext", folded, problem)


def test_unknown_target_is_bad_input():
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=8)
    with pytest.raises(SpecError, match="to: unknown export format 'jax'"):
        export("jax", api.plan_from_text("tp=1", problem), problem)


def test_torchtitan_toml_parses_and_agrees_with_the_plan():
    tomllib = pytest.importorskip("tomllib")          # the standard library's TOML reader (Python >= 3.11)
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=64, global_batch=256, seq_len=4096)
    plan = api.plan_from_text("tp=2,pp=4,vpp=2,mbs=2,sp=true,zero=0,recompute=full", problem)
    titan = tomllib.loads(export("torchtitan", plan, problem).text)
    par = titan["parallelism"]
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["data_parallel_replicate_degree"]) == (2, 4, 8)
    parts = par["module_fqns_per_model_part"]
    assert len(parts) == 8 and parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    assert sum(sum(n.startswith("layers.") for n in p) for p in parts) == 32
    assert titan["training"]["local_batch_size"] * 8 == 256 and titan["activation_checkpoint"]["mode"] == "full"


def test_maxtext_yaml_and_deepspeed_json_agree_with_the_plan():
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=64, global_batch=256, seq_len=4096)
    plan = api.plan_from_text("tp=2,pp=4,vpp=2,mbs=2,sp=true,zero=0,recompute=selective", problem)
    mx = yaml.safe_load(export("maxtext", plan, problem).text)
    ici = np.prod([v for k, v in mx.items() if k.startswith("ici_")])
    dcn = np.prod([v for k, v in mx.items() if k.startswith("dcn_")])
    assert (ici, dcn) == (8, 8) and mx["num_slices"] == 8
    assert mx["num_pipeline_microbatches"] == 256 // (8 * 2) and mx["num_pipeline_repeats"] == 2
    assert mx["per_device_batch_size"] * 64 == 256
    assert mx["remat_policy"] == "minimal"              # saves projections, recomputes attention output
    dp_plan = api.plan_from_text("tp=2,mbs=2,zero=1", problem)
    ds = json.loads(export("deepspeed", dp_plan, problem).text)
    # DeepSpeed: train_batch_size = micro * accumulation * data-parallel ranks (32 with AutoTP 2)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 32
    assert ds["zero_optimization"]["stage"] == 1 and ds["tensor_parallel"]["autotp_size"] == 2


# A real Megatron-LM argument dump (megatron/training/arguments.py _print_args), lines as a run prints
# them; the values are those of a Llama-style run with tp 2, pp 2 on 8 GPUs.
ARG_DUMP = """\
------------------------ arguments ------------------------
  account_for_embedding_in_pipeline_split ......... False
  account_for_loss_in_pipeline_split .............. False
  context_parallel_size ........................... 1
  data_parallel_size .............................. 2
  decoder_first_pipeline_num_layers ............... None
  decoder_last_pipeline_num_layers ................ None
  expert_model_parallel_size ...................... 1
  expert_tensor_parallel_size ..................... 2
  global_batch_size ............................... 64
  micro_batch_size ................................ 2
  num_layers ...................................... 32
  num_layers_per_virtual_pipeline_stage ........... None
  pipeline_model_parallel_layout .................. None
  pipeline_model_parallel_size .................... 2
  recompute_granularity ........................... selective
  recompute_method ................................ None
  recompute_modules ............................... ['core_attn']
  recompute_num_layers ............................ None
  sequence_parallel ............................... True
  tensor_model_parallel_size ...................... 2
  use_distributed_optimizer ....................... True
  virtual_pipeline_model_parallel_size ............ None
  world_size ...................................... 8
-------------------- end of arguments ---------------------
"""


def test_argument_dump_gives_the_plan():
    values = parse_megatron_arg_dump(ARG_DUMP)
    assert values["world_size"] == "8" and values["global_batch_size"] == "64"
    plan = plan_from_megatron_args(values)
    assert str(plan) == ("tp=2,pp=2,dp=2,cp=1,ep=1,etp=1,vpp=1,mbs=2,recompute=selective,"
                         "recompute_modules=core_attn,sp=true,zero=1")


def test_interleaving_where_pp_does_not_divide_the_micro_batches():
    """6 micro-batches per rank over pp 4 interleave in one group of 6 (Megatron-Core's
    --microbatch-group-size-per-virtual-pipeline-stage; its default, pp, would refuse them): the exports pass it,
    and the longer warm-up holds more activations than 8 micro-batches in groups of 4."""
    plan = Plan(tp=1, pp=4, dp=16, vpp=2, mbs=1, zero=1)
    six = api.build_problem(model="llama3-8b", gpu="h100", gpus=64, global_batch=96, seq_len=4096)
    eight = api.build_problem(model="llama3-8b", gpu="h100", gpus=64, global_batch=128, seq_len=4096)
    assert "--microbatch-group-size-per-virtual-pipeline-stage 6" in export("megatron", plan, six).text
    assert "model.microbatch_group_size_per_vp_stage=6" in export("bridge", plan, six).text
    assert "microbatch-group-size" not in export("megatron", plan, eight).text
    for target in ("megatron", "bridge"):
        assert set(export(target, plan, six).options) <= NAMES[target]
    assert (api.predict(six, plan)["memory_gb"]["activations"] > api.predict(eight, plan)["memory_gb"]["activations"])
    # torch's Interleaved1F1B: max(1, m // pp) equal rounds; 9 micro-batches make 2 rounds, which 9 is not a multiple of
    nine = api.build_problem(model="llama3-8b", gpu="h100", gpus=64, global_batch=144, seq_len=4096)
    with pytest.raises(ExportRefused, match="rounds"):
        export("torchtitan", dataclasses.replace(plan, zero=0), nine)


@pytest.mark.parametrize("plan_text, keys", [
    ("tp=2,pp=4,vpp=2,mbs=1,sp=true,zero=1,first_layers=6,last_layers=6",
     ("model.num_layers_in_first_pipeline_stage=6", "model.num_layers_in_last_pipeline_stage=6")),
    ("tp=2,pp=2,mbs=1,sp=true,zero=1,account_for_embedding=true,account_for_loss=true",
     ("model.account_for_embedding_in_pipeline_split=true", "model.account_for_loss_in_pipeline_split=true")),
])
def test_bridge_export_keeps_the_pipeline_split(plan_text, keys):
    problem = api.build_problem(**PROBLEMS["dense"])
    text = export("bridge", api.plan_from_text(plan_text, problem), problem).text
    for key in keys:
        assert key in text


def test_interleaving_groups_found_on_the_host_match_the_cost_models_own():
    """autotune.scoring.with_groups finds the groups on the host for the rows that need them; the cost model, given
    none, searches them itself: the same memory either way."""
    from autotune.scoring import Inputs, with_groups
    from costmodels import model as cm
    from costmodels.params import EfficiencyParams
    from costmodels.plan import PLAN_FIELDS, PlanBatch
    problem = api.build_problem(model="llama3-8b", gpu="h100", gpus=64, global_batch=96, seq_len=4096)
    batch = PlanBatch.from_plans([Plan(tp=1, pp=4, dp=16, vpp=2, mbs=1, zero=1), Plan(tp=1, pp=4, dp=16, mbs=1, zero=1)])
    inp, e = Inputs(problem), EfficiencyParams()
    part = {f: np.asarray(batch[f], dtype=np.int32) for f in PLAN_FIELDS}
    host = with_groups(part, inp)
    assert list(host["mb_group"]) == [6.0, 4.0]
    a = cm.evaluate(host, inp.model, inp.hw, inp.job, e).memory.total
    b = cm.evaluate(part, inp.model, inp.hw, inp.job, e).memory.total
    assert np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
