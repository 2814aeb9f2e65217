"""The all-reduce cost against NCCL as measured on an 8-GPU A100 node.

tests/data/nccl/a100_allreduce_vtrain.json: nccl-tests all_reduce_perf times on 2, 4 and 8 GPUs of the A100
node vTrain's ground-truth runs were measured on (VIA-Research/vTrain trace/a100, MIT licence; provenance in
the file), 1 MiB to 1 GiB. The cost model's ring all-reduce (costmodels/collectives.py: 2(n-1)/n of the
buffer at the achieved bus bandwidth plus a fixed and a per-step latency) with the shipped constants:
gradient-sized buffers (>= 32 MiB) within 7.7 % MAPE (max 20 %); activation-sized buffers (1-16 MiB, a TP
all-reduce of a small model) 17-55 % too fast, NCCL's bandwidth ramp that the alpha-beta form does not
have. A refit with the measured intercept as the prior of `collective_latency_s` (42 us against 15) was
tried and made vTrain's own runs worse out of sample (README, Accuracy), so the miss stays, bounded here.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from costmodels import collectives as C
from costmodels.encode import encode_cluster
from costmodels.params import EfficiencyParams
from costmodels.presets import build_cluster

DATA = json.loads((Path(__file__).parent / "data" / "nccl" / "a100_allreduce_vtrain.json").read_text())


@pytest.fixture(scope="module")
def errors():
    e = EfficiencyParams()
    H = encode_cluster(build_cluster(gpu=DATA["gpu"], num_gpus=8, gpus_per_node=DATA["gpus_per_node"]))
    runs = DATA["runs"]
    size, gpus = (np.array([r[k] for r in runs], dtype=np.float32) for k in ("bytes", "gpus"))
    t = np.asarray(C.all_reduce_s(size, gpus, 1.0, H, (e.intra_bw_eff, e.inter_bw_eff), e.collective_latency_s))
    return [(r["gpus"], r["bytes"], float(x) / (r["time_us"] * 1e-6) - 1.0) for r, x in zip(runs, t)]


def test_the_table_is_complete():
    assert sorted({r["gpus"] for r in DATA["runs"]}) == [2, 4, 8]
    assert len(DATA["runs"]) == 33 and DATA["source"]["licence"].startswith("MIT")


def test_gradient_sized_all_reduces(errors):
    err = np.array([x[2] for x in errors if x[1] >= 32 << 20])
    assert len(err) == 18
    assert np.mean(np.abs(err)) < 0.10 and np.max(np.abs(err)) < 0.25, err


def test_activation_sized_all_reduces_are_a_lower_bound(errors):
    # the known miss: the model never charges more than NCCL took, and stays within 2.5x of it
    err = np.array([x[2] for x in errors if x[1] <= 16 << 20])
    assert len(err) == 15
    assert np.all(err < 0.0) and np.all(err > -0.6), err
