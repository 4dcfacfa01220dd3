"""Typed reads of what lies under the model contract: the one place above which no floor touches Hugging Face or
TransformerLens internals (the bridge's blocks and wrapped modules, a config's fields, transformers' registries).

The engine and the analyses call these; ``tests/model/test_reaches.py`` counts the places outside ``analysis/model/``
that still reach past them. Grouped by who asks:

- the pass engine: :func:`can_skip_blocks` and :func:`skipped_blocks` (resuming a pass at a block),
  :func:`unwrap_component` and :func:`attention_layer_index` (the Hugging Face module in a bridge's wrapper, the layer
  of an attention module), :func:`register_attention` (a function in transformers' ``AttentionInterface``),
  :func:`interface_refusal` (why a model's attention is not what the interface computes), :func:`hooked_modules`;
- the analyses: :func:`head_output_weights` (W_O per head), :func:`vocab_size`, :func:`positional_encoding_name`,
  :func:`layer_position_module`, :func:`attention_logit_scale`, :func:`attention_operation`, :func:`attention_window`;
- the reference models' own options (``analysis.train``, ``analysis.dynamics``): :func:`reference_config`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from analysis.model.contract import ModelContractError, SinkModel, hf_module
from analysis.model.reference.config import ModelConfig
from analysis.model.weights import materialized

_WRAPPED = "_original_component"  # where a bridge block keeps the Hugging Face block it wraps


def _stated(model, field: str, default=None):
    """A field of the model's TransformerLens or reference config (``model.cfg``); ``default`` where it has none."""
    return getattr(getattr(model, "cfg", None), field, default)


def _text_config(hf: torch.nn.Module):
    """A Hugging Face model's text config (its decoder's, for a multimodal one)."""
    cfg = hf.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


# ----------------------------------------------------------------------------- The pass engine


def can_skip_blocks(model: SinkModel) -> bool:
    """Whether the first blocks of ``model`` can be stood in for (:func:`skipped_blocks`): a TransformerBridge whose
    every block wraps a Hugging Face block, not split by a device map.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    bool
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None or not all(_WRAPPED in getattr(b, "_modules", {}) for b in blocks):
        return False
    return not getattr(hf_module(model), "hf_device_map", None)


class _PassOn(torch.nn.Module):
    """Stands in for a skipped block: hands its input on unchanged (the resumed block swaps in its residual)."""

    def forward(self, *args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]


@contextmanager
def skipped_blocks(model: SinkModel, layer: int) -> Iterator[None]:
    """Within the block, blocks 0..layer-1 of a bridge hand their input on unchanged (restored on exit, whatever
    happens).

    Parameters
    ----------
    model : SinkModel
        A model :func:`can_skip_blocks` accepts.
    layer : int
        The first block that runs.

    Yields
    ------
    None
    """
    blocks = list(model.blocks)[:layer]
    kept = [b._modules[_WRAPPED] for b in blocks]
    try:
        for b in blocks:
            b._modules[_WRAPPED] = _PassOn()
        yield
    finally:
        for b, m in zip(blocks, kept):
            b._modules[_WRAPPED] = m


def unwrap_component(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face module inside a bridge's wrapper (``module`` itself where it wraps none).

    Parameters
    ----------
    module : torch.nn.Module

    Returns
    -------
    torch.nn.Module
    """
    while isinstance(getattr(module, "original_component", None), torch.nn.Module):
        module = module.original_component
    return module


def _piece(i: int, groups: int = 1, width: int = -1) -> tuple[Callable, Callable]:
    """Piece ``i`` of 2 along the last dim, in each of ``groups`` groups of 2 * ``width``: (take(x), put(x, y))."""
    cut = lambda x: x.unflatten(-1, (groups, 2, width))  # noqa: E731

    def put(x, y):
        pieces = list(cut(x).unbind(-2))
        pieces[i] = y.reshape(pieces[i].shape)
        return torch.stack(pieces, -2).flatten(-3)

    return (lambda x: cut(x)[..., i, :].flatten(-2)), put


def module_part(model: SinkModel, name: str, spec) -> tuple[torch.nn.Module, str, Callable, Callable] | None:
    """Where a bridge hook that no Hugging Face module gives whole is a part of one's input or output: (module, "in"
    or "out", ``take(x)`` the hook's value from that activation, ``put(x, y)`` the activation with the value edited).

    ``hook_q``/``hook_k``: the q and k projections' outputs, by head (not MLA's); the gate and up halves of a joint
    gate-up projection (Phi-3, GLM-4); Granite's ``hook_attn_out``/``hook_mlp_out`` (the sublayer's output times the
    residual multiplier); and, where the heads are gated (Qwen3-Next), the gate logits (each head's second half of the
    q projection, whose ``hook_q`` holds both, as 2 H heads) and z (the output projection's input, by head). A norm's
    ``hook_normalized`` is its input normalised as the bridge does it, beside the module: ``put`` is None (no edit).
    None elsewhere.

    Parameters
    ----------
    model : SinkModel
    name : str
        A hook name of the bridge.
    spec : FamilySpec
        The model's family (its gate, its latent attention).

    Returns
    -------
    tuple or None
    """
    path, _, site = name.rpartition(".")
    parent, _, last = path.rpartition(".")
    try:
        owner, own = model.get_submodule(parent), model.get_submodule(path)
    except AttributeError:
        return None
    if getattr(owner, "fused_attr", None) and last in ("gate", "in") and site == "hook_out":
        return (unwrap_component(getattr(unwrap_component(owner), owner.fused_attr)), "out", *_piece(int(last == "in")))
    if site == "hook_normalized" and hasattr(own, "uses_rms_norm"):  # the bridge's, beside the module: read-only
        norm, rms = unwrap_component(own), own.uses_rms_norm
        eps = next((e for e in (getattr(norm, a, None) for a in ("eps", "variance_epsilon")) if e is not None), 1e-5)

        def normalise(x):
            x = x.float() if rms else x.float() - x.float().mean(-1, keepdim=True)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

        return norm, "in", normalise, None
    scale = getattr(own, "residual_contribution_scale", None)
    sub = site in ("hook_attn_out", "hook_mlp_out") and getattr(own, f"scaled_{site[5:-4]}_submodule", None)
    if scale is not None and sub:
        return unwrap_component(own.submodules[sub]), "out", lambda x: x * scale, lambda x, y: y / scale
    attn = unwrap_component(own)
    d = getattr(attn, "head_dim", None) if last == "attn" and spec.latent is None else None
    proj = {"hook_q": "q_proj", "hook_k": "k_proj", **({"hook_z": "o_proj"} if spec.gate else {})}
    if d and site in proj and hasattr(attn, proj[site]):  # q and k but a joint QKV projection's; a gated z
        by_head = lambda x: x.unflatten(-1, (-1, d)), lambda x, y: y.flatten(-2)
        return unwrap_component(getattr(attn, proj[site])), "in" if site == "hook_z" else "out", *by_head
    if d and spec.gate and site == "hook_q_gate":  # the query and the gate interleaved per head
        return unwrap_component(attn.q_proj), "out", *_piece(1, -1, d)
    return None


def attention_layer_index(module: torch.nn.Module) -> int:
    """The layer of a Hugging Face attention module (``layer_idx``, set by transformers).

    Parameters
    ----------
    module : torch.nn.Module

    Returns
    -------
    int
    """
    return int(module.layer_idx)


def register_attention(name: str, fn: Callable) -> None:
    """Register ``fn`` as the attention ``name`` in transformers' ``AttentionInterface``, with SDPA's mask (None
    where the attention is plainly causal).

    Parameters
    ----------
    name : str
    fn : callable
        ``(module, query, key, value, attention_mask, scaling=..., ...) -> (out, weights)``.

    Returns
    -------
    None
    """
    from transformers import AttentionInterface  # lazy: import time
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)


def interface_refusal(model: SinkModel) -> str | None:
    """Why ``model``'s attention is not what transformers' ``AttentionInterface`` computes from q, k and v (None
    when it is), read from its config and parameters.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    str or None
    """
    hf = hf_module(model)
    if hf is None:
        return f"{type(model).__name__} is not a Hugging Face model through a TransformerBridge (a reference model)"
    if not hf._can_set_attn_implementation():
        return "its attention does not go through transformers' AttentionInterface (a custom attention module)"
    cfg = _text_config(hf)
    if getattr(cfg, "alibi", False) or getattr(cfg, "model_type", "") in ("bloom", "mpt"):
        return "an ALiBi position bias is added to the scores outside q·k"
    return None


def hooked_modules(module: torch.nn.Module, *, bridged: bool) -> list[str]:
    """The modules with user hooks: a bridge's hook points (its own wiring aside: the hooks that relay an MLP split
    over a layer, OPT's ``fc1``/``fc2``, to ``mlp.hook_in``/``hook_out``), or any module of a Hugging Face model.

    Parameters
    ----------
    module : torch.nn.Module
        A bridge or a Hugging Face model.
    bridged : bool
        Whether ``module`` is a bridge (only its hook points count).

    Returns
    -------
    list of str
    """
    from transformer_lens.hook_points import HookPoint  # lazy: import time

    wired = [m.submodules for m in module.modules() if getattr(m, "_placeholder_hooks_wired", False)]
    relays = {id(getattr(w[s], f"hook_{s}")) for w in wired for s in ("in", "out") if w.get(s) is not None}  # one each
    return [
        n
        for n, m in module.named_modules()
        if len(m._forward_hooks) + len(m._forward_pre_hooks) > (id(m) in relays)
        and (not bridged or isinstance(m, HookPoint))
    ]


# ----------------------------------------------------------------------------- The analyses


def head_output_weights(model: SinkModel, layer: int) -> torch.Tensor:
    """A layer's per-head output weights W_O (H, d_head, d_model), TransformerLens' layout, detached.

    Parameters
    ----------
    model : SinkModel
    layer : int

    Returns
    -------
    torch.Tensor
        ModelContractError where the layer exposes none.
    """
    block = model.blocks[layer]
    with materialized(block):  # the real W_O on a model with offloaded blocks
        W = getattr(getattr(block, "attn", None), "W_O", None)
        W = W.detach() if isinstance(W, torch.Tensor) else None
    if W is None or W.ndim != 3:
        raise ModelContractError(
            f"layer {layer} exposes no per-head output weights `blocks[{layer}].attn.W_O` (H, "
            "d_head, d_model); the head's output norm needs them (load the model with `load_model`)."
        )
    return W


def vocab_size(model: SinkModel) -> int | None:
    """The vocabulary size the model states (``cfg.d_vocab``); None where it states none.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    int or None
    """
    v = _stated(model, "d_vocab")
    return int(v) if v else None


def positional_encoding_name(model: SinkModel) -> str | None:
    """The positional encoding the model's config names (TransformerLens' ``positional_embedding_type``: "standard",
    "alibi", "rotary", ...); None where it names none.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    str or None
    """
    return _stated(model, "positional_embedding_type")


def layer_position_module(model: SinkModel, layer: int) -> torch.nn.Module:
    """The attention module of a layer that holds its position bias (a relative bias' ``relative``, ALiBi's
    ``alibi_slopes``).

    Parameters
    ----------
    model : SinkModel
    layer : int

    Returns
    -------
    torch.nn.Module
    """
    return model.blocks[layer].attn


def attention_logit_scale(model: SinkModel) -> float | None:
    """The divisor of q·k in the logits where the model states one (a positive ``cfg.attn_scale``); None where it
    states none (the bridge leaves it at -1: sqrt(d_head)).

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    float or None
    """
    scale = _stated(model, "attn_scale")
    return float(scale) if scale is not None and float(scale) > 0 else None


def attention_operation(model: SinkModel) -> str:
    """The attention operation: a reference model's ``cfg.attention`` ("softmax", "sigmoid", "sink-token", ...);
    "softmax" for a Hugging Face model.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    str
    """
    return _stated(model, "attention", "softmax")


def attention_window(model: SinkModel) -> int | None:
    """The sliding window the model's config states (a reference model's ``sliding_window``); None where it states
    none.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    int or None
    """
    w = _stated(model, "sliding_window")
    return None if w is None else int(w)


# ----------------------------------------------------------------------------- The reference models


def reference_config(model: SinkModel) -> ModelConfig:
    """A reference model's own config (``analysis.model.reference.config.ModelConfig``: its attention, window,
    prefix, n_ctx).

    Parameters
    ----------
    model : SinkModel
        A reference model (``analysis.train``'s ``SinkLM``).

    Returns
    -------
    ModelConfig
        ModelContractError for any other model.
    """
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise ModelContractError(
            f"{type(model).__name__} is not a reference model (analysis.train's SinkLM); this "
            "reads a reference model's own options. Build or load one with analysis.train."
        )
    return cfg
