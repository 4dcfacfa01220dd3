"""Massive activations (Sun et al. 2024) in the residual stream, reduced inside the hooks.

For every layer l (by default ``blocks.{l}.hook_resid_post``, the residual stream after block l) and
every sample, the reducer keeps:

- the top-k |activation| over (positions x dims), with its position, dimension and token;
- the median |activation| over all of the sample's hidden states;
- the activations flagged by Sun et al.'s criterion: |a| > ``abs_threshold`` (100) and
  |a| >= ``ratio_threshold`` (1000) x the median |a| of its hidden state (by default the sample's
  whole hidden state at that layer, positions x dims; ``median_over="token"``: that token's vector);
- per dimension: how many samples flag it (at any position, at the first token), and the first
  token's mean (signed) activation.

Nothing else outlives a layer. A dimension is a *spike dimension* of a layer when it is flagged on at
least ``min_share`` of the samples there. ``activation_map`` gives |h| over (positions x dims) at one
layer for one sequence, for the heatmap.

Layer numbering: with ``hook="resid_post"`` (default), layer l is the output of block l, so the spike
read by block l's attention is the one of layer l - 1. ``hook="resid_pre"`` numbers by the block that
reads the stream (layer 0 is then the embeddings).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.core.defaults import (
    NARROW_MODEL_D,
    SPIKE_ABS,
    SPIKE_MIN_SHARE,
    SPIKE_RATIO,
    SPIKE_RATIO_NARROW,
    SPIKE_SAMPLES,
)
from analysis.model.hooks import (
    ModelContractError,
    act_name,
    check_layers,
    check_tokens,
    model_dims,
    model_facts,
    token_strings,
)
from analysis.engine.passes import Accumulator, Batch, LayerCollector, Reduction, run_pass
from analysis.core.results import Result, layer_runs, pass_options
from analysis.core.reductions import top_k_abs
from analysis.core.docs import model_tokens, parameters_from, share_parameters
from analysis.core.stats import flat_above, host_selection, lower_median

RESID_HOOKS = ("resid_post", "resid_pre", "resid_mid")


def resid_hook(layer: int, *, hook: str = "resid_post") -> str:
    """The hook name of a residual stream, checked.

    Parameters
    ----------
    layer : int
        The block.
    hook : {"resid_post", "resid_pre", "resid_mid"}

    Returns
    -------
    str
        E.g. "blocks.3.hook_resid_post".
    """
    if hook not in RESID_HOOKS:
        raise ValueError(f"hook must be one of {list(RESID_HOOKS)}; got {hook!r}.")
    return act_name(hook, layer)


@dataclass
class MassiveActivations(Result):
    """Massive activations per layer; tensors are indexed by position in ``layers`` (L of them), K = ``top_k``, D =
    d_model.

    Attributes
    ----------
    layers : list of int, length L
        The blocks read.
    hook : str
        The residual stream read ("resid_post", "resid_pre" or "resid_mid").
    top_k : int
        K.
    abs_threshold, ratio_threshold, min_share : float
        The criterion (see :func:`massive_activations`).
    n_samples : int
        N, the number of sequences.
    T : int
        The sequence length.
    median_over : {"sequence", "token"}
        The median the ratio is taken to.
    top_values : torch.Tensor, shape (N, L, K)
        The K largest |a| per sample and layer, descending.
    top_pos, top_dim, top_token : torch.Tensor, shape (N, L, K)
        Their position, dimension and token id.
    median : torch.Tensor, shape (N, L)
        The median |a| over the sample's positions x dims (or per token, see ``median_over``).
    flag_samples : torch.Tensor, shape (L, D)
        Samples where the dim is flagged at any position.
    flag_first : torch.Tensor, shape (L, D)
        Samples where the dim is flagged at the first token.
    first_mean, first_abs : torch.Tensor, shape (L, D)
        The first token's mean signed activation, and its mean |a|.
    other_abs_max : torch.Tensor, shape (L, D)
        Mean over samples of the largest |a| at positions t > 1.
    flagged : pandas.DataFrame
        One row per (sample, position, dim) flagged in any layer, with its layer range and largest |a| and ratio.
    token_text : dict of int to str
        Token id -> decoded token.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    spike_dims : dict of int to list of int
        {layer: dims flagged on >= min_share of samples, at any position} (a property).
    first_token_dims : dict of int to list of int
        {layer: dims flagged at the first token on >= min_share of samples} (a property).
    """

    layers: list[int]
    hook: str
    top_k: int
    abs_threshold: float
    ratio_threshold: float
    min_share: float
    n_samples: int
    T: int
    median_over: str
    top_values: torch.Tensor  # (N, L, K) |a|, descending
    top_pos: torch.Tensor  # (N, L, K)
    top_dim: torch.Tensor  # (N, L, K)
    top_token: torch.Tensor  # (N, L, K) token id at top_pos
    median: torch.Tensor  # (N, L) median |a| over the sample's (positions x dims)
    flag_samples: torch.Tensor  # (L, D) samples where the dim is flagged (any position)
    flag_first: torch.Tensor  # (L, D) samples where the dim is flagged at position 0
    first_mean: torch.Tensor  # (L, D) mean signed activation of the first token
    first_abs: torch.Tensor  # (L, D) mean |a| of the first token
    other_abs_max: torch.Tensor  # (L, D) mean over samples of max_{t>0} |a|
    flagged: pd.DataFrame  # one row per (sample, position, dim) flagged in any layer
    token_text: dict = field(default_factory=dict)  # id -> decoded token
    model_name: str | None = None
    kind: str | None = None

    # ----- derived -----
    def _dims_over(self, counts: torch.Tensor) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        if self.n_samples > 0:  # one nonzero over (L, D): its rows come by layer, then dim, both ascending
            for i, d in (counts >= self.min_share * self.n_samples).nonzero().tolist():
                out.setdefault(self.layers[i], []).append(d)
        return out

    @property
    def spike_dims(self) -> dict[int, list[int]]:
        return self._dims_over(self.flag_samples)

    @property
    def first_token_dims(self) -> dict[int, list[int]]:
        return self._dims_over(self.flag_first)

    def input_dims(self, n_layers: int | None = None) -> dict[int, list[int]]:
        """First-token spike dims by the block that reads them: {block: dims in its input stream}.

        With ``hook="resid_post"``, the stream after block l is read by block l + 1 (dropped past
        ``n_layers - 1`` when given); with ``hook="resid_pre"`` the keys are already the reading blocks.
        This is the form ``norm_gain_trace`` and ``first_key_ablation`` take.
        """
        d = self.first_token_dims
        if self.hook == "resid_pre":
            return dict(d)
        if self.hook != "resid_post":
            raise ValueError("input_dims needs hook='resid_post' or 'resid_pre'.")
        return {l + 1: v for l, v in d.items() if n_layers is None or l + 1 < n_layers}

    @property
    def has_spike(self) -> bool:
        return bool(self.spike_dims)

    @property
    def first_layer(self) -> int | None:
        """First layer with a spike dimension (None without spikes)."""
        s = self.spike_dims
        return min(s) if s else None

    @property
    def last_layer(self) -> int | None:
        """Last layer with a spike dimension; the spikes fade after it (None without spikes)."""
        s = self.spike_dims
        return max(s) if s else None

    @property
    def all_spike_dims(self) -> list[int]:
        return sorted({d for dims in self.spike_dims.values() for d in dims})

    def spike_layers(self, dim: int) -> list[int]:
        return [l for l, dims in self.spike_dims.items() if dim in dims]

    def _tok(self, i: int) -> str:
        return self.token_text.get(int(i), f"#{int(i)}")

    @property
    def per_layer(self) -> pd.DataFrame:
        """One row per layer: mean top-k |a| and median over samples, where the tops sit, flag counts."""
        rows = []
        spikes = self.spike_dims
        for i, l in enumerate(self.layers):
            row = {"layer": l}
            for k in range(self.top_k):
                row[f"top{k + 1}"] = float(self.top_values[:, i, k].mean())
            row["median"] = float(self.median[:, i].mean())
            row["top1_over_median"] = row["top1"] / max(row["median"], 1e-12)
            for k in range(self.top_k):
                pos = Counter(self.top_pos[:, i, k].tolist()).most_common(1)[0]
                dim = Counter(self.top_dim[:, i, k].tolist()).most_common(1)[0]
                tok = Counter(self.top_token[:, i, k].tolist()).most_common(1)[0]
                row[f"top{k + 1}_pos"] = int(pos[0])
                row[f"top{k + 1}_pos_share"] = pos[1] / self.n_samples
                row[f"top{k + 1}_dim"] = int(dim[0])
                row[f"top{k + 1}_dim_share"] = dim[1] / self.n_samples
                row[f"top{k + 1}_token"] = self._tok(tok[0])
            row["spike_dims"] = spikes.get(l, [])
            row["first_token_dims"] = self.first_token_dims.get(l, [])
            rows.append(row)
        return pd.DataFrame(rows)

    @property
    def dims(self) -> pd.DataFrame:
        """One row per spike dimension: the layers where it is a spike (appears, fades), how big, who carries it."""
        rows = []
        for d in self.all_spike_dims:
            ls = self.spike_layers(d)
            idx = [self.layers.index(l) for l in ls]
            peak = idx[int(self.first_abs[idx, d].argmax())]
            f = self.flagged[self.flagged["dim"] == d]
            n_first = int((f["position"] == 0).sum()) if len(f) else 0
            others = f[f["position"] > 0]
            top_tokens = Counter(others["token"].tolist()).most_common(3)
            rows.append(
                {
                    "dim": d,
                    "layers": layer_runs(ls),
                    "first_layer": min(ls),
                    "last_layer": max(ls),
                    "n_layers": len(ls),
                    "peak_layer": self.layers[peak],
                    "first_token_mean": float(self.first_mean[peak, d]),
                    "first_token_abs": float(self.first_abs[peak, d]),
                    "first_token_share": n_first / max(len(f), 1),
                    "n_other_positions": int(len(others)),
                    "other_tokens": ", ".join(f"{t!r} x{c}" for t, c in top_tokens),
                }
            )
        return pd.DataFrame(
            rows,
            columns=[
                "dim",
                "layers",
                "first_layer",
                "last_layer",
                "n_layers",
                "peak_layer",
                "first_token_mean",
                "first_token_abs",
                "first_token_share",
                "n_other_positions",
                "other_tokens",
            ],
        )

    @property
    def carriers(self) -> pd.DataFrame:
        """Which tokens carry flagged activations: counts of (sample, position) per dim, first token apart."""
        f = self.flagged
        if not len(f):
            return pd.DataFrame(columns=["dim", "carrier", "n", "share"])
        lab = f["token"].where(f["position"] > 0, "<first token>")
        g = f.assign(carrier=lab).groupby(["dim", "carrier"]).size().rename("n").reset_index()
        g["share"] = g["n"] / g.groupby("dim")["n"].transform("sum")
        return g.sort_values(["dim", "n"], ascending=[True, False]).reset_index(drop=True)

    @property
    def first_token_share(self) -> float:
        """Share of flagged (sample, position, dim) activations that sit on the first token (NaN if none)."""
        return float((self.flagged["position"] == 0).mean()) if len(self.flagged) else float("nan")

    table_fields = ("per_layer", "dims", "carriers")

    def findings(self) -> list[str]:
        """Where the spikes are and how much of them the first token carries, or that there are none."""
        name = self.model_name or "the model"
        kind = f" on {self.kind} inputs" if self.kind else ""
        if not self.has_spike:
            top = float(self.top_values[:, :, 0].mean(0).max()) if self.n_samples else float("nan")
            return [
                f"No massive activations in {name}{kind}: the first token carries no massive activation and no other "
                f"token does either (no dimension passes {criterion_text(self.abs_threshold, self.ratio_threshold)} "
                f"on {self.min_share:.0%} of samples; largest mean top-1 |a| over layers: {top:.1f})."
            ]
        parts = [
            f"dim {r.dim} (layers {r.layers}, {r.first_token_share:.0%} on the first token, "
            f"peak {r.first_token_mean:+.0f})"
            for r in self.dims.itertuples()
        ]
        first = self.first_token_dims
        return [
            f"Massive activations in {name}{kind} ({self.hook}): " + "; ".join(parts) + ".",
            f"They appear at layer {self.first_layer} and fade after layer {self.last_layer}.",
            f"On the first token, {len(first)} of {len(self.layers)} layers (hook_{self.hook}) carry massive dims "
            f"{sorted({x for v in first.values() for x in v})}; {self.first_token_share:.0%} of all flagged "
            "activations sit on the first token.",
        ]

    @property
    def peak_dim(self) -> int:
        """The dimension with the largest mean |a| of the first token, over all layers."""
        return int(self.first_abs.max(0).values.argmax())

    def peak_layer(self) -> int:
        """The first layer with a spike dimension, else the layer with the largest mean top-1 |a|."""
        return self.first_layer if self.has_spike else int(self.per_layer.sort_values("top1").iloc[-1].layer)

    def to_dict(self) -> dict:
        per_layer = self.per_layer
        keep = (
            ["layer"]
            + [f"top{k + 1}" for k in range(self.top_k)]
            + ["median", "top1_over_median"]
            + [f"top{k + 1}_{c}" for k in range(self.top_k) for c in ("pos", "dim", "token")]
        )
        return {
            **self.header(),
            "hook": self.hook,
            "T": self.T,
            "abs_threshold": self.abs_threshold,
            "ratio_threshold": self.ratio_threshold,
            "min_share": self.min_share,
            "median_over": self.median_over,
            "has_spike": self.has_spike,
            "first_layer": self.first_layer,
            "last_layer": self.last_layer,
            "spike_dims": {str(l): d for l, d in self.spike_dims.items()},
            "first_token_dims": {str(l): d for l, d in self.first_token_dims.items()},
            "first_token_share": None if not len(self.flagged) else self.first_token_share,
            "n_flagged": int(len(self.flagged)),
            "per_layer": [
                {k: (v if isinstance(v, (str, int)) else float(v)) for k, v in r.items()}
                for r in per_layer[keep].to_dict("records")
            ],
            "dims": self.dims.to_dict("records"),
            "text": self.text(),
        }


def _check_thresholds(top_k, abs_threshold, ratio_threshold, min_share, D):
    if not 1 <= int(top_k) <= D:
        raise ValueError(f"top_k must lie in [1, d_model={D}]; got {top_k}.")
    if float(abs_threshold) < 0 or float(ratio_threshold) < 0:
        raise ValueError("abs_threshold and ratio_threshold must be >= 0 (Sun et al.: 100 and 1000).")
    if not 0.0 < float(min_share) <= 1.0:
        raise ValueError(f"min_share must lie in (0, 1]; got {min_share}.")


def massive_stats(acts: dict, *, top_k: int, abs_threshold: float, median_over: str = "sequence") -> dict:
    """One layer's reduce for the massive-activation table, from its residual stream x (B, T, D): per sample the
    top-k |x| (values, positions, dims) and the lower median of |x| ("top", (B, 3 top_k + 1)); over the batch the
    first token's sum of x and of |x| and the later positions' max |x| ("first_sum", "first_abs", "other_max", (D,)
    float64); the candidates for Sun et al.'s flags, |x| above ``abs_threshold`` (few): flat indices into (B, T, D),
    |x| and the median they are judged against ("flat", "vals", "ref").

    Parameters
    ----------
    acts : dict
        {"resid": the residual stream (B, T, D)}.
    top_k : int
    abs_threshold : float
    median_over : {"sequence", "token"}
        The median a candidate is judged against: its sample's, or its own position's.

    Returns
    -------
    dict of str to torch.Tensor
    """
    x = acts["resid"]
    D = x.shape[-1]
    a = x.detach().float().abs()
    flat = a.reshape(a.shape[0], -1)
    v, idx = top_k_abs(a, top_k)
    zero = torch.zeros(D, dtype=torch.float64, device=a.device)
    other = a[:, 1:].amax(dim=1).double().sum(0) if a.shape[1] > 1 else zero
    f = flat_above(a, abs_threshold).to(a.device)
    vals = a.reshape(-1)[f]
    ref = lower_median(a, nonnegative=True).to(a.device).reshape(-1) if median_over == "token" else None
    first_abs = a[:, 0].double().sum(0)
    if x.dtype in (torch.bfloat16, torch.float16) and not host_selection(a):  # one radix pass on 16-bit keys:
        med = lower_median(x.detach().abs().reshape(x.shape[0], -1)).float()  # the same values, half the work
    else:
        med = lower_median(flat, overwrite=True, nonnegative=True).to(a.device)  # (B,) positions x dims; scrambles a
    return {
        "top": torch.cat([v, (idx // D).float(), (idx % D).float(), med[:, None]], -1),
        "first_sum": x[:, 0].detach().double().sum(0),
        "first_abs": first_abs,
        "other_max": other,
        "flat": f,
        "vals": vals,
        "ref": med[f // flat.shape[1]] if ref is None else ref[f // D],
    }


class MassiveAccumulator(Accumulator):
    """Per layer and batch: top-k |a|, the median, Sun et al.'s flags, the first token's activations.

    Built by :func:`massive_accumulator`, which checks the arguments (those of :func:`massive_activations`; ``D`` is
    d_model).
    """

    def __init__(
        self,
        model,
        layers,
        D: int,
        *,
        hook: str = "resid_post",
        top_k: int = 3,
        abs_threshold: float = SPIKE_ABS,
        ratio_threshold: float = SPIKE_RATIO,
        min_share: float = SPIKE_MIN_SHARE,
        median_over: str = "sequence",
        kind: str | None = None,
    ):
        self.model, self.layers, self.D, self.hook, self.kind = model, list(layers), int(D), hook, kind
        self.K, self.min_share, self.median_over = int(top_k), float(min_share), median_over
        self.abs_threshold, self.ratio_threshold = float(abs_threshold), float(ratio_threshold)
        self.index = {l: i for i, l in enumerate(self.layers)}
        self.top = LayerCollector(self.layers)  # (N, L, 3K + 2): values, positions, dims, median, top tokens
        # per layer, on the layer's own device until the result: the first token's signed sum, |a| sum, the mean
        # max |a| at t > 0 (float64, (3, D)), and the per-dim flag counts (long, (2, D): any position, first token)
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, torch.Tensor] = {}
        self.flag_rows: list[torch.Tensor] = []  # (sample, pos, dim, layer_idx, |a|, ratio, token) per flag, on device
        self.n_samples, self.T = 0, 0

    def hooks(self):
        return {l: {"resid": resid_hook(l, hook=self.hook)} for l in self.layers}

    def reduction(self, layer: int) -> Reduction:
        return Reduction(
            massive_stats, {"top_k": self.K, "abs_threshold": self.abs_threshold, "median_over": self.median_over}
        )

    def fold(self, layer: int, s: dict, batch: Batch) -> None:
        if s["first_sum"].shape[-1] != self.D:
            raise ModelContractError(
                f"{resid_hook(layer, hook=self.hook)} has last dim {s['first_sum'].shape[-1]}, expected "
                f"d_model={self.D}."
            )
        i, dev = self.index[layer], s["first_sum"].device
        if i not in self.sums:
            self.sums[i] = torch.zeros(3, self.D, dtype=torch.float64, device=dev)
            self.counts[i] = torch.zeros(2, self.D, dtype=torch.long, device=dev)
        self.sums[i] += torch.stack([s["first_sum"], s["first_abs"], s["other_max"]])
        tokens = batch.tokens.to(dev)
        top = s["top"]
        top_tok = tokens.gather(1, top[:, self.K : 2 * self.K].long()).float()
        self.top.put(layer, torch.cat([top, top_tok], -1))
        self._flags(i, s["flat"], s["vals"], s["ref"], tokens, batch)

    def _flags(
        self, i: int, f: torch.Tensor, vals: torch.Tensor, ref: torch.Tensor, tokens: torch.Tensor, batch: Batch
    ) -> None:
        """Sun et al.'s flags among the activations above abs_threshold (flat indices ``f`` into (B, T, D), |a|
        ``vals``): |a| >= ratio_threshold x ``ref``, the median of their hidden state; per-dim sample counts and
        the flagged rows, kept on the layer's device."""
        keep = vals >= self.ratio_threshold * ref
        f, vals, ref = f[keep], vals[keep], ref[keep]
        if not f.numel():
            return
        T = tokens.shape[1]
        b, t, d = f // (T * self.D), f // self.D % T, f % self.D
        self.counts[i][0] += torch.bincount(torch.unique(b * self.D + d) % self.D, minlength=self.D)
        self.counts[i][1] += torch.bincount(d[t == 0], minlength=self.D)
        cols = [b + batch.offset, t, d, torch.full_like(b, i), vals, vals / ref.clamp_min(1e-30), tokens[b, t]]
        self.flag_rows.append(torch.stack([c.double() for c in cols], 1))

    def end_batch(self, batch: Batch, logits) -> None:
        self.top.end_batch()
        self.n_samples += batch.tokens.shape[0]
        self.T = batch.tokens.shape[1]

    def _per_dim(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-layer sums (L, 3, D) and flag counts (L, 2, D), on the host: one copy per layer after the pass."""
        zeros = (torch.zeros(3, self.D, dtype=torch.float64), torch.zeros(2, self.D, dtype=torch.long))
        sums = [self.sums[i].cpu() if i in self.sums else zeros[0] for i in range(len(self.layers))]
        counts = [self.counts[i].cpu() if i in self.counts else zeros[1] for i in range(len(self.layers))]
        return torch.stack(sums), torch.stack(counts)

    def result(self) -> "MassiveActivations":
        top, K, N, T = self.top.result(), self.K, self.n_samples, self.T
        sums, counts = self._per_dim()
        top_pos, top_dim = (top[..., j * K : (j + 1) * K].long() for j in (1, 2))
        top_token = top[..., 3 * K + 1 :].long()
        flagged = _flag_table([r.cpu() for r in self.flag_rows], self.layers)
        ids = sorted(set(top_token.flatten().tolist()) | set(flagged["token_id"].tolist()))
        text = dict(zip(ids, token_strings(self.model, ids)))
        flagged.insert(
            4, "token", pd.Series([text[int(i)] for i in flagged["token_id"]], dtype="object", index=flagged.index)
        )
        return MassiveActivations(
            layers=self.layers,
            hook=self.hook,
            top_k=K,
            abs_threshold=self.abs_threshold,
            ratio_threshold=self.ratio_threshold,
            min_share=self.min_share,
            n_samples=N,
            T=T,
            median_over=self.median_over,
            top_values=top[..., :K],
            top_pos=top_pos,
            top_dim=top_dim,
            top_token=top_token,
            median=top[..., 3 * K],
            flag_samples=counts[:, 0].clone(),
            flag_first=counts[:, 1].clone(),
            first_mean=(sums[:, 0] / N).float(),
            first_abs=(sums[:, 1] / N).float(),
            other_abs_max=(sums[:, 2] / N).float(),
            flagged=flagged,
            token_text=text,
            model_name=getattr(self.model, "model_name", None),
            kind=self.kind,
        )


def criterion_text(abs_threshold: float, ratio_threshold: float) -> str:
    """The massive-activation criterion in words, the one phrasing every section of a report uses.

    Parameters
    ----------
    abs_threshold, ratio_threshold : float
        |a| > abs_threshold and >= ratio_threshold x the median |a| of its hidden state (abs_threshold 0: no floor).

    Returns
    -------
    str
        E.g. "|a| > 100 and >= 1000x the median |a| of its hidden state (Sun et al.)", or ">= 50x the median |a| of
        its hidden state (no absolute floor: a narrow model)".
    """
    if float(abs_threshold) <= 0:
        return f">= {ratio_threshold:g}x the median |a| of its hidden state (no absolute floor: a narrow model)"
    who = " (Sun et al.)" if (float(abs_threshold), float(ratio_threshold)) == (SPIKE_ABS, SPIKE_RATIO) else ""
    return f"|a| > {abs_threshold:g} and >= {ratio_threshold:g}x the median |a| of its hidden state{who}"


def spike_criterion(model: SinkModel) -> tuple[float, float]:
    """The massive-activation criterion suited to ``model``'s width: Sun et al.'s (|a| > 100 and >= 1000x the median
    |a| of its hidden state) for a model at least ``NARROW_MODEL_D`` wide, and a relative one for a narrower model
    (no absolute floor, >= ``SPIKE_RATIO_NARROW`` x the median), whose activations never come near 100.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.

    Returns
    -------
    (abs_threshold, ratio_threshold) : tuple of float
    """
    return width_criterion(model_dims(model).d_model)


def width_criterion(d_model: int) -> tuple[float, float]:
    """:func:`spike_criterion` of a model ``d_model`` wide (for models without hooks: the nnsight backend).

    Parameters
    ----------
    d_model : int

    Returns
    -------
    (abs_threshold, ratio_threshold) : tuple of float
    """
    return (0.0, SPIKE_RATIO_NARROW) if d_model < NARROW_MODEL_D else (SPIKE_ABS, SPIKE_RATIO)


def massive_accumulator(
    model: SinkModel,
    tokens_shape,
    *,
    layers=None,
    top_k: int = 3,
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    min_share: float = SPIKE_MIN_SHARE,
    hook: str = "resid_post",
    median_over: str = "sequence",
    kind: str | None = None,
) -> MassiveAccumulator:
    """Check the arguments of :func:`massive_activations` and build its accumulator.

    Parameters
    ----------
    tokens_shape : tuple of int
        (N, T) of the tokens the pass runs over.
    model, layers, top_k, abs_threshold, ratio_threshold, min_share, hook, median_over, kind
        As in :func:`massive_activations`.

    Returns
    -------
    MassiveAccumulator
    """
    if median_over not in ("sequence", "token"):
        raise ValueError(f"median_over must be 'sequence' or 'token'; got {median_over!r}.")
    facts = model_facts(model)
    layers = list(range(facts.dims.n_layers)) if layers is None else check_layers(model, layers)
    if not layers:
        raise ValueError("layers is empty: give at least one layer (None means all).")
    resid_hook(layers[0], hook=hook)
    D = facts.dims.d_model
    if D is None:
        raise ModelContractError("model.cfg has no d_model; set it on the model's config.")
    _check_thresholds(top_k, abs_threshold, ratio_threshold, min_share, D)
    return MassiveAccumulator(
        model,
        layers,
        D,
        hook=hook,
        top_k=top_k,
        abs_threshold=abs_threshold,
        ratio_threshold=ratio_threshold,
        min_share=min_share,
        median_over=median_over,
        kind=kind,
    )


@share_parameters(massive_accumulator)
@parameters_from(pass_options)
@parameters_from(model_tokens)
def massive_activations(
    model: SinkModel,
    tokens,
    *,
    layers: Sequence[int] | None = None,
    top_k: int = 3,
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    min_share: float = SPIKE_MIN_SHARE,
    hook: str = "resid_post",
    median_over: str = "sequence",
    batch_size: int | None = None,
    kind: str | None = None,
) -> MassiveActivations:
    """Massive activations of ``model`` on ``tokens``, per layer, reduced inside the hooks.

    The pass stops after the last layer asked for.

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens`.
    layers : sequence of int, optional
        Blocks whose residual stream to read (default all).
    top_k : int
        The K largest |a| kept per sample and layer.
    abs_threshold, ratio_threshold : float
        Sun et al.'s criterion: |a| > abs_threshold and >= ratio_threshold x the median |a| (100 and 1000).
    min_share : float
        A flagged dimension is a spike dimension of a layer when it is flagged on at least this share of samples.
    hook : {"resid_post", "resid_pre", "resid_mid"}
        The residual stream read.
    median_over : {"sequence", "token"}
        The median the ratio is taken to: over the sample's whole hidden state at that layer (positions x dims, Sun et
        al.'s "median magnitude of its hidden state"), or over the one token's vector (stricter where the first token's
        whole vector is large, as in SmolLM2).
    batch_size, kind
        As in :func:`pass_options`.

    Returns
    -------
    MassiveActivations
        Tensors of shape (N, L, K) and (L, D); ``spike_dims`` and ``first_token_dims`` by layer.
    """
    tokens = check_tokens(model, tokens)
    acc = massive_accumulator(
        model,
        tokens.shape,
        layers=layers,
        top_k=top_k,
        abs_threshold=abs_threshold,
        ratio_threshold=ratio_threshold,
        min_share=min_share,
        hook=hook,
        median_over=median_over,
        kind=kind,
    )
    return run_pass(model, tokens, [acc], batch_size=batch_size)[0]


@parameters_from(model_tokens)
def first_token_spike_dims(
    model: SinkModel,
    tokens,
    *,
    hook: str = "resid_pre",
    layers=None,
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    min_share: float = SPIKE_MIN_SHARE,
    max_samples: int = SPIKE_SAMPLES,
) -> dict[int, list[int]]:
    """The one spike finder: the first token's spike dims per layer, on the first ``max_samples`` sequences.

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens`.
    hook : {"resid_pre", "resid_post", "resid_mid"}
        "resid_pre": the stream block l reads; "resid_post": what block l writes.
    layers : sequence of int, optional
        Blocks to read (default all).
    abs_threshold, ratio_threshold, min_share : float
        As in :func:`massive_activations`.
    max_samples : int
        The sequences used.

    Returns
    -------
    dict of int to list of int
        {layer: the first token's spike dims}; layers without spike dims are left out.
    """
    tokens = check_tokens(model, tokens)
    ma = massive_activations(
        model,
        tokens[:max_samples],
        layers=layers,
        top_k=1,
        hook=hook,
        abs_threshold=abs_threshold,
        ratio_threshold=ratio_threshold,
        min_share=min_share,
    )
    return ma.first_token_dims


def _flag_table(rows: list[torch.Tensor], layers: list[int]) -> pd.DataFrame:
    """Collapse flagged activations to one row per (sample, position, dim), with its layer range and token id."""
    cols = ["sample", "position", "dim", "token_id", "first_layer", "last_layer", "n_layers", "max_abs", "max_ratio"]
    if not rows:
        return pd.DataFrame(
            {c: pd.Series(dtype="int64" if c not in ("max_abs", "max_ratio") else "float64") for c in cols}
        )
    r = torch.cat(rows)
    df = pd.DataFrame(r.numpy(), columns=["sample", "position", "dim", "li", "abs", "ratio", "token_id"])
    for c in ("sample", "position", "dim", "li", "token_id"):
        df[c] = df[c].astype("int64")
    df["layer"] = np.asarray(layers, dtype="int64")[df["li"].to_numpy()]
    g = (
        df.groupby(["sample", "position", "dim"])
        .agg(
            token_id=("token_id", "first"),
            first_layer=("layer", "min"),
            last_layer=("layer", "max"),
            n_layers=("layer", "size"),
            max_abs=("abs", "max"),
            max_ratio=("ratio", "max"),
        )
        .reset_index()
    )
    return g[cols]


def massive_by_kind(model: SinkModel, probes: dict, **kwargs) -> dict[str, MassiveActivations]:
    """:func:`massive_activations` for each named input kind.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    probes : dict of str to ProbeSet or torch.Tensor
        {kind: ProbeSet or token ids of shape (N, T)}.
    **kwargs
        Options of :func:`massive_activations`.

    Returns
    -------
    dict of str to MassiveActivations
    """
    return {
        kind: massive_activations(model, getattr(p, "tokens", p), kind=kind, **kwargs) for kind, p in probes.items()
    }


def kinds_text(results: dict[str, MassiveActivations], *, skip: str | None = None) -> list[str]:
    """One sentence per input kind: its spike dims, or that it has none.

    Parameters
    ----------
    results : dict of str to MassiveActivations
        One result per input kind.
    skip : str, optional
        A kind left out.

    Returns
    -------
    list of str
    """
    return [
        f"On {kind} tokens: "
        + (
            f"spike dims {r.all_spike_dims} at {len(r.spike_dims)} layers (on the first token "
            f"at {len(r.first_token_dims)} of them)."
            if r.has_spike
            else "no massive activation."
        )
        for kind, r in results.items()
        if kind != skip
    ]


def spike_table(results: dict[str, MassiveActivations]) -> pd.DataFrame:
    """Spike dims across input kinds.

    Parameters
    ----------
    results : dict of str to MassiveActivations
        One result per input kind.

    Returns
    -------
    pandas.DataFrame
        One row per (kind, dim): the layers, the first-token share and peak value, the other positions that carry it
        (one row with ``dim`` None for a kind without spikes).
    """
    rows = []
    for kind, r in results.items():
        if not r.has_spike:
            rows.append(
                {
                    "kind": kind,
                    "dim": None,
                    "layers": "",
                    "first_token_share": float("nan"),
                    "peak_first_token": float("nan"),
                    "n_other_positions": 0,
                }
            )
        for d in r.dims.itertuples():
            rows.append(
                {
                    "kind": kind,
                    "dim": d.dim,
                    "layers": d.layers,
                    "first_token_share": d.first_token_share,
                    "peak_first_token": d.first_token_mean,
                    "n_other_positions": d.n_other_positions,
                }
            )
    return pd.DataFrame(rows)


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, Section, register  # noqa: E402


register(
    Analysis(
        "massive",
        result=MassiveActivations,
        every_kind=True,
        order=20,
        hooks=("resid",),
        doc="Input kind -> massive activations.",
        accumulators=lambda p: [
            massive_accumulator(
                p.model, p.tokens.shape, abs_threshold=p.spike[0], ratio_threshold=p.spike[1], kind=p.kind
            )
        ],
        sections=(Section("Massive activations", "spike", 30, runner="analysis.report.sections:_massive"),),
        exports=("massive_activations",),
    )
)
