"""The model contract: what every analysis reads from a model, and streaming hook runs.

Anything whose hook names follow TransformerLens (``blocks.{l}.attn.hook_pattern`` ...) works:
TransformerLens' ``TransformerBridge`` for Hugging Face models, and this package's own reference
models (``analysis.train``). Analyses attach small reducers to those hooks and keep only what they
reduce to, never the full activation cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch

HookFn = Callable[[torch.Tensor, object], object]


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
    if not n_layers or f"blocks.{n_layers - 1}.attn.hook_pattern" not in names:
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


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model with no parameters
        return torch.device("cpu")


def check_tokens(model, tokens: torch.Tensor) -> torch.Tensor:
    """Validate a (N, T) batch of token ids against the model; return it as a LongTensor."""
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape (N, T); got {tuple(tokens.shape)}.")
    if tokens.numel() == 0 or tokens.shape[1] == 0:
        raise ValueError("tokens are empty: give at least one sequence of at least one token.")
    if tokens.is_floating_point():
        raise ValueError("tokens must be integer token ids, not floats.")
    dims = model_dims(model)
    if dims.n_ctx is not None and tokens.shape[1] > dims.n_ctx:
        raise ValueError(
            f"sequence length T={tokens.shape[1]} exceeds the model's context of {dims.n_ctx} tokens; "
            f"use T <= {dims.n_ctx}."
        )
    vocab = getattr(getattr(model, "cfg", None), "d_vocab", None)
    if vocab is not None and (int(tokens.max()) >= vocab or int(tokens.min()) < 0):
        raise ValueError(f"token ids must lie in [0, {vocab}); got ids in [{int(tokens.min())}, {int(tokens.max())}].")
    return tokens.long()


def batches(tokens: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    for start in range(0, tokens.shape[0], batch_size):
        yield tokens[start : start + batch_size]


def default_batch_size(tokens: torch.Tensor) -> int:
    """Keep a batch near 2k tokens on CPU (attention maps are built per layer, one at a time)."""
    T = tokens.shape[1]
    return max(1, min(tokens.shape[0], 2048 // max(T, 1)))


class _Stop(Exception):
    """Raised inside a hook to end a forward pass early (nothing after the last needed layer runs)."""


def token_strings(model, ids: Sequence[int]) -> list[str]:
    """Decoded tokens, one string per id (``#id`` when the model has no tokenizer)."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return [f"#{int(i)}" for i in ids]
    return [tok.decode([int(i)]) for i in ids]


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
    """Run ``model`` over ``tokens`` in batches with ``reducers`` attached as forward hooks.

    Each reducer ``fn(activation, hook)`` folds the activation into its own accumulator and returns
    None (or a replacement activation, for interventions), so nothing but the reduced statistics
    outlives a layer. ``on_batch(batch, logits)`` sees each batch's tokens and logits (e.g. to
    accumulate a loss). ``stop_after`` names a hook after which each forward pass ends early (the
    later layers are not run; ``on_batch`` then gets ``logits=None``).
    """
    names = hook_names(model)
    missing = sorted({n for n, _ in reducers if n not in names} | ({stop_after} - names if stop_after else set()))
    if missing:
        raise ModelContractError(
            f"the model has no hook(s) {missing[:4]}{'...' if len(missing) > 4 else ''}; "
            "this analysis needs TransformerLens hook names (load with `analysis.load_model`)."
        )
    tokens = check_tokens(model, tokens)
    device = model_device(model)
    bs = batch_size or default_batch_size(tokens)
    it = batches(tokens, bs)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, total=(tokens.shape[0] + bs - 1) // bs, desc="batches", leave=False)

    def stop(x, hook):
        raise _Stop

    hooks = list(reducers) + ([(stop_after, stop)] if stop_after else [])
    with torch.inference_mode():
        for batch in it:
            batch = batch.to(device)
            logits = None
            try:
                logits = model.run_with_hooks(batch, fwd_hooks=hooks)
            except _Stop:
                pass
            if on_batch is not None:
                on_batch(batch, logits)
