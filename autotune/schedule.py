"""The pipeline schedule of a plan as a timeline: which micro-batch each stage runs when.

Megatron-Core's 1F1B and interleaved 1F1B orders (megatron/core/pipeline_parallel/schedules.py,
`forward_backward_pipelining_with_interleaving`; Narayanan et al. 2021, sec. 2.2, fig. 4): each stage
runs a warm-up of forwards, then alternates one forward and one backward, then drains the backwards.
Rank r of p with v model chunks runs (p - r - 1) * 2 + (v - 1) * p warm-up forwards ((p - r - 1)
without interleaving); its k-th forward is micro-batch (k // (p v)) p + k % p of chunk (k // p) % v,
its k-th backward the same micro-batch of chunk v - 1 - (k // p) % v. The list of operations per
stage is replayed with their dependencies (a forward needs the previous virtual stage's forward of the
same micro-batch, a backward the next virtual stage's backward), each stage running its operations in
order, so the timeline and its bubble come out of the order itself, not from the bubble formula.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    stage: int
    kind: str          # "F" or "B"
    micro_batch: int
    chunk: int
    start_s: float
    end_s: float


def stage_order(rank: int, p: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """Megatron-Core's order of (kind, micro_batch, chunk) on pipeline rank `rank`."""
    total = m * v
    warmup = (p - rank - 1) * 2 + (v - 1) * p if v > 1 else p - rank - 1
    warmup = min(warmup, total)

    def fwd(k):
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k):
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    order = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [fwd(warmup + i), bwd(i)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def simulate(p: int, v: int, m: int, forward_s, backward_s) -> list[Op]:
    """Replay the per-stage orders with their dependencies; `forward_s` / `backward_s` per chunk per
    micro-batch, one number or one per stage. Needs m a multiple of p when v > 1 (Megatron's rule)."""
    if v > 1 and m % p:
        raise ValueError(f"interleaving needs micro-batches ({m}) to be a multiple of pipeline stages ({p})")
    fwd_s = list(forward_s) if hasattr(forward_s, "__len__") else [float(forward_s)] * p
    bwd_s = list(backward_s) if hasattr(backward_s, "__len__") else [float(backward_s)] * p
    if len(fwd_s) != p or len(bwd_s) != p:
        raise ValueError(f"need one forward and one backward time per stage ({p})")
    orders = [stage_order(r, p, v, m) for r in range(p)]
    done: dict = {}
    free = [0.0] * p
    pos = [0] * p
    ops: list[Op] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, mb, c = orders[r][pos[r]]
                vs = c * p + r                               # virtual stage index
                dep = (("F", mb, vs - 1) if vs > 0 else None) if kind == "F" else \
                    (("B", mb, vs + 1) if vs < p * v - 1 else ("F", mb, vs))
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep is not None else 0.0)
                end = start + (fwd_s[r] if kind == "F" else bwd_s[r])
                done[(kind, mb, vs)] = end
                free[r] = end
                ops.append(Op(r, kind, mb, c, start, end))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")   # a bug in the order, never user input
    return ops


def makespan_s(ops: list[Op]) -> float:
    return max(o.end_s for o in ops) if ops else 0.0


def stage_weights(plan: dict, num_layers: int | None) -> list[float]:
    """Each stage's share of the slowest stage's work, by its transformer layers (costmodels.plan.stage_layers:
    uneven first / last stages, embedding / loss counted as layers); all 1.0 without the model's layer
    count, for one stage, or for a layout plan (its middle ranks are not one size)."""
    from costmodels.plan import stage_layers
    p = int(plan["pp"])
    if not num_layers or p < 2 or plan.get("layout"):
        return [1.0] * p
    first, mid, last = (float(x) for x in stage_layers(
        float(num_layers), float(p), float(max(int(plan.get("vpp") or 1), 1)), float(plan.get("first_layers") or 0),
        float(plan.get("last_layers") or 0), acc_embedding=float(bool(plan.get("account_for_embedding"))),
        acc_loss=float(bool(plan.get("account_for_loss")))))
    layers = [first] + [mid] * (p - 2) + [last]
    top = max(layers)
    return [n / top for n in layers]


def plan_timeline(report: dict, max_micro_batches: int | None = None, num_layers: int | None = None) -> dict:
    """The timeline of a scored plan (a `top` entry of a search report): per-chunk forward and backward
    times from its compute (+ recomputation and exposed TP/CP/EP communication, which run inside the
    layers) split 1:2 (the backward pass does twice the forward's matmuls; recomputation is part of the
    backward), taken as the slowest stage's and scaled by each stage's layers (`stage_weights`), at most
    `max_micro_batches` micro-batches shown (a multiple of p)."""
    plan = report["plan"]
    p, v = int(plan["pp"]), max(int(plan.get("vpp") or 1), 1)
    m = int(report.get("micro_batches") or p)
    tb = report["time_breakdown_s"]
    layer_s = sum(tb.get(k, 0.0) for k in ("compute", "tp_comm", "cp_comm", "ep_comm", "pp_comm"))
    per_op = layer_s / max(m * v, 1)
    fwd, bwd = per_op / 3.0, 2.0 * per_op / 3.0 + tb.get("recompute", 0.0) / max(m * v, 1)
    shown = m if max_micro_batches is None else min(m, max(p, (max_micro_batches // p) * p))
    w = stage_weights(plan, num_layers)
    ops = simulate(p, v, shown, [fwd * x for x in w], [bwd * x for x in w])
    return {"pp": p, "vpp": v, "micro_batches": m, "shown_micro_batches": shown, "forward_s": fwd,
            "backward_s": bwd, "stage_weights": w, "makespan_s": makespan_s(ops), "ops": ops}
