"""Figures for norm-gain tracing (``analysis.chain.norm_gain``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from analysis.figures.layout import one_axes, place_axes, returns_figure, set_log_scale, set_title
from analysis.chain.norm_gain import NormGainTrace


@one_axes((5.5, 3.2), left=0.7, bottom=0.55)
def plot_stage_shares(trace: NormGainTrace, *, ax=None):
    """Share of |v|^2 held by the spike dims at each stage of the key path, first token against ordinary tokens.

    Parameters
    ----------
    trace : NormGainTrace
    """
    st = trace.stages
    x = np.arange(len(st))
    b1 = ax.bar(x - 0.2, st["first_share"], 0.4, label="first token", color="#c44e52")
    b2 = ax.bar(x + 0.2, st["other_share"].fillna(0), 0.4, label="ordinary tokens", color="#4c72b0")
    ax.bar_label(b1, fmt="%.2f", fontsize=7)
    ax.bar_label(b2, labels=[("" if np.isnan(v) else f"{v:.2f}") for v in st["other_share"]], fontsize=7)
    ax.set_xticks(x, ["h (resid)", "norm(h)", "g * norm(h)", "k_1\n(along k_1^S)"])
    ax.set(ylim=(0, 1.1), ylabel="share of |.|^2 in spike dims")
    set_title(ax, f"Layer {trace.layer}: spike dims {trace.spike_dims}")
    ax.legend(fontsize=8)


@returns_figure
def plot_gain_profile(trace: NormGainTrace, *, top: int = 3):
    """Top: the first token's mean normalised vector |n_1,d| against ordinary tokens' mean |n_t,d|.
    Bottom: the ln1 gain g_d, spike dims marked.

    Parameters
    ----------
    trace : NormGainTrace
    top : int
        The dims with the largest first-token |n_1,d| labelled.
    """
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 4.4), sharex=True)
    D = trace.gain_vector.shape[0]
    x = np.arange(D)
    a1.plot(x, trace.first_normalised_mean.abs().numpy(), color="#c44e52", lw=0.8, label="first token |n_1,d|")
    a1.plot(x, trace.other_normalised_abs.numpy(), color="#4c72b0", lw=0.8, label="ordinary tokens mean |n_t,d|")
    set_log_scale(a1)
    a1.set_ylabel("|normalised|")
    a1.legend(fontsize=7, loc="lower left", ncol=2)
    a1.set_ylim(top=float(max(trace.first_normalised_mean.abs().max(), trace.other_normalised_abs.max())) * 6)
    a2.plot(x, trace.gain_vector.numpy(), color="#555555", lw=0.6)
    S = list(trace.spike_dims)
    if S:
        a1.scatter(S, trace.first_normalised_mean.abs()[S].numpy(), color="#c44e52", s=18, zorder=3)
        a1.scatter(S, trace.other_normalised_abs[S].numpy(), color="#4c72b0", s=18, zorder=3)
        a2.scatter(S, trace.gain_vector[S].numpy(), color="#c44e52", s=18, zorder=3)
    for d in S:  # each label on the side of its point towards the middle, so it stays inside the axes
        left = d > D / 2
        style = dict(textcoords="offset points", fontsize=8, color="#c44e52", ha="right" if left else "left")
        dx = -6 if left else 6
        a1.annotate(
            f"dim {d}: {float(trace.first_normalised_mean[d]):+.1f}",
            (d, float(trace.first_normalised_mean[d].abs())),
            xytext=(dx, -4),
            **style,
        )
        a2.annotate(
            f"dim {d}: g={float(trace.gain_vector[d]):.3f}", (d, float(trace.gain_vector[d])), xytext=(dx, 6), **style
        )
    a2.set(ylabel="ln1 gain g", xlabel="residual dimension")
    set_title(a1, f"Layer {trace.layer}: what the norm and its gain do to the first token")
    return place_axes(fig, left=0.8, hspace=0.25)


@one_axes((6.5, 3.2), left=0.7, bottom=0.5)
def plot_head_attribution(trace: NormGainTrace, *, ax=None):
    """Per head: alpha_1 as is, with k_1 rebuilt from the spike dims alone, and with them removed from k_1.

    Parameters
    ----------
    trace : NormGainTrace
    """
    h = trace.heads
    x = np.arange(len(h))
    ax.bar(x - 0.27, h["alpha_1"], 0.27, label="k_1 (model)", color="#555555")
    ax.bar(x, h["alpha_1_spike_only"].fillna(0), 0.27, label="k_1^S: spike dims only", color="#c44e52")
    ax.bar(x + 0.27, h["alpha_1_no_spike"].fillna(0), 0.27, label="k_1 - k_1^S", color="#4c72b0")
    ax.set_xticks(x, [f"h{i}\nkv{k}" for i, k in zip(h["head"], h["kv_head"])], fontsize=7)
    ax.set(ylabel="alpha_1", ylim=(0, 1.05))
    set_title(ax, f"Layer {trace.layer}: attention on the first key, by key")
    ax.legend(fontsize=7)


@one_axes((5.5, 3.2), left=0.7)
def plot_constancy(traces: dict[str, NormGainTrace] | NormGainTrace, *, ax=None):
    """Mean pairwise cosine across inputs of the first token's vectors (h, norm(h), g*norm(h), k_1) against
    ordinary tokens' normalised vectors, for one or several traces.

    Parameters
    ----------
    traces : NormGainTrace or dict of str to NormGainTrace
        One trace, or several by name.
    """
    if isinstance(traces, NormGainTrace):
        traces = {f"layer {traces.layer}": traces}
    labels = ["first: h", "first: norm(h)", "first: g*norm(h)", "first: k_1", "ordinary: norm(h)"]
    w = 0.8 / len(traces)
    for i, (name, t) in enumerate(traces.items()):
        c = t.constancy
        vals = [
            c["cos_first_resid"],
            c["cos_first_normalised"],
            c["cos_first_gain"],
            float(np.mean(c["cos_first_key"])),
            c["cos_other_normalised"],
        ]
        ax.bar(np.arange(5) + (i - (len(traces) - 1) / 2) * w, vals, w, label=name)
    ax.set_xticks(range(5), labels, fontsize=7, rotation=15)
    ax.set(ylim=(min(0, ax.get_ylim()[0]), 1.05), ylabel="mean cosine across inputs")
    ax.legend(fontsize=7)
    set_title(ax, "How constant is the first token?")
