"""Figures for streaming perplexity (``analysis.streaming.StreamResult``)."""

from __future__ import annotations

import numpy as np

from analysis.figures.layout import one_axes


@one_axes((7.5, 3.6), tight=True)
def plot_log_ppl(result, *, labels=None, bin: int = 32, ax=None):
    """Log-perplexity against position, one line per policy; the dotted line is where token 1 leaves a
    window cache (position window + 1).

    Parameters
    ----------
    result : StreamResult
        A result of ``analysis.streaming.streaming_perplexity``.
    labels : sequence of str, optional
        The policies drawn (default: every full-precision policy).
    bin : int
        Positions averaged per point.
    """
    curve = result.curve(bin)
    labels = labels or [r.policy.label for r in result.runs if not r.policy.bits]
    for label in labels:
        style = dict(ls="--", marker="o", ms=3) if label.startswith("recompute") else dict(lw=1.6)
        ax.plot(curve["position"], curve[label], label=label, **style)
    ax.axvline(result.window + 1, color="grey", ls=":", lw=1)
    ax.text(result.window + 1, ax.get_ylim()[1], " token 1 evicted", va="top", fontsize=8, color="grey")
    ax.set(xlabel="position in the stream", ylabel=f"log-perplexity (mean NLL per {bin} tokens)")
    ax.set_title(f"{result.model}: cache of {result.window} tokens")
    ax.legend(fontsize=8, ncol=2)


@one_axes((7.5, 3.4), tight=True)
def plot_policy_ppl(result, *, column: str = "ppl_past_window", ax=None):
    """Perplexity per policy (log scale), full precision and quantised.

    Parameters
    ----------
    result : StreamResult
        A result of ``analysis.streaming.streaming_perplexity``.
    column : str
        The perplexity column of ``result.table``.
    """
    t = result.table
    colors = [
        "#c44e52"
        if k == "window"
        else "#8172b2"
        if k == "recompute"
        else "#4c72b0"
        if k == "dense"
        else ("#dd8452" if b < 32 else "#55a868")
        for k, b in zip(t["kind"], t["bits"])
    ]
    bars = ax.bar(np.arange(len(t)), t[column], color=colors)
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(np.arange(len(t)), t["policy"], rotation=40, ha="right", fontsize=8)
    ax.set(yscale="log", ylabel=column.replace("_", " "))
    ax.set_title("perplexity per cache policy")
