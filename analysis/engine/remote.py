"""A pass through nnsight traces on NDIF (``load_model(name, backend="nnsight", remote=True)``): the accumulators'
own reductions run next to the model, and only what they return comes back to be folded here.

Each accumulator says how a layer's activations reduce (``Accumulator.reduction``: a module-level function of
torch and plain parameters) and how the result folds into its state (``fold``); locally ``update`` is the two
together, so a table computed remotely is the one computed here, by the same operations. In the trace the decoder
layers give the residual stream (``hook_resid_pre`` their input, ``hook_resid_post`` their output) and each
attention layer's call to transformers' attention function gives q, k and v after the rotary, the mask, the scale
and the soft cap (``hook_q``/``hook_k``/``hook_v``, ``hook_pattern`` as :class:`AttentionWeights` with the rows'
log-sum-exp, ``hook_z``; ``hook_k_proj``: ``k_proj``'s output, before them). Nothing T x T, and never q or the
residual stream, leaves the model's side; keys only where asked (the key manifold's first keys, and its scatter's:
each layer's two candidates on the first batch), residual rows likewise (the norm gain's first token and a few others
per sequence).

The reductions ship by value (:func:`register_shipped`: NDIF does not have this package); what they reach must be
torch, numpy, math and typing (``tests/engine/test_nnsight.py`` walks every reduction's closure to check it). A
request's results stay under NDIF's message limit: :func:`plan_requests` cuts samples (and, where one sample is too
big, layers) by the bytes the reductions return, measured on one sample here (:func:`reduction_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from analysis.engine.attention import AttentionWeights
from analysis.model.hooks import model_dims
from analysis.model.nnsight_model import BLOCK_SITES, NnsightModel, NnsightUnsupported, TraceWeight

REQUEST_LIMIT_BYTES = 32 * 2**20  # NDIF drops results above about this (a 32 MB message limit was seen)
REQUEST_FILL = 0.8  # plan requests to this share of the limit (the pickled containers add a little)
CAND_ROWS_PER_SAMPLE = 64  # flag candidates (|x| > the absolute threshold) budgeted per sample and layer
ATTENTION_SITES = ("hook_pattern", "hook_q", "hook_k", "hook_rot_q", "hook_rot_k", "hook_v", "hook_z", "hook_k_proj")
CALL_SITES = frozenset(ATTENTION_SITES[:-1]) | {"z"}  # what the attention function's call gives (and the edit of z)
LAYER_SITES = tuple(s for s in BLOCK_SITES if s not in ("call", "k_in"))  # the layer's other reads (by module)
EDIT_SITES = {"resid_post": "hook_resid_post"}  # an edit's key -> its site


@dataclass
class RequestPlan:
    """How a pass is cut into requests.

    Attributes
    ----------
    n_requests : int
        Requests in all (layer groups x batches of samples).
    samples : int
        Sequences per request.
    layer_groups : list of list of int
        The layers each request of a batch measures.
    bytes_per_request : int
        The most bytes one request saves (an upper bound).
    bytes_total : int
        The bytes every request saves together.
    """

    n_requests: int
    samples: int
    layer_groups: list[list[int]]
    bytes_per_request: int
    bytes_total: int


def plan_requests(n: int, layers: list[int], *, per: int, fixed: int = 0, limit: int = REQUEST_LIMIT_BYTES):
    """Cut N sequences over ``layers`` into requests each under ``limit`` bytes, fewest requests first: layers in
    groups of g (each group one trace per batch of samples) and as many samples per request as fit beside the
    group's per-layer fixed bytes, for the g that needs fewest requests.

    Parameters
    ----------
    n : int
        Sequences.
    layers : list of int
    per : int
        Bytes one sample adds to one layer's results.
    fixed : int
        Bytes a layer's results hold whatever the samples (sums over the batch).
    limit : int
        The size limit of one request's results.

    Returns
    -------
    RequestPlan
    """
    budget = int(limit * REQUEST_FILL)
    if fixed + per > budget:
        raise ValueError(
            f"one sample of one layer saves {fixed + per} bytes, over the {budget}-byte budget of a request."
        )
    best = None
    for g in range(1, len(layers) + 1):
        samples = min(n, (budget // g - fixed) // max(1, per))
        if samples < 1:
            break
        cost = (math.ceil(len(layers) / g) * math.ceil(n / samples), -g)
        best = min(best, (cost, g, samples)) if best else (cost, g, samples)
    (n_req, _), g, samples = best
    groups = [layers[i : i + g] for i in range(0, len(layers), g)]
    batches = math.ceil(n / samples)
    return RequestPlan(n_req, samples, groups, g * (samples * per + fixed), len(layers) * (n * per + batches * fixed))


def stats_bytes(stats) -> int:
    """The bytes of the tensors in a (nested) list / dict / tuple of statistics: what a request sends back.

    Parameters
    ----------
    stats : torch.Tensor, dict, list or tuple

    Returns
    -------
    int
    """
    if isinstance(stats, torch.Tensor):
        return stats.numel() * stats.element_size()
    if isinstance(stats, dict):
        return sum(stats_bytes(v) for v in stats.values())
    return sum(stats_bytes(v) for v in stats) if isinstance(stats, (list, tuple)) else 0


def register_shipped() -> None:
    """Have nnsight ship this package's code by value (NDIF does not have it installed): only what the trace calls
    travels, the reductions and what they reach.

    Returns
    -------
    None
    """
    import nnsight  # optional: the "remote" extra

    import analysis  # cycle: the package's root imports this module

    nnsight.register(analysis)


def pass_plan(model: NnsightModel, accumulators: Sequence) -> list[tuple]:
    """Per layer, in the order the forward runs them: what the trace reads and which reductions it runs.

    Parameters
    ----------
    model : NnsightModel
    accumulators : sequence of Accumulator

    Returns
    -------
    list of tuple
        (layer, attention call name or None, site names read, [(index, Reduction, {key: site})]); NnsightUnsupported,
        before any work, for a site or an accumulator the remote pass cannot serve.
    """
    layers: dict[int, list] = {}
    for j, acc in enumerate(accumulators):
        for layer, names in acc.hooks().items():
            red = acc.reduction(layer)
            if red is None:
                raise NnsightUnsupported(
                    f"{type(acc).__name__} reduces in its own update, which runs here only: it has no reduction a "
                    "remote trace can ship (run it locally, or through the bridge)."
                )
            sites = {k: n.removeprefix(f"blocks.{layer}.").removeprefix("attn.") for k, n in names.items()}
            bad = sorted(n for k, n in names.items() if sites[k] not in CALL_SITES and sites[k] not in LAYER_SITES)
            if bad:
                raise NnsightUnsupported(
                    f"{type(acc).__name__} reads {bad}: a remote trace gives the attention call's "
                    f"{', '.join(ATTENTION_SITES)} and the layer's {', '.join(LAYER_SITES)}."
                )
            for s in set(sites.values()) - CALL_SITES:
                model.site(int(layer), s)  # NnsightUnsupported now where the family's layer has no such module
            layers.setdefault(int(layer), []).append((j, red, sites))
    plan = []
    for layer in sorted(layers):
        sites = {s for _, _, m in layers[layer] for s in m.values()}
        attn = sites & CALL_SITES
        if attn and layer not in model.spec.attention_layers:
            raise NnsightUnsupported(f"layer {layer} has no softmax attention call ({model.spec.skipped.get(layer)}).")
        call = model.attention_call_name(layer) if attn else None
        plan.append((layer, call, frozenset(sites), layers[layer]))
    return plan


def trace_batch(
    model: NnsightModel, tokens: torch.Tensor, plan: list[tuple], *, edits=None, logits=None, remote=None
) -> list:
    """One nnsight trace over a batch: each layer's sites that ``plan`` reads, and those ``edits`` set, in the order
    the forward reaches them (``NnsightModel.site``, nnsight's interleaving needs it); every reduction of ``plan``
    run next to the model on the edited activations and saved; nothing else comes back. The whole model runs.

    Parameters
    ----------
    model : NnsightModel
    tokens : torch.Tensor, shape (B, T)
    plan : list of tuple
        From :func:`pass_plan` (the layers of one request).
    edits : dict of int to dict of str to Reduction, optional
        Per layer, edits shipped like the reductions, each setting a site to what it returns: "k_in" (the key
        projection's input), "z" (the attention call's output, from {"pattern", "v", "z"}), "resid_post" (the
        layer's output), "mlp.hook_post" (the MLP's neurons), or any other site of ``NnsightModel.site`` (of its
        value).
    logits : Reduction, optional
        Of (logits, tokens), run on the output; returned last, as (-1, -1, what it returned).
    remote : bool or str, optional
        nnsight's ``remote``: False (here), True (NDIF), "local" (nnsight's simulation of a remote run: serialized,
        then run with this package hidden); None: ``model.remote``.

    Returns
    -------
    list of (int, int, object)
        (accumulator index, layer, what its reduction returned), on the CPU.
    """
    import nnsight  # optional: the "remote" extra

    remote, edits, jobs = model.remote if remote is None else remote, edits or {}, {p[0]: p for p in plan}
    if remote:
        register_shipped()
    layers = sorted(jobs.keys() | edits.keys())  # in the order the layers run
    edits = {l: {EDIT_SITES.get(k, k): v for k, v in edits.get(l, {}).items()} for l in layers}
    order = {l: _in_order(jobs[l][2] if l in jobs else frozenset(), edits[l]) for l in layers}
    calls = {l: model.attention_call(l) for l in layers if "call" in order[l]}
    where = {(l, n): model.site(l, n) for l in layers for n in order[l] if n != "call"}  # refused before the trace
    with torch.no_grad(), model.lm.trace({"input_ids": tokens}, remote=remote):  # no_grad: here; NDIF runs without
        saved = nnsight.save([])
        for layer in layers:
            _, _, sites, todo = jobs.get(layer, (layer, None, frozenset(), []))
            acts, ed = {}, edits[layer]
            for name in order[layer]:
                if name == "call":
                    acts.update(_attention_acts(model, calls[layer], sites, ed.get("z")))
                else:
                    acts[name] = _site(model, tokens, *where[layer, name], name, ed.get(name))
            for j, red, keys in todo:
                saved.append((j, layer, red.fn({key: acts[s] for key, s in keys.items()}, **_params(model, red))))
        if logits is not None:
            saved.append((-1, -1, logits.fn(model.lm.output.logits, tokens, **_params(model, logits))))
    return [(j, l, _to_cpu(r)) for j, l, r in saved]


def in_trace(model: NnsightModel, layer: int, red) -> object:
    """What ``red`` (a Reduction of weights alone: no activations, its TraceWeights read where the model is) returns,
    run in a trace of one token at ``layer`` (on NDIF: there, so only what it returns comes back).

    Parameters
    ----------
    model : NnsightModel
    layer : int
        The block whose trace site runs it.
    red : Reduction
        Its ``fn`` reads only its parameters (``TraceWeight``s among them).

    Returns
    -------
    object
        What ``red`` returned, on the CPU.
    """
    return trace_batch(model, torch.zeros(1, 1, dtype=torch.long), [(layer, None, frozenset(), [(0, red, {})])])[0][2]


def _in_order(sites, edits: dict) -> list[str]:
    """The sites a layer's trace reads or edits, in the order its forward reaches them (``BLOCK_SITES``), the
    attention call's as one ("call")."""
    return sorted({"call" if s in CALL_SITES else s for s in sites | edits.keys()}, key=list(BLOCK_SITES).index)


def _site(model: NnsightModel, tokens, env, side: str, scale: float, name: str, edit=None):
    """Inside a trace over ``tokens``: a layer's site ``name`` (``NnsightModel.site``: ``env``'s ``side`` times
    ``scale``; the key projection as the bridge's hook, (B, T, H_kv, d_head)), set first to what ``edit`` makes of
    it."""
    got = getattr(env, side)
    x = got[0] if isinstance(got, tuple) else got
    flat = x.dim() == 2  # a module that flattens the tokens (Llama 4's experts): (B * T, d), read as (B, T, d)
    x = x.unflatten(0, (tokens.shape[0], -1)) if flat else x
    x = x * scale if scale != 1.0 else x  # Granite's writes as the bridge's hooks hold them
    if edit is not None:
        x = edit.fn(x, **_params(model, edit))
        y = (x / scale).flatten(0, 1) if flat else x / scale  # as the module gives it (/ 1.0: the same bits)
        setattr(env, side, (y, *got[1:]) if isinstance(got, tuple) else y)
    return x.unflatten(-1, (model.spec.n_kv_heads, -1)) if name == "hook_k_proj" else x


def _attention_acts(model: NnsightModel, call, sites, edit=None) -> dict:
    """Inside a trace: what a layer's call to the attention function gives for ``sites``, in the hooks' layout (q, k,
    v (B, T, heads, d) after the rotary; the pattern as :class:`AttentionWeights` from q, k, the mask and the scale;
    z the call's output, set first to what ``edit`` makes of {"pattern", "v", "z"})."""
    args, kwargs = call.inputs
    q, k, v, mask = args[1], args[2], args[3], args[4]
    scale = kwargs.get("scaling") or q.shape[-1] ** -0.5
    pre = scale / getattr(args[0], "scaling", scale)  # OPT scales q by its module's scale before a call at 1.0: undone
    acts = {"hook_q": q.transpose(1, 2) * pre if pre != 1 else q.transpose(1, 2), "hook_k": k.transpose(1, 2)}
    acts |= {"hook_v": v.transpose(1, 2), "hook_rot_q": acts["hook_q"], "hook_rot_k": acts["hook_k"]}
    if "hook_pattern" in sites or edit is not None:
        extras = dict(softcap=model.spec.softcap, sinks=kwargs.get("s_aux"))  # gpt-oss: a sink logit per head
        acts["hook_pattern"] = AttentionWeights.from_qk(q, k, scale=scale, mask=mask, **extras)
    if "hook_z" in sites or edit is not None:
        res = call.output
        acts["hook_z"] = res[0]
        if edit is not None:
            z = edit.fn({"pattern": acts["hook_pattern"], "v": acts["hook_v"], "z": res[0]}, **_params(model, edit))
            call.output, acts["hook_z"] = (z, *res[1:]), z
    return acts


def _params(model: NnsightModel, red) -> dict:
    """A reduction's parameters, each :class:`TraceWeight` read where the trace runs (also inside a parameter with
    ``with_weights``: the key path's ``KeyOps``)."""
    read = lambda v: model.weight(v) if isinstance(v, TraceWeight) else v  # noqa: E731
    return {k: v.with_weights(read) if hasattr(v, "with_weights") else read(v) for k, v in (red.params or {}).items()}


def grad_trace(model: NnsightModel, tokens: torch.Tensor, jobs: dict, loss, *, remote=None) -> list:
    """One nnsight trace with a backward pass: per layer of ``jobs``, a forward reduction of {"pattern", "z"} (its
    ``hook_pattern`` and ``hook_z``) and, after the backward of ``loss(logits, tokens)``, a backward reduction
    of {"z": hook_z, "grad": dloss/dz}; only what they return comes back. The gradient starts at the first measured
    layer's input (made a leaf that needs it where the weights take none), so no weight needs a gradient.

    Parameters
    ----------
    model : NnsightModel
    tokens : torch.Tensor, shape (B, T)
    jobs : dict of int to (Reduction, Reduction)
        {layer: (forward, backward)}, attention layers.
    loss : callable
        ``loss(logits, tokens)`` -> a scalar: a module-level torch function (it ships).
    remote : bool or str, optional
        nnsight's ``remote``; None: ``model.remote``.

    Returns
    -------
    list of (int, object, object)
        (layer, forward result, backward result), on the CPU, layers ascending.
    """
    import nnsight  # optional: the "remote" extra

    remote = model.remote if remote is None else remote
    if remote:
        register_shipped()
    layers, blocks = sorted(jobs), model.decoder_layers()
    calls = {layer: model.attention_call(layer) for layer in layers}
    with torch.enable_grad(), model.lm.trace({"input_ids": tokens}, remote=remote):
        fwd, bwd, zs = nnsight.save([]), nnsight.save([]), []
        x = blocks[layers[0]].input
        if not x.requires_grad:  # frozen weights: the graph starts here
            x.requires_grad_(True)
        for layer in layers:
            acts = _attention_acts(model, calls[layer], {"hook_pattern", "hook_z"})
            zs.append(acts["hook_z"])
            acts = {"pattern": acts["hook_pattern"], "z": acts["hook_z"]}
            fwd.append(jobs[layer][0].fn(acts, **_params(model, jobs[layer][0])))
        total = loss(model.lm.output.logits, tokens)
        with total.backward():
            for layer, z in reversed(list(zip(layers, zs))):  # gradients arrive last layer first
                bwd.append(jobs[layer][1].fn({"z": z, "grad": z.grad}, **_params(model, jobs[layer][1])))
    return [(layer, _to_cpu(f), _to_cpu(b)) for layer, f, b in zip(layers, fwd, reversed(bwd))]


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return type(x)(_to_cpu(v) for v in x) if isinstance(x, (list, tuple)) else x


def reduction_bytes(model: NnsightModel, tokens: torch.Tensor, plan: list[tuple]) -> tuple[int, int]:
    """The bytes the reductions return per layer: (per sample, fixed), measured here on one and two samples of
    ``tokens`` (the largest layer's), with ``CAND_ROWS_PER_SAMPLE`` flag candidates budgeted where a reduction
    returns them (their count depends on the data).

    Parameters
    ----------
    model : NnsightModel
    tokens : torch.Tensor, shape (N, T)
    plan : list of tuple

    Returns
    -------
    tuple of int
    """
    if model.remote or next(model.hf.parameters()).is_meta:
        return _meta_bytes(model, tokens.shape[1], plan)
    sizes = []
    for b in (1, 2):
        got = trace_batch(model, tokens[:1].expand(b, -1), plan, remote=False)
        per_layer: dict[int, int] = {}
        for _, layer, r in got:
            per_layer[layer] = per_layer.get(layer, 0) + stats_bytes(r) + _candidates(r) * b
        sizes.append(max(per_layer.values(), default=0))
    return max(0, sizes[1] - sizes[0]), max(0, 2 * sizes[0] - sizes[1])


def _candidates(r) -> int:
    """Bytes budgeted for the flag candidates a reduction returned (``flat`` int64, ``vals`` and ``ref`` float32)."""
    return 16 * CAND_ROWS_PER_SAMPLE if isinstance(r, dict) and "flat" in r else 0


def _meta_bytes(model: NnsightModel, T: int, plan: list[tuple]) -> tuple[int, int]:
    """:func:`reduction_bytes` without running the model: each reduction on activations of the model's shapes
    (zeros, on the CPU) for one and two samples."""
    s, d_head, d_mlp = model.spec, model_dims(model).d_head, model.mlp_spec.d_mlp or 1
    sizes = []
    for b in (1, 2):
        q = torch.zeros(b, s.n_heads, T, d_head)
        k = torch.zeros(b, s.n_kv_heads, T, d_head)
        acts = {n: torch.zeros(b, T, s.d_model) for n in LAYER_SITES} | {
            n: torch.zeros(b, T, d_mlp) for n in ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")
        }
        acts |= {n: q.transpose(1, 2) for n in ("hook_q", "hook_rot_q", "hook_z")}
        acts |= {n: k.transpose(1, 2) for n in ("hook_k", "hook_rot_k", "hook_v", "hook_k_proj")}
        acts["hook_pattern"] = AttentionWeights.from_qk(q, k, scale=d_head**-0.5)
        seen: dict = {}  # reductions alike but for the layer of the weights they name return alike: each measured once
        per_layer = []
        for _, _, sites, jobs in plan:
            total = 0
            for _, red, keys in jobs:
                sig = repr((red.fn, _by_kind(red.params), keys))
                if sig not in seen:
                    args = _stand_ins(red.params, s.n_heads, d_head)
                    r = red.fn({key: acts[x] for key, x in keys.items()}, **args)
                    seen[sig] = stats_bytes(r) + _candidates(r) * b
                total += seen[sig]
            per_layer.append(total)
        sizes.append(max(per_layer, default=0))
    return max(0, sizes[1] - sizes[0]), max(0, 2 * sizes[0] - sizes[1])


def _by_kind(params) -> dict:
    """A reduction's parameters with each :class:`TraceWeight` as its name and shape (what its stand-in depends on)."""
    return {k: (v.name, v.shape) if isinstance(v, TraceWeight) else v for k, v in (params or {}).items()}


def _stand_ins(params, n_heads: int, d_head: int) -> dict:
    """A reduction's parameters with each :class:`TraceWeight` as zeros (also inside one with ``with_weights``): of
    its shape where it gives one (the key path's), else W_O's with d_model cut to 1 (what the reduction returns
    depends on neither the values nor d_model), so the dry run of :func:`_meta_bytes` needs no weight."""

    def stand_in(v):
        if not isinstance(v, TraceWeight):
            return v
        return torch.zeros(v.shape) if v.shape else torch.zeros(n_heads, d_head, 1)

    return {
        k: v.with_weights(stand_in) if hasattr(v, "with_weights") else stand_in(v) for k, v in (params or {}).items()
    }


def remote_pass(
    model: NnsightModel,
    tokens: torch.Tensor,
    accumulators: Sequence,
    *,
    make_batch,
    batch_size=None,
    edits=None,
    logits=None,
):
    """Every accumulator fed through nnsight traces of ``model`` (on NDIF where ``model.remote``), each layer's
    reductions run in the trace and folded here, batch by batch.

    Parameters
    ----------
    model : NnsightModel
    tokens : torch.Tensor, shape (N, T)
        Checked token ids.
    accumulators : sequence of Accumulator
        Each with a ``reduction`` for every layer it reads.
    make_batch : callable
        ``make_batch(tokens, offset)``: the pass engine's batch handed to each fold.
    batch_size : int, optional
        Sequences per trace, at most as many as keep a request under NDIF's size limit (:func:`plan_requests`,
        also the default).
    edits : callable, optional
        ``edits(batch)``: :func:`trace_batch`'s edits, made in every trace of the batch.
    logits : callable, optional
        ``logits(batch)``: (a Reduction of (logits, tokens), a function folding what it returned), run in the batch's
        last trace.

    Returns
    -------
    dict
        "requests": the traces run; "bytes": what they sent back.
    """
    plan = pass_plan(model, accumulators)
    N = tokens.shape[0]
    per, fixed = reduction_bytes(model, tokens, plan)
    req = plan_requests(N, [p[0] for p in plan], per=per, fixed=fixed)
    bs = min(batch_size or req.samples, req.samples)  # never a request over the limit
    requests, sent = 0, 0
    for start in range(0, N, bs):
        batch = make_batch(tokens[start : start + bs], start)
        by_layer = {p[0]: p for p in (pass_plan(model, accumulators) if start else plan)}  # a reduction may follow
        for group in req.layer_groups:  # what was folded (the key manifold's scatter heads, chosen on the first batch)
            loss = logits(batch) if logits and group is req.layer_groups[-1] else (None, None)
            todo, ed = [by_layer[l] for l in group], edits(batch) if edits else None
            got = trace_batch(model, batch.tokens, todo, edits=ed, logits=loss[0])
            requests, sent = requests + 1, sent + stats_bytes([r for _, _, r in got])
            for j, layer, r in got:
                if j < 0:  # what logits returned, last
                    loss[1](r)
                else:
                    accumulators[j].fold(layer, r, batch)
        for acc in accumulators:
            acc.end_batch(batch, None)
    return {"requests": requests, "bytes": sent}
