"""Forward passes with the decoder's linear inputs (and weights) fake-quantised: calibration of per-tensor static
scales (with where each scale comes from) and the negative log-likelihood of held-out windows.

A window may follow a prefix: its keys and values are computed once in full precision and cached (a
``transformers`` ``DynamicCache``, copied for every batch), the window runs at positions P..P+T-1 on top of it,
and the prefix is never scored. A reference model (``ReferenceLM``) has no such cache path: its prefix is run
inline with the window, its rows kept in full precision (the same numbers: a causal prefix in full precision
does not see the window).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from analysis.model.causal import cache_keyword, new_cache
from analysis.quant.quantizers import quant_weight


@dataclass(frozen=True)
class Scheme:
    """One quantisation scheme.

    Attributes
    ----------
    a_bits : int or None
        Activation bits (None: full precision).
    granularity : {"tensor", "token"}
        Per-tensor static scales (from calibration) or per-token dynamic scales.
    w_bits : int or None
        Weight bits, per output channel (None: full precision).
    """

    a_bits: int | None
    granularity: str = "tensor"
    w_bits: int | None = None

    @property
    def label(self) -> str:
        if self.a_bits is None and self.w_bits is None:
            return "fp"
        a = f"A{self.a_bits} per-{self.granularity}" if self.a_bits else "A16"
        return f"W{self.w_bits or 16}{a}"


@dataclass
class ScaleSite:
    """Where a per-tensor scale comes from: the largest |input| of one linear over the calibration tokens.

    Attributes
    ----------
    site : str
        ``layer.linear``.
    layer : int
    linear : str
    absmax : float
    window, position, dim, token_id : int
        The calibration window, position inside it, feature (input) dimension and token of that maximum.
    """

    site: str
    layer: int
    linear: str
    absmax: float
    window: int
    position: int
    dim: int
    token_id: int


@contextlib.contextmanager
def quantized_weights(sites, w_bits: int | None):
    """Weights fake-quantised per output channel while inside; restored after.

    Parameters
    ----------
    sites : list of LinearSite
    w_bits : int or None

    Returns
    -------
    contextmanager
    """
    saved = []
    if w_bits:
        with torch.no_grad():
            for s in sites:
                for w, axes in s.weights:
                    if not any(w is p for p, _ in saved):
                        saved.append((w, w.detach().clone()))
                        w.copy_(quant_weight(w, w_bits, axes))
    try:
        yield
    finally:
        with torch.no_grad():
            for w, orig in saved:
                w.copy_(orig)


@contextlib.contextmanager
def hooked(sites, fn_for_site):
    """Every site's input passed through ``fn_for_site(site)`` while inside.

    Parameters
    ----------
    sites : list of LinearSite
    fn_for_site : callable
        site -> (x -> x).

    Returns
    -------
    contextmanager
    """
    handles = [s.hook(fn_for_site(s)) for s in sites]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class PrefixRunner:
    """Runs windows (B, T) after a fixed prefix (its full-precision KV computed once), or alone.

    Attributes
    ----------
    hf : the causal LM (``analysis.streaming.backbone.causal_lm``)
    prefix : torch.Tensor of long, shape (P,)
    cached : bool
        True where the prefix's KV is a cached ``DynamicCache``; False: the prefix runs inline.
    """

    def __init__(self, hf, prefix=None):
        self.hf = hf
        self.prefix = torch.as_tensor(prefix if prefix is not None else [], dtype=torch.long)
        self.cache = new_cache(hf) if len(self.prefix) else None  # None: a reference model runs its prefix inline
        self.cached = self.cache is not None
        if self.cached:
            with torch.no_grad():
                hf(input_ids=self.prefix[None], **{cache_keyword(hf): self.cache}, use_cache=True)

    @property
    def P(self) -> int:
        return len(self.prefix)

    def logits(self, ids: torch.Tensor, keep: torch.Tensor | None, set_keep) -> torch.Tensor:
        """Logits (B, T, V) of the window tokens; ``set_keep`` receives the (B, T') full-precision row mask."""
        B, T = ids.shape
        if self.cached:
            cache = copy.deepcopy(self.cache)
            cache.batch_repeat_interleave(B)
            set_keep(keep)
            pos = torch.arange(self.P, self.P + T)[None].expand(B, -1)
            return self.hf(input_ids=ids, position_ids=pos, **{cache_keyword(self.hf): cache}, use_cache=True).logits
        if self.P:
            ids = torch.cat([self.prefix[None].expand(B, -1), ids], dim=1)
            pre = torch.ones(B, self.P, dtype=torch.bool)
            keep = torch.cat([pre, keep if keep is not None else torch.zeros(B, T, dtype=torch.bool)], dim=1)
        set_keep(keep)
        return self.hf(input_ids=ids).logits[:, self.P :]
