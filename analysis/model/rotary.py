"""The one rotary implementation, and the one place that turns a model's queries/keys into the rotated
queries/keys its attention really uses.

Two pairings: Hugging Face ``rotate_half`` (pairs (x_i, x_{i + rd/2}); Llama, GPT-NeoX and every family but
GPT-J) and GPT-J's ``rotate_every_two`` ("interleaved": pairs (x_0, x_1), (x_2, x_3), ...). Partial rotary
(GPT-NeoX, Phi, StableLM, Qwen3-Next...) rotates only the first ``rot_dim`` dims of a head.

``rotate_as_spec(x, spec, layer)`` is what the analyses call on the queries/keys read from the family spec's
hooks (``spec.query_hook`` / ``spec.key_hook``): where the bridge fires ``hook_rot_q``/``hook_rot_k`` they
already hold the rotated vectors and are returned as they are; where it does not (Phi-3, GPT-NeoX, Falcon,
GPT-J: ``spec.key_rotated`` False) the spec's rotary (its dim, pairing and the layer's base) is applied here.
Used by ``analysis.chain.qk``, ``analysis.chain.key_manifold``, ``analysis.chain.norm_gain`` and ``analysis.causal.interventions``;
the training module's ``positions.py`` builds its cos/sin from ``rope_cos_sin`` here.
"""

from __future__ import annotations

import torch

from analysis.core.docs import parameters_from
from analysis.model.hooks import ModelContractError


def rope_cos_sin(
    positions: torch.Tensor,
    rot_dim: int,
    base: float | None,
    *,
    dtype=torch.float32,
    style: str = "half",
    inv_freq: torch.Tensor | None = None,
):
    """cos, sin (T, rot_dim) at ``positions`` (T,), computed in float64: the rotate-half layout (angles repeated
    as [a_0..a_{rd/2-1}, a_0..a_{rd/2-1}]) or the interleaved one ([a_0, a_0, a_1, a_1, ...]).

    Parameters
    ----------
    positions : torch.Tensor, shape (T,)
    rot_dim : int
        The rotated dims.
    base : float
        The rope theta.
    dtype : torch.dtype
        Of the result.
    style : {"half", "interleaved"}
    inv_freq : torch.Tensor or sequence of float, shape (rot_dim / 2,), optional
        The frequencies themselves, where a rope type scales them (linear, llama3, yarn: read from the model's rotary
        module, ``FamilySpec.rope_freqs``); default ``base ** (-2i / rot_dim)``.

    Returns
    -------
    cos, sin : torch.Tensor, shape (T, rot_dim)
    """
    if inv_freq is not None:
        inv = torch.as_tensor(inv_freq, dtype=torch.float64, device=positions.device)
    else:
        inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64, device=positions.device) / rot_dim))
    ang = positions.double()[:, None] * inv[None]
    emb = ang.repeat_interleave(2, -1) if style == "interleaved" else torch.cat([ang, ang], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's pairing: (x_1, x_2) -> (-x_2, x_1) on the two halves of the last axis.

    Parameters
    ----------
    x : torch.Tensor, shape (..., d)

    Returns
    -------
    torch.Tensor, shape (..., d)
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's pairing: (x_0, x_1, x_2, x_3, ...) -> (-x_1, x_0, -x_3, x_2, ...).

    Parameters
    ----------
    x : torch.Tensor, shape (..., d)
        d even.

    Returns
    -------
    torch.Tensor, shape (..., d)
    """
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)


@parameters_from(rope_cos_sin)
def rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    base: float | None,
    *,
    rot_dim: int | None = None,
    style: str = "half",
    inv_freq: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Rotary on x (..., T, heads, d_head) at ``positions`` (T,); only the first ``rot_dim`` dims rotate
    (partial rotary: GPT-NeoX, Phi), the rest pass through. ``style``: "half" (HF rotate_half) or "interleaved"
    (GPT-J rotate_every_two). Returns float32.

    Parameters
    ----------
    x : torch.Tensor, shape (..., T, heads, d_head)
    positions, base, style
        As in :func:`rope_cos_sin`.
    rot_dim : int, optional
        Dims rotated (default all).
    inv_freq : torch.Tensor, optional
        As in :func:`rope_cos_sin` (then ``base`` may be None).
    scale : float
        Times the rotated dims (Hugging Face's ``attention_scaling`` of yarn and longrope on cos and sin).

    Returns
    -------
    torch.Tensor, shape (..., T, heads, d_head)
    """
    if style not in ("half", "interleaved"):
        raise ValueError(f"rotary style must be 'half' or 'interleaved'; got {style!r}.")
    rd = x.shape[-1] if rot_dim is None else int(rot_dim)
    cos, sin = rope_cos_sin(positions.to(x.device), rd, base, style=style, inv_freq=inv_freq)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, rd): broadcast over heads
    xr, xp = x[..., :rd].float(), x[..., rd:].float()
    turn = rotate_every_two if style == "interleaved" else rotate_half
    return torch.cat([(xr * cos + turn(xr) * sin) * scale, xp], -1)  # times 1.0: the same bits


def apply_spec_rotary(
    x: torch.Tensor, spec, layer: int, *, positions: torch.Tensor | None = None, inverse: bool = False
) -> torch.Tensor:
    """The spec's rotary of ``layer`` (dim, pairing, base; a scaled type's frequencies and scale) on unrotated
    queries/keys x (B, T, heads, d_head) at ``positions`` (default 0..T-1); the identity (float32) without rotary.

    Parameters
    ----------
    x : torch.Tensor, shape (B, T, heads, d_head)
    spec : FamilySpec
    layer : int
    positions : torch.Tensor, shape (T,), optional
    inverse : bool
        Turn rotated vectors back instead (rotated by -positions, divided by the scale).

    Returns
    -------
    torch.Tensor, shape (B, T, heads, d_head)
    """
    if not spec.rotary_at(layer):  # no rotary, or a NoPE layer of a rotary model
        return x.float()
    base = spec.rotary_bases.get(int(layer), spec.rotary_base)
    if base is None or spec.rotary_dim is None:
        raise ModelContractError(
            f"this {spec.family} model uses rotary embeddings but its rotary base / dim of "
            f"layer {layer} is unknown (model.family.rotary_bases, rotary_dim)."
        )
    if positions is None:
        positions = torch.arange(x.shape[-3])
    inv, s = spec.rope_freqs.get(int(layer), (None, 1.0))
    at, s = (-positions, 1.0 / s) if inverse else (positions, s)
    return rotate(x, at, base, rot_dim=spec.rotary_dim, style=spec.rotary_style or "half", inv_freq=inv, scale=s)


@parameters_from(apply_spec_rotary)
def rotate_as_spec(
    x: torch.Tensor, spec, layer: int, *, positions: torch.Tensor | None = None, rotated: bool = True
) -> torch.Tensor:
    """Queries or keys read from ``spec.query_hook(layer)`` / ``spec.key_hook(layer)`` ((B, T, heads, d_head)) as
    the attention uses them, float32, at ``positions`` (default 0..T-1).

    ``rotated`` True: after the rotary. Returned as they are where those hooks already hold them rotated
    (``spec.key_rotated``) or the model has no rotary; rotated per the spec otherwise. ``rotated`` False: the same
    vectors before the rotary (hooks that hold them rotated are turned back by the inverse rotation, so q/k norms
    and the gated families' query stay applied; Llama 4's L2 norm follows the rotary). A scaled rope type's frequencies
    are the model's at load (``FamilySpec.rope_freqs``: longrope's and dynamic's, exact up to the original context).

    Parameters
    ----------
    x, spec, layer, positions
        As in :func:`apply_spec_rotary`.
    rotated : bool

    Returns
    -------
    torch.Tensor, shape (B, T, heads, d_head)
    """
    if not spec.rotary_at(layer) or rotated == spec.key_rotated:
        return x.float()
    x = apply_spec_rotary(x, spec, layer, positions=positions, inverse=not rotated)
    return x * x.pow(2).mean(-1, keepdim=True).add(spec.norm.eps).rsqrt() if rotated and spec.qk_l2_norm else x
