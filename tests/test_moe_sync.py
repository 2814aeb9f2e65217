"""A dropless MoE layer's host-device synchronization (costmodels.model.moe_host_sync).

Megatron-Core's dispatchers learn on the host how many tokens each expert receives before they size the
all-to-all and the grouped GEMMs (MoEAlltoAllTokenDispatcher's cuda_sync_point, DeepEP's received-token
count, TEGroupedMLP.forward's tokens_per_expert.tolist()). The host waits for the GPU to finish the
layer's attention and router (P), then issues the dispatch, the experts and the combine (Q): slack it
gained while the GPU ran P is lost. Golden cycles are hand-computed from that composition.
"""
from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodels import compute
from costmodels.model import moe_host_sync


def _inputs(g_f, g_p, h_f, h_p, capacity=0.0, iteration_graph=0.0, host_op=0.05):
    """One MoE layer forward: GPU g_f in all (g_p of it before the wait: attention projections + core +
    its memory-bound work), host h_f (h_p before the wait)."""
    S = NS(is_moe=np.float32(1.0))
    w = NS(attn_proj=np.float32(g_p * 0.6), attn_core=np.float32(g_p * 0.3), elem_attn=np.float32(g_p * 0.1), rope=np.float32(0.0),
           host_moe=np.float32(h_f), host_moe_pre=np.float32(h_p), host_op=np.float32(host_op))
    lt = NS(fwd_moe=np.float32(g_f - 0.5))
    lc = NS(tp_moe=np.float32(0.0), ep_fwd=np.float32(0.5), cp_fwd=np.float32(0.0))   # all-to-alls: dispatch + combine
    J = {"moe_capacity": np.float32(capacity), "cg_iteration": np.float32(iteration_graph)}
    e = NS(kernel_overhead_s=0.0)
    return S, w, lt, lc, J, e


@pytest.mark.parametrize("g_f, g_p, h_f, h_p, cycle", [
    # host-heavy Q (2.2 host vs 1.5 GPU), GPU-heavy P (1.0 host vs 1.5 GPU): 2.2 + 1.5 + one host op,
    # where without the wait the sums overlap: max(3.2, 3.0)
    (3.0, 1.5, 3.2, 1.0, 2.2 + 1.5 + 0.05),
    # host-bound throughout: the host's own sum
    (2.0, 1.0, 5.0, 2.0, 5.0 + 0.05),
    # GPU-bound throughout: the GPU's own sum
    (5.0, 2.0, 1.0, 0.4, 5.0 + 0.05),
])
def test_the_cycle_of_a_layer_after_the_wait(g_f, g_p, h_f, h_p, cycle):
    out = moe_host_sync(*_inputs(g_f, g_p, h_f, h_p))
    assert float(out.cycle) == pytest.approx(cycle, rel=1e-5)
    assert float(out.gpu) == pytest.approx(g_f) and float(out.host) == pytest.approx(h_f)


@pytest.mark.parametrize("capacity, graph", [(1.0, 0.0), (0.0, 1.0)])
def test_padded_experts_and_full_iteration_graphs_do_not_wait(capacity, graph):
    out = moe_host_sync(*_inputs(3.0, 1.5, 3.2, 1.0, capacity=capacity, iteration_graph=graph))
    assert float(out.cycle) == float(out.gpu) == float(out.host) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.floats(0.1, 10.0), st.floats(0.0, 1.0), st.floats(0.1, 10.0), st.floats(0.0, 1.0),
       st.floats(0.0, 50.0), st.floats(0.0, 50.0))
def test_waiting_is_never_faster(g_f, share_g, h_f, share_h, rest_g, rest_h):
    # a micro-batch with the wait (the cycle plus the rest composed as before) is never shorter than the
    # same work with the host free to run ahead: max(GPU, host)
    out = moe_host_sync(*_inputs(g_f, share_g * g_f, h_f, share_h * h_f, host_op=0.0))
    gpu, host = g_f + rest_g, h_f + rest_h
    waited = float(out.cycle) + max(gpu - float(out.gpu), host - float(out.host))
    assert waited >= max(gpu, host) * (1 - 1e-6)


def test_pre_wait_launches_follow_the_graphs():
    # the attention block (8) with its TP pair (tp 2 + SP: 2 of 4 collectives), the pre-MLP norm, the
    # router (4) and the preprocess (2) are issued before the wait; graphs replace captured regions
    S = NS(tp=np.float32(2.0), sp=np.float32(1.0), ep=np.float32(8.0), softmax_fallback=np.float32(0.0))
    eager = {"flash": 1.0, "cg_attn": 0.0, "cg_router": 0.0, "cg_preprocess": 0.0, "cg_whole": 0.0, "cg_iteration": 0.0,
             "compiled_step": 0.0}
    M = {"rope_unfused": 0.0}
    assert float(compute.moe_pre_sync_launches(S, M, eager)) == 8 + 2 + 1 + 4 + 2
    graphs = {**eager, "cg_attn": 1.0, "cg_router": 1.0, "cg_preprocess": 1.0}
    assert float(compute.moe_pre_sync_launches(S, M, graphs)) == 1 + 1
    whole = {**graphs, "cg_whole": 1.0}
    assert float(compute.moe_pre_sync_launches(S, M, whole)) == 1
