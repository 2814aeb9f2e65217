"""Sensitivity of one plan: what limits it, and what would help.

Elasticities d log(output) / d log(input) of step time, tokens/s and peak memory with respect to
the continuous inputs (hardware rates and latencies, job size, every efficiency parameter), by
forward-mode differentiation (`jax.jacfwd`) through the same cost model the search uses: each
input is scaled by exp(u_i) and the Jacobian is taken at u = 0. No finite differences.

The elasticities become ranked sentences ("1.00 -> 1.10x inter-node bandwidth: -3.1% step time
(exposed DP gradient sync is 22% of the step)"), where the 10% what-if is extrapolated from the
elasticity as 1.1**e - 1 and the named term is the breakdown term whose time moves most with that
input. Discrete knobs cannot be differentiated; for them the best neighbouring plan (one knob moved
to an adjacent legal value) is scored instead.
"""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from costmodels import model as cm
from costmodels.params import EfficiencyParams
from costmodels.plan import DEFAULT_RECOMPUTE_MODULES, OPTIONAL_FIELDS, PLAN_FIELDS, Plan, PlanBatch, modules_mask
from costmodels.specs import Recompute, SpecError
from search_spaces.space import KNOBS, Problem, check_plan, legal_values_of

from .report import TIME_LABELS
from .scoring import TIME_KEYS, Inputs, plan_report, score_full

#: continuous inputs that are not efficiency parameters: name -> [(dict, key)] scaled together
HW_INPUTS = {
    "peak_flops": (("job", "peak_gemm"), ("hw", "peak_bf16")),
    "hbm_bandwidth": (("hw", "hbm_bw"),),
    "intra_node_bandwidth": (("hw", "intra_bw"),),
    "inter_node_bandwidth": (("hw", "inter_bw"),),
    "intra_node_latency": (("hw", "intra_lat"),),
    "inter_node_latency": (("hw", "inter_lat"),),
    "global_batch": (("job", "global_batch"),),
    "seq_len": (("job", "seq_len"),),
}
INPUT_LABELS = {
    "peak_flops": "peak FLOP/s", "hbm_bandwidth": "HBM bandwidth",
    "intra_node_bandwidth": "intra-node bandwidth", "inter_node_bandwidth": "inter-node bandwidth",
    "intra_node_latency": "intra-node latency", "inter_node_latency": "inter-node latency",
    "global_batch": "global batch", "seq_len": "sequence length",
}
#: every differentiated input, in Jacobian column order
INPUT_NAMES = tuple(HW_INPUTS) + tuple(EfficiencyParams._fields)
OUTPUTS = ("step_time_s", "tokens_per_s", "peak_memory_gb")
TERMS = tuple(TIME_KEYS)                         # breakdown terms (sum to the step time)
WHATIF = 1.10                                    # the what-if factor in the sentences


def _outputs(u, plan, model, hw, job, params):
    """log(step), log(tokens/s), log(peak memory), then the breakdown terms (s), with every input
    scaled by exp(u)."""
    hw, job, pd = dict(hw), dict(job), params._asdict()
    scale = jnp.exp(u)
    for i, name in enumerate(HW_INPUTS):
        for where, key in HW_INPUTS[name]:
            d = hw if where == "hw" else job
            d[key] = d[key] * scale[i]
    off = len(HW_INPUTS)
    for j, f in enumerate(EfficiencyParams._fields):
        pd[f] = pd[f] * scale[off + j]
    out = cm.evaluate(plan, model, hw, job, EfficiencyParams(**pd))
    head = jnp.stack([jnp.log(out.step_time_s[0]), jnp.log(out.tokens_per_s[0]),
                      jnp.log(out.memory.total[0])])
    terms = jnp.stack([getattr(out.time, t)[0] for t in TERMS])
    vec = jnp.concatenate([head, terms])
    return vec, vec


#: (Jacobian [3 + n_terms, n_inputs], values at u = 0). Deliberately not jitted: XLA takes ~30 s
#: to compile the 39-wide forward-mode graph on CPU, while eager dispatch runs it in ~0.15 s once
#: the per-primitive kernels are cached (a few seconds on the first call of a process).
_jac_eager = jax.jacfwd(_outputs, has_aux=True)
#: the same outputs without derivatives (for finite-difference checks)
outputs_jit = jax.jit(lambda u, plan, model, hw, job, params: _outputs(u, plan, model, hw, job, params)[0])


def plan_arrays(plan: Plan) -> dict:
    return PlanBatch.from_plans([plan]).arrays


def _params_f32(params: EfficiencyParams) -> EfficiencyParams:
    return EfficiencyParams(*(np.float32(v) for v in params))


def jacobian(plan: Plan, inp: Inputs, params: EfficiencyParams) -> tuple[np.ndarray, np.ndarray]:
    u0 = jnp.zeros(len(INPUT_NAMES), dtype=jnp.float32)
    jac, val = _jac_eager(u0, plan_arrays(plan), inp.model, inp.hw, inp.job, _params_f32(params))
    return np.asarray(jac, dtype=np.float64), np.asarray(val, dtype=np.float64)


def _pct_change(e: float, factor: float = WHATIF) -> float:
    return (math.exp(e * math.log(factor)) - 1.0) * 100.0


#: efficiency parameters in the words of a user's sentence (the field names stay in --json)
PARAM_LABELS = {
    "gemm_eff_max": "large-GEMM efficiency", "gemm_eff_max_fp8": "large fp8 GEMM efficiency",
    "gemm_dim_half": "GEMM size at half efficiency", "attn_eff_max": "attention kernel efficiency",
    "attn_seq_half": "attention kernel's fixed cost per query row",
    "attn_bwd_ratio": "fused attention backward/forward MMA ratio",
    "softmax_bytes_per_score": "unfused softmax bytes per score", "hbm_eff": "achieved HBM bandwidth share",
    "elementwise_bytes_h": "elementwise bytes per hidden unit", "elementwise_bytes_f": "elementwise bytes per FFN unit",
    "lp_cast_bytes": "low-precision cast bytes", "kernel_overhead_s": "per-kernel launch overhead",
    "intra_bw_eff": "achieved NVLink bandwidth share", "inter_bw_eff": "achieved network bandwidth share",
    "tp_comm_overlap": "TP communication overlap", "dp_overlap": "DP communication overlap",
    "cp_overlap": "CP communication overlap", "pp_overlap": "pipeline p2p overlap",
    "ep_overlap": "MoE all-to-all overlap", "moe_imbalance": "MoE load imbalance",
    "step_overhead_s": "per-step host overhead", "microbatch_overhead_s": "per-micro-batch host overhead",
    "collective_latency_s": "collective launch latency", "zero3_bw_eff": "DeepSpeed ZeRO-3 gather bandwidth share",
    "mem_fragmentation": "allocator fragmentation",
}


def _input_label(name: str, params: EfficiencyParams) -> str:
    if name in INPUT_LABELS:
        return INPUT_LABELS[name]
    label = PARAM_LABELS.get(name, name.replace("_", " "))
    return f"{label} (now {getattr(params, name):.4g})"


def _fmt_knob(knob: str, plan: Plan) -> str:
    """A knob's value as the plan tables show it (the knob's own formatter)."""
    return KNOBS[knob].fmt(plan.row()[knob])


def neighbour_plans(plan: Plan, problem: Problem) -> list[tuple[str, Plan]]:
    """Legal plans that differ from `plan` in one knob moved to an adjacent value of its domain
    (dp follows from the GPU count when tp, cp or pp moves). For the Optuna-only knobs, whose 0
    means "even split" / "every layer", the adjacent values are the nearest legal ones with 0
    ranked above all others (first_layers 0 -> one chunk fewer than the even split)."""
    out = []
    n = problem.cluster.num_gpus
    row = plan.row()
    for knob in KNOBS:
        if knob == "dp" or (plan.layout and knob in ("pp", "vpp", "first_layers", "last_layers")):
            continue
        dom = sorted(int(x) for x in KNOBS[knob].domain(problem))
        cur = row[knob]
        if cur not in dom:
            dom = sorted(set(dom) | {cur})
        optional = knob in OPTIONAL_FIELDS
        if optional:            # only legal values, 0 last: adjacency among what a user could pick
            legal = set(legal_values_of(knob, row, problem, dom).tolist()) | {cur}
            dom = sorted(legal, key=lambda v: (v == 0, v))
        i = dom.index(cur)
        for j in (i - 1, i + 1):
            if not 0 <= j < len(dom):
                continue
            vals = dict(row, **{knob: dom[j]})
            if knob == "recompute":    # modules go with selective recompute (Megatron's default set)
                vals["recompute_modules"] = modules_mask(DEFAULT_RECOMPUTE_MODULES) if dom[j] == int(Recompute.SELECTIVE) else 0
            if knob in ("tp", "cp", "pp"):
                denom = vals["tp"] * vals["cp"] * vals["pp"]
                if n % denom:
                    continue
                vals["dp"] = n // denom
            try:
                cand = Plan.from_row(vals, (plan.layout,) if plan.layout else ())
                check_plan(cand, problem)
            except (SpecError, ValueError):
                continue
            out.append((knob, cand))
    return out


def _neighbours(plan: Plan, base_step: float, inp: Inputs, params: EfficiencyParams) -> list[dict]:
    cands = neighbour_plans(plan, inp.problem)
    if not cands:
        return []
    batch = PlanBatch.from_plans([p for _, p in cands])
    out = score_full(batch, inp, params)
    rows = []
    for i, (knob, p) in enumerate(cands):
        rep = plan_report(p, out, i, inp)
        rows.append({"knob": knob, "from": _fmt_knob(knob, plan),
                     "to": _fmt_knob(knob, p), "plan": rep["plan"],
                     "step_time_s": rep["step_time_s"], "fits": rep["fits"],
                     "memory_gb": rep["memory_gb"]["total"],
                     "step_time_change_pct": (rep["step_time_s"] / base_step - 1.0) * 100.0})
    rows.sort(key=lambda r: (not r["fits"], r["step_time_s"]))
    return rows


def sensitivity(problem: Problem, plan: Plan, params: EfficiencyParams | None = None, *,
                memory_limit_gb: float | None = None, max_sentences: int = 10,
                neighbours: bool = True) -> dict:
    """Elasticities of one plan, ranked sentences, and the best neighbouring plan."""
    params = params or EfficiencyParams()
    t0 = time.perf_counter()
    inp = Inputs(problem, memory_limit_gb)
    jac, val = jacobian(plan, inp, params)
    step = math.exp(val[0])
    terms = dict(zip(TERMS, val[3:]))
    elast = {o: {name: float(jac[k, i]) for i, name in enumerate(INPUT_NAMES)} for k, o in enumerate(OUTPUTS)}

    def driver(i: int) -> str:
        """The breakdown term whose time moves most with input i, and its share of the step."""
        dts = jac[3:, i]
        k = int(np.argmax(np.abs(dts)))
        t = TERMS[k]
        return f"{TIME_LABELS[t]} is {terms[t] / step:.0%} of the step"

    ranked = sorted(range(len(INPUT_NAMES)), key=lambda i: -abs(jac[0, i]))
    sentences = []
    for i in ranked:
        name = INPUT_NAMES[i]
        e = jac[0, i]
        if abs(e) < 1e-3 or len(sentences) >= max_sentences:
            continue
        text = (f"1.00 -> {WHATIF:.2f}x {_input_label(name, params)}: "
                f"{_pct_change(e):+.1f}% step time")
        if name in ("global_batch", "seq_len"):
            text += f", {_pct_change(jac[1, i]):+.1f}% tokens/s"
        sentences.append(f"{text} ({driver(i)})")
    mem_ranked = [i for i in sorted(range(len(INPUT_NAMES)), key=lambda i: -abs(jac[2, i])) if abs(jac[2, i]) >= 1e-3]
    for i in mem_ranked[:3]:
        sentences.append(f"1.00 -> {WHATIF:.2f}x {_input_label(INPUT_NAMES[i], params)}: "
                         f"{_pct_change(jac[2, i]):+.1f}% peak memory")
    result = {
        "plan": plan.as_dict(),
        "step_time_s": step,
        "tokens_per_s": math.exp(val[1]),
        "peak_memory_gb": math.exp(val[2]) / 1e9,
        "time_breakdown_s": {t: float(v) for t, v in terms.items()},
        "elasticities": elast,
        "sentences": sentences,
    }
    if neighbours:
        rows = _neighbours(plan, step, inp, params)
        best = next((r for r in rows if r["fits"]), None)
        result["neighbours"] = rows
        result["best_neighbour"] = best
        if best is not None:
            result["sentences"].append(
                f"best neighbouring plan: {best['knob']} {best['from']} -> {best['to']}: "
                f"{best['step_time_change_pct']:+.1f}% step time"
                + (" (this plan is a local optimum)" if best["step_time_change_pct"] >= 0 else ""))
    result["elapsed_s"] = time.perf_counter() - t0
    return result


def add_sensitivity(report: dict, problem: Problem, params, memory_limit_gb: float | None = None) -> dict:
    """Add the best plan's elasticities (jax.jacfwd through the cost model) and their sentences to a
    search report, as the "sensitivity" key and a Markdown section."""
    sens = sensitivity(problem, Plan.from_dict(report["best"]["plan"]), params, memory_limit_gb=memory_limit_gb,
                       neighbours=False)
    report["sensitivity"] = {"elasticities": sens["elasticities"], "sentences": sens["sentences"]}
    md = "What limits the best plan, and what would help (elasticities from jax.jacfwd):\n\n" + \
        "\n".join(f"- {s}" for s in sens["sentences"])
    report.setdefault("sections", []).append({"title": "Sensitivity", "markdown": md})
    return report
