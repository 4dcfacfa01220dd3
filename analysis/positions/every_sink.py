"""Sinks at any position: every key that draws a head's attention, not only the first token.

For every sample, attention layer l, head h and key position k (0-based in this module, its tables and the command
line), alpha_k is the mean attention the key receives from the queries that see it,

    alpha_k = 1 / (T - k) * sum_{i = k..T-1} A[i, k]     (Gu et al.'s alpha, ``analysis.sinks.metric``, counted from 0)

computed by ``analysis.sinks.metric.sink_pass`` with k_max = T: on the fused path (``path="auto"`` where it is exact) from q,
k and the attention kernel's log-sum-exp in blocks of query rows, otherwise from each layer's ``hook_pattern`` as
column sums reduced in the hook; never a T x T map kept. A position is a *sink* of a head when alpha_k > eps, among
the keys seen by at least ``min_queries`` queries: alpha over a handful of queries is their local attention (the
last key's alpha is the last query's attention on itself), not a sink.

The same pass reads the residual stream after every block (``hook_resid_post``) and keeps, per layer and position:

- the cosine of the position's hidden state to the first token's: a *secondary sink* (arXiv 2512.22213) is a later
  token aligned with the first one; it is created at the first layer where the cosine exceeds ``cos_min`` and lasts
  for the run of layers that follows;
- its largest |activation| and that dimension, beside the sequence's median |activation| at that layer (the table
  gives the layer where that ratio peaks);
- Sun et al.'s massive-activation flags (``analysis.chain.massive``: |a| > ``abs_threshold`` and >= ``ratio_threshold`` x
  the median |a| of the sample's hidden state at that layer), with their dims, values and layers.

Layers: ``layers`` are the attention layers measured (true indices), ``resid_layers`` every block (layer l is the
output of block l, as in ``analysis.chain.massive``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.core.defaults import SECONDARY_COS, SINK_EPS, SINK_MIN_QUERIES, SPIKE_ABS, SPIKE_RATIO
from analysis.core.docs import model_tokens_min2, parameters_from
from analysis.model.hooks import act_name, bos_sentence, check_layers, token_strings
from analysis.engine.passes import Accumulator, Batch, LayerCollector, Reduction
from analysis.chain.massive import criterion_text, massive_accumulator
from analysis.core.results import LayerAxis, Result, compact_repr, layer_runs
from analysis.sinks.metric import check_eps, sink_pass
from analysis.core.stats import one_thread


def default_min_queries(T: int) -> int:
    """Keys must be seen by at least min(``SINK_MIN_QUERIES``, T // 2) queries (at least 1) to count as sinks.

    Parameters
    ----------
    T : int
        The sequence length.

    Returns
    -------
    int
    """
    return max(1, min(SINK_MIN_QUERIES, int(T) // 2))


def sink_rates(alpha: torch.Tensor, eps: float, min_queries: int) -> dict[str, float]:
    """From alpha (N, L, H, T) of every key: ``sink_1_pct``, Sink on the first token in percent of (sample, layer,
    head); ``secondary_pct``, the percent of (sample, layer, head) that sink on some later measured key (k >= 1,
    seen by at least ``min_queries`` queries); ``later_sinks_per_sequence``, the mean number of later measured
    positions that are a sink in some head.

    Parameters
    ----------
    alpha : torch.Tensor, shape (N, L, H, T)
        alpha_k of every key.
    eps : float
        The sink threshold.
    min_queries : int
        Keys seen by fewer queries are left out of the later sinks.

    Returns
    -------
    dict of str to float
    """
    later = alpha[..., 1 : alpha.shape[-1] - min_queries + 1] > eps
    return {
        "sink_1_pct": float((alpha[..., 0] > eps).float().mean() * 100),
        "secondary_pct": float(later.any(-1).float().mean() * 100),
        "later_sinks_per_sequence": float(later.flatten(1, 2).any(1).sum(-1).float().mean()),
    }


def check_cos(cos_min: float) -> float:
    """The cosine threshold of a secondary sink, checked.

    Parameters
    ----------
    cos_min : float
        Must lie in (-1, 1).

    Returns
    -------
    float
    """
    cos_min = float(cos_min)
    if not -1.0 < cos_min < 1.0:
        raise ValueError(f"cos_min must lie in (-1, 1) (default {SECONDARY_COS}); got {cos_min}.")
    return cos_min


def check_min_queries(min_queries: int | None, T: int) -> int:
    """``min_queries`` checked against T (and T >= 2), or its default.

    Parameters
    ----------
    min_queries : int or None
        None: :func:`default_min_queries`.
    T : int
        The sequence length.

    Returns
    -------
    int
    """
    if T < 2:
        raise ValueError(
            f"give at least 2 tokens: with T = {T} the first token is all a query can see, so alpha is 1 "
            "by construction and says nothing about sinks."
        )
    min_queries = default_min_queries(T) if min_queries is None else int(min_queries)
    if not 1 <= min_queries <= T:
        raise ValueError(f"min_queries (--min-queries) must lie in [1, T={T}]; got {min_queries}.")
    return min_queries


@dataclass
class PositionStats:
    """Per layer (``hook_resid_post``) and position: the cosine to the first token's hidden state, and the peak.

    Attributes
    ----------
    cos_first : torch.Tensor, shape (N, R, T)
        The cosine of h[t] to h[0] at each of the R layers; float32.
    peak_abs : torch.Tensor, shape (N, R, T)
        The largest |h[t]| over dims; float32.
    peak_dim : torch.Tensor, shape (N, R, T)
        The dim holding it; int64.
    """

    cos_first: torch.Tensor
    peak_abs: torch.Tensor
    peak_dim: torch.Tensor


def position_stats(acts: dict) -> dict:
    """One layer's reduce for every position of its residual stream x (B, T, D): the cosine of h_t to h_0 and the
    peak |h_t| and its dim, (B, T) each (the dim as int32: half the bytes a remote trace sends back).

    Parameters
    ----------
    acts : dict
        {"resid": the residual stream (B, T, D)}.

    Returns
    -------
    dict of str to torch.Tensor
        "cos", "peak", "dim".
    """
    x = acts["resid"].float()
    u = torch.nn.functional.normalize(x, dim=-1)
    peak, dim = x.abs().max(dim=-1)
    return {"cos": (u * u[:, :1]).sum(-1), "peak": peak, "dim": dim.int()}


class PositionAccumulator(Accumulator):
    """Per layer and batch: cos(h_t, h_0) and the peak |h_t| (value, dim) of every position, from ``hook_resid_post``
    (O(layers x T) numbers a sequence). Reads only the residual stream, so the fused pass can feed it too."""

    __repr__ = compact_repr  # shapes, never tensor values

    def __init__(self, layers):
        self.layers = [int(l) for l in layers]
        self.cos, self.peak, self.dim = (LayerCollector(self.layers) for _ in range(3))

    def hooks(self):
        return {l: {"resid": act_name("resid_post", l)} for l in self.layers}

    def reduction(self, layer: int) -> Reduction:
        return Reduction(position_stats)

    @one_thread()
    def update(self, layer: int, acts: dict, batch: Batch) -> None:
        super().update(layer, acts, batch)

    def fold(self, layer: int, stats: dict, batch: Batch) -> None:
        self.cos.put(layer, stats["cos"])
        self.peak.put(layer, stats["peak"])
        self.dim.put(layer, stats["dim"].long())

    def end_batch(self, batch: Batch, logits) -> None:
        for c in (self.cos, self.peak, self.dim):
            c.end_batch()

    def result(self) -> PositionStats:
        return PositionStats(self.cos.result(), self.peak.result(), self.dim.result())


def _first_run(aligned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """aligned (N, R, T) bool -> (created (N, T): the first layer index where True, -1 if never; lifetime (N, T): the
    length of the run of True that starts there, 0 if never)."""
    R = aligned.shape[1]
    any_ = aligned.any(1)
    created = aligned.int().argmax(1)
    r = torch.arange(R)[None, :, None]
    ended = (~aligned) & (r > created[:, None])
    end = torch.where(ended.any(1), ended.int().argmax(1), torch.full_like(created, R))
    return torch.where(any_, created, -1), torch.where(any_, end - created, 0)


@dataclass
class SinkPositions(Result, LayerAxis):
    """Every sink position, with what the residual stream carries there.

    L: the attention layers measured; R: the layers whose residual stream is read.

    Attributes
    ----------
    alpha : torch.Tensor, shape (N, L, H, T)
        alpha_k of every key k (0-based) per sample, attention layer and query head; float32.
    tokens : torch.Tensor, shape (N, T)
        The token ids (int64).
    cos_first : torch.Tensor, shape (N, R, T)
        The cosine of each position's hidden state to the first token's, per layer; float32.
    peak_abs, peak_dim : torch.Tensor, shape (N, R, T)
        The largest |activation| of each position per layer, and its dim.
    median : torch.Tensor, shape (N, R)
        The median |activation| of each sample's hidden state per layer (positions x dims); float32.
    flagged : pandas.DataFrame
        One row per (sample, position, dim) flagged massive in some layer (``analysis.chain.massive``).
    token_text : dict of int to str
        Token id -> decoded string.
    eps : float
        The threshold on alpha (strict).
    min_queries : int
        Keys seen by fewer queries (k > T - min_queries) are left out of the sinks.
    cos_min : float
        The cosine above which a later token is aligned with the first one.
    abs_threshold, ratio_threshold : float
        Sun et al.'s massive-activation criterion used for ``flagged``.
    layers : list of int, length L
        The attention layers on alpha's layer axis (true indices).
    resid_layers : list of int, length R
        The layers of ``cos_first``, ``peak_abs``, ``peak_dim`` and ``median``.
    skipped : str
        The layers left out (not attention layers) and why, in one sentence; "" when none.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    meta : dict
        How it was computed, e.g. ``{"path": "fused"}``.
    """

    alpha: torch.Tensor
    tokens: torch.Tensor
    cos_first: torch.Tensor
    peak_abs: torch.Tensor
    peak_dim: torch.Tensor
    median: torch.Tensor
    flagged: pd.DataFrame
    token_text: dict
    eps: float = SINK_EPS
    min_queries: int = 1
    cos_min: float = SECONDARY_COS
    abs_threshold: float = SPIKE_ABS
    ratio_threshold: float = SPIKE_RATIO
    layers: list[int] = field(default_factory=list)
    resid_layers: list[int] = field(default_factory=list)
    skipped: str = ""
    model_name: str | None = None
    kind: str | None = None
    meta: dict = field(default_factory=dict)

    @property
    def n_samples(self) -> int:
        return int(self.alpha.shape[0])

    @property
    def T(self) -> int:
        return int(self.alpha.shape[-1])

    @property
    def n_measured(self) -> int:
        """Keys 0..n_measured-1 are seen by at least ``min_queries`` queries (the positions the sinks are read at)."""
        return self.T - self.min_queries + 1

    def token(self, token_id: int) -> str:
        return self.token_text.get(int(token_id), f"#{int(token_id)}")

    def sink_mask(self, eps: float | None = None) -> torch.Tensor:
        """(N, L, H, T) bool: alpha_k > eps at a measured key."""
        e = self.eps if eps is None else check_eps(eps)
        mask = self.alpha > e
        mask[..., self.n_measured :] = False
        return mask

    def sink_rate(self, position: int = 0, eps: float | None = None) -> float:
        """Sink at ``position`` (0-based) in percent of (sample, layer, head): Sink_{position+1}^eps of Gu et al."""
        if not 0 <= int(position) < self.T:
            raise ValueError(f"position must lie in [0, T={self.T}) (0 is the first token); got {position}.")
        return float(self.sink_mask(eps)[..., int(position)].float().mean() * 100)

    def secondary_rate(self, eps: float | None = None) -> float:
        """Percent of (sample, layer, head) that sink on some later position (alpha_k > eps for a measured k >= 1)."""
        return sink_rates(self.alpha, self.eps if eps is None else check_eps(eps), self.min_queries)["secondary_pct"]

    def later_sinks_per_sequence(self, eps: float | None = None) -> float:
        """Mean number of later positions (k >= 1) that are a sink in some head, per sequence."""
        e = self.eps if eps is None else check_eps(eps)
        return sink_rates(self.alpha, e, self.min_queries)["later_sinks_per_sequence"]

    def _secondary(self) -> tuple[torch.Tensor, torch.Tensor]:
        created, life = _first_run(self.cos_first > self.cos_min)
        created[:, 0], life[:, 0] = -1, 0  # the first token is aligned with itself
        return created, life

    @property
    def sinks(self) -> pd.DataFrame:
        """One row per (sample, position) that is a sink in some head: its token, its (layer, head) pairs and their
        alpha (its share of each head's attention), whether it carries a massive activation (dims, largest |a|,
        layers), its peak activation, and as a secondary sink the layer it is created at and how long it lasts.
        Built once per eps, min_queries and cos_min (its tables, findings and JSON each read it)."""
        key = (self.eps, self.min_queries, self.cos_min)
        memo = self.__dict__.get("_sinks")
        if memo is None or memo[0] != key:
            memo = self.__dict__["_sinks"] = (key, self._sink_rows())
        return memo[1].copy()

    def _sink_rows(self) -> pd.DataFrame:
        mask = self.sink_mask()
        where = mask.flatten(1, 2).any(1).nonzero().tolist()  # (sample, position) pairs
        created, life = self._secondary()
        massive = dict(iter(self.flagged.groupby(["sample", "position"]))) if len(self.flagged) else {}
        H = self.alpha.shape[2]
        rows = []
        for s, k in where:
            lh = mask[s, :, :, k].nonzero().tolist()
            heads = [(self.layers[l], h) for l, h in lh]
            alphas = [float(self.alpha[s, l, h, k]) for l, h in lh]
            m = massive.get((s, k))
            r = int((self.peak_abs[s, :, k] / self.median[s].clamp_min(1e-30)).argmax())  # the most massive layer
            rows.append(
                {
                    "sample": s,
                    "position": k,
                    "token_id": int(self.tokens[s, k]),
                    "token": self.token(self.tokens[s, k]),
                    "n_heads": len(heads),
                    "share_of_heads": len(heads) / (len(self.layers) * H),
                    "layers": layer_runs(sorted({l for l, _ in heads})),
                    "heads": heads,
                    "alpha": alphas,
                    "max_alpha": max(alphas),
                    "mean_alpha": float(np.mean(alphas)),
                    "massive": m is not None,
                    "massive_dims": sorted(int(d) for d in m["dim"].unique()) if m is not None else [],
                    "massive_max_abs": float(m["max_abs"].max()) if m is not None else None,
                    "massive_layers": (
                        f"{int(m['first_layer'].min())}-{int(m['last_layer'].max())}" if m is not None else ""
                    ),
                    "peak_layer": self.resid_layers[r],
                    "peak_dim": int(self.peak_dim[s, r, k]),
                    "peak_abs": float(self.peak_abs[s, r, k]),
                    "peak_ratio": float(self.peak_abs[s, r, k] / self.median[s, r].clamp_min(1e-30)),
                    "created_layer": (self.resid_layers[int(created[s, k])] if created[s, k] >= 0 else None),
                    "lifetime": int(life[s, k]),
                    "max_cos_first": float(self.cos_first[s, :, k].max()) if k > 0 else 1.0,
                }
            )
        return pd.DataFrame(rows, columns=SINK_COLUMNS)

    @property
    def secondary(self) -> pd.DataFrame:
        """One row per (sample, later position) aligned with the first token in some layer (cosine > cos_min),
        whether or not it is a sink: the layer it is created at, how many layers it lasts, and its heads."""
        created, life = self._secondary()
        heads = self.sink_mask().sum((1, 2))  # (N, T)
        rows = [
            {
                "sample": s,
                "position": k,
                "token": self.token(self.tokens[s, k]),
                "created_layer": self.resid_layers[int(created[s, k])],
                "lifetime": int(life[s, k]),
                "max_cos_first": float(self.cos_first[s, :, k].max()),
                "n_heads": int(heads[s, k]),
                "is_sink": bool(heads[s, k] > 0),
            }
            for s, k in (created >= 0).nonzero().tolist()
        ]
        return pd.DataFrame(
            rows,
            columns=["sample", "position", "token", "created_layer", "lifetime", "max_cos_first", "n_heads", "is_sink"],
        )

    def by_token(self, sinks: pd.DataFrame | None = None) -> pd.DataFrame:
        """The later sink positions (k >= 1) grouped by token: how often, in how many sequences and heads, with a
        massive activation or aligned with the first token how often."""
        df = self.sinks if sinks is None else sinks
        df = df[df.position > 0]
        cols = [
            "token",
            "n_positions",
            "n_sequences",
            "share_of_sequences",
            "median_heads",
            "max_heads",
            "mean_max_alpha",
            "first_position",
            "last_position",
            "share_massive",
            "share_aligned",
            "median_created_layer",
            "median_lifetime",
        ]
        if not len(df):
            return pd.DataFrame(columns=cols)
        g = df.assign(aligned=df.created_layer.notna()).groupby("token", sort=False)
        out = pd.DataFrame(
            {
                "n_positions": g.size(),
                "n_sequences": g["sample"].nunique(),
                "median_heads": g["n_heads"].median(),
                "max_heads": g["n_heads"].max(),
                "mean_max_alpha": g["max_alpha"].mean(),
                "first_position": g["position"].min(),
                "last_position": g["position"].max(),
                "share_massive": g["massive"].mean(),
                "share_aligned": g["aligned"].mean(),
                "median_created_layer": g["created_layer"].median(),
                "median_lifetime": g["lifetime"].median(),
            }
        ).reset_index()
        out["share_of_sequences"] = out["n_sequences"] / self.n_samples
        out = out.sort_values(["n_positions", "max_heads"], ascending=False, kind="stable")
        return out[cols].reset_index(drop=True)

    def per_head(self) -> pd.DataFrame:
        """One row per (layer, head): the share of sequences in which it sinks on the first token and on some later
        position, and the mean alpha of its later sinks."""
        mask = self.sink_mask()
        later = mask[..., 1:]
        L, H = mask.shape[1:3]
        a_later = torch.where(later, self.alpha[..., 1:], torch.nan)
        return pd.DataFrame(
            {
                "layer": torch.tensor(self.layers).repeat_interleave(H).numpy(),
                "head": torch.arange(H).repeat(L).numpy(),
                "share_first": mask[..., 0].float().mean(0).flatten().numpy(),
                "share_later": later.any(-1).float().mean(0).flatten().numpy(),
                "mean_later_alpha": a_later.nanmean((0, -1)).flatten().numpy(),
            }
        )

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        sinks = self.sinks
        return {
            "sinks": sinks,
            "by_token": self.by_token(sinks),
            "secondary": self.secondary,
            "per_head": self.per_head(),
        }

    def findings(self) -> list[str]:
        """Which later positions sink, in how many heads and layers; as secondary sinks, when they are created and
        how long they last; whether they carry a massive activation."""
        sinks = self.sinks
        later = sinks[sinks.position > 0]
        on = f" on {self.kind} inputs" if self.kind else ""
        name = self.model_name or "the model"
        rule = (
            f"alpha_k > {self.eps:g} in at least one head, keys 0..{self.n_measured - 1} seen by at least "
            f"{self.min_queries} queries"
        )
        bos = self.meta.get("bos")
        tail = ([self.skipped] if self.skipped else []) + ([bos_sentence(bos, asked=bos.get("asked"))] if bos else [])
        if not len(later):
            first = (
                f"the first token is the only sink (Sink_1 {self.sink_rate(0):.1f}%)"
                if self.sink_rate(0) > 0
                else "no position is a sink, the first token included (Sink_1 0.0%)"
            )
            return [
                f"In {name}{on}, {first} ({rule}; positions 0-based; N = {self.n_samples} sequences "
                f"of T = {self.T} tokens)."
            ] + tail
        n_seq = later["sample"].nunique()
        out = [
            f"In {name}{on}, {n_seq} of {self.n_samples} sequences ({100 * n_seq / self.n_samples:.0f}%) have a "
            f"sink besides the first token ({rule}; positions 0-based; T = {self.T}), "
            f"{self.later_sinks_per_sequence():.2f} later sink "
            f"positions per sequence on average."
        ]
        tok = self.by_token(sinks).head(4)
        listed = ", ".join(
            f"{r.token!r} ({_count(r.n_positions, 'position')} in {_count(r.n_sequences, 'sequence')})"
            for r in tok.itertuples()
        )
        layers = sorted({l for hs in later.heads for l, _ in hs})
        out.append(
            f"The most frequent later sink tokens are {listed}; a later sink draws more than eps in a median of "
            f"{later.n_heads.median():.0f} heads (range {later.n_heads.min()}-{later.n_heads.max()}), in layers "
            f"{layer_runs(layers)}."
        )
        out.append(self._secondary_text(later))
        out.append(self._massive_text(later))
        return out + tail

    def _secondary_text(self, later: pd.DataFrame) -> str:
        aligned = later[later.created_layer.notna()]
        if not len(aligned):
            return (
                f"None of the later sink positions aligns with the first token's hidden state (cosine > "
                f"{self.cos_min:g} in no layer)."
            )
        c, life = aligned.created_layer.astype(int), aligned.lifetime
        return (
            f"{100 * len(aligned) / len(later):.0f}% of the later sink positions are secondary sinks, aligned with "
            f"the first token's hidden state (cosine > {self.cos_min:g}): created at layer {c.median():.0f} "
            f"(median; range {c.min()}-{c.max()}) and lasting {life.median():.0f} layers (median; range "
            f"{life.min()}-{life.max()})."
        )

    def _massive_text(self, later: pd.DataFrame) -> str:
        crit = criterion_text(self.abs_threshold, self.ratio_threshold)
        peak = (
            f"their largest activation relative to the sequence median is on dim "
            f"{int(later.peak_dim.mode().iloc[0])} (the most frequent), a median of {later.peak_abs.median():.0f} "
            f"({later.peak_ratio.median():.0f}x the median) at layer {later.peak_layer.median():.0f} (median)"
        )
        flagged = later[later.massive]
        if not len(flagged):
            return f"None of them carries a massive activation by the criterion ({crit}); {peak}."
        dims = sorted({d for ds in flagged.massive_dims for d in ds})
        return (
            f"{100 * len(flagged) / len(later):.0f}% of them carry a massive activation by the criterion "
            f"({crit}), on dims {dims}; {peak}."
        )

    def records(self) -> list[dict]:
        """One JSON-ready record per sink position (``sinks`` rows; heads as [layer, head] pairs)."""
        recs = self.sinks.to_dict("records")
        for r in recs:
            r["heads"] = [list(h) for h in r["heads"]]
        return recs

    def to_dict(self) -> dict:
        return {
            **self.header(),
            "T": self.T,
            "eps": self.eps,
            "min_queries": self.min_queries,
            "cos_min": self.cos_min,
            "massive_criterion": {"abs_threshold": self.abs_threshold, "ratio_threshold": self.ratio_threshold},
            "layers": list(self.layers),
            "resid_layers": list(self.resid_layers),
            **({"skipped": self.skipped} if self.skipped else {}),
            **self.meta,
            "sink_1_pct": self.sink_rate(0),
            "secondary_pct": self.secondary_rate(),
            "later_sinks_per_sequence": self.later_sinks_per_sequence(),
            "sinks": self.records(),
            "by_token": self.by_token().to_dict("records"),
            "text": self.text(),
        }


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


SINK_COLUMNS = [
    "sample",
    "position",
    "token_id",
    "token",
    "n_heads",
    "share_of_heads",
    "layers",
    "heads",
    "alpha",
    "max_alpha",
    "mean_alpha",
    "massive",
    "massive_dims",
    "massive_max_abs",
    "massive_layers",
    "peak_layer",
    "peak_dim",
    "peak_abs",
    "peak_ratio",
    "created_layer",
    "lifetime",
    "max_cos_first",
]


@parameters_from(model_tokens_min2)
def sink_positions(
    model: SinkModel,
    tokens,
    *,
    eps: float = SINK_EPS,
    min_queries: int | None = None,
    cos_min: float = SECONDARY_COS,
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    path: str = "auto",
    batch_size: int | None = None,
    progress: bool = False,
    kind: str | None = None,
) -> SinkPositions:
    """Every sink position of ``model`` on ``tokens`` and what its hidden state carries, from one pass.

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens_min2`.
    eps : float
        In (0, 1): a position sinks in a head when alpha_k > eps.
    min_queries : int, optional
        In [1, T]: keys seen by fewer queries are left out (default min(16, T // 2)).
    cos_min : float
        In (-1, 1): the cosine to the first token's hidden state above which a position is aligned.
    abs_threshold, ratio_threshold : float
        Sun et al.'s massive-activation criterion (``analysis.chain.massive``).
    path : {"auto", "fused", "eager"}
        "auto": fused where exact, as in ``analysis.sink_metric``.
    batch_size, progress, kind
        As in ``analysis.sink_metric``.

    Returns
    -------
    SinkPositions
        alpha of shape (N, L, H, T).
    """
    eps, cos_min = check_eps(eps), check_cos(cos_min)
    tokens = torch.as_tensor(tokens)
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    min_queries = check_min_queries(min_queries, int(tokens.shape[-1]))
    resid_layers = check_layers(model, None)

    def accumulators():
        massive = massive_accumulator(
            model, tokens.shape, abs_threshold=abs_threshold, ratio_threshold=ratio_threshold, kind=kind
        )
        return [PositionAccumulator(resid_layers), massive]

    sink, (pos, ma) = sink_pass(
        model,
        tokens,
        make_accumulators=accumulators,
        eps=eps,
        k_max=int(tokens.shape[-1]),
        batch_size=batch_size,
        progress=progress,
        kind=kind,
        path=path,
    )
    ids = sorted(set(torch.as_tensor(tokens).flatten().tolist()))
    return SinkPositions(
        alpha=sink.alpha,
        tokens=torch.as_tensor(tokens).long().cpu(),
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
        layers=list(sink.layers),
        resid_layers=resid_layers,
        skipped=sink.skipped,
        model_name=getattr(model, "model_name", None),
        kind=kind,
        meta=dict(sink.meta),
    )


def format_sinks(res: SinkPositions, *, max_rows: int = 60) -> str:
    """The sink table as printed by ``python -m analysis sinks``: one line per sink position.

    Parameters
    ----------
    res : SinkPositions
    max_rows : int
        Rows printed (the rest are counted).

    Returns
    -------
    str
    """
    df = res.sinks
    head = (
        f"Sinks (alpha_k > {res.eps:g} in some head; keys seen by >= {res.min_queries} queries) of "
        f"{res.model_name or 'the model'}: N={res.n_samples} x T={res.T} tokens, {res.meta.get('path', '')} path; "
        "sample and pos 0-based"
    )
    lines = [
        head,
        f"{'sample':>6} {'pos':>5}  {'token':<14} {'heads':>5}  {'layers':<14} {'max a':>6}  "
        f"{'massive (dims)':<16} {'peak (dim, layer)':<22} {'secondary':<14}",
    ]
    for r in df.head(max_rows).itertuples():
        massive = f"yes {r.massive_dims}" if r.massive else "no"
        second = (
            "first token"
            if r.position == 0
            else (f"L{int(r.created_layer)}, {r.lifetime} layers" if pd.notna(r.created_layer) else "no")
        )
        peak = f"{r.peak_abs:.0f} ({r.peak_dim}, L{r.peak_layer})"
        lines.append(
            f"{r.sample:>6} {r.position:>5}  {repr(r.token)[:14]:<14} {r.n_heads:>5}  {r.layers[:14]:<14} "
            f"{r.max_alpha:>6.2f}  {massive[:16]:<16} {peak:<22} {second:<14}"
        )
    if len(df) > max_rows:
        lines.append(f"... {len(df) - max_rows} more rows in the JSON")
    return "\n".join(lines)


def _later(res: SinkPositions) -> pd.DataFrame:
    sinks = res.sinks
    return sinks[sinks.position > 0]


def _check_runs(runs) -> dict:
    runs = dict(runs)
    if not runs or not all(isinstance(r, SinkPositions) for r in runs.values()):
        raise TypeError(
            "runs must map each probe seed to its sink_positions result (a SinkPositions), at least one; "
            f"got {type(runs).__name__} of {sorted({type(r).__name__ for r in runs.values()})}."
        )
    return runs


def _no_later(runs: dict, what: str) -> str:
    return f"No position after the first sinks on any of the {len(runs)} probe seeds: {what}."


def _span(col: pd.Series, fmt: str) -> str:
    """min-max of a per-seed column; "none (no such position)" where no seed has a value (a share of nothing)."""
    col = col.dropna()
    return f"{col.min():{fmt}}-{col.max():{fmt}}" if len(col) else "none (no such position)"


def later_sinks_by_seed(runs) -> tuple[pd.DataFrame, str]:
    """Per probe seed: Sink_1, the share of sequences with a sink after the first token, the later sink positions
    per sequence and the share of (sample, layer, head) on a later one; and a sentence of their ranges over the
    seeds. With no later sink on any seed, the sentence is the first seed's finding (only the first token sinks, or
    nothing does).

    Parameters
    ----------
    runs : dict of int to SinkPositions
        Probe seed -> ``sink_positions`` on that seed's probe.

    Returns
    -------
    (pandas.DataFrame, str)
        The table (index: seed) and the sentence.
    """
    runs = _check_runs(runs)
    table = pd.DataFrame(
        [
            {
                "seed": s,
                "Sink_1 (%)": r.sink_rate(0),
                "sequences with a later sink": _later(r)["sample"].nunique() / r.n_samples,
                "later sinks per sequence": r.later_sinks_per_sequence(),
                "(sample, layer, head) on a later sink (%)": r.secondary_rate(),
            }
            for s, r in runs.items()
        ]
    ).set_index("seed")
    if not table["later sinks per sequence"].any():
        return table, next(iter(runs.values())).findings()[0]
    share = table["sequences with a later sink"]
    return table, (
        f"{_span(share, '.0%')} of the sequences have a sink besides the first token (seeds {list(runs)}), "
        f"{_span(table['later sinks per sequence'], '.2f')} later sink positions per sequence; Sink_1 is "
        f"{_span(table['Sink_1 (%)'], '.1f')}%."
    )


def later_sink_tokens(runs, *, top: int = 6) -> tuple[pd.DataFrame, str]:
    """The tokens that sink most often after the first position, over the probe seeds: per seed their positions,
    median and largest number of heads and share aligned with the first token (``by_token``), the ``top`` by
    positions; and a line per token (of the first four) with its median number of heads and the layers they are in.

    Parameters
    ----------
    runs : dict of int to SinkPositions
        Probe seed -> ``sink_positions`` on that seed's probe.
    top : int
        Tokens kept (the most positions over the seeds first).

    Returns
    -------
    (pandas.DataFrame, str)
        The table (index: token; columns: seed, then statistic), empty when no later position sinks, and the text.
    """
    runs = _check_runs(runs)
    cols = ["n_positions", "median_heads", "max_heads", "share_aligned"]
    tokens = pd.concat({s: r.by_token().set_index("token")[cols] for s, r in runs.items()}, axis=1).fillna(0)
    order = tokens.xs("n_positions", axis=1, level=1).sum(axis=1).sort_values(ascending=False, kind="stable")
    table = tokens.loc[order.index[:top]]
    if not len(table):
        return table, _no_later(runs, "no token to list")
    later = pd.concat([_later(r) for r in runs.values()])
    lines = []
    for tok in table.index[:4]:
        rows = later[later.token == tok]
        layers = sorted({l for hs in rows.heads for l, _ in hs})
        lines.append(f"{tok!r}: a median of {rows.n_heads.median():.0f} heads, in layers {layers[0]}-{layers[-1]}")
    return table, "\n".join(lines)


def secondary_by_seed(runs) -> tuple[pd.DataFrame, str]:
    """Per probe seed, the later sinks as secondary sinks (aligned with the first token's hidden state): the share
    aligned, the layer they are created at and how long they last, and of the aligned positions the share that sink
    (the first aligned one in its sequence against the later ones, first occurrences of a token against repeats);
    and the sentences of their ranges. Seeds without a later sink are left out; with none on any seed, the table is
    empty and the sentence says so.

    Parameters
    ----------
    runs : dict of int to SinkPositions
        Probe seed -> ``sink_positions`` on that seed's probe (its later sinks' cosines to the first token are read).

    Returns
    -------
    (pandas.DataFrame, str)
        The table (index: the seeds with a later sink) and two sentences, or the one that says there is none.
    """
    runs = _check_runs(runs)
    rows = [_secondary_row(s, r) for s, r in runs.items() if len(_later(r))]
    if not rows:
        return pd.DataFrame(rows), _no_later(runs, "no secondary sink to trace")
    t = pd.DataFrame(rows).set_index("seed")
    if t["later sinks aligned"].isna().all() or not t["later sinks aligned"].any():
        return t, (
            f"None of the later sinks is aligned with the first token's hidden state (cosine > "
            f"{next(iter(runs.values())).cos_min:g} in no layer) on seeds {list(t.index)}: no secondary sink."
        )
    return t, (
        f"{_span(t['later sinks aligned'], '.0%')} of the later sinks are aligned with the first token (cosine > "
        f"{next(iter(runs.values())).cos_min:g}); they are created at layer {t['created (median)'].median():.0f} "
        f"and last {t['lifetime (median)'].median():.0f} layers (medians; seeds' ranges "
        f"{', '.join(t['created (range)'])} and {', '.join(t['lifetime (range)'])}).\n"
        f"Of the aligned positions, {_span(t['first aligned that sink'], '.0%')} of the first in a sequence sink, "
        f"{_span(t['later aligned that sink'], '.0%')} of the later ones; "
        f"{_span(t['first occurrence that sinks'], '.0%')} of first occurrences against "
        f"{_span(t['repeat that sinks'], '.0%')} of repeats."
    )


def _secondary_row(seed, r: SinkPositions) -> dict:
    later, sec, toks = _later(r), r.secondary, r.tokens
    sec["first_aligned"] = sec.groupby("sample").position.rank() == 1
    sec["repeat"] = [bool((toks[x.sample, : x.position] == toks[x.sample, x.position]).any()) for x in sec.itertuples()]
    aligned = later[later.created_layer.notna()]
    return {
        "seed": seed,
        "later sinks aligned": len(aligned) / len(later),
        "created (median)": aligned.created_layer.median(),
        "created (range)": f"{aligned.created_layer.min():.0f}-{aligned.created_layer.max():.0f}",
        "lifetime (median)": aligned.lifetime.median(),
        "lifetime (range)": f"{aligned.lifetime.min()}-{aligned.lifetime.max()}",
        "aligned positions": len(sec),
        "aligned that sink": sec.is_sink.mean(),
        "first aligned that sink": sec[sec.first_aligned].is_sink.mean(),
        "later aligned that sink": sec[~sec.first_aligned].is_sink.mean(),
        "first occurrence that sinks": sec[~sec.repeat].is_sink.mean(),
        "repeat that sinks": sec[sec.repeat].is_sink.mean(),
    }


def massive_by_seed(runs, *, strict: float = SPIKE_RATIO) -> tuple[pd.DataFrame, str]:
    """Per probe seed, the massive activations on the later sinks: the share flagged at ``strict`` x the median
    (Sun et al.) and at the runs' own ratio, the dims and layers flagged, their median peak; and the sentence, with
    the first token's peak beside them. Seeds without a later sink are left out; with none on any seed, the table is
    empty and the sentence says so.

    Parameters
    ----------
    runs : dict of int to SinkPositions
        Probe seed -> ``sink_positions`` on that seed's probe (its flags at its ``ratio_threshold``, the lenient
        ratio, at most ``strict``).
    strict : float
        The stricter ratio to the median (Sun et al.'s 1000x).

    Returns
    -------
    (pandas.DataFrame, str)
        The table (index: seed) and the text.
    """
    runs = _check_runs(runs)
    lenient = next(iter(runs.values())).ratio_threshold
    rows = [_massive_row(s, r, strict) for s, r in runs.items() if len(_later(r))]
    if not rows:
        return pd.DataFrame(rows), _no_later(runs, "no later sink whose activations to read")
    first = pd.concat([r.sinks[r.sinks.position == 0] for r in runs.values()])
    t = pd.DataFrame(rows).set_index("seed")
    at = f"massive at {lenient:g}x"
    peak = (
        f"a median of {t['peak |a| (median)'].median():.0f} ({t['x median (median)'].median():.0f}x the median)"
        if t[at].any()
        else "none of them"
    )
    own = (
        f"the first token peaks at {first.peak_abs.median():.0f} ({first.peak_ratio.median():.0f}x) on dim "
        f"{int(first.peak_dim.mode()[0])}"
        if len(first)
        else "the first token sinks in no head"
    )
    return t, (
        f"At Sun et al.'s {strict:g}x, {_span(t[f'massive at {strict:g}x'], '.0%')} of the later sinks carry a "
        f"massive activation; at {lenient:g}x, {_span(t[at], '.0%')}, {peak}; {own}."
    )


def _massive_row(seed, r: SinkPositions, strict: float) -> dict:
    later, f = _later(r), r.flagged
    hits = (
        set(map(tuple, f[(f.position > 0) & (f.max_ratio >= strict)][["sample", "position"]].values))
        if len(f)
        else set()
    )
    flagged = later[later.massive]
    first_l = [int(x.split("-")[0]) for x in flagged.massive_layers]
    last_l = [int(x.split("-")[1]) for x in flagged.massive_layers]
    lenient = f"{r.ratio_threshold:g}x"
    return {
        "seed": seed,
        "later sinks": len(later),
        f"massive at {strict:g}x": sum((x.sample, x.position) in hits for x in later.itertuples()) / len(later),
        f"massive at {lenient}": later.massive.mean(),
        f"dims ({lenient})": sorted({d for ds in flagged.massive_dims for d in ds}),
        f"layers ({lenient})": f"{min(first_l)}-{max(last_l)}" if first_l else "none",
        "peak |a| (median)": flagged.peak_abs.median(),
        "x median (median)": flagged.peak_ratio.median(),
    }


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, Section, register  # noqa: E402


register(
    Analysis(
        "positions",
        result=SinkPositions,
        order=230,
        doc="Every sink position (its own pass: alpha of every key).",
        sections=(Section("Every sink", "every_sink", 100, needs=(), runner="analysis.report.sections:_positions"),),
        exports=("SinkPositions", "sink_positions"),
    )
)
