"""Perplexity of a causal LM on a long token stream, decoded token by token with a bounded cache.

``run_policy`` decodes one stream under one ``Policy`` and returns per-position negative log-likelihoods
(nats; entry t scores token t+1 given tokens <= t), tokens/s of the token-by-token part, the peak KV-cache
size, the process's peak memory, and the attention share the kept sink slots receive once the cache is
full (read from each step's attention weights and reduced at once). ``recompute_nll`` is the
sliding-window-with-re-computation ceiling: every scored token sees the previous ``window`` tokens,
re-encoded from scratch at positions 0..window-1 (exact; slow, so it can score every k-th position).
"""
from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch

from analysis.memory import peak_mib, reset_peak
from analysis.streaming.backbone import context_length, n_layers
from analysis.streaming.cache import Policy, StreamingCache, rope_spec


@contextlib.contextmanager
def eager_attention(hf):
    """Eager attention while inside (it returns the attention weights); restores the model's choice."""
    old = hf.config._attn_implementation
    if old == "eager":
        yield
        return
    hf.set_attn_implementation("eager")
    try:
        yield
    finally:
        hf.set_attn_implementation(old)


class PolicyRun:
    """One policy's pass over a stream. ``nll[t]``: -log p(token t+1 | kept tokens <= t), NaN if not scored."""

    def __init__(self, policy: Policy, nll: np.ndarray, seconds: float, decoded: int, peak_kv_mib: float,
                 peak_mib: float, sink_share: float | None, batch: int = 1):
        self.batch = batch  # policies decoded together (tokens/s is per policy, in that batch)
        self.policy, self.nll, self.seconds, self.decoded = policy, nll, seconds, decoded
        self.peak_kv_mib, self.peak_mib, self.sink_share = peak_kv_mib, peak_mib, sink_share

    @property
    def tokens_per_s(self) -> float:
        return self.decoded / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        p = self.policy
        return {"policy": p.label, "kind": p.kind, "window": p.window, "sinks": p.sinks, "sink_tokens": p.sink_tokens,
                "bits": p.bits, "fp_sinks": p.fp_sinks, "seconds": self.seconds, "decoded": self.decoded,
                "tokens_per_s": self.tokens_per_s, "peak_kv_mib": self.peak_kv_mib, "peak_mib": self.peak_mib,
                "sink_share": self.sink_share, "batch": self.batch,
                "nll": [None if math.isnan(x) else round(float(x), 5) for x in self.nll]}

    @classmethod
    def from_dict(cls, d: dict) -> "PolicyRun":
        pol = Policy(d["kind"], d["window"], d["sinks"], d["sink_tokens"], d["bits"], d["fp_sinks"])
        nll = np.array([np.nan if x is None else x for x in d["nll"]], dtype=float)
        return cls(pol, nll, d["seconds"], d["decoded"], d["peak_kv_mib"], d["peak_mib"], d["sink_share"], d.get("batch", 1))


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


@torch.no_grad()
def run_policies(hf, tokens: torch.Tensor, policies: list[Policy], newline: int | None = None,
                 prefill: int | None = None, attention_share: bool = True, allow_beyond_context: bool = False,
                 progress: bool = False, keep_logits: bool = False, chunk: int = 512) -> list[PolicyRun]:
    """Decode ``tokens`` (N,) under each policy (one batch row per policy, same cache size) with a
    ``StreamingCache``; see the module docstring.

    The first ``prefill`` tokens (default: the window; for dense, all but the last 64) go through in
    forward passes of ``chunk`` tokens (the same arithmetic as token by token, as nothing is evicted
    yet); the rest one token at a time. tokens/s counts the token-by-token part."""
    capacity = _check_group(policies)
    device = hf.get_output_embeddings().weight.device
    tokens = torch.as_tensor(tokens).long().flatten()
    N = tokens.numel()
    if N < 2:
        raise ValueError(f"a stream needs at least 2 tokens; got {N}.")
    n_ctx = context_length(hf)
    if n_ctx is not None and not allow_beyond_context and (capacity or N) > n_ctx:
        raise ValueError(
            f"the cache would hold {capacity or N} tokens, beyond the model's context ({n_ctx}); "
            + (f"use a window of at most {n_ctx}." if capacity else f"use at most {n_ctx} tokens for the dense policy.")
        )
    B = len(policies)
    sinks = [p.sinks if p.kind == "sinks" else 0 for p in policies]
    ids = tokens.to(device)[None].repeat(B, 1)
    for b, p in enumerate(policies):
        if p.sink_tokens == "newline":
            if newline is None:
                raise ValueError("newline sinks need the newline token id (newline=...).")
            ids[b, : sinks[b]] = newline
    if prefill is None:
        prefill = capacity if capacity else max(N - 1 - 64, 0)
    prefill = max(0, min(prefill, N - 1, capacity or N))
    cache = StreamingCache(n_layers(hf), rope_spec(hf), capacity, sinks, [p.bits for p in policies],
                           [s if p.fp_sinks else 0 for s, p in zip(sinks, policies)])
    nll = np.full((B, N - 1), np.nan)
    logits_out = [] if keep_logits else None
    share_sum, share_n = np.zeros(B), 0
    reset_peak(device)
    with eager_attention(hf) if attention_share else contextlib.nullcontext():
        for c0 in range(0, prefill, chunk):
            c1 = min(prefill, c0 + chunk)
            out = hf(input_ids=ids[:, c0:c1], position_ids=torch.arange(c0, c1, device=device)[None].expand(B, -1),
                     past_key_values=cache, use_cache=True)
            nll[:, c0:c1] = _nll(out.logits.flatten(0, 1), ids[:, c0 + 1 : c1 + 1].flatten()).view(B, -1).cpu().numpy()
            if keep_logits:
                logits_out.append(out.logits.float().cpu())
        steps = range(prefill, N - 1)
        if progress:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc=", ".join(p.label for p in policies)[:40], leave=False)
        t0 = time.perf_counter()
        for t in steps:
            want = attention_share and (capacity is None or t + 1 >= capacity)
            out = hf(input_ids=ids[:, t : t + 1], position_ids=torch.full((B, 1), cache.position(t), device=device),
                     past_key_values=cache, use_cache=True, output_attentions=want)
            nll[:, t] = _nll(out.logits[:, -1], ids[:, t + 1]).cpu().numpy()
            if keep_logits:
                logits_out.append(out.logits.float().cpu())
            if want:
                att = torch.stack([a[:, :, -1, :] for a in out.attentions])  # (layers, B, heads, L)
                oldest = cache.layers[0].oldest_slots()  # rows without sinks: the oldest kept token
                share_sum += np.array([float((att[:, b, :, : sinks[b]].sum(-1) if sinks[b] else att[:, b, :, int(oldest[b])]).mean())
                                       for b in range(B)])
                share_n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    peak_kv = np.array(cache.kv_bytes(), dtype=float)  # the cache only grows, up to its capacity
    peak = peak_mib(device)
    runs = []
    for b, p in enumerate(policies):
        run = PolicyRun(p, nll[b], seconds, max(N - 1 - prefill, 0), float(peak_kv[b]) / 2**20, peak,
                        float(share_sum[b] / share_n) if share_n else None, B)
        if keep_logits:
            run.logits = torch.cat([x[b] for x in logits_out], dim=0)  # (N-1, vocab)
        runs.append(run)
    return runs


def run_policy(hf, tokens: torch.Tensor, policy: Policy, **kwargs) -> PolicyRun:
    """One policy alone (``run_policies`` with one row)."""
    return run_policies(hf, tokens, [policy], **kwargs)[0]


@torch.no_grad()
def recompute_nll(hf, tokens: torch.Tensor, window: int, every: int = 1, batch: int = 4, progress: bool = False) -> PolicyRun:
    """Sliding window with re-computation: token t+1 is scored from tokens t-window+1..t encoded from scratch
    at positions 0..window-1. Exact at every ``every``-th position past the window (all positions before it)."""
    device = hf.get_output_embeddings().weight.device
    ids = tokens.to(device)
    N = ids.numel()
    nll = np.full(N - 1, np.nan)
    reset_peak(device)
    first = min(window, N - 1)
    out = hf(input_ids=ids[None, :first])
    nll[:first] = _nll(out.logits[0], ids[1 : first + 1]).cpu().numpy()
    ts = list(range(window, N - 1, max(1, every)))
    chunks = [ts[i : i + batch] for i in range(0, len(ts), batch)]
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, desc=f"recompute {window}", leave=False)
    t0 = time.perf_counter()
    for chunk in chunks:
        ctx = torch.stack([ids[t - window + 1 : t + 1] for t in chunk])
        logits = hf(input_ids=ctx, logits_to_keep=1).logits[:, -1]
        nll[chunk] = _nll(logits, ids[[t + 1 for t in chunk]]).cpu().numpy()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return PolicyRun(Policy("recompute", window), nll, seconds, len(ts), float("nan"), peak_mib(device), None, batch)
