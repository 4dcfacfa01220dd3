"""Causal tests of the sink mechanism: intervene inside the forward pass, measure sink, attention and loss.

- ``spike_ablation``: set the first token's spike dims in the residual stream to zero, or to their mean
  over the other inputs (leave-one-out), at the layers where they are spikes; compare the sink rate
  and the loss with the unchanged model (Sun et al.: zero breaks the model, the mean does not).
- ``value_ablation``: remove the first token's value from the sink heads' outputs
  (z_t -= A[t, 1] v_1): if the sink is a no-op, the loss hardly moves.
- ``first_key_ablation``: subtract from the first key its part built by the spike dims
  (x_1[S] W_K, see ``analysis.norm_gain``); where does the attention go instead (first token, self,
  previous token, the rest) and does the sink move to another token?

Each condition is one streamed pass: intervention hooks change activations, reducers on
``hook_pattern`` fold the attention into per-(sample, layer, head) numbers, and the loss is
accumulated per batch. Nothing else is kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import pandas as pd
import torch

from analysis.hooks import (
    ModelContractError,
    check_layers,
    check_tokens,
    hook_names,
    model_dims,
    run_with_reducers,
)
from analysis.sink import DEFAULT_EPS, SinkResult, alpha_from_pattern, check_eps

WHERE_KEYS = ("first", "previous", "self", "other")

# ----------------------------------------------------------------------------------------------
# One streamed pass under interventions
# ----------------------------------------------------------------------------------------------


@dataclass
class PassResult:
    """What one pass over the tokens leaves: alpha per (sample, layer, head, key), attention shares, loss."""

    alpha: torch.Tensor  # (N, L, H, K)
    where: torch.Tensor  # (L, H, 4) mean attention share of queries t >= 3 on first/previous/self/other keys
    loss: float
    eps: float
    T: int

    def sink(self, model_name=None, kind=None) -> SinkResult:
        return SinkResult(self.alpha, self.eps, self.T, model_name, kind)

    def sink_rate(self, k: int = 1) -> float:
        return float((self.alpha[..., k - 1] > self.eps).float().mean() * 100)


def where_shares(pattern: torch.Tensor) -> torch.Tensor:
    """Attention shares of queries t >= 3 (1-based) on the first key, the previous key, itself and the rest.

    pattern (B, H, T, T) -> (B, H, 4), summed over those queries (divide by T - 2 for the mean).
    The four categories are disjoint and sum to 1 for every query.
    """
    T = pattern.shape[-1]
    p = pattern[..., 2:, :].float()  # queries t = 2..T-1 (0-based)
    t = torch.arange(2, T, device=pattern.device)
    first = p[..., 0]
    prev = p.gather(-1, (t - 1).expand(*p.shape[:-2], -1)[..., None])[..., 0]
    self_ = p.gather(-1, t.expand(*p.shape[:-2], -1)[..., None])[..., 0]
    total = p.sum(-1)
    other = total - first - prev - self_
    return torch.stack([first, prev, self_, other], -1).sum(-2)


def run_condition(
    model,
    tokens: torch.Tensor,
    hooks: Sequence[tuple[str, Callable]] = (),
    *,
    eps: float = DEFAULT_EPS,
    k_max: int = 4,
    batch_size: int | None = None,
    on_batch_start: Callable[[int, int], None] | None = None,
) -> PassResult:
    """One pass with intervention ``hooks`` (fns returning the changed activation) plus attention reducers.

    ``on_batch_start(offset, B)`` is called before each batch (hooks that need sample indices use it).
    """
    dims = model_dims(model)
    tokens = check_tokens(model, tokens)
    N, T = tokens.shape
    k_max = min(k_max, T)
    L = dims.n_layers
    chunks: list[torch.Tensor] = []
    cur: list[torch.Tensor | None] = [None] * L
    where = torch.zeros(L, dims.n_heads, 4, dtype=torch.float64)
    loss = {"sum": 0.0, "n": 0}
    offset = [0]

    def reducer(layer: int):
        def fn(pattern, hook):
            cur[layer] = alpha_from_pattern(pattern, k_max).cpu()
            if T >= 3:
                where[layer] += where_shares(pattern).double().sum(0).cpu()
        return fn

    def first_hook(x, hook):  # runs first in every batch: tell stateful hooks which samples these are
        if on_batch_start is not None:
            on_batch_start(offset[0], x.shape[0])

    def collect(batch, logits):
        missing = [l for l, a in enumerate(cur) if a is None]
        if missing:
            raise RuntimeError(f"hook_pattern did not fire for layers {missing}.")
        chunks.append(torch.stack(cur, dim=1))
        cur[:] = [None] * L
        lg = logits[:, :-1].float()
        loss["sum"] += float(torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"))
        loss["n"] += lg.shape[0] * lg.shape[1]
        offset[0] += batch.shape[0]

    all_hooks = [("blocks.0.hook_resid_pre", first_hook)] + list(hooks)
    all_hooks += [(f"blocks.{l}.attn.hook_pattern", reducer(l)) for l in range(L)]
    run_with_reducers(model, tokens, all_hooks, batch_size=batch_size, on_batch=collect)
    return PassResult(torch.cat(chunks), (where / (N * max(T - 2, 1))).float(),
                      loss["sum"] / max(loss["n"], 1) if T > 1 else float("nan"), eps, T)


def _sink_per_layer(res: PassResult, k: int = 1) -> torch.Tensor:
    return (res.alpha[..., k - 1] > res.eps).float().mean(dim=(0, 2)) * 100


def _clean(v):
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, (torch.Tensor,)):
        return v.tolist()
    if hasattr(v, "item"):
        return v.item()
    return v


def _records(df: pd.DataFrame) -> list[dict]:
    return [{k: _clean(v) for k, v in r.items()} for r in df.to_dict("records")]


# ----------------------------------------------------------------------------------------------
# 1. Spike ablation
# ----------------------------------------------------------------------------------------------


def _spike_map(model, tokens, spike_dims, abs_threshold, ratio_threshold, min_share, max_samples=32):
    """{resid_post layer: [dims]} of the first token's spikes (found, or given as a dict or list)."""
    from analysis.massive import massive_activations

    D = model_dims(model).d_model
    if spike_dims is None:
        ma = massive_activations(model, tokens[:max_samples], top_k=1, abs_threshold=abs_threshold,
                                 ratio_threshold=ratio_threshold, min_share=min_share)
        return ma.first_token_dims, "found"
    if isinstance(spike_dims, Mapping):
        layers = check_layers(model, list(spike_dims))
        out = {l: sorted({int(d) for d in spike_dims[l]}) for l in layers}
    else:
        raise ValueError("spike_dims must be a dict {layer: [dims]} of the residual stream (hook_resid_post) layers "
                         "where the first token carries them (e.g. MassiveActivations.first_token_dims), or None to find them.")
    bad = sorted({d for ds in out.values() for d in ds if not 0 <= d < D})
    if bad:
        raise ValueError(f"spike dims {bad} out of range: d_model is {D}.")
    return {l: d for l, d in out.items() if d}, "given"


def _appear_layers(spikes: dict[int, list[int]]) -> dict[int, list[int]]:
    """Keep each dim only at the first layer of each run of consecutive layers where it is a spike."""
    out: dict[int, list[int]] = {}
    for l in sorted(spikes):
        for d in spikes[l]:
            if d not in spikes.get(l - 1, []):
                out.setdefault(l, []).append(d)
    return out


@dataclass
class SpikeAblation:
    """Sink rate and loss with the first token's spike dims unchanged, zeroed, or set to their mean."""

    spike_dims: dict[int, list[int]]  # resid_post layer -> dims intervened on
    where: str
    has_spike: bool
    message: str
    summary: pd.DataFrame  # condition, sink_1_pct, loss, delta_loss
    per_layer: pd.DataFrame  # layer, sink_1 per condition
    means: dict  # (layer, dim) -> mean value used by the mean condition (over all inputs)
    results: dict = field(default_factory=dict)  # condition -> PassResult
    model_name: str | None = None

    def effect(self, condition: str) -> dict:
        s = self.summary.set_index("condition")
        b = s.loc["baseline"]
        return {"d_sink_1": float(s.loc[condition, "sink_1_pct"] - b["sink_1_pct"]),
                "d_loss": float(s.loc[condition, "loss"] - b["loss"])}

    def text(self) -> str:
        if not self.has_spike:
            return self.message
        s = self.summary.set_index("condition")
        return (f"Zeroing the first token's spike dims ({_dims_text(self.spike_dims)}) takes Sink_1 from "
                f"{s.loc['baseline', 'sink_1_pct']:.1f}% to {s.loc['zero', 'sink_1_pct']:.1f}% and the loss from "
                f"{s.loc['baseline', 'loss']:.3f} to {s.loc['zero', 'loss']:.3f}; setting them to their mean over the "
                f"other inputs gives {s.loc['mean', 'sink_1_pct']:.1f}% and {s.loc['mean', 'loss']:.3f}.")

    def to_dict(self) -> dict:
        return {
            "model": self.model_name,
            "spike_dims": {str(l): d for l, d in self.spike_dims.items()},
            "where": self.where,
            "has_spike": self.has_spike,
            "message": self.message,
            "summary": _records(self.summary),
            "per_layer": _records(self.per_layer),
            "text": self.text(),
        }


def _dims_text(spikes: dict[int, list[int]]) -> str:
    from analysis.massive import _layer_runs

    by_dim: dict[int, list[int]] = {}
    for l, ds in spikes.items():
        for d in ds:
            by_dim.setdefault(d, []).append(l)
    return "; ".join(f"dim {d} at layers {_layer_runs(ls)}" for d, ls in sorted(by_dim.items()))


def spike_ablation(
    model,
    tokens,
    spike_dims: Mapping[int, Sequence[int]] | None = None,
    where: str = "all",
    abs_threshold: float = 100.0,
    ratio_threshold: float = 1000.0,
    min_share: float = 0.5,
    eps: float = DEFAULT_EPS,
    batch_size: int | None = None,
) -> SpikeAblation:
    """Zero the first token's spike dims, or set them to their mean over the other inputs; measure sink and loss.

    ``spike_dims``: {layer: dims} in the residual stream after block ``layer`` (``hook_resid_post``),
    e.g. ``MassiveActivations.first_token_dims``; None finds them with ``massive_activations``
    (``abs_threshold``, ``ratio_threshold``, ``min_share``). ``where="all"`` intervenes at every layer
    where a dim is a spike (later blocks can rebuild a spike zeroed once: SmolLM2 rebuilds dim 507);
    ``where="appear"`` only at the first layer of each run. The mean is leave-one-out: sample i gets the
    mean of the first token's value over the other samples (the mean over all inputs is in ``means``).
    """
    eps = check_eps(eps)
    tokens = check_tokens(model, tokens)
    if where not in ("all", "appear"):
        raise ValueError(f"where must be 'all' or 'appear'; got {where!r}.")
    N = tokens.shape[0]
    spikes, how = _spike_map(model, tokens, spike_dims, abs_threshold, ratio_threshold, min_share)
    if where == "appear":
        spikes = _appear_layers(spikes)
    name = getattr(model, "model_name", None) or "the model"
    # The baseline pass also records the first token's values at the intervention points (for the means).
    layers = sorted(spikes)
    idx = {l: torch.tensor(spikes[l]) for l in layers}
    values = {l: [] for l in layers}

    def rec(l):
        def fn(x, hook):
            values[l].append(x[:, 0, idx[l].to(x.device)].detach().double().cpu())
        return fn

    base = run_condition(model, tokens, [(f"blocks.{l}.hook_resid_post", rec(l)) for l in layers], eps=eps,
                         batch_size=batch_size)
    results = {"baseline": base}
    if not spikes:
        msg = (f"The first token of {name} carries no spike: no residual dim passes |a| > {abs_threshold:g} and "
               f">= {ratio_threshold:g}x the hidden state's median on {min_share:.0%} of samples, so there is "
               "nothing to ablate (only the baseline is reported). Lower the thresholds or pass spike_dims.")
        summary = pd.DataFrame([{"condition": "baseline", "sink_1_pct": base.sink_rate(1), "loss": base.loss, "delta_loss": 0.0}])
        per_layer = pd.DataFrame({"layer": range(base.alpha.shape[1]), "baseline": _sink_per_layer(base).numpy()})
        return SpikeAblation({}, where, False, msg, summary, per_layer, {}, results, getattr(model, "model_name", None))
    if N < 2:
        raise ValueError("the mean condition needs at least 2 sequences (a leave-one-out mean over the other inputs).")
    vals = {l: torch.cat(values[l]) for l in layers}  # (N, n_dims)
    loo = {l: ((v.sum(0, keepdim=True) - v) / (N - 1)).float() for l, v in vals.items()}
    means = {f"{l}:{d}": float(vals[l][:, j].mean()) for l in layers for j, d in enumerate(spikes[l])}
    state = {"offset": 0, "B": 0}

    def start(offset, B):
        state["offset"], state["B"] = offset, B

    def setter(l, mode):
        def fn(x, hook):
            x = x.clone()
            dims = idx[l].to(x.device)
            if mode == "zero":
                x[:, 0, dims] = 0.0
            else:
                o, B = state["offset"], x.shape[0]
                x[:, 0, dims] = loo[l][o : o + B].to(x.device, x.dtype)
            return x
        return fn

    for mode in ("zero", "mean"):
        hooks = [(f"blocks.{l}.hook_resid_post", setter(l, mode)) for l in layers]
        results[mode] = run_condition(model, tokens, hooks, eps=eps, batch_size=batch_size, on_batch_start=start)
    summary = pd.DataFrame([
        {"condition": c, "sink_1_pct": r.sink_rate(1), "loss": r.loss, "delta_loss": r.loss - base.loss}
        for c, r in results.items()
    ])
    per_layer = pd.DataFrame({"layer": range(base.alpha.shape[1]),
                              **{c: _sink_per_layer(r).numpy() for c, r in results.items()}})
    msg = f"{how} first-token spike dims: {_dims_text(spikes)}."
    return SpikeAblation(spikes, where, True, msg, summary, per_layer, means, results, getattr(model, "model_name", None))


# ----------------------------------------------------------------------------------------------
# 2. Value ablation
# ----------------------------------------------------------------------------------------------


@dataclass
class ValueAblation:
    """Loss with the first token's value removed from the sink heads (and, as a contrast, from all heads)."""

    sink_heads: list[tuple[int, int]]
    summary: pd.DataFrame  # condition, n_heads, loss, delta_loss, sink_1_pct
    heads: pd.DataFrame  # per sink head: alpha_1, |v_1|, mean |v_j|, |A[t,1] v_1| and |z_t| (means over t > 1)
    message: str
    model_name: str | None = None

    def text(self) -> str:
        if not self.sink_heads:
            return self.message
        s = self.summary.set_index("condition")
        h = self.heads
        later = (f", by {s.loc['sink_heads_later', 'delta_loss']:+.4f} if the first token keeps its own output"
                 if "sink_heads_later" in s.index else "")
        mean = (f", and by {s.loc['sink_heads_mean', 'delta_loss']:+.4f} when v_1 is set to its mean over the other inputs"
                if "sink_heads_mean" in s.index else "")
        return (f"Removing the first token's value from {len(self.sink_heads)} sink heads changes the loss by "
                f"{s.loc['sink_heads', 'delta_loss']:+.4f} (from {s.loc['baseline', 'loss']:.3f}){later}{mean}. In those heads the "
                f"first value's norm is {h['v1_norm'].mean():.2f} against {h['v_other_norm'].mean():.2f} for the other "
                f"tokens: while taking {h['alpha_1'].mean():.1%} of the attention, it adds a vector of norm "
                f"{h['first_contrib_norm'].mean():.2f} to head outputs of norm {h['output_norm'].mean():.2f}.")

    def to_dict(self) -> dict:
        return {
            "model": self.model_name,
            "sink_heads": [list(h) for h in self.sink_heads],
            "message": self.message,
            "summary": _records(self.summary),
            "heads": _records(self.heads),
            "text": self.text(),
        }


def _check_heads(model, heads) -> list[tuple[int, int]]:
    dims = model_dims(model)
    out = []
    for h in heads:
        try:
            l, hh = (int(v) for v in h)
        except (TypeError, ValueError):
            raise ValueError(f"sink_heads must be (layer, head) pairs; got {h!r}.") from None
        if not 0 <= l < dims.n_layers or not 0 <= hh < dims.n_heads:
            raise ValueError(f"head {(l, hh)} out of range: layers 0..{dims.n_layers - 1}, heads 0..{dims.n_heads - 1}.")
        out.append((l, hh))
    return sorted(set(out))


def _value_hooks(model, heads: list[tuple[int, int]], mode: str = "zero", stats: dict | None = None,
                 v_mean: dict | None = None, state: dict | None = None, first_query: bool = True):
    """Hooks on hook_pattern, hook_v and hook_z of the layers holding ``heads``.

    mode "stats": change nothing; fold per-head norms into ``stats`` and keep each sample's v_1.
    mode "zero": z_t -= A[t, 1] v_1.  mode "mean": z_t -= A[t, 1] (v_1 - mean of v_1 over the other inputs),
    from ``v_mean`` {layer: (N, h, d)} and the batch offset in ``state``. ``first_query=False`` leaves the
    first token's own output (t = 1) unchanged.
    """
    dims = model_dims(model)
    names = hook_names(model)
    by_layer: dict[int, list[int]] = {}
    for l, h in heads:
        by_layer.setdefault(l, []).append(h)
    hooks = []
    for l, hs in by_layer.items():
        need = [f"blocks.{l}.attn.hook_pattern", f"blocks.{l}.attn.hook_v", f"blocks.{l}.attn.hook_z"]
        missing = [n for n in need if n not in names]
        if missing:
            raise ModelContractError(f"the model has no hook(s) {missing}; value ablation needs TransformerLens hook names.")
        st: dict = {}
        hidx = torch.tensor(sorted(hs))

        def on_pattern(p, hook, st=st, hidx=hidx):
            st["a1"] = p[:, hidx.to(p.device), :, 0].detach()  # (B, h, T)

        def on_v(v, hook, st=st, hidx=hidx):
            group = dims.n_heads // v.shape[2]
            kv = (hidx // group).to(v.device)
            st["v1"] = v[:, 0, kv].detach()  # (B, h, d)
            if mode == "stats":
                vh = v[:, :, kv].float()  # (B, T, h, d)
                st["v1_norm"] = vh[:, 0].norm(dim=-1).sum(0).cpu()
                st["vj_norm"] = vh[:, 1:].norm(dim=-1).mean(1).sum(0).cpu() if v.shape[1] > 1 else torch.zeros(len(hidx))

        def on_z(z, hook, st=st, hidx=hidx, l=l):
            v1 = st["v1"]
            if mode == "mean":
                o = state["offset"]
                v1 = v1 - v_mean[l][o : o + z.shape[0]].to(v1.device, v1.dtype)
            contrib = st["a1"].permute(0, 2, 1)[..., None] * v1[:, None]  # (B, T, h, d)
            if mode == "stats":
                zh = z[:, :, hidx.to(z.device)].float()
                s = stats.setdefault(l, {"heads": hidx.tolist(), "n": 0, "v1": 0, "vj": 0, "contrib": 0, "z": 0,
                                         "a1": 0, "v1_all": []})
                s["n"] += z.shape[0]
                s["v1"] = s["v1"] + st["v1_norm"]
                s["vj"] = s["vj"] + st["vj_norm"]
                s["contrib"] = s["contrib"] + contrib.float().norm(dim=-1)[:, 1:].mean(1).sum(0).cpu()
                s["z"] = s["z"] + zh.norm(dim=-1)[:, 1:].mean(1).sum(0).cpu()
                s["a1"] = s["a1"] + st["a1"].float().mean(-1).sum(0).cpu()
                s["v1_all"].append(st["v1"].float().cpu())
                return None
            if not first_query:
                contrib = contrib.clone()
                contrib[:, 0] = 0
            z = z.clone()
            z[:, :, hidx.to(z.device)] -= contrib.to(z.dtype)
            return z

        hooks += [(f"blocks.{l}.attn.hook_pattern", on_pattern), (f"blocks.{l}.attn.hook_v", on_v),
                  (f"blocks.{l}.attn.hook_z", on_z)]
    return hooks


def value_ablation(
    model,
    tokens,
    sink_heads: Sequence[tuple[int, int]] | None = None,
    eps: float = DEFAULT_EPS,
    min_share: float = 50.0,
    all_heads: bool = True,
    batch_size: int | None = None,
) -> ValueAblation:
    """Remove the first token's value from the sink heads' outputs; compare the loss with the unchanged model.

    For head h and query t the output z_t = sum_j A[t, j] v_j becomes z_t - A[t, 1] v_1 (with GQA, v_1 of
    the head's KV group). Conditions: ``sink_heads`` (every query), ``sink_heads_later`` (queries t > 1
    only: the first token's own output, which feeds its later layers, is kept), ``sink_heads_mean`` (v_1
    set to its mean over the other inputs: does v_1 carry anything input-specific?) and, with
    ``all_heads``, ``all_heads`` (v_1 removed from every head, a contrast). ``sink_heads``: (layer, head)
    pairs; None takes the heads whose alpha_1 > eps on at least ``min_share`` % of the samples.
    """
    eps = check_eps(eps)
    tokens = check_tokens(model, tokens)
    dims = model_dims(model)
    N = tokens.shape[0]
    every = [(l, h) for l in range(dims.n_layers) for h in range(dims.n_heads)]
    stats: dict = {}
    if sink_heads is None:
        # The baseline pass measures the sink heads and the value norms of every head at once.
        base = run_condition(model, tokens, _value_hooks(model, every, "stats", stats), eps=eps, batch_size=batch_size)
        heads = base.sink(getattr(model, "model_name", None)).sink_heads(k=1, min_share=min_share)
        how = f"found (alpha_1 > {eps} on >= {min_share:g}% of samples)"
    else:
        heads = _check_heads(model, sink_heads)
        base = run_condition(model, tokens, _value_hooks(model, heads, "stats", stats), eps=eps, batch_size=batch_size)
        how = "given"
    rows = [{"condition": "baseline", "n_heads": 0, "loss": base.loss, "delta_loss": 0.0, "sink_1_pct": base.sink_rate(1)}]
    name = getattr(model, "model_name", None) or "the model"
    cols = ["layer", "head", "alpha_1", "v1_norm", "v_other_norm", "first_contrib_norm", "output_norm"]
    if not heads:
        msg = f"{name} has no sink heads (alpha_1 > {eps} on >= {min_share:g}% of samples): nothing to ablate."
        return ValueAblation([], pd.DataFrame(rows), pd.DataFrame(columns=cols), msg, getattr(model, "model_name", None))
    head_rows = []
    v_mean: dict[int, torch.Tensor] = {}
    for l in sorted({l for l, _ in heads}):
        s = stats[l]
        hs = [h for ll, h in heads if ll == l]
        j = [s["heads"].index(h) for h in hs]
        n = s["n"]
        v1 = torch.cat(s["v1_all"])[:, j]  # (N, h, d)
        v_mean[l] = (v1.sum(0, keepdim=True) - v1) / max(N - 1, 1)
        for h, jj in zip(hs, j):
            head_rows.append({"layer": l, "head": h, "alpha_1": float(s["a1"][jj] / n), "v1_norm": float(s["v1"][jj] / n),
                              "v_other_norm": float(s["vj"][jj] / n), "first_contrib_norm": float(s["contrib"][jj] / n),
                              "output_norm": float(s["z"][jj] / n)})
    state = {"offset": 0}

    def start(offset, B):
        state["offset"] = offset

    conditions = [("sink_heads", heads, "zero", True), ("sink_heads_later", heads, "zero", False)]
    if N >= 2:
        conditions.append(("sink_heads_mean", heads, "mean", True))
    if all_heads:
        conditions.append(("all_heads", every, "zero", True))
    for cname, hs, mode, fq in conditions:
        hooks = _value_hooks(model, hs, mode, v_mean=v_mean, state=state, first_query=fq)
        r = run_condition(model, tokens, hooks, eps=eps, batch_size=batch_size, on_batch_start=start)
        rows.append({"condition": cname, "n_heads": len(hs), "loss": r.loss, "delta_loss": r.loss - base.loss,
                     "sink_1_pct": r.sink_rate(1)})
    msg = f"{how}: {len(heads)} sink heads."
    return ValueAblation(heads, pd.DataFrame(rows), pd.DataFrame(head_rows), msg, getattr(model, "model_name", None))


# ----------------------------------------------------------------------------------------------
# 3. First-key ablation
# ----------------------------------------------------------------------------------------------


@dataclass
class FirstKeyAblation:
    """Attention with the spike-driven part of the first key removed, against the unchanged model."""

    layers: list[int]  # layers whose first key was changed
    spike_dims: dict[int, list[int]]  # layer (the block whose ln1 reads them) -> dims
    has_spike: bool
    message: str
    summary: pd.DataFrame  # condition x (first, previous, self, other, sink_1..sink_k, loss), over ablated layers
    per_layer: pd.DataFrame  # layer, condition, first, previous, self, other, sink_1, sink_2
    results: dict = field(default_factory=dict)
    model_name: str | None = None

    def text(self) -> str:
        if not self.has_spike:
            return self.message
        s = self.summary.set_index("condition")
        b, a = s.loc["baseline"], s.loc["ablated"]
        gain = {k: a[k] - b[k] for k in ("previous", "self", "other")}
        top = max(gain, key=gain.get)
        return (f"Removing the spike-driven part of the first key in layers {_runs(self.layers)} moves the attention of "
                f"later queries there from the first token ({b['first']:.1%} -> {a['first']:.1%}) mostly to "
                f"'{top}' keys ({b[top]:.1%} -> {a[top]:.1%}); Sink_1 in those layers {b['sink_1']:.1f}% -> "
                f"{a['sink_1']:.1f}%, Sink_2 {b['sink_2']:.1f}% -> {a['sink_2']:.1f}%; loss {b['loss']:.3f} -> {a['loss']:.3f}.")

    def to_dict(self) -> dict:
        return {
            "model": self.model_name,
            "layers": self.layers,
            "spike_dims": {str(l): d for l, d in self.spike_dims.items()},
            "has_spike": self.has_spike,
            "message": self.message,
            "summary": _records(self.summary),
            "per_layer": _records(self.per_layer),
            "text": self.text(),
        }


def _runs(layers):
    from analysis.massive import _layer_runs

    return _layer_runs(list(layers))


def first_key_ablation(
    model,
    tokens,
    layers: Sequence[int] | None = None,
    spike_dims: Mapping[int, Sequence[int]] | Sequence[int] | None = None,
    abs_threshold: float = 100.0,
    ratio_threshold: float = 1000.0,
    min_share: float = 0.5,
    eps: float = DEFAULT_EPS,
    k_max: int = 4,
    batch_size: int | None = None,
) -> FirstKeyAblation:
    """Subtract k_1^S = (g * norm(h_1))[S] W_K from the first key of each layer; see where the attention goes.

    ``spike_dims``: {layer: dims} of the stream each layer's ln1 reads (``hook_resid_pre``), a list of
    dims for every layer, or None to find them (``massive_activations`` on ``hook_resid_pre``).
    ``layers``: where to intervene (default: every layer whose input carries first-token spike dims).
    All those layers are changed in the same pass. The attention shares are over queries t >= 3 of
    the changed layers: first key, previous key, the query's own key, the rest.
    """
    from analysis.massive import massive_activations
    from analysis.norm_gain import key_path

    eps = check_eps(eps)
    tokens = check_tokens(model, tokens)
    dims = model_dims(model)
    D = dims.d_model
    if spike_dims is None:
        ma = massive_activations(model, tokens[:32], top_k=1, hook="resid_pre", abs_threshold=abs_threshold,
                                 ratio_threshold=ratio_threshold, min_share=min_share)
        spikes = ma.first_token_dims
        how = "found"
    elif isinstance(spike_dims, Mapping):
        spikes = {l: sorted({int(d) for d in ds}) for l, ds in zip(check_layers(model, list(spike_dims)), spike_dims.values())}
        how = "given"
    else:
        ds = sorted({int(d) for d in spike_dims})
        spikes = {l: ds for l in range(dims.n_layers)}
        how = "given"
    bad = sorted({d for ds in spikes.values() for d in ds if not 0 <= d < (D or 0)})
    if bad:
        raise ValueError(f"spike dims {bad} out of range: d_model is {D}.")
    layers = check_layers(model, layers) if layers is not None else sorted(l for l, d in spikes.items() if d)
    layers = [l for l in layers if spikes.get(l)]
    name = getattr(model, "model_name", None) or "the model"
    base = run_condition(model, tokens, eps=eps, k_max=k_max, batch_size=batch_size)
    results = {"baseline": base}
    if not layers:
        msg = (f"The first token of {name} carries no spike in the stream any chosen layer reads (|a| > {abs_threshold:g}, "
               f">= {ratio_threshold:g}x the median, on {min_share:.0%} of samples): there is no spike-driven key part "
               "to remove. Pass spike_dims or lower the thresholds.")
        return FirstKeyAblation([], {}, False, msg, _fk_summary(results, list(range(dims.n_layers)), k_max),
                                _fk_per_layer(results, k_max), results, getattr(model, "model_name", None))
    paths = {l: key_path(model, l) for l in layers}
    masks = {}
    for l in layers:
        m = torch.zeros(D, dtype=torch.bool)
        m[spikes[l]] = True
        masks[l] = m
    state: dict = {}

    def on_resid(l):
        def fn(h, hook):
            n1 = paths[l].norm.normalise(h[:, :1])
            state[l] = paths[l].norm.affine(n1) * masks[l].to(h.device)  # (B, 1, D)
        return fn

    def on_k(l):
        def fn(k, hook):
            kS = paths[l].keys(state.pop(l), torch.zeros(1, dtype=torch.long), bias=False, rotary=False)  # (B,1,Hkv,d)
            k = k.clone()
            k[:, :1] -= kS.to(k.dtype)
            return k
        return fn

    hooks = []
    for l in layers:
        hooks += [(f"blocks.{l}.hook_resid_pre", on_resid(l)), (paths[l].key_hook, on_k(l))]
    results["ablated"] = run_condition(model, tokens, hooks, eps=eps, k_max=k_max, batch_size=batch_size)
    msg = f"{how} spike dims; changed the first key in layers {_runs(layers)}."
    return FirstKeyAblation(layers, {l: spikes[l] for l in layers}, True, msg, _fk_summary(results, layers, k_max),
                            _fk_per_layer(results, k_max), results, getattr(model, "model_name", None))


def _fk_summary(results: dict, layers: list[int], k_max: int) -> pd.DataFrame:
    rows = []
    for c, r in results.items():
        w = r.where[layers].mean(dim=(0, 1))
        row = {"condition": c, **{k: float(w[i]) for i, k in enumerate(WHERE_KEYS)}}
        for k in range(1, min(k_max, r.alpha.shape[-1]) + 1):
            row[f"sink_{k}"] = float((r.alpha[:, layers, :, k - 1] > r.eps).float().mean() * 100)
        row["loss"] = r.loss
        rows.append(row)
    return pd.DataFrame(rows)


def _fk_per_layer(results: dict, k_max: int) -> pd.DataFrame:
    rows = []
    for c, r in results.items():
        L = r.alpha.shape[1]
        w = r.where.mean(1)  # (L, 4)
        for l in range(L):
            row = {"layer": l, "condition": c, **{k: float(w[l, i]) for i, k in enumerate(WHERE_KEYS)}}
            for k in range(1, min(k_max, r.alpha.shape[-1], 2) + 1):
                row[f"sink_{k}"] = float((r.alpha[:, l, :, k - 1] > r.eps).float().mean() * 100)
            rows.append(row)
    return pd.DataFrame(rows)
