"""Configuration dataclasses: the model's architecture (``ModelConfig``) and the run (``TrainConfig``).

Both are flat dataclasses so every field can be set from the command line (``--d-model 128``) and
stored in a checkpoint's ``config.json``. Field names on ``ModelConfig`` follow TransformerLens'
``cfg`` (``n_layers``, ``n_heads``, ``n_key_value_heads``, ``d_head``, ``positional_embedding_type``,
...) so analysis code can read ``model.cfg`` the same way for a ``TransformerBridge`` and for these
models.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from analysis.core.defaults import SINK_EPS

POSITIONAL_EMBEDDINGS = ("rotary", "none", "learned", "sinusoidal", "alibi", "relative")
NORMALIZATIONS = ("RMS", "LN")
NORM_POSITIONS = ("pre", "post")
ACTIVATIONS = ("swiglu", "gelu", "relu")
SIGMOID_BIASES = ("none", "fixed", "learnable")
ATTN_IMPLS = ("auto", "eager", "sdpa", "flex", "triton")


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {list(allowed)}.")


class _Config:
    """What both configs do: ``to_dict`` (every field) and ``from_dict`` (ValueError for an unknown field)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(
                f"unknown {cls.__name__.removesuffix('Config').lower()} config field(s) {unknown}; known fields: {sorted(names)}. "
                "Was this config written by a newer version of analysis.train?"
            )
        return cls(**d)


@dataclass
class ModelConfig(_Config):
    """Architecture of a LLaMA-style decoder with a swappable attention operation.

    Defaults give the small synthetic-task model (1 layer, 4 heads, d_model 64).

    Attributes
    ----------
    d_vocab : int
        The vocabulary size.
    n_ctx : int
        The longest sequence.
    d_model : int
        The residual width.
    n_layers : int
        The number of blocks.
    n_heads : int
        Query heads per layer.
    n_key_value_heads : int or None
        Key/value heads (None: n_heads, no GQA).
    d_head : int or None
        The width of a head (None: d_model // n_heads).
    d_mlp : int or None
        The MLP width (None: 4 d_model for gelu / relu, 8/3 d_model rounded up to 8 for swiglu).
    act_fn : str
        The MLP: "swiglu", "gelu" or "relu".
    normalization_type : str
        "RMS" or "LN".
    norm_position : str
        "pre" or "post".
    eps : float
        The norms' epsilon.
    positional_embedding_type : str
        "rotary", "none", "learned", "sinusoidal", "alibi" or "relative".
    rotary_base : float
        The true RoPE base (theta).
    relative_attention_num_buckets : int
        T5-style relative bias.
    relative_attention_max_distance : int
        T5-style relative bias: the largest distance bucketed.
    alibi_slope_scale : float
        ALiBi: every head's slope (Press et al.'s geometric series) times this factor (1: the paper's slopes).
    attention : str
        The attention operation (see ``analysis.model.reference.attention.available_attention()``).
    sliding_window : int or None
        Keys j with i - w < j <= i (any operation).
    prefix_attention : int
        Prefix LM: the first p tokens attend to each other bidirectionally.
    document_token : int or None
        Intra-document masking: a document starts at each of these tokens.
    attn_alpha : float
        Softmax-scaled: divide by Z / alpha.
    attn_p : float
        Softmax-pnorm: sim / (sum sim^p)^(1/p).
    sigmoid_bias : str
        Sigmoid attention: "none", "fixed" (-log T) or "learnable" (per head).
    kernel_hidden : int or None
        Linear-mlp kernel width (None: d_head).
    tie_embeddings : bool
        Share the embedding and unembedding.
    init_std : float
        The standard deviation of the initial weights.
    attn_impl : str
        "auto", "eager", "sdpa", "flex" or "triton" (auto: fused kernels on CUDA when no pattern hook); which kernel
        each operation takes, and why not where it cannot: ``analysis.model.reference.kernels``.
    model_name : str
        The model's name.
    """

    d_vocab: int = 65
    n_ctx: int = 64
    d_model: int = 64
    n_layers: int = 1
    n_heads: int = 4
    n_key_value_heads: Optional[int] = None  # None: = n_heads (no GQA)
    d_head: Optional[int] = None  # None: d_model // n_heads
    d_mlp: Optional[int] = None  # None: 4 * d_model (gelu/relu) or 8/3 * d_model rounded up to 8 (swiglu)
    act_fn: str = "swiglu"  # swiglu | gelu | relu
    normalization_type: str = "RMS"  # RMS | LN
    norm_position: str = "pre"  # pre | post
    eps: float = 1e-6
    positional_embedding_type: str = "rotary"  # rotary | none | learned | sinusoidal | alibi | relative
    rotary_base: float = 10000.0  # the true RoPE base (theta)
    relative_attention_num_buckets: int = 32  # T5-style relative bias
    relative_attention_max_distance: int = 128
    alibi_slope_scale: float = 1.0  # ALiBi: the slopes times this (1: Press et al.'s)
    attention: str = "softmax"  # see analysis.model.reference.attention.available_attention()
    sliding_window: Optional[int] = None  # keys j with i - w < j <= i (any operation)
    prefix_attention: int = 0  # prefix LM: the first p tokens attend to each other bidirectionally
    document_token: Optional[int] = None  # intra-document masking: a document starts at each of these tokens
    attn_alpha: float = 1.0  # softmax-scaled: divide by Z / alpha
    attn_p: float = 2.0  # softmax-pnorm: sim / (sum sim^p)^(1/p)
    sigmoid_bias: str = "none"  # sigmoid: none | fixed (-log T) | learnable (per head)
    kernel_hidden: Optional[int] = None  # linear-mlp kernel width (None: d_head)
    tie_embeddings: bool = False
    init_std: float = 0.02
    attn_impl: str = "auto"  # auto | eager | sdpa | flex | triton (auto: fused kernels on CUDA when no pattern hook)
    model_name: str = "sink-lm"

    def __post_init__(self) -> None:
        if self.n_key_value_heads is None:
            self.n_key_value_heads = self.n_heads
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "choose another n_heads or set d_head explicitly."
                )
            self.d_head = self.d_model // self.n_heads
        if self.d_mlp is None:
            self.d_mlp = 8 * math.ceil(8 * self.d_model / 3 / 8) if self.act_fn == "swiglu" else 4 * self.d_model
        self.validate()

    def validate(self) -> None:
        for name in ("d_vocab", "n_ctx", "d_model", "n_layers", "n_heads", "n_key_value_heads", "d_head", "d_mlp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}.")
        if self.n_heads % self.n_key_value_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_key_value_heads={self.n_key_value_heads} "
                "(query head h uses key/value head h // (n_heads / n_key_value_heads))."
            )
        _choice("act_fn", self.act_fn, ACTIVATIONS)
        _choice("normalization_type", self.normalization_type, NORMALIZATIONS)
        _choice("norm_position", self.norm_position, NORM_POSITIONS)
        _choice("positional_embedding_type", self.positional_embedding_type, POSITIONAL_EMBEDDINGS)
        _choice("sigmoid_bias", self.sigmoid_bias, SIGMOID_BIASES)
        _choice("attn_impl", self.attn_impl, ATTN_IMPLS)
        if self.positional_embedding_type == "rotary" and self.d_head % 2:
            raise ValueError(f"rotary embeddings need an even d_head; got {self.d_head}.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None; got {self.sliding_window}.")
        if self.prefix_attention < 0:
            raise ValueError(f"prefix_attention must be >= 0; got {self.prefix_attention}.")
        if self.document_token is not None and not 0 <= self.document_token < self.d_vocab:
            raise ValueError(f"document_token={self.document_token} is not a token id in [0, {self.d_vocab}).")
        if self.attn_p <= 0:
            raise ValueError(f"attn_p must be > 0; got {self.attn_p}.")
        if not self.alibi_slope_scale > 0:
            raise ValueError(f"alibi_slope_scale must be > 0 (1: Press et al.'s slopes); got {self.alibi_slope_scale}.")
        from analysis.model.reference.attention import check_attention  # import time: the CLI parses before torch

        self.attention = check_attention(self.attention, self)

    # A TransformerLens-style alias read by some analysis code.
    @property
    def n_kv_heads(self) -> int:
        return self.n_key_value_heads


@dataclass
class TrainConfig(_Config):
    """One training run: data, optimisation, logging and checkpointing.

    Attributes
    ----------
    out : str or None
        The run's folder (None: nothing written).
    preset : str or None
        The preset the run started from.
    seed : int
        The seed of the initialisation and of the batches.
    device : str
        "auto", "cpu", "cuda" or "cuda:N" (under torchrun: the local rank's GPU).
    precision : str
        "auto" (bf16 autocast on CUDA, fp32 on CPU), "fp32" or "bf16".
    compile : bool
        ``torch.compile`` the model.
    dataset : str
        "synthetic", "synthetic-docs", "synthetic-broadcast", "stdlib", "hf:NAME[:CONFIG]" or "tokens:PATH.npy".
    dataset_split : str
        The split of a Hugging Face dataset.
    text_column : str
        The column holding its text.
    corpus_max_chars : int or None
        Cap the text read from the corpus.
    tokenizer : str
        "bpe" (byte-level BPE trained on the corpus), or a Hugging Face tokenizer name or folder.
    tokenizer_vocab_size : int
        The vocabulary of a trained BPE tokenizer.
    bos : bool
        Prepend the BOS token to every window (natural text; the synthetic task always has one).
    fixed_token_position : int or None
        1-based position k at which a fixed token is inserted.
    fixed_token_id : int or None
        The fixed token (None: the tokenizer's BOS / EOS id).
    prefix_len : int
        Prefix LM: loss only on tokens after the first p.
    synthetic_vocab : int
        Synthetic task: content tokens (ids 1..V; 0 is BOS).
    synthetic_triggers : int
        Copy rule after the most frequent tokens.
    synthetic_seed : int
        The seed of the task's transition matrix.
    synthetic_bos : bool
        Synthetic task: start every sequence with BOS (False: at an arbitrary chain token).
    synthetic_keys : int
        Induction rule: after a key token seen before, repeat what followed it (0: no keys).
    synthetic_lags : int
        Key i repeats the token 1 + (i mod lags) after its last occurrence (one circuit per lag).
    synthetic_topics : int
        ``synthetic-broadcast``: the topic tokens, one of which opens every sequence.
    synthetic_noise : float
        ``synthetic-broadcast``: the chance that a token is drawn uniformly instead of by its topic's permutation.
    val_fraction : float
        Natural text: tail of the token stream held out.
    steps : int
        Optimiser steps.
    batch_size : int
        Sequences per optimiser step (global, over all processes).
    micro_batch_size : int or None
        Per process and forward pass (gradient accumulation).
    lr : float
        The peak learning rate.
    schedule : str
        "cosine" or "constant" (both after a linear warm-up).
    warmup_steps : int
        Linear warm-up steps.
    min_lr_ratio : float
        Cosine floor as a fraction of lr.
    beta1 : float
        AdamW's beta1.
    beta2 : float
        AdamW's beta2.
    weight_decay : float
        AdamW's weight decay.
    decay_all_params : bool
        True: also norm gains, biases, embeddings (as in the paper); False: matrices only.
    grad_clip : float
        The gradient norm clip (0 disables).
    log_every : int
        Steps between log records.
    eval_every : int
        Sink_1 and first-token norm ratio on the held-out probe.
    probe_size : int
        Sequences of the held-out probe.
    probe_len : int
        Tokens per probe sequence.
    sink_eps : float
        The sink threshold of the evaluations.
    checkpoint_every : int
        0: no intermediate checkpoints.
    keep_checkpoints : int
        Checkpoints kept.
    snapshots : str or None
        Weights kept along training: "log:N" (N log-spaced steps) or "100,500,2000".
    resume : bool
        Continue from the latest checkpoint in `out`.
    progress : bool
        Show a progress bar.
    """

    out: Optional[str] = None
    preset: Optional[str] = None
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N (under torchrun: the local rank's GPU)
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16
    compile: bool = False  # torch.compile the model
    # data
    dataset: str = "synthetic"  # synthetic | synthetic-docs | synthetic-broadcast | stdlib | hf:NAME | tokens:PATH.npy
    dataset_split: str = "train"
    text_column: str = "text"
    corpus_max_chars: Optional[int] = None  # cap the text read from the corpus
    tokenizer: str = "bpe"  # bpe (byte-level BPE trained on the corpus) | a HF tokenizer name or folder
    tokenizer_vocab_size: int = 4096
    bos: bool = False  # prepend the BOS token to every window (natural text; the synthetic task always has one)
    fixed_token_position: Optional[int] = None  # 1-based position k at which a fixed token is inserted
    fixed_token_id: Optional[int] = None  # None: the tokenizer's BOS/EOS id
    prefix_len: int = 0  # prefix LM: loss only on tokens after the first p
    synthetic_vocab: int = 64  # synthetic task: content tokens (ids 1..V; 0 is BOS)
    synthetic_triggers: int = 3  # copy rule after the most frequent tokens
    synthetic_seed: int = 1234  # the task's transition matrix
    synthetic_bos: bool = True  # synthetic task: start every sequence with BOS (False: at an arbitrary chain token)
    synthetic_keys: int = 0  # induction rule: after a key token seen before, repeat what followed it (0: no keys)
    synthetic_lags: int = 1  # key i repeats the token 1 + (i mod lags) after its last occurrence (one circuit per lag)
    synthetic_topics: int = 4  # synthetic-broadcast: topic tokens, one of which opens every sequence
    synthetic_noise: float = 0.2  # synthetic-broadcast: chance a token is uniform instead of its topic's permutation
    val_fraction: float = 0.02  # natural text: tail of the token stream held out
    # optimisation
    steps: int = 4000
    batch_size: int = 32  # sequences per optimiser step (global, over all processes)
    micro_batch_size: Optional[int] = None  # per process and forward pass (gradient accumulation)
    lr: float = 1e-2
    schedule: str = "cosine"  # cosine | constant (both after linear warm-up)
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    decay_all_params: bool = True  # True: also norm gains, biases, embeddings (as in the paper); False: matrices only
    grad_clip: float = 1.0  # 0 disables
    # logging, probes, checkpoints
    log_every: int = 10
    eval_every: int = 500  # Sink_1 and first-token norm ratio on the held-out probe
    probe_size: int = 100
    probe_len: int = 64
    sink_eps: float = SINK_EPS
    checkpoint_every: int = 500  # 0: no intermediate checkpoints
    keep_checkpoints: int = 2
    snapshots: Optional[str] = None  # weights kept along training: "log:N" (N log-spaced steps) or "100,500,2000"
    resume: bool = False  # continue from the latest checkpoint in `out`
    progress: bool = True

    def __post_init__(self) -> None:
        _choice("schedule", self.schedule, ("cosine", "constant"))
        _choice("precision", self.precision, ("auto", "fp32", "bf16"))
        for name in ("steps", "batch_size", "log_every", "probe_size", "probe_len", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}.")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "prefix_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}.")
        if self.fixed_token_position is not None and self.fixed_token_position < 1:
            raise ValueError(f"fixed_token_position is 1-based (1 = first token); got {self.fixed_token_position}.")
        if self.synthetic_keys < 0 or self.synthetic_lags < 1:
            raise ValueError(
                f"synthetic_keys must be >= 0 and synthetic_lags >= 1; got {self.synthetic_keys}, "
                f"{self.synthetic_lags}."
            )
        if self.synthetic_topics < 1 or not 0.0 <= self.synthetic_noise <= 1.0:
            raise ValueError(
                f"synthetic_topics must be >= 1 and synthetic_noise in [0, 1]; got "
                f"{self.synthetic_topics}, {self.synthetic_noise}."
            )
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0; got {self.lr}.")
        snapshot_steps(self.snapshots, self.steps)  # a bad spec fails here, before any training


def snapshot_steps(spec: Optional[str], steps: int) -> list[int]:
    """The steps at which a run keeps its weights (``TrainConfig.snapshots``), ascending, each in [1, steps].

    ``"log:N"``: N steps spaced evenly in log from 10 (or 1 for runs under 100 steps) to ``steps`` (fewer when
    rounding makes two equal); ``"100,500,2000"``: those steps. None or "": none.

    Parameters
    ----------
    spec : str or None
    steps : int
        The run's length.

    Returns
    -------
    list of int
    """
    if not spec:
        return []
    spec = str(spec).strip()
    if spec.startswith("log:"):
        try:
            n = int(spec[4:])
        except ValueError:
            n = 0
        if n < 2:
            raise ValueError(f"snapshots={spec!r}: give 'log:N' with N >= 2 (e.g. log:12).")
        lo = 10 if steps >= 100 else 1
        return sorted({int(round(lo * (steps / lo) ** (i / (n - 1)))) for i in range(n)})
    try:
        out = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"snapshots={spec!r}: give 'log:N' or comma-separated steps such as 100,500,2000.") from None
    bad = [s for s in out if not 1 <= s <= steps]
    if bad:
        raise ValueError(f"snapshot steps {bad} lie outside 1..steps={steps}.")
    return out


def split_overrides(overrides: dict) -> tuple[dict, dict]:
    """Split a flat {field: value} dict into (model fields, train fields); unknown names raise.

    Parameters
    ----------
    overrides : dict

    Returns
    -------
    model : dict
    train : dict
    """
    m_names, t_names = ({f.name for f in dataclasses.fields(c)} for c in (ModelConfig, TrainConfig))
    unknown = sorted(set(overrides) - m_names - t_names)
    if unknown:
        raise ValueError(
            f"unknown config field(s) {unknown}; model fields: {sorted(m_names)}; train fields: {sorted(t_names)}."
        )
    return ({k: v for k, v in overrides.items() if k in m_names}, {k: v for k, v in overrides.items() if k in t_names})
