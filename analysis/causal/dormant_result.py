"""The result of :func:`analysis.causal.dormant_heads.dormant_heads`: ``DormantHeads``, per (sample, attention layer,
query head, query) the attention on the sink, the head's output norm and its effect on the loss, with the per-head
table, the per-layer table, the verdicts and the findings in words; and the input checks the pass and the removal
share (sink positions, the first query the statistics use, the quantile).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from analysis.core.defaults import DORMANT_MIN_QUERIES, DORMANT_MIN_SHARE, DORMANT_QUANTILE, SINK_EPS
from analysis.core.io import jsonable
from analysis.core.results import LayerAxis, Result, layers_text

from analysis.core.defaults import DORMANT_LAYER_RHO  # a layer's heads go dormant with the sink below this median rho

SIGNAL_WORDS = {
    "sink": "attention on the sink",
    "slot": "attention on the extra slot",
    "mass": "total attention weight on the input tokens",
}


# ----------------------------------------------------------------------------- Checks


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
    if not isinstance(sink_positions, (list, tuple, range, set)):
        sink_positions = torch.as_tensor(sink_positions).flatten().tolist()
    pos = sorted({int(p) for p in sink_positions})
    if not pos:
        raise ValueError(
            "sink_positions is empty; give 0-based key positions (0 is the first token) or an (N, T) mask."
        )
    bad = [p for p in pos if not 0 <= p < T - 2]
    if bad:
        raise ValueError(
            f"sink positions {bad} lie outside [0, T - 3 = {T - 3}]: a sink needs at least one later query "
            "whose output can change a prediction (0 is the first token)."
        )
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


# ----------------------------------------------------------------------------- The result


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
        self._summary: tuple | None = None  # (the settings it was built with, the summary)

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
            cols["rho_mass_norm"] = rowwise_spearman(m, norm)
            cols["rho_mass_effect"] = rowwise_spearman(m, effs["effect"])
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
        for name in ("sink_attn", "out_norm", "effect", "effect_mean", "slot", "mass"):
            if (x := getattr(self, name)) is not None:
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
        key = (self.eps, self.quantile, self.min_share, self.min_queries)  # built once per setting: the verdicts,
        if self._summary is None or self._summary[0] != key:  # findings and JSON each read it
            self._summary = (key, self._build_summary())
        return copy.deepcopy(self._summary[1])

    def _build_summary(self) -> dict:
        t, sig = self.head_table(), self.signal
        p, tag, other = _WORDS[sig]
        heads, mixed = self.sinking_heads(), self.mixed_heads()
        n = len(self.query_positions) * self.n_samples
        out = {
            "signal": sig,
            "effect_method": self.effect_method,
            "eps": self.eps,
            "quantile": self.quantile,
            "n_heads": len(t),
            "n_sinking_heads": len(heads),
            "n_mixed_heads": len(mixed),
            "n_always_sinking": int(((1 - heads[self._share_column()]) * n < self.min_queries).sum()),
            "queries_per_head": n,
        }
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
            out["dormant_layers"] = [int(l) for l in lt.layer[lt.median_rho_norm <= DORMANT_LAYER_RHO]]
            out["other_sinking_layers"] = [int(l) for l in lt.layer[lt.median_rho_norm > DORMANT_LAYER_RHO]]
        if self.has_mass:
            out["median_rho_mass_norm"] = _median(t["rho_mass_norm"])
            out["share_rho_mass_norm_positive"] = float((t["rho_mass_norm"] > 0).mean())
            out["quiet_mass"], out["loud_mass"] = float(t["quiet_mass"].mean()), float(t["loud_mass"].mean())
        if self.active is not None and t["abs_effect_active"].notna().any():
            best = t.loc[t["abs_effect_active"].idxmax()]  # the head the task needs most at the active queries
            out["copy_head"] = {
                "layer": int(best["layer"]),
                "head": int(best["head"]),
                **{k: float(best[k]) for k in t.columns if k.endswith("_active") or k.endswith("_inactive")},
            }
        return out

    def layer_table(self) -> pd.DataFrame:
        """One row per attention layer with a mixed head (``mixed_heads``): ``n_mixed_heads`` and the medians over
        them of the attention on the sink (``attn``; on the slot in slot models), ``median_rho_norm``,
        ``median_rho_effect`` (``median_rho_effect_mean``), ``quiet_if_sinking`` and ``quiet_if_other``."""
        p, tag, other = _WORDS[self.signal]
        heads = self.mixed_heads()
        cols = {
            f"{self.signal}_attn": "attn",
            **{f"rho_{p}{m}": f"median_rho_{m}" for m in ("norm",) + tuple(self.effects)},
            f"quiet_if_{tag}": "quiet_if_sinking",
            f"quiet_if_{other}": "quiet_if_other",
        }
        g = heads.groupby("layer")[list(cols)].median().rename(columns=cols)
        g.insert(0, "n_mixed_heads", heads.groupby("layer").size())
        return g.reset_index()

    def verdict(self, measure: str = "norm") -> str:
        """Whether the queries that sink a head's attention are its dormant ones by ``measure``: "norm" (quiet),
        "effect" (inert under zero removal) or "effect_mean" (inert under mean removal), over the mixed heads. "yes":
        the median Spearman rho is at most ``DORMANT_LAYER_RHO`` (-0.3) and sinking queries are quiet (inert) at least 0.2
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
        if rho <= DORMANT_LAYER_RHO and gap >= 0.2:
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
        loss = (
            [
                f"{words[self.verdict('effect_mean')]} when the head's output is set to its mean (median rho = "
                f"{s['median_rho_effect_mean']:.2f})"
            ]
            if self.effect_mean is not None
            else []
        )
        loss.append(f"{words[self.verdict('effect')]} when it is set to zero ({s['median_rho_effect']:.2f})")
        return (
            f"By output norm (median rho = {s['median_rho_norm']:.2f}) the queries that sink a head's attention are "
            f"{words[self.verdict('norm')]} the ones for which the head is dormant"
            + (" (the sink gates it off)" if self.verdict("norm") != "no" else "")
            + "; by loss effect they are "
            + " and ".join(loss)
            + "."
        )

    def _mixed_findings(self, s: dict, how: str) -> list[str]:
        """The findings over the heads that sink on some queries and not on others (``s``: ``summary()``)."""
        parts = [
            f"Over the {s['n_mixed_heads']} heads that sink on some queries and not on others (at least "
            f"{self.min_queries} of each), the head's output norm falls as its {SIGNAL_WORDS[s['signal']]} rises in "
            f"{_pct(s['share_rho_norm_negative'])} of them (median Spearman rho = {s['median_rho_norm']:.2f})."
        ]
        if s["dormant_layers"] and s["other_sinking_layers"]:
            lt = self.layer_table().set_index("layer")
            parts.append(
                f"The link lives in {layers_text(s['dormant_layers'])} (median rho over their heads "
                f"{_span(lt.loc[s['dormant_layers'], 'median_rho_norm'])}), not in {layers_text(s['other_sinking_layers'])} "
                f"({_span(lt.loc[s['other_sinking_layers'], 'median_rho_norm'])})."
            )
        mean = (
            f" and in {_pct(s['share_rho_effect_mean_negative'])} with it set to the head's mean output (median "
            f"rho = {s['median_rho_effect_mean']:.2f})"
            if self.effect_mean is not None
            else ""
        )
        parts.append(
            f"Its effect on the loss when removed at that query ({how}) falls with it in "
            f"{_pct(s['share_rho_effect_negative'])} of them with the output set to zero (median rho = "
            f"{s['median_rho_effect']:.2f}){mean}."
        )
        qw = "median" if abs(self.quantile - 0.5) < 1e-9 else f"{100 * self.quantile:.0f}th percentile"
        mean = (
            f", and in {_pct(s['inert_mean_if_sinking'])} against {_pct(s['inert_mean_if_other'])} with it set to "
            "its mean"
            if "inert_mean_if_sinking" in s
            else ""
        )
        parts.append(
            f"In the median head a sinking query is quiet (output norm below the head's {qw}) in "
            f"{_pct(s['quiet_if_sinking'])} of cases against {_pct(s['quiet_if_other'])} for the other queries; it is "
            f"inert (|loss effect| below the head's {qw}) in {_pct(s['inert_if_sinking'])} against "
            f"{_pct(s['inert_if_other'])} with the output set to zero{mean} ({_pct(self.quantile)} each without any "
            "link)."
        )
        parts.append(self.verdict_text())
        return parts

    def findings(self) -> list[str]:
        s = self.summary()
        name = self.model_name or "this model"
        sinks = "the extra slot" if s["signal"] == "slot" else _positions_words(self.sink_positions)
        how = "gradient x activation" if self.effect_method == "gradient" else "exact removal"
        parts = []
        if not s["n_sinking_heads"]:
            parts.append(
                f"No head of {name} puts more than {self.eps:g} of a query's attention on {sinks} for at least "
                f"{100 * self.min_share:.0f}% of its queries, so no sink gates a head here."
            )
        else:
            always = (
                f"; {s['n_always_sinking']} of them sink on nearly every query (fewer than {self.min_queries} "
                "other queries)"
                if s["n_always_sinking"]
                else ""
            )
            parts.append(
                f"In {name}, {s['n_sinking_heads']} of {s['n_heads']} heads put more than {self.eps:g} of a "
                f"query's attention on {sinks} for at least {100 * self.min_share:.0f}% of their queries{always}."
            )
        if s["n_mixed_heads"]:
            parts += self._mixed_findings(s, how)
        elif s["n_sinking_heads"]:
            parts.append(
                f"No head sinks on some queries and not on others (at least {self.min_queries} of each), so "
                "whether sinking marks the dormant queries cannot be told query by query here."
            )
        if self.has_mass and not self.has_slot:
            parts.append(
                f"The weights that multiply the values need not sum to one here: a query's total weight on the input "
                f"tokens rises with the head's output norm in {_pct(s['share_rho_mass_norm_positive'])} of the heads "
                f"(median Spearman rho = {s['median_rho_mass_norm']:.2f}), and the quiet queries give the tokens a total "
                f"weight of {s['quiet_mass']:.3f} against {s['loud_mass']:.3f} for the others: a head silences itself by "
                "small scores on every key rather than by a sink."
            )
        if "copy_head" in s:
            c = s["copy_head"]
            key = "slot_attn" if s["signal"] == "slot" else "sink_attn"
            mass = (
                f", with a total weight of {c['mass_active']:.3f} against {c['mass_inactive']:.3f}"
                if "mass_active" in c and not self.has_slot
                else ""
            )
            parts.append(
                f"At the positions where the task needs a head (the copy positions), the head that matters most there "
                f"({c['layer']}.{c['head']}, |loss effect| {c['abs_effect_active']:.3g} nats against "
                f"{c['abs_effect_inactive']:.3g} elsewhere, {how}) puts {c[f'{key}_active']:.2f} of its attention on "
                f"{sinks} against {c[f'{key}_inactive']:.2f} elsewhere and writes an output of norm "
                f"{c['norm_active']:.3g} against {c['norm_inactive']:.3g}{mass}."
            )
        return parts + ([self.skipped] if self.skipped else [])

    table_fields = ("heads=head_table",)

    def to_dict(self) -> dict:
        """Header, the per-head table, the pooled summary, the verdicts and the text (no per-query tensors)."""
        sinks = (
            self.sink_positions.int().tolist()
            if isinstance(self.sink_positions, torch.Tensor)
            else list(self.sink_positions)
        )
        verdicts = {m: self.verdict(m) for m in ("norm",) + tuple(self.effects)}
        return jsonable(
            {
                **self.header(),
                "T": self.T,
                "layers": self.layers,
                "sink_positions": sinks,
                "query_positions": [self.query_positions[0], self.query_positions[-1]],
                "eps": self.eps,
                "quantile": self.quantile,
                "verdict": verdicts,
                "summary": self.summary(),
                "heads": self.head_table(),
                "text": self.text(),
                **({"skipped": self.skipped} if self.skipped else {}),
            }
        )


SPREAD_KEYS = (
    "n_sinking_heads",
    "n_mixed_heads",
    "median_rho_norm",
    "quiet_if_sinking",
    "quiet_if_other",
    "median_rho_effect",
    "median_rho_effect_mean",
    "inert_if_sinking",
    "inert_if_other",
    "inert_mean_if_sinking",
    "inert_mean_if_other",
)


def seed_spread(results) -> tuple[pd.DataFrame, str]:
    """The pooled findings (``summary``) of one model on several probe seeds, a row per seed, with the layers where
    the mixed heads go dormant with the sink; and a sentence: on how many seeds heads sink on some queries and not on
    others (the mixed heads the findings are about), or that no seed has one, so there is nothing to spread.

    Parameters
    ----------
    results : dict of int to DormantHeads
        Probe seed -> ``dormant_heads`` on that seed's probe (one model).

    Returns
    -------
    (pandas.DataFrame, str)
        The table (index: seed; the medians empty on a seed without a mixed head) and the sentence.
    """
    results = dict(results)
    if not results or not all(isinstance(r, DormantHeads) for r in results.values()):
        raise TypeError("results must map each probe seed to its dormant_heads result (a DormantHeads), at least one.")
    table = pd.DataFrame({seed: {k: r.summary().get(k) for k in SPREAD_KEYS} for seed, r in results.items()}).T
    table["dormant_layers"] = [r.summary().get("dormant_layers", []) for r in results.values()]
    table.index.name = "seed"
    mixed = table.n_mixed_heads.astype(int)
    name = next(iter(results.values())).model_name or "the model"
    if not mixed.any():
        return table, (
            f"No head of {name} sinks on some queries and not on others on any of the {len(results)} probe "
            f"seeds (sinking heads per seed: {table.n_sinking_heads.astype(int).tolist()}), so there is no "
            "per-query contrast to spread over seeds."
        )
    missing = [int(s) for s in mixed.index[mixed == 0]]
    return table, (
        f"Heads that sink on some queries and not on others, per probe seed: {mixed.tolist()} (seeds "
        f"{[int(s) for s in mixed.index]})"
        + (f"; seeds {missing} have none, their medians are empty." if missing else ".")
    )


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


def _positions_words(sink_positions) -> str:
    if isinstance(sink_positions, torch.Tensor):
        return "the sink keys"
    pos = list(sink_positions)
    if pos == [0]:
        return "the first token"
    return "the tokens at positions " + ", ".join(str(p) for p in pos) + " (0-based)"


__all__ = [
    "DormantHeads",
    "DORMANT_LAYER_RHO",
    "SIGNAL_WORDS",
    "SPREAD_KEYS",
    "seed_spread",
    "check_sink_positions",
    "first_query",
    "check_quantile",
    "rowwise_pearson",
    "rowwise_spearman",
]
