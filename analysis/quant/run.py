"""``quant_study``: the whole measurement for one model (what ``python -m analysis quant`` runs)."""

from __future__ import annotations

import math

import pandas as pd
import torch

from analysis.model.causal import context_length, require_model
from analysis.model.hooks import readable_text
from analysis.positions.every_sink import sink_positions
from analysis.quant.calibrate import calibrate, find_prefix, mean_nll
from analysis.quant.kv_cache import KV_BITS
from analysis.quant.kv_study import kv_table
from analysis.quant.origin import scale_origin
from analysis.quant.passes import Scheme
from analysis.quant.sites import linear_sites
from analysis.quant.study import QuantResult, check_conditions, layer_scales, schemes_of
from analysis.quant.windows import make_windows
from analysis.model.contract import SinkModel, hf_module
from analysis.streaming.backbone import causal_lm


def sink_keep(model: SinkModel, windows: torch.Tensor, *, eps: float | None = None) -> torch.Tensor:
    """(N, T) True at each window's first token and at every later sink ``every_sink`` finds.

    Parameters
    ----------
    model : SinkModel
    windows : torch.Tensor of long, shape (N, T)
    eps : float, optional
        The sink threshold (default ``SINK_EPS``).

    Returns
    -------
    torch.Tensor of bool, shape (N, T)
    """
    res = sink_positions(model, windows, **({} if eps is None else {"eps": eps}))
    keep = torch.zeros(windows.shape, dtype=torch.bool)
    keep[:, 0] = True
    for _, r in res.sinks.iterrows():
        keep[int(r["sample"]), int(r["position"])] = True
    return keep


def _candidates(windows: torch.Tensor, keep: torch.Tensor, tokenizer, n: int) -> list[int]:
    """PrefixQuant's candidates: the most frequent tokens among the later sinks, then BOS and the newline."""
    later = keep.clone()
    later[:, 0] = False
    ids = pd.Series(windows[later].tolist(), dtype="int64").value_counts().index.tolist()
    if tokenizer is not None:
        extra = [
            t for t in (tokenizer.bos_token_id, *tokenizer.encode("\n", add_special_tokens=False)) if t is not None
        ]
    else:
        extra = [int(windows[0, 0])]  # a reference model: its BOS
    return list(dict.fromkeys(int(t) for t in ids[:n] + extra))[: n + len(extra)]  # in order, each once


def check_setting(model: SinkModel, *, T: int, prefix_len: int, kv_bits) -> None:
    """Bad input before any work: a prefix with the window beyond the context, KV bits the packed cache lacks.

    Parameters
    ----------
    model : SinkModel
    T, prefix_len : int
    kv_bits : sequence of int

    Returns
    -------
    None
    """
    with causal_lm(model, where="check_setting") as lm:
        n_ctx = context_length(lm)
    if prefix_len < 0:
        raise ValueError(f"--prefix must be >= 0; got {prefix_len}.")
    if n_ctx is not None and T + prefix_len > n_ctx:
        raise ValueError(
            f"a prefix of {prefix_len} tokens and a window of {T} exceed the context ({n_ctx} tokens): "
            f"use --prefix {max(n_ctx - T, 0)} or less, or --T {max(n_ctx - prefix_len, 1)} or less."
        )
    bad = [b for b in kv_bits if b not in KV_BITS]
    if bad:
        raise ValueError(
            f"the packed KV cache stores {' or '.join(map(str, KV_BITS))} bits; got {bad}. Use --kv-bits 4,2."
        )


def _seed_rows(model, sites, tok, win, keep, schemes, conditions, prefix_len, n_cand, origin, fp_cache) -> tuple:
    """One calibration seed: the scheme rows, the scale rows and the searched prefix."""
    cal_keep = keep["calib"]
    prefix, costs = [], []
    if "prefix" in conditions and prefix_len:
        cands = _candidates(win.calib, cal_keep, tok, n_cand)
        prefix, costs = find_prefix(model, sites, win.calib[:2], cands, prefix_len)
    setups = {"as_is": dict(), "sinks_fp": dict(keep=cal_keep), "prefix": dict(prefix=prefix)}
    ev = {"as_is": dict(), "sinks_fp": dict(keep=keep["eval"]), "prefix": dict(prefix=prefix)}
    rows, scale_rows, layer_rows = [], [], []
    for cond in conditions:
        scales = calibrate(model, sites, win.calib, **setups[cond])
        layer_rows += [{"seed": win.seed, "condition": cond, **r} for r in layer_scales(scales).to_dict("records")]
        top = sorted(scales.values(), key=lambda s: -s.absmax)
        scale_rows += [
            {
                "seed": win.seed,
                "condition": cond,
                **{k: getattr(s, k) for k in "site absmax window position dim token_id".split()},
                "origin": scale_origin(s, origin, readable_text(tok, [s.token_id])),
            }
            for s in top[:8]
        ]
        fp_key = (cond == "prefix", tuple(prefix))
        if fp_key not in fp_cache:
            fp_cache[fp_key] = math.exp(
                mean_nll(model, sites, win.eval, Scheme(None), **ev["prefix" if cond == "prefix" else "as_is"])
            )
        for sch in schemes:
            ppl = math.exp(mean_nll(model, sites, win.eval, sch, scales=scales, **ev[cond]))
            rows.append(
                {
                    "seed": win.seed,
                    "scheme": sch.label,
                    "a_bits": sch.a_bits,
                    "granularity": sch.granularity,
                    "w_bits": sch.w_bits or 16,
                    "condition": cond,
                    "ppl": ppl,
                    "fp_ppl": fp_cache[fp_key],
                    "ratio": ppl / fp_cache[fp_key],
                    "site": top[0].site,
                    "scale_absmax": top[0].absmax,
                    "site_position": top[0].position,
                    "site_dim": top[0].dim,
                }
            )
    return rows, scale_rows, layer_rows, {"ids": prefix, "text": readable_text(tok, prefix), "costs": costs}


def quant_study(
    model: SinkModel,
    *,
    a_bits=(8, 4),
    granularities=("tensor", "token"),
    w_bits=(None,),
    conditions=("as_is", "sinks_fp", "prefix"),
    T: int = 256,
    n_eval: int = 8,
    calib_tokens: int = 1024,
    seeds=(0,),
    prefix_len: int = 3,
    n_candidates: int = 3,
    kv_bits=(4, 2),
    origin: bool = True,
) -> QuantResult:
    """Perplexity under every scheme and condition, the scales' sites, and the packed KV cache.

    Parameters
    ----------
    model : SinkModel
        What ``analysis.load_model`` returns (a name goes through it first; a name or a bare Hugging Face model is
        refused). Its passes (the sinks, the spike's writers) run on its backend; the quantised passes and the KV
        caches on its own Hugging Face module (``analysis.streaming.backbone.causal_lm``).
    a_bits, granularities, w_bits : sequences
        The grid (``w_bits`` None: full-precision weights).
    conditions : sequence of {"as_is", "sinks_fp", "prefix"}
    T, n_eval, calib_tokens : int
        Window length, held-out windows, calibration text in tokens (at least T).
    seeds : sequence of int
        Calibration draws.
    prefix_len, n_candidates : int
        The prefix search's longest prefix and its candidate tokens (besides BOS and the newline).
    kv_bits : sequence of int
        The packed KV cache's bits (empty: leave it out).
    origin : bool
        Tie each scale to the spike's writing neurons (``analysis.chain.spike_writers``).

    Returns
    -------
    QuantResult
    """
    schemes, conditions = schemes_of(a_bits, granularities, w_bits), check_conditions(conditions)
    require_model(model, "quant_study")
    check_setting(model, T=T, prefix_len=prefix_len if "prefix" in conditions else 0, kv_bits=kv_bits)
    tok, name = model.tokenizer, model.model_name
    sites = linear_sites(model)  # a calibration text shorter than a window: make_windows' error, before any pass
    rows, scale_rows, layer_rows, prefixes, fp_cache, kv, spike = [], [], [], {}, {}, pd.DataFrame(), {}
    if origin:  # lazy for import time: the spike-origin trace loads the chain's einsum machinery only when asked
        from analysis.chain.spike_writers import spike_origin
    for seed in seeds:
        win = make_windows(model, tok, T=T, n_eval=n_eval, calib_tokens=calib_tokens, seed=seed)
        keep = {"calib": sink_keep(model, win.calib), "eval": sink_keep(model, win.eval)}
        so = spike_origin(model, win.calib[:4]) if origin else None
        so = so if so is not None and so.has_spike else None
        r, s, lr, prefixes[seed] = _seed_rows(
            model, sites, tok, win, keep, schemes, conditions, prefix_len, n_candidates, so, fp_cache
        )
        rows, scale_rows, layer_rows = rows + r, scale_rows + s, layer_rows + lr
        if so is not None:  # the blocks whose MLPs write and erase each spike dim, per seed
            spike[seed] = {
                str(d): {"writers": so.writing_blocks(d), "erasers": so.writing_blocks(d, "eraser")} for d in so.dims
            }
    notes = [
        f"Every activation and weight number is fake quantisation (quantise, de-quantise in float32); the KV "
        f"cache rows hold real packed int{'/int'.join(map(str, kv_bits))} codes."
        if kv_bits
        else "Every number is fake quantisation (quantise, de-quantise in float32)."
    ]
    if kv_bits and hf_module(model) is not None:
        kv = kv_table(model, win.eval, keep["eval"], bits=kv_bits)
    elif kv_bits:
        notes.append(
            "The packed KV cache is measured on Hugging Face models only (a reference model decodes "
            "through its own streaming cache)."
        )
    setting = {
        "T": T,
        "n_eval": n_eval,
        "calib_tokens": calib_tokens,
        "seeds": list(seeds),
        "source": win.source,
        "n_linears": len(sites),
        "prefix_len": prefix_len,
    }
    return QuantResult(
        name,
        pd.DataFrame(rows),
        pd.DataFrame(scale_rows),
        kv,
        prefixes,
        setting,
        n_samples=n_eval,
        notes=notes,
        layers=pd.DataFrame(layer_rows),
        spike_blocks=spike,
    )
