"""What a sink does for its head: a head that puts a query's attention on the sink is dormant for that query.

The notes the project started from read the sink as a learned implicit gate, and Guo et al. (2024, active and
dormant heads) find that a head is active or dormant depending on the input, and that a dormant head puts its
attention on the first token. This module measures it per head and per query: for every attention layer l, query
head h, sequence n and query position t,

- ``sink_attn``: the attention the query puts on the sink keys (``hook_pattern`` summed over ``sink_positions``;
  by default the first token, key 1 of the sink metric);
- ``slot``: the attention it puts on an extra slot that is no input token (a learned sink logit, a sink token, K/KV
  biases): 1 - the row sum of ``hook_pattern``, as ``SinkResult.slot``;
- ``mass``: where the model has ``hook_raw_pattern`` (the reference models of ``analysis.train``), the total weight
  that really multiplies the values, summed over the input tokens (1 - slot under softmax; under sigmoid attention
  without normalisation the row sum of the sigmoid scores, which a head can make small without any sink);
- ``out_norm``: the norm of the head's output at that query, its term of the attention output z_t^h W_O^h (what the
  head writes into the residual stream; before any post-attention norm), from ``hook_z`` and ``W_O``;
- ``effect``: the change in the sequence's summed next-token loss (nats) when that head's output at that query is
  removed (z_t^h set to 0), estimated by gradient x activation, -dL/dz_t^h . z_t^h: one forward and one backward
  pass give every head and query; ``effect_mean`` the same with z_t^h set to the head's mean output (mean ablation:
  what the head writes for this query goes, its constant part stays), -dL/dz_t^h . (z_t^h - mean z^h).
  :func:`removal_effects` computes the exact change for chosen heads (one pass per head, resumed at its block where
  the model can resume, every query of every sequence removed in a row of its own) and :func:`attribution_check`
  compares the two.

The reduction happens in the hooks: a pass keeps these (N, L, H, T) numbers, never the activations of every layer
(the backward pass keeps what autograd needs for one batch of about 256 tokens). Statistics use the queries after
the sink that see enough keys for uniform attention not to count as sinking (``first_query``: 3 for the first token
and eps = 0.3) and whose output can change a later prediction (up to T - 2, 0-based).

Per head (:meth:`DormantHeads.head_table`): Spearman and Pearson correlations between sink attention and output
norm and between sink attention and |effect|; the share of *sinking* queries (sink attention > eps) that are
*quiet* (output norm below the head's ``quantile``-quantile of output norms, by default its median) against the
share of the other queries that are, and the same for *inert* (|effect| below the head's quantile of |effect|).
Without any link between sinking and dormancy both shares equal ``quantile``. A query is *dormant* for a head when
it is quiet; the finding (:meth:`DormantHeads.text`) says whether the queries that sink a head's attention are its
dormant ones, by output norm and by loss effect, and in which layers (:meth:`DormantHeads.layer_table`).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from analysis.core.defaults import DORMANT_GRAD_BATCH_TOKENS, DORMANT_MIN_QUERIES, DORMANT_MIN_SHARE, DORMANT_QUANTILE, SINK_EPS
from analysis.model.hooks import (
    ModelContractError,
    act_name,
    attention_layers_of,
    check_tokens,
    hook_names,
    model_device,
    model_dims,
    skipped_note,
)
from analysis.core.io import jsonable
from analysis.model.weights import materialized
from analysis.engine.passes import Accumulator, Batch, ResidCapture, Resume, batches, can_resume, resume_from, run_pass
from analysis.core.results import LayerAxis, Result, layers_text
from analysis.sinks.metric import check_eps, slot_share

GATING_RHO = -0.3  # a layer gates when the median Spearman rho of sink attention with output norm is at most this
SIGNAL_WORDS = {"sink": "attention on the sink", "slot": "attention on the extra slot",
                "mass": "total attention weight on the input tokens"}


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def check_sink_positions(sink_positions, tokens: torch.Tensor):
    """``sink_positions`` as a sorted tuple of 0-based key positions, or as an (N, T) bool mask of sink keys per
    sequence; ValueError saying what to give otherwise.

    Parameters
    ----------
    sink_positions : sequence of int, or torch.Tensor of shape (N, T)
        0-based key positions in [0, T - 3], or a bool mask of sink keys per sequence.
    tokens : torch.Tensor, shape (N, T)

    Returns
    -------
    tuple of int, or torch.Tensor of shape (N, T)
    """
    N, T = tokens.shape
    if isinstance(sink_positions, torch.Tensor) and sink_positions.dtype == torch.bool:
        if tuple(sink_positions.shape) != (N, T):
            raise ValueError(f"a sink mask must have the tokens' shape {(N, T)}; got {tuple(sink_positions.shape)}.")
        if not sink_positions.any(1).all():
            raise ValueError("the sink mask marks no key in some sequences; mark at least one sink key per sequence.")
        return sink_positions.cpu()
    pos = sorted({int(p) for p in (sink_positions if isinstance(sink_positions, (list, tuple, range, set)) else
                                    torch.as_tensor(sink_positions).flatten().tolist())})
    if not pos:
        raise ValueError("sink_positions is empty; give 0-based key positions (0 is the first token) or an (N, T) mask.")
    bad = [p for p in pos if not 0 <= p < T - 2]
    if bad:
        raise ValueError(f"sink positions {bad} lie outside [0, T - 3 = {T - 3}]: a sink needs at least one later query "
                         "whose output can change a prediction (0 is the first token).")
    return tuple(pos)


def first_query(sink_positions, *, eps: float = SINK_EPS) -> int:
    """The first query position (0-based) the statistics use: after every fixed sink position, and seeing enough keys
    that uniform attention does not count as sinking: with k sink keys, query t puts k / (t + 1) on them under
    uniform attention, at most eps from t = ceil(k / eps - 1) on (t = 3 for one sink and eps = 0.3). With a mask, k is
    the largest number of sink keys in a sequence.

    Parameters
    ----------
    sink_positions : tuple of int, or torch.Tensor of shape (N, T)
        As :func:`check_sink_positions` returns them.
    eps : float
        The sink threshold.

    Returns
    -------
    int
    """
    if isinstance(sink_positions, torch.Tensor):
        after, k = 1, int(sink_positions.sum(1).max())
    else:
        after, k = max(sink_positions) + 1, len(sink_positions)
    return max(after, math.ceil(k / eps - 1 - 1e-9))


def check_heads(model, heads) -> list[tuple[int, int]]:
    """``heads`` as a list of (true layer, query head) pairs on attention layers; ValueError naming the ranges.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    heads : iterable of (int, int)

    Returns
    -------
    list of (int, int)
        Without duplicates, in the order given.
    """
    H = model_dims(model).n_heads
    try:
        pairs = [(int(l), int(h)) for l, h in heads]
    except (TypeError, ValueError):
        raise ValueError(f"heads must be (layer, head) pairs, e.g. [(3, 0), (12, 5)]; got {heads!r}.") from None
    if not pairs:
        raise ValueError("heads is empty; give at least one (layer, head) pair.")
    attention_layers_of(model, layers=[l for l, _ in pairs])  # raises on a layer out of range or without attention
    bad = [(l, h) for l, h in pairs if not 0 <= h < H]
    if bad:
        raise ValueError(f"heads {bad} out of range: this model has query heads 0..{H - 1}.")
    return list(dict.fromkeys(pairs))


def check_quantile(quantile: float) -> float:
    """The quantile below which a query is quiet for a head, checked.

    Parameters
    ----------
    quantile : float
        Must lie in (0, 1).

    Returns
    -------
    float
    """
    quantile = float(quantile)
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must lie in (0, 1) (0.5: below the head's median); got {quantile}.")
    return quantile


# ----------------------------------------------------------------------------------------------
# The result
# ----------------------------------------------------------------------------------------------


def _ranks(x: np.ndarray) -> np.ndarray:
    from scipy import stats  # lazy for import time: scipy.stats costs ~0.5 s on `import analysis`

    return stats.rankdata(x, axis=-1)


def rowwise_pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r of each row of x (R, M) with the same row of y; NaN where a row is constant.

    Parameters
    ----------
    x, y : numpy.ndarray, shape (R, M)

    Returns
    -------
    numpy.ndarray, shape (R,)
    """
    x = x - x.mean(-1, keepdims=True)
    y = y - y.mean(-1, keepdims=True)
    den = np.sqrt((x * x).sum(-1) * (y * y).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (x * y).sum(-1) / np.where(den > 0, den, 1.0), np.nan)


def rowwise_spearman(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman rho of each row of x (R, M) with the same row of y (Pearson r of the ranks, ties averaged).

    Parameters
    ----------
    x, y : numpy.ndarray, shape (R, M)

    Returns
    -------
    numpy.ndarray, shape (R,)
    """
    return rowwise_pearson(_ranks(x), _ranks(y))


@dataclass
class DormantHeads(Result, LayerAxis):
    """Per (sample, attention layer, query head, query): attention on the sink, output norm and loss effect.

    Tensors are (N, L, H, T): N sequences, L attention layers (``layers``: their true indices; a hybrid's other layers
    are left out, ``skipped`` says which), H query heads, T query positions (0-based; every position is kept, the
    statistics use ``query_positions``).

    Attributes
    ----------
    layers : list of int, length L
        The true layer index of each position on the layer axis.
    sink_attn : torch.Tensor, shape (N, L, H, T)
        The attention each query puts on the sink keys (``sink_positions``).
    out_norm : torch.Tensor, shape (N, L, H, T)
        The norm of the head's output at the query, |z_t^h W_O^h|.
    effect : torch.Tensor, shape (N, L, H, T)
        The estimated change of the sequence's summed next-token loss (nats) when the head's output at the query is set
        to zero (gradient x activation; positive: the loss rises without it).
    sink_positions : tuple of int, or torch.Tensor of shape (N, T)
        The 0-based key positions of the sink, or a bool mask of sink keys per sequence.
    eps : float
        A query sinks when its attention on the sink (or slot) exceeds eps.
    quantile : float
        A query is quiet (inert) for a head when its output norm (|effect|) lies below this quantile of the head's
        output norms (|effects|) over the measured queries.
    effect_mean : torch.Tensor, shape (N, L, H, T), or None
        The same with the output set to the head's mean output ``z_mean`` instead (mean ablation: removes what the head
        writes for this query and keeps its constant part).
    z_mean : torch.Tensor, shape (L, H, d_head), or None
        Each head's mean z over the measured queries of every sequence.
    slot : torch.Tensor, shape (N, L, H, T), or None
        Attention on an extra slot that is no input token (1 - the row sum of the pattern); None where no head gives one
        any (every row sums to 1).
    mass : torch.Tensor, shape (N, L, H, T), or None
        The total weight multiplying the values over the input tokens (``hook_raw_pattern`` row sum), where the model
        has that hook.
    active : torch.Tensor, shape (N, T), or None
        bool, the queries known to need a head (e.g. the copy positions of the synthetic task).
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    skipped : str
        The layers left out (not attention layers) and why, in one sentence; "" when none.
    min_share : float
        Which heads enter the pooled summary (``sinking_heads``, ``mixed_heads``): the share of their queries that sink.
    min_queries : int
        The fewest sinking (and other) queries a head needs to enter the pooled summary.
    effect_method : {"gradient", "exact"}
        Gradient x activation, or one removal pass per head.
    """

    layers: list[int]
    sink_attn: torch.Tensor
    out_norm: torch.Tensor
    effect: torch.Tensor
    sink_positions: object
    eps: float = SINK_EPS
    quantile: float = DORMANT_QUANTILE
    effect_mean: torch.Tensor | None = None
    z_mean: torch.Tensor | None = None
    slot: torch.Tensor | None = None
    mass: torch.Tensor | None = None
    active: torch.Tensor | None = None
    model_name: str | None = None
    kind: str | None = None
    skipped: str = ""
    min_share: float = DORMANT_MIN_SHARE
    min_queries: int = DORMANT_MIN_QUERIES
    effect_method: str = "gradient"

    def __post_init__(self):
        self.layers = [int(l) for l in self.layers]
        self._table = None

    @property
    def n_samples(self) -> int:
        return int(self.sink_attn.shape[0])

    @property
    def T(self) -> int:
        return int(self.sink_attn.shape[-1])

    @property
    def n_heads(self) -> int:
        return int(self.sink_attn.shape[2])

    @property
    def query_positions(self) -> list[int]:
        """0-based query positions the statistics use: after the sink, before the last token."""
        return list(range(first_query(self.sink_positions, eps=self.eps), self.T - 1))

    @property
    def has_slot(self) -> bool:
        return self.slot is not None

    @property
    def has_mass(self) -> bool:
        """True where the weights multiplying the values need not sum to one (their total varies across queries)."""
        if self.mass is None:
            return False
        m = self._flat(self.mass)
        return bool(np.nanmax(m) - np.nanmin(m) > 1e-3)

    @property
    def signal(self) -> str:
        """What the head sinks onto: "slot" where the model has an extra slot, else "sink"."""
        return "slot" if self.has_slot else "sink"

    @property
    def effects(self) -> dict[str, torch.Tensor]:
        """{"effect": zero removal, "effect_mean": mean removal (where computed)}."""
        return {"effect": self.effect} | ({"effect_mean": self.effect_mean} if self.effect_mean is not None else {})

    def _flat(self, x: torch.Tensor) -> np.ndarray:
        """(N, L, H, T) -> (L * H, N * Q) over the measured queries."""
        q = self.query_positions
        return x[..., q].permute(1, 2, 0, 3).reshape(len(self.layers) * self.n_heads, -1).double().numpy()

    @staticmethod
    def _split(x: np.ndarray, where: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Share of True in ``x`` (R, M) bool among the queries where ``where`` holds, and among the others, per row."""
        return _masked_mean(x, where), _masked_mean(x, ~where)

    def head_table(self) -> pd.DataFrame:
        """One row per (true layer, query head).

        Columns: ``sink_attn`` (mean over the measured queries), ``sinking_share`` (share with sink attention > eps),
        ``rho_norm`` / ``r_norm`` (Spearman / Pearson of sink attention against output norm), ``rho_effect`` /
        ``r_effect`` (against |effect|, zero removal) and ``rho_effect_mean`` (mean removal), ``quiet_if_sinking`` /
        ``quiet_if_other`` (share of the sinking / other queries whose output norm lies below the head's quantile),
        ``inert_if_sinking`` / ``inert_if_other`` (|effect| below the head's quantile; ``inert_mean_if_*`` for mean
        removal), ``n_sinking`` / ``n_other`` (query counts), ``median_norm``, ``median_abs_effect``; with a slot the
        same for the slot (``slot_attn``, ``slot_share``, ``rho_slot_norm``, ``rho_slot_effect``, ``quiet_if_slot``,
        ``quiet_if_not_slot``, ...); with a varying total weight ``mass``, ``rho_mass_norm``, ``rho_mass_effect`` and
        ``quiet_mass`` / ``loud_mass`` (mean total weight of the quiet / other queries); with ``active`` queries
        ``<x>_active`` / ``<x>_inactive`` means of sink attention, output norm, |effect| (and slot, mass).
        """
        if self._table is not None:
            return self._table.copy()
        L, H = len(self.layers), self.n_heads
        norm = self._flat(self.out_norm)
        quiet = norm < np.quantile(norm, self.quantile, axis=-1, keepdims=True)
        effs = {k: np.abs(self._flat(v)) for k, v in self.effects.items()}
        inert = {k: e < np.quantile(e, self.quantile, axis=-1, keepdims=True) for k, e in effs.items()}
        cols = {"layer": np.repeat(self.layers, H), "head": np.tile(np.arange(H), L)}
        for name in ("sink", "slot") if self.has_slot else ("sink",):
            s = self._flat(getattr(self, "sink_attn" if name == "sink" else "slot"))
            sinking = s > self.eps
            p, tag, other = _WORDS[name]
            cols[f"{name}_attn"] = s.mean(-1)
            cols["sinking_share" if name == "sink" else "slot_share"] = sinking.mean(-1)
            cols[f"rho_{p}norm"], cols[f"r_{p}norm"] = rowwise_spearman(s, norm), rowwise_pearson(s, norm)
            for k, e in effs.items():
                cols[f"rho_{p}{k}"] = rowwise_spearman(s, e)
            cols[f"r_{p}effect"] = rowwise_pearson(s, effs["effect"])
            cols[f"quiet_if_{tag}"], cols[f"quiet_if_{other}"] = self._split(quiet, sinking)
            for k, x in inert.items():
                w = "inert" if k == "effect" else "inert_mean"
                cols[f"{w}_if_{tag}"], cols[f"{w}_if_{other}"] = self._split(x, sinking)
            if name == "sink":
                cols["n_sinking"], cols["n_other"] = sinking.sum(-1), (~sinking).sum(-1)
        cols["median_norm"], cols["median_abs_effect"] = np.median(norm, -1), np.median(effs["effect"], -1)
        if self.has_mass:
            m = self._flat(self.mass)
            cols["mass"] = m.mean(-1)
            cols["rho_mass_norm"], cols["rho_mass_effect"] = rowwise_spearman(m, norm), rowwise_spearman(m, effs["effect"])
            cols["quiet_mass"], cols["loud_mass"] = _masked_mean(m, quiet), _masked_mean(m, ~quiet)
        if self.active is not None:
            act = np.broadcast_to(self.active[:, self.query_positions].reshape(-1).numpy(), norm.shape)
            values = {"sink_attn": self._flat(self.sink_attn), "norm": norm, "abs_effect": effs["effect"]}
            values |= {"abs_effect_mean": effs["effect_mean"]} if "effect_mean" in effs else {}
            values |= {"slot_attn": self._flat(self.slot)} if self.has_slot else {}
            values |= {"mass": self._flat(self.mass)} if self.has_mass else {}
            for key, v in values.items():
                cols[f"{key}_active"], cols[f"{key}_inactive"] = _masked_mean(v, act), _masked_mean(v, ~act)
        self._table = pd.DataFrame(cols)
        return self._table.copy()

    def queries(self, layer: int, head: int) -> pd.DataFrame:
        """One row per measured (sample, query) of one head: ``sample``, ``query`` (0-based), ``sink_attn``,
        ``out_norm``, ``effect`` (and ``effect_mean``, ``slot``, ``mass``, ``active`` where present), e.g. for a
        scatter plot."""
        i, head = self._index(layer, head)
        q = self.query_positions
        out = {"sample": np.repeat(np.arange(self.n_samples), len(q)), "query": np.tile(q, self.n_samples)}
        for name, x in (("sink_attn", self.sink_attn), ("out_norm", self.out_norm), ("effect", self.effect),
                        ("effect_mean", self.effect_mean), ("slot", self.slot), ("mass", self.mass)):
            if x is not None:
                out[name] = x[:, i, int(head)][:, q].reshape(-1).numpy()
        if self.active is not None:
            out["active"] = self.active[:, q].reshape(-1).numpy()
        return pd.DataFrame(out)

    def _index(self, layer: int, head: int) -> tuple[int, int]:
        """(position on the layer axis, head) of a true layer index and a query head; ValueError when not measured."""
        if not 0 <= int(head) < self.n_heads:
            raise ValueError(f"head {head} out of range: this result has query heads 0..{self.n_heads - 1}.")
        return self.pos(layer), int(head)

    def _head_mask(self, x: torch.Tensor, layer: int, head: int) -> torch.Tensor:
        i, h = self._index(layer, head)
        out = torch.zeros(self.n_samples, self.T, dtype=torch.bool)
        q = self.query_positions
        out[:, q] = x[:, i, h][:, q]
        return out

    def sinking_mask(self, layer: int, head: int) -> torch.Tensor:
        """(N, T) bool: the measured queries whose attention on the sink (the slot, where there is one) exceeds eps."""
        sig = self.slot if self.has_slot else self.sink_attn
        return self._head_mask(sig > self.eps, layer, head)

    def quiet_mask(self, layer: int, head: int) -> torch.Tensor:
        """(N, T) bool: the measured queries for which the head is dormant, its output norm below its ``quantile``
        of output norms over the measured queries."""
        i, h = self._index(layer, head)
        norm = self.out_norm[:, i, h][:, self.query_positions].double()
        cut = float(np.quantile(norm.numpy(), self.quantile))
        return self._head_mask(self.out_norm.double() < cut, layer, head)

    def _share_column(self) -> str:
        return "slot_share" if self.signal == "slot" else "sinking_share"

    def sinking_heads(self) -> pd.DataFrame:
        """The rows of :meth:`head_table` whose queries sink (on the slot, where there is one) on at least
        ``min_share`` of the measured queries."""
        t = self.head_table()
        return t[t[self._share_column()] >= self.min_share]

    def mixed_heads(self) -> pd.DataFrame:
        """The sinking heads (:meth:`sinking_heads`) with at least ``min_queries`` sinking and ``min_queries`` other
        queries."""
        t = self.sinking_heads()
        share, n = t[self._share_column()], len(self.query_positions) * self.n_samples
        return t[(share * n >= self.min_queries) & ((1 - share) * n >= self.min_queries)]

    def example_heads(self, k: int = 4) -> list[tuple[int, int]]:
        """Up to ``k`` heads to look at: the mixed heads (sinking on some queries, not on others) whose output norm
        falls most with their sink attention, else the heads that sink most, else those whose output norm follows
        their total attention weight most (sigmoid), else the first heads."""
        p = _WORDS[self.signal][0]
        if len(self.mixed_heads()):
            t = self.mixed_heads().sort_values(f"rho_{p}norm")
        elif len(self.sinking_heads()):
            t = self.sinking_heads().sort_values(f"{self.signal}_attn", ascending=False)
        else:
            t = self.head_table()
            t = t.sort_values("rho_mass_norm", ascending=False) if self.has_mass else t
        return [(int(r.layer), int(r.head)) for r in t.head(k).itertuples()]

    def summary(self) -> dict:
        """The pooled finding. ``n_sinking_heads``: heads sinking on at least ``min_share`` of their queries;
        ``n_always_sinking``: those of them with fewer than ``min_queries`` other queries (dormant on nearly every
        query, so no per-query contrast); over the others, the mixed heads (``mixed_heads``): the median Spearman rho
        of sink attention with output norm and |effect| and the share of heads where it is negative, the median quiet /
        inert shares of sinking and of other queries and the share of heads where sinking queries are quiet (inert)
        more often, and the layers where the output norm falls with the sink attention (``layer_table``); the
        total-weight correlation where the weights need not sum to one (``has_mass``, no slot); the copy-position
        contrast (``active``) of the head whose |effect| at the active queries is largest (``copy_head``)."""
        t, sig = self.head_table(), self.signal
        p, tag, other = _WORDS[sig]
        heads, mixed = self.sinking_heads(), self.mixed_heads()
        n = len(self.query_positions) * self.n_samples
        out = {"signal": sig, "effect_method": self.effect_method, "eps": self.eps, "quantile": self.quantile,
               "n_heads": len(t), "n_sinking_heads": len(heads), "n_mixed_heads": len(mixed),
               "n_always_sinking": int(((1 - heads[self._share_column()]) * n < self.min_queries).sum()),
               "queries_per_head": n}
        for m in ("norm",) + tuple(self.effects):
            out[f"median_rho_{m}"] = _median(mixed[f"rho_{p}{m}"])
            out[f"share_rho_{m}_negative"] = float((mixed[f"rho_{p}{m}"] < 0).mean()) if len(mixed) else None
        for what in ("quiet", "inert") + (("inert_mean",) if self.effect_mean is not None else ()):
            if len(mixed):
                a, b = mixed[f"{what}_if_{tag}"], mixed[f"{what}_if_{other}"]
                out[f"{what}_if_sinking"], out[f"{what}_if_other"] = _median(a), _median(b)
                out[f"share_{what}_more_if_sinking"] = float((a > b).mean())
        if len(mixed):
            lt = self.layer_table()
            out["gating_layers"] = [int(l) for l in lt.layer[lt.median_rho_norm <= GATING_RHO]]
            out["other_sinking_layers"] = [int(l) for l in lt.layer[lt.median_rho_norm > GATING_RHO]]
        if self.has_mass:
            out["median_rho_mass_norm"] = _median(t["rho_mass_norm"])
            out["share_rho_mass_norm_positive"] = float((t["rho_mass_norm"] > 0).mean())
            out["quiet_mass"], out["loud_mass"] = float(t["quiet_mass"].mean()), float(t["loud_mass"].mean())
        if self.active is not None and t["abs_effect_active"].notna().any():
            best = t.loc[t["abs_effect_active"].idxmax()]  # the head the task needs most at the active queries
            out["copy_head"] = {"layer": int(best["layer"]), "head": int(best["head"]), **{
                k: float(best[k]) for k in t.columns if k.endswith("_active") or k.endswith("_inactive")}}
        return out

    def layer_table(self) -> pd.DataFrame:
        """One row per attention layer with a mixed head (``mixed_heads``): ``n_mixed_heads`` and the medians over
        them of the attention on the sink (``attn``; on the slot in slot models), ``median_rho_norm``,
        ``median_rho_effect`` (``median_rho_effect_mean``), ``quiet_if_sinking`` and ``quiet_if_other``."""
        p, tag, other = _WORDS[self.signal]
        heads = self.mixed_heads()
        cols = {f"{self.signal}_attn": "attn", **{f"rho_{p}{m}": f"median_rho_{m}" for m in ("norm",) + tuple(self.effects)},
                f"quiet_if_{tag}": "quiet_if_sinking", f"quiet_if_{other}": "quiet_if_other"}
        g = heads.groupby("layer")[list(cols)].median().rename(columns=cols)
        g.insert(0, "n_mixed_heads", heads.groupby("layer").size())
        return g.reset_index()

    def verdict(self, measure: str = "norm") -> str:
        """Whether the queries that sink a head's attention are its dormant ones by ``measure``: "norm" (quiet),
        "effect" (inert under zero removal) or "effect_mean" (inert under mean removal), over the mixed heads. "yes":
        the median Spearman rho is at most ``GATING_RHO`` (-0.3) and sinking queries are quiet (inert) at least 0.2
        more often than the others (medians); "partly": a negative rho in at least 60% of the heads and a positive
        gap; "no" otherwise; "untested" without a mixed head (no head sinks on some queries and not on others)."""
        if measure not in ("norm",) + tuple(self.effects):
            raise ValueError(f"measure must be one of {['norm', *self.effects]}; got {measure!r}.")
        s = self.summary()
        rho, neg = s[f"median_rho_{measure}"], s[f"share_rho_{measure}_negative"]
        what = {"norm": "quiet", "effect": "inert", "effect_mean": "inert_mean"}[measure]
        if rho is None:
            return "untested"
        gap = s[f"{what}_if_sinking"] - s[f"{what}_if_other"]
        if rho <= GATING_RHO and gap >= 0.2:
            return "yes"
        if rho < 0 and neg >= 0.6 and gap > 0:
            return "partly"
        return "no"

    def verdict_text(self) -> str:
        """Whether the queries that sink a head's attention are those for which it is dormant, by output norm and by
        loss effect, in one sentence ("" where no head sinks on some queries and not on others)."""
        s = self.summary()
        if not s["n_mixed_heads"]:
            return ""
        words = {"yes": "clearly", "partly": "weakly", "no": "not"}
        loss = [f"{words[self.verdict('effect_mean')]} when the head's output is set to its mean (median rho = "
                f"{s['median_rho_effect_mean']:.2f})"] if self.effect_mean is not None else []
        loss.append(f"{words[self.verdict('effect')]} when it is set to zero ({s['median_rho_effect']:.2f})")
        return (f"By output norm (median rho = {s['median_rho_norm']:.2f}) the queries that sink a head's attention are "
                f"{words[self.verdict('norm')]} the ones for which the head is dormant"
                + (" (the sink gates it off)" if self.verdict("norm") != "no" else "")
                + "; by loss effect they are " + " and ".join(loss) + ".")

    def findings(self) -> list[str]:
        s = self.summary()
        name = self.model_name or "this model"
        sinks = "the extra slot" if s["signal"] == "slot" else _positions_words(self.sink_positions)
        how = "gradient x activation" if self.effect_method == "gradient" else "exact removal"
        parts = []
        if not s["n_sinking_heads"]:
            parts.append(f"No head of {name} puts more than {self.eps:g} of a query's attention on {sinks} for at least "
                         f"{100 * self.min_share:.0f}% of its queries, so no sink gates a head here.")
        else:
            always = (f"; {s['n_always_sinking']} of them sink on nearly every query (fewer than {self.min_queries} "
                      "other queries)" if s["n_always_sinking"] else "")
            parts.append(f"In {name}, {s['n_sinking_heads']} of {s['n_heads']} heads put more than {self.eps:g} of a "
                         f"query's attention on {sinks} for at least {100 * self.min_share:.0f}% of their queries{always}.")
        if s["n_mixed_heads"]:
            parts.append(
                f"Over the {s['n_mixed_heads']} heads that sink on some queries and not on others (at least "
                f"{self.min_queries} of each), the head's output norm falls as its {SIGNAL_WORDS[s['signal']]} rises in "
                f"{_pct(s['share_rho_norm_negative'])} of them (median Spearman rho = {s['median_rho_norm']:.2f}).")
            if s["gating_layers"] and s["other_sinking_layers"]:
                lt = self.layer_table().set_index("layer")
                parts.append(
                    f"The link lives in {layers_text(s['gating_layers'])} (median rho over their heads "
                    f"{_span(lt.loc[s['gating_layers'], 'median_rho_norm'])}), not in {layers_text(s['other_sinking_layers'])} "
                    f"({_span(lt.loc[s['other_sinking_layers'], 'median_rho_norm'])}).")
            mean = (f" and in {_pct(s['share_rho_effect_mean_negative'])} with it set to the head's mean output (median "
                    f"rho = {s['median_rho_effect_mean']:.2f})" if self.effect_mean is not None else "")
            parts.append(f"Its effect on the loss when removed at that query ({how}) falls with it in "
                         f"{_pct(s['share_rho_effect_negative'])} of them with the output set to zero (median rho = "
                         f"{s['median_rho_effect']:.2f}){mean}.")
            qw = _quantile_words(self.quantile)
            mean = (f", and in {_pct(s['inert_mean_if_sinking'])} against {_pct(s['inert_mean_if_other'])} with it set to "
                    "its mean" if "inert_mean_if_sinking" in s else "")
            parts.append(
                f"In the median head a sinking query is quiet (output norm below the head's {qw}) in "
                f"{_pct(s['quiet_if_sinking'])} of cases against {_pct(s['quiet_if_other'])} for the other queries; it is "
                f"inert (|loss effect| below the head's {qw}) in {_pct(s['inert_if_sinking'])} against "
                f"{_pct(s['inert_if_other'])} with the output set to zero{mean} ({_pct(self.quantile)} each without any "
                "link).")
            parts.append(self.verdict_text())
        elif s["n_sinking_heads"]:
            parts.append(f"No head sinks on some queries and not on others (at least {self.min_queries} of each), so "
                         "whether sinking marks the dormant queries cannot be told query by query here.")
        if self.has_mass and not self.has_slot:
            parts.append(
                f"The weights that multiply the values need not sum to one here: a query's total weight on the input "
                f"tokens rises with the head's output norm in {_pct(s['share_rho_mass_norm_positive'])} of the heads "
                f"(median Spearman rho = {s['median_rho_mass_norm']:.2f}), and the quiet queries give the tokens a total "
                f"weight of {s['quiet_mass']:.3f} against {s['loud_mass']:.3f} for the others: a head silences itself by "
                "small scores on every key rather than by a sink.")
        if "copy_head" in s:
            c = s["copy_head"]
            key = "slot_attn" if s["signal"] == "slot" else "sink_attn"
            mass = (f", with a total weight of {c['mass_active']:.3f} against {c['mass_inactive']:.3f}"
                    if "mass_active" in c and not self.has_slot else "")
            parts.append(
                f"At the positions where the task needs a head (the copy positions), the head that matters most there "
                f"({c['layer']}.{c['head']}, |loss effect| {c['abs_effect_active']:.3g} nats against "
                f"{c['abs_effect_inactive']:.3g} elsewhere, {how}) puts {c[f'{key}_active']:.2f} of its attention on "
                f"{sinks} against {c[f'{key}_inactive']:.2f} elsewhere and writes an output of norm "
                f"{c['norm_active']:.3g} against {c['norm_inactive']:.3g}{mass}.")
        return parts + ([self.skipped] if self.skipped else [])

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {"heads": self.head_table()}

    def to_dict(self) -> dict:
        """Header, the per-head table, the pooled summary, the verdicts and the text (no per-query tensors)."""
        sinks = (self.sink_positions.int().tolist() if isinstance(self.sink_positions, torch.Tensor)
                 else list(self.sink_positions))
        verdicts = {m: self.verdict(m) for m in ("norm",) + tuple(self.effects)}
        return jsonable({**self.header(), "T": self.T, "layers": self.layers, "sink_positions": sinks,
                         "query_positions": [self.query_positions[0], self.query_positions[-1]],
                         "eps": self.eps, "quantile": self.quantile, "verdict": verdicts,
                         "summary": self.summary(), "heads": self.head_table(), "text": self.text(),
                         **({"skipped": self.skipped} if self.skipped else {})})


# signal -> (column prefix, the sinking queries' tag, the other queries' tag)
_WORDS = {"sink": ("", "sinking", "other"), "slot": ("slot_", "slot", "not_slot")}


def _masked_mean(x: np.ndarray, where: np.ndarray) -> np.ndarray:
    """Mean of x (R, M) over the entries where ``where`` holds, per row; NaN where none does."""
    n = where.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (x * where).sum(-1) / np.maximum(n, 1), np.nan)


def _span(x) -> str:
    x = np.asarray(x, dtype=float)
    return f"{x.min():.2f}" if x.size == 1 or x.min() == x.max() else f"{x.min():.2f} to {x.max():.2f}"


def _median(s) -> float | None:
    s = np.asarray(s, dtype=float)
    return float(np.nanmedian(s)) if s.size and np.isfinite(s).any() else None


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _quantile_words(q: float) -> str:
    return "median" if abs(q - 0.5) < 1e-9 else f"{100 * q:.0f}th percentile"


def _positions_words(sink_positions) -> str:
    if isinstance(sink_positions, torch.Tensor):
        return "the sink keys"
    pos = list(sink_positions)
    if pos == [0]:
        return "the first token"
    return "the tokens at positions " + ", ".join(str(p) for p in pos) + " (0-based)"


# ----------------------------------------------------------------------------------------------
# The pass: one forward and one backward per batch, reduced in the hooks
# ----------------------------------------------------------------------------------------------


def output_grams(model, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """{layer: W_O^h W_O^h^T (H, d_head, d_head)} so that |z_t^h W_O^h|^2 = z_t^h G_h z_t^h (float32). Reads
    ``blocks[l].attn.W_O`` (H, d_head, d_model), TransformerLens' layout; ModelContractError where it is missing.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    layers : sequence of int
        Attention layers.

    Returns
    -------
    dict of int to torch.Tensor
        {layer: (H, d_head, d_head)}.
    """
    out = {}
    for l in layers:
        with materialized(model.blocks[l]):  # the real W_O on a model with offloaded blocks
            W = getattr(getattr(model.blocks[l], "attn", None), "W_O", None)
        if not isinstance(W, torch.Tensor) or W.ndim != 3:
            raise ModelContractError(f"layer {l} exposes no per-head output weights `blocks[{l}].attn.W_O` (H, d_head, "
                                     "d_model); the head's output norm needs them (load the model with `load_model`).")
        W = W.detach().float()
        out[l] = torch.einsum("hdD,heD->hde", W, W)
    return out


@contextmanager
def _no_weight_grads(model):
    """The model's parameters without gradients for the duration (restored after): the backward pass then keeps no
    activation for weight gradients, only what the gradients to the heads' outputs need."""
    # An offloaded model's placeholders made under inference mode take no gradient either way: left alone.
    params = [p for p in model.parameters() if p.requires_grad and not p.is_inference()]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


class _BatchHooks:
    """The hooks of one batch: per attention layer, the sink / slot / mass attention from the pattern hooks, the
    output norm and the kept z (for the backward pass) from ``hook_z``."""

    def __init__(self, layers, grams, sink_sel, raw: bool, z_mean: torch.Tensor | None = None):
        self.layers, self.grams, self.sink_sel, self.raw, self.z_mean = layers, grams, sink_sel, raw, z_mean
        self.z: dict[int, torch.Tensor] = {}
        self.got: dict[str, dict[int, torch.Tensor]] = {k: {} for k in ("sink", "slot", "mass", "norm")}

    def hooks(self, model) -> list:
        first = min(self.layers)
        out = [(act_name("resid_pre", first), self.leaf)]
        for l in self.layers:
            out += [(act_name("pattern", l), self.on_pattern(l)), (act_name("z", l), self.on_z(l))]
            if self.raw:
                out.append((f"blocks.{l}.attn.hook_raw_pattern", self.on_raw(l)))
        return out

    @staticmethod
    def leaf(x, hook):
        """The residual stream entering the first attention layer as a leaf needing a gradient."""
        return x.detach().requires_grad_(True)

    def on_pattern(self, l):
        def f(x, hook):
            with torch.no_grad():
                p = x.detach().float()  # (B, H, T, T)
                if isinstance(self.sink_sel, torch.Tensor):
                    sink = (p * self.sink_sel[:, None, None, :].to(p)).sum(-1)
                else:
                    sink = p[..., list(self.sink_sel)].sum(-1)
                self.got["sink"][l] = sink.cpu()
                self.got["slot"][l] = slot_share(x.detach()).cpu()  # zero within a bf16 row's rounding
        return f

    def on_raw(self, l):
        def f(x, hook):
            with torch.no_grad():
                self.got["mass"][l] = x.detach().float().sum(-1).cpu()
        return f

    def on_z(self, l):
        def f(x, hook):
            self.z[l] = x
            with torch.no_grad():
                z = x.detach().float()  # (B, T, H, d)
                sq = torch.einsum("bthd,hde,bthe->bht", z, self.grams[l].to(z.device), z)
                self.got["norm"][l] = sq.clamp_min(0).sqrt().cpu()
            return x  # returned so that the bridge uses this very tensor downstream (the gradient reaches it)
        return f


def sequence_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of each sequence, (B,) float32, from ``logits`` (B, T, V).

    Parameters
    ----------
    logits : torch.Tensor, shape (B, T, V)
    tokens : torch.Tensor, shape (B, T)

    Returns
    -------
    torch.Tensor, shape (B,)
    """
    lg = logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(lg.transpose(1, 2), tokens[:, 1:], reduction="none").sum(-1)


def _grad_batch(model, tokens: torch.Tensor, hk: _BatchHooks) -> dict[str, torch.Tensor]:
    """One batch: forward with the hooks, backward of the summed loss to every head's output; (B, L, H, T) each."""
    with torch.inference_mode(False), torch.enable_grad(), _no_weight_grads(model):
        logits = model.run_with_hooks(tokens, fwd_hooks=hk.hooks(model))
        loss = sequence_losses(logits, tokens).sum()
        missing = [l for l in hk.layers if l not in hk.z or not hk.z[l].requires_grad]
        if missing:
            raise ModelContractError(f"hook_z of layers {missing} did not fire or is not on the path to the loss; the "
                                     "loss effect needs the heads' outputs (`blocks.{l}.attn.hook_z`) to feed the model.")
        grads = torch.autograd.grad(loss, [hk.z[l] for l in hk.layers], allow_unused=True)
    effect, effect_mean = {}, {}
    for i, (l, g) in enumerate(zip(hk.layers, grads)):
        if g is None:  # a layer whose output reaches no loss (cannot happen for a causal LM; kept defensive)
            g = torch.zeros_like(hk.z[l])
        g = g.float()
        effect[l] = -(g * hk.z[l].detach().float()).sum(-1)  # (B, T, H): -dL/dz . z, removal = z set to 0
        if hk.z_mean is not None:  # removal = z set to the head's mean output: -dL/dz . (z - z_mean)
            effect_mean[l] = effect[l] + torch.einsum("bthd,hd->bth", g, hk.z_mean[i].to(g))
    out = {"effect": torch.stack([effect[l].permute(0, 2, 1).cpu() for l in hk.layers], 1)}
    if effect_mean:
        out["effect_mean"] = torch.stack([effect_mean[l].permute(0, 2, 1).cpu() for l in hk.layers], 1)
    for k, per in hk.got.items():
        if per:
            out[k] = torch.stack([per[l] for l in hk.layers], 1)
    return out


def grad_batch_size(T: int) -> int:
    """Sequences per forward + backward batch: about ``DORMANT_GRAD_BATCH_TOKENS`` tokens (the backward pass keeps
    every layer's activations of the batch).

    Parameters
    ----------
    T : int
        The sequence length.

    Returns
    -------
    int
    """
    return max(1, DORMANT_GRAD_BATCH_TOKENS // max(int(T), 1))


def dormant_heads(
    model,
    tokens,
    *,
    sink_positions=(0,),
    eps: float = SINK_EPS,
    quantile: float = DORMANT_QUANTILE,
    layers: Sequence[int] | None = None,
    active: torch.Tensor | None = None,
    mean_ablation: bool = True,
    exact: bool = False,
    batch_size: int | None = None,
    progress: bool = False,
    kind: str | None = None,
) -> DormantHeads:
    """Per head and query: attention on the sink, the head's output norm and its effect on the loss.

    Cost: one forward and one backward pass over the tokens (the backward keeps one batch's activations), plus the
    means' pass with ``mean_ablation``.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``load_model``; a reference model of ``analysis.train``).
    tokens : torch.Tensor, shape (N, T)
        Token ids, T >= max(sink_positions) + 3.
    sink_positions : sequence of int, or torch.Tensor of shape (N, T)
        0-based key positions whose attention counts as the sink (default the first token), or a bool mask of sink
        keys per sequence (statistics then start at query 1).
    eps : float
        A query sinks when more than eps of its attention goes to the sink (the sink metric's 0.3).
    quantile : float
        A query is quiet (inert) when its output norm (|effect|) lies below this quantile of the head's.
    layers : sequence of int, optional
        Attention layers (true indices) to measure; None: all.
    active : torch.Tensor, shape (N, T), optional
        bool, queries known to need a head (``copy_queries`` for the synthetic task).
    mean_ablation : bool
        Also estimate the loss effect of setting the head's output to its mean output (``effect_mean``); costs one
        streamed forward pass for the means (stopping after the last layer measured, no unembedding).
    exact : bool
        Replace the gradient x activation estimates by exact removal (:func:`removal_effects`) for every head: one pass
        per head (two with ``mean_ablation``) over N x (Q + 1) rows, Q the measured queries. Only for small models:
        gradient x activation misses effects where the model is certain of its prediction (the gradient vanishes), e.g.
        the copy positions of the synthetic task.
    batch_size : int, optional
        Sequences per forward + backward (default about 256 tokens: see ``grad_batch_size``).
    progress : bool
        Show a progress bar.
    kind : str, optional
        The input kind, a label ("natural", "random").

    Returns
    -------
    DormantHeads
        Tensors of shape (N, L, H, T) and the per-head table.
    """
    tokens = check_tokens(model, tokens)
    N, T = tokens.shape
    eps, quantile = check_eps(eps), check_quantile(quantile)
    if T < 3:
        raise ValueError(f"T={T} is too short: give T >= 3 tokens (a sink, a query, and a token to predict after it).")
    sinks = check_sink_positions(sink_positions, tokens)
    layers = attention_layers_of(model, layers=layers)
    if not layers:
        raise ModelContractError("this model has no attention layers to measure.")
    if active is not None:
        active = torch.as_tensor(active).bool().cpu()
        if tuple(active.shape) != (N, T):
            raise ValueError(f"active must be an (N, T) bool mask like the tokens {(N, T)}; got {tuple(active.shape)}.")
    grams = output_grams(model, layers)
    raw = all(f"blocks.{l}.attn.hook_raw_pattern" in hook_names(model) for l in layers)
    first = first_query(sinks, eps=eps)
    if first > T - 2:
        raise ValueError(f"T={T} is too short for these sinks and eps = {eps:g}: the statistics use queries {first}..T-2 "
                         f"(0-based: those that see more than k / eps keys, before the last token); give T >= {first + 2}.")
    z_mean = head_means(model, tokens, layers, first=first, batch_size=batch_size) if mean_ablation else None
    bs = batch_size or grad_batch_size(T)
    device = model_device(model)
    chunks: dict[str, list[torch.Tensor]] = {}
    it = batches(tokens, bs)
    if progress:
        from tqdm.auto import tqdm  # optional progress bar

        it = tqdm(it, total=-(-N // bs), desc="forward + backward", leave=False)
    start = 0
    for tk in it:
        sel = sinks if not isinstance(sinks, torch.Tensor) else sinks[start : start + tk.shape[0]].to(device)
        got = _grad_batch(model, tk.to(device), _BatchHooks(layers, grams, sel, raw, z_mean))
        for k, v in got.items():
            chunks.setdefault(k, []).append(v)
        start += tk.shape[0]
    full = {k: torch.cat(v) for k, v in chunks.items()}
    if "sink" not in full or "norm" not in full:
        raise ModelContractError("the attention-pattern or hook_z hooks did not fire; load the model with `load_model`.")
    slot = full.get("slot")
    if exact:
        heads = [(l, h) for l in layers for h in range(model_dims(model).n_heads)]
        kw = {"queries": list(range(first, T - 1)), "first": first, "progress": progress}
        full["effect"] = _on_queries(removal_effects(model, tokens, heads, **kw), len(layers), first, T)
        if z_mean is not None:
            full["effect_mean"] = _on_queries(removal_effects(model, tokens, heads, values=z_mean.flatten(0, 1), **kw),
                                              len(layers), first, T)
    if slot is not None and float(slot[..., first : T - 1].abs().max()) <= 1e-4:
        slot = None  # every row sums to one: no extra slot
    return DormantHeads(layers=layers, sink_attn=full["sink"], out_norm=full["norm"], effect=full["effect"],
                        sink_positions=sinks, eps=eps, quantile=quantile, effect_mean=full.get("effect_mean"),
                        z_mean=z_mean, slot=slot, mass=full.get("mass"), active=active,
                        model_name=getattr(model, "model_name", None), kind=kind, skipped=skipped_note(model),
                        effect_method="exact" if exact else "gradient")


def _on_queries(effects: torch.Tensor, n_layers: int, first: int, T: int) -> torch.Tensor:
    """(L * H, N, Q) exact effects over queries first..T-2 -> (N, L, H, T) float32, zero at the other queries."""
    LH, N, Q = effects.shape
    out = torch.zeros(N, LH, T)
    out[..., first : first + Q] = effects.permute(1, 0, 2).float()
    return out.view(N, n_layers, LH // n_layers, T)


class _HeadMeans(Accumulator):
    """Each head's mean z over the queries first..T-2 of every sequence (``hook_z``), (L, H, d_head) float32."""

    def __init__(self, layers, first: int):
        self.layers, self.first = list(layers), int(first)
        self.sums: dict[int, torch.Tensor] = {}
        self.n = 0

    def hooks(self):
        return {l: {"z": act_name("z", l)} for l in self.layers}

    def update(self, layer: int, acts, batch: Batch) -> None:
        z = acts["z"][:, self.first : -1].double()  # (B, Q, H, d)
        self.sums[layer] = self.sums.get(layer, 0) + z.sum((0, 1)).cpu()
        if layer == self.layers[0]:
            self.n += z.shape[0] * z.shape[1]

    def result(self) -> torch.Tensor:
        return torch.stack([self.sums[l] / self.n for l in self.layers]).float()


def head_means(model, tokens, layers: Sequence[int], *, first: int = 1, batch_size: int | None = None) -> torch.Tensor:
    """Each head's mean output z over the queries ``first``..T-2 (0-based) of every sequence, (L, H, d_head): the
    value mean ablation sets a head's output to. One streamed pass, stopping after the last of ``layers``.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    tokens : torch.Tensor, shape (N, T)
        Token ids.
    layers : sequence of int
        Attention layers (true indices).
    first : int
        The first query averaged over.
    batch_size : int, optional
        Sequences per batch (default: ``analysis.engine.passes.default_batch_size``).

    Returns
    -------
    torch.Tensor, shape (L, H, d_head)
    """
    return run_pass(model, check_tokens(model, tokens), [_HeadMeans(attention_layers_of(model, layers=layers), first)],
                  batch_size=batch_size)[0]


def copy_queries(model, tokens) -> torch.Tensor:
    """(N, T) bool: the queries of the synthetic bigram-copy task (``analysis.train``, Guo et al.'s bigram-backcopy)
    where the next token copies the one before, i.e. whose own token is a trigger at position >= 2 (0-based). The
    triggers are read from the reference model's data config; ValueError for a model without that task.

    Parameters
    ----------
    model : analysis.train.SinkLM
        A reference model of the synthetic bigram-copy task.
    tokens : torch.Tensor, shape (N, T)
        Token ids.

    Returns
    -------
    torch.Tensor, shape (N, T)
        bool.
    """
    data = (getattr(model, "reference_config", None) or {}).get("data", {})
    triggers = data.get("triggers")
    if not triggers:
        raise ValueError("this model was not trained on the synthetic bigram-copy task (no triggers in its reference "
                         "config); give your own (N, T) mask of active queries.")
    tokens = check_tokens(model, tokens).cpu()
    out = torch.isin(tokens, torch.tensor(triggers))
    out[:, :2] = False
    return out


# ----------------------------------------------------------------------------------------------
# Exact removal, and how close gradient x activation comes to it
# ----------------------------------------------------------------------------------------------


class _RowLosses(Accumulator):
    """The summed next-token loss of every row of a pass (needs the logits)."""

    needs_logits = True

    def __init__(self):
        self.kept: list[torch.Tensor] = []

    def hooks(self):
        return {}

    def end_batch(self, batch: Batch, logits) -> None:
        self.kept.append(sequence_losses(logits, batch.tokens).double().cpu())

    def result(self) -> torch.Tensor:
        return torch.cat(self.kept)


def check_queries(queries, T: int, first: int) -> list[int]:
    """Query positions (0-based) in [first, T - 2]; None: all of them.

    Parameters
    ----------
    queries : sequence of int or None
    T : int
        The sequence length.
    first : int
        The first query the statistics use.

    Returns
    -------
    list of int
    """
    if queries is None:
        return list(range(first, T - 1))
    qs = sorted({int(q) for q in queries})
    bad = [q for q in qs if not first <= q <= T - 2]
    if not qs or bad:
        raise ValueError(f"queries must lie in [{first}, {T - 2}] (0-based: after the sink, before the last token); "
                         f"got {bad or 'none'}.")
    return qs


def removal_effects(model, tokens, heads, *, queries: Sequence[int] | None = None, first: int = 1,
                    values: torch.Tensor | None = None, resid: dict | None = None, batch_size: int | None = None,
                    progress: bool = False) -> torch.Tensor:
    """The exact change of each sequence's summed next-token loss (nats) when one head's output at one query is
    removed (z_t^h set to 0, or to ``values[i]`` (n_heads, d_head) for the i-th head: its mean output for mean
    ablation, ``head_means``), (n_heads, N, Q) float64.

    One pass per head over N x (Q + 1) rows: each sequence unchanged, then once per query with that query's output
    removed, so every (sequence, query) is exact on its own. Where the model can resume (``passes.can_resume``) the
    pass starts at the head's block from the residual entering it: from ``resid`` ({block: (N, T, D)}, e.g.
    ``Profile.resid``: the last kept block at or before it) or from one capturing pass. ``queries``: 0-based
    positions in [first, T - 2] (default all). Cost: n_heads x (Q + 1) passes' worth of tokens; keep N and T small.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    tokens : torch.Tensor, shape (N, T)
        Token ids (keep N and T small).
    heads : sequence of (int, int)
        (true layer, query head) pairs.
    queries : sequence of int, optional
        0-based positions in [first, T - 2] (default all).
    first : int
        The first query position allowed.
    values : torch.Tensor, shape (n_heads, d_head), optional
        What each head's output is set to (default 0).
    resid : dict of int to torch.Tensor, optional
        {block: the residual entering it, (N, T, D)}.
    batch_size : int, optional
        Sequences per batch (default: ``analysis.engine.passes.default_batch_size``).
    progress : bool
        Show a progress bar over heads.

    Returns
    -------
    torch.Tensor, shape (n_heads, N, Q)
        float64, nats.
    """
    tokens = check_tokens(model, tokens)
    N, T = tokens.shape
    pairs = check_heads(model, heads)
    qs = check_queries(queries, T, first)
    R = len(qs) + 1
    rows = tokens.repeat_interleave(R, 0)
    layers = sorted({l for l, _ in pairs})
    if resid is None and can_resume(model):
        resid = run_pass(model, tokens, [ResidCapture([l for l in layers if l > 0])])[0] if any(layers) else {}
    if values is not None and (values.ndim != 2 or values.shape[0] != len(pairs)):
        raise ValueError(f"values must hold one output (d_head,) per head: shape ({len(pairs)}, d_head); got "
                         f"{tuple(values.shape)}.")
    qpos = torch.tensor([-1] + qs)  # row r of a sequence removes query qpos[r] (-1: none)
    vocab = int(getattr(getattr(model, "cfg", None), "d_vocab", None) or 50_000)
    bs = batch_size or min(512, max(1, 2**26 // (T * vocab)))  # rows whose logits take at most 256 MiB
    out = []
    for i, (l, h) in enumerate(pairs):
        base = resume_from(resid, l) if can_resume(model) else None
        resume = None if base is None else Resume(base.layer, base.resid.repeat_interleave(R, 0))
        state = {"offset": 0}

        def on_start(batch, state=state):
            state["offset"] = batch.offset

        new = 0.0 if values is None else values[i]

        def remove(x, hook, h=h, state=state, new=new):
            idx = torch.arange(state["offset"], state["offset"] + x.shape[0]) % R
            keep = idx > 0
            if not keep.any():
                return x
            x = x.clone()
            b = torch.nonzero(keep).squeeze(1)
            x[b.to(x.device), qpos[idx[keep]].to(x.device), h] = new if values is None else new.to(x)
            return x

        losses = run_pass(model, rows, [_RowLosses()], fwd_hooks=[(act_name("z", l), remove)], batch_size=bs,
                        on_batch_start=on_start, resume=resume, progress=progress)[0].view(N, R)
        out.append(losses[:, 1:] - losses[:, :1])
    return torch.stack(out)


@dataclass
class AttributionCheck(Result):
    """Gradient x activation against exact removal, per (head, sequence, query).

    Attributes
    ----------
    heads : list of (int, int)
        The (layer, head) pairs checked.
    queries : list of int, length Q
        The 0-based query positions.
    exact : torch.Tensor, shape (n_heads, N, Q)
        The exact loss change (nats) when the head's output at the query is removed.
    estimate : torch.Tensor, shape (n_heads, N, Q)
        The gradient x activation estimate of the same.
    ablation : {"zero", "mean"}
        The output set to 0, or to the head's mean output.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    """

    heads: list[tuple[int, int]]
    queries: list[int]
    exact: torch.Tensor
    estimate: torch.Tensor
    ablation: str = "zero"
    model_name: str | None = None
    kind: str | None = None

    @property
    def n_samples(self) -> int:
        return int(self.exact.shape[1])

    @staticmethod
    def _stats(x: np.ndarray, y: np.ndarray) -> dict:
        """x exact, y estimate (1-D)."""
        from scipy import stats  # lazy for import time: scipy.stats costs ~0.5 s on `import analysis`

        diff = np.abs(y - x)
        big = np.abs(x) > 1e-3
        out = {"n": int(x.size), "mean_abs_exact": float(np.abs(x).mean()), "mean_abs_error": float(diff.mean()),
               "max_abs_error": float(diff.max()),
               "relative_error": float(diff.sum() / max(np.abs(x).sum(), 1e-12)),
               "sign_agreement": float((np.sign(x[big]) == np.sign(y[big])).mean()) if big.any() else None}
        ok = x.size >= 3 and np.ptp(x) > 0 and np.ptp(y) > 0
        out["pearson_r"] = float(stats.pearsonr(x, y)[0]) if ok else None
        out["spearman_rho"] = float(stats.spearmanr(x, y)[0]) if ok else None
        out["spearman_abs"] = float(stats.spearmanr(np.abs(x), np.abs(y))[0]) if ok else None
        return out

    def table(self) -> pd.DataFrame:
        """One row per head: Pearson r, Spearman rho (signed and of |.|), mean |exact|, mean and max |error|, the
        relative error sum |estimate - exact| / sum |exact|, and the sign agreement where |exact| > 1e-3 nats."""
        rows = []
        for i, (l, h) in enumerate(self.heads):
            rows.append({"layer": l, "head": h, **self._stats(self.exact[i].flatten().numpy(),
                                                               self.estimate[i].flatten().numpy())})
        return pd.DataFrame(rows)

    def pooled(self) -> dict:
        return self._stats(self.exact.flatten().numpy(), self.estimate.flatten().numpy())

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {"heads": self.table()}

    def findings(self) -> list[str]:
        p = self.pooled()
        heads = ", ".join(f"{l}.{h}" for l, h in self.heads)
        if p["pearson_r"] is None:
            return [f"Exact removal of heads {heads} changes the loss by {p['mean_abs_exact']:.2g} nats on average; the "
                    "correlation with the gradient x activation estimate is undefined (constant values)."]
        how = "set to zero" if self.ablation == "zero" else "set to its mean output"
        return [f"Gradient x activation estimates the exact loss change of one head's output at one query {how} with Pearson "
                f"r = {p['pearson_r']:.3f} (Spearman rho = {p['spearman_rho']:.3f}, of the magnitudes "
                f"{p['spearman_abs']:.3f}) over {p['n']} (sequence, query) pairs of heads {heads}; its mean absolute "
                f"error is {p['mean_abs_error']:.2g} nats against a mean |exact change| of {p['mean_abs_exact']:.2g} "
                f"(relative error {p['relative_error']:.2f})."]

    def to_dict(self) -> dict:
        return jsonable({**self.header(), "ablation": self.ablation, "heads": [list(h) for h in self.heads],
                         "queries": self.queries,
                         "pooled": self.pooled(), "per_head": self.table(), "text": self.text()})


def attribution_check(model, tokens, heads, *, ablation: str = "zero", result: DormantHeads | None = None,
                      queries: Sequence[int] | None = None, resid: dict | None = None, batch_size: int | None = None,
                      kind: str | None = None) -> AttributionCheck:
    """Compare the gradient x activation estimate of :func:`dormant_heads` with exact removal
    (:func:`removal_effects`) on ``heads`` ((layer, head) pairs) over ``tokens`` (N, T; keep them small: one pass of
    N x (Q + 1) rows per head). ``ablation``: "zero" (``effect``) or "mean" (``effect_mean``, the output set to the
    result's ``z_mean``). ``result``: a ``DormantHeads`` of these very tokens (computed when None).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    tokens : torch.Tensor, shape (N, T)
        Token ids (keep them small).
    heads : sequence of (int, int)
        (true layer, query head) pairs.
    ablation : {"zero", "mean"}
    result : DormantHeads, optional
        Of these very tokens (computed when None).
    queries : sequence of int, optional
        0-based query positions (default all the statistics use).
    resid : dict of int to torch.Tensor, optional
        {block: the residual entering it, (N, T, D)}.
    batch_size : int, optional
        Sequences per batch (default: ``analysis.engine.passes.default_batch_size``).
    kind : str, optional
        The input kind, a label ("natural", "random").

    Returns
    -------
    AttributionCheck
    """
    if ablation not in ("zero", "mean"):
        raise ValueError(f"ablation must be 'zero' or 'mean'; got {ablation!r}.")
    tokens = check_tokens(model, tokens)
    pairs = check_heads(model, heads)
    if result is None:
        result = dormant_heads(model, tokens, layers=sorted({l for l, _ in pairs}), kind=kind)
    elif tuple(result.sink_attn.shape[::3]) != tuple(tokens.shape):
        raise ValueError(f"the result was computed on {result.n_samples} sequences of T = {result.T}; these tokens are "
                         f"{tuple(tokens.shape)}: pass the result of these tokens, or none.")
    missing = [l for l, _ in pairs if l not in result.layers]
    if missing:
        raise ValueError(f"layers {missing} are not in the result (it holds {result.layers}).")
    if ablation == "mean" and result.effect_mean is None:
        raise ValueError("the result has no mean-ablation effects; compute it with dormant_heads(..., mean_ablation=True).")
    first = first_query(result.sink_positions, eps=result.eps)
    qs = check_queries(queries, tokens.shape[1], first)
    values = torch.stack([result.z_mean[result.pos(l), h] for l, h in pairs]) if ablation == "mean" else None
    exact = removal_effects(model, tokens, pairs, queries=qs, first=first, values=values, resid=resid,
                            batch_size=batch_size)
    effect = result.effect if ablation == "zero" else result.effect_mean
    est = torch.stack([effect[:, result.pos(l), h][:, qs] for l, h in pairs]).double()
    return AttributionCheck(pairs, qs, exact, est, ablation, getattr(model, "model_name", None), kind or result.kind)


__all__ = ["DormantHeads", "AttributionCheck", "dormant_heads", "removal_effects", "attribution_check", "copy_queries",
           "head_means", "output_grams", "sequence_losses", "check_heads", "check_sink_positions"]
