"""Figures of the emergence grids (``analysis.train.sweep``): a statistic against a grid field, with its
spread over seeds, and Sink_1 through training. Each function returns a matplotlib Figure."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import matplotlib.pyplot as plt
import pandas as pd

from analysis.figures.layout import returns_figure
from analysis.train.sweep import grid_label


@returns_figure
def grid_figure(
    runs: pd.DataFrame,
    field: str,
    *,
    metrics: Sequence[str] = ("sink_1",),
    paper: Optional[Mapping] = None,
    title: str = "",
    labels: Optional[Mapping[str, str]] = None,
):
    """Each metric (percent) against the values of ``field``: one dot per seed, the mean as a bar, and the
    paper's figure for the same value beside it (``paper``: {value: percent}) where given.

    Parameters
    ----------
    runs : pandas.DataFrame
        One row per finished run (``analysis.train.sweep.load_sweep``).
    field : str
        The configuration field varied.
    metrics : sequence of str
        The metrics drawn, one panel each.
    paper : mapping, optional
        {value: percent} of the paper's figure.
    title : str
    labels : mapping of str to str, optional
        Names for the values of ``field``.
    """
    values = list(dict.fromkeys(runs[field].tolist()))
    fig, axes = plt.subplots(
        1, len(metrics), figsize=(max(4.0, 0.75 * len(values) + 2) * len(metrics), 3.6), squeeze=False
    )
    width = 0.38 if paper else 0.7
    for ax, metric in zip(axes[0], metrics):
        for i, v in enumerate(values):
            rows = runs[runs[field].astype(str) == str(v)][metric].astype(float)
            ax.bar(i, rows.mean(), width, color="tab:blue", alpha=0.55, label="ours (mean)" if i == 0 else None)
            ax.scatter(
                [i] * len(rows), rows, color="tab:blue", s=12, zorder=3, label="ours (each seed)" if i == 0 else None
            )
            if paper and str(v) in {str(k) for k in paper}:
                p = {str(k): x for k, x in paper.items()}[str(v)]
                ax.bar(
                    i + width,
                    p,
                    width,
                    color="tab:gray",
                    alpha=0.6,
                    label="Gu et al. (60M)" if "Gu et al. (60M)" not in ax.get_legend_handles_labels()[1] else None,
                )
        ax.set_xticks(
            range(len(values)),
            [grid_label(v) for v in values],
            rotation=30 if len(values) > 5 else 0,
            ha="right" if len(values) > 5 else "center",
        )
        ax.set(xlabel=field.replace("_", " "), ylabel=(labels or {}).get(metric, metric.replace("_", " ")))
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title or f"{', '.join(metrics)} against {field}")
    fig.tight_layout()
    return fig


@returns_figure
def curves_figure(curves: pd.DataFrame, *, field: Optional[str] = None, metric: str = "sink_1", title: str = ""):
    """``metric`` through training (mean over seeds, shaded min-max), one line per value of ``field``.

    Parameters
    ----------
    curves : pandas.DataFrame
        One row per (run, step): the training log.
    field : str, optional
        The configuration field whose values are separate lines.
    metric : str
        The metric drawn.
    title : str
    """
    fig, ax = plt.subplots(figsize=(6, 3.6))
    groups = [(None, curves)] if field is None else list(curves.groupby(field, sort=False, dropna=False))
    for value, df in groups:
        g = df.groupby("step")[metric].agg(["mean", "min", "max"])
        label = "all" if field is None else f"{field.replace('_', ' ')} {grid_label(value)}"
        ax.plot(g.index, g["mean"], label=label)
        ax.fill_between(g.index, g["min"], g["max"], alpha=0.2)
    ax.set(xlabel="training step", ylabel=metric.replace("_", " "))
    ax.legend(fontsize=7)
    ax.set_title(title or f"{metric} through training")
    fig.tight_layout()
    return fig
