"""The sink metric and the massive-activation table through nnsight (``load_model(name, backend="nnsight")``), as the
same ``SinkResult`` and ``MassiveActivations`` the bridge gives, to 1e-6 (``tests/engine/test_nnsight.py``).

The traces (``analysis.engine.nnsight_pass.trace_batch``) save per layer and head only: alpha (B, H, k_max) and the
residual stream's top-k, median, first-token sums and flag candidates. Here they are folded into the package's own
accumulators, so the tables, findings and texts are those of the bridge's path. With ``remote=True`` (the model's,
or the argument) the same traces run on NDIF, cut into requests under its size limit (``plan_requests``).
"""

from __future__ import annotations

import logging

import torch

from analysis.chain.massive import MassiveAccumulator, MassiveActivations
from analysis.core.defaults import SINK_EPS, SPIKE_ABS, SPIKE_MIN_SHARE, SPIKE_RATIO
from analysis.engine.nnsight_pass import plan_requests, trace_batch
from analysis.engine.passes import Batch
from analysis.model.hooks import bos_record, validate_token_ids
from analysis.model.nnsight_model import NnsightModel
from analysis.sinks.metric import SinkResult, check_eps, check_k_max

LOG = logging.getLogger(__name__)


class StatsMassive(MassiveAccumulator):
    """``MassiveAccumulator`` fed the statistics a trace saved (``remote_reductions.resid_stats``) instead of the
    residual stream: the same sums, top-k rows and flags."""

    def update_stats(self, layer: int, s: dict, T: int, batch: Batch) -> None:
        i = self.index[layer]
        if i not in self.sums:
            self.sums[i] = torch.zeros(3, self.D, dtype=torch.float64, device=s["first_sum"].device)
            self.counts[i] = torch.zeros(2, self.D, dtype=torch.long, device=s["first_sum"].device)
        self.sums[i][0] += s["first_sum"]
        self.sums[i][1] += s["first_abs"]
        self.sums[i][2] += s["other_max"]
        top = s["top"].float()
        tokens = batch.tokens.to(top.device)
        top_tok = tokens.gather(1, top[:, self.K : 2 * self.K].long()).float()
        self.top.put(layer, torch.cat([top, top_tok], -1))
        c = s["cand"]
        self._flags(i, c[:, 0].long(), c[:, 1].float(), c[:, 2].float(), tokens, batch)


def check_nnsight_tokens(model: NnsightModel, tokens) -> torch.Tensor:
    """Token ids checked against the model's context and vocabulary (``validate_token_ids``), as (N, T) int64.

    Parameters
    ----------
    model : NnsightModel
    tokens : array-like of int

    Returns
    -------
    torch.Tensor
    """
    if not isinstance(model, NnsightModel):
        raise TypeError(f"give a model from load_model(name, backend='nnsight'); got {type(model).__name__}.")
    return validate_token_ids(tokens, model.n_ctx, model.vocab_size)


def nnsight_tables(
    model: NnsightModel,
    tokens,
    *,
    sink: bool = True,
    massive: bool = True,
    eps: float = SINK_EPS,
    k_max: int | None = None,
    top_k: int = 3,
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    min_share: float = SPIKE_MIN_SHARE,
    batch_size: int | None = None,
    kind: str | None = None,
    remote=None,
) -> tuple[SinkResult | None, MassiveActivations | None]:
    """The sink metric and the massive-activation table of ``model`` on ``tokens`` from nnsight traces.

    Parameters
    ----------
    model : analysis.model.nnsight_model.NnsightModel
    tokens : torch.Tensor, shape (N, T)
        Token ids (the BOS only where the probe put it).
    sink, massive : bool
        Which tables.
    eps, k_max
        As in ``analysis.sinks.metric.sink_metric``.
    top_k, abs_threshold, ratio_threshold, min_share
        As in ``analysis.chain.massive.massive_activations`` (the median over the sequence, resid_post).
    batch_size : int, optional
        Sequences per trace; None: as many as keep a request under NDIF's size limit (``plan_requests``).
    kind : str, optional
        The input kind, a label.
    remote : bool or str, optional
        nnsight's ``remote`` (True: NDIF; "local": nnsight's local simulation of it); None: ``model.remote``.

    Returns
    -------
    tuple of (SinkResult or None, MassiveActivations or None)
    """
    tokens = check_nnsight_tokens(model, tokens)
    T = tokens.shape[1]
    eps, k_max = check_eps(eps), check_k_max(k_max, T)
    spec = model.spec
    sink_layers = list(spec.attention_layers) if sink else []
    massive_layers = list(range(spec.n_layers)) if massive else []
    remote = model.remote if remote is None else remote
    acc = (
        StatsMassive(
            model,
            massive_layers,
            spec.d_model,
            top_k=top_k,
            abs_threshold=abs_threshold,
            ratio_threshold=ratio_threshold,
            min_share=min_share,
            kind=kind,
        )
        if massive
        else None
    )
    alpha, meta = run_traces(
        model,
        tokens,
        sink_layers=sink_layers,
        massive=acc,
        k_max=k_max,
        top_k=top_k,
        abs_threshold=abs_threshold,
        batch_size=batch_size,
        remote=remote,
    )
    res = (
        SinkResult(alpha, eps, T, model.model_name, kind, meta=meta, layers=sink_layers, skipped=skipped_text(spec))
        if sink
        else None
    )
    return res, (acc.result() if acc is not None else None)


def skipped_text(spec) -> str:
    """The layers the sink metric leaves out and why, in one sentence ("" when none).

    Parameters
    ----------
    spec : analysis.model.nnsight_model.NnsightSpec

    Returns
    -------
    str
    """
    return "; ".join(f"layer {l}: {why}" for l, why in spec.skipped.items())


def run_traces(
    model: NnsightModel,
    tokens: torch.Tensor,
    *,
    sink_layers: list[int],
    massive,
    k_max: int,
    top_k: int,
    abs_threshold: float,
    batch_size: int | None,
    remote,
    positions=None,
):
    """The traces of :func:`nnsight_tables`, cut into requests by ``plan_requests``: alpha of ``sink_layers``
    returned, every layer's residual statistics fed to ``massive`` (and ``positions``, where given).

    Parameters
    ----------
    model : NnsightModel
    tokens : torch.Tensor, shape (N, T)
        Checked token ids.
    sink_layers : list of int
    massive : StatsMassive or None
        Fed every layer's ``resid_stats``.
    k_max, top_k : int
    abs_threshold : float
    batch_size : int or None
    remote : bool or str
    positions : accumulator, optional
        With ``update_stats(layer, stats)`` and ``end_batch``: fed every layer's ``position_stats``.

    Returns
    -------
    alpha : torch.Tensor or None
        (N, L, H, k_max); None without sink layers.
    meta : dict
        The path, remote, the requests and the BOS record.
    """
    N, T = tokens.shape
    spec = model.spec
    massive_layers = list(range(spec.n_layers)) if massive is not None else []
    plan = plan_requests(
        N,
        sorted(set(sink_layers) | set(massive_layers)),
        n_heads=spec.n_heads,
        k_max=k_max,
        d_model=spec.d_model,
        top_k=top_k,
        sink=bool(sink_layers),
        massive=massive is not None,
        positions=T if positions is not None else 0,
    )
    bs = batch_size or plan.samples
    alphas = []
    for start in range(0, N, bs):
        batch = Batch(tokens[start : start + bs], start)
        per_layer: dict[int, torch.Tensor] = {}
        for group in plan.layer_groups:
            mine = [l for l in massive_layers if l in group]
            a, r = trace_batch(
                model,
                batch.tokens,
                k_max=k_max,
                sink_layers=[l for l in sink_layers if l in group],
                massive_layers=mine,
                top_k=top_k,
                abs_threshold=abs_threshold,
                positions=positions is not None,
                remote=remote,
            )
            per_layer.update(zip([l for l in sink_layers if l in group], a))
            for l, s in zip(mine, r):
                massive.update_stats(l, s, T, batch)
                if positions is not None:
                    positions.update_stats(l, s)
        if sink_layers:
            alphas.append(torch.stack([per_layer[l] for l in sink_layers], 1))
        for acc in (massive, positions):
            if acc is not None:
                acc.end_batch(batch, None)
    meta = {"path": "nnsight", "remote": bool(remote), "requests": plan.n_requests, "bos": bos_record(model, tokens)}
    return (torch.cat(alphas) if alphas else None), meta


def nnsight_sink_metric(model: NnsightModel, tokens, **kwargs) -> SinkResult:
    """``sink_metric`` through nnsight: :func:`nnsight_tables` with the sink table only.

    Parameters
    ----------
    model : analysis.model.nnsight_model.NnsightModel
    tokens : torch.Tensor, shape (N, T)
    **kwargs
        Of :func:`nnsight_tables`.

    Returns
    -------
    SinkResult
    """
    return nnsight_tables(model, tokens, massive=False, **kwargs)[0]


def nnsight_massive(model: NnsightModel, tokens, **kwargs) -> MassiveActivations:
    """``massive_activations`` through nnsight: :func:`nnsight_tables` with the massive table only.

    Parameters
    ----------
    model : analysis.model.nnsight_model.NnsightModel
    tokens : torch.Tensor, shape (N, T)
    **kwargs
        Of :func:`nnsight_tables`.

    Returns
    -------
    MassiveActivations
    """
    return nnsight_tables(model, tokens, sink=False, **kwargs)[1]


def nnsight_sink_payload(
    model_name: str,
    n: int,
    T: int,
    eps: float,
    k_max: int,
    bos: bool,
    seed: int,
    device: str | None,
    *,
    dtype=None,
    remote: bool = False,
    **placement,
) -> dict:
    """``python -m analysis sink --backend nnsight [--remote]``: the payload of ``analysis.__main__.sink_report``
    (the same probes, BOS only with ``bos``), from nnsight traces.

    Parameters
    ----------
    model_name : str
    n, T : int
        Sequences per probe kind and tokens per sequence.
    eps : float
    k_max : int
    bos : bool
    seed : int
    device : str or None
    dtype : str, optional
        "float32" (default), "bfloat16" or "float16".
    remote : bool
        Run on NDIF.
    **placement
        ``load_model``'s device_map / max_memory / offload_folder: refused (one device here; NDIF places its models).

    Returns
    -------
    dict
    """
    from analysis.core.io import parse_dtype  # import time: only the command line needs it
    from analysis.core.versions import package_versions
    from analysis.model.hooks import check_length
    from analysis.model.loading import load_model
    from analysis.model.probes import model_probe_sets

    check_length(T)
    check_eps(eps)
    model = load_model(
        model_name, device=device, dtype=parse_dtype(dtype or "float32"), backend="nnsight", remote=remote, **placement
    )
    probes = model_probe_sets(model, n=n, T=T, bos=bos, seed=seed)
    sink = {
        kind: nnsight_sink_metric(model, probe.tokens, eps=eps, k_max=k_max, kind=kind)
        for kind, probe in probes.items()
    }
    kinds = {
        kind: {"source": probe.source, "tokens": probe.tokens.tolist(), **sink[kind].to_dict()}
        for kind, probe in probes.items()
    }
    return {
        "model": model_name,
        "n": n,
        "T": T,
        "eps": eps,
        "k_max": k_max,
        "bos": bos,
        "seed": seed,
        "dtype": dtype or "float32",
        "backend": "nnsight",
        "remote": remote,
        "device": "NDIF" if remote else str(next(model.hf.parameters()).device),
        "positions": "1-based: Sink_k and per_head_alpha[k - 1] are about key k, k = 1 the first token",
        "sink_1_pct": {k: v["sink_k_pct"][0] for k, v in kinds.items()},
        "inputs": kinds,
        "versions": package_versions(),
    }
