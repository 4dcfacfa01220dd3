"""Figures for value norms (``analysis.chain.values``)."""

from __future__ import annotations

import numpy as np

from analysis.figures.layout import one_axes, set_log_scale, set_title
from analysis.chain.values import ValueNorms


@one_axes((6.5, 3.4), left=0.8)
def plot_value_norms(vn: ValueNorms, *, ax=None):
    """Per layer: |v_1| and mean |v_j| (j > 1), one point per KV head, lines through the head means.

    Parameters
    ----------
    vn : ValueNorms
    """
    x = np.asarray(vn.layers)
    K = vn.v1_norm.shape[1]
    for vals, label, color in ((vn.v1_norm, "$|v_1|$", "C3"), (vn.vj_norm, "mean $|v_j|$, j>1", "C0")):
        v = vals.numpy()
        ax.scatter(np.repeat(x, K), v.ravel(), s=8, color=color, alpha=0.5, lw=0)
        ax.plot(x, v.mean(1), marker="o", ms=3, color=color, label=label)
    set_log_scale(ax)
    ax.set(xlabel="layer", ylabel="value norm (per KV head)")
    set_title(ax, "First-token value norm against the others")
    ax.legend(fontsize=8)


@one_axes((5.2, 3.8), left=0.7, bottom=0.65)
def plot_value_alpha(vn: ValueNorms, *, reduce: str | None = None, ax=None):
    """Scatter over (layer, KV head): |v_1| / mean |v_j| (log) against alpha_1, coloured by layer.

    Parameters
    ----------
    vn : ValueNorms
    reduce : {"mean", "max"}, optional
        How a KV head's query heads map to one alpha (default ``vn.reduce``).
    """
    t = vn.table(reduce)
    acol = [c for c in t.columns if c.startswith("alpha_1_")][0]
    sc = ax.scatter(t["ratio"], t[acol], c=t["layer"], cmap="viridis", s=18)
    set_log_scale(ax, which="x")
    ax.axvline(1, color="grey", lw=0.5)
    ax.set_xlabel("$|v_1|$ / mean $|v_j|$ (j>1)")
    ax.set_ylabel(f"$\\alpha_1$ ({acol.split('_')[-1]} over the KV head's query heads)")
    c = vn.correlation(reduce)
    if c["pearson_r"] is not None:
        set_title(
            ax, f"Pearson r = {c['pearson_r']:.2f}, Spearman ρ = {c['spearman_rho']:.2f} (n = {c['n']})", fontsize=9
        )
    else:
        set_title(ax, "correlation undefined (constant values)", fontsize=9)
    ax.figure.colorbar(sc, ax=ax, label="layer")


@one_axes((6, 3.2), left=0.8, top=0.15)
def plot_value_profile(vn: ValueNorms, *, layers: list[int] | None = None, ax=None):
    """Mean |v_t| against position t for a few layers (mean over KV heads).

    Parameters
    ----------
    vn : ValueNorms
    layers : list of int, optional
        True layer indices (default: up to five spread over the layers measured).
    """
    if layers is None:
        idx = np.unique(np.linspace(0, len(vn.layers) - 1, min(5, len(vn.layers))).round().astype(int))
        layers = [vn.layers[i] for i in idx]
    bad = [l for l in layers if l not in vn.layers]
    if bad:
        raise ValueError(f"layers {bad} were not analysed; available: {vn.layers}.")
    pos = np.arange(1, vn.T + 1)
    for l in layers:
        ax.plot(pos, vn.v_norm_by_pos[vn.layers.index(l)].mean(0).numpy(), label=f"layer {l}")
    set_log_scale(ax)
    ax.set(xlabel="position t", ylabel="mean $|v_t|$")
    ax.legend(fontsize=7)
