"""The causal LM behind a model: from a name, a local folder, a TransformerBridge, an HF model or a reference model.

Streaming drives the Hugging Face backbone directly with a bounded cache (no TransformerLens hooks are
needed; a TransformerBridge's own backbone has bridge attention modules, so a clean copy is loaded from
the bridge's source). The project's reference models (``analysis.train.SinkLM``, by name, folder or object)
are driven through ``analysis.streaming.reference.ReferenceLM``, which decodes them with the same cache.
"""
from __future__ import annotations

import warnings
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
from analysis.streaming.reference import ReferenceLM


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


def causal_lm(model, *, tokenizer=None, device=None, dtype=None):
    """Return ``(hf_model, tokenizer, name)`` for a name, folder, TransformerBridge or PreTrainedModel.

    Parameters
    ----------
    model : str, path-like, TransformerBridge or transformers.PreTrainedModel
        A name (``smollm2-135m``, a reference model), a local Hugging Face folder, or a loaded model.
    tokenizer : transformers.PreTrainedTokenizerBase, optional
        Overrides the model's own.
    device : str, optional
        Where a model loaded here runs (default: "cuda" when a GPU is available, as ``load_model``; a loaded
        bridge's copy: the bridge's device).
    dtype : torch.dtype or str, optional

    Returns
    -------
    hf : transformers.PreTrainedModel
    tokenizer : transformers.PreTrainedTokenizerBase or None
    name : str
    """
    from transformers import PreTrainedModel

    if isinstance(model, (str, Path)):
        name = str(model)
        device = resolve_device(device)  # cuda without CUDA is an error, before anything loads
        if name == DEFAULT_MODEL:
            hf, tok = _load_folder(str(smollm2_dir()), True, device, dtype)
            return _checked(hf), tokenizer or tok, name
        path = Path(name).expanduser()
        if name in _reference_models() or ((path / "config.json").is_file() and _is_reference(path)):
            return _reference(load_model(name, device=device, dtype=dtype), tokenizer, name)
        if path.exists():
            if not (path / "config.json").is_file():
                raise ModelNotFoundError(f"{path} is not a Hugging Face model folder (no config.json).")
            hf, tok = _load_folder(str(path), True, device, dtype)
            return _checked(hf), tokenizer or tok, name
        hf, tok = _load_folder(check_hub(hub_id(name)), False, device, dtype)
        return _checked(hf), tokenizer or tok, name
    if type(model).__name__ == "SinkLM":
        return _reference(model, tokenizer, getattr(model, "model_name", None) or "sink-lm")
    hf = getattr(model, "original_model", None)  # a TransformerLens TransformerBridge
    if hf is not None:
        # The bridge swaps the attention modules for its own components; stream on a clean copy of the same
        # weights, loaded from where the bridge came from.
        name = getattr(model, "model_name", None) or hf.config.name_or_path
        src = str(smollm2_dir()) if name == DEFAULT_MODEL else hf.config.name_or_path
        p = hf.get_output_embeddings().weight
        clean, tok = _load_folder(src, Path(src).exists(), device or p.device, dtype or p.dtype)
        return _checked(clean), tokenizer or getattr(model, "tokenizer", None) or tok, name
    if isinstance(model, PreTrainedModel):
        return _checked(model), tokenizer, getattr(model.config, "name_or_path", "") or type(model).__name__
    raise TypeError(f"expected a model name, a Hugging Face folder, a TransformerBridge or a PreTrainedModel; got {type(model).__name__}.")


def _reference(model, tokenizer, name: str):
    return ReferenceLM(model.eval()), tokenizer or model.tokenizer, name


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
