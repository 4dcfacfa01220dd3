"""The per-layer statistics the nnsight trace computes next to the model: alpha of the first keys per head (from q,
k after the rotary and each query row's log-sum-exp), the residual stream's massive-activation statistics (top-k
|x| by selection, the lower median, the first token's sums and the few candidates above the absolute threshold) and,
for the sinks at every position, each position's cosine to the first token and its peak |x| and dim.

This module and ``analysis.core.reductions`` are the code shipped inside an nnsight trace (by value, for NDIF): they
import only torch, math and typing (``tests/engine/test_nnsight.py`` checks it by parsing them), and everything here reduces
on the layer's own device to values of size per layer x head, per layer x d_model or per layer x position; nothing T x T is built.

Under tensor parallelism each rank holds whole groups of query heads with their KV heads, and every statistic here is
head-local (query head h reads only KV head h // group): a rank's alpha is its heads' rows of the full alpha, and the
ranks' (B, H_rank, k) results are gathered along the head axis; q and k never leave their rank.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from analysis.core.reductions import (
    ALPHA_CHUNK_ELEMENTS,
    alpha_from_lse,
    block_rows,
    hide_scores,
    lower_median,
    top_k_abs,
)


def key_mask(mask: Optional[torch.Tensor], T: int) -> Optional[torch.Tensor]:
    """The attention mask an attention function received, cut to the ``T`` keys (a 4-d mask may be longer).

    Parameters
    ----------
    mask : torch.Tensor or None
        (B, 1 or H, T, >= T), boolean (True = attend) or additive float; None: causal.
    T : int

    Returns
    -------
    torch.Tensor or None
        Boolean (True = attend): an additive mask's hidden entries (-inf, or the dtype's minimum as eager attention
        writes them) are those far below zero.
    """
    if mask is None:
        return None
    if mask.ndim == 4:
        mask = mask[..., :T]
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def _scores(
    q: torch.Tensor, keys: torch.Tensor, s: int, e: int, kc: int, scale: float, softcap: Optional[float]
) -> torch.Tensor:
    """Scores (B, H_kv, g, e - s, kc) of query rows s..e-1 against keys 0..kc-1, soft-capped where asked."""
    B, H_kv, group, _, d = q.shape
    sc = q[..., s:e, :].reshape(B, H_kv, group * (e - s), d) @ keys[..., :kc, :].transpose(-1, -2)
    sc = sc.view(B, H_kv, group, e - s, kc).mul_(scale)
    if softcap is not None:
        sc = torch.tanh(sc / softcap) * softcap
    return sc


def row_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: float,
    *,
    mask: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    chunk_elements: int = ALPHA_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Each query row's log-sum-exp over the keys it sees (causal, and ``mask``), in blocks of query rows.

    Parameters
    ----------
    query : torch.Tensor, shape (B, H, T, d)
    key : torch.Tensor, shape (B, H_kv, T, d)
    scale : float
    mask : torch.Tensor, optional
        (B, 1 or H, T, T), boolean (True = attend) or additive float (-inf = hidden).
    softcap : float, optional
        Gemma 2's cap: scores = cap * tanh(scores / cap).
    chunk_elements : int
        The most scores held at a time.

    Returns
    -------
    torch.Tensor, shape (B, H, T)
        float32.
    """
    B, H, T, d = query.shape
    H_kv = key.shape[1]
    q = query.float().unflatten(1, (H_kv, H // H_kv))
    keys = key.float()
    rows = block_rows(B, H, T, chunk_elements)
    out = []
    for s in range(0, T, rows):
        e = min(s + rows, T)
        sc = _scores(q, keys, s, e, e, scale, softcap)  # keys 0..e-1: the later ones are hidden anyway
        hide_scores(sc, s, e, e, mask, -math.inf)
        out.append(sc.logsumexp(-1))
    return torch.cat(out, dim=-1).flatten(1, 2)


def softcapped_alpha(
    query: torch.Tensor,
    key: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    softcap: float,
    k_max: int,
    *,
    mask: Optional[torch.Tensor] = None,
    chunk_elements: int = ALPHA_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """``alpha_from_lse`` for soft-capped scores (Gemma 2), whose cap is not a factor of q . k.

    Parameters
    ----------
    query, key, lse, scale, k_max, mask, chunk_elements
        As in ``analysis.core.reductions.alpha_from_lse``.
    softcap : float

    Returns
    -------
    torch.Tensor, shape (B, H, k_max)
        float32.
    """
    B, H, T, d = query.shape
    k_max = min(int(k_max), T)
    H_kv = key.shape[1]
    group = H // H_kv
    q = query.float().unflatten(1, (H_kv, group))
    keys = key[..., :k_max, :].float()
    lse = lse.float().unflatten(1, (H_kv, group))
    rows = block_rows(B, H, k_max, chunk_elements)
    sums = torch.zeros(B, H_kv, group, k_max, dtype=torch.float64, device=query.device)
    for s in range(0, T, rows):
        e = min(s + rows, T)
        kc = min(e, k_max)
        sc = _scores(q, keys, s, e, kc, scale, softcap).sub_(lse[..., s:e, None]).exp_()
        hide_scores(sc, s, e, kc, mask, 0.0)
        sums[..., :kc] += sc.sum(dim=-2)
    counts = (T - torch.arange(k_max, device=query.device)).double()
    return (sums / counts).float().flatten(1, 2)


def attention_alpha(
    query: torch.Tensor,
    key: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: Optional[float],
    k_max: int,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """alpha_1..k_max of one attention layer from what its attention function received: q and k after the rotary
    (and any q/k norm), the mask (sliding windows), the scale and the soft cap.

    Parameters
    ----------
    query : torch.Tensor, shape (B, H, T, d)
    key : torch.Tensor, shape (B, H_kv, T, d)
    mask : torch.Tensor or None
    scale : float or None
        None: d ** -0.5, as transformers' attention functions.
    k_max : int
    softcap : float, optional

    Returns
    -------
    torch.Tensor, shape (B, H, k_max)
        float32, on the layer's device.
    """
    T = query.shape[-2]
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    mask = key_mask(mask, T)
    lse = row_lse(query, key, scale, mask=mask, softcap=softcap)
    if softcap is None:
        return alpha_from_lse(query, key, lse, scale, k_max, mask=mask)
    return softcapped_alpha(query, key, lse, scale, float(softcap), k_max, mask=mask)


def resid_stats(x: torch.Tensor, top_k: int, abs_threshold: float) -> dict:
    """The massive-activation statistics of one layer's residual stream (B, T, D), those
    ``analysis.chain.massive.MassiveAccumulator`` keeps: per sample the top-k |x| (values, flat indices) and the lower
    median of |x| over positions x dims; the first token's sum of x and of |x| and the later positions' max |x|
    summed over samples; and the candidates for Sun et al.'s flags, |x| above ``abs_threshold`` (few), as flat
    indices, values and their sample's median.

    Parameters
    ----------
    x : torch.Tensor, shape (B, T, D)
    top_k : int
    abs_threshold : float

    Returns
    -------
    dict of str to torch.Tensor
        "top" (B, 3 top_k + 1) float32: values, positions, dims, median; "first_sum", "first_abs", "other_max" (D,)
        float64; "cand" (n, 3) float64: flat index, |x|, median.
    """
    B, T, D = x.shape
    a = x.detach().float().abs()
    flat = a.reshape(B, -1)
    v, idx = top_k_abs(a, int(top_k))
    med = lower_median(flat)
    top = torch.cat([v, (idx // D).float(), (idx % D).float(), med[:, None]], -1)
    other = a[:, 1:].amax(dim=1).double().sum(0) if T > 1 else torch.zeros(D, dtype=torch.float64, device=x.device)
    f = (flat.reshape(-1) > abs_threshold).nonzero()[:, 0]
    cand = torch.stack([f.double(), flat.reshape(-1)[f].double(), med[f // flat.shape[1]].double()], 1)
    return {
        "top": top,
        "first_sum": x[:, 0].detach().double().sum(0),
        "first_abs": a[:, 0].double().sum(0),
        "other_max": other,
        "cand": cand,
    }


def position_stats(x: torch.Tensor) -> dict:
    """Per position of one layer's residual stream (B, T, D), what ``analysis.positions.every_sink.PositionAccumulator``
    keeps: the cosine of h_t to h_0, and the largest |h_t| and its dim (the same operations, so the same numbers).

    Parameters
    ----------
    x : torch.Tensor, shape (B, T, D)

    Returns
    -------
    dict of str to torch.Tensor
        "cos", "peak" (B, T) float32; "dim" (B, T) int32 (half the bytes of int64; D < 2**31).
    """
    x = x.detach().float()
    u = torch.nn.functional.normalize(x, dim=-1)
    peak, dim = x.abs().max(dim=-1)
    return {"cos": (u * u[:, :1]).sum(-1), "peak": peak, "dim": dim.int()}


def stats_bytes(stats) -> int:
    """The bytes of the tensors in a (nested) list / dict / tuple of statistics: what a request sends back.

    Parameters
    ----------
    stats : torch.Tensor, dict, list or tuple

    Returns
    -------
    int
    """
    if isinstance(stats, torch.Tensor):
        return stats.numel() * stats.element_size()
    if isinstance(stats, dict):
        return sum(stats_bytes(v) for v in stats.values())
    if isinstance(stats, (list, tuple)):
        return sum(stats_bytes(v) for v in stats)
    return 0
