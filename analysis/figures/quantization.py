"""Figures for quantization (``analysis.quant``): perplexity per scheme and condition over the calibration seeds, and
the per-layer largest calibrated input with the spike's writing and erasing blocks marked."""

from __future__ import annotations

import numpy as np

from analysis.figures.layout import one_axes, set_log_scale, set_title
from analysis.quant.study import CONDITION_WORDS

_COLORS = {"as_is": "#c44e52", "sinks_fp": "#55a868", "prefix": "#4c72b0"}
_WRITER, _ERASER = "#c44e52", "#2a7f62"


def _short(v: float) -> str:
    """A bar's label: 54.6, 14k, 12.4M."""
    return f"{v / 1e6:.1f}M" if v >= 1e6 else f"{v / 1e3:.0f}k" if v >= 1e4 else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


@one_axes((9, 3.8), left=0.8, bottom=0.75, right=0.15, top=0.4)
def plot_quant_ppl(spread, *, fp_ppl: float | None = None, title: str = "perplexity per scheme and condition", ax=None):
    """Perplexity per scheme (groups) and condition (bars), the mean over the calibration seeds, with their range
    (min to max) as error bars and each bar's mean written on it; log scale.

    Parameters
    ----------
    spread : pandas.DataFrame
        Of ``analysis.quant.study.seed_spread``: ``scheme``, ``condition``, ``ppl``, ``ppl_min``, ``ppl_max``.
    fp_ppl : float, optional
        Full precision's perplexity, drawn as a dotted line.
    title : str
    """
    schemes, conds = list(dict.fromkeys(spread.scheme)), list(dict.fromkeys(spread.condition))
    width = 0.8 / len(conds)
    for j, c in enumerate(conds):
        r = spread[spread.condition == c].set_index("scheme").reindex(schemes)
        x = np.arange(len(schemes)) + (j - (len(conds) - 1) / 2) * width
        err = np.vstack([r.ppl - r.ppl_min, r.ppl_max - r.ppl])
        bars = ax.bar(
            x,
            r.ppl,
            width * 0.9,
            color=_COLORS.get(c, "#8172b2"),
            label=CONDITION_WORDS.get(c, c),
            yerr=err,
            capsize=3,
            error_kw={"lw": 1, "ecolor": "#333333"},
        )
        ax.bar_label(bars, labels=[_short(v) for v in r.ppl], fontsize=7, padding=2)
    if fp_ppl is not None:
        ax.axhline(fp_ppl, color="grey", ls=":", lw=1.2, label=f"full precision ({fp_ppl:.1f})")
    ax.set_xticks(np.arange(len(schemes)), schemes, fontsize=8)
    set_log_scale(ax)
    ax.set_ylim(top=ax.get_ylim()[1] * 4)  # room for the labels above the tallest bar
    ax.set_ylabel("perplexity (mean over seeds)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4, frameon=False)
    set_title(ax, title + " (error bars: the seeds' range)")


@one_axes((9, 3.6), left=0.8, bottom=0.55, right=0.15, top=0.4)
def plot_layer_scales(layers: dict, *, writers=(), erasers=(), ax=None):
    """Per layer, the largest calibrated input over its linears (the per-tensor scale of its worst linear), one line
    per condition, with the blocks whose MLPs write the first token's spike and those that erase it marked.

    Parameters
    ----------
    layers : dict of str to pandas.DataFrame
        Label -> a table of ``analysis.quant.study.layer_scales`` (``layer``, ``absmax``, ``site``).
    writers, erasers : sequence of int
        The spike's writing and erasing blocks (``SpikeOrigin.writing_blocks(dim)``, ``(dim, "eraser")``).
    """
    colors = iter(["#c44e52", "#55a868", "#4c72b0", "#8172b2"])
    for label, t in layers.items():
        ax.plot(t.layer, t.absmax, marker="o", ms=3, lw=1.4, color=next(colors), label=label)
    for blocks, color, word in ((writers, _WRITER, "writes"), (erasers, _ERASER, "erases")):
        for i, b in enumerate(blocks):
            ax.axvspan(
                b - 0.4,
                b + 0.4,
                color=color,
                alpha=0.15,
                lw=0,
                label=f"MLP that {word} the first token's spike" if i == 0 else None,
            )
    first = next(iter(layers.values()))
    marked = first[first.layer.isin([*writers, *erasers])].nlargest(2, "absmax")
    for r in marked.itertuples():  # name the linear that sets the two largest scales at a marked block
        right = r.layer > first.layer.max() / 2
        ax.annotate(
            f"{r.site}: |x| = {r.absmax:,.0f}",
            (r.layer, r.absmax),
            xytext=(-8 if right else 8, -2),
            textcoords="offset points",
            fontsize=7,
            va="top",
            ha="right" if right else "left",
        )
    set_log_scale(ax)
    ax.set(xlabel="layer", ylabel="largest |input| of its linears")
    ax.set_xticks(np.arange(0, int(first.layer.max()) + 1, 2))
    ax.legend(fontsize=7, loc="upper left")
    set_title(ax, "per-layer largest calibrated input (the per-tensor static scale of its worst linear)")
