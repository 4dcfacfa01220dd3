"""Value norms: the first token's value is small, so a head that sinks onto it writes (almost) nothing.

Per layer and key/value head (values live per KV head under GQA), from ``hook_v``, reduced inside the
hooks over N sequences of T tokens:

- ``v1_norm``: mean |v_1| (the first token's value), ``vj_norm``: mean |v_j| over positions j > 1, and
  ``ratio = v1_norm / vj_norm``; ``v_norm_by_pos`` the mean |v_t| per position t (the profile);
- ``alpha_1`` per query head (from ``sink`` if given, else from ``hook_pattern`` in the same pass), mapped
  to KV heads by the mean or max over the query heads that read each KV head;
- ``v1_cos_pair``: mean cosine between the first token's values of different inputs, against
  ``vj_cos_pair``, the mean pairwise cosine of all other values (is v_1 a constant, i.e. a bias?);
- ``first_value_share`` per query head: mean over queries t > 1 of A_t1 |v_1| / sum_j A_tj |v_j|, the
  share of the value-norm mass a query draws from the first token (small when the sink is a no-op);
- Pearson and Spearman correlations between the ratio and alpha_1 over all (layer, KV head) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.core.defaults import SINK_MIN_ALPHA, TINY
from analysis.model.hooks import (
    act_name,
    check_attention_layers,
    check_tokens,
    group_reduce,
    kv_view,
    model_dims,
    model_facts,
    per_query_head,
    skipped_note,
)
from analysis.core.io import jsonable
from analysis.engine.attention import attention_of
from analysis.engine.passes import Reduction, SummingAccumulator, run_pass
from analysis.core.docs import model_tokens_min2, parameters_from
from analysis.core.results import Result, pass_options
from analysis.sinks.metric import SinkResult
from analysis.core.stats import pair_cosine

REDUCTIONS = ("mean", "max")


def _reduce_groups(x: torch.Tensor, group_size: int, how: str) -> torch.Tensor:
    """(L, H) per query head -> (L, H_kv): mean or max over the query heads of each KV head."""
    return group_reduce(x, group_size, how=_check_reduce(how))


def correlation(x, y) -> dict:
    """Pearson and Spearman correlation of two 1-D arrays, with p-values.

    Parameters
    ----------
    x, y : array-like, shape (n,)
        Non-finite pairs are dropped.

    Returns
    -------
    dict
        ``n``, ``pearson_r``, ``pearson_p``, ``spearman_rho``, ``spearman_p``; None where undefined (fewer than 3
        points or a constant variable, with a ``note`` saying so).
    """
    from scipy import stats

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    out = {"n": int(x.size), "pearson_r": None, "pearson_p": None, "spearman_rho": None, "spearman_p": None}
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        out["note"] = "undefined: fewer than 3 points or a constant variable"
        return out
    pr = stats.pearsonr(x, y)
    sr = stats.spearmanr(x, y)
    out.update(pearson_r=float(pr[0]), pearson_p=float(pr[1]), spearman_rho=float(sr[0]), spearman_p=float(sr[1]))
    return out


@dataclass
class ValueNorms(Result):
    """Per (layer, KV head) value norms joined with the sink metric's alpha_1.

    Tensors are indexed by position in ``layers``, the TRUE indices of the attention layers measured (a hybrid's
    linear-attention / Mamba layers have no values or pattern and are left out; ``skipped`` says which).

    Attributes
    ----------
    layers : list of int, length L
        The true layer index of each position on the layer axis.
    group_size : int
        Query heads per KV head.
    n_samples : int
        N, the number of sequences.
    T : int
        The sequence length.
    v1_norm : torch.Tensor, shape (L, H_kv)
        Mean |v_1|, the first token's value norm.
    vj_norm : torch.Tensor, shape (L, H_kv)
        Mean |v_j| over positions j > 1.
    v_norm_by_pos : torch.Tensor, shape (L, H_kv, T)
        Mean |v_t| per position t (the profile).
    alpha_1 : torch.Tensor, shape (L, H)
        alpha_1 per query head.
    first_value_share : torch.Tensor, shape (L, H)
        Per query head, the mean over queries t > 1 of A_t1 |v_1| / sum_j A_tj |v_j|: the share of the value-norm mass
        a query draws from the first token.
    alpha_source : str
        Where alpha_1 comes from (a given ``SinkResult``, or ``hook_pattern`` in the same pass).
    v1_cos_pair : torch.Tensor, shape (L, H_kv), or None
        Mean cosine between the first token's values of different inputs.
    vj_cos_pair : torch.Tensor, shape (L, H_kv), or None
        Mean pairwise cosine of the values at positions j > 1.
    reduce : {"mean", "max"}
        How the query heads of a KV head map to one alpha.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    skipped : str
        The layers left out (not attention layers) and why, in one sentence; "" when none.
    ratio : torch.Tensor, shape (L, H_kv)
        ``v1_norm / vj_norm`` (a property).
    """

    layers: list[int]
    group_size: int
    n_samples: int
    T: int
    v1_norm: torch.Tensor  # (L, H_kv)
    vj_norm: torch.Tensor  # (L, H_kv)
    v_norm_by_pos: torch.Tensor  # (L, H_kv, T)
    alpha_1: torch.Tensor  # (L, H) per query head
    first_value_share: torch.Tensor  # (L, H) per query head
    alpha_source: str
    v1_cos_pair: torch.Tensor | None = None  # (L, H_kv) mean cosine between v_1 of different inputs
    vj_cos_pair: torch.Tensor | None = None  # (L, H_kv) mean pairwise cosine of the values at positions j > 1
    reduce: str = "mean"
    model_name: str | None = None
    kind: str | None = None
    skipped: str = ""  # the layers left out (not attention layers), in one sentence

    @property
    def ratio(self) -> torch.Tensor:
        """|v_1| / mean |v_j| (j > 1), (L, H_kv)."""
        return self.v1_norm / self.vj_norm

    def alpha_kv(self, reduce: str | None = None) -> torch.Tensor:
        """alpha_1 per KV head, (L, H_kv): mean or max over its query heads."""
        return _reduce_groups(self.alpha_1, self.group_size, _check_reduce(reduce or self.reduce))

    def table(self, reduce: str | None = None) -> pd.DataFrame:
        """One row per (layer, KV head)."""
        how = _check_reduce(reduce or self.reduce)
        L, K = self.v1_norm.shape
        extra = (
            {}
            if self.v1_cos_pair is None
            else {"v1_cos_pair": self.v1_cos_pair.flatten().numpy(), "vj_cos_pair": self.vj_cos_pair.flatten().numpy()}
        )
        return pd.DataFrame(
            {
                "layer": torch.tensor(self.layers).repeat_interleave(K).numpy(),
                "kv_head": torch.arange(K).repeat(L).numpy(),
                "v1_norm": self.v1_norm.flatten().numpy(),
                "vj_norm": self.vj_norm.flatten().numpy(),
                "ratio": self.ratio.flatten().numpy(),
                f"alpha_1_{how}": self.alpha_kv(how).flatten().numpy(),
                f"first_value_share_{how}": _reduce_groups(self.first_value_share, self.group_size, how)
                .flatten()
                .numpy(),
                **extra,
            }
        )

    def correlation(self, reduce: str | None = None, log_ratio: bool = False) -> dict:
        """Correlation over (layer, KV head) pairs between the ratio (or its log) and alpha_1."""
        how = _check_reduce(reduce or self.reduce)
        r = self.ratio.flatten().numpy().astype(float)
        with np.errstate(divide="ignore"):
            x = np.log(r) if log_ratio else r
        return {
            "x": "log(ratio)" if log_ratio else "ratio",
            "y": f"alpha_1_{how}",
            **correlation(x, self.alpha_kv(how).flatten().numpy()),
        }

    table_fields = ("kv_heads=table",)

    def text(self, min_alpha: float = SINK_MIN_ALPHA) -> str:
        return " ".join(self.findings(min_alpha))

    def findings(self, min_alpha: float = SINK_MIN_ALPHA) -> list[str]:
        """How small the first value is in sink KV heads, how constant, and how it goes with alpha_1."""
        S, c = self.summary(min_alpha), self.correlation()
        out = [self.ratio_text(min_alpha)]
        if S["n_sink_kv_heads"] and S.get("mean_v1_cos_pair_sink") is not None:
            out.append(
                f"In those heads the first token's values of different inputs have mean pairwise cosine "
                f"{S['mean_v1_cos_pair_sink']:.3f}, against {S['mean_vj_cos_pair_sink']:.3f} for the values at "
                "other positions: the first value is small and nearly constant."
            )
        if S["n_sink_kv_heads"] and c["pearson_r"] is not None:
            out.append(
                f"Across {c['n']} (layer, KV head) pairs, |v_1| / |v_j| and alpha_1 correlate with Pearson r = "
                f"{c['pearson_r']:.2f} and Spearman rho = {c['spearman_rho']:.2f}."
            )
        return out + ([self.skipped] if self.skipped else [])

    def caveats(self) -> list[str]:
        """The layers measured where some were left out, and a correlation undefined here."""
        out = (
            [f"Value norms are measured on the attention layers {self.layers}. {self.skipped}"] if self.skipped else []
        )
        c = self.correlation()
        if c["pearson_r"] is None:
            out.append(f"The correlation between |v_1| / |v_j| and alpha_1 is undefined here ({c.get('note')}).")
        return out

    def ratio_text(self, min_alpha: float = SINK_MIN_ALPHA) -> str:
        """How small the first value is in sink KV heads against the others."""
        S = self.summary(min_alpha)
        if not S["n_sink_kv_heads"]:
            return f"No KV head sinks (alpha_1 > {min_alpha}); the median |v_1| / mean |v_j| is {S['median_ratio_other']:.2f}."
        other = (
            f"{S['median_ratio_other']:.2f} over the other {S['n_other_kv_heads']}"
            if S["n_other_kv_heads"]
            else "no other heads"
        )
        return (
            f"The first token's value is {S['median_ratio_sink']:.3g} times the other tokens' (median |v_1| / mean |v_j| "
            f"over {S['n_sink_kv_heads']} sink KV heads), against {other}."
        )

    def smallest_text(self) -> str:
        low = self.table().sort_values("ratio").iloc[0]
        return (
            f"The smallest first value is in layer {int(low.layer)}, KV head {int(low.kv_head)}: |v_1| = {low.v1_norm:.2f} "
            f"against {low.vj_norm:.2f} (ratio {low.ratio:.3f}, alpha_1 {low[f'alpha_1_{self.reduce}']:.2f})."
        )

    def correlation_text(self) -> str:
        """The correlation of alpha_1 with |v_1| / |v_j| for both reductions and against the log ratio."""
        out = []
        for how in REDUCTIONS:
            c = self.correlation(reduce=how)
            if c["pearson_r"] is None:
                return f"The correlation between |v_1| / |v_j| and alpha_1 is undefined here ({c.get('note')})."
            out.append(
                f"alpha_1 ({how} over the KV head's query heads) against |v_1| / |v_j|, n = {c['n']} KV heads: "
                f"Pearson r = {c['pearson_r']:.2f} (p = {c['pearson_p']:.1e}), Spearman rho = {c['spearman_rho']:.2f}."
            )
        c = self.correlation(log_ratio=True)
        return " ".join(out) + f" Against log(ratio): Pearson r = {c['pearson_r']:.2f}."

    def profile_text(self, min_alpha: float = SINK_MIN_ALPHA) -> str:
        """|v_t| by position in sink layers, and how much value-norm mass sink heads draw from the first token."""
        prof = self.v_norm_by_pos.mean(1)  # (layers, T): mean over KV heads
        sink_layers = [i for i in range(len(self.layers)) if self.alpha_kv()[i].mean() > min_alpha]
        if not sink_layers:
            return f"No layer sinks (mean alpha_1 > {min_alpha})."
        later_min = prof[sink_layers, 1:].min(-1).values
        sink_q = self.alpha_1 > min_alpha
        return (
            f"In {len(sink_layers)} sink layers, |v_1| is below the smallest later |v_t| in "
            f"{int((prof[sink_layers, 0] < later_min).sum())} of them (mean |v_1| {prof[sink_layers, 0].mean():.2f}, mean "
            f"of the smallest later |v_t| {later_min.mean():.2f}). Sink query heads draw "
            f"{100 * self.first_value_share[sink_q].mean():.0f}% of their value-norm mass from token 1 (A_t1 |v_1| / "
            f"sum_j A_tj |v_j|), against {100 * self.alpha_1[sink_q].mean():.0f}% of their attention."
        )

    def summary(self, min_alpha: float = SINK_MIN_ALPHA) -> dict:
        """Median ratio over sink KV heads (alpha_1 above ``min_alpha``) and over the others."""
        a = self.alpha_kv().flatten()
        r = self.ratio.flatten()
        sink = a > min_alpha
        med = lambda m: float(r[m].median()) if m.any() else None  # noqa: E731
        cos = {}
        if self.v1_cos_pair is not None:
            c1, cj = self.v1_cos_pair.flatten(), self.vj_cos_pair.flatten()
            cos = {
                "mean_v1_cos_pair_sink": float(c1[sink].mean()) if sink.any() else None,
                "mean_vj_cos_pair_sink": float(cj[sink].mean()) if sink.any() else None,
                "mean_v1_cos_pair_other": float(c1[~sink].mean()) if (~sink).any() else None,
            }
        return {
            "min_alpha": min_alpha,
            "reduce": self.reduce,
            "n_sink_kv_heads": int(sink.sum()),
            "n_other_kv_heads": int((~sink).sum()),
            "median_ratio_sink": med(sink),
            "median_ratio_other": med(~sink),
            "mean_first_value_share_sink_query_heads": float(self.first_value_share[self.alpha_1 > min_alpha].mean())
            if (self.alpha_1 > min_alpha).any()
            else None,
            **cos,
        }

    def to_dict(self) -> dict:
        """JSON-serialisable; undefined numbers (e.g. cosines between first values with N = 1) are None."""
        return jsonable(
            {
                **self.header(),
                "T": self.T,
                "layers": self.layers,
                **({"skipped": self.skipped} if self.skipped else {}),
                "group_size": self.group_size,
                "alpha_source": self.alpha_source,
                "reduce": self.reduce,
                "table": self.table().to_dict("records"),
                "alpha_1_per_query_head": self.alpha_1.tolist(),
                "first_value_share_per_query_head": self.first_value_share.tolist(),
                "v_norm_by_position": self.v_norm_by_pos.tolist(),  # [layer][kv_head][position]
                "correlation": {
                    "ratio": self.correlation(),
                    "log_ratio": self.correlation(log_ratio=True),
                    "ratio_max": self.correlation(reduce="max" if self.reduce == "mean" else "mean"),
                },
                "summary": self.summary(),
                "text": self.text(),
            }
        )


def _check_reduce(reduce: str) -> str:
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS} (how query heads map to their KV head); got {reduce!r}.")
    return reduce


def value_stats(acts: dict, *, n_heads: int, n_kv_heads: int) -> dict:
    """One layer's reduce for the value norms, summed over the batch (float64): |v| per KV head and position
    ("by_pos", (K, T)), the sums of unit vectors of the first and the other values ("unit_first", "unit_other",
    (K, d)), and per query head the first value's share of sum_j A_ij |v_j| and alpha_1 ("share", "alpha", (H,)).

    Parameters
    ----------
    acts : dict
        {"v": values (B, T, H or H_kv, d), "pattern": the map or ``AttentionWeights``}.
    n_heads, n_kv_heads : int

    Returns
    -------
    dict of str to torch.Tensor
    """
    p = attention_of(acts["pattern"])
    v = kv_view(acts["v"], n_kv_heads).float()  # (B, T, K, d)
    norms = v.norm(dim=-1)  # (B, T, K)
    unit = torch.nn.functional.normalize(v.double(), dim=-1)
    per_q = per_query_head(norms, n_heads).transpose(1, 2)  # (B, H, T)
    mass = p.weighted(per_q)  # sum_j A_ij |v_j|
    first = p.column(0) * per_q[..., :1]  # A_i1 |v_1|
    return {
        "by_pos": norms.double().sum(0).T,
        "unit_first": unit[:, 0].sum(0),
        "unit_other": unit[:, 1:].sum((0, 1)),
        "share": (first[..., 1:] / mass[..., 1:].clamp(min=TINY)).mean(-1).double().sum(0),
        "alpha": p.alpha(1)[..., 0].double().sum(0),
    }


class ValueNormsAccumulator(SummingAccumulator):
    """Per layer: |v_t| per KV head and position, unit-vector sums (pairwise cosines), alpha_1 and the first token's
    share of the value-norm mass per query head.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    layers : sequence of int
        Attention layers (true indices).
    T : int
        The sequence length.
    kind : str, optional
        The input kind, a label.
    """

    reads_rows = True  # sum_j A_ij |v_j|

    def __init__(self, model, layers, T: int, *, kind: str | None = None):
        # sums on each layer's device until the result: |v| by position (K, T), alpha_1 and the first value's share
        # (H,), the sums of unit vectors (K, d), whose |sum|^2 gives the mean pairwise cosine
        super().__init__(layers)
        dims = model_facts(model).dims
        self.model, self.kind, self.H, self.K = model, kind, dims.n_heads, dims.n_kv_heads
        self.T, self.d_head = int(T), dims.d_head or 1

    def hooks(self):
        return {l: {"v": act_name("v", l), "pattern": act_name("pattern", l)} for l in self.layers}

    def reduction(self, layer: int) -> Reduction:
        return Reduction(value_stats, {"n_heads": self.H, "n_kv_heads": self.K})

    def result(self, sink: SinkResult | None = None, reduce: str = "mean") -> ValueNorms:
        N, T, h = self.n, self.T, self.sums.host
        by_pos = (h("by_pos", (self.K, T)) / N).float()
        if sink is not None:
            alpha = sink.per_head_alpha[[sink.pos(l) for l in self.layers], :, 0].float()
            source = f"sink_metric (N={sink.n_samples}, T={sink.T}{', ' + sink.kind if sink.kind else ''})"
        else:
            alpha, source = (h("alpha", (self.H,)) / N).float(), "hook_pattern, same tokens"
        return ValueNorms(
            layers=self.layers,
            group_size=self.H // self.K,
            n_samples=N,
            T=T,
            v1_norm=by_pos[..., 0],
            vj_norm=by_pos[..., 1:].mean(-1),
            v_norm_by_pos=by_pos,
            alpha_1=alpha,
            first_value_share=(h("share", (self.H,)) / N).float(),
            alpha_source=source,
            reduce=reduce,
            v1_cos_pair=pair_cosine(h("unit_first", (self.K, self.d_head)), N),
            vj_cos_pair=pair_cosine(h("unit_other", (self.K, self.d_head)), N * (T - 1)),
            model_name=getattr(self.model, "model_name", None),
            kind=self.kind,
            skipped=skipped_note(self.model),
        )


def _check_sink(sink, dims, layers: list[int], all_layers: list[int]) -> None:
    if sink is None:
        return
    if not isinstance(sink, SinkResult):
        raise ValueError(f"sink must be a SinkResult from analysis.sink_metric; got {type(sink).__name__}.")
    H_s = sink.per_head_alpha.shape[1]
    missing = [l for l in layers if l not in sink.layers]
    if H_s != dims.n_heads or missing or max(sink.layers) >= dims.n_layers:
        raise ValueError(
            f"the sink result has {len(sink.layers)} layers x {H_s} heads but the model has {len(all_layers)} x "
            f"{dims.n_heads} (attention layers {all_layers}; the result holds {sink.layers}): pass a "
            "sink_metric result of this model."
        )


@parameters_from(pass_options)
@parameters_from(model_tokens_min2)
def value_norms(
    model: SinkModel,
    tokens,
    *,
    sink: SinkResult | None = None,
    layers=None,
    reduce: str = "mean",
    batch_size: int | None = None,
    kind: str | None = None,
) -> ValueNorms:
    """|v_1| against mean |v_j| (j > 1) per layer and KV head, joined with alpha_1; streamed through hooks.

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens_min2`.
    sink : SinkResult, optional
        A result of ``analysis.sink_metric`` on this model whose per-head alpha_1 to use; by default alpha_1 is
        computed from ``hook_pattern`` in the same pass on ``tokens``.
    layers : sequence of int, optional
        Attention layers (true indices; default all).
    reduce : {"mean", "max"}
        How the query heads of a KV head map to one alpha.
    batch_size, kind
        As in :func:`pass_options`.

    Returns
    -------
    ValueNorms
        Norms of shape (L, H_kv), alpha_1 of shape (L, H).
    """
    reduce = _check_reduce(reduce)
    dims = model_dims(model)
    layers = check_attention_layers(model, layers=layers)
    tokens = check_tokens(model, tokens)
    _check_sink(sink, dims, layers, check_attention_layers(model))
    acc = ValueNormsAccumulator(model, layers, tokens.shape[1], kind=kind)
    run_pass(model, tokens, [acc], batch_size=batch_size)
    return acc.result(sink, reduce)


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, Section, register  # noqa: E402


register(
    Analysis(
        "value_norms",
        result=ValueNorms,
        order=50,
        hooks=("v", "pattern"),
        doc="Value norms on the main kind.",
        # the attention analyses run on the attention layers (true indices)
        accumulators=lambda p: [
            ValueNormsAccumulator(p.model, list(model_facts(p.model).attention_layers), p.tokens.shape[1], kind=p.kind)
        ],
        sections=(
            Section(
                "Value norms",
                "value",
                70,
                tables=(),
                figures=(
                    ("analysis.figures.value_norms:plot_value_norms", "|v_1| and mean |v_j| per layer"),
                    ("analysis.figures.value_norms:plot_value_alpha", "|v_1| / |v_j| against alpha_1, per KV head"),
                ),
            ),
        ),
        exports=("value_norms",),
    )
)
