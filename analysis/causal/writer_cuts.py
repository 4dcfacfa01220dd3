"""The cut that removes the sink: the writer neurons zeroed (or set to their mean) on the first token only.

For the neurons ``analysis.chain.spike_writers`` names (those carrying ``share`` of each writing MLP's write on a spike
dimension), :func:`spike_cuts` runs the conditions that change the same first block in one pass (their sequences
repeated once per condition, ``conditions.run_condition``'s ``groups``), resumed at that block from the shared
baseline's residuals:

- ``writers``: the writer neurons' activations on the first token set to 0 (``zero``) or to their mean over the
  other tokens (``mean``); against as many random neurons of the same MLPs (``random``, several draws);
- ``erasers``: the same for the neurons of the blocks that erase the spike after its last writer, so that the
  spike is *not* removed before the unembedding.

Each condition reports the spike downstream (the dims' first-token value entering the block where the unchanged
model's spike peaks, and after the last block), Sink_1 and the loss over every position, and the loss of the first
token's own prediction (the position the spike sits on). Only the activations of the first token change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.core.defaults import NEURON_SHARES, SINK_EPS, TINY
from analysis.model.mlp_spec import get_mlp
from analysis.chain.first_token_cause import why_first_token
from analysis.chain.spike_writers import spike_origin
from analysis.causal.conditions import Baseline, PassResult, baseline_for, condition_rows, run_condition
from analysis.model.hooks import act_name, check_tokens, model_dims
from analysis.model.nnsight_model import weights_in_trace
from analysis.engine.passes import Accumulator, Reduction, ResidCapture
from analysis.core.results import Result, layer_runs
from analysis.sinks.metric import check_eps

from analysis.core.defaults import WRITER_CUT_RANDOM_DRAWS as N_RANDOM  # random draws per condition


class _NeuronSetter:
    """Sets the first token's activation of chosen neurons to 0 ("zero") or to a value each ("mean") at the MLP's neuron
    hook, and records the spike dims' first-token values after every block from ``start`` on (the first position's
    loss comes with the pass's own: ``PassResult.loss_first``). Several conditions can share one pass: the sequences
    repeated once per condition, each condition's neurons set on its own ``rows`` (``run_condition``'s ``groups``).

    ``conditions`` gives, per condition in the order of their rows, {block: the neurons to set} and its mode; ``means``
    {block: each neuron's mean activation on the other tokens, (d_mlp,)} for "mean"."""

    def __init__(
        self,
        model,
        conditions: list[tuple[dict[int, list[int]], str]],
        means: dict[int, torch.Tensor],
        dims: list[int],
        start: int,
        rows: int,
    ):
        spec = get_mlp(model)
        self.dims, self.start, self.rows = dims, int(start), int(rows)
        self.set_at: dict[int, list[tuple[int, torch.Tensor, torch.Tensor | float]]] = {}  # block -> (condition, ...)
        for c, (neurons, mode) in enumerate(conditions):
            for b, ns in sorted(neurons.items()):
                if ns:
                    idx = torch.tensor(sorted(ns))
                    value = means[b][idx] if mode == "mean" else 0.0
                    self.set_at.setdefault(b, []).append((c, idx, value))
        self.hook_of = {b: spec.neuron_hook(b) for b in self.set_at}
        self.L = model_dims(model).n_layers
        self.values: list[torch.Tensor] = []
        self.current: dict[int, torch.Tensor] = {}
        self.batch: tuple[int, int] = (0, 0)  # the current batch's offset in the pass and its size

    def start_batch(self, batch) -> None:
        self.batch = (batch.offset, batch.size)

    def hooks(self):
        out = [(self.hook_of[b], partial(self.set, b)) for b in sorted(self.set_at)]
        return out + [(act_name("resid_post", l), partial(self.record, l)) for l in range(self.start, self.L)]

    def sets(self, block: int) -> list[tuple[slice, torch.Tensor, torch.Tensor | float]]:
        """(rows, neurons, value) set at ``block`` in the current batch: each condition's, on its rows."""
        here = dict(condition_rows(*self.batch, self.rows))  # condition -> its rows in this batch
        return [(here[c], idx, value) for c, idx, value in self.set_at[block] if c in here]

    def set(self, block: int, a: torch.Tensor, hook) -> torch.Tensor:
        return set_neurons(a, sets=self.sets(block))

    def edits(self, batch) -> dict:
        """The sets of ``batch`` as trace edits (``analysis.engine.remote.trace_batch``) of the neurons' site."""
        self.start_batch(batch)
        return {b: {"mlp.hook_post": Reduction(set_neurons, {"sets": self.sets(b)})} for b in self.set_at}

    def record(self, layer: int, x: torch.Tensor, hook) -> None:
        self.keep(layer, first_token_dims({"x": x}, dims=self.dims).cpu())

    def keep(self, layer: int, values: torch.Tensor) -> None:
        """The spike dims' first-token values after block ``layer`` (B, n_dims); the batch's row after the last."""
        self.current[layer] = values
        if layer == self.L - 1:
            self.values.append(torch.stack([self.current.pop(l) for l in range(self.start, self.L)], 1))


def set_neurons(a: torch.Tensor, *, sets: list) -> torch.Tensor:
    """The neuron activations ``a`` (B, T, d_mlp) with the first token's chosen neurons set (torch only: a remote
    trace ships it).

    Parameters
    ----------
    a : torch.Tensor
    sets : list of (slice, torch.Tensor, float or torch.Tensor)
        (rows, neurons, the value or one per neuron).

    Returns
    -------
    torch.Tensor
    """
    a = a.clone()
    for rows, idx, value in sets:
        a[rows, 0, idx.to(a.device)] = value if isinstance(value, float) else value.to(a.device, a.dtype)
    return a


def first_token_dims(acts: dict, *, dims: list[int]) -> torch.Tensor:
    """The spike dims' first-token values of the stream {"x"} (B, n_dims), float32 (torch only: it ships).

    Parameters
    ----------
    acts : dict
    dims : list of int

    Returns
    -------
    torch.Tensor
    """
    return acts["x"][:, 0, dims].detach().float()


class _SpikeValues(Accumulator):
    """A remote cut's record (:class:`_NeuronSetter`'s, read in the trace): the spike dims' first-token values after
    each block from the setter's start on."""

    def __init__(self, setter: _NeuronSetter):
        self.setter = setter

    def hooks(self):
        return {l: {"x": act_name("resid_post", l)} for l in range(self.setter.start, self.setter.L)}

    def reduction(self, layer: int) -> Reduction:
        return Reduction(first_token_dims, {"dims": self.setter.dims})

    def fold(self, layer: int, stats, batch) -> None:
        self.setter.keep(layer, stats)

    def result(self) -> None:
        return None


@dataclass
class SpikeCuts(Result):
    """Spike, Sink_1 and loss with the writer (or eraser) neurons cut on the first token, against random neurons.

    Attributes
    ----------
    conditions : pandas.DataFrame
        One row per condition: ``role`` ("baseline", "writers", "erasers"), ``mode`` ("zero", "mean"), ``chosen``
        ("named", "random", or "MLP b": block b's named neurons alone), ``draw``, ``n_neurons``, ``blocks``, and per spike dim ``dim``: ``value_peak`` (the
        first token's value entering the block where the unchanged spike peaks, mean over samples), ``kept``
        (that over the unchanged value), ``value_final`` (after the last block), then ``sink_1_pct``, ``loss``,
        ``loss_first`` (the first token's own next-token loss) and their changes.
    neurons : dict
        role -> {block: the neurons cut}.
    peak_block : dict
        dim -> the block whose input carries the unchanged spike's peak.
    message : str
        Why nothing was cut (no spike, no writer neuron), in words; "" otherwise.
    n_random : int
        Random draws per condition.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    n_samples : int
        N, the number of sequences.
    """

    conditions: pd.DataFrame
    neurons: dict
    peak_block: dict
    message: str = ""
    n_random: int = N_RANDOM
    model_name: str | None = None
    kind: str | None = None
    n_samples: int = 0

    table_fields = ("conditions", "summary")

    @property
    def summary(self) -> pd.DataFrame:
        """Per (role, mode, chosen, dim): the mean of each measure over draws and its spread (min, max)."""
        c = self.conditions
        if not len(c):
            return pd.DataFrame()
        keys = ["role", "mode", "chosen", "dim"]
        meas = ["kept", "value_final", "sink_1_pct", "loss", "loss_first"]
        g = c.groupby(keys, sort=False)[meas]
        out = g.mean().add_suffix("_mean").join(g.min().add_suffix("_min")).join(g.max().add_suffix("_max"))
        return out.join(c.groupby(keys, sort=False).size().rename("n_draws")).reset_index()

    @staticmethod
    def _row(s: pd.DataFrame, role, mode, chosen, dim) -> pd.Series | None:
        r = s[(s.role == role) & (s["mode"] == mode) & (s.chosen == chosen) & (s.dim == dim)]
        return r.iloc[0] if len(r) else None

    def findings(self) -> list[str]:
        if self.message:
            return [self.message]
        out, summary = [], self.summary  # built once (three joins), not once per row looked up
        base = self.conditions[self.conditions.role == "baseline"]
        for dim in dict.fromkeys(self.conditions.dim):
            b = base[base.dim == dim].iloc[0]
            for role in ("writers", "erasers"):
                if role not in self.neurons:
                    continue
                named = {m: self._row(summary, role, m, "named", dim) for m in ("zero", "mean")}
                rnd = self._row(summary, role, "zero", "random", dim)
                ns = self.neurons[role]
                what = (
                    f"the {sum(len(v) for v in ns.values())} {'writer' if role == 'writers' else 'eraser'} neurons of "
                    f"MLP{'s' if len(ns) > 1 else ''} {layer_runs(list(ns))}"
                )
                z, m = named["zero"], named["mean"]
                if role == "writers":
                    s = (
                        f"Zeroing {what} on the first token only keeps {z.kept_mean:.1%} of dim {dim}'s spike entering "
                        f"block {self.peak_block[dim]} (+{abs(b.value_peak):.4g} unchanged), takes Sink_1 from "
                        f"{b.sink_1_pct:.1f}% to {z.sink_1_pct_mean:.1f}% and the loss from {b.loss:.3f} to {z.loss_mean:.3f}; "
                        f"setting them to their mean over the other tokens keeps {m.kept_mean:.1%}, Sink_1 "
                        f"{m.sink_1_pct_mean:.1f}%, loss {m.loss_mean:.3f}."
                    )
                else:
                    s = (
                        f"Zeroing {what} on the first token (the spike is then not removed before the unembedding) "
                        f"leaves dim {dim} at {z.value_final_mean:+.4g} after the last block (unchanged "
                        f"{b.value_final:+.4g}); Sink_1 {b.sink_1_pct:.1f}% -> {z.sink_1_pct_mean:.1f}%, the loss "
                        f"{b.loss:.3f} -> {z.loss_mean:.3f}, the first token's own next-token loss {b.loss_first:.3f} -> "
                        f"{z.loss_first_mean:.3f}; set to their mean over the other tokens: dim {dim} "
                        f"{m.value_final_mean:+.4g}, loss {m.loss_mean:.3f}, first-token loss {m.loss_first_mean:.3f}."
                    )
                out.append(s)
                if rnd is not None:
                    key = "kept" if role == "writers" else "value_final"
                    fmt = (lambda v: f"{v:.1%}") if role == "writers" else (lambda v: f"{v:+.4g}")
                    out.append(
                        f"As many random neurons of the same MLPs ({int(rnd.n_draws)} draws) "
                        f"{'keep' if role == 'writers' else 'leave dim ' + str(dim) + ' at'} "
                        f"{fmt(rnd[key + '_mean'])} ({fmt(rnd[key + '_min'])} to {fmt(rnd[key + '_max'])}), Sink_1 "
                        f"{rnd.sink_1_pct_min:.1f}-{rnd.sink_1_pct_max:.1f}%, loss {rnd.loss_min:.3f}-"
                        f"{rnd.loss_max:.3f}."
                    )
        return out

    json_fields = ("neurons", "peak_block", "message", "*tables")


def _named(origin, role: str, share: float) -> dict[int, list[int]]:
    """{block: neurons carrying ``share`` of the write} for the writers, or for the erasers after each dim's last
    writer (those that remove the spike before the unembedding)."""
    out: dict[int, set] = {}
    for n in origin.neurons:
        if role == "writers" and n.role == "writer":
            out.setdefault(n.block, set()).update(n.neurons(share))
        elif role == "erasers" and n.role == "eraser" and n.block > max(origin.writing_blocks(n.dim) or [-1]):
            out.setdefault(n.block, set()).update(n.neurons(share))
    return {b: sorted(v) for b, v in sorted(out.items())}


def _random_like(named: dict[int, list[int]], d_mlp: int, gen: torch.Generator) -> dict[int, list[int]]:
    """As many random neurons of each MLP as ``named`` holds there, none of them named."""
    out = {}
    for b, ns in named.items():
        pool = torch.tensor([n for n in range(d_mlp) if n not in set(ns)])
        out[b] = sorted(pool[torch.randperm(len(pool), generator=gen)[: len(ns)]].tolist())
    return out


def _baseline(model, tokens, baseline: Baseline | None, blocks: list[int], eps: float, batch_size) -> Baseline:
    """The unchanged pass over ``tokens``: the shared ``baseline`` (its first N sequences) or one run here that keeps
    the residual entering ``blocks`` (so each condition resumes at the first block it changes)."""
    N = tokens.shape[0]
    if baseline is None:  # the unchanged run and the residuals to resume from (not the value statistics)
        # each condition of a model loaded through nnsight runs from the embedding in its traces: no residual to resume
        capture = [] if weights_in_trace(model) else [ResidCapture([b for b in blocks if b > 0])]
        run = run_condition(model, tokens, eps=eps, batch_size=batch_size, accumulators=capture)
        resid = capture[0].result() if capture else {}
        return Baseline(run, torch.empty(0), pd.DataFrame(), torch.empty(0), resid)
    if baseline.run.eps == eps and baseline.run.alpha.shape[0] > N:  # its first N sequences
        run = replace(baseline.run, alpha=baseline.run.alpha[:N], loss=float("nan"), loss_first=None)
        resid = {b: x[:N] for b, x in baseline.resid.items()}
        baseline = replace(baseline, run=run, first_resid=baseline.first_resid[:N], v1=baseline.v1[:N], resid=resid)
    return baseline_for(model, tokens, baseline, eps, batch_size)  # checked: these N sequences, this eps


def _run_stacked(
    model,
    tokens,
    conditions: list[tuple[dict[int, list[int]], str]],
    means,
    dims: list[int],
    *,
    eps: float,
    batch_size,
    baseline: Baseline,
) -> list[tuple[PassResult, torch.Tensor]]:
    """Run each condition ({block: neurons}, mode) over ``tokens`` (N, T): those that change the same first block in
    one pass, their sequences repeated once per condition. Per condition, in order: its PassResult and the spike dims'
    first-token values after every block from its first on, (N, L - start, n_dims)."""
    N, L = tokens.shape[0], model_dims(model).n_layers
    by_start: dict[int, list[int]] = {}
    for c, (neurons, _) in enumerate(conditions):
        by_start.setdefault(min(neurons) if neurons else L - 1, []).append(c)
    done: dict[int, tuple[PassResult, torch.Tensor]] = {}
    for start, cs in by_start.items():
        setter = _NeuronSetter(model, [conditions[c] for c in cs], means, dims, start, N)
        got = run_condition(
            model,
            tokens.repeat(len(cs), 1),
            hooks=setter.hooks(),
            eps=eps,
            batch_size=batch_size,
            on_batch_start=setter.start_batch,
            baseline=baseline,
            groups=len(cs),
            edits=setter.edits,  # a model loaded through nnsight: the neurons set in its traces (no resume)
            accumulators=[_SpikeValues(setter)] if weights_in_trace(model) else [],  # and the spike dims read there
        )
        after = torch.cat(setter.values)  # (len(cs) N, L - start, n_dims): the stream after blocks start..L-1
        for i, (c, r) in enumerate(zip(cs, got if len(cs) > 1 else [got])):
            done[c] = (r, after[i * N : (i + 1) * N])
    return [done[c] for c in range(len(conditions))]


def spike_cuts(
    model: SinkModel,
    tokens,
    origin,
    *,
    share: float = NEURON_SHARES[0],
    n_random: int = N_RANDOM,
    random_modes: tuple[str, ...] = ("zero",),
    roles: tuple[str, ...] = ("writers", "erasers"),
    per_block: bool = False,
    max_samples: int | None = None,
    seed: int = 0,
    eps: float = SINK_EPS,
    baseline: Baseline | None = None,
    batch_size: int | None = None,
) -> SpikeCuts:
    """Cut the writer (and eraser) neurons on the first token; measure the spike downstream, Sink_1 and the loss.

    Parameters
    ----------
    model
        The model ``origin`` was measured on.
    tokens : torch.Tensor, shape (N, T)
        The tokens ``origin`` was measured on (their first ``max_samples`` sequences are used).
    origin : SpikeOrigin
        Names the writing and erasing neurons (``analysis.chain.spike_writers``).
    share : float
        The neurons carrying this share of each MLP's write are cut.
    n_random : int
        Random draws of as many neurons of the same MLPs, per mode in ``random_modes``.
    random_modes : tuple of str
        The modes ("zero", "mean") the random neurons are cut with.
    roles : tuple of str
        "writers", "erasers" (those after the last writer: the spike is then not removed before the unembedding).
    per_block : bool
        Also zero each writing MLP's neurons alone (``chosen`` "MLP b"): which writer the others depend on.
    max_samples : int, optional
        Run on the first ``max_samples`` sequences only.
    seed : int
        Seed of the random draws.
    eps : float
        The sink threshold of Sink_1.
    baseline : conditions.Baseline, optional
        The unchanged pass over ``tokens`` with its residuals (``analysis.profile``'s); run here when not given.
    batch_size : int, optional
        Sequences per batch.

    Returns
    -------
    SpikeCuts
    """
    eps = check_eps(eps)
    tokens = check_tokens(model, tokens)
    if max_samples is not None:
        tokens = tokens[: int(max_samples)]
    N, T = tokens.shape
    if N > origin.n_samples or not torch.equal(tokens[:, 0].cpu(), origin.trace.first_ids[:N]):
        raise ValueError(
            "these tokens are not those the spike origin was measured on (its first tokens differ): pass "
            "the tokens of `origin`."
        )
    bad = [r for r in roles if r not in ("writers", "erasers")]
    if bad or int(n_random) < 0 or any(m not in ("zero", "mean") for m in random_modes):
        raise ValueError(
            f"roles must be among ('writers', 'erasers'), random_modes among ('zero', 'mean') and "
            f"n_random >= 0; got {roles}, {random_modes}, {n_random}."
        )
    name = getattr(model, "model_name", None)
    sets = {r: _named(origin, r, share) for r in roles}
    sets = {r: s for r, s in sets.items() if s}
    if not origin.has_spike or not sets:
        why = (
            "there is no spike on the first token"
            if not origin.has_spike
            else "no MLP neuron is named as the spike's writer or eraser (it is written by the embedding, attention or a "
            "mixture of experts, or by nothing the writes show)"
        )
        return SpikeCuts(pd.DataFrame(), {}, {}, f"Nothing to cut: {why}.", int(n_random), name, origin.kind, N)
    dims = origin.dims
    starts = sorted({min(s) for s in sets.values()})
    base = _baseline(model, tokens, baseline, starts, eps, batch_size)
    vals = origin.trace.resid[:N][:, :, dims]  # (N, L + 1, n_dims)
    peak = {d: int(vals[:, :, j].mean(0).abs().argmax()) for j, d in enumerate(dims)}
    L = model_dims(model).n_layers
    runs = _cut_runs(model, sets, per_block=per_block, n_random=n_random, random_modes=random_modes, seed=seed)
    done = _run_stacked(
        model,
        tokens,
        [(neurons, mode or "zero") for _, mode, _, _, neurons in runs],
        origin.trace.act_other,
        dims,
        eps=eps,
        batch_size=batch_size,
        baseline=base,
    )
    df = pd.DataFrame(_cut_rows(runs, done, vals, peak, dims, L))
    b = df[df.role == "baseline"].iloc[0]
    df["delta_loss"], df["delta_loss_first"] = df["loss"] - b["loss"], df["loss_first"] - b["loss_first"]
    df["delta_sink_1"] = df["sink_1_pct"] - b["sink_1_pct"]
    return SpikeCuts(df, sets, peak, "", int(n_random), name, origin.kind, N)


def _cut_runs(
    model: SinkModel, sets: dict, *, per_block: bool, n_random: int, random_modes: tuple[str, ...], seed: int
) -> list[tuple]:
    """The runs of :func:`spike_cuts`, ``(role, mode, chosen, draw, neurons)``: the baseline, then per role its named
    neurons zeroed and set to their mean, each writing MLP's alone (``per_block``), and the random draws."""
    runs = [("baseline", "", "named", 0, {})]
    gen = torch.Generator().manual_seed(int(seed))
    for role, named in sets.items():
        runs += [(role, mode, "named", 0, named) for mode in ("zero", "mean")]
        if per_block and len(named) > 1:
            runs += [(role, "zero", f"MLP {b}", 0, {b: ns}) for b, ns in named.items()]
        runs += [
            (role, mode, "random", k, _random_like(named, get_mlp(model).d_mlp, gen))
            for mode in random_modes
            for k in range(int(n_random))
        ]
    return runs


def _cut_rows(runs: list[tuple], done: list, vals: torch.Tensor, peak: dict, dims: list[int], L: int) -> list[dict]:
    """One row per run and spike dim: the spike at its peak (and the share of it kept) and at the end, Sink_1 and the
    loss; ``vals`` the unchanged residual's dims (N, L + 1, n_dims), ``done`` each run's pass and residual after its
    first cut block."""
    rows = []
    for c, (role, mode, chosen, draw, neurons) in enumerate(runs):
        start = min(neurons) if neurons else L - 1
        r, after = done[c]
        full = torch.cat([vals[:, 1 : start + 1], after], 1)  # (N, L, n_dims): entering blocks 1..L-1, then final
        loss_first = float(r.loss_first.mean()) if r.loss_first is not None else float("nan")
        for j, d in enumerate(dims):
            v_peak = float(full[:, peak[d] - 1, j].mean()) if peak[d] > 0 else float(vals[:, 0, j].mean())
            unchanged = float(vals[:, peak[d], j].mean())
            rows.append(
                {
                    "role": role,
                    "mode": mode,
                    "chosen": chosen,
                    "draw": draw,
                    "n_neurons": sum(len(v) for v in neurons.values()),
                    "blocks": layer_runs(list(neurons)) if neurons else "",
                    "dim": d,
                    "value_peak": v_peak,
                    "kept": v_peak / unchanged if abs(unchanged) > TINY else float("nan"),
                    "value_final": float(full[:, -1, j].mean()),
                    "sink_1_pct": r.sink_rate(1),
                    "loss": r.loss,
                    "loss_first": loss_first,
                }
            )
    return rows


def origin_row(model: SinkModel, tokens, *, kind: str | None = None, max_samples: int | None = None) -> dict:
    """The spike's origin on one probe in one row (notebook 10's spread over probes): the main dim, its writing and
    erasing blocks, peak, the top neurons and quadratic view of its main writing MLP, the later / first ratio and
    Sink_1 and the spike kept with the writers zeroed. Without a spike the row holds the sentence that says so.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    tokens : torch.Tensor, shape (N, T)
        The probe.
    kind : str, optional
        The input kind, a label.
    max_samples : int, optional
        The cuts run on the first ``max_samples`` sequences only.

    Returns
    -------
    dict
        ``dim`` None and ``finding`` for a model whose first token carries no spike; NaN where a part does not apply
        (no MLP writes the spike, an MLP without a gate).
    """
    o = spike_origin(model, tokens, kind=kind)
    d, nan = o.main_dim, float("nan")
    if d is None:
        return {"dim": None, "finding": o.findings()[0]}
    w = o.writers(d)
    w = w[w.component == "mlp"]
    main = int(w.sort_values("write", key=abs).block.iloc[-1]) if len(w) else None
    top = o.mlp_neurons(d, main).table(NEURON_SHARES[0], max_rows=2) if main is not None else pd.DataFrame()
    q = next((q for q in o.quadratic if q.dim == d and q.block == main), None)
    c = why_first_token(model, tokens, o)
    s = spike_cuts(model, tokens, o, roles=("writers",), n_random=1, max_samples=max_samples).summary
    s = s.set_index(["role", "mode", "chosen", "dim"]) if len(s) else pd.DataFrame()

    def cut(key, col):
        return s.loc[key, col] if key in s.index else nan

    return {
        "dim": d,
        "writers": o.writing_blocks(d),
        "erasers": o.writing_blocks(d, "eraser"),
        "peak": float(o.values(d).mean(0).abs().max()),
        "top neurons (share)": [(int(r.neuron), round(r.share, 2)) for r in top.itertuples()],
        "top eig share": float(q.energy_share[0]) if q else nan,
        "|cos|": float(q.cos_top[0]) if q else nan,
        "rank one": q.rank_one if q else None,
        "later / first": float(c.spike.loc[c.spike["first"].abs().idxmax(), "ratio"]) if len(c.spike) else nan,
        "Sink_1": cut(("baseline", "", "named", d), "sink_1_pct_mean"),
        "kept (cut)": cut(("writers", "zero", "named", d), "kept_mean"),
        "Sink_1 (cut)": cut(("writers", "zero", "named", d), "sink_1_pct_mean"),
        "kept (random)": cut(("writers", "zero", "random", d), "kept_min"),
    }


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, register  # noqa: E402


def _follow_up(inputs, prof) -> SpikeCuts | None:
    """The writer cuts on the first ``follow_up_samples`` main-kind sequences (None without a spike)."""
    if prof.origin is None or not prof.origin.has_spike:
        return None
    return spike_cuts(
        inputs.model,
        inputs.tokens,
        prof.origin,
        baseline=prof.baseline,
        max_samples=inputs.follow_up_samples,
        batch_size=inputs.batch_size,
    )


register(
    Analysis(
        "cuts",
        result=SpikeCuts,
        order=110,
        follows="origin",
        requires=("massive", "origin", "baseline"),
        run=_follow_up,
        doc='The spike, Sink_1 and the loss with the writer or eraser neurons cut (follow-up "cuts"; None without a spike).',
        exports=("spike_cuts",),
    )
)
