"""Position encodings: RoPE, ALiBi, T5-style relative buckets and sinusoidal absolute embeddings."""

from __future__ import annotations

import math

import torch

# the one rotary, shared with the analyses; sink_lm imports rope_cos_sin from here
from analysis.model.rotary import rope_cos_sin, rotate_half  # noqa: F401
from torch import nn


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, d) rotated by cos/sin (T, d).

    Parameters
    ----------
    x : torch.Tensor, shape (B, T, H, d)
    cos, sin : torch.Tensor, shape (T, d)

    Returns
    -------
    torch.Tensor, shape (B, T, H, d)
    """
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The ALiBi head slopes of Press et al. (geometric, with the power-of-two interleaving).

    Parameters
    ----------
    n_heads : int

    Returns
    -------
    torch.Tensor, shape (n_heads,)
    """

    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        s = pow2(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        s = pow2(closest) + pow2(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(s, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """(H, *distance.shape) bias -slope * distance (distance = i - j >= 0 for visible keys).

    Parameters
    ----------
    slopes : torch.Tensor, shape (H,)
    distance : torch.Tensor

    Returns
    -------
    torch.Tensor, shape (H, *distance.shape)
    """
    return -slopes.view(-1, *([1] * distance.ndim)) * distance.clamp_min(0).to(slopes.dtype)


def _relative_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's causal (unidirectional) bucketing of distance = i - j >= 0 (long, ``distance``'s shape): exact below
    num_buckets/2, log above."""
    n = distance.clamp_min(0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = (
        max_exact
        + (
            torch.log(n.float().clamp_min(1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp_max(num_buckets - 1)
    return torch.where(is_small, n, large)


class RelativeBias(nn.Module):
    """A learned bias per head and distance bucket (T5)."""

    def __init__(self, n_heads: int, num_buckets: int, max_distance: int):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.weight = nn.Parameter(torch.zeros(num_buckets, n_heads))

    def forward(self, distance: torch.Tensor) -> torch.Tensor:
        b = _relative_bucket(distance, self.num_buckets, self.max_distance)
        return self.weight[b].movedim(-1, 0)  # (H, *distance.shape)


def sinusoidal_table(n_ctx: int, d_model: int) -> torch.Tensor:
    """(n_ctx, d_model) sine/cosine absolute embeddings of Vaswani et al.

    Parameters
    ----------
    n_ctx : int
    d_model : int

    Returns
    -------
    torch.Tensor, shape (n_ctx, d_model)
    """
    pos = torch.arange(n_ctx, dtype=torch.float32)[:, None]
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_ctx, d_model)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div)[:, : d_model // 2]
    return table
