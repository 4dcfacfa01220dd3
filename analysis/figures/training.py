"""Figures of models trained with different attention operations (``analysis.dynamics.compare``,
``notebooks/07_attention_variants.ipynb``): their mean attention patterns, the first token's statistics side by side,
and loss and Sink_1 over training.
"""

from __future__ import annotations

import pandas as pd
import torch

from analysis.core.docs import parameters_from
from analysis.core.io import read_log
from analysis.dynamics.compare import compare_models, mean_pattern
from analysis.figures.layout import returns_figure
from analysis.model.hooks import model_facts


@parameters_from(compare_models)
@returns_figure
def plot_patterns(models: dict, tokens: torch.Tensor, *, layer: int = 0, n_pos: int = 16):
    """Mean attention pattern of each head (first ``n_pos`` positions), one row per model.

    Parameters
    ----------
    models, tokens
        As in :func:`compare_models`.
    layer : int
    n_pos : int
        Positions shown.
    """
    import matplotlib.pyplot as plt

    H = max(model_facts(m).dims.n_heads for m in models.values())
    fig, axes = plt.subplots(len(models), H, figsize=(2.2 * H, 2.3 * len(models)), squeeze=False)
    for r, (label, model) in enumerate(models.items()):
        pat = mean_pattern(model, tokens, layer=layer)[:, :n_pos, :n_pos]
        for h in range(H):
            ax = axes[r, h]
            ax.imshow(pat[h].numpy(), cmap="viridis", vmin=0, vmax=1)
            ax.set(xticks=[], yticks=[])
            ax.set_title(f"{label} h{h}", fontsize=8)
    fig.suptitle(f"mean attention (hook_pattern), layer {layer}: keys → columns, queries ↓ rows", fontsize=9)
    fig.tight_layout()
    return fig


@returns_figure
def plot_first_token(table: pd.DataFrame):
    """Bars of Sink_1, the value-norm ratio and the raw first-token weight per model.

    Parameters
    ----------
    table : pandas.DataFrame
        Of :func:`compare_models`.
    """
    import matplotlib.pyplot as plt

    cols = ["Sink_1 (%)", "|v_1| / mean |v_j|", "raw weight on token 1"]
    fig, axes = plt.subplots(1, len(cols), figsize=(3.3 * len(cols), 2.8))
    for ax, col in zip(axes, cols):
        ax.bar(table.index, table[col], color=["tab:blue", "tab:orange", "tab:green", "tab:red"][: len(table)])
        ax.set_title(col, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


@returns_figure
def plot_training(runs: dict):
    """Loss and Sink_1 against training step for each run folder {label: dir}.

    Parameters
    ----------
    runs : dict of str to path-like
    """
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3))
    for label, d in runs.items():
        log = pd.DataFrame(read_log(d))
        a.plot(log["step"], log["loss"], label=label)
        if "sink_1" in log:
            ev = log.dropna(subset=["sink_1"])
            b.plot(ev["step"], ev["sink_1"], marker="o", label=label)
    a.set(xlabel="step", ylabel="training loss")
    b.set(xlabel="step", ylabel="Sink_1 (%) on the held-out probe")
    a.legend()
    b.legend()
    fig.tight_layout()
    return fig


__all__ = ["plot_patterns", "plot_first_token", "plot_training"]
