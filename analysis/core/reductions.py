"""Exact reductions on the tensor's own device, by selection rather than a sort: the k-th smallest value and the lower
median (a radix select over the floats' bit patterns, a few ``bincount`` passes), the k largest |x| of each sample
(``torch.topk``, itself a selection on the CPU and on CUDA, over the k + 1 rows with the largest maxima), and alpha of
the first keys from q, k and each query row's log-sum-exp, in blocks of rows (never T x T).

Why not ``torch.median``: on CUDA it selects with one thread block per slice, so the median over one sample's
T x D residual stream (e.g. 33 M values at T = 8,192 on an 8B model) runs on one of the GPU's 132 multiprocessors.
A radix select counts the values' leading 16 bits in one histogram over every slice at once (``bincount``, all the
GPU), keeps the bin that holds rank k, and counts the next 16 bits among the values in that bin: two passes for
float32, one for bfloat16 and float16, four for float64, each a read of the tensor.

This module imports only torch, math and typing: a later backend (e.g. nnsight's) imports it as it is.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

RADIX_BITS = 16  # bits counted per pass: 2 passes for float32, 1 for 16-bit floats
RADIX_MAX_BINS = 2**24  # slices x 2**RADIX_BITS above this (many short slices): torch.kthvalue selects per slice
ALPHA_CHUNK_ELEMENTS = 2**22  # scores per block of query rows (16 MiB in float32)

_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """Signed integers in the order of ``x``'s floats: -inf < ... < -0.0 < +0.0 < ... < +inf (NaNs at the ends).

    Parameters
    ----------
    x : torch.Tensor
        float16, bfloat16, float32 or float64.

    Returns
    -------
    torch.Tensor
        int32 (16- and 32-bit floats) or int64, ``x``'s shape, on ``x``'s device.
    """
    if x.dtype not in FLOATS:
        raise TypeError(f"ordered_keys takes a floating tensor ({FLOATS}); got {x.dtype}.")
    nbits = 8 * x.element_size()
    bits = x.contiguous().view(_INTS[x.element_size()])
    bits = bits.long() if nbits == 64 else bits.int()  # 16-bit patterns sign-extend into int32
    return bits ^ ((bits >> (nbits - 1)) & ((1 << (nbits - 1)) - 1))  # negatives: flip every bit but the sign


def keys_to_floats(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`ordered_keys` (the map is its own inverse on the bit patterns).

    Parameters
    ----------
    keys : torch.Tensor
        Integers from :func:`ordered_keys`.
    dtype : torch.dtype
        The floats they came from.

    Returns
    -------
    torch.Tensor
    """
    size = torch.empty((), dtype=dtype).element_size()
    nbits = 8 * size
    keys = keys.long()
    bits = keys ^ ((keys >> (nbits - 1)) & ((1 << (nbits - 1)) - 1))  # in the signed range of the float's width
    return bits.to(_INTS[size]).view(dtype)


def radix_select(x: torch.Tensor, k: torch.Tensor | int, *, bits: int = RADIX_BITS) -> torch.Tensor:
    """The (k+1)-th smallest value of each row of ``x`` (S, n) (0-based rank ``k``), by a radix select over the bit
    patterns: per pass, one ``bincount`` over every row's next ``bits`` bits among the values still in the running.

    NaNs take part as values beyond +-inf (by their sign); :func:`kth_smallest` handles them as torch does.

    Parameters
    ----------
    x : torch.Tensor, shape (S, n)
        Floating values.
    k : int or torch.LongTensor, shape (S,)
        0-based ranks, in [0, n).
    bits : int
        Bits per pass (a divisor of the float's width: 8 or 16).

    Returns
    -------
    torch.Tensor, shape (S,)
        ``x``'s dtype.
    """
    S, n = x.shape
    nbits = 8 * x.element_size()
    if nbits % bits:
        raise ValueError(f"bits must divide {nbits}; got {bits}.")
    keys = ordered_keys(x)
    width = 1 << bits
    rank = torch.as_tensor(k, device=x.device).long().expand(S).clone()
    idx_type = torch.int32 if S * width < 2**31 - 1 else torch.long  # bin indices: half the memory where they fit
    rows = (torch.arange(S, device=x.device)[:, None] * width).to(idx_type)
    prefix = torch.zeros(S, dtype=torch.long, device=x.device)
    for shift in range(nbits - bits, -1, -bits):
        digit = keys >> shift
        if shift == nbits - bits:  # the leading digit: signed, shifted into [0, width)
            idx = (digit + width // 2).to(idx_type) + rows
        else:  # only the values whose leading bits equal the prefix chosen so far
            idx = torch.where(
                (keys >> (shift + bits)) == prefix[:, None], (digit & (width - 1)).to(idx_type) + rows, S * width
            )
        hist = torch.bincount(idx.flatten(), minlength=S * width + 1)[: S * width].view(S, width)
        cum = hist.cumsum(-1)
        d = (cum <= rank[:, None]).sum(-1)  # the first digit whose running count passes the rank
        rank -= torch.where(d > 0, cum.gather(1, (d - 1).clamp_min(0)[:, None])[:, 0], 0)
        prefix = prefix * width + (d - width // 2 if shift == nbits - bits else d)
    return keys_to_floats(prefix, x.dtype)


def kth_smallest(x: torch.Tensor, k: int, *, dim: int = -1, method: str = "auto") -> torch.Tensor:
    """The (k+1)-th smallest value along ``dim`` (0-based ``k``), exact, NaN where the slice holds a NaN (as
    ``torch.median`` and ``torch.kthvalue`` on CUDA), found on ``x``'s device by selection.

    Parameters
    ----------
    x : torch.Tensor
        float16, bfloat16, float32 or float64.
    k : int
        0-based rank, in [0, x.shape[dim]).
    dim : int
        The axis reduced.
    method : {"auto", "radix", "kthvalue"}
        "radix": :func:`radix_select` (few long slices: one histogram over all of them); "kthvalue":
        ``torch.kthvalue`` (a quickselect on the CPU, one radix select per slice on CUDA: many short slices);
        "auto": kthvalue on the CPU and where slices x 2**RADIX_BITS passes ``RADIX_MAX_BINS``, else radix.

    Returns
    -------
    torch.Tensor
        ``x``'s shape without ``dim``, ``x``'s dtype.
    """
    n = x.shape[dim]
    if not 0 <= int(k) < n:
        raise ValueError(f"k must lie in [0, {n}); got {k}.")
    rows = x.movedim(dim, -1)
    shape = rows.shape[:-1]
    rows = rows.reshape(-1, n)
    if method == "auto":
        many = rows.shape[0] * (1 << RADIX_BITS) > RADIX_MAX_BINS
        method = "kthvalue" if x.device.type == "cpu" or many else "radix"
    if method == "radix":
        out = radix_select(rows, int(k))
    elif method == "kthvalue":
        out = rows.kthvalue(int(k) + 1, dim=-1).values
    else:
        raise ValueError(f"method must be 'auto', 'radix' or 'kthvalue'; got {method!r}.")
    out = torch.where(rows.isnan().any(-1), torch.full_like(out, math.nan), out)
    return out.reshape(shape)


def lower_median(x: torch.Tensor, *, dim: int = -1, method: str = "auto") -> torch.Tensor:
    """``x.median(dim).values`` on ``x``'s device by selection: the lower of the two middle values for an even
    count, NaN where a slice holds a NaN.

    Parameters
    ----------
    x : torch.Tensor
    dim : int
        The axis reduced.
    method : {"auto", "radix", "kthvalue"}
        As in :func:`kth_smallest`.

    Returns
    -------
    torch.Tensor
        ``x``'s shape without ``dim``.
    """
    if x.numel() == 0 or x.dtype not in FLOATS:
        return x.median(dim=dim).values
    return kth_smallest(x, (x.shape[dim] - 1) // 2, dim=dim, method=method)


def top_k_abs(a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``a.reshape(B, -1).topk(k, dim=-1)`` of a (B, T, D) (e.g. |x|), read off the k + 1 rows with the largest
    maxima: they hold a sample's k + 1 largest values, so where those are all distinct the top k (values, flat
    indices) are unique and equal torch's; samples with ties (or NaN) among them take topk over the whole sample,
    which decides among equal values. ``topk`` selects (a radix select on CUDA, a partial selection on the CPU):
    no sort of the sample's T x D values.

    Parameters
    ----------
    a : torch.Tensor, shape (B, T, D)
    k : int

    Returns
    -------
    values : torch.Tensor, shape (B, k)
        Descending.
    indices : torch.LongTensor, shape (B, k)
        Flat indices into (T x D).
    """
    B, T, D = a.shape
    flat = a.reshape(B, -1)
    if T <= k:
        return flat.topk(k, dim=-1)
    rows = a.amax(-1).topk(k + 1, dim=-1).indices  # (B, k + 1)
    v, j = a.gather(1, rows[..., None].expand(B, k + 1, D)).reshape(B, -1).topk(k + 1, dim=-1)
    idx = rows.gather(1, j // D) * D + j % D
    v, idx, tied = v[:, :k].contiguous(), idx[:, :k].contiguous(), ~(v[:, :-1] > v[:, 1:]).all(-1)
    if tied.any():  # one flag to the host; the rare tied samples take the full topk
        v[tied], idx[tied] = flat[tied].topk(k, dim=-1)
    return v, idx


# ---------------------------------------------------------- alpha of the first keys from q, k and the rows' log-sum-exp


def hide_scores(scores: torch.Tensor, s: int, e: int, kc: int, mask: Optional[torch.Tensor], fill: float) -> None:
    """Set, in place, the entries of a block of scores (B, H_kv, g, e - s, kc) (query rows s..e-1 against keys
    0..kc-1) that a query does not see to ``fill``: the keys after it (j > i) and those ``mask`` hides ((B, 1 or H,
    T, T) boolean, True = attend, or additive float, -inf = hidden).

    Parameters
    ----------
    scores : torch.Tensor, shape (B, H_kv, g, e - s, kc)
    s, e, kc : int
        The block's first and past-last query rows, and its keys.
    mask : torch.Tensor or None
    fill : float

    Returns
    -------
    None
    """
    if kc > s + 1 and fill == 0.0:  # keys after the query in the block's diagonal part: tril_, no broadcast mask
        scores[..., s:kc].tril_()
    elif kc > s + 1:
        later = torch.arange(s, kc, device=scores.device)[None, :] > torch.arange(s, e, device=scores.device)[:, None]
        scores[..., s:kc].masked_fill_(later, fill)
    if mask is not None:
        m = mask[..., s:e, :kc]
        hidden = ~m if m.dtype == torch.bool else m == float("-inf")
        H_kv, group = scores.shape[1:3]
        scores.masked_fill_(hidden[:, :, None] if hidden.shape[1] == 1 else hidden.unflatten(1, (H_kv, group)), fill)


def block_rows(B: int, H: int, keys: int, chunk_elements: int) -> int:
    """Query rows per block so that a block's scores (B x H x rows x keys) stay near ``chunk_elements`` (>= 16).

    Parameters
    ----------
    B, H, keys, chunk_elements : int

    Returns
    -------
    int
    """
    return max(16, int(chunk_elements) // max(1, B * H * keys))


def alpha_from_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    k_max: int,
    *,
    mask: Optional[torch.Tensor] = None,
    chunk_elements: int = ALPHA_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """alpha_k for keys 1..k_max: the mean attention key k receives over the queries that can see it, each query
    counted T - k + 1 times (1-based k); entries the mask hides (sliding windows) count as zero attention.
    ``mask``: None (causal) or (B, 1 or H, T, T), boolean (True = attend) or additive float (-inf = hidden).

    The column sums of A[i, k] = exp(q_i . k_k * scale - lse_i) are taken over blocks of query rows, each block
    against the keys its rows can see (j <= i), with at most ``chunk_elements`` scores at a time: O(rows x k_max)
    memory, never T x T. Query head h reads KV head h // (H / H_kv); each KV head's keys meet the queries of its
    group in one matrix product (no repeat of K per query head). q and k are those the attention used (after the
    rotary and any q/k norm).

    Parameters
    ----------
    query : torch.Tensor, shape (B, H, T, d)
    key : torch.Tensor, shape (B, H_kv, T, d)
    lse : torch.Tensor, shape (B, H, T)
        The rows' log-sum-exp.
    scale : float
    k_max : int
    mask : torch.Tensor, shape (B, 1 or H, T, T), optional
    chunk_elements : int
        The most scores held at a time.

    Returns
    -------
    torch.Tensor, shape (B, H, k_max)
        float32.
    """
    B, H, T, d = query.shape
    k_max = min(int(k_max), T)
    H_kv = key.shape[1]
    group = H // H_kv
    q = query.float().unflatten(1, (H_kv, group))  # (B, H_kv, g, T, d)
    keys = key[..., :k_max, :].float()  # (B, H_kv, K, d)
    lse = lse.float().unflatten(1, (H_kv, group))  # (B, H_kv, g, T)
    rows = block_rows(B, H, k_max, chunk_elements)
    sums = torch.zeros(B, H_kv, group, k_max, dtype=torch.float64, device=query.device)
    for s in range(0, T, rows):
        e = min(s + rows, T)
        kc = min(e, k_max)  # the keys a query row of this block can see: j <= i < e
        sc = q[..., s:e, :].reshape(B, H_kv, group * (e - s), d) @ keys[..., :kc, :].transpose(-1, -2)
        sc = sc.view(B, H_kv, group, e - s, kc).mul_(scale).sub_(lse[..., s:e, None]).exp_()
        hide_scores(sc, s, e, kc, mask, 0.0)
        sums[..., :kc] += sc.sum(dim=-2)
    counts = (T - torch.arange(k_max, device=query.device)).double()  # T - k + 1 for 1-based k
    return (sums / counts).float().flatten(1, 2)
