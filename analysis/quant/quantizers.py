"""Symmetric fake quantisers (quantise, then de-quantise) for activations and weights, as PrefixQuant, IntactKV and
CushionCache measure accuracy: the numbers they give are float tensors on the int grid, not int kernels.

Activations: per-tensor static (one scale, set by calibration: max |x| / qmax) or per-token dynamic (one scale per
token, max |x| over its features). Weights: per output channel (max |w| over the channel's inputs). Symmetric
round-to-nearest with qmax = 2**(bits-1) - 1 (int8: 127, int4: 7).
"""

from __future__ import annotations

import torch

ACT_BITS = (8, 4)  # activation bits the fake quantiser supports
WEIGHT_BITS = (8, 4)  # weight bits (per output channel)
GRANULARITIES = ("tensor", "token")  # per-tensor static scales from calibration; per-token dynamic scales


def check_bits(bits: int, *, what: str = "activation", allowed=ACT_BITS) -> int:
    """``bits`` if the quantiser supports it, else a ValueError that says which it does.

    Parameters
    ----------
    bits : int
    what : str
        "activation", "weight" or "KV", for the message.
    allowed : tuple of int

    Returns
    -------
    int
    """
    if bits not in allowed:
        raise ValueError(
            f"{what} bits must be one of {', '.join(map(str, allowed))}; got {bits}. "
            f"Use --{'w-' if what == 'weight' else 'kv-' if what == 'KV' else ''}bits with those values."
        )
    return int(bits)


def check_granularity(granularity: str) -> str:
    """``granularity`` if supported, else a ValueError.

    Parameters
    ----------
    granularity : str
        One of ``GRANULARITIES``.

    Returns
    -------
    str
    """
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"granularity must be one of {', '.join(GRANULARITIES)} (per-tensor static, per-token "
            f"dynamic); got {granularity!r}."
        )
    return granularity


def qmax(bits: int) -> int:
    """The largest code of a symmetric signed ``bits``-bit grid.

    Parameters
    ----------
    bits : int
        Bits per code (8: int8, whose largest code is 127).

    Returns
    -------
    int
    """
    return 2 ** (bits - 1) - 1


def fake_quant(x: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """round(x / scale) clamped to [-qmax-1, qmax], times scale: the error is at most scale / 2 inside the range.

    Parameters
    ----------
    x : torch.Tensor
    scale : torch.Tensor
        Broadcasts against ``x``; positive.
    bits : int

    Returns
    -------
    torch.Tensor
        Like ``x``.
    """
    q = qmax(bits)
    scale = scale.clamp_min(torch.finfo(x.dtype).tiny)
    return torch.round(x / scale).clamp(-q - 1, q) * scale


def token_scale(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-token dynamic scale: max |x| over the last dim / qmax.

    Parameters
    ----------
    x : torch.Tensor, shape (..., D)
    bits : int

    Returns
    -------
    torch.Tensor, shape (..., 1)
    """
    return x.abs().amax(dim=-1, keepdim=True) / qmax(bits)


def quant_activation(x: torch.Tensor, bits: int, static_scale: float | None, keep: torch.Tensor | None) -> torch.Tensor:
    """Fake-quantise a linear layer's input, per tensor (``static_scale``) or per token (None); rows marked in
    ``keep`` stay in full precision.

    Parameters
    ----------
    x : torch.Tensor, shape (B, T, ...)
    bits : int
    static_scale : float or None
    keep : torch.Tensor of bool, shape (B, T), optional

    Returns
    -------
    torch.Tensor
        Like ``x``.
    """
    flat = x.flatten(2)
    scale = token_scale(flat, bits) if static_scale is None else torch.tensor(static_scale, dtype=x.dtype)
    out = fake_quant(flat, scale, bits)
    if keep is not None:
        out = torch.where(keep[..., None].to(x.device), flat, out)
    return out.view_as(x)


def quant_weight(w: torch.Tensor, bits: int, in_axes: tuple[int, ...]) -> torch.Tensor:
    """Per-output-channel symmetric fake quantisation of a weight.

    Parameters
    ----------
    w : torch.Tensor
    bits : int
    in_axes : tuple of int
        The axes the layer sums over (its inputs); every other index is one output channel.

    Returns
    -------
    torch.Tensor
        Like ``w``.
    """
    scale = w.abs().amax(dim=in_axes, keepdim=True) / qmax(bits)
    return fake_quant(w, scale, bits)
