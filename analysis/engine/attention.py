"""A layer's attention probabilities as the reductions read them, from a T x T map or from q, k and the log-sum-exp.

Every analysis that reads attention asks for ``hook_pattern`` by its TransformerLens name; what it gets depends on
the backend that ran the pass (``analysis.engine.backends``): the bridge hands the map it built (B, H, T, T), the
transformers backend hands the queries and keys the attention used (after the rotary and any q/k norm), each query
row's log-sum-exp and the mask, so that no T x T map is ever built. :func:`attention_of` wraps either as an
:class:`AttentionWeights`, and the reductions (the first key's column, alpha_k, the attention-weighted mean of a
per-key quantity, a band of diagonals, whole rows for a view) are written once against it:

    A[i, j] = exp(scale * q_i . k_j - lse_i)       (j <= i and not masked)

computed in blocks of query rows, each block against the keys its rows can see. Under grouped-query attention each
KV head's keys meet the queries of its group in one product, never repeated per query head.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

from analysis.core.docs import parameters_from
from analysis.core.reductions import ALPHA_CHUNK_ELEMENTS, alpha_from_lse, block_rows, hide_scores


COLUMNS_KEPT = 16  # key columns a layer's weights keep for its reductions to share (alpha_1..16): (B, H, T, 16) floats


class AttentionWeights:
    """A layer's attention probabilities A of shape (B, H, T, T), held as a map or as q, k and the log-sum-exp.

    Parameters
    ----------
    pattern : torch.Tensor, shape (B, H, T, T), optional
        The map itself (the bridge's ``hook_pattern``).
    query : torch.Tensor, shape (B, H, T, d), optional
        The queries the attention used.
    key : torch.Tensor, shape (B, H_kv, T, d), optional
        Its keys (H a multiple of H_kv).
    lse : torch.Tensor, shape (B, H, T), optional
        Each query row's log-sum-exp of its scores (a learned sink logit included, where the family has one).
    scale : float
        The score scale.
    mask : torch.Tensor, shape (B, 1 or H, T, T), optional
        None: causal; boolean (True = attend) or additive float (-inf = hidden).
    chunk_elements : int
        The most scores held at a time.
    softcap : float, optional
        Gemma 2's cap, applied to the scaled scores before the softmax: cap * tanh(scores / cap).
    sinks : torch.Tensor, shape (H,), optional
        Learned sink logits (gpt-oss), an extra column of every row's softmax that ``lse`` includes.
    """

    def __init__(
        self,
        *,
        pattern: Optional[torch.Tensor] = None,
        query: Optional[torch.Tensor] = None,
        key: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        scale: float = 1.0,
        mask: Optional[torch.Tensor] = None,
        chunk_elements: int = ALPHA_CHUNK_ELEMENTS,
        softcap: Optional[float] = None,
        sinks: Optional[torch.Tensor] = None,
    ):
        if pattern is None and (query is None or key is None or lse is None):
            raise ValueError("AttentionWeights needs the pattern, or the query, key and log-sum-exp.")
        self.pattern, self.query, self.key, self.lse = pattern, query, key, lse
        self.scale, self.mask, self.chunk = float(scale), mask, int(chunk_elements)
        self.softcap, self.sinks = None if softcap is None else float(softcap), sinks
        self._cols: Optional[torch.Tensor] = None  # the first key columns, once computed (``columns``)
        self._sums: Optional[torch.Tensor] = None  # their sums over the queries, float64, once taken (``alpha``)
        self._full: Optional[torch.Tensor] = None  # the whole map, once built (``_map``)
        self._source: Optional[bool] = None  # ``share``'s decision: the map is every read's source, or never kept
        ref = pattern if pattern is not None else query
        self.shape = tuple(pattern.shape) if pattern is not None else (*query.shape[:3], query.shape[2])
        self.device, self.dtype = ref.device, ref.dtype

    @classmethod
    def from_qk(cls, query, key, *, scale: float, mask=None, softcap=None, sinks=None) -> "AttentionWeights":
        """The weights of the queries and keys an attention function received (its mask cut to the keys and made
        boolean, :func:`key_mask`), with each row's log-sum-exp taken here in blocks of rows (:func:`row_lse`), a
        learned sink logit per head (``sinks``) joined to it."""
        mask = key_mask(mask, query.shape[-2])
        lse = row_lse(query, key, scale, mask=mask, softcap=softcap, sinks=sinks)
        return cls(query=query, key=key, lse=lse, scale=scale, mask=mask, softcap=softcap, sinks=sinks)

    # -- blocks of A from q, k and the lse ------------------------------------------------------------------------

    def _capped(self, sc: torch.Tensor) -> torch.Tensor:
        """Scaled scores as the softmax takes them: soft-capped where the model caps them (Gemma 2)."""
        return sc if self.softcap is None else torch.tanh(sc / self.softcap) * self.softcap

    def _blocks(self, keys: Optional[int] = None) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(s, e, A[:, :, s:e, :kc]) over blocks of query rows, kc = min(e, keys): float32, (B, H, e - s, kc)."""
        B, H, T, d = self.query.shape
        keys = T if keys is None else min(int(keys), T)
        H_kv = self.key.shape[1]
        g = H // H_kv
        q = self.query.float().unflatten(1, (H_kv, g))
        k = self.key[..., :keys, :].float()
        lse = self.lse.float().unflatten(1, (H_kv, g))
        rows = block_rows(B, H, keys, self.chunk)
        for s in range(0, T, rows):
            e = min(s + rows, T)
            kc = min(e, keys)
            sc = (
                (q[..., s:e, :].reshape(B, H_kv, g * (e - s), d) @ k[..., :kc, :].transpose(-1, -2))
                .view(B, H_kv, g, e - s, kc)
                .mul_(self.scale)
            )
            sc = self._capped(sc).sub_(lse[..., s:e, None]).exp_()
            hide_scores(sc, s, e, kc, self.mask, 0.0)
            yield s, e, sc.flatten(1, 2)

    def _map(self, build: bool = True) -> Optional[torch.Tensor]:
        """The whole map from q, k and the lse, float32 (B, H, T, T), kept once built: only while it is one block of
        ``_blocks`` (at most ``chunk_elements`` scores, what a block holds anyway), so the full-row reductions of a
        layer (``weighted``, the diagonals, rows) share one product of q and k. None past that, or (``build``
        False) before a reduction built it. After :meth:`share`: the layer's map, built by its first reader (every
        read's source), or never kept."""
        full, source = self._full, self._source
        if full is not None or self.pattern is not None or not (build or source):
            return full
        B, H, T, _ = self.shape
        if block_rows(B, H, T, self.chunk) < T:
            return None
        full = next(self._blocks())[2]
        if source is not False:  # kept (two threads asking at once build the same bits; one is kept)
            self._full = full
        return full

    def share(self, rows: bool) -> None:
        """Fix, before any reads, what this layer's readers share (``engine.passes._feed``): the map is the source of
        every read where one of them reads whole rows (``rows``), built by the first to ask; otherwise a map is never
        kept. Every number then comes from the same products of q and k whichever reader, order or thread asks."""
        self._source = bool(rows)

    def _pattern(self, k_max: Optional[int] = None) -> torch.Tensor:
        """The map's first ``k_max`` key columns (all: None) with the entries above the diagonal zeroed, float32."""
        T = self.shape[-1]
        cols = self.pattern[..., :, : (T if k_max is None else min(int(k_max), T))].float()
        later = torch.arange(T, device=self.device)[:, None] < torch.arange(cols.shape[-1], device=self.device)
        return cols.masked_fill(later, 0.0)

    # -- what the reductions read ---------------------------------------------------------------------------------

    def columns(self, k_max: int) -> torch.Tensor:
        """A[..., :, :k_max]: the attention every query gives keys 1..k_max, float32 (B, H, T, k_max). Up to
        ``COLUMNS_KEPT`` keys, the first ``COLUMNS_KEPT`` columns are computed and kept at the first ask, so the
        reductions of one layer (alpha, the first key's column) share one pass over the query rows, and every ask
        is a slice of the same numbers."""
        T = self.shape[-1]
        k, cols, full = min(int(k_max), T), self._cols, self._map(build=False)  # each read once
        if cols is not None and cols.shape[-1] >= k:
            return cols[..., :k]
        width = k if k > COLUMNS_KEPT else min(T, COLUMNS_KEPT)
        if self.pattern is not None:
            out = self._pattern(width)
        elif full is not None:
            out = full[..., :width]
        else:
            out = torch.zeros(*self.shape[:3], width, device=self.device)
            for s, e, a in self._blocks(width):
                out[..., s:e, : a.shape[-1]] = a
        if width == min(T, COLUMNS_KEPT):
            self._cols = out
        return out[..., :k]

    def column(self, j: int) -> torch.Tensor:
        """A[..., :, j] (0-based key j): the attention every query gives key j + 1, float32 (B, H, T)."""
        return self.columns(j + 1)[..., j]

    def alpha(self, k_max: int) -> torch.Tensor:
        """alpha_k for keys 1..k_max (the mean attention key k receives from the queries i >= k), float32
        (B, H, k_max); the same as ``analysis.sinks.metric.alpha_from_pattern`` on the map. Past ``COLUMNS_KEPT``
        keys of q, k and the lse, the column sums stream over blocks of query rows (every key: never T x T)."""
        T = self.shape[-1]
        k_max = min(int(k_max), T)
        counts = (T - torch.arange(k_max, device=self.device)).double()
        if self.pattern is not None and k_max > COLUMNS_KEPT:  # a map's columns past those kept
            return (self.columns(k_max).sum(-2, dtype=torch.float64) / counts).float()
        if k_max <= COLUMNS_KEPT:  # one column sum for every alpha of the layer
            sums = self._sums
            if sums is None:
                sums = self._sums = self.columns(COLUMNS_KEPT).sum(-2, dtype=torch.float64)
            return (sums[..., :k_max] / counts).float()
        if self.softcap is not None:  # the cap is not a factor of q . k: sum the blocks
            sums = torch.zeros(*self.shape[:2], k_max, dtype=torch.float64, device=self.device)
            for _, _, a in self._blocks(k_max):
                sums[..., : a.shape[-1]] += a.sum(-2)
            return (sums / counts).float()
        return alpha_from_lse(
            self.query, self.key, self.lse, self.scale, k_max, mask=self.mask, chunk_elements=self.chunk
        )

    def row_sums(self) -> torch.Tensor:
        """Each query's total attention on the input tokens, float32 (B, H, T): 1 less any share on an extra slot
        (a learned sink logit, a sink token's slot). From q, k and the lse: 1 less the sink logit's share, or one."""
        if self.pattern is not None:
            return self.pattern.float().sum(-1)
        if self.sinks is None:
            return torch.ones(self.shape[:3], device=self.device)
        return 1.0 - (self.sinks.float().view(1, -1, 1) - self.lse.float()).exp()

    def weighted(self, x: torch.Tensor) -> torch.Tensor:
        """sum_j A[i, j] x_j for a per-key quantity x of shape (B, H, T): float32 (B, H, T). From q and k it is an
        attention whose value is x, so PyTorch's fused attention gives it (the softmax's own normaliser is the
        lse); under a soft cap, blocks of A."""
        if self.pattern is not None:
            return torch.einsum("bhij,bhj->bhi", self.pattern.float(), x.float())
        if (full := self._map()) is not None:
            return torch.einsum("bhij,bhj->bhi", full, x.float())
        if self.softcap is None:
            g = self.shape[1] // self.key.shape[1]
            k = self.key.float().repeat_interleave(g, dim=1) if g > 1 else self.key.float()
            mask = self.mask if self.mask is None or self.mask.dtype == torch.bool else self.mask.float()
            return torch.nn.functional.scaled_dot_product_attention(
                self.query.float(), k, x.float()[..., None], attn_mask=mask, is_causal=mask is None, scale=self.scale
            )[..., 0] * (1.0 if self.sinks is None else self.row_sums())  # SDPA's rows sum to one
        out = torch.empty(self.shape[:3], device=self.device)
        for s, e, a in self._blocks():
            out[..., s:e] = (a * x[..., None, : a.shape[-1]].float()).sum(-1)
        return out

    def diagonal(self, offset: int = 0) -> torch.Tensor:
        """A[i, i - offset] for i >= offset: each query's attention on itself (0) or on the key ``offset`` before it,
        float32 (B, H, T - offset)."""
        if self.pattern is not None:
            return self.pattern.float().diagonal(-offset, dim1=-2, dim2=-1)
        if (full := self._map(build=False)) is not None:
            return full.diagonal(-offset, dim1=-2, dim2=-1)
        B, H, T, d = self.query.shape
        g = H // self.key.shape[1]
        k = self.key.float().repeat_interleave(g, dim=1) if g > 1 else self.key.float()
        sc = (self.query[..., offset:, :].float() * k[..., : T - offset, :]).sum(-1) * self.scale
        out = (self._capped(sc) - self.lse[..., offset:].float()).exp()
        if self.mask is not None:
            m = self.mask.diagonal(-offset, dim1=-2, dim2=-1)
            out = out.masked_fill(~m if m.dtype == torch.bool else m == float("-inf"), 0.0)
        return out

    def row(self, i: int) -> torch.Tensor:
        """A[..., i, :]: query i's attention on every key (0 after it), float32 (B, H, T); -1 the last query."""
        if self.pattern is not None:
            return self.pattern[..., i, :].float()
        if (full := self._map(build=False)) is not None:
            return full[..., i, :]
        B, H, T, d = self.query.shape
        i = i % T
        g = H // self.key.shape[1]
        q = self.query[..., i, :].float().unflatten(1, (self.key.shape[1], g))  # (B, H_kv, g, d)
        sc = (q @ self.key[..., : i + 1, :].float().transpose(-1, -2)).flatten(1, 2) * self.scale  # (B, H, i + 1)
        a = (self._capped(sc) - self.lse[..., i, None].float()).exp()
        if self.mask is not None:
            m = self.mask[..., i, : i + 1]
            a = a.masked_fill(~m if m.dtype == torch.bool else m == float("-inf"), 0.0)
        return torch.nn.functional.pad(a, (0, T - i - 1))

    def dense(self, rows: slice = slice(None)) -> torch.Tensor:
        """The map's query rows ``rows`` (a view, or the analyses that read whole rows), float32 (B, H, r, T)."""
        if self.pattern is not None:
            return self.pattern[..., rows, :].float()
        if (full := self._map()) is not None:
            return full[..., rows, :]
        B, H, T, _ = self.shape
        out = torch.zeros(B, H, T, T, device=self.device)
        for s, e, a in self._blocks():
            out[..., s:e, : a.shape[-1]] = a
        return out[..., rows, :]


def key_mask(mask: Optional[torch.Tensor], T: int) -> Optional[torch.Tensor]:
    """An attention function's mask cut to the ``T`` keys (a 4-d mask may be longer) and made boolean (True =
    attend): an additive mask's hidden entries (-inf, or the dtype's minimum as eager attention writes them) are
    those far below zero. None stays None (causal).

    Parameters
    ----------
    mask : torch.Tensor or None
        (B, 1 or H, T, >= T), boolean (True = attend) or additive float.
    T : int

    Returns
    -------
    torch.Tensor or None
    """
    if mask is None:
        return None
    if mask.ndim == 4:
        mask = mask[..., :T]
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


@parameters_from(alpha_from_lse)
def row_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: float,
    *,
    mask: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    value: Optional[torch.Tensor] = None,
    chunk_elements: int = ALPHA_CHUNK_ELEMENTS,
):
    """Each query row's log-sum-exp over the keys it sees (causal, and a boolean ``mask``), soft-capped where
    asked, in blocks of query rows, never a T x T map; with ``value``, the attention's output too, from the same
    block of scores (the soft-capped attention of Gemma 2, which no fused kernel takes).

    Parameters
    ----------
    query, key, scale, chunk_elements
        As in :func:`alpha_from_lse`.
    mask : torch.Tensor, optional
        (B, 1 or H, T, T) boolean (True = attend).
    softcap : float, optional
        Gemma 2's cap: scores = cap * tanh(scores / cap).
    sinks : torch.Tensor, optional
        A learned sink logit per head, (H,) (gpt-oss): a column without a value, joined to every row.
    value : torch.Tensor, optional
        (B, H_kv, T, dv).

    Returns
    -------
    torch.Tensor, shape (B, H, T), or (it, the output (B, H, T, dv) in value's dtype) with ``value``
        float32.
    """
    B, H, T, d = query.shape
    H_kv = key.shape[1]
    q, k, v = query.float().unflatten(1, (H_kv, H // H_kv)), key.float(), None if value is None else value.float()
    sink = None if sinks is None else sinks.float().view(1, H_kv, -1, 1)
    rows = block_rows(B, H, T, chunk_elements)
    lse, out = [], []
    for s in range(0, T, rows):
        e = min(s + rows, T)  # keys 0..e-1: the later ones are hidden anyway
        sc = (q[..., s:e, :].reshape(B, H_kv, -1, d) @ k[..., :e, :].transpose(-1, -2)).view(B, H_kv, -1, e - s, e)
        sc = sc.mul_(scale) if softcap is None else torch.tanh(sc * scale / softcap) * softcap
        hide_scores(sc, s, e, e, mask, -math.inf)
        lse.append(_join_sinks(sc.logsumexp(-1), sink))
        if v is not None:  # a row that sees no key (-inf) gives zeros
            out.append(sc.sub_(lse[-1].nan_to_num(neginf=0.0)[..., None]).exp_() @ v[:, :, None, :e])
    lse = torch.cat(lse, dim=-1).flatten(1, 2)
    return lse if v is None else (lse, torch.cat(out, dim=-2).flatten(1, 2).to(value.dtype))


def _join_sinks(lse: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Each row's log-sum-exp with its head's learned sink logit (``sinks`` broadcast to ``lse``) joined, or as is."""
    return lse if sinks is None else torch.logaddexp(lse, sinks)


def attention_of(x) -> AttentionWeights:
    """``x`` as :class:`AttentionWeights`: a map (B, H, T, T) is wrapped, weights are returned as they are.

    Parameters
    ----------
    x : torch.Tensor or AttentionWeights
        What a pass handed for ``hook_pattern``.

    Returns
    -------
    AttentionWeights
    """
    return x if isinstance(x, AttentionWeights) else AttentionWeights(pattern=x)
