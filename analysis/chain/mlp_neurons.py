"""Inside one MLP that writes or erases the first token's spike: every neuron's contribution on the first token (its
activation x W_out[d, n], times the MLP's output factor: Granite's multiplier, a post-norm's gain and scale), the
fewest neurons carrying 90% and 99% of the write, and their activation (and gate and up factors, for gated MLPs) on
the first token against the other tokens (:class:`MlpNeurons`); for a mixture of experts, which routed experts write
(:class:`ExpertWrites`). Read from the :class:`~analysis.chain.first_token_trace.FirstTokenTrace` of one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.core.defaults import NEURON_SHARES, TINY
from analysis.model.mlp_spec import block_norm, expert_writes, get_mlp, mlp_weights, norm_weights
from analysis.core.docs import fill_parameters
from analysis.core.io import jsonable
from analysis.core.results import Result
from analysis.model.key_path import NormOps
from analysis.model.nnsight_model import TraceWeight, weights_in_trace
from analysis.engine import remote
from analysis.engine.passes import Reduction
from analysis.chain.first_token_trace import FirstTokenTrace


# ------------------------------------------------------ Inside one MLP: neurons (dense) or experts (mixture of experts)


@dataclass
class MlpNeurons(Result):
    """The neurons of one dense MLP on one spike dimension, first token.

    Attributes
    ----------
    dim, block : int
    role : str
        "writer" or "eraser".
    contributions : torch.Tensor, shape (N, d_mlp)
        Each neuron's contribution to the MLP's write on ``dim`` per sample: output factor x a_n x W_out[d, n].
    constant : torch.Tensor, shape (N,)
        What the MLP writes on ``dim`` besides its neurons (output factor x b_out[d], a post-norm's bias).
    write : torch.Tensor, shape (N,)
        The MLP's write on ``dim`` (``hook_mlp_out``), first token.
    w_out : torch.Tensor, shape (d_mlp,)
        W_out[d, :] as it reaches the residual (centred over d_model for a LayerNorm post-norm).
    act_first, act_other, act_other_max, gate_first, gate_other, up_first, up_other : torch.Tensor, shape (d_mlp,)
        Mean neuron activation on the first token and on the other tokens (and its largest |value| there), and the
        gate and up pre-activations (gated MLPs; ``up_*`` is a plain MLP's pre-activation, ``gate_*`` then None).
    output : str
        How the MLP's output reaches the stream ("add", "scaled", "post_norm").
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    n_samples : int
        N (a property).
    """

    dim: int
    block: int
    role: str
    contributions: torch.Tensor
    constant: torch.Tensor
    write: torch.Tensor
    w_out: torch.Tensor
    act_first: torch.Tensor
    act_other: torch.Tensor
    act_other_max: torch.Tensor
    gate_first: torch.Tensor | None
    gate_other: torch.Tensor | None
    up_first: torch.Tensor
    up_other: torch.Tensor
    output: str = "add"
    model_name: str | None = None
    kind: str | None = None

    @property
    def n_samples(self) -> int:
        return int(self.contributions.shape[0])

    table_fields = ("neurons=table",)

    @property
    def mean_write(self) -> float:
        return float(self.write.mean())

    @property
    def mean_contributions(self) -> torch.Tensor:
        return self.contributions.mean(0)

    @property
    def order(self) -> torch.Tensor:
        """Neurons by decreasing contribution in the direction of the write."""
        return (self.mean_contributions * (1.0 if self.mean_write >= 0 else -1.0)).argsort(descending=True)

    def neurons(self, share: float = NEURON_SHARES[0]) -> list[int]:
        """The fewest neurons whose mean contributions carry ``share`` of the MLP's mean write on ``dim`` (all of
        them, in order, if even every neuron pushing the same way does not reach it)."""
        sign = 1.0 if self.mean_write >= 0 else -1.0
        c = self.mean_contributions[self.order].double() * sign
        target = share * abs(self.mean_write - float(self.constant.mean()))
        reached = (c.cumsum(0) >= target).nonzero()
        k = int(reached[0]) + 1 if len(reached) else int((c > 0).sum())
        return self.order[: max(k, 1)].tolist()

    def sample_share(self, share: float = NEURON_SHARES[0]) -> torch.Tensor:
        """(N,) the share of each sample's neuron write the ``neurons(share)`` set carries."""
        idx = torch.tensor(self.neurons(share))
        total = self.contributions.sum(1)
        return self.contributions[:, idx].sum(1) / total.where(total.abs() > TINY, torch.full_like(total, TINY))

    @property
    def sum_error(self) -> float:
        """Largest |sum of the neurons' contributions + constant - the MLP's write| over samples."""
        return float((self.contributions.double().sum(1) + self.constant.double() - self.write.double()).abs().max())

    def table(self, share: float = NEURON_SHARES[-1], max_rows: int = 20) -> pd.DataFrame:
        """One row per neuron of the ``share`` set (at most ``max_rows``): contribution, its share of the write and the
        cumulative share, activation, gate and up factors on the first token against the other tokens."""
        idx = self.neurons(share)[:max_rows]
        c = self.mean_contributions
        base = self.mean_write - float(self.constant.mean())
        rows = []
        cum = 0.0
        for n in idx:
            cum += float(c[n]) / base if base else float("nan")
            row = {
                "dim": self.dim,
                "block": self.block,
                "role": self.role,
                "neuron": n,
                "contribution": float(c[n]),
                "share": float(c[n]) / base if base else float("nan"),
                "cum_share": cum,
                "w_out": float(self.w_out[n]),
                "act_first": float(self.act_first[n]),
                "act_other": float(self.act_other[n]),
                "act_other_max": float(self.act_other_max[n]),
            }
            if self.gate_first is not None:
                row |= {"gate_first": float(self.gate_first[n]), "gate_other": float(self.gate_other[n])}
            row |= {"up_first": float(self.up_first[n]), "up_other": float(self.up_other[n])}
            rows.append(row)
        return pd.DataFrame(rows)

    def findings(self) -> list[str]:
        """How few neurons carry the write, then how its largest neuron fires on the first token and elsewhere."""
        lo, hi = NEURON_SHARES[0], NEURON_SHARES[-1]
        n_lo, n_hi = self.neurons(lo), self.neurons(hi)
        t = self.table(lo, max_rows=3)
        per = self.sample_share(lo)
        top = ", ".join(f"{int(r.neuron)} ({r.share:.0%})" for r in t.itertuples())
        what = "writes" if self.role == "writer" else "erases"
        s = (
            f"Inside MLP {self.block}, which {what} {self.mean_write:+.4g} on dim {self.dim}, {len(n_lo)} of "
            f"{self.contributions.shape[1]} neurons carry {lo:.0%} of it and {len(n_hi)} carry {hi:.0%} (the largest: "
            f"{top}); over samples that set carries {float(per.min()):.0%}-{float(per.max()):.0%} of the neuron write."
        )
        r = t.iloc[0] if len(t) else None
        if r is None:
            return [s]
        if self.gate_first is not None:
            fires = (
                f"Neuron {int(r.neuron)} fires on the first token (activation {r.act_first:+.3g}, gate "
                f"{r.gate_first:+.3g}, up {r.up_first:+.3g}) and not elsewhere (activation {r.act_other:+.3g} on "
                f"average over the other tokens, |largest| {r.act_other_max:.3g}; gate {r.gate_other:+.3g}, up "
                f"{r.up_other:+.3g})."
            )
        else:
            fires = (
                f"Neuron {int(r.neuron)} fires on the first token (pre-activation {r.up_first:+.3g}, activation "
                f"{r.act_first:+.3g}) against {r.act_other:+.3g} on average over the other tokens (|largest| "
                f"{r.act_other_max:.3g})."
            )
        return [s, fires]

    def to_dict(self) -> dict:
        return jsonable(
            {
                "dim": self.dim,
                "block": self.block,
                "role": self.role,
                "write": self.mean_write,
                "write_spread": [float(self.write.min()), float(self.write.max())],
                "constant": float(self.constant.mean()),
                "output": self.output,
                **{f"neurons_{round(s * 100)}": self.neurons(s) for s in NEURON_SHARES},
                **{f"n_{round(s * 100)}": len(self.neurons(s)) for s in NEURON_SHARES},
                "sample_share_90": self.sample_share(NEURON_SHARES[0]),
                "sum_error": self.sum_error,
                "top": self.table(),
                "text": self.text(),
            }
        )


@dataclass
class ExpertWrites(Result):
    """Which experts of a mixture-of-experts block write on one spike dimension, first token.

    Attributes
    ----------
    dim : int
        The spike dimension.
    block : int
        The mixture-of-experts block.
    role : str
        "writer", "eraser" or "amplifier".
    table : pandas.DataFrame
        One row per expert (the share of samples it was routed on, its mean write there and over all samples), a row
        "rest" for what the block adds beyond its routed experts (a shared expert), and a row "unaccounted" where the
        block's write is not what its modules make (a hook on its output).
    write : float
        The block's mean write on ``dim``, first token.
    n_samples : int
        The samples the block's write was measured on.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    """

    dim: int
    block: int
    role: str
    table: pd.DataFrame
    write: float
    n_samples: int = 0
    model_name: str | None = None
    kind: str | None = None

    table_fields = ("experts=table",)

    def findings(self) -> list[str]:
        t = self.table[~self.table.expert.isin(["rest", "unaccounted"])].sort_values(
            "mean_write", key=abs, ascending=False
        )
        rest = float(self.table.loc[self.table.expert == "rest", "mean_write"].sum())
        left = self.table.loc[self.table.expert == "unaccounted", "mean_write"]
        top = ", ".join(
            f"expert {r.expert} ({r.mean_write:+.4g}, routed on {r.routed_share:.0%} of samples)"
            for r in t.head(3).itertuples()
        )
        s = (
            f"MLP {self.block} is a mixture of experts, whose neurons no hook holds (so no neuron is named): of its "
            f"{self.write:+.4g} on dim {self.dim}, the routed experts write {top or 'nothing'}, and the rest of the block "
            f"(a shared expert) {rest:+.4g}."
        )
        out = [s]
        if len(left):
            out.append(
                f"Of that write, {float(left.iloc[0]):+.4g} is made by none of the block's modules (a hook on the "
                "block's output adds it)."
            )
        return out

    json_header = False
    json_fields = ("dim", "block", "role", "write", "experts=table")


def _out_factor(model, block: int, act: torch.Tensor, dim: int):
    """(factor (N,), w_out (d_mlp,), constant (N,)): how neuron n's a_n reaches the stream on ``dim``, with the
    output norm's scale held at its value for each sample (exact for the write: sum_n factor a_n w_out[n] +
    constant = the MLP's write). Without an output norm only W_out's row ``dim`` is read (all a model on NDIF sends);
    with one, :func:`_post_norm_reads` reads all of W_out, through nnsight in a trace (on NDIF: there)."""
    spec = get_mlp(model)
    if spec.output != "post_norm":
        W = mlp_weights(model, block, dims=[dim])
        k = torch.full((act.shape[0],), float(spec.output_scale))
        return k, W.W_out[0], k * (float(W.b_out[0]) if W.b_out is not None else 0.0)
    w, nb = norm_weights(block_norm(model, block, spec.output_norm_module))
    ns = spec.output_norm
    norm = NormOps.of(ns, w, nb)
    W = None if weights_in_trace(model) else mlp_weights(model, block)
    ws = {k: TraceWeight(f"mlp.{k}", block) if W is None else getattr(W, k) for k in ("W_out", "b_out")}
    red = Reduction(_post_norm_reads, {"act": act, "dim": dim, "norm": norm, **ws})
    scale, w_out, bc = red({}) if W is not None else remote.in_trace(model, block, red)
    k = (scale * norm.gain[dim]).float()
    return k, w_out, k * float(bc) + (float(nb[dim]) if nb is not None else 0.0)


def _post_norm_reads(acts, *, act, W_out, b_out, dim: int, norm) -> tuple:
    """What the writer table needs of a norm on the MLP's write, torch only: the norm's scale (N,) at each sample's
    MLP output act @ W_out.T + b_out, W_out's row ``dim`` (d_mlp,) and b_out[dim] (centred over d_model for a
    LayerNorm). A remote trace ships it as a reduction of no activations (``acts`` unused): W_out stays on NDIF."""
    W = W_out.float()
    b = torch.zeros(W.shape[0], device=W.device) if b_out is None else b_out.float()
    scale = norm.scale(act.to(W.device) @ W.T + b)[:, 0]
    return (scale, W[dim] - W.mean(0), b[dim] - b.mean()) if norm.kind == "LN" else (scale, W[dim], b[dim])


def mlp_neurons(model: SinkModel, trace: FirstTokenTrace, dim: int, block: int, *, role: str = "writer") -> MlpNeurons:
    """The neurons of a block's dense MLP on one spike dimension, from the trace of a pass.

    Parameters
    ----------
    model
        The model the trace was measured on.
    trace : FirstTokenTrace
        The reduced pass.
    dim : int
        The spike dimension.
    block : int
        The MLP block.
    role : {"writer", "eraser", "amplifier"}
        What the block does to the spike (a label).

    Returns
    -------
    MlpNeurons
    """
    spec = get_mlp(model)
    a = trace.act_first[block]
    k, w_out, const = _out_factor(model, block, a, dim)
    contrib = k[:, None] * a * w_out[None]
    gated = spec.kind == "gated"
    return MlpNeurons(
        dim,
        block,
        role,
        contrib,
        const,
        trace.mlp[:, block, dim],
        w_out * k.mean(),
        a.mean(0),
        trace.act_other[block],
        trace.act_other_max[block],
        trace.gate_first.get(block) if gated else None,
        trace.gate_other.get(block) if gated else None,
        trace.up_first[block],
        trace.up_other[block],
        spec.output,
        model_name=getattr(model, "model_name", None),
    )


def moe_experts(
    model: SinkModel, trace: FirstTokenTrace, dim: int, block: int, *, role: str = "writer"
) -> ExpertWrites:
    """Which routed experts of a mixture-of-experts block write on one spike dimension for the first token.

    Parameters
    ----------
    model, trace, dim, block, role
        As in :func:`mlp_neurons`.

    Returns
    -------
    ExpertWrites
    """
    idx, slots, rest = expert_writes(model, block, trace.mlp_in[block])
    N = idx.shape[0]
    rows = []
    for e in sorted(set(idx.flatten().tolist())):
        on = idx == e  # (N, k)
        w = (slots[..., dim] * on).sum(1)  # (N,)
        routed = on.any(1)
        share, when = float(routed.float().mean()), float(w[routed].mean())
        rows.append({"expert": str(e), "routed_share": share, "write_when_routed": when, "mean_write": float(w.mean())})
    r = float(rest[:, dim].mean())
    rows.append({"expert": "rest", "routed_share": 1.0, "write_when_routed": r, "mean_write": r})
    write = trace.mlp[:N, block, dim]
    left = write - (slots[..., dim].sum(1) + rest[:, dim])  # what the block's modules do not make (a hook on it)
    if float(left.abs().max()) > 1e-3 * max(float(write.abs().max()), 1.0):
        u = float(left.mean())
        rows.append({"expert": "unaccounted", "routed_share": 1.0, "write_when_routed": u, "mean_write": u})
    return ExpertWrites(
        dim, block, role, pd.DataFrame(rows), float(write.mean()), int(N), getattr(model, "model_name", None)
    )


fill_parameters(moe_experts, mlp_neurons)  # the same five Parameters, written once in mlp_neurons


__all__ = ["MlpNeurons", "ExpertWrites", "mlp_neurons", "moe_experts"]
