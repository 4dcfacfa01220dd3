"""What a sink does for its head: a head that puts a query's attention on the sink is dormant for that query.

The notes the project started from read the sink as a learned implicit gate, and Guo et al. (2024, active and
dormant heads) find that a head is active or dormant depending on the input, and that a dormant head puts its
attention on the first token. This module measures it per head and per query: for every attention layer l, query
head h, sequence n and query position t,

- ``sink_attn``: the attention the query puts on the sink keys (``hook_pattern`` summed over ``sink_positions``;
  by default the first token, key 1 of the sink metric);
- ``slot``: the attention it puts on an extra slot that is no input token (a learned sink logit, a sink token, K/KV
  biases): 1 - the row sum of ``hook_pattern``, as ``SinkResult.slot``;
- ``mass``: where the model has ``hook_raw_pattern`` (the reference models of ``analysis.train``), the total weight
  that really multiplies the values, summed over the input tokens (1 - slot under softmax; under sigmoid attention
  without normalisation the row sum of the sigmoid scores, which a head can make small without any sink);
- ``out_norm``: the norm of the head's output at that query, its term of the attention output z_t^h W_O^h (what the
  head writes into the residual stream; before any post-attention norm), from ``hook_z`` and ``W_O``;
- ``effect``: the change in the sequence's summed next-token loss (nats) when that head's output at that query is
  removed (z_t^h set to 0), estimated by gradient x activation, -dL/dz_t^h . z_t^h: one forward and one backward
  pass give every head and query; ``effect_mean`` the same with z_t^h set to the head's mean output (mean ablation:
  what the head writes for this query goes, its constant part stays), -dL/dz_t^h . (z_t^h - mean z^h).
  :func:`removal_effects` computes the exact change for chosen heads (one pass per head, resumed at its block where
  the model can resume, every query of every sequence removed in a row of its own) and :func:`attribution_check`
  compares the two.

The result (``DormantHeads``, its tables and findings) lives in ``dormant_result``, exact removal in
``head_removal``, the comparison of the two estimates in ``attribution``; this module is the gradient x activation
pass itself.

The reduction happens in the hooks: a pass keeps these (N, L, H, T) numbers, never the activations of every layer
(the backward pass keeps what autograd needs for one batch of about 256 tokens). Statistics use the queries after
the sink that see enough keys for uniform attention not to count as sinking (``first_query``: 3 for the first token
and eps = 0.3) and whose output can change a later prediction (up to T - 2, 0-based).

Per head (:meth:`DormantHeads.head_table`): Spearman and Pearson correlations between sink attention and output
norm and between sink attention and |effect|; the share of *sinking* queries (sink attention > eps) that are
*quiet* (output norm below the head's ``quantile``-quantile of output norms, by default its median) against the
share of the other queries that are, and the same for *inert* (|effect| below the head's quantile of |effect|).
Without any link between sinking and dormancy both shares equal ``quantile``. A query is *dormant* for a head when
it is quiet; the finding (:meth:`DormantHeads.text`) says whether the queries that sink a head's attention are its
dormant ones, by output norm and by loss effect, and in which layers (:meth:`DormantHeads.layer_table`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch

from analysis.model.contract import SinkModel
from analysis.core.defaults import DORMANT_GRAD_BATCH_TOKENS, DORMANT_QUANTILE, SINK_EPS
from analysis.model.hooks import (
    ModelContractError,
    act_name,
    check_attention_layers,
    check_tokens,
    hook_names,
    model_device,
    model_dims,
    skipped_note,
)
from analysis.core.docs import parameters_from
from analysis.engine.attention import attention_of
from analysis.engine.passes import Reduction, batches
from analysis.engine.remote import grad_trace, plan_requests
from analysis.model.nnsight_model import NnsightModel, NnsightUnsupported, TraceWeight
from analysis.model.access import head_output_weights
from analysis.sinks.metric import check_eps, slot_share
from analysis.causal.dormant_result import DormantHeads, check_quantile, check_sink_positions, first_query
from analysis.causal.head_removal import head_means, removal_effects, sequence_losses


# ----------------------------------------------- The pass: one forward and one backward per batch, reduced in the hooks


def output_grams(model: SinkModel, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """{layer: W_O^h W_O^h^T (H, d_head, d_head)} so that |z_t^h W_O^h|^2 = z_t^h G_h z_t^h (float32). Reads
    ``analysis.model.access.head_output_weights`` (H, d_head, d_model); ModelContractError where they are missing.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    layers : sequence of int
        Attention layers.

    Returns
    -------
    dict of int to torch.Tensor
        {layer: (H, d_head, d_head)}.
    """
    return {l: head_gram(head_output_weights(model, l)) for l in layers}  # ModelContractError where a layer has none


def head_gram(W: torch.Tensor) -> torch.Tensor:
    """Each head's output Gram W_O W_O^T (H, d_head, d_head), float32, from W_O (H, d_head, d_model).

    Parameters
    ----------
    W : torch.Tensor, shape (H, d_head, d_model)

    Returns
    -------
    torch.Tensor
    """
    W = W.float()
    return torch.einsum("hdD,heD->hde", W, W)


@contextmanager
def _no_weight_grads(model):
    """The model's parameters without gradients for the duration (restored after): the backward pass then keeps no
    activation for weight gradients, only what the gradients to the heads' outputs need."""
    # An offloaded model's placeholders made under inference mode take no gradient either way: left alone.
    params = [p for p in model.parameters() if p.requires_grad and not p.is_inference()]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


class _BatchHooks:
    """The hooks of one batch: per attention layer, the sink / slot / mass attention from the pattern hooks, the
    output norm and the kept z (for the backward pass) from ``hook_z``."""

    def __init__(self, layers, grams, sink_sel, raw: bool, z_mean: torch.Tensor | None = None):
        self.layers, self.grams, self.sink_sel, self.raw, self.z_mean = layers, grams, sink_sel, raw, z_mean
        self.z: dict[int, torch.Tensor] = {}
        self.pattern: dict[int, torch.Tensor] = {}
        self.got: dict[str, dict[int, torch.Tensor]] = {k: {} for k in ("sink", "slot", "mass", "norm")}

    def hooks(self, model) -> list:
        first = min(self.layers)
        out = [(act_name("resid_pre", first), self.leaf)]
        for l in self.layers:
            out += [(act_name("pattern", l), self.on_pattern(l)), (act_name("z", l), self.on_z(l))]
            if self.raw:
                out.append((f"blocks.{l}.attn.hook_raw_pattern", self.on_raw(l)))
        return out

    @staticmethod
    def leaf(x, hook):
        """The residual stream entering the first attention layer as a leaf needing a gradient."""
        return x.detach().requires_grad_(True)

    def on_pattern(self, l):
        def f(x, hook):
            self.pattern[l] = x.detach()
            self._reduce(l)

        return f

    def on_raw(self, l):
        def f(x, hook):
            with torch.no_grad():
                self.got["mass"][l] = x.detach().float().sum(-1).cpu()

        return f

    def on_z(self, l):
        def f(x, hook):
            self.z[l] = x
            self._reduce(l)
            return x  # returned so that the bridge uses this very tensor downstream (the gradient reaches it)

        return f

    def _reduce(self, l) -> None:
        """:func:`head_stats` of layer ``l`` once its pattern and z have both fired (in either order: some families'
        pattern hook fires after z)."""
        if l in self.pattern and l in self.z:
            acts = {"pattern": self.pattern.pop(l), "z": self.z[l]}
            for k, v in head_stats(acts, sinks=self.sink_sel, gram=self.grams[l]).items():
                self.got[k][l] = v.cpu()


def head_stats(acts: dict, *, sinks, gram: torch.Tensor | None = None, W_O: torch.Tensor | None = None) -> dict:
    """One attention layer's statistics per head and query, (B, H, T) float32 each: "sink", the attention on the sink
    keys; "slot", the share on an extra slot; "norm", the norm of the head's output |z W_O| = sqrt(z G z), G = W_O
    W_O^T (``gram``, or from ``W_O`` read where the trace runs). A reduction of {"pattern", "z"}: the bridge's hooks
    and a remote trace run the same operations.

    Parameters
    ----------
    acts : dict
        "pattern": (B, H, T, T) or AttentionWeights; "z": (B, T, H, d_head).
    sinks : sequence of int, or torch.Tensor of shape (B, T)
        0-based sink key positions, or a mask of sink keys per sequence.
    gram, W_O : torch.Tensor, optional
        (H, d_head, d_head), or (H, d_head, d_model); one of them.

    Returns
    -------
    dict of str to torch.Tensor
    """
    with torch.no_grad():
        a = attention_of(acts["pattern"])
        if isinstance(sinks, torch.Tensor):
            sink = a.weighted(sinks[:, None, :].expand(-1, a.shape[1], -1).float())
        else:
            sink = a.columns(max(sinks) + 1)[..., list(sinks)].sum(-1)
        z = acts["z"].detach().float()
        G = (head_gram(W_O) if gram is None else gram).to(z)
        norm = torch.einsum("bthd,hde,bthe->bht", z, G, z).clamp_min(0).sqrt()
        return {"sink": sink, "slot": slot_share(acts["pattern"]), "norm": norm}


def grad_effects(acts: dict, *, z_mean: torch.Tensor | None = None) -> dict:
    """Each head's loss effect per query by gradient x activation, (B, H, T) float32: "effect", of removing its output
    (z set to 0), -dL/dz . z; with the head's mean output ``z_mean`` (H, d_head), "effect_mean", of setting z to it,
    -dL/dz . (z - z_mean). A reduction of {"z", "grad"} after the backward pass, here or next to a remote model.

    Parameters
    ----------
    acts : dict
        "z" and "grad" (dL/dz), (B, T, H, d_head).
    z_mean : torch.Tensor, optional

    Returns
    -------
    dict of str to torch.Tensor
    """
    g, z = acts["grad"].float(), acts["z"].detach().float()
    effect = -(g * z).sum(-1)  # (B, T, H)
    out = {"effect": effect.permute(0, 2, 1)}
    if z_mean is not None:
        out["effect_mean"] = (effect + torch.einsum("bthd,hd->bth", g, z_mean.to(g))).permute(0, 2, 1)
    return out


@parameters_from(sequence_losses)
def summed_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The batch's summed next-token loss: what the backward pass differentiates.

    Parameters
    ----------
    logits, tokens
        As in :func:`sequence_losses`.

    Returns
    -------
    torch.Tensor
        A scalar.
    """
    return sequence_losses(logits, tokens).sum()


def _grad_batch(model, tokens: torch.Tensor, hk: _BatchHooks) -> dict[str, torch.Tensor]:
    """One batch: forward with the hooks, backward of the summed loss to every head's output; (B, L, H, T) each."""
    tokens = tokens.to(model_device(model))
    if isinstance(hk.sink_sel, torch.Tensor):
        hk.sink_sel = hk.sink_sel.to(tokens.device)
    with torch.inference_mode(False), torch.enable_grad(), _no_weight_grads(model):
        logits = model.run_with_hooks(tokens, fwd_hooks=hk.hooks(model))
        loss = summed_loss(logits, tokens)
        missing = [l for l in hk.layers if l not in hk.z or not hk.z[l].requires_grad]
        if missing:
            raise ModelContractError(
                f"hook_z of layers {missing} did not fire or is not on the path to the loss; the "
                "loss effect needs the heads' outputs (`blocks.{l}.attn.hook_z`) to feed the model."
            )
        grads = torch.autograd.grad(loss, [hk.z[l] for l in hk.layers], allow_unused=True)
    effects = [  # a layer whose output reaches no loss (cannot happen for a causal LM) has none: zeros
        grad_effects(
            {"z": hk.z[l], "grad": torch.zeros_like(hk.z[l]) if g is None else g},
            z_mean=None if hk.z_mean is None else hk.z_mean[i],
        )
        for i, (l, g) in enumerate(zip(hk.layers, grads))
    ]
    out = {k: torch.stack([e[k].cpu() for e in effects], 1) for k in effects[0]}
    for k, per in hk.got.items():
        if per:
            out[k] = torch.stack([per[l] for l in hk.layers], 1)
    return out


def _remote_grad_batch(model: NnsightModel, tokens, sel, layers: list[int], z_mean, groups) -> dict:
    """:func:`_grad_batch` for a model loaded through nnsight: one trace with its backward pass per layer group
    (``analysis.engine.remote.grad_trace``), :func:`head_stats` and :func:`grad_effects` run in it (W_O read there)."""
    got = {}
    for group in groups:
        jobs = {
            l: (
                Reduction(head_stats, {"sinks": sel, "W_O": TraceWeight("W_O", l)}),
                Reduction(grad_effects, {"z_mean": None if z_mean is None else z_mean[layers.index(l)]}),
            )
            for l in group
        }
        with _no_weight_grads(model):
            got.update({l: {**f, **b} for l, f, b in grad_trace(model, tokens, jobs, summed_loss)})
    return {k: torch.stack([got[l][k] for l in layers], 1) for k in got[layers[0]]}


def grad_batch_size(T: int) -> int:
    """Sequences per forward + backward batch: about ``DORMANT_GRAD_BATCH_TOKENS`` tokens (the backward pass keeps
    every layer's activations of the batch).

    Parameters
    ----------
    T : int
        The sequence length.

    Returns
    -------
    int
    """
    return max(1, DORMANT_GRAD_BATCH_TOKENS // max(int(T), 1))


def _on_queries(effects: torch.Tensor, n_layers: int, first: int, T: int) -> torch.Tensor:
    """(L * H, N, Q) exact effects over queries first..T-2 -> (N, L, H, T) float32, zero at the other queries."""
    LH, N, Q = effects.shape
    out = torch.zeros(N, LH, T)
    out[..., first : first + Q] = effects.permute(1, 0, 2).float()
    return out.view(N, n_layers, LH // n_layers, T)


def dormant_heads(
    model: SinkModel,
    tokens,
    *,
    sink_positions=(0,),
    eps: float = SINK_EPS,
    quantile: float = DORMANT_QUANTILE,
    layers: Sequence[int] | None = None,
    active: torch.Tensor | None = None,
    mean_ablation: bool = True,
    exact: bool = False,
    batch_size: int | None = None,
    progress: bool = False,
    kind: str | None = None,
) -> DormantHeads:
    """Per head and query: attention on the sink, the head's output norm and its effect on the loss.

    Cost: one forward and one backward pass over the tokens (the backward keeps one batch's activations), plus the
    means' pass with ``mean_ablation``.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``load_model``; a reference model of ``analysis.train``).
    tokens : torch.Tensor, shape (N, T)
        Token ids, T >= max(sink_positions) + 3.
    sink_positions : sequence of int, or torch.Tensor of shape (N, T)
        0-based key positions whose attention counts as the sink (default the first token), or a bool mask of sink
        keys per sequence (statistics then start at query 1).
    eps : float
        A query sinks when more than eps of its attention goes to the sink (the sink metric's 0.3).
    quantile : float
        A query is quiet (inert) when its output norm (|effect|) lies below this quantile of the head's.
    layers : sequence of int, optional
        Attention layers (true indices) to measure; None: all.
    active : torch.Tensor, shape (N, T), optional
        bool, queries known to need a head (``copy_queries`` for the synthetic task).
    mean_ablation : bool
        Also estimate the loss effect of setting the head's output to its mean output (``effect_mean``); costs one
        streamed forward pass for the means (stopping after the last layer measured, no unembedding).
    exact : bool
        Replace the gradient x activation estimates by exact removal (:func:`removal_effects`) for every head: one pass
        per head (two with ``mean_ablation``) over N x (Q + 1) rows, Q the measured queries. Only for small models:
        gradient x activation misses effects where the model is certain of its prediction (the gradient vanishes), e.g.
        the copy positions of the synthetic task.
    batch_size : int, optional
        Sequences per forward + backward (default about 256 tokens: see ``grad_batch_size``).
    progress : bool
        Show a progress bar.
    kind : str, optional
        The input kind, a label ("natural", "random").

    Returns
    -------
    DormantHeads
        Tensors of shape (N, L, H, T) and the per-head table.
    """
    tokens = check_tokens(model, tokens, minimum=3, why="Dormant heads need a sink, a query and a token to predict.")
    N, T = tokens.shape
    eps, quantile = check_eps(eps), check_quantile(quantile)
    sinks = check_sink_positions(sink_positions, tokens)
    layers = check_attention_layers(model, layers=layers)
    if not layers:
        raise ModelContractError("this model has no attention layers to measure.")
    if active is not None:
        active = torch.as_tensor(active).bool().cpu()
        if tuple(active.shape) != (N, T):
            raise ValueError(f"active must be an (N, T) bool mask like the tokens {(N, T)}; got {tuple(active.shape)}.")
    remote = isinstance(model, NnsightModel)  # its traces read W_O and run the backward where the model runs
    if remote and exact:
        raise NnsightUnsupported(
            "exact removal effects rerun the model once per head: give exact=False through nnsight."
        )
    first = first_query(sinks, eps=eps)
    if first > T - 2:
        raise ValueError(
            f"T={T} is too short for these sinks and eps = {eps:g}: the statistics use queries {first}..T-2 "
            f"(0-based: those that see more than k / eps keys, before the last token); give T >= {first + 2}."
        )
    z_mean = head_means(model, tokens, layers, first=first, batch_size=batch_size) if mean_ablation else None
    if remote:  # requests cut under NDIF's size limit by the five (B, H, T) statistics a layer returns
        req = plan_requests(N, layers, per=5 * model_dims(model).n_heads * T * 4)
        batch_size = min(batch_size or req.samples, req.samples)  # NDIF's limit, not this machine's memory
        grad_batch = lambda tk, sel: _remote_grad_batch(model, tk, sel, layers, z_mean, req.layer_groups)  # noqa: E731
    else:
        grams = output_grams(model, layers)
        raw = all(f"blocks.{l}.attn.hook_raw_pattern" in hook_names(model) for l in layers)
        grad_batch = lambda tk, sel: _grad_batch(model, tk, _BatchHooks(layers, grams, sel, raw, z_mean))  # noqa: E731
    full = _forward_backward(tokens, sinks, grad_batch, batch_size=batch_size, progress=progress)
    slot = full.get("slot")
    if exact:
        full.update(_exact_effects(model, tokens, layers, z_mean, first=first, progress=progress))
    if slot is not None and float(slot[..., first : T - 1].abs().max()) <= 1e-4:
        slot = None  # every row sums to one: no extra slot
    return DormantHeads(
        layers=layers,
        sink_attn=full["sink"],
        out_norm=full["norm"],
        effect=full["effect"],
        sink_positions=sinks,
        eps=eps,
        quantile=quantile,
        effect_mean=full.get("effect_mean"),
        z_mean=z_mean,
        slot=slot,
        mass=full.get("mass"),
        active=active,
        model_name=getattr(model, "model_name", None),
        kind=kind,
        skipped=skipped_note(model),
        effect_method="exact" if exact else "gradient",
    )


def _forward_backward(tokens: torch.Tensor, sinks, grad_batch, *, batch_size: int | None, progress: bool) -> dict:
    """The per-head statistics of every batch (``grad_batch(tokens, sinks)``: one forward and one backward pass each,
    :func:`_grad_batch` or :func:`_remote_grad_batch`), joined over the sequences; ``sinks`` a mask of sink keys per
    sequence is cut to each batch's rows."""
    N, T = tokens.shape
    bs = batch_size or grad_batch_size(T)
    chunks: dict[str, list[torch.Tensor]] = {}
    from tqdm.auto import tqdm  # lazy: import time

    it = tqdm(batches(tokens, bs), total=-(-N // bs), desc="forward + backward", leave=False, disable=not progress)
    start = 0
    for tk in it:
        sel = sinks if not isinstance(sinks, torch.Tensor) else sinks[start : start + tk.shape[0]]
        got = grad_batch(tk, sel)
        for k, v in got.items():
            chunks.setdefault(k, []).append(v)
        start += tk.shape[0]
    full = {k: torch.cat(v) for k, v in chunks.items()}
    if "sink" not in full or "norm" not in full:
        raise ModelContractError(
            "the attention-pattern or hook_z hooks did not fire; load the model with `load_model`."
        )
    return full


def _exact_effects(
    model: SinkModel,
    tokens: torch.Tensor,
    layers: list[int],
    z_mean: torch.Tensor | None,
    *,
    first: int,
    progress: bool,
) -> dict[str, torch.Tensor]:
    """``effect`` (and ``effect_mean`` given the heads' means) by exact removal of every head, on the statistics'
    queries ``first``..T-2."""
    T = tokens.shape[1]
    heads = [(l, h) for l in layers for h in range(model_dims(model).n_heads)]
    kw = {"queries": list(range(first, T - 1)), "first": first, "progress": progress}
    out = {"effect": _on_queries(removal_effects(model, tokens, heads, **kw), len(layers), first, T)}
    if z_mean is not None:
        out["effect_mean"] = _on_queries(
            removal_effects(model, tokens, heads, values=z_mean.flatten(0, 1), **kw), len(layers), first, T
        )
    return out


__all__ = ["dormant_heads", "output_grams", "grad_batch_size"]


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, Section, register  # noqa: E402


register(
    Analysis(
        "dormant",
        result=DormantHeads,
        order=220,
        doc="What a sink does for its head (its own forward + backward pass: gradients the profile's pass cannot give).",
        sections=(
            Section(
                "What a sink does for its head", "dormant", 90, needs=(), runner="analysis.report.sections:_dormant"
            ),
        ),
        exports=("dormant_heads",),
    )
)
