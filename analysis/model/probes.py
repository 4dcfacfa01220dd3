"""Probe inputs for the sink metric: natural text, random tokens, one token repeated.

All three are seeded and deterministic, (N, T) LongTensors, with the first token explicit: the paper's
default is no BOS (``bos=False``), T = 64, N = 100. With ``bos=True`` the tokenizer's BOS token is
position 1 and the sequence still has T tokens.

Natural text comes from an offline corpus that every Python install has: the docstrings of a fixed
list of standard-library modules. ``hf_dataset_texts`` reads a Hugging Face dataset when online.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from analysis.model.contract import SinkModel
from analysis.core.docs import parameters_from
from analysis.core.results import compact_repr

PROBE_KINDS = ("natural", "random", "repeated")

# Modules whose docstrings make the offline natural-text corpus (prose, not code). Fixed order.
STDLIB_MODULES = tuple(
    """
    abc argparse asyncio base64 bisect calendar collections contextlib copy csv dataclasses datetime decimal
    difflib email enum fractions functools glob gzip hashlib heapq hmac html http.client inspect io ipaddress
    itertools json logging mailbox math mimetypes numbers operator optparse os pathlib pickle pprint queue
    random re sched secrets selectors shlex shutil smtplib socket sqlite3 statistics string struct subprocess
    tarfile tempfile textwrap threading timeit tokenize traceback types typing unittest urllib.parse uuid
    warnings weakref zipfile zoneinfo
    """.split()
)


@dataclass
class ProbeSet:
    """A batch of probe sequences and how it was made.

    Attributes
    ----------
    kind : str
        "natural", "random" or "repeated".
    tokens : torch.LongTensor, shape (N, T)
        Token ids.
    bos : bool
        Whether position 1 holds the tokenizer's BOS token (or, for a task, a fixed first token).
    seed : int
        The seed it was drawn with.
    source : str
        Where the tokens come from, in words ("stdlib docstrings", "uniform over non-special tokens", ...).
    meta : dict
        Further facts (``corpus_tokens``: the size of a natural-text corpus).
    n, T : int
        N and T (properties).
    """

    kind: str
    tokens: torch.Tensor  # (N, T) long
    bos: bool
    seed: int
    source: str = ""
    meta: dict = field(default_factory=dict)

    __repr__ = compact_repr  # shapes, never tensor values

    @property
    def n(self) -> int:
        return self.tokens.shape[0]

    @property
    def T(self) -> int:
        return self.tokens.shape[1]


def _check_nt(n: int, T: int, bos: bool = False) -> None:
    if int(n) < 1:
        raise ValueError(f"n must be at least 1 sequence; got {n}.")
    if int(T) < (2 if bos else 1):
        raise ValueError(f"T must be at least {2 if bos else 1} token(s){' with a BOS' if bos else ''}; got {T}.")


def _bos_id(tokenizer) -> int:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise ValueError("bos=True but the tokenizer has no BOS token; use bos=False.")
    return int(bos)


def _with_bos(body: torch.Tensor, tokenizer, bos: bool) -> torch.Tensor:
    if not bos:
        return body
    first = torch.full((body.shape[0], 1), _bos_id(tokenizer), dtype=torch.long)
    return torch.cat([first, body[:, :-1]], dim=1)


def stdlib_texts(modules: Sequence[str] = STDLIB_MODULES) -> list[str]:
    """Docstrings of the given standard-library modules and their public members, in a fixed order: the prose the
    natural probes and the streamed corpus read. Not the reference models' training corpus
    (``analysis.model.reference.data.stdlib_docstrings``: every docstring of every standard-library file, read from
    the source, for volume), whose text and order differ; each keeps its own so that neither's numbers move.

    Parameters
    ----------
    modules : sequence of str
        Module names (default: ``STDLIB_MODULES``, prose rather than code); one missing on a trimmed Python build is
        skipped.

    Returns
    -------
    list of str
        Docstrings longer than 200 characters, whitespace collapsed, duplicates removed.
    """
    texts = []
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # a module missing on a trimmed Python build
            continue
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            doc = inspect.getdoc(obj) if (obj is mod or getattr(obj, "__module__", None) == mod.__name__) else None
            if doc and len(doc) > 200:
                texts.append(" ".join(doc.split()))
    # Remove duplicates, keep order.
    return list(dict.fromkeys(texts))


def hf_dataset_texts(
    name: str, *, split: str = "train", text_field: str = "text", n_texts: int = 2000, **kwargs
) -> list[str]:
    """Texts from a Hugging Face dataset (needs a network, or a local folder / file builder, and ``datasets``).

    Parameters
    ----------
    name : str
        The dataset's id or builder.
    split : str
        The split to read.
    text_field : str
        The field holding the text.
    n_texts : int
        Stop after this many non-empty texts.
    **kwargs
        Passed on to ``datasets.load_dataset`` (``streaming=True`` reads without downloading everything).

    Returns
    -------
    list of str
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "hf_dataset_texts needs the `datasets` package: pip install 'attention-sink-lens[datasets]'."
        ) from e
    ds = datasets.load_dataset(name, split=split, streaming=kwargs.pop("streaming", False), **kwargs)
    texts = []
    for row in ds:
        if text_field not in row:
            raise ValueError(f"dataset {name!r} has no field {text_field!r}; fields: {sorted(row)}.")
        if row[text_field] and row[text_field].strip():
            texts.append(row[text_field])
        if len(texts) >= n_texts:
            break
    return texts


@functools.lru_cache(maxsize=4)  # the last few corpora, by tokenizer (its identity) and texts
def _token_stream(tokenizer, texts: tuple[str, ...]) -> tuple[int, ...]:
    """The concatenated token ids of ``texts``, tokenized once per tokenizer and corpus (a report cuts windows of
    the same corpus at several lengths and seeds)."""
    return tuple(i for t in texts for i in tokenizer.encode(t, add_special_tokens=False))


def text_probe(
    tokenizer,
    texts: Iterable[str],
    *,
    n: int = 100,
    T: int = 64,
    bos: bool = False,
    seed: int = 0,
    source: str = "texts",
) -> ProbeSet:
    """N windows of T tokens cut at seeded offsets from the concatenated, tokenized texts.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        The model's tokenizer.
    texts : iterable of str
        The texts (empty ones are dropped).
    n : int
        N, the number of sequences.
    T : int
        Tokens per sequence (the BOS included).
    bos : bool
        Put the tokenizer's BOS token at position 1 (the sequence still has T tokens); the paper's default is none.
    seed : int
        The seed of the sampling.
    source : str
        Where the texts come from, in words (kept as ``ProbeSet.source``).

    Returns
    -------
    ProbeSet
        ``tokens`` of shape (N, T).
    """
    _check_nt(n, T, bos)
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise ValueError("no text to probe with: give at least one non-empty text.")
    stream = _token_stream(tokenizer, tuple(texts))
    if len(stream) < T:
        raise ValueError(f"the texts hold {len(stream)} tokens, fewer than T={T}; give more text or a smaller T.")
    g = torch.Generator().manual_seed(seed)
    n_windows = len(stream) - T + 1
    stream_t = torch.tensor(stream, dtype=torch.long)
    # Distinct windows when the corpus allows it, else sampling with replacement. The windows are the same with and
    # without a BOS (T tokens each; a BOS takes the place of the last), so a BOS comparison is made on the same text.
    starts = (
        torch.randperm(n_windows, generator=g)[:n] if n_windows >= n else torch.randint(n_windows, (n,), generator=g)
    )
    body = torch.stack([stream_t[s : s + T] for s in starts.tolist()])
    distinct = len(set(starts.tolist()))
    if distinct < n:
        warnings.warn(
            f"text_probe: the texts hold {len(stream)} tokens, so only {n_windows} distinct windows of T={T} "
            f"tokens; the {n} sequences repeat windows ({distinct} distinct). Give more text, a smaller n or "
            "a smaller T for independent sequences.",
            UserWarning,
            stacklevel=2,
        )
    meta = {"corpus_tokens": len(stream), "distinct_windows": distinct}
    return ProbeSet("natural", _with_bos(body, tokenizer, bos), bos, seed, source, meta)


def text_tokens(
    tokenizer, text: str, *, bos: bool = False, max_tokens: int | None = None, n_ctx: int | None = None
) -> torch.Tensor:
    """One text as a sequence of token ids, for an analysis of your own text.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
        The model's tokenizer.
    text : str
        The whole text (not cut into windows).
    bos : bool
        Put the tokenizer's BOS token first.
    max_tokens : int, optional
        Keep the first ``max_tokens`` tokens (the BOS included).
    n_ctx : int, optional
        The model's context; a longer sequence raises ValueError saying what to do.

    Returns
    -------
    torch.LongTensor, shape (1, T)
    """
    if not text or not text.strip():
        raise ValueError("the text is empty: give a file with some text in it.")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if bos:
        ids = [_bos_id(tokenizer)] + ids
    if max_tokens is not None:
        if int(max_tokens) < 2:
            raise ValueError(f"max_tokens (--max-tokens) must be at least 2; got {max_tokens}.")
        ids = ids[: int(max_tokens)]
    if len(ids) < 2:
        raise ValueError(f"the text holds {len(ids)} token; give at least 2 (a sink needs queries after it).")
    if n_ctx is not None and len(ids) > n_ctx:
        raise ValueError(
            f"the text holds {len(ids)} tokens, more than the model's context of {n_ctx}: pass "
            f"--max-tokens {n_ctx} (max_tokens={n_ctx}) to keep the first {n_ctx} tokens, or split the text "
            f"into parts of at most {n_ctx} tokens and run each."
        )
    return torch.tensor([ids], dtype=torch.long)


@parameters_from(text_probe)
def natural_probe(
    tokenizer, *, n: int = 100, T: int = 64, bos: bool = False, seed: int = 0, texts: Iterable[str] | None = None
) -> ProbeSet:
    """Natural text: windows of the offline standard-library docstring corpus unless ``texts`` is given.

    Parameters
    ----------
    tokenizer, n, T, bos, seed
        As in :func:`text_probe`.
    texts : iterable of str, optional
        Your own texts instead of the corpus.

    Returns
    -------
    ProbeSet
        ``tokens`` of shape (N, T).
    """
    source = "stdlib docstrings" if texts is None else "texts"
    return text_probe(
        tokenizer, stdlib_texts() if texts is None else texts, n=n, T=T, bos=bos, seed=seed, source=source
    )


def _draw(tokenizer, vocab_size: int | None, n: int, T: int, bos: bool, seed: int, width: int) -> torch.Tensor:
    """(n, width) ids drawn uniformly over the tokenizer's non-special tokens below ``vocab_size``, n and T checked."""
    _check_nt(n, T, bos)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = torch.tensor([i for i in range(vocab_size or len(tokenizer)) if i not in special], dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("the vocabulary has no ordinary (non-special) tokens to sample.")
    return ids[torch.randint(ids.numel(), (n, width), generator=torch.Generator().manual_seed(seed))]


@parameters_from(text_probe)
def random_probe(
    tokenizer, *, n: int = 100, T: int = 64, bos: bool = False, seed: int = 0, vocab_size: int | None = None
) -> ProbeSet:
    """Tokens drawn uniformly over the vocabulary, special tokens excluded.

    Parameters
    ----------
    tokenizer, n, T, bos, seed
        As in :func:`text_probe`.
    vocab_size : int, optional
        Draw ids below this (default: ``len(tokenizer)``).

    Returns
    -------
    ProbeSet
        ``tokens`` of shape (N, T).
    """
    body = _draw(tokenizer, vocab_size, n, T, bos, seed, T)
    return ProbeSet("random", _with_bos(body, tokenizer, bos), bos, seed, "uniform over non-special tokens")


@parameters_from(random_probe)
def repeated_probe(
    tokenizer, *, n: int = 100, T: int = 64, bos: bool = False, seed: int = 0, vocab_size: int | None = None
) -> ProbeSet:
    """One token repeated T times per sequence (a different random token for each sequence).

    Parameters
    ----------
    tokenizer, n, T, bos, seed, vocab_size
        As in :func:`random_probe`.

    Returns
    -------
    ProbeSet
        ``tokens`` of shape (N, T).
    """
    tok = _draw(tokenizer, vocab_size, n, T, bos, seed, 1)
    return ProbeSet(
        "repeated", _with_bos(tok.expand(n, T).clone(), tokenizer, bos), bos, seed, "one random token repeated"
    )


@parameters_from(text_probe)
def make_probe(kind: str, tokenizer, *, n: int = 100, T: int = 64, bos: bool = False, seed: int = 0) -> ProbeSet:
    """One of ``PROBE_KINDS`` by name.

    Parameters
    ----------
    kind : {"natural", "random", "repeated"}
    tokenizer : transformers.PreTrainedTokenizerBase
        The model's tokenizer (ValueError for None: build token tensors yourself).
    n, T, bos, seed
        As in :func:`text_probe`.

    Returns
    -------
    ProbeSet
        ``tokens`` of shape (N, T).
    """
    makers = {"natural": natural_probe, "random": random_probe, "repeated": repeated_probe}
    if kind not in makers:
        raise ValueError(f"unknown probe kind {kind!r}; choose one of {list(PROBE_KINDS)}.")
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; build token tensors yourself and pass them to the metric.")
    return makers[kind](tokenizer, n=n, T=T, bos=bos, seed=seed)


@parameters_from(text_probe)
def probe_sets(
    tokenizer, *, n: int = 100, T: int = 64, bos: bool = False, seed: int = 0, kinds: Sequence[str] = PROBE_KINDS
) -> dict[str, ProbeSet]:
    """The paper's three probe kinds (natural, random, repeated), with the same N, T, BOS and seed.

    Parameters
    ----------
    tokenizer, n, T, bos, seed
        As in :func:`text_probe`.
    kinds : sequence of str
        The kinds to make (default all of ``PROBE_KINDS``).

    Returns
    -------
    dict of str to ProbeSet
        Kind -> probe, ``tokens`` of shape (N, T).
    """
    return {k: make_probe(k, tokenizer, n=n, T=T, bos=bos, seed=seed) for k in kinds}


def task_probe_sets(model: SinkModel, *, n: int = 100, T: int = 64, seed: int = 2024) -> dict[str, ProbeSet]:
    """The three probe kinds for a reference model trained on a token task without a tokenizer (the synthetic
    bigram-copy task of ``analysis.train``).

    ``natural`` is held-out sequences of the task itself (training used another seed), ``random`` tokens uniform over
    the task's content tokens, and ``repeated`` one content token repeated.

    Parameters
    ----------
    model : analysis.train.SinkLM
        A reference model of the synthetic task (ValueError for a model without such a task).
    n : int
        N, the number of sequences.
    T : int
        Tokens per sequence.
    seed : int
        The seed of the held-out sequences and of the sampling.

    Returns
    -------
    dict of str to ProbeSet
        Kind -> probe, ``tokens`` of shape (N, T).
    """
    ref = getattr(model, "reference_config", None) or {}
    train = ref.get("train", {})
    if not str(train.get("dataset", "")).startswith("synthetic"):
        raise ValueError(
            "this model has no tokenizer and was not trained on the synthetic task, so there are no "
            "probes to build; pass your own token tensors (N, T) to the analyses."
        )
    _check_nt(n, T)
    # lazy for import time: the reference model package loads transformer_lens (~2 s), needed only for reference models
    from analysis.model.reference.config import TrainConfig
    from analysis.model.reference.data import build_data

    data = build_data(TrainConfig.from_dict({**train, "seed": seed, "out": None}), T)
    content = torch.arange(1, data.vocab_size)  # token 0 is BOS
    g = torch.Generator().manual_seed(seed)
    random = content[torch.randint(content.numel(), (n, T), generator=g)]
    repeated = content[torch.randint(content.numel(), (n, 1), generator=g)].expand(n, T).clone()
    natural_bos = data.starts_with_fixed_token()
    return {
        "natural": ProbeSet("natural", data.probe(n, T), natural_bos, seed, data.description),
        "random": ProbeSet("random", random, False, seed, "uniform over the task's content tokens"),
        "repeated": ProbeSet("repeated", repeated, False, seed, "one content token repeated"),
    }


@parameters_from(text_probe)
def model_probe_sets(
    model: SinkModel, *, n: int = 100, T: int = 64, bos: bool = False, seed: int = 0
) -> dict[str, ProbeSet]:
    """``probe_sets`` from the model's tokenizer or, for a tokenizer-less reference model of the synthetic task,
    ``task_probe_sets`` (held-out task sequences, seed 2024 + ``seed``).

    Parameters
    ----------
    model : SinkModel
    n, T, bos, seed
        As in :func:`text_probe`.

    Returns
    -------
    dict of str to ProbeSet
        Kind -> probe, ``tokens`` of shape (N, T).
    """
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:
        return probe_sets(tokenizer, n=n, T=T, bos=bos, seed=seed)
    return task_probe_sets(model, n=n, T=T, seed=2024 + seed)
