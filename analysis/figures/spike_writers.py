"""Figures for where the spike comes from (``analysis.chain.spike_writers``, ``analysis.chain.first_token_cause``,
``analysis.causal.writer_cuts``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from analysis.core.docs import parameters_from
from analysis.figures.layout import one_axes, place_axes, returns_figure, set_log_scale, set_title
from analysis.chain.first_token_cause import FirstTokenCause
from analysis.causal.writer_cuts import SpikeCuts
from analysis.chain.spike_writers import SpikeOrigin

_ATTN, _MLP, _VALUE, _OTHER = "#4c72b0", "#c44e52", "#222222", "#8c8c8c"


def _main_dim(origin: SpikeOrigin, dim: int | None) -> int:
    if dim is not None:
        return int(dim)
    if not origin.dims:
        raise ValueError("the spike origin traced no dimension (the first token carries no spike): nothing to plot.")
    return max(origin.dims, key=lambda d: float(origin.values(d).abs().max()))


@one_axes((9, 3.6), left=0.8)
def plot_spike_path(origin: SpikeOrigin, *, dim: int | None = None, ax=None):
    """The first token's value of ``dim`` entering each block (line; the other tokens' largest |value| dashed) with
    each block's attention and MLP writes on it as bars, on a symmetric log axis; writers and erasers labelled.

    Parameters
    ----------
    origin : SpikeOrigin
    dim : int, optional
        The spike dimension (default: the one with the largest first-token value).
    """
    d = _main_dim(origin, dim)
    t = origin.block_table(d)
    L = origin.n_layers
    x = np.arange(L + 1)
    ax.bar(x[:L] - 0.2, t["attn_first"][:L], 0.4, color=_ATTN, label="attention write")
    ax.bar(x[:L] + 0.2, t["mlp_first"][:L], 0.4, color=_MLP, label="MLP write")
    ax.plot(x, t["value_first"], color=_VALUE, marker="o", ms=3, label="value entering the block (first token)")
    ax.plot(x, t["value_other_max"], color=_OTHER, ls="--", lw=1, label="other tokens' largest |value|")
    peak = float(np.nanmax(np.abs(t["value_first"].to_numpy())))
    ax.set_yscale("symlog", linthresh=max(peak * 1e-3, 1e-6))
    for r in origin.writes[origin.writes.dim == d].itertuples():
        if r.component == "embedding":
            continue
        xb = r.block + (0.2 if r.component == "mlp" else -0.2)
        ax.annotate(
            f"{'+' if r.write > 0 else ''}{r.write:.3g}",
            (xb, r.write),
            xytext=(0, 4 if r.write > 0 else -10),
            textcoords="offset points",
            ha="center",
            fontsize=7,
            color={"writer": _MLP, "eraser": "#2a7f62"}.get(r.role, _OTHER),
        )
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xticks(x, [str(i) for i in range(L)] + ["out"], fontsize=7)
    ax.set(xlabel="block", ylabel=f"dim {d}")
    set_title(ax, f"Dim {d} on the first token through the blocks" + (f" ({origin.kind})" if origin.kind else ""))
    ax.legend(fontsize=7, loc="upper left", ncol=2, framealpha=0.9)


@parameters_from(plot_spike_path)
@returns_figure
def plot_neuron_contributions(origin: SpikeOrigin, *, dim: int | None = None, top: int = 12, role: str = "writer"):
    """Per writing (``role="eraser"``: erasing) MLP on ``dim``: the ``top`` neurons' contributions to its write on the
    first token (bars) and their cumulative share of the write (line), 90% and 99% marked.

    Parameters
    ----------
    origin, dim
        As in :func:`plot_spike_path`.
    top : int
        Neurons drawn per MLP.
    role : {"writer", "eraser"}
        Writing or erasing MLPs.
    """
    d = _main_dim(origin, dim)
    ns = [n for n in origin.neurons if n.dim == d and n.role == role]
    if not ns:
        raise ValueError(f"no {role} MLP with readable neurons on dim {d}: nothing to plot.")
    fig, axes = plt.subplots(1, len(ns), figsize=(3.4 * len(ns) + 0.6, 3.2), squeeze=False)
    for ax, n in zip(axes[0], ns):
        t = n.table(0.999, max_rows=top)
        x = np.arange(len(t))
        ax.bar(x, t["contribution"], color=_MLP if role == "writer" else "#2a7f62")
        ax.set_xticks(x, [str(int(v)) for v in t["neuron"]], rotation=90, fontsize=7)
        ax.set(xlabel="neuron", ylabel="contribution to the write")
        tw = ax.twinx()
        tw.plot(x, t["cum_share"], color=_VALUE, marker="o", ms=3)
        for s in (0.9, 0.99):
            tw.axhline(s, color=_OTHER, ls=":", lw=0.8)
        tw.set_ylim(0, 1.1)
        tw.set_ylabel("cumulative share", fontsize=8)
        set_title(ax, f"MLP {n.block}: {n.mean_write:+.4g} on dim {d}", fontsize=9)
    return place_axes(fig, left=0.75, right=0.6, bottom=0.8, wspace=1.2)


@parameters_from(plot_spike_path)
@returns_figure
def plot_spectrum(origin: SpikeOrigin, *, dim: int | None = None, top: int = 40):
    """Per writing gated MLP on ``dim``: the |eigenvalues| of A_d's symmetric part by rank (log scale; positive and
    negative ones coloured), with the top direction's share and its |cos| with the first token's MLP input.

    Parameters
    ----------
    origin, dim
        As in :func:`plot_spike_path`.
    top : int
        Eigenvalues drawn per MLP.
    """
    d = _main_dim(origin, dim)
    qs = [q for q in origin.quadratic if q.dim == d]
    if not qs:
        raise ValueError(f"no gated MLP writes dim {d}: the quadratic-form view does not apply here.")
    fig, axes = plt.subplots(1, len(qs), figsize=(3.4 * len(qs) + 0.4, 3.1), squeeze=False)
    for ax, q in zip(axes[0], qs):
        lam = q.eigenvalues[:top].numpy()
        x = np.arange(1, len(lam) + 1)
        ax.bar(x, np.abs(lam), color=np.where(lam >= 0, _MLP, _ATTN), width=0.8)
        set_log_scale(ax)
        ax.set(xlabel="eigenvalue rank", ylabel="|eigenvalue|")
        ax.text(
            0.97,
            0.95,
            f"top: {float(q.energy_share[0]):.0%} of sum(λ²)\n|cos| with x₁: {float(q.cos_top[0]):.2f}\n"
            f"rank one: {'yes' if q.rank_one else 'no'}",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=8,
        )
        set_title(ax, f"A_d of MLP {q.block}, dim {d}", fontsize=9)
    return place_axes(fig, left=0.75, bottom=0.6, wspace=0.9)


@returns_figure
def plot_first_token_cause(
    cause: FirstTokenCause, *, dim: int | None = None, block: int | None = None, factor: str | None = None
):
    """One writer neuron's gate (or pre-activation) over what feeds it: each component's part on the first token
    and on the same token later (bars), the pre-activation total last.

    Parameters
    ----------
    cause : FirstTokenCause
    dim : int, optional
        The spike dimension (default the first traced).
    block : int, optional
        The writing block (default the first).
    factor : str, optional
        "gate" or "up" (default: the gate of a gated MLP).
    """
    c = cause.contributions
    if not len(c):
        raise ValueError("no writer neuron was followed: nothing to plot.")
    dim = int(c.dim.iloc[0]) if dim is None else int(dim)
    block = int(c[c.dim == dim].block.iloc[-1]) if block is None else int(block)
    chain = cause.chain(dim, block)
    chain = chain[chain.component != "hook"]
    factor = factor or ("gate" if "gate_first" in chain else "pre")
    fig, ax = plt.subplots(figsize=(max(5.0, 0.32 * len(chain) + 1.6), 3.4))
    x = np.arange(len(chain))
    ax.bar(x - 0.2, chain[f"{factor}_first"], 0.4, color=_MLP, label="position 1")
    ax.bar(x + 0.2, chain[f"{factor}_later"], 0.4, color=_OTHER, label=f"same token at position {cause.later + 1}")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xticks(x, chain["component"], rotation=90, fontsize=7)
    ax.set_ylabel(f"{factor} pre-activation part")
    neuron = int(c[(c.dim == dim) & (c.block == block)].neuron.iloc[0])
    set_title(ax, f"Why neuron {neuron} of MLP {block} fires on the first token", fontsize=9)
    ax.legend(fontsize=7)
    return place_axes(fig, left=0.7, bottom=1.1)


@returns_figure
def plot_spike_cuts(cuts: SpikeCuts, *, dim: int | None = None):
    """Per condition: the share of the spike kept where it peaks, the dim's value after the last block (what the
    unembedding sees: erasers), Sink_1 and the loss; random draws as their mean with min-max bars.

    Parameters
    ----------
    cuts : SpikeCuts
    dim : int, optional
        The spike dimension (default the first traced).
    """
    s = cuts.summary
    if not len(s):
        raise ValueError("no cut was made: nothing to plot.")
    d = int(s.dim.iloc[0]) if dim is None else int(dim)
    s = s[s.dim == d].reset_index(drop=True)
    labels = [
        (
            "baseline"
            if r.role == "baseline"
            else f"{r.role} {r.mode}" + ("" if r.chosen == "named" else f"\n{r.chosen}")
        )
        for r in s.itertuples()
    ]
    colors = [
        "#555555"
        if r.role == "baseline"
        else (_OTHER if r.chosen == "random" else (_MLP if r.role == "writers" else "#2a7f62"))
        for r in s.itertuples()
    ]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.4))
    x = np.arange(len(s))
    for ax, key, label in zip(
        axes,
        ("kept", "value_final", "sink_1_pct", "loss"),
        ("spike kept entering its peak block", f"dim {d} after the last block", "Sink_1 (%)", "loss (nats/token)"),
    ):
        m, lo, hi = s[f"{key}_mean"], s[f"{key}_min"], s[f"{key}_max"]
        ax.bar(x, m, color=colors, yerr=np.vstack([m - lo, hi - m]), capsize=2, error_kw={"lw": 0.8})
        ax.set_xticks(x, labels, rotation=90, fontsize=7)
        ax.set_ylabel(label, fontsize=8)
    set_title(axes[0], f"Cutting the neurons on the first token (dim {d})", fontsize=9)
    return place_axes(fig, left=0.7, bottom=1.4, wspace=0.8)
