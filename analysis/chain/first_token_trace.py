"""The streamed pass the spike's origin is read from: :class:`SpikeOriginAccumulator` (fed beside the other analyses
by ``analysis.profile``) keeps, for the first token only, the residual stream entering every block, each block's
attention and MLP write, the MLP's input and its neuron activations; for the other tokens only their means (and the
stream's largest |value|), in a :class:`FirstTokenTrace`. Nothing else outlives a layer: O(N x L x (3 d_model +
d_mlp)) numbers, never the activations of every token. ``analysis.chain.spike_writers`` names the writing blocks
from it, ``analysis.chain.mlp_neurons`` the neurons inside each MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from analysis.core.defaults import TINY
from analysis.model.mlp_spec import get_mlp, mlp_input
from analysis.model.hooks import act_name, model_facts
from analysis.engine.passes import Accumulator, Batch, LayerCollector, Reduction
from analysis.core.results import compact_repr
from analysis.core.stats import one_thread


# ------------------------------------------------------ The streamed pass: the first token's stream, writes and neurons


@dataclass
class FirstTokenTrace:
    """What :class:`SpikeOriginAccumulator` keeps from one pass (first token: per sample; other tokens: means).

    Attributes
    ----------
    resid : torch.Tensor, shape (N, L + 1, d_model)
        The first token's residual stream entering each block (``hook_resid_pre``); index L: after the last block.
    attn, mlp : torch.Tensor, shape (N, L, d_model)
        Each block's token-mixer write (``hook_attn_out``; ``hook_resid_mid - hook_resid_pre`` for Mamba / linear
        attention) and MLP write (``hook_mlp_out``) on the first token.
    other_resid, other_resid_max : torch.Tensor, shape (L + 1, d_model)
        Mean over samples of the mean (and of the largest |value|) over the other tokens of the stream.
    other_attn, other_mlp : torch.Tensor, shape (L, d_model)
        Mean writes on the other tokens.
    mlp_in : dict[int, torch.Tensor]
        Block -> the first token's MLP input x (N, d_model).
    act_first : dict[int, torch.Tensor]
        Dense block -> the first token's neuron activations (N, d_mlp).
    act_other, act_other_max, gate_first, gate_other, up_first, up_other : dict[int, torch.Tensor]
        Dense block -> (d_mlp,): mean activation on the other tokens, mean over samples of its largest |value| there;
        mean gate and up pre-activations (gated MLPs; up holds a plain MLP's pre-activation) on the first token and
        on the other tokens.
    first_ids : torch.Tensor, shape (N,)
        The first token of each sequence.
    T : int
        The sequence length.
    dtype : str
        The model's dtype ("float32", "bfloat16" ...): the stream is rounded to it after every write, so the writes
        add up to the stream to its precision only (:meth:`bookkeeping_tolerance`).
    """

    resid: torch.Tensor
    attn: torch.Tensor
    mlp: torch.Tensor
    other_resid: torch.Tensor
    other_resid_max: torch.Tensor
    other_attn: torch.Tensor
    other_mlp: torch.Tensor
    mlp_in: dict
    act_first: dict
    act_other: dict
    act_other_max: dict
    gate_first: dict
    gate_other: dict
    up_first: dict
    up_other: dict
    first_ids: torch.Tensor
    T: int
    dtype: str = "float32"

    def __repr__(self) -> str:
        return compact_repr(self)  # shapes, never tensor values

    @property
    def n_samples(self) -> int:
        return int(self.resid.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.attn.shape[1])

    def bookkeeping(self, dim: int) -> tuple[float, float]:
        """(largest |embedding + writes - value| over samples and blocks, that over the largest |value|) on ``dim``."""
        v = self.resid[:, :, dim].double()
        rebuilt = torch.cat(
            [v[:, :1], v[:, :1] + (self.attn[:, :, dim].double() + self.mlp[:, :, dim].double()).cumsum(1)], 1
        )
        err = float((rebuilt - v).abs().max())
        return err, err / max(float(v.abs().max()), TINY)

    def bookkeeping_tolerance(self) -> float:
        """The largest relative error of :meth:`bookkeeping` that still adds up: 1e-4 in float32, 8 rounding units
        of a bf16 / fp16 stream (0.0625 in bf16; SmolLM2 measures ~0.01 there, against 1e-7 in float32)."""
        return max(1e-4, 8 * torch.finfo(getattr(torch, self.dtype)).eps)


def _abs_max(x: torch.Tensor) -> torch.Tensor:
    """The largest |x| over dim 1, without an |x| copy (about 1.5x faster on the CPU)."""
    return torch.maximum(x.amax(1), x.amin(1).neg())


def _other(out: dict, key: str, x: torch.Tensor) -> None:
    """Sums over samples of the mean (and, for the stream, the largest |value|) over positions t > 0."""
    if x.shape[1] < 2:
        return
    rest = x[:, 1:]
    out[f"{key}_sum"] = rest.mean(1).double().sum(0)
    if key in ("resid", "post"):
        out[f"{key}_max"] = _abs_max(rest).double().sum(0)


def first_token_stats(acts: dict) -> dict:
    """:class:`SpikeOriginAccumulator`'s reduce of one block (torch only: a remote trace ships it): the first token's
    stream entering the block, its attention (or mixer: "mid" - "pre") and MLP writes, its MLP input x and neurons,
    and the other tokens' sums over samples.

    Parameters
    ----------
    acts : dict
        {"pre", "attn" or "mid", "mlp", "x"; a dense block's "act", "up" (and "gate"); the last block's "post"}.

    Returns
    -------
    dict
        "first" (B, 3, D), "x" (B, D), the sums "resid_sum", "resid_max", "attn_sum", "mlp_sum"; with neurons "act"
        (B, M) and the sums "act_other", "act_other_max", "up_first", "up_other" ("gate_first", "gate_other"); for
        the last block "post" (B, D), "post_sum", "post_max".
    """
    pre = acts["pre"].detach().float()
    attn = acts["attn"].float() if "attn" in acts else acts["mid"].float() - pre
    mlp = acts["mlp"].detach().float()
    out = {"first": torch.stack([pre[:, 0], attn[:, 0], mlp[:, 0]], 1)}
    out["x"] = acts["x"][:, 0].float().clone()  # a copy: a view would keep the layer's whole (B, T, D) input alive
    for key, x in (("resid", pre), ("attn", attn), ("mlp", mlp)):
        _other(out, key, x)
    if "act" in acts:
        # Sums over (sample, position) as a sum over positions then samples: on the CPU about 20x faster than one
        # reduction over both dims of the strided slice t > 0 (which walks d_mlp columns one at a time).
        a = acts["act"].detach().float()
        rest = a[:, 1:]
        out["act"] = a[:, 0].clone()
        out["act_other"] = rest.sum(1).sum(0)
        out["act_other_max"] = _abs_max(rest).sum(0) if rest.shape[1] else rest.sum((0, 1))  # T = 1: zeros
        for f in ("gate", "up") if "gate" in acts else ("up",):
            out[f"{f}_first"] = acts[f][:, 0].float().sum(0)
            out[f"{f}_other"] = acts[f][:, 1:].float().sum(1).sum(0)
    if "post" in acts:
        post = acts["post"].detach().float()
        out["post"] = post[:, 0].clone()
        _other(out, "post", post)
    return out


class SpikeOriginAccumulator(Accumulator):
    """Per block and batch: the first token's stream, writes, MLP input and neurons (:class:`FirstTokenTrace`).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    kind : str, optional
        The input kind, a label.
    """

    def __init__(self, model, *, kind: str | None = None):
        self.model, self.kind = model, kind
        self.spec = get_mlp(model)
        dims = model_facts(model).dims
        self.L, self.D = dims.n_layers, int(dims.d_model)
        self.neuron_layers = [l for l in range(self.L) if self.spec.has_neurons(l)]
        self.first = LayerCollector(list(range(self.L)))  # (N, L, 3, D): resid, attn, mlp of the first token
        self.x = LayerCollector(list(range(self.L)))  # (N, L, D): the MLP input
        self.acts = LayerCollector(self.neuron_layers)  # (N, L', M)
        L, D = self.L, self.D
        self.sums = {
            k: torch.zeros(L + (k.startswith("resid")), D, dtype=torch.float64)
            for k in ("resid", "resid_max", "attn", "mlp")
        }
        self.neuron_sums: dict[int, dict[str, torch.Tensor]] = {}
        self.post: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []
        self.n, self.T = 0, 0

    def hooks(self):
        out = {}
        for l in range(self.L):
            h = {"pre": act_name("resid_pre", l), "mlp": act_name("mlp_out", l)}
            attn = self.spec.attn_write_hook(l)
            h.update({"attn": attn} if attn else {"mid": act_name("resid_mid", l)})
            if self.spec._input_hook:
                h["x"] = self.spec._input_hook.format(layer=l)
            else:
                h["h"] = act_name(self.spec.input_resid, l)
            if l in self.neuron_layers:
                h["act"], h["up"] = self.spec.neuron_hook(l), self.spec.up_hook(l)
                if self.spec.kind == "gated":
                    h["gate"] = self.spec.gate_hook(l)
            if l == self.L - 1:
                h["post"] = act_name("resid_post", l)
            out[l] = h
        return out

    def reduction(self, layer: int) -> Reduction:
        return Reduction(first_token_stats)

    @one_thread()
    def update(self, layer: int, acts: dict, batch: Batch) -> None:
        if "h" in acts:  # the MLP input made here from the residual it reads (a model without an input hook)
            acts = {**acts, "x": mlp_input(self.model, layer, acts["h"][:, :1])}
        self.fold(layer, first_token_stats(acts), batch)

    def fold(self, layer: int, stats: dict, batch: Batch) -> None:
        self.first.put(layer, stats["first"])
        self.x.put(layer, stats["x"])
        for key, i in (("resid", layer), ("attn", layer), ("mlp", layer), ("post", self.L)):
            if f"{key}_sum" in stats:
                k = "resid" if key == "post" else key
                self.sums[k][i] += stats[f"{key}_sum"].cpu()
                if k == "resid":
                    self.sums["resid_max"][i] += stats[f"{key}_max"].cpu()
        if "act" in stats:
            self.acts.put(layer, stats["act"])
            s = self.neuron_sums.setdefault(layer, {})
            for k, v in stats.items():
                if k.endswith(("_first", "_other", "_other_max")):
                    s[k] = s.get(k, 0) + v.double().cpu()
        if "post" in stats:
            self.post.append(stats["post"].cpu())

    def end_batch(self, batch: Batch, logits) -> None:
        self.first.end_batch()
        self.x.end_batch()
        if self.neuron_layers:
            self.acts.end_batch()
        self.ids.append(batch.tokens[:, 0].cpu())
        self.n += batch.size
        self.T = batch.tokens.shape[1]

    def result(self) -> FirstTokenTrace:
        first = self.first.result()  # (N, L, 3, D)
        n, n_other = max(self.n, 1), max(self.n * (self.T - 1), 1)
        nan = float("nan") if self.T < 2 else None
        mean = {k: (v / n).float() if nan is None else torch.full_like(v, nan).float() for k, v in self.sums.items()}
        acts = self.acts.result() if self.neuron_layers else None
        per = {k: {} for k in ("act_other", "act_other_max", "gate_first", "gate_other", "up_first", "up_other")}
        for l, s in self.neuron_sums.items():
            for k, v in s.items():
                per[k][l] = (v / (n_other if k.endswith("_other") else n)).float()
        resid = torch.cat([first[:, :, 0], torch.cat(self.post)[:, None]], 1)
        x = self.x.result()
        return FirstTokenTrace(
            resid=resid,
            attn=first[:, :, 1],
            mlp=first[:, :, 2],
            other_resid=mean["resid"],
            other_resid_max=mean["resid_max"],
            other_attn=mean["attn"],
            other_mlp=mean["mlp"],
            mlp_in={l: x[:, l] for l in range(self.L)},
            act_first={l: acts[:, i] for i, l in enumerate(self.neuron_layers)} if acts is not None else {},
            **per,
            first_ids=torch.cat(self.ids),
            T=self.T,
            dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
        )


__all__ = ["FirstTokenTrace", "SpikeOriginAccumulator", "first_token_stats"]
