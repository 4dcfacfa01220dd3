"""The causal LM behind a model of the contract (a TransformerBridge or a reference model), that the cache passes decode.

Streaming drives the Hugging Face backbone directly with a bounded cache (no TransformerLens hooks are
needed; a TransformerBridge's own backbone has bridge attention modules, so a clean copy is loaded from
the bridge's source). The project's reference models (``analysis.train.SinkLM``, by name, folder or object)
are driven through ``analysis.streaming.reference.ReferenceLM``, which decodes them with the same cache.
"""
from __future__ import annotations

import warnings
import weakref
from pathlib import Path

import torch

from analysis.model.loading import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    _is_reference,
    _reference_models,
    check_hub,
    default_device,
    hub_id,
    load_model,
    resolve_device,
    smollm2_dir,
)
from analysis.model.contract import SinkModel, hf_module, is_model, is_pass_module, pass_module, warn_old_call
from analysis.streaming.reference import ReferenceLM

_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model of the contract -> the causal LM stream_lm made


def _load_folder(src: str, local: bool, device, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(src, local_files_only=local)
            hf = AutoModelForCausalLM.from_pretrained(src, dtype=dtype or torch.float32, local_files_only=local)
    except ValueError as e:  # a config with no causal-LM class
        raise ValueError(f"{src} has no causal-LM head ({str(e).splitlines()[0][:160]}); streaming perplexity "
                         "needs a model AutoModelForCausalLM can load.") from e
    except OSError as e:
        raise ModelNotFoundError(f"could not load {src!r} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                                 "pass a local Hugging Face folder (no network here).") from e
    return hf.to(device or default_device()).eval(), tok


def causal_lm(model: SinkModel, *, tokenizer=None, device=None, dtype=None):
    """Return ``(lm, tokenizer, name)``: the causal LM the cache passes decode, reached through the model contract.

    A TransformerBridge's own backbone has bridge attention modules: the cache passes run a clean copy of the same
    weights, loaded from where the bridge came from (:func:`analysis.model.contract.hf_module` names it). A reference
    model is decoded through :class:`analysis.streaming.reference.ReferenceLM`. The old forms (a name, a folder, a
    bare ``PreTrainedModel``) still work for one release, with a DeprecationWarning.

    Parameters
    ----------
    model : SinkModel
        What ``analysis.load_model`` returns.
    tokenizer : transformers.PreTrainedTokenizerBase, optional
        Overrides the model's own.
    device : str, optional
        Where the clean copy runs (default: the bridge's device).
    dtype : torch.dtype or str, optional
        The clean copy's dtype (default: the bridge's).

    Returns
    -------
    lm : transformers.PreTrainedModel or ReferenceLM
    tokenizer : transformers.PreTrainedTokenizerBase or None
    name : str
    """
    return resolve(model, where="causal_lm", tokenizer=tokenizer, device=device, dtype=dtype)


def resolve(model: SinkModel, *, where: str, tokenizer=None, device=None, dtype=None):
    """:func:`causal_lm` for the analysis ``where``: a model of the contract, a causal LM a loader gave
    (``load_causal_lm``), or an old form (a name, a folder, a bare ``PreTrainedModel``) with a DeprecationWarning
    naming ``where``.

    Parameters
    ----------
    model : SinkModel
    where : str
        The analysis asking.
    tokenizer, device, dtype
        As in :func:`causal_lm`.

    Returns
    -------
    lm, tokenizer, name
        As :func:`causal_lm`.
    """
    if is_pass_module(model):
        inner = getattr(model, "model", None) if isinstance(model, ReferenceLM) else None
        name = getattr(inner, "model_name", None) or getattr(getattr(model, "config", None), "name_or_path", "")
        return model, tokenizer or getattr(inner, "tokenizer", None), name or type(model).__name__
    if not is_model(model):
        warn_old_call(where, model)
        return _old_form(model, tokenizer=tokenizer, device=device, dtype=dtype)
    if hf_module(model) is None:  # a reference model: its own module
        return _reference(model, tokenizer, getattr(model, "model_name", None) or "sink-lm")
    hf = hf_module(model)
    # The bridge swaps the attention modules for its own components; stream on a clean copy of the same
    # weights, loaded from where the bridge came from.
    name = getattr(model, "model_name", None) or hf.config.name_or_path
    src = str(smollm2_dir()) if name == DEFAULT_MODEL else hf.config.name_or_path
    p = hf.get_output_embeddings().weight
    clean, tok = _load_folder(src, Path(src).exists(), device or p.device, dtype or p.dtype)
    return pass_module(_checked(clean)), tokenizer or getattr(model, "tokenizer", None) or tok, name


def stream_lm(model: SinkModel, *, where: str) -> torch.nn.Module:
    """The causal LM a cache pass decodes: :func:`causal_lm`'s for a model of the contract (made once per model and
    kept while the model lives, so that the passes of one study, and the linear sites they hook, share it); one that
    a loader or the contract gave, as is; a bare ``PreTrainedModel`` / ``ReferenceLM`` (the old form, for one
    release) with a DeprecationWarning.

    Parameters
    ----------
    model : SinkModel
    where : str
        The function asking (named in the warning).

    Returns
    -------
    transformers.PreTrainedModel or ReferenceLM
    """
    if is_model(model):
        if hf_module(model) is None:  # a reference model: a fresh wrapper around the same modules
            return causal_lm(model)[0]
        if model not in _KEPT:
            _KEPT[model] = causal_lm(model)[0]
        return _KEPT[model]
    if not is_pass_module(model):
        from transformers import PreTrainedModel  # import time

        if not isinstance(model, (PreTrainedModel, ReferenceLM)):
            raise TypeError(f"{where} takes the model analysis.load_model returns; got {type(model).__name__}.")
        warn_old_call(where, model)
        pass_module(model)  # warned once: the calls it makes inside take it as is
    return model


def _old_form(model, *, tokenizer=None, device=None, dtype=None):
    """``causal_lm`` of the old call forms: a name, a local folder, a bare PreTrainedModel (one release more)."""
    from transformers import PreTrainedModel

    if isinstance(model, (str, Path)):
        name = str(model)
        device = resolve_device(device)  # cuda without CUDA is an error, before anything loads
        if name == DEFAULT_MODEL:
            hf, tok = _load_folder(str(smollm2_dir()), True, device, dtype)
            return pass_module(_checked(hf)), tokenizer or tok, name
        path = Path(name).expanduser()
        if name in _reference_models() or ((path / "config.json").is_file() and _is_reference(path)):
            return _reference(load_model(name, device=device, dtype=dtype), tokenizer, name)
        if path.exists():
            if not (path / "config.json").is_file():
                raise ModelNotFoundError(f"{path} is not a Hugging Face model folder (no config.json).")
            hf, tok = _load_folder(str(path), True, device, dtype)
            return pass_module(_checked(hf)), tokenizer or tok, name
        hf, tok = _load_folder(check_hub(hub_id(name)), False, device, dtype)
        return pass_module(_checked(hf)), tokenizer or tok, name
    if isinstance(model, PreTrainedModel):
        name = getattr(model.config, "name_or_path", "") or type(model).__name__
        return pass_module(_checked(model)), tokenizer, name
    raise TypeError(f"expected the model analysis.load_model returns (or, for one release, a model name, a Hugging Face "
                    f"folder or a PreTrainedModel); got {type(model).__name__}.")


def _reference(model, tokenizer, name: str):
    return pass_module(ReferenceLM(model.eval())), tokenizer or model.tokenizer, name


def _checked(hf):
    if hf.get_output_embeddings() is None:
        raise ValueError(
            f"{type(hf).__name__} has no causal-LM head; load the model with AutoModelForCausalLM "
            "(e.g. LlamaForCausalLM, not LlamaModel)."
        )
    return hf.eval()


def context_length(hf) -> int | None:
    """The context a Hugging Face model accepts, from its config.

    Parameters
    ----------
    hf : transformers.PreTrainedModel

    Returns
    -------
    int or None
    """
    cfg = hf.config.get_text_config(decoder=True)
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def n_layers(hf) -> int:
    """The number of blocks of a Hugging Face model.

    Parameters
    ----------
    hf : transformers.PreTrainedModel

    Returns
    -------
    int
    """
    return int(hf.config.get_text_config(decoder=True).num_hidden_layers)
