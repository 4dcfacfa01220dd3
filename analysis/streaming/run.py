"""Streaming perplexity of one model under every cache policy, on one recorded stream: ``StreamResult``."""

from __future__ import annotations

import json
import math
from dataclasses import KW_ONLY, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from analysis.core.docs import parameters_from
from analysis.core.io import write_atomic
from analysis.core.results import Result
from analysis.model.contract import SinkModel, hf_module, model_device, model_dtype
from analysis.model.causal import context_length
from analysis.streaming.backbone import causal_lm
from analysis.streaming.cache import Policy
from analysis.streaming.corpus import newline_id, stdlib_stream, task_stream
from analysis.streaming.perplexity import PolicyRun, recompute_nll, run_policies
from analysis.core.versions import package_versions


def default_policies(
    window: int,
    *,
    sinks=(0, 1, 2, 4, 8),
    newline_sinks: int | None = 4,
    bits=(8, 4),
    quant_sinks: int = 4,
    dense: bool = True,
) -> list[Policy]:
    """dense; s + (window - s) for each s (s = 0 is the window policy); newline sinks; and the
    sinks + window cache quantised to each of ``bits``, with and without its sinks in full precision.

    Parameters
    ----------
    window : int
        Tokens every cache keeps, sinks included.
    sinks : sequence of int
        Sink counts s (0: the plain window).
    newline_sinks : int, optional
        Also s newline tokens as sinks.
    bits : sequence of int
        Quantisations of the sinks + window cache.
    quant_sinks : int
        Sinks of the quantised caches.
    dense : bool
        Add the dense cache.

    Returns
    -------
    list of Policy
    """
    pols = [Policy("dense")] if dense else []
    pols += [Policy("window", window) if s == 0 else Policy("sinks", window, s) for s in sinks]
    if newline_sinks:
        pols.append(Policy("sinks", window, newline_sinks, "newline"))
    for b in bits or ():
        pols += [
            Policy("sinks", window, quant_sinks, bits=b),
            Policy("sinks", window, quant_sinks, bits=b, fp_sinks=True),
        ]
    return pols


@dataclass(eq=False)
class StreamResult(Result):
    """Per policy: per-position NLL, perplexity, tokens/s, memory and the sinks' attention share.

    Attributes
    ----------
    model : str
        The model streamed (``model_name`` in the result protocol).
    window : int
    n_ctx : int or None
        The model's context.
    stream : dict
        How to rebuild the stream (``TokenStream.record()``).
    skip : int
        Positions left out of the perplexity at the start.
    runs : list of PolicyRun
    recompute_every : int or None
    device : str
    tokens : list of int or None
    dtype : str
        The model's dtype ("float32", ...).
    backend : dict
        What decoded the stream, and why (``name``, ``why``).
    model_name : str
        ``model`` (a property).
    kind : str
        "stream" (a property).
    n_samples : int
        1, the one stream (a property).
    """

    kind = "stream"
    n_samples = 1

    model: str
    window: int
    n_ctx: int | None
    stream: dict
    skip: int
    runs: list[PolicyRun]
    recompute_every: int | None
    device: str
    _: KW_ONLY
    tokens: list[int] | None = None
    dtype: str = "float32"
    backend: dict | None = None

    def __post_init__(self):
        self.backend = self.backend or {}

    def __repr__(self) -> str:
        return (
            f"<StreamResult model={self.model!r}, window={self.window}, tokens={self.stream.get('n_tokens')}, "
            f"policies={len(self.runs)}, device={self.device!r}>"
        )

    @property
    def model_name(self) -> str:
        return self.model

    table_fields = ("policies=table", "curve")

    def run(self, label: str) -> PolicyRun:
        for r in self.runs:
            if r.policy.label == label:
                return r
        raise KeyError(f"no policy {label!r}; have {[r.policy.label for r in self.runs]}.")

    def _recompute(self) -> PolicyRun | None:
        return next((r for r in self.runs if r.policy.kind == "recompute"), None)

    @staticmethod
    def _ppl(nll: np.ndarray) -> float:
        nll = nll[~np.isnan(nll)]
        return float(math.exp(nll.mean())) if nll.size else float("nan")

    @property
    def table(self) -> pd.DataFrame:
        """One row per policy. ppl: over every scored token from token skip+1; ppl_past_window: over tokens
        after the first eviction; ppl_at_recompute: on the positions the re-computation ceiling scored."""
        rec = self._recompute()
        rec_pos = [] if rec is None else np.where(~np.isnan(rec.nll) & (np.arange(rec.nll.size) >= self.window))[0]
        rows = []
        for r in self.runs:
            p = r.policy
            nll = r.nll.copy()
            nll[: self.skip] = np.nan
            rows.append(
                {
                    "policy": p.label,
                    "kind": p.kind,
                    "sinks": p.sinks,
                    "sink_tokens": p.sink_tokens if p.sinks else "",
                    "bits": p.bits or 32,
                    "fp_sinks": p.fp_sinks,
                    "ppl": self._ppl(nll),
                    "ppl_past_window": self._ppl(nll[self.window :]),
                    "ppl_at_recompute": self._ppl(nll[rec_pos]),  # NaN without positions
                    "tokens_scored": int((~np.isnan(nll)).sum()),
                    "tokens_per_s": r.tokens_per_s,
                    "batch": r.batch,
                    "kv_cache_mib": r.peak_kv_mib,
                    "peak_mib": r.peak_mib,
                    "sink_attention": r.sink_share,
                    "learned_sink_attention": r.learned_share,
                }
            )
        return pd.DataFrame(rows)

    def curve(self, bin: int = 32) -> pd.DataFrame:
        """Mean NLL (log-perplexity) per bin of ``bin`` positions, one column per policy (NaN bins left out
        of a policy's mean; the re-computation ceiling is sampled)."""
        n = self.runs[0].nll.size
        starts = np.arange(0, n, bin)
        data = {"position": starts + 1}
        for r in self.runs:
            with np.errstate(all="ignore"):
                data[r.policy.label] = [
                    np.nanmean(r.nll[a : a + bin]) if np.any(~np.isnan(r.nll[a : a + bin])) else np.nan for a in starts
                ]
        return pd.DataFrame(data)

    def jump(self, label: str, width: int = 64) -> tuple[float, float]:
        """Mean NLL of a policy over ``width`` tokens before and after the first eviction (token window+1)."""
        nll = self.run(label).nll
        w = self.window
        width = max(1, min(width, w - self.skip))
        return float(np.nanmean(nll[w - width : w])), float(np.nanmean(nll[w : w + width]))

    def text(self) -> str:
        """The findings, one per line (the re-computation gap of each sink policy indented under the ceiling)."""
        return "\n".join(self._lines())

    def findings(self) -> list[str]:
        lines = [l.strip() for l in self._lines()]
        return [l if l[:1].isupper() or l[:1].isdigit() else f"Model {l}" for l in lines]  # a name may start lower

    def _lines(self) -> list[str]:
        t = self.table.set_index("policy")
        w = self.window
        lines = [
            f"{self.model}: streaming perplexity on {self.stream.get('n_tokens')} tokens "
            f"({self.stream.get('source', 'given tokens')}), cache of {w} tokens."
        ]
        lines += [self.stream["note"]] if self.stream.get("note") else []
        win = f"0+{w}"
        if win in t.index:
            before, after = self.jump(win)
            width = max(1, min(64, w - self.skip))
            lines.append(
                f"Window ({win}): perplexity {t.loc[win, 'ppl_past_window']:.2f} after the first eviction; "
                f"log-perplexity {before:.2f} over the {width} tokens before token 1 leaves the cache and "
                f"{after:.2f} over the {width} after."
            )
        sink_rows = t[(t["kind"] == "sinks") & (t["bits"] == 32) & (t["sink_tokens"] == "first")]
        for label, row in sink_rows.iterrows():
            lines.append(
                f"{label}: perplexity {row['ppl_past_window']:.2f} past the window; the {row['sinks']} kept "
                f"sink token(s) get {100 * (row['sink_attention'] or 0):.0f}% of the attention."
            )
        lines += self._learned_lines(t)
        rec = self._recompute()
        if rec is not None:
            r = t.loc[rec.policy.label]
            lines.append(
                f"Re-computation ceiling ({rec.policy.label}, every {self.recompute_every} position(s)): "
                f"perplexity {r['ppl_at_recompute']:.2f} on its positions past the window."
            )
            for label, row in sink_rows.iterrows():
                gap = 100 * (row["ppl_at_recompute"] / r["ppl_at_recompute"] - 1)
                lines.append(
                    f"  {label} on the same positions: {row['ppl_at_recompute']:.2f} ({gap:+.1f}% against the ceiling)."
                )
        q = t[t["bits"] < 32]
        for label, row in q.iterrows():
            lines.append(f"{label}: perplexity {row['ppl_past_window']:.2f} past the window.")
        return lines

    def _learned_lines(self, t: pd.DataFrame) -> list[str]:
        """The model's learned sink slot (sink token, K/KV biases, sink logits), where it has one."""
        rows = t[t["learned_sink_attention"].notna() & (t["bits"] == 32) & (t["kind"] != "dense")]
        if rows.empty:
            return []
        parts = [f"{label} {100 * row['learned_sink_attention']:.0f}%" for label, row in rows.iterrows()]
        return [
            "The model's learned sink slot (always in the cache) gets, once the cache is full: "
            + ", ".join(parts)
            + "."
        ]

    def to_dict(self) -> dict:
        return {
            **{
                k: getattr(self, k)
                for k in "model window n_ctx stream skip recompute_every device dtype backend tokens".split()
            },
            "timing": "tokens_per_s is measured per decode batch: the policies of one batch (batch: how many "
            "rows were decoded together) share one timing",
            "table": json.loads(self.table.to_json(orient="records")),
            "runs": [r.to_dict() for r in self.runs],
            "versions": package_versions(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "StreamResult":
        given = {k: d[k] for k in ("model", "window", "n_ctx", "stream", "skip", "recompute_every")}
        runs = [PolicyRun.from_dict(r) for r in d["runs"]]
        keywords = dict(tokens=d.get("tokens"), dtype=d.get("dtype", "float32"), backend=d.get("backend"))
        return cls(**given, runs=runs, device=d.get("device", "cpu"), **keywords)

    @classmethod
    def load(cls, path) -> "StreamResult":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, path) -> Path:
        """Write the JSON atomically (an existing file is only replaced once the new one is complete)."""
        write_atomic(path, json.dumps(self.to_dict()))
        return Path(path)


def compare_streams(results: dict, *, sinks=(0, 1, 4)) -> pd.DataFrame:
    """One row per model ({name: StreamResult}, each with one cache size): perplexity past the first eviction
    with s = each of ``sinks`` kept first tokens (s = 0: the window), the re-computation ceiling, and the
    attention on the kept first token (1 sink) and on the model's learned sink slot (window policy).

    Parameters
    ----------
    results : dict of str to StreamResult
    sinks : sequence of int

    Returns
    -------
    pandas.DataFrame
    """
    rows = []
    for name, res in results.items():
        t, w = res.table.set_index("policy"), res.window
        row = {"model": name, "window": w}
        nan = float("nan")  # a policy the run left out
        for s in sinks:
            row[f"{s} sinks"] = t["ppl_past_window"].get(f"0+{w}" if s == 0 else f"{s}+{w - s}", nan)
        row["recompute"] = t["ppl_past_window"].get(f"recompute {w}", nan)
        row["first token attention (1 sink)"] = t["sink_attention"].get(f"1+{w - 1}", nan)
        row["learned slot attention (window)"] = t["learned_sink_attention"].get(f"0+{w}", nan)
        rows.append(row)
    return pd.DataFrame(rows).set_index("model").apply(pd.to_numeric)  # None (no learned slot) -> NaN


def write_csv_atomic(df: pd.DataFrame, path) -> Path:
    """A DataFrame written as CSV, atomically.

    Parameters
    ----------
    df : pandas.DataFrame
    path : path-like

    Returns
    -------
    pathlib.Path
    """
    write_atomic(path, df.to_csv(index=False))
    return Path(path)


def _backend(model: SinkModel) -> dict:
    """What decodes a model's stream, and why (the stream JSON's ``backend``)."""
    if hf_module(model) is None:
        return {"name": "reference", "why": "a reference model decodes through its own hooks (ReferenceLM)"}
    return {
        "name": "transformers",
        "why": "the cache passes decode the Hugging Face model in its own attention, the "
        "only one that keeps a KV cache (the bridge's wrappers off for the passes)",
    }


@parameters_from(default_policies)
def streaming_perplexity(
    model: SinkModel,
    tokens=None,
    *,
    window: int = 256,
    n_tokens: int = 2048,
    sinks=(0, 1, 2, 4, 8),
    newline_sinks: int | None = 4,
    bits=(8, 4),
    quant_sinks: int = 4,
    dense: bool = True,
    recompute_every: int | None = 8,
    seed: int = 0,
    tokenizer=None,
    skip: int | None = None,
    batch: int = 16,
    progress: bool = False,
) -> StreamResult:
    """Perplexity of a causal LM on a long stream under dense, window, sinks + window (several s), newline
    sinks, quantised caches and the re-computation ceiling. ``model``: what ``analysis.load_model`` returns (a name
    goes through it first: a name or a bare Hugging Face model is refused; split over devices with its
    ``device_map``), decoded through its own Hugging Face module. ``tokens``: your own ids (N,), else
    ``n_tokens`` of the offline docstring stream shuffled with ``seed``. The cache policies that share the
    window are decoded together, ``batch`` rows at a time. ``recompute_every``: score the ceiling at every
    k-th position past the window (1: all; None: leave it out).

    Parameters
    ----------
    model : SinkModel
    tokens : torch.Tensor, shape (N,), optional
        Your own ids.
    window, sinks, newline_sinks, bits, quant_sinks, dense
        As in :func:`default_policies`.
    n_tokens : int
        The stream's length when ``tokens`` is not given.
    recompute_every : int, optional
    seed : int
        The order of the docstring stream.
    tokenizer : transformers.PreTrainedTokenizerBase, optional
        Overrides the model's own.
    skip : int, optional
        Positions left out of the perplexity at the start.
    batch : int
        Policies decoded together.
    progress : bool

    Returns
    -------
    StreamResult
    """
    with causal_lm(model, where="streaming_perplexity") as lm:  # a name or a bare model: refused here, before any work
        n_ctx = context_length(lm)
    device, dtype = model_device(model), model_dtype(model)
    tok, name = tokenizer or model.tokenizer, model.model_name
    if window < 1:
        raise ValueError(f"window must be at least 1 token; got {window}.")
    if n_ctx is not None and window > n_ctx:
        raise ValueError(
            f"window {window} is larger than the context of {name} ({n_ctx} tokens); use --window {n_ctx} or less."
        )
    bad = [s for s in sinks if s >= window] + ([quant_sinks] if bits and quant_sinks >= window else [])
    if bad:
        raise ValueError(f"sinks {bad} must each be smaller than the window ({window}); the window counts the sinks.")
    tokens, record = _stream_tokens(model, tok, tokens, n_tokens=n_tokens, seed=seed)
    if tokens.numel() <= window:
        raise ValueError(
            f"the stream ({tokens.numel()} tokens) is not longer than the window ({window}): nothing would "
            f"ever be evicted. Use more tokens (--tokens) or a smaller window (--window)."
        )
    skip = max([8, *sinks]) if skip is None else skip
    if newline_sinks and tok is None:  # a synthetic task has no newline token
        record["note"] = "newline sinks left out: the model has no tokenizer (its task has no newline token)."
        newline_sinks = None
    pols = default_policies(
        window, sinks=sinks, newline_sinks=newline_sinks, bits=bits, quant_sinks=quant_sinks, dense=dense
    )
    nl = newline_id(tok) if newline_sinks else None
    # one run per cache policy: the dense one over the stream's first n_ctx tokens (NaN past them), the cached ones
    # batch at a time over the whole stream
    runs: list[PolicyRun] = []
    dense_pols = [p for p in pols if p.kind == "dense"]
    if dense_pols:
        n_dense = tokens.numel() if n_ctx is None else min(tokens.numel(), n_ctx)
        r = run_policies(model, tokens[:n_dense], dense_pols, progress=progress)[0]
        r.nll = np.concatenate([r.nll, np.full(tokens.numel() - n_dense, np.nan)])
        runs.append(r)
    cached = [p for p in pols if p.kind != "dense"]
    for i in range(0, len(cached), batch):
        runs += run_policies(model, tokens, cached[i : i + batch], newline=nl, progress=progress)
    if recompute_every:
        runs.append(recompute_nll(model, tokens, window, every=recompute_every, progress=progress))
    return StreamResult(
        name,
        window,
        n_ctx,
        record,
        skip,
        runs,
        recompute_every,
        str(device),
        tokens=tokens.tolist(),
        dtype=str(dtype).removeprefix("torch."),
        backend=_backend(model),
    )


def _stream_tokens(model: SinkModel, tok, tokens, *, n_tokens: int, seed: int) -> tuple[torch.Tensor, dict]:
    """The stream's ids (N,) and the record of where they come from: the ids given, else ``n_tokens`` of the offline
    docstring stream (a tokenizer-less reference model: its task's stream) shuffled with ``seed``."""
    if tokens is None:
        stream = task_stream(model, n_tokens, seed=seed) if tok is None else stdlib_stream(tok, n_tokens, seed=seed)
        return stream.tokens, stream.record()
    tokens = torch.as_tensor(tokens).long().flatten()
    return tokens, {"source": "given tokens", "seed": None, "n_tokens": int(tokens.numel())}
