"""Collective communication over a hierarchical topology, vectorized over candidate plans.

Symbols: n group size, stride the rank distance between consecutive group members (TP innermost
with stride 1, then CP, EP/DP, PP outermost: Megatron's rank order), D0 the NVLink domain size,
D1 the GPUs of one site, B0/B1/B2 per-GPU bandwidths of NVLink, fabric and wide-area link,
S the bytes each rank contributes.

Placement: a group with stride s has k_l = clip(floor(D_l / s), 1, n) members inside one level-l
domain. If n > k_l the group crosses that level's boundary, and the k_l members inside a domain
share k_l per-GPU links of the level above (each GPU owns its NIC: rail-optimized DGX), so the
bus bandwidth is min(B0, k0 * B1, k1 * B2') where B2' is one GPU's share of the site's WAN link.
This reproduces NCCL's measured multi-node bus bandwidth (~8 x NIC for a full-node ring).

Costs (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009, bandwidth-optimal rings):
  all-reduce      2 (n-1)/n * S / bw + latency
  reduce-scatter  (n-1)/n * S / bw + latency        (all-gather the same)
  all-to-all      each rank sends (n-1)/n of S; the part leaving a domain goes over the slower link
  p2p             S / bw_link + latency
"""
from __future__ import annotations

import jax.numpy as jnp


def _members_inside(domain, stride, n):
    return jnp.clip(jnp.floor(domain / stride), 1.0, n)


def group_link(n, stride, hw, eff):
    """(bus bandwidth bytes/s, per-step latency s) of a group of n ranks at the given stride."""
    intra_eff, inter_eff = eff
    k0 = _members_inside(hw["domain"], stride, n)
    k1 = _members_inside(hw["site"], stride, n)
    crosses0 = n > k0
    crosses1 = n > k1
    wan_share = hw["wan_bw"] / hw["site"]           # one GPU's share of its site's WAN link
    bw = hw["intra_bw"] * intra_eff
    bw = jnp.where(crosses0, jnp.minimum(bw, k0 * hw["inter_bw"] * inter_eff), bw)
    bw = jnp.where(crosses1, jnp.minimum(bw, k1 * wan_share * inter_eff), bw)
    lat = jnp.where(crosses1, hw["wan_lat"], jnp.where(crosses0, hw["inter_lat"], hw["intra_lat"]))
    return bw, lat


def _steps(n):
    # latency term: NCCL picks rings for bandwidth and trees (log depth) for latency at scale
    return 2.0 * jnp.log2(jnp.maximum(n, 1.0))


def all_reduce_s(bytes_, n, stride, hw, eff, base_s=0.0):
    bw, lat = group_link(n, stride, hw, eff)
    t = 2.0 * (n - 1.0) / n * bytes_ / bw + _steps(n) * lat + base_s
    return jnp.where(n > 1, t, 0.0)


def reduce_scatter_s(bytes_, n, stride, hw, eff, base_s=0.0):
    """Reduce-scatter (or all-gather) of a buffer of `bytes_` per rank (full size).

    NCCL runs these as rings only (no tree), so the latency term grows with n - 1."""
    bw, lat = group_link(n, stride, hw, eff)
    t = (n - 1.0) / n * bytes_ / bw + (n - 1.0) * lat + base_s
    return jnp.where(n > 1, t, 0.0)


all_gather_s = reduce_scatter_s


def all_to_all_s(bytes_, n, stride, hw, eff, base_s=0.0, remote_share=1.0, local_share=1.0):
    """All-to-all where each rank holds `bytes_` and keeps 1/n of it (token dispatch/combine);
    `remote_share` scales what leaves the NVLink domain (a dispatcher that sends a token once per
    destination node instead of once per expert), `local_share` what stays inside it (once per
    destination rank)."""
    intra_eff, inter_eff = eff
    k0 = _members_inside(hw["domain"], stride, n)
    k1 = _members_inside(hw["site"], stride, n)
    wan_share = hw["wan_bw"] / hw["site"]
    t_intra = local_share * bytes_ * (k0 - 1.0) / n / (hw["intra_bw"] * intra_eff)
    t_inter = remote_share * bytes_ * (k1 - k0) / n / (hw["inter_bw"] * inter_eff)
    t_wan = remote_share * bytes_ * (n - k1) / n / (wan_share * inter_eff)
    lat = jnp.where(n > k1, hw["wan_lat"], jnp.where(n > k0, hw["inter_lat"], hw["intra_lat"]))
    t = jnp.maximum(jnp.maximum(t_intra, t_inter), t_wan) + _steps(n) * lat + base_s
    return jnp.where(n > 1, t, 0.0)


def node_dedup_share(top_k, n, stride, hw):
    """Share of a token's remote copies a node-deduplicating dispatcher still sends: DeepEP / HybridEP
    (Megatron-Core's flex dispatcher) send each token once to every other NVLink domain holding one of
    its top-k experts and fan it out over NVLink there [DeepEP README, "normal kernels"]. With uniform
    (force-balanced) routing over D domains a token reaches (D-1)(1-(1-1/D)^k) other domains in
    expectation, against k(D-1)/D copies for a plain all-to-all."""
    return dedup_share(top_k, n / _members_inside(hw["domain"], stride, n))


def rank_dedup_share(top_k, n):
    """Share of a token's copies to the other ranks of its own NVLink domain that DeepEP / HybridEP still send:
    one per destination rank holding any of its top-k experts (DeepEP intranode.cu: a token is copied to a
    rank when `is_token_in_rank`, and the rank fans it out to its local experts), against one per expert."""
    return dedup_share(top_k, n)


def dedup_share(top_k, d):
    """Copies a deduplicating dispatcher sends over d equal destinations (ranks or domains), per copy of the
    plain all-to-all: uniform routing reaches each of them with probability 1 - (1 - 1/d)^k."""
    d = jnp.maximum(d, 1.0)
    k = jnp.maximum(top_k, 1.0)
    share = d * (1.0 - (1.0 - 1.0 / d) ** k) / k
    return jnp.where(d > 1.0, jnp.minimum(share, 1.0), 1.0)


def p2p_s(bytes_, stride, pp, hw, eff):
    """Pipeline send/recv between adjacent stages `stride` ranks apart; the slowest boundary counts.

    Only the GPUs of one stage cross a boundary at a time, so across sites each GPU gets the WAN
    link divided by the stage's GPUs on it (not by the whole site as for data parallelism). Inside
    a node one peer gets the scale-up bandwidth a switch gives it (all of NVLink behind NVSwitch,
    one xGMI link in MI300X's fully connected mesh); across nodes one NIC.
    """
    intra_eff, inter_eff = eff
    crosses0 = pp * stride > hw["domain"]
    crosses1 = hw["sites"] > 1.0
    senders_on_wan = jnp.minimum(stride, hw["site"])
    bw = jnp.where(crosses0, hw["inter_bw"] * inter_eff, hw["intra_p2p_bw"] * intra_eff)
    bw = jnp.where(crosses1, jnp.minimum(bw, hw["wan_bw"] / senders_on_wan * inter_eff), bw)
    lat = jnp.where(crosses1, hw["wan_lat"], jnp.where(crosses0, hw["inter_lat"], hw["intra_lat"]))
    return jnp.where(pp > 1, bytes_ / bw + lat, 0.0)


def crosses_levels(n, stride, hw):
    """(crosses NVLink domain, crosses site) for a group: used by reports and tests."""
    k0 = _members_inside(hw["domain"], stride, n)
    k1 = _members_inside(hw["site"], stride, n)
    return n > k0, n > k1
