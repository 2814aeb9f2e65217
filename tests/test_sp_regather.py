"""Sequence parallelism's backward all-gather of a column-parallel layer's input.

With SP a column-parallel layer (QKV, fc1) does not keep the all-gathered input of its forward: its backward
gathers it again for the weight gradient, issued before the input-gradient GEMM and run under it
(Megatron-Core tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication.backward:
``dist_all_gather_func(all_gather_buffer, input, ..., async_op=True)`` then ``grad_output.matmul(weight)``;
Transformer Engine's LayerNormLinear the same). The golden value is worked by hand from the collective and
GEMM terms: two all-gathers per dense layer, each half an all-reduce of the activations, hidden under the
layer's GEMMs up to ``tp_comm_overlap`` of their time.
"""
from __future__ import annotations

import numpy as np
import pytest

from costmodels import collectives as C
from costmodels import communication as comm
from costmodels import compute
from costmodels.encode import encode_cluster, encode_job, encode_model
from costmodels.params import EfficiencyParams
from costmodels.plan import Plan, PlanBatch
from costmodels.presets import build_cluster, load_model
from costmodels.specs import FrameworkSpec, JobSpec, Precision

CLUSTER = build_cluster(gpu="h100", num_gpus=8, gpus_per_node=8)
MODEL = load_model("llama3-8b")


def _terms(sp: bool, e=EfficiencyParams()):
    job = JobSpec(global_batch=64, seq_len=4096, precision=Precision.BF16,
                  framework=FrameworkSpec(tp_comm_overlap=False))
    P = {k: np.asarray(v, dtype=np.float32)
         for k, v in PlanBatch.from_plans([Plan(tp=8, pp=1, dp=1, mbs=1, sp=sp)]).arrays.items()}
    M, H, J = encode_model(MODEL), encode_cluster(CLUSTER), encode_job(job, CLUSTER)
    S = compute.shapes(P, M, J, e)
    w = compute.layer_work(S, M, H, J, e)
    lc = comm.layer_comm(S, w, compute.layer_times(w, e), M, H, J, e)
    return S, w, H, lc


def _pair(H, e):
    """One all-reduce of a sequence's activations (bf16) over the 8 TP ranks."""
    return float(C.all_reduce_s(np.float32(4096 * MODEL.hidden_size * 2.0), np.float32(8), 1.0, H,
                                (e.intra_bw_eff, e.inter_bw_eff), e.collective_latency_s))


def test_the_backward_regathers_the_column_parallel_inputs():
    e = EfficiencyParams()
    S, w, H, lc = _terms(sp=True, e=e)
    pair = _pair(H, e)
    gemm = float(np.asarray(w.attn_proj + w.mlp_dense).ravel()[0])
    # forward: 2 pairs of AG + RS, not hidden (no userbuffers); backward the same with the column-parallel
    # layers' reduce-scatters (half of it) under the weight-gradient GEMMs, plus the two re-gathers
    fwd = 2.0 * pair
    bwd = 2.0 * pair - 0.5 * min(e.tp_comm_overlap * 2.0 * pair, gemm) + (pair - min(e.tp_comm_overlap * pair, gemm))
    assert float(np.asarray(lc.tp_dense).ravel()[0]) == pytest.approx(fwd, rel=1e-4)
    assert float(np.asarray(lc.tp_dense_bwd).ravel()[0]) == pytest.approx(bwd, rel=1e-4)


def test_no_regather_without_sequence_parallelism():
    # without SP the forward all-reduces leave the full input on every rank; the backward's all-reduces of the
    # input gradients run under the weight-gradient GEMMs, nothing is gathered again
    e = EfficiencyParams()
    S, w, H, lc = _terms(sp=False, e=e)
    pair = _pair(H, e)
    gemm = float(np.asarray(w.attn_proj + w.mlp_dense).ravel()[0])
    assert float(np.asarray(lc.tp_dense_bwd).ravel()[0]) == pytest.approx(
        2.0 * pair - min(e.tp_comm_overlap * 2.0 * pair, gemm), rel=1e-4)
