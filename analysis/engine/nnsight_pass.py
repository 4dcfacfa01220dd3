"""The sink and massive-activation statistics from nnsight traces, locally or on NDIF (``remote=True``): the same
trace either way, one flag apart.

Per batch of sequences one trace runs the model; in it, each attention layer's call to the attention function hands
over q and k (after the rotary), the mask and the scale, and ``analysis.engine.remote_reductions.attention_alpha``
reduces them to alpha (B, H, k_max); each decoder layer's output (the residual stream after the block, the bridge's
``hook_resid_post``) is reduced by ``resid_stats`` (and, for the sinks at every position, ``position_stats``). Only those are saved: never q, k or a T x T map. The functions
called in the trace come from ``remote_reductions`` and ``analysis.core.reductions``, registered with nnsight to be
shipped by value (they import only torch, math and typing, which NDIF allows).

A request's payload is about ``request_bytes``; :func:`plan_requests` cuts the samples (and, where one sample is too
big, the layers) so each request stays under the size limit NDIF's messages were seen to drop results above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from analysis.model.nnsight_model import NnsightModel
from analysis.engine import remote_reductions
from analysis.engine.remote_reductions import attention_alpha, position_stats, resid_stats
from analysis.core import reductions

REQUEST_LIMIT_BYTES = 32 * 2**20  # NDIF drops results above about this (a 32 MB message limit was seen)
REQUEST_FILL = 0.8  # plan requests to this share of the limit (the pickled containers add a little)
CAND_ROWS_PER_SAMPLE = 64  # flag candidates (|x| > the absolute threshold) budgeted per sample and layer


@dataclass
class RequestPlan:
    """How a table is cut into requests.

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


def layer_bytes(
    *, n_heads: int, k_max: int, d_model: int, top_k: int, sink: bool, massive: bool, positions: int = 0
) -> int:
    """Bytes one sample adds to one layer's saved statistics (alpha float32; massive: top-k row float32, the first
    token's three float64 sums, which do not grow with the samples, are counted in :func:`request_bytes`; positions:
    ``position_stats``' cosine, peak and dim, 12 bytes a position).

    Parameters
    ----------
    n_heads, k_max, d_model, top_k : int
    sink, massive : bool
    positions : int
        The positions whose ``position_stats`` are saved (0: none).

    Returns
    -------
    int
    """
    return (
        (4 * n_heads * k_max if sink else 0)
        + ((4 * (3 * top_k + 1) + 24 * CAND_ROWS_PER_SAMPLE) if massive else 0)
        + 12 * int(positions)
    )


def request_bytes(
    samples: int,
    layers: int,
    *,
    n_heads: int,
    k_max: int,
    d_model: int,
    top_k: int = 3,
    sink: bool = True,
    massive: bool = True,
    positions: int = 0,
) -> int:
    """The bytes a request of ``samples`` sequences over ``layers`` layers saves (an upper bound: the flag
    candidates budgeted at ``CAND_ROWS_PER_SAMPLE``).

    Parameters
    ----------
    samples, layers, n_heads, k_max, d_model, top_k : int
    sink, massive : bool
    positions : int
        As in :func:`layer_bytes`.

    Returns
    -------
    int
    """
    per = layer_bytes(
        n_heads=n_heads, k_max=k_max, d_model=d_model, top_k=top_k, sink=sink, massive=massive, positions=positions
    )
    fixed = 3 * 8 * d_model if massive else 0  # first_sum, first_abs, other_max: (D,) float64 per layer
    return layers * (samples * per + fixed)


def plan_requests(
    n: int,
    layers: list[int],
    *,
    n_heads: int,
    k_max: int,
    d_model: int,
    top_k: int = 3,
    sink: bool = True,
    massive: bool = True,
    positions: int = 0,
    limit: int = REQUEST_LIMIT_BYTES,
) -> RequestPlan:
    """Cut N sequences over ``layers`` into requests each under ``limit`` bytes, fewest requests first: layers in
    groups of g (each group one trace per batch of samples) and as many samples per request as fit beside the
    group's per-layer sums, for the g that needs fewest requests.

    Parameters
    ----------
    n : int
        Sequences.
    layers : list of int
    n_heads, k_max, d_model, top_k : int
    sink, massive : bool
    positions : int
        As in :func:`layer_bytes`.
    limit : int
        The size limit of one request's results.

    Returns
    -------
    RequestPlan
    """
    budget = int(limit * REQUEST_FILL)
    kw = dict(
        n_heads=n_heads, k_max=k_max, d_model=d_model, top_k=top_k, sink=sink, massive=massive, positions=positions
    )
    fixed, per = request_bytes(0, 1, **kw), request_bytes(1, 1, **kw) - request_bytes(0, 1, **kw)
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
    return RequestPlan(
        n_req,
        samples,
        groups,
        request_bytes(samples, g, **kw),
        math.ceil(n / samples) * sum(request_bytes(0, len(gr), **kw) for gr in groups)
        + sum(request_bytes(n, len(gr), **kw) - request_bytes(0, len(gr), **kw) for gr in groups),
    )


def register_shipped() -> None:
    """Have nnsight ship the trace's reductions by value (NDIF does not have this package installed).

    Returns
    -------
    None
    """
    import nnsight  # optional: the "remote" extra

    for module in (reductions, remote_reductions):
        nnsight.register(module)


def trace_batch(
    model: NnsightModel,
    tokens: torch.Tensor,
    *,
    k_max: int,
    sink_layers: list[int],
    massive_layers: list[int],
    top_k: int = 3,
    abs_threshold: float = 100.0,
    positions: bool = False,
    remote=False,
) -> tuple[list, list]:
    """One nnsight trace over a batch: alpha (B, H, k_max) of each layer in ``sink_layers`` and ``resid_stats`` of
    each layer in ``massive_layers`` (with ``position_stats`` where ``positions``), computed next to the model and
    saved; nothing else comes back.

    Parameters
    ----------
    model : analysis.model.nnsight_model.NnsightModel
    tokens : torch.Tensor, shape (B, T)
    k_max : int
    sink_layers, massive_layers : list of int
        True layer indices.
    top_k : int
    abs_threshold : float
    positions : bool
        Add each massive layer's ``position_stats`` (cosine to the first token, peak |x| and dim per position).
    remote : bool or str
        nnsight's ``remote``: False (here), True (NDIF), "local" (nnsight's local simulation of a remote run:
        serialized and run with this package hidden).

    Returns
    -------
    alphas : list of torch.Tensor
        (B, H, k_max) per sink layer, on the CPU.
    resid : list of dict
        ``resid_stats`` (and ``position_stats``) per massive layer, on the CPU.
    """
    import nnsight  # optional: the "remote" extra

    if remote:
        register_shipped()
    calls = {l: model.attention_call(l) for l in sink_layers}
    blocks = model.decoder_layers()
    alpha_fn, resid_fn, pos_fn, softcap = attention_alpha, resid_stats, position_stats, model.spec.softcap
    sink_set, massive_set = set(sink_layers), set(massive_layers)
    with torch.no_grad(), model.lm.trace({"input_ids": tokens}, remote=remote):  # no_grad: here; NDIF runs without
        alphas, resid = nnsight.save([]), nnsight.save([])
        for l in sorted(sink_set | massive_set):  # in the order the layers run (nnsight's interleaving needs it)
            if l in sink_set:
                args, kwargs = calls[l].inputs
                alphas.append(alpha_fn(args[1], args[2], args[4], kwargs.get("scaling"), k_max, softcap))
            if l in massive_set:
                out = blocks[l].output
                h = out[0] if isinstance(out, tuple) else out
                resid.append({**resid_fn(h, top_k, abs_threshold), **(pos_fn(h) if positions else {})})
    return [a.detach().cpu() for a in alphas], [{k: v.detach().cpu() for k, v in r.items()} for r in resid]
