"""The sink metric at the cost of a fused attention forward pass: alpha from q, k and the log-sum-exp.

A fused attention kernel never builds the T x T map, but it returns each query row's log-sum-exp
``lse_i = log sum_j exp(s_ij)``, s_ij = q_i . k_j * scale. Any entry of the map follows from it,

    A[i, k] = exp(q_i . k_k * scale - lse_i),

so alpha_k (see ``analysis.sink``) for keys 1..k_max needs only the (T x k_max) scores of those keys. The pass
runs the Hugging Face model with an attention function registered in transformers' ``AttentionInterface`` for
the duration of the run, so every family's q and k arrive after their rotary and q/k norms; the function
computes the output with the fused kernel, takes the lse and folds alpha (B, H, k_max) of its layer into an
``AlphaAccumulator``. Under grouped-query attention only the k_max keys are expanded to the query heads.

Kernels (``fused_attention``): on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (masks, GQA);
on CUDA ``aten._scaled_dot_product_efficient_attention`` with ``compute_log_sumexp=True``; elsewhere, or if the
kernel refuses the inputs, ``F.scaled_dot_product_attention`` plus a log-sum-exp computed in query chunks
(O(chunk x T) memory, never T x T at once).

What the fused path cannot reproduce exactly, it refuses with ``FusedUnsupported`` (``unsupported_reason``
says why before a run): attention-logit soft-capping (Gemma 2), learned sink logits (gpt-oss), additive
position biases (ALiBi), bidirectional attention, models whose attention does not go through the
``AttentionInterface`` (GPT-J, Falcon, this package's reference models) and models with hooks attached (the
fused pass would skip them). ``sink_metric(...,
path="auto")`` then takes the eager ``hook_pattern`` path.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator

import torch
from torch import nn

from analysis.hooks import check_tokens
from analysis.passes import batches, default_batch_size

ATTN_NAME = "attention_sinks_fused"  # the name registered in transformers' attention and mask interfaces
LSE_CHUNK = 256  # query rows per chunk of the fall-back log-sum-exp

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


def chunked_lse(query, key, scale: float, mask: torch.Tensor | None, chunk: int = LSE_CHUNK) -> torch.Tensor:
    """Row log-sum-exp of causal (or ``mask``ed) scores, ``chunk`` query rows at a time: (B, H, T) float32."""
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


def fused_attention(query, key, value, mask: torch.Tensor | None, scale: float):
    """Causal attention output (B, H, T, d) and row log-sum-exp (B, H, T) float32 from a fused kernel.

    ``query`` (B, H, T, d); ``key``/``value`` (B, H_kv, T, d) with H a multiple of H_kv; ``mask`` None (causal)
    or (B, 1, T, T) boolean (True = attend) / additive float.
    """
    T = query.shape[-2]
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, mask is None, attn_mask=_additive(mask, query.dtype), scale=scale
        )
    if query.device.type == "cuda":
        group = query.shape[1] // key.shape[1]
        k, v = (x.repeat_interleave(group, dim=1) for x in (key, value)) if group > 1 else (key, value)
        try:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, k, v, _additive(mask, query.dtype), True, 0.0, mask is None, scale=scale
            )[:2]
            return out, lse[..., :T].float()  # the kernel may pad the lse rows to a multiple of 32
        except RuntimeError:  # inputs the kernel does not take (head size, dtype): the reference path
            pass
    return _reference_attention(query, key, value, mask, scale)


# ----------------------------------------------------------------------------------------------
# alpha from the log-sum-exp
# ----------------------------------------------------------------------------------------------


def alpha_from_lse(query, key, lse, scale: float, k_max: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """alpha_k for keys 1..k_max, (B, H, k_max) float32, from q (B, H, T, d), k (B, H_kv, T, d) and lse (B, H, T).

    Same convention as ``analysis.sink.alpha_from_pattern``: the queries a key is averaged over are i >= k,
    counted T - k + 1 times (1-based k); entries the mask hides (sliding windows) count as zero attention.
    """
    T = query.shape[-2]
    k_max = min(int(k_max), T)
    keys = key[..., :k_max, :].float()
    group = query.shape[1] // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)  # only k_max keys are expanded
    scores = query.float() @ keys.transpose(-1, -2) * scale  # (B, H, T, k_max)
    rows = torch.arange(T, device=query.device)[:, None]
    seen = rows >= torch.arange(k_max, device=query.device)[None, :]  # (T, k_max)
    if mask is not None:
        cols = mask[..., :k_max]
        seen = seen & (cols if cols.dtype == torch.bool else cols > float("-inf"))
    a = (scores - lse.float()[..., None]).masked_fill(~seen, float("-inf")).exp()
    counts = (T - torch.arange(k_max, device=query.device)).float()  # T - k + 1 for 1-based k
    return a.sum(dim=-2) / counts


class AlphaAccumulator:
    """alpha per batch and attention layer, gathered into (N, L, H, K) with L = len(layers) (true layer indices:
    a hybrid's linear-attention / Mamba layers never report): ``update`` once per layer, ``end_batch`` after
    each batch (checks every layer reported), ``result()`` at the end."""

    def __init__(self, layers, k_max: int):
        self.layers, self.k_max = [int(l) for l in layers], int(k_max)
        self._current: dict[int, torch.Tensor] = {}
        self._chunks: list[torch.Tensor] = []
        self.calls = 0  # attention calls seen in this batch (the layer index where a module has none)

    def update(self, layer: int, alpha: torch.Tensor) -> None:
        if layer not in self.layers:
            raise FusedUnsupported(f"attention reported layer {layer}, not among the attention layers {self.layers}.")
        self._current[layer] = alpha.cpu()
        self.calls += 1

    def end_batch(self) -> None:
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
        self._chunks.append(torch.stack([self._current[l] for l in self.layers], dim=1))  # (B, L, H, K)
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
    """
    acc = _ACTIVE.get()
    if acc is None:
        raise RuntimeError(f"the {ATTN_NAME!r} attention runs only inside analysis.fused_sink.fused_alpha.")
    _refuse_extras(module, attention_mask, is_causal, kwargs)
    if query.shape[-2] != key.shape[-2]:
        raise FusedUnsupported("queries and keys differ in length (a KV cache); run without a cache.")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = attention_mask
    if mask is not None and mask.ndim == 4 and mask.shape[-1] > key.shape[-2]:
        mask = mask[..., : key.shape[-2]]
    out, lse = fused_attention(query, key, value, mask, scale)
    layer = getattr(module, "layer_idx", None)
    layer = acc.layers[min(acc.calls, len(acc.layers) - 1)] if layer is None else int(layer)
    acc.update(layer, alpha_from_lse(query, key, lse, scale, acc.k_max, mask))
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, sink_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)  # the masks SDPA gets: None when plainly causal


# ----------------------------------------------------------------------------------------------
# Running a Hugging Face model (bare, or the one inside a TransformerBridge)
# ----------------------------------------------------------------------------------------------


def hf_model(model) -> nn.Module:
    """The Hugging Face ``PreTrainedModel`` of ``model`` (itself, or a TransformerBridge's ``original_model``)."""
    from transformers import PreTrainedModel

    inner = model if isinstance(model, PreTrainedModel) else getattr(model, "original_model", None)
    if not isinstance(inner, PreTrainedModel):
        raise FusedUnsupported(
            f"{type(model).__name__} is neither a Hugging Face PreTrainedModel nor a TransformerBridge around one."
        )
    return inner


def unsupported_reason(model) -> str | None:
    """Why the fused path cannot give this model's exact alpha (None when it can), read from its config/modules."""
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
    from transformer_lens.hook_points import HookPoint

    return [n for n, m in model.named_modules()
            if (m._forward_hooks or m._forward_pre_hooks) and (not bridged or isinstance(m, HookPoint))]


def _unwrap(module: nn.Module) -> nn.Module:
    while isinstance(getattr(module, "original_component", None), nn.Module):
        module = module.original_component
    return module


@contextlib.contextmanager
def unbridged(hf: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``hf`` holds its own modules again where a TransformerBridge put its wrappers (the
    bridge re-implements attention eagerly); the wrappers are put back on exit, whatever happens."""
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


@contextlib.contextmanager
def attention_implementation(hf: nn.Module, name: str) -> Iterator[None]:
    """``hf.config._attn_implementation`` (and its sub-configs') set to ``name`` within the block."""
    old = hf.config._attn_implementation
    hf.config._attn_implementation = name
    try:
        yield
    finally:
        hf.config._attn_implementation = old


def _check_tokens(model, tokens) -> torch.Tensor:
    """The package's token checks: ``analysis.hooks.check_tokens`` for a model with hooks (a bridge), the same
    checks against the Hugging Face config for a bare model."""
    if hasattr(model, "hook_dict"):
        return check_tokens(model, tokens)
    tokens = torch.as_tensor(tokens)
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape (N, T); got {tuple(tokens.shape)}.")
    if tokens.numel() == 0:
        raise ValueError("tokens are empty: give at least one sequence of at least one token.")
    if tokens.is_floating_point():
        raise ValueError("tokens must be integer token ids, not floats.")
    hf = hf_model(model)
    cfg = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    n_ctx = getattr(cfg, "max_position_embeddings", None)
    if n_ctx is not None and tokens.shape[1] > n_ctx:
        raise ValueError(f"sequence length T={tokens.shape[1]} exceeds the model's context of {n_ctx} tokens; "
                         f"use T <= {n_ctx}.")
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None and (int(tokens.max()) >= vocab or int(tokens.min()) < 0):
        raise ValueError(f"token ids must lie in [0, {vocab}); got ids in [{int(tokens.min())}, {int(tokens.max())}].")
    return tokens.long()


def fused_layers(model) -> list[int]:
    """The attention layers (true indices) the fused pass measures: ``analysis.hooks.attention_layers_of`` for a
    model with hooks (a bridge), the layer types of the Hugging Face config for a bare model."""
    if hasattr(model, "hook_dict"):
        from analysis.hooks import attention_layers_of

        return attention_layers_of(model)
    from analysis.families import config_attention_layers

    return config_attention_layers(hf_model(model).config)


def fused_alpha(model, tokens, k_max: int, batch_size: int | None = None, progress: bool = False) -> torch.Tensor:
    """alpha (N, L, H, k_max) float32 on CPU from one fused forward pass of ``model`` (HF model or bridge) per batch;
    L runs over ``fused_layers(model)`` (the attention layers, true indices).

    ``tokens`` (N, T): unpadded sequences. The base model runs without a KV cache and without the unembedding
    (alpha needs neither). Raises ``FusedUnsupported`` where the fused path is not exact.
    """
    reason = unsupported_reason(model)
    if reason:
        raise FusedUnsupported(reason)
    hf = hf_model(model)
    tokens = _check_tokens(model, tokens)
    if not 1 <= int(k_max) <= tokens.shape[1]:
        raise ValueError(f"k_max must lie in [1, T={tokens.shape[1]}]; got {k_max}.")
    acc = AlphaAccumulator(fused_layers(model), k_max)
    device = next(hf.parameters()).device
    bs = batch_size or default_batch_size(tokens)
    it = batches(tokens, bs)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, total=math.ceil(tokens.shape[0] / bs), desc="batches", leave=False)
    _register()
    token = _ACTIVE.set(acc)
    try:
        with unbridged(hf), attention_implementation(hf, ATTN_NAME), torch.inference_mode():
            for batch in it:
                hf.base_model(input_ids=batch.to(device), use_cache=False)
                acc.end_batch()
    finally:
        _ACTIVE.reset(token)
    return acc.result()


def sink_metric_fused(model, tokens, eps: float | None = None, k_max: int | None = None,
                      batch_size: int | None = None, progress: bool = False, kind: str | None = None):
    """``analysis.sink.sink_metric`` through the fused pass: the same ``SinkResult``, no T x T map built."""
    from analysis.sink import DEFAULT_EPS, SinkResult, check_eps, check_k_max

    hf_model(model)  # not a Hugging Face model: FusedUnsupported before any token check
    tokens = _check_tokens(model, tokens)
    T = tokens.shape[1]
    eps = check_eps(DEFAULT_EPS if eps is None else eps)
    alpha = fused_alpha(model, tokens, check_k_max(k_max, T), batch_size, progress)
    skipped = ""
    if hasattr(model, "hook_dict"):
        from analysis.hooks import skipped_note

        skipped = skipped_note(model)
    return SinkResult(alpha, eps, T, getattr(model, "model_name", None), kind, meta={"path": "fused"},
                      layers=fused_layers(model), skipped=skipped)
