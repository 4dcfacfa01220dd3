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

from analysis.hooks import ModelContractError, check_layers, check_tokens, hook_names, model_dims, run_with_reducers
from analysis.sink import SinkResult, alpha_from_pattern

REDUCTIONS = ("mean", "max")


def _reduce_groups(x: torch.Tensor, group_size: int, how: str) -> torch.Tensor:
    """(L, H) per query head -> (L, H_kv): mean or max over the query heads of each KV head."""
    g = x.reshape(x.shape[0], -1, group_size)
    return g.mean(-1) if how == "mean" else g.max(-1).values


def correlation(x, y) -> dict:
    """Pearson and Spearman correlation of two 1-D arrays, with p-values; None where undefined."""
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
class ValueNorms:
    """Per (layer, KV head) value norms joined with the sink metric's alpha_1."""

    layers: list[int]
    group_size: int
    N: int
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
        extra = {} if self.v1_cos_pair is None else {"v1_cos_pair": self.v1_cos_pair.flatten().numpy(),
                                                     "vj_cos_pair": self.vj_cos_pair.flatten().numpy()}
        return pd.DataFrame({
            "layer": torch.tensor(self.layers).repeat_interleave(K).numpy(),
            "kv_head": torch.arange(K).repeat(L).numpy(),
            "v1_norm": self.v1_norm.flatten().numpy(),
            "vj_norm": self.vj_norm.flatten().numpy(),
            "ratio": self.ratio.flatten().numpy(),
            f"alpha_1_{how}": self.alpha_kv(how).flatten().numpy(),
            f"first_value_share_{how}": _reduce_groups(self.first_value_share, self.group_size, how).flatten().numpy(),
            **extra,
        })

    def correlation(self, reduce: str | None = None, log_ratio: bool = False) -> dict:
        """Correlation over (layer, KV head) pairs between the ratio (or its log) and alpha_1."""
        how = _check_reduce(reduce or self.reduce)
        r = self.ratio.flatten().numpy().astype(float)
        with np.errstate(divide="ignore"):
            x = np.log(r) if log_ratio else r
        return {"x": "log(ratio)" if log_ratio else "ratio", "y": f"alpha_1_{how}", **correlation(x, self.alpha_kv(how).flatten().numpy())}

    def summary(self, min_alpha: float = 0.3) -> dict:
        """Median ratio over sink KV heads (alpha_1 above ``min_alpha``) and over the others."""
        a = self.alpha_kv().flatten()
        r = self.ratio.flatten()
        sink = a > min_alpha
        med = lambda m: float(r[m].median()) if m.any() else None  # noqa: E731
        cos = {}
        if self.v1_cos_pair is not None:
            c1, cj = self.v1_cos_pair.flatten(), self.vj_cos_pair.flatten()
            cos = {"mean_v1_cos_pair_sink": float(c1[sink].mean()) if sink.any() else None,
                   "mean_vj_cos_pair_sink": float(cj[sink].mean()) if sink.any() else None,
                   "mean_v1_cos_pair_other": float(c1[~sink].mean()) if (~sink).any() else None}
        return {
            "min_alpha": min_alpha, "reduce": self.reduce,
            "n_sink_kv_heads": int(sink.sum()), "n_other_kv_heads": int((~sink).sum()),
            "median_ratio_sink": med(sink), "median_ratio_other": med(~sink),
            "mean_first_value_share_sink_query_heads": float(self.first_value_share[self.alpha_1 > min_alpha].mean())
            if (self.alpha_1 > min_alpha).any() else None,
            **cos,
        }

    def to_dict(self) -> dict:
        """JSON-serialisable; undefined numbers (e.g. cosines between first values with N = 1) are None."""
        return _finite({
            "model": self.model_name, "N": self.N, "T": self.T, "layers": self.layers,
            "group_size": self.group_size, "alpha_source": self.alpha_source, "reduce": self.reduce,
            "table": self.table().to_dict("records"),
            "alpha_1_per_query_head": self.alpha_1.tolist(),
            "first_value_share_per_query_head": self.first_value_share.tolist(),
            "v_norm_by_position": self.v_norm_by_pos.tolist(),  # [layer][kv_head][position]
            "correlation": {"ratio": self.correlation(), "log_ratio": self.correlation(log_ratio=True),
                            "ratio_max": self.correlation(reduce="max" if self.reduce == "mean" else "mean")},
            "summary": self.summary(),
        })


def _finite(obj):
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(obj) if np.isfinite(obj) else None
    return obj


def _check_reduce(reduce: str) -> str:
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS} (how query heads map to their KV head); got {reduce!r}.")
    return reduce


def value_norms(
    model,
    tokens,
    sink: SinkResult | None = None,
    layers=None,
    reduce: str = "mean",
    batch_size: int | None = None,
) -> ValueNorms:
    """|v_1| against mean |v_j| (j > 1) per layer and KV head, joined with alpha_1; streamed through hooks.

    ``sink``: a ``SinkResult`` (``analysis.sink_metric``) whose per-head alpha_1 to use; by default alpha_1
    is computed from ``hook_pattern`` in the same pass on ``tokens``. ``reduce`` ("mean" or "max") maps
    the query heads of a KV head to one alpha.
    """
    reduce = _check_reduce(reduce)
    dims = model_dims(model)
    layers = check_layers(model, layers)
    tokens = check_tokens(model, tokens)
    N, T = tokens.shape
    if T < 2:
        raise ValueError(f"value norms compare the first token with the others: give T >= 2 tokens; got T={T}.")
    names = hook_names(model)
    missing = [f"blocks.{l}.attn.hook_v" for l in layers if f"blocks.{l}.attn.hook_v" not in names]
    if missing:
        raise ModelContractError(f"the model has no value hooks {missing[:3]}; value norms need `blocks.{{l}}.attn.hook_v`.")
    if sink is not None:
        if not isinstance(sink, SinkResult):
            raise ValueError(f"sink must be a SinkResult from analysis.sink_metric; got {type(sink).__name__}.")
        L_s, H_s = sink.per_head_alpha.shape[:2]
        if (L_s, H_s) != (dims.n_layers, dims.n_heads):
            raise ValueError(
                f"the sink result has {L_s} layers x {H_s} heads but the model has {dims.n_layers} x {dims.n_heads}: "
                "pass a sink_metric result of this model."
            )
    L, H, K = len(layers), dims.n_heads, dims.n_kv_heads
    f64 = torch.float64
    by_pos = torch.zeros(L, K, T, dtype=f64)
    alpha_sum = torch.zeros(L, H, dtype=f64)
    share_sum = torch.zeros(L, H, dtype=f64)
    unit_first_sum = [None] * L  # |sum of unit vectors|^2 gives the mean pairwise cosine
    unit_other = [None] * L
    pending: dict[int, dict[str, torch.Tensor]] = {}

    def reduce_layer(i: int, v: torch.Tensor, pattern: torch.Tensor) -> None:
        n_k = v.shape[2]
        if H % n_k or n_k not in (K, H):
            raise ValueError(f"layer {layers[i]}: hook_v has {n_k} heads; expected {K} KV heads (or {H}).")
        norms = v.float().norm(dim=-1)  # (B, T, n_k)
        kv_norms = norms if n_k == K else norms[:, :, :: dims.group_size]
        by_pos[i] += kv_norms.double().sum(0).T.cpu()
        unit = torch.nn.functional.normalize((v if n_k == K else v[:, :, :: dims.group_size]).double(), dim=-1)
        unit_first_sum[i] = unit[:, 0].sum(0).cpu() + (0 if unit_first_sum[i] is None else unit_first_sum[i])
        unit_other[i] = unit[:, 1:].sum((0, 1)).cpu() + (0 if unit_other[i] is None else unit_other[i])
        per_q = norms.repeat_interleave(H // n_k, dim=2).transpose(1, 2)  # (B, H, T)
        p = pattern.float()
        mass = torch.einsum("bhij,bhj->bhi", p, per_q)  # sum_j A_ij |v_j|
        first = p[..., 0] * per_q[..., :1]  # A_i1 |v_1|
        share = (first[..., 1:] / mass[..., 1:].clamp(min=1e-30)).mean(-1)  # (B, H), queries t > 1
        share_sum[i] += share.double().sum(0).cpu()
        alpha_sum[i] += alpha_from_pattern(pattern, 1)[..., 0].double().sum(0).cpu()

    fired: set[int] = set()

    def reducer(i: int, which: str):
        def fn(x, hook):
            fired.add(i)
            slot = pending.setdefault(i, {})
            slot[which] = x
            if len(slot) == 2:
                reduce_layer(i, slot["v"], slot["pattern"])
                del pending[i]
        return fn

    reducers = []
    for i, l in enumerate(layers):
        reducers += [(f"blocks.{l}.attn.hook_v", reducer(i, "v")), (f"blocks.{l}.attn.hook_pattern", reducer(i, "pattern"))]
    run_with_reducers(model, tokens, reducers, batch_size=batch_size)
    if len(fired) < L or pending:
        silent = sorted({layers[i] for i in range(L) if i not in fired} | {layers[i] for i in pending})
        raise ModelContractError(f"the value/pattern hooks of layers {silent} did not both fire; value norms need "
                                 "`blocks.{l}.attn.hook_v` and `hook_pattern` to run.")

    by_pos = (by_pos / N).float()

    def pair_cos(sums: list, n: int) -> torch.Tensor:
        s = torch.stack(sums)  # (L, K, d)
        return (((s * s).sum(-1) - n) / (n * (n - 1))).float() if n > 1 else torch.full(s.shape[:2], float("nan"))

    v1_cos, vj_cos = pair_cos(unit_first_sum, N), pair_cos(unit_other, N * (T - 1))
    if sink is not None:
        alpha = sink.per_head_alpha[layers, :, 0].float()
        source = f"sink_metric (N={sink.alpha.shape[0]}, T={sink.T}{', ' + sink.kind if sink.kind else ''})"
    else:
        alpha = (alpha_sum / N).float()
        source = "hook_pattern, same tokens"
    return ValueNorms(
        layers=layers, group_size=dims.group_size, N=N, T=T,
        v1_norm=by_pos[..., 0], vj_norm=by_pos[..., 1:].mean(-1), v_norm_by_pos=by_pos,
        alpha_1=alpha, first_value_share=(share_sum / N).float(), alpha_source=source, reduce=reduce,
        v1_cos_pair=v1_cos, vj_cos_pair=vj_cos,
        model_name=getattr(model, "model_name", None),
    )
