"""Perplexity of a causal LM on a long token stream, decoded token by token with a bounded cache.

``run_policy`` decodes one stream under one ``Policy`` and returns per-position negative log-likelihoods
(nats; entry t scores token t+1 given tokens <= t), tokens/s of the token-by-token part, the peak KV-cache
size, the process's peak memory, and the attention share the kept sink slots receive once the cache is
full (reduced inside each layer by the decode attention function, ``analysis.streaming.attention``; no
attention map is kept). ``recompute_nll`` is the
sliding-window-with-re-computation ceiling: every scored token sees the previous ``window`` tokens,
re-encoded from scratch at positions 0..window-1 (exact; slow, so it can score every k-th position).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from analysis.model.causal import attention_name, cache_keyword, context_length, has_sink_logits, n_layers
from analysis.model.families import attention_implementation
from analysis.model.placement import input_device
from analysis.core.docs import parameters_from
from analysis.core.io import jsonable
from analysis.core.memory import peak_mib, reset_peak
from analysis.core.results import Result
from analysis.model.contract import SinkModel
from analysis.streaming.backbone import causal_lm
from analysis.streaming.attention import NAME as ATTENTION
from analysis.streaming.attention import ShareRecorder, recording
from analysis.streaming.cache import Policy, StreamingCache, rope_spec


def decode_attention(hf) -> str:
    """ "streaming" (``analysis.streaming.attention``: SDPA prefill, grouped-query decode steps that measure the
    sinks' share) unless the model adds learned sink logits (gpt-oss), whose own eager function applies them.

    Parameters
    ----------
    hf : transformers.PreTrainedModel
        The causal LM.

    Returns
    -------
    str
    """
    return "eager" if has_sink_logits(hf) else ATTENTION


@dataclass(eq=False)
class PolicyRun(Result):
    """One policy's pass over a stream. ``nll[t]``: -log p(token t+1 | kept tokens <= t), NaN if not scored.
    ``sink_share``: attention on the kept sink tokens (window policy: the oldest kept token) once the cache is
    full; ``learned_share``: attention on the model's learned sink slot (a reference model's sink token or K/KV
    biases, gpt-oss's sink logits), None for models without one. Both are means over steps, layers and heads.
    It keeps the result protocol; ``to_dict()`` is also its record in ``StreamResult``'s JSON (``from_dict``).

    Attributes
    ----------
    policy : Policy
    nll : numpy.ndarray, shape (N - 1,)
    seconds : float
        The time of the token-by-token part.
    decoded : int
        Tokens decoded one at a time.
    peak_kv_mib, peak_mib : float
        The cache's and the process's peak memory.
    sink_share : float or None
    learned_share : float or None
    batch : int
        Policies decoded together (tokens/s is per policy, in that batch).
    model_name : None
        The model is the ``StreamResult``'s.
    kind : str
        "stream".
    n_samples : int
        1, the one stream.
    tables : dict of str to pandas.DataFrame
        ``nll``: t, nll (the scored positions t: -log p(token t+1 | kept tokens <= t)).
    """

    kind = "stream"
    model_name = None
    n_samples = 1

    policy: Policy
    nll: np.ndarray
    seconds: float
    decoded: int
    peak_kv_mib: float
    peak_mib: float
    sink_share: float | None
    batch: int = 1  # policies decoded together (tokens/s is per policy, in that batch)
    learned_share: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.decoded / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        scored = ~np.isnan(self.nll)
        return {"nll": pd.DataFrame({"t": np.nonzero(scored)[0], "nll": self.nll[scored]})}

    def findings(self) -> list[str]:
        scored = self.nll[~np.isnan(self.nll)]
        ppl = (
            f"perplexity {math.exp(float(scored.mean())):.2f} over {scored.size} scored tokens"
            if scored.size
            else "no scored token"
        )
        share = (
            "" if self.sink_share is None else f"; the kept sinks draw {100 * self.sink_share:.0f}% of the attention"
        )
        # no tokens/s: a finding is the model's, not the machine's
        return [f"Policy {self.policy.label}: {ppl}{share}."]

    def to_dict(self) -> dict:
        """The run's record (strict JSON: NaN as null) with the protocol's model, n_samples and text."""
        p = self.policy
        return jsonable(
            {
                "model": self.model_name,
                "n_samples": self.n_samples,
                "text": self.text(),
                "policy": p.label,
                **{k: getattr(p, k) for k in "kind window sinks sink_tokens bits fp_sinks".split()},
                **{
                    k: getattr(self, k)
                    for k in "seconds decoded tokens_per_s peak_kv_mib peak_mib sink_share learned_share batch".split()
                },
                "nll": [None if math.isnan(x) else round(float(x), 5) for x in self.nll],
            }
        )

    @classmethod
    def from_dict(cls, d: dict) -> "PolicyRun":
        pol = Policy(d["kind"], d["window"], d["sinks"], d["sink_tokens"], d["bits"], d["fp_sinks"])
        nll = np.array([np.nan if x is None else x for x in d["nll"]], dtype=float)
        num = {k: float("nan") if d[k] is None else d[k] for k in ("seconds", "peak_kv_mib", "peak_mib")}  # null: NaN
        extra = dict(batch=d.get("batch", 1), learned_share=d.get("learned_share"))
        return cls(pol, nll, decoded=d["decoded"], sink_share=d["sink_share"], **num, **extra)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")


def _check_group(policies: list[Policy]) -> int | None:
    if not policies:
        raise ValueError("give at least one policy.")
    if any(p.kind == "recompute" for p in policies):
        raise ValueError("the recompute policy keeps no cache; use recompute_nll for it.")
    caps = {None if p.kind == "dense" else p.window for p in policies}
    if len(caps) > 1:
        raise ValueError(f"policies decoded together must share one cache size; got {sorted(caps, key=str)}.")
    return caps.pop()


def _check_stream(hf, tokens, capacity: int | None, allow_beyond_context: bool) -> torch.Tensor:
    tokens = torch.as_tensor(tokens).long().flatten()
    if tokens.numel() < 2:
        raise ValueError(f"a stream needs at least 2 tokens; got {tokens.numel()}.")
    n_ctx, held = context_length(hf), capacity or tokens.numel()
    if n_ctx is not None and not allow_beyond_context and held > n_ctx:
        raise ValueError(
            f"the cache would hold {held} tokens, beyond the model's context ({n_ctx}); "
            + (f"use a window of at most {n_ctx}." if capacity else f"use at most {n_ctx} tokens for the dense policy.")
        )
    return tokens


def _sink_slots(cache: StreamingCache, sinks: list[int]) -> torch.Tensor:
    """(B, L) 1.0 on the cache slots whose attention counts as the sinks' share: the first ``sinks[b]`` slots,
    or for a row without sinks the slot of its oldest kept token."""
    layer = cache.layers[0]
    B, L = layer.keys.shape[0], layer.keys.shape[-2]
    slot = torch.arange(L, device=layer.keys.device)[None]
    s = torch.tensor(sinks, device=slot.device)[:, None]
    oldest = layer.oldest_slots().to(slot.device)[:, None]
    return torch.where(s > 0, slot < s, slot == oldest).float().expand(B, L)


class _Decoder:
    """One batch of policies decoded through ``hf``: nll (B, N-1), the sinks' share per row, kept logits."""

    def __init__(self, hf, ids: torch.Tensor, cache: StreamingCache, sinks: list[int], keep_logits: bool):
        self.hf, self.ids, self.cache, self.sinks = hf, ids, cache, sinks
        self.nll = np.full((ids.shape[0], ids.shape[1] - 1), np.nan)
        self.logits = [] if keep_logits else None
        self.share_sum, self.share_n = np.zeros(ids.shape[0]), 0
        self.learned_sum, self.learned_n = np.zeros(ids.shape[0]), 0
        self.recorder = ShareRecorder()
        self.sink_logits = has_sink_logits(hf)
        self.cache_kw = cache_keyword(hf)

    def _score(self, logits: torch.Tensor, c0: int, c1: int) -> None:
        B = self.ids.shape[0]
        self.nll[:, c0:c1] = (
            _nll(logits.flatten(0, 1), self.ids[:, c0 + 1 : c1 + 1].flatten()).view(B, -1).cpu().numpy()
        )
        if self.logits is not None:
            self.logits.append(logits.float().cpu())

    def prefill(self, c0: int, c1: int) -> None:
        B, device = self.ids.shape[0], self.ids.device
        out = self.hf(
            input_ids=self.ids[:, c0:c1],
            position_ids=torch.arange(c0, c1, device=device)[None].expand(B, -1),
            **{self.cache_kw: self.cache},
            use_cache=True,
        )
        self._score(out.logits, c0, c1)

    def step(self, t: int, share: bool) -> None:
        """Token t in, token t+1 scored; with ``share``, the sinks' attention share of this step is kept."""
        B, device = self.ids.shape[0], self.ids.device
        eager = share and attention_name(self.hf) == "eager"
        self.recorder.marks = (lambda: _sink_slots(self.cache, self.sinks)) if share else None
        with recording(self.recorder):
            out = self.hf(
                input_ids=self.ids[:, t : t + 1],
                position_ids=torch.full((B, 1), self.cache.position(t), device=device),
                **{self.cache_kw: self.cache},
                use_cache=True,
                output_attentions=eager,
            )
        self._score(out.logits, t, t + 1)
        if eager:  # learned-sink models: weights from the model's own eager attention
            att = torch.stack([a[:, :, -1, :] for a in out.attentions])  # (layers, B, heads, L)
            self.recorder.add(att.permute(1, 0, 2, 3))  # layers stand in for KV-head groups: the same mean
            for a in att if self.sink_logits else ():
                self.recorder.add_learned(1 - a.float().sum(-1))  # the sink logits take what the rows miss
        got, learned = self.recorder.take(), self.recorder.take_learned()
        if share and got is not None:
            self.share_sum += got.cpu().numpy()
            self.share_n += 1
        if share and learned is not None:
            self.learned_sum += learned.cpu().numpy()
            self.learned_n += 1

    def runs(self, policies, seconds: float, decoded: int, peak: float) -> list[PolicyRun]:
        peak_kv = np.array(self.cache.kv_bytes(), dtype=float)  # the cache only grows, up to its capacity
        share = (self.share_sum / self.share_n).tolist() if self.share_n else [None] * len(policies)
        learned = (self.learned_sum / self.learned_n).tolist() if self.learned_n else [None] * len(policies)
        runs = []
        for b, p in enumerate(policies):
            run = PolicyRun(
                p, self.nll[b], seconds, decoded, float(peak_kv[b]) / 2**20, peak, share[b], len(policies), learned[b]
            )
            if self.logits is not None:
                run.logits = torch.cat([x[b] for x in self.logits], dim=0)  # (N-1, vocab)
            runs.append(run)
        return runs


@torch.no_grad()
def run_policies(
    model: SinkModel,
    tokens: torch.Tensor,
    policies: list[Policy],
    *,
    newline: int | None = None,
    prefill: int | None = None,
    attention_share: bool = True,
    allow_beyond_context: bool = False,
    progress: bool = False,
    keep_logits: bool = False,
    chunk: int = 512,
) -> list[PolicyRun]:
    """Decode ``tokens`` (N,) under each policy (one batch row per policy, same cache size) with a
    ``StreamingCache``; see the module docstring.

    The first ``prefill`` tokens (default: the window; for dense, all but the last 64) go through in
    forward passes of ``chunk`` tokens (the same arithmetic as token by token, as nothing is evicted
    yet); the rest one token at a time. tokens/s counts the token-by-token part. ``attention_share``: measure
    the attention the kept sinks (for the window policy: the oldest kept token) receive once the cache is full.

    Parameters
    ----------
    model : SinkModel
        What ``analysis.load_model`` returns (decoded through :func:`analysis.streaming.backbone.causal_lm`: its own
        Hugging Face module, no copy).
    tokens : torch.Tensor, shape (N,)
        The stream.
    policies : list of Policy
        Policies with the same cache size.
    newline : int, optional
        The newline token (newline sinks).
    prefill : int, optional
        Tokens run in forward passes before decoding.
    attention_share : bool
    allow_beyond_context : bool
        Let the stream exceed the model's context.
    progress : bool
    keep_logits : bool
        Keep each step's logits (for tests).
    chunk : int
        Tokens per prefill pass.

    Returns
    -------
    list of PolicyRun
    """
    with causal_lm(model, where="run_policies") as hf:
        capacity = _check_group(policies)
        device = input_device(hf)
        tokens = _check_stream(hf, tokens, capacity, allow_beyond_context)
        N = tokens.numel()
        sinks = [p.sinks if p.kind == "sinks" else 0 for p in policies]
        prefill = capacity if prefill is None and capacity else (max(N - 1 - 64, 0) if prefill is None else prefill)
        prefill = max(0, min(prefill, N - 1, capacity or N))
        cache = StreamingCache(
            n_layers(hf),
            rope_spec(hf),
            capacity,
            sinks,
            [p.bits for p in policies],
            [s if p.fp_sinks else 0 for s, p in zip(sinks, policies)],
        )
        ids = tokens.to(device)[None].repeat(len(policies), 1)  # (B, N): the stream once per policy
        for b, p in enumerate(policies):  # its first sinks[b] tokens replaced by newlines where asked
            if p.sink_tokens == "newline":
                if newline is None:
                    raise ValueError("newline sinks need the newline token id (newline=...).")
                ids[b, : sinks[b]] = newline
        dec = _Decoder(hf, ids, cache, sinks, keep_logits)
        reset_peak(device)
        with attention_implementation(hf, decode_attention(hf)):
            for c0 in range(0, prefill, chunk):
                dec.prefill(c0, min(prefill, c0 + chunk))
            from tqdm.auto import tqdm  # lazy: import time

            steps = tqdm(
                range(prefill, N - 1), desc=", ".join(p.label for p in policies)[:40], leave=False, disable=not progress
            )
            t0 = time.perf_counter()
            for t in steps:
                dec.step(t, attention_share and (capacity is None or t + 1 >= capacity))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
        return dec.runs(policies, seconds, max(N - 1 - prefill, 0), peak_mib(device))


@parameters_from(run_policies)
def run_policy(model: SinkModel, tokens: torch.Tensor, policy: Policy, **kwargs) -> PolicyRun:
    """One policy alone (``run_policies`` with one row).

    Parameters
    ----------
    model, tokens
        As in :func:`run_policies`.
    policy : Policy
    **kwargs
        Options of :func:`run_policies`.

    Returns
    -------
    PolicyRun
    """
    return run_policies(model, tokens, [policy], **kwargs)[0]


@parameters_from(run_policies)
@torch.no_grad()
def recompute_nll(
    model: SinkModel, tokens: torch.Tensor, window: int, *, every: int = 1, batch: int = 4, progress: bool = False
) -> PolicyRun:
    """Sliding window with re-computation: token t+1 is scored from tokens t-window+1..t encoded from scratch
    at positions 0..window-1. Exact at every ``every``-th position past the window (all positions before it).

    Parameters
    ----------
    model, tokens, progress
        As in :func:`run_policies`.
    window : int
    every : int
        Score every ``every``-th position past the window.
    batch : int
        Windows per forward pass.

    Returns
    -------
    PolicyRun
    """
    with causal_lm(model, where="recompute_nll") as hf:
        device = input_device(hf)
        ids = tokens.to(device)
        N = ids.numel()
        nll = np.full(N - 1, np.nan)
        reset_peak(device)
        first = min(window, N - 1)
        out = hf(input_ids=ids[None, :first])
        nll[:first] = _nll(out.logits[0], ids[1 : first + 1]).cpu().numpy()
        ts = list(range(window, N - 1, max(1, every)))
        from tqdm.auto import tqdm  # lazy: import time

        chunks = [ts[i : i + batch] for i in range(0, len(ts), batch)]
        t0 = time.perf_counter()
        for chunk in tqdm(chunks, desc=f"recompute {window}", leave=False, disable=not progress):
            ctx = torch.stack([ids[t - window + 1 : t + 1] for t in chunk])
            logits = hf(input_ids=ctx, logits_to_keep=1).logits[:, -1]
            nll[chunk] = _nll(logits, ids[[t + 1 for t in chunk]]).cpu().numpy()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        return PolicyRun(
            Policy("recompute", window), nll, seconds, len(ts), float("nan"), peak_mib(device), None, batch
        )
