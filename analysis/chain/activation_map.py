"""One sequence's residual stream at one layer as a picture: |h| over (positions x dims) (``activation_map``), where
the massive activations stand out as a few bright cells. A look at single examples beside the pass statistics of
``analysis.chain.massive``.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.model.hooks import check_layers, check_tokens, token_strings
from analysis.engine.passes import Capture, run_pass
from analysis.chain.massive import resid_hook
from analysis.core.results import compact_repr


@dataclass
class ActivationMap:
    """|h| over (positions x dims) at one layer for one sequence.

    Attributes
    ----------
    layer : int
        The block.
    hook : str
        The residual stream read.
    values : torch.Tensor, shape (T, D)
        |h| per position and dimension.
    tokens : list of str, length T
        The decoded tokens.
    """

    layer: int
    hook: str
    values: torch.Tensor  # (T, D) |h|
    tokens: list[str]

    def __repr__(self) -> str:
        return compact_repr(self)  # shapes, never tensor values

    def top(self, k: int = 5) -> pd.DataFrame:
        v, idx = self.values.flatten().topk(min(k, self.values.numel()))
        D = self.values.shape[1]
        return pd.DataFrame({"position": (idx // D).tolist(), "dim": (idx % D).tolist(),
                             "token": [self.tokens[i] for i in (idx // D).tolist()], "abs": v.tolist()})

    def to_dict(self) -> dict:
        return {"layer": self.layer, "hook": self.hook, "top": self.top().to_dict("records")}


def activation_map(model: SinkModel, tokens, layer: int, *, sample: int = 0, hook: str = "resid_post") -> ActivationMap:
    """|h| over (positions x dims) at one layer for one sequence.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    tokens : torch.Tensor, shape (N, T)
        Token ids.
    layer : int
        The block.
    sample : int
        The sequence, ``tokens[sample]``.
    hook : {"resid_post", "resid_pre", "resid_mid"}
        The residual stream read.

    Returns
    -------
    ActivationMap
        ``values`` of shape (T, D).
    """
    tokens = check_tokens(model, tokens)
    (layer,) = check_layers(model, [layer])
    if not 0 <= int(sample) < tokens.shape[0]:
        raise ValueError(f"sample must lie in [0, {tokens.shape[0]}); got {sample}.")
    seq = tokens[int(sample)][None]
    h = run_pass(model, seq, [Capture(resid_hook(layer, hook=hook), layer, lambda x: x.abs())])[0][0]
    return ActivationMap(layer, hook, h, token_strings(model, seq[0].tolist()))


__all__ = ["ActivationMap", "activation_map"]
