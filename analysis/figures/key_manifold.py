"""Figures for the first-key manifold (``analysis.chain.key_manifold``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from analysis.core.defaults import SINK_MIN_ALPHA
from analysis.figures.layout import flat_bars, place_axes, returns_figure, set_title
from analysis.chain.key_manifold import KeyManifold


def _head_label(km: KeyManifold, layer: int, kv_head: int) -> str:
    row = km.head(layer, kv_head) if layer in km.layers and kv_head in km.kv_heads else None
    a = f", $\\alpha_1$ max {row.alpha_1_max:.2f}" if row is not None else ""
    kind = "" if row is None else (" (sink)" if row.alpha_1_max > SINK_MIN_ALPHA else " (no sink)")
    return f"layer {layer}, KV head {kv_head}{a}{kind}"


VIEWS = ("pca", "axis")


@returns_figure
def plot_key_pca(
    km: KeyManifold, *, heads: list[tuple[int, int]] | None = None, views=VIEWS, max_sequences: int | None = None
):
    """Every key of each scatter head (default: all in ``km.scatter``, e.g. a sink and a non-sink head) in 2-D,
    coloured by position, the first keys marked with red crosses. One column per head, one row per view:
    ``"pca"``, a PCA fit on all keys; ``"axis"``, the first-key axis (the line from the other keys' mean to the
    first keys' mean) against the other keys' top orthogonal principal direction.

    Parameters
    ----------
    km : KeyManifold
    heads : list of (int, int), optional
        (layer, KV head) pairs among ``km.scatter`` (default all).
    views : sequence of str
        "pca" and / or "axis".
    max_sequences : int, optional
        Draw the keys of the first sequences only.
    """
    heads = list(km.scatter) if heads is None else [tuple(h) for h in heads]
    missing = [h for h in heads if h not in km.scatter]
    if missing or not heads:
        raise ValueError(
            f"no scatter coordinates for {missing or 'any head'}; run first_key_manifold(..., scatter_heads=[(layer, kv_head), ...]) "
            f"(kept: {list(km.scatter)})."
        )
    views = [views] if isinstance(views, str) else list(views)
    bad = [v for v in views if v not in VIEWS]
    if bad or not views:
        raise ValueError(f"views must be among {VIEWS}; got {views}.")
    fig, axes = plt.subplots(len(views), len(heads), figsize=(4.8 * len(heads), 3.8 * len(views)), squeeze=False)
    for col, (l, h) in enumerate(heads):
        s, head_name = km.scatter[(l, h)], _head_label(km, l, h)
        for row, view in enumerate(views):
            ax = axes[row, col]
            c = (s["coords"] if view == "pca" else s["axis_coords"])[:max_sequences]  # (N, T, 2)
            N, T = c.shape[:2]
            pos = np.broadcast_to(np.arange(1, T + 1), (N, T))
            sc = ax.scatter(
                c[:, 1:, 0].ravel(), c[:, 1:, 1].ravel(), c=pos[:, 1:].ravel(), cmap="viridis", s=5, alpha=0.5, lw=0
            )
            ax.scatter(c[:, 0, 0], c[:, 0, 1], marker="x", c="red", s=40, lw=1.5, label="first keys $k_1$")
            if view == "pca":
                ax.set(xlabel=f"PC1 ({100 * s['evr'][0]:.0f}% var.)", ylabel=f"PC2 ({100 * s['evr'][1]:.0f}% var.)")
                set_title(ax, head_name + "\nPCA of all keys", fontsize=9)
            else:
                ax.set_xlabel(f"first-key axis (k$_1$ at {s['axis_z']:.1f} sd of the others)")
                ax.set_ylabel("top orthogonal PC of $k_{j>1}$")
                set_title(ax, head_name + "\nfirst-key axis view", fontsize=9)
            ax.legend(loc="best", fontsize=8)
            fig.colorbar(sc, ax=ax, label="key position")
    return place_axes(fig, left=0.85, right=0.3, top=0.55, wspace=1.1, hspace=0.95)


@returns_figure
def plot_manifold_summary(km: KeyManifold):
    """Per layer (mean over KV heads), with mean alpha_1 as grey bars behind:
    (a) relative residual of k_1 off the other keys' principal subspace vs the other keys' own;
    (b) cosine between first keys of different inputs vs between keys at position T/2;
    (c) cos(q_t, k_1) vs cos(q_t, k_j);  (d) components for 90% variance: first keys vs keys at T/2.

    Parameters
    ----------
    km : KeyManifold
    """
    t = km.table.groupby("layer").mean(numeric_only=True)
    x = t.index.to_numpy()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.2), sharex=True)
    panels = [
        (
            axes[0, 0],
            [("resid_first", "$k_1$"), ("resid_other", "$k_j$, j>1 (RMS)")],
            "relative residual off\nthe top-r subspace of $k_{j>1}$",
        ),
        (
            axes[0, 1],
            [
                ("cos_first_pair", "$k_1$ of different inputs"),
                ("cos_mid_pair", f"$k_{{{km.T // 2 + 1}}}$ of different inputs"),
            ],
            "mean pairwise cosine",
        ),
        (axes[1, 0], [("cos_q_k1", "cos($q_t$, $k_1$)"), ("cos_q_kj", "cos($q_t$, $k_j$), 1<j<=t")], "mean cosine"),
    ]
    for ax, series, ylabel in panels:
        for col, lab in series:
            ax.plot(x, t[col], marker="o", ms=3, label=lab)
        flat_bars(ax, x, t["alpha_1_mean"], color="0.88", label="$\\alpha_1$ (mean)")  # behind the lines (zorder 1)
        ax.set_ylabel(ylabel)
        ax.axhline(0, color="grey", lw=0.5)
        ax.legend(fontsize=7, loc="best")
    ax = axes[1, 1]
    ax.plot(x, t["first_n90"], marker="o", ms=3, label="first keys")
    ax.plot(x, t["mid_n90"], marker="o", ms=3, label=f"keys at position {km.T // 2 + 1}")
    ax.set_ylabel(f"PCs for 90% variance\n(N={km.n_samples} keys each)")
    ax.legend(fontsize=7)
    for a in axes[1]:
        a.set_xlabel("layer")
    return place_axes(fig, left=0.95, top=0.15, wspace=1.0, hspace=0.25)
