"""Plots of reports (plotly) and the self-contained HTML page that holds them.

Every figure is a plotly `Figure` built from the JSON report (the source of truth), so a page can be
regenerated from a saved report. The page embeds plotly.js once (inline: one file that works offline),
or, for a folder of reports, refers to one shared `plotly.min.js` next to them.
"""
from __future__ import annotations

import html
import os
import warnings

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from .labels import TIME_LABELS, plan_text, training_text

MEMORY_TERMS = ("weights", "gradients", "optimizer", "activations", "other")
PLOTLYJS_FILE = "plotly.min.js"


def _plan_label(i: int, r: dict) -> str:
    return f"#{i + 1}"


def _hover(r: dict) -> str:
    return html.escape(plan_text(r["plan"]))


def memory_figure(top: list, headroom: dict | None = None) -> go.Figure:
    """Peak memory per GPU of each listed plan, stacked by term, with the limit (and the device's memory)."""
    x = [_plan_label(i, r) for i, r in enumerate(top)]
    fig = go.Figure([go.Bar(name=k, x=x, y=[r["memory_gb"][k] for r in top], hovertext=[_hover(r) for r in top])
                     for k in MEMORY_TERMS])
    limit = headroom["limit_gb"] if headroom else (top[0]["memory_gb"]["limit"] if top else None)
    if limit:
        fig.add_hline(y=limit, line_dash="dash", line_color="red", annotation_text=f"limit {limit:.1f} GB")
    if headroom and headroom.get("headroom_frac"):
        fig.add_hline(y=headroom["device_limit_gb"], line_dash="dot", line_color="grey",
                      annotation_text=f"device {headroom['device_limit_gb']:.1f} GB")
    fig.update_layout(barmode="stack", title="Peak memory per GPU by plan", yaxis_title="GB",
                      xaxis_title="plan (rank by step time)")
    return fig


def time_figure(top: list) -> go.Figure:
    """Step time of each listed plan, stacked by term (the terms sum to the step)."""
    x = [_plan_label(i, r) for i, r in enumerate(top)]
    keys = [k for k in (top[0]["time_breakdown_s"] if top else {})
            if any(r["time_breakdown_s"][k] > 0 for r in top)]
    fig = go.Figure([go.Bar(name=TIME_LABELS.get(k, k), x=x, y=[r["time_breakdown_s"][k] for r in top],
                            hovertext=[_hover(r) for r in top]) for k in keys])
    fig.update_layout(barmode="stack", title="Step time by plan and term", yaxis_title="seconds per step",
                      xaxis_title="plan (rank by step time)")
    return fig


def top_plans_figure(top: list) -> go.Figure:
    """Step time against peak memory of the listed plans; plans tied with the fastest are marked."""
    tied = [bool(r.get("tie_with_best")) for r in top]
    fig = go.Figure()
    for flag, name, symbol in ((True, "within the model's error of the fastest", "circle"),
                               (False, "slower", "x")):
        rows = [(i, r) for i, r in enumerate(top) if tied[i] == flag]
        if rows:
            fig.add_trace(go.Scatter(x=[r["memory_gb"]["total"] for _, r in rows],
                                     y=[r["step_time_s"] for _, r in rows], mode="markers+text",
                                     text=[_plan_label(i, r) for i, r in rows], textposition="top center",
                                     hovertext=[_hover(r) for _, r in rows], name=name,
                                     marker={"symbol": symbol, "size": 10}))
    fig.update_layout(title="Top plans: step time vs peak memory", xaxis_title="peak memory per GPU (GB)",
                      yaxis_title="seconds per step")
    return fig


def schedule_figure(timeline: dict) -> go.Figure:
    """The pipeline schedule: one row per stage, a bar per forward (light) / backward (dark) of a
    micro-batch, labelled with the micro-batch number (and the model chunk when interleaved)."""
    ops = timeline["ops"]
    v = timeline["vpp"]
    fig = go.Figure()
    for kind, name, color in (("F", "forward", "#7fb3e6"), ("B", "backward", "#1f5fa8")):
        sel = [o for o in ops if o.kind == kind]
        fig.add_trace(go.Bar(
            name=name, orientation="h", y=[f"stage {o.stage}" for o in sel], x=[o.end_s - o.start_s for o in sel],
            base=[o.start_s for o in sel], marker_color=color, marker_line_width=0.5, marker_line_color="white",
            text=[f"{o.micro_batch}" + (f".{o.chunk}" if v > 1 else "") for o in sel], textposition="inside",
            insidetextanchor="middle",
            hovertext=[f"{name} micro-batch {o.micro_batch}, chunk {o.chunk}: {o.start_s:.3f}-{o.end_s:.3f} s"
                       for o in sel]))
    shown, m = timeline["shown_micro_batches"], timeline["micro_batches"]
    kind = "interleaved 1F1B" if v > 1 else "1F1B"
    title = (f"Pipeline schedule ({kind}, {timeline['pp']} stages, {v} chunks per stage): "
             f"{shown} of {m} micro-batches" + (" shown" if shown < m else ""))
    fig.update_layout(barmode="overlay", title=title, xaxis_title="seconds", bargap=0.2,
                      yaxis={"autorange": "reversed"}, height=max(250, 40 * timeline["pp"] + 150))
    return fig


def capacity_figure(report: dict) -> go.Figure:
    """Time to train against cost (GPU-hours when no price was given) per GPU type and GPU count."""
    fig = go.Figure()
    priced = all(g["price_per_gpu_hour"] for g in report["per_gpu"])
    for g in report["per_gpu"]:
        rows = [r for r in g["rows"] if r["wall_days"] is not None]
        fig.add_trace(go.Scatter(
            x=[r["wall_days"] for r in rows], y=[r["cost"] if priced else r["gpu_hours"] for r in rows],
            mode="lines+markers", name=g["gpu"], text=[f"{r['gpus']} GPUs" for r in rows],
            hovertext=[f"{g['gpu']} x {r['gpus']}: {r['wall_days']:.1f} days, {html.escape(plan_text(r['plan']))}"
                       for r in rows]))
        if g["pick"]:
            p = g["pick"]
            fig.add_trace(go.Scatter(x=[p["wall_days"]], y=[p["cost"] if priced else p["gpu_hours"]],
                                     mode="markers", marker={"size": 16, "symbol": "star"},
                                     name=f"{g['gpu']}: {p['gpus']} GPUs (pick)"))
    ys = [y for t in fig.data for y in t.y if y]
    if report.get("deadline_days") and ys:
        # a trace, not add_vline: its annotation is misplaced on log axes
        fig.add_trace(go.Scatter(x=[report["deadline_days"]] * 2, y=[min(ys), max(ys)], mode="lines",
                                 line={"dash": "dash", "color": "red"}, name=f"deadline {report['deadline_days']:g} d"))
    fig.update_layout(title=f"{report['model']}: time to train {report['tokens']:.3g} tokens vs "
                            f"{'cost ($)' if priced else 'GPU-hours'}",
                      xaxis_title="days (with failures and checkpoints)", xaxis_type="log", yaxis_type="log",
                      yaxis_title="cost ($)" if priced else "GPU-hours")
    return fig


def optuna_figures(study, objective_names: list[str], maximize: tuple = ()) -> list[tuple[str, go.Figure]]:
    """Optuna's own study plots (optuna.visualization): history per objective, Pareto front with two or
    more objectives, parameter importances. A plot Optuna cannot draw for this study is left out."""
    import optuna.visualization as ov

    figs: list[tuple[str, go.Figure]] = []
    multi = len(objective_names) > 1
    for i, name in enumerate(objective_names):
        target = (lambda t, i=i: t.values[i]) if multi else None
        try:
            figs.append((f"Optimisation history: {name}",
                         ov.plot_optimization_history(study, target=target, target_name=name)))
        except ValueError:
            pass
    if multi:
        try:
            figs.append(("Pareto front", ov.plot_pareto_front(study, target_names=objective_names[:3]
                                                               if len(objective_names) <= 3 else None)))
        except ValueError:
            pass
    try:
        sign = -1.0 if maximize and maximize[0] else 1.0      # importances look at low values of the target
        target = (lambda t: sign * t.values[0]) if multi else None
        with warnings.catch_warnings():          # the sign of the target is handled above
            warnings.simplefilter("ignore", UserWarning)
            fig = ov.plot_param_importances(study, target=target, target_name=objective_names[0])
        figs.append((f"Parameter importances ({objective_names[0]})", fig))
    except (ValueError, RuntimeError):
        pass
    return figs


def html_page(title: str, blocks: list, plotlyjs: str = "inline") -> str:
    """An HTML page of blocks, each ("h2", text) / ("p", text) / ("pre", text) / ("fig", Figure).
    plotlyjs: "inline" embeds plotly.js once (self-contained), "directory" refers to plotly.min.js
    beside the page (see write_plotlyjs)."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "pre{white-space:pre-wrap}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}"
             "</style>"]
    if plotlyjs == "inline":
        parts.append(f"<script type='text/javascript'>{get_plotlyjs()}</script>")
    else:
        parts.append(f"<script src='{PLOTLYJS_FILE}'></script>")
    parts.append(f"</head><body><h1>{html.escape(title)}</h1>")
    n_figs = 0
    for kind, content in blocks:
        if kind == "fig":
            n_figs += 1
            height = content.layout.height or 480       # a div of 100 % height inside a page body has none
            parts.append(content.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False},
                                         default_height=f"{height}px", div_id=f"figure-{n_figs}"))
        elif kind == "table":
            parts.append(_table_html(*content))
        else:
            parts.append(f"<{kind}>{html.escape(str(content))}</{kind}>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _table_html(header: list, rows: list) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_plotlyjs(out_dir: str) -> str:
    path = os.path.join(out_dir, PLOTLYJS_FILE)
    if not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(get_plotlyjs())
    return path


def search_page(report: dict, study=None, plotlyjs: str = "inline", max_plans: int = 10) -> str:
    """The HTML page of a search report: summary, top plans, memory and time breakdowns, the best plan's
    pipeline schedule, the sensitivity sentences and, with an Optuna study, Optuna's own plots."""
    from .schedule import plan_timeline

    p = report["problem"]
    top = report["top"][:max_plans]
    title = (f"{p['model']['name']} on {p['cluster']['num_gpus']} x {p['gpu']['name']}: global batch "
             f"{p['job']['global_batch']} x {p['job']['seq_len']}{training_text(p['job'])}")
    blocks: list = [("p", report["explanation"])]
    if report.get("ties"):
        from .headroom import ties_sentence
        blocks.append(("p", ties_sentence(report)))
    flagged = [i + 1 for i, r in enumerate(top) if r.get("at_limit")]
    if flagged:
        blocks.append(("p", f"Plans above {report['headroom']['at_limit_frac']:.0%} of the device memory: "
                            + ", ".join(f"#{i}" for i in flagged)))
    rows = [(f"#{i + 1}", f"{r['step_time_s']:.3f}", f"{r['mfu']:.1%}", f"{r['memory_gb']['total']:.1f}",
             "-" if r.get("headroom_gb") is None else f"{r['headroom_gb']:.1f}",
             "yes" if r.get("tie_with_best") else "no", plan_text(r["plan"])) for i, r in enumerate(top)]
    blocks += [("h2", "Top plans"),
               ("table", (["#", "step (s)", "MFU", "memory (GB)", "headroom (GB)", "within error of fastest", "plan"],
                          rows)),
               ("fig", top_plans_figure(top)),
               ("h2", "Memory"), ("fig", memory_figure(top, report.get("headroom"))),
               ("h2", "Time"), ("fig", time_figure(top))]
    best = report["best"]
    if best["plan"]["pp"] > 1:
        blocks += [("h2", "Pipeline schedule of the best plan"),
                   ("fig", schedule_figure(plan_timeline(best, max_micro_batches=4 * best["plan"]["pp"],
                                                         num_layers=p["model"].get("num_layers"))))]
    if report.get("sensitivity"):
        blocks += [("h2", "Sensitivity"), ("pre", "\n".join(report["sensitivity"]["sentences"]))]
    if study is not None and report.get("optuna"):
        blocks.append(("h2", "Optuna study"))
        names = [o["name"] for o in report["optuna"]["objectives"]]
        maximize = tuple(o["direction"] == "maximize" for o in report["optuna"]["objectives"])
        for heading, fig in optuna_figures(study, names, maximize):
            blocks += [("p", heading), ("fig", fig)]
    return html_page(title, blocks, plotlyjs)


def capacity_page(report: dict, plotlyjs: str = "inline") -> str:
    from .capacity import capacity_lines
    blocks: list = [("pre", "\n".join(capacity_lines(report))), ("fig", capacity_figure(report))]
    for g in report["per_gpu"]:
        rows = [(f"{r['gpus']}{' (pick)' if g['pick'] is r else ''}", _fmt(r["wall_days"], ".1f"),
                 _fmt(r["gpu_hours"], ",.0f"), _fmt(r["cost"], ",.0f"), _fmt(r["energy_kwh"], ",.0f"),
                 f"{r['goodput']:.1%}", f"{r['mfu']:.1%}", plan_text(r["plan"])) for r in g["rows"]]
        blocks += [("h2", g["gpu"]), ("table", (["GPUs", "days", "GPU-hours", "cost $", "kWh", "goodput", "MFU",
                                                  "plan"], rows))]
    return html_page(f"Capacity plan: {report['model']}, {report['tokens']:.3g} tokens", blocks, plotlyjs)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)
