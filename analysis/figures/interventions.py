"""Figures for the causal tests (``analysis.causal.interventions``)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from analysis.causal.conditions import WHERE_KEYS
from analysis.figures.layout import place_axes, returns_figure, set_title
from analysis.causal.interventions import FirstKeyAblation, SpikeAblation, ValueAblation

_COND_COLORS = {"baseline": "#555555", "zero": "#c44e52", "mean": "#55a868", "ablated": "#c44e52"}


@returns_figure
def plot_spike_ablation(result: SpikeAblation | dict[str, SpikeAblation]):
    """Sink_1 and loss per condition (baseline / zero / mean), and Sink_1 per layer.

    Several results (e.g. two spike criteria) can be given as a dict name -> result.

    Parameters
    ----------
    result : SpikeAblation or dict of str to SpikeAblation
    """
    results = result if isinstance(result, dict) else {"": result}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2), gridspec_kw={"width_ratios": [1, 1, 2]})
    n = len(results)
    w = 0.8 / n
    for i, (name, r) in enumerate(results.items()):
        s = r.conditions
        x = np.arange(len(s)) + (i - (n - 1) / 2) * w
        hatch, colors = ["", "//", "..", "xx"][i % 4], [_COND_COLORS.get(c, "grey") for c in s["condition"]]
        b = axes[0].bar(x, s["sink_1_pct"], w, color=colors, hatch=hatch, label=name or None)
        axes[0].bar_label(b, fmt="%.0f", fontsize=7)
        b = axes[1].bar(x, s["loss"], w, color=colors, hatch=hatch)
        axes[1].bar_label(b, fmt="%.2f", fontsize=7)
        pl = r.per_layer
        for c in [c for c in pl.columns if c != "layer"]:
            axes[2].plot(
                pl["layer"],
                pl[c],
                marker="o",
                ms=2.5,
                color=_COND_COLORS.get(c, "grey"),
                ls=["-", "--", ":", "-."][i % 4],
                label=f"{c} {name}".strip(),
            )
    cond = list(next(iter(results.values())).conditions["condition"])
    for a in axes[:2]:
        a.set_xticks(range(len(cond)), cond)
    axes[0].set_ylabel("Sink$_1$ (%)")
    axes[1].set_ylabel("loss (nats/token)")
    axes[2].set_xlabel("layer")
    axes[2].set_ylabel("Sink$_1$ (%)")
    axes[2].legend(fontsize=7, ncol=2, loc="lower left", framealpha=0.9)
    if n > 1:
        axes[0].legend(fontsize=7)
    set_title(axes[0], "first token's spike dims")
    return place_axes(fig, left=0.7, wspace=0.8)


@returns_figure
def plot_value_ablation(result: ValueAblation):
    """Loss change per condition, and per sink head the first value's norm against the other values'.

    Parameters
    ----------
    result : ValueAblation
    """
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.3))
    s = result.conditions[result.conditions["condition"] != "baseline"]
    b = a1.barh(s["condition"], s["delta_loss"], color="#c44e52")
    a1.bar_label(b, fmt="%+.3f", fontsize=7)
    a1.margins(x=0.25)  # room for the labels beside the bar ends
    a1.axvline(0, color="grey", lw=0.6)
    a1.set_xlabel("loss change (nats/token)")
    set_title(a1, "remove the first token's value")
    h = result.heads
    if len(h):
        sc = a2.scatter(h["v_other_norm"], h["v1_norm"], c=h["alpha_1"], cmap="viridis", s=12, vmin=0, vmax=1)
        lim = max(h["v_other_norm"].max(), h["v1_norm"].max()) * 1.05
        a2.plot([0, lim], [0, lim], color="grey", lw=0.6, ls=":")
        fig.colorbar(sc, ax=a2, label="alpha_1")
    a2.set(xlabel="mean |v_j|, j > 1", ylabel="|v_1|")
    set_title(a2, "sink heads: value norms")
    return place_axes(fig, left=1.65, right=0.3, wspace=1.0)  # left: condition names of up to 16 characters


@returns_figure
def plot_first_key_ablation(result: FirstKeyAblation):
    """Where the attention of later queries goes (first / previous / self / other keys), over the changed
    layers, and the first key's share per layer, with and without the spike-driven part of k_1.

    Parameters
    ----------
    result : FirstKeyAblation
    """
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10.5, 3.3), gridspec_kw={"width_ratios": [1, 2]})
    s = result.conditions
    bottom = np.zeros(len(s))
    colors = {"first": "#c44e52", "previous": "#dd8452", "self": "#55a868", "other": "#4c72b0"}
    for k in WHERE_KEYS:
        a1.bar(s["condition"], s[k], bottom=bottom, color=colors[k], label=k)
        bottom += s[k].to_numpy()
    a1.set_ylabel("attention share (queries t >= 3)")
    a1.legend(fontsize=7)
    set_title(a1, "where the attention goes")
    pl = result.per_layer
    for c, ls in (("baseline", "-"), ("ablated", "--")):
        d = pl[pl["condition"] == c]
        if len(d):
            a2.plot(d["layer"], d["first"], ls=ls, color="#c44e52", marker="o", ms=2.5, label=f"first key, {c}")
            a2.plot(d["layer"], d["other"], ls=ls, color="#4c72b0", marker="o", ms=2.5, label=f"other keys, {c}")
    for l in result.layers:
        a2.axvspan(l - 0.5, l + 0.5, color="#eeeeee", zorder=0)
    a2.set(xlabel="layer (shaded: first key changed)", ylabel="attention share")
    a2.legend(fontsize=7, ncol=2)
    return place_axes(fig, left=0.7, wspace=0.7)
