"""A KV cache that really stores low-bit keys and values (uint8 words, 2 int4 or 4 int2 codes each), its sinks in
full precision.

``LowBitCache`` is a ``transformers.Cache`` whose layers (``LowBitLayer``) quantise each entering token's keys and
values per token and head (asymmetric min-max over the head dimension, the scheme of the simulated streaming
cache ``analysis.streaming.cache.fake_quantize``), pack the codes into ``torch.uint8`` and keep a float16 scale and
zero point per token and head; the tokens at ``fp_positions`` (the first tokens, and KVSink-style the later sinks
``analysis.positions.every_sink`` finds) stay in the model's dtype. ``nbytes`` is what the layer's tensors really
hold. Attention reads the de-quantised keys and values (the entering chunk too, as the simulated cache does), so
one prefill of a window scores exactly as token-by-token decoding with quantise-on-entry would.
"""

from __future__ import annotations

import itertools

import torch
from transformers.cache_utils import Cache, DynamicLayer

KV_BITS = (4, 2)  # bits the packed cache stores (8 // bits codes per uint8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (< 2**bits) along the last dim into uint8 words.

    Parameters
    ----------
    codes : torch.Tensor of uint8, shape (..., D)
        D divisible by 8 // bits.
    bits : int

    Returns
    -------
    torch.Tensor of uint8, shape (..., D * bits / 8)
    """
    per = 8 // bits
    c = codes.to(torch.uint8).unflatten(-1, (-1, per))
    shifts = torch.arange(per, dtype=torch.uint8, device=c.device) * bits
    return (c << shifts).sum(-1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``pack_codes``.

    Parameters
    ----------
    packed : torch.Tensor of uint8, shape (..., W)
    bits : int

    Returns
    -------
    torch.Tensor of uint8, shape (..., W * 8 / bits)
    """
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
    return ((packed[..., None] >> shifts) & (2**bits - 1)).flatten(-2)


class PackedKV:
    """One chunk of tokens stored low-bit: packed codes, float16 scale and zero point per token and head.

    Attributes
    ----------
    codes : torch.Tensor of uint8, shape (B, H, n, D * bits / 8)
    scale, zero : torch.Tensor of float16, shape (B, H, n, 1)
    bits : int
    dtype : torch.dtype
        The dtype it de-quantises to.
    """

    def __init__(self, x: torch.Tensor, bits: int):
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8).half()
        zero = lo.half()
        codes = torch.round((x - zero.to(x.dtype)) / scale.to(x.dtype)).clamp(0, 2**bits - 1)
        self.codes, self.scale, self.zero, self.bits, self.dtype = pack_codes(codes, bits), scale, zero, bits, x.dtype

    def dequantize(self) -> torch.Tensor:
        return unpack_codes(self.codes, self.bits).to(self.dtype) * self.scale.to(self.dtype) + self.zero.to(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.zero))


class LowBitLayer(DynamicLayer):
    """One layer's keys and values: the tokens at ``fp_positions`` in full precision, the rest packed ``bits``-bit;
    chunks kept in position order and de-quantised when attention reads them."""

    def __init__(self, bits: int | None, fp_positions=()):
        super().__init__()
        self.bits, self.fp_positions = bits, set(int(p) for p in fp_positions)
        self.chunks: list = []  # (keys, values): tensors (full precision) or PackedKV
        self.n_seen = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, start = key_states.shape[-2], self.n_seen
        # runs of consecutive positions that are all full precision or all low-bit, one chunk each
        for fp, run in itertools.groupby(range(n), key=lambda i: (start + i) in self.fp_positions):
            idx = list(run)
            k, v = (x[..., idx[0] : idx[-1] + 1, :].clone() for x in (key_states, value_states))
            self.chunks.append((k, v) if fp or self.bits is None else (PackedKV(k, self.bits), PackedKV(v, self.bits)))
        self.n_seen += n
        deq = [(k.dequantize(), v.dequantize()) if isinstance(k, PackedKV) else (k, v) for k, v in self.chunks]
        self.keys = torch.cat([k for k, _ in deq], dim=-2)
        self.values = torch.cat([v for _, v in deq], dim=-2)
        out = self.keys, self.values
        self.keys, self.values = self.keys[..., :0, :], self.values[..., :0, :]  # hold only the chunks
        return out

    def get_seq_length(self, *args) -> int:
        return self.n_seen

    @property
    def nbytes(self) -> int:
        """Bytes the layer's stored keys and values hold."""
        return sum(t.nbytes for chunk in self.chunks for t in chunk)  # a tensor's nbytes, or a PackedKV's


class LowBitCache(Cache):
    """A ``transformers.Cache`` of ``LowBitLayer`` s: keys and values stored ``bits``-bit (None: full precision),
    the tokens at ``fp_positions`` (absolute positions in the stream) kept in full precision.

    Attributes
    ----------
    bits : int or None
    fp_positions : tuple of int
    """

    def __init__(self, n_layers: int, bits: int | None, fp_positions=()):
        if bits is not None and bits not in KV_BITS:
            raise ValueError(
                f"the packed KV cache stores {' or '.join(map(str, KV_BITS))} bits (or None for full "
                f"precision); got {bits}. Use --kv-bits 4,2."
            )
        super().__init__(layers=[LowBitLayer(bits, fp_positions) for _ in range(n_layers)])
        self.bits, self.fp_positions = bits, tuple(sorted(set(int(p) for p in fp_positions)))

    def kv_bytes(self) -> int:
        """Bytes held by every layer's keys and values.

        Returns
        -------
        int
        """
        return sum(layer.nbytes for layer in self.layers)
