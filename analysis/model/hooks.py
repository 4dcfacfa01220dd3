"""The model contract: what every analysis reads from a model.

Anything whose hook names follow TransformerLens (``blocks.{l}.attn.hook_pattern`` ...) works:
TransformerLens' ``TransformerBridge`` for Hugging Face models, and this package's own reference
models (``analysis.train``). This module names the hooks (``act_name``), reads the model's dimensions
(``model_dims``) and attention layers (``check_attention_layers``), checks token ids (``check_tokens``) and lays out
KV heads under grouped-query attention (``kv_view``). The streamed passes that feed analyses from those hooks are
in ``analysis.engine.passes``.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from analysis.core.checks import check_length  # noqa: F401 (its home; named here too)
from analysis.model.contract import ModelContractError, SinkModel, model_device  # noqa: F401 (their home; named here)
from analysis.model.families import FamilySpec, get_family, rotary_base
from analysis.model.nnsight_model import NnsightModel

# Short activation names -> where TransformerLens puts them in block l (as transformer_lens.utils.get_act_name).
_BLOCK_ACTS = {
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "resid_post": "hook_resid_post",
    "normalized": "ln1.hook_normalized",
    "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out",
}
_ATTN_ACTS = ("q", "k", "v", "z", "rot_q", "rot_k", "attn_scores", "pattern")


@dataclass(frozen=True)
class ModelDims:
    """Shape facts an analysis needs, read from ``model.cfg`` (with fall-backs to the hook names).

    Attributes
    ----------
    n_layers : int
        L, the number of blocks.
    n_heads : int
        H, query heads per attention layer.
    n_kv_heads : int
        H_kv, key/value heads (``n_heads`` without grouped-query attention).
    d_model, d_head : int or None
        The residual width and the width of one head.
    n_ctx : int or None
        The context the model accepts.
    group_size : int
        Query heads per key/value head, ``n_heads // n_kv_heads`` (a property).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int | None
    d_head: int | None
    n_ctx: int | None

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 without GQA)."""
        return self.n_heads // self.n_kv_heads


def act_name(name: str, layer: int) -> str:
    """The TransformerLens hook name of an activation in a block.

    ``resid_pre`` / ``resid_mid`` / ``resid_post`` / ``normalized`` (ln1's output before the gain) live on the block,
    ``q k v z rot_q rot_k attn_scores pattern`` on its attention.

    Parameters
    ----------
    name : str
        The short activation name, e.g. "pattern".
    layer : int
        The block.

    Returns
    -------
    str
        E.g. ``act_name("pattern", 3) == "blocks.3.attn.hook_pattern"``.
    """
    if name in _BLOCK_ACTS:
        return f"blocks.{int(layer)}.{_BLOCK_ACTS[name]}"
    if name in _ATTN_ACTS:
        return f"blocks.{int(layer)}.attn.hook_{name}"
    raise ValueError(f"unknown activation {name!r}; choose among {sorted(_BLOCK_ACTS) + list(_ATTN_ACTS)}.")


def hook_names(model: SinkModel) -> set[str]:
    """All hook names the model exposes.

    Parameters
    ----------
    model
        A model with TransformerLens hooks (``hook_dict``); ModelContractError otherwise.

    Returns
    -------
    set of str
    """
    names = getattr(model, "hook_dict", None)
    if names is None:
        raise ModelContractError(
            f"{type(model).__name__} exposes no TransformerLens hooks (no `hook_dict`). Load models with "
            "`analysis.load_model(...)` (a TransformerBridge) or build one with `analysis.train`."
        )
    return set(names.keys())


def model_dims(model: SinkModel) -> ModelDims:
    """Read layer and head counts from ``model.cfg``; check the attention-pattern hooks exist.

    Parameters
    ----------
    model : SinkModel
        A model of the contract (a TransformerBridge, a reference model, an nnsight model: the last from its config).

    Returns
    -------
    ModelDims
        ModelContractError where the model has no ``blocks.{l}.attn.hook_pattern`` or no ``cfg.n_heads``.
    """
    if isinstance(model, NnsightModel):  # from its config (its weights may be on NDIF)
        s, cfg = model.spec, model.hf.config.get_text_config()
        d_head = getattr(cfg, "head_dim", None) or s.d_model // s.n_heads
        return ModelDims(s.n_layers, s.n_heads, s.n_kv_heads, s.d_model, int(d_head), model.n_ctx)
    names = hook_names(model)
    cfg = getattr(model, "cfg", None)
    n_layers = getattr(cfg, "n_layers", None)
    if n_layers is None:
        n_layers = sum(1 for n in names if n.startswith("blocks.") and n.endswith(".attn.hook_pattern"))
    if not n_layers or not any(f"blocks.{l}.attn.hook_pattern" in names for l in range(int(n_layers))):
        raise ModelContractError(
            f"{type(model).__name__} has no attention-pattern hooks (`blocks.{{l}}.attn.hook_pattern`). "
            "The sink analyses need a model with TransformerLens hook names: load it with "
            "`analysis.load_model(name_or_path)`."
        )
    n_heads = getattr(cfg, "n_heads", None)
    if n_heads is None:
        raise ModelContractError("model.cfg has no `n_heads`; set it on the model's config.")
    n_kv = getattr(cfg, "n_key_value_heads", None) or n_heads
    return ModelDims(
        n_layers=int(n_layers),
        n_heads=int(n_heads),
        n_kv_heads=int(n_kv),
        d_model=getattr(cfg, "d_model", None),
        d_head=getattr(cfg, "d_head", None),
        n_ctx=getattr(cfg, "n_ctx", None),
    )


def check_layers(model: SinkModel, layers: Iterable[int] | None) -> list[int]:
    """Validate layer indices against the model's blocks.

    Parameters
    ----------
    model : SinkModel
    layers : iterable of int, optional
        Block indices; None: every block.

    Returns
    -------
    list of int
        The layers, in the order given (ValueError for one out of range).
    """
    n = model_dims(model).n_layers
    if layers is None:
        return list(range(n))
    layers = [int(l) for l in layers]
    bad = [l for l in layers if not 0 <= l < n]
    if bad:
        raise ValueError(f"layers {bad} out of range: this model has layers 0..{n - 1}.")
    return layers


def check_dims(dims: Iterable[int], D: int, *, name: str = "dims") -> list[int]:
    """Residual-stream dimensions, sorted and without duplicates; ValueError naming the range. The one check of
    residual dims every analysis taking them calls.

    Parameters
    ----------
    dims : iterable of int
        Residual-stream dimensions.
    D : int
        d_model.
    name : str
        The argument's name, for the error message.

    Returns
    -------
    list of int
    """
    dims = sorted({int(d) for d in dims})
    bad = [d for d in dims if not 0 <= d < D]
    if bad:
        raise ValueError(f"{name} {bad} out of range: d_model is {D}; give residual dimensions in 0..{D - 1}.")
    return dims


def check_attention_layers(model: SinkModel, *, layers: Iterable[int] | None = None) -> list[int]:
    """The softmax-attention layers an analysis of attention hooks runs on, as TRUE layer indices: the input check
    of ``layers`` against the model's attention layers (``analysis.attention_layers``, the fact, owned by
    ``families``).

    The one place that decides which layers an attention analysis sees: every analysis reading ``hook_pattern`` / q /
    k / v / z hooks calls this (residual-stream analyses use :func:`check_layers`).

    Parameters
    ----------
    model : SinkModel
    layers : iterable of int, optional
        None: every attention layer of the model (``model.family.attention_layers``; on a hybrid such as Qwen3-Next
        or Jamba the linear-attention / Mamba layers are left out, and ``get_family(model).skipped_text()`` says
        which and why). Explicit layers are validated and returned in the order given; a layer out of range, or one
        that is not an attention layer, raises ValueError naming the attention layers.

    Returns
    -------
    list of int
    """
    if isinstance(model, NnsightModel):  # from its config (no FamilySpec: its weights may be on NDIF)
        att = list(model.spec.attention_layers)
        bad = [] if layers is None else [l for l in map(int, layers) if l not in att]
        if bad:
            raise ValueError(f"layers {bad} are not attention layers of this model (attention layers: {att}).")
        return att if layers is None else [int(l) for l in layers]
    spec = get_family(model)
    if layers is None:
        return list(spec.attention_layers)
    layers = [int(l) for l in layers]
    bad = [l for l in layers if not 0 <= l < spec.n_layers]
    if bad:
        raise ValueError(
            f"layers {bad} out of range: this model has layers 0..{spec.n_layers - 1} "
            f"(attention layers: {list(spec.attention_layers)})."
        )
    return [spec._check_attention_layer(l) for l in layers]


def check_heads(model: SinkModel, heads, *, kv: bool = False, name: str = "heads") -> list[tuple[int, int]]:
    """``heads`` as a list of (true layer, head) pairs on attention layers; ValueError naming the ranges. The one
    check of head pairs every analysis taking them calls.

    Parameters
    ----------
    model : SinkModel
    heads : iterable of (int, int)
        (layer, head) pairs.
    kv : bool
        The heads are KV heads (0..n_kv_heads - 1) rather than query heads.
    name : str
        The argument's name, for the error message.

    Returns
    -------
    list of (int, int)
        Without duplicates, in the order given.
    """
    dims = model_dims(model)
    H, what = (dims.n_kv_heads, "KV heads") if kv else (dims.n_heads, "query heads")
    try:
        pairs = [(int(l), int(h)) for l, h in heads]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be (layer, head) pairs, e.g. [(3, 0), (12, 5)]; got {heads!r}.") from None
    if not pairs:
        raise ValueError(f"{name} is empty; give at least one (layer, head) pair.")
    check_attention_layers(model, layers=[l for l, _ in pairs])  # raises on a layer out of range or without attention
    bad = [(l, h) for l, h in pairs if not 0 <= h < H]
    if bad:
        raise ValueError(f"{name} {bad} out of range: this model has {what} 0..{H - 1}.")
    return list(dict.fromkeys(pairs))


def skipped_note(model: SinkModel) -> str:
    """The layers an attention analysis leaves out, in one sentence.

    Parameters
    ----------
    model : SinkModel
        Any model with TransformerLens hook names.

    Returns
    -------
    str
        E.g. "Layers [0, 2] skipped (linear attention (Gated DeltaNet): no softmax attention pattern)."; "" when every
        layer is an attention layer.
    """
    if isinstance(model, NnsightModel):
        return "; ".join(f"layer {l}: {why}" for l, why in model.spec.skipped.items())
    text = get_family(model).skipped_text()
    return text[0].upper() + text[1:] + "." if text else ""


@dataclass(frozen=True)
class ModelFacts:
    """What the passes know of a model, derived once per model (:func:`model_facts`): its dims, attention layers,
    family and the layers an attention analysis leaves out.

    Attributes
    ----------
    dims : ModelDims
        Layer and head counts, widths (:func:`model_dims`).
    attention_layers : tuple of int
        The softmax-attention layers, true indices (``analysis.attention_layers``).
    family : FamilySpec
        What the model's family computes (``analysis.get_family``).
    skipped : str
        The layers an attention analysis leaves out, in one sentence; "" when none (:func:`skipped_note`).
    """

    dims: ModelDims
    attention_layers: tuple[int, ...]
    family: FamilySpec
    skipped: str


_FACTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (family, cfg, its ModelFacts)


def model_facts(model: SinkModel) -> ModelFacts:
    """The model's facts, derived on first use and kept for the model (read again where its family or cfg changed),
    so every accumulator of every pass asks for them instead of being handed them.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    ModelFacts
    """
    if isinstance(model, NnsightModel):  # nnsight's LanguageModel (maybe on NDIF): from its config, no FamilySpec
        return ModelFacts(model_dims(model), tuple(model.spec.attention_layers), None, skipped_note(model))
    family, cfg = get_family(model), getattr(model, "cfg", None)
    kept = None
    with contextlib.suppress(TypeError):  # not weakly referenceable: derived each time
        kept = _FACTS.get(model)
    if kept is not None and kept[0] is family and kept[1] is cfg:
        return kept[2]
    facts = ModelFacts(model_dims(model), tuple(family.attention_layers), family, skipped_note(model))
    with contextlib.suppress(TypeError):  # not weakly referenceable: not kept
        _FACTS[model] = (family, cfg, facts)
    return facts


def check_tokens(model: SinkModel, tokens: torch.Tensor, *, minimum: int = 2, why: str = "") -> torch.Tensor:
    """Validate a batch of token ids against the model's context and vocabulary, and their length.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``cfg.n_ctx`` and ``cfg.d_vocab`` are checked where set).
    tokens : torch.Tensor or array-like, shape (N, T) or (T,)
        Token ids.
    minimum, why : int, str
        The shortest length, and why a longer one than 2 applies (``analysis.core.checks.check_length``).

    Returns
    -------
    torch.LongTensor, shape (N, T)
        ValueError saying what to give otherwise.
    """
    vocab = (
        model.vocab_size if isinstance(model, NnsightModel) else getattr(getattr(model, "cfg", None), "d_vocab", None)
    )
    tokens = validate_token_ids(tokens, model_dims(model).n_ctx, vocab)
    check_length(tokens.shape[1], minimum=minimum, why=why)
    return tokens


def _not_ids_hint(tokens) -> str | None:
    """What to pass instead of ``tokens`` when it is text or a ProbeSet rather than token ids; None when it is ids."""
    if isinstance(tokens, str):
        return (
            "tokens must be token ids, an integer tensor or array of shape (N, T); got a string. Tokenize it "
            "first: analysis.model.probes.text_tokens(model.tokenizer, text) (no BOS), or "
            "model.to_tokens(text) (which puts the tokenizer's BOS first)."
        )
    if isinstance(tokens, (list, tuple)) and tokens and all(isinstance(t, str) for t in tokens):
        return (
            "tokens must be token ids, an integer tensor or array of shape (N, T); got a list of strings. Cut "
            "them into windows of T tokens: analysis.model.probes.text_probe(model.tokenizer, texts, n=N, T=T)"
            ".tokens."
        )
    if hasattr(tokens, "tokens") and hasattr(tokens, "bos") and hasattr(tokens, "kind"):
        return f"tokens must be token ids; got a {type(tokens).__name__}: pass its .tokens (probe.tokens)."
    return None


def validate_token_ids(
    tokens, n_ctx: int | None, vocab: int | None, *, hint: str = "", sync: bool = True
) -> torch.Tensor:
    """Token ids as a (N, T) LongTensor, checked for shape, dtype, emptiness, context and vocabulary.

    Parameters
    ----------
    tokens : torch.Tensor or array-like, shape (N, T) or (T,)
        Token ids (a 1-d sequence gets a batch axis).
    n_ctx : int or None
        The longest sequence allowed (None: not checked).
    vocab : int or None
        The vocabulary size: ids must lie in [0, vocab) (None: not checked).
    hint : str
        What to do beyond shortening the input, appended to the context error.
    sync : bool
        False: the vocabulary is checked on the CPU only (a training step does not wait for the GPU to read the ids).

    Returns
    -------
    torch.LongTensor, shape (N, T)
        ValueError saying what to give otherwise.
    """
    hint_ids = _not_ids_hint(tokens)
    if hint_ids:
        raise ValueError(hint_ids)
    if not isinstance(tokens, torch.Tensor):
        try:
            tokens = torch.as_tensor(np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(
                f"tokens must be token ids, an integer tensor or array of shape (N, T); got "
                f"{type(tokens).__name__} ({str(e).splitlines()[0][:120]})."
            ) from None
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape (N, T); got {tuple(tokens.shape)}.")
    if tokens.numel() == 0 or tokens.shape[1] == 0:
        raise ValueError("tokens are empty: give at least one sequence of at least one token.")
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be integer token ids; got dtype {tokens.dtype}.")
    if n_ctx is not None and tokens.shape[1] > n_ctx:
        raise ValueError(
            f"sequence length T={tokens.shape[1]} exceeds the model's context of {n_ctx} tokens; "
            f"use T <= {n_ctx}{hint}."
        )
    if vocab is not None and (sync or tokens.device.type == "cpu") and not torch.compiler.is_compiling():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}); got ids in [{lo}, {hi}].")
    return tokens.long()


def token_strings(model: SinkModel, ids: Sequence[int]) -> list[str]:
    """Decoded tokens, one string per id.

    Parameters
    ----------
    model
        A model with a ``tokenizer`` attribute (or none).
    ids : sequence of int
        Token ids.

    Returns
    -------
    list of str
        ``#id`` for each id when the model has no tokenizer.
    """
    tok = getattr(model, "tokenizer", None)
    return [f"#{int(i)}" for i in ids] if tok is None else [tok.decode([int(i)]) for i in ids]


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


def readable_text(tokenizer, ids: Sequence[int]) -> str:
    """Decoded text of ``ids``, with the bytes that form no whole UTF-8 character escaped (``' \\xe2\\x80'``), where
    the tokenizer's own decode would show each as '\ufffd' (a byte-level BPE token holding part of a character).

    Parameters
    ----------
    tokenizer : transformers tokenizer or None
    ids : sequence of int
        Token ids.

    Returns
    -------
    str
        The ids joined by spaces when there is no tokenizer.
    """
    ids = [int(i) for i in ids]
    if tokenizer is None:
        return " ".join(map(str, ids))
    text = tokenizer.decode(ids)
    if "\ufffd" not in text:
        return text
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # import time: only for a text with a byte token

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    raw = bytearray()
    for t in tokenizer.convert_ids_to_tokens(ids):
        m = _BYTE_TOKEN.fullmatch(t)
        if m:
            raw.append(int(m.group(1), 16))
        elif all(c in byte_of for c in t):  # byte-level BPE: each character stands for one byte
            raw.extend(byte_of[c] for c in t)
        else:  # SentencePiece: the word boundary is a space
            raw.extend(t.replace("\u2581", " ").encode())
    return raw.decode("utf-8", errors="backslashreplace")


def qk_hook_names(model: SinkModel, layer: int, *, rotated: bool = True) -> tuple[str, str]:
    """The (query, key) hooks of a layer.

    A model loaded by ``analysis.load_model`` carries its family spec (``model.family``), which names the hooks the
    attention really uses; otherwise, as some models list ``hook_rot_k`` without rotary (it never fires there), the
    rotary is checked on the model.

    Parameters
    ----------
    model : SinkModel
    layer : int
        The attention layer.
    rotated : bool
        Take the rotated hooks (``hook_rot_q`` / ``hook_rot_k``) where the model uses rotary embeddings and has them;
        False: ``hook_q`` / ``hook_k``.

    Returns
    -------
    tuple of (str, str)
        The query hook and the key hook.
    """
    spec = getattr(model, "family", None)  # the loader's family spec knows which key hook the attention uses
    if rotated and spec is not None and hasattr(spec, "key_hook"):
        return spec.query_hook(layer), spec.key_hook(layer)
    names = hook_names(model)
    rot = (act_name("rot_q", layer), act_name("rot_k", layer))
    if rotated and all(n in names for n in rot) and rotary_base(model) is not None:
        return rot
    plain = (act_name("q", layer), act_name("k", layer))
    missing = [n for n in plain if n not in names]
    if missing:
        raise ModelContractError(
            f"the model has no query/key hooks {missing}; QK analyses need TransformerLens hook names "
            "(`blocks.{l}.attn.hook_k`, or `hook_rot_k` with rotary): load it with `analysis.load_model`."
        )
    return plain


# ------------------------------------------------------------------ Head layout: KV heads under grouped-query attention


def kv_view(x: torch.Tensor, n_kv_heads: int, *, dim: int = 2) -> torch.Tensor:
    """The KV heads of a key/value activation.

    The bridge may hand ``hook_k`` / ``hook_v`` with each KV head repeated for its query heads ((B, T, H, d) instead of
    (B, T, H_kv, d)); this undoes the repetition.

    Parameters
    ----------
    x : torch.Tensor, shape (B, T, H or H_kv, d)
        A key or value activation (heads on axis ``dim``).
    n_kv_heads : int
        H_kv.
    dim : int
        The head axis.

    Returns
    -------
    torch.Tensor, shape (B, T, H_kv, d)
        A view of the first copy of each KV head (``x`` itself when it already has H_kv heads).
    """
    n = x.shape[dim]
    if n == n_kv_heads:
        return x
    if n % n_kv_heads:
        raise ModelContractError(f"an activation with {n} heads cannot hold {n_kv_heads} KV heads.")
    return x.narrow(dim, 0, n).unflatten(dim, (n_kv_heads, n // n_kv_heads)).select(dim + 1, 0)


def per_query_head(x: torch.Tensor, n_heads: int, *, dim: int = 2) -> torch.Tensor:
    """KV-head values repeated for each query head that reads them (query head h reads KV head h // group).

    Parameters
    ----------
    x : torch.Tensor, shape (..., H_kv, ...)
        Values per KV head on axis ``dim``.
    n_heads : int
        H, the number of query heads.
    dim : int
        The head axis.

    Returns
    -------
    torch.Tensor, shape (..., H, ...)
    """
    n = x.shape[dim]
    if n_heads % n:
        raise ModelContractError(f"{n_heads} query heads cannot share {n} KV heads.")
    return x.repeat_interleave(n_heads // n, dim=dim)


def group_reduce(x: torch.Tensor, group_size: int, *, how: str = "mean") -> torch.Tensor:
    """Per-query-head values reduced to their KV head: the mean or max over the query heads of each KV head.

    Parameters
    ----------
    x : torch.Tensor, shape (..., H)
        Values per query head.
    group_size : int
        Query heads per KV head.
    how : {"mean", "max"}
        The reduction.

    Returns
    -------
    torch.Tensor, shape (..., H_kv)
    """
    g = x.unflatten(-1, (-1, group_size))
    if how == "mean":
        return g.mean(-1)
    if how == "max":
        return g.max(-1).values
    raise ValueError(f"reduce must be 'mean' or 'max' (how query heads map to their KV head); got {how!r}.")


def hook_layer(name: str) -> int | None:
    """The block a hook lies in.

    Parameters
    ----------
    name : str
        A hook name, e.g. "blocks.3.attn.hook_pattern".

    Returns
    -------
    int or None
        The block index; -1 for the embedding's hooks, None for those after the blocks.
    """
    m = re.match(r"blocks\.(\d+)\.", name)
    if m:
        return int(m.group(1))
    return -1 if name.split(".")[0] in ("hook_embed", "hook_pos_embed", "embed", "pos_embed") else None


def bos_record(model: SinkModel, tokens: torch.Tensor) -> dict:
    """Whether the sequences start with the tokenizer's BOS token: what every result records of its first token.

    Parameters
    ----------
    model
        A model with a ``tokenizer`` attribute (or none: the record then says no BOS is known).
    tokens : torch.Tensor, shape (N, T)
        Token ids.

    Returns
    -------
    dict
        ``bos_id`` (int or None), ``bos_token`` (str or None) and ``starts_with_bos`` (the fraction of the sequences
        whose first token is that BOS, 0.0 where the tokenizer has none).
    """
    tok = getattr(model, "tokenizer", None)
    bos_id = getattr(tok, "bos_token_id", None) if tok is not None else None
    if bos_id is None:
        return {"bos_id": None, "bos_token": None, "starts_with_bos": 0.0}
    first = torch.as_tensor(tokens)[:, 0]
    share = float((first.cpu() == int(bos_id)).float().mean()) if first.numel() else 0.0
    return {"bos_id": int(bos_id), "bos_token": getattr(tok, "bos_token", None), "starts_with_bos": share}


def bos_sentence(record: dict | None, *, asked: bool | None = None) -> str:
    """The sentence a result's text gives its first token, from :func:`bos_record`.

    Parameters
    ----------
    record : dict or None
        Of :func:`bos_record` (None: nothing is said).
    asked : bool, optional
        Whether the probe was asked for a BOS (``--bos``); a BOS that was not asked for gets a note.

    Returns
    -------
    str
        One or two sentences; "" for no record.
    """
    if not record:
        return ""
    share = float(record.get("starts_with_bos") or 0.0)
    name = f"{record.get('bos_token')!r} (id {record.get('bos_id')})"
    if record.get("bos_id") is None:
        return "The tokenizer has no BOS token, so no sequence starts with one."
    if share == 0:
        return f"No sequence starts with the tokenizer's BOS {name}."
    which = "Every sequence" if share == 1 else f"{100 * share:.0f}% of the sequences"
    out = f"{which} starts with the tokenizer's BOS {name}."
    if not asked:
        out += (
            " Note: no BOS was asked for (the paper's probe has none); a BOS first often comes from "
            "model.to_tokens(text), which prepends it, so the sink measured may be the BOS's own."
        )
    return out
