"""Causal tests of the sink mechanism: intervene inside the forward pass, measure sink, attention and loss.

- ``spike_ablation``: set the first token's spike dims in the residual stream to zero, or to their mean
  over the other inputs (leave-one-out), at the layers where they are spikes; compare the sink rate
  and the loss with the unchanged model (Sun et al.: zero breaks the model, the mean does not).
- ``value_ablation``: remove the first token's value from the sink heads' outputs
  (z_t -= A[t, 1] v_1): if the sink is a no-op, the loss hardly moves.
- ``first_key_ablation``: subtract from the first key its part built by the spike dims
  (x_1[S] W_K, see ``analysis.chain.norm_gain``); where does the attention go instead (first token, self,
  previous token, the rest) and does the sink move to another token?

Each condition is one pass of the condition runner (``analysis.causal.conditions.run_condition``): intervention hooks
change activations, the runner measures the sink, the attention shares and the loss. Each ablation shares the
unchanged model's pass (``analysis.causal.conditions.Baseline``: ``baseline_pass``, or ``analysis.profile``).

Every family: the attention is read on the attention layers only (``check_attention_layers``: a hybrid's
linear-attention / Mamba layers are skipped, results keep the true layer index and say which were skipped); the
spike edits act on the residual stream; the first key is edited at ``hook_k`` (the linear key, before any q/k
norm and the rotary, which is the identity at position 0); where ``hook_pattern``
is read-only (``FamilySpec.pattern_live`` False: GPT-J, OPT, Jamba) the value ablation edits ``hook_v``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Mapping, Sequence

import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.causal.conditions import K_MAX, WHERE_KEYS, Baseline, PassResult, baseline_for, run_condition
from analysis.core.defaults import SINK_EPS, SINK_HEAD_MIN_SHARE, SPIKE_ABS, SPIKE_MIN_SHARE, SPIKE_RATIO
from analysis.model.families import get_family
from analysis.model.hooks import (
    ModelContractError,
    act_name,
    check_attention_layers,
    check_dims,
    check_heads,
    check_layers,
    check_tokens,
    hook_names,
    kv_view,
    model_dims,
    per_query_head,
)
from analysis.core.docs import parameters_from
from analysis.model.key_path import key_path
from analysis.chain.massive import criterion_text, first_token_spike_dims
from analysis.engine.attention import attention_of
from analysis.engine.passes import Batch, Reduction, reading
from analysis.model.nnsight_model import NnsightModel
from analysis.core.results import Result, dims_by_layer_text, layer_runs
from analysis.sinks.metric import check_eps

# ------------------------------------------------------------------------- Where the ablations' condition passes resume


def resume_layers(
    model: SinkModel,
    baseline: Baseline,
    spike_dims: Mapping,
    input_dims: Mapping,
    *,
    min_share: float = SINK_HEAD_MIN_SHARE,
) -> list[int]:
    """The blocks where the condition passes of the three ablations resume (the first block each one's hooks touch): the
    residuals worth keeping in ``Baseline.resid`` from a pass over the same tokens. Block 0 is left out.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    baseline : analysis.causal.conditions.Baseline
        The unchanged model's pass (its sink heads decide where ``value_ablation`` starts).
    spike_dims : mapping of int to sequence of int
        ``spike_ablation(spike_dims=...)``: {``hook_resid_post`` layer: dims}.
    input_dims : mapping of int to sequence of int
        ``first_key_ablation(spike_dims=...)``: {block reading them: dims}.
    min_share : float
        The share of samples on which a head's alpha_1 > eps makes it a sink head.

    Returns
    -------
    list of int
    """
    attn = check_attention_layers(model)
    heads = baseline.run.sink().sink_heads(k=1, min_share=min_share)
    firsts = [
        min((int(l) + 1 for l, d in spike_dims.items() if len(d)), default=0),  # hook_resid_post of l: block l + 1
        min((l for l, _ in heads), default=0),
        min((int(l) for l, d in input_dims.items() if len(d) and int(l) in attn), default=0),
    ]
    return sorted({min(l, model_dims(model).n_layers - 1) for l in firsts if l > 0})


def _leave_one_out(x: torch.Tensor) -> torch.Tensor:
    """Each sample's mean over the other samples (dim 0)."""
    return (x.sum(0, keepdim=True) - x) / max(x.shape[0] - 1, 1)


# ----------------------------------------------------------------------------- 1. Spike ablation


def _spike_dims(model, tokens, spike_dims, hook, abs_threshold, ratio_threshold, min_share, *, every_layer=False):
    """{layer: dims} of the first token's spikes at ``hook`` (found, given as a dict, or with ``every_layer`` one list for
    every layer) and how they were chosen ("found", "given")."""
    if spike_dims is None:
        return first_token_spike_dims(
            model, tokens, hook=hook, abs_threshold=abs_threshold, ratio_threshold=ratio_threshold, min_share=min_share
        ), "found"
    if not isinstance(spike_dims, Mapping):
        if not every_layer:
            raise ValueError(
                f"spike_dims must be a dict {{layer: [dims]}} of the residual stream (hook_{hook}) layers where the "
                "first token carries them (e.g. MassiveActivations.first_token_dims), or None to find them."
            )
        spike_dims = dict.fromkeys(range(model_dims(model).n_layers), spike_dims)
    D = model_dims(model).d_model or 0
    layers = check_layers(model, list(spike_dims))
    given = {l: check_dims(ds, D, name="spike dims") for l, ds in zip(layers, spike_dims.values())}
    return {l: d for l, d in given.items() if d}, "given"


def _appear_layers(spikes: dict[int, list[int]]) -> dict[int, list[int]]:
    """Keep each dim only at the first layer of each run of consecutive layers where it is a spike."""
    out: dict[int, list[int]] = {}
    for l in sorted(spikes):
        for d in spikes[l]:
            if d not in spikes.get(l - 1, []):
                out.setdefault(l, []).append(d)
    return out


@dataclass
class SpikeAblation(Result):
    """Sink rate and loss with the first token's spike dims unchanged, zeroed, or set to their mean.

    Attributes
    ----------
    spike_dims : dict of int to list of int
        ``hook_resid_post`` layer -> the dims intervened on.
    where : {"all", "appear"}
        Every layer where a dim is a spike, or only the first of each run.
    has_spike : bool
        False where the first token carries no spike (only the baseline is reported).
    message : str
        How the dims were chosen, or why there are none.
    conditions : pandas.DataFrame
        One row per condition ("baseline", "zero", "mean"): ``sink_1_pct``, ``loss``, ``delta_loss``.
    per_layer : pandas.DataFrame
        One row per attention layer: Sink_1 (%) under each condition.
    means : dict of str to float
        "layer:dim" -> the first token's mean value over all inputs.
    results : dict of str to PassResult
        Condition -> its pass (alpha (N, L, H, k_max), shares, loss).
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    n_samples : int
        N, the number of sequences.
    """

    spike_dims: dict[int, list[int]]  # resid_post layer -> dims intervened on
    where: str
    has_spike: bool
    message: str
    conditions: pd.DataFrame  # condition, sink_1_pct, loss, delta_loss
    per_layer: pd.DataFrame  # layer, sink_1 per condition
    means: dict  # "layer:dim" -> mean value over all inputs
    results: dict = field(default_factory=dict)  # condition -> PassResult
    model_name: str | None = None
    kind: str | None = None
    n_samples: int = 0

    table_fields = ("conditions", "per_layer")

    def effect(self, condition: str) -> dict:
        s = self.conditions.set_index("condition")
        b = s.loc["baseline"]
        return {
            "d_sink_1": float(s.loc[condition, "sink_1_pct"] - b["sink_1_pct"]),
            "d_loss": float(s.loc[condition, "loss"] - b["loss"]),
        }

    def findings(self) -> list[str]:
        if not self.has_spike:
            return [self.message]
        s = self.conditions.set_index("condition")
        return [
            f"Zeroing the first token's spike dims ({dims_by_layer_text(self.spike_dims)}) takes Sink_1 from "
            f"{s.loc['baseline', 'sink_1_pct']:.1f}% to {s.loc['zero', 'sink_1_pct']:.1f}% and the loss from "
            f"{s.loc['baseline', 'loss']:.3f} to {s.loc['zero', 'loss']:.3f}; setting them to their mean over the "
            f"other inputs gives {s.loc['mean', 'sink_1_pct']:.1f}% and {s.loc['mean', 'loss']:.3f}."
        ]

    json_fields = ("spike_dims", "where", "has_spike", "message", "*tables")


class SpikeSetter:
    """Sets the first token's spike dims in ``hook_resid_post`` to zero or to each sample's leave-one-out mean.

    Call ``start(batch)`` before each batch.

    Parameters
    ----------
    spikes : dict of int to list of int
        {``hook_resid_post`` layer: dims}.
    mode : {"zero", "mean"}
    loo : dict of int to torch.Tensor
        {layer: the leave-one-out means, (N, n_dims)} for "mean".
    """

    def __init__(self, spikes: dict[int, list[int]], mode: str, loo: dict[int, torch.Tensor]):
        self.spikes, self.mode, self.loo, self.offset = spikes, mode, loo, 0

    def start(self, batch: Batch) -> None:
        self.offset = batch.offset

    def hooks(self):
        return [(act_name("resid_post", l), partial(self.set, l)) for l in sorted(self.spikes)]

    def _value(self, layer: int, B: int):
        return 0.0 if self.mode == "zero" else self.loo[layer][self.offset : self.offset + B]

    def set(self, layer: int, x: torch.Tensor, hook) -> torch.Tensor:
        return _set_first(x, dims=torch.tensor(self.spikes[layer]), value=self._value(layer, x.shape[0]))

    def edits(self, batch: Batch) -> dict:
        """The same edits in a remote trace (``run_condition``'s ``edits``), at each layer's output."""
        self.start(batch)
        return {
            l: {"resid_post": Reduction(_set_first, {"dims": torch.tensor(d), "value": self._value(l, batch.size)})}
            for l, d in self.spikes.items()
        }


def _set_first(x: torch.Tensor, *, dims: torch.Tensor, value) -> torch.Tensor:
    """``x`` (B, T, D) with the first token's ``dims`` set to ``value`` (a number, or (B, n_dims)): torch only, so a
    remote trace ships it."""
    x = x.clone()
    x[:, 0, dims.to(x.device)] = value.to(x.device, x.dtype) if isinstance(value, torch.Tensor) else value
    return x


def _spike_message(model, spikes: dict, how: str, skipped: str, abs_threshold, ratio_threshold, min_share) -> str:
    """How :func:`spike_ablation`'s dims were chosen or, with none, why there is nothing to ablate."""
    if spikes:
        return f"{how} first-token spike dims: {dims_by_layer_text(spikes)}." + (f" {skipped}" if skipped else "")
    name = getattr(model, "model_name", None) or "the model"
    return (
        f"The first token of {name} carries no spike: no residual dim passes "
        f"{criterion_text(abs_threshold, ratio_threshold)} on {min_share:.0%} of samples, so there is "
        "nothing to ablate (only the baseline is reported). Lower the thresholds or pass spike_dims."
    )


def spike_ablation(
    model: SinkModel,
    tokens,
    *,
    spike_dims: Mapping[int, Sequence[int]] | None = None,
    where: str = "all",
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    min_share: float = SPIKE_MIN_SHARE,
    eps: float = SINK_EPS,
    batch_size: int | None = None,
    baseline: Baseline | None = None,
) -> SpikeAblation:
    """Zero the first token's spike dims, or set them to their mean over the other inputs; measure sink and loss.

    Sun et al.: zero breaks the model, the mean does not.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    tokens : torch.Tensor, shape (N, T)
        Token ids; N >= 2 for the mean condition.
    spike_dims : mapping of int to sequence of int, optional
        {layer: dims} in the residual stream after block ``layer`` (``hook_resid_post``), e.g.
        ``MassiveActivations.first_token_dims``; None finds them (``first_token_spike_dims``).
    where : {"all", "appear"}
        "all" intervenes at every layer where a dim is a spike (later blocks can rebuild a spike zeroed once: SmolLM2
        rebuilds dim 507); "appear" only at the first layer of each run.
    abs_threshold, ratio_threshold, min_share : float
        The spike criterion where the dims are found (see ``analysis.massive_activations``).
    eps : float
        The sink threshold.
    batch_size : int, optional
        Sequences per batch (default: ``analysis.engine.passes.default_batch_size``).
    baseline : analysis.causal.conditions.Baseline, optional
        The shared ``baseline_pass`` of these tokens (run here if not given).

    Returns
    -------
    SpikeAblation
        The mean is leave-one-out: sample i gets the mean of the first token's value over the other samples (the mean
        over all inputs is in ``means``).
    """
    eps = check_eps(eps)
    tokens = check_tokens(model, tokens)
    if where not in ("all", "appear"):
        raise ValueError(f"where must be 'all' or 'appear'; got {where!r}.")
    spikes, how = _spike_dims(model, tokens, spike_dims, "resid_post", abs_threshold, ratio_threshold, min_share)
    if where == "appear":
        spikes = _appear_layers(spikes)
    if spikes and tokens.shape[0] < 2:
        raise ValueError("the mean condition needs at least 2 sequences (a leave-one-out mean over the other inputs).")
    base = baseline_for(model, tokens, baseline, eps, batch_size)
    vals = {l: base.first_resid[:, l, spikes[l]].double() for l in spikes}  # (N, n_dims)
    loo = {l: _leave_one_out(v).float() for l, v in vals.items()}
    means = {f"{l}:{d}": float(vals[l][:, j].mean()) for l in spikes for j, d in enumerate(spikes[l])}
    results = {"baseline": base.run}
    for mode in ("zero", "mean") if spikes else ():  # without a spike only the baseline is reported
        setter = SpikeSetter(spikes, mode, loo)
        results[mode] = run_condition(
            model,
            tokens,
            hooks=setter.hooks(),
            edits=setter.edits,
            eps=eps,
            batch_size=batch_size,
            on_batch_start=setter.start,
            baseline=base,
        )
    conditions = pd.DataFrame(
        [
            {"condition": c, "sink_1_pct": r.sink_rate(1), "loss": r.loss, "delta_loss": r.loss - base.run.loss}
            for c, r in results.items()
        ]
    )
    per_layer = pd.DataFrame({"layer": base.run.layers, **{c: r.sink_per_layer().numpy() for c, r in results.items()}})
    msg = _spike_message(model, spikes, how, base.run.skipped, abs_threshold, ratio_threshold, min_share)
    name = getattr(model, "model_name", None)
    return SpikeAblation(
        spikes, where, bool(spikes), msg, conditions, per_layer, means, results, name, n_samples=len(tokens)
    )


# ----------------------------------------------------------------------------- 2. Value ablation


@dataclass
class ValueAblation(Result):
    """Loss with the first token's value removed from the sink heads (and, as a contrast, from all heads).

    Attributes
    ----------
    sink_heads : list of (int, int)
        The (layer, query head) pairs ablated.
    conditions : pandas.DataFrame
        One row per condition ("baseline", "sink_heads", "sink_heads_later", "sink_heads_mean", "all_heads"):
        ``n_heads``, ``loss``, ``delta_loss``, ``sink_1_pct``.
    heads : pandas.DataFrame
        One row per sink head: alpha_1, |v_1|, mean |v_j|, |A[t, 1] v_1| and |z_t| (means over t > 1).
    message : str
        How the heads were chosen, or why there are none.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    n_samples : int
        N, the number of sequences.
    """

    sink_heads: list[tuple[int, int]]  # (layer, query head)
    conditions: pd.DataFrame  # condition, n_heads, loss, delta_loss, sink_1_pct
    heads: pd.DataFrame  # per sink head: alpha_1, |v_1|, mean |v_j|, |A[t,1] v_1| and |z_t| (means over t > 1)
    message: str
    model_name: str | None = None
    kind: str | None = None
    n_samples: int = 0

    table_fields = ("conditions", "heads")

    def findings(self) -> list[str]:
        if not self.sink_heads:
            return [self.message]
        s = self.conditions.set_index("condition")
        h = self.heads
        later = (
            f", by {s.loc['sink_heads_later', 'delta_loss']:+.4f} if the first token keeps its own output"
            if "sink_heads_later" in s.index
            else ""
        )
        mean = (
            f", and by {s.loc['sink_heads_mean', 'delta_loss']:+.4f} when v_1 is set to its mean over the other inputs"
            if "sink_heads_mean" in s.index
            else ""
        )
        return [
            f"Removing the first token's value from {len(self.sink_heads)} sink heads changes the loss by "
            f"{s.loc['sink_heads', 'delta_loss']:+.4f} (from {s.loc['baseline', 'loss']:.3f}){later}{mean}.",
            f"In those heads the first value's norm is {h['v1_norm'].mean():.2f} against {h['v_other_norm'].mean():.2f} for the other "
            f"tokens: while taking {h['alpha_1'].mean():.1%} of the attention, it adds a vector of norm "
            f"{h['first_contrib_norm'].mean():.2f} to head outputs of norm {h['output_norm'].mean():.2f}.",
        ]

    json_fields = ("sink_heads", "message", "*tables")


class ValueRemoval:
    """z_t -= A[t, 1] v_1 in the chosen heads ("zero"), or z_t -= A[t, 1] (v_1 - its leave-one-out mean) ("mean").

    Call ``start(batch)`` before each batch. Where ``hook_pattern`` is live (fires before the output): hooks on
    hook_pattern, hook_v and hook_z edit z. Where it is not (TransformerLens' generic attention bridge: GPT-J, OPT,
    Jamba; ``FamilySpec.pattern_live``) the same edit is made on the value: v_1 set to 0 (or to its mean) at ``hook_v``
    gives z_t = sum_(j>1) A[t, j] v_j (+ A[t, 1] mean) for every query, exactly; ``first_query=False`` then adds
    v_1 - v_1' back to z_1 (A[1, 1] = 1). With grouped-query attention and KV heads in hook_v this edits the whole KV
    group, so there every query head of a group must be chosen together (``ModelContractError`` otherwise).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    heads : list of (int, int)
        (layer, query head) pairs.
    mode : {"zero", "mean"}
    v_mean : dict of int to torch.Tensor, optional
        {layer: the leave-one-out mean of v_1 for every query head, (N, H, d)} for "mean".
    first_query : bool
        False leaves the first token's own output (t = 1) unchanged.
    """

    def __init__(
        self,
        model,
        heads: list[tuple[int, int]],
        *,
        mode: str = "zero",
        v_mean: dict | None = None,
        first_query: bool = True,
    ):
        dims, spec = model_dims(model), None if isinstance(model, NnsightModel) else get_family(model)
        # a remote trace reads q and k: the pattern is live there
        self.H, self.K, self.live = dims.n_heads, dims.n_kv_heads, spec is None or spec.pattern_live
        self.mode, self.v_mean, self.first_query, self.offset = mode, v_mean, first_query, 0
        self.by_layer: dict[int, torch.Tensor] = {}
        for l, h in heads:
            self.by_layer.setdefault(l, []).append(h)
        self.by_layer = {l: torch.tensor(sorted(hs)) for l, hs in self.by_layer.items()}
        self.state: dict[int, dict] = {}
        if not self.live and spec.learned_sinks:
            raise ModelContractError(
                "the value ablation edits hook_v here (hook_pattern is read-only) and needs "
                "A[1, 1] = 1, which learned sink logits break."
            )

    def start(self, batch: Batch) -> None:
        self.offset = batch.offset

    def hooks(self):
        out = []
        for l in self.by_layer:
            if self.live:
                out += [
                    (act_name("pattern", l), reading(partial(self.on_pattern, l))),
                    (act_name("v", l), reading(partial(self.on_v, l))),
                    (act_name("z", l), partial(self.on_z, l)),
                ]
            else:
                out += [(act_name("v", l), partial(self.set_v, l))]
                out += [] if self.first_query else [(act_name("z", l), partial(self.restore_first, l))]
        return out

    def _mean(self, layer: int, B: int, heads: torch.Tensor) -> torch.Tensor:
        return self.v_mean[layer][self.offset : self.offset + B, heads]  # (B, h, d)

    def on_pattern(self, layer: int, p: torch.Tensor, hook) -> None:
        self.state.setdefault(layer, {})["pattern"] = p

    def on_v(self, layer: int, v: torch.Tensor, hook) -> None:
        self.state.setdefault(layer, {})["v"] = v

    def _params(self, layer: int, B: int) -> dict:
        """:func:`_value_removed`'s parameters for a batch of B sequences from ``self.offset``."""
        h = self.by_layer[layer]
        v_sub = self._mean(layer, B, h) if self.mode == "mean" else None
        return {"heads": h, "H": self.H, "K": self.K, "v_sub": v_sub, "keep_first": not self.first_query}

    def on_z(self, layer: int, z: torch.Tensor, hook) -> torch.Tensor:
        return _value_removed({**self.state.pop(layer), "z": z}, **self._params(layer, z.shape[0]))

    def edits(self, batch: Batch) -> dict:
        """The same removal in a remote trace (``run_condition``'s ``edits``), at each layer's attention output."""
        self.start(batch)
        return {l: {"z": Reduction(_value_removed, self._params(l, batch.size))} for l in self.by_layer}

    def _value_slots(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots of hook_v's head axis to edit, the query head each slot stands for)."""
        heads = self.by_layer[layer]
        if n == self.H:  # one value per query head: edit exactly the chosen heads
            return heads, heads
        group = self.H // n
        slots = torch.unique(heads // group)
        whole = torch.cat([torch.arange(s * group, (s + 1) * group) for s in slots.tolist()])
        if not torch.equal(whole, heads):
            raise ModelContractError(
                f"hook_pattern is read-only here, so the value ablation edits hook_v, which holds {n} KV heads shared "
                f"by groups of {group} query heads: choose whole groups (layer {layer}: heads {whole.tolist()}, not "
                f"{heads.tolist()})."
            )
        return slots, slots * group

    def set_v(self, layer: int, v: torch.Tensor, hook) -> torch.Tensor:
        if v.ndim != 4:
            raise ModelContractError(f"hook_v of layer {layer} has shape {tuple(v.shape)}, not (B, T, heads, d_head).")
        slots, heads = self._value_slots(layer, v.shape[2])
        slots = slots.to(v.device)
        old = v[:, 0, slots]  # (B, s, d)
        new = (
            torch.zeros_like(old) if self.mode == "zero" else self._mean(layer, v.shape[0], heads).to(v.device, v.dtype)
        )
        v = v.clone()
        v[:, 0, slots] = new
        group = 1 if v.shape[2] == self.H else self.H // v.shape[2]
        self.state[layer] = {"diff": (old - new).repeat_interleave(group, dim=1)}  # (B, h, d), the chosen query heads
        return v

    def restore_first(self, layer: int, z: torch.Tensor, hook) -> torch.Tensor:
        """z_1 of the chosen heads back to its unchanged value (A[1, 1] = 1: z_1 = v_1)."""
        diff, hidx = self.state.pop(layer)["diff"], self.by_layer[layer].to(z.device)
        z = z.clone()
        z[:, 0, hidx] += diff.to(z.dtype)
        return z


def _value_removed(acts: dict, *, heads, H: int, K: int, v_sub=None, keep_first: bool = False) -> torch.Tensor:
    """One attention layer's {"pattern", "v", "z"} -> z with z_t -= A[t, 1] (v_1 - ``v_sub``) in ``heads`` (H query, K
    KV heads), in float32 and rounded once to z's dtype (bf16: no double rounding); ``keep_first`` leaves z_1. Torch
    only: the hooks here and a remote trace make the same edit."""
    z, hidx = acts["z"], heads.to(acts["z"].device)
    a1 = attention_of(acts["pattern"]).column(0)[:, hidx].float()  # (B, h, T)
    v1 = per_query_head(kv_view(acts["v"], K), H)[:, 0][:, hidx].float()  # (B, h, d)
    if v_sub is not None:
        v1 = v1 - v_sub.to(v1.device, v1.dtype)
    contrib = a1.permute(0, 2, 1)[..., None] * v1[:, None]  # (B, T, h, d)
    if keep_first:
        contrib[:, 0] = 0
    z = z.clone()
    z[:, :, hidx] = (z[:, :, hidx].float() - contrib.to(z.device)).to(z.dtype)
    return z


@parameters_from(spike_ablation)
def value_ablation(
    model: SinkModel,
    tokens,
    *,
    sink_heads: Sequence[tuple[int, int]] | None = None,
    eps: float = SINK_EPS,
    min_share: float = SINK_HEAD_MIN_SHARE,
    all_heads: bool = True,
    later: bool = True,
    batch_size: int | None = None,
    baseline: Baseline | None = None,
) -> ValueAblation:
    """Remove the first token's value from the sink heads' outputs; compare the loss with the unchanged model.

    For head h and query t the output z_t = sum_j A[t, j] v_j becomes z_t - A[t, 1] v_1 (with GQA, v_1 of the head's KV
    group). Conditions: ``sink_heads`` (every query), with ``later`` ``sink_heads_later`` (queries t > 1 only: the first
    token's own output, which feeds its later layers, is kept), ``sink_heads_mean`` (v_1 set to its mean over the other
    inputs: does v_1 carry anything input-specific?) and, with ``all_heads``, ``all_heads`` (v_1 removed from every
    head, a contrast).

    Parameters
    ----------
    model, eps, batch_size, baseline
        As in :func:`spike_ablation`.
    tokens : torch.Tensor, shape (N, T)
        Token ids.
    sink_heads : sequence of (int, int), optional
        (layer, query head) pairs; None takes the heads whose alpha_1 > eps on at least ``min_share`` of the samples.
    min_share : float
        A fraction of the samples (see ``sink_heads``).
    all_heads : bool
        Add the contrast with v_1 removed from every head.
    later : bool
        Add the condition that keeps the first token's own output.

    Returns
    -------
    ValueAblation
    """
    eps = check_eps(eps)
    tokens = check_tokens(model, tokens)
    heads = None if sink_heads is None else sorted(check_heads(model, sink_heads, name="sink_heads"))
    base = baseline_for(model, tokens, baseline, eps, batch_size)
    if heads is None:
        heads = base.run.sink(getattr(model, "model_name", None)).sink_heads(k=1, min_share=min_share)
        how = f"found (alpha_1 > {eps} on >= {min_share:.0%} of samples)"
    else:
        how = "given"
    rows, name = [_loss_row("baseline", 0, base.run, base.run.loss)], getattr(model, "model_name", None)
    if not heads:
        msg = (
            f"{name or 'the model'} has no sink heads (alpha_1 > {eps} on >= {min_share:.0%} of samples): nothing to "
            "ablate."
        )
        cols = ["layer", "head", "alpha_1", "v1_norm", "v_other_norm", "first_contrib_norm", "output_norm"]
        return ValueAblation([], pd.DataFrame(rows), pd.DataFrame(columns=cols), msg, name, n_samples=len(tokens))
    table = base.value_heads.set_index(["layer", "head"]).loc[heads].reset_index()
    # one row per condition (the loss and Sink_1 with the first token's value removed from the heads it names)
    N = tokens.shape[0]
    v_mean = {
        l: _leave_one_out(base.v1[:, i].double()).float()
        for l, i in zip(base.run.layers, base.run.positions(base.run.layers))
        if l in {l for l, _ in heads}
    }
    every = [(l, h) for l in base.run.layers for h in range(model_dims(model).n_heads)]
    conditions = [("sink_heads", heads, "zero", True)] + ([("sink_heads_later", heads, "zero", False)] if later else [])
    conditions += ([("sink_heads_mean", heads, "mean", True)] if N >= 2 else []) + (
        [("all_heads", every, "zero", True)] if all_heads else []
    )
    removals = [  # built (and checked) before any pass
        (c, len(hs), ValueRemoval(model, hs, mode=mode, v_mean=v_mean, first_query=fq))
        for c, hs, mode, fq in conditions
    ]
    run = partial(run_condition, model, tokens, eps=eps, batch_size=batch_size, baseline=base)
    rows += [
        _loss_row(c, n, run(hooks=r.hooks(), edits=r.edits, on_batch_start=r.start), base.run.loss)
        for c, n, r in removals
    ]
    msg = f"{how}: {len(heads)} sink heads." + (f" {base.run.skipped}" if base.run.skipped else "")
    return ValueAblation(heads, pd.DataFrame(rows), table, msg, name, n_samples=len(tokens))


def _loss_row(condition: str, n_heads: int, r: PassResult, base_loss: float) -> dict:
    """One row of ``ValueAblation.conditions``: a condition's loss, its change and Sink_1."""
    return {
        "condition": condition,
        "n_heads": n_heads,
        "loss": r.loss,
        "delta_loss": r.loss - base_loss,
        "sink_1_pct": r.sink_rate(1),
    }


# ----------------------------------------------------------------------------- 3. First-key ablation


@dataclass
class FirstKeyAblation(Result):
    """Attention with the spike-driven part of the first key removed, against the unchanged model.

    Attributes
    ----------
    layers : list of int
        The layers whose first key was changed.
    spike_dims : dict of int to list of int
        Layer (the block whose ln1 reads them) -> dims.
    has_spike : bool
        False where no chosen layer's input carries a spike (only the baseline is reported).
    message : str
        How the dims were chosen, or why there are none.
    conditions : pandas.DataFrame
        One row per condition ("baseline", "ablated"): the attention shares of queries t >= 3 on the first, previous,
        own and other keys, Sink_1..Sink_k and the loss, over the ablated layers.
    per_layer : pandas.DataFrame
        The same per (layer, condition).
    results : dict of str to PassResult
        Condition -> its pass.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    n_samples : int
        N, the number of sequences.
    """

    layers: list[int]  # layers whose first key was changed
    spike_dims: dict[int, list[int]]  # layer (the block whose ln1 reads them) -> dims
    has_spike: bool
    message: str
    conditions: pd.DataFrame  # condition x (first, previous, self, other, sink_1..sink_k, loss), over ablated layers
    per_layer: pd.DataFrame  # layer, condition, first, previous, self, other, sink_1, sink_2
    results: dict = field(default_factory=dict)
    model_name: str | None = None
    kind: str | None = None
    n_samples: int = 0

    table_fields = ("conditions", "per_layer")

    def findings(self) -> list[str]:
        if not self.has_spike:
            return [self.message]
        s = self.conditions.set_index("condition")
        b, a = s.loc["baseline"], s.loc["ablated"]
        gain = {k: a[k] - b[k] for k in ("previous", "self", "other")}
        top = max(gain, key=gain.get)
        return [
            f"Removing the spike-driven part of the first key in layers {layer_runs(self.layers)} moves the attention of "
            f"later queries there from the first token ({b['first']:.1%} -> {a['first']:.1%}) mostly to "
            f"'{top}' keys ({b[top]:.1%} -> {a[top]:.1%}); Sink_1 in those layers {b['sink_1']:.1f}% -> "
            f"{a['sink_1']:.1f}%, Sink_2 {b['sink_2']:.1f}% -> {a['sink_2']:.1f}%; loss {b['loss']:.3f} -> {a['loss']:.3f}."
        ]

    json_fields = ("layers", "spike_dims", "has_spike", "message", "*tables")


class FirstKeyRemoval:
    """Hooks that subtract k_1^S = (g * norm(h_1))[S] W_K from the first key of each layer (before the rotary, which is
    the identity at position 0).

    Parameters
    ----------
    paths : dict of int to KeyPath
        {layer: its key path}.
    spikes : dict of int to list of int
        {layer: S, the dims}.
    D : int
        d_model.
    """

    def __init__(self, paths: dict, spikes: dict[int, list[int]], D: int):
        self.paths, self.state = paths, {}
        self.masks = {l: torch.zeros(D, dtype=torch.bool).index_fill_(0, torch.tensor(spikes[l]), True) for l in paths}

    def hooks(self, names=frozenset()):
        """Where ``names`` (the model's hooks) has the key projection's input (``attn.k.hook_in``), the first token's
        dims S zeroed there, as in :meth:`edits` (every backend applies it); else k_1^S subtracted at the key hook."""
        out = []
        for l, p in self.paths.items():
            if (k_in := f"blocks.{l}.attn.k.hook_in") in names:
                out.append(
                    (k_in, lambda x, hook, dims=self.masks[l].nonzero()[:, 0]: _set_first(x, dims=dims, value=0.0))
                )
            else:
                out += [(act_name("resid_pre", l), partial(self.on_resid, l)), (p.key_hook, partial(self.on_k, l))]
        return out

    def on_resid(self, layer: int, h: torch.Tensor, hook) -> None:
        norm = self.paths[layer].norm
        self.state[layer] = norm.affine(norm.normalise(h[:, :1])) * self.masks[layer].to(h.device)  # (B, 1, D)

    def edits(self, batch: Batch) -> dict:
        """The same removal in a remote trace (``run_condition``'s ``edits``): the key projection's input with the
        first token's dims S zeroed (x W_K is linear: that removes exactly k_1^S, and nothing but the key)."""
        return {
            l: {"k_in": Reduction(_set_first, {"dims": m.nonzero()[:, 0], "value": 0.0})} for l, m in self.masks.items()
        }

    def on_k(self, layer: int, k: torch.Tensor, hook) -> torch.Tensor:
        kS = self.paths[layer].keys(self.state.pop(layer), torch.zeros(1, dtype=torch.long), bias=False, rotary=False)
        k = k.clone()
        k[:, :1] -= kS.to(k.dtype)
        return k


@parameters_from(spike_ablation)
def first_key_ablation(
    model: SinkModel,
    tokens,
    *,
    layers: Sequence[int] | None = None,
    spike_dims: Mapping[int, Sequence[int]] | Sequence[int] | None = None,
    abs_threshold: float = SPIKE_ABS,
    ratio_threshold: float = SPIKE_RATIO,
    min_share: float = SPIKE_MIN_SHARE,
    eps: float = SINK_EPS,
    k_max: int = K_MAX,
    batch_size: int | None = None,
    baseline: Baseline | None = None,
) -> FirstKeyAblation:
    """Subtract k_1^S = (g * norm(h_1))[S] W_K from the first key of each layer; see where the attention goes.

    All the chosen layers are changed in the same pass. The attention shares are over queries t >= 3 of the changed
    layers: first key, previous key, the query's own key, the rest.

    Parameters
    ----------
    model, abs_threshold, ratio_threshold, min_share, eps, batch_size
        As in :func:`spike_ablation`.
    tokens : torch.Tensor, shape (N, T)
        Token ids.
    layers : sequence of int, optional
        Where to intervene (default: every attention layer whose input carries first-token spike dims).
    spike_dims : mapping of int to sequence of int, or sequence of int, optional
        {layer: dims} of the stream each layer's ln1 reads (``hook_resid_pre``), a list of dims for every layer, or
        None to find them (``first_token_spike_dims`` on ``hook_resid_pre``).
    k_max : int
        Keys whose alpha is kept (Sink_1..Sink_k_max).
    baseline : analysis.causal.conditions.Baseline, optional
        The shared ``baseline_pass`` of these tokens (run here if not given).
        Used when ``k_max`` is the default 4.

    Returns
    -------
    FirstKeyAblation
    """
    eps = check_eps(eps)
    tokens = check_tokens(model, tokens)
    remote = isinstance(model, NnsightModel)
    if remote and model.spec.latent:
        raise ModelContractError("a remote trace edits k_proj's input, which latent attention has not: run it here.")
    spikes, how = _spike_dims(
        model, tokens, spike_dims, "resid_pre", abs_threshold, ratio_threshold, min_share, every_layer=True
    )
    attn = check_attention_layers(model)
    layers = (
        check_attention_layers(model, layers=layers)
        if layers is not None
        else sorted(l for l, d in spikes.items() if d and l in attn)
    )
    layers = [l for l in layers if spikes.get(l)]
    full = baseline_for(model, tokens, baseline, eps, batch_size) if k_max == K_MAX else None
    base = full.run if full is not None else run_condition(model, tokens, eps=eps, k_max=k_max, batch_size=batch_size)
    results, name = {"baseline": base}, getattr(model, "model_name", None)
    if layers:
        paths = {l: None if remote else key_path(model, l) for l in layers}  # remote: the trace's own k_proj
        removal = FirstKeyRemoval(paths, spikes, model_dims(model).d_model)
        hooks = () if remote else removal.hooks(hook_names(model))
        results["ablated"] = run_condition(
            model, tokens, hooks=hooks, edits=removal.edits, eps=eps, k_max=k_max, batch_size=batch_size, baseline=full
        )
        msg = f"{how} spike dims; changed the first key in layers {layer_runs(layers)}." + (
            f" {base.skipped}" if base.skipped else ""
        )
    else:
        msg = (
            f"The first token of {name or 'the model'} carries no spike in the stream any chosen layer reads "
            f"({criterion_text(abs_threshold, ratio_threshold)}, on {min_share:.0%} of samples): there is no "
            "spike-driven key part to remove. Pass spike_dims or lower the thresholds."
        )
    conditions = [
        {"condition": c, **_fk_row(r, r.positions(layers or base.layers), k_max), "loss": r.loss}
        for c, r in results.items()
    ]
    per_layer = [
        {"layer": l, "condition": c, **_fk_row(r, [i], min(k_max, 2))}
        for c, r in results.items()
        for i, l in enumerate(r.layers)
    ]
    return FirstKeyAblation(
        layers,
        {l: spikes[l] for l in layers},
        bool(layers),
        msg,
        pd.DataFrame(conditions),
        pd.DataFrame(per_layer),
        results,
        name,
        n_samples=len(tokens),
    )


def _fk_row(r: PassResult, pos: list[int], k_top: int) -> dict:
    """A pass's attention shares and Sink_1..k_top (%) over the layers at positions ``pos`` of its layer axis."""
    w, ks = r.where[pos].mean(dim=(0, 1)), range(1, min(k_top, r.alpha.shape[-1]) + 1)
    sinks = {f"sink_{k}": float((r.alpha[:, pos, :, k - 1] > r.eps).float().mean() * 100) for k in ks}
    return {**{k: float(w[i]) for i, k in enumerate(WHERE_KEYS)}, **sinks}


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, Section, register  # noqa: E402


register(
    Analysis(
        "interventions",
        result=(SpikeAblation, ValueAblation, FirstKeyAblation),
        order=210,
        doc="Spike, value and first-key ablations (passes of their own, sharing the profile's baseline).",
        # resid: later passes resume from the profile's residuals
        sections=(
            Section(
                "Interventions",
                "cuts",
                80,
                needs=("baseline", "massive", "resid"),
                runner="analysis.report.sections:_interventions",
            ),
        ),
        exports=("first_key_ablation", "spike_ablation", "value_ablation"),
    )
)
