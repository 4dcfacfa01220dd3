"""Small statistics shared by the analyses (each written once)."""
from __future__ import annotations

import torch


def pair_cosine(unit_sum: torch.Tensor, n: int) -> torch.Tensor:
    """Mean cosine over the n (n - 1) ordered pairs of n unit vectors, from their sum s (..., d):
    (|s|^2 - n) / (n (n - 1)); NaN for n < 2. Lets a streamed pass keep only the running sum."""
    if n < 2:
        return torch.full(unit_sum.shape[:-1], float("nan"))
    return (((unit_sum * unit_sum).sum(-1) - n) / (n * (n - 1))).float()


def mean_pairwise_cosine(x: torch.Tensor, groups: torch.Tensor | None = None) -> float:
    """Mean cosine over pairs of different rows of ``x`` (n, d); with ``groups`` (n,), only over pairs from
    different groups (e.g. tokens of different sequences)."""
    if x.shape[0] < 2:
        return float("nan")
    u = torch.nn.functional.normalize(x.double(), dim=-1)
    if groups is None:
        return float(pair_cosine(u.sum(0), x.shape[0]))
    mask = groups[:, None] != groups[None, :]
    return float((u @ u.T)[mask].mean()) if mask.any() else float("nan")
