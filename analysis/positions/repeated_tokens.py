"""One token repeated t times: the propositions of Gu et al. (ICLR 2025, appendix) measured on a model.

With t copies of one token and a positional encoding that enters only the attention logits (NoPE, ALiBi, relative
bias, rotary), every position has the same hidden state at every layer (by induction: equal values give an equal
attention output whatever the weights). The last query's attention row then has a closed form, computed here from the
model's own weights:

- NoPE (Proposition 1): A_{t,i} = 1 / t, no sink;
- relative PE (Proposition 2): A_{t,i} = softmax_i(b_h(t - i)), the learned bias by distance alone;
- ALiBi (Proposition 3): A_{t,i} = softmax_i(-m_h (t - i)), the head's slope times distance alone;
- rotary: every weight is at most e^{2 xi} / (e^{2 xi} + t - 1), xi = |q| |k| / sqrt(d_head) of the head.

Absolute encodings (learned, sinusoidal) add a different vector at each position, so the premise fails and no closed
form applies: only the measurement is given.

One pass over N sequences of T tokens (each one token repeated) gives, per attention layer: the largest deviation of
the hidden state across positions (``hook_resid_pre`` and ``hook_resid_post``), the first column of every head's
attention (query i sees t = i + 1 copies, so the column is the first token's attention against t = 1..T) and the last
row, the query and key norms of the last position; reduced inside the hooks (O(L x H x T) numbers a sequence).
Sink_1 is Gu et al.'s: alpha_1 = the mean over queries of the first column, > eps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd
import torch

from analysis.model.access import (
    attention_logit_scale,
    attention_operation,
    layer_position_module,
    positional_encoding_name,
)
from analysis.model.contract import SinkModel
from analysis.core.defaults import REPEATED_TOL, SINK_EPS
from analysis.core.io import jsonable
from analysis.core.results import LayerAxis, Result, compact_repr
from analysis.engine.attention import attention_of
from analysis.engine.passes import Accumulator, Batch, LayerCollector, run_pass
from analysis.model.families import rotary_base
from analysis.model.hooks import act_name, check_attention_layers, kv_view, model_dims, per_query_head, qk_hook_names
from analysis.sinks.metric import check_eps

ENCODINGS = ("rotary", "none", "alibi", "relative", "learned", "sinusoidal")
_TL_NAMES = {"standard": "learned", "shortformer": "learned"}  # TransformerLens names of absolute PE
CLOSED_FORMS = {
    "none": "1 / t (Proposition 1)",
    "relative": "softmax of the learned bias by distance (Proposition 2)",
    "alibi": "softmax of the head's slope times distance (Proposition 3)",
    "rotary": "the bound e^{2 xi} / (e^{2 xi} + t - 1), xi = |q||k| / sqrt(d_head)",
}


def check_repeated(tokens) -> torch.Tensor:
    """(N, T) token ids, each row one token repeated, T >= 2; a clear error otherwise.

    Parameters
    ----------
    tokens : torch.Tensor, shape (N, T) or (T,)

    Returns
    -------
    torch.Tensor, shape (N, T)
    """
    tokens = torch.as_tensor(tokens)
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    if tokens.ndim != 2 or tokens.shape[-1] < 2:
        raise ValueError(f"give token ids of shape (N, T) with T >= 2; got shape {tuple(tokens.shape)}.")
    bad = (tokens != tokens[:, :1]).any(-1)
    if bad.any():
        raise ValueError(
            f"each row must be one token repeated (rows {bad.nonzero().flatten().tolist()[:5]} are not): "
            "build them with analysis.model.probes.repeated_probe or torch.full((N, T), token_id)."
        )
    return tokens


class RepeatedAccumulator(Accumulator):
    """Per attention layer and batch: the hidden state's largest deviation across positions (in and out), the first
    column and last row of every head's attention, and the last position's query and key norms."""

    __repr__ = compact_repr  # shapes, never tensor values

    def __init__(self, model, layers):
        dims = model_dims(model)
        self.H, self.H_kv, self.layers = dims.n_heads, dims.n_kv_heads, list(layers)
        self.qk = {l: qk_hook_names(model, l) for l in self.layers}
        self.out = {
            k: LayerCollector(self.layers)
            for k in ("dev_in", "dev_out", "scale", "scale_out", "first", "last", "qn", "kn")
        }

    def hooks(self):
        return {
            l: {
                "resid_in": act_name("resid_pre", l),
                "resid_out": act_name("resid_post", l),
                "pattern": act_name("pattern", l),
                "q": self.qk[l][0],
                "k": self.qk[l][1],
            }
            for l in self.layers
        }

    def update(self, layer: int, acts: dict, batch: Batch) -> None:
        put = {k: c.put for k, c in self.out.items()}
        for key, dev, scale in (("resid_in", "dev_in", "scale"), ("resid_out", "dev_out", "scale_out")):
            x = acts[key].float()
            put[dev](layer, (x - x[:, :1]).abs().amax((1, 2)))  # (B,)
            put[scale](layer, x[:, 0].abs().amax(-1))
        A = attention_of(acts["pattern"])  # (B, H, T, T) as the map or q, k and the lse
        put["first"](layer, A.column(0))  # (B, H, T): the first token's weight from query i (t = i + 1)
        put["last"](layer, A.row(-1))  # (B, H, T): the last query's row
        put["qn"](layer, acts["q"][:, -1].float().norm(dim=-1))  # (B, H)
        k = kv_view(acts["k"][:, -1:], self.H_kv)[:, 0].float().norm(dim=-1)  # (B, H_kv)
        put["kn"](layer, per_query_head(k, self.H, dim=1))

    def end_batch(self, batch: Batch, logits) -> None:
        for c in self.out.values():
            c.end_batch()

    def result(self) -> dict[str, torch.Tensor]:
        return {k: c.result() for k, c in self.out.items()}


def _softmax_rows(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bias (H, T) by distance d = 0..T-1 -> (first (H, T): the first token's weight for t = 1..T, i.e.
    e^{b(t-1)} / sum_{d<t} e^{b(d)}; last (H, T): the row of t = T, key j weighted e^{b(T-1-j)} / sum)."""
    b = bias.double()
    return torch.exp(b - torch.logcumsumexp(b, dim=-1)), torch.softmax(b.flip(-1), dim=-1)


def _distance_bias(model: SinkModel, layer: int, encoding: str, T: int) -> tuple[torch.Tensor, str]:
    """The (H, T) logit bias by distance d = 0..T-1 of an ALiBi or relative layer, from the model's own module, and
    where it was read.

    A reference ALiBi model reads its own slopes; another ALiBi model gets Press et al.'s slopes (stated).
    """
    attn = layer_position_module(model, layer)
    d = torch.arange(T)
    with torch.no_grad():
        if encoding == "relative":
            return attn.relative(d.to(next(attn.relative.parameters()).device)).float().cpu(), "the learned bias"
        slopes = getattr(attn, "alibi_slopes", None)
        source = "the model's slopes"
        if slopes is None:
            # lazy for import time: the reference package loads transformer_lens, needed only here
            from analysis.model.reference.positions import alibi_slopes

            slopes, source = alibi_slopes(model_dims(model).n_heads), "Press et al.'s slopes (the model holds none)"
        return -slopes.float().cpu()[:, None] * d[None].float(), source


def _closed_forms(
    model: SinkModel, layers, encoding: str, T: int, xi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The propositions' closed forms of the first token's weight against t and of the last row, per layer and head.

    ``xi`` (N, L, H) is |q||k| / sqrt(d_head) of the last position (used by rotary). Returns first and last (N, L, H, T)
    in float64 (NaN where no closed form applies; for rotary the upper bound, the same for every key of a row), and
    where the bias was read.
    """
    N, L, H = xi.shape
    t = torch.arange(1, T + 1, dtype=torch.float64)
    nan = torch.full((N, L, H, T), math.nan, dtype=torch.float64)
    if encoding == "none":
        return (1 / t).expand(N, L, H, T).clone(), torch.full((N, L, H, T), 1 / T, dtype=torch.float64), ""
    if encoding == "rotary":
        e = torch.exp(2 * xi.double())[..., None]
        return e / (e + t - 1), (e / (e + T - 1)).expand(N, L, H, T).clone(), "q and k norms"
    if encoding in ("alibi", "relative"):
        pairs = [_distance_bias(model, l, encoding, T) for l in layers]
        forms = [_softmax_rows(b) for b, _ in pairs]
        first = torch.stack([f for f, _ in forms])[None].expand(N, L, H, T).clone()
        last = torch.stack([r for _, r in forms])[None].expand(N, L, H, T).clone()
        return first, last, pairs[0][1]
    return nan, nan.clone(), ""


@dataclass
class RepeatedTokens(Result, LayerAxis):
    """The propositions on t repeated tokens, measured.

    Attributes
    ----------
    encoding : str
        The model's positional encoding (``ENCODINGS`` or "unknown").
    dev_in, dev_out : torch.Tensor, shape (N, L)
        max over positions and dims of |h_i - h_0| at the layer's input (``hook_resid_pre``) and output.
    scale, scale_out : torch.Tensor, shape (N, L)
        max |h_0| at the layer's input and output (the deviations' yardsticks).
    first, last : torch.Tensor, shape (N, L, H, T)
        The first token's attention from query i (t = i + 1 tokens seen), and the last query's row.
    form_first, form_last : torch.Tensor, shape (N, L, H, T)
        The closed forms (float64; NaN for absolute PE; the upper bound for rotary).
    xi : torch.Tensor, shape (N, L, H)
        |q||k| / sqrt(d_head) at the last position.
    token_ids : list of int
        The repeated token of each sequence.
    eps : float
        Sink_1's threshold.
    layers : list of int
        The attention layers (true indices).
    skipped : str
        The layers left out (not attention layers), in one sentence; "" when none.
    source : str
        Where the closed form's parameters were read.
    model_name, kind : str or None
    meta : dict
    """

    encoding: str
    dev_in: torch.Tensor
    dev_out: torch.Tensor
    scale: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    form_first: torch.Tensor
    form_last: torch.Tensor
    xi: torch.Tensor
    token_ids: list
    scale_out: torch.Tensor | None = None
    eps: float = SINK_EPS
    layers: list[int] = field(default_factory=list)
    skipped: str = ""
    source: str = ""
    model_name: str | None = None
    kind: str | None = "repeated"
    meta: dict = field(default_factory=dict)

    __repr__ = compact_repr  # shapes, never tensor values

    @property
    def n_samples(self) -> int:
        return int(self.first.shape[0])

    @property
    def T(self) -> int:
        return int(self.first.shape[-1])

    @property
    def is_bound(self) -> bool:
        """The closed form is an upper bound (rotary), not an equality."""
        return self.encoding == "rotary"

    @property
    def has_form(self) -> bool:
        return self.encoding in CLOSED_FORMS

    @property
    def alpha_1(self) -> torch.Tensor:
        """(N, L, H): Gu et al.'s alpha_1, the mean over the T queries of the first token's weight."""
        return self.first.mean(-1)

    def sink_rate(self, eps: float | None = None) -> float:
        """Sink_1 (%): the percent of (sample, layer, head) with alpha_1 > eps."""
        e = self.eps if eps is None else check_eps(eps)
        return float((self.alpha_1 > e).float().mean() * 100)

    def relative_deviation(self, where: str = "both") -> torch.Tensor:
        """(N, L): the largest deviation across positions relative to max |h_0|, at the layer's input (``in``), output
        (``out``) or the larger of the two (``both``)."""
        rin = self.dev_in / self.scale.clamp_min(1e-30)
        if where == "in" or self.scale_out is None:
            return rin
        rout = self.dev_out / self.scale_out.clamp_min(1e-30)
        return rout if where == "out" else torch.maximum(rin, rout)

    def gap(self, which: str = "last") -> torch.Tensor:
        """(N, L, H): the largest gap to the closed form over keys (``last``) or over t (``first``): |A - form| for
        an equality, A - bound (positive: the bound is broken) for rotary; NaN without a closed form."""
        a, f = (self.last, self.form_last) if which == "last" else (self.first, self.form_first)
        d = a.double() - f
        return (d if self.is_bound else d.abs()).amax(-1)

    def per_layer(self) -> pd.DataFrame:
        """One row per attention layer: the hidden-state deviation in and out (absolute and relative), the largest gap
        to the closed form (last row and first token against t), and Sink_1 in that layer."""
        return pd.DataFrame(
            {
                "layer": self.layers,
                "dev_in": self.dev_in.amax(0).numpy(),
                "dev_in_rel": self.relative_deviation("in").amax(0).numpy(),
                "dev_out": self.dev_out.amax(0).numpy(),
                "dev_out_rel": self.relative_deviation("out").amax(0).numpy(),
                "gap_last": self.gap("last").amax((0, 2)).numpy(),
                "gap_first": self.gap("first").amax((0, 2)).numpy(),
                "first_at_T": self.last[..., 0].mean((0, 2)).numpy(),
                "form_first_at_T": self.form_last[..., 0].mean((0, 2)).numpy(),
                "sink_1_pct": ((self.alpha_1 > self.eps).float().mean((0, 2)) * 100).numpy(),
            }
        )

    def per_head(self) -> pd.DataFrame:
        """One row per (layer, head), means over samples: alpha_1, the first token's weight from the last query, its
        closed form, the largest gap, and xi."""
        L, H = self.first.shape[1:3]
        return pd.DataFrame(
            {
                "layer": torch.tensor(self.layers).repeat_interleave(H).numpy(),
                "head": torch.arange(H).repeat(L).numpy(),
                "alpha_1": self.alpha_1.mean(0).flatten().numpy(),
                "first_at_T": self.last[..., 0].mean(0).flatten().numpy(),
                "form_first_at_T": self.form_last[..., 0].mean(0).flatten().numpy(),
                "gap_last": self.gap("last").amax(0).flatten().numpy(),
                "xi": self.xi.mean(0).flatten().numpy(),
            }
        )

    def first_vs_t(self) -> pd.DataFrame:
        """One row per (layer, head, t): the first token's weight with t tokens seen (mean over samples) and the
        closed form (the bound for rotary, NaN for absolute PE)."""
        L, H, T = self.first.shape[1:]
        idx = torch.cartesian_prod(torch.arange(L), torch.arange(H), torch.arange(T))
        return pd.DataFrame(
            {
                "layer": torch.tensor(self.layers)[idx[:, 0]].numpy(),
                "head": idx[:, 1].numpy(),
                "t": (idx[:, 2] + 1).numpy(),
                "attention": self.first.mean(0).flatten().numpy(),
                "closed_form": self.form_first.mean(0).flatten().numpy(),
            }
        )

    table_fields = ("per_layer", "per_head", "first_vs_t")

    def findings(self) -> list[str]:
        """Whether the hidden states stay equal, whether the closed form holds (and by how much), and Sink_1."""
        name = self.model_name or "the model"
        return [
            f"On {self.n_samples} sequences of one token repeated T = {self.T} times, {name} ({self.encoding} "
            f"positional encoding, {len(self.layers)} attention layers): {self._premise_text()}",
            self._form_text(),
            self._sink_text(),
        ]

    def _premise_text(self) -> str:
        rel = self.relative_deviation()
        worst, l = float(rel.max()), int(rel.amax(0).argmax())
        if worst < REPEATED_TOL:
            return (
                f"every position has the same hidden state at every layer (largest deviation across positions "
                f"{worst:.1e} of |h_0|, below {REPEATED_TOL:g}), the propositions' premise."
            )
        return (
            f"the hidden states differ across positions (up to {worst:.3g} of |h_0|, at layer {self.layers[l]}), so "
            "the propositions' premise fails and no closed form applies."
        )

    def _form_text(self) -> str:
        a_T = float(self.last[..., 0].mean())
        if not self.has_form or float(self.relative_deviation().max()) >= REPEATED_TOL:
            return (
                f"The last query gives the first token a mean weight of {a_T:.4f}, against 1/T = {1 / self.T:.4f} "
                "for NoPE."
            )
        g = float(self.gap("last").max())
        gf = float(self.gap("first").max())
        if self.is_bound:
            ok = "never exceeds it" if max(g, gf) <= REPEATED_TOL else "exceeds it"
            return (
                f"Against the rotary bound, the largest weight minus its bound is {g:.2g} on the last row and "
                f"{gf:.2g} on the first token over t = 1..{self.T}: the attention {ok}; xi ranges "
                f"{float(self.xi.min()):.2f}-{float(self.xi.max()):.2f}, so at t = {self.T} the bound allows the "
                f"first token up to {float(self.form_last[..., 0].mean()):.3f} (mean over heads) where it gets "
                f"{a_T:.4f}."
            )
        ok = "holds" if max(g, gf) <= REPEATED_TOL else "fails"
        src = f" ({self.source})" if self.source else ""
        return (
            f"The attention equals {CLOSED_FORMS[self.encoding]}{src} to within {g:.1e} on the last "
            f"row and {gf:.1e} on the first token for every t, so the proposition {ok}; at t = {self.T} the first "
            f"token gets {a_T:.4f} (closed form {float(self.form_last[..., 0].mean()):.4f})."
        )

    def _sink_text(self) -> str:
        nope = sum(1 / i for i in range(1, self.T + 1)) / self.T
        return (
            f"Sink_1 on these tokens is {self.sink_rate():.1f}% (alpha_1 > {self.eps:g}; mean alpha_1 "
            f"{float(self.alpha_1.mean()):.3f}, largest {float(self.alpha_1.max()):.3f}; NoPE's exact value is "
            f"H_T / T = {nope:.3f})."
        )

    def to_dict(self) -> dict:
        return jsonable(
            {
                **self.header(),
                "encoding": self.encoding,
                "T": self.T,
                "eps": self.eps,
                "layers": list(self.layers),
                "token_ids": [int(t) for t in self.token_ids],
                "source": self.source,
                **self.meta,
                "sink_1_pct": self.sink_rate(),
                "max_relative_deviation": float(self.relative_deviation().max()),
                "max_gap_last": _num(self.gap("last").max()),
                "max_gap_first": _num(self.gap("first").max()),
                "per_layer": self.per_layer().to_dict("records"),
                "per_head": self.per_head().to_dict("records"),
                "text": self.text(),
            }
        )


def _attn_scale(model) -> float:
    """The divisor of q.k in the logits: a positive ``cfg.attn_scale`` where the model states one, else sqrt(d_head)
    (the bridge leaves ``attn_scale`` at -1 and divides by sqrt(d_head))."""
    scale = attention_logit_scale(model)
    return scale if scale is not None else math.sqrt(model_dims(model).d_head)


def _num(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def repeated_tokens(
    model: SinkModel,
    tokens=None,
    *,
    n: int = 8,
    T: int = 64,
    seed: int = 0,
    eps: float = SINK_EPS,
    batch_size: int | None = None,
) -> RepeatedTokens:
    """The propositions on t repeated tokens, measured on ``model`` against their closed forms.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names and softmax attention (``analysis.load_model``, a reference model).
    tokens : torch.Tensor, shape (N, T), optional
        Each row one token repeated; default ``model_probe_sets(...)["repeated"]`` with ``n``, ``T``, ``seed``.
    n, T, seed : int
        The default probe's size and seed.
    eps : float
        Sink_1's threshold.
    batch_size : int, optional
        Sequences per batch.

    Returns
    -------
    RepeatedTokens
    """
    eps = check_eps(eps)
    if tokens is None:
        # lazy for import time: the probes read the stdlib corpus module list
        from analysis.model.probes import model_probe_sets

        tokens = model_probe_sets(model, n=n, T=T, seed=seed)["repeated"].tokens
    tokens = check_repeated(tokens)
    layers = check_attention_layers(model)
    out = run_pass(model, tokens, [RepeatedAccumulator(model, layers)], batch_size=batch_size)[0]
    pe = positional_encoding_name(model)
    pe = "rotary" if rotary_base(model) is not None else _TL_NAMES.get(pe, pe)
    encoding = pe if pe in ENCODINGS else "unknown"  # the model's positional encoding: one of ENCODINGS, or "unknown"
    xi = out["qn"] * out["kn"] / _attn_scale(model)
    form_first, form_last, source = _closed_forms(model, layers, encoding, int(tokens.shape[-1]), xi)
    op = attention_operation(model)
    meta = {} if op == "softmax" else {"note": f"the closed forms hold for softmax attention; this model uses {op}"}
    return RepeatedTokens(
        encoding=encoding,
        **{k: out[k] for k in ("dev_in", "dev_out", "scale", "scale_out", "first", "last")},  # the pass's reductions
        form_first=form_first,
        form_last=form_last,
        xi=xi,
        token_ids=tokens[:, 0].tolist(),
        eps=eps,
        layers=layers,
        source=source,
        model_name=getattr(model, "model_name", None),
        meta=meta,
    )
