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
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import pandas as pd
import torch

from analysis.model.contract import ModelContractError, SinkModel
from analysis.core.defaults import SPIKE_ABS, SPIKE_MIN_SHARE, SPIKE_RATIO, TINY
from analysis.model.families import sink_logits
from analysis.model.hooks import act_name, check_dims, check_layers, check_tokens, hook_names, kv_view, model_dims
from analysis.model.key_path import KeyPath, key_path
from analysis.chain.massive import criterion_text, first_token_spike_dims
from analysis.engine.attention import attention_of
from analysis.engine.passes import Accumulator, Batch, Reduction, can_resume, resume_from, run_pass
from analysis.model.nnsight_model import TraceWeight, weights_in_trace
from analysis.core.results import Result, pass_options, runs
from analysis.core.docs import model_tokens_min2, parameters_from, share_parameters
from analysis.model.rotary import rotate_as_spec
from analysis.core.stats import mean_pairwise_cosine

# ----------------------------------------------------------------------------- Scores from the rebuilt keys


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
    p = _with_sink(s.masked_fill(future, float("-inf")), sink).softmax(-1)[..., :T]
    return p[..., 0].mean(-1)  # every query sees key 1 (unless a sliding window hides it): mean over all T queries


def _with_sink(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """``scores`` (B,H,T,T) with the learned sink logit per head (H,) as an extra last column, where there is one."""
    if sink is None:
        return scores
    return torch.cat([scores, sink.to(scores).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)


def _causal_window(T: int, window: int | None) -> torch.Tensor:
    """Which keys each query sees: causal, and inside ``window`` where one is given.

    A bool tensor (T, T), [i, j]: query i sees key j."""
    seen = torch.ones(T, T, dtype=torch.bool).tril()
    if window:
        seen &= ~torch.ones(T, T, dtype=torch.bool).tril(-int(window))
    return seen


# ----------------------------------------------------------------------------- The trace


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
        g, S = self.gain_vector.abs(), self.spike_dims
        rest = _rest(g, S)
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
        return self.message if not self.has_spike else " ".join(self._spike_key())

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
    call_keys = frozenset({"scores"})  # a call's q, k and mask give them (``_call_scores``)

    def __init__(self, model, path: KeyPath, S: list[int], T: int, *, n_other: int = 4, kind: str | None = None):
        self.model, self.path, self.S, self.kind, self.H = model, path, S, kind, model_dims(model).n_heads
        self.spec, self.layer, D, self.T = path.spec, path.layer, path.W_K.shape[1], int(T)
        self.Smask = torch.zeros(D, dtype=torch.bool)
        self.Smask[S] = True
        self.kv_of = torch.arange(self.H) // path.group
        self.other_pos = torch.unique(torch.linspace(1, T - 1, max(1, min(n_other, T - 1))).round().long())
        self.has_norm_hook = (
            path.norm.kind != "none"
            and not weights_in_trace(model)
            and act_name("normalized", self.layer) in hook_names(model)
        )
        read = (lambda _, layer: TraceWeight("sinks", layer)) if weights_in_trace(model) else sink_logits  # in a trace
        self.sink = read(model, self.layer) if self.spec.learned_sinks else None
        # running sums (float64), each started at zero by its first update
        self.acc = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        self.keep = defaultdict(list)  # the first token's vectors (and a few ordinary ones), one per sample
        self.err = {"k_max": 0.0, "final": 0.0, "final_ref": 0.0, "score": None, "pattern": 0.0}
        self.gain, self.key_gain = path.norm.gain, path.key_norm_gain()  # the folded reductions' (read in the trace)

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

    def reduction(self, layer: int) -> Reduction:
        spec, p = self.spec, self.path
        window = spec.sliding_window if spec.sliding_window and layer in spec.sliding_layers else None
        return Reduction(
            norm_gain_stats,
            {
                "path": p.in_trace() if weights_in_trace(self.model) else p,
                "spike": self.Smask,
                "other_pos": self.other_pos,
                "kv_of": self.kv_of,
                "scale": spec.attn_scale,
                "cap": spec.attn_softcap,
                "window": window,
                "sink": self.sink,
            },
        )

    def update(self, layer: int, acts: dict, batch: Batch) -> None:
        """The reduction on the hooks' queries and keys as the attention uses them (rotated here where the hooks hold
        them before the rotary: a remote trace reads them after it)."""
        pos = torch.arange(acts["h"].shape[1], device=acts["h"].device)
        rot = {k: rotate_as_spec(acts[k].detach(), self.spec, layer, positions=pos) for k in ("q", "kf")}
        self.fold(layer, self.reduction(layer)({**acts, **rot}), batch)

    def fold(self, layer: int, r: dict, batch: Batch) -> None:
        for k, v in r["sum"].items():
            self.acc[k] = self.acc[k] + v.double().cpu()  # scalars, and vectors (per dim, KV head or query head)
        for k, v in r["keep"].items():
            self.keep[k].append(v.detach().float().cpu())
        for k, v in r["max"].items():
            self.err[k] = float(v) if self.err[k] is None else max(self.err[k], float(v))
        self.gain, self.key_gain = r["gain"].float().cpu(), r.get("key_gain")
        B = r["keep"]["h1"].shape[0]
        self.keep["g_o"].append((torch.arange(B) + batch.offset).repeat_interleave(len(self.other_pos)))

    def result(self, message: str = "") -> NormGainTrace:
        kept = {k: torch.cat(v) for k, v in self.keep.items()}
        path, err, ref = self.path, self.err["final"], self.err["final_ref"]
        if err > 0.05 * ref:  # SmolLM2: 6e-7 (float32), 0.005-0.008 (bf16); a step missed: about 1, every share wrong
            raise ModelContractError(
                f"{path.text()} It rebuilds the keys the attention uses ({path.final_key_hook}) only to {err:.3g} of "
                f"entries up to {ref:.3g}: it misses a step of this model's keys, and every share would be wrong."
            )
        return NormGainTrace(
            layer=self.layer,
            spike_dims=self.S,
            has_spike=bool(self.S),
            message=message,
            norm_kind=path.norm.kind,
            rotary=path.rotary,
            rotary_base=path.base,
            n_samples=kept["h1"].shape[0],
            T=self.T,
            stages=self._stage_table(kept),
            gain=self._gain_table(kept),
            heads=self._head_table(kept),
            constancy=constancy(kept),
            rebuild=self._rebuild(),
            gain_vector=self.gain.clone(),
            first_normalised_mean=kept["n1"].mean(0),
            other_normalised_abs=(self.acc["other_abs"] / float(self.acc["count_o"])).float(),
            first_resid_mean=kept["h1"].mean(0),
            key_dims=self._key_dims_table(kept),
            path_text=path.text(),
            key_norm=path.key_norm_text(),
            model_name=getattr(self.model, "model_name", None),
            kind=self.kind,
        )

    def _knorm_cols(self, kept: dict) -> dict:
        """Per KV head: the key norm's scale on the first key and on ordinary keys, its gain along the spike part
        of k_1 and its RMS gain (NaN without a key norm)."""
        p, Hkv = self.path, self.path.W_K.shape[0]
        nan = torch.full((Hkv,), float("nan"))
        if p.k_norm is None:
            return dict.fromkeys(
                ("knorm_scale_first", "knorm_scale_other", "knorm_gain_spike", "knorm_gain_rms", "kproj_share_spike"),
                nan,
            )
        g = self.key_gain
        return {
            "knorm_scale_first": kept["knorm_first"].mean(0),
            "knorm_scale_other": (self.acc["knorm_other"] / float(self.acc["count_o"])).float(),
            "knorm_gain_spike": kept["knorm_spike"].mean(0) if self.S else nan,
            "knorm_gain_rms": g.pow(2).mean(-1).sqrt(),
            "kproj_share_spike": _part_share(kept["kp1"], kept["kp1S"]).mean(0) if self.S else nan,
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

    # The result's tables, from ``kept`` (``result``: the first token's vectors h1, n1, x1 (N, D), k1, k1S, kp1, kp1S
    # (N, H_kv, d_head), the residual dims' shares of k1 ``dim_share`` (N, D), ordinary tokens' n_o and their sequence
    # g_o) and the running sums.

    def _stage_table(self, kept: dict) -> pd.DataFrame:
        """One row per stage of the key path (resid, normalised, gain, key): spike share and norm, first token against
        the others (the key before the key norm: ``heads.kproj_share_spike``)."""
        acc, Smask = self.acc, self.Smask
        cnt, nan, has = float(acc["count_o"]), float("nan"), bool(Smask.any())
        rows = [
            {
                "stage": stage,
                "first_share": float(_spike_share(kept[key], Smask).mean()) if has else nan,
                "other_share": float(acc[f"{o}_share_o"]) / cnt if has else nan,
                "first_norm": float(kept[key].norm(dim=-1).mean()),
                "other_norm": float(acc[f"{o}_norm_o"]) / cnt,
            }
            for stage, key, o in (("resid (h)", "h1", "h"), ("normalised", "n1", "n"), ("gain", "x1", "x"))
        ]
        rows.append(
            {
                "stage": "key",
                "first_share": float(_part_share(kept["k1"], kept["k1S"]).mean()) if has else nan,
                "other_share": nan,
                "first_norm": float(kept["k1"].norm(dim=-1).mean()),
                "other_norm": float(acc["k_norm_o"]) / cnt,
            }
        )
        return pd.DataFrame(rows)

    def _gain_table(self, kept: dict) -> pd.DataFrame:
        """The gain at each spike dim against the rest (median and mean |g|), its percentile, the first token there."""
        g, S = self.gain, self.S
        g_rest, nan = g[_rest(g, S)].abs(), float("nan")
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

    def _key_dims_table(self, kept: dict, *, n: int = 8) -> pd.DataFrame:
        """The ``n`` residual dims with the largest share of the first key ((x_1[d] W_K[d] through the key norm) . k_1
        / |k_1|^2, mean over inputs and KV heads; the shares of all dims and the bias sum to 1)."""
        share = kept["dim_share"].mean(0)  # (D,)
        top = share.abs().argsort(descending=True)[:n]
        return pd.DataFrame(
            {
                "dim": top.numpy(),
                "k1_share": share[top].numpy(),
                "spike_dim": self.Smask[top].numpy(),
                "first_token_x": kept["x1"][:, top].mean(0).numpy(),
            }
        )

    def _head_table(self, kept: dict) -> pd.DataFrame:
        """One row per query head: |k_1|, its spike part, logits and alpha_1 with the full, spike-only and spike-free
        key, and the key norm's scales and gains (its KV head's); without spike dims the spike columns are NaN."""
        kv_of, hd = self.kv_of, self.acc
        k1h, k1Sh = kept["k1"][:, kv_of], kept["k1S"][:, kv_of]  # (N,H,dh)
        N, nan = k1h.shape[0], float("nan")
        cq, co = max(int(self.acc["count_q"]), 1), max(int(self.acc["count_k"]), 1)
        lf, ls = hd["logit_first"] / cq, hd["logit_spike"] / cq
        spike = lambda v: v.numpy() if self.S else nan  # noqa: E731
        return pd.DataFrame(
            {
                "layer": self.layer,
                "head": range(len(kv_of)),
                "kv_head": kv_of.numpy(),
                "k1_norm": k1h.norm(dim=-1).mean(0).numpy(),
                "k1_spike_norm": k1Sh.norm(dim=-1).mean(0).numpy(),
                "cos_k1_spike": spike(torch.nn.functional.cosine_similarity(k1h, k1Sh, dim=-1).mean(0)),
                "k1_share_spike": spike(_part_share(k1h, k1Sh).mean(0)),
                "logit_first": lf.numpy(),
                "logit_first_spike": spike(ls),
                "logit_first_rest": (hd["logit_rest"] / cq).numpy(),
                "logit_other": (hd["logit_other"] / co).numpy(),
                "logit_share_spike": spike(ls / lf),
                "alpha_1": (hd["alpha"] / N).numpy(),
                "alpha_1_spike_only": spike(hd["alpha_spike"] / N),
                "alpha_1_no_spike": spike(hd["alpha_rest"] / N),
                **{k: v.float()[kv_of].numpy() for k, v in self._knorm_cols(kept).items()},
            }
        )


def norm_gain_stats(acts: dict, *, path, spike, other_pos, kv_of, scale: float, cap, window, sink) -> dict:
    """One batch's reduce of the norm-gain trace at one layer (torch only, so that a remote trace ships it): the
    residual h rebuilt through ``path`` (the norm, its gain, W_K, the key norm) and checked against the model's key
    projection, keys and scores; the sums, maxima and first-token vectors the accumulator folds.

    Parameters
    ----------
    acts : dict
        {"h": the residual (B, T, D), "k": the key projection, "kf", "q": the keys and queries the attention uses
        (after the rotary), "pattern": the map or ``AttentionWeights``; optional "scores" (pre-softmax) and "n"}.
    path : KeyPath or KeyOps
        The key path (its weights read in the trace, remotely).
    spike : torch.Tensor, shape (D,)
        bool: the spike dims S.
    other_pos, kv_of : torch.Tensor
        Ordinary positions kept; each query head's KV head.
    scale, cap, window, sink
        The score scale, soft cap, sliding window (or None) and learned sink logits (or None).

    Returns
    -------
    dict
        "sum" (sums over the batch; per query head the logits and alpha_1), "keep" (per sequence), "max" (the
        rebuild errors), "gain",
        "key_gain".
    """
    h = acts["h"].detach().float()
    n = path.norm.normalise(h)
    x = path.norm.affine(n)
    r = _residual_stats(h, n, x, spike, other_pos)
    if "n" in acts:
        r["sum"].update(n_err=(acts["n"].float() - n).abs().max(), n_ref=n.abs().max())
    kp, k = path.project(x), path.projection_heads(acts["k"].detach()).float()
    err = (kp - k).abs().max()
    r["sum"].update(k_err=err, k_ref=k.abs().max())
    used = kv_view(acts["kf"].detach().float(), kp.shape[2])  # (B,T,Hkv,d)
    pos = torch.arange(h.shape[1], device=h.device)
    final = (path.rotate(path.key_norm(kp), pos) - used).abs().max()
    r["max"] = {"k_max": err, "final": final, "final_ref": used.abs().max()}
    k1S = _first_key_stats(r, path, x, kp, used, spike)
    _score_stats(r, acts, used, k1S, kv_of, scale, cap, window, sink)
    r.update(gain=path.norm.gain, key_gain=path.key_norm_gain())
    return r


def _residual_stats(h, n, x, spike, other_pos) -> dict:
    """Shares and norms of ordinary tokens (summed); the first token's vectors (kept, one per sample)."""
    out = {"sum": {"count_o": torch.tensor(h.shape[0] * (h.shape[1] - 1))}}
    for key, v in (("h", h[:, 1:]), ("n", n[:, 1:]), ("x", x[:, 1:])):
        out["sum"][f"{key}_share_o"] = _spike_share(v, spike).double().sum()
        out["sum"][f"{key}_norm_o"] = v.norm(dim=-1).double().sum()
    out["sum"]["other_abs"] = n[:, 1:].abs().double().sum(dim=(0, 1))
    pos = other_pos.to(h.device)
    out["keep"] = {"h1": h[:, 0], "n1": n[:, 0], "x1": x[:, 0], "n_o": n[:, pos].reshape(-1, h.shape[-1])}
    return out


def _first_key_stats(r: dict, path, x, kp, used, spike) -> torch.Tensor:
    """Into ``r``: k_1 (as the attention uses it), its spike part k_1^S (x_1[S] W_K through the key norm's linear
    part at k_1's scale), the key norm's scales, and each residual dim's share of k_1; return k_1^S (B,Hkv,d)."""
    kpS = path.project(x[:, :1] * spike.to(x.device), bias=False)  # (B,1,Hkv,d)
    k1S = path.key_norm_part(kpS, kp[:, :1])[:, 0]  # position 0: the rotary is the identity
    k1 = used[:, 0]
    sq = k1.pow(2).sum(-1).clamp_min(TINY)  # (B,Hkv)
    v = path.key_norm_adjoint(k1[:, None], kp[:, :1])[:, 0]  # (B,Hkv,d)
    share = x[:, 0, None, :] * torch.einsum("hde,bhe->bhd", path.W_K.to(x.device, torch.float32), v) / sq[..., None]
    scale = path.key_norm_scale(kp)  # (B,T,Hkv)
    r["sum"]["knorm_other"] = scale[:, 1:].double().sum((0, 1))
    spike_gain = k1S.norm(dim=-1) / (kpS[:, 0].norm(dim=-1) * scale[:, 0]).clamp_min(TINY)
    r["sum"]["k_norm_o"] = used[:, 1:].norm(dim=-1).mean(-1).double().sum()
    r["keep"].update(k1=k1, k1S=k1S, kp1=kp[:, 0], kp1S=kpS[:, 0], dim_share=share.mean(1))
    r["keep"].update(knorm_first=scale[:, 0], knorm_spike=spike_gain)
    return k1S


def _score_stats(r: dict, acts: dict, used, k1S, kv_of, scale, cap, window, sink) -> None:
    """Into ``r``: first-key logits (checked against the model's scores and pattern) and alpha_1 with k_1, k_1^S or
    k_1 - k_1^S; scores as the softmax sees them: the model's (the scores hook, with ALiBi and masks, or an attention
    call's), or rebuilt from q and k."""
    q, sc, hd = acts["q"].detach().float(), acts.get("scores"), r["sum"]
    sc = _call_scores(acts["pattern"]) if sc is None else sc
    B, T = q.shape[:2]
    kv = kv_of.to(q.device)
    raw = torch.einsum("bqhd,bkhd->bhqk", q, used[:, :, kv]) * scale  # (B,H,T,T)
    vis = _causal_window(T, window).to(q.device)
    capped = softcap(raw, cap)
    if sc is None:
        sc = capped.masked_fill(~vis, float("-inf"))
    else:
        sc = sc.detach().float()
        r["max"]["score"] = (sc[..., 0] - capped[..., 0])[..., vis[:, 0]].abs().max()
    lf, ls = raw[..., 0], torch.einsum("bthd,bhd->bht", q, k1S[:, kv]) * scale
    first = vis[:, 0].clone()
    first[0] = False  # queries t > 1 that see key 1
    for key, v in (("logit_first", lf), ("logit_spike", ls), ("logit_rest", lf - ls)):
        hd[key] = v[..., first].double().sum(dim=(0, 2))
    tri = vis.clone()
    tri[:, 0] = False  # keys j > 1 and the queries that see them
    hd["logit_other"] = raw[..., tri].double().sum(dim=(0, 2))
    hd.update(count_q=torch.tensor(B * int(first.sum())), count_k=torch.tensor(B * int(tri.sum())))
    off = sc[..., 0] - capped[..., 0]  # what the scores add to q . k (ALiBi, masks); 0 when rebuilt
    for key, c in (
        ("alpha", sc[..., 0]),
        ("alpha_spike", softcap(ls, cap) + off),
        ("alpha_rest", softcap(lf - ls, cap) + off),
    ):
        hd[key] = _softmax_alpha(sc, c, sink).double().sum(0)
    pattern = attention_of(acts["pattern"]).dense()
    r["max"]["pattern"] = (_with_sink(sc, sink).softmax(-1)[..., :T] - pattern).abs().max()


def _call_scores(pattern):
    """The pre-softmax scores of an attention call (``AttentionWeights`` from its q, k, scale, soft cap and mask;
    hidden entries -inf), or None for a map."""
    q, k = getattr(pattern, "query", None), getattr(pattern, "key", None)
    if q is None:
        return None
    sc = softcap(
        q.float() @ k.float().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * pattern.scale,
        pattern.softcap,
    )
    seen = _causal_window(sc.shape[-1], None).to(sc.device)
    return sc.masked_fill(~(seen if pattern.mask is None else seen & pattern.mask), float("-inf"))


def _rest(g: torch.Tensor, S: list[int]) -> torch.Tensor:
    """The dims of ``g`` (D,) outside the spike dims ``S``: a bool mask (D,)."""
    rest = torch.ones_like(g, dtype=torch.bool)
    rest[S] = False
    return rest


def _spike_share(v: torch.Tensor, Smask: torch.Tensor) -> torch.Tensor:
    """Each vector's share of |v|^2 in the spike dims: v (..., D) -> (...)."""
    sq = v.pow(2)
    return sq[..., Smask].sum(-1) / sq.sum(-1).clamp_min(TINY)


def _part_share(full: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """The share (part . full) / |full|^2 of each vector along the last dim."""
    return (full * part).sum(-1) / full.pow(2).sum(-1).clamp_min(TINY)


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
@parameters_from(pass_options)
@parameters_from(model_tokens_min2)
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
    model, tokens
        As in :func:`model_tokens_min2`.
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
    batch_size, kind
        As in :func:`pass_options`.
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
