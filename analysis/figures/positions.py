"""Figures for sinks at any position (``analysis.positions.every_sink``), the sink against context length and eps
(``analysis.positions.context_length``), and the propositions on repeated tokens per positional encoding
(``analysis.positions.repeated_tokens``, ``analysis.positions.encodings``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from analysis.core.defaults import SINK_EPS
from analysis.figures.layout import one_axes, place_axes, returns_figure, set_title
from analysis.positions.context_length import BARBERO_EPS, SinkContext
from analysis.positions.encodings import KINDS, EncodingGrid
from analysis.positions.every_sink import SinkPositions
from analysis.positions.repeated_tokens import RepeatedTokens


def _example_sample(res: SinkPositions) -> int:
    """The first sequence with a sink besides the first token (0 if none has one)."""
    later = res.sinks[res.sinks.position > 0]
    return int(later["sample"].iloc[0]) if len(later) else 0


@one_axes((8, 3.2), right=0.7, top=0.35)
def plot_sink_positions(res: SinkPositions, *, sample: int | None = None, ax=None):
    """One sequence: at each position, the number of heads where it is a sink (alpha_k > eps), and its largest alpha
    over heads; the sink positions are labelled with their tokens.

    Parameters
    ----------
    res : SinkPositions
    sample : int, optional
        The sequence (default :func:`_example_sample`).
    """
    sample = _example_sample(res) if sample is None else int(sample)
    heads = res.sink_mask()[sample].sum((0, 1)).numpy()
    x = np.arange(res.T)
    ax.bar(x, heads, color="#4c72b0", width=0.8, label="heads with $\\alpha_k > \\epsilon$")
    ax.set(xlabel="position k (0-based)", ylabel="heads")
    ax2 = ax.twinx()
    ax2.plot(x, res.alpha[sample].flatten(0, 1).max(0).values.numpy(), color="#c44e52", lw=1, label="max $\\alpha_k$")
    ax2.axhline(res.eps, color="#c44e52", lw=0.6, ls=":")
    ax2.axvspan(res.n_measured - 0.5, res.T - 0.5, color="grey", alpha=0.15, lw=0)
    ax2.set(ylim=(0, 1.05), ylabel="max $\\alpha_k$ over heads")
    for k in np.nonzero(heads)[0]:
        ax.annotate(
            repr(res.token(res.tokens[sample, k])),
            (k, heads[k]),
            fontsize=7,
            rotation=60,
            ha="left",
            va="bottom",
            xytext=(1, 2),
            textcoords="offset points",
        )
    ax.set_ylim(0, max(1, heads.max()) * 1.3)
    set_title(ax, f"sequence {sample}: sinks at every position (grey: too few queries)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper right")


@one_axes((4.5, 6), left=0.8, right=0.4)
def plot_later_sink_heads(res: SinkPositions, *, ax=None):
    """Heatmap per (layer, head): the share of sequences in which the head sinks on a position after the first.

    Parameters
    ----------
    res : SinkPositions
    """
    df = res.per_head()
    H = int(df["head"].max()) + 1
    share = df["share_later"].to_numpy().reshape(-1, H)
    im = ax.imshow(share, aspect="auto", cmap="magma", vmin=0, vmax=1, origin="lower")
    ax.set_yticks(range(len(res.layers)), [str(l) for l in res.layers], fontsize=6)
    ax.set(xlabel="head", ylabel="layer")
    set_title(ax, "share of sequences sinking on a later position")
    ax.figure.colorbar(im, ax=ax, label="share of sequences")


@one_axes((6, 3.2), top=0.35)
def plot_cos_first(res: SinkPositions, *, ax=None):
    """Cosine of the hidden state to the first token's, per layer: the later sink positions (median and 10-90%
    band) against the other later positions, with the threshold of a secondary sink.

    Parameters
    ----------
    res : SinkPositions
    """
    cos = res.cos_first[:, :, 1 : res.n_measured]  # (N, R, T') later measured positions
    sink = res.sink_mask()[..., 1 : res.n_measured].flatten(1, 2).any(1)  # (N, T')
    layers = res.resid_layers
    for pick, label, color in ((sink, "later sink positions", "#c44e52"), (~sink, "other positions", "#4c72b0")):
        if not pick.any():
            continue
        c = cos.permute(1, 0, 2)[:, pick]  # (R, n)
        q = np.nanquantile(c.numpy(), [0.1, 0.5, 0.9], axis=1)
        ax.plot(layers, q[1], color=color, marker="o", ms=2, label=f"{label} ({int(pick.sum())})")
        ax.fill_between(layers, q[0], q[2], color=color, alpha=0.2, lw=0)
    ax.axhline(res.cos_min, color="grey", lw=0.6, ls=":")
    ax.set(xlabel="layer (hook_resid_post)", ylabel="cos(h$_t$, h$_0$)", ylim=(-0.2, 1.05))
    ax.legend(fontsize=7, loc="lower left")
    set_title(ax, "alignment with the first token's hidden state (median, 10-90%)")


def _band(ax, x, df, rate: str, label: str, color, marker="o"):
    ax.plot(x, df[f"{rate}_mean"], color=color, marker=marker, ms=3, label=label)
    ax.fill_between(x, df[f"{rate}_min"], df[f"{rate}_max"], color=color, alpha=0.2, lw=0)


@one_axes((6.5, 3.4), top=0.35)
def plot_sink_vs_context(ctx: SinkContext, *, eps=(SINK_EPS, BARBERO_EPS), ax=None):
    """Sink_1 and the share of (sample, layer, head) sinking on a later position against T (log scale), at each
    eps; lines are the mean over probe seeds, bands their min-max.

    Parameters
    ----------
    ctx : SinkContext
    eps : sequence of float
        The thresholds drawn.
    """
    colors = ["#4c72b0", "#dd8452", "#55a868", "#8172b2"]
    for i, e in enumerate(e for e in eps if ctx._has_eps(e)):
        df = ctx.by_T(e)
        _band(ax, df["T"], df, "sink_1_pct", f"Sink$_1$, $\\epsilon$ = {e:g}", colors[i % 4])
        _band(ax, df["T"], df, "secondary_pct", f"later position, $\\epsilon$ = {e:g}", colors[i % 4], marker="s")
        ax.lines[-1].set_linestyle("--")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context length T (tokens)", ylabel="% of (sample, layer, head)", ylim=(0, 100))
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    set_title(ax, f"sink against context length ({ctx.model_name or 'model'}; bands: seeds)")


@one_axes((5, 3.2), top=0.35)
def plot_sink_vs_eps(ctx: SinkContext, *, T: int | None = None, ax=None):
    """Sink_1 and the secondary share against eps at context length T (default the largest), mean over seeds with
    the min-max band.

    Parameters
    ----------
    ctx : SinkContext
    T : int, optional
        The context length (default the largest).
    """
    df = ctx.by_eps(T)
    _band(ax, df["eps"], df, "sink_1_pct", "Sink$_1$", "#4c72b0")
    _band(ax, df["eps"], df, "secondary_pct", "later position", "#c44e52", marker="s")
    ax.set(xlabel="$\\epsilon$", ylabel="% of (sample, layer, head)", ylim=(0, 100))
    ax.legend(fontsize=7)
    set_title(ax, f"sink against the threshold (T = {T or max(ctx.Ts)})")


@returns_figure
def plot_first_vs_t(grid: EncodingGrid, *, encodings=None, log: bool = True):
    """Per encoding, the first token's attention against the number t of repeated tokens seen (one thin line per
    seed, layer and head), with the proposition's closed form drawn over it (dashed; the upper bound for rotary) and
    NoPE's 1/t (dotted grey) where no closed form applies.

    Parameters
    ----------
    grid : EncodingGrid
    encodings : sequence of str, optional
        The panels (default: every encoding of the grid).
    log : bool
        Log-scale both axes.
    """
    encodings = list(encodings or grid.encodings)
    ncols = min(3, len(encodings))
    nrows = -(-len(encodings) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(2.7 * ncols + 0.6, 2.3 * nrows + 0.9), squeeze=False, sharex=True, sharey=True
    )
    cmap = plt.get_cmap("tab10")
    for ax, pe in zip(axes.flat, encodings):
        df = grid.curves[grid.curves.encoding == pe]
        for (_, _, head), c in df.groupby(["seed", "layer", "head"]):
            ax.plot(c.t, c.attention, color=cmap(int(head) % 10), lw=0.7, alpha=0.7)
            if c.closed_form.notna().any():
                ax.plot(c.t, c.closed_form, color="black", lw=0.8, ls="--", alpha=0.6)
        t = np.arange(1, int(df.t.max()) + 1)
        if df.closed_form.isna().all():
            ax.plot(t, 1 / t, color="grey", lw=1, ls=":", label="1/t (NoPE)")
            ax.legend(fontsize=6, loc="lower left")
        if log:
            ax.set(xscale="log", yscale="log")
        set_title(ax, pe, fontsize=8)
    for ax in axes.flat[len(encodings) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("t (tokens seen)")
    for ax in axes[:, 0]:
        ax.set_ylabel("attention on token 1")
    fig.suptitle("one token repeated: measured (colour: head) vs closed form (dashed)", fontsize=9)
    return place_axes(fig, left=0.7, top=0.5, wspace=0.15, hspace=0.35)


@one_axes((6, 3.2), top=0.35)
def plot_hidden_deviation(results: dict[str, RepeatedTokens], *, ax=None, floor: float = 1e-10):
    """The largest deviation of the hidden state across positions, relative to max |h_0|, along the residual stream
    (0: the first layer's input, l + 1: layer l's output), one line per model; zeros are drawn at ``floor``.

    Parameters
    ----------
    results : dict of str to RepeatedTokens
        Label -> result.
    floor : float
        Where an exact zero is drawn on the log axis.
    """
    for label, res in results.items():
        # (L + 1,) the relative deviation along the residual stream: each layer's input, then the last layer's output
        rel = np.append(res.relative_deviation("in").amax(0).numpy(), res.relative_deviation("out").amax(0).numpy()[-1])
        ax.plot(np.arange(len(rel)), np.maximum(rel, floor), marker="o", ms=3, lw=1, label=label)
    ax.set_yscale("log")
    ax.axhspan(floor / 3, floor * 3, color="grey", alpha=0.15, lw=0)
    ax.set_xlabel("residual stream (0: input of layer 0; l + 1: output of layer l)")
    ax.set_ylabel("max |h_i - h_0| / max |h_0|")
    ax.legend(fontsize=7, loc="center right")
    set_title(ax, f"one token repeated: deviation across positions (grey: 0, drawn at {floor:g})")


@one_axes((7, 3.2), top=0.35)
def plot_sink_by_encoding(grid: EncodingGrid, *, ax=None):
    """Sink_1 (%) per encoding and input kind: the mean over seeds (bars), each seed (dots) and the range.

    Parameters
    ----------
    grid : EncodingGrid
    """
    encs = grid.encodings
    width = 0.8 / len(KINDS)
    colors = {"natural": "#4c72b0", "random": "#dd8452", "repeated": "#55a868"}
    for j, kind in enumerate(KINDS):
        col = f"sink_1_{kind}"
        x = np.arange(len(encs)) + (j - (len(KINDS) - 1) / 2) * width
        vals = [grid.runs.loc[grid.runs.encoding == pe, col] for pe in encs]
        ax.bar(x, [v.mean() for v in vals], width=width, color=colors[kind], alpha=0.8, label=kind)
        for xi, v in zip(x, vals):
            ax.scatter(np.full(len(v), xi), v, s=8, color="black", zorder=3)
    ax.set_xticks(np.arange(len(encs)), encs)
    ax.set(ylabel="Sink$_1$ (%)", ylim=(0, 105))
    ax.legend(fontsize=7, ncol=3, loc="upper right")
    set_title(
        ax, f"Sink$_1$ per positional encoding and input (bars: mean of {grid.runs.seed.nunique()} seeds; dots: seeds)"
    )
