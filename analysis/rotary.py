"""The one rotary implementation (Hugging Face ``rotate_half``, non-interleaved), and the model facts it needs.

Used by the analyses that rebuild keys and queries (``analysis.norm_gain``, ``analysis.interventions``);
the training module's ``positions.py`` should build its cos/sin from ``rope_cos_sin`` here.
"""
from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, rot_dim: int, base: float, dtype=torch.float32):
    """cos, sin (T, rot_dim) of the rotate-half convention at ``positions`` (T,), computed in float64."""
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64, device=positions.device) / rot_dim))
    ang = positions.double()[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float, rot_dim: int | None = None) -> torch.Tensor:
    """Rotary on x (..., T, heads, d_head) at ``positions`` (T,); only the first ``rot_dim`` dims rotate
    (partial rotary: GPT-NeoX, Phi), the rest pass through. Returns float32."""
    rd = x.shape[-1] if rot_dim is None else int(rot_dim)
    cos, sin = rope_cos_sin(positions.to(x.device), rd, base)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, rd): broadcast over heads
    xr, xp = x[..., :rd].float(), x[..., rd:].float()
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], -1)


def uses_rotary(model) -> bool:
    return getattr(getattr(model, "cfg", None), "positional_embedding_type", None) == "rotary"


def rotary_dim(model, d_head: int) -> int:
    """How many of a head's dims are rotated (partial rotary: GPT-NeoX, Phi...)."""
    rd = getattr(getattr(model, "cfg", None), "rotary_dim", None)
    if rd:
        return int(rd)
    hf = getattr(getattr(model, "original_model", None), "config", None)
    params = getattr(hf, "rope_parameters", None) if hf is not None else None
    for src in (params if isinstance(params, dict) else {}, hf):
        for name in ("partial_rotary_factor", "rotary_pct"):
            frac = src.get(name) if isinstance(src, dict) else getattr(src, name, None)
            if frac is not None:
                return int(d_head * float(frac))
    return d_head
