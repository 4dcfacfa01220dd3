"""Figures for massive activations (``analysis.chain.massive``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LogNorm

from analysis.figures.layout import log_axis_ticks, one_axes, place_axes, returns_figure, set_log_scale, set_title
from analysis.chain.activation_map import ActivationMap
from analysis.chain.massive import MassiveActivations


@one_axes((6.5, 3.4), left=0.8)
def plot_top_activations(result: MassiveActivations, *, ax=None, title: str | None = None):
    """Top-1/2/3 |activation| and the median per layer (means over samples), log scale (Sun et al., Fig. 1).

    Parameters
    ----------
    result : MassiveActivations
    title : str, optional
        The axes' title.
    """
    df = result.per_layer
    for k, c in zip(range(1, result.top_k + 1), ["#c44e52", "#dd8452", "#ccb974", "#8c8c8c"]):
        ax.plot(df["layer"], df[f"top{k}"], marker="o", ms=3, color=c, label=f"top {k}")
    ax.plot(df["layer"], df["median"], marker="s", ms=3, color="#4c72b0", label="median")
    ax.axhline(result.abs_threshold, color="grey", ls=":", lw=0.8)
    set_log_scale(ax)
    ax.set(xlabel=f"layer ({result.hook})", ylabel="|activation|")
    set_title(ax, title or "Largest activations per layer" + (f" ({result.kind})" if result.kind else ""))
    ax.legend(fontsize=8, ncol=2)


@one_axes((8, 4.0), left=1.45, top=1.15)  # left: position labels of up to 18 characters
def plot_activation_map(amap: ActivationMap, *, n_positions: int | None = None, ax=None, label_top: int = 3):
    """|h| over positions x dims at one layer for one sequence, log colour scale; the top dims are labelled.

    Parameters
    ----------
    amap : ActivationMap
        ``values`` of shape (T, D).
    n_positions : int, optional
        The first positions shown (default all).
    label_top : int
        The largest activations labelled with their dim.
    """
    v = amap.values.numpy()
    if n_positions is not None:
        v = v[:n_positions]
    im = ax.imshow(
        np.maximum(v, 1e-3),
        aspect="auto",
        cmap="magma",
        norm=LogNorm(vmin=max(1e-2, float(np.median(v)) / 10), vmax=v.max()),
        interpolation="nearest",
    )
    ax.set(xlabel="residual dimension", ylabel="position")
    step = max(1, v.shape[0] // 12)
    ax.set_yticks(range(0, v.shape[0], step))
    ax.set_yticklabels([f"{i} {amap.tokens[i]!r}"[:18] for i in range(0, v.shape[0], step)], fontsize=7)
    top = amap.top(label_top * 4)
    seen = set()
    for r in top.itertuples():
        if r.dim in seen or len(seen) >= label_top or (n_positions is not None and r.position >= n_positions):
            continue
        seen.add(r.dim)
        ax.annotate(
            f"dim {r.dim}",
            (r.dim, r.position),
            xytext=(10, 14 + 11 * len(seen)),
            textcoords="offset points",
            color="#00b3b3",
            fontsize=8,
            annotation_clip=False,
            arrowprops=dict(arrowstyle="-", color="#00b3b3", lw=0.6),
        )
    log_axis_ticks(ax.figure.colorbar(im, ax=ax, label="|h|").long_axis)
    set_title(ax, f"|h| at layer {amap.layer} ({amap.hook})", pad=60)  # above the labels of the top dims


@returns_figure
def plot_spike_dims_by_kind(
    results: dict[str, MassiveActivations], *, dims: list[int] | None = None, max_dims: int = 4
):
    """Per input kind: the first token's mean |h_d| across layers for the spike dims (solid), and the mean
    over samples of the largest |h_d| at any other position (dashed).

    Parameters
    ----------
    results : dict of str to MassiveActivations
        One result per input kind.
    dims : list of int, optional
        The dims drawn (default: the spike dims with the largest first-token |h_d|, else each
        kind's largest first-token dims).
    max_dims : int
        At most this many dims.
    """
    if dims is None:
        score: dict[int, float] = {}
        for r in results.values():
            for d in r.all_spike_dims:
                score[d] = max(score.get(d, 0.0), float(r.first_abs[:, d].max()))
        if not score:  # no spikes anywhere: show each kind's largest first-token dims
            for r in results.values():
                for d in r.first_abs.max(0).values.topk(2).indices.tolist():
                    score[d] = max(score.get(d, 0.0), float(r.first_abs[:, d].max()))
        dims = sorted(score, key=score.get, reverse=True)[:max_dims]
    kinds = list(results)
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.6 * len(kinds), 3.2), sharey=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, kind in zip(axes[0], kinds):
        r = results[kind]
        for i, d in enumerate(dims):
            c = colors[i % len(colors)]
            ax.plot(r.layers, r.first_abs[:, d].numpy(), color=c, marker="o", ms=2.5, label=f"dim {d}, first token")
            ax.plot(
                r.layers, r.other_abs_max[:, d].numpy(), color=c, ls="--", lw=1, label=f"dim {d}, other tokens (max)"
            )
        set_log_scale(ax)
        spikes = r.all_spike_dims
        set_title(ax, f"{kind}: spike dims {spikes[:6]}{'...' if len(spikes) > 6 else ''}", fontsize=9)
        ax.set_xlabel("layer")
    axes[0][0].set_ylabel("|h_d| (mean over samples)")
    axes[0][-1].legend(fontsize=6, loc="lower right")
    return place_axes(fig, left=0.8, wspace=0.25)
