"""FlexAttention path for similarity-based operations (sigmoid, elu+1, with or without normalisation), and for plain
softmax (the baseline those are timed against on the same kernel).

FlexAttention computes softmax(score_mod(s)) V and the log-sum-exp of the modified scores. With
score_mod = log f (f = sigmoid or elu+1), softmax(log f(s)) V = sum_j f(s_ij) v_j / sum_j f(s_ij), and
multiplying by exp(lse) = sum_j f(s_ij) gives the unnormalised sum_j f(s_ij) v_j exactly. On CUDA the
call is compiled into a fused kernel; on CPU it runs unfused (used only in tests).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, *, window, **kw):
    """``flex_attention`` (compiled on CUDA) under the causal, optionally sliding-window, block mask."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = _compiled() if q.device.type == "cuda" else flex_attention
    return flex(q, k, v, block_mask=_block_mask(q.shape[-2], window, str(q.device)), **kw)


@functools.lru_cache(maxsize=64)
def _block_mask(T: int, window, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):  # causal, within the window where there is one
        causal = q_idx >= kv_idx
        return causal if window is None else causal & (q_idx - kv_idx < window)

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=T, KV_LEN=T, device=device)


def flex_elementwise(op, q, k, v, *, window=None, score_bias=None):
    """An elementwise attention operation (sigmoid, elu + 1, ...) through ``flex_attention`` on CUDA.

    Parameters
    ----------
    op : AttentionOp
        The elementwise operation (its ``log_f`` and ``extra_bias``).
    q, k, v : torch.Tensor, shape (B, H, T, d)
    window : int, optional
        A sliding window.
    score_bias : torch.Tensor, shape (H, T, T), optional
        A positional bias.

    Returns
    -------
    torch.Tensor, shape (B, H, T, d)
    """
    from torch.nn.attention.flex_attention import AuxRequest

    extra = op.extra_bias(q.shape[-2])
    pos = score_bias
    log_f = op.log_f

    def score_mod(score, b, h, q_idx, kv_idx):
        if pos is not None:
            score = score + pos[h, q_idx, kv_idx]
        if extra is not None:
            score = score + (extra[h, 0, 0] if torch.is_tensor(extra) else extra)
        return log_f(score)

    out, aux = _flex(q, k, v, window=window, score_mod=score_mod, scale=op.scale, return_aux=AuxRequest(lse=True))
    return out if op.normalise else out * torch.exp(aux.lse).unsqueeze(-1).to(out.dtype)


def flex_softmax(q, k, v, *, scale: float, window=None, score_bias=None):
    """Plain causal softmax attention through ``flex_attention``: the softmax baseline of the FlexAttention path
    (``attn_impl="flex"`` for ``attention="softmax"``).

    Parameters
    ----------
    q, k, v : torch.Tensor, shape (B, H, T, d)
    scale : float
        The logit scale (1 / sqrt(d)).
    window, score_bias
        As in :func:`flex_elementwise`.

    Returns
    -------
    torch.Tensor, shape (B, H, T, d)
    """
    pos = score_bias

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + pos[h, q_idx, kv_idx]

    return _flex(q, k, v, window=window, score_mod=score_mod if pos is not None else None, scale=scale)
