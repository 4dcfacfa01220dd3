"""The one model contract: what an analysis may ask of a model, checked once, at load.

Every public analysis takes a :class:`SinkModel`: what ``analysis.load_model`` returns (a TransformerLens
``TransformerBridge`` around a Hugging Face model) or a reference model (``analysis.train``'s ``SinkLM``). It may ask:

- hook names: ``model.hook_dict`` in TransformerLens' names (``analysis.model.hooks.act_name``), read and run
  through ``model.run_with_hooks`` / ``model.hooks``;
- dims, attention layers and family: ``analysis.model.hooks.model_facts`` (derived once per model and kept), read
  from ``model.cfg`` (``n_layers``, ``n_heads``, ``n_key_value_heads``, ``d_model``, ``d_head``, ``n_ctx``);
- what lies under the contract (the blocks, their weights, a config's fields, transformers' registries): only
  through the typed functions of ``analysis.model`` (``analysis.model.access``, ``key_path``, ``mlp_spec``); no
  floor above reaches into Hugging Face or TransformerLens internals (``tests/model/test_reaches.py`` counts it);
- the family spec: ``model.family`` (``analysis.model.families.FamilySpec``), set at load, read through
  ``analysis.model.families.get_family`` (which fills it on a model built by hand);
- the tokenizer: ``model.tokenizer`` (None for a reference model of a synthetic task), ``model.to_tokens``;
- the Hugging Face module the fused and cache passes run: :func:`hf_module` (in its own attention:
  ``analysis.model.causal.own_causal_lm``);
- device and dtype: :func:`model_device` and :func:`model_dtype` (``analysis.model.placement``: where the inputs go,
  never "the first parameter").

A model name goes through ``load_model`` first, at the caller (the CLI, a notebook), never inside an analysis: a name
or a bare Hugging Face model given to one is refused (``analysis.model.causal.require_model``). The
nnsight backend has a contract of its own (``analysis.model.nnsight_model.NnsightModel``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from analysis.core.defaults import BACKENDS  # noqa: F401 (load_model's and the passes' backends; named here too)
from analysis.model.placement import input_device

# The members every model must have (the Protocol's, in the order the error names them).
_MEMBERS = tuple("hook_dict cfg blocks run_with_hooks hooks to_tokens tokenizer model_name parameters".split())
_CFG_FIELDS = ("n_layers", "n_heads", "d_model")


class ModelContractError(ValueError):
    """The model lacks something an analysis needs (hook names, config fields, weights)."""


@runtime_checkable
class SinkModel(Protocol):
    """What every analysis takes: a model with TransformerLens hook names, dims, a family spec and a tokenizer.

    Attributes
    ----------
    hook_dict : Mapping[str, HookPoint]
        Every hook by its TransformerLens name (``blocks.{l}.attn.hook_pattern`` ...).
    cfg : object
        ``n_layers``, ``n_heads``, ``d_model`` (and ``n_key_value_heads``, ``d_head``, ``n_ctx`` where set).
    blocks : Sequence[torch.nn.Module]
        The blocks, for the analyses that read weights.
    tokenizer : transformers.PreTrainedTokenizerBase or None
        None for a reference model of a synthetic task.
    model_name : str
        The name results carry.
    family : FamilySpec
        Set at load (``get_family`` reads it on a model built by hand).
    """

    hook_dict: Mapping[str, Any]
    cfg: Any
    blocks: Any
    tokenizer: Any
    model_name: str

    def run_with_hooks(self, *args, **kwargs) -> Any: ...

    def hooks(self, *args, **kwargs) -> Any: ...

    def to_tokens(self, *args, **kwargs) -> Any: ...

    def parameters(self, recurse: bool = True) -> Any: ...


def _missing(model) -> list[str]:
    """What of the contract ``model`` lacks, in words (empty when it has it all)."""
    gone = [m for m in _MEMBERS if not hasattr(model, m)]
    if "hook_dict" not in gone:
        n = getattr(getattr(model, "cfg", None), "n_layers", None)
        names = model.hook_dict
        if not n or not any(f"blocks.{l}.attn.hook_pattern" in names for l in range(int(n))):
            gone.append("attention-pattern hooks (blocks.{l}.attn.hook_pattern)")
    if "cfg" not in gone:
        gone += [f"cfg.{f}" for f in _CFG_FIELDS if getattr(model.cfg, f, None) is None]
    family = getattr(model, "family", None)
    if family is not None and not hasattr(family, "attention_layers"):
        gone.append(f"a family spec (model.family is a {type(family).__name__}, not a FamilySpec)")
    return gone


def check_model(model: object) -> SinkModel:
    """Check, once at load, that ``model`` gives what every analysis may ask (:class:`SinkModel`).

    Parameters
    ----------
    model
        A loaded model (a TransformerBridge, a reference model).

    Returns
    -------
    SinkModel
        ``model`` itself; ModelContractError naming everything it lacks and what to do, otherwise.
    """
    gone = _missing(model)
    family = getattr(model, "family", None)
    if gone and getattr(family, "attention_layers", None) == () and getattr(family, "skipped_layers", None):
        # loaded as asked, but no layer exposes an attention pattern: say why, layer by layer (the family spec)
        raise ModelContractError(
            f"{getattr(model, 'model_name', type(model).__name__)} loaded, but no layer exposes an attention pattern "
            f"the analyses can read: {family.text()} It is not supported yet (docs/families.md)."
        )
    if gone:
        raise ModelContractError(
            f"{type(model).__name__} does not meet the model contract (analysis.model.contract.SinkModel): it lacks "
            f"{', '.join(gone)}. Load models with analysis.load_model(name_or_path) (a TransformerBridge), wrap one "
            "in memory with analysis.model.loading.bridge_hf, or build one with analysis.train."
        )
    return model


def is_model(obj) -> bool:
    """Whether ``obj`` is a model of the contract (not a name, a path nor a bare Hugging Face model).

    Parameters
    ----------
    obj
        Anything.

    Returns
    -------
    bool
    """
    return not isinstance(obj, (str, os.PathLike)) and isinstance(obj, SinkModel)


def hf_module(model: SinkModel) -> torch.nn.Module | None:
    """The Hugging Face module inside a model of the contract, that the fused and cache passes run.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    transformers.PreTrainedModel or None
        A TransformerBridge's ``original_model``; None for a reference model (it is its own module).
    """
    hf = getattr(model, "original_model", None)
    return hf if isinstance(hf, torch.nn.Module) else None


def runs_bridge_components(module: torch.nn.Module) -> bool:
    """Whether a Hugging Face module runs TransformerLens bridge components in place of its own (``hf_module`` of a
    TransformerBridge): their attention keeps no KV cache, so ``generate`` on it ignores the cache it is given.

    Parameters
    ----------
    module : torch.nn.Module

    Returns
    -------
    bool
    """
    try:
        from transformer_lens.model_bridge.generalized_components.base import GeneralizedComponent
    except ImportError:  # optional: bridges only
        return False
    return any(isinstance(m, GeneralizedComponent) for m in module.modules())


def model_device(model: SinkModel) -> torch.device:
    """Where the model's inputs go and its work starts (``analysis.model.placement.input_device``).

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    torch.device
    """
    return input_device(model)


def model_dtype(model: SinkModel) -> torch.dtype:
    """The dtype of the model's floating-point weights.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    torch.dtype
        float32 for a model without floating-point weights.
    """
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
