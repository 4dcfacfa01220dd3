"""Norm-gain tracing: how the first token's spike becomes the first key.

Along the key path of one layer l, for the first token and for ordinary tokens:

    h (blocks.l.hook_resid_pre) -> n = norm(h) (RMSNorm: h / rms(h); LayerNorm: centred, / std)
      -> x = g * n (+ b for LayerNorm) -> k = x W_K (+ b_K) per KV head -> rotary (HF rotate_half) -> key

everything rebuilt from the hooks' h and the model's raw weights (norms not folded into W_K), and
checked against the model's own ``hook_k`` (before the rotary), ``hook_rot_k`` (where it fires) and
the attention scores (which check the rotary of queries and keys end to end). For the spike dims S
(found by ``analysis.massive`` on the first token of h, or given) it measures:

- the share of |h|^2, |n|^2 and |x|^2 held by S, first token against ordinary tokens;
- the gain g at S against the rest;
- how much of k_1 S alone explains (k_1^S = x_1[S] W_K[S]: cosine, share of |k_1|^2), and of the
  logits q_t . k_1; the attention the head gives the first key when k_1 is replaced by k_1^S
  alone, or by k_1 - k_1^S (the spike removed);
- how constant the first token's vectors are across inputs (mean pairwise cosine of n_1, x_1, k_1
  over different sequences), against ordinary tokens.

All statistics are reduced inside the hooks of layer l, and the forward pass stops after it.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import pandas as pd
import torch

from analysis.defaults import SPIKE_ABS, SPIKE_MIN_SHARE, SPIKE_RATIO, TINY
from analysis.hooks import (
    Accumulator,
    Batch,
    ModelContractError,
    act_name,
    check_layers,
    check_tokens,
    hook_names,
    model_dims,
    stream,
)
from analysis.io import jsonable
from analysis.models import rotary_base
from analysis.results import Result, runs
from analysis.rotary import rotary_dim, rotate, uses_rotary
from analysis.stats import mean_pairwise_cosine

# ----------------------------------------------------------------------------------------------
# The key path, rebuilt from weights
# ----------------------------------------------------------------------------------------------


@dataclass
class NormParams:
    """A pre-attention norm: kind 'RMS' (no centring) or 'LN' (centring, bias), gain w, bias b, eps."""

    kind: str
    w: torch.Tensor  # (D,)
    b: torch.Tensor | None  # (D,) or None
    eps: float

    def normalise(self, h: torch.Tensor) -> torch.Tensor:
        """n = norm(h) before the gain, in float32."""
        h = h.float()
        if self.kind == "LN":
            h = h - h.mean(-1, keepdim=True)
        return h / (h.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def affine(self, n: torch.Tensor) -> torch.Tensor:
        """x = g * n (+ b)."""
        x = n * self.w.float()
        return x + self.b.float() if self.b is not None else x


def norm_kind(model) -> str | None:
    """'RMS', 'LN' or None (no normalisation), from ``cfg.normalization_type``."""
    t = getattr(getattr(model, "cfg", None), "normalization_type", None)
    if t is None:
        return None
    t = str(t).upper()
    if t.startswith("RMS"):
        return "RMS"
    if t.startswith("LN"):
        return "LN"
    return None


def norm_params(model, layer: int) -> NormParams:
    """The ln1 gain, bias and eps of ``layer``; ModelContractError for models without a norm gain."""
    (layer,) = check_layers(model, [layer])
    blocks = getattr(model, "blocks", None)
    ln = getattr(blocks[layer], "ln1", None) if blocks is not None else None
    kind = norm_kind(model)
    w = getattr(ln, "w", None) if ln is not None else None
    if ln is None or w is None or kind is None:
        raise ModelContractError(
            f"layer {layer} has no pre-attention norm with a gain to trace (model.blocks[{layer}].ln1.w; "
            f"cfg.normalization_type={getattr(getattr(model, 'cfg', None), 'normalization_type', None)!r}). "
            "Norm-gain tracing needs RMSNorm or LayerNorm with its gain kept as a weight: load the model with "
            "raw weights (`analysis.load_model`), not with the norms folded into W_Q/W_K/W_V, and not a model "
            "without normalisation."
        )
    b = getattr(ln, "b", None) if kind == "LN" else None
    eps = float(getattr(model.cfg, "eps", 1e-5) or 1e-5)
    return NormParams(kind, w.detach().float().cpu(), None if b is None else b.detach().float().cpu(), eps)


def key_weights(model, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W_K (H_kv, D, d_head) and b_K (H_kv, d_head) or None, as float32 on CPU."""
    attn = getattr(model.blocks[layer], "attn", None)
    W_K = getattr(attn, "W_K", None)
    if W_K is None:
        raise ModelContractError(f"model.blocks[{layer}].attn has no W_K; the key path needs the key weights.")
    if W_K.ndim != 3:
        raise ModelContractError(f"W_K of layer {layer} has shape {tuple(W_K.shape)}; expected (heads, d_model, d_head).")
    b_K = getattr(attn, "b_K", None)
    return W_K.detach().float().cpu(), (None if b_K is None else b_K.detach().float().cpu().reshape(W_K.shape[0], -1))


@dataclass
class KeyPath:
    """Everything needed to rebuild a layer's keys from its residual input."""

    layer: int
    norm: NormParams
    W_K: torch.Tensor  # (H_kv, D, d_head)
    b_K: torch.Tensor | None
    rotary: bool
    base: float | None
    rot_dim: int | None
    group: int  # query heads per KV head
    key_hook: str  # the key before the rotary (blocks.l.attn.hook_k)
    query_hook: str  # the query before the rotary (blocks.l.attn.hook_q)
    rot_key_hook: str | None  # the rotated key, where the model has the hook (checked when it fires)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply the rotary (identity without one) to queries or keys (..., T, heads, d_head)."""
        if not self.rotary:
            return x.float()
        return rotate(x, positions.to(x.device), self.base, self.rot_dim)

    def keys(self, x: torch.Tensor, positions: torch.Tensor, bias: bool = True, rotary: bool = True) -> torch.Tensor:
        """Keys from the gain-scaled normalised input x (..., T, D) -> (..., T, H_kv, d_head), rotated."""
        W = self.W_K.to(x.device)
        k = torch.einsum("...td,hde->...the", x.float(), W)
        if bias and self.b_K is not None:
            k = k + self.b_K.to(x.device)
        return self.rotate(k, positions) if rotary else k

    def keys_from_resid(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.keys(self.norm.affine(self.norm.normalise(h)), positions)


def key_path(model, layer: int) -> KeyPath:
    """Read the norm, key weights and rotary of ``layer`` (ModelContractError with what is missing)."""
    dims = model_dims(model)
    (layer,) = check_layers(model, [layer])
    norm = norm_params(model, layer)
    W_K, b_K = key_weights(model, layer)
    names = hook_names(model)
    rot = uses_rotary(model)
    base = rotary_base(model) if rot else None
    if rot and base is None:
        raise ModelContractError("the model uses rotary embeddings but its rotary base is unknown (set model.rope_theta).")
    kh, qh, rkh = act_name("k", layer), act_name("q", layer), act_name("rot_k", layer)
    missing = [n for n in (act_name("resid_pre", layer), kh, qh) if n not in names]
    if missing:
        raise ModelContractError(f"the model has no hook(s) {missing}; the key path needs TransformerLens hook names.")
    return KeyPath(layer, norm, W_K, b_K, rot, base, rotary_dim(model, W_K.shape[-1]) if rot else None,
                   dims.n_heads // W_K.shape[0], kh, qh, rkh if rot and rkh in names else None)


def attn_scale(model, d_head: int) -> float:
    """The factor on q . k in the attention scores (1/sqrt(d_head) unless the config says otherwise)."""
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "use_attn_scale", True) is False:
        return 1.0
    s = getattr(cfg, "attn_scale", None)
    return 1.0 / float(s) if s is not None and float(s) > 0 else 1.0 / math.sqrt(d_head)


def _check_dims(dims: Sequence[int] | None, D: int) -> list[int]:
    dims = sorted({int(d) for d in dims})
    bad = [d for d in dims if not 0 <= d < D]
    if bad:
        raise ValueError(f"spike_dims {bad} out of range: d_model is {D}, dims lie in 0..{D - 1}.")
    return dims


def _softmax_alpha(scores: torch.Tensor, col0: torch.Tensor) -> torch.Tensor:
    """alpha_1 per (B, H) after replacing the first-key column of ``scores`` (B,H,T,T) with ``col0`` (B,H,T)."""
    s = scores.float().clone()
    s[..., 0] = col0
    T = s.shape[-1]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=s.device), diagonal=1)
    p = s.masked_fill(future, float("-inf")).softmax(-1)
    return p[..., 0].mean(-1)  # every query sees key 1: alpha_1 = mean over all T queries


# ----------------------------------------------------------------------------------------------
# The trace
# ----------------------------------------------------------------------------------------------


@dataclass
class NormGainTrace(Result):
    """Norm-gain trace of one layer. ``heads`` has one row per query head; ``stages`` one row per stage."""

    layer: int
    spike_dims: list[int]
    has_spike: bool
    message: str
    norm_kind: str
    rotary: bool
    rotary_base: float | None
    n_samples: int
    T: int
    stages: pd.DataFrame
    gain: pd.DataFrame
    heads: pd.DataFrame
    constancy: dict
    rebuild: dict
    gain_vector: torch.Tensor  # (D,)
    first_normalised_mean: torch.Tensor  # (D,) mean n_1
    other_normalised_abs: torch.Tensor  # (D,) mean |n_t|, t > 1
    first_resid_mean: torch.Tensor  # (D,) mean h_1
    model_name: str | None = None
    kind: str | None = None
    meta: dict = field(default_factory=dict)

    def gain_summary(self) -> dict:
        g = self.gain_vector.abs()
        S = self.spike_dims
        rest = torch.ones_like(g, dtype=torch.bool)
        rest[S] = False
        return {
            "gain_at_spike": [float(self.gain_vector[d]) for d in S],
            "gain_rest_mean_abs": float(g[rest].mean()),
            "gain_rest_median_abs": float(g[rest].median()),
            "gain_spike_over_rest": [float(g[d] / g[rest].median()) for d in S],
        }

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {"stages": self.stages, "gain": self.gain, "heads": self.heads}

    def text(self) -> str:
        if not self.has_spike:
            return self.message
        return " ".join([self.gain_text(), self.key_text(), self.constancy_text()])

    def gain_text(self) -> str:
        """What the norm and its gain do to the spike dims."""
        if not self.has_spike:
            return self.message
        st, g = self.stages.set_index("stage"), self.gain_summary()
        return (f"Layer {self.layer}, spike dims {self.spike_dims}: they hold {st.loc['normalised', 'first_share']:.1%} of the "
                f"first token's normalised |n|^2 (ordinary tokens: {st.loc['normalised', 'other_share']:.1%}); the gain there is "
                f"{g['gain_spike_over_rest'][0]:.2f}x the median |g|, and after it they hold {st.loc['gain', 'first_share']:.1%} "
                f"(ordinary tokens {st.loc['gain', 'other_share']:.1%}).")

    def key_text(self) -> str:
        """How much of the first key, its logit and the sink the spike dims explain."""
        if not self.has_spike:
            return self.message
        h = self.heads
        return (f"k_1 rebuilt from the spike dims alone has cosine {h['cos_k1_spike'].mean():.3f} with k_1 (mean over "
                f"heads) and gives {h['logit_share_spike'].mean():.0%} of the logit q_t . k_1; alpha_1 is "
                f"{h['alpha_1'].mean():.3f}, {h['alpha_1_spike_only'].mean():.3f} with the spike part alone and "
                f"{h['alpha_1_no_spike'].mean():.3f} with the spike part removed.")

    def constancy_text(self) -> str:
        c = self.constancy
        return (f"Across inputs the first token's normalised vector has mean cosine {c['cos_first_normalised']:.3f} "
                f"(ordinary tokens {c['cos_other_normalised']:.3f}).")

    def rebuild_text(self) -> str:
        r = self.rebuild
        rot = r["rotated_key_max_abs_err"]
        return (f"Layer {self.layer}: rebuilt keys against hook_k, relative error {r['key_rel_err']:.1e}"
                + (f"; against hook_rot_k, max abs error {rot:.1e}" if rot is not None else "")
                + f"; first-key scores, max abs error {r['score_max_abs_err']:.1e}.")

    def to_dict(self) -> dict:
        return jsonable({
            **self.header(), "layer": self.layer, "spike_dims": self.spike_dims, "has_spike": self.has_spike,
            "message": self.message, "norm": self.norm_kind, "rotary": self.rotary, "rotary_base": self.rotary_base,
            "T": self.T, **self.tables, "constancy": self.constancy, "rebuild": self.rebuild, "text": self.text(),
        })


class NormGainAccumulator(Accumulator):
    """The key path of one layer, fed jointly with its residual input, normalised input, q, k, rotated k and
    scores: shares of |.|^2 in the spike dims S, the rebuild errors, and per head the first-key logits and
    alpha_1 with k_1 replaced by its spike part or with the spike part removed."""

    optional_keys = frozenset({"rot_k"})  # GPT-NeoX-style bridges list hook_rot_k without running it

    def __init__(self, model, path: KeyPath, S: list[int], T: int, n_other: int = 4, kind: str | None = None):
        dims = model_dims(model)
        self.model, self.path, self.S, self.kind, self.H = model, path, S, kind, dims.n_heads
        self.layer, D, self.T = path.layer, path.W_K.shape[1], int(T)
        self.scale = attn_scale(model, path.W_K.shape[-1])
        self.Smask = torch.zeros(D, dtype=torch.bool)
        self.Smask[S] = True
        self.kv_of = torch.arange(self.H) // path.group
        self.other_pos = torch.unique(torch.linspace(1, T - 1, max(1, min(n_other, T - 1))).round().long())
        self.has_norm_hook = act_name("normalized", self.layer) in hook_names(model)
        self.acc = {k: torch.zeros((), dtype=torch.float64) for k in
                    ("h_share_o", "n_share_o", "x_share_o", "h_norm_o", "n_norm_o", "x_norm_o", "k_norm_o", "count_o",
                     "k_err", "k_ref", "n_err", "n_ref")}
        self.other_abs = torch.zeros(D, dtype=torch.float64)
        self.head = {k: torch.zeros(self.H, dtype=torch.float64) for k in
                     ("logit_first", "logit_spike", "logit_rest", "logit_other", "alpha", "alpha_spike", "alpha_rest", "score_err")}
        self.cnt = {"q": 0, "o": 0}
        self.keep = {k: [] for k in ("h1", "n1", "x1", "k1", "k1S", "n_o", "g_o")}
        self.err = {"k_max": 0.0, "rot": float("nan")}

    def hooks(self):
        l, p = self.layer, self.path
        want = {"h": act_name("resid_pre", l), "q": p.query_hook, "k": p.key_hook, "scores": act_name("attn_scores", l)}
        if self.has_norm_hook:
            want["n"] = act_name("normalized", l)
        if p.rot_key_hook is not None:
            want["rot_k"] = p.rot_key_hook
        return {l: want}

    def update(self, layer: int, acts: dict, batch: Batch) -> None:
        h = acts["h"].detach().float()
        n = self.path.norm.normalise(h)
        x = self.path.norm.affine(n)
        pos = torch.arange(h.shape[1])
        self._residual(h, n, x, batch)
        if "n" in acts:
            self.acc["n_err"] += (acts["n"].float() - n).abs().max().double().cpu()
            self.acc["n_ref"] += n.abs().max().double().cpu()
        k1, k1S = self._key(acts["k"].detach().float(), x, pos)
        if "rot_k" in acts:
            e = float((acts["rot_k"].detach().float() - self.path.keys(x, pos)).abs().max())
            self.err["rot"] = e if math.isnan(self.err["rot"]) else max(self.err["rot"], e)
        q = self.path.rotate(acts["q"].detach().float(), pos)
        self._scores(q, k1, k1S, acts["scores"].detach().float())

    def _residual(self, h, n, x, batch: Batch) -> None:
        """Shares and norms of ordinary tokens (streamed); the first token's vectors (kept, one per sample)."""
        for key, v in (("h", h[:, 1:]), ("n", n[:, 1:]), ("x", x[:, 1:])):
            sq = v.pow(2)
            self.acc[f"{key}_share_o"] += (sq[..., self.Smask].sum(-1) / sq.sum(-1).clamp_min(TINY)).double().sum().cpu()
            self.acc[f"{key}_norm_o"] += v.norm(dim=-1).double().sum().cpu()
        B = h.shape[0]
        self.acc["count_o"] += B * (h.shape[1] - 1)
        self.other_abs.add_(n[:, 1:].abs().double().sum(dim=(0, 1)).cpu())
        for key, v in (("h1", h[:, 0]), ("n1", n[:, 0]), ("x1", x[:, 0]), ("n_o", n[:, self.other_pos].reshape(-1, h.shape[-1]))):
            self.keep[key].append(v.cpu())
        self.keep["g_o"].append((torch.arange(B) + batch.offset).repeat_interleave(len(self.other_pos)))

    def _key(self, k, x, pos) -> tuple[torch.Tensor, torch.Tensor]:
        """Check the rebuilt key against hook_k; keep k_1 and its spike part k_1^S (both rotated)."""
        err = (self.path.keys(x, pos, rotary=False) - k).abs().max()
        self.err["k_max"] = max(self.err["k_max"], float(err))
        self.acc["k_err"] += float(err)
        self.acc["k_ref"] += float(k.abs().max())
        k = self.path.rotate(k, pos)
        self.acc["k_norm_o"] += k[:, 1:].norm(dim=-1).mean(-1).double().sum().cpu()
        x1 = x[:, :1]
        k1S = self.path.keys(x1 * self.Smask.to(x1.device), pos[:1], bias=False)[:, 0]  # (B,Hkv,dh)
        self.keep["k1"].append(k[:, 0].cpu())
        self.keep["k1S"].append(k1S.cpu())
        return k[:, 0], k1S

    def _scores(self, q, k1, k1S, sc) -> None:
        """First-key logits (checked against the model's scores) and alpha_1 with k_1, k_1^S or k_1 - k_1^S."""
        B, T = q.shape[:2]
        kq = self.kv_of.to(q.device)
        lf = torch.einsum("bthd,bhd->bht", q, k1[:, kq]) * self.scale  # (B,H,T)
        ls = torch.einsum("bthd,bhd->bht", q, k1S[:, kq]) * self.scale
        hd = self.head
        hd["score_err"] = torch.maximum(hd["score_err"], (sc[..., 0] - lf).abs().amax(dim=(0, 2)).double().cpu())
        for key, v in (("logit_first", lf), ("logit_spike", ls), ("logit_rest", lf - ls)):
            hd[key] += v[..., 1:].double().sum(dim=(0, 2)).cpu()
        self.cnt["q"] += B * (T - 1)
        tri = torch.tril(torch.ones(T, T, dtype=torch.bool, device=sc.device))
        tri[:, 0] = False  # keys j > 1 and the queries i >= j that see them
        hd["logit_other"] += sc[..., tri].double().sum(dim=(0, 2)).cpu()
        self.cnt["o"] += B * int(tri.sum())
        col = sc[..., 0]
        for key, c in (("alpha", col), ("alpha_spike", col + (ls - lf)), ("alpha_rest", col - ls)):
            hd[key] += _softmax_alpha(sc, c).double().sum(0).cpu()

    def result(self, message: str = "") -> NormGainTrace:
        kept = {k: torch.cat(v) for k, v in self.keep.items()}
        N = kept["h1"].shape[0]
        has_spike = bool(self.S)
        path = self.path
        return NormGainTrace(
            layer=self.layer, spike_dims=self.S, has_spike=has_spike, message=message, norm_kind=path.norm.kind,
            rotary=path.rotary, rotary_base=path.base, n_samples=N, T=self.T,
            stages=stage_table(kept, self.acc, self.Smask), gain=gain_table(path.norm.w, self.S, kept),
            heads=head_table(kept, self.head, self.cnt, self.kv_of, self.layer, has_spike),
            constancy=constancy(kept), rebuild=self._rebuild(), gain_vector=path.norm.w.clone(),
            first_normalised_mean=kept["n1"].mean(0), other_normalised_abs=(self.other_abs / float(self.acc["count_o"])).float(),
            first_resid_mean=kept["h1"].mean(0), model_name=getattr(self.model, "model_name", None), kind=self.kind,
        )

    def _rebuild(self) -> dict:
        a = self.acc
        return {
            "key_hook": self.path.key_hook, "key_max_abs_err": self.err["k_max"],
            "key_rel_err": float(a["k_err"] / a["k_ref"].clamp_min(TINY)),
            "rotated_key_max_abs_err": None if math.isnan(self.err["rot"]) else self.err["rot"],
            "normalised_rel_err": float(a["n_err"] / a["n_ref"]) if self.has_norm_hook else None,
            "score_max_abs_err": float(self.head["score_err"].max()), "attn_scale": self.scale,
        }


def _first_share(v: torch.Tensor, Smask: torch.Tensor) -> float:
    """The first tokens' share of |v|^2 in the spike dims, mean over samples (NaN without spike dims)."""
    if not Smask.any():
        return float("nan")
    sq = v.pow(2)
    return float((sq[:, Smask].sum(-1) / sq.sum(-1).clamp_min(TINY)).mean())


def stage_table(kept: dict, acc: dict, Smask: torch.Tensor) -> pd.DataFrame:
    """One row per stage (resid, normalised, gain, key): spike share and norm, first token against the others."""
    cnt, nan, has = float(acc["count_o"]), float("nan"), bool(Smask.any())
    k1, k1S = kept["k1"], kept["k1S"]
    k_share = ((k1 * k1S).sum(-1) / k1.pow(2).sum(-1).clamp_min(TINY)).mean() if has else nan
    rows = [{"stage": stage, "first_share": _first_share(kept[key], Smask),
             "other_share": float(acc[f"{o}_share_o"]) / cnt if has else nan,
             "first_norm": float(kept[key].norm(dim=-1).mean()), "other_norm": float(acc[f"{o}_norm_o"]) / cnt}
            for stage, key, o in (("resid (h)", "h1", "h"), ("normalised", "n1", "n"), ("gain", "x1", "x"))]
    rows.append({"stage": "key", "first_share": float(k_share), "other_share": nan,
                 "first_norm": float(k1.norm(dim=-1).mean()), "other_norm": float(acc["k_norm_o"]) / cnt})
    return pd.DataFrame(rows)


def gain_table(g: torch.Tensor, S: list[int], kept: dict) -> pd.DataFrame:
    """The gain at each spike dim against the rest (median and mean |g|), its percentile, the first token there."""
    rest = torch.ones_like(g, dtype=torch.bool)
    rest[S] = False
    g_rest, nan = g[rest].abs(), float("nan")
    h1, n1 = kept["h1"], kept["n1"]
    return pd.DataFrame({
        "dim": S + ["rest (median |g|)", "rest (mean |g|)"],
        "gain": [float(g[d]) for d in S] + [float(g_rest.median()), float(g_rest.mean())],
        "over_rest_median": [float(g[d].abs() / g_rest.median()) for d in S] + [1.0, float(g_rest.mean() / g_rest.median())],
        "percentile": [float((g_rest < g[d].abs()).float().mean() * 100) for d in S] + [50.0, nan],
        "first_token_h": [float(h1[:, d].mean()) for d in S] + [nan, nan],
        "first_token_n": [float(n1[:, d].mean()) for d in S] + [nan, nan],
    })


def head_table(kept: dict, hd: dict, cnt: dict, kv_of: torch.Tensor, layer: int, has_spike: bool) -> pd.DataFrame:
    """One row per query head: |k_1|, its spike part, logits and alpha_1 with the full, spike-only and spike-free key."""
    k1h, k1Sh = kept["k1"][:, kv_of], kept["k1S"][:, kv_of]  # (N,H,dh)
    N, nan = k1h.shape[0], float("nan")
    cq, co = max(cnt["q"], 1), max(cnt["o"], 1)
    lf, ls = hd["logit_first"] / cq, hd["logit_spike"] / cq
    spike = lambda v: v.numpy() if has_spike else nan  # noqa: E731
    return pd.DataFrame({
        "layer": layer, "head": range(len(kv_of)), "kv_head": kv_of.numpy(),
        "k1_norm": k1h.norm(dim=-1).mean(0).numpy(), "k1_spike_norm": k1Sh.norm(dim=-1).mean(0).numpy(),
        "cos_k1_spike": spike(torch.nn.functional.cosine_similarity(k1h, k1Sh, dim=-1).mean(0)),
        "k1_share_spike": spike(((k1h * k1Sh).sum(-1) / k1h.pow(2).sum(-1).clamp_min(TINY)).mean(0)),
        "logit_first": lf.numpy(), "logit_first_spike": spike(ls), "logit_first_rest": (hd["logit_rest"] / cq).numpy(),
        "logit_other": (hd["logit_other"] / co).numpy(), "logit_share_spike": spike(ls / lf),
        "alpha_1": (hd["alpha"] / N).numpy(), "alpha_1_spike_only": spike(hd["alpha_spike"] / N),
        "alpha_1_no_spike": spike(hd["alpha_rest"] / N),
    })


def constancy(kept: dict) -> dict:
    """How constant the first token's vectors are across inputs (mean pairwise cosine), against ordinary tokens."""
    n1, n_o, k1 = kept["n1"], kept["n_o"], kept["k1"]
    return {
        "cos_first_resid": mean_pairwise_cosine(kept["h1"]), "cos_first_normalised": mean_pairwise_cosine(n1),
        "cos_first_gain": mean_pairwise_cosine(kept["x1"]),
        "cos_first_key": [mean_pairwise_cosine(k1[:, j]) for j in range(k1.shape[1])],
        "cos_other_normalised": mean_pairwise_cosine(n_o, kept["g_o"]),
        "cos_first_other_normalised": float(torch.nn.functional.cosine_similarity(n1.mean(0, keepdim=True), n_o).mean()),
    }


def _spike_message(model, layer: int, S: list[int], found: bool, abs_threshold, ratio_threshold, min_share) -> str:
    if S:
        return f"{'found' if found else 'given'} spike dims {S} on the first token of the residual stream layer {layer} reads."
    name = getattr(model, "model_name", None) or "the model"
    return (f"The first token carries no spike in the residual stream layer {layer} of {name} reads: no dimension "
            f"passes |a| > {abs_threshold:g} and >= {ratio_threshold:g}x the hidden state's median on "
            f"{min_share:.0%} of samples. Spike shares and the spike-only key are not defined (NaN); try another "
            "layer (see analysis.massive), lower thresholds, or pass spike_dims.")


def trace_layers(first_token_dims: dict[int, list[int]], dim: int, max_runs: int = 2) -> list[int]:
    """The middle layer of each of the first ``max_runs`` runs of layers whose input carries ``dim`` on the first
    token (``first_token_dims`` of ``massive_activations(..., hook="resid_pre")``)."""
    with_dim = [l for l, ds in first_token_dims.items() if dim in ds]
    return [r[len(r) // 2] for r in runs(with_dim)[:max_runs]]


def choose_layer(sink, first_token_dims: dict[int, list[int]] | None, n_layers: int) -> int:
    """The sinkiest layer (``SinkResult``) whose input carries the first token's spike (block l reads
    ``hook_resid_post`` of l - 1, ``first_token_dims``), else the sinkiest layer."""
    reading = sorted({l + 1 for l in (first_token_dims or {}) if l + 1 < n_layers})
    if sink is None:
        return reading[0] if reading else 0
    per_layer = sink.per_layer(1)
    pool = per_layer[per_layer.layer.isin(reading)] if reading else per_layer
    return int(pool.sort_values(["sink_1_pct", "mean_alpha_1"], kind="stable").iloc[-1].layer)


def norm_gain_accumulator(model, tokens, layer: int, spike_dims=None, abs_threshold: float = SPIKE_ABS,
                          ratio_threshold: float = SPIKE_RATIO, min_share: float = SPIKE_MIN_SHARE, n_other: int = 4,
                          kind: str | None = None) -> tuple[NormGainAccumulator, str]:
    """Check the arguments of ``norm_gain_trace``, find the spike dims if not given; the accumulator and its message."""
    from analysis.massive import first_token_spike_dims

    tokens = check_tokens(model, tokens)
    (layer,) = check_layers(model, [layer])
    if tokens.shape[1] < 2:
        raise ValueError("norm-gain tracing needs T >= 2 tokens (the first token and at least one ordinary token).")
    path = key_path(model, layer)
    if act_name("attn_scores", layer) not in hook_names(model):
        raise ModelContractError(f"the model has no {act_name('attn_scores', layer)}; the attention check needs the pre-softmax scores.")
    found = spike_dims is None
    if found:
        spike_dims = first_token_spike_dims(model, tokens, "resid_pre", [layer], abs_threshold, ratio_threshold,
                                            min_share).get(layer, [])
    S = _check_dims(spike_dims, path.W_K.shape[1])
    message = _spike_message(model, layer, S, found, abs_threshold, ratio_threshold, min_share)
    if not S:
        warnings.warn(message, stacklevel=3)
    return NormGainAccumulator(model, path, S, tokens.shape[1], n_other, kind), message


def norm_gain_trace(
    model,
    tokens,
    layer: int,
    spike_dims: Sequence[int] | None = None,
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    min_share: float = SPIKE_MIN_SHARE,
    n_other: int = 4,
    batch_size: int | None = None,
    kind: str | None = None,
) -> NormGainTrace:
    """Trace the first token's spike through ln1, its gain, W_K and the rotary of ``layer``.

    ``spike_dims``: residual dims to trace; None finds the first token's spike dims in the stream the
    layer reads (``massive_activations`` on ``hook_resid_pre`` with ``abs_threshold``,
    ``ratio_threshold`` and ``min_share``). If the first token carries no spike, the trace still runs
    (norms, rebuild check, constancy) and ``has_spike`` is False with a plain ``message``.
    ``n_other``: ordinary tokens per sequence kept for the cross-input cosine. The pass stops after the layer.
    """
    tokens = check_tokens(model, tokens)
    acc, message = norm_gain_accumulator(model, tokens, layer, spike_dims, abs_threshold, ratio_threshold, min_share,
                                         n_other, kind)
    stream(model, tokens, [acc], batch_size=batch_size)
    return acc.result(message)
