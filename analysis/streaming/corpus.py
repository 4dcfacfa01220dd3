"""A long offline token stream: standard-library docstrings (``analysis.model.probes.stdlib_texts``, about 63k
SmolLM2 tokens) in a seeded order, separated by blank lines. The record says how to rebuild it."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch

from analysis.model.contract import SinkModel
from analysis.model.probes import STDLIB_MODULES, stdlib_texts


@dataclass
class TokenStream:
    """A long token stream and how to rebuild it.

    Attributes
    ----------
    tokens : torch.LongTensor, shape (N,)
        The stream.
    source : str
        Where it comes from, in words.
    seed : int
        The seed of its order (or of the task's draw).
    """

    tokens: torch.Tensor  # (N,) long
    source: str
    seed: int

    def record(self) -> dict:
        ids = self.tokens.tolist()
        return {
            "source": self.source,
            "seed": self.seed,
            "n_tokens": len(ids),
            "sha256": hashlib.sha256(" ".join(map(str, ids)).encode()).hexdigest(),
        }


def stdlib_stream(tokenizer, n_tokens: int, *, seed: int = 0) -> TokenStream:
    """The first ``n_tokens`` of the docstring corpus shuffled with ``seed``.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
    n_tokens : int
        N, the stream's length.
    seed : int

    Returns
    -------
    TokenStream
        ``tokens`` of shape (N,).
    """
    if tokenizer is None:
        raise ValueError("a text stream needs the model's tokenizer; pass tokenizer=... or your own token ids.")
    texts = stdlib_texts()
    random.Random(seed).shuffle(texts)
    ids: list[int] = []
    sep = tokenizer.encode("\n\n", add_special_tokens=False)
    for t in texts:
        ids.extend(tokenizer.encode(t, add_special_tokens=False) + sep)
        if len(ids) >= n_tokens:
            break
    if len(ids) < n_tokens:
        raise ValueError(
            f"the offline docstring corpus has only {len(ids)} tokens for this tokenizer; "
            f"ask for at most that many (got {n_tokens}), or pass your own token ids."
        )
    src = f"docstrings of {len(STDLIB_MODULES)} standard-library modules (analysis.model.probes.stdlib_texts), shuffled with seed {seed}, joined by blank lines"
    return TokenStream(torch.tensor(ids[:n_tokens], dtype=torch.long), src, seed)


def newline_id(tokenizer) -> int:
    """The newline token of a tokenizer.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase

    Returns
    -------
    int
        ValueError where a newline is not one token.
    """
    ids = tokenizer.encode("\n", add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"the tokenizer does not encode a newline as one token ({ids}); newline sinks need one. "
            "Leave them out (`--newline-sinks 0`; in Python `newline_sinks=None`)."
        )
    return int(ids[0])


def task_stream(model: SinkModel, n_tokens: int, *, seed: int = 0) -> TokenStream:
    """A long stream from a reference model's own synthetic training task (``analysis.train``'s ``synthetic``
    dataset: BOS, then one Markov chain with the copy rule, ``n_tokens`` long), a held-out draw with ``seed``.

    Parameters
    ----------
    model : analysis.train.SinkLM
        A reference model of the synthetic task.
    n_tokens, seed
        As in :func:`stdlib_stream`.

    Returns
    -------
    TokenStream
        ``tokens`` of shape (N,).
    """
    from dataclasses import replace

    # lazy for import time: analysis.train loads transformer_lens (~0.7 s beside transformers), for reference models only
    from analysis.model.reference.config import TrainConfig
    from analysis.model.reference.data import build_data

    cfg = getattr(model, "reference_config", None) or {}
    train = cfg.get("train") or {}
    if train.get("dataset") not in ("synthetic", "synthetic-docs"):
        raise ValueError(
            "this model has no tokenizer and no synthetic training task to draw a stream from; pass your "
            "own token ids (tokens=...)."
        )
    tcfg = replace(TrainConfig.from_dict(train), dataset="synthetic", seed=seed)
    data = build_data(tcfg, n_ctx=n_tokens)
    ids = data.probe(1, n_tokens)[0]
    return TokenStream(
        ids.long(),
        f"{data.description}: one held-out sequence of the model's own training task, drawn with seed {seed}",
        seed,
    )
