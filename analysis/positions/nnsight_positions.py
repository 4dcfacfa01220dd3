"""Every sink position through nnsight (``load_model(name, backend="nnsight")``, locally or on NDIF): the same
``SinkPositions`` as ``analysis.positions.every_sink.sink_positions`` (``tests/engine/test_nnsight.py`` checks it against the
bridge's on tiny families).

The traces (``analysis.engine.nnsight_pass.trace_batch`` with ``positions=True``) save alpha of every key (k_max = T)
per head, each layer's massive-activation statistics and, per layer and position, the cosine of h_t to h_0 and the
peak |h_t| and its dim (``analysis.engine.remote_reductions.position_stats``, on the decoder layers' outputs, the
bridge's ``hook_resid_post``): O(layers x (heads + 1) x T) numbers a sequence, never the residual stream itself.
"""

from __future__ import annotations

import torch

from analysis.model.nnsight_model import NnsightModel
from analysis.chain.nnsight_tables import StatsMassive, check_nnsight_tokens, run_traces, skipped_text
from analysis.core.defaults import SECONDARY_COS, SINK_EPS, SPIKE_ABS, SPIKE_RATIO
from analysis.model.hooks import token_strings
from analysis.positions.every_sink import PositionAccumulator, SinkPositions, check_cos, check_min_queries
from analysis.sinks.metric import check_eps


class _StatsPositions(PositionAccumulator):
    """``PositionAccumulator`` fed the statistics a trace saved (``remote_reductions.position_stats``) instead of the
    residual stream."""

    def update_stats(self, layer: int, s: dict) -> None:
        self.cos.put(layer, s["cos"])
        self.peak.put(layer, s["peak"])
        self.dim.put(layer, s["dim"].long())


def nnsight_sink_positions(
    model: NnsightModel,
    tokens,
    *,
    eps: float = SINK_EPS,
    min_queries: int | None = None,
    cos_min: float = SECONDARY_COS,
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    batch_size: int | None = None,
    kind: str | None = None,
    remote=None,
) -> SinkPositions:
    """``sink_positions`` through nnsight: every sink position of ``model`` on ``tokens`` and what its hidden state
    carries.

    Parameters
    ----------
    model : analysis.model.nnsight_model.NnsightModel
    tokens : torch.Tensor, shape (N, T) or (T,)
        Token ids, T >= 2.
    eps, min_queries, cos_min, abs_threshold, ratio_threshold, kind
        As in ``analysis.positions.every_sink.sink_positions``.
    batch_size : int, optional
        Sequences per trace; None: as many as keep a request under NDIF's size limit.
    remote : bool or str, optional
        nnsight's ``remote`` (True: NDIF); None: ``model.remote``.

    Returns
    -------
    SinkPositions
        alpha of shape (N, L, H, T); ``meta["path"]`` is "nnsight".
    """
    eps, cos_min = check_eps(eps), check_cos(cos_min)
    tokens = torch.as_tensor(tokens)
    tokens = check_nnsight_tokens(model, tokens[None] if tokens.ndim == 1 else tokens)
    T = int(tokens.shape[1])
    min_queries = check_min_queries(min_queries, T)
    spec = model.spec
    resid_layers = list(range(spec.n_layers))
    massive = StatsMassive(
        model, resid_layers, spec.d_model, abs_threshold=abs_threshold, ratio_threshold=ratio_threshold, kind=kind
    )
    positions = _StatsPositions(resid_layers)
    alpha, meta = run_traces(
        model,
        tokens,
        sink_layers=list(spec.attention_layers),
        massive=massive,
        k_max=T,
        top_k=3,
        abs_threshold=abs_threshold,
        batch_size=batch_size,
        remote=model.remote if remote is None else remote,
        positions=positions,
    )
    ma, pos = massive.result(), positions.result()
    ids = sorted(set(tokens.flatten().tolist()))
    return SinkPositions(
        alpha=alpha,
        tokens=tokens.long().cpu(),
        cos_first=pos.cos_first,
        peak_abs=pos.peak_abs,
        peak_dim=pos.peak_dim,
        median=ma.median,
        flagged=ma.flagged,
        token_text=dict(zip(ids, token_strings(model, ids))),
        eps=eps,
        min_queries=min_queries,
        cos_min=cos_min,
        abs_threshold=float(abs_threshold),
        ratio_threshold=float(ratio_threshold),
        layers=list(spec.attention_layers),
        resid_layers=resid_layers,
        skipped=skipped_text(spec),
        model_name=model.model_name,
        kind=kind,
        meta=meta,
    )
