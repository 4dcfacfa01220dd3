"""Side-by-side measurements of models trained with different attention operations, and the mechanism chain of one
trained model (their figures: ``analysis.figures.training``).

Used by ``notebooks/07_attention_variants.ipynb``; every function takes ``{label: model}`` and a probe
(LongTensor (N, T)) and reduces through hooks.
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd
import torch

from analysis.model.access import attention_operation
from analysis.model.contract import SinkModel
from analysis.core.defaults import SINK_EPS
from analysis.core.docs import parameters_from
from analysis.model.hooks import act_name, model_dims
from analysis.model.placement import input_device
from analysis.chain.key_manifold import first_key_manifold
from analysis.chain.massive import massive_activations
from analysis.engine.passes import run_with_reducers
from analysis.sinks.metric import sink_metric
from analysis.dynamics.metrics import _ThresholdResult, first_token_stats, slot_sink_rate
from analysis.chain.values import value_norms


@parameters_from(first_token_stats)
@torch.no_grad()
def mean_pattern(model: SinkModel, tokens: torch.Tensor, *, layer: int = 0, hook: str = "hook_pattern") -> torch.Tensor:
    """Attention pattern averaged over the probe, (H, T, T) (``hook="hook_raw_pattern"`` for the raw weights).

    Parameters
    ----------
    model, tokens
        As in :func:`first_token_stats`.
    layer : int
    hook : str
        The attention hook of the layer.

    Returns
    -------
    torch.Tensor, shape (H, T, T)
    """
    acc = {}

    def fn(x, hook):
        acc["sum"] = acc.get("sum", 0) + x.float().sum(0)

    name = f"blocks.{layer}.attn.{hook}"
    run_with_reducers(model, tokens, [(name, fn)], stop_after=name)
    return (acc["sum"] / tokens.shape[0]).cpu()


@torch.no_grad()
def compare_models(models: dict, tokens: torch.Tensor, *, eps: float = SINK_EPS) -> pd.DataFrame:
    """One row per model: Sink_1 (sink metric), mean alpha_1, first-token value-norm ratio, residual-norm
    ratio (last layer), raw attention mass on the first token, held-out loss, and the bias-slot sink.

    Parameters
    ----------
    models : dict of str to SinkLM
    tokens : torch.Tensor, shape (N, T)
        Token ids.
    eps : float
        The sink threshold.

    Returns
    -------
    pandas.DataFrame
    """
    rows = []
    for label, model in models.items():
        res = sink_metric(model, tokens, eps=eps, k_max=1)
        stats = first_token_stats(model, tokens)
        dev = input_device(model)
        row = {
            "model": label,
            "attention": attention_operation(model),
            "Sink_1 (%)": res.sink_rate(k=1),
            "mean alpha_1": float(res.alpha[..., 0].mean()),
            "|v_1| / mean |v_j|": float(stats.value_norm_ratio.mean()),
            "|h_1| / mean |h_j|": float(stats.resid_norm_ratio[-1]),
            "raw weight on token 1": float(stats.raw_first_mass.mean()),
            "held-out loss": float(model(tokens.to(dev), return_type="loss")),
        }
        if "blocks.0.attn.hook_sink_pattern" in model.hook_dict:
            row["Sink on slot (%)"] = slot_sink_rate(model, tokens, eps=eps)
        rows.append(row)
    return pd.DataFrame(rows).set_index("model")


# ----------------------------------------------------------------------------- the mechanism chain

from analysis.core.defaults import SPIKE_RATIO_SMALL  # a small model's massive activation: >= 100x the median


def _zero_first_token_dims(dims: list[int]):
    def fn(x, hook):
        x = x.clone()
        x[:, 0, dims] = 0.0
        return x

    return fn


def sink_kv_heads(vn, eps: float = SINK_EPS) -> list[tuple[int, int]]:
    """The (layer, KV head) pairs of a ``ValueNorms`` whose alpha_1 (mean over the KV head's query heads) > eps.

    Parameters
    ----------
    vn : ValueNorms
        ``analysis.chain.values.value_norms`` of a model.
    eps : float
        The sink threshold.

    Returns
    -------
    list of (int, int)
    """
    t = vn.table()
    return [(int(l), int(h)) for l, h, a in zip(t.layer, t.kv_head, t.alpha_1_mean) if a > eps]


def _over_heads(table: pd.DataFrame, heads, col: str, how: str = "mean") -> float:
    """``col`` of ``table`` (one row per (layer, kv_head)) over ``heads``: their mean, or median (torch's: the lower
    middle value, as over a model's own sink heads); NaN without heads."""
    if not heads:
        return float("nan")
    v = torch.tensor(table.set_index(["layer", "kv_head"]).loc[[tuple(h) for h in heads], col].to_numpy(dtype=float))
    return float(v.median() if how == "median" else v.mean())


class MechanismChain(_ThresholdResult):
    """The sink's mechanism, link by link, on one model (:func:`mechanism_chain`): a dict of the links, as before,
    that keeps the result protocol.

    Attributes
    ----------
    kind, model_name, n_samples
        The header (:class:`analysis.core.results.MappingResult`).
    eps : float
        The sink threshold.
    tables : dict of str to pandas.DataFrame
        ``values`` (name, value: every number of the dict), ``spike_dims`` (stream, dim) and ``sink_kv_heads``
        (layer, kv_head).
    """

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        dims = [(s, int(d)) for s, ds in self.get("spike_dims", {}).items() for d in ds]
        return {
            **super().tables,
            "spike_dims": pd.DataFrame(dims, columns=["stream", "dim"]),
            "sink_kv_heads": pd.DataFrame(self.get("sink_kv_heads", []), columns=["layer", "kv_head"]),
        }

    def findings(self) -> list[str]:
        out = [
            f"Sink_1 is {self['sink_1']:.1f}% (eps {self.eps:g}); the first token's largest activation is "
            f"{self['spike_ratio_token']:.3g}x its own median |a| and {self['spike_ratio_sequence']:.3g}x the "
            "median of the sample's hidden state."
        ]
        heads = self.get("sink_kv_heads", [])
        if heads:
            out.append(
                f"In the {len(heads)} sink KV heads the first token's value norm is "
                f"{self['value_ratio_sink_heads']:.2f}x the others' (other heads: "
                f"{self['value_ratio_other_heads']:.2f}x); its key lies {self['key_offsub_z']:.1f}x a typical "
                f"key's distance off the other keys' subspace, and queries meet it at a mean cosine of "
                f"{self['cos_q_k1']:.2f} (other keys: {self['cos_q_kj']:.2f})."
            )
        else:
            out.append(f"No KV head has alpha_1 above {self.eps:g}, so the value and key links have no sink head.")
        out.append(f"Zeroing the first token's spike dims leaves Sink_1 at {self['sink_1_spike_zeroed']:.1f}%.")
        return out


@parameters_from(sink_metric)
@torch.no_grad()
def mechanism_chain(
    model: SinkModel,
    tokens: torch.Tensor,
    *,
    eps: float = SINK_EPS,
    ratio: float = SPIKE_RATIO_SMALL,
    dims: Sequence[int] | None = None,
    heads: Sequence[tuple[int, int]] | None = None,
) -> MechanismChain:
    """The sink's mechanism, link by link, measured with the package's analyses on one model:

    - ``sink_1``: Sink_1 (%) (``analysis.sinks.metric``);
    - ``spike_ratio_token`` / ``spike_ratio_sequence``: the first token's largest |activation| over the median
      |activation| of its own vector / of the sample's whole hidden state, the largest over the residual
      stream's positions (the embedding and after each block), and ``spike_dims`` {stream: dims} flagged at
      >= ``ratio`` x the token median on most samples (``analysis.chain.massive``, ``median_over="token"``, no
      absolute floor: a 64-wide model has no activation above 100);
    - ``value_ratio_sink_heads``: median |v_1| / mean |v_j| over the KV heads whose alpha_1 > eps
      (``analysis.chain.values``; NaN without such a head), ``value_ratio_other_heads`` over the others, and
      ``sink_kv_heads``: those (layer, KV head) pairs;
    - ``key_offsub_z``, ``cos_q_k1``, ``cos_q_kj``: how far the first key lies from the other keys' subspace
      (z-score), and the mean cosine of queries with k_1 and with other keys, in sink heads
      (``analysis.chain.key_manifold``; NaN without a sink head);
    - ``sink_1_spike_zeroed``: Sink_1 with the first token's spike dims set to zero where they appear.

    Parameters
    ----------
    model, tokens
        As in :func:`sink_metric`.
    eps : float
        The sink threshold on alpha_1.
    ratio : float
        A spike dimension is at least this many times the first token's median |activation|.
    dims : sequence of int, optional
        Residual dimensions to zero instead, for ``sink_1_spike_zeroed``: on the first token in every stream (the
        embedding and after every block), whether they carry a spike or not (a trained model's spike dims followed
        along its training).
    heads : sequence of (layer, kv_head), optional
        KV heads to follow (e.g. a trained model's sink heads): adds ``value_ratio_heads`` (median),
        ``key_offsub_z_heads``, ``cos_q_k1_heads`` and ``cos_q_kj_heads`` (means) over these heads, whether
        they sink or not.

    Returns
    -------
    MechanismChain
        A dict of the links above (``chain["sink_1"]``), with the result protocol (``text()``, ``to_dict()``).
    """
    sink = sink_metric(model, tokens, eps=eps, k_max=1)
    out = MechanismChain(
        {"sink_1": sink.sink_rate(1)}, eps=eps, model_name=getattr(model, "model_name", None), n_samples=tokens.shape[0]
    )
    out.update(_spike_links(model, tokens, ratio))
    streams = out["spike_dims"]
    vn = value_norms(model, tokens, sink=sink)
    ratio_kv = vn.ratio.flatten()
    sink_kv = vn.alpha_kv().flatten() > eps
    out["value_ratio_sink_heads"] = float(ratio_kv[sink_kv].median()) if sink_kv.any() else float("nan")
    out["value_ratio_other_heads"] = float(ratio_kv[~sink_kv].median()) if (~sink_kv).any() else float("nan")
    vt = vn.table()
    out["sink_kv_heads"] = sink_kv_heads(vn, eps)
    km = first_key_manifold(model, tokens)
    sk = km.summary()["sink"]
    out.update(
        {
            k: float("nan") if sk[c] is None else sk[c]
            for k, c in (("key_offsub_z", "offsub_z"), ("cos_q_k1", "cos_q_k1"), ("cos_q_kj", "cos_q_kj"))
        }
    )
    if heads is not None:
        out["value_ratio_heads"] = _over_heads(vt, heads, "ratio", "median")
        for k in ("offsub_z", "cos_q_k1", "cos_q_kj"):
            out[f"{'key_' if k == 'offsub_z' else ''}{k}_heads"] = _over_heads(km.table, heads, k)
    if dims is not None:
        hooks = [
            (name, _zero_first_token_dims(list(dims)))
            for name in ["hook_embed"] + [act_name("resid_post", l) for l in range(model_dims(model).n_layers)]
        ]
    else:
        hooks = [("hook_embed" if s == "embed" else s, _zero_first_token_dims(d)) for s, d in streams.items()]
    if hooks:
        with model.hooks(fwd_hooks=hooks):
            out["sink_1_spike_zeroed"] = sink_metric(model, tokens, eps=eps, k_max=1).sink_rate(1)
    else:
        out["sink_1_spike_zeroed"] = out["sink_1"]
    return out


def _spike_links(model: SinkModel, tokens: torch.Tensor, ratio: float) -> dict:
    """The chain's spike links: ``spike_ratio_token`` and ``spike_ratio_sequence`` (the largest over the residual
    stream's positions) and ``spike_dims`` {stream: dims} (see :func:`mechanism_chain`)."""
    out, streams = {}, {}
    for hook in ("resid_pre", "resid_post"):
        layers = [0] if hook == "resid_pre" else None
        for median_over in ("token", "sequence"):
            ma = massive_activations(
                model,
                tokens,
                layers=layers,
                hook=hook,
                median_over=median_over,
                abs_threshold=0.0,
                ratio_threshold=ratio,
            )
            ref = ma.first_abs.amax(-1)  # (L,) mean over samples of |a| of the first token's largest dim
            if median_over == "token":
                med = ma.first_abs.median(-1).values  # the first token's own median |a|
                r = (ref / med.clamp_min(1e-12)).amax().item()
                for l, found in ma.first_token_dims.items():  # the layers with any, in order
                    streams["embed" if hook == "resid_pre" else f"blocks.{l}.hook_resid_post"] = found
            else:  # the median |a| over each sample's positions x dims
                r = (ref / ma.median.mean(0).clamp_min(1e-12)).amax().item()
            key = f"spike_ratio_{median_over}"
            out[key] = max(out.get(key, 0.0), r)
    out["spike_dims"] = streams
    return out
