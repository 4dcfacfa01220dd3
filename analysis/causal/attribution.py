"""How close gradient x activation (:func:`analysis.causal.dormant_heads.dormant_heads`) comes to exact removal
(:func:`analysis.causal.head_removal.removal_effects`): ``AttributionCheck``, per (head, sequence, query).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.core.docs import parameters_from
from analysis.core.results import Result, pass_options
from analysis.model.hooks import check_heads, check_tokens
from analysis.causal.dormant_result import DormantHeads, first_query
from analysis.causal.head_removal import check_queries, removal_effects
from analysis.causal.dormant_heads import dormant_heads


@dataclass
class AttributionCheck(Result):
    """Gradient x activation against exact removal, per (head, sequence, query).

    Attributes
    ----------
    heads : list of (int, int)
        The (layer, head) pairs checked.
    queries : list of int, length Q
        The 0-based query positions.
    exact : torch.Tensor, shape (n_heads, N, Q)
        The exact loss change (nats) when the head's output at the query is removed.
    estimate : torch.Tensor, shape (n_heads, N, Q)
        The gradient x activation estimate of the same.
    ablation : {"zero", "mean"}
        The output set to 0, or to the head's mean output.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    """

    heads: list[tuple[int, int]]
    queries: list[int]
    exact: torch.Tensor
    estimate: torch.Tensor
    ablation: str = "zero"
    model_name: str | None = None
    kind: str | None = None

    @property
    def n_samples(self) -> int:
        return int(self.exact.shape[1])

    @staticmethod
    def _stats(x: np.ndarray, y: np.ndarray) -> dict:
        """x exact, y estimate (1-D)."""
        from scipy import stats  # lazy for import time: scipy.stats costs ~0.5 s on `import analysis`

        diff = np.abs(y - x)
        big = np.abs(x) > 1e-3
        out = {
            "n": int(x.size),
            "mean_abs_exact": float(np.abs(x).mean()),
            "mean_abs_error": float(diff.mean()),
            "max_abs_error": float(diff.max()),
            "relative_error": float(diff.sum() / max(np.abs(x).sum(), 1e-12)),
            "sign_agreement": float((np.sign(x[big]) == np.sign(y[big])).mean()) if big.any() else None,
        }
        ok = x.size >= 3 and np.ptp(x) > 0 and np.ptp(y) > 0
        out["pearson_r"] = float(stats.pearsonr(x, y)[0]) if ok else None
        out["spearman_rho"] = float(stats.spearmanr(x, y)[0]) if ok else None
        out["spearman_abs"] = float(stats.spearmanr(np.abs(x), np.abs(y))[0]) if ok else None
        return out

    def table(self) -> pd.DataFrame:
        """One row per head: Pearson r, Spearman rho (signed and of |.|), mean |exact|, mean and max |error|, the
        relative error sum |estimate - exact| / sum |exact|, and the sign agreement where |exact| > 1e-3 nats."""
        stats = [self._stats(x.flatten().numpy(), y.flatten().numpy()) for x, y in zip(self.exact, self.estimate)]
        return pd.DataFrame([{"layer": l, "head": h, **s} for (l, h), s in zip(self.heads, stats)])

    def pooled(self) -> dict:
        return self._stats(self.exact.flatten().numpy(), self.estimate.flatten().numpy())

    table_fields = ("heads=table",)

    def findings(self) -> list[str]:
        p = self.pooled()
        heads = ", ".join(f"{l}.{h}" for l, h in self.heads)
        if p["pearson_r"] is None:
            return [
                f"Exact removal of heads {heads} changes the loss by {p['mean_abs_exact']:.2g} nats on average; the "
                "correlation with the gradient x activation estimate is undefined (constant values)."
            ]
        how = "set to zero" if self.ablation == "zero" else "set to its mean output"
        return [
            f"Gradient x activation estimates the exact loss change of one head's output at one query {how} with Pearson "
            f"r = {p['pearson_r']:.3f} (Spearman rho = {p['spearman_rho']:.3f}, of the magnitudes "
            f"{p['spearman_abs']:.3f}) over {p['n']} (sequence, query) pairs of heads {heads}; its mean absolute "
            f"error is {p['mean_abs_error']:.2g} nats against a mean |exact change| of {p['mean_abs_exact']:.2g} "
            f"(relative error {p['relative_error']:.2f})."
        ]

    json_fields = ("ablation", "heads", "queries", "pooled", "per_head=table")


@parameters_from(pass_options)
def attribution_check(
    model: SinkModel,
    tokens,
    heads,
    *,
    ablation: str = "zero",
    result: DormantHeads | None = None,
    queries: Sequence[int] | None = None,
    resid: dict | None = None,
    batch_size: int | None = None,
    kind: str | None = None,
) -> AttributionCheck:
    """Compare the gradient x activation estimate of :func:`dormant_heads` with exact removal
    (:func:`removal_effects`) on ``heads`` ((layer, head) pairs) over ``tokens`` (N, T; keep them small: one pass of
    N x (Q + 1) rows per head). ``ablation``: "zero" (``effect``) or "mean" (``effect_mean``, the output set to the
    result's ``z_mean``). ``result``: a ``DormantHeads`` of these very tokens (computed when None).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    tokens : torch.Tensor, shape (N, T)
        Token ids (keep them small).
    heads : sequence of (int, int)
        (true layer, query head) pairs.
    ablation : {"zero", "mean"}
    result : DormantHeads, optional
        Of these very tokens (computed when None).
    queries : sequence of int, optional
        0-based query positions (default all the statistics use).
    resid : dict of int to torch.Tensor, optional
        {block: the residual entering it, (N, T, D)}.
    batch_size, kind
        As in :func:`pass_options`.

    Returns
    -------
    AttributionCheck
    """
    if ablation not in ("zero", "mean"):
        raise ValueError(f"ablation must be 'zero' or 'mean'; got {ablation!r}.")
    tokens = check_tokens(model, tokens)
    pairs = check_heads(model, heads)
    if result is None:
        result = dormant_heads(model, tokens, layers=sorted({l for l, _ in pairs}), kind=kind)
    elif tuple(result.sink_attn.shape[::3]) != tuple(tokens.shape):
        raise ValueError(
            f"the result was computed on {result.n_samples} sequences of T = {result.T}; these tokens are "
            f"{tuple(tokens.shape)}: pass the result of these tokens, or none."
        )
    missing = [l for l, _ in pairs if l not in result.layers]
    if missing:
        raise ValueError(f"layers {missing} are not in the result (it holds {result.layers}).")
    if ablation == "mean" and result.effect_mean is None:
        raise ValueError(
            "the result has no mean-ablation effects; compute it with dormant_heads(..., mean_ablation=True)."
        )
    first = first_query(result.sink_positions, eps=result.eps)
    qs = check_queries(queries, tokens.shape[1], first)
    values = torch.stack([result.z_mean[result.pos(l), h] for l, h in pairs]) if ablation == "mean" else None
    exact = removal_effects(
        model, tokens, pairs, queries=qs, first=first, values=values, resid=resid, batch_size=batch_size
    )
    effect = result.effect if ablation == "zero" else result.effect_mean
    est = torch.stack([effect[:, result.pos(l), h][:, qs] for l, h in pairs]).double()
    return AttributionCheck(pairs, qs, exact, est, ablation, getattr(model, "model_name", None), kind or result.kind)


__all__ = ["AttributionCheck", "attribution_check"]
