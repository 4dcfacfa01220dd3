"""One sequence's residual stream at one layer as a picture: |h| over (positions x dims) (``activation_map``), where
the massive activations stand out as a few bright cells. A look at single examples beside the pass statistics of
``analysis.chain.massive``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from analysis.core.docs import model_tokens, parameters_from
from analysis.model.contract import SinkModel
from analysis.model.hooks import check_layers, check_tokens, token_strings
from analysis.engine.passes import Capture, run_pass
from analysis.chain.massive import resid_hook
from analysis.core.results import Result, compact_repr


@dataclass
class ActivationMap(Result):
    """|h| over (positions x dims) at one layer for one sequence (the result protocol: ``tables["top"]``, the largest
    cells; ``to_dict()`` keeps ``layer``, ``hook`` and ``top``).

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
    model_name : str or None
        The model measured.
    kind : str or None
        The input kind.
    sample : int
        The sequence of the tokens given, ``tokens[sample]``.
    n_samples : int
        1, the one sequence.
    """

    layer: int
    hook: str
    values: torch.Tensor  # (T, D) |h|
    tokens: list[str]
    model_name: str | None = None
    kind: str | None = None
    sample: int = 0
    n_samples: int = 1

    def __repr__(self) -> str:
        return compact_repr(self)  # shapes, never tensor values

    table_fields = ("top",)

    def findings(self) -> list[str]:
        top = self.top(1).iloc[0]
        med = float(self.values.median())
        return [
            f"At layer {self.layer} ({self.hook}) of sequence {self.sample}, the largest |h| is {top['abs']:.3g} at "
            f"position {int(top.position)} (token {top.token!r}), dim {int(top.dim)}: "
            f"{top['abs'] / max(med, 1e-30):.0f}x the map's median |h| ({med:.3g})."
        ]

    def top(self, k: int = 5) -> pd.DataFrame:
        v, idx = self.values.flatten().topk(min(k, self.values.numel()))
        D = self.values.shape[1]
        return pd.DataFrame(
            {
                "position": (idx // D).tolist(),
                "dim": (idx % D).tolist(),
                "token": [self.tokens[i] for i in (idx // D).tolist()],
                "abs": v.tolist(),
            }
        )

    def to_dict(self) -> dict:
        return {**super().to_dict(), "layer": self.layer, "hook": self.hook}


@parameters_from(model_tokens)
def activation_map(model: SinkModel, tokens, layer: int, *, sample: int = 0, hook: str = "resid_post") -> ActivationMap:
    """|h| over (positions x dims) at one layer for one sequence.

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens`.
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
    return ActivationMap(
        layer,
        hook,
        h,
        token_strings(model, seq[0].tolist()),
        model_name=getattr(model, "model_name", None),
        sample=int(sample),
    )


__all__ = ["ActivationMap", "activation_map"]
