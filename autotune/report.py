"""Reports: JSON (the source of truth), the explanation paragraph, Markdown rendering, saving."""
from __future__ import annotations

import datetime as _dt
import os
import re

from dataclasses import replace

from costmodels.plan import Plan, format_plan
from costmodels.specs import DispatcherType, SpecError, spec_dict
from search_spaces.space import KNOBS, Problem, check_plan

from . import __version__
from .labels import TIME_LABELS, plan_text, training_text  # noqa: F401 (re-exported: reports and the CLI use them)
from .files import dumps_json, write_text_atomic



def problem_dict(problem: Problem) -> dict:
    cl = spec_dict(problem.cluster)
    gpu = cl.pop("gpu")
    return {"model": spec_dict(problem.model), "gpu": gpu, "cluster": cl, "job": spec_dict(problem.job)}


def extras_text(plan: dict) -> str:
    """The Optuna-only knobs in words ("" when unused): uneven end stages, block recompute."""
    parts = []
    if plan.get("first_layers") or plan.get("last_layers"):
        parts.append(f"first/last stage {plan.get('first_layers') or 'even'}/{plan.get('last_layers') or 'even'} layers")
    if plan.get("recompute_layers"):
        parts.append(f"recompute {plan['recompute_layers']} layers/chunk")
    return ", ".join(parts)


def uses_extras(reports: list) -> bool:
    return any(extras_text(r["plan"]) for r in reports)


# Plan-table columns, defined once for the CLI's tables and the Markdown report: one column per
# knob, headed by its Knob.label, cells formatted by its Knob.fmt (search_spaces.space.KNOBS).
TABLE_KNOBS = ("tp", "pp", "dp", "cp", "ep", "vpp", "mbs", "recompute", "sp", "zero")
#: knobs shown only when a listed plan uses them (their unused value)
EXTRA_KNOBS = {"etp": 1, "first_layers": 0, "last_layers": 0, "recompute_layers": 0}


#: knobs shown only when the listed plans differ in them (else two rows could look the same)
VARYING_KNOBS = ("recompute_modules", "account_for_embedding", "account_for_loss")


def table_knobs(reports: list) -> list[str]:
    """The knob columns of a table of these plans: TABLE_KNOBS, then the extras any plan uses and
    the knobs the plans differ in."""
    def varies(k):
        return len({str(r["plan"].get(k)) for r in reports}) > 1
    extras = [k for k, unused in EXTRA_KNOBS.items()
              if any(r["plan"].get(k, unused) not in (unused, None) for r in reports)]
    return list(TABLE_KNOBS) + extras + [k for k in VARYING_KNOBS if varies(k)]


def knob_label(name: str) -> str:
    return KNOBS[name].label


def knob_cell(name: str, plan: dict) -> str:
    """A knob's value as a table shows it (Knob.fmt: sp on/off, recompute by name, 0 = even)."""
    value = plan.get(name, EXTRA_KNOBS.get(name))
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, str):                 # reports carry recompute by name already
        return value
    if isinstance(value, (list, tuple)):       # recompute modules by name
        return "+".join(value) or "-"
    try:
        return KNOBS[name].fmt(value)
    except (ValueError, TypeError, KeyError):
        return str(value)


def _layout(plan: dict) -> str:
    keys = ("tp", "pp", "dp", "cp", "ep", "vpp", "mbs")
    s = " ".join(f"{k.upper()}{plan[k]}" for k in keys if plan[k] != 1 or k in ("tp", "pp", "dp"))
    extra = extras_text(plan)
    return f"{s} recompute={plan['recompute']} ZeRO-{plan['zero']}" + (f" ({extra})" if extra else "")


def explain(best: dict, runner: dict | None, problem: Problem) -> str:
    """One paragraph: where the winner's time and memory go, and why it beats the runner-up."""
    tb = best["time_breakdown_s"]
    step = best["step_time_s"]
    parts = sorted(((k, v) for k, v in tb.items() if v > 0.005 * step), key=lambda kv: -kv[1])
    shares = ", ".join(f"{TIME_LABELS[k]} {v / step:.0%}" for k, v in parts[:4])
    mem = best["memory_gb"]
    big = max(("weights", "gradients", "optimizer", "activations"), key=lambda k: mem[k])
    text = (f"The fastest plan, {_layout(best['plan'])}, takes {step:.3g} s per step "
            f"({best['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {best['mfu']:.1%}): {shares}. "
            f"It needs {mem['total']:.1f} of {mem['limit']:.1f} GB per GPU, mostly {big} ({mem[big]:.1f} GB).")
    tail = ((_site_sentence(best["plan"], problem) if problem.cluster.num_sites > 1 else "")
            + _host_sentence(best, problem) + _ep_sentence(best, problem))
    if runner is None:
        return text + " It is the only plan that fits." + tail
    slower = runner["step_time_s"] / step - 1.0
    diffs = sorted(((k, runner["time_breakdown_s"][k] - tb[k]) for k in tb), key=lambda kv: -abs(kv[1]))
    worse = [(k, d) for k, d in diffs if d > 0][:2]
    better = [(k, -d) for k, d in diffs if d < 0][:1]
    why = " and ".join(f"{d:.3g} s more {TIME_LABELS[k]}" for k, d in worse) or "no single term"
    text += (f" The best plan with another layout, {_layout(runner['plan'])}, is {slower:.1%} slower: "
             f"it spends {why}")
    if better:
        k, d = better[0]
        text += f", which its {d:.3g} s less {TIME_LABELS[k]} does not make up"
    text += f"; it needs {runner['memory_gb']['total']:.1f} GB."
    return text + tail


#: a host wait above this share of the step is worth a sentence
HOST_BOUND_SHARE = 0.10


def _host_sentence(best: dict, problem: Problem) -> str:
    """Say when the GPUs wait for the host to issue kernels, and what removes that wait."""
    wait = best["time_breakdown_s"].get("host_wait", 0.0)
    share = wait / best["step_time_s"]
    if share < HOST_BOUND_SHARE:
        return ""
    impl = problem.job.framework.cuda_graph_impl.value
    if impl == "none":
        fix = ("Megatron-Core's CUDA graphs replay captured kernels with one launch: try `--cuda-graph-impl "
               "transformer_engine` (per layer) or `full_iteration`")
    else:
        fix = (f"with --cuda-graph-impl {impl} the rest is the uncaptured regions' kernels: capture more of "
               "the layer, or give each kernel more work (a larger micro-batch)")
    x = problem.cluster.gpu.host_op_x
    cpu = f", and a host CPU that takes {x:g}x a DGX H100's Xeon time per op" if x != 1.0 else ""
    return (f" Its GPUs wait {share:.0%} of the step ({wait:.3g} s) for the host to issue kernels (small "
            f"kernels, eager launches{cpu}): {fix}.")


#: exposed MoE all-to-alls above this share of the step are worth a sentence, if another dispatcher saves at least
#: FLEX_WORTH_SAYING of the step
EP_BOUND_SHARE = 0.10
FLEX_WORTH_SAYING = 0.03
#: the GPU families Megatron-Core's flex dispatcher runs on (DeepEP's kernels: Hopper; HybridEP: Hopper and Blackwell)
FLEX_FAMILIES = frozenset({"hopper", "blackwell"})


def _ep_sentence(best: dict, problem: Problem) -> str:
    """Say when exposed all-to-alls take a large share of the step and the flex dispatcher (DeepEP / HybridEP),
    which sends a token once per node and rank holding its experts, would cut them: the same plan re-scored."""
    from .search import predict                          # search imports this module
    step, a2a = best["step_time_s"], best["time_breakdown_s"].get("ep_comm", 0.0)
    fw = problem.job.framework
    if (a2a < EP_BOUND_SHARE * step or fw.moe_token_dispatcher_type is DispatcherType.FLEX
            or problem.cluster.gpu.family not in FLEX_FAMILIES):
        return ""
    try:
        flex = replace(problem, job=replace(problem.job, framework=replace(
            fw, moe_token_dispatcher_type=DispatcherType.FLEX)))
        plan = Plan.from_dict(best["plan"])
        check_plan(plan, flex)
        got = predict(flex, plan)
    except SpecError:
        return ""                                        # a plan or option flex cannot run: nothing to suggest
    if got["step_time_s"] > (1.0 - FLEX_WORTH_SAYING) * step:
        return ""
    return (f" Its all-to-alls take {a2a / step:.0%} of the step ({a2a:.3g} s) with the "
            f"{fw.moe_token_dispatcher_type.value} dispatcher: `--moe-token-dispatcher-type flex` (DeepEP / HybridEP, "
            f"a token sent once to each node and rank holding its experts) would take "
            f"{got['time_breakdown_s']['ep_comm']:.3g} s of them and {got['step_time_s']:.3g} s per step.")


def _site_sentence(plan: dict, problem: Problem) -> str:
    site = problem.cluster.gpus_per_site
    inner = plan["tp"] * plan["cp"] * plan["dp"]
    if plan["pp"] > 1 and inner <= site:
        return (f" Across the {problem.cluster.num_sites} sites only pipeline stages span the slow wide-area "
                f"link (one stage boundary per site), so only activations ({plan['pp']} stages), never "
                f"gradients or TP/CP/EP traffic, cross it.")
    return " Data-parallel gradient traffic crosses the wide-area link between sites."


def search_report(result, params_source: str = "defaults") -> dict:
    problem = result.problem
    return {
        "tool": "autotune", "version": __version__, "kind": "search",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "problem": problem_dict(problem),
        "strategy": result.strategy,
        "calibration": params_source,
        "best": result.best,
        "runner_up": result.runner_up,
        "top": result.top,
        "space": result.space,
        "explanation": explain(result.best, result.runner_up, problem),
        "elapsed_s": result.elapsed_s,
        **result.extra,
    }


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def report_basename(report: dict) -> str:
    p = report["problem"]
    date = report["created"][:19].replace(":", "").replace("-", "")
    return f"{_slug(p['model']['name'])}_{_slug(p['gpu']['name'])}x{p['cluster']['num_gpus']}_{date}"


def render_markdown(report: dict) -> str:
    p = report["problem"]
    knobs = table_knobs(report["top"])
    lines = [f"# autotune search: {p['model']['name']} on {p['cluster']['num_gpus']:,} x {p['gpu']['name']}",
             "", f"Created {report['created']} by autotune {report['version']} "
             f"(strategy {report['strategy']}, calibration {report['calibration']}).", "",
             f"Job: global batch {p['job']['global_batch']:,} x {p['job']['seq_len']:,} tokens, "
             f"precision {p['job']['precision']}{training_text(p['job'])}.", "", "## Why this plan", "",
             report["explanation"], "",
             *_ties_lines(report),
             "## Best plans", "",
             "| # | " + " | ".join(knob_label(k) for k in knobs)
             + " | step (s) | tokens/s/GPU | TFLOP/s/GPU | MFU | memory (GB) | fits |",
             "|---|" + "---|" * (len(knobs) + 6)]
    for i, r in enumerate(report["top"], 1):
        pl = r["plan"]
        tie = " ≈" if i > 1 and r.get("tie_with_best") else ""        # within the model's error of #1
        lines.append(f"| {i}{tie} | " + " | ".join(knob_cell(k, pl) for k in knobs)
                     + f" | {r['step_time_s']:.3f} | {r['tokens_per_s_per_gpu']:,.0f} | "
                     f"{r['model_tflops_per_gpu']:,.0f} | {r['mfu']:.1%} | {r['memory_gb']['total']:.1f} | "
                     f"{'yes' if r['fits'] else 'no'} |")
    best = report["best"]
    lines += ["", "## Time and memory of the best plan", "", "| time term | seconds | share |", "|---|---|---|"]
    for k, v in best["time_breakdown_s"].items():
        lines.append(f"| {k} | {v:.4f} | {v / best['step_time_s']:.1%} |")
    lines += ["", "| memory term | GB |", "|---|---|"]
    for k, v in best["memory_gb"].items():
        lines.append(f"| {k} | {v:.2f} |")
    sp = report["space"]
    illegal = ", ".join(f"{k} {v}" for k, v in sp.get("illegal", {}).items())
    lines += ["", "## Search space", "",
              f"{sp['total']} combinations, {sp['legal']} legal, {sp['fitting']} fit in memory, "
              f"{sp['scored']} scored in {report['elapsed_s']:.2f} s. Illegal by first rule broken: {illegal}.", ""]
    for extra in report.get("sections", []):
        lines += [f"## {extra['title']}", "", extra["markdown"], ""]
    return "\n".join(lines)


def _ties_lines(report: dict) -> list:
    """The headroom and ties sentence and the plans flagged at the memory limit (empty without them)."""
    from .headroom import ties_sentence
    if not report.get("ties"):
        return []
    out = [ties_sentence(report), ""]
    flagged = [str(i) for i, r in enumerate(report["top"], 1) if r.get("at_limit")]
    if flagged:
        out += [f"**At the memory limit** (above {report['headroom']['at_limit_frac']:.0%} of the device): "
                f"plan {', '.join(flagged)}.", ""]
    return out


def save_report(report: dict, out_dir: str, *, study=None, plotlyjs: str = "inline") -> tuple[str, ...]:
    """Write the report as strict JSON (the source of truth), its Markdown rendering and the HTML page
    with plots (plotly; with an Optuna `study`, Optuna's own study plots too), under a name no other
    report holds (concurrent searches into one folder keep every report), each atomically."""
    from .figures import search_page, write_plotlyjs

    base = os.path.join(out_dir, report_basename(report))
    json_path = write_text_atomic(base + ".json", dumps_json(report) + "\n", "out", exclusive=True)
    stem = json_path[:-len(".json")]
    md_path = write_text_atomic(stem + ".md", render_markdown(report), "out")
    if not report.get("top"):                     # nothing to plot (an empty report)
        return json_path, md_path
    if plotlyjs == "directory":
        write_plotlyjs(out_dir)
    html_path = write_text_atomic(stem + ".html", search_page(report, study=study, plotlyjs=plotlyjs), "out")
    return json_path, md_path, html_path
