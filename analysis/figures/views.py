"""Attention views with circuitsvis that work offline.

circuitsvis' own notebook display first tries to reach an internet host to choose between its CDN
copy and the inline one. We never do that: we take the inline (``local_src``) HTML, which embeds the
JavaScript, so views render in JupyterLab and in saved HTML with no network.
"""

from __future__ import annotations

import torch

from analysis.core.docs import parameters_from
from analysis.model.contract import SinkModel
from analysis.model.hooks import act_name, check_attention_layers, check_tokens, token_strings
from analysis.engine.passes import Capture, run_pass


class OfflineHTML:
    """Displays in Jupyter from inline HTML only; ``str()`` gives the HTML.

    Parameters
    ----------
    html : str
        Self-contained HTML.
    """

    def __init__(self, html: str):
        self.html = html

    def _repr_html_(self) -> str:
        return self.html

    def __str__(self) -> str:
        return self.html


def attention_pattern(model: SinkModel, tokens, layer: int) -> torch.Tensor:
    """The attention maps of one attention layer for one sequence.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    tokens : torch.Tensor, shape (1, T)
        One sequence of token ids (pass ``tokens[:1]``).
    layer : int
        An attention layer (its true index; a hybrid's linear-attention / Mamba layers have none: ValueError naming
        the attention layers).

    Returns
    -------
    torch.Tensor, shape (H, T, T)
    """
    (layer,) = check_attention_layers(model, layers=[layer])
    tokens = check_tokens(model, tokens)
    if tokens.shape[0] != 1:
        raise ValueError(f"attention views take one sequence; got {tokens.shape[0]}. Pass tokens[:1].")
    return run_pass(model, tokens, [Capture(act_name("pattern", layer), layer)])[0][0]


@parameters_from(attention_pattern)
def attention_view_html(model: SinkModel, tokens, layer: int, *, heads: list[int] | None = None) -> str:
    """Self-contained circuitsvis HTML (inline JavaScript, no CDN) of one layer's attention on one sequence.

    Parameters
    ----------
    model, tokens, layer
        As in :func:`attention_pattern`.
    heads : list of int, optional
        The query heads shown (default all).

    Returns
    -------
    str
    """
    import circuitsvis as cv

    tokens = check_tokens(model, tokens)
    pattern = attention_pattern(model, tokens, layer)
    if heads is not None:
        pattern = pattern[heads]
    names = [f"L{layer}H{h}" for h in (heads if heads is not None else range(pattern.shape[0]))]
    rendered = cv.attention.attention_heads(
        attention=pattern, tokens=token_strings(model, tokens[0].tolist()), attention_head_names=names
    )
    return rendered.local_src


@parameters_from(attention_view_html)
def attention_view(model: SinkModel, tokens, layer: int, *, heads: list[int] | None = None) -> OfflineHTML:
    """For notebooks: an offline circuitsvis attention view of one layer on one sequence.

    Parameters
    ----------
    model, tokens, layer, heads
        As in :func:`attention_view_html`.

    Returns
    -------
    OfflineHTML
        Renders in JupyterLab and in saved HTML with no network.
    """
    return OfflineHTML(attention_view_html(model, tokens, layer, heads=heads))
