"""The attention-sink metric of Gu et al. (2025), computed by a reducer on ``hook_pattern``.

For head (l, h), sample s and key position k (1-based), the mean attention the key receives from the
queries that can see it is

    alpha_k = 1 / (T - k + 1) * sum_{i = k..T} A[i, k]

and ``Sink_k^eps`` is 100 x the share of (sample, layer, head) triples with alpha_k > eps (strict),
eps = 0.3 by default. Only alpha for keys 1..k_max is kept: memory per batch is O(layers x heads x k_max).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch

from analysis.hooks import check_tokens, model_dims, run_with_reducers

DEFAULT_EPS = 0.3


def check_eps(eps: float) -> float:
    eps = float(eps)
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must lie in (0, 1) (the paper uses 0.3); got {eps}.")
    return eps


def alpha_from_pattern(pattern: torch.Tensor, k_max: int) -> torch.Tensor:
    """alpha_k for keys 1..k_max from attention maps ``pattern`` (..., T_query, T_key) -> (..., k_max).

    Entries above the diagonal (queries before the key) are ignored even if non-zero.
    """
    T = pattern.shape[-1]
    k_max = min(k_max, T)
    cols = pattern[..., :, :k_max].float()  # (..., T, k_max)
    q = torch.arange(T, device=pattern.device)[:, None]
    k = torch.arange(k_max, device=pattern.device)[None, :]
    seen = (q >= k).to(cols.dtype)  # query i sees key k (0-based i >= k)
    counts = (T - torch.arange(k_max, device=pattern.device)).to(cols.dtype)  # T - k + 1 (1-based k)
    return (cols * seen).sum(dim=-2) / counts


@dataclass
class SinkResult:
    """alpha for every sample, layer, head and key 1..k_max, with the metric and tables on top."""

    alpha: torch.Tensor  # (N, L, H, K) float32, on CPU
    eps: float
    T: int
    model_name: str | None = None
    kind: str | None = None
    meta: dict = field(default_factory=dict)

    @property
    def k_max(self) -> int:
        return self.alpha.shape[-1]

    def _k(self, k: int) -> int:
        k = int(k)
        if not 1 <= k <= self.T:
            raise ValueError(f"k must lie in [1, T={self.T}] (1 is the first token); got {k}.")
        if k > self.k_max:
            raise ValueError(f"alpha was kept for keys 1..{self.k_max} only; rerun sink_metric with k_max >= {k}.")
        return k - 1

    def sink_rate(self, k: int = 1, eps: float | None = None) -> float:
        """Sink_k^eps in percent."""
        e = self.eps if eps is None else check_eps(eps)
        return float((self.alpha[..., self._k(k)] > e).float().mean() * 100)

    def sink_rates(self, eps: float | None = None) -> torch.Tensor:
        """Sink_k^eps for k = 1..k_max, in percent."""
        e = self.eps if eps is None else check_eps(eps)
        return (self.alpha > e).float().mean(dim=(0, 1, 2)) * 100

    @property
    def per_head_alpha(self) -> torch.Tensor:
        """alpha averaged over samples, (L, H, K)."""
        return self.alpha.mean(dim=0)

    def head_sink_share(self, k: int = 1) -> torch.Tensor:
        """Per head, the percent of samples with alpha_k > eps, (L, H)."""
        return (self.alpha[..., self._k(k)] > self.eps).float().mean(dim=0) * 100

    def per_head(self, k: int = 1) -> pd.DataFrame:
        """One row per (layer, head): mean alpha_k, its spread over samples, share of samples above eps."""
        i = self._k(k)
        a = self.alpha[..., i]
        L, H = a.shape[1:]
        return pd.DataFrame(
            {
                "layer": torch.arange(L).repeat_interleave(H).numpy(),
                "head": torch.arange(H).repeat(L).numpy(),
                f"alpha_{k}": a.mean(0).flatten().numpy(),
                f"alpha_{k}_std": a.std(0, unbiased=False).flatten().numpy(),
                f"sink_{k}_pct": ((a > self.eps).float().mean(0) * 100).flatten().numpy(),
            }
        )

    def per_layer(self, k: int = 1) -> pd.DataFrame:
        """One row per layer: Sink_k over that layer's heads, mean and max head alpha_k."""
        i = self._k(k)
        a = self.alpha[..., i]
        return pd.DataFrame(
            {
                "layer": range(a.shape[1]),
                f"sink_{k}_pct": ((a > self.eps).float().mean(dim=(0, 2)) * 100).numpy(),
                f"mean_alpha_{k}": a.mean(dim=(0, 2)).numpy(),
                f"max_head_alpha_{k}": a.mean(0).max(dim=-1).values.numpy(),
            }
        )

    def sink_heads(self, k: int = 1, min_share: float = 50.0) -> list[tuple[int, int]]:
        """(layer, head) pairs whose alpha_k exceeds eps on at least ``min_share`` percent of samples."""
        share = self.head_sink_share(k)
        return [tuple(x) for x in (share >= min_share).nonzero().tolist()]

    def to_dict(self) -> dict:
        return {
            "eps": self.eps,
            "T": self.T,
            "n": int(self.alpha.shape[0]),
            "k_max": self.k_max,
            "sink_k_pct": [round(float(x), 4) for x in self.sink_rates()],
            "per_head_alpha": self.per_head_alpha.permute(2, 0, 1).tolist(),  # [k][layer][head]
        }


def sink_metric(
    model,
    tokens,
    eps: float = DEFAULT_EPS,
    k_max: int | None = None,
    batch_size: int | None = None,
    progress: bool = False,
    kind: str | None = None,
) -> SinkResult:
    """Sink metric of ``model`` on ``tokens`` (N, T), streamed through ``hook_pattern`` reducers.

    ``k_max`` (default min(T, 16)) bounds the key positions whose alpha is kept.
    """
    eps = check_eps(eps)
    dims = model_dims(model)
    tokens = check_tokens(model, tokens)
    T = tokens.shape[1]
    if k_max is None:
        k_max = min(T, 16)
    if not 1 <= int(k_max) <= T:
        raise ValueError(f"k_max must lie in [1, T={T}]; got {k_max}.")
    k_max = int(k_max)

    chunks: list[torch.Tensor] = []
    current: list[torch.Tensor | None] = [None] * dims.n_layers

    def reducer(layer: int):
        def fn(pattern, hook):
            current[layer] = alpha_from_pattern(pattern, k_max).cpu()  # (B, H, K)
        return fn

    def collect(batch, logits):
        missing = [l for l, a in enumerate(current) if a is None]
        if missing:
            raise RuntimeError(f"hook_pattern did not fire for layers {missing}.")
        chunks.append(torch.stack(current, dim=1))  # (B, L, H, K)
        current[:] = [None] * dims.n_layers

    reducers = [(f"blocks.{l}.attn.hook_pattern", reducer(l)) for l in range(dims.n_layers)]
    run_with_reducers(model, tokens, reducers, batch_size=batch_size, progress=progress, on_batch=collect)
    return SinkResult(torch.cat(chunks), eps, T, getattr(model, "model_name", None), kind)


def sink_table(results: dict[str, SinkResult], k: int = 1) -> pd.DataFrame:
    """Sink_k (%) for each named result (e.g. natural / random / repeated)."""
    return pd.DataFrame(
        {"input": list(results), f"Sink_{k} (%)": [r.sink_rate(k) for r in results.values()]}
    ).set_index("input")
