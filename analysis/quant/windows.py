"""Held-out and calibration windows: disjoint windows of one text stream (a model with a tokenizer: the offline
docstring corpus) or independent sequences of a reference model's own synthetic task (BOS first, as it trained)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from analysis.model.causal import require_model
from analysis.model.contract import SinkModel, hf_module
from analysis.streaming.corpus import stdlib_stream


@dataclass
class Windows:
    """Evaluation and calibration windows.

    Attributes
    ----------
    eval : torch.Tensor of long, shape (N_eval, T)
        Held-out windows (the same for every calibration seed).
    calib : torch.Tensor of long, shape (N_calib, T)
        Calibration windows, drawn with ``seed`` from windows disjoint from ``eval``.
    source : str
        Where the text comes from.
    seed : int
    """

    eval: torch.Tensor
    calib: torch.Tensor
    source: str
    seed: int


def _task_windows(sink_lm, n: int, T: int, seed: int) -> torch.Tensor:
    from dataclasses import replace

    # lazy for import time: the reference model's data module is only needed for reference models
    from analysis.model.reference.config import TrainConfig
    from analysis.model.reference.data import build_data

    train = (getattr(sink_lm, "reference_config", None) or {}).get("train") or {}
    if train.get("dataset") not in ("synthetic", "synthetic-docs"):
        raise ValueError(
            "this reference model has no synthetic training task to draw windows from; use a model with a tokenizer."
        )
    data = build_data(replace(TrainConfig.from_dict(train), dataset="synthetic", seed=seed), n_ctx=T)
    return data.probe(n, T).long()


def make_windows(model: SinkModel, tokenizer, *, T: int, n_eval: int, calib_tokens: int, seed: int) -> Windows:
    """Held-out windows and ``calib_tokens // T`` calibration windows drawn with ``seed``.

    Parameters
    ----------
    model : SinkModel
        What ``analysis.load_model`` returns (a reference model draws from its task).
    tokenizer : transformers tokenizer or None
    T : int
        Tokens per window.
    n_eval : int
        Held-out windows.
    calib_tokens : int
        Calibration text, in tokens: at least one window.
    seed : int

    Returns
    -------
    Windows
    """
    if calib_tokens < T:
        raise ValueError(
            f"the calibration text ({calib_tokens} tokens) is shorter than one window ({T} tokens); "
            f"use --calib-tokens {T} or more, or a shorter --T."
        )
    n_cal = calib_tokens // T
    if hf_module(require_model(model, "make_windows")) is None:  # a reference model: its own task
        ev = _task_windows(model, n_eval, T, 10_000)  # held out: a seed no calibration draw uses
        cal = _task_windows(model, n_cal, T, 20_000 + seed)
        return Windows(ev, cal, "independent sequences of the model's own synthetic training task (BOS first)", seed)
    pool = n_eval + 4 * n_cal
    stream = stdlib_stream(tokenizer, pool * T, seed=0)
    w = stream.tokens.view(pool, T)
    pick = torch.randperm(pool - n_eval, generator=torch.Generator().manual_seed(seed))[:n_cal] + n_eval
    return Windows(w[:n_eval], w[pick], stream.source + f"; {T}-token windows, the first {n_eval} held out", seed)
