"""A loaded model's facts in one flat row: family, parameter count, attention kind, position encoding, norm.

What the atlas (``analysis.report.atlas``) puts beside each model's numbers. Everything is read from the family spec
(``analysis.model.families.FamilySpec``, measured at load time), a reference model's own config, or, for a model
loaded through nnsight, its config's spec (``NnsightSpec``: the norm and positions are not read there, and the card
says so).
"""

from __future__ import annotations

from analysis.model.contract import SinkModel
from analysis.model.families import get_family, rope_theta
from analysis.model.nnsight_model import NnsightModel

NOT_READ = "not read through nnsight"


def _head_grouping(n_heads: int, n_kv_heads: int, *, latent: bool = False) -> str:
    """How the query heads share keys and values: MHA, GQA, MQA, or multi-head latent attention (MLA)."""
    if latent:
        return "MLA"
    if n_kv_heads == n_heads:
        return "MHA"
    return "MQA" if n_kv_heads == 1 else f"GQA ({n_heads} q / {n_kv_heads} kv heads)"


def _attention_text(
    op: str,
    grouping: str,
    n_attention: int,
    n_layers: int,
    *,
    window=None,
    n_window: int = 0,
    sinks: bool = False,
    gate: bool = False,
    softcap=None,
) -> str:
    parts = [f"{op}, {grouping}"]
    if n_attention != n_layers:
        parts.append(f"hybrid: attention on {n_attention} of {n_layers} layers")
    if window:
        parts.append(f"sliding window {window} on {n_window or 'all'} layers")
    if sinks:
        parts.append("learned sink logits")
    if gate:
        parts.append("gated output")
    if softcap:
        parts.append(f"logits soft-capped at {softcap:g}")
    return "; ".join(parts)


def _n_params(module) -> int:
    return int(sum(p.numel() for p in module.parameters()))


def model_card(model: SinkModel) -> dict:
    """The model's facts, one flat row.

    Parameters
    ----------
    model
        A model of ``analysis.load_model`` (a bridge, a reference model, or one loaded through nnsight).

    Returns
    -------
    dict
        ``family``, ``architecture``, ``n_params`` (every parameter once, tied ones once), ``attention`` (the
        operation, MHA / GQA / MQA / MLA, hybrid layers, sliding windows, learned sinks, gates), ``positions``,
        ``norm`` (where it sits and what it is), ``n_layers``, ``n_heads``, ``n_kv_heads``, ``d_model``.
    """
    if isinstance(model, NnsightModel):
        return _nnsight_card(model)
    spec = get_family(model)
    ref = getattr(model, "reference_config", None)
    op = str(ref.get("model", {}).get("attention", "softmax")) if isinstance(ref, dict) else "softmax"
    hf = getattr(model, "original_model", None)
    attention = _attention_text(
        op,
        _head_grouping(spec.n_heads, spec.n_kv_heads, latent=spec.latent is not None),
        len(spec.attention_layers),
        spec.n_layers,
        window=spec.sliding_window,
        n_window=len(spec.sliding_layers),
        sinks=spec.learned_sinks,
        gate=bool(spec.gate),
        softcap=spec.attn_softcap,
    )
    positions = spec.positions + (f" (none on layers {list(spec.nope_layers)})" if spec.nope_layers else "")
    norm = spec.norm or spec.post_norm
    return {
        "family": spec.family,
        "architecture": spec.architecture,
        "n_params": _n_params(hf if hf is not None else model),
        "attention": attention,
        "positions": positions,
        "norm": f"{spec.norm_placement}-norm {norm.kind}" if norm is not None else "none",
        **{k: getattr(spec, k) for k in "n_layers n_heads n_kv_heads d_model".split()},
    }


def _nnsight_card(model: NnsightModel) -> dict:
    """The card of a model loaded through nnsight, from its config's spec (no norm or position probe there)."""
    s = model.spec
    config = model.hf.config.get_text_config() if hasattr(model.hf.config, "get_text_config") else model.hf.config
    attention = _attention_text(
        "softmax",
        _head_grouping(s.n_heads, s.n_kv_heads, latent=s.latent is not None),
        len(s.attention_layers),
        s.n_layers,
        window=s.sliding_window,
        softcap=s.softcap,
    )
    return {
        "family": s.family,
        "architecture": type(model.hf).__name__,
        "n_params": _n_params(model.hf),
        "attention": attention,
        "positions": "rotary" if rope_theta(config) is not None else NOT_READ,
        "norm": NOT_READ,
        **{k: getattr(s, k) for k in "n_layers n_heads n_kv_heads d_model".split()},
    }
