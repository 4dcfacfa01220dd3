"""The first key's manifold: is k_1 a point apart from the keys at every other position?

Per layer and key/value head (keys live per KV head under GQA), from the keys the queries really see
(``hook_rot_k``, i.e. after the rotary embedding; ``hook_k`` for models without rotary) at all
positions of N sequences:

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

from analysis.hooks import ModelContractError, check_layers, check_tokens, model_dims, run_with_reducers
from analysis.qk import qk_hook_names
from analysis.sink import alpha_from_pattern

DEFAULT_N_COMPONENTS = 0.9
VARIANCE_LEVEL = 0.9  # first_n90 / other_n90
SAME_POINT = 1e-6  # keys whose variance is below this share of their squared norm count as one point


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
    """Run small (d_head x d_head) linear algebra on one thread: on a busy CPU, thread pools make a 64 x 64
    eigendecomposition a hundred times slower."""
    from threadpoolctl import threadpool_limits

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(n)


def _n_for_variance(evr_cum: np.ndarray, level: float) -> int:
    """Smallest number of components whose cumulative explained-variance ratio reaches ``level``."""
    if evr_cum.size == 0 or not np.isfinite(evr_cum[-1]) or evr_cum[-1] <= 0:
        return 0
    return int(min(np.searchsorted(evr_cum, level - 1e-12) + 1, evr_cum.size))


def _pairwise_mean_cos(x: torch.Tensor) -> float:
    """Mean cosine over pairs (i != j) of the rows of ``x`` (n, d)."""
    n = x.shape[0]
    if n < 2:
        return float("nan")
    u = torch.nn.functional.normalize(x.double(), dim=-1)
    s = u.sum(0)
    return float((s @ s - (u * u).sum()) / (n * (n - 1)))


@dataclass
class KeyManifold:
    """Per (layer, KV head) first-key statistics; see the module docstring for each column."""

    table: pd.DataFrame
    layers: list[int]
    kv_heads: list[int]
    n_components: float | int
    N: int
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

    def head(self, layer: int, kv_head: int) -> pd.Series:
        """The table row of one (layer, KV head)."""
        rows = self.table[(self.table.layer == layer) & (self.table.kv_head == kv_head)]
        if rows.empty:
            raise ValueError(f"(layer {layer}, KV head {kv_head}) was not analysed; layers {self.layers}, KV heads {self.kv_heads}.")
        return rows.iloc[0]

    def sink_heads(self, min_alpha: float = 0.3, by: str = "alpha_1_mean") -> list[tuple[int, int]]:
        """(layer, KV head) pairs whose query heads' alpha_1 (max or mean over the group) exceeds ``min_alpha``."""
        t = self.table[self.table[by] > min_alpha]
        return list(zip(t.layer.tolist(), t.kv_head.tolist()))

    def summary(self, min_alpha: float = 0.3, by: str = "alpha_1_mean") -> dict:
        """Mean statistics over sink KV heads (``by``, alpha_1 averaged (or max) over the KV head's query heads,
        above ``min_alpha``) against the others."""
        if by not in ("alpha_1_mean", "alpha_1_max"):
            raise ValueError(f"by must be 'alpha_1_mean' or 'alpha_1_max'; got {by!r}.")
        sink = self.table[by] > min_alpha
        cols = ["resid_first", "resid_other", "offsub_z", "centroid_z", "axis_z", "cos_first_pair", "cos_mid_pair", "cos_other_pair",
                "cos_q_k1", "cos_q_kj", "first_n90", "mid_n90", "other_n90", "first_var_rel", "k1_norm", "kj_norm", "norm_ratio"]
        out = {"n_sink_heads": int(sink.sum()), "n_other_heads": int((~sink).sum()), "min_alpha": min_alpha, "by": by}
        for name, mask in (("sink", sink), ("non_sink", ~sink)):
            out[name] = {c: (float(self.table.loc[mask, c].mean()) if mask.any() else None) for c in cols}
        return out

    def to_dict(self) -> dict:
        def clean(v):
            if isinstance(v, float) and not np.isfinite(v):
                return None
            return v

        return {
            "model": self.model_name,
            "N": self.N,
            "T": self.T,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "group_size": self.group_size,
            "n_components": self.n_components,
            "rotated_keys": self.rotated,
            "variance_level": VARIANCE_LEVEL,
            "table": [{k: clean(v) for k, v in row.items()} for row in self.table.to_dict("records")],
            "cos_q_k1_per_query_head": self.cos_q_k1.tolist(),
            "cos_q_kj_per_query_head": self.cos_q_kj.tolist(),
            "alpha_1_per_query_head": self.alpha_1.tolist(),
            "first_evr_cumulative": self.first_evr.tolist(),
            "other_evr_cumulative": self.other_evr.tolist(),
            "summary": {k: ({c: clean(x) for c, x in v.items()} if isinstance(v, dict) else v) for k, v in self.summary().items()},
            "scatter": [
                {
                    "layer": l, "kv_head": h, "fit_on": s["fit_on"],
                    "explained_variance_ratio": s["evr"],
                    "alpha_1_max": s.get("alpha_1_max"),
                    "axis_z": clean(s["axis_z"]),
                    "coords": np.round(s["coords"], 4).tolist(),  # [sequence][position][pc]
                    "axis_coords": np.round(s["axis_coords"], 4).tolist(),
                }
                for (l, h), s in self.scatter.items()
            ],
        }


def _pca_few(x: torch.Tensor) -> tuple[np.ndarray, int, float]:
    """PCA (scikit-learn) of a few keys (n, d): cumulative explained-variance ratio (length min(n, d)), the
    number of components for ``VARIANCE_LEVEL`` of the variance, and the first component's share. Keys whose
    total variance is below ``SAME_POINT`` of their mean squared norm are one point: (zeros, 0, nan)."""
    from sklearn.decomposition import PCA

    n, d = x.shape
    m = min(n, d)
    sq = float((x ** 2).sum(-1).mean())
    if float(x.var(dim=0, unbiased=False).sum()) <= SAME_POINT * max(sq, 1e-30):
        return np.zeros(m), 0, float("nan")
    pca = PCA(n_components=m, svd_solver="full").fit(x.numpy())
    cum = np.cumsum(pca.explained_variance_ratio_)
    return cum, _n_for_variance(cum, VARIANCE_LEVEL), float(pca.explained_variance_ratio_[0])


def _pca2(keys: torch.Tensor) -> dict:
    """Two 2-D views of all keys (N, T, d) of one head, first keys included.

    ``coords``: PCA (scikit-learn) fit on all keys. ``axis_coords``: x = the projection on the line from the
    other keys' mean to the first keys' mean (the "first-key axis"), y = the other keys' top principal
    direction orthogonal to it; both centred at the other keys' mean. ``axis_z`` = the first keys' mean
    x over the other keys' standard deviation along x.
    """
    from sklearn.decomposition import PCA

    N, T, d = keys.shape
    if N * T < 3:
        raise ValueError(f"a 2-D PCA needs at least 3 keys; got {N * T}. Give more sequences or tokens.")
    k = keys.double()
    x = k.reshape(N * T, d).numpy()
    pca = PCA(n_components=2, svd_solver="full").fit(x)
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
        "coords": pca.transform(x).reshape(N, T, 2).astype(np.float32),
        "evr": [float(v) for v in pca.explained_variance_ratio_],
        "fit_on": "all keys (first keys included)",
        "axis_coords": axis_coords.float().numpy(),
        "axis_z": float(axis_coords[:, 0, 0].mean()) / sd if sd > 0 else float("inf"),
    }


def collect_keys(model, tokens, heads: list[tuple[int, int]], rotated: bool = True, batch_size: int | None = None) -> dict:
    """Keys at all positions (N, T, d_head) for a few (layer, KV head) pairs only: one pass, nothing else kept."""
    tokens = check_tokens(model, tokens)
    layers = check_layers(model, sorted({l for l, _ in heads}))
    kept: dict[tuple[int, int], list[torch.Tensor]] = {tuple(h): [] for h in heads}

    def keep(layer: int):
        def fn(k, hook):
            for (l, h), chunks in kept.items():
                if l == layer:
                    if not 0 <= h < k.shape[2]:
                        raise ValueError(f"KV head {h} out of range: layer {l} has KV heads 0..{k.shape[2] - 1}.")
                    chunks.append(k[:, :, h].float().cpu().clone())
        return fn

    reducers = [(qk_hook_names(model, l, rotated)[1], keep(l)) for l in layers]
    run_with_reducers(model, tokens, reducers, batch_size=batch_size)
    return {h: torch.cat(c) for h, c in kept.items()}


def first_key_manifold(
    model,
    tokens,
    layers=None,
    heads=None,
    n_components: float | int = DEFAULT_N_COMPONENTS,
    scatter_heads="auto",
    rotated: bool = True,
    batch_size: int | None = None,
) -> KeyManifold:
    """First-key manifold statistics per (layer, KV head), streamed through the key/query/pattern hooks.

    Parameters
    ----------
    layers : layer indices (default: all).
    heads : KV head indices (default: all). Query head h reads KV head h // group_size.
    n_components : the other keys' principal subspace: an int r (fixed number of components, 1 <= r <
        d_head) or a fraction in (0, 1) (the fewest components explaining that share of the other keys'
        variance, per head; default 0.9), as in scikit-learn's PCA.
    scatter_heads : (layer, KV head) pairs whose keys to keep for the 2-D PCA scatter. "auto" (default)
        keeps the analysed KV head with the largest and the one with the smallest alpha_1 (max over its
        query heads), chosen on the first batch (the whole input when N x T <= 2048), in the same pass.
        None or [] keeps none.
    rotated : read keys after the rotary embedding (``hook_rot_k``) where the model has it.
    """
    dims = model_dims(model)
    layers = check_layers(model, layers)
    tokens = check_tokens(model, tokens)
    N, T = tokens.shape
    if N < 2:
        raise ValueError(
            f"the first-key manifold compares first keys of different inputs: give at least 2 sequences "
            f"(better 16 or more); got {N}."
        )
    if T < 3:
        raise ValueError(f"the first-key manifold needs T >= 3 tokens (a first key and other keys to fit a PCA on); got T={T}.")
    n_components = _check_n_components(n_components, dims.d_head)
    n_other = N * (T - 1)
    if isinstance(n_components, int) and n_other <= n_components:
        raise ValueError(
            f"too few samples for a PCA with {n_components} components: {n_other} other keys "
            f"(N={N} x (T-1)={T - 1}). Give more sequences or tokens, or fewer components."
        )
    n_kv, H = dims.n_kv_heads, dims.n_heads
    heads = list(range(n_kv)) if heads is None else [int(h) for h in heads]
    bad = [h for h in heads if not 0 <= h < n_kv]
    if bad or not heads:
        raise ValueError(f"KV heads {bad or heads} out of range: this model has KV heads 0..{n_kv - 1} "
                         f"({H} query heads, {dims.group_size} per KV head).")
    auto = isinstance(scatter_heads, str)
    if auto and scatter_heads != "auto":
        raise ValueError(f"scatter_heads must be 'auto', None or a list of (layer, KV head) pairs; got {scatter_heads!r}.")
    explicit = [] if (auto or not scatter_heads) else [(int(l), int(h)) for l, h in scatter_heads]
    if explicit:
        check_layers(model, [l for l, _ in explicit])
        bad = [h for _, h in explicit if not 0 <= h < n_kv]
        if bad:
            raise ValueError(f"scatter KV heads {bad} out of range: this model has KV heads 0..{n_kv - 1}.")

    L, S = len(layers), len(heads)
    sel = torch.tensor(heads)
    f64 = torch.float64
    acc = {
        "k1_norm": torch.zeros(L, S, dtype=f64), "kj_norm": torch.zeros(L, S, dtype=f64),
        "cos_q_k1": torch.zeros(L, H, dtype=f64), "cos_q_kj": torch.zeros(L, H, dtype=f64), "alpha_1": torch.zeros(L, H, dtype=f64),
    }
    sums: dict[str, list] = {"sum": [None] * L, "gram": [None] * L, "unit_sum": [None] * L}
    firsts: list[list[torch.Tensor]] = [[] for _ in range(L)]
    mids: list[list[torch.Tensor]] = [[] for _ in range(L)]
    mid = T // 2  # 0-based position of the control keys
    kept: dict[tuple[int, int], list[torch.Tensor]] = {h: [] for h in explicit}
    auto_pick: dict[str, tuple] = {}  # "max"/"min" -> (alpha, (layer, kv_head)), fixed after the first batch
    auto_kept: dict[tuple[int, int], list[torch.Tensor]] = {}
    batch_no = [0]
    pending: dict[int, dict[str, torch.Tensor]] = {}
    n_pairs_other = T * (T - 1) // 2  # (query t, key j) with 1 < j <= t

    def kv_index(h: int, n_k: int) -> int:
        return h if n_k == n_kv else h * dims.group_size  # hooks that repeat KV heads per query head

    def add(name: str, i: int, x: torch.Tensor) -> None:
        sums[name][i] = x if sums[name][i] is None else sums[name][i] + x

    def keep_keys(layer: int, kk: torch.Tensor, alpha_kv: torch.Tensor | None) -> None:
        n_k = kk.shape[2]
        for (l, h), chunks in kept.items():
            if l == layer:
                chunks.append(kk[:, :, kv_index(h, n_k)].clone())
        if not auto or alpha_kv is None:
            return
        if batch_no[0] == 0:  # choose on the first batch, keeping the keys of the current picks only
            for j, h in enumerate(heads):
                a = float(alpha_kv[j])
                if "max" not in auto_pick or a > auto_pick["max"][0]:
                    auto_pick["max"] = (a, (layer, h))
                if "min" not in auto_pick or a < auto_pick["min"][0]:
                    auto_pick["min"] = (a, (layer, h))
            chosen = {v[1] for v in auto_pick.values()}
            for h in heads:
                if (layer, h) in chosen:
                    auto_kept[(layer, h)] = [kk[:, :, kv_index(h, n_k)].clone()]
            for key in [key for key in auto_kept if key not in chosen]:
                del auto_kept[key]
        else:
            for (l, h), chunks in auto_kept.items():
                if l == layer:
                    chunks.append(kk[:, :, kv_index(h, n_k)].clone())

    def reduce(i: int, q: torch.Tensor, k: torch.Tensor, pattern: torch.Tensor) -> None:
        B, n_k = k.shape[0], k.shape[2]
        if H % n_k or n_k not in (n_kv, H):
            raise ValueError(f"layer {layers[i]}: hook_k has {n_k} heads; expected {n_kv} KV heads (or {H}).")
        kk = k.float().cpu()
        ks = kk[:, :, sel if n_k == n_kv else sel * dims.group_size]  # (B, T, S, d)
        other = ks[:, 1:].double().reshape(B * (T - 1), S, -1).transpose(0, 1)  # (S, n, d)
        add("sum", i, other.sum(1))
        add("gram", i, other.transpose(1, 2) @ other)  # (S, d, d)
        add("unit_sum", i, torch.nn.functional.normalize(other, dim=-1).sum(1))
        acc["k1_norm"][i] += ks[:, 0].norm(dim=-1).double().sum(0)
        acc["kj_norm"][i] += ks[:, 1:].norm(dim=-1).double().sum((0, 1))
        firsts[i].append(ks[:, 0].clone())  # (B, S, d): only the first keys are kept ...
        mids[i].append(ks[:, mid].clone())  # ... and, as a same-size control, the keys at one later position
        qn = torch.nn.functional.normalize(q.float().cpu(), dim=-1)  # (B, T, H, d)
        kn = torch.nn.functional.normalize(kk, dim=-1).repeat_interleave(H // n_k, dim=2)  # each query head's KV head
        # sum_t cos(q_t, k_1) and sum_t sum_{1<j<=t} cos(q_t, k_j) = sum_t q_t . (cumulative sum of unit keys 2..t)
        acc["cos_q_k1"][i] += torch.einsum("bthd,bhd->h", qn[:, 1:], kn[:, 0]).double()
        acc["cos_q_kj"][i] += torch.einsum("bthd,bthd->h", qn[:, 1:], kn[:, 1:].cumsum(dim=1)).double()
        a1 = alpha_from_pattern(pattern, 1)[..., 0].double().cpu()  # (B, H)
        acc["alpha_1"][i] += a1.sum(0)
        alpha_kv = torch.stack([a1.mean(0)[[qh for qh in range(H) if qh // dims.group_size == h]].max() for h in heads])
        keep_keys(layers[i], kk, alpha_kv)

    def reducer(i: int, which: str):
        def fn(x, hook):
            slot = pending.setdefault(i, {})
            slot[which] = x
            if len(slot) == 3:
                reduce(i, slot["q"], slot["k"], slot["pattern"])
                del pending[i]
        return fn

    def key_only(layer: int):  # scatter heads in layers outside ``layers``
        def fn(k, hook):
            keep_keys(layer, k.float().cpu(), None)
        return fn

    def next_batch(batch, logits):
        batch_no[0] += 1

    reducers = []
    for i, l in enumerate(layers):
        qn, kn = qk_hook_names(model, l, rotated)
        reducers += [(qn, reducer(i, "q")), (kn, reducer(i, "k")), (f"blocks.{l}.attn.hook_pattern", reducer(i, "pattern"))]
    reducers += [(qk_hook_names(model, l, rotated)[1], key_only(l)) for l in sorted({l for l, _ in explicit} - set(layers))]
    run_with_reducers(model, tokens, reducers, batch_size=batch_size, on_batch=next_batch)
    silent = [layers[i] for i in range(L) if sums["sum"][i] is None]
    if silent:
        raise ModelContractError(
            f"the query/key/pattern hooks of layers {silent} did not fire ({', '.join(qk_hook_names(model, silent[0], rotated))}, "
            "hook_pattern); the model lists hooks it does not run. Try rotated=False."
        )
    used_rotated = qk_hook_names(model, layers[0], rotated)[1].endswith("hook_rot_k")

    cos_q_k1 = (acc["cos_q_k1"] / (N * (T - 1))).float()
    cos_q_kj = (acc["cos_q_kj"] / (N * n_pairs_other)).float()
    alpha_1 = (acc["alpha_1"] / N).float()
    mu = torch.stack(sums["sum"]) / n_other  # (L, S, d)
    cov = torch.stack(sums["gram"]) / n_other - mu[..., :, None] * mu[..., None, :]
    unit_sum = torch.stack(sums["unit_sum"])
    first_all = torch.stack([torch.cat(f) for f in firsts]).double()  # (L, N, S, d)
    mid_all = torch.stack([torch.cat(f) for f in mids]).double()  # (L, N, S, d)

    rows, first_evr, other_evr = [], [], []
    with small_linalg():
        evals_all, evecs_all = torch.linalg.eigh(cov)  # ascending, batched over (L, S)
        for i, l in enumerate(layers):
            fe, oe = [], []
            for j, h in enumerate(heads):
                evals, evecs = evals_all[i, j].flip(0).clamp(min=0), evecs_all[i, j].flip(1)
                d = evals.numel()
                total = float(evals.sum())
                evr_cum = (evals.cumsum(0) / total).numpy() if total > 0 else np.zeros(d)
                r = min(n_components if isinstance(n_components, int) else _n_for_variance(evr_cum, n_components), d - 1)
                U = evecs[:, :r]
                k1 = first_all[i, :, j]  # (N, d)
                shift = k1.mean(0) - mu[i, j]
                axis_var = float(shift @ cov[i, j] @ shift) / max(float(shift @ shift), 1e-30)
                c = k1 - mu[i, j]
                perp = (c - (c @ U) @ U.T).norm(dim=-1)
                c_norm = c.norm(dim=-1)
                resid_var = float(evals[r:].sum())
                # PCA of the first keys alone (scikit-learn), and of the N keys at one later position.
                k1_sq = float((k1 ** 2).sum(-1).mean())
                first_var = float(k1.var(dim=0, unbiased=False).sum())
                f_cum, first_n90, first_evr1 = _pca_few(k1)
                _, mid_n90, _ = _pca_few(mid_all[i, :, j])
                fe.append(torch.as_tensor(f_cum, dtype=torch.float32))
                oe.append(torch.as_tensor(evr_cum, dtype=torch.float32))
                qh = [x for x in range(H) if x // dims.group_size == h]
                us = unit_sum[i, j]
                rows.append({
                    "layer": l, "kv_head": h, "query_heads": ",".join(map(str, qh)),
                    "alpha_1_mean": float(alpha_1[i, qh].mean()), "alpha_1_max": float(alpha_1[i, qh].max()),
                    "k1_norm": float(acc["k1_norm"][i, j] / N), "kj_norm": float(acc["kj_norm"][i, j] / n_other),
                    "r": r,
                    "resid_first": float((perp / c_norm.clamp(min=1e-30)).mean()),
                    "resid_other": float(np.sqrt(max(resid_var, 0.0) / total)) if total > 0 else float("nan"),
                    "offsub_z": float(perp.mean() / np.sqrt(resid_var)) if resid_var > 0 else float("inf"),
                    "centroid_z": float(c_norm.mean() / np.sqrt(total)) if total > 0 else float("inf"),
                    "axis_z": float(shift.norm()) / np.sqrt(axis_var) if axis_var > 0 else float("inf"),
                    "first_n90": first_n90, "mid_n90": mid_n90, "other_n90": _n_for_variance(evr_cum, VARIANCE_LEVEL),
                    "first_evr1": first_evr1, "first_var_rel": first_var / k1_sq if k1_sq > 0 else float("nan"),
                    "cos_first_pair": _pairwise_mean_cos(k1), "cos_mid_pair": _pairwise_mean_cos(mid_all[i, :, j]),
                    "cos_other_pair": float((us @ us - n_other) / (n_other * (n_other - 1))),
                    "cos_q_k1": float(cos_q_k1[i, qh].mean()), "cos_q_kj": float(cos_q_kj[i, qh].mean()),
                })
            first_evr.append(torch.stack(fe))
            other_evr.append(torch.stack(oe))
        table = pd.DataFrame(rows)
        table["norm_ratio"] = table.k1_norm / table.kj_norm
        result = KeyManifold(
            table=table, layers=layers, kv_heads=heads, n_components=n_components, N=N, T=T,
            group_size=dims.group_size, rotated=used_rotated, first_evr=torch.stack(first_evr),
            other_evr=torch.stack(other_evr), cos_q_k1=cos_q_k1, cos_q_kj=cos_q_kj, alpha_1=alpha_1,
            model_name=getattr(model, "model_name", None),
        )
        if auto:
            order = [auto_pick[w][1] for w in ("max", "min") if w in auto_pick]
            kept = {h: auto_kept[h] for h in dict.fromkeys(order)}
        for (l, h), chunks in kept.items():
            if not chunks:
                continue
            entry = _pca2(torch.cat(chunks))
            row = table[(table.layer == l) & (table.kv_head == h)]
            entry["alpha_1_max"] = float(row.alpha_1_max.iloc[0]) if len(row) else None
            result.scatter[(l, h)] = entry
    return result
