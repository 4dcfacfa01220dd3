"""Where the spike comes from: the blocks, and the MLP neurons inside them, that write the first token's massive
activation, and the blocks that erase it again.

The residual stream is a sum. On the first token, the value of a spike dimension d entering block l is the
embedding plus every attention (or other token mixer) and MLP write of the blocks before l (to float32 rounding;
``FirstTokenTrace.bookkeeping`` measures it; every family here adds ``hook_attn_out`` / ``hook_mlp_out`` as they are,
Granite's residual multiplier included, see ``analysis.model.mlp_spec.MlpSpec``). One streamed pass
(:class:`SpikeOriginAccumulator`, fed beside the other analyses by ``analysis.profile``) keeps, for the first token
only, the residual stream entering every block, each block's attention and MLP write, the MLP's input and its
neuron activations; for the other tokens only their means (and the stream's largest |value|). Nothing else outlives
a layer: O(N x L x (3 d_model + d_mlp)) numbers, never the activations of every token.

From that trace, for each spike dimension (the first token's spike dims ``analysis.chain.massive`` finds, or given),
:func:`_origin_from` names

- the **writing** components: the embedding, or an attention / MLP write of at least ``SPIKE_WRITE_SHARE`` of the
  value it leads to (in the spike's sign), and the **erasing** ones: a write against the spike of at least that
  share of the value it meets; both at least Sun et al.'s absolute threshold and ``SPIKE_WRITE_FLOOR`` of the peak
  (parallel blocks, GPT-J / NeoX / Phi / Falcon: attention and MLP both read the block's input and are measured
  against the block's output);
- inside each writing or erasing dense MLP (:class:`MlpNeurons`): every neuron's contribution on the first token
  (its activation x W_out[d, n], times the MLP's output factor: Granite's multiplier, a post-norm's gain and scale),
  the fewest neurons carrying 90% and 99% of the write, and their activation (and gate and up factors, for gated
  MLPs) on the first token against the other tokens; for a mixture of experts, which routed experts write
  (:class:`ExpertWrites`);
- for each writing gated MLP, the quadratic-form view of the notes (``analysis.chain.quadratic_form``).

The pass itself lives in ``analysis.chain.first_token_trace``, the neurons and experts inside one MLP in
``analysis.chain.mlp_neurons``; this module names the writing and erasing blocks and assembles the result.

Where the first token's spike is already in its embedding (the project's 1-layer reference models: BOS is a token of
its own) the embedding is the writer and no neuron is named. Without a spike there is nothing to trace, and the
result says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pandas as pd
import torch

from analysis.core.docs import model_tokens, parameters_from
from analysis.model.contract import SinkModel
from analysis.core.defaults import SPIKE_ABS, SPIKE_MIN_SHARE, SPIKE_RATIO, SPIKE_WRITE_FLOOR, SPIKE_WRITE_SHARE, TINY
from analysis.model.mlp_spec import get_mlp, mlp_weights
from analysis.model.hooks import check_dims, check_tokens, model_dims
from analysis.core.io import jsonable
from analysis.chain.massive import massive_accumulator
from analysis.engine import remote
from analysis.engine.passes import Reduction, run_pass
from analysis.chain.quadratic_form import QuadraticForm, _form_spectrum, quadratic_form
from analysis.model.nnsight_model import TraceWeight, weights_in_trace
from analysis.core.results import Result
from analysis.chain.first_token_trace import FirstTokenTrace, SpikeOriginAccumulator
from analysis.chain.mlp_neurons import MlpNeurons, mlp_neurons, moe_experts

ROLES = ("writer", "eraser")  # the roles whose MLPs' neurons are resolved ("amplifier": adds to an embedding spike)


# ----------------------------------------------------------------------------- The result


@dataclass
class SpikeOrigin(Result):
    """Where each spike dimension of the first token comes from and where it goes.

    Attributes
    ----------
    dims : list[int]
        The spike dimensions traced (the first token's, as ``analysis.chain.massive`` finds them, or given).
    trace : FirstTokenTrace
        The reduced pass (first-token stream and writes, neurons).
    writes : pandas.DataFrame
        One row per writing or erasing component: dim, role ("writer" / "eraser" / "amplifier": a write adding to a
        spike the embedding already carries), component ("embedding",
        "attention", "mixer", "mlp"), block (-1 for the embedding), write (mean, first token), write_min, write_max
        (over samples), value_before, value_after, share (of the value after it for a writer, of the value before it
        for an eraser).
    neurons : list[MlpNeurons]
        The neurons of every writing and erasing dense MLP, per dim.
    experts : list[ExpertWrites]
        The routed experts of every writing and erasing mixture-of-experts block, per dim.
    quadratic : list[QuadraticForm]
        The quadratic-form view of every writing gated MLP, per dim.
    bookkeeping : pandas.DataFrame
        Per dim: the largest |embedding + writes - value| over samples and blocks, absolute and over the peak.
    notes : list[str]
        What does not apply here, in sentences (the family's MLP, a write no neuron holds, ...).
    appears : dict
        dim -> the first stream where the first token carries the spike (0: its embedding; l: entering block l).
    mlp_facts : str
        The family's MLP in words (``MlpSpec.text()``).
    share : float
        What counted as a write: at least this share of the value it leads to (or erases).
    min_write : float
        The smallest |write| considered.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    """

    dims: list[int]
    trace: FirstTokenTrace
    writes: pd.DataFrame
    neurons: list = field(default_factory=list)
    experts: list = field(default_factory=list)
    quadratic: list = field(default_factory=list)
    bookkeeping: pd.DataFrame = field(default_factory=pd.DataFrame)
    notes: list = field(default_factory=list)
    mlp_facts: str = ""
    appears: dict = field(default_factory=dict)  # dim -> the first stream carrying the spike (0: the embedding)
    share: float = SPIKE_WRITE_SHARE
    min_write: float = SPIKE_ABS
    model_name: str | None = None
    kind: str | None = None

    @property
    def n_samples(self) -> int:
        return self.trace.n_samples

    @property
    def has_spike(self) -> bool:
        return bool(self.dims)

    @property
    def n_layers(self) -> int:
        return self.trace.n_layers

    @property
    def main_dim(self) -> int | None:
        """The traced dim whose first-token value is largest in size anywhere; None without a spike."""
        return max(self.dims, key=lambda d: float(self.values(d).abs().max())) if self.dims else None

    def values(self, dim: int) -> torch.Tensor:
        """(N, L + 1) the first token's value of ``dim`` entering each block (index L: after the last)."""
        return self.trace.resid[:, :, self._dim(dim)]

    def _dim(self, dim: int) -> int:
        if int(dim) not in self.dims:
            raise ValueError(f"dim {dim} was not traced; this result traces dims {self.dims}.")
        return int(dim)

    def embedding_origin(self, dim: int) -> bool:
        """Whether the spike on ``dim`` already is in the first token's embedding (then no neuron writes it)."""
        return self.appears.get(self._dim(dim)) == 0

    def writers(self, dim: int | None = None, role: str = "writer") -> pd.DataFrame:
        w = self.writes[self.writes.role == role]
        return w if dim is None else w[w.dim == self._dim(dim)]

    def erasers(self, dim: int | None = None) -> pd.DataFrame:
        return self.writers(dim, "eraser")

    def writing_blocks(self, dim: int | None = None, role: str = "writer") -> list[int]:
        """The blocks whose MLP writes (``role="eraser"``: erases) the spike on ``dim`` (every dim: None)."""
        w = self.writers(dim, role)
        return sorted({int(b) for b in w[w.component == "mlp"].block})

    def mlp_neurons(self, dim: int, block: int) -> MlpNeurons:
        for n in self.neurons:
            if n.dim == int(dim) and n.block == int(block):
                return n
        raise ValueError(
            f"no neurons resolved for dim {dim} in block {block}; resolved: {[(n.dim, n.block) for n in self.neurons]}."
        )

    def block_table(self, dim: int) -> pd.DataFrame:
        """One row per block: the first token's value of ``dim`` entering it (mean, min, max over samples), the other
        tokens' mean and largest |value|, the attention and MLP writes on the first token and on the other tokens."""
        d, tr = self._dim(dim), self.trace
        v = tr.resid[:, :, d]
        rows = []
        for l in range(self.n_layers + 1):
            row = {
                "dim": d,
                "block": l if l < self.n_layers else "final",
                "value_first": float(v[:, l].mean()),
                "value_first_min": float(v[:, l].min()),
                "value_first_max": float(v[:, l].max()),
                "value_other": float(tr.other_resid[l, d]),
                "value_other_max": float(tr.other_resid_max[l, d]),
            }
            if l < self.n_layers:
                row |= {
                    "attn_first": float(tr.attn[:, l, d].mean()),
                    "mlp_first": float(tr.mlp[:, l, d].mean()),
                    "attn_other": float(tr.other_attn[l, d]),
                    "mlp_other": float(tr.other_mlp[l, d]),
                }
            rows.append(row)
        return pd.DataFrame(rows)

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        out = {"writes": self.writes, "bookkeeping": self.bookkeeping}
        if self.dims:
            out["blocks"] = pd.concat([self.block_table(d) for d in self.dims], ignore_index=True)
        if self.neurons:
            out["neurons"] = pd.concat([n.table() for n in self.neurons], ignore_index=True)
        if self.quadratic:
            out["quadratic"] = pd.concat([q.table for q in self.quadratic], ignore_index=True)
        if self.experts:
            out["experts"] = pd.concat(
                [e.table.assign(dim=e.dim, block=e.block) for e in self.experts], ignore_index=True
            )
        return out

    def _component_text(self, rows: pd.DataFrame) -> str:
        def name(r):
            return (
                "the embedding"
                if r.component == "embedding"
                else f"{'MLP' if r.component == 'mlp' else r.component} {r.block}"
            )

        return ", ".join(
            f"{name(r)} ({r.write:+.4g}, {r.share:.0%} of the value {'before' if r.role == 'eraser' else 'after'} it)"
            for r in rows.itertuples()
        )

    def dim_text(self, dim: int) -> str:
        """Where one spike dimension peaks, which blocks write and erase it, and that the bookkeeping adds up."""
        return " ".join(self.dim_findings(dim))

    def dim_findings(self, dim: int) -> list[str]:
        """``dim_text`` as a list of whole sentences."""
        d = self._dim(dim)
        v = self.values(d).mean(0)
        peak = int(v.abs().argmax())
        where = f"entering block {peak}" if peak < self.n_layers else "after the last block"
        w, e = self.writers(d), self.erasers(d)
        err, rel = self.trace.bookkeeping(d)
        s = [
            f"Dim {d} reaches {float(v[peak]):+.4g} on the first token ({where}; the other tokens' largest |value| there: "
            f"{float(self.trace.other_resid_max[peak, d]):.3g})."
        ]
        if self.embedding_origin(d):
            emb = float(v[0])
            s.append(
                f"The spike on dim {d} is the first token's own embedding ({emb:+.4g} entering block 0, where it is "
                f"already a spike; {abs(emb) / max(abs(float(v[peak])), TINY):.0%} of the peak): no block writes it, so "
                "no neuron is named."
            )
            amp = self.writers(d, "amplifier")
            if len(amp):
                s.append(f"After it, {self._component_text(amp)} add{'s' if len(amp) == 1 else ''} to it.")
        elif len(w):
            s.append(f"It is written by {self._component_text(w)}.")
        else:
            s.append(f"No single write of at least {self.share:.0%} of the value it leads to builds it.")
        s.append(
            f"It is erased by {self._component_text(e)}."
            if len(e)
            else f"No block erases it: it is {float(v[-1]):+.4g} after the last block."
        )
        attn = self.trace.attn[:, :, d].mean(0).abs()
        s.append(f"Attention writes at most {float(attn.max()):.3g} on it (block {int(attn.argmax())}).")
        s.append(
            f"The bookkeeping adds up: the embedding plus every write equals the value entering each block to "
            f"{err:.2g} ({rel:.1e} of the largest value)."
            if rel < self.trace.bookkeeping_tolerance()
            else f"The bookkeeping does not add up ({err:.3g}, {rel:.1e} of the largest value): the stream is not a sum "
            "of these writes here."
        )
        return s

    def findings(self) -> list[str]:
        name = self.model_name or "the model"
        kind = f" on {self.kind} inputs" if self.kind else ""
        if not self.has_spike:
            return [
                f"The first token of {name}{kind} carries no spike dimension, so there is nothing to trace: no block "
                "or neuron is named.",
                *self.notes,
            ]
        parts = [f for d in self.dims for f in self.dim_findings(d)]
        parts += [f for n in self.neurons if n.role == "writer" for f in n.findings()]
        parts += [f for e in self.experts for f in e.findings()]
        parts += [f for q in self.quadratic for f in q.findings()]
        return parts + list(self.notes)

    def to_dict(self) -> dict:
        return jsonable(
            {
                **self.header(),
                "dims": self.dims,
                "has_spike": self.has_spike,
                "share": self.share,
                "min_write": self.min_write,
                "mlp": self.mlp_facts,
                "writing_blocks": {str(d): self.writing_blocks(d) for d in self.dims},
                "erasing_blocks": {str(d): self.writing_blocks(d, "eraser") for d in self.dims},
                "writes": self.writes,
                "bookkeeping": self.bookkeeping,
                "blocks": {str(d): self.block_table(d) for d in self.dims},
                "neurons": [n.to_dict() for n in self.neurons],
                "experts": [e.to_dict() for e in self.experts],
                "quadratic": [q.to_dict() for q in self.quadratic],
                "notes": self.notes,
                "text": self.text(),
            }
        )


# ----------------------------------------------------------------------------- From the trace to the origin

_WRITE_COLS = "dim role component block write write_min write_max value_before value_after share".split()


def _components(trace: FirstTokenTrace, dim: int, parallel: bool, mixers: Sequence[int]):
    """(component, block, writes (N,), value before (N,), value after (N,)) in the order they reach the stream."""
    v = trace.resid[:, :, dim]
    yield "embedding", -1, v[:, 0], torch.zeros_like(v[:, 0]), v[:, 0]
    for l in range(trace.n_layers):
        a, m = trace.attn[:, l, dim], trace.mlp[:, l, dim]
        mixer = "mixer" if l in mixers else "attention"
        if parallel:  # both read the block's input; each is measured against the block's output
            yield mixer, l, a, v[:, l], v[:, l + 1]
            yield "mlp", l, m, v[:, l], v[:, l + 1]
        else:
            yield mixer, l, a, v[:, l], v[:, l] + a
            yield "mlp", l, m, v[:, l] + a, v[:, l + 1]


def _find_writes(
    trace: FirstTokenTrace,
    dim: int,
    *,
    parallel: bool = False,
    mixers: Sequence[int] = (),
    share: float = SPIKE_WRITE_SHARE,
    min_write: float = SPIKE_ABS,
    appears: int | None = None,
) -> pd.DataFrame:
    """The components that write and erase the first token's spike on one dimension (the rows of
    ``SpikeOrigin.writes``).

    A writer adds, in the sign of the spike's peak, at least ``share`` of the value it leads to; an eraser takes away
    at least ``share`` of the value it meets; both write at least ``min_write`` and ``SPIKE_WRITE_FLOOR`` of the peak
    |value| (means over samples, first token).

    ``parallel``: attention and MLP read the block's input (measured against the block's output); ``mixers``: blocks
    whose token mixer has no ``hook_attn_out``; ``appears``: the first stream carrying the spike, where 0 (the
    embedding) makes the embedding its writer, and a later write that adds to it an "amplifier". One row per component:
    dim, role, component, block, write, write_min, write_max, value_before, value_after, share."""
    v = trace.resid[:, :, dim].mean(0)
    peak = float(v[int(v.abs().argmax())])
    sign = 1.0 if peak >= 0 else -1.0
    floor = max(float(min_write), SPIKE_WRITE_FLOOR * abs(peak))
    rows = []
    for comp, block, w, before, after in _components(trace, dim, parallel, mixers):
        wm, b, a = float(w.mean()), float(before.mean()), float(after.mean())
        if abs(wm) < floor:
            continue
        if sign * wm > 0 and sign * wm >= share * abs(a):
            role, sh = "writer" if appears != 0 or comp == "embedding" else "amplifier", sign * wm / max(abs(a), TINY)
        elif sign * wm < 0 and -sign * wm >= share * abs(b) and comp != "embedding":
            role, sh = "eraser", -sign * wm / max(abs(b), TINY)
        else:
            continue
        rows.append((int(dim), role, comp, int(block), wm, float(w.min()), float(w.max()), b, a, sh))  # _WRITE_COLS
    return pd.DataFrame(rows, columns=_WRITE_COLS)


def _check_blocks(blocks, L: int) -> list[int] | None:
    if blocks is None:
        return None
    blocks = sorted({int(b) for b in blocks})
    bad = [b for b in blocks if not 0 <= b < L]
    if bad:
        raise ValueError(f"blocks {bad} out of range: this model has blocks 0..{L - 1}.")
    return blocks


def _origin_from(
    model: SinkModel,
    trace: FirstTokenTrace,
    *,
    dims: Sequence[int] | None = None,
    massive=None,
    blocks: Sequence[int] | None = None,
    share: float = SPIKE_WRITE_SHARE,
    min_write: float | None = None,
    kind: str | None = None,
) -> SpikeOrigin:
    """The :class:`SpikeOrigin` of a pass's :class:`FirstTokenTrace`.

    ``dims`` None takes the first token's spike dims of ``massive`` (the massive activations of the same tokens, e.g.
    ``Profile.massive["natural"]``) over every layer; ``blocks`` are the MLP blocks whose neurons (or experts) to
    resolve (None: every writing and erasing MLP found); ``min_write`` None is ``massive``'s absolute threshold, else
    Sun et al.'s 100; ``kind`` labels the input."""
    spec = get_mlp(model)
    D, L = int(model_dims(model).d_model), trace.n_layers
    blocks = _check_blocks(blocks, L)
    dims = _spike_dims(dims, massive, D)
    if min_write is None:
        min_write = float(getattr(massive, "abs_threshold", SPIKE_ABS)) if massive is not None else SPIKE_ABS
    name = getattr(model, "model_name", None)
    notes = []
    if not spec.additive:
        notes.append(
            "This model's stream after a block is not its input plus the block's writes "
            "(a post-norm stream, or a hook that edits the stream): the writes need not add up."
        )
    appears = {d: _appears(trace, d, massive) for d in dims}
    writes, books = _writes_and_books(trace, dims, spec, share=share, min_write=min_write, appears=appears)
    out = SpikeOrigin(
        dims,
        trace,
        writes,
        bookkeeping=books,
        notes=notes,
        mlp_facts=spec.text(),
        share=share,
        min_write=float(min_write),
        appears=appears,
        model_name=name,
        kind=kind,
    )
    for d in dims:
        todo = (
            [(b, role) for role in ROLES for b in out.writing_blocks(d, role)]
            if blocks is None
            else [(b, "eraser" if b in out.writing_blocks(d, "eraser") else "writer") for b in blocks]
        )
        for b, role in todo:
            _resolve(model, out, spec, d, b, role)
    return out


def _spike_dims(dims: Sequence[int] | None, massive, D: int) -> list[int]:
    """The spike dims to trace, checked: those given, else the first token's spike dims of ``massive`` over every
    layer."""
    if dims is None:
        if massive is None:
            raise ValueError(
                "give the spike dims to trace (dims=[...]) or the massive activations of these tokens "
                "(massive=MassiveActivations) to find them."
            )
        dims = sorted({d for ds in massive.first_token_dims.values() for d in ds})
    return check_dims(dims, D)


def _writes_and_books(
    trace: FirstTokenTrace, dims: list[int], spec, *, share: float, min_write: float, appears: dict[int, int]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every dim's writes (:func:`_find_writes`) in one table, and the bookkeeping table (how far the writes fall from
    adding up to the stream, per dim)."""
    writes = pd.concat(
        [
            _find_writes(
                trace,
                d,
                parallel=spec.parallel,
                mixers=spec.mixer_layers,
                share=share,
                min_write=min_write,
                appears=appears[d],
            )
            for d in dims
        ]
        or [pd.DataFrame(columns=_WRITE_COLS)],
        ignore_index=True,
    )
    books = pd.DataFrame(
        [{"dim": d, "max_abs_err": e, "rel_err": r} for d in dims for e, r in [trace.bookkeeping(d)]],
        columns=["dim", "max_abs_err", "rel_err"],
    )
    return writes, books


def _appears(trace: FirstTokenTrace, dim: int, massive) -> int:
    """The first stream (0: the embedding, entering block 0; l: entering block l; L: after the last block) where the
    first token carries the spike on ``dim``: where ``massive`` first flags it, else where its |value| first reaches
    half its peak."""
    flagged = [l for l, ds in (massive.first_token_dims.items() if massive is not None else ()) if dim in ds]
    if flagged:
        return min(flagged) + (massive.hook == "resid_post")
    v = trace.resid[:, :, dim].mean(0).abs()
    return int((v >= 0.5 * v.max()).nonzero()[0])


def _resolve(model, out: SpikeOrigin, spec, dim: int, block: int, role: str) -> None:
    """Add the neurons (dense MLP) or experts (mixture of experts) of ``block`` on ``dim`` to ``out``, or a note."""
    tr = out.trace
    if spec.has_neurons(block):
        n = mlp_neurons(model, tr, dim, block, role=role)
        out.neurons.append(n)
        if role == "writer" and spec.kind == "gated":
            out.quadratic.append(_quadratic(model, n, tr.mlp_in[block]))
        elif role == "writer":
            out.notes.append(
                f"MLP {block} is a plain ({spec.activation}) MLP: each neuron is act(w_in . x), not a product "
                "of two projections, so the quadratic-form view does not apply."
            )
    elif block in spec.moe_layers:
        try:
            out.experts.append(moe_experts(model, tr, dim, block, role=role))
        except ValueError as e:
            out.notes.append(f"MLP {block} is a mixture of experts whose experts could not be run one by one ({e}).")
    else:
        out.notes.append(f"MLP {block}'s neurons are not readable in this {spec.family} model ({spec.kind} MLP).")


def _quadratic(model, n: MlpNeurons, x: torch.Tensor) -> QuadraticForm:
    """A writer block's quadratic form (``x``: its first-token MLP input); through nnsight its spectrum is taken in a
    trace (``_form_spectrum``, W_gate and W_up read there as TraceWeights): from NDIF only the spectrum comes back."""
    if not weights_in_trace(model):
        W = mlp_weights(model, n.block)
        return quadratic_form(n.w_out, W.W_gate, W.W_in, x, dim=n.dim, block=n.block, write=n.mean_write)
    ws = {"W_gate": TraceWeight("mlp.W_gate", n.block), "W_up": TraceWeight("mlp.W_in", n.block), "x": x}
    lam, cos, share, form = remote.in_trace(model, n.block, Reduction(_form_spectrum, {"w_out_d": n.w_out, **ws}))
    return QuadraticForm(n.dim, n.block, lam, cos, share, float(form), float(n.mean_write), n_samples=len(x))


@parameters_from(model_tokens)
def spike_origin(
    model: SinkModel,
    tokens,
    *,
    dims: Sequence[int] | None = None,
    blocks: Sequence[int] | None = None,
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    min_share: float = SPIKE_MIN_SHARE,
    median_over: str = "sequence",
    share: float = SPIKE_WRITE_SHARE,
    min_write: float | None = None,
    batch_size: int | None = None,
    kind: str | None = None,
) -> SpikeOrigin:
    """Where the first token's spike comes from, in one streamed pass over ``tokens`` (N, T).

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens`.
    dims : sequence of int, optional
        The residual dimensions to trace; None finds the first token's spike dims with ``analysis.chain.massive`` in the
        same pass, in the stream entering every block (``hook_resid_pre``: the embedding included, so a spike the
        first token's embedding already carries is found; ``abs_threshold``, ``ratio_threshold``, ``min_share``,
        ``median_over``: its criterion).
    blocks : sequence of int, optional
        The MLP blocks whose neurons to resolve; None: every writing and erasing MLP found.
    abs_threshold, ratio_threshold, min_share : float
        The massive-activation criterion that finds the spike dims (see ``analysis.massive_activations``).
    median_over : {"sequence", "token"}
        The median its ratio is taken to.
    share : float
        What counts as a write: at least this share of the value it leads to (or erases).
    min_write : float, optional
        ... and at least this mean |write| (None: ``abs_threshold`` when the dims are found here, Sun et al.'s 100
        when they are given; 0 for a small model whose spike stays under 100).
    batch_size : int, optional
        Sequences per batch.
    kind : str, optional
        The input kind, a label ("natural", "random").

    Returns
    -------
    SpikeOrigin
    """
    tokens = check_tokens(model, tokens)
    D, L = int(model_dims(model).d_model), model_dims(model).n_layers
    if dims is not None:
        dims = check_dims(dims, D)
    _check_blocks(blocks, L)
    if not 0 < float(share) <= 1:
        raise ValueError(f"share must lie in (0, 1]; got {share}.")
    accs = [SpikeOriginAccumulator(model, kind=kind)]
    if dims is None:
        accs.append(
            massive_accumulator(
                model,
                tokens.shape,
                abs_threshold=abs_threshold,
                ratio_threshold=ratio_threshold,
                min_share=min_share,
                hook="resid_pre",
                median_over=median_over,
                kind=kind,
            )
        )
    got = run_pass(model, tokens, accs, batch_size=batch_size)
    massive = got[1] if dims is None else None
    if min_write is None:
        min_write = abs_threshold if dims is None else None
    return _origin_from(
        model, got[0], dims=dims, massive=massive, blocks=blocks, share=share, min_write=min_write, kind=kind
    )


def writer_summary(origin: SpikeOrigin) -> list[dict]:
    """The writing blocks and, inside each writing MLP, its writer neurons with their shares of the write (the
    report's "writers").

    Parameters
    ----------
    origin : SpikeOrigin

    Returns
    -------
    list of dict
        Per writing block: ``dim``, ``component``, ``block``, ``write``, ``share_of_value``; for an MLP with its
        neurons resolved also ``neurons`` (``neuron``, ``share``), ``n_90`` and ``n_99``.
    """
    out = []
    for r in origin.writes[origin.writes.role == "writer"].itertuples():
        row = {"dim": r.dim, "component": r.component, "block": r.block, "write": r.write, "share_of_value": r.share}
        if r.component == "mlp":
            n = next((n for n in origin.neurons if n.dim == r.dim and n.block == r.block), None)
            if n is not None:
                t = n.table()
                row["neurons"] = [{"neuron": int(x.neuron), "share": float(x.share)} for x in t.itertuples()]
                row["n_90"], row["n_99"] = len(n.neurons(0.9)), len(n.neurons(0.99))
        out.append(row)
    return out


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, Section, register  # noqa: E402


register(
    Analysis(
        "origin",
        result=SpikeOrigin,
        order=90,
        hooks=("pre", "attn", "mlp", "post", "x", "act", "gate", "up"),
        requires=("massive",),
        doc="Where the main kind's first-token spike comes from (the spike dims of ``massive``).",
        accumulators=lambda p: [SpikeOriginAccumulator(p.model, kind=p.kind)],
        finish=lambda outputs, p, got: _origin_from(p.model, outputs[0], massive=got["massive"][0], kind=p.kind),
        sections=(
            Section(
                "Where the spike comes from",
                "spike",
                40,
                key="spike_writers",
                needs=("massive", "origin", "baseline", "resid", "cause", "cuts"),
                runner="analysis.report.sections:_spike_writers",
            ),
        ),
        exports=("spike_origin",),
    )
)
