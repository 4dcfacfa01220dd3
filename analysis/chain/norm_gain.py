"""Norm-gain tracing: how the first token's spike becomes the first key.

Along the key path of one attention layer l, for the first token and for ordinary tokens, as the family spec
(``analysis.model.families``) says the layer computes it:

    h (blocks.l.hook_resid_pre) -> n = norm(h) (RMSNorm: h / rms(h); LayerNorm: centred, / std; none where the
      block normalises after attention: OLMo-2) -> x = g * n (+ b for LayerNorm; g = w, or 1 + w for Gemma,
      Qwen3-Next, Qwen3.5) -> k = x W_K (+ b_K) per KV head (fused QKV: the bridge's split W_K) -> the key norm
      (Qwen3, Gemma 3, Qwen3-Next: per head; OLMo-2: over all heads together) -> rotary (the spec's dim, pairing
      and base; none for ALiBi / absolute positions) -> the key the attention uses

everything rebuilt from the hooks' h and the model's raw weights (norms not folded into W_K), and checked
against the model's own ``hook_k`` (the projection), the spec's key hook (the key the attention uses) and the
attention scores / pattern (which check the queries, the rotary, the score scale and the soft-cap end to end).
For the spike dims S (found by ``analysis.chain.massive`` on the first token of h, or given) it measures:

- the share of |h|^2, |n|^2 and |x|^2 held by S, first token against ordinary tokens;
- the gain g at S against the rest;
- how much of k_1 S alone explains (k_1^S: x_1[S] W_K through the key norm's linear part at k_1's scale; cosine,
  share of |k_1|^2), and of the logits q_t . k_1; the attention the head gives the first key when k_1 is
  replaced by k_1^S alone, or by k_1 - k_1^S (the spike removed); which residual dims the first key comes from;
- where the key passes a q/k norm: how much it scales the first key against ordinary keys, and its gain along
  the spike part of k_1 against its RMS gain (the link the spike passes on its way into the key);
- how constant the first token's vectors are across inputs (mean pairwise cosine of n_1, x_1, k_1
  over different sequences), against ordinary tokens.

All statistics are reduced inside the hooks of layer l, and the forward pass stops after it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Sequence

import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.core.defaults import SPIKE_ABS, SPIKE_MIN_SHARE, SPIKE_RATIO, TINY
from analysis.model.families import get_family, sink_logits
from analysis.model.hooks import act_name, check_dims, check_layers, check_tokens, hook_names, kv_view, model_dims
from analysis.model.key_path import KeyPath, key_path
from analysis.chain.massive import criterion_text, first_token_spike_dims
from analysis.engine.attention import attention_of
from analysis.engine.passes import Accumulator, Batch, can_resume, resume_from, run_pass
from analysis.core.results import Result, runs
from analysis.core.docs import share_parameters
from analysis.model.rotary import rotate_as_spec
from analysis.core.stats import mean_pairwise_cosine

# ----------------------------------------------------------------------------------------------
# Scores from the rebuilt keys
# ----------------------------------------------------------------------------------------------


def attn_scale(model: SinkModel, *, d_head: int | None = None) -> float:
    """The factor on q . k in the attention scores (the family spec's: Granite's attention multiplier, Gemma's
    query_pre_attn_scalar, 1/sqrt(d_head) by default).

    Parameters
    ----------
    model
        A loaded model.
    d_head : int, optional
        Unused; the family spec knows the scale.

    Returns
    -------
    float
    """
    return float(get_family(model).attn_scale)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's logit soft-cap: cap * tanh(x / cap) (identity without one).

    Parameters
    ----------
    x : torch.Tensor, shape (...)
    cap : float or None

    Returns
    -------
    torch.Tensor, shape (...)
    """
    return cap * torch.tanh(x / cap) if cap else x


def _softmax_alpha(scores: torch.Tensor, col0: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
    """alpha_1 per (B, H) after replacing the first-key column of ``scores`` (B,H,T,T; masked entries very negative)
    with ``col0`` (B,H,T); ``sink``: the learned sink logit per head (H,) that takes its share of each row."""
    s = scores.float().clone()
    s[..., 0] = col0
    T = s.shape[-1]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=s.device), diagonal=1)
    s = s.masked_fill(future, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.to(s.device).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    p = s.softmax(-1)[..., :T]
    return p[..., 0].mean(-1)  # every query sees key 1 (unless a sliding window hides it): mean over all T queries


def visible_keys(spec, layer: int, T: int) -> torch.Tensor:
    """Which keys each query sees: causal, and inside the sliding window on the spec's sliding layers.

    Parameters
    ----------
    spec : FamilySpec
    layer : int
    T : int
        The sequence length.

    Returns
    -------
    torch.Tensor, shape (T, T)
        bool, [i, j]: query i sees key j.
    """
    seen = torch.ones(T, T, dtype=torch.bool).tril()
    if spec.sliding_window and layer in spec.sliding_layers:
        seen &= ~torch.ones(T, T, dtype=torch.bool).tril(-int(spec.sliding_window))
    return seen


# ----------------------------------------------------------------------------------------------
# The trace
# ----------------------------------------------------------------------------------------------


@dataclass
class NormGainTrace(Result):
    """Norm-gain trace of one attention layer: how the first token's spike becomes the first key.

    Attributes
    ----------
    layer : int
        The attention layer traced.
    spike_dims : list of int
        S, the residual dims traced.
    has_spike : bool
        Whether S is not empty.
    message : str
        Whether S was found or given, or why there is none, in words.
    norm_kind : str
        The norm on the attention input ("RMSNorm", "LayerNorm", ...).
    rotary : bool
        Whether the key passes a rotary embedding.
    rotary_base : float or None
        Its theta.
    n_samples : int
        N, the number of sequences.
    T : int
        The sequence length.
    stages : pandas.DataFrame
        One row per stage of the key path (resid, normalised, gain, key): the spike share and norm, first token against
        the others.
    gain : pandas.DataFrame
        The gain at each spike dim against the rest (median and mean |g|), its percentile, the first token there.
    heads : pandas.DataFrame
        One row per query head: |k_1| and its spike part, the logits and alpha_1 with the full, spike-only and
        spike-free key, the key norm's scales and gains.
    constancy : dict
        How constant the first token's vectors are across inputs (mean pairwise cosines), against ordinary tokens.
    rebuild : dict
        The largest errors of the rebuilt keys, scores and pattern against the model's own hooks.
    gain_vector : torch.Tensor, shape (D,)
        The gain g (w, or 1 + w).
    first_normalised_mean : torch.Tensor, shape (D,)
        The mean normalised first token n_1.
    other_normalised_abs : torch.Tensor, shape (D,)
        The mean |n_t| of the other tokens, t > 1.
    first_resid_mean : torch.Tensor, shape (D,)
        The mean residual h_1 of the first token.
    key_dims : pandas.DataFrame
        The residual dims the first key comes from most, with their share of k_1.
    path_text : str
        The key path in words (``KeyPath.text()``).
    key_norm : str or None
        The key norm in words, where the family has one.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    meta : dict
        Further facts.
    """

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
    gain_vector: torch.Tensor  # (D,) the gain g (w, or 1 + w)
    first_normalised_mean: torch.Tensor  # (D,) mean n_1
    other_normalised_abs: torch.Tensor  # (D,) mean |n_t|, t > 1
    first_resid_mean: torch.Tensor  # (D,) mean h_1
    key_dims: pd.DataFrame = field(default_factory=pd.DataFrame)
    path_text: str = ""
    key_norm: str | None = None  # the key norm in words, where the family has one
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

    def top_dims(self, n: int = 4) -> list[int]:
        """The residual dims with the largest share of the first key (mean over inputs and KV heads)."""
        return [int(d) for d in self.key_dims["dim"].head(n)] if len(self.key_dims) else []

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {"stages": self.stages, "gain": self.gain, "heads": self.heads, "key_dims": self.key_dims}

    def findings(self) -> list[str]:
        """The key path, what the norm and its gain do to the spike dims, the key norm, how much of the first key
        the spike dims explain, and how constant the normalised first token is."""
        if not self.has_spike:
            return [t for t in (self.message, self.path_text) if t]
        return [
            t
            for t in (self.path_text, self.gain_text(), self.key_norm_text(), *self._spike_key(), self.constancy_text())
            if t
        ]

    def norm_findings(self) -> list[str]:
        """The norm's part of the chain: the spike dims through the norm and its gain, and how constant the first
        token's normalised vector is."""
        return [self.gain_text(), self.constancy_text()] if self.has_spike else [self.message]

    def key_findings(self) -> list[str]:
        """The key's part of the chain: the key path, the key norm, and how much of the first key, its logit and
        the sink the spike dims explain (whole sentences; without a spike, the path alone)."""
        if not self.has_spike:
            return [self.path_text] if self.path_text else []
        return [t for t in (self.path_text, self.key_norm_text(), *self._spike_key()) if t]

    def _spike_key(self) -> list[str]:
        h = self.heads
        out = [
            f"The first key k_1 rebuilt from the spike dims alone has cosine {h['cos_k1_spike'].mean():.3f} with k_1 "
            f"(mean over heads) and gives {h['logit_share_spike'].mean():.0%} of the logit q_t·k_1; alpha_1 is "
            f"{h['alpha_1'].mean():.3f}, {h['alpha_1_spike_only'].mean():.3f} with the spike part alone and "
            f"{h['alpha_1_no_spike'].mean():.3f} with the spike part removed."
        ]
        if len(self.key_dims):
            out.append(f"The first key's largest shares come from residual dims {self.top_dims()}.")
        return out

    def gain_text(self) -> str:
        """What the norm and its gain do to the spike dims."""
        if not self.has_spike:
            return self.message
        st, g = self.stages.set_index("stage"), self.gain_summary()
        if self.norm_kind == "none":
            return (
                f"Layer {self.layer} has no norm before attention: spike dims {self.spike_dims} hold "
                f"{st.loc['resid (h)', 'first_share']:.1%} of the first token's |h|^2 (ordinary tokens: "
                f"{st.loc['resid (h)', 'other_share']:.1%}) and enter W_K as they are."
            )
        return (
            f"Layer {self.layer}, spike dims {self.spike_dims}: they hold {st.loc['normalised', 'first_share']:.1%} of the "
            f"first token's normalised |n|^2 (ordinary tokens: {st.loc['normalised', 'other_share']:.1%}); the gain there is "
            f"{g['gain_spike_over_rest'][0]:.2f}x the median |g|, and after it they hold {st.loc['gain', 'first_share']:.1%} "
            f"(ordinary tokens {st.loc['gain', 'other_share']:.1%})."
        )

    def key_norm_text(self) -> str:
        """What the key norm (Qwen3, Gemma 3, OLMo-2, Qwen3-Next) does to the first key and its spike part."""
        if self.key_norm is None:
            return ""
        h = self.heads
        s1, so = h["knorm_scale_first"].mean(), h["knorm_scale_other"].mean()
        out = (
            f"The keys then pass {self.key_norm}: it scales the first key's projection by {s1:.3g} against "
            f"{so:.3g} for ordinary keys ({s1 / so:.2f}x)"
        )
        if self.has_spike:
            out += (
                f", and its gain along the spike part of k_1 is {h['knorm_gain_spike'].mean():.2f} against an RMS "
                f"gain of {h['knorm_gain_rms'].mean():.2f}"
            )
        return out + "."

    def key_text(self) -> str:
        """How much of the first key, its logit and the sink the spike dims explain."""
        if not self.has_spike:
            return self.message
        return " ".join(self._spike_key())

    def constancy_text(self) -> str:
        c = self.constancy
        return (
            f"Across inputs the first token's normalised vector has mean cosine {c['cos_first_normalised']:.3f} "
            f"(ordinary tokens {c['cos_other_normalised']:.3f})."
        )

    def rebuild_text(self) -> str:
        r = self.rebuild
        fmt = lambda v: "not checked (no hook)" if v is None else f"{v:.1e}"  # noqa: E731
        return (
            f"Layer {self.layer}: rebuilt key projection against {r['key_hook']}, relative error {r['key_rel_err']:.1e}; "
            f"rebuilt keys against {r['final_key_hook']}, max abs error {fmt(r['final_key_max_abs_err'])}; first-key "
            f"scores, max abs error {fmt(r['score_max_abs_err'])}; pattern, max abs error {fmt(r['pattern_max_abs_err'])}."
        )

    json_fields = (
        "layer",
        "spike_dims",
        "has_spike",
        "message",
        "norm=norm_kind",
        "rotary",
        "rotary_base",
        "key_norm",
        "path=path_text",
        "T",
        "*tables",
        "constancy",
        "rebuild",
    )


class NormGainAccumulator(Accumulator):
    """The key path of one attention layer, fed jointly with its residual input, normalised input, key projection,
    the key and query the attention uses, scores and pattern: shares of |.|^2 in the spike dims S, the rebuild
    errors, per head the first-key logits and alpha_1 with k_1 replaced by its spike part or with the spike part
    removed, the key norm's scales, and the residual dims' shares of k_1."""

    optional_keys = frozenset({"n", "scores"})

    def __init__(self, model, path: KeyPath, S: list[int], T: int, *, n_other: int = 4, kind: str | None = None):
        self.model, self.path, self.S, self.kind, self.H = model, path, S, kind, model_dims(model).n_heads
        self.spec, self.layer, D, self.T = path.spec, path.layer, path.W_K.shape[1], int(T)
        self.Smask = torch.zeros(D, dtype=torch.bool)
        self.Smask[S] = True
        self.kv_of = torch.arange(self.H) // path.group
        self.other_pos = torch.unique(torch.linspace(1, T - 1, max(1, min(n_other, T - 1))).round().long())
        self.has_norm_hook = path.norm.kind != "none" and act_name("normalized", self.layer) in hook_names(model)
        self.sink = sink_logits(model, self.layer) if self.spec.learned_sinks else None
        self.acc = {
            k: torch.zeros((), dtype=torch.float64)
            for k in (
                "h_share_o",
                "n_share_o",
                "x_share_o",
                "h_norm_o",
                "n_norm_o",
                "x_norm_o",
                "k_norm_o",
                "count_o",
                "k_err",
                "k_ref",
                "n_err",
                "n_ref",
            )
        }
        self.other_abs = torch.zeros(D, dtype=torch.float64)
        self.knorm_other = torch.zeros(path.W_K.shape[0], dtype=torch.float64)
        self.head = {
            k: torch.zeros(self.H, dtype=torch.float64)
            for k in ("logit_first", "logit_spike", "logit_rest", "logit_other", "alpha", "alpha_spike", "alpha_rest")
        }
        self.cnt = {"q": 0, "o": 0}
        self.keep = {
            k: []
            for k in (
                "h1",
                "n1",
                "x1",
                "k1",
                "k1S",
                "kp1",
                "kp1S",
                "n_o",
                "g_o",
                "dim_share",
                "knorm_first",
                "knorm_spike",
            )
        }
        self.err = {"k_max": 0.0, "final": 0.0, "score": None, "pattern": 0.0}

    def hooks(self):
        l, p = self.layer, self.path
        want = {
            "h": act_name("resid_pre", l),
            "q": p.query_hook,
            "k": p.key_hook,
            "kf": p.final_key_hook,
            "pattern": self.spec.pattern_hook(l),
        }
        if self.spec.scores_hook(l):
            want["scores"] = self.spec.scores_hook(l)
        if self.has_norm_hook:
            want["n"] = act_name("normalized", l)
        return {l: want}

    def _max_err(self, key: str, err) -> None:
        e = float(err)
        self.err[key] = e if self.err[key] is None else max(self.err[key], e)

    def update(self, layer: int, acts: dict, batch: Batch) -> None:
        p, spec = self.path, self.spec
        h = acts["h"].detach().float()
        n = p.norm.normalise(h)
        x = p.norm.affine(n)
        pos = torch.arange(h.shape[1], device=h.device)
        self._residual(h, n, x, batch)
        if "n" in acts:
            self.acc["n_err"] += (acts["n"].float() - n).abs().max().double().cpu()
            self.acc["n_ref"] += n.abs().max().double().cpu()
        kp = p.project(x)
        self._projection(kp, p.projection_heads(acts["k"].detach()).float())
        used = kv_view(rotate_as_spec(acts["kf"].detach(), spec, layer, positions=pos), kp.shape[2])  # (B,T,Hkv,d)
        self._max_err("final", (p.rotate(p.key_norm(kp), pos) - used).abs().max())
        k1S = self._first_key(x, kp, used)
        q = rotate_as_spec(acts["q"].detach(), spec, layer, positions=pos)
        self._scores(q, used, k1S, acts.get("scores"), attention_of(acts["pattern"]).dense())

    def _residual(self, h, n, x, batch: Batch) -> None:
        """Shares and norms of ordinary tokens (streamed); the first token's vectors (kept, one per sample)."""
        for key, v in (("h", h[:, 1:]), ("n", n[:, 1:]), ("x", x[:, 1:])):
            sq = v.pow(2)
            self.acc[f"{key}_share_o"] += (
                (sq[..., self.Smask].sum(-1) / sq.sum(-1).clamp_min(TINY)).double().sum().cpu()
            )
            self.acc[f"{key}_norm_o"] += v.norm(dim=-1).double().sum().cpu()
        B = h.shape[0]
        self.acc["count_o"] += B * (h.shape[1] - 1)
        self.other_abs.add_(n[:, 1:].abs().double().sum(dim=(0, 1)).cpu())
        for key, v in (
            ("h1", h[:, 0]),
            ("n1", n[:, 0]),
            ("x1", x[:, 0]),
            ("n_o", n[:, self.other_pos].reshape(-1, h.shape[-1])),
        ):
            self.keep[key].append(v.cpu())
        self.keep["g_o"].append((torch.arange(B) + batch.offset).repeat_interleave(len(self.other_pos)))

    def _projection(self, kp, k) -> None:
        """Check the rebuilt key projection against hook_k."""
        err = (kp - k).abs().max()
        self.err["k_max"] = max(self.err["k_max"], float(err))
        self.acc["k_err"] += float(err)
        self.acc["k_ref"] += float(k.abs().max())

    def _first_key(self, x, kp, used) -> torch.Tensor:
        """Keep k_1 (as the attention uses it), its spike part k_1^S (x_1[S] W_K through the key norm's linear part
        at k_1's scale), the key norm's scales, and each residual dim's share of k_1; return k_1^S (B,Hkv,d)."""
        p = self.path
        kpS = p.project(x[:, :1] * self.Smask.to(x.device), bias=False)  # (B,1,Hkv,d)
        k1S = p.key_norm_part(kpS, kp[:, :1])[:, 0]  # position 0: the rotary is the identity
        k1 = used[:, 0]
        sq = k1.pow(2).sum(-1).clamp_min(TINY)  # (B,Hkv)
        v = p.key_norm_adjoint(k1[:, None], kp[:, :1])[:, 0]  # (B,Hkv,d)
        share = x[:, 0, None, :] * torch.einsum("hde,bhe->bhd", p.W_K.to(x.device), v) / sq[..., None]
        scale = p.key_norm_scale(kp)  # (B,T,Hkv)
        self.knorm_other += scale[:, 1:].double().sum((0, 1)).cpu()
        spike_gain = k1S.norm(dim=-1) / (kpS[:, 0].norm(dim=-1) * scale[:, 0]).clamp_min(TINY)
        self.acc["k_norm_o"] += used[:, 1:].norm(dim=-1).mean(-1).double().sum().cpu()
        for key, t in (
            ("k1", k1),
            ("k1S", k1S),
            ("kp1", kp[:, 0]),
            ("kp1S", kpS[:, 0]),
            ("dim_share", share.mean(1)),
            ("knorm_first", scale[:, 0]),
            ("knorm_spike", spike_gain),
        ):
            self.keep[key].append(t.detach().float().cpu())
        return k1S

    def _scores(self, q, used, k1S, sc, pattern) -> None:
        """First-key logits (checked against the model's scores and pattern) and alpha_1 with k_1, k_1^S or
        k_1 - k_1^S; scores as the softmax sees them: the hook's (with ALiBi, masks), or rebuilt from q and k."""
        spec, (B, T) = self.spec, q.shape[:2]
        cap, scale = spec.attn_softcap, spec.attn_scale
        raw = torch.einsum("bqhd,bkhd->bhqk", q, used[:, :, self.kv_of.to(q.device)]) * scale  # (B,H,T,T)
        vis = visible_keys(spec, self.layer, T).to(q.device)
        capped = softcap(raw, cap)
        if sc is None:
            sc = capped.masked_fill(~vis, float("-inf"))
        else:
            sc = sc.detach().float()
            self._max_err("score", (sc[..., 0] - capped[..., 0])[..., vis[:, 0]].abs().max())
        lf, ls = raw[..., 0], torch.einsum("bthd,bhd->bht", q, k1S[:, self.kv_of.to(q.device)]) * scale
        first = vis[:, 0].clone()
        first[0] = False  # queries t > 1 that see key 1
        hd = self.head
        for key, v in (("logit_first", lf), ("logit_spike", ls), ("logit_rest", lf - ls)):
            hd[key] += v[..., first].double().sum(dim=(0, 2)).cpu()
        self.cnt["q"] += B * int(first.sum())
        tri = vis.clone()
        tri[:, 0] = False  # keys j > 1 and the queries that see them
        hd["logit_other"] += raw[..., tri].double().sum(dim=(0, 2)).cpu()
        self.cnt["o"] += B * int(tri.sum())
        off = sc[..., 0] - capped[..., 0]  # what the scores add to q . k (ALiBi, masks); 0 when rebuilt
        for key, c in (
            ("alpha", sc[..., 0]),
            ("alpha_spike", softcap(ls, cap) + off),
            ("alpha_rest", softcap(lf - ls, cap) + off),
        ):
            hd[key] += _softmax_alpha(sc, c, self.sink).double().sum(0).cpu()
        logits = (
            sc
            if self.sink is None
            else torch.cat([sc, self.sink.to(sc.device).view(1, -1, 1, 1).expand(*sc.shape[:-1], 1)], -1)
        )
        self._max_err("pattern", (logits.softmax(-1)[..., :T] - pattern).abs().max())

    def result(self, message: str = "") -> NormGainTrace:
        kept = {k: torch.cat(v) for k, v in self.keep.items()}
        N, path, has_spike = kept["h1"].shape[0], self.path, bool(self.S)
        knorm = None
        if path.k_norm is not None:
            knorm = (
                f"{path.k_norm.text()} over {'each head' if path.k_norm_scope == 'head' else 'all heads together'}"
                if path.k_norm_scope != "latent"
                else f"{path.k_norm.text()} over the {path.rank}-dim key latent (kv_a_layernorm), then kv_b_proj"
            )
        return NormGainTrace(
            layer=self.layer,
            spike_dims=self.S,
            has_spike=has_spike,
            message=message,
            norm_kind=path.norm.kind,
            rotary=path.rotary,
            rotary_base=path.base,
            n_samples=N,
            T=self.T,
            stages=stage_table(kept, self.acc, self.Smask),
            gain=gain_table(path.norm.gain, self.S, kept),
            heads=head_table(kept, self._knorm_cols(kept), self.head, self.cnt, self.kv_of, self.layer, has_spike),
            constancy=constancy(kept),
            rebuild=self._rebuild(),
            gain_vector=path.norm.gain.clone(),
            first_normalised_mean=kept["n1"].mean(0),
            other_normalised_abs=(self.other_abs / float(self.acc["count_o"])).float(),
            first_resid_mean=kept["h1"].mean(0),
            key_dims=key_dims_table(kept, self.Smask),
            path_text=path.text(),
            key_norm=knorm,
            model_name=getattr(self.model, "model_name", None),
            kind=self.kind,
        )

    def _knorm_cols(self, kept: dict) -> dict:
        """Per KV head: the key norm's scale on the first key and on ordinary keys, its gain along the spike part
        of k_1 and its RMS gain (NaN without a key norm)."""
        p, Hkv = self.path, self.path.W_K.shape[0]
        nan = torch.full((Hkv,), float("nan"))
        if p.k_norm is None:
            return {
                "knorm_scale_first": nan,
                "knorm_scale_other": nan,
                "knorm_gain_spike": nan,
                "knorm_gain_rms": nan,
                "kproj_share_spike": nan,
            }
        g = p.key_norm_gain()
        kp1, kp1S = kept["kp1"], kept["kp1S"]
        return {
            "knorm_scale_first": kept["knorm_first"].mean(0),
            "knorm_scale_other": (self.knorm_other / float(self.acc["count_o"])).float(),
            "knorm_gain_spike": kept["knorm_spike"].mean(0) if self.S else nan,
            "knorm_gain_rms": g.pow(2).mean(-1).sqrt(),
            "kproj_share_spike": ((kp1 * kp1S).sum(-1) / kp1.pow(2).sum(-1).clamp_min(TINY)).mean(0) if self.S else nan,
        }

    def _rebuild(self) -> dict:
        a, spec = self.acc, self.spec
        return {
            "key_hook": self.path.key_hook,
            "key_max_abs_err": self.err["k_max"],
            "key_rel_err": float(a["k_err"] / a["k_ref"].clamp_min(TINY)),
            "final_key_hook": self.path.final_key_hook,
            "final_key_max_abs_err": self.err["final"],
            "rotated_key_max_abs_err": self.err["final"] if spec.key_rotated else None,
            "normalised_rel_err": float(a["n_err"] / a["n_ref"]) if self.has_norm_hook else None,
            "score_max_abs_err": self.err["score"],
            "pattern_max_abs_err": self.err["pattern"],
            "attn_scale": spec.attn_scale,
            "attn_softcap": spec.attn_softcap,
        }


def _first_share(v: torch.Tensor, Smask: torch.Tensor) -> float:
    """The first tokens' share of |v|^2 in the spike dims, mean over samples (NaN without spike dims)."""
    if not Smask.any():
        return float("nan")
    sq = v.pow(2)
    return float((sq[:, Smask].sum(-1) / sq.sum(-1).clamp_min(TINY)).mean())


def _part_share(full: torch.Tensor, part: torch.Tensor) -> float:
    """Mean share (part . full) / |full|^2 over samples and heads."""
    return float(((full * part).sum(-1) / full.pow(2).sum(-1).clamp_min(TINY)).mean())


def stage_table(kept: dict, acc: dict, Smask: torch.Tensor) -> pd.DataFrame:
    """One row per stage of the key path (resid, normalised, gain, key): spike share and norm, first token against the
    others (the key before the key norm: ``heads.kproj_share_spike``).

    Parameters
    ----------
    kept : dict of str to torch.Tensor
        The first token's vectors kept by the pass (``h1``, ``n1``, ``x1``, ``k1``, ``k1S``: (N, ...)).
    acc : dict of str to torch.Tensor
        The ordinary tokens' running sums (shares, norms, ``count_o``).
    Smask : torch.Tensor, shape (D,)
        bool, the spike dims.

    Returns
    -------
    pandas.DataFrame
    """
    cnt, nan, has = float(acc["count_o"]), float("nan"), bool(Smask.any())
    rows = [
        {
            "stage": stage,
            "first_share": _first_share(kept[key], Smask),
            "other_share": float(acc[f"{o}_share_o"]) / cnt if has else nan,
            "first_norm": float(kept[key].norm(dim=-1).mean()),
            "other_norm": float(acc[f"{o}_norm_o"]) / cnt,
        }
        for stage, key, o in (("resid (h)", "h1", "h"), ("normalised", "n1", "n"), ("gain", "x1", "x"))
    ]
    rows.append(
        {
            "stage": "key",
            "first_share": _part_share(kept["k1"], kept["k1S"]) if has else nan,
            "other_share": nan,
            "first_norm": float(kept["k1"].norm(dim=-1).mean()),
            "other_norm": float(acc["k_norm_o"]) / cnt,
        }
    )
    return pd.DataFrame(rows)


def gain_table(g: torch.Tensor, S: list[int], kept: dict) -> pd.DataFrame:
    """The gain at each spike dim against the rest (median and mean |g|), its percentile, the first token there.

    Parameters
    ----------
    g : torch.Tensor, shape (D,)
        The gain.
    S : list of int
        The spike dims.
    kept : dict of str to torch.Tensor
        The first token's residual ``h1`` and normalised ``n1``, (N, D).

    Returns
    -------
    pandas.DataFrame
    """
    rest = torch.ones_like(g, dtype=torch.bool)
    rest[S] = False
    g_rest, nan = g[rest].abs(), float("nan")
    h1, n1 = kept["h1"], kept["n1"]
    return pd.DataFrame(
        {
            "dim": S + ["rest (median |g|)", "rest (mean |g|)"],
            "gain": [float(g[d]) for d in S] + [float(g_rest.median()), float(g_rest.mean())],
            "over_rest_median": [float(g[d].abs() / g_rest.median()) for d in S]
            + [1.0, float(g_rest.mean() / g_rest.median())],
            "percentile": [float((g_rest < g[d].abs()).float().mean() * 100) for d in S] + [50.0, nan],
            "first_token_h": [float(h1[:, d].mean()) for d in S] + [nan, nan],
            "first_token_n": [float(n1[:, d].mean()) for d in S] + [nan, nan],
        }
    )


def key_dims_table(kept: dict, Smask: torch.Tensor, *, n: int = 8) -> pd.DataFrame:
    """The residual dims with the largest share of the first key ((x_1[d] W_K[d] through the key norm) . k_1 / |k_1|^2,
    mean over inputs and KV heads; the shares of all dims and the bias sum to 1).

    Parameters
    ----------
    kept : dict of str to torch.Tensor
        ``dim_share`` (N, D) and ``x1`` (N, D).
    Smask : torch.Tensor, shape (D,)
        bool, the spike dims.
    n : int
        The number of dims listed.

    Returns
    -------
    pandas.DataFrame
    """
    share = kept["dim_share"].mean(0)  # (D,)
    top = share.abs().argsort(descending=True)[:n]
    return pd.DataFrame(
        {
            "dim": top.numpy(),
            "k1_share": share[top].numpy(),
            "spike_dim": Smask[top].numpy(),
            "first_token_x": kept["x1"][:, top].mean(0).numpy(),
        }
    )


def head_table(
    kept: dict, knorm: dict, hd: dict, cnt: dict, kv_of: torch.Tensor, layer: int, has_spike: bool
) -> pd.DataFrame:
    """One row per query head: |k_1|, its spike part, logits and alpha_1 with the full, spike-only and spike-free key,
    and the key norm's scales and gains (its KV head's).

    Parameters
    ----------
    kept : dict of str to torch.Tensor
        ``k1`` and ``k1S``, (N, H_kv, d_head).
    knorm : dict of str to torch.Tensor
        The key norm's columns per KV head, (H_kv,).
    hd : dict of str to torch.Tensor
        Per query head running sums (logits, alpha), (H,).
    cnt : dict of str to int
        Query counts (``"q"``: first-key queries, ``"o"``: others).
    kv_of : torch.Tensor, shape (H,)
        The KV head of each query head.
    layer : int
    has_spike : bool
        Without spike dims the spike columns are NaN.

    Returns
    -------
    pandas.DataFrame
    """
    k1h, k1Sh = kept["k1"][:, kv_of], kept["k1S"][:, kv_of]  # (N,H,dh)
    N, nan = k1h.shape[0], float("nan")
    cq, co = max(cnt["q"], 1), max(cnt["o"], 1)
    lf, ls = hd["logit_first"] / cq, hd["logit_spike"] / cq
    spike = lambda v: v.numpy() if has_spike else nan  # noqa: E731
    return pd.DataFrame(
        {
            "layer": layer,
            "head": range(len(kv_of)),
            "kv_head": kv_of.numpy(),
            "k1_norm": k1h.norm(dim=-1).mean(0).numpy(),
            "k1_spike_norm": k1Sh.norm(dim=-1).mean(0).numpy(),
            "cos_k1_spike": spike(torch.nn.functional.cosine_similarity(k1h, k1Sh, dim=-1).mean(0)),
            "k1_share_spike": spike(((k1h * k1Sh).sum(-1) / k1h.pow(2).sum(-1).clamp_min(TINY)).mean(0)),
            "logit_first": lf.numpy(),
            "logit_first_spike": spike(ls),
            "logit_first_rest": (hd["logit_rest"] / cq).numpy(),
            "logit_other": (hd["logit_other"] / co).numpy(),
            "logit_share_spike": spike(ls / lf),
            "alpha_1": (hd["alpha"] / N).numpy(),
            "alpha_1_spike_only": spike(hd["alpha_spike"] / N),
            "alpha_1_no_spike": spike(hd["alpha_rest"] / N),
            **{k: v.float()[kv_of].numpy() for k, v in knorm.items()},
        }
    )


def constancy(kept: dict) -> dict:
    """How constant the first token's vectors are across inputs (mean pairwise cosine), against ordinary tokens.

    Parameters
    ----------
    kept : dict of str to torch.Tensor
        The first token's ``h1``, ``n1``, ``x1`` (N, D) and ``k1`` (N, H_kv, d_head); ordinary tokens' ``n_o`` and
        their sequence ``g_o``.

    Returns
    -------
    dict
        ``cos_first_resid``, ``cos_first_normalised``, ``cos_first_gain``, ``cos_first_key`` (per KV head),
        ``cos_other_normalised``, ``cos_first_other_normalised``.
    """
    n1, n_o, k1 = kept["n1"], kept["n_o"], kept["k1"]
    return {
        "cos_first_resid": mean_pairwise_cosine(kept["h1"]),
        "cos_first_normalised": mean_pairwise_cosine(n1),
        "cos_first_gain": mean_pairwise_cosine(kept["x1"]),
        "cos_first_key": [mean_pairwise_cosine(k1[:, j]) for j in range(k1.shape[1])],
        "cos_other_normalised": mean_pairwise_cosine(n_o, groups=kept["g_o"]),
        "cos_first_other_normalised": float(
            torch.nn.functional.cosine_similarity(n1.mean(0, keepdim=True), n_o).mean()
        ),
    }


def _spike_message(model, layer: int, S: list[int], found: bool, abs_threshold, ratio_threshold, min_share) -> str:
    if S:
        return f"{'found' if found else 'given'} spike dims {S} on the first token of the residual stream layer {layer} reads."
    name = getattr(model, "model_name", None) or "the model"
    return (
        f"The first token carries no spike in the residual stream layer {layer} of {name} reads: no dimension "
        f"passes {criterion_text(abs_threshold, ratio_threshold)} on {min_share:.0%} of samples. Spike shares and "
        "the spike-only key are not defined; try another "
        "layer (see analysis.chain.massive), lower thresholds, or pass spike_dims."
    )


def trace_layers(first_token_dims: dict[int, list[int]], dim: int, *, max_runs: int = 2) -> list[int]:
    """The middle layer of each of the first runs of layers whose input carries a dim on the first token.

    Parameters
    ----------
    first_token_dims : dict of int to list of int
        ``first_token_dims`` of ``massive_activations(..., hook="resid_pre")``.
    dim : int
        The spike dim.
    max_runs : int
        Runs of layers considered.

    Returns
    -------
    list of int
    """
    with_dim = [l for l, ds in first_token_dims.items() if dim in ds]
    return [r[len(r) // 2] for r in runs(with_dim)[:max_runs]]


def choose_layer(
    sink, first_token_dims: dict[int, list[int]] | None, n_layers: int, *, attention_layers: Sequence[int] | None = None
) -> int:
    """The sinkiest attention layer whose input carries the first token's spike, else the sinkiest attention layer.

    Parameters
    ----------
    sink : SinkResult or None
        Ranks the layers (None: the first reading layer).
    first_token_dims : dict of int to list of int, or None
        The first token's spike dims in ``hook_resid_post`` of each layer (block l reads that of l - 1).
    n_layers : int
        L.
    attention_layers : sequence of int, optional
        The layers with an attention pattern (default: all ``n_layers``; hybrids: ``model.family.attention_layers``).

    Returns
    -------
    int
    """
    attn = list(range(n_layers)) if attention_layers is None else [int(l) for l in attention_layers]
    reading = sorted({l + 1 for l in (first_token_dims or {}) if l + 1 in attn})
    if sink is None:
        return reading[0] if reading else attn[0]
    per_layer = sink.per_layer(1)
    per_layer = per_layer[per_layer.layer.isin(attn)]
    pool = per_layer[per_layer.layer.isin(reading)] if reading else per_layer
    return int(pool.sort_values(["sink_1_pct", "mean_alpha_1"], kind="stable").iloc[-1].layer)


def norm_gain_accumulator(
    model: SinkModel,
    tokens,
    layer: int,
    *,
    spike_dims=None,
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    min_share: float = SPIKE_MIN_SHARE,
    n_other: int = 4,
    kind: str | None = None,
) -> tuple[NormGainAccumulator, str]:
    """Check the arguments of :func:`norm_gain_trace` and find the spike dims if not given.

    Parameters
    ----------
    model, tokens, layer, spike_dims, abs_threshold, ratio_threshold, min_share, n_other, kind
        As in :func:`norm_gain_trace`.

    Returns
    -------
    accumulator : NormGainAccumulator
    message : str
        Whether the spike dims were found or given, or why there are none.
    """
    tokens = check_tokens(model, tokens)
    (layer,) = check_layers(model, [layer])
    if tokens.shape[1] < 2:
        raise ValueError("norm-gain tracing needs T >= 2 tokens (the first token and at least one ordinary token).")
    path = key_path(model, layer)
    found = spike_dims is None
    if found:
        spike_dims = first_token_spike_dims(
            model,
            tokens,
            hook="resid_pre",
            layers=[layer],
            abs_threshold=abs_threshold,
            ratio_threshold=ratio_threshold,
            min_share=min_share,
        ).get(layer, [])
    S = check_dims(spike_dims, path.W_K.shape[1], name="spike_dims")
    message = _spike_message(model, layer, S, found, abs_threshold, ratio_threshold, min_share)
    if not S:
        warnings.warn(message, stacklevel=3)
    return NormGainAccumulator(model, path, S, tokens.shape[1], n_other=n_other, kind=kind), message


@share_parameters(norm_gain_accumulator)
def norm_gain_trace(
    model: SinkModel,
    tokens,
    layer: int,
    *,
    spike_dims: Sequence[int] | None = None,
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    min_share: float = SPIKE_MIN_SHARE,
    n_other: int = 4,
    batch_size: int | None = None,
    kind: str | None = None,
    resid: dict | None = None,
) -> NormGainTrace:
    """Trace the first token's spike through the key path of an attention layer: its input norm and gain, W_K, the key
    norm and the rotary, as the family computes them (``KeyPath.text()``).

    The pass stops after the layer.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    tokens : torch.Tensor, shape (N, T)
        Token ids, T >= 2.
    layer : int
        The attention layer.
    spike_dims : sequence of int, optional
        Residual dims to trace; None finds the first token's spike dims in the stream the layer reads
        (``massive_activations`` on ``hook_resid_pre`` with ``abs_threshold``, ``ratio_threshold`` and ``min_share``).
        If the first token carries no spike, the trace still runs (norms, rebuild check, constancy) and ``has_spike`` is
        False with a plain ``message``.
    abs_threshold, ratio_threshold, min_share : float
        The spike criterion (see ``analysis.massive_activations``).
    n_other : int
        Ordinary tokens per sequence kept for the cross-input cosine.
    batch_size : int, optional
        Sequences per batch (default: ``analysis.engine.passes.default_batch_size``).
    kind : str, optional
        The input kind, a label ("natural", "random").
    resid : dict of int to torch.Tensor, optional
        {block: the residual entering it, (N, T, D)} kept by a pass over the same tokens and batches
        (``Profile.resid``): the pass then starts at the last kept block at or before ``layer`` instead of at the
        embedding.

    Returns
    -------
    NormGainTrace
    """
    tokens = check_tokens(model, tokens)
    acc, message = norm_gain_accumulator(
        model,
        tokens,
        layer,
        spike_dims=spike_dims,
        abs_threshold=abs_threshold,
        ratio_threshold=ratio_threshold,
        min_share=min_share,
        n_other=n_other,
        kind=kind,
    )
    run_pass(
        model, tokens, [acc], batch_size=batch_size, resume=resume_from(resid, acc.layer) if can_resume(model) else None
    )
    return acc.result(message)


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, Section, register  # noqa: E402


register(
    Analysis(
        "norm_gain",
        result=NormGainTrace,
        order=200,
        doc="The norm-gain trace of one sink layer (its own pass).",
        sections=(
            Section(
                "Norm gain: from the spike to the first key",
                "norm",
                50,
                needs=("sink", "massive", "resid"),
                runner="analysis.report.sections:_norm_gain",
            ),
        ),
        exports=("norm_gain_trace",),
    )
)
