"""Megatron-Core CUDA graphs (--cuda-graph-impl, --cuda-graph-modules, formerly --cuda-graph-scope): a
captured region's kernels are replayed by one graph launch instead of being issued one by one by the host.

Golden launch counts are hand-computed from the per-block kernel counts of costmodels/compute.py
(attention block 8, MLP block 6, router 4 + the pre-MLP norm, preprocess 2, dispatch 4, 3 per local
expert; TP collectives split between the blocks). Names, defaults and refusals follow Megatron-LM
d98e8a64 (megatron/training/arguments.py, core/transformer/transformer_config.py, cuda_graph_config.py).
The default (none) must leave every prediction as it was: tests/test_frozen.py checks the frozen table.
"""
from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from autotune import api
from autotune.export import export, megatron_args
from autotune.report import problem_dict
from autotune.saved import problem_from_report
from cli.main import app
from costmodels import compute
from costmodels.encode import cuda_graph_capture
from costmodels.plan import Plan
from costmodels.specs import CudaGraphImpl, CudaGraphModule, FrameworkSpec, SpecError

A, R, P = CudaGraphModule.ATTN, CudaGraphModule.MOE_ROUTER, CudaGraphModule.MOE_PREPROCESS
TE, LOCAL, FULL = CudaGraphImpl.TRANSFORMER_ENGINE, CudaGraphImpl.LOCAL, CudaGraphImpl.FULL_ITERATION
#: a small MoE on one 8-GPU H100 node, short sequences: a host-bound step without graphs
MOE_JOB = dict(model="deepseek-v2-lite", gpu="h100", gpus=8, global_batch=64, seq_len=1024)
MOE_PLAN = "tp=1,pp=1,ep=8,mbs=1,zero=1"


class _Shapes:                         # the Shapes fields layer_kernels / host_kernels read
    def __init__(self, tp, sp, ep):
        self.tp, self.sp, self.ep = np.float32(tp), np.float32(sp), np.float32(ep)
        self.softmax_fallback = np.float32(0.0)


def _host_launches(fw: FrameworkSpec, tp=1, sp=0, ep=8, experts=64.0):
    J = {"flash": 1.0, "low_precision": 0.0, "compiled_step": 0.0, **cuda_graph_capture(fw)}
    S = _Shapes(tp, sp, ep)
    M = {"experts": experts, "rope_unfused": 0.0, "expert_bias": 0.0}
    dense, moe = compute.host_kernels(S, M, J, *compute.layer_kernels(S, M, J))
    return float(dense), float(moe)


# dense layer, tp=8 with SP: 14 kernels + 4 collectives; the attention block holds 8 + 2 of them
DENSE_TP8 = 14 + 4
# MoE layer, tp=1, ep=8, 64 experts: 14 + router/preprocess/dispatch 10 + 8 local experts x 3 + 2 all-to-alls
MOE_EP8 = 14 + 10 + 8 * 3 + 2


@pytest.mark.parametrize("fw, dense, moe", [
    (FrameworkSpec(), DENSE_TP8, MOE_EP8),
    (FrameworkSpec(cuda_graph_impl=TE, cuda_graph_modules=(A,)), DENSE_TP8 - (8 + 2) + 1, None),
    (FrameworkSpec(cuda_graph_impl=TE, cuda_graph_modules=(CudaGraphModule.MLP,)), DENSE_TP8 - (6 + 2) + 1, None),
    (FrameworkSpec(cuda_graph_impl=LOCAL), 1, None),                          # the whole layer: one graph
    (FrameworkSpec(cuda_graph_impl=FULL), 0, 0),                              # one graph per step, none per layer
])
def test_dense_layer_launches(fw, dense, moe):
    d, _ = _host_launches(fw, tp=8, sp=1, ep=1)
    assert d == dense
    if moe is not None:
        assert _host_launches(fw)[1] == moe


@pytest.mark.parametrize("fw, moe", [
    # attention (8) and router side (norm 1 + router 4 + preprocess 2) replayed, one graph each
    (FrameworkSpec(cuda_graph_impl=TE, cuda_graph_modules=(A, R, P)), MOE_EP8 - 8 - (1 + 4 + 2) + 2),
    (FrameworkSpec(cuda_graph_impl=TE, cuda_graph_modules=(A, R)), MOE_EP8 - 8 - (1 + 4) + 2),
    # the local impl captures moe_router and moe_preprocess together (transformer_config.py)
    (FrameworkSpec(cuda_graph_impl=LOCAL, cuda_graph_modules=(R,)), MOE_EP8 - (1 + 4 + 2) + 1),
    # whole layer, dropless: attention + router + preprocess in one graph, the dispatch stays eager
    (FrameworkSpec(cuda_graph_impl=TE), MOE_EP8 - 8 - (1 + 4 + 2) + 1),
    # drop-and-pad MoE: the whole MoE block (moe) with its all-to-alls; the attention block stays eager
    (FrameworkSpec(cuda_graph_impl=TE, cuda_graph_modules=(CudaGraphModule.MOE,), moe_expert_capacity_factor=1.0), 8 + 1),
    (FrameworkSpec(cuda_graph_impl=TE, moe_expert_capacity_factor=1.0), 1),  # and the whole padded layer
])
def test_moe_layer_launches(fw, moe):
    assert _host_launches(fw)[1] == moe


def _predict(fw: dict, plan: str = MOE_PLAN, **job):
    problem = api.build_problem(**{**MOE_JOB, **job}, framework=fw)
    rep = api.predict_plan(problem, api.plan_from_text(plan, problem))
    return rep["step_time_s"], rep["time_breakdown_s"]["host_wait"]


def test_full_iteration_removes_host_wait():
    eager, wait = _predict({})
    graphed, no_wait = _predict({"cuda_graph_impl": "full_iteration"})
    assert wait > 0.05 * eager                    # the eager step is host-bound
    assert no_wait == 0.0
    assert graphed < eager - 0.9 * wait


SCOPES = [{"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": "attn"},
          {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": "attn,moe_router,moe_preprocess"},
          {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": "moe_router"},
          {"cuda_graph_impl": "local", "cuda_graph_modules": "moe_preprocess"},
          {"cuda_graph_impl": "local"},
          {"cuda_graph_impl": "full_iteration"}]


@pytest.mark.parametrize("scope", SCOPES, ids=lambda s: "+".join(map(str, s.values())))
@pytest.mark.parametrize("plan", [MOE_PLAN, "tp=2,pp=1,ep=4,mbs=2,zero=1", "tp=1,pp=2,ep=4,mbs=1,recompute=selective,account_for_loss=true",
                                  "tp=1,pp=1,ep=8,mbs=4,zero=1"])
def test_a_scope_never_makes_a_plan_slower(scope, plan):
    eager, _ = _predict({}, plan)
    graphed, _ = _predict(scope, plan)
    assert graphed <= eager * (1 + 1e-6)


def test_none_is_the_default_and_changes_nothing():
    assert FrameworkSpec().cuda_graph_impl is CudaGraphImpl.NONE and FrameworkSpec().cuda_graph_modules == ()
    assert set(cuda_graph_capture(FrameworkSpec()).values()) == {0.0}
    assert _predict({}) == _predict({"cuda_graph_impl": "none"})


@pytest.mark.parametrize("fw, field", [
    (dict(cuda_graph_impl="full_iteration", cuda_graph_modules="attn"), "cuda_graph_modules"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules="moe,moe_router"), "cuda_graph_modules"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules="moe_preprocess"), "cuda_graph_modules"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules="moe"), "cuda_graph_modules"),   # dropless
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules="moe_router,moe_preprocess",
          moe_expert_capacity_factor=1.0), "cuda_graph_modules"),     # alltoall + capacity: host copies in preprocess
    (dict(cuda_graph_modules="attn"), "cuda_graph_modules"),                     # no effect without an impl
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules="full_iteration"), "cuda_graph_modules"),
    (dict(cuda_graph_impl="local", framework="deepspeed"), "cuda_graph_impl"),
    (dict(cuda_graph_impl="cudnn"), "cuda_graph_impl"),
    (dict(cuda_graph_impl="local", cuda_graph_modules="attention"), "cuda_graph_modules"),
])
def test_megatron_refusals_name_the_field(fw, field):
    with pytest.raises(SpecError) as exc:
        api.build_problem(**MOE_JOB, framework=fw)
    assert exc.value.field == field and "\n" not in str(exc.value)


def test_deprecated_scope_spellings_migrate_like_megatron():
    """cuda_graph_config.py: "full" = the whole layer, "full_iteration" = --cuda-graph-impl full_iteration."""
    whole = api.build_problem(**MOE_JOB, framework=dict(cuda_graph_impl="local", cuda_graph_modules=["full"]))
    assert whole.job.framework.cuda_graph_modules == ()
    it = api.build_problem(**MOE_JOB, framework=dict(cuda_graph_modules=["full_iteration"]))
    assert it.job.framework.cuda_graph_impl is FULL


runner = CliRunner()
SMALL = ["--model", "deepseek-v2-lite", "--gpu", "h100", "--gpus", "8", "--global-batch", "64", "--seq-len", "1024"]


@pytest.mark.parametrize("args, needle", [
    (["--cuda-graph-impl", "full_iteration", "--cuda-graph-scope", "attn"], "cuda_graph_modules"),
    (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "moe", "--cuda-graph-modules", "moe_router"],
     "cuda_graph_modules"),
    (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "moe_preprocess"], "moe_router"),
    (["--cuda-graph-scope", "attn"], "cuda_graph_impl=none"),
    (["--cuda-graph-impl", "bogus"], "cuda_graph_impl"),
])
@pytest.mark.parametrize("command", ["predict", "export"])
def test_cli_refuses_illegal_combinations_in_one_line(args, needle, command):
    extra = ["--plan", MOE_PLAN] + (["--to", "megatron"] if command == "export" else [])
    result = runner.invoke(app, [command, *SMALL, *extra, *args])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr


def test_cli_refuses_full_recompute_with_per_layer_graphs():
    """transformer_config.py: "full recompute is only supported with full iteration CUDA graph"."""
    result = runner.invoke(app, ["predict", *SMALL, "--plan", "tp=1,pp=1,ep=8,mbs=1,recompute=full",
                                 "--cuda-graph-impl", "transformer_engine"])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1 and "full recompute" in result.stderr
    ok = runner.invoke(app, ["predict", *SMALL, "--plan", "tp=1,pp=1,ep=8,mbs=1,recompute=full",
                             "--cuda-graph-impl", "full_iteration", "--json"])
    assert ok.exit_code in (0, 3), ok.stderr


def test_search_never_recommends_full_recompute_with_per_layer_graphs():
    from search_spaces.space import enumerate_legal
    problem = api.build_problem(**MOE_JOB, framework=dict(cuda_graph_impl="transformer_engine",
                                                          cuda_graph_modules="attn"))
    stream, stats = enumerate_legal(problem)
    assert all((b.arrays["recompute"] != 2).all() for b in stream)
    assert stats.illegal.get("cuda_graph_full_recompute", 0) > 0


def test_megatron_export_uses_the_flags_of_arguments_py():
    problem = api.build_problem(**MOE_JOB, framework=dict(cuda_graph_impl="transformer_engine",
                                                          cuda_graph_modules=["attn", "moe_router,moe_preprocess"]))
    argv = megatron_args(api.plan_from_text(MOE_PLAN, problem), problem)
    i = argv.index("--cuda-graph-impl")
    assert argv[i:i + 6] == ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules",
                             "attn", "moe_router", "moe_preprocess"]
    full = api.build_problem(**MOE_JOB, framework=dict(cuda_graph_impl="full_iteration"))
    argv = megatron_args(api.plan_from_text(MOE_PLAN, full), full)
    assert "--cuda-graph-modules" not in argv          # must be empty with full_iteration (arguments.py)
    assert "--no-check-for-nan-in-loss-and-grad" in argv


def test_bridge_export_and_other_targets():
    problem = api.build_problem(**MOE_JOB, framework=dict(cuda_graph_impl="transformer_engine",
                                                          cuda_graph_modules="attn,moe_router,moe_preprocess"))
    plan = api.plan_from_text(MOE_PLAN, problem)
    text = export("bridge", plan, problem).text
    for line in ("model.cuda_graph_impl=transformer_engine", "model.cuda_graph_scope=[attn,moe_router,moe_preprocess]",
                 "model.use_te_rng_tracker=true"):
        assert line in text
    from autotune.export import ExportRefused
    for target in ("torchtitan", "maxtext", "deepspeed"):
        with pytest.raises(ExportRefused, match="cuda_graph_impl=transformer_engine"):
            export(target, Plan(tp=1, pp=1, dp=8, ep=8, mbs=1, zero=3), problem)


@pytest.mark.parametrize("fw", [dict(cuda_graph_impl="transformer_engine", cuda_graph_modules="attn,moe_router"),
                                dict(cuda_graph_impl="full_iteration"), dict(cuda_graph_impl="local")])
def test_saved_reports_round_trip_the_choice(fw):
    problem = api.build_problem(**MOE_JOB, framework=fw)
    back = problem_from_report({"problem": problem_dict(problem)})
    assert back.job.framework == problem.job.framework
