"""Figures for the sink's kind (``analysis.causal.sink_kind``): the kinds per layer, and the traces that call them."""

from __future__ import annotations

import numpy as np

from analysis.causal.sink_kind import KINDS, SinkKinds
from analysis.core.defaults import KIND_BROADCAST_PR, KIND_VALUE_RATIO
from analysis.figures.layout import flat_bars, one_axes, set_log_scale, set_title

KIND_COLORS = {"nop": "C0", "broadcast": "C3", "mixed": "0.6"}


@one_axes((6.5, 3.2), left=0.7)
def plot_sink_kinds(res: SinkKinds, *, ax=None):
    """Per layer, the sink heads stacked by kind: nop, broadcast, mixed.

    Parameters
    ----------
    res : SinkKinds
    """
    t = res.layer_table()
    x = t["layer"].to_numpy()
    top = np.zeros(len(t))
    tops = []
    for k in KINDS:  # each kind's bar from 0 to its stack's top, drawn from the tallest down: a stacked bar
        top = top + t[k].to_numpy()
        tops.append((k, top.copy()))
    for k, h in reversed(tops):
        flat_bars(ax, x, h, color=KIND_COLORS[k], label=k)
    ax.set(xlabel="layer", ylabel="sink heads", ylim=(0, max(1, int(t["n_heads"].max()))))
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], fontsize=8)
    s = res.shares()
    set_title(ax, f"Sink heads by kind ({s['n_sink_heads']} sink heads, alpha_1 > {res.eps})")


@one_axes((5.2, 3.8), left=0.7, bottom=0.65)
def plot_kind_traces(res: SinkKinds, *, ax=None):
    """Each sink head at its nop trace (|v_1| / mean |v_j|, log) and its broadcast trace (the participation ratio of
    its outputs over sinking queries within a sequence), coloured by kind, with the thresholds.

    Parameters
    ----------
    res : SinkKinds
    """
    t = res.heads[lambda d: d["sink"]]
    for k in KINDS:
        sub = t[t["sink_kind"] == k]
        ax.scatter(sub["value_ratio"], sub["pr"], s=18, color=KIND_COLORS[k], label=f"{k} ({len(sub)})")
    set_log_scale(ax, which="x")
    ax.axvline(KIND_VALUE_RATIO, color="grey", lw=0.5)
    ax.axhline(KIND_BROADCAST_PR, color="grey", lw=0.5)
    ax.set(xlabel="$|v_1|$ / mean $|v_j|$ (j>1)", ylabel="participation ratio within a sequence")
    set_title(ax, "The traces of each sink head", fontsize=9)
    ax.legend(fontsize=8)
