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

from analysis.hooks import ModelContractError, check_layers, check_tokens, hook_names, model_dims, run_with_reducers
from analysis.models import rotary_base

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


def rotary_dim(model, d_head: int) -> int:
    """How many of a head's dims are rotated (partial rotary: GPT-NeoX, Phi...)."""
    rd = getattr(getattr(model, "cfg", None), "rotary_dim", None)
    if rd:
        return int(rd)
    hf = getattr(getattr(model, "original_model", None), "config", None)
    params = getattr(hf, "rope_parameters", None) if hf is not None else None
    sources = [params if isinstance(params, dict) else {}, hf]
    for src in sources:
        for name in ("partial_rotary_factor", "rotary_pct"):
            frac = src.get(name) if isinstance(src, dict) else getattr(src, name, None)
            if frac is not None:
                return int(d_head * float(frac))
    return d_head


def uses_rotary(model) -> bool:
    cfg = getattr(model, "cfg", None)
    return getattr(cfg, "positional_embedding_type", None) == "rotary"


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float, rot_dim: int | None = None) -> torch.Tensor:
    """HF rotary (rotate_half, non-interleaved) on x (..., T, heads, d_head) at ``positions`` (T,)."""
    d = x.shape[-1]
    rd = d if rot_dim is None else int(rot_dim)
    inv = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    ang = positions.double()[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)  # (T, rd)
    cos, sin = emb.cos().float()[:, None, :], emb.sin().float()[:, None, :]  # (T, 1, rd)
    xr, xp = x[..., :rd].float(), x[..., rd:].float()
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    out = xr * cos.to(x.device) + torch.cat([-x2, x1], -1) * sin.to(x.device)
    return torch.cat([out, xp], -1)


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
    kh, qh = f"blocks.{layer}.attn.hook_k", f"blocks.{layer}.attn.hook_q"
    rkh = f"blocks.{layer}.attn.hook_rot_k"
    missing = [n for n in (f"blocks.{layer}.hook_resid_pre", kh, qh) if n not in names]
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


def first_token_spike_dims(model, tokens, layer: int, abs_threshold: float = 100.0, ratio_threshold: float = 1000.0,
                           min_share: float = 0.5, max_samples: int = 32) -> list[int]:
    """Spike dims of the first token in the residual stream block ``layer`` reads (``hook_resid_pre``)."""
    from analysis.massive import massive_activations

    tokens = check_tokens(model, tokens)
    ma = massive_activations(model, tokens[:max_samples], layers=[layer], hook="resid_pre", top_k=1,
                             abs_threshold=abs_threshold, ratio_threshold=ratio_threshold, min_share=min_share)
    return ma.first_token_dims.get(layer, [])


def _check_dims(dims: Sequence[int] | None, D: int) -> list[int]:
    dims = sorted({int(d) for d in dims})
    bad = [d for d in dims if not 0 <= d < D]
    if bad:
        raise ValueError(f"spike_dims {bad} out of range: d_model is {D}, dims lie in 0..{D - 1}.")
    return dims


def _pairwise_cos(x: torch.Tensor, groups: torch.Tensor | None = None) -> float:
    """Mean cosine over pairs of rows (only pairs from different groups when ``groups`` is given)."""
    if x.shape[0] < 2:
        return float("nan")
    xn = torch.nn.functional.normalize(x.double(), dim=-1)
    c = xn @ xn.T
    mask = ~torch.eye(x.shape[0], dtype=torch.bool)
    if groups is not None:
        mask &= groups[:, None] != groups[None, :]
    return float(c[mask].mean()) if mask.any() else float("nan")


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
class NormGainTrace:
    """Norm-gain trace of one layer. ``heads`` has one row per query head; ``stages`` one row per stage."""

    layer: int
    spike_dims: list[int]
    has_spike: bool
    message: str
    norm_kind: str
    rotary: bool
    rotary_base: float | None
    n: int
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

    def summary(self) -> str:
        if not self.has_spike:
            return self.message
        st = self.stages.set_index("stage")
        h = self.heads
        return (
            f"Layer {self.layer}, spike dims {self.spike_dims}: they hold {st.loc['normalised', 'first_share']:.1%} of the first "
            f"token's normalised |n|^2 (ordinary tokens: {st.loc['normalised', 'other_share']:.2%}); after the gain "
            f"{st.loc['gain', 'first_share']:.1%}. k_1 rebuilt from them alone has cosine {h['cos_k1_spike'].mean():.3f} "
            f"with k_1 (mean over heads) and gives alpha_1 {h['alpha_1_spike_only'].mean():.3f} against "
            f"{h['alpha_1'].mean():.3f}; without them alpha_1 is {h['alpha_1_no_spike'].mean():.3f}. Across inputs the first "
            f"token's normalised vector has mean cosine {self.constancy['cos_first_normalised']:.3f} "
            f"(ordinary tokens {self.constancy['cos_other_normalised']:.3f})."
        )

    def to_dict(self) -> dict:
        def rec(df):
            return [{k: (v if isinstance(v, str) else (None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)))
                     for k, v in r.items()} for r in df.to_dict("records")]

        return {
            "model": self.model_name,
            "kind": self.kind,
            "layer": self.layer,
            "spike_dims": self.spike_dims,
            "has_spike": self.has_spike,
            "message": self.message,
            "norm": self.norm_kind,
            "rotary": self.rotary,
            "rotary_base": self.rotary_base,
            "n": self.n,
            "T": self.T,
            "stages": rec(self.stages),
            "gain": rec(self.gain),
            "heads": rec(self.heads),
            "constancy": {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in self.constancy.items()},
            "rebuild": self.rebuild,
            "summary": self.summary(),
        }


def norm_gain_trace(
    model,
    tokens,
    layer: int,
    spike_dims: Sequence[int] | None = None,
    abs_threshold: float = 100.0,
    ratio_threshold: float = 1000.0,
    min_share: float = 0.5,
    n_other: int = 4,
    batch_size: int | None = None,
    kind: str | None = None,
) -> NormGainTrace:
    """Trace the first token's spike through ln1, its gain, W_K and the rotary of ``layer``.

    ``spike_dims``: residual dims to trace; None finds the first token's spike dims in the stream the
    layer reads (``massive_activations`` on ``hook_resid_pre`` with ``abs_threshold``,
    ``ratio_threshold`` and ``min_share``). If the first token carries no spike, the trace still runs
    (norms, rebuild check, constancy) and ``has_spike`` is False with a plain ``message``.
    ``n_other``: ordinary tokens per sequence kept for the cross-input cosine.
    """

    tokens = check_tokens(model, tokens)
    (layer,) = check_layers(model, [layer])
    N, T = tokens.shape
    if T < 2:
        raise ValueError("norm-gain tracing needs T >= 2 tokens (the first token and at least one ordinary token).")
    path = key_path(model, layer)
    dims = model_dims(model)
    D = path.W_K.shape[1]
    dh = path.W_K.shape[-1]
    H = dims.n_heads
    scale = attn_scale(model, dh)
    if spike_dims is None:
        spike_dims = first_token_spike_dims(model, tokens, layer, abs_threshold, ratio_threshold, min_share)
        found = "found"
    else:
        found = "given"
    S = _check_dims(spike_dims, D)
    has_spike = bool(S)
    name = getattr(model, "model_name", None) or "the model"
    if has_spike:
        message = f"{found} spike dims {S} on the first token of the residual stream layer {layer} reads."
    else:
        message = (f"The first token carries no spike in the residual stream layer {layer} of {name} reads: no dimension "
                   f"passes |a| > {abs_threshold:g} and >= {ratio_threshold:g}x the hidden state's median on "
                   f"{min_share:.0%} of samples. Spike shares and the spike-only key are not defined (NaN); try another "
                   "layer (see analysis.massive), lower thresholds, or pass spike_dims.")
        warnings.warn(message, stacklevel=2)
    Smask = torch.zeros(D, dtype=torch.bool)
    Smask[S] = True
    kv_of = torch.arange(H) // path.group
    other_pos = torch.unique(torch.linspace(1, T - 1, max(1, min(n_other, T - 1))).round().long())
    positions = torch.arange(T)

    acc = {k: torch.zeros((), dtype=torch.float64) for k in
           ("h_share_o", "n_share_o", "x_share_o", "h_norm_o", "n_norm_o", "x_norm_o", "k_norm_o", "count_o",
            "k_err", "k_ref", "n_err", "n_ref")}
    other_abs = torch.zeros(D, dtype=torch.float64)
    head_acc = {k: torch.zeros(H, dtype=torch.float64) for k in
                ("logit_first", "logit_spike", "logit_rest", "logit_other", "alpha", "alpha_spike", "alpha_rest",
                 "score_err", "cnt_q", "cnt_o")}
    keep = {k: [] for k in ("h1", "n1", "x1", "k1", "k1S", "n_o", "g_o")}
    k_err_max = [0.0]
    rot_err = [float("nan")]
    state: dict = {}
    names = hook_names(model)
    norm_hook = f"blocks.{layer}.ln1.hook_normalized"
    scores_hook = f"blocks.{layer}.attn.hook_attn_scores"
    if scores_hook not in names:
        raise ModelContractError(f"the model has no {scores_hook}; the attention check needs the pre-softmax scores.")
    offset = [0]

    def on_resid(h, hook):
        h = h.detach().float()
        B = h.shape[0]
        n = path.norm.normalise(h)
        x = path.norm.affine(n)
        state.update(h=h, n=n, x=x)
        # ordinary tokens
        ho, no, xo = h[:, 1:], n[:, 1:], x[:, 1:]
        for key, v in (("h", ho), ("n", no), ("x", xo)):
            sq = v.pow(2)
            acc[f"{key}_share_o"] += (sq[..., Smask].sum(-1) / sq.sum(-1).clamp_min(1e-30)).double().sum().cpu()
            acc[f"{key}_norm_o"] += v.norm(dim=-1).double().sum().cpu()
        acc["count_o"] += B * (h.shape[1] - 1)
        other_abs.add_(no.abs().double().sum(dim=(0, 1)).cpu())
        keep["h1"].append(h[:, 0].cpu())
        keep["n1"].append(n[:, 0].cpu())
        keep["x1"].append(x[:, 0].cpu())
        keep["n_o"].append(n[:, other_pos].reshape(-1, D).cpu())
        keep["g_o"].append((torch.arange(B) + offset[0]).repeat_interleave(len(other_pos)))

    def on_norm(nh, hook):
        n = state["n"]
        acc["n_err"] += (nh.float() - n).abs().max().double().cpu()
        acc["n_ref"] += n.abs().max().double().cpu()

    def on_key(k, hook):  # the key before the rotary
        k = k.detach().float()
        x = state["x"]
        pos = positions[: x.shape[1]]
        kr = path.keys(x, pos, rotary=False)  # (B,T,Hkv,dh)
        err = (kr - k).abs().max()
        k_err_max[0] = max(k_err_max[0], float(err))
        acc["k_err"] += float(err)
        acc["k_ref"] += float(k.abs().max())
        k = path.rotate(k, pos)
        acc["k_norm_o"] += k[:, 1:].norm(dim=-1).mean(-1).double().sum().cpu()
        x1 = x[:, :1]
        k1S = path.keys(x1 * Smask.to(x1.device), positions[:1], bias=False)[:, 0]  # (B,Hkv,dh)
        keep["k1"].append(k[:, 0].cpu())
        keep["k1S"].append(k1S.cpu())
        state["k1"], state["k1S"], state["k_rot"] = k[:, 0], k1S, k

    def on_rot_key(k, hook):  # the model's own rotated key, where the hook fires
        e = float((k.detach().float() - path.keys(state["x"], positions[: k.shape[1]])).abs().max())
        rot_err[0] = e if math.isnan(rot_err[0]) else max(rot_err[0], e)

    def on_query(q, hook):
        state["q"] = path.rotate(q.detach().float(), positions[: q.shape[1]])

    def on_scores(sc, hook):
        q, k1, k1S = state["q"], state["k1"], state["k1S"]
        B, T_ = q.shape[:2]
        kq = kv_of.to(q.device)
        k1h, k1Sh = k1[:, kq], k1S[:, kq]  # (B,H,dh)
        lf = torch.einsum("bthd,bhd->bht", q, k1h) * scale  # (B,H,T)
        ls = torch.einsum("bthd,bhd->bht", q, k1Sh) * scale
        sc = sc.detach().float()
        head_acc["score_err"] = torch.maximum(head_acc["score_err"], (sc[..., 0] - lf).abs().amax(dim=(0, 2)).double().cpu())
        later = slice(1, None)
        head_acc["logit_first"] += lf[..., later].double().sum(dim=(0, 2)).cpu()
        head_acc["logit_spike"] += ls[..., later].double().sum(dim=(0, 2)).cpu()
        head_acc["logit_rest"] += (lf - ls)[..., later].double().sum(dim=(0, 2)).cpu()
        head_acc["cnt_q"] += B * (T_ - 1)
        tri = torch.tril(torch.ones(T_, T_, dtype=torch.bool, device=sc.device))
        tri[:, 0] = False  # keys j > 1 and the queries i >= j that see them
        head_acc["logit_other"] += sc[..., tri].double().sum(dim=(0, 2)).cpu()
        head_acc["cnt_o"] += B * int(tri.sum())
        col = sc[..., 0]
        head_acc["alpha"] += _softmax_alpha(sc, col).double().sum(0).cpu()
        head_acc["alpha_spike"] += _softmax_alpha(sc, col + (ls - lf)).double().sum(0).cpu()
        head_acc["alpha_rest"] += _softmax_alpha(sc, col - ls).double().sum(0).cpu()

    def done(batch, logits):
        offset[0] += batch.shape[0]

    hooks = [(f"blocks.{layer}.hook_resid_pre", on_resid)]
    if norm_hook in names:
        hooks.append((norm_hook, on_norm))
    hooks += [(path.query_hook, on_query), (path.key_hook, on_key), (scores_hook, on_scores)]
    if path.rot_key_hook is not None:
        hooks.append((path.rot_key_hook, on_rot_key))
    run_with_reducers(model, tokens, hooks, stop_after=scores_hook if layer < dims.n_layers - 1 else None,
                batch_size=batch_size, on_batch=done)

    h1, n1, x1 = (torch.cat(keep[k]) for k in ("h1", "n1", "x1"))
    k1, k1S = torch.cat(keep["k1"]), torch.cat(keep["k1S"])  # (N,Hkv,dh)
    n_o, g_o = torch.cat(keep["n_o"]), torch.cat(keep["g_o"])
    cnt = float(acc["count_o"])
    nan = float("nan")

    def share(v):  # first-token share of |v|^2 in S, mean over samples
        sq = v.pow(2)
        return float((sq[:, Smask].sum(-1) / sq.sum(-1).clamp_min(1e-30)).mean()) if has_spike else nan

    k1h, k1Sh = k1[:, kv_of], k1S[:, kv_of]  # (N,H,dh)
    k_share = (k1h * k1Sh).sum(-1) / k1h.pow(2).sum(-1).clamp_min(1e-30)  # share of |k_1|^2 along k_1^S
    cos_k = torch.nn.functional.cosine_similarity(k1h, k1Sh, dim=-1)
    stages = pd.DataFrame([
        {"stage": "resid (h)", "first_share": share(h1), "other_share": float(acc["h_share_o"]) / cnt if has_spike else nan,
         "first_norm": float(h1.norm(dim=-1).mean()), "other_norm": float(acc["h_norm_o"]) / cnt},
        {"stage": "normalised", "first_share": share(n1), "other_share": float(acc["n_share_o"]) / cnt if has_spike else nan,
         "first_norm": float(n1.norm(dim=-1).mean()), "other_norm": float(acc["n_norm_o"]) / cnt},
        {"stage": "gain", "first_share": share(x1), "other_share": float(acc["x_share_o"]) / cnt if has_spike else nan,
         "first_norm": float(x1.norm(dim=-1).mean()), "other_norm": float(acc["x_norm_o"]) / cnt},
        {"stage": "key", "first_share": float(k_share.mean()) if has_spike else nan, "other_share": nan,
         "first_norm": float(k1.norm(dim=-1).mean()), "other_norm": float(acc["k_norm_o"]) / cnt},
    ])
    g = path.norm.w
    rest = ~Smask
    g_rest = g[rest].abs()
    rank = [float((g_rest < g[d].abs()).float().mean() * 100) for d in S]
    gain = pd.DataFrame({
        "dim": S + ["rest (median |g|)", "rest (mean |g|)"],
        "gain": [float(g[d]) for d in S] + [float(g_rest.median()), float(g_rest.mean())],
        "over_rest_median": [float(g[d].abs() / g_rest.median()) for d in S] + [1.0, float(g_rest.mean() / g_rest.median())],
        "percentile": rank + [50.0, nan],
        "first_token_h": [float(h1[:, d].mean()) for d in S] + [nan, nan],
        "first_token_n": [float(n1[:, d].mean()) for d in S] + [nan, nan],
    })
    cq, co = head_acc["cnt_q"].clamp_min(1), head_acc["cnt_o"].clamp_min(1)
    lf, ls = head_acc["logit_first"] / cq, head_acc["logit_spike"] / cq
    heads = pd.DataFrame({
        "layer": layer,
        "head": range(H),
        "kv_head": kv_of.numpy(),
        "k1_norm": k1h.norm(dim=-1).mean(0).numpy(),
        "k1_spike_norm": k1Sh.norm(dim=-1).mean(0).numpy(),
        "cos_k1_spike": cos_k.mean(0).numpy() if has_spike else nan,
        "k1_share_spike": k_share.mean(0).numpy() if has_spike else nan,
        "logit_first": lf.numpy(),
        "logit_first_spike": ls.numpy() if has_spike else nan,
        "logit_first_rest": (head_acc["logit_rest"] / cq).numpy(),
        "logit_other": (head_acc["logit_other"] / co).numpy(),
        "logit_share_spike": (ls / lf).numpy() if has_spike else nan,
        "alpha_1": (head_acc["alpha"] / N).numpy(),
        "alpha_1_spike_only": (head_acc["alpha_spike"] / N).numpy() if has_spike else nan,
        "alpha_1_no_spike": (head_acc["alpha_rest"] / N).numpy() if has_spike else nan,
    })
    constancy = {
        "cos_first_resid": _pairwise_cos(h1),
        "cos_first_normalised": _pairwise_cos(n1),
        "cos_first_gain": _pairwise_cos(x1),
        "cos_first_key": [_pairwise_cos(k1[:, j]) for j in range(k1.shape[1])],
        "cos_other_normalised": _pairwise_cos(n_o, g_o),
        "cos_first_other_normalised": float(torch.nn.functional.cosine_similarity(
            n1.mean(0, keepdim=True), n_o).mean()),
    }
    rebuild = {
        "key_hook": path.key_hook,
        "key_max_abs_err": k_err_max[0],
        "key_rel_err": float(acc["k_err"] / acc["k_ref"].clamp_min(1e-30)),
        "rotated_key_max_abs_err": None if math.isnan(rot_err[0]) else rot_err[0],
        "normalised_rel_err": float(acc["n_err"] / acc["n_ref"]) if norm_hook in names else None,
        "score_max_abs_err": float(head_acc["score_err"].max()),
        "attn_scale": scale,
    }
    return NormGainTrace(
        layer=layer, spike_dims=S, has_spike=has_spike, message=message, norm_kind=path.norm.kind, rotary=path.rotary,
        rotary_base=path.base, n=N, T=T, stages=stages, gain=gain, heads=heads, constancy=constancy, rebuild=rebuild,
        gain_vector=g.clone(), first_normalised_mean=n1.mean(0), other_normalised_abs=(other_abs / cnt).float(),
        first_resid_mean=h1.mean(0), model_name=getattr(model, "model_name", None), kind=kind,
    )
