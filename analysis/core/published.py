"""Published Sink_1 figures, as data with their source: shown beside a model's own numbers, never as our results.

``GU_TABLE1`` holds Gu et al. (ICLR 2025, "When Attention Sink Emerges in Language Models"), Sink_1 in % at eps 0.3,
T = 64, on natural, random and repeated tokens (their Table 1), and the natural-text figures of their base against chat
comparison and of Jamba (every row the paper gives for an open model); a figure the paper does not give is None. Each row names the hub ids (and short names) it matches: :func:`published_sink` finds a model's
row by the name it was loaded by (a hub id, or a local folder named after one).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import PurePath

GU_SOURCE = (
    "Gu et al. 2025, When Attention Sink Emerges in Language Models (ICLR 2025): Table 1 and the base/chat "
    "comparison; Sink_1 (%), eps 0.3, T = 64"
)


@dataclass(frozen=True)
class PublishedSink:
    """One model's published Sink_1 (%), by input kind.

    Attributes
    ----------
    model : str
        The model as the paper names it.
    natural, random, repeated : float or None
        Sink_1 (%) on each input kind (None: not given).
    names : tuple of str
        Hub ids and short names it matches (compared lower-case, on the last part of a path or id).
    source : str
        Where the figures come from.
    """

    model: str
    natural: float | None
    random: float | None
    repeated: float | None
    names: tuple[str, ...]
    source: str = GU_SOURCE

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "names"}  # the figures and their source


GU_TABLE1 = (
    PublishedSink("GPT2-XL", 77.00, 70.29, 62.28, ("openai-community/gpt2-xl", "gpt2-xl")),
    PublishedSink("Mistral-7B", 97.49, 75.21, 0.00, ("mistralai/Mistral-7B-v0.1", "mistral-7b")),
    PublishedSink("LLaMA2-7B Base", 92.47, 90.13, 0.00, ("meta-llama/Llama-2-7b-hf", "llama-2-7b", "llama2-7b")),
    PublishedSink("LLaMA3-8B Base", 99.02, 91.23, 0.00, ("meta-llama/Meta-Llama-3-8B", "llama-3-8b", "llama3-8b")),
    PublishedSink(
        "Mistral-7B Instruct", 88.34, None, None, ("mistralai/Mistral-7B-Instruct-v0.1", "mistral-7b-instruct")
    ),
    PublishedSink("LLaMA2-7B Chat", 92.88, None, None, ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b-chat")),
    PublishedSink("LLaMA2-13B Base", 91.69, None, None, ("meta-llama/Llama-2-13b-hf", "llama-2-13b", "llama2-13b")),
    PublishedSink("LLaMA2-13B Chat", 90.94, None, None, ("meta-llama/Llama-2-13b-chat-hf", "llama-2-13b-chat")),
    PublishedSink(
        "LLaMA3-8B Instruct",
        98.85,
        None,
        None,
        ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b-instruct", "llama3-8b-instruct"),
    ),
    PublishedSink("Jamba-v0.1", 88.48, None, None, ("ai21labs/Jamba-v0.1", "jamba-v0.1")),
    PublishedSink("Jamba-1.5 Mini", 87.88, None, None, ("ai21labs/AI21-Jamba-1.5-Mini", "jamba-1.5-mini")),
)


def _key(name: str) -> str:
    """The last part of a hub id or path, lower-case, without a trailing "-hf" or "/"."""
    last = PurePath(str(name).rstrip("/\\")).name or str(name)
    return re.sub(r"-hf$", "", last.lower())


def published_sink(name: str) -> PublishedSink | None:
    """The published Sink_1 row of a model, found by the name it was loaded by.

    Parameters
    ----------
    name : str
        A hub id ("meta-llama/Llama-2-7b-hf"), a short name ("gpt2-xl") or a local folder named after one.

    Returns
    -------
    PublishedSink or None
        None where no published row matches.
    """
    key = _key(name)
    for row in GU_TABLE1:
        if key in {_key(n) for n in row.names}:
            return row
    return None
