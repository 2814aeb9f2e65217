"""Pipeline parallelism: which layers each stage holds, and how stages compose into a step.

The first, a middle and the last stage are scored separately (the embedding sits on the first,
the output layer and loss on the last; uneven or accounted splits change their layer counts).

Sources
  [N21] Narayanan et al. 2021, sec. 2.2: 1F1B and interleaved 1F1B; bubble (p-1)/(v*m) of the
        ideal step for equal stages.
  [MC]  Megatron-Core schedules.py: interleaved warm-up 2*(pp-rank-1) + (v-1)*N chunk forwards (N the
        micro-batch group, pp by default);
        transformer_block.py get_num_layers_to_build (stage layer counts).
"""
from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from .compute import Shapes
from .plan import stage_layers


class Stages(NamedTuple):
    """Transformer layers on the first, a middle and the last pipeline rank."""
    first: object
    mid: object
    last: object
    has_mid: object          # 1 when pp > 2
    single: object           # 1 when pp == 1 (one rank holds everything)


def stages(S: Shapes, P: dict, M: dict) -> Stages:
    """MTP layers sit where a layout puts them ('m', counted in its ranks' layers), else on the last rank
    [MC multi_token_prediction.py mtp_on_this_rank]."""
    has_layout = (P["layout"] > 0).astype(jnp.float32)
    mtp = M["mtp_layers"]
    n_first, n_mid, n_last = stage_layers(M["layers"] + has_layout * mtp, S.pp, S.vpp, P["first_layers"],
                                          P["last_layers"], jnp, acc_embedding=P["account_for_embedding"],
                                          acc_loss=P["account_for_loss"], layout=P["layout"])
    single = (S.pp == 1).astype(jnp.float32)
    on_last = (1.0 - has_layout) * mtp
    return Stages(n_first + single * on_last, n_mid + single * on_last, n_last + on_last,
                  (S.pp > 2).astype(jnp.float32), single)


def recomputed_layers(S: Shapes, P: dict, n):
    """Layers of a stage that full recomputation replays: all, or with block recompute
    (Megatron --recompute-method block) recompute_layers of each of its vpp chunks."""
    R = P["recompute_layers"]
    return S.rec_full * jnp.where(R > 0, jnp.minimum(R, n / S.vpp) * S.vpp, n)


class Selector(NamedTuple):
    """Which of (first, middle, last) a per-stage quantity is taken from."""
    is_first: object
    is_last: object

    def pick(self, x_first, x_mid, x_last):
        return jnp.where(self.is_first, x_first, jnp.where(self.is_last, x_last, x_mid))


def largest(x_first, x_mid, x_last, has_mid) -> Selector:
    """The stage with the largest value (the middle counts only when it exists)."""
    mid = has_mid * x_mid
    is_first = (x_first >= x_last) & (x_first >= mid)
    return Selector(is_first, ~is_first & (x_last >= mid))


def bubble_s(S: Shapes, t_first, t_mid, t_last, slowest: Selector):
    """The slowest stage sets the 1F1B steady state; the others fill and drain the pipe:
    (m - 1) * t_max + sum_i t_i in chunks of 1/v, i.e. (p-1)/v * t for equal stages [N21 sec. 2.2]
    (also when m < pp: more slots than micro-batches)."""
    t_max = slowest.pick(t_first, t_mid, t_last)
    t_sum = t_first + t_last + jnp.maximum(S.pp - 2.0, 0.0) * t_mid
    # no pipeline, no bubble: exactly 0 (t_sum - t_max cancels only up to float32 rounding there)
    return jnp.where(S.pp > 1, jnp.maximum(t_sum - t_max, 0.0) / S.vpp, 0.0)


def in_flight_micro_batches(S: Shapes, rank, gpipe=0.0):
    """Micro-batches whose activations a pipeline rank holds at its peak: 1F1B warm-up pp - rank
    (at most m); interleaved, 2*(pp - rank - 1) + (v - 1)*N + 1 chunk forwards of 1/v stage [MC], N the
    micro-batch group per virtual stage (pp, or more where pp does not divide m: plan.microbatch_group_size).
    GPipe (gpipe = 1) runs all m forwards before the first backward [Huang et al. 2019, sec. 2.3]:
    m micro-batches with pp > 1 (without pipelining, pp = 1, one micro-batch at a time)."""
    v, pp = S.vpp, S.pp
    one_f_one_b = jnp.where(v > 1, (2.0 * (pp - rank - 1.0) + (v - 1.0) * S.mb_group + 1.0) / v,
                            jnp.minimum(S.micro_batches, pp - rank))
    return jnp.where((gpipe > 0) & (pp > 1), S.micro_batches, one_f_one_b)
