"""The causal LM the cache passes decode, reached through the model contract.

Streaming and quantisation drive a causal LM with a bounded cache, no TransformerLens hooks: for a model
``analysis.load_model`` returns (a TransformerBridge), the bridge's own Hugging Face module, in its own attention
(``analysis.model.causal.own_causal_lm``: the bridge's wrappers come off for the block, so no second copy of the
weights is loaded); for the project's reference models (``analysis.train.SinkLM``), ``ReferenceLM``, which decodes
them with the same cache. Anything else (a name, a path, a bare Hugging Face model) is refused before any work.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from analysis.model.causal import own_causal_lm, require_model
from analysis.model.contract import SinkModel, hf_module
from analysis.streaming.reference import ReferenceLM


@contextlib.contextmanager
def causal_lm(model: SinkModel, *, where: str = "causal_lm") -> Iterator[torch.nn.Module]:
    """The causal LM the cache passes decode, for the block: a loaded model's own Hugging Face module (in its own
    attention, the same weights: nothing is copied or loaded again), or a reference model's ``ReferenceLM``.

    Do not run the bridge itself (its analyses) inside the block: its attention wrappers are off there.

    Parameters
    ----------
    model : SinkModel
        What ``analysis.load_model`` returns; TypeError saying so for a name, a path or a bare Hugging Face model.
    where : str
        The function asking, named in errors.

    Yields
    ------
    transformers.PreTrainedModel or ReferenceLM
    """
    require_model(model, where)
    if hf_module(model) is None:  # a reference model: its own module, decoded through the same cache
        yield ReferenceLM(model.eval())
        return
    with own_causal_lm(model, where=where) as hf:
        yield hf
