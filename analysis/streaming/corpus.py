"""A long offline token stream: standard-library docstrings (``analysis.probes.stdlib_texts``, about 63k
SmolLM2 tokens) in a seeded order, separated by blank lines. The record says how to rebuild it."""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch

from analysis.probes import STDLIB_MODULES, stdlib_texts


@dataclass
class TokenStream:
    tokens: torch.Tensor  # (N,) long
    source: str
    seed: int

    def record(self) -> dict:
        ids = self.tokens.tolist()
        return {"source": self.source, "seed": self.seed, "n_tokens": len(ids),
                "sha256": hashlib.sha256(" ".join(map(str, ids)).encode()).hexdigest()}


def stdlib_stream(tokenizer, n_tokens: int, seed: int = 0) -> TokenStream:
    """The first ``n_tokens`` of the docstring corpus shuffled with ``seed``."""
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
        raise ValueError(f"the offline docstring corpus has only {len(ids)} tokens for this tokenizer; "
                         f"ask for at most that many (got {n_tokens}), or pass your own token ids.")
    src = f"docstrings of {len(STDLIB_MODULES)} standard-library modules (analysis.probes.stdlib_texts), shuffled with seed {seed}, joined by blank lines"
    return TokenStream(torch.tensor(ids[:n_tokens], dtype=torch.long), src, seed)


def newline_id(tokenizer) -> int:
    ids = tokenizer.encode("\n", add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer does not encode a newline as one token ({ids}); newline sinks need one.")
    return int(ids[0])
