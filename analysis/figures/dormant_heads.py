"""Figures for what a sink does for its head (``analysis.causal.dormant_heads``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LogNorm

from analysis.causal.dormant_result import SIGNAL_WORDS, DormantHeads
from analysis.figures.layout import place_axes, returns_figure, set_log_scale, set_title


def _x_signal(res: DormantHeads) -> str:
    """The attention quantity on the x axis: the slot where there is one, the total weight where no head sinks and
    it varies (sigmoid), else the sink."""
    if res.has_slot:
        return "slot"
    return "mass" if res.has_mass and not len(res.sinking_heads()) else "sink"


@returns_figure
def plot_sink_vs_norm(res: DormantHeads, *, heads: list[tuple[int, int]] | None = None, max_heads: int = 4):
    """One panel per head: each measured (sequence, query) as a point, its attention on the sink (or slot, or total
    weight) against the head's output norm (log), coloured by |loss effect| (gradient x activation, log).

    Parameters
    ----------
    res : DormantHeads
    heads : list of (int, int), optional
        (true layer, head) pairs (default ``res.example_heads(max_heads)``).
    max_heads : int
        At most this many panels.
    """
    heads = heads or res.example_heads(max_heads)
    if not heads:
        raise ValueError("no head to plot: give heads=[(layer, head), ...].")
    sig = _x_signal(res)
    col = {"sink": "sink_attn", "slot": "slot", "mass": "mass"}[sig]
    fig, axes = plt.subplots(1, len(heads), figsize=(2.9 * len(heads) + 0.9, 3.1), squeeze=False)
    effects = np.concatenate([np.abs(res.queries(l, h)["effect"].to_numpy()) for l, h in heads])
    pos = effects[effects > 0]
    norm = (
        LogNorm(vmin=max(float(np.percentile(pos, 2)), 1e-12), vmax=max(float(pos.max()), 1e-11)) if pos.size else None
    )
    sc = None
    for ax, (l, h) in zip(axes[0], heads):
        df = res.queries(l, h)
        y = df["out_norm"].to_numpy()
        floor = max(float(np.min(y[y > 0])) / 2, 1e-12) if (y > 0).any() else 1e-12
        sc = ax.scatter(
            df[col],
            np.maximum(y, floor),
            c=np.maximum(np.abs(df["effect"]), 1e-12),
            norm=norm,
            cmap="viridis",
            s=7,
            lw=0,
            alpha=0.8,
        )
        if sig != "mass":
            ax.axvline(res.eps, color="grey", lw=0.6, ls="--")
        set_log_scale(ax)
        ax.set_xlabel(SIGNAL_WORDS[sig].replace("total attention weight on the input tokens", "total weight"))
        row = res.head_table().set_index(["layer", "head"]).loc[(l, h)]
        rho = row["rho_mass_norm" if sig == "mass" else ("rho_slot_norm" if sig == "slot" else "rho_norm")]
        set_title(ax, f"head {l}.{h}: Spearman ρ = {rho:.2f}", fontsize=9)
    axes[0][0].set_ylabel("|head output| at the query")
    place_axes(fig, left=0.75, bottom=0.6, right=1.2, top=0.35, wspace=0.55)
    if sc is not None and norm is not None:
        fig.colorbar(
            sc, cax=_bar_axes(fig, right=1.2, bottom=0.6, top=0.35), label="|loss effect| (nats), output set to 0"
        )
    return fig


def _bar_axes(fig, *, right: float, bottom: float, top: float, gap: float = 0.15, width: float = 0.14):
    """An axes for a colour bar in the right margin (inches), beside the grid laid out by ``place_axes``."""
    w, h = fig.get_size_inches()
    return fig.add_axes([1 - (right - gap) / w, bottom / h, width / w, 1 - (bottom + top) / h])


@returns_figure
def plot_head_correlations(res: DormantHeads):
    """Per (layer, head): Spearman rho of the sink (slot) attention with the output norm, and with |loss effect|
    under zero and (where computed) mean removal; heads that sink on fewer than ``min_share`` of their queries are
    left blank.

    Parameters
    ----------
    res : DormantHeads
    """
    t = res.head_table()
    sig = "slot" if res.has_slot else "sink"
    p = "slot_" if sig == "slot" else ""
    share = t["slot_share" if sig == "slot" else "sinking_share"].to_numpy()
    panels = [(f"rho_{p}norm", "output norm"), (f"rho_{p}effect", "|effect|, output set to 0")]
    if res.effect_mean is not None:
        panels.append((f"rho_{p}effect_mean", "|effect|, output set to its mean"))
    L, H = len(res.layers), res.n_heads
    height = min(7.0, 1.2 + 0.18 * L) if L > 2 else 2.2
    fig, axes = plt.subplots(1, len(panels), figsize=(2.2 * len(panels) + 1.6, height), squeeze=False)
    im = None
    for ax, (key, label) in zip(axes[0], panels):
        v = np.where(share >= res.min_share, t[key].to_numpy(), np.nan).reshape(L, H)
        im = ax.imshow(v, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, origin="lower", interpolation="nearest")
        ax.set(xlabel="head", xticks=range(H))
        set_title(ax, label, fontsize=9)
        if L <= 4 or res.layers != list(range(L)):
            ax.set_yticks(range(L), [str(l) for l in res.layers])
    axes[0][0].set_ylabel("layer")
    place_axes(fig, left=0.6, bottom=0.55, right=1.15, top=0.3, wspace=0.35)
    fig.colorbar(im, cax=_bar_axes(fig, right=1.15, bottom=0.55, top=0.3), label=f"Spearman ρ with {SIGNAL_WORDS[sig]}")
    return fig
