"""An MoE layer's expert GEMMs and biases. The local experts' fc1 and fc2 run as grouped GEMMs (Transformer Engine's
GroupedLinear; the law is measured in tests/test_gpu_measured.py). Routed experts with biases (GPT-OSS): Megatron-Core's
TEGroupedMLP adds fc2's bias in a Python loop over the local experts (TEGroupedMLP._apply_bias,
megatron/core/transformer/moe/experts.py, core_v0.15.0-core_v0.17.0): `torch.cat([t + b * p for each expert's rows])`.
The cost model charges its kernels (a multiply and an add per expert forward; two multiply + sum reductions backward)
and its bytes, counted op by op."""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune import api
from autotune.export import megatron_args
from costmodels import compute
from costmodels.params import EfficiencyParams
from costmodels.presets import MODEL_PRESETS, model_from_hf_config

#: GPT-OSS-120B on one B200 node, EP 8 (16 local experts), micro-batch 4: GPU-bound, no DP traffic to hide
JOB = dict(model="gpt-oss-120b", gpu="b200", gpus=8, global_batch=64, seq_len=4096)
PLAN = "tp=1,pp=1,ep=8,mbs=4,zero=1"


def test_gpt_oss_experts_have_biases_and_other_moe_models_do_not():
    assert MODEL_PRESETS["gpt-oss-120b"].expert_bias
    for name in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b", "llama3-8b"):
        assert not MODEL_PRESETS[name].expert_bias, name
    # from a config.json: transformers' GptOssExperts has gate_up_proj_bias and down_proj_bias
    from tests.test_attention_kernel import tiny_gpt_oss_config
    assert model_from_hf_config(tiny_gpt_oss_config(), "tiny-oss").expert_bias


def test_the_loop_costs_its_counted_bytes_and_kernels():
    problem = api.build_problem(**JOB)
    plan = api.plan_from_text(PLAN, problem)
    with_bias = api.predict_plan(problem, plan)
    nobias = dataclasses.replace(problem, model=dataclasses.replace(problem.model, expert_bias=False))
    without = api.predict_plan(nobias, plan)
    e, m = EfficiencyParams(), problem.model
    # per micro-batch and MoE layer, forward + 2 x backward: the counted bytes of every routed token copy at the
    # achieved HBM bandwidth, and the counted kernels of every local expert at the per-kernel GPU time
    routed = JOB["seq_len"] * 4 * m.experts_per_token * e.moe_imbalance
    bytes_s = compute.EXPERT_BIAS_BYTES_PER_H * routed * m.hidden_size / (
        problem.cluster.gpu.hbm_bandwidth_bytes_per_s * e.hbm_eff)
    kernels_s = (m.num_experts / 8) * compute.EXPERT_BIAS_KERNELS_PER_LOCAL_EXPERT * e.kernel_overhead_s
    micro_batches = JOB["global_batch"] // 8 // 4
    expected = micro_batches * m.num_layers * 3.0 * (bytes_s + kernels_s)
    got = with_bias["time_breakdown_s"]["compute"] - without["time_breakdown_s"]["compute"]
    assert got == pytest.approx(expected, rel=1e-3)
    # the op count: forward b * p, the add and the cat move 12 B; backward the two gradients' multiplies and
    # sums and the split's cat 16 B; 6 kernels per expert; per forward-equivalent (backward = 2 x forward)
    assert compute.EXPERT_BIAS_BYTES_PER_H * 3.0 == pytest.approx(28.0)
    assert compute.EXPERT_BIAS_KERNELS_PER_LOCAL_EXPERT * 3.0 == pytest.approx(6.0)


def test_fewer_local_experts_pay_fewer_launches():
    # EP 64 leaves 2 local experts per GPU: the per-expert kernels shrink 8x, the per-token bytes do not
    problem = api.build_problem(**{**JOB, "gpus": 64, "global_batch": 512})
    nobias = dataclasses.replace(problem, model=dataclasses.replace(problem.model, expert_bias=False))
    deltas = []
    for plan_text in ("tp=1,pp=1,ep=8,mbs=4,zero=1", "tp=1,pp=1,ep=64,mbs=4,zero=1"):
        plan = api.plan_from_text(plan_text, problem)
        deltas.append(api.predict_plan(problem, plan)["time_breakdown_s"]["compute"]
                      - api.predict_plan(nobias, plan)["time_breakdown_s"]["compute"])
    assert deltas[0] > deltas[1] > 0.0


def test_export_keeps_gpt_oss_biases():
    # Megatron-LM adds biases by default (--add-bias-linear); a Llama-style export turns them off, GPT-OSS's keeps them
    oss = api.build_problem(**JOB)
    assert "--disable-bias-linear" not in megatron_args(api.plan_from_text(PLAN, oss), oss)
    llama = api.build_problem(model="llama3-8b", gpu="b200", gpus=8, global_batch=64, seq_len=4096)
    assert "--disable-bias-linear" in megatron_args(api.plan_from_text("tp=1,pp=1,mbs=1", llama), llama)


def test_saved_reports_carry_it():
    from autotune.report import problem_dict
    from autotune.saved import problem_from_report
    problem = api.build_problem(**JOB)
    again = problem_from_report(json.loads(json.dumps({"problem": problem_dict(problem)})))
    assert again.model.expert_bias


@settings(max_examples=200, deadline=None)
@given(groups=st.integers(1, 64), m=st.integers(1, 16384), n=st.integers(16, 16384), k=st.integers(16, 16384))
def test_a_grouped_gemm_sits_between_its_parts_and_one_stacked_gemm(groups, m, n, k):
    # the grouped law (compute.gemm_s groups; moe_mlp_s's expert GEMMs): its rows saturate together, so it is
    # never slower than the groups' GEMMs run one by one, and it reads every group's weights, so never faster
    # than one GEMM of all the rows against a single weight matrix
    e, peak, bw = EfficiencyParams(), 989e12 * 0.8, 3.35e12
    grouped = float(compute.gemm_s(m, n, k, peak, 2.0, bw, e.gemm_eff_max, e, groups))
    apart = groups * float(compute.gemm_s(m, n, k, peak, 2.0, bw, e.gemm_eff_max, e))
    stacked = float(compute.gemm_s(groups * m, n, k, peak, 2.0, bw, e.gemm_eff_max, e))
    assert stacked * (1 - 1e-5) <= grouped <= apart * (1 + 1e-5)
