"""The model contract: what every analysis reads from a model, and streaming hook runs.

Anything whose hook names follow TransformerLens (``blocks.{l}.attn.hook_pattern`` ...) works:
TransformerLens' ``TransformerBridge`` for Hugging Face models, and this package's own reference
models (``analysis.train``). Analyses attach small reducers to those hooks and keep only what they
reduce to, never the full activation cache.
"""
from __future__ import annotations

import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from analysis.families import RESUMABLE, get_family, rotary_base
from analysis.stats import unit_vectors

HookFn = Callable[[torch.Tensor, object], object]

# Short activation names -> where TransformerLens puts them in block l (as transformer_lens.utils.get_act_name).
_BLOCK_ACTS = {"resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid", "resid_post": "hook_resid_post",
               "normalized": "ln1.hook_normalized", "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out"}
_ATTN_ACTS = ("q", "k", "v", "z", "rot_q", "rot_k", "attn_scores", "pattern")


class ModelContractError(ValueError):
    """The model lacks something an analysis needs (hook names, config fields, weights)."""


@dataclass(frozen=True)
class ModelDims:
    """Shape facts an analysis needs, read from ``model.cfg`` (with fall-backs to the hook names)."""

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
    """The TransformerLens hook name of activation ``name`` in block ``layer``: ``act_name("pattern", 3)`` is
    ``blocks.3.attn.hook_pattern``; ``resid_pre``/``resid_mid``/``resid_post``/``normalized`` (ln1's output
    before the gain) live on the block, ``q k v z rot_q rot_k attn_scores pattern`` on its attention."""
    if name in _BLOCK_ACTS:
        return f"blocks.{int(layer)}.{_BLOCK_ACTS[name]}"
    if name in _ATTN_ACTS:
        return f"blocks.{int(layer)}.attn.hook_{name}"
    raise ValueError(f"unknown activation {name!r}; choose among {sorted(_BLOCK_ACTS) + list(_ATTN_ACTS)}.")


def hook_names(model) -> set[str]:
    """All hook names the model exposes (``hook_dict`` keys)."""
    names = getattr(model, "hook_dict", None)
    if names is None:
        raise ModelContractError(
            f"{type(model).__name__} exposes no TransformerLens hooks (no `hook_dict`). Load models with "
            "`analysis.load_model(...)` (a TransformerBridge) or build one with `analysis.train`."
        )
    return set(names.keys())


def model_dims(model) -> ModelDims:
    """Read layer/head counts from ``model.cfg``; check the attention-pattern hooks exist."""
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


def check_layers(model, layers: Iterable[int] | None) -> list[int]:
    """Validate a list of layer indices (None means all layers)."""
    n = model_dims(model).n_layers
    if layers is None:
        return list(range(n))
    layers = [int(l) for l in layers]
    bad = [l for l in layers if not 0 <= l < n]
    if bad:
        raise ValueError(f"layers {bad} out of range: this model has layers 0..{n - 1}.")
    return layers


def attention_layers_of(model, layers: Iterable[int] | None = None) -> list[int]:
    """The softmax-attention layers an analysis of attention hooks runs on, as TRUE layer indices.

    ``layers=None``: every attention layer of the model (``model.family.attention_layers``; on a hybrid such as
    Qwen3-Next or Jamba the linear-attention / Mamba layers are left out, and ``get_family(model).skipped_text()``
    says which and why). Explicit ``layers`` are validated and returned in the order given; a layer out of range,
    or one that is not an attention layer, raises ValueError naming the attention layers. The one place that
    decides which layers an attention analysis sees: every analysis reading ``hook_pattern`` / q / k / v / z
    hooks calls this (residual-stream analyses use :func:`check_layers`)."""
    spec = get_family(model)
    if layers is None:
        return list(spec.attention_layers)
    layers = [int(l) for l in layers]
    bad = [l for l in layers if not 0 <= l < spec.n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range: this model has layers 0..{spec.n_layers - 1} "
                         f"(attention layers: {list(spec.attention_layers)}).")
    return [spec._check_attention_layer(l) for l in layers]


def skipped_note(model) -> str:
    """The layers an attention analysis leaves out, in one sentence ("Layers [0, 2] skipped (linear attention
    (Gated DeltaNet): no softmax attention pattern)."); "" when every layer is an attention layer."""
    text = get_family(model).skipped_text()
    return text[0].upper() + text[1:] + "." if text else ""


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model with no parameters
        return torch.device("cpu")


def check_tokens(model, tokens: torch.Tensor) -> torch.Tensor:
    """Validate a (N, T) batch of token ids against the model; return it as a LongTensor."""
    dims = model_dims(model)
    return validate_token_ids(tokens, dims.n_ctx, getattr(getattr(model, "cfg", None), "d_vocab", None))


def validate_token_ids(tokens, n_ctx: int | None, vocab: int | None, hint: str = "", sync: bool = True) -> torch.Tensor:
    """Token ids as a (N, T) LongTensor (a 1-d sequence gets a batch axis), checked for shape, dtype, emptiness, the
    context ``n_ctx`` and the vocabulary ``vocab`` (None: not checked); ValueError saying what to give otherwise.
    ``hint``: what to do beyond shortening the input, appended to the context error. ``sync=False``: the vocabulary
    is checked on the CPU only (a training step does not wait for the GPU to read the ids)."""
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape (N, T); got {tuple(tokens.shape)}.")
    if tokens.numel() == 0 or tokens.shape[1] == 0:
        raise ValueError("tokens are empty: give at least one sequence of at least one token.")
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be integer token ids; got dtype {tokens.dtype}.")
    if n_ctx is not None and tokens.shape[1] > n_ctx:
        raise ValueError(f"sequence length T={tokens.shape[1]} exceeds the model's context of {n_ctx} tokens; "
                         f"use T <= {n_ctx}{hint}.")
    if vocab is not None and (sync or tokens.device.type == "cpu") and not torch.compiler.is_compiling():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}); got ids in [{lo}, {hi}].")
    return tokens.long()


def batches(tokens: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    for start in range(0, tokens.shape[0], batch_size):
        yield tokens[start : start + batch_size]


def default_batch_size(tokens: torch.Tensor) -> int:
    """Keep a batch near 2k tokens on CPU (attention maps are built per layer, one at a time)."""
    T = tokens.shape[1]
    return max(1, min(tokens.shape[0], 2048 // max(T, 1)))


def token_strings(model, ids: Sequence[int]) -> list[str]:
    """Decoded tokens, one string per id (``#id`` when the model has no tokenizer)."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return [f"#{int(i)}" for i in ids]
    return [tok.decode([int(i)]) for i in ids]


def qk_hook_names(model, layer: int, rotated: bool = True) -> tuple[str, str]:
    """The (query, key) hooks of ``layer``: the rotated ones where the model uses rotary embeddings and has
    them (and ``rotated``), else ``hook_q``/``hook_k``. A model loaded by ``analysis.load_model`` carries its
    family spec (``model.family``), which names the hooks the attention really uses; otherwise, as some models
    list ``hook_rot_k`` without rotary (it never fires there), the rotary is checked on the model."""
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


# ----------------------------------------------------------------------------------------------
# Head layout: KV heads under grouped-query attention
# ----------------------------------------------------------------------------------------------


def kv_view(x: torch.Tensor, n_kv_heads: int, dim: int = 2) -> torch.Tensor:
    """The KV heads of a key/value activation: the bridge may hand ``hook_k``/``hook_v`` with each KV head
    repeated for its query heads ((B, T, H, d) instead of (B, T, H_kv, d)); this undoes the repetition."""
    n = x.shape[dim]
    if n == n_kv_heads:
        return x
    if n % n_kv_heads:
        raise ModelContractError(f"an activation with {n} heads cannot hold {n_kv_heads} KV heads.")
    return x.narrow(dim, 0, n).unflatten(dim, (n_kv_heads, n // n_kv_heads)).select(dim + 1, 0)


def per_query_head(x: torch.Tensor, n_heads: int, dim: int = 2) -> torch.Tensor:
    """KV-head values repeated for each query head that reads them (query head h reads KV head h // group)."""
    n = x.shape[dim]
    if n_heads % n:
        raise ModelContractError(f"{n_heads} query heads cannot share {n} KV heads.")
    return x.repeat_interleave(n_heads // n, dim=dim)


def group_reduce(x: torch.Tensor, group_size: int, how: str = "mean") -> torch.Tensor:
    """(..., H) per query head -> (..., H_kv): mean or max over the query heads of each KV head."""
    g = x.unflatten(-1, (-1, group_size))
    if how == "mean":
        return g.mean(-1)
    if how == "max":
        return g.max(-1).values
    raise ValueError(f"reduce must be 'mean' or 'max' (how query heads map to their KV head); got {how!r}.")


# ----------------------------------------------------------------------------------------------
# Streaming: accumulators fed per layer and batch
# ----------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """The batch being run: its tokens (on the model's device) and the index of its first sample."""

    tokens: torch.Tensor
    offset: int

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


class Accumulator:
    """One analysis' state during a streamed pass.

    ``hooks()`` says which activations it needs, per layer: {layer: {key: hook name}}. For each batch and
    layer, once every activation of that layer (over all accumulators of the pass) has fired,
    ``update(layer, acts, batch)`` receives its own ``{key: tensor}`` together (a :class:`LayerActs`): the joint
    reducer. Then ``end_batch(batch, logits)`` once per batch; ``result()`` after the pass. ``needs_logits`` False
    lets the pass stop after the last layer any accumulator needs.
    """

    needs_logits = False
    optional_keys: frozenset = frozenset()  # keys whose hooks may be listed but never fire (passed when they do)

    def hooks(self) -> dict[int, dict[str, str]]:
        raise NotImplementedError

    def update(self, layer: int, acts: dict[str, torch.Tensor], batch: Batch) -> None:
        raise NotImplementedError

    def end_batch(self, batch: Batch, logits: torch.Tensor | None) -> None:
        pass

    def result(self):
        raise NotImplementedError


class LayerActs(dict):
    """One layer's activations as an accumulator asked for them ({key: tensor}), and what every accumulator fed
    the same layer in the pass shares: :meth:`units`, computed once per tensor. Built by the joint reducer for
    each layer and batch and dropped after it, so nothing derived outlives the layer."""

    def __init__(self, acts: Mapping[str, torch.Tensor], scratch: dict | None = None):
        super().__init__(acts)
        self.scratch = {} if scratch is None else scratch  # id(x) -> (x, derived): x held, so its id stays its own

    def units(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``unit_vectors(x.float())`` (unit vectors, norms) of queries or keys x (..., d) derived from this layer's
        activations: the QK angles and the first-key manifold of one pass compute them once."""
        hit = self.scratch.get(id(x))
        if hit is None:
            hit = self.scratch[id(x)] = (x, unit_vectors(x.float()))
        return hit[1]


class LayerCollector:
    """Per-layer results of one batch -> (N, L, ...) after the pass (one tensor per layer and batch)."""

    def __init__(self, layers: Sequence[int]):
        self.layers = list(layers)
        self.current: dict[int, torch.Tensor] = {}
        self.chunks: list[torch.Tensor] = []

    def put(self, layer: int, x: torch.Tensor) -> None:
        self.current[layer] = x.detach().cpu()

    def end_batch(self) -> None:
        missing = [l for l in self.layers if l not in self.current]
        if missing:
            raise ModelContractError(f"no result for layers {missing}: their hooks did not fire.")
        self.chunks.append(torch.stack([self.current[l] for l in self.layers], dim=1))
        self.current.clear()

    def result(self) -> torch.Tensor:
        return torch.cat(self.chunks)


class _Stop(Exception):
    """Raised inside a hook to end a forward pass early (nothing after the last needed layer runs)."""


def _stop(x, hook):
    raise _Stop


class Capture(Accumulator):
    """Keeps ``select(activation)`` of one hook (e.g. one layer's attention maps for a view), per batch."""

    def __init__(self, name: str, layer: int, select: Callable[[torch.Tensor], torch.Tensor] = lambda x: x):
        self.name, self.layer, self.select, self.kept = name, int(layer), select, []

    def hooks(self):
        return {self.layer: {"x": self.name}}

    def update(self, layer: int, acts: dict, batch: Batch) -> None:
        self.kept.append(self.select(acts["x"]).detach().float().cpu())

    def result(self) -> torch.Tensor:
        return torch.cat(self.kept)


class _JointReducer:
    """Holds the activations of one layer until all of them have fired, then feeds every accumulator."""

    def __init__(self, accumulators: Sequence[Accumulator], stop_early: bool):
        self.accs = list(accumulators)
        self.wants = [a.hooks() for a in self.accs]
        self.by_layer: dict[int, set[str]] = {}  # every hook of the layer
        self.required: dict[int, set[str]] = {}  # the hooks that must fire before the layer is handed over
        for acc, w in zip(self.accs, self.wants):
            for layer, names in w.items():
                self.by_layer.setdefault(int(layer), set()).update(names.values())
                self.required.setdefault(int(layer), set()).update(
                    n for k, n in names.items() if k not in acc.optional_keys)
        self.last = max(self.by_layer) if self.by_layer else None
        self.stop_early = stop_early
        self.slot: dict[int, dict[str, torch.Tensor]] = {}
        self.done: set[int] = set()
        self.batch: Batch | None = None

    def fwd_hooks(self) -> list[tuple[str, HookFn]]:
        return [(name, self._hook(layer, name)) for layer, names in self.by_layer.items() for name in sorted(names)]

    def _hook(self, layer: int, name: str) -> HookFn:
        return lambda x, hook: self.fired(layer, name, x)

    def fired(self, layer: int, name: str, x: torch.Tensor) -> None:
        if layer in self.done:
            return
        slot = self.slot.setdefault(layer, {})
        slot[name] = x
        if not self.required[layer] <= slot.keys():
            return
        del self.slot[layer]
        self.done.add(layer)
        scratch: dict = {}  # shared by the layer's accumulators (LayerActs.units), dropped with the layer
        for acc, want in zip(self.accs, self.wants):
            if layer in want:
                acc.update(layer, LayerActs({k: slot[n] for k, n in want[layer].items() if n in slot}, scratch), self.batch)
        if self.stop_early and layer == self.last:
            raise _Stop

    def start(self, batch: Batch) -> None:
        self.batch, self.slot, self.done = batch, {}, set()

    def check_fired(self) -> None:
        silent = sorted(set(self.by_layer) - self.done)
        if silent:
            never = sorted({n for l in silent for n in self.required[l] - set(self.slot.get(l, {}))})
            raise ModelContractError(
                f"hooks {never[:4]}{'...' if len(never) > 4 else ''} did not fire: the model lists hooks it does not "
                "run. Load it with `analysis.load_model` (or, for keys/queries, try rotated=False).")


class ResidCapture(Accumulator):
    """The residual stream entering each block in ``layers`` (``hook_resid_pre``), (N, T, D) per layer in the
    model's dtype: what a pass resumed at that layer starts from (:class:`Resume`)."""

    def __init__(self, layers: Iterable[int]):
        self.layers = sorted({int(l) for l in layers})
        self.kept: dict[int, list[torch.Tensor]] = {l: [] for l in self.layers}

    def hooks(self):
        return {l: {"resid": act_name("resid_pre", l)} for l in self.layers}

    def update(self, layer: int, acts: dict, batch: Batch) -> None:
        self.kept[layer].append(acts["resid"].detach().clone().cpu())

    def result(self) -> dict[int, torch.Tensor]:
        return {l: torch.cat(chunks) for l, chunks in self.kept.items()}


@dataclass
class Resume:
    """Start a streamed pass at block ``layer`` from ``resid`` (N, T, D), the residual stream entering it
    (``hook_resid_pre``, e.g. from :class:`ResidCapture` over the same tokens and batches), instead of at the
    embedding: blocks 0..layer-1 are skipped, not run. Exact when nothing before ``layer`` is changed; no hook
    before ``layer`` may be attached (``stream`` raises ValueError), but for intervention hooks on the stream the
    pass starts from (``hook_resid_post`` of block ``layer - 1``), which ``stream`` applies to ``resid`` itself.
    Only models where :func:`can_resume`."""

    layer: int
    resid: torch.Tensor


def checkpoint_layers(n_layers: int, block_bytes: int, budget_mib: float) -> list[int]:
    """The blocks (1..n_layers-1) whose input a pass keeps so that later passes over the same tokens can resume
    (:class:`ResidCapture`): every block when their residuals (``block_bytes`` each) fit in ``budget_mib``, else
    every s-th block (s, 2s, ...) with the smallest s that fits; none when not even one fits."""
    if n_layers < 2 or block_bytes <= 0:
        return []
    fit = int(budget_mib * 2**20 // block_bytes)
    if fit < 1:
        return []
    step = -(-(n_layers - 1) // fit)  # ceil: (n_layers - 1) // step blocks kept
    return list(range(step, n_layers, step))


def resume_from(resid: dict[int, torch.Tensor] | None, layer: int) -> Resume | None:
    """A :class:`Resume` at the last kept block at or before ``layer`` (``resid``: {block: (N, T, D) residual
    entering it}, e.g. ``Profile.resid``); None when no kept block lies in 1..layer (run from the embedding)."""
    kept = [b for b in (resid or {}) if 0 < b <= layer]
    return Resume(max(kept), resid[max(kept)]) if kept else None


def can_resume(model) -> bool:
    """Whether a pass of ``model`` can start at a block from the residual entering it: a TransformerBridge whose
    blocks each read only the residual stream (``families.RESUMABLE``, checked by tests/test_interventions.py)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None or not all("_original_component" in getattr(b, "_modules", {}) for b in blocks):
        return False
    return get_family(model).family in RESUMABLE


class _PassOn(torch.nn.Module):
    """Stands in for a skipped block: hands its input on unchanged (the resumed block swaps in its residual)."""

    def forward(self, *args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]


@contextmanager
def _skipped_blocks(model, layer: int):
    """Blocks 0..layer-1 of a bridge replaced by :class:`_PassOn` for the duration (restored on exit)."""
    blocks = list(model.blocks)[:layer]
    kept = [b._modules["_original_component"] for b in blocks]
    try:
        for b in blocks:
            b._modules["_original_component"] = _PassOn()
        yield
    finally:
        for b, m in zip(blocks, kept):
            b._modules["_original_component"] = m


def hook_layer(name: str) -> int | None:
    """The block a hook lies in; -1 for the embedding's hooks, None for those after the blocks."""
    m = re.match(r"blocks\.(\d+)\.", name)
    if m:
        return int(m.group(1))
    return -1 if name.split(".")[0] in ("hook_embed", "hook_pos_embed", "embed", "pos_embed") else None


def _check_resume(model, tokens, resume: Resume, names: Iterable[str]) -> None:
    if not can_resume(model):
        raise ModelContractError(f"{type(model).__name__} cannot resume a pass at a block (``can_resume``).")
    if tuple(resume.resid.shape[:2]) != tuple(tokens.shape):
        raise ValueError(f"the residual to resume from has shape {tuple(resume.resid.shape)}; the tokens {tuple(tokens.shape)}.")
    early = sorted({n for n in names if hook_layer(n) is not None and hook_layer(n) < resume.layer})
    if early:
        raise ValueError(f"hooks {early[:4]} lie before layer {resume.layer}, where the pass resumes: they would not see "
                         "the model's activations.")


def _check_hooks(model, names: Iterable[str]) -> None:
    missing = sorted(set(names) - hook_names(model))
    if missing:
        raise ModelContractError(
            f"the model has no hook(s) {missing[:4]}{'...' if len(missing) > 4 else ''}; "
            "this analysis needs TransformerLens hook names (load with `analysis.load_model`)."
        )


def _batches(model, tokens, batch_size, progress) -> Iterator[Batch]:
    device = model_device(model)
    bs = batch_size or default_batch_size(tokens)
    it = range(0, tokens.shape[0], bs)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, total=(tokens.shape[0] + bs - 1) // bs, desc="batches", leave=False)
    for start in it:
        yield Batch(tokens[start : start + bs].to(device), start)


def stream(
    model,
    tokens: torch.Tensor,
    accumulators: Sequence[Accumulator],
    *,
    fwd_hooks: Sequence[tuple[str, HookFn]] = (),
    batch_size: int | None = None,
    progress: bool = False,
    on_batch_start: Callable[[Batch], None] | None = None,
    resume: Resume | None = None,
) -> list:
    """One streamed pass of ``model`` over ``tokens`` (N, T) feeding every accumulator; returns their results.

    ``fwd_hooks``: plain hooks that may return a changed activation (interventions); they run before the
    accumulators' hooks, which see the changed activations. ``on_batch_start(batch)`` runs before each batch.
    The pass stops after the last layer any accumulator needs unless one ``needs_logits`` or hooks change it.
    ``resume``: start each batch at block ``resume.layer`` from its rows of ``resume.resid`` (:class:`Resume`).
    """
    tokens = check_tokens(model, tokens)
    stop_early = not fwd_hooks and not any(a.needs_logits for a in accumulators)
    joint = _JointReducer(accumulators, stop_early)
    entry = _entry_hooks(fwd_hooks, resume)
    hooks = [h for h in fwd_hooks if h not in entry] + joint.fwd_hooks()
    _check_hooks(model, [n for n, _ in hooks + entry])
    if resume is not None:
        _check_resume(model, tokens, resume, [n for n, _ in hooks])
    with torch.inference_mode(), (_skipped_blocks(model, resume.layer) if resume is not None else nullcontext()):
        for batch in _batches(model, tokens, batch_size, progress):
            joint.start(batch)
            if on_batch_start is not None:
                on_batch_start(batch)
            _run_batch(model, batch, hooks, joint, accumulators, resume, entry)
    return [acc.result() for acc in accumulators]


def _entry_hooks(fwd_hooks, resume: Resume | None) -> list[tuple[str, HookFn]]:
    """The intervention hooks on the stream a resumed pass starts from (``hook_resid_post`` of the block before)."""
    if resume is None or resume.layer < 1:
        return []
    name = act_name("resid_post", resume.layer - 1)
    return [(n, fn) for n, fn in fwd_hooks if n == name]


def _run_batch(model, batch: Batch, hooks, joint: _JointReducer, accumulators, resume: Resume | None,
               entry=()) -> None:
    """One batch through the model (from the embedding, or resumed at a block with the ``entry`` hooks applied to
    the residual it starts from), then each accumulator's end."""
    logits = None
    try:
        if resume is None:
            logits = model.run_with_hooks(batch.tokens, fwd_hooks=hooks)
        else:
            resid = resume.resid[batch.offset : batch.offset + batch.size].to(batch.tokens.device)
            for name, fn in entry:
                out = fn(resid, model.hook_dict[name])
                resid = resid if out is None else out
            logits = model.run_with_hooks(resid, fwd_hooks=hooks, start_at_layer=resume.layer)
    except _Stop:
        pass
    joint.check_fired()
    for acc in accumulators:
        acc.end_batch(batch, logits)


def run_with_reducers(
    model,
    tokens: torch.Tensor,
    reducers: Sequence[tuple[str, HookFn]],
    *,
    batch_size: int | None = None,
    progress: bool = False,
    on_batch: Callable[[torch.Tensor, torch.Tensor | None], None] | None = None,
    stop_after: str | None = None,
) -> None:
    """Run ``model`` over ``tokens`` in batches with plain ``reducers`` attached as forward hooks.

    Each reducer ``fn(activation, hook)`` folds the activation into its own state and returns None (or a
    replacement activation). ``on_batch(batch, logits)`` sees each batch's tokens and logits. ``stop_after``
    names a hook after which each pass ends early (``on_batch`` then gets ``logits=None``). Analyses use
    ``stream`` with accumulators; this is the plain form for one-off hooks.
    """
    hooks = list(reducers) + ([(stop_after, _stop)] if stop_after else [])
    stream(model, tokens, [_OnBatch(on_batch)], fwd_hooks=hooks, batch_size=batch_size, progress=progress)


class _OnBatch(Accumulator):
    """Calls ``fn(tokens, logits)`` after each batch (``run_with_reducers``' ``on_batch``)."""

    needs_logits = True

    def __init__(self, fn):
        self.fn = fn

    def hooks(self):
        return {}

    def end_batch(self, batch: Batch, logits) -> None:
        if self.fn is not None:
            self.fn(batch.tokens, logits)

    def result(self) -> None:
        return None
