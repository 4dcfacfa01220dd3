"""First-token statistics of a model, computed by small hook reducers on the package's streamed pass
(``analysis.engine.passes.run_with_reducers``: no full activation cache).

- ``sink_rate``: Sink_k^eps through the package's sink metric (``analysis.sinks.metric.sink_metric``).
- ``first_token_stats``: per layer, the first token's value norm relative to the other tokens'
  (|v_1| / mean_j>1 |v_j|, averaged over key/value heads), the residual-norm ratio
  |h_1| / mean_j |h_j| of ``hook_resid_post``, and the raw attention mass on the first token (for
  sigmoid attention: the sigmoid scores themselves, before any proxy normalisation), and the first
  token's spike ratio max_d |h_1d| / median |h| (median over the sample's positions x dims, as in
  Sun et al.; the full analysis is ``analysis.chain.massive``).
- ``slot_sink_rate``: Sink on the extra slot of the sink-token and K/KV-bias variants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import torch

from analysis.model.access import attention_operation, attention_window
from analysis.model.contract import SinkModel
from analysis.model.hooks import model_facts
from analysis.core.defaults import SINK_EPS
from analysis.core.docs import parameters_from
from analysis.engine.passes import run_with_reducers
from analysis.model.placement import input_device
from analysis.sinks.metric import sink_metric
from analysis.core.results import MappingResult, Result, compact_repr


_PER_LAYER = ("value_norm_ratio", "resid_norm_ratio", "raw_first_mass", "spike_ratio")  # FirstTokenStats' (L,) fields


@dataclass
class FirstTokenStats(Result):
    """What makes the first token special, per layer L of a reference model (the result protocol: ``tables["layers"]``,
    ``findings()``; ``to_dict()`` keeps the four lists it always had).

    Attributes
    ----------
    value_norm_ratio : torch.Tensor, shape (L,)
        |v_1| / mean_{j>1} |v_j|.
    resid_norm_ratio : torch.Tensor, shape (L,)
        |h_1| / mean_j |h_j| at ``hook_resid_post``.
    raw_first_mass : torch.Tensor, shape (L,)
        The mean over heads and queries i >= 1 of the raw weight on key 1.
    spike_ratio : torch.Tensor, shape (L,)
        The mean over samples of max_d |h_1d| / median |h| at ``hook_resid_post``.
    model_name : str or None
        The model measured.
    n_samples : int
        N, the number of sequences.
    kind : str or None
        The input kind.
    """

    value_norm_ratio: torch.Tensor  # (L,) |v_1| / mean_{j>1} |v_j|
    resid_norm_ratio: torch.Tensor  # (L,) |h_1| / mean_j |h_j| at hook_resid_post
    raw_first_mass: torch.Tensor  # (L,) mean over heads and queries i >= 1 of the raw weight on key 1
    spike_ratio: torch.Tensor  # (L,) mean over samples of max_d |h_1d| / median |h| at hook_resid_post
    model_name: str | None = None
    n_samples: int = 0
    kind: str | None = None

    __repr__ = compact_repr  # shapes, never tensor values

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        per_layer = {k: getattr(self, k).tolist() for k in _PER_LAYER}
        return {"layers": pd.DataFrame({"layer": range(len(self.spike_ratio)), **per_layer})}

    def findings(self) -> list[str]:
        v, s = self.value_norm_ratio, self.spike_ratio
        return [
            f"Over {len(s)} layer{'s' if len(s) > 1 else ''} the first token's value norm is {float(v.min()):.2f}-{float(v.max()):.2f}x "
            f"the other tokens' (mean {float(v.mean()):.2f}x), and its residual norm at the last layer "
            f"{float(self.resid_norm_ratio[-1]):.2f}x the mean.",
            f"It gets a raw attention mass of {float(self.raw_first_mass.mean()):.3f} on average, and its largest "
            f"activation reaches {float(s.max()):.1f}x the median |h| (layer {int(s.argmax())}).",
        ]

    def to_dict(self) -> dict:
        return {**super().to_dict(), **{k: [round(float(x), 5) for x in getattr(self, k)] for k in _PER_LAYER}}


@torch.no_grad()
def first_token_stats(model: SinkModel, tokens: torch.Tensor, *, batch_size: int = 64) -> FirstTokenStats:
    """Value-norm ratio, residual-norm ratio and raw first-token mass per layer (see module doc).

    Parameters
    ----------
    model : SinkLM
        A reference model (or any model with TransformerLens hook names).
    tokens : torch.Tensor, shape (N, T)
        Token ids.
    batch_size : int

    Returns
    -------
    FirstTokenStats
    """
    L = model_facts(model).dims.n_layers
    acc = {k: torch.zeros(L, dtype=torch.float64) for k in ("v", "h", "raw", "spike")}

    def reducer(kind, layer):
        def fn(x, hook):
            x = x.float()
            if kind == "v":  # (B, T, Hkv, d)
                norms = x.norm(dim=-1)  # (B, T, Hkv)
                r = norms[:, 0] / norms[:, 1:].mean(1).clamp_min(1e-12)
            elif kind == "h":  # (B, T, D)
                norms = x.norm(dim=-1)
                r = norms[:, 0] / norms.mean(1).clamp_min(1e-12)
                a = x.abs()
                spike = a[:, 0].amax(-1) / a.flatten(1).median(-1).values.clamp_min(1e-12)
                acc["spike"][layer] += spike.sum().double().cpu()
            else:  # raw pattern (B, H, T, T): weight on key 0 from every query
                r = x[:, :, :, 0]
            acc[kind][layer] += r.reshape(r.shape[0], -1).mean(1).sum().double().cpu()

        return fn

    hooks = []
    for l in range(L):
        hooks += [
            (f"blocks.{l}.attn.hook_v", reducer("v", l)),
            (f"blocks.{l}.hook_resid_post", reducer("h", l)),
            (f"blocks.{l}.attn.hook_raw_pattern", reducer("raw", l)),
        ]
    was_training = model.training
    model.eval()
    try:
        run_with_reducers(model, tokens, hooks, batch_size=batch_size, stop_after=f"blocks.{L - 1}.hook_resid_post")
    finally:
        model.train(was_training)
    return FirstTokenStats(
        *(acc[k].float() / tokens.shape[0] for k in ("v", "h", "raw", "spike")),
        model_name=getattr(model, "model_name", None),
        n_samples=tokens.shape[0],
    )


@parameters_from(first_token_stats)
@torch.no_grad()
def sink_rate(model: SinkModel, tokens: torch.Tensor, *, k: int = 1, eps: float = SINK_EPS) -> float:
    """Sink_k^eps (percent) on ``tokens`` through ``analysis.sinks.metric.sink_metric`` (reads ``hook_pattern``).

    Parameters
    ----------
    model, tokens
        As in :func:`first_token_stats`.
    k : int
        The key position.
    eps : float

    Returns
    -------
    float
    """
    was_training = model.training
    model.eval()
    try:
        return float(sink_metric(model, tokens.to(input_device(model)), eps=eps, k_max=k).sink_rate(k=k))
    finally:
        model.train(was_training)


@parameters_from(first_token_stats)
@torch.no_grad()
def slot_sink_rate(model: SinkModel, tokens: torch.Tensor, *, eps: float = SINK_EPS, batch_size: int = 64) -> float:
    """Sink on the extra slot (sink token, K or KV biases): 100 x share of (sample, layer, head) whose
    mean slot weight over all queries exceeds eps. Raises ValueError for models without a slot.

    Parameters
    ----------
    model, tokens
        As in :func:`first_token_stats`.
    eps : float
    batch_size : int

    Returns
    -------
    float
    """
    L = model_facts(model).dims.n_layers
    names = [f"blocks.{l}.attn.hook_sink_pattern" for l in range(L)]
    if names[0] not in model.hook_dict:
        raise ValueError(
            f"attention={attention_operation(model)!r} has no extra slot (only sink-token, kv-bias, k-bias)."
        )
    hits, count = 0.0, 0

    def fn(x, hook):  # (B, H, T)
        nonlocal hits, count
        alpha = x.float().mean(-1)
        hits += float((alpha > eps).sum())
        count += alpha.numel()

    run_with_reducers(model, tokens, [(n, fn) for n in names], batch_size=batch_size, stop_after=names[-1])
    return 100.0 * hits / count


class _ThresholdResult(MappingResult):  # a MappingResult that keeps the sink threshold eps it was measured at
    def __init__(self, values: dict, *, eps: float = SINK_EPS, **header):
        super().__init__(values, **header)
        self.eps = eps


class WindowSinkRates(_ThresholdResult):
    """Where the sink sits in a sliding-window model (:func:`window_sink_rates`): the dict ``sink_1_in_window``,
    ``sink_window_start`` (percent), as before, that keeps the result protocol.

    Attributes
    ----------
    kind, model_name, n_samples
        The header (:class:`analysis.core.results.MappingResult`).
    eps : float
        The sink threshold.
    tables : dict of str to pandas.DataFrame
        ``values`` (name, value).
    """

    def findings(self) -> list[str]:
        start = self["sink_window_start"]
        return [
            f"Sink_1 (eps {self.eps:g}) over the queries that still see the first token is "
            f"{self['sink_1_in_window']:.1f}%; "
            + (
                "no query lies beyond the window."
                if math.isnan(start)
                else f"on the oldest key of each later query's window it is {start:.1f}% (Gu et al.: the sink stays on "
                "the absolute first token)."
            )
        ]


@parameters_from(slot_sink_rate)
@torch.no_grad()
def window_sink_rates(
    model: SinkModel, tokens: torch.Tensor, *, eps: float = SINK_EPS, batch_size: int = 64
) -> WindowSinkRates:
    """Sliding-window models (``sliding_window = w``): where the sink sits when the first token leaves the window.

    ``sink_1_in_window``: Sink on key 1 over the queries that still see it (i < w, 0-based), so that the
    window does not dilute alpha_1 with queries that cannot attend to it; ``sink_window_start``: Sink on the
    oldest key of each query's window (the *relative* first token, key i - w + 1) over the queries i >= w.
    Gu et al.: the sink stays on the absolute first token.

    Parameters
    ----------
    model, tokens, eps, batch_size
        As in :func:`slot_sink_rate`.

    Returns
    -------
    WindowSinkRates
        A dict, ``sink_1_in_window`` and ``sink_window_start`` (%), with the result protocol.
    """
    w = attention_window(model)
    if w is None:
        raise ValueError("window_sink_rates needs a model with a sliding window (cfg.sliding_window).")
    hits = {"in": 0.0, "start": 0.0}
    count = {"in": 0, "start": 0}

    def fn(x, hook):  # (B, H, T, T)
        T = x.shape[-1]
        a_in = x[:, :, : min(w, T), 0].float().mean(-1)  # (B, H)
        hits["in"] += float((a_in > eps).sum())
        count["in"] += a_in.numel()
        if T > w:
            i = torch.arange(w, T, device=x.device)
            a_start = x[:, :, i, i - w + 1].float().mean(-1)
            hits["start"] += float((a_start > eps).sum())
            count["start"] += a_start.numel()

    names = [f"blocks.{l}.attn.hook_pattern" for l in range(model_facts(model).dims.n_layers)]
    run_with_reducers(model, tokens, [(n, fn) for n in names], batch_size=batch_size, stop_after=names[-1])
    rates = {
        "sink_1_in_window": 100.0 * hits["in"] / max(count["in"], 1),
        "sink_window_start": 100.0 * hits["start"] / count["start"] if count["start"] else float("nan"),
    }
    return WindowSinkRates(rates, eps=eps, model_name=getattr(model, "model_name", None), n_samples=len(tokens))
