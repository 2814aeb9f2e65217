"""Plots of a study with Optuna's own `optuna.visualization` (plotly), saved as HTML next to the report."""
from __future__ import annotations

import os

import optuna

from .objectives import OBJECTIVES

#: plot_pareto_front draws two or three objectives
_MAX_PLOTTED = 3


def pareto_figure(study: optuna.Study, objectives, title: str):
    """Optuna's Pareto-front plot of the study (the first three objectives), infeasible trials greyed."""
    from optuna.visualization import plot_pareto_front

    names = [OBJECTIVES[o].label for o in objectives][:_MAX_PLOTTED]
    kwargs = {}
    if len(objectives) > _MAX_PLOTTED:
        kwargs["targets"] = lambda t: tuple(t.values[:_MAX_PLOTTED])
    fig = plot_pareto_front(study, target_names=names, **kwargs)
    fig.update_layout(title=title)
    return fig


def save_pareto_html(study: optuna.Study, objectives, title: str, path: str) -> str:
    """Write the Pareto-front plot to `path` (HTML; plotly.js from its CDN keeps the file small)."""
    fig = pareto_figure(study, objectives, title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.write_html(path, include_plotlyjs="cdn", full_html=True)
    return path
