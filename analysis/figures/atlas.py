"""Figures of the atlas (``analysis.report.atlas``): Sink_1 by model and input kind, the largest activation by model."""

from __future__ import annotations

from pathlib import PurePath

import numpy as np
import pandas as pd

from analysis.figures.layout import new_or_given, place_axes, returns_figure, set_log_scale, set_title

KIND_COLOURS = {"natural": "#4c72b0", "random": "#dd8452", "repeated": "#55a868"}


def _short_name(name: str) -> str:
    """A model's label on a figure: the last part of its path or hub id."""
    return PurePath(str(name).rstrip("/\\")).name or str(name)


def _rows(table: pd.DataFrame, ax, height: float):
    """The models with a result (the first on top), the axes, whether its figure is new, and the models' y positions."""
    ok = table[table["status"] == "ok"]
    if ok.empty:
        raise ValueError("no model of the atlas has a result yet: nothing to draw.")
    _, ax, own = new_or_given(ax, (6.5, 0.9 + height * len(ok)))
    return ok.iloc[::-1], ax, own, np.arange(len(ok))


def _finish(ax, rows: pd.DataFrame, own: bool, *, xlabel: str, title: str):
    """The models named on the y axis, the legend, the title and the margins."""
    ax.set_yticks(np.arange(len(rows)), [_short_name(m) for m in rows["model"]])
    ax.set_xlabel(xlabel)
    ax.legend(loc="lower right", fontsize=7, frameon=False)
    set_title(ax, title)
    return place_axes(ax.figure, left=1.7, bottom=0.5, top=0.3, own=own)


@returns_figure
def plot_atlas_sink(table: pd.DataFrame, *, ax=None):
    """Sink_1 (%) by model and input kind (horizontal bars), the paper's figure as a black tick where it gives one.

    Parameters
    ----------
    table : pandas.DataFrame
        ``analysis.report.atlas.atlas_table``: ``model``, ``status``, ``sink1_<kind>``, ``paper_<kind>``.
    """
    rows, ax, own, y = _rows(table, ax, 0.5)
    h = 0.8 / len(KIND_COLOURS)
    for i, (kind, colour) in enumerate(KIND_COLOURS.items()):
        at = y + (1 - i) * h
        bars = ax.barh(at, rows[f"sink1_{kind}"].astype(float), height=h, color=colour, label=kind)
        ax.bar_label(bars, fmt="%.1f", fontsize=6, padding=1)
        paper = rows[f"paper_{kind}"].astype(float).to_numpy()
        has = ~np.isnan(paper)
        if has.any():
            ax.scatter(
                paper[has],
                at[has],
                marker="|",
                s=120,
                color="black",
                zorder=3,
                label="Gu et al. (published)" if i == 0 else None,
            )
    ax.set_xlim(0, 108)  # room for the label of a bar at 100
    ax.set_xticks(range(0, 101, 20))
    return _finish(ax, rows, own, xlabel="Sink$_1$ (%)", title="Sink on the first token, by model and input")


@returns_figure
def plot_atlas_activation(table: pd.DataFrame, *, ax=None):
    """The largest activation (mean top-1 |a|) and the median |a| at its layer, by model, on a log scale.

    Parameters
    ----------
    table : pandas.DataFrame
        ``analysis.report.atlas.atlas_table``: ``model``, ``status``, ``largest_abs``, ``largest_median``,
        ``largest_layer``, ``largest_dim``, ``largest_massive``.
    """
    rows, ax, own, y = _rows(table, ax, 0.4)
    big, med = rows["largest_abs"].astype(float).to_numpy(), rows["largest_median"].astype(float).to_numpy()
    massive = rows["largest_massive"].astype(bool).to_numpy()
    lo = max(float(np.nanmin(med)) / 3, 1e-3)  # the bars start at the axis' left end (a log axis has no 0)
    ax.barh(y, big - lo, height=0.6, color=np.where(massive, "#c44e52", "#8c8c8c"), left=lo)
    ax.scatter(med, y, marker="o", s=18, color="black", zorder=3, label="median |a| at that layer")
    for yi, (b, l, d) in enumerate(zip(big, rows["largest_layer"], rows["largest_dim"])):
        ax.annotate(f" L{int(l)} d{int(d)}", (b, yi), va="center", fontsize=7)
    set_log_scale(ax, which="x")
    ax.set_xlim(lo, float(np.nanmax(big)) * 8)
    return _finish(
        ax,
        rows,
        own,
        xlabel="|activation| (red: massive by the criterion; grey: not)",
        title="Largest activation of the residual stream (natural text)",
    )


SINK_KIND_COLOURS = {"nop": "C0", "broadcast": "C3", "mixed": "0.6"}


@returns_figure
def plot_atlas_kinds(table: pd.DataFrame, *, ax=None):
    """The share of each model's sink heads by kind (nop, broadcast, mixed), stacked horizontal bars, with the number
    of sink heads; a model without a sink head (or without kinds) has no bar.

    Parameters
    ----------
    table : pandas.DataFrame
        ``analysis.report.atlas.atlas_table``: ``model``, ``status``, ``kinds_nop``, ``kinds_broadcast``,
        ``kinds_mixed``, ``kinds_n_sink_heads``.
    """
    rows, ax, own, y = _rows(table, ax, 0.3)
    left = np.zeros(len(rows))
    for kind, colour in SINK_KIND_COLOURS.items():
        share = rows[f"kinds_{kind}"].astype(float).fillna(0.0).to_numpy() * 100
        ax.barh(y, share, height=0.6, left=left, color=colour, label=kind)
        left += share
    for yi, n in zip(y, rows["kinds_n_sink_heads"]):
        ax.annotate(" -" if pd.isna(n) else f" {int(n)}", (100, yi), va="center", fontsize=7)
    ax.set_xlim(0, 112)  # room for the number of sink heads
    ax.set_xticks(range(0, 101, 20))
    return _finish(
        ax,
        rows,
        own,
        xlabel="share of sink heads (%); right: their number",
        title="The sink's kind, by model (natural text)",
    )
