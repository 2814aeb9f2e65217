"""Megatron-DeepSpeed (`--framework deepspeed`): the search keeps to what it runs and the export speaks its flags.

Sources (microsoft/Megatron-DeepSpeed@f4157bea): megatron/training.py train_step runs a pipeline on DeepSpeed's
PipelineEngine (its TrainSchedule is plain 1F1B: no interleaving, the gradient reduction after the last
backward); megatron/arguments.py has no --context-parallel-size and a selective recompute of the core attention
only; megatron/model/gpt_model.py builds PipelineModule(partition_method='type:transformer') and says "deepspeed's
pipeline doesn't support the block recompute method"."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from autotune import api
from autotune.export import MDS_CONFIG_FILE, ExportRefused, export, parse_megatron_argv
from autotune.validate import validate_rows
from costmodels.plan import modules_mask
from costmodels.specs import Recompute, SpecError
from search_spaces.space import check_plan, enumerate_legal
from tests.test_cli import assert_one_line_error, run
from tests.test_export import NAMES, spread_plans


def _problem(framework: str, **kw):
    args = dict(model="llama3-8b", gpu="h100", gpus=64, global_batch=256, seq_len=4096)
    args.update(kw)
    return api.build_problem(**args, framework={"framework": framework})


def _legal(problem) -> dict:
    stream, _ = enumerate_legal(problem)
    batches = list(stream)
    return {f: np.concatenate([np.asarray(b[f]) for b in batches]) for f in
            ("vpp", "cp", "pp", "account_for_embedding", "account_for_loss", "recompute", "recompute_modules", "zero")}


@pytest.fixture(scope="module")
def spaces():
    return {fw: _legal(_problem(fw)) for fw in ("megatron", "deepspeed")}


def test_search_space_keeps_to_what_megatron_deepspeed_runs(spaces):
    ds, mc = spaces["deepspeed"], spaces["megatron"]
    # the rules bite: Megatron-Core's space has each of these, Megatron-DeepSpeed's none
    assert (mc["vpp"] > 1).any() and (mc["cp"] > 1).any() and (mc["account_for_embedding"] > 0).any()
    assert (ds["vpp"] == 1).all() and (ds["cp"] == 1).all()
    assert (ds["account_for_embedding"] == 0).all() and (ds["account_for_loss"] == 0).all()
    selective = ds["recompute"] == int(Recompute.SELECTIVE)
    assert selective.any() and (ds["recompute_modules"][selective] == modules_mask(("core_attn",))).all()
    assert (ds["pp"] > 1).any() and 2 in set(ds["zero"][ds["pp"] == 1])     # pipelines, and ZeRO-2 without them


@pytest.mark.parametrize("text,rule", [
    ("tp=2,pp=4,vpp=2", "deepspeed_no_interleave"),
    ("tp=2,cp=2", "deepspeed_no_cp"),
    ("pp=2,account_for_embedding=true,account_for_loss=true", "deepspeed_split"),
    ("pp=2,first_layers=12", "deepspeed_split"),
    ("recompute=selective,recompute_modules=core_attn+layernorm", "deepspeed_recompute"),
    ("pp=2,recompute=full,recompute_layers=2", "deepspeed_recompute"),
])
def test_plans_megatron_deepspeed_cannot_run_are_refused_by_rule(text, rule):
    problem = _problem("deepspeed")
    with pytest.raises(SpecError, match=rf"plan \({rule}\)"):
        check_plan(api.plan_from_text(text, problem), problem)
    check_plan(api.plan_from_text(text, _problem("megatron")), _problem("megatron"))     # legal for Megatron-Core


def test_deepspeed_pipeline_reduces_gradients_after_the_schedule():
    """TrainSchedule reduces the gradients after the last backward, so with pp > 1 none of the data-parallel traffic
    hides; without a pipeline the two frameworks overlap it alike (same gradient dtype)."""
    same = {"grad_reduce_in_fp32": False}

    def dp_s(framework, text):
        p = api.build_problem(model="llama3-8b", gpu="h100", gpus=64, global_batch=256, seq_len=4096,
                              framework={"framework": framework, **same})
        return api.predict_plan(p, api.plan_from_text(text, p))["time_breakdown_s"]["dp_comm"]

    piped = "tp=2,pp=4,mbs=1,zero=1"
    assert dp_s("deepspeed", piped) > 1.2 * dp_s("megatron", piped)
    flat = "tp=2,mbs=1,zero=1"
    assert dp_s("deepspeed", flat) == pytest.approx(dp_s("megatron", flat), rel=1e-6)


@pytest.fixture(scope="module")
def ds_plans():
    problem = _problem("deepspeed")
    return problem, spread_plans(problem, 1500)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pick=st.integers(min_value=0, max_value=10**9))
def test_megatron_deepspeed_export_says_the_plan_with_documented_flags(ds_plans, pick):
    problem, plans = ds_plans
    plan = plans[pick % len(plans)]
    try:
        out = export("megatron-deepspeed", plan, problem)
    except ExportRefused as exc:
        assert str(exc).startswith("export --to megatron-deepspeed: ") and "\n" not in str(exc)
        return
    bad = [o for o in out.options if o not in NAMES["megatron-deepspeed"]]
    assert not bad, f"undocumented Megatron-DeepSpeed flags {bad}"
    a = parse_megatron_argv(out.text.replace("\\\n", " ").split())
    assert (int(a["tensor_model_parallel_size"]), int(a["pipeline_model_parallel_size"])) == (plan.tp, plan.pp)
    assert int(a["micro_batch_size"]) == plan.mbs and int(a["zero_stage"]) == plan.zero
    assert int(a["global_batch_size"]) == problem.job.global_batch
    assert bool(a.get("sequence_parallel")) == bool(plan.sp)
    # without a pipeline, --no-pipeline-parallel (else DeepSpeed's PipelineModule refuses ZeRO-2/3)
    assert bool(a.get("no_pipeline_parallel")) == (plan.pp == 1)
    assert a.get("recompute_granularity") == {Recompute.NONE: None, Recompute.SELECTIVE: "selective",
                                              Recompute.FULL: "full"}[plan.recompute]
    assert a["deepspeed"] is True and a["deepspeed_config"] == MDS_CONFIG_FILE
    assert int(a["num_key_value_heads"]) == problem.model.num_kv_heads and "num_query_groups" not in a
    # the config it names: DeepSpeed's batch identity over the plan's data-parallel ranks, no AutoTP
    ds = json.loads(export("deepspeed", plan, problem).text)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * plan.dp
    assert ds["zero_optimization"]["stage"] == plan.zero and "tensor_parallel" not in ds


@pytest.mark.parametrize("title,zero_text", [
    ("a 2022 run", "DeepSpeed ZeRO stage 1"),               # its optimizer is DeepSpeed's
    ("trained with Megatron-DeepSpeed (2022)", None),        # its source names the framework
])
def test_validate_scores_a_megatron_deepspeed_row_as_it_ran(title, zero_text):
    """A Megatron-DeepSpeed row (BLOOM-like: 70 layers over pp 12, vpp not given) is scored without interleaving
    and with DeepSpeed's own layer split, not Megatron-Core's account-for flags."""
    row = {"id": "mds-row", "source": {"title": title, "group": "t"}, "usable": True,
           "model": {"name": "t", "layers": 70, "hidden": 14336, "ffn_hidden": 57344, "heads": 112, "kv_heads": 112,
                     "vocab": 250880, "seq_len": 2048},
           "hardware": {"gpu_key": "a100-80gb", "num_gpus": 384, "gpus_per_node": 8},
           "plan": {"tp": 4, "pp": 12, "dp": 8, "micro_batch": 2, "global_batch": 2048, "precision_key": "bf16",
                    "recompute_key": "full", "zero_key": 1, "distributed_optimizer_or_zero": zero_text},
           "measured": {"tokens_per_s_per_gpu": 100.0}}
    res = validate_rows([row])["runs"][0]
    assert res["skipped"] is None, res["skipped"]
    plan = res["plan"]
    assert plan["vpp"] == 1 and not plan["account_for_embedding"] and not plan["account_for_loss"] and plan["layout"]


@pytest.mark.parametrize("extra", [{"cp": 8}, {"pp": 4, "vpp": 2}])
def test_a_deepspeed_row_with_a_plan_its_engine_lacks_is_scored_not_refused(extra):
    """A published context-parallel (DeepSpeed-Ulysses) or interleaved plan whose ZeRO column names DeepSpeed did not
    run on DeepSpeed's pipeline engine: it is scored as Megatron-Core runs such plans, never dropped as illegal."""
    row = {"id": "ds-cp", "source": {"title": "a 2023 long-sequence run", "group": "t"}, "usable": True,
           "model": {"name": "t", "layers": 32, "hidden": 4096, "ffn_hidden": 16384, "heads": 32, "kv_heads": 32,
                     "vocab": 51200, "seq_len": 32768},
           "hardware": {"gpu_key": "a100-80gb", "num_gpus": 64, "gpus_per_node": 8},
           "plan": {"tp": 1, "pp": 1, "micro_batch": 1, "global_batch": 64, "precision_key": "bf16",
                    "recompute_key": "full", "zero_key": 1, "distributed_optimizer_or_zero": "DeepSpeed ZeRO-1", **extra},
           "measured": {"tokens_per_s_per_gpu": 1000.0}}
    res = validate_rows([row])["runs"][0]
    assert res["skipped"] is None, res["skipped"]
    assert all(res["plan"][k] == v for k, v in extra.items())


@pytest.mark.parametrize("title,sp_filled", [
    ("Smith et al. 2022, Megatron-DeepSpeed", False),       # Megatron-DeepSpeed: --sequence-parallel off by default
    ("a 2021 Megatron-LM run", False),                      # before Megatron-LM v3.0 (2022) had it
    ("a 2024 Megatron-Core run", True),                     # unknown: the fastest legal value, and said so
])
def test_sequence_parallelism_is_filled_only_where_the_framework_had_it(title, sp_filled):
    row = {"id": "sp-row", "source": {"title": title, "group": "t"}, "usable": True,
           "model": {"name": "t", "layers": 24, "hidden": 4096, "ffn_hidden": 16384, "heads": 32, "kv_heads": 32,
                     "vocab": 51200, "seq_len": 2048},
           "hardware": {"gpu_key": "a100-80gb", "num_gpus": 64, "gpus_per_node": 8},
           "plan": {"tp": 4, "pp": 2, "micro_batch": 1, "global_batch": 512, "precision_key": "bf16",
                    "recompute_key": "full", "zero_key": 0},
           "measured": {"tokens_per_s_per_gpu": 1000.0}}
    res = validate_rows([row])["runs"][0]
    assert res["skipped"] is None, res["skipped"]
    assert ("sp" in res["filled"]) == sp_filled
    if not sp_filled:
        assert res["plan"]["sp"] is False


def test_cli_search_and_export_for_megatron_deepspeed(tmp_path):
    common = ["--model", "llama3-8b", "--gpu", "h100", "--gpus", "64", "--global-batch", "256", "--seq-len", "4096",
              "--framework", "deepspeed"]
    r = run("search", *common, "--json", "--no-save", "--top", "5")
    assert r.exit_code == 0, r.stderr
    for p in json.loads(r.stdout)["top"]:
        assert p["plan"]["vpp"] == 1 and p["plan"]["cp"] == 1
    plan = "tp=2,pp=4,mbs=1,recompute=full,zero=1"
    r = run("export", "--to", "megatron-deepspeed", "--plan", plan, *common)
    assert r.exit_code == 0, r.stderr
    assert "--deepspeed_config ds_config.json" in r.stdout and "--zero-stage 1" in r.stdout
    # with --out, the DeepSpeed config the command names is written beside it, named after its plan
    r = run("export", "--to", "megatron-deepspeed", "--plan", plan, *common, "--out", str(tmp_path))
    assert r.exit_code == 0, r.stderr
    (args_file,) = tmp_path.glob("*.args")
    named = args_file.read_text().split("--deepspeed_config ")[1].split()[0]
    assert named == args_file.stem + "_ds_config.json" and str(tmp_path / named) in r.stdout
    cfg = json.loads((tmp_path / named).read_text())
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 8   # dp = 64 / (tp 2 x pp 4)
    r = run("search", *common, "--json", "--no-save", "--export", "megatron-deepspeed")
    assert r.exit_code == 0, r.stderr
    exp = json.loads(r.stdout)["export"]
    assert "--deepspeed_config ds_config.json" in exp["text"] and exp["companions"][0]["file"] == "ds_config.json"
    assert_one_line_error(run("export", "--to", "megatron", "--plan", plan, *common), 2,
                          "export --to megatron", "framework=deepspeed", "megatron-deepspeed")
    assert_one_line_error(run("export", "--to", "megatron-deepspeed", "--plan", "tp=2,pp=4,vpp=2", *common), 2,
                          "plan (deepspeed_no_interleave)", "vpp=2")


@pytest.mark.parametrize("model,framework,says", [
    ("mixtral-8x7b", "deepspeed", True),      # DeepSpeed-MoE is not the layer scored
    ("mixtral-8x7b", "megatron", False),
    ("llama3-8b", "deepspeed", False),
])
def test_search_says_when_a_moe_model_is_scored_for_megatron_deepspeed(model, framework, says):
    r = run("search", "--model", model, "--gpu", "h100", "--gpus", "64", "--global-batch", "256", "--seq-len", "4096",
            "--framework", framework, "--no-save", "--top", "1")
    assert r.exit_code == 0, r.stderr
    assert ("Megatron-DeepSpeed runs DeepSpeed-MoE" in " ".join(r.stdout.split())) == says


# DeepSpeed balances the layers over its pipeline stages itself where pp does not divide them. BLOOM 176B (70
# layers) ran TP 4, PP 12, DP 8 on 384 A100 with Megatron-DeepSpeed (BigScience 2022, arXiv:2211.05100, sec. 3.4):
# a plan Megatron-Core's even split cannot express. The model reads DeepSpeed's split as ceil(70 / 12) = 6 layers
# on the first and middle stages and the 4 left on the last (as `validate`'s balanced layout does).
BLOOM = {"model_type": "gpt2", "n_layer": 70, "n_embd": 14336, "n_head": 112, "n_inner": 57344, "vocab_size": 250880,
         "n_positions": 2048}      # BLOOM's shape as a GPT (its ALiBi and embedding norm are not what is tested)


def _bloom(tmp_path, framework):
    path = tmp_path / "bloom.json"
    path.write_text(json.dumps(BLOOM))
    return api.build_problem(model=str(path), gpu="a100-80gb", gpus=384, global_batch=2048, seq_len=2048,
                             framework={"framework": framework})


def test_blooms_published_pipeline_is_scored_with_deepspeeds_own_split(tmp_path):
    problem = _bloom(tmp_path, "deepspeed")
    plan = api.plan_from_text("tp=4,pp=12,mbs=2,recompute=full,zero=1", problem)
    assert (plan.first_layers, plan.last_layers) == (6, 4)
    check_plan(plan, problem)
    assert api.predict_plan(problem, plan)["fits"]
    # no flag sets it: the export gives pp alone, as BLOOM's launcher did
    text = export("megatron-deepspeed", plan, problem).text
    assert "--pipeline-model-parallel-size 12" in text and "decoder-first" not in text and "layout" not in text
    # another split is not what DeepSpeed makes
    with pytest.raises(SpecError, match=r"plan \(deepspeed_split\)"):
        check_plan(api.plan_from_text("tp=4,pp=12,mbs=2,recompute=full,zero=1,first_layers=4,last_layers=6",
                                      problem), problem)
    # Megatron-Core without first/last flags or a layout still refuses pp 12 for 70 layers
    with pytest.raises(SpecError, match=r"plan \(pp_split\)"):
        check_plan(api.plan_from_text("tp=4,pp=12,mbs=2,recompute=full,zero=1", _bloom(tmp_path, "megatron")),
                   _bloom(tmp_path, "megatron"))


def test_the_deepspeed_search_pipelines_a_layer_count_pp_does_not_divide(tmp_path):
    problem = _bloom(tmp_path, "deepspeed")
    stream, _ = enumerate_legal(problem)
    batches = list(stream)
    rows = {f: np.concatenate([np.asarray(b[f]) for b in batches]) for f in ("pp", "first_layers", "last_layers")}
    odd = 70 % rows["pp"] != 0
    assert (rows["pp"][odd] == 12).any()
    k = -(-70 // rows["pp"][odd])
    assert (rows["first_layers"][odd] == k).all() and (rows["last_layers"][odd] == 70 - (rows["pp"][odd] - 1) * k).all()
    assert (rows["first_layers"][~odd] == 0).all()
