"""Perplexity and bytes held of the packed low-bit KV cache (``LowBitCache``) beside the simulated one
(``analysis.streaming.cache.StreamingCache``, keys and values quantised then stored de-quantised)."""

from __future__ import annotations

import math

import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.quant.kv_cache import LowBitCache
from analysis.model.causal import cache_keyword, n_layers
from analysis.streaming.backbone import causal_lm
from analysis.streaming.cache import StreamingCache, rope_spec

from analysis.core.defaults import KV_FIRST_TOKENS as FIRST_TOKENS  # noqa: E402  (the sink-keeping condition)


def _window_nll(hf, ids: torch.Tensor, cache) -> tuple[float, int]:
    pos = torch.arange(ids.numel())[None]
    with torch.no_grad():
        logits = hf(input_ids=ids[None], position_ids=pos, **{cache_keyword(hf): cache}, use_cache=True).logits[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")
    return float(nll), ids.numel() - 1


def kv_table(model: SinkModel, windows: torch.Tensor, sink_keep: torch.Tensor, *, bits=(4, 2)) -> pd.DataFrame:
    """One row per cache: full precision, then per ``bits``: all low-bit, the first tokens in full precision, and
    the first tokens plus every later sink in full precision (KVSink); real bytes held and the simulated cache's
    perplexity and estimated bytes (first tokens in full precision) beside them.

    Parameters
    ----------
    model : SinkModel
        What ``analysis.load_model`` returns (a Hugging Face model's: run through its own causal LM,
        ``analysis.streaming.backbone.causal_lm``).
    windows : torch.Tensor of long, shape (N, T)
        Each window is one prefill of a fresh cache (quantise-on-entry: as token-by-token decoding).
    sink_keep : torch.Tensor of bool, shape (N, T)
        The sink positions (``analysis.positions.every_sink``), the first token included.
    bits : sequence of int

    Returns
    -------
    pandas.DataFrame
        cache, bits, fp_tokens, ppl, kv_bytes (mean per window), simulated_ppl, simulated_bytes.
    """
    with causal_lm(model, where="kv_table") as hf:
        return _kv_rows(hf, windows, sink_keep, bits)


def _kv_rows(hf, windows: torch.Tensor, sink_keep: torch.Tensor, bits) -> pd.DataFrame:
    """:func:`kv_table` on the causal LM ``hf`` the contract gave."""
    L, rope = n_layers(hf), rope_spec(hf)
    first = list(range(FIRST_TOKENS))
    plans = [("fp", None, lambda w: [])] + [
        (name, b, f)
        for b in bits
        for name, f in (
            ("low-bit", lambda w: []),
            (f"first {FIRST_TOKENS} fp", lambda w: first),
            (
                "first + every sink fp (KVSink)",
                lambda w: sorted(set(first) | set(sink_keep[w].nonzero().flatten().tolist())),
            ),
        )
    ]
    rows = []
    for name, b, fp_of in plans:
        nll = n = byt = sim_nll = sim_byt = 0
        for w in range(len(windows)):
            cache = LowBitCache(L, b, fp_of(w))
            a, k = _window_nll(hf, windows[w], cache)
            nll, n, byt = nll + a, n + k, byt + cache.kv_bytes()
            if name.startswith("first ") and "KVSink" not in name or name == "low-bit":
                fp_tok = FIRST_TOKENS if name != "low-bit" else 0
                sim = StreamingCache(L, rope, None, sinks=(0,), bits=(b,), fp_tokens=(fp_tok,))
                a, _ = _window_nll(hf, windows[w], sim)
                sim_nll, sim_byt = sim_nll + a, sim_byt + sim.kv_bytes()[0]
        rows.append(
            {
                "cache": name if b is None else f"int{b} {name}",
                "bits": b or 32,
                "fp_tokens": len(fp_of(0)),
                "ppl": math.exp(nll / n),
                "kv_bytes": byt / len(windows),
                "simulated_ppl": math.exp(sim_nll / n) if sim_byt else None,
                "simulated_bytes": sim_byt / len(windows) if sim_byt else None,
            }
        )
    return pd.DataFrame(rows)
