"""Why the first token: what makes the writer neurons fire at position 1 and not when the same token comes later.

A writer neuron n of block l's MLP reads the MLP input x = norm(h), h the residual the MLP reads (the block's input
for parallel blocks, the stream after attention otherwise). With the norm's scale s of the token held at its value
(as direct attribution does), each pre-activation is a sum over what feeds h:

    w_n . x + b_n = sum_c s (w_n * gain) . centre(c) + (w_n . b_norm + b_n),

c running over the embedding and every earlier attention (token mixer) and MLP write (and block l's own attention
where the MLP reads the stream after it); centring for a LayerNorm. :func:`why_first_token` measures that sum for
the writer neurons ``analysis.chain.spike_writers`` names (their gate and up factors for gated MLPs, the pre-activation for
plain ones) on the first token, and on the same token id placed at a later position of the same sequence (one pass
over the tokens with position ``later`` replaced by the first token; nothing before it changes). It also says, for
each spike dimension, whether the same token carries the spike there: a table a reader can follow from "position 1"
to "these neurons fire". The components are projected onto the neurons' weights inside the hooks, at the two
positions only; the pass stops after the last writer block.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.core.defaults import NEURON_SHARES, TINY
from analysis.model.mlp_spec import block_norm, get_mlp, mlp_weights, norm_weights
from analysis.model.hooks import act_name, check_tokens, model_facts
from analysis.model.key_path import NormParams
from analysis.engine.passes import Accumulator, Batch, Reduction, run_pass
from analysis.core.results import Result

from analysis.core.defaults import FIRST_TOKEN_DIVERGED as DIVERGED, FIRST_TOKEN_MAX_NEURONS as MAX_NEURONS


def _input_norm(model, block: int) -> NormParams:
    """The norm on block ``block``'s MLP input as NormParams (kind "none" where the MLP reads the raw residual)."""
    spec = get_mlp(model)
    mod = block_norm(model, block, spec.input_norm_module)
    if mod is None or spec.input_norm is None:
        return NormParams("none", torch.ones(int(model_facts(model).dims.d_model)), None, 0.0)
    w, b = norm_weights(mod)
    ns = spec.input_norm
    return NormParams.of(ns, w, b if ns.bias else None)


@dataclass
class _Readout:
    """The writer neurons of one block and the vectors that read their pre-activations off the residual stream."""

    dim: int
    block: int
    neurons: list[int]
    factors: list[str]  # "gate", "up" (gated) or "pre" (plain)
    U: torch.Tensor  # (D, F): one column per (factor, neuron), F = len(factors) * len(neurons); gain folded in, centred
    const: torch.Tensor  # (F,): w . b_norm + b
    norm: NormParams

    @property
    def columns(self) -> list[tuple[str, int]]:
        return [(f, n) for f in self.factors for n in self.neurons]


def _readout(model, dim: int, block: int, neurons: list[int]) -> _Readout:
    spec = get_mlp(model)
    W = mlp_weights(model, block, neurons=neurons)  # their rows only (all a model held on NDIF sends)
    norm = _input_norm(model, block)
    rows, consts, factors = [], [], []
    for f, (w, b) in (
        {"gate": (W.W_gate, W.b_gate), "up": (W.W_in, W.b_in)} if spec.kind == "gated" else {"pre": (W.W_in, W.b_in)}
    ).items():
        wg = w * norm.gain if norm.kind != "none" else w
        rows.append(wg - wg.mean(-1, keepdim=True) if norm.kind == "LN" else wg)
        c = w @ norm.b if norm.b is not None else torch.zeros(len(neurons))
        consts.append(c + (b if b is not None else 0))
        factors.append(f)
    return _Readout(dim, block, list(neurons), factors, torch.cat(rows).T.contiguous(), torch.cat(consts), norm)


def cause_stats(acts: dict, *, layer: int, U, dims: list, later: int, norm=None, readouts=()) -> list:
    """:class:`CauseAccumulator`'s reduce of one block (torch only: a remote trace ships it), at positions 0 and
    ``later``: every component's projection on the writer neurons' weights ``U`` (D, F) and its norms, the spike
    dims' values in and out, and where ``readouts`` ((dim, neurons, factors) of this block) the input norm's scale,
    the neurons' activations and their hooks' pre-activations.

    Parameters
    ----------
    acts : dict
        {"pre", "attn" or "mid", "mlp", "post"; a writer block's "h", "act", "factor_<f>"}.
    layer : int
    U : torch.Tensor
    dims : list of int
    later : int
    norm : NormParams, optional
        The block's MLP input norm (a writer block).
    readouts : sequence of (int, torch.Tensor, list of str)

    Returns
    -------
    list of (tuple, torch.Tensor)
    """
    pos, out = [0, later], []
    pre = acts["pre"][:, pos].float()
    attn = acts["attn"][:, pos].float() if "attn" in acts else acts["mid"][:, pos].float() - pre
    U = U.to(pre.device)
    mlp = acts["mlp"][:, pos].float()
    mixer = "attention" if "attn" in acts else "mixer"
    for key, c in ([(("embedding", -1), pre)] if layer == 0 else []) + [((mixer, layer), attn), (("mlp", layer), mlp)]:
        out.append((key, c @ U))
        norms = torch.stack([c[:, 0].norm(dim=-1), c[:, 1].norm(dim=-1), (c[:, 0] - c[:, 1]).norm(dim=-1)], -1)
        out.append((("norms",) + key, norms))
    out.append((("value_in", layer), pre[..., dims]))
    out.append((("value_out", layer), acts["post"][:, pos][..., dims].float()))
    if norm is not None:
        out.append((("scale", layer), norm.scale(acts["h"][:, pos])[..., 0]))
    for dim, idx, factors in readouts:
        idx = idx.to(pre.device)
        out.append((("act", layer, dim), acts["act"][:, pos][..., idx]))
        out.append((("hook", layer, dim), torch.cat([acts[f"factor_{f}"][:, pos][..., idx] for f in factors], -1)))
    return out


class CauseAccumulator(Accumulator):
    """At positions 0 and ``later``: every component's projection on the writer neurons' weights, the norm scale,
    the hooks' pre-activations and activations of the writer blocks, and the spike dims' values."""

    def __init__(self, model, readouts: list[_Readout], dims: list[int], later: int, *, last: int = 0):
        self.model, self.readouts, self.dims, self.later = model, readouts, dims, int(later)
        self.spec = get_mlp(model)
        self.last = min(max([r.block for r in readouts] + [int(last)]), model_facts(model).dims.n_layers - 1)
        self.U = (
            torch.cat([r.U for r in readouts], 1) if readouts else torch.zeros(int(model_facts(model).dims.d_model), 0)
        )
        self.rows: dict[tuple, list[torch.Tensor]] = {}
        self.blocks = sorted({r.block for r in readouts})

    def hooks(self):
        out = {}
        for l in range(self.last + 1):
            h = {"pre": act_name("resid_pre", l), "mlp": act_name("mlp_out", l), "post": act_name("resid_post", l)}
            attn = self.spec.attn_write_hook(l)
            h.update({"attn": attn} if attn else {"mid": act_name("resid_mid", l)})
            if l in self.blocks:
                h["h"] = act_name(self.spec.input_resid, l)
                h["act"] = self.spec.neuron_hook(l)
                for f in self.readouts_of(l)[0].factors:
                    h[f"factor_{f}"] = self.spec.gate_hook(l) if f == "gate" else self.spec.up_hook(l)
            out[l] = h
        return out

    def readouts_of(self, block: int) -> list[_Readout]:
        return [r for r in self.readouts if r.block == block]

    def reduction(self, layer: int) -> Reduction:
        mine = self.readouts_of(layer)
        return Reduction(
            cause_stats,
            {
                "layer": layer,
                "U": self.U,
                "dims": self.dims,
                "later": self.later,
                "norm": mine[0].norm if mine else None,
                "readouts": [(r.dim, torch.tensor(r.neurons), r.factors) for r in mine],
            },
        )

    def fold(self, layer: int, stats: list, batch: Batch) -> None:
        for key, x in stats:
            self.rows.setdefault(key, []).append(x.detach().float().cpu())

    def result(self) -> dict:
        return {k: torch.cat(v) for k, v in self.rows.items()}


@dataclass
class FirstTokenCause(Result):
    """The writer neurons' pre-activations on the first token and on the same token later, over what feeds them.

    Attributes
    ----------
    later : int
        The (0-based) position the first token's id was placed at.
    contributions : pandas.DataFrame
        One row per (dim, block, neuron, factor, component): ``first`` and ``later``, the component's part of the
        pre-activation (mean over samples), with the rows "constant" (biases) and "total" (their sum), and the
        check ``hook`` (the hook's pre-activation; ``total`` equals it to float tolerance).
    neurons : pandas.DataFrame
        One row per (dim, block, neuron): activation at the first and later position, and their write on the dim.
    spike : pandas.DataFrame
        One row per (dim, stream point): the dim's value on the first token and on the same token later (means),
        their ratio and whether the later one is a spike too (at least half the first one).
    divergence : pandas.DataFrame
        One row per component up to the last writer block: the norm of its write on the first token and on the same
        token later, and how different the two are (|first - later| / (|first| + |later|), means over samples): where
        position 1 first makes a difference.
    max_error : float
        Largest |total - hook| over every neuron, factor, position and sample.
    message : str
        Why there is nothing to decompose (no spike, no writer), in words; "" otherwise.
    note : str
        Why no writer neuron is followed, where none is.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    n_samples : int
        N, the number of sequences.
    """

    later: int
    contributions: pd.DataFrame
    neurons: pd.DataFrame
    spike: pd.DataFrame
    divergence: pd.DataFrame
    max_error: float
    message: str = ""
    note: str = ""  # why no writer neuron is followed
    model_name: str | None = None
    kind: str | None = None
    n_samples: int = 0

    table_fields = ("contributions", "neurons", "spike", "divergence")

    def chain(self, dim: int, block: int, neuron: int | None = None) -> pd.DataFrame:
        """The table to follow for one writer neuron (the largest by default): one row per component (and constant,
        total), one column per factor and position: ``gate_first``, ``gate_later``, ``up_first``, ... ."""
        c = self.contributions[(self.contributions.dim == dim) & (self.contributions.block == block)]
        if not len(c):
            raise ValueError(f"no writer neurons were followed in block {block} for dim {dim}.")
        neuron = int(c.neuron.iloc[0]) if neuron is None else int(neuron)
        c = c[c.neuron == neuron]
        wide = c.pivot_table(index=["order", "component"], columns="factor", values=["first", "later"], sort=False)
        wide.columns = [f"{f}_{p}" for p, f in wide.columns]
        wide = wide.reset_index().sort_values("order").drop(columns="order")
        cols = ["component"] + [f"{f}_{p}" for f in dict.fromkeys(c.factor) for p in ("first", "later")]
        return wide[cols].reset_index(drop=True)

    def _block_text(self, dim: int, block: int) -> str:
        c = self.contributions[(self.contributions.dim == dim) & (self.contributions.block == block)]
        neuron = int(c.neuron.iloc[0])
        mine = c[c.neuron == neuron]
        c = mine[~mine.component.isin(["total", "constant", "hook"])]
        factor = "gate" if "gate" in set(c.factor) else "pre"
        f = c[c.factor == factor].assign(diff=lambda d: d["first"] - d["later"]).sort_values("diff", ascending=False)
        f = f[f["diff"] > 0.1 * max(float(f["diff"].clip(lower=0).sum()), TINY)]  # the parts that make the difference
        tot = mine[(mine.factor == factor) & (mine.component == "total")].iloc[0]
        top = f.head(2)
        parts = (
            ", ".join(f"{r.component} ({r.first:+.3g} against {r.later:+.3g})" for r in top.itertuples())
            or "no one part"
        )
        n = self.neurons[
            (self.neurons.dim == dim) & (self.neurons.block == block) & (self.neurons.neuron == neuron)
        ].iloc[0]
        return (
            f"Writer neuron {neuron} of MLP {block} (dim {dim}): its {'gate' if factor == 'gate' else 'pre-activation'} "
            f"is {tot['first']:+.3g} on the first token against {tot['later']:+.3g} for the same token at position "
            f"{self.later + 1}; the difference comes most from {parts}; it fires at {n.act_first:+.3g} against "
            f"{n.act_later:+.3g} there (write on dim {dim}: {n.write_first:+.4g} against {n.write_later:+.4g})."
        )

    def findings(self) -> list[str]:
        if self.message:
            return [self.message]
        c = self.contributions  # (dim, block), in order; none (no columns) without a writer to follow
        blocks = dict.fromkeys(zip(c.dim, c.block)) if len(c) else {}
        none = self.note or "No writer neuron to follow: no MLP neuron is named as the spike's writer."
        out = [self._block_text(int(d), int(b)) for d, b in blocks] or [none]
        div = self.divergence
        if len(div):
            first = div[div.difference >= DIVERGED].head(1)
            top = div[div.difference >= 0.05].sort_values("difference", ascending=False).head(3)
            where = (
                f"{first.component.iloc[0]} is the first write that differs ({first.difference.iloc[0]:.0%})"
                if len(first)
                else "no write differs by much"
            )
            most = ", ".join(f"{r.component} ({r.difference:.0%})" for r in top.itertuples()) or "none"
            out.append(
                f"Between position 1 and position {self.later + 1} the same token's embedding is the same; "
                f"{where}, and the writes that differ most are {most}."
            )
        for d in dict.fromkeys(self.spike.dim):
            s = self.spike[self.spike.dim == d].reset_index(drop=True)
            peak = s.iloc[int(s["first"].abs().argmax())]
            verdict = "carries the spike too" if peak["later_is_spike"] else "carries no spike"
            out.append(
                f"The same token id at position {self.later + 1} {verdict} on dim {d}: {peak['later']:+.4g} "
                f"against {peak['first']:+.4g} at position 1 ({peak['point']})."
            )
        if len(self.contributions):
            out.append(
                f"The decomposition adds up: the components' sum equals each pre-activation to {self.max_error:.2g}."
            )
        return out

    json_fields = ("later", "max_error", "*tables")


def _check_later(later, T: int) -> int:
    later = T // 2 if later is None else int(later)
    if not 1 <= later < T:
        raise ValueError(
            f"later must be a position in [1, {T - 1}] (0-based) of these T={T}-token sequences; got {later}."
        )
    return later


def why_first_token(
    model: SinkModel,
    tokens,
    origin,
    *,
    later: int | None = None,
    max_neurons: int = MAX_NEURONS,
    share: float = NEURON_SHARES[0],
    batch_size: int | None = None,
) -> FirstTokenCause:
    """Decompose the writer neurons' pre-activations on the first token against the same token id at a later
    position, and say whether the later one carries the spike.

    Parameters
    ----------
    model
        The model ``origin`` was measured on.
    tokens : torch.Tensor, shape (N, T)
        Token ids (those of ``origin``, or others); position ``later`` is replaced by each sequence's first token.
    origin : SpikeOrigin
        Names the spike dims and the writing MLPs (``analysis.chain.spike_writers``).
    later : int, optional
        The 0-based position to place the first token at (default T // 2).
    max_neurons : int
        Writer neurons followed per block: those carrying ``share`` of the write, the largest first, at most this many.
    share : float
        The share of each writing MLP's write the followed neurons carry.
    batch_size : int, optional
        Sequences per batch.

    Returns
    -------
    FirstTokenCause
    """
    tokens = check_tokens(model, tokens)
    later = _check_later(later, tokens.shape[1])
    name = getattr(model, "model_name", None)
    if not origin.has_spike:
        why = "There is no spike on the first token, so there is nothing to trace back."
        return FirstTokenCause(later, *[pd.DataFrame()] * 4, 0.0, why, name, origin.kind, tokens.shape[0])
    writers = [n for n in origin.neurons if n.role == "writer"]
    readouts = [_readout(model, n.dim, n.block, n.neurons(share)[:max_neurons]) for n in writers]
    moved = tokens.clone()
    moved[:, later] = tokens[:, 0]
    peaks = {d: int(origin.values(d).mean(0).abs().argmax()) for d in origin.dims}  # the stream entering block p
    acc = CauseAccumulator(model, readouts, origin.dims, later, last=max([p - 1 for p in peaks.values()] + [0]))
    got = run_pass(model, moved, [acc], batch_size=batch_size)[0]
    out = _cause(model, origin, readouts, got, later, tokens.shape[0], peaks)
    if not readouts:
        emb = all(origin.embedding_origin(d) for d in origin.dims)
        out.note = (
            f"No writer neuron to follow on dims {origin.dims}: the spike is in the first token's embedding, not "
            "written by an MLP."
            if emb
            else f"No writer neuron to follow on dims {origin.dims}: no MLP neuron is named as the spike's writer."
        )
    return out


def _cause(model, origin, readouts: list[_Readout], got: dict, later: int, N: int, peaks: dict) -> FirstTokenCause:
    parallel = get_mlp(model).parallel
    rows, nrows, max_err, offset = [], [], 0.0, 0
    comps = [k for k in got if k[0] in ("embedding", "attention", "mixer", "mlp")]
    for r in readouts:
        F = len(r.columns)
        sl = slice(offset, offset + F)
        offset += F
        named = _factor_parts(r, got, comps, sl, parallel=parallel)
        max_err = max(max_err, float((named["total"] - named["hook"]).abs().max()))
        for order, (comp, v) in enumerate(named.items()):
            m = v.mean(0)  # (2, F)
            for j, (f, n) in enumerate(r.columns):
                rows.append(
                    {
                        "dim": r.dim,
                        "block": r.block,
                        "neuron": n,
                        "factor": f,
                        "order": order,
                        "component": comp,
                        "first": float(m[0, j]),
                        "later": float(m[1, j]),
                    }
                )
        nrows += _neuron_rows(origin, r, got)
    spike = _spike_rows(origin, got, readouts, peaks)
    return FirstTokenCause(
        later,
        pd.DataFrame(rows),
        pd.DataFrame(nrows),
        spike,
        _divergence(got),
        max_err,
        "",
        getattr(model, "model_name", None),
        origin.kind,
        N,
    )


def _factor_parts(r: _Readout, got: dict, comps: list, sl: slice, *, parallel: bool) -> dict[str, torch.Tensor]:
    """The readout's factors (columns ``sl`` of the components' writes, (N, 2, F) each) split into what each
    component before block ``r.block`` writes into them (scaled by the block's norm), the constant, their total and
    what the hook holds."""
    s = got[("scale", r.block)]  # (N, 2)
    feeds = [
        k for k in comps if k[1] < r.block or (k[1] == r.block and k[0] in ("attention", "mixer") and not parallel)
    ]
    parts = {k: got[k][..., sl] * s[..., None] for k in feeds}  # (N, 2, F)
    total = sum(parts.values()) + r.const
    named = {
        ("embedding" if k[0] == "embedding" else f"{'MLP' if k[0] == 'mlp' else k[0]} {k[1]}"): v
        for k, v in parts.items()
    }
    return named | {"constant": r.const.expand_as(total), "total": total, "hook": got[("hook", r.block, r.dim)]}


def _neuron_rows(origin, r: _Readout, got: dict) -> list[dict]:
    """Per neuron of the readout: its activation and its write (activation x its output weight on the dim), first
    token against the same token later."""
    act = got[("act", r.block, r.dim)].mean(0)  # (2, n)
    w = origin.mlp_neurons(r.dim, r.block).w_out
    return [
        {
            "dim": r.dim,
            "block": r.block,
            "neuron": n,
            "act_first": float(act[0, j]),
            "act_later": float(act[1, j]),
            "write_first": float(act[0, j]) * float(w[n]),
            "write_later": float(act[1, j]) * float(w[n]),
        }
        for j, n in enumerate(r.neurons)
    ]


def _divergence(got: dict) -> pd.DataFrame:
    """Per component (in the order they reach the stream): the norm of its write on the first token and on the same
    token later, and their difference over the sum of both norms (0: the same vector, 1: opposite or one of them 0)."""
    rows = []
    for key, v in got.items():
        if key[0] != "norms":
            continue
        m = v.mean(0)  # (3,): |first|, |later|, |first - later|
        comp = "embedding" if key[1] == "embedding" else f"{'MLP' if key[1] == 'mlp' else key[1]} {key[2]}"
        rows.append(
            {
                "component": comp,
                "block": key[2],
                "norm_first": float(m[0]),
                "norm_later": float(m[1]),
                "difference": float(m[2] / (m[0] + m[1]).clamp_min(TINY)),
            }
        )
    return pd.DataFrame(rows, columns=["component", "block", "norm_first", "norm_later", "difference"])


def _spike_rows(origin, got: dict, readouts: list[_Readout], peaks: dict) -> pd.DataFrame:
    """Per dim: its value at the embedding, after each writing block and where the first token's spike peaks, first
    token against the same token later."""
    rows = []
    blocks = sorted({r.block for r in readouts})
    for j, d in enumerate(origin.dims):
        points = [("embedding", got[("value_in", 0)][..., j])]
        points += [(f"after MLP {b}", got[("value_out", b)][..., j]) for b in blocks]
        p = peaks[d]
        if p > 0 and p - 1 not in blocks and ("value_out", p - 1) in got:
            where = f"entering block {p}" if p < origin.n_layers else "after the last block"
            points.append((where, got[("value_out", p - 1)][..., j]))
        for point, v in points:
            m = v.mean(0)
            first, lat = float(m[0]), float(m[1])
            rows.append(
                {
                    "dim": d,
                    "point": point,
                    "first": first,
                    "later": lat,
                    "ratio": lat / first if abs(first) > TINY else float("nan"),
                    "later_is_spike": bool(abs(first) > TINY and lat / first >= 0.5),
                }
            )
    return pd.DataFrame(rows)


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, register  # noqa: E402


def _follow_up(inputs, prof) -> FirstTokenCause | None:
    """Why the first token, on the first ``follow_up_samples`` main-kind sequences (None without a spike)."""
    if prof.origin is None or not prof.origin.has_spike:
        return None
    return why_first_token(
        inputs.model, inputs.tokens[: inputs.follow_up_samples], prof.origin, batch_size=inputs.batch_size
    )


register(
    Analysis(
        "cause",
        result=FirstTokenCause,
        order=100,
        follows="origin",
        requires=("massive", "origin", "baseline"),
        run=_follow_up,
        doc='Why the first token: what feeds the main writer neurons (follow-up "cause"; None without a spike).',
        exports=("why_first_token",),
    )
)
