"""The sink metric at the cost of a fused attention forward pass: alpha from q, k and the log-sum-exp.

A fused attention kernel never builds the T x T map, but it returns each query row's log-sum-exp
``lse_i = log sum_j exp(s_ij)``, s_ij = q_i . k_j * scale. Any entry of the map follows from it,

    A[i, k] = exp(q_i . k_k * scale - lse_i),

so alpha_k (see ``analysis.sinks.metric``) for keys 1..k_max needs only the (T x k_max) scores of those keys, taken here
in blocks of query rows (``alpha_from_lse``): O(rows x k_max) memory. For every key (k_max = T, the sink at any
position) the attention function instead computes the attention itself in blocks of query rows, its output and the
column sums of its softmax together (``attention_with_alpha``): the scores once, never a T x T map.

The pass runs the Hugging Face model with an attention function registered in transformers' ``AttentionInterface``
for the duration of the run, so every family's q and k arrive after their rotary and q/k norms; the function computes
the output with the fused kernel, takes the lse and folds alpha (B, H, k_max) of its layer into an
``AlphaAccumulator``. Under grouped-query attention each KV head's keys meet the queries of its group in one product,
never repeated per query head.

This module returns alpha as a tensor (``fused_alpha``); ``analysis.sinks.metric`` chooses the path and builds the
``SinkResult``. The same pass can feed accumulators of the residual stream (``hook_resid_post``, e.g. massive
activations) from the Hugging Face decoder layers' outputs, so an analysis that needs both gets them from one pass.

Kernels (``fused_attention``), chosen by one explicit table (``sink_kernel``, a pure function of device, dtype, head
size, GQA and mask, tested on the CPU): on CUDA aten's flash attention (the kernel the model's own SDPA forward takes,
with native grouped-query attention and the log-sum-exp), aten's efficient attention where flash does not take the
inputs (an explicit mask, float32, an odd head size: K and V repeated per group); on CPU
``aten._scaled_dot_product_flash_attention_for_cpu`` (masks, GQA); elsewhere ``F.scaled_dot_product_attention``
plus a log-sum-exp computed in query chunks (O(chunk x T) memory, never T x T at once). A fallback from the table's
first choice is logged once and recorded in the result (``meta["kernels"]``); no kernel error is caught.

What the fused path cannot reproduce exactly, it refuses with ``FusedUnsupported`` (``unsupported_reason``
says why before a run): attention-logit soft-capping (Gemma 2), learned sink logits (gpt-oss), additive
position biases (ALiBi), bidirectional attention, models whose attention does not go through the
``AttentionInterface`` (Falcon, BLOOM, GPT-J before transformers 5.24, this package's reference models) and models
with hooks attached (the fused pass would skip them). ``sink_metric(...,
path="auto")`` then takes the eager ``hook_pattern`` path.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from analysis.model.contract import SinkModel
from analysis.model.families import attention_implementation, config_attention_layers
from analysis.model.hooks import act_name, check_attention_layers, check_tokens, model_device, validate_token_ids
from analysis.engine.passes import Accumulator, Batch, LayerActs, batches, default_batch_size
from analysis.core.reductions import ALPHA_CHUNK_ELEMENTS, alpha_from_lse, block_rows, hide_scores
from analysis.core.stats import one_thread

ATTN_NAME = "attention_sinks_fused"  # the name registered in transformers' attention and mask interfaces
LSE_CHUNK = 256  # query rows per chunk of the fall-back log-sum-exp
PREFER: str | None = None  # a kernel among SINK_KERNELS the benchmarks ask for (bench_scale.py --sink-kernel)
EVERY_KEY_SHARE = 4  # alpha for more than T / this keys: attention_with_alpha; fewer: the fused kernel + alpha_from_lse

LOG = logging.getLogger(__name__)
_ACTIVE: contextvars.ContextVar["AlphaAccumulator | None"] = contextvars.ContextVar("fused_sink_acc", default=None)


class FusedUnsupported(NotImplementedError):
    """The model does something the fused path cannot reproduce exactly; use the eager path."""


# ----------------------------------------------------------------------------------------------
# Kernels: output and log-sum-exp of causal attention
# ----------------------------------------------------------------------------------------------


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True = attend) as the additive float mask the fused kernels take."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def chunked_lse(query, key, scale: float, mask: torch.Tensor | None, *, chunk: int = LSE_CHUNK) -> torch.Tensor:
    """Row log-sum-exp of causal (or ``mask``ed) scores, ``chunk`` query rows at a time: (B, H, T) float32.

    Parameters
    ----------
    query : torch.Tensor, shape (B, H, T, d)
    key : torch.Tensor, shape (B, H_kv, T, d)
    scale : float
        The score scale.
    mask : torch.Tensor, shape (B, 1, T, T), or None
        None: causal; boolean (True = attend) or additive float.
    chunk : int
        Query rows per step.

    Returns
    -------
    torch.Tensor, shape (B, H, T)
    """
    T, group = query.shape[-2], query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1) if group > 1 else key.float()
    out = []
    for s in range(0, T, chunk):
        sc = query[..., s : s + chunk, :].float() @ k.transpose(-1, -2) * scale  # (B, H, c, T)
        if mask is None:
            rows = torch.arange(s, s + sc.shape[-2], device=sc.device)[:, None]
            sc = sc.masked_fill(torch.arange(T, device=sc.device)[None, :] > rows, float("-inf"))
        else:
            m = mask[..., s : s + chunk, :]
            sc = sc.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else sc + m.float()
        out.append(sc.logsumexp(-1))
    return torch.cat(out, dim=-1)


def _reference_attention(query, key, value, mask, scale):
    """F.scaled_dot_product_attention and a chunked log-sum-exp (any device)."""
    group = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=group > 1
    )
    return out, chunked_lse(query, key, scale, mask)


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


def sink_kernel(device_type: str, dtype: torch.dtype, head_dim: int, *, gqa: bool, masked: bool,
                prefer: str | None = None) -> SinkKernel:
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
        return SinkKernel("reference", "native" if gqa else "none",
                          f"no fused kernel with a log-sum-exp on {device_type!r}: SDPA plus a chunked log-sum-exp")
    why = ("an explicit mask (padding or a sliding window)" if masked else
           f"dtype {str(dtype).replace('torch.', '')} (flash takes float16/bfloat16)" if dtype not in FLASH_DTYPES else
           f"head size {head_dim} (flash takes multiples of 8 up to {FLASH_MAX_HEAD_DIM})"
           if head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM else "")
    if prefer == "efficient" and not why:
        why = "asked for (prefer='efficient')"
    if not why:
        return SinkKernel("flash", "native" if gqa else "none")
    return SinkKernel("efficient", "repeat" if gqa else "none", f"{why}: the efficient kernel, K and V repeated per "
                      "query group" if gqa else f"{why}: the efficient kernel")


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
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False,
                                                                       scale=scale)[:2]
        return out, lse.float()
    if kernel.name == "efficient":
        k, v = (x.repeat_interleave(group, dim=1) for x in (key, value)) if group > 1 else (key, value)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, k, v, _additive(mask, query.dtype), True, 0.0, mask is None, scale=scale
        )[:2]
        return out, lse[..., :T].float()  # the kernel may pad the lse rows to a multiple of 32
    return _reference_attention(query, key, value, mask, scale)


# ----------------------------------------------------------------------------------------------
# alpha from the log-sum-exp
# ----------------------------------------------------------------------------------------------


def attention_with_alpha(query, key, value, mask: torch.Tensor | None, scale: float, *,
                         chunk_elements: int = ALPHA_CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention and alpha of every key from one pass over blocks of query rows: output (B, H, T, d_v) in
    the query's dtype and alpha (B, H, T) float32 (the convention of :func:`alpha_from_lse`).

    Each block of rows takes its scores against the keys it can see (one product per KV head and its group of
    query heads), the softmax in float32, the output (a second product) and the column sums of the softmax: the
    attention computed once, where the fused kernel plus :func:`alpha_from_lse` compute the scores twice. On a CPU
    it runs on one thread: its many mid-sized operations lose more to a second thread's waits (on a shared
    machine several times their work) than they gain, while the matrix products dominate.

    Parameters
    ----------
    query : torch.Tensor, shape (B, H, T, d)
    key : torch.Tensor, shape (B, H_kv, T, d)
    value : torch.Tensor, shape (B, H_kv, T, d_v)
    mask : torch.Tensor, shape (B, 1 or H, T, T), or None
    scale : float
    chunk_elements : int
        The most scores held at a time.

    Returns
    -------
    output : torch.Tensor, shape (B, H, T, d_v)
    alpha : torch.Tensor, shape (B, H, T)
    """
    B, H, T, d = query.shape
    H_kv = key.shape[1]
    group = H // H_kv
    with one_thread() if query.device.type == "cpu" else contextlib.nullcontext():
        q = (query.float() * scale).unflatten(1, (H_kv, group))  # (B, H_kv, g, T, d)
        k, v = key.float(), value.float()
        out = torch.empty(B, H_kv, group, T, v.shape[-1], device=query.device)
        sums = torch.zeros(B, H_kv, group, T, dtype=torch.float64, device=query.device)
        rows = block_rows(B, H, T, chunk_elements)
        for s in range(0, T, rows):
            e = min(s + rows, T)
            sc = q[..., s:e, :].reshape(B, H_kv, group * (e - s), d) @ k[..., :e, :].transpose(-1, -2)
            hide_scores(sc.view(B, H_kv, group, e - s, e), s, e, e, mask, float("-inf"))
            sc.sub_(sc.amax(-1, keepdim=True)).exp_()
            sc.div_(sc.sum(-1, keepdim=True))  # the attention A[i, j] of rows s..e-1
            out[..., s:e, :] = (sc @ v[..., :e, :]).view(B, H_kv, group, e - s, -1)
            sums[..., :e] += sc.view(B, H_kv, group, e - s, e).sum(dim=-2)
        counts = (T - torch.arange(T, device=query.device)).double()
        return out.flatten(1, 2).to(query.dtype), (sums / counts).float().flatten(1, 2)


class AlphaAccumulator(Accumulator):
    """alpha per batch and attention layer, gathered into (N, L, H, K) with L = len(layers) (true layer indices:
    a hybrid's linear-attention / Mamba layers never report): ``update`` once per layer, ``end_batch`` after
    each batch (checks every layer reported), ``result()`` at the end. It reads no hook: the fused attention
    function hands it each layer's alpha as ``{"alpha": (B, H, K)}``."""

    def __init__(self, layers, k_max: int, *, prefer: str | None = None):
        self.layers, self.k_max, self.prefer = [int(l) for l in layers], int(k_max), prefer
        self.kernels: dict[str, str] = {}  # kernel name -> its fallback reason ("" for the table's first choice)
        self._current: dict[int, torch.Tensor] = {}
        self._chunks: list[torch.Tensor] = []
        self.calls = 0  # attention calls seen in this batch (the layer index where a module has none)

    def hooks(self) -> dict[int, dict[str, str]]:
        return {}  # fed by the fused attention function, not by hooks

    def update(self, layer: int, acts: dict[str, torch.Tensor], batch: Batch | None = None) -> None:
        if layer not in self.layers:
            raise FusedUnsupported(f"attention reported layer {layer}, not among the attention layers {self.layers}.")
        self._current[layer] = acts["alpha"]  # on the layer's device until the batch ends: one copy per batch
        self.calls += 1

    def end_batch(self, batch: Batch | None = None, logits: torch.Tensor | None = None) -> None:
        missing = [l for l in self.layers if l not in self._current]
        if len(missing) == len(self.layers):
            raise FusedUnsupported(
                "no layer's attention went through transformers' AttentionInterface (a custom attention module)."
            )
        if missing:
            raise FusedUnsupported(
                f"layers {missing} did not report to the fused attention function (a module that bypasses the "
                "AttentionInterface); alpha there needs the eager path."
            )
        self._chunks.append(torch.stack([self._current[l].to(self._current[self.layers[0]].device)
                                         for l in self.layers], dim=1).cpu())  # (B, L, H, K)
        self._current = {}
        self.calls = 0

    def result(self) -> torch.Tensor:
        if not self._chunks:
            raise RuntimeError("no batch was run.")
        return torch.cat(self._chunks)


# ----------------------------------------------------------------------------------------------
# The attention function registered with transformers
# ----------------------------------------------------------------------------------------------


def _refuse_extras(module, attention_mask, is_causal, kwargs) -> None:
    if kwargs.get("softcap") is not None or getattr(module, "attn_logit_softcapping", None) is not None:
        raise FusedUnsupported("attention-logit soft-capping changes the scores the lse is taken over.")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise FusedUnsupported("learned sink logits join the softmax as an extra column.")
    if kwargs.get("position_bias") is not None:
        raise FusedUnsupported("an additive position bias (ALiBi and the like) is not in q·k.")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and not causal:
        raise FusedUnsupported("bidirectional attention: alpha_k here is defined for causal attention.")


def sink_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                           **kwargs):
    """An ``AttentionInterface`` function: fused attention, plus alpha of this layer into the active accumulator.

    Same contract as transformers' ``sdpa_attention_forward``: q (B, H, T, d), k/v (B, H_kv, T, d); returns
    the output as (B, T, H, d) and no weights.

    Parameters
    ----------
    module : torch.nn.Module
        The attention module (its ``layer_idx`` names the layer).
    query : torch.Tensor, shape (B, H, T, d)
    key, value : torch.Tensor, shape (B, H_kv, T, d)
    attention_mask : torch.Tensor or None
    dropout, scaling, is_causal, **kwargs
        As transformers passes them (dropout is ignored: evaluation only; soft-capping, sink logits and position
        biases raise FusedUnsupported).

    Returns
    -------
    output : torch.Tensor, shape (B, T, H, d)
    weights : None
    """
    acc = _ACTIVE.get()
    if acc is None:
        raise RuntimeError(f"the {ATTN_NAME!r} attention runs only inside analysis.engine.fused_sink.fused_alpha.")
    _refuse_extras(module, attention_mask, is_causal, kwargs)
    if query.shape[-2] != key.shape[-2]:
        raise FusedUnsupported("queries and keys differ in length (a KV cache); run without a cache.")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = attention_mask
    if mask is not None and mask.ndim == 4 and mask.shape[-1] > key.shape[-2]:
        mask = mask[..., : key.shape[-2]]
    if acc.k_max > query.shape[-2] // EVERY_KEY_SHARE:  # many keys: the attention and alpha in one blocked pass
        acc.kernels.setdefault("blocked (every key)", "")
        out, alpha = attention_with_alpha(query, key, value, mask, scale)
        alpha = alpha[..., : acc.k_max]
    else:
        kernel = sink_kernel(query.device.type, query.dtype, query.shape[-1], gqa=query.shape[1] > key.shape[1],
                             masked=mask is not None, prefer=acc.prefer)
        state_fallback(kernel)
        acc.kernels.setdefault(kernel.name, kernel.fallback)
        out, lse = fused_attention(query, key, value, mask, scale, kernel=kernel)
        alpha = alpha_from_lse(query, key, lse, scale, acc.k_max, mask=mask)
    layer = getattr(module, "layer_idx", None)
    layer = acc.layers[min(acc.calls, len(acc.layers) - 1)] if layer is None else int(layer)
    acc.update(layer, {"alpha": alpha})
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface  # lazy: import time (the package imports without transformers loaded)
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, sink_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)  # the masks SDPA gets: None when plainly causal


# ----------------------------------------------------------------------------------------------
# Running a Hugging Face model (bare, or the one inside a TransformerBridge)
# ----------------------------------------------------------------------------------------------


def hf_model(model: SinkModel) -> nn.Module:
    """The Hugging Face ``PreTrainedModel`` of ``model`` (itself, or a TransformerBridge's ``original_model``).

    Parameters
    ----------
    model

    Returns
    -------
    transformers.PreTrainedModel
        FusedUnsupported otherwise.
    """
    from transformers import PreTrainedModel  # lazy: import time

    inner = model if isinstance(model, PreTrainedModel) else getattr(model, "original_model", None)
    if not isinstance(inner, PreTrainedModel):
        raise FusedUnsupported(
            f"{type(model).__name__} is neither a Hugging Face PreTrainedModel nor a TransformerBridge around one."
        )
    return inner


def unsupported_reason(model: SinkModel) -> str | None:
    """Why the fused path cannot give this model's exact alpha (None when it can), read from its config/modules.

    Parameters
    ----------
    model

    Returns
    -------
    str or None
    """
    try:
        hf = hf_model(model)
    except FusedUnsupported as e:
        return str(e)
    cfg = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention-logit soft-capping (attn_logit_softcapping) changes the scores the lse is taken over."
    if getattr(cfg, "alibi", False) or getattr(cfg, "model_type", "") in ("bloom", "mpt"):
        return "an ALiBi position bias is added to the scores outside q·k."
    if any(n.rpartition(".")[2] == "sinks" for n, _ in hf.named_parameters()):
        return "learned sink logits (gpt-oss) join the softmax as an extra column."
    hooked = _hooked(model, bridged=model is not hf)
    if hooked:
        return f"hooks are attached ({hooked[0]}{', ...' if len(hooked) > 1 else ''}); they run only on the eager path."
    return None


def _hooked(model: nn.Module, bridged: bool) -> list[str]:
    """Modules with user hooks: a bridge's hook points (its own wiring hooks aside), or any module of an HF model."""
    from transformer_lens.hook_points import HookPoint  # lazy: import time

    return [n for n, m in model.named_modules()
            if (m._forward_hooks or m._forward_pre_hooks) and (not bridged or isinstance(m, HookPoint))]


def _unwrap(module: nn.Module) -> nn.Module:
    while isinstance(getattr(module, "original_component", None), nn.Module):
        module = module.original_component
    return module


@contextlib.contextmanager
def unbridged(hf: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``hf`` holds its own modules again where a TransformerBridge put its wrappers (the
    bridge re-implements attention eagerly); the wrappers are put back on exit, whatever happens.

    Parameters
    ----------
    hf : torch.nn.Module

    Yields
    ------
    torch.nn.Module
        ``hf``.
    """
    swaps: list[tuple[nn.Module, str, nn.Module]] = []

    def walk(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            inner = _unwrap(child)
            if inner is not child:
                setattr(parent, name, inner)
                swaps.append((parent, name, child))
            walk(inner)

    try:
        walk(hf)
        yield hf
    finally:
        for parent, name, child in reversed(swaps):
            setattr(parent, name, child)


def check_fused_tokens(model: SinkModel, tokens) -> torch.Tensor:
    """Token ids (N, T) checked by the package's one validator (``analysis.model.hooks.validate_token_ids``): against the
    hook contract for a model with hooks (a bridge), against the Hugging Face config's context and vocabulary for
    a bare model.

    Parameters
    ----------
    model
    tokens : torch.Tensor, shape (N, T)

    Returns
    -------
    torch.LongTensor, shape (N, T)
    """
    if hasattr(model, "hook_dict"):
        return check_tokens(model, tokens)
    cfg = hf_model(model).config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return validate_token_ids(tokens, getattr(cfg, "max_position_embeddings", None), getattr(cfg, "vocab_size", None))


def fused_layers(model: SinkModel) -> list[int]:
    """The attention layers (true indices) the fused pass measures: ``analysis.model.hooks.check_attention_layers`` for a
    model with hooks (a bridge), the layer types of the Hugging Face config for a bare model.

    Parameters
    ----------
    model

    Returns
    -------
    list of int
    """
    if hasattr(model, "hook_dict"):
        return check_attention_layers(model)
    return config_attention_layers(hf_model(model).config)


def _decoder_layers(model) -> list[nn.Module]:
    """The Hugging Face decoder layer inside each block of a bridge (true layer indices): their outputs are the
    residual stream after each block, ``hook_resid_post``."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or not hasattr(model, "hook_dict"):
        raise FusedUnsupported("residual-stream accumulators on the fused pass need a TransformerBridge (blocks with "
                               "hook names); use the eager path.")
    return [_unwrap(b) for b in blocks]


class _ResidTaps:
    """Forward hooks on the Hugging Face decoder layers that hand each layer's output (the residual stream after the
    block, as the bridge's ``hook_resid_post``) to the accumulators that asked for it, as the streamed pass does.
    Only ``hook_resid_post`` can be tapped here; other hooks raise ``FusedUnsupported``."""

    def __init__(self, model, accumulators: Sequence[Accumulator]):
        self.accs = list(accumulators)
        self.wants: dict[int, list[tuple[Accumulator, dict[str, str]]]] = {}
        for acc in self.accs:
            for layer, names in acc.hooks().items():
                wrong = [n for n in names.values() if n != act_name("resid_post", layer)]
                if wrong:
                    raise FusedUnsupported(f"the fused pass feeds only hook_resid_post to accumulators; "
                                           f"{type(acc).__name__} asks for {wrong[:2]}: use the eager path.")
                self.wants.setdefault(int(layer), []).append((acc, names))
        self.layers = _decoder_layers(model) if self.wants else []
        self.batch: Batch | None = None

    def _hook(self, layer: int):
        def fn(module, args, output):
            x = output[0] if isinstance(output, (tuple, list)) else output
            scratch: dict = {}
            for acc, names in self.wants[layer]:
                acc.update(layer, LayerActs({k: x for k in names}, scratch), self.batch)
        return fn

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        handles = [self.layers[l].register_forward_hook(self._hook(l)) for l in self.wants]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def end_batch(self) -> None:
        for acc in self.accs:
            acc.end_batch(self.batch, None)


def fused_alpha(model: SinkModel, tokens, k_max: int, *, batch_size: int | None = None, progress: bool = False,
                accumulators: Sequence[Accumulator] = (), kernel: str | None = None,
                record: dict | None = None) -> torch.Tensor:
    """alpha from one fused forward pass of ``model`` per batch.

    The base model runs without a KV cache and without the unembedding (alpha needs neither).

    Parameters
    ----------
    model
        A TransformerBridge or a Hugging Face ``PreTrainedModel``.
    tokens : torch.Tensor, shape (N, T)
        Unpadded token ids.
    k_max : int
        In [1, T]: alpha is kept for keys 1..k_max (k_max = T: every key, the sink at any position).
    batch_size : int, optional
        Sequences per batch (default about 2k tokens a batch).
    progress : bool
        Show a progress bar over batches.
    accumulators : sequence of Accumulator
        Accumulators (``analysis.engine.passes.Accumulator``) that read only ``hook_resid_post``, fed in the same pass from the
        decoder layers' outputs (a bridge only); their ``result()`` is the caller's to take.
    kernel : str, optional
        A kernel among ``SINK_KERNELS`` to prefer where the device has it (benchmarks); None: ``PREFER``, else
        ``sink_kernel``'s table.
    record : dict, optional
        Filled with ``{"kernels": {name: fallback reason or ""}}``: the kernels the layers took.

    Returns
    -------
    torch.Tensor, shape (N, L, H, k_max)
        float32 on the CPU; L runs over ``fused_layers(model)`` (the attention layers, true indices). Raises
        ``FusedUnsupported`` where the fused path is not exact.
    """
    reason = unsupported_reason(model)
    if reason:
        raise FusedUnsupported(reason)
    hf = hf_model(model)
    tokens = check_fused_tokens(model, tokens)
    if not 1 <= int(k_max) <= tokens.shape[1]:
        raise ValueError(f"k_max must lie in [1, T={tokens.shape[1]}]; got {k_max}.")
    acc = AlphaAccumulator(fused_layers(model), k_max, prefer=kernel if kernel is not None else PREFER)
    taps = _ResidTaps(model, accumulators)
    device = model_device(model)  # the embedding's execution device (never the first parameter: maybe on disk)
    bs = batch_size or default_batch_size(tokens)
    it = batches(tokens, bs)
    if progress:
        from tqdm.auto import tqdm  # lazy: import time (tqdm.auto looks for notebook widgets)

        it = tqdm(it, total=math.ceil(tokens.shape[0] / bs), desc="batches", leave=False)
    _register()
    token = _ACTIVE.set(acc)
    try:
        with unbridged(hf), attention_implementation(hf, ATTN_NAME), torch.inference_mode(), taps.attached():
            for start, batch in zip(range(0, tokens.shape[0], bs), it):
                taps.batch = Batch(batch.to(device), start)
                hf.base_model(input_ids=taps.batch.tokens, use_cache=False)
                acc.end_batch(taps.batch, None)
                taps.end_batch()
    finally:
        _ACTIVE.reset(token)
    if record is not None:
        record["kernels"] = dict(acc.kernels)
    return acc.result()
