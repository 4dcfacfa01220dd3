"""Training data: packed windows from a tokenized corpus, the synthetic bigram-copy task and the broadcast task.

Every batch is a pure function of (seed, step): windows are cut at offsets drawn from a random
generator seeded with ``[seed, step]``, so a run resumed at step s sees exactly the batches an
uninterrupted run would, and every process of a distributed run slices the same global batch.

Corpora
    ``stdlib``          docstrings of the Python standard library (offline, deterministic: files in
                        sorted order, docstrings in source order), documents separated by EOS.
    ``hf:NAME[:CONFIG]`` a Hugging Face dataset (needs ``datasets`` and a network).
    ``tokens:PATH.npy`` an already tokenized stream (1-D integer array; needs a tokenizer name).
    ``synthetic``       BOS-prefixed bigram transitions with a copy rule after trigger tokens.
    ``synthetic-docs``  the same task as packed documents: windows start at an arbitrary token.
    ``synthetic-broadcast`` the ground truth of a broadcast sink: a topic token first, read at every position
                        (the ground truth of a nop sink is ``synthetic`` itself: a copy needed at a few positions).

As in the paper's packing, the first token of a window is an arbitrary token of the stream unless
``bos`` (prepend BOS) or ``fixed_token_position`` (insert a fixed token at position k) is set.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np
import torch

from analysis.core.io import cache_dir
from analysis.model.reference.config import TrainConfig

EOS_TOKEN = "<|endoftext|>"
KEY_RANK = 8  # the synthetic task's induction keys follow the 8 most frequent tokens
_SKIP_DIRS = set(
    "test tests idlelib site-packages dist-packages turtledemo __pycache__ lib2to3 ensurepip tkinter pydoc_data".split()
)


# ----------------------------------------------------------------------------- corpora


def stdlib_docstrings(max_chars: Optional[int] = None) -> list[str]:
    """Docstrings of the standard library's modules, classes and functions, in a fixed order: the reference models'
    training corpus (every file of the standard library, parsed, for volume). The probes read another, smaller
    selection (``analysis.model.probes.stdlib_texts``: 72 prose modules, through ``inspect``).

    Parameters
    ----------
    max_chars : int, optional
        Stop after this many characters.

    Returns
    -------
    list of str
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= 40:
                    docs.append(doc)
                    total += len(doc)
                    if max_chars is not None and total >= max_chars:
                        return docs
    return docs


def _hf_documents(name: str, split: str, text_column: str, max_chars: Optional[int]) -> Iterator[str]:
    """Documents of a Hugging Face dataset ``NAME[:CONFIG]``, streamed, up to ``max_chars`` characters."""
    try:
        from datasets import load_dataset  # imported lazily: only needed for hf: corpora
    except ImportError as e:
        raise ImportError(
            "dataset='hf:...' needs the `datasets` package: `pip install datasets` (and a network), "
            "or use --dataset stdlib / tokens:PATH.npy."
        ) from e

    repo, _, config = name.partition(":")
    try:
        ds = load_dataset(repo, config or None, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - offline, unknown name, gated, ...
        raise RuntimeError(
            f"could not open the Hugging Face dataset {name!r} ({type(e).__name__}: {e}). It needs a "
            "network; offline, use --dataset stdlib or a pre-tokenized --dataset tokens:PATH.npy."
        ) from e
    total = 0
    for row in ds:
        text = row.get(text_column)
        if text is None:
            raise ValueError(
                f"dataset {name!r} has no column {text_column!r}; set --text-column (columns: {sorted(row)})."
            )
        yield text
        total += len(text)
        if max_chars is not None and total >= max_chars:
            return


# ----------------------------------------------------------------------------- tokenizers


def train_bpe(docs: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``docs``, wrapped as a ``PreTrainedTokenizerFast`` whose BOS, EOS and
    padding are the EOS token.

    Parameters
    ----------
    docs : iterable of str
    vocab_size : int

    Returns
    -------
    transformers.PreTrainedTokenizerFast
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=None, pad_token=EOS_TOKEN
    )


def load_tokenizer_file(path) -> "object":
    """A run's ``tokenizer.json`` as a ``PreTrainedTokenizerFast``.

    Parameters
    ----------
    path : path-like

    Returns
    -------
    transformers.PreTrainedTokenizerFast
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN
    )


def _pretrained_tokenizer(name: str):
    """A Hugging Face tokenizer by name or folder; RuntimeError saying what to use instead where it cannot be
    loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(
            f"could not load the tokenizer {name!r} ({type(e).__name__}). A hub name needs a network; "
            "use --tokenizer bpe to train a byte-level BPE tokenizer on the corpus instead."
        ) from e


def tokenize_docs(tokenizer, docs: Iterable[str], *, chunk: int = 1000) -> np.ndarray:
    """One stream: each document's ids followed by EOS (the packing of the paper: BOS = EOS).
    Tokenizes ``chunk`` documents at a time, so the stream is the only large object in memory.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
    docs : iterable of str
    chunk : int
        Documents per tokenizer call.

    Returns
    -------
    numpy.ndarray, shape (n_tokens,)
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token to separate documents.")
    parts, buf = [], []

    def flush():
        ids = tokenizer(buf, add_special_tokens=False)["input_ids"]
        parts.append(np.fromiter((t for seq in ids for t in (*seq, eos)), dtype=np.int32))
        buf.clear()

    for doc in docs:
        buf.append(doc)
        if len(buf) >= chunk:
            flush()
    if buf:
        flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


# ----------------------------------------------------------------------------- batch sources


@dataclass
class TrainBatch:
    """One training batch.

    Attributes
    ----------
    inputs : torch.LongTensor, shape (B, T)
        Token ids.
    targets : torch.LongTensor, shape (B, T)
        The next-token targets, -100 where no loss is taken.
    """

    inputs: torch.Tensor  # (B, T) long
    targets: torch.Tensor  # (B, T) long, -100 where no loss


class DataSource:
    """Base: ``batch(step, batch_size)`` -> ``TrainBatch`` (deterministic) and ``probe(n, T)`` held-out tokens."""

    vocab_size: int
    tokenizer = None
    bos_token_id: Optional[int] = None
    description: str = ""

    def __init__(self, cfg: TrainConfig, n_ctx: int):
        self.cfg = cfg
        self.n_ctx = n_ctx

    def windows(self, rng: np.random.Generator, n: int, length: int, held_out: bool) -> np.ndarray:
        raise NotImplementedError

    def _format(self, rng, n: int, T: int, held_out: bool) -> np.ndarray:
        """Windows of T tokens with the BOS / fixed-token options applied."""
        k = self.cfg.fixed_token_position
        if self.cfg.bos and k is None:
            k = 1
        if k is None:
            return self.windows(rng, n, T, held_out)
        if k > T:
            raise ValueError(f"fixed_token_position={k} lies beyond the window length {T}.")
        fixed = self.cfg.fixed_token_id if self.cfg.fixed_token_id is not None else self.bos_token_id
        if fixed is None:
            raise ValueError("no fixed token: set --fixed-token-id (this data source has no BOS token).")
        w = self.windows(rng, n, T - 1, held_out)
        return np.concatenate([w[:, : k - 1], np.full((n, 1), fixed, dtype=w.dtype), w[:, k - 1 :]], axis=1)

    def batch(self, step: int, batch_size: int) -> TrainBatch:
        rng = np.random.default_rng([self.cfg.seed, int(step), 0])
        w = torch.from_numpy(self._format(rng, batch_size, self.n_ctx + 1, held_out=False).astype(np.int64))
        inputs, targets = w[:, :-1].clone(), w[:, 1:].clone()
        p = self.cfg.prefix_len
        if p > 0:  # prefix LM: no loss on predicting the first p tokens (targets[:, j] is token j + 1)
            targets[:, : max(p - 1, 0)] = -100
        return TrainBatch(inputs, targets)

    def probe(self, n: int, T: int) -> torch.Tensor:
        """Held-out sequences (n, T) for the sink metric, the same for every call."""
        rng = np.random.default_rng([self.cfg.seed, 2**31 - 1, 1])
        return torch.from_numpy(self._format(rng, n, T, held_out=True).astype(np.int64))

    def probe_without_fixed_token(self, n: int, T: int) -> Optional[torch.Tensor]:
        """The held-out probe with the fixed first token left out (the paper's "trained with a fixed BOS,
        probed without it"), or None when training windows do not start with a fixed token."""
        if not self.starts_with_fixed_token():
            return None
        rng = np.random.default_rng([self.cfg.seed, 2**31 - 1, 1])
        return torch.from_numpy(self._format(rng, n, T + 1, held_out=True)[:, 1:].astype(np.int64))

    def starts_with_fixed_token(self) -> bool:
        return self.cfg.bos or self.cfg.fixed_token_position == 1

    def meta(self) -> dict:
        return {
            "dataset": self.cfg.dataset,
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "description": self.description,
        }


class PackedCorpus(DataSource):
    """Windows cut at random offsets from a packed token stream (train part / held-out tail)."""

    def __init__(self, cfg: TrainConfig, n_ctx: int, stream: np.ndarray, tokenizer, description: str):
        super().__init__(cfg, n_ctx)
        n_val = max(int(len(stream) * cfg.val_fraction), n_ctx + 2)
        if len(stream) - n_val < 2 * (n_ctx + 2):
            raise ValueError(
                f"the corpus has only {len(stream)} tokens, too few for windows of {n_ctx + 1} tokens; "
                "use a larger corpus (--corpus-max-chars) or a smaller --n-ctx."
            )
        self.train_ids, self.val_ids = stream[:-n_val], stream[-n_val:]
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        self.description = description

    def windows(self, rng, n, length, held_out):
        ids = self.val_ids if held_out else self.train_ids
        if len(ids) <= length:
            raise ValueError(
                f"the {'held-out' if held_out else 'training'} stream ({len(ids)} tokens) is "
                f"shorter than a window of {length}; lower --T / --n-ctx."
            )
        offsets = rng.integers(0, len(ids) - length, size=n)
        return np.stack([ids[o : o + length] for o in offsets])


class SyntheticBigramCopy(DataSource):
    """BOS, then a Markov chain over V tokens; after a trigger token (one of the ``synthetic_triggers``
    most frequent tokens of the chain, by its stationary distribution) the next token copies the token
    before the trigger (the bigram-backcopy task of Guo et al. 2024). Bigram prediction needs no attention; the copy needs one head at trigger positions
    only, so a head must learn to do nothing elsewhere: with softmax it parks its attention on BOS.

    With ``synthetic_keys`` K > 0, the tokens ranked 9..8+K by frequency are *keys* with an induction rule: after a key
    that occurred before (last at position j), the next token repeats the token ``lag`` after that occurrence,
    x[t + 1] = x[j + lag], lag = 1 + (the key's rank mod ``synthetic_lags``) (when j + lag <= t; the trigger
    rule wins on a trigger). Each lag needs its own circuit over two layers (a head that moves token j into
    position j + lag, then a head that finds it), and the second head has nothing to read at every other
    position: a task whose heads are active for few queries and must do nothing for the rest.

    Token 0 is BOS; content tokens are 1..V.
    """

    def __init__(self, cfg: TrainConfig, n_ctx: int):
        super().__init__(cfg, n_ctx)
        V = cfg.synthetic_vocab
        if V < max(cfg.synthetic_triggers, KEY_RANK) + cfg.synthetic_keys + 2 or cfg.synthetic_triggers < 0:
            raise ValueError(
                f"synthetic_vocab={V} must exceed max(synthetic_triggers, 8) + synthetic_keys + 1 (and triggers >= 0)."
            )
        rng = np.random.default_rng(cfg.synthetic_seed)
        popularity = 1.0 / np.arange(1, V + 1) ** 1.0  # Zipf-like token frequencies
        P = rng.dirichlet(np.full(V, 0.2), size=V) * popularity[None, :]
        self.P = P / P.sum(1, keepdims=True)
        pi = np.full(V, 1.0 / V)
        for _ in range(500):
            pi = pi @ self.P
        self.stationary = pi
        by_freq = np.argsort(-pi, kind="stable") + 1
        self.triggers = np.sort(by_freq[: cfg.synthetic_triggers])
        first = max(cfg.synthetic_triggers, KEY_RANK)  # keys of middling frequency: a key recurs now and then
        self.keys = by_freq[first : first + cfg.synthetic_keys]
        self.lag = np.zeros(V + 1, dtype=np.int64)  # token -> its induction lag (0: not a key)
        self.lag[self.keys] = 1 + np.arange(len(self.keys)) % cfg.synthetic_lags
        start = pi.copy()
        start[self.triggers - 1] = 0.0
        self.start = start / start.sum()
        self.cdf = np.cumsum(self.P, axis=1)
        self.vocab_size = V + 1
        self.bos_token_id = 0
        self.is_trigger = np.zeros(V + 1, dtype=bool)
        self.is_trigger[self.triggers] = True
        self.description = (
            f"synthetic bigram-copy task: BOS + Markov chain over {V} tokens, copy rule "
            f"after triggers {self.triggers.tolist()}"
        )
        if len(self.keys):
            self.description += (
                f", induction rule after keys {sorted(self.keys.tolist())} (lags 1.."
                f"{min(cfg.synthetic_lags, len(self.keys))})"
            )

    def windows(self, rng, n, length, held_out):
        x = np.zeros((n, length), dtype=np.int64)
        if length == 1:
            return x
        x[:, 1] = 1 + np.searchsorted(np.cumsum(self.start), rng.random(n), side="right").clip(max=len(self.start) - 1)
        rows = np.arange(n)
        last = np.full((n, self.vocab_size), -1, dtype=np.int64)  # last position of each token before t
        for t in range(1, length - 1):
            cur = x[:, t]
            u = rng.random(n)
            nxt = 1 + (self.cdf[cur - 1] < u[:, None]).sum(1).clip(max=self.P.shape[0] - 1)
            copy = self.is_trigger[cur] & (t >= 2)
            x[:, t + 1] = np.where(copy, x[:, t - 1], nxt)
            if len(self.keys):
                j, lag = last[rows, cur], self.lag[cur]
                recall = (lag > 0) & (j >= 1) & (j + lag <= t) & ~copy
                x[:, t + 1] = np.where(recall, x[rows, np.clip(j + lag, 0, t)], x[:, t + 1])
                last[rows, cur] = t
        return x

    def _format(self, rng, n, T, held_out):
        # every sequence starts with BOS; a fixed token at a later position k replaces it: the chain
        # starts at position 1 and BOS is inserted at position k
        k = self.cfg.fixed_token_position
        if k is None and not self.cfg.synthetic_bos:  # no BOS anywhere: the window starts inside the chain
            return self.windows(rng, n, T + 1, held_out)[:, 1:]
        if k is None:
            return self.windows(rng, n, T, held_out)
        fixed = self.cfg.fixed_token_id if self.cfg.fixed_token_id is not None else self.bos_token_id
        if k == 1:  # the fixed token takes BOS's place: a content token there is set apart by its position alone
            w = self.windows(rng, n, T, held_out)
            w[:, 0] = fixed
            return w
        if k > T:
            raise ValueError(f"fixed_token_position={k} lies beyond the window length {T}.")
        w = self.windows(rng, n, T, held_out)[:, 1:]
        return np.concatenate([w[:, : k - 1], np.full((n, 1), fixed, dtype=w.dtype), w[:, k - 1 :]], axis=1)

    def starts_with_fixed_token(self) -> bool:
        return self.cfg.fixed_token_position == 1 or (self.cfg.fixed_token_position is None and self.cfg.synthetic_bos)

    def meta(self):
        return {
            **super().meta(),
            "triggers": self.triggers.tolist(),
            "synthetic_vocab": self.cfg.synthetic_vocab,
            "synthetic_seed": self.cfg.synthetic_seed,
            "keys": self.keys.tolist(),
            "lags": self.lag[self.keys].tolist(),
        }


class SyntheticDocuments(SyntheticBigramCopy):
    """The bigram-copy task as packed documents (``dataset="synthetic-docs"``): documents (BOS + chain) of
    random length between n_ctx / 4 and 2 n_ctx are concatenated and windows are cut at random offsets,
    so a window's first token is an arbitrary token, as in the paper's packing. With the model's
    ``document_token=0`` attention stays inside each document (intra-document masking)."""

    def __init__(self, cfg: TrainConfig, n_ctx: int):
        super().__init__(cfg, n_ctx)
        self.description = self.description.replace("BOS + Markov chain", "packed documents (BOS + Markov chain)")

    def windows(self, rng, n, length, held_out):
        lo, hi = max(2, self.n_ctx // 4), 2 * self.n_ctx
        n_docs = 2 + (2 * length) // lo
        docs = super().windows(rng, n * n_docs, hi, held_out).reshape(n, n_docs, hi)
        lengths = rng.integers(lo, hi + 1, size=(n, n_docs))
        offsets = rng.integers(0, hi, size=n)
        out = np.empty((n, length), dtype=np.int64)
        for i in range(n):
            stream = np.concatenate([docs[i, j, : lengths[i, j]] for j in range(n_docs)])
            out[i] = stream[offsets[i] : offsets[i] + length]
        return out

    def _format(self, rng, n, T, held_out):
        return DataSource._format(self, rng, n, T, held_out)

    def starts_with_fixed_token(self) -> bool:
        return DataSource.starts_with_fixed_token(self)


class SyntheticBroadcast(DataSource):
    """The broadcast task (``dataset="synthetic-broadcast"``): every sequence opens with one of K topic tokens (ids
    V+1..V+K), then content tokens 1..V in which each next token is the current one mapped by the topic's
    permutation, x[t + 1] = pi_topic(x[t]), or, with probability ``synthetic_noise``, a uniform token. Every position
    needs the topic, a global variable of the sequence that the context does not give away (each permutation keeps
    the uniform distribution, so the tokens' counts say nothing of it) and that one token holds: a head that reads
    the first token from every query and carries its value on (a broadcast, whose value is large and differs with
    the topic). The permutations are seeded by ``synthetic_seed``.

    Token 0 (BOS) never occurs.
    """

    def __init__(self, cfg: TrainConfig, n_ctx: int):
        super().__init__(cfg, n_ctx)
        V, K = cfg.synthetic_vocab, cfg.synthetic_topics
        if cfg.fixed_token_position is not None or cfg.bos:
            raise ValueError(f"dataset={cfg.dataset!r} sets its own first token; drop --fixed-token-position / --bos.")
        if V < 2:
            raise ValueError(f"dataset={cfg.dataset!r} needs synthetic_vocab >= 2; got {V}.")
        rng = np.random.default_rng(cfg.synthetic_seed)
        self.perms = np.stack([np.concatenate([[0], 1 + rng.permutation(V)]) for _ in range(K)])  # (K, V + 1)
        self.topics = np.arange(V + 1, V + K + 1)
        self.vocab_size = V + K + 1
        self.bos_token_id = None
        self.description = (
            f"synthetic broadcast task: a topic token of {K} (ids {V + 1}..{V + K}) first, then a "
            f"permutation chain over {V} tokens by the topic's permutation (noise {cfg.synthetic_noise})"
        )

    def windows(self, rng, n, length, held_out):
        V = self.cfg.synthetic_vocab
        topic = rng.integers(0, len(self.topics), size=n)
        x = np.zeros((n, length), dtype=np.int64)
        x[:, 0] = self.topics[topic]
        uniform = rng.integers(1, V + 1, size=(n, length))
        noisy = rng.random((n, length)) < self.cfg.synthetic_noise
        if length > 1:
            x[:, 1] = uniform[:, 1]
        for t in range(1, length - 1):
            x[:, t + 1] = np.where(noisy[:, t + 1], uniform[:, t + 1], self.perms[topic, x[:, t]])
        return x

    def _format(self, rng, n, T, held_out):
        return self.windows(rng, n, T, held_out)

    def starts_with_fixed_token(self) -> bool:
        return False

    def meta(self):
        return {
            **super().meta(),
            "topics": self.topics.tolist(),
            "synthetic_vocab": self.cfg.synthetic_vocab,
            "synthetic_noise": self.cfg.synthetic_noise,
        }


def _stream_cache_key(cfg: TrainConfig) -> str:
    key = json.dumps(
        {
            "dataset": cfg.dataset,
            "split": cfg.dataset_split,
            "col": cfg.text_column,
            "max_chars": cfg.corpus_max_chars,
            "tok": cfg.tokenizer,
            "vocab": cfg.tokenizer_vocab_size,
            "py": sys.version_info[:2],
            "v": 1,
        },
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def build_data(cfg: TrainConfig, n_ctx: int, *, tokenizer=None) -> DataSource:
    """The data source a run's config asks for. Tokenized streams are cached (``analysis.core.io.cache_dir() / "train"``).

    ``tokenizer``: reuse this tokenizer (e.g. when resuming) instead of training / loading one.

    Parameters
    ----------
    cfg : TrainConfig
    n_ctx : int
        The sequence length.
    tokenizer : transformers.PreTrainedTokenizerBase, optional

    Returns
    -------
    DataSource
    """
    ds = cfg.dataset
    if ds == "synthetic":
        return SyntheticBigramCopy(cfg, n_ctx)
    if ds == "synthetic-docs":
        return SyntheticDocuments(cfg, n_ctx)
    if ds == "synthetic-broadcast":
        return SyntheticBroadcast(cfg, n_ctx)
    if ds.startswith("tokens:"):
        path = Path(ds[len("tokens:") :]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"token file {path} not found (dataset='tokens:PATH.npy').")
        stream = np.load(path, mmap_mode="r", allow_pickle=False)
        if stream.ndim != 1 or not np.issubdtype(stream.dtype, np.integer):
            raise ValueError(f"{path} must hold a 1-D integer array of token ids.")
        if tokenizer is None:
            if cfg.tokenizer == "bpe":
                raise ValueError("dataset='tokens:...' needs the tokenizer the ids came from: --tokenizer NAME.")
            tokenizer = _pretrained_tokenizer(cfg.tokenizer)
        return PackedCorpus(cfg, n_ctx, stream, tokenizer, f"token file {path.name}")
    if ds != "stdlib" and not ds.startswith("hf:"):
        raise ValueError(
            f"unknown dataset {ds!r}: use synthetic, synthetic-docs, synthetic-broadcast, stdlib, hf:NAME[:CONFIG] or tokens:PATH.npy."
        )

    cache = cache_dir() / "train" / f"stream-{_stream_cache_key(cfg)}"
    if (
        tokenizer is None
        and (cache / "tokens.npy").is_file()
        and (cache / "tokenizer.json").is_file()
        and cfg.tokenizer == "bpe"
    ):
        tokenizer = load_tokenizer_file(cache / "tokenizer.json")
        return PackedCorpus(cfg, n_ctx, np.load(cache / "tokens.npy", allow_pickle=False), tokenizer, _describe(cfg))
    if ds == "stdlib":
        stdlib = stdlib_docstrings(cfg.corpus_max_chars)
        docs = lambda: iter(stdlib)  # noqa: E731
    else:
        docs = lambda: _hf_documents(ds[3:], cfg.dataset_split, cfg.text_column, cfg.corpus_max_chars)  # noqa: E731
    if tokenizer is None:
        tokenizer = (
            train_bpe(docs(), cfg.tokenizer_vocab_size)
            if cfg.tokenizer == "bpe"
            else _pretrained_tokenizer(cfg.tokenizer)
        )
    stream = tokenize_docs(tokenizer, docs())
    if len(stream) == 0:
        raise ValueError(f"the corpus {ds!r} is empty.")
    if cfg.tokenizer == "bpe":
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = cache / f"tokens.{os.getpid()}.tmp.npy"
            np.save(tmp, stream, allow_pickle=False)
            os.replace(tmp, cache / "tokens.npy")
            tokenizer.backend_tokenizer.save(str(cache / f"tokenizer.{os.getpid()}.tmp"))
            os.replace(cache / f"tokenizer.{os.getpid()}.tmp", cache / "tokenizer.json")
        except OSError:
            pass  # a read-only cache is not an error
    return PackedCorpus(cfg, n_ctx, stream, tokenizer, _describe(cfg))


def _describe(cfg: TrainConfig) -> str:
    what = (
        "Python standard-library docstrings" if cfg.dataset == "stdlib" else f"Hugging Face dataset {cfg.dataset[3:]}"
    )
    tok = f"byte-level BPE ({cfg.tokenizer_vocab_size})" if cfg.tokenizer == "bpe" else cfg.tokenizer
    return f"{what}, tokenizer {tok}, packed windows"
