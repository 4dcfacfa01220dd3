"""Figure of the order in which the sink's chain forms during training (``analysis.dynamics.formation``)."""

from __future__ import annotations

import math
from typing import Sequence

import matplotlib.pyplot as plt

from analysis.figures.layout import place_axes, returns_figure, set_log_scale, set_title
from analysis.dynamics.formation import ONSETS, FormationOrder

# The links drawn by default, in the order of the chain, with their axis titles.
FIGURE_LINKS: dict[str, str] = {
    "spike_ratio": "spike (x the first token's median)",
    "mlp_write_share": "largest MLP write / spike",
    "writer_neurons_90": "neurons carrying 90% of it",
    "norm_share": "spike dims' share after norm",
    "key_offsub_z_final_heads": "k_1 off-subspace z",
    "cos_q_k1_final_heads": "cos(q, k_1)",
    "value_ratio_final_heads": "|v_1| / mean |v_j|",
    "sink_1": "Sink_1 (%)",
    "cut_kept": "Sink_1 kept, writers cut",
    "zero_kept": "Sink_1 kept, spike zeroed",
}
_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")


@returns_figure
def plot_formation(result: FormationOrder, links: Sequence[str] | None = None, *, ncols: int = 5):
    """Each link against the training step (log x), on its own axis: the median over the runs of each attention
    operation (line) and their min-max (band), the onset criterion (dashed) and the median onset step of the runs
    that reach it (dotted, with a triangle). Final-heads links are measured in the final model's sink heads.

    Parameters
    ----------
    result : FormationOrder
    links : sequence of str, optional
        The links to draw (default ``FIGURE_LINKS``).
    ncols : int
        Axes per row.
    """
    links = list(FIGURE_LINKS) if links is None else list(links)
    f = result.formation
    unknown = [k for k in links if k not in set(f.link)]
    if unknown:
        raise ValueError(f"links {unknown} are not in this result; it holds {sorted(set(f.link))}.")
    crit = {c.link: c for c in ONSETS}
    ncols = min(ncols, len(links))
    nrows = math.ceil(len(links) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.55 * ncols + 0.6, 2.1 * nrows + 0.9), squeeze=False)
    attentions = list(dict.fromkeys(f.attention))
    colour = {a: _COLOURS[i % len(_COLOURS)] for i, a in enumerate(attentions)}
    lo, hi = float(f.step.min()), float(f.step.max())
    for ax, link in zip(axes.flat, links):
        for att in attentions:
            df = f[(f.link == link) & (f.attention == att)]
            g = df.groupby("step").value.agg(["median", "min", "max"])
            c = colour[att]
            n = df.run.nunique()
            ax.plot(g.index, g["median"], color=c, marker="o", ms=2.5, lw=1.2, label=f"{att} ({n} run{'s' * (n > 1)})")
            ax.fill_between(g.index, g["min"], g["max"], color=c, alpha=0.2, lw=0)
            on = result.onsets[(result.onsets.link == link) & (result.onsets.attention == att)].onset_step.dropna()
            if len(on):
                ax.axvline(on.median(), color=c, ls=":", lw=1)
                ax.plot(
                    [on.median()], [1.0], marker="v", color=c, ms=5, transform=ax.get_xaxis_transform(), clip_on=False
                )
        if link in crit:
            ax.axhline(crit[link].threshold, color="grey", ls="--", lw=0.8)
        if f[f.link == link].value.isna().all():
            ax.text(0.5, 0.5, "not defined at any step", transform=ax.transAxes, ha="center", fontsize=7, color="grey")
        set_log_scale(ax, which="x")
        ax.set_xlim(lo / 1.3, hi * 1.3)
        ax.tick_params(labelsize=7)
        set_title(ax, FIGURE_LINKS.get(link, link), fontsize=8)
    for ax in axes.flat[len(links) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("training step", fontsize=7)
    axes[0, 0].legend(fontsize=6, loc="best")
    fig.suptitle(
        "The sink's chain along training: median over runs (band: min-max); dashed: onset criterion, "
        "dotted: median onset",
        fontsize=9,
        y=1 - 0.12 / fig.get_size_inches()[1],
    )
    return place_axes(fig, left=0.45, bottom=0.45, right=0.15, top=0.5, wspace=0.45, hspace=0.45)
