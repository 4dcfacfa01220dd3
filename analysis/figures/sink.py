"""Figures for the sink metric and QK angles."""

from __future__ import annotations

import matplotlib.pyplot as plt

from analysis.core.docs import parameters_from
from analysis.figures.layout import one_axes, place_axes, returns_figure, set_title
from analysis.chain.qk import QKAngles
from analysis.sinks.metric import SinkResult, sink_table


@parameters_from(sink_table)
@one_axes((4.5, 3.2), left=0.8, bottom=0.4)
def plot_sink_rates(results: dict[str, SinkResult], *, k: int = 1, ax=None):
    """Bar chart of Sink_k (%) per input kind.

    Parameters
    ----------
    results, k
        As in :func:`sink_table`.
    """
    names = list(results)
    vals = [results[n].sink_rate(k) for n in names]
    bars = ax.bar(names, vals, color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"][: len(names)])
    ax.bar_label(bars, fmt="%.1f")
    eps = next(iter(results.values())).eps
    ax.set(ylabel=f"Sink$_{k}^{{\\epsilon={eps}}}$ (%)", ylim=(0, 105))
    set_title(ax, f"Sink on token {k}")


@one_axes((4.5, 6), left=0.8, right=0.4)
def plot_head_alpha(result: SinkResult, *, k: int = 1, ax=None):
    """Heatmap of mean alpha_k per (layer, head).

    Parameters
    ----------
    result : SinkResult
        alpha of shape (N, L, H, k_max).
    k : int
        The key position (1: the first token).
    """
    a = result.per_head_alpha[..., k - 1].numpy()
    im = ax.imshow(a, aspect="auto", cmap="viridis", vmin=0, vmax=1, origin="lower")
    if result.layers != list(range(len(result.layers))):  # a hybrid: rows are its attention layers, true indices
        ax.set_yticks(range(len(result.layers)), [str(l) for l in result.layers])
    ax.set(xlabel="head", ylabel="layer")
    set_title(ax, f"mean $\\alpha_{k}$ per head" + (f" ({result.kind})" if result.kind else ""))
    ax.figure.colorbar(im, ax=ax, label=f"$\\alpha_{k}$")


@parameters_from(plot_sink_rates)
@one_axes((6, 3.2), top=0.15)
def plot_sink_by_layer(results: dict[str, SinkResult], *, k: int = 1, ax=None):
    """Sink_k (%) per layer for each input kind.

    Parameters
    ----------
    results, k
        As in :func:`plot_sink_rates`.
    """
    for name, res in results.items():
        df = res.per_layer(k)
        ax.plot(df["layer"], df[f"sink_{k}_pct"], marker="o", ms=3, label=name)
    ax.set(xlabel="layer", ylabel=f"Sink$_{k}$ (%)")
    ax.legend()


@returns_figure
def plot_qk_angles(angles: QKAngles, *, head: tuple[int, int] | None = None):
    """Left: per layer, mean cos(q_t, k_1) and cos(q_t, k_j>1) (averaged over heads), with key norms.
    Right: the two cosine distributions for one head (default: the head with the largest gap).

    Parameters
    ----------
    angles : QKAngles
    head : tuple of (int, int), optional
        (true layer, head) of the right panel.
    """
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    layers = angles.layers
    ax.plot(layers, angles.cos_first.mean(-1), marker="o", ms=3, label="cos(q$_t$, k$_1$)")
    ax.plot(layers, angles.cos_other.mean(-1), marker="o", ms=3, label="cos(q$_t$, k$_j$), j>1")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set(xlabel="layer", ylabel="mean cosine")
    axn = ax.twinx()
    axn.plot(layers, angles.k_first_norm.mean(-1), ls="--", color="C2", label="|k$_1$|")
    axn.plot(layers, angles.k_other_norm.mean(-1), ls="--", color="C3", label="|k$_j$|")
    axn.set_ylabel("key norm (dashed)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = axn.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper right")
    if head is None:
        gap = angles.cos_first - angles.cos_other
        li, h = divmod(int(gap.argmax()), gap.shape[1])
    else:
        li, h = layers.index(head[0]), head[1]
    centers = ((angles.bin_edges[1:] + angles.bin_edges[:-1]) / 2).numpy()
    w = float(angles.bin_edges[1] - angles.bin_edges[0])
    ax2.bar(centers, angles.hist_other[li, h], width=w, alpha=0.6, label="k$_j$, j>1")
    ax2.bar(centers, angles.hist_first[li, h], width=w, alpha=0.6, label="k$_1$")
    ax2.set(xlabel=f"cos(q$_t$, k) in layer {layers[li]}, head {h}", ylabel="share of (query, key) pairs")
    ax2.legend()
    return place_axes(fig, right=0.15, top=0.15, wspace=1.25)
