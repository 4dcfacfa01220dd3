"""The causal LM inside a model of the contract, and what the cache passes (streaming, quant) read of it.

The one place those passes learn about Hugging Face and TransformerLens modules: the bridge's own Hugging Face module
run in its own attention (:func:`own_causal_lm`: no second copy from disk), its config (:func:`context_length`,
:func:`n_layers`, :func:`attention_name`), its forward's cache keyword, a fresh cache, its learned sink logits, and the
linear maps of its decoder (:func:`linear_maps`; a reference model's at the hook points that feed them).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Iterator

import torch
from torch import nn

from analysis.model.access import unwrap_component as unwrap  # the bridge's wrapper -> its Hugging Face module
from analysis.model.contract import ModelContractError, SinkModel, hf_module, is_model

# A reference SinkLM's maps: hook point (under blocks.{l}) -> (map name, [(weight, its input axes)])
REFERENCE_MAPS = {
    "ln1.hook_normalized": ("attn.W_QKV", [("attn.W_Q", (1,)), ("attn.W_K", (1,)), ("attn.W_V", (1,))]),
    "attn.hook_z": ("attn.W_O", [("attn.W_O", (0, 1))]),
    "ln2.hook_normalized": ("mlp.W_in", [("mlp.W_in", (0,)), ("mlp.W_gate", (0,))]),
    "mlp.hook_post": ("mlp.W_out", [("mlp.W_out", (0,))]),
}


def require_model(model: object, where: str) -> SinkModel:
    """``model`` itself when it is a model of the contract; TypeError saying what to do otherwise (a name, a path or a
    bare Hugging Face model: load it with ``analysis.load_model`` first), before any work.

    Parameters
    ----------
    model
        What the caller was given.
    where : str
        The function called, named in the error.

    Returns
    -------
    SinkModel
    """
    if is_model(model):
        return model
    what = f"the name {str(model)!r}" if isinstance(model, (str, os.PathLike)) else f"a {type(model).__name__}"
    raise TypeError(
        f"{where} takes the model analysis.load_model returns, not {what}: call "
        f"{where}(load_model(name_or_path), ...) (a Hugging Face model in memory: "
        "analysis.model.loading.bridge_hf(hf, tokenizer=...))."
    )


@contextlib.contextmanager
def unbridged(hf: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``hf`` holds its own modules again where a TransformerBridge put its wrappers (the bridge
    re-implements attention eagerly); the wrappers are put back on exit, whatever happens. Nested blocks are free.

    Parameters
    ----------
    hf : torch.nn.Module

    Yields
    ------
    torch.nn.Module
        ``hf``.
    """
    swaps: list = []

    def walk(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            inner = unwrap(child)
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
def own_causal_lm(model: SinkModel, *, where: str = "own_causal_lm") -> Iterator[nn.Module]:
    """The Hugging Face causal LM inside a loaded model, in its own attention (which keeps a KV cache), for the block.

    The same weights the bridge runs, no copy: the bridge's wrappers come off for the block (:func:`unbridged`) and go
    back after, so TransformerLens' hooks and the analyses see the model unchanged. Do not run the bridge itself
    inside the block.

    Parameters
    ----------
    model : SinkModel
        What ``analysis.load_model`` returns (a TransformerBridge; a reference model is its own module: ValueError).
    where : str
        The function asking, named in errors.

    Yields
    ------
    transformers.PreTrainedModel
    """
    hf = hf_module(require_model(model, where))
    if hf is None:
        raise ModelContractError(f"{where}: {model.model_name} is a reference model, not a Hugging Face model.")
    if hf.get_output_embeddings() is None:
        raise ModelContractError(
            f"{type(hf).__name__} has no causal-LM head; {where} needs a model loaded with its head "
            "(e.g. LlamaForCausalLM, not LlamaModel)."
        )
    with unbridged(hf):
        yield hf


def _text_config(lm):
    cfg = lm.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def context_length(lm) -> int | None:
    """The context a causal LM accepts, from its config.

    Parameters
    ----------
    lm : transformers.PreTrainedModel or a reference model's decoding wrapper

    Returns
    -------
    int or None
    """
    cfg = _text_config(lm)
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def n_layers(lm) -> int:
    """The number of decoder blocks of a causal LM, from its config.

    Parameters
    ----------
    lm : transformers.PreTrainedModel or a reference model's decoding wrapper

    Returns
    -------
    int
    """
    return int(_text_config(lm).num_hidden_layers)


def attention_name(lm) -> str:
    """The attention implementation the causal LM runs now ("sdpa", "eager", a registered name).

    Parameters
    ----------
    lm
        As in :func:`context_length`.

    Returns
    -------
    str
    """
    return str(lm.config._attn_implementation)


def cache_keyword(lm) -> str:
    """The name under which ``lm.forward`` takes a KV cache: transformers 5 names it ``cache`` (``past_key_values`` is
    deprecated there); older models and a reference model's decoding wrapper take ``past_key_values``.

    Parameters
    ----------
    lm : torch.nn.Module

    Returns
    -------
    str
    """
    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


def has_sink_logits(lm) -> bool:
    """Whether the model adds learned sink logits to its attention (gpt-oss's ``sinks``).

    Parameters
    ----------
    lm : torch.nn.Module

    Returns
    -------
    bool
    """
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in lm.modules())


def rotary_frequencies(lm) -> list[tuple[torch.Tensor, str]]:
    """Each rotary embedding of a causal LM, once: its inverse frequencies and its rope type ("default", "dynamic"...).

    Parameters
    ----------
    lm : torch.nn.Module
        A Hugging Face causal LM (its rotary modules' ``inv_freq``), or a reference model's decoding wrapper.

    Returns
    -------
    list of (torch.Tensor, str)
        Empty for a model without rotary embeddings.
    """
    mods = {id(m): m for m in lm.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)}.values()
    return [(m.inv_freq, str(getattr(m, "rope_type", "default"))) for m in mods]


def new_cache(lm):
    """A fresh, empty transformers ``DynamicCache`` for a Hugging Face causal LM; None for another module (a reference
    model's wrapper has no such cache path).

    Parameters
    ----------
    lm : torch.nn.Module

    Returns
    -------
    transformers.DynamicCache or None
    """
    from transformers import DynamicCache, PreTrainedModel  # import time

    return DynamicCache(config=lm.config) if isinstance(lm, PreTrainedModel) else None


def _decoder_layers(hf) -> nn.ModuleList | None:
    n = getattr(_text_config(hf), "num_hidden_layers", None)
    return next(
        (m for _, m in hf.named_modules() if isinstance(m, nn.ModuleList) and n is not None and len(m) == n), None
    )


def _reference_maps(sink_lm) -> list[tuple]:
    maps = []
    for l, block in enumerate(sink_lm.blocks):
        for hook_name, (name, weights) in REFERENCE_MAPS.items():
            ws = [
                (p, axes)
                for w_name, axes in weights
                if isinstance(
                    p := getattr(block.get_submodule(w_name.split(".")[0]), w_name.split(".")[1], None), torch.Tensor
                )
            ]
            maps.append((l, name, block.get_submodule(hook_name), False, ws))
    return maps


def linear_maps(model: SinkModel, *, where: str = "linear_maps") -> list[tuple]:
    """Every linear map of the decoder and where its input is reached, in layer order.

    A Hugging Face model: every ``nn.Linear`` inside the decoder's layer list (the ``ModuleList`` as long as the
    config's layer count; the LM head is not a decoder linear), its input reached by a forward pre-hook. A reference
    model has no ``nn.Linear``: its maps are einsums on weights, reached at the hook points that feed them
    (:data:`REFERENCE_MAPS`).

    Parameters
    ----------
    model : SinkModel
    where : str
        The function asking, named in errors.

    Returns
    -------
    list of tuple
        ``(layer, name, module, pre_hook, [(weight, its input axes)])``; empty where none can be reached.
    """
    if hf_module(require_model(model, where)) is None:
        return _reference_maps(model)
    with own_causal_lm(model, where=where) as hf:
        layers = _decoder_layers(hf)
        return [
            (l, n, m, True, [(m.weight, (1,))])
            for l, layer in enumerate(layers or [])
            for n, m in layer.named_modules()
            if isinstance(m, nn.Linear)
        ]
