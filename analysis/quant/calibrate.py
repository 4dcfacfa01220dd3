"""Calibration (the per-tensor static scales and where each comes from), scored perplexity, and the prefix search."""

from __future__ import annotations

import math

import torch

from analysis.model.causal import require_model
from analysis.model.contract import SinkModel
from analysis.streaming.backbone import causal_lm
from analysis.quant.passes import PrefixRunner, ScaleSite, Scheme, hooked, quantized_weights
from analysis.quant.quantizers import qmax, quant_activation


class _Keep:
    """The full-precision row mask of the running batch, shared by every hook."""

    mask: torch.Tensor | None = None


def calibrate(
    model: SinkModel, sites, windows: torch.Tensor, *, keep: torch.Tensor | None = None, prefix=None, batch: int = 4
) -> dict[str, ScaleSite]:
    """The largest |input| of every linear over the calibration tokens, rows in ``keep`` (and the prefix) left out.

    Parameters
    ----------
    model : SinkModel
        What ``analysis.load_model`` returns (run through its own causal LM, ``analysis.streaming.backbone.causal_lm``).
    sites : list of LinearSite
        ``linear_sites(model)``.
    windows : torch.Tensor of long, shape (N, T)
    keep : torch.Tensor of bool, shape (N, T), optional
        Tokens kept in full precision, so not calibrated.
    prefix : sequence of int, optional
    batch : int

    Returns
    -------
    dict of str to ScaleSite
        By ``site.label``.
    """
    with causal_lm(model, where="calibrate") as hf:
        runner, state, best = PrefixRunner(hf, prefix), _Keep(), {}
        offset = {"w": 0}

        def record(site):
            def fn(x):
                a = x.detach().flatten(2).abs().float()
                if state.mask is not None:
                    a = a.masked_fill(state.mask[..., None].to(a.device), 0.0)
                if runner.P and not runner.cached:
                    a = a[:, runner.P :]
                v, i = a.flatten().max(0)
                if site.label not in best or float(v) > best[site.label].absmax:
                    b, t, d = (int(j) for j in torch.unravel_index(i, a.shape))
                    w = offset["w"] + b  # the window among all of them
                    best[site.label] = ScaleSite(
                        site.label, site.layer, site.name, float(v), w, t, d, int(windows[w, t])
                    )
                return x

            return fn

        with torch.no_grad(), hooked(sites, record):
            for s in range(0, len(windows), batch):
                offset["w"] = s
                k = None if keep is None else keep[s : s + batch]
                runner.logits(windows[s : s + batch], k, lambda m: setattr(state, "mask", m))
        return best


def mean_nll(
    model: SinkModel,
    sites,
    windows: torch.Tensor,
    scheme: Scheme,
    *,
    scales: dict[str, ScaleSite] | None = None,
    keep: torch.Tensor | None = None,
    prefix=None,
    batch: int = 4,
) -> float:
    """Mean NLL (nats) of tokens 2..T of every window, given the ones before (and the prefix), under ``scheme``.

    Parameters
    ----------
    model, sites, windows, keep, prefix, batch
        As in :func:`calibrate`.
    scheme : Scheme
    scales : dict of str to ScaleSite, optional
        The per-tensor static scales (``scheme.granularity == "tensor"``).

    Returns
    -------
    float
    """
    with causal_lm(model, where="mean_nll") as hf:
        runner, state = PrefixRunner(hf, prefix), _Keep()
        static = scheme.a_bits is not None and scheme.granularity == "tensor"
        if static and scales is None:
            raise ValueError("a per-tensor static scheme needs the calibrated scales (calibrate(...)).")

        def quant(site):
            s = scales[site.label].absmax / qmax(scheme.a_bits) if static else None
            return lambda x: quant_activation(x, scheme.a_bits, s, state.mask)

        total, n = 0.0, 0
        ctx = hooked(sites, quant) if scheme.a_bits else hooked([], quant)
        with torch.no_grad(), quantized_weights(sites, scheme.w_bits), ctx:
            for s in range(0, len(windows), batch):
                ids = windows[s : s + batch]
                k = None if keep is None else keep[s : s + batch]
                logits = runner.logits(ids, k, lambda m: setattr(state, "mask", m))
                nll = torch.nn.functional.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum"
                )
                total, n = total + float(nll), n + ids[:, 1:].numel()
        return total / n


def _scale_cost(scales: dict[str, ScaleSite]) -> float:
    """Mean log max |input| over the linears: what a prefix search lowers (the static scales' size)."""
    return sum(math.log(max(s.absmax, 1e-12)) for s in scales.values()) / max(len(scales), 1)


def find_prefix(
    model: SinkModel, sites, windows: torch.Tensor, candidates, length: int
) -> tuple[list[int], list[float]]:
    """Greedy search (CushionCache's, on PrefixQuant's candidate outlier tokens) for a prefix of up to ``length``
    tokens that takes the massive activations: each step appends the candidate that most lowers the calibrated
    scales of the tokens after it; stops early when none lowers them.

    Parameters
    ----------
    model, sites, windows
        As in :func:`calibrate`.
    candidates : sequence of int
        Token ids to try.
    length : int

    Returns
    -------
    prefix : list of int
    costs : list of float
        ``_scale_cost`` with no prefix, then after each step taken.
    """
    require_model(model, "find_prefix")
    prefix, costs = [], [_scale_cost(calibrate(model, sites, windows))]
    for _ in range(length):
        tried = {c: _scale_cost(calibrate(model, sites, windows, prefix=prefix + [c])) for c in candidates}
        c, cost = min(tried.items(), key=lambda kv: kv[1])
        if cost >= costs[-1]:
            break
        prefix, costs = prefix + [int(c)], costs + [cost]
    return prefix, costs
