"""Bounded KV caches for streaming: dense, window, sinks + window (StreamingLLM), simulated KV quantisation.

``StreamingCache`` is a ``transformers.Cache`` (the installed transformers 5 API; ``SinkCache`` was removed
there). Positions follow StreamingLLM: inside the cache, so the query always sees the sinks at distance
capacity-1-i however long the stream; rotary keys are re-rotated as the window moves (how, without
re-rotating the whole cache every step: ``StreamingLayer``), with ``analysis.model.rotary`` (the one rotary
implementation; ``rope_spec`` reads ``inv_freq`` from the backbone, ``analysis.streaming.generate`` reads each
layer's from ``analysis.model.families.decoder_positions``); a model without rotary embeddings needs no re-rotation.
The same cache serves ``model.generate`` (``analysis.streaming.generate.sink_cache``): generate numbers the tokens
0, 1, 2... as this cache expects, and ``get_mask_sizes`` places the query at the last slot.

KV quantisation is simulated: a token's keys and values are quantised per token and head (asymmetric
min-max over the head dimension, ``bits`` bits) when they enter the cache, and stored de-quantised; the
first ``fp_tokens`` cache slots (the sinks) can be kept in full precision, as IntactKV keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from analysis.model.causal import rotary_frequencies
from analysis.model.rotary import rotate

POLICY_KINDS = ("dense", "window", "sinks", "recompute")


@dataclass(frozen=True)
class Policy:
    """One cache policy.

    Attributes
    ----------
    kind : {"dense", "window", "sinks", "recompute"}
        Keep everything, a sliding window, sinks + a window, or re-compute the window from scratch.
    window : int or None
        Every kept token (sinks included), as StreamingLLM's "s + w" counts s + (window - s).
    sinks : int
        The sink slots kept (``kind="sinks"``).
    sink_tokens : {"first", "newline"}
        "first" keeps the stream's first tokens, "newline" replaces them by newline tokens first.
    bits : int or None
        Simulated KV quantisation (8, 4, 3 or 2); None: full precision.
    fp_sinks : bool
        Keep the first ``sinks`` slots in full precision.
    """

    kind: str
    window: int | None = None
    sinks: int = 0
    sink_tokens: str = "first"
    bits: int | None = None
    fp_sinks: bool = False

    def __post_init__(self):
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"unknown policy kind {self.kind!r}: use one of {POLICY_KINDS}.")
        if self.kind != "dense" and (self.window is None or self.window < 1):
            raise ValueError(f"policy {self.kind!r} needs a window of at least 1 token; got {self.window}.")
        if self.kind == "window" and self.sinks:
            raise ValueError("the window policy keeps no sinks; use kind='sinks' with sinks=s.")
        if self.kind == "sinks":
            if self.sinks < 0:
                raise ValueError(f"sinks must be >= 0; got {self.sinks}.")
            if self.sinks >= self.window:
                raise ValueError(
                    f"sinks={self.sinks} must be smaller than the window ({self.window}): the window counts the "
                    f"sinks too, so use sinks <= {self.window - 1} or a larger window."
                )
        if self.sink_tokens not in ("first", "newline"):
            raise ValueError(f"sink_tokens must be 'first' or 'newline'; got {self.sink_tokens!r}.")
        if self.bits is not None and self.bits not in (2, 3, 4, 8):
            raise ValueError(f"bits must be 8, 4, 3 or 2 (or None for full precision); got {self.bits}.")
        if self.fp_sinks and (self.bits is None or self.sinks < 1):
            raise ValueError("fp_sinks keeps the sink tokens in full precision: it needs bits and sinks >= 1.")

    @property
    def label(self) -> str:
        if self.kind == "dense":
            base = "dense"
        elif self.kind == "recompute":
            base = f"recompute {self.window}"
        else:
            s = self.sinks if self.kind == "sinks" else 0
            base = f"{s}+{self.window - s}" + (" newline" if self.sink_tokens == "newline" else "")
        if self.bits:
            base += f" int{self.bits}" + (" (sinks fp)" if self.fp_sinks else "")
        return base


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding acting on the first ``rot_dim`` dims.

    Attributes
    ----------
    inv_freq : torch.Tensor, shape (rot_dim / 2,)
        The inverse frequencies.
    style : {"half", "interleaved"}
        The pairing (``analysis.model.rotary``).
    rot_dim : int
        The rotated dims (a property).
    """

    inv_freq: torch.Tensor
    style: str = "half"

    @property
    def rot_dim(self) -> int:
        return 2 * self.inv_freq.numel()


def rope_spec(hf_model) -> RopeSpec | None:
    """The backbone's rotary embedding (its frequencies: ``analysis.model.causal.rotary_frequencies``), or None.

    Parameters
    ----------
    hf_model : transformers.PreTrainedModel

    Returns
    -------
    RopeSpec or None
    """
    found = rotary_frequencies(hf_model)
    if not found:
        return None
    freqs = [f for f, _ in found]
    if len({tuple(f.shape) for f in freqs}) > 1 or any(not torch.equal(f, freqs[0]) for f in freqs):
        raise NotImplementedError(
            f"{type(hf_model).__name__} has several rotary embeddings (e.g. local and global layers); streaming "
            "re-rotation supports one rotary embedding shared by every layer."
        )
    if found[0][1] == "dynamic":
        raise NotImplementedError("dynamic NTK rotary embeddings change with the sequence length; not supported.")
    return RopeSpec(freqs[0].detach().float().clone())


def _rotate_keys(keys: torch.Tensor, delta: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate keys (B, H, L, D) by ``delta`` (L,) positions, with ``analysis.model.rotary.rotate``."""
    out = rotate(keys.transpose(1, 2), delta, None, rot_dim=spec.rot_dim, style=spec.style, inv_freq=spec.inv_freq)
    return out.transpose(1, 2).to(keys.dtype)


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-token asymmetric min-max quantisation over the last dim, returned de-quantised.

    Parameters
    ----------
    x : torch.Tensor, shape (..., D)
    bits : int
        2**bits levels from each row's min to its max.

    Returns
    -------
    torch.Tensor, shape (..., D)
    """
    lo = x.amin(dim=-1, keepdim=True)
    hi = x.amax(dim=-1, keepdim=True)
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).clamp_min(torch.finfo(x.dtype).tiny)
    return torch.round((x - lo) / scale).clamp(0, levels) * scale + lo


class StreamingLayer(DynamicLayer):
    """One layer's keys and values for a batch of streams that share a length and a capacity but may differ
    in sinks and KV precision (one policy per batch row).

    Positions: the model rotates each key at its absolute stream position t (the caller passes
    ``position_ids = t``), so a kept recent key and the query keep their true distance, the same distance
    StreamingLLM gets by numbering the cache 0..capacity-1. The sinks are the exception: in StreamingLLM they
    sit at positions 0..s-1 while the query sits at capacity-1, so after E evictions each sink key is
    rotated forward by E positions, from its stored original (no error accumulates). Once the cache is
    full a new token overwrites the oldest recent slot in place (a ring buffer: softmax attention of one
    query does not depend on the order of the keys), so a step copies nothing but the new token."""

    def __init__(
        self,
        rope: RopeSpec | None,
        capacity: int | None,
        sinks: list[int],
        bits: list[int | None],
        fp_tokens: list[int],
    ):
        super().__init__()
        self.rope, self.capacity = rope, capacity
        self.sinks, self.bits, self.fp_tokens = list(sinks), list(bits), list(fp_tokens)
        self.n_seen = 0  # tokens that entered this layer
        self.ptr = None  # (B,) next slot to overwrite once full
        self.sink_keys = None  # (B, H, max sinks, D) as stored when they entered

    @property
    def evictions(self) -> int:
        return 0 if self.capacity is None else max(0, self.n_seen - self.capacity)

    def _quantize(self, x: torch.Tensor, start: int) -> torch.Tensor:
        slot = torch.arange(start, start + x.shape[-2], device=x.device)
        fp = torch.tensor(self.fp_tokens, device=x.device)
        for b in sorted({b for b in self.bits if b is not None}):
            rows = torch.tensor([bb == b for bb in self.bits], device=x.device)
            use = rows[:, None] & (slot[None, :] >= fp[:, None])  # (B, n)
            x = torch.where(use[:, None, :, None], fake_quantize(x, b), x)
        return x

    def _start(self, key_states, value_states) -> None:
        self.lazy_initialization(key_states, value_states)
        B = key_states.shape[0]
        if len(self.sinks) == 1 and B > 1:  # one setting for every row (generate's batches)
            self.sinks, self.bits, self.fp_tokens = self.sinks * B, self.bits * B, self.fp_tokens * B
        if len(self.sinks) != B:
            raise ValueError(f"this cache holds {len(self.sinks)} rows; the model gave {B}: make one cache per batch.")
        self.ptr = torch.tensor(self.sinks, device=key_states.device)
        self._sink_mask = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self._start(key_states, value_states)
        n = key_states.shape[-2]
        if any(b is not None for b in self.bits):
            start = min(self.n_seen, self.capacity - 1) if self.capacity is not None else self.n_seen
            key_states, value_states = self._quantize(key_states, start), self._quantize(value_states, start)
        L = self.get_seq_length()
        if self.capacity is None or L + n <= self.capacity:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        else:
            if n != 1 or L != self.capacity:
                raise ValueError(
                    f"{L + n} tokens would enter a streaming cache of {self.capacity}: prefill at most the window "
                    "(to generate from a longer prompt, pass prefill_chunk_size=1 to generate, which feeds it a token "
                    "at a time as StreamingLLM does), with a fresh cache per generate call."
                )
            B, H, _, D = self.keys.shape
            slot = self.ptr.view(B, 1, 1, 1).expand(B, H, 1, D)
            self.keys.scatter_(2, slot, key_states)
            self.values.scatter_(2, slot.expand(B, self.values.shape[1], 1, self.values.shape[-1]), value_states)
            s = torch.tensor(self.sinks, device=self.ptr.device)
            self.ptr = s + (self.ptr - s + 1) % (self.capacity - s)
        self.n_seen += n
        smax = max(self.sinks)
        if self.sink_keys is None and smax and self.get_seq_length() >= smax:
            self.sink_keys = self.keys[:, :, :smax].clone()
        if self.rope is not None and smax and self.evictions:
            rot = _rotate_keys(self.sink_keys, torch.full((smax,), self.evictions), self.rope)
            if self._sink_mask is None:
                self._sink_mask = (torch.arange(smax) < torch.tensor(self.sinks)[:, None]).to(self.keys.device)[
                    :, None, :, None
                ]
            self.keys[:, :, :smax] = torch.where(self._sink_mask, rot, self.keys[:, :, :smax])
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(keys the step attends to, the index of the first one): once full, the offset puts the query (at index
        ``get_seq_length()``, the cache's query offset) right after the last key, so the first kept key sits
        ``capacity - 1`` before it, as in StreamingLLM (a sliding-window mask keeps every kept token while the
        capacity is at most the window)."""
        L = self.get_seq_length() + query_length
        return (L, 0) if self.capacity is None else (min(L, self.capacity), max(0, L - self.capacity))

    def oldest_slots(self) -> torch.Tensor:
        """(B,) the slot of each row's oldest kept non-sink token."""
        if self.capacity is not None and self.n_seen >= self.capacity:
            return self.ptr.clone()
        return torch.tensor(self.sinks, device=self.keys.device)


class StreamingCache(Cache):
    """A KV cache that keeps each row's first ``sinks[b]`` tokens and the most recent ones, ``capacity`` in all
    (None: keep everything). Feed it token t at ``position_ids = cache.position(t)``: the absolute position
    for rotary models (see ``StreamingLayer``), the cache index for models without rotary embeddings. ``rope``: one
    ``RopeSpec`` for every layer, or a list with one per layer (None on a layer without rotary). One row's settings
    serve a batch of any size."""

    def __init__(
        self,
        n_layers: int,
        rope: RopeSpec | list | None,
        capacity: int | None,
        sinks=(0,),
        bits=(None,),
        fp_tokens=(0,),
    ):
        if not len(sinks) == len(bits) == len(fp_tokens):
            raise ValueError("sinks, bits and fp_tokens need one entry per batch row.")
        if capacity is not None and max(sinks) >= capacity:
            raise ValueError(f"sinks ({max(sinks)}) must be fewer than the capacity ({capacity}).")
        ropes = list(rope) if isinstance(rope, (list, tuple)) else [rope] * n_layers
        if len(ropes) != n_layers:
            raise ValueError(f"give one rope per layer ({n_layers}); got {len(ropes)}.")
        super().__init__(layers=[StreamingLayer(r, capacity, sinks, bits, fp_tokens) for r in ropes])
        self.capacity, self.rope = capacity, rope

    def position(self, t: int) -> int:
        if any(layer.rope is not None for layer in self.layers) or self.capacity is None:
            return t
        return min(t, self.capacity - 1)

    def kv_bytes(self) -> list[int]:
        """Per row: bytes its cached keys and values would take at its precision (quantised: codes plus a
        float16 scale and zero point per token and head)."""
        out = None
        for layer in self.layers:
            if not layer.is_initialized or layer.keys.numel() == 0:
                continue
            B, H, L, D = layer.keys.shape
            es = layer.keys.element_size()
            row = []
            for b in range(B):
                if layer.bits[b] is None:
                    row.append(2 * H * L * D * es)
                else:
                    n_fp = min(L, layer.fp_tokens[b])
                    row.append(2 * H * (n_fp * D * es + (L - n_fp) * (D * layer.bits[b] / 8 + 4)))
            out = row if out is None else [a + c for a, c in zip(out, row)]
        return [int(x) for x in out] if out is not None else [0]
