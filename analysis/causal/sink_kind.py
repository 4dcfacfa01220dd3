"""The sink's kind: is a sink head a nop (it parks on a null token to write nothing) or a broadcast (the sink holds
something every query reads)?

Fesser, Jacobs, Fel et al. ("A Unifying View of Attention Sinks: Two Algorithms, Two Solutions", arXiv 2606.08105)
separate the two with the same attention picture: a nop sink's value is negligible, a broadcast sink makes the head's
outputs low-rank. For every attention layer and query head, on the queries that *sink* (A_t1 > eps, from query
``first_query`` on, where uniform attention no longer counts as sinking), reduced inside the hooks (``hook_v``,
``hook_z``, ``hook_pattern`` through ``AttentionWeights``: no T x T map is built, so it runs on every backend):

- ``value_ratio``: |v_1| / mean |v_j| (j > 1), the sink value's norm against the others' (the nop trace);
- ``out_ratio``: the mean norm of the head's output z_t W_O on sinking queries against its mean on the other queries
  (a nop writes less when it sinks, a broadcast more);
- ``pr``: the participation ratio (sum s^2)^2 / sum s^4 of the singular values of the head's outputs over the
  sinking queries of one sequence, averaged over the sequences with at least ``KIND_MIN_QUERIES`` of them (a
  broadcast writes one vector per sequence: about 1); pooled over sequences it does not separate the kinds;
- ``cos``: the mean cosine of those outputs to their mean direction within the sequence (1: one direction).

A sink head (mean alpha_1 > eps over the probe) is called **nop** where its nop traces hold (``value_ratio`` below
``KIND_VALUE_RATIO``, ``out_ratio`` below ``KIND_OUT_RATIO``), **broadcast** where its broadcast traces hold
(``value_ratio`` and ``out_ratio`` above those, ``pr`` below ``KIND_BROADCAST_PR``, ``cos`` above
``KIND_BROADCAST_COS``), and **mixed** otherwise. The thresholds were chosen on the ground-truth reference models
(``nop-task-s0..s2``, ``broadcast-task-s0..s2``, ``docs/training.md``), never on a pretrained model
(``analysis/core/defaults.py`` says how).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from analysis.causal.dormant_heads import head_gram, output_grams
from analysis.causal.dormant_result import first_query
from analysis.core.defaults import (
    KIND_BROADCAST_COS,
    KIND_BROADCAST_PR,
    KIND_MIN_QUERIES,
    KIND_OUT_RATIO,
    KIND_VALUE_RATIO,
    SINK_EPS,
    TINY,
)
from analysis.core.results import Result, layers_text
from analysis.engine.attention import attention_of
from analysis.engine.passes import Reduction, SummingAccumulator, run_pass
from analysis.model.hooks import model_facts
from analysis.model.contract import SinkModel
from analysis.model.nnsight_model import TraceWeight, weights_in_trace
from analysis.model.hooks import act_name, check_attention_layers, check_tokens, kv_view, per_query_head, skipped_note
from analysis.sinks.metric import check_eps

KINDS = ("nop", "broadcast", "mixed")
# each per-head number, in the tables' order
_NUMBERS = ("alpha_1", "sinking_share", "value_ratio", "out_ratio", "pr", "cos")


def call_kind(value_ratio: float, out_ratio: float, pr: float, cos: float) -> str:
    """A sink head's kind from its four traces, by the thresholds of ``analysis.core.defaults``.

    Parameters
    ----------
    value_ratio, out_ratio, pr, cos : float
        As :class:`SinkKinds` holds them; ``out_ratio`` NaN where the head sinks on every query (no other query to
        compare: that trace is left out), ``pr`` and ``cos`` NaN where no sequence has ``KIND_MIN_QUERIES`` sinking
        queries (the broadcast traces then fail).

    Returns
    -------
    str
        "nop", "broadcast" or "mixed".
    """
    small_out = math.isnan(out_ratio) or out_ratio < KIND_OUT_RATIO
    large_out = math.isnan(out_ratio) or out_ratio > KIND_OUT_RATIO
    nop = value_ratio < KIND_VALUE_RATIO and small_out
    one_vector = (not math.isnan(pr)) and pr < KIND_BROADCAST_PR and cos > KIND_BROADCAST_COS
    broadcast = value_ratio > KIND_VALUE_RATIO and large_out and one_vector
    return "nop" if nop and not broadcast else "broadcast" if broadcast and not nop else "mixed"


@dataclass
class SinkKinds(Result):
    """Per (layer, query head): the traces of a nop and of a broadcast sink, and each sink head's kind.

    Tensors are (L, H), indexed by position in ``layers`` (the true indices of the attention layers measured).

    Attributes
    ----------
    layers : list of int, length L
    alpha_1 : torch.Tensor, shape (L, H)
        Mean attention on the first token over the probe; a sink head has alpha_1 > eps.
    sinking_share : torch.Tensor, shape (L, H)
        The share of queries (from ``first``) that sink (A_t1 > eps).
    value_ratio : torch.Tensor, shape (L, H)
        |v_1| / mean |v_j| (j > 1) of the head's KV head.
    out_ratio : torch.Tensor, shape (L, H)
        Mean |z_t W_O| on sinking queries over the mean on the others (NaN where either set is empty).
    pr, cos : torch.Tensor, shape (L, H)
        Within one sequence, the participation ratio of the outputs over sinking queries and their mean cosine to
        their mean direction, averaged over the sequences with at least ``min_queries`` sinking queries (NaN: none).
    n_seqs : torch.Tensor, shape (L, H)
        How many sequences ``pr`` and ``cos`` average.
    eps : float
        The sink threshold.
    first : int
        The first query position (0-based) measured.
    min_queries : int
        Sinking queries a sequence needs for ``pr`` and ``cos``.
    n_samples, T : int
    model_name, kind : str or None
    skipped : str
        The layers left out, in one sentence ("" when none).
    """

    layers: list
    alpha_1: torch.Tensor
    sinking_share: torch.Tensor
    value_ratio: torch.Tensor
    out_ratio: torch.Tensor
    pr: torch.Tensor
    cos: torch.Tensor
    n_seqs: torch.Tensor
    eps: float
    first: int
    min_queries: int
    n_samples: int
    T: int
    model_name: str | None = None
    kind: str | None = None
    skipped: str = ""

    @property
    def heads(self) -> pd.DataFrame:
        """One row per (layer, head): its numbers, ``sink`` and ``sink_kind`` (None for a head that does not sink)."""
        L, H = self.alpha_1.shape
        df = pd.DataFrame(
            {
                "layer": np.repeat(self.layers, H),
                "head": np.tile(np.arange(H), L),
                **{k: getattr(self, k).flatten().double().numpy() for k in _NUMBERS},
                "n_seqs": self.n_seqs.flatten().long().numpy(),
            }
        )
        df["sink"] = df["alpha_1"] > self.eps
        df["sink_kind"] = [
            call_kind(r.value_ratio, r.out_ratio, r.pr, r.cos) if r.sink else None for r in df.itertuples()
        ]
        return df

    def layer_table(self) -> pd.DataFrame:
        """One row per layer: its sink heads and how many of each kind."""
        df = self.heads
        out = df.groupby("layer", sort=False).agg(n_heads=("head", "size"), sink_heads=("sink", "sum"))
        for k in KINDS:
            out[k] = df.assign(x=df["sink_kind"] == k).groupby("layer", sort=False)["x"].sum()
        return out.reset_index().astype({c: int for c in ("sink_heads", *KINDS)})

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {"layers": self.layer_table(), "sink_heads": self.heads[lambda d: d["sink"]].drop(columns="sink")}

    def shares(self) -> dict:
        """The share of sink heads of each kind (None where no head sinks) and their number: the atlas' ``kinds``."""
        kinds = self.heads["sink_kind"].dropna()
        n = len(kinds)
        return {**{k: (float((kinds == k).mean()) if n else None) for k in KINDS}, "n_sink_heads": int(n)}

    def findings(self) -> list[str]:
        """How many sink heads of each kind, in which layers, and the traces that call them."""
        s, df = self.shares(), self.heads[lambda d: d["sink"]]
        crit = (
            f"A sink head has mean alpha_1 > {self.eps} and a query sinks when A_t1 > {self.eps}; a head is nop "
            f"where |v_1| / |v_j| < {KIND_VALUE_RATIO} and its output on sinking queries < {KIND_OUT_RATIO}x the "
            "rest, broadcast where both are above and, within a sequence, its outputs on sinking queries have a "
            f"participation ratio < {KIND_BROADCAST_PR} and a mean cosine to one direction > {KIND_BROADCAST_COS}, "
            "mixed otherwise (thresholds chosen on the ground-truth models nop-task and broadcast-task)."
        )
        if not s["n_sink_heads"]:
            return [f"No head sinks (mean alpha_1 > {self.eps}), so no sink has a kind here.", crit]
        out = [
            f"Of {s['n_sink_heads']} sink heads, "
            + ", ".join(f"{int(round(s[k] * s['n_sink_heads']))} are {k} ({100 * s[k]:.0f}%)" for k in KINDS)
            + "."
        ]
        for k in KINDS:
            sub = df[df["sink_kind"] == k]
            if len(sub):
                out.append(
                    f"The {k} heads sit in {layers_text(sorted(set(sub['layer'])))}: median "
                    f"|v_1| / |v_j| {sub['value_ratio'].median():.2f}, output on sinking queries "
                    f"{_median(sub['out_ratio'])}x the rest, participation ratio within a sequence "
                    f"{_median(sub['pr'])}, cosine to one direction {_median(sub['cos'])}."
                )
        out.append(crit)
        return out + ([self.skipped] if self.skipped else [])

    def thresholds(self) -> dict:
        """The thresholds the kinds were read with: the run's eps, first query and query count, and the defaults'."""
        return {
            "eps": self.eps,
            "first_query": self.first,
            "min_queries": self.min_queries,
            "value_ratio": KIND_VALUE_RATIO,
            "out_ratio": KIND_OUT_RATIO,
            "pr": KIND_BROADCAST_PR,
            "cos": KIND_BROADCAST_COS,
        }

    json_fields = ("T", "layers", "thresholds", "shares", "by_layer=layer_table", "heads", "skipped?")


def _median(x: pd.Series) -> str:
    x = x.dropna()
    return f"{x.median():.2f}" if len(x) else "undefined"


class SinkKindAccumulator(SummingAccumulator):
    """Per layer and query head, running sums on the layer's device of alpha_1, the first and other values' norms,
    the output norms on sinking and other queries, and the within-sequence participation ratio and cosine.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names and per-head ``W_O``.
    layers : sequence of int
        Attention layers (true indices).
    T : int
        The sequence length.
    eps : float
        The sink threshold.
    kind : str, optional
        The input kind, a label.
    """

    def __init__(self, model, layers, T: int, *, eps: float = SINK_EPS, kind: str | None = None):
        super().__init__(layers)
        dims = model_facts(model).dims
        self.model, self.kind, self.H, self.K = model, kind, dims.n_heads, dims.n_kv_heads
        # |z W_O| = |z R|, R (H, d, d): from the weights here, or in the trace where they stay next to the model
        self.roots = None if weights_in_trace(model) else gram_roots(output_grams(model, self.layers))
        self.T, self.eps, self.first = int(T), float(eps), first_query((0,), eps=eps)
        self.min_queries = KIND_MIN_QUERIES

    def hooks(self):
        return {
            l: {"v": act_name("v", l), "z": act_name("z", l), "pattern": act_name("pattern", l)} for l in self.layers
        }

    def reduction(self, layer: int) -> Reduction:
        return Reduction(
            kind_stats,
            {
                "R": None if self.roots is None else self.roots[layer],
                "W_O": TraceWeight("W_O", layer) if self.roots is None else None,
                "n_heads": self.H,
                "n_kv_heads": self.K,
                "eps": self.eps,
                "first": self.first,
                "min_queries": self.min_queries,
            },
        )

    def result(self) -> SinkKinds:
        h, N, T, H = self.sums.host, self.n, self.T, (self.H,)
        div = lambda a, b: (a / b).where(b > 0, torch.tensor(float("nan"), dtype=a.dtype))  # noqa: E731
        n_sink, n_rest, n_seqs = h("n_sink", H), h("n_rest", H), h("n_seqs", H)
        return SinkKinds(
            layers=self.layers,
            alpha_1=(h("alpha", H) / N).float(),
            sinking_share=(n_sink / (n_sink + n_rest)).float(),
            value_ratio=(h("v1", H) / h("vj", H).clamp(min=TINY)).float(),
            out_ratio=div(div(h("out_sink", H), n_sink), div(h("out_rest", H), n_rest)).float(),
            pr=div(h("pr", H), n_seqs).float(),
            cos=div(h("cos", H), n_seqs).float(),
            n_seqs=n_seqs.float(),
            eps=self.eps,
            first=self.first,
            min_queries=self.min_queries,
            n_samples=N,
            T=T,
            model_name=getattr(self.model, "model_name", None),
            kind=self.kind,
            skipped=skipped_note(self.model),
        )


def kind_stats(
    acts: dict, *, R, W_O=None, n_heads: int, n_kv_heads: int, eps: float, first: int, min_queries: int
) -> dict:
    """One layer's reduce for the sink kinds, per query head summed over the batch (float64, (H,) each): alpha_1,
    the first and the other values' norms, the queries that sink and those that do not with their output norms
    |z_t W_O| = |z_t R| (``R`` R^T = W_O W_O^T per head, (H, d, d)), and over the sinking queries of each sequence
    that has ``min_queries`` of them the participation ratio and cosine of the outputs (:func:`_within`).

    Parameters
    ----------
    acts : dict
        {"v": values (B, T, H or H_kv, d), "z": head outputs (B, T, H, d), "pattern": the map or ``AttentionWeights``}.
    R : torch.Tensor, shape (H, d, d)
        A square root of each head's output Gram (:func:`gram_roots`).
    W_O : torch.Tensor, shape (H, d, d_model), optional
        In place of ``R`` where the weights stay next to the model (a remote trace): R is taken from it here.
    n_heads, n_kv_heads : int
    eps : float
        A query sinks when its weight on the first token exceeds it.
    first : int
        The first query counted (``dormant_result.first_query``).
    min_queries : int

    Returns
    -------
    dict of str to torch.Tensor
    """
    p = attention_of(acts["pattern"])
    c0 = p.column(0).transpose(0, 1)  # (H, B, T): the first token's weight from every query, head-major as y
    norms = per_query_head(kv_view(acts["v"], n_kv_heads).float().norm(dim=-1), n_heads)  # (B, T, H)
    z = acts["z"].float()
    B, T, H, d = z.shape
    R = gram_root(head_gram(W_O)) if R is None else R
    # y_s . y_t = o_s . o_t: one product per head on z's own strides (no permuted copy), (H, B, T', d)
    y = torch.bmm(z.reshape(B * T, H, d).transpose(0, 1), R.to(z.device, torch.float32)).view(H, B, T, d)
    y = y[:, :, first:]
    out = y.norm(dim=-1)
    sink = (c0[..., first:] > eps).float()
    pr, cos, ok = _within(y, out, sink, min_queries)
    got = {
        "alpha": c0.sum(-1, dtype=torch.float64) / c0.shape[-1],
        "v1": norms[:, 0].T,
        "vj": norms[:, 1:].mean(1).T,
        "n_sink": sink.sum(-1),
        "n_rest": (1 - sink).sum(-1),
        "out_sink": (out * sink).sum(-1),
        "out_rest": (out * (1 - sink)).sum(-1),
        "pr": pr * ok,
        "cos": cos * ok,
        "n_seqs": ok,
    }
    return {k: v.double().sum(1) for k, v in got.items()}


def gram_roots(grams: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """{layer: R (H, d, d)} with R R^T = G for each head's output Gram G = W_O W_O^T (symmetric, PSD): from its
    eigendecomposition, so that the outputs' norms and inner products are those of z R, in the head's own d dims.

    Parameters
    ----------
    grams : dict of int to torch.Tensor
        {layer: (H, d, d)}, ``dormant_heads.output_grams``.

    Returns
    -------
    dict of int to torch.Tensor
    """
    return {layer: gram_root(G) for layer, G in grams.items()}


def gram_root(G: torch.Tensor) -> torch.Tensor:
    """R with R R^T = G, per head, from the eigendecomposition of the symmetric PSD G (float32).

    Parameters
    ----------
    G : torch.Tensor, shape (H, d, d)

    Returns
    -------
    torch.Tensor, shape (H, d, d)
    """
    w, U = torch.linalg.eigh(G.double())
    return (U * w.clamp(min=0).sqrt()[..., None, :]).float()


def _within(y, out, sink, min_queries: int):
    """Per head and sequence, over the sinking queries: the participation ratio of the outputs' singular values and
    their mean cosine to their mean direction, and whether the sequence has ``min_queries`` of them (float64, (H, B)).

    The outputs o_t = z_t W_O have the inner products of y_t = z_t R (R R^T = W_O W_O^T), so the sinking outputs'
    Gram has the nonzero eigenvalues (the s^2) of C = sum_t y_t y_t^T (d x d): PR = tr(C)^2 / |C|_F^2, and no
    (T, d_model) output is built."""
    n = sink.sum(-1)  # (B, H)
    ys = y * sink[..., None]
    C = ys.transpose(-1, -2) @ ys  # (H, B, d, d)
    tr = (out.square() * sink).sum(-1)
    pr = tr**2 / C.square().sum((-2, -1)).clamp(min=TINY)
    ybar = ys.sum(2) / n.clamp(min=1)[..., None]  # (H, B, d)
    cos = (y @ ybar[..., None])[..., 0] / (out * ybar.norm(dim=-1)[..., None]).clamp(min=TINY)
    cos = (cos * sink).sum(-1) / n.clamp(min=1)
    return pr, cos, (n >= min_queries).double()


def sink_kinds(
    model: SinkModel,
    tokens,
    *,
    eps: float = SINK_EPS,
    layers=None,
    batch_size: int | None = None,
    kind: str | None = None,
) -> SinkKinds:
    """Call each sink head nop, broadcast or mixed from its value norms and its outputs on sinking queries.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``), on any backend.
    tokens : torch.Tensor, shape (N, T)
        Token ids; T must leave queries after ``first_query`` (T >= 6 at eps 0.3).
    eps : float
        The sink threshold: of a head (mean alpha_1) and of a query (A_t1).
    layers : sequence of int, optional
        Attention layers (true indices; default all).
    batch_size : int, optional
        Sequences per batch.
    kind : str, optional
        The input kind, a label.

    Returns
    -------
    SinkKinds
    """
    eps = check_eps(eps)
    layers = check_attention_layers(model, layers=layers)
    first = first_query((0,), eps=eps)
    tokens = check_tokens(
        model, tokens, minimum=first + 3, why=f"The sink's kind reads queries from position {first} on."
    )
    acc = SinkKindAccumulator(model, layers, tokens.shape[1], eps=eps, kind=kind)
    run_pass(model, tokens, [acc], batch_size=batch_size)
    return acc.result()


__all__ = ["sink_kinds", "call_kind", "SinkKinds", "SinkKindAccumulator", "KINDS"]


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, Section, register  # noqa: E402


register(
    Analysis(
        "sink_kind",
        result=SinkKinds,
        order=55,
        hooks=("v", "z", "pattern"),
        doc="The sink's kind per sink head (nop / broadcast / mixed) on the main kind.",
        accumulators=lambda p: [
            SinkKindAccumulator(
                p.model, list(model_facts(p.model).attention_layers), p.tokens.shape[1], eps=p.eps, kind=p.kind
            )
        ],
        sections=(
            Section(
                "The sink's kind: nop or broadcast",
                "dormant",
                95,
                figures=(
                    (
                        "analysis.figures.sink_kind:plot_sink_kinds",
                        "sink heads per layer by kind: nop, broadcast or mixed",
                    ),
                ),
            ),
        ),
        exports=("sink_kinds",),
    )
)
