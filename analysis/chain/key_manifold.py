"""The first key's manifold: is k_1 a point apart from the keys at every other position?

Per attention layer and key/value head (keys live per KV head under GQA), from the keys the queries really see
(the family spec's ``key_hook``, after the q/k norms where the family has them and after the rotary embedding,
applied per the spec where the bridge does not fire ``hook_rot_k``: ``analysis.model.rotary.rotate_as_spec``) at all
positions of N sequences (hybrids: attention layers only, true layer indices, the skipped layers named):

- **distance from the other keys' principal subspace**: PCA of the keys at positions j > 1 (centred
  at their mean mu) gives the top-r principal directions U_r. The first key's relative residual
  ``|P_perp (k_1 - mu)| / |k_1 - mu|`` (``resid_first``, averaged over sequences) is 0 when k_1 lies in
  that subspace and 1 when it is orthogonal to it. ``resid_other`` is the same quantity for the other
  keys themselves (root-mean-square, sqrt(1 - explained variance at r)): the baseline.
  ``offsub_z`` is the first key's off-subspace distance in units of the other keys' RMS off-subspace
  distance (1 = as far off as a typical key).
- **how few components the first keys need**: PCA (scikit-learn) of the N first keys alone; the
  number of components that explain 90% of their variance (``first_n90``), against the same count for
  the N keys at one later position T // 2 (``mid_n90``: same sample size, so a fair control; at most N)
  and for all other keys (``other_n90``); the first PC's share (``first_evr1``) and the first keys' total
  variance relative to their squared norm (``first_var_rel``: 0 when every input gives the same first key).
- **cosine between first keys of different inputs** (``cos_first_pair``, mean over pairs of
  sequences) against the same for the keys at position T // 2 (``cos_mid_pair``) and the mean pairwise
  cosine of all other keys (``cos_other_pair``).
- **norms**: mean |k_1| (``k1_norm``), mean |k_j| (``kj_norm``), their ratio (``norm_ratio``), and the
  first key's distance from the other keys' centroid in units of their RMS spread (``centroid_z``), and
  along the line joining the two means in units of the other keys' standard deviation along that line
  (``axis_z``: how cleanly one direction separates k_1 from every other key).
- **cos(q_t, k_1) against cos(q_t, k_j)** (queries t > 1, keys 1 < j <= t), averaged over the query
  heads that read the KV head, and alpha_1 of those query heads (mean and max), so the table says which
  heads are sinks.
- **2-D coordinates** of every key of a few chosen heads (``scatter``) for the scatter figure: a PCA
  fit on all keys, and the "first-key axis" view (the line joining the other keys' mean to the first
  keys' mean against the other keys' top orthogonal principal direction).

Every statistic but the scatter reduces inside the hooks: the other keys enter through their running
sum and d_head x d_head Gram matrix (exact PCA through the covariance), only the N first keys per head
are kept, and full keys only for the scatter heads.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.core.defaults import SINK_MIN_ALPHA
from analysis.model.hooks import (
    act_name,
    check_attention_layers,
    check_heads,
    check_layers,
    check_tokens,
    group_reduce,
    kv_view,
    model_dims,
    model_facts,
    per_query_head,
    qk_hook_names,
)
from analysis.core.io import jsonable
from analysis.engine.passes import Accumulator, Batch, Reduction, RunningSums, run_pass
from analysis.core.results import Result, layers_text, pass_options
from analysis.core.docs import parameters_from, share_parameters
from analysis.model.families import rotary_base
from analysis.model.nnsight_model import NnsightModel, NnsightUnsupported
from analysis.model.rotary import rotate_as_spec
from analysis.sinks.metric import alpha_from_pattern
from analysis.core.stats import one_thread, pair_cosine, unit_vectors

from analysis.core.defaults import (
    KEY_MANIFOLD_N_COMPONENTS as DEFAULT_N_COMPONENTS,
    KEY_SAME_POINT as SAME_POINT,
    KEY_VARIANCE_LEVEL as VARIANCE_LEVEL,
)


def _check_n_components(n_components, d_head: int | None):
    if isinstance(n_components, bool) or n_components is None:
        raise ValueError(f"n_components must be an int >= 1 or a variance fraction in (0, 1); got {n_components!r}.")
    if isinstance(n_components, (int, np.integer)):
        if n_components < 1 or (d_head is not None and n_components >= d_head):
            raise ValueError(
                f"n_components={n_components} must lie in [1, d_head - 1 = {None if d_head is None else d_head - 1}] "
                "(a subspace of the key space that leaves room for a residual), or be a variance fraction in (0, 1) "
                "such as 0.9."
            )
        return int(n_components)
    n_components = float(n_components)
    if not 0.0 < n_components < 1.0:
        raise ValueError(
            f"a fractional n_components is the share of the other keys' variance the subspace explains and must "
            f"lie in (0, 1); got {n_components}. Pass an int for a fixed number of components."
        )
    return n_components


@contextmanager
def small_linalg():
    """A context in which small (d_head x d_head) linear algebra runs on one thread: on a busy CPU, thread pools make a
    64 x 64 eigendecomposition a hundred times slower.

    Returns
    -------
    contextlib.AbstractContextManager
    """
    from threadpoolctl import threadpool_limits

    with one_thread(), threadpool_limits(limits=1):
        yield


def _n_for_variance(evr_cum: np.ndarray, level: float):
    """Smallest number of components whose cumulative explained-variance ratio reaches ``level``, along the last
    axis (an int for one head, an int array for a stack); 0 where the ratios are empty, not finite or not positive."""
    evr_cum = np.asarray(evr_cum)
    if evr_cum.shape[-1] == 0:
        out = np.zeros(evr_cum.shape[:-1], dtype=np.int64)
    else:  # ratios ascend, so counting those below the level is searchsorted
        last = evr_cum[..., -1]
        n = np.minimum((evr_cum < level - 1e-12).sum(-1) + 1, evr_cum.shape[-1])
        out = np.where(np.isfinite(last) & (last > 0), n, 0)
    return int(out) if out.ndim == 0 else out.astype(np.int64)


@dataclass
class KeyManifold(Result):
    """Per (layer, KV head) first-key statistics; the module docstring describes each column of ``table``.

    L: the attention layers measured, H_sel: the KV heads analysed, H: query heads.

    Attributes
    ----------
    table : pandas.DataFrame
        One row per (layer, KV head): the subspace residuals, component counts, pairwise cosines, norms, cos(q, k)
        and alpha_1 of its query heads.
    layers : list of int, length L
        The true layer index of each position on the layer axis.
    kv_heads : list of int, length H_sel
        The KV heads analysed.
    n_components : int or float
        The other keys' principal subspace (a number of components, or a share of their variance).
    n_samples : int
        N, the number of sequences.
    T : int
        The sequence length.
    group_size : int
        Query heads per KV head.
    rotated : bool
        Keys after the rotary embedding.
    first_evr : torch.Tensor, shape (L, H_sel, m)
        The cumulative explained-variance ratio of the first keys alone (m = min(N, d_head)).
    other_evr : torch.Tensor, shape (L, H_sel, d_head)
        The cumulative explained-variance ratio of the other keys.
    cos_q_k1 : torch.Tensor, shape (L, H)
        Per query head: mean cos(q_t, k_1), t > 1.
    cos_q_kj : torch.Tensor, shape (L, H)
        Per query head: mean cos(q_t, k_j), 1 < j <= t.
    alpha_1 : torch.Tensor, shape (L, H)
        Per query head: mean alpha_1.
    scatter : dict
        (layer, KV head) -> {"coords": (N, T, 2) coordinates, "evr": the two components' shares, ...}.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    skipped : str
        The layers left out (hybrids: linear-attention / Mamba layers), in words; "" when none.
    first_token_dims : dict of int to list of int, optional
        The first token's spike dims per layer where ``massive`` ran in the same pass (``analysis.profile``): the
        findings and ``to_dict()`` then split the sink layers by whether they read the spike (``by_spike``).
    """

    table: pd.DataFrame
    layers: list[int]
    kv_heads: list[int]
    n_components: float | int
    n_samples: int
    T: int
    group_size: int
    rotated: bool
    first_evr: torch.Tensor  # (L, Hsel, m) cumulative explained-variance ratio of the first keys alone
    other_evr: torch.Tensor  # (L, Hsel, d) cumulative explained-variance ratio of the other keys
    cos_q_k1: torch.Tensor  # (L, H) per query head: mean cos(q_t, k_1), t > 1
    cos_q_kj: torch.Tensor  # (L, H) per query head: mean cos(q_t, k_j), 1 < j <= t
    alpha_1: torch.Tensor  # (L, H) per query head: mean alpha_1
    scatter: dict = field(default_factory=dict)  # (layer, kv_head) -> {"coords": (N, T, 2), "evr": [2], ...}
    model_name: str | None = None
    kind: str | None = None
    skipped: str = ""  # the layers left out (hybrids: linear-attention / Mamba layers), in words
    first_token_dims: dict | None = None  # the spike dims of massive, run in the same pass

    table_fields = ("kv_heads=table",)

    def skipped_text(self) -> str:
        """The layers left out, as one sentence ('' when none)."""
        return f"{self.skipped[0].upper()}{self.skipped[1:]}." if self.skipped else ""

    def text(self, min_alpha: float = SINK_MIN_ALPHA) -> str:
        return " ".join(self.findings(min_alpha))

    def findings(self, min_alpha: float = SINK_MIN_ALPHA) -> list[str]:
        """The first keys of sink KV heads against the others, in words."""
        S = self.summary(min_alpha)
        sk, ot = S["sink"], S["non_sink"]
        mid = self.T // 2 + 1
        skipped = [self.skipped_text()] if self.skipped else []
        if S["n_sink_kv_heads"] == 0:
            return [
                f"No KV head has alpha_1 above {min_alpha} on these inputs, so there is no sink head's first key to "
                f"describe; over all heads the first keys of different inputs have mean cosine "
                f"{ot['cos_first_pair']:.3f}.",
                *skipped,
            ]
        few = (
            "they are one point (no variance left to explain)"
            if sk["first_n90"] < 0.5
            else f"they need {sk['first_n90']:.1f} principal components for 90% of their variance, against "
            f"{sk['mid_n90']:.1f} for as many keys at position {mid}"
        )
        out = [
            f"In {S['n_sink_kv_heads']} sink KV heads (alpha_1 > {min_alpha}) the first keys of different inputs "
            f"have mean pairwise cosine {sk['cos_first_pair']:.3f}, against {sk['cos_mid_pair']:.3f} for the keys at "
            f"position {mid}; {few}.",
            f"Queries point at the first key in sink heads: cos(q_t, k_1) = {sk['cos_q_k1']:.2f} against "
            f"cos(q_t, k_j) = {sk['cos_q_kj']:.2f}, although |k_1| / |k_j| = {sk['norm_ratio']:.2f}.",
        ]
        if S["n_other_kv_heads"]:
            out.append(
                f"The first key k_1 lies {sk['offsub_z']:.2f} times as far off the other keys' principal subspace "
                f"(90% of their variance) as those keys do in sink heads, against {ot['offsub_z']:.2f} in the other "
                f"{S['n_other_kv_heads']} KV heads (relative residual {sk['resid_first']:.2f} vs "
                f"{sk['resid_other']:.2f})."
            )
        return out + skipped + self._spike_findings()

    def _spike_findings(self) -> list[str]:
        """The sink layers that read the first token's spike against those before it, where the spike dims are known."""
        said = self.by_spike_text(self.first_token_dims) if self.first_token_dims is not None else ""
        return [said] if said else []

    def head_text(self, layer: int, kv_head: int) -> str:
        """One KV head's first keys in words."""
        r = self.head(layer, kv_head)
        return (
            f"Layer {layer}, KV head {kv_head} (alpha_1 {r.alpha_1_max:.2f}): the first keys of {self.n_samples} inputs have "
            f"mean pairwise cosine {r.cos_first_pair:.3f} (keys at position {self.T // 2 + 1}: {r.cos_mid_pair:.3f}) and sit "
            f"{r.axis_z:.1f} standard deviations from the other keys along one axis; cos(q_t, k_1) = {r.cos_q_k1:.2f}, "
            f"|k_1| / |k_j| = {r.norm_ratio:.2f}."
        )

    def subspace_layers(self, min_alpha: float = SINK_MIN_ALPHA) -> dict[str, list[int]]:
        """Sink layers where k_1 lies inside the other keys' principal subspace (relative residual below theirs)
        and where it lies off it (mean over the layer's KV heads)."""
        by_layer = self.table.groupby("layer").mean(numeric_only=True)
        sinky = by_layer[by_layer.alpha_1_mean > min_alpha]
        return {
            "inside": [int(l) for l in sinky.index[sinky.resid_first < sinky.resid_other]],
            "off": [int(l) for l in sinky.index[sinky.resid_first > sinky.resid_other]],
        }

    def subspace_text(self, min_alpha: float = SINK_MIN_ALPHA) -> str:
        s = self.subspace_layers(min_alpha)
        inside = layers_text(s["inside"]) if s["inside"] else "no sink layer"
        off = layers_text(s["off"]) if s["off"] else "no sink layer"
        return (
            f"The first key k_1 lies inside the other keys' principal subspace in {inside} and off it in {off} "
            f"(sink layers: alpha_1 > {min_alpha})."
        )

    def by_spike(self, first_token_dims: dict[int, list[int]], min_alpha: float = SINK_MIN_ALPHA) -> dict:
        """Mean first-key statistics of sink layers whose input carries the first token's spike (block l reads
        ``hook_resid_post`` of l - 1) against sink layers before the first such layer."""
        reading = sorted({l + 1 for l in first_token_dims})
        by_layer = self.table.groupby("layer").mean(numeric_only=True)
        sinky = by_layer[by_layer.alpha_1_mean > min_alpha]
        groups = {"reading": sinky[sinky.index.isin(reading)]}
        if reading:
            groups["before"] = sinky[sinky.index < min(reading)]
        cols = ("resid_first", "resid_other", "offsub_z", "cos_first_pair", "cos_q_k1")
        return {
            name: {"layers": [int(x) for x in g.index], **{c: float(g[c].mean()) for c in cols}}
            for name, g in groups.items()
            if len(g)
        }

    def by_spike_text(self, first_token_dims: dict[int, list[int]]) -> str:
        """Where k_1 lies in sink layers that read the spike against sink layers before it ('' if undefined)."""
        split = self.by_spike(first_token_dims)
        r, p = split.get("reading"), split.get("before")
        if not (r and p):
            return ""
        where = lambda g: "off" if g["resid_first"] > g["resid_other"] else "inside"  # noqa: E731
        return (
            f"In sink layers that read the first token's spike ({layers_text(r['layers'])}), k_1 lies {where(r)} the "
            f"other keys' principal subspace (relative residual {r['resid_first']:.2f} against {r['resid_other']:.2f} "
            f"for the other keys); in sink layers before the spike appears ({layers_text(p['layers'])}) it lies "
            f"{where(p)} it ({p['resid_first']:.2f} against {p['resid_other']:.2f})."
        )

    def head(self, layer: int, kv_head: int) -> pd.Series:
        """The table row of one (layer, KV head)."""
        rows = self.table[(self.table.layer == layer) & (self.table.kv_head == kv_head)]
        if rows.empty:
            raise ValueError(
                f"(layer {layer}, KV head {kv_head}) was not analysed; layers {self.layers}, KV heads {self.kv_heads}."
            )
        return rows.iloc[0]

    def sink_kv_heads(self, min_alpha: float = SINK_MIN_ALPHA, by: str = "alpha_1_mean") -> list[tuple[int, int]]:
        """(layer, KV head) pairs whose query heads' alpha_1 (max or mean over the group) exceeds ``min_alpha``."""
        t = self.table[self.table[by] > min_alpha]
        return list(zip(t.layer.tolist(), t.kv_head.tolist()))

    def summary(self, min_alpha: float = SINK_MIN_ALPHA, by: str = "alpha_1_mean") -> dict:
        """Mean statistics over sink KV heads (``by``, alpha_1 averaged (or max) over the KV head's query heads,
        above ``min_alpha``) against the others."""
        if by not in ("alpha_1_mean", "alpha_1_max"):
            raise ValueError(f"by must be 'alpha_1_mean' or 'alpha_1_max'; got {by!r}.")
        sink = self.table[by] > min_alpha
        cols = [
            "resid_first",
            "resid_other",
            "offsub_z",
            "centroid_z",
            "axis_z",
            "cos_first_pair",
            "cos_mid_pair",
            "cos_other_pair",
            "cos_q_k1",
            "cos_q_kj",
            "first_n90",
            "mid_n90",
            "other_n90",
            "first_var_rel",
            "k1_norm",
            "kj_norm",
            "norm_ratio",
        ]
        out = {
            "n_sink_kv_heads": int(sink.sum()),
            "n_other_kv_heads": int((~sink).sum()),
            "min_alpha": min_alpha,
            "by": by,
        }
        for name, mask in (("sink", sink), ("non_sink", ~sink)):
            out[name] = {c: (float(self.table.loc[mask, c].mean()) if mask.any() else None) for c in cols}
        return out

    def to_dict(self) -> dict:
        return jsonable(
            {
                **self.header(),
                "T": self.T,
                "layers": self.layers,
                "kv_heads": self.kv_heads,
                "group_size": self.group_size,
                "n_components": self.n_components,
                "rotated_keys": self.rotated,
                "skipped": self.skipped,
                "variance_level": VARIANCE_LEVEL,
                "table": self.table,
                "cos_q_k1_per_query_head": self.cos_q_k1.tolist(),
                "cos_q_kj_per_query_head": self.cos_q_kj.tolist(),
                "alpha_1_per_query_head": self.alpha_1.tolist(),
                "first_evr_cumulative": self.first_evr.tolist(),
                "other_evr_cumulative": self.other_evr.tolist(),
                "summary": self.summary(),
                "text": self.text(),
                "scatter": [
                    {
                        "layer": l,
                        "kv_head": h,
                        "fit_on": s["fit_on"],
                        "explained_variance_ratio": s["evr"],
                        "alpha_1_max": s.get("alpha_1_max"),
                        "axis_z": s["axis_z"],
                        "coords": np.round(s["coords"], 4).tolist(),  # [sequence][position][pc]
                        "axis_coords": np.round(s["axis_coords"], 4).tolist(),
                    }
                    for (l, h), s in self.scatter.items()
                ],
                **({} if self.first_token_dims is None else {"by_spike": self.by_spike(self.first_token_dims)}),
            }
        )


def _pca(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's ``PCA(svd_solver="full")`` fit of x (n, d), float64, with its arithmetic and without its
    overhead (nor its import): the mean, the components (rows, signs as ``svd_flip(u_based_decision=False)``)
    and every component's explained-variance ratio."""
    from scipy import linalg

    mean = np.mean(x, axis=0)
    centred = x.copy()
    centred -= mean
    _, S, Vt = linalg.svd(centred, full_matrices=False)
    var = S**2 / (x.shape[0] - 1)
    big = np.argmax(np.abs(Vt), axis=1)
    Vt *= np.sign(np.take(np.reshape(Vt, (-1,)), big + np.arange(Vt.shape[0]) * Vt.shape[1]))[:, np.newaxis]
    return mean, Vt, var / np.sum(var)


def _pca_few(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PCA of a few keys per head, x (M, n, d): cumulative explained-variance ratios (M, min(n, d)), the number of
    components for ``VARIANCE_LEVEL`` of the variance (M,) and the first component's share (M,). Keys whose total
    variance is below ``SAME_POINT`` of their mean squared norm are one point: (zeros, 0, nan)."""
    M, n, d = x.shape
    m = min(n, d)
    sq = (x**2).sum(-1).mean(-1)
    same = (x.var(dim=1, unbiased=False).sum(-1) <= SAME_POINT * sq.clamp(min=1e-30)).numpy()
    X = x.double().numpy()
    S = np.linalg.svd(X - X.mean(axis=1, keepdims=True), compute_uv=False)[:, :m]
    var = S**2 / (n - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = var / var.sum(-1, keepdims=True)
    cum = np.where(same[:, None], 0.0, np.cumsum(ratio, axis=-1))
    return cum, np.where(same, 0, _n_for_variance(cum, VARIANCE_LEVEL)), np.where(same, np.nan, ratio[:, 0])


def _pca2(keys: torch.Tensor) -> dict:
    """Two 2-D views of all keys (N, T, d) of one head, first keys included.

    ``coords``: PCA fit on all keys (scikit-learn's arithmetic: ``_pca``). ``axis_coords``: x = the projection on
    the line from the other keys' mean to the first keys' mean (the "first-key axis"), y = the other keys' top
    principal direction orthogonal to it; both centred at the other keys' mean. ``axis_z`` = the first keys' mean
    x over the other keys' standard deviation along x.
    """
    N, T, d = keys.shape
    if N * T < 3:
        raise ValueError(f"a 2-D PCA needs at least 3 keys; got {N * T}. Give more sequences or tokens.")
    k = keys.double()
    x = k.reshape(N * T, d).numpy()
    mean, components, ratio = _pca(x)
    components = np.ascontiguousarray(components[:2])
    coords = x @ components.T
    coords -= np.reshape(mean, (1, -1)) @ components.T  # as PCA.transform: centred after the projection
    other = k[:, 1:].reshape(-1, d)
    mu = other.mean(0)
    axis = k[:, 0].mean(0) - mu
    axis = axis / axis.norm().clamp(min=1e-30)
    rest = other - mu
    rest = rest - (rest @ axis)[:, None] * axis
    y_dir = torch.linalg.svd(rest, full_matrices=False).Vh[0]
    centred = k.reshape(N * T, d) - mu
    axis_coords = torch.stack([centred @ axis, centred @ y_dir], dim=-1).reshape(N, T, 2)
    sd = float(axis_coords[:, 1:, 0].std())
    return {
        "coords": coords.reshape(N, T, 2).astype(np.float32),
        "evr": [float(v) for v in ratio[:2]],
        "fit_on": "all keys (first keys included)",
        "axis_coords": axis_coords.float().numpy(),
        "axis_z": float(axis_coords[:, 0, 0].mean()) / sd if sd > 0 else float("inf"),
    }


class ScatterKeys:
    """Keys at all positions (N, T, d_head) of a few (layer, KV head) pairs, for the 2-D scatter: the ``explicit``
    pairs, and with ``auto`` the analysed KV heads with the largest and the smallest alpha_1 (max over the
    KV head's query heads), chosen on the first batch from each layer's two candidates (:func:`key_stats`), so a
    remote trace returns the keys of two heads per layer on the first batch and of the chosen ones after it."""

    def __init__(self, explicit: list[tuple[int, int]], auto: bool):
        self.kept: dict[tuple[int, int], list[torch.Tensor]] = {h: [] for h in explicit}
        self.auto, self.batch_no = auto, 0
        self.pick: dict[str, tuple[float, tuple[int, int]]] = {}  # "max"/"min" -> (alpha, (layer, kv_head))

    def keep(self, layer: int) -> list[int]:
        """The KV heads of ``layer`` whose keys its reduction returns (the first batch's candidates aside)."""
        return [h for l, h in self.kept if l == layer]

    def fold(self, layer: int, stats: dict, heads: list[int]) -> None:
        """Keep the keys ``stats["keys"]`` (B, T, n, d) of :meth:`keep`'s heads, and on the first batch choose among
        the layer's candidates (the last two, ``stats["picks"]`` into ``heads``, scored by ``stats["alpha_kv"]``)."""
        keys = stats["keys"].cpu()
        for j, h in enumerate(self.keep(layer)):
            self.kept[(layer, h)].append(keys[:, :, j])
        if "picks" not in stats:
            return
        for slot, which in enumerate(("max", "min")):
            j = int(stats["picks"][slot])
            a = float(stats["alpha_kv"][j])
            if which not in self.pick or (a > self.pick[which][0] if which == "max" else a < self.pick[which][0]):
                self.pick[which] = (a, (layer, heads[j]))
                self.kept[(layer, heads[j])] = [keys[:, :, keys.shape[2] - 2 + slot]]
        chosen = {v[1] for v in self.pick.values()}
        self.kept = {h: c for h, c in self.kept.items() if h in chosen}

    def heads(self) -> dict[tuple[int, int], torch.Tensor]:
        order = [self.pick[w][1] for w in ("max", "min") if w in self.pick] if self.auto else list(self.kept)
        return {h: torch.cat(self.kept[h]) for h in dict.fromkeys(order) if self.kept.get(h)}


def _vectors(acts: dict, spec, layer: int, rotated: bool, n_kv_heads: int):
    """The queries (None where not read) and the KV heads' keys the attention of ``layer`` uses, float32: per the family
    spec (``rotate_as_spec``), or where ``spec`` is None (a remote trace) as read, after the rotary."""
    turn = (lambda x: x.float()) if spec is None else (lambda x: rotate_as_spec(x, spec, layer, rotated=rotated))
    return (turn(acts["q"]) if "q" in acts else None), kv_view(turn(acts["k"]), n_kv_heads)


def key_stats(acts: dict, *, n_heads: int, heads, keep, pick: bool, **where) -> dict:
    """One layer's reduce for the first-key manifold, float64 sums over the batch where they are sums.

    Parameters
    ----------
    acts : dict
        {"k": keys; on an analysed layer also "q" and "pattern" (the map or ``AttentionWeights``)}.
    n_heads : int
    heads : list of int or None
        The analysed KV heads (S of them; None: a layer read for the scatter only).
    keep : list of int
        The KV heads whose keys at every position come back (the scatter's).
    pick : bool
        Also return the layer's scatter candidates (the automatic choice, on the first batch).
    **where
        ``spec``, ``layer``, ``rotated``, ``n_kv_heads``: how the keys are read (``rotate_as_spec``).

    Returns
    -------
    dict of str to torch.Tensor
        "keys" (B, T, n, d) of ``keep``, then (``pick``) of the analysed KV heads of largest and smallest alpha_1
        ("picks" into ``heads``, scored by "alpha_kv" (S,)); the other keys' "sum", "unit_sum" (S, d) and "gram"
        (S, d, d), "k1_norm" and "kj_norm" (S,), the first keys and the keys at T // 2 ("ends", (B, 2, S, d)); per
        query head sum_t cos(q_t, k_1), sum_t sum_{1<j<=t} cos(q_t, k_j) and alpha_1 ("cos_q_k1", "cos_q_kj",
        "alpha" (H,)).
    """
    q, kk = _vectors(acts, **where)
    out = {"keys": kk[:, :, keep]}
    if heads is None:
        return out
    B, T, K, d = kk.shape
    units = getattr(acts, "units", None) or (lambda x: unit_vectors(x.float()))  # shared with the QK angles here
    kn, norms = units(kk)
    ks, ns = (kk, norms) if heads == list(range(K)) else (kk[:, :, heads], norms[:, :, heads])
    other = torch.empty(len(heads), B, T - 1, d, dtype=torch.float64, device=ks.device)
    other = other.copy_(ks[:, 1:].permute(2, 0, 1, 3)).view(len(heads), B * (T - 1), d)  # converted as copied
    qn = units(q)[0][:, 1:]  # unit queries t > 1 against each query head's KV head (cumulative unit keys 2..t)
    a1 = alpha_from_pattern(acts["pattern"], 1)[..., 0].double()  # (B, H)
    out |= {
        "sum": other.sum(1),
        "gram": other.transpose(1, 2) @ other,
        "unit_sum": unit_vectors(other)[0].sum(1),
        "k1_norm": ns[:, 0].double().sum(0),
        "kj_norm": ns[:, 1:].double().sum((0, 1)),
        "ends": ks[:, [0, T // 2]],  # only the first keys are kept, and as a same-size control the keys at T // 2
        "cos_q_k1": torch.einsum("bthd,bhd->h", qn, per_query_head(kn[:, 0], n_heads, dim=1)).double(),
        "cos_q_kj": _dot_cumulative(qn, kn[:, 1:].cumsum(dim=1), n_heads).double(),
        "alpha": a1.sum(0),
    }
    if pick:
        a_kv = group_reduce(a1.mean(0), n_heads // K, how="max")[heads]
        picks = torch.stack([a_kv.argmax(), a_kv.argmin()])
        out |= {"alpha_kv": a_kv, "picks": picks, "keys": torch.cat([out["keys"], ks[:, :, picks]], 2)}
    return out


class KeyManifoldAccumulator(Accumulator):
    """Per analysed layer and KV head: the other keys' running sum, Gram matrix and unit-vector sum; the first
    keys and the keys at position T // 2; norms; query-key cosines and alpha_1 per query head (:func:`key_stats`,
    here and in a remote trace)."""

    def __init__(
        self,
        model,
        layers,
        heads,
        T: int,
        n_components,
        scatter: ScatterKeys,
        *,
        rotated: bool = True,
        kind: str | None = None,
    ):
        facts = model_facts(model)
        dims = facts.dims
        self.model, self.layers, self.heads, self.T, self.kind = model, list(layers), list(heads), int(T), kind
        self.n_components, self.scatter, self.rotated = n_components, scatter, rotated
        self.spec = spec = facts.family  # None: a model loaded for a remote trace (no FamilySpec)
        self.rotary = spec.rotary if spec else rotary_base(model) is not None
        self.skipped = spec.skipped_text() if spec else facts.skipped
        self.H, self.K, self.group = dims.n_heads, dims.n_kv_heads, dims.group_size
        self.index = {l: i for i, l in enumerate(self.layers)}
        self.sums = RunningSums(len(self.layers))  # on each layer's device until the result
        self.ends: list[list[torch.Tensor]] = [[] for _ in self.layers]  # per layer and batch: (B, 2, S, d)
        self.n = 0

    def hooks(self):
        out = {}
        for l in sorted({*self.layers, *(l for l, _ in self.scatter.kept)}):  # the spec's hooks, rotated as asked
            q, k = qk_hook_names(self.model, l) if self.spec else (act_name("rot_q", l), act_name("rot_k", l))
            out[l] = {"q": q, "k": k, "pattern": act_name("pattern", l)} if l in self.index else {"k": k}
        return out

    def _where(self, layer: int) -> dict:  # no layer where no spec turns the keys: layers of one shape reduce alike
        return {"spec": self.spec, "layer": layer if self.spec else None, "rotated": self.rotated, "n_kv_heads": self.K}

    def vectors(self, layer: int, acts: dict) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The queries (B, T, H, d; None where not read) and keys (B, T, H_kv, d) the attention of ``layer`` uses."""
        return _vectors(acts, **self._where(layer))

    def reduction(self, layer: int) -> Reduction:
        mine = layer in self.index  # else a layer read for the scatter only
        pick = mine and self.scatter.auto and self.scatter.batch_no == 0  # the scatter's candidates, on the first batch
        keep, heads = self.scatter.keep(layer), self.heads if mine else None
        return Reduction(key_stats, dict(n_heads=self.H, heads=heads, keep=keep, pick=pick, **self._where(layer)))

    def fold(self, layer: int, stats: dict, batch: Batch) -> None:
        i = self.index.get(layer)
        if i is not None:
            for name in ("sum", "gram", "unit_sum", "k1_norm", "kj_norm", "cos_q_k1", "cos_q_kj", "alpha"):
                self.sums.add(name, i, stats[name])
            self.ends[i].append(stats["ends"].cpu())
            self.n += batch.size if i == 0 else 0
        self.scatter.fold(layer, stats, self.heads)

    def end_batch(self, batch: Batch, logits) -> None:
        self.scatter.batch_no += 1

    def result(self) -> KeyManifold:
        N, T, h = self.n, self.T, self.sums.host
        n_other = N * (T - 1)
        per_q = {
            "cos_q_k1": (h("cos_q_k1", (self.H,)) / (N * (T - 1))).float(),
            "cos_q_kj": (h("cos_q_kj", (self.H,)) / (N * T * (T - 1) // 2)).float(),
            "alpha_1": (h("alpha", (self.H,)) / N).float(),
        }
        mu = h("sum", ()) / n_other  # (L, S, d)
        cov = h("gram", ()) / n_other - mu[..., :, None] * mu[..., None, :]
        L, S, d = mu.shape

        def per_head(j):  # [layer][batch] (B, 2, S, d) -> (L S, N, d), heads in (layer, head) order
            return torch.stack([torch.cat(c)[:, j] for c in self.ends]).double().transpose(1, 2).reshape(L * S, N, d)

        with small_linalg():
            evals, evecs = torch.linalg.eigh(cov)  # ascending, batched over (L, S)
            cols, f_cum, evr_cum = _head_stats(
                evals.flip(-1).clamp(min=0).reshape(L * S, d),
                evecs.flip(-1).reshape(L * S, d, d),
                mu.reshape(L * S, d),
                cov.reshape(L * S, d, d),
                per_head(0),
                per_head(1),
                h("unit_sum", ()).reshape(L * S, d),
                n_other,
                self.n_components,
            )
            first_evr = torch.as_tensor(f_cum, dtype=torch.float32).reshape(L, S, -1)
            other_evr = torch.as_tensor(evr_cum, dtype=torch.float32).reshape(L, S, d)
            return self._result(pd.DataFrame(self._rows(cols, per_q)), first_evr, other_evr, per_q)

    def _rows(self, cols: dict, per_q: dict) -> dict[str, list]:
        """The table's columns, one row per (layer, KV head): ``head_stats`` columns (``cols``, heads in (layer, head)
        order) joined with the norms and the per-query-head statistics averaged (alpha_1 also maxed) over the KV head's
        query heads."""
        N, g, h = self.n, self.group, self.sums.host
        by_kv = lambda x, how="mean": group_reduce(x, g, how=how)[:, self.heads].flatten().tolist()  # noqa: E731
        return {
            "layer": [l for l in self.layers for _ in self.heads],
            "kv_head": self.heads * len(self.layers),
            "query_heads": [",".join(map(str, range(k * g, (k + 1) * g))) for k in self.heads] * len(self.layers),
            "alpha_1_mean": by_kv(per_q["alpha_1"]),
            "alpha_1_max": by_kv(per_q["alpha_1"], "max"),
            "k1_norm": (h("k1_norm", ()) / N).flatten().tolist(),
            "kj_norm": (h("kj_norm", ()) / (N * (self.T - 1))).flatten().tolist(),
            **cols,
            "cos_q_k1": by_kv(per_q["cos_q_k1"]),
            "cos_q_kj": by_kv(per_q["cos_q_kj"]),
        }

    def _result(self, table, first_evr, other_evr, per_q) -> KeyManifold:
        table["norm_ratio"] = table.k1_norm / table.kj_norm
        km = KeyManifold(
            table=table,
            layers=self.layers,
            kv_heads=self.heads,
            n_components=self.n_components,
            n_samples=self.n,
            T=self.T,
            group_size=self.group,
            rotated=self.rotated and self.rotary,
            first_evr=first_evr,
            other_evr=other_evr,
            cos_q_k1=per_q["cos_q_k1"],
            cos_q_kj=per_q["cos_q_kj"],
            alpha_1=per_q["alpha_1"],
            model_name=getattr(self.model, "model_name", None),
            kind=self.kind,
            skipped=self.skipped,
        )
        for (l, h), keys in self.scatter.heads().items():
            entry = _pca2(keys)
            row = table[(table.layer == l) & (table.kv_head == h)]
            entry["alpha_1_max"] = float(row.alpha_1_max.iloc[0]) if len(row) else None
            km.scatter[(l, h)] = entry
        return km


_INT_COLUMNS = ("r", "first_n90", "mid_n90", "other_n90")  # the table columns that are counts


def _head_stats(
    evals, evecs, mu, cov, k1, mid, unit_sum, n_other: int, n_components
) -> tuple[dict, np.ndarray, np.ndarray]:
    """The table columns of M (layer, KV head) pairs at once, from the other keys' eigen-decomposition (evals
    (M, d) descending, evecs (M, d, d)), mean mu (M, d) and covariance cov (M, d, d), the N first keys k1 and the N
    keys at position T // 2 mid (M, N, d), and the other keys' unit-vector sum (M, d); returns {column: M python
    numbers}, the first keys' cumulative explained-variance ratios (M, min(N, d)) and the other keys' (M, d)."""
    M, d = evals.shape
    total = evals.sum(-1)
    evr_cum = torch.where(total[:, None] > 0, evals.cumsum(-1) / total[:, None], torch.zeros(())).numpy()
    r = np.minimum(n_components if isinstance(n_components, int) else _n_for_variance(evr_cum, n_components), d - 1)
    kept = torch.as_tensor(np.arange(d)[None] < np.broadcast_to(r, (M,))[:, None])  # (M, d): the top-r directions
    shift = k1.mean(1) - mu
    axis_var = torch.einsum("md,mde,me->m", shift, cov, shift) / (shift * shift).sum(-1).clamp(min=1e-30)
    c = k1 - mu[:, None]
    perp = (c - ((c @ evecs) * kept[:, None]) @ evecs.transpose(1, 2)).norm(dim=-1)  # off the top-r subspace
    c_norm = c.norm(dim=-1)
    resid_var = (evals * ~kept).sum(-1)
    k1_sq = (k1**2).sum(-1).mean(-1)
    first_var = k1.var(dim=1, unbiased=False).sum(-1)
    f_cum, first_n90, first_evr1 = _pca_few(k1)
    _, mid_n90, _ = _pca_few(mid)
    pos = total > 0
    nan, inf = (torch.tensor(float(x), dtype=total.dtype) for x in ("nan", "inf"))
    cols = {
        "r": np.broadcast_to(r, (M,)),
        "resid_first": (perp / c_norm.clamp(min=1e-30)).mean(-1),
        "resid_other": torch.where(pos, (resid_var.clamp(min=0) / total).sqrt(), nan),
        "offsub_z": torch.where(resid_var > 0, perp.mean(-1) / resid_var.sqrt(), inf),
        "centroid_z": torch.where(pos, c_norm.mean(-1) / total.sqrt(), inf),
        "axis_z": torch.where(axis_var > 0, shift.norm(dim=-1) / axis_var.sqrt(), inf),
        "first_n90": first_n90,
        "mid_n90": mid_n90,
        "other_n90": np.broadcast_to(_n_for_variance(evr_cum, VARIANCE_LEVEL), (M,)),
        "first_evr1": first_evr1,
        "first_var_rel": torch.where(k1_sq > 0, first_var / k1_sq, nan),
        "cos_first_pair": _pair_cosines(k1),
        "cos_mid_pair": _pair_cosines(mid),
        "cos_other_pair": ((unit_sum * unit_sum).sum(-1) - n_other) / (n_other * (n_other - 1)),
    }
    return (
        {k: [int(x) if k in _INT_COLUMNS else float(x) for x in np.asarray(v).tolist()] for k, v in cols.items()},
        f_cum,
        evr_cum,
    )


def _pair_cosines(x: torch.Tensor) -> torch.Tensor:
    """``mean_pairwise_cosine`` of each head's rows, x (M, n, d) -> (M,), float32 as it rounds."""
    if x.shape[1] < 2:
        return torch.full(x.shape[:1], float("nan"))
    return pair_cosine(torch.nn.functional.normalize(x.double(), dim=-1).sum(1), x.shape[1])


def _dot_cumulative(qn: torch.Tensor, cum: torch.Tensor, H: int) -> torch.Tensor:
    """``einsum("bthd,bthd->h", qn, cum repeated per query head)`` for queries qn (B, T', H, d) and cumulative key
    sums cum (B, T', H_kv, d): each KV head's group of query heads against its keys by broadcasting, in one product
    and one sum (no repeated or transposed copy; about 2x faster than einsum's batched product on the CPU)."""
    K = cum.shape[2]
    return (qn.unflatten(2, (K, H // K)) * cum[:, :, :, None]).sum((0, 1, 4)).flatten()


def _check_kv_heads(model, heads, scatter_heads) -> tuple[list[int], list[tuple[int, int]], bool]:
    """KV heads to analyse, explicit scatter pairs, and whether the scatter heads are picked automatically."""
    dims = model_dims(model)
    n_kv = dims.n_kv_heads
    heads = list(range(n_kv)) if heads is None else [int(h) for h in heads]
    bad = [h for h in heads if not 0 <= h < n_kv]
    if bad or not heads:
        raise ValueError(
            f"KV heads {bad or heads} out of range: this model has KV heads 0..{n_kv - 1} "
            f"({dims.n_heads} query heads, {dims.group_size} per KV head)."
        )
    auto = isinstance(scatter_heads, str)
    if auto and scatter_heads != "auto":
        raise ValueError(
            f"scatter_heads must be 'auto', None or a list of (layer, KV head) pairs; got {scatter_heads!r}."
        )
    explicit = [] if (auto or not scatter_heads) else check_heads(model, scatter_heads, kv=True, name="scatter_heads")
    return heads, explicit, auto


def _check_sizes(N: int, T: int, n_components) -> None:
    if N < 2:
        raise ValueError(
            "the first-key manifold compares first keys of different inputs: give at least 2 sequences "
            f"(better 16 or more); got {N}."
        )
    if T < 3:
        raise ValueError(
            f"the first-key manifold needs T >= 3 tokens (a first key and other keys to fit a PCA on); got T={T}."
        )
    if isinstance(n_components, int) and N * (T - 1) <= n_components:
        raise ValueError(
            f"too few samples for a PCA with {n_components} components: {N * (T - 1)} other keys "
            f"(N={N} x (T-1)={T - 1}). Give more sequences or tokens, or fewer components."
        )


def key_manifold_accumulator(
    model: SinkModel,
    tokens_shape,
    *,
    layers=None,
    heads=None,
    n_components=DEFAULT_N_COMPONENTS,
    scatter_heads="auto",
    rotated: bool = True,
    kind: str | None = None,
) -> KeyManifoldAccumulator:
    """Check the arguments of :func:`first_key_manifold` and build its accumulator.

    Parameters
    ----------
    tokens_shape : tuple of int
        (N, T) of the tokens the pass runs over (N >= 2, T >= 3).
    model, layers, heads, n_components, scatter_heads, rotated, kind
        As in :func:`first_key_manifold`.

    Returns
    -------
    KeyManifoldAccumulator
    """
    facts = model_facts(model)
    dims = facts.dims
    layers = (
        list(facts.attention_layers)
        if layers is None
        else check_attention_layers(model, layers=check_layers(model, layers))
    )
    if not rotated and isinstance(model, NnsightModel):
        raise NnsightUnsupported(
            "rotated=False reads the keys before the rotary; a model loaded through nnsight hands its trace q and k "
            "after it (at the attention function): use rotated=True, or load the model with load_model(name)."
        )
    N, T = tokens_shape
    n_components = _check_n_components(n_components, dims.d_head)
    _check_sizes(N, T, n_components)
    heads, explicit, auto = _check_kv_heads(model, heads, scatter_heads)
    return KeyManifoldAccumulator(
        model, layers, heads, T, n_components, ScatterKeys(explicit, auto), rotated=rotated, kind=kind
    )


@share_parameters(key_manifold_accumulator)
@parameters_from(pass_options)
def first_key_manifold(
    model: SinkModel,
    tokens,
    *,
    layers=None,
    heads=None,
    n_components: float | int = DEFAULT_N_COMPONENTS,
    scatter_heads="auto",
    rotated: bool = True,
    batch_size: int | None = None,
    kind: str | None = None,
) -> KeyManifold:
    """First-key manifold statistics per (layer, KV head), streamed through the key / query / pattern hooks.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    tokens : torch.Tensor, shape (N, T)
        Token ids; N >= 2 (better 16 or more), T >= 3.
    layers : sequence of int, optional
        Attention layer indices (default: all attention layers; hybrids skip their linear-attention / Mamba layers,
        named in ``skipped``).
    heads : sequence of int, optional
        KV head indices (default: all). Query head h reads KV head h // group_size.
    n_components : int or float
        The other keys' principal subspace: an int r (a fixed number of components, 1 <= r < d_head) or a fraction in
        (0, 1) (the fewest components explaining that share of the other keys' variance, per head; default 0.9), as in
        scikit-learn's PCA.
    scatter_heads : "auto", sequence of (int, int) or None
        (layer, KV head) pairs whose keys to keep for the 2-D PCA scatter. "auto" keeps the analysed KV head with the
        largest and the one with the smallest alpha_1 (max over its query heads), chosen on the first batch (the whole
        input when N x T <= 2048), in the same pass. None or [] keeps none.
    rotated : bool
        Keys and queries after the rotary embedding (default), or before it (False).
    batch_size, kind
        As in :func:`pass_options`.

    Returns
    -------
    KeyManifold
    """
    model_dims(model)
    tokens = check_tokens(model, tokens)
    acc = key_manifold_accumulator(
        model,
        tokens.shape,
        layers=layers,
        heads=heads,
        n_components=n_components,
        scatter_heads=scatter_heads,
        rotated=rotated,
        kind=kind,
    )
    return run_pass(model, tokens, [acc], batch_size=batch_size)[0]


def _with_spike(km: KeyManifold, got: dict) -> KeyManifold:
    """The pass's key manifold with the first token's spike dims of ``massive`` where it ran in the same pass."""
    if got.get("massive"):
        km.first_token_dims = got["massive"][0].first_token_dims
    return km


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, Section, register  # noqa: E402


register(
    Analysis(
        "key_manifold",
        result=KeyManifold,
        order=40,
        hooks=("q", "k", "pattern"),
        doc="The first-key manifold on the main kind.",
        accumulators=lambda p: [key_manifold_accumulator(p.model, p.tokens.shape, kind=p.kind)],
        finish=lambda outputs, p, got: _with_spike(outputs[0], got),
        sections=(
            Section(
                "The first key's manifold",
                "key",
                60,
                needs=("key_manifold", "massive"),
                tables=(),
                figures=(
                    (
                        "analysis.figures.key_manifold:plot_key_pca",
                        "keys of a sink head and of a non-sink head (first keys: red crosses)",
                    ),
                    ("analysis.figures.key_manifold:plot_manifold_summary", "first-key statistics per layer"),
                ),
            ),
        ),
        exports=("first_key_manifold",),
    )
)
