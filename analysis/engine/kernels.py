"""The attention kernels of the transformers backend: each layer's output and each query row's log-sum-exp.

A fused attention kernel never builds the T x T map, but it returns each query row's log-sum-exp
``lse_i = log sum_j exp(s_ij)``, s_ij = q_i . k_j * scale. Any entry of the map follows from it,

    A[i, k] = exp(q_i . k_k * scale - lse_i),

which is how ``analysis.engine.attention.AttentionWeights`` gives every attention quantity an analysis reads (alpha_k,
a key's column, a band of diagonals, the attention-weighted mean of a per-key quantity) in blocks of query rows.

Kernels (``fused_attention``), chosen by one explicit table (``sink_kernel``, a pure function of device, dtype, head
size, GQA and mask, tested on the CPU): on CUDA aten's flash attention (the kernel the model's own SDPA forward takes,
with native grouped-query attention and the log-sum-exp), aten's efficient attention where flash does not take the
inputs (an explicit mask, float32, an odd head size: K and V repeated per group); on CPU
``aten._scaled_dot_product_flash_attention_for_cpu`` (masks, GQA); elsewhere ``F.scaled_dot_product_attention``
plus a log-sum-exp computed in query chunks (O(chunk x T) memory, never T x T at once). A fallback from the table's
first choice is logged once and recorded in the result (``meta["kernels"]``); no kernel error is caught.

Learned sink logits (gpt-oss) join a kernel's rows exactly; soft-capped scores (Gemma 2), which no fused kernel
takes, are computed in blocks of query rows (``_interface_attention``). What cannot be reproduced
exactly, ``backends.choose_backend`` names before a run: additive position biases (ALiBi), bidirectional attention,
models whose attention does not go through the ``AttentionInterface`` (Falcon, BLOOM, this package's reference
models) and models with hooks attached (the pass would skip them). The backend ``auto`` then takes the bridge.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from analysis.engine.attention import _join_sinks, key_mask, row_lse

PREFER: str | None = None  # a kernel among SINK_KERNELS the benchmarks ask for (bench_scale.py --sink-kernel)

LOG = logging.getLogger(__name__)


class FusedUnsupported(NotImplementedError):
    """The model's attention does something the fused kernels cannot reproduce exactly (the bridge can)."""


# ------------------------------------------------------------------ Kernels: output and log-sum-exp of causal attention


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True = attend) as the additive float mask the fused kernels take."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _reference_attention(query, key, value, mask, scale):
    """F.scaled_dot_product_attention and the rows' log-sum-exp in blocks of rows (any device)."""
    group = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
    )
    return out, row_lse(query, key, scale, mask=key_mask(mask, query.shape[-2]))


@dataclass(frozen=True)
class SinkKernel:
    """The kernel that computes a layer's attention output and row log-sum-exp on the fused sink path.

    Attributes
    ----------
    name : str
        "flash" (aten's flash attention, CUDA), "efficient" (aten's memory-efficient attention, CUDA), "cpu-flash"
        (aten's flash attention for the CPU) or "reference" (SDPA plus a log-sum-exp in query chunks, any device).
    gqa : str
        "native" (each KV head meets its group of query heads inside the kernel), "repeat" (K and V repeated per
        query group before the call) or "none" (no grouping).
    fallback : str
        Empty for the kernel the table prefers on the device; else why it was not taken (logged once, recorded in
        the result's ``meta["kernels"]``).
    """

    name: str
    gqa: str
    fallback: str = ""


SINK_KERNELS = ("flash", "efficient", "cpu-flash", "reference")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def sink_kernel(
    device_type: str, dtype: torch.dtype, head_dim: int, *, gqa: bool, masked: bool, prefer: str | None = None
) -> SinkKernel:
    """The kernel table of the fused sink path: a pure function of the device type, dtype, head size, grouped-query
    attention and mask (a plain causal mask or an explicit one: padding, sliding windows).

    =======  ==============================  ==============================================  ========
    device   inputs                          kernel                                          GQA
    =======  ==============================  ==============================================  ========
    cuda     causal, fp16/bf16, d % 8 == 0,  flash (``aten._scaled_dot_product_flash_        native
             d <= 256                        attention``: the model's own SDPA kernel, lse)
    cuda     an explicit mask, or float32,   efficient (``aten._scaled_dot_product_          repeat
             or another head size            efficient_attention``, lse), stated fallback
    cpu      any                             cpu-flash (``aten._scaled_dot_product_flash_    native
                                             attention_for_cpu``: masks, lse)
    other    any                             reference (SDPA + chunked lse), stated          native
    =======  ==============================  ==============================================  ========

    Parameters
    ----------
    device_type : str
        "cuda", "cpu", "mps", ...
    dtype : torch.dtype
        The queries' dtype.
    head_dim : int
    gqa : bool
        Fewer KV heads than query heads.
    masked : bool
        An explicit mask (None: plainly causal).
    prefer : str, optional
        A kernel among ``SINK_KERNELS`` to take where the device has it (a benchmark's choice); None: the table's.

    Returns
    -------
    SinkKernel
    """
    if prefer is not None and prefer not in SINK_KERNELS:
        raise ValueError(f"prefer must be one of {list(SINK_KERNELS)} or None; got {prefer!r}.")
    if prefer == "reference":
        return SinkKernel("reference", "native", "asked for (prefer='reference')")
    if device_type == "cpu":
        return SinkKernel("cpu-flash", "native" if gqa else "none")
    if device_type != "cuda":
        return SinkKernel(
            "reference",
            "native" if gqa else "none",
            f"no fused kernel with a log-sum-exp on {device_type!r}: SDPA plus a chunked log-sum-exp",
        )
    why = (
        "an explicit mask (padding or a sliding window)"
        if masked
        else f"dtype {str(dtype).replace('torch.', '')} (flash takes float16/bfloat16)"
        if dtype not in FLASH_DTYPES
        else f"head size {head_dim} (flash takes multiples of 8 up to {FLASH_MAX_HEAD_DIM})"
        if head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM
        else ""
    )
    if prefer == "efficient" and not why:
        why = "asked for (prefer='efficient')"
    if not why:
        return SinkKernel("flash", "native" if gqa else "none")
    return SinkKernel(
        "efficient",
        "repeat" if gqa else "none",
        f"{why}: the efficient kernel, K and V repeated per query group" if gqa else f"{why}: the efficient kernel",
    )


_STATED: set[tuple[str, str]] = set()


def state_fallback(kernel: SinkKernel) -> None:
    """Log a kernel fallback once per process (the result records it for every run).

    Parameters
    ----------
    kernel : SinkKernel

    Returns
    -------
    None
    """
    if kernel.fallback and (kernel.name, kernel.fallback) not in _STATED:
        _STATED.add((kernel.name, kernel.fallback))
        LOG.warning("fused sink path: kernel %r, not the table's first choice: %s.", kernel.name, kernel.fallback)


def fused_attention(query, key, value, mask: torch.Tensor | None, scale: float, *, kernel: SinkKernel | None = None):
    """Causal attention output (B, H, T, d) and row log-sum-exp (B, H, T) float32 from the kernel ``sink_kernel``
    picks for these inputs.

    ``query`` (B, H, T, d); ``key``/``value`` (B, H_kv, T, d) with H a multiple of H_kv; ``mask`` None (causal)
    or (B, 1, T, T) boolean (True = attend) / additive float.

    Parameters
    ----------
    query : torch.Tensor, shape (B, H, T, d)
    key, value : torch.Tensor, shape (B, H_kv, T, d)
    mask : torch.Tensor, shape (B, 1, T, T), or None
    scale : float
    kernel : SinkKernel, optional
        The kernel; None: ``sink_kernel``'s choice.

    Returns
    -------
    output : torch.Tensor, shape (B, H, T, d)
    lse : torch.Tensor, shape (B, H, T)
    """
    T, group = query.shape[-2], query.shape[1] // key.shape[1]
    if kernel is None:
        kernel = sink_kernel(query.device.type, query.dtype, query.shape[-1], gqa=group > 1, masked=mask is not None)
    if kernel.name == "cpu-flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, mask is None, attn_mask=_additive(mask, query.dtype), scale=scale
        )
    if kernel.name == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False, scale=scale)[
            :2
        ]
        return out, lse.float()
    if kernel.name == "efficient":
        k, v = (x.repeat_interleave(group, dim=1) for x in (key, value)) if group > 1 else (key, value)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, k, v, _additive(mask, query.dtype), True, 0.0, mask is None, scale=scale
        )[:2]
        return out, lse[..., :T].float()  # the kernel may pad the lse rows to a multiple of 32
    return _reference_attention(query, key, value, mask, scale)


def _interface_attention(query, key, value, mask, scale: float, *, softcap=None, sinks=None):
    """One layer's attention as transformers' attention function computes it: the output (B, H, T, d), each row's
    log-sum-exp (B, H, T) and (the kernel, why not the table's first).

    The fused kernel ``sink_kernel`` picks (a narrower v, MLA's, padded to the head size); soft-capped scores (Gemma
    2), which no fused kernel takes, in blocks of query rows of ``AttentionWeights``; learned sink logits (gpt-oss, one
    per head) joined to every row's softmax as a column without a value, which shrinks the output by the sink's share."""
    if softcap is not None:
        mask = key_mask(mask, key.shape[-2])
        lse, out = row_lse(query, key, scale, mask=mask, softcap=softcap, sinks=sinks, value=value)
        return out, lse, ("capped", "soft-capped scores, which no fused kernel takes: blocks of rows")
    g, m, dv = query.shape[1] > key.shape[1], mask is not None, value.shape[-1]
    kernel = sink_kernel(query.device.type, query.dtype, query.shape[-1], gqa=g, masked=m, prefer=PREFER)
    state_fallback(kernel)
    if dv != query.shape[-1]:  # MLA's narrower v, padded as the flash kernels want it (the zeros add nothing)
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - dv))
    out, lse = fused_attention(query, key, value, mask, scale, kernel=kernel)
    if sinks is not None:
        full = _join_sinks(lse, sinks.float().view(1, -1, 1))
        out, lse = out * (lse - full).exp()[..., None].to(out.dtype), full
    return out[..., :dv], lse, (kernel.name, kernel.fallback)


# ----------------------------------------------------------------------------- What the kernels cannot reproduce


def _refuse_extras(module, attention_mask, is_causal, kwargs) -> None:
    if kwargs.get("position_bias") is not None:
        raise FusedUnsupported("an additive position bias (ALiBi and the like) is not in q·k.")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and not causal:
        raise FusedUnsupported("bidirectional attention: alpha_k here is defined for causal attention.")
