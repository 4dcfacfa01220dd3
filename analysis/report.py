"""One self-contained HTML report and a JSON with every number behind it, for any model with TransformerLens hooks.

``build_report(model, out_dir)`` runs the whole chain on natural, random and repeated probes:

1. the sink metric (Sink_1 table, per-head alpha), with offline circuitsvis attention views;
2. massive activations (the spike dims per layer, ``spike_dims`` in the JSON);
3. the norm-gain trace of one sink layer that reads the spike;
4. the first key's manifold (PCA of the keys, QK angles);
5. value norms against alpha_1;
6. interventions (spike, value and first-key ablations);

and writes ``report.html`` (figures as inline PNG, circuitsvis views with their JavaScript inline, no CDN, no
network) and ``report.json`` into ``out_dir``, each atomically (a temporary file, then ``os.replace``); other
files in ``out_dir`` are left alone. Each finding is one sentence with its number. A section whose analysis
does not apply to the model (no spike on the first token, no norm gain to trace, ...) says so in plain words
and the rest of the report goes on.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch

from analysis.hooks import ModelContractError, model_dims

DEFAULT_N = 32
SECTIONS = ("sink", "views", "massive", "norm_gain", "key_manifold", "value_norms", "interventions")


# ----------------------------------------------------------------------------------------------
# Small helpers: JSON, figures, tables, atomic files
# ----------------------------------------------------------------------------------------------


def jsonable(obj):
    """A strictly JSON-serialisable copy: tensors and arrays to lists, NaN/inf to None, tuple keys to strings."""
    if isinstance(obj, dict):
        return {(",".join(map(str, k)) if isinstance(k, tuple) else str(k)): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return jsonable(obj.detach().cpu().tolist())
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, pd.DataFrame):
        return jsonable(obj.to_dict("records"))
    if isinstance(obj, (np.bool_, bool)):
        return bool(obj)
    if isinstance(obj, (np.integer, int)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if obj is None or isinstance(obj, str):
        return obj
    return str(obj)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def figure_html(fig, caption: str = "", dpi: int = 90) -> str:
    """A matplotlib figure as an inline base64 PNG ``<figure>``; closes the figure."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}"/>{cap}</figure>'


def table_html(df: pd.DataFrame, digits: int = 3, max_rows: int = 40) -> str:
    if len(df) > max_rows:
        df = df.head(max_rows)
    return df.to_html(index=False, float_format=lambda v: f"{v:.{digits}f}", classes="tbl", border=0, escape=True)


def _p(text: str) -> str:
    return f"<p>{html.escape(text)}</p>"


@dataclass
class Section:
    key: str
    title: str
    parts: list[str] = field(default_factory=list)  # HTML fragments
    data: dict = field(default_factory=dict)  # JSON payload
    findings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # plain statements: not applicable, missing module, error
    seconds: float = 0.0

    def say(self, sentence: str) -> None:
        """A finding: in the summary at the top and in the section."""
        self.findings.append(sentence)
        self.parts.append(f'<p class="finding">{html.escape(sentence)}</p>')

    def note(self, sentence: str) -> None:
        self.notes.append(sentence)
        self.parts.append(f'<p class="note">{html.escape(sentence)}</p>')

    def figure(self, make: Callable, caption: str) -> None:
        """Add a figure; a figure that fails is replaced by a note (the numbers are still in the JSON)."""
        try:
            self.parts.append(figure_html(make(), caption))
        except Exception as e:  # noqa: BLE001 - a figure must not sink the report
            self.note(f"Figure '{caption}' could not be drawn ({type(e).__name__}: {e}).")


def _optional_plots(module: str, calls: list[tuple[str, tuple, dict, str]], sec: Section) -> bool:
    """Call figure functions of a colleague module if it exists; False if the module is missing."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False
    for name, args, kwargs, caption in calls:
        fn = getattr(mod, name, None)
        if fn is not None:
            sec.figure(lambda fn=fn: fn(*args, **kwargs), caption)
    return True


# ----------------------------------------------------------------------------------------------
# The sections
# ----------------------------------------------------------------------------------------------


class _Context:
    """What the sections share: the model, the probes, and earlier results."""

    def __init__(self, model, n: int, T: int, seed: int, batch_size: int | None):
        from analysis.probes import probe_sets

        self.model, self.n, self.T, self.seed, self.batch_size = model, n, T, seed, batch_size
        self.dims = model_dims(model)
        self.name = getattr(model, "model_name", None) or type(model).__name__
        self.probes = probe_sets(model.tokenizer, n=n, T=T, seed=seed)
        self.natural = self.probes["natural"].tokens
        self.sink: dict = {}
        self.massive = None


def _sink(ctx: _Context, sec: Section) -> None:
    import matplotlib.pyplot as plt  # noqa: F401 - backend set by the caller

    from analysis.figures.sink import plot_head_alpha, plot_sink_by_layer, plot_sink_rates
    from analysis.sink import sink_metric, sink_table

    for kind, probe in ctx.probes.items():
        ctx.sink[kind] = sink_metric(ctx.model, probe.tokens, k_max=min(ctx.T, 16), kind=kind, batch_size=ctx.batch_size)
    table = sink_table(ctx.sink)
    rates = table["Sink_1 (%)"]
    nat = ctx.sink["natural"]
    per_layer = nat.per_layer(1)
    sinky = per_layer[per_layer.sink_1_pct > 50].layer.tolist()
    sec.say(f"Sink_1 (eps = {nat.eps}) is {rates['natural']:.1f}% on natural text, {rates['random']:.1f}% on random tokens "
            f"and {rates['repeated']:.1f}% on one repeated token (N = {ctx.n} sequences of T = {ctx.T} tokens, no BOS).")
    sec.say(f"{len(sinky)} of {ctx.dims.n_layers} layers have Sink_1 above 50% on natural text"
            + (f"; the layers without a sink (below 5%) are {per_layer[per_layer.sink_1_pct < 5].layer.tolist()}." if sinky else "."))
    sec.parts.append(table_html(table.reset_index(), digits=2))
    sec.figure(lambda: plot_sink_rates(ctx.sink), "Sink_1 on natural, random and repeated tokens")
    sec.figure(lambda: plot_sink_by_layer(ctx.sink), "Sink_1 per layer")
    sec.figure(lambda: plot_head_alpha(nat), "mean alpha_1 per head (natural text)")
    sec.data = {
        "eps": nat.eps,
        "sink_1_pct": {k: float(v) for k, v in rates.items()},
        "per_layer": {k: r.per_layer(1).to_dict("list") for k, r in ctx.sink.items()},
        "results": {k: r.to_dict() for k, r in ctx.sink.items()},  # per-head alpha [k][layer][head]
        "sink_heads_natural": [list(h) for h in nat.sink_heads(1)],
    }


def _views(ctx: _Context, sec: Section) -> None:
    if "natural" not in ctx.sink:
        from analysis.sink import sink_metric

        ctx.sink["natural"] = sink_metric(ctx.model, ctx.natural, k_max=1, kind="natural", batch_size=ctx.batch_size)
    per_layer = ctx.sink["natural"].per_layer(1)
    order = per_layer.sort_values(["sink_1_pct", "mean_alpha_1"], kind="stable")
    layers = list(dict.fromkeys([int(order.iloc[-1].layer), int(order.iloc[0].layer)]))
    tokens = ctx.natural[:1]
    from analysis.attention_view import attention_view_html

    for l, label in zip(layers, ("the layer with the most sink", "the layer with the least sink")):
        sec.parts.append(f"<h3>Layer {l}: {label} (Sink_1 {float(per_layer.sink_1_pct[l]):.0f}%)</h3>")
        sec.parts.append(f'<div class="cv">{attention_view_html(ctx.model, tokens, l)}</div>')
    sec.data = {"layers": layers, "sequence": tokens[0].tolist()}


def _massive(ctx: _Context, sec: Section) -> None:
    from analysis.massive import activation_map, massive_activations

    by_kind = {kind: massive_activations(ctx.model, p.tokens, kind=kind, batch_size=ctx.batch_size)
               for kind, p in ctx.probes.items()}
    ma = by_kind["natural"]
    ctx.massive = ma
    sec.data = {"natural": ma.to_dict(), **{k: {"spike_dims": r.to_dict()["spike_dims"], "first_token_dims":
                                                r.to_dict()["first_token_dims"], "summary": r.summary()}
                                            for k, r in by_kind.items() if k != "natural"}}
    if ma.has_spike:
        sec.say(ma.summary())
        first = ma.first_token_dims
        sec.say(f"On the first token, {len(first)} of {len(ma.layers)} layers (hook_{ma.hook}) carry massive dims "
                f"{sorted({x for v in first.values() for x in v})}; {100 * ma.first_token_share:.0f}% of all flagged "
                "activations sit on the first token.")
        if len(ma.dims):
            sec.parts.append(table_html(ma.dims, digits=1))
    else:
        sec.say(f"The first token of {ctx.name} carries no massive activation: " + ma.summary())
    for kind, r in by_kind.items():
        if kind != "natural":
            sec.say(f"On {kind} tokens: " + (f"spike dims {r.all_spike_dims} at {len(r.spike_dims)} layers "
                                             f"(on the first token at {len(r.first_token_dims)} of them)."
                                             if r.has_spike else "no massive activation."))
    layer = ma.first_layer if ma.has_spike else int(ma.per_layer.sort_values("top1").iloc[-1].layer)
    amap = activation_map(ctx.model, ctx.natural, layer, sample=0)
    sec.data["activation_map_layer"] = layer
    _optional_plots("analysis.figures.massive", [
        ("plot_top_activations", (ma,), {}, "largest |activation| and the median per layer (natural text)"),
        ("plot_activation_map", (amap,), {}, f"|h| over positions x dims at layer {layer}, first natural sequence"),
        ("plot_spike_dims_by_kind", (by_kind,), {}, "the first token's spike dims across layers, per input kind"),
    ], sec)


def _norm_gain_layer(ctx: _Context) -> int:
    """The sinkiest layer whose input (hook_resid_pre) carries the first token's spike, else the sinkiest layer."""
    per_layer = ctx.sink["natural"].per_layer(1) if "natural" in ctx.sink else None
    first = ctx.massive.first_token_dims if ctx.massive is not None else {}
    reading = sorted({l + 1 for l in first if l + 1 < ctx.dims.n_layers})
    if per_layer is None:
        return reading[0] if reading else 0
    pool = per_layer[per_layer.layer.isin(reading)] if reading else per_layer
    return int(pool.sort_values(["sink_1_pct", "mean_alpha_1"], kind="stable").iloc[-1].layer)


def _norm_gain(ctx: _Context, sec: Section) -> None:
    import warnings

    from analysis.norm_gain import norm_gain_trace

    layer = _norm_gain_layer(ctx)
    spike = None
    if ctx.massive is not None and (layer - 1) in ctx.massive.first_token_dims:
        spike = ctx.massive.first_token_dims[layer - 1]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = norm_gain_trace(ctx.model, ctx.natural, layer, spike_dims=spike, kind="natural", batch_size=ctx.batch_size)
    except ModelContractError as e:
        sec.note(f"No norm gain to trace in {ctx.name}: {e}")
        sec.data = {"applicable": False, "reason": str(e)}
        return
    sec.data = {"applicable": True, **tr.to_dict()}
    if tr.has_spike:
        sec.say(tr.summary())
        sec.parts.append(table_html(tr.stages))
        sec.parts.append(table_html(tr.gain))
    else:
        sec.say(f"The first token carries no spike in the stream layer {layer} reads, so there is no norm gain to trace "
                f"from it: {tr.message}")
    _optional_plots("analysis.figures.norm_gain", [
        ("plot_stage_shares", (tr,), {}, f"share of |.|^2 in the spike dims along the key path, layer {layer}"),
        ("plot_gain_profile", (tr,), {}, f"ln1 gain of layer {layer}, spike dims marked"),
        ("plot_head_attribution", (tr,), {}, f"alpha_1 per head of layer {layer}: full key, spike part only, spike removed"),
        ("plot_constancy", (tr,), {}, "how constant the first token's vectors are across inputs"),
    ] if tr.has_spike else [], sec)


def _key_manifold(ctx: _Context, sec: Section) -> None:
    from analysis.figures.key_manifold import plot_key_pca, plot_manifold_summary
    from analysis.key_manifold import first_key_manifold

    km = first_key_manifold(ctx.model, ctx.natural, batch_size=ctx.batch_size)
    sec.data = km.to_dict()
    S = km.summary()
    sk, ot = S["sink"], S["non_sink"]
    if S["n_sink_heads"] == 0:
        sec.say(f"No KV head has alpha_1 above {S['min_alpha']} on these inputs, so there is no sink head's first key to "
                f"describe; over all heads the first keys of different inputs have mean cosine {ot['cos_first_pair']:.3f}.")
    else:
        few = ("they are one point (no variance left to explain)" if sk["first_n90"] < 0.5 else
               f"they need {sk['first_n90']:.1f} principal components for 90% of their variance, against "
               f"{sk['mid_n90']:.1f} for as many keys at position {km.T // 2 + 1}")
        sec.say(f"In {S['n_sink_heads']} sink KV heads (alpha_1 > {S['min_alpha']}) the first keys of different inputs have "
                f"mean pairwise cosine {sk['cos_first_pair']:.3f}, against {sk['cos_mid_pair']:.3f} for the keys at position "
                f"{km.T // 2 + 1}; {few}.")
        sec.say(f"Queries point at the first key in sink heads: cos(q_t, k_1) = {sk['cos_q_k1']:.2f} against "
                f"cos(q_t, k_j) = {sk['cos_q_kj']:.2f}, although |k_1| / |k_j| = {sk['norm_ratio']:.2f}.")
        if S["n_other_heads"]:
            sec.say(f"k_1 lies {sk['offsub_z']:.2f} times as far off the other keys' principal subspace (90% of their "
                    f"variance) as those keys do in sink heads, against {ot['offsub_z']:.2f} in the other "
                    f"{S['n_other_heads']} KV heads (relative residual {sk['resid_first']:.2f} vs {sk['resid_other']:.2f}).")
    if ctx.massive is not None and S["n_sink_heads"]:
        split = _spike_split(km.table, ctx.massive.first_token_dims)
        sec.data["by_spike"] = split
        r, p = split.get("reading"), split.get("before")
        if r and p:
            where = lambda g: "off" if g["resid_first"] > g["resid_other"] else "inside"  # noqa: E731
            sec.say(f"In sink layers that read the first token's spike ({_runs(r['layers'])}), k_1 lies {where(r)} the other "
                    f"keys' principal subspace (relative residual {r['resid_first']:.2f} against {r['resid_other']:.2f} for the "
                    f"other keys); in sink layers before the spike appears ({_runs(p['layers'])}) it lies {where(p)} it "
                    f"({p['resid_first']:.2f} against {p['resid_other']:.2f}).")
    sec.figure(lambda: plot_key_pca(km), "keys of a sink head and of a non-sink head (first keys: red crosses)")
    sec.figure(lambda: plot_manifold_summary(km), "first-key statistics per layer")


def _runs(layers: list[int]) -> str:
    """[3, 4, 5, 9] -> 'layers 3-5, 9'."""
    from analysis.massive import _layer_runs

    return ("layer " if len(layers) == 1 else "layers ") + _layer_runs(layers)


def _spike_split(table: pd.DataFrame, first_token_dims: dict[int, list[int]], min_alpha: float = 0.3) -> dict:
    """Mean first-key statistics of sink layers whose input carries the first token's spike (block l reads
    hook_resid_post of l - 1) against sink layers before the first such layer."""
    reading = sorted({l + 1 for l in first_token_dims})
    by_layer = table.groupby("layer").mean(numeric_only=True)
    sinky = by_layer[by_layer.alpha_1_mean > min_alpha]
    groups = {"reading": sinky[sinky.index.isin(reading)]}
    if reading:
        groups["before"] = sinky[sinky.index < min(reading)]
    out = {}
    for name, g in groups.items():
        if len(g):
            out[name] = {"layers": [int(x) for x in g.index], "resid_first": float(g.resid_first.mean()),
                         "resid_other": float(g.resid_other.mean()), "offsub_z": float(g.offsub_z.mean()),
                         "cos_first_pair": float(g.cos_first_pair.mean()), "cos_q_k1": float(g.cos_q_k1.mean())}
    return out


def _value_norms(ctx: _Context, sec: Section) -> None:
    from analysis.figures.value_norms import plot_value_alpha, plot_value_norms
    from analysis.value_norms import value_norms

    vn = value_norms(ctx.model, ctx.natural, sink=ctx.sink.get("natural"), batch_size=ctx.batch_size)
    sec.data = vn.to_dict()
    S = vn.summary()
    c = vn.correlation()
    if S["n_sink_kv_heads"]:
        sec.say(f"The first token's value is {S['median_ratio_sink']:.3g} times the other tokens' (median |v_1| / mean |v_j| "
                f"over {S['n_sink_kv_heads']} sink KV heads), against "
                + (f"{S['median_ratio_other']:.2f} over the other {S['n_other_kv_heads']}." if S["n_other_kv_heads"] else "no other heads."))
        if S.get("mean_v1_cos_pair_sink") is not None:
            sec.say(f"In those heads the first token's values of different inputs have mean pairwise cosine "
                    f"{S['mean_v1_cos_pair_sink']:.3f}, against {S['mean_vj_cos_pair_sink']:.3f} for the values at other "
                    "positions: the first value is small and nearly constant.")
    else:
        sec.say(f"No KV head sinks (alpha_1 > {S['min_alpha']}); the median |v_1| / mean |v_j| is {S['median_ratio_other']:.2f}.")
    if c["pearson_r"] is not None:
        sec.say(f"Across {c['n']} (layer, KV head) pairs, |v_1| / |v_j| and alpha_1 correlate with Pearson r = "
                f"{c['pearson_r']:.2f} and Spearman rho = {c['spearman_rho']:.2f}.")
    else:
        sec.note(f"The correlation between |v_1| / |v_j| and alpha_1 is undefined here ({c.get('note')}).")
    sec.figure(lambda: plot_value_norms(vn), "|v_1| and mean |v_j| per layer")
    sec.figure(lambda: plot_value_alpha(vn), "|v_1| / |v_j| against alpha_1, per KV head")


def _interventions(ctx: _Context, sec: Section) -> None:
    from analysis.interventions import first_key_ablation, spike_ablation, value_ablation

    first = ctx.massive.first_token_dims if ctx.massive is not None else None
    kw = {"batch_size": ctx.batch_size}
    runs = {
        "spike_ablation": lambda: spike_ablation(ctx.model, ctx.natural, spike_dims=first, **kw),
        "value_ablation": lambda: value_ablation(ctx.model, ctx.natural, **kw),
        "first_key_ablation": lambda: first_key_ablation(
            ctx.model, ctx.natural,
            spike_dims=None if first is None else {l + 1: d for l, d in first.items() if l + 1 < ctx.dims.n_layers}, **kw),
    }
    results = {}
    for name, run in runs.items():
        try:
            r = run()
        except ModelContractError as e:
            sec.note(f"{name.replace('_', ' ').capitalize()} does not apply to {ctx.name}: {e}")
            sec.data[name] = {"applicable": False, "reason": str(e)}
            continue
        results[name] = r
        sec.data[name] = r.to_dict()
        sec.parts.append(f"<h3>{name.replace('_', ' ').capitalize()}</h3>")
        sec.say(r.text())
        summary = getattr(r, "summary", None)
        if isinstance(summary, pd.DataFrame):
            sec.parts.append(table_html(summary, digits=3))
    captions = {"spike_ablation": "Sink_1 and loss with the first token's spike dims unchanged, zeroed, or set to their mean",
                "value_ablation": "loss with the first token's value removed from the sink heads",
                "first_key_ablation": "where the attention goes when the spike-driven part of the first key is removed"}
    _optional_plots("analysis.figures.interventions",
                    [(f"plot_{name}", (r,), {}, captions[name]) for name, r in results.items()], sec)


RUNNERS: dict[str, tuple[str, Callable]] = {
    "sink": ("Sink metric", _sink),
    "views": ("Attention views (circuitsvis, offline)", _views),
    "massive": ("Massive activations", _massive),
    "norm_gain": ("Norm gain: from the spike to the first key", _norm_gain),
    "key_manifold": ("The first key's manifold", _key_manifold),
    "value_norms": ("Value norms", _value_norms),
    "interventions": ("Interventions", _interventions),
}


# ----------------------------------------------------------------------------------------------
# The page
# ----------------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}h3{font-size:1.05em}
.finding{background:#f3f7fb;border-left:4px solid #4c72b0;padding:.4em .7em}
.note{background:#fff7e6;border-left:4px solid #dd8452;padding:.4em .7em}
.error{background:#fdecea;border-left:4px solid #c44e52;padding:.4em .7em;white-space:pre-wrap;font-family:monospace;font-size:.85em}
figure{margin:1em 0}figure img{max-width:100%}figcaption{color:#555;font-size:.9em}
table.tbl{border-collapse:collapse;font-size:.85em;margin:.6em 0}table.tbl td,table.tbl th{border:1px solid #ddd;padding:2px 6px;text-align:right}
.cv{border:1px solid #eee;padding:.3em;margin:.5em 0}.small{color:#666;font-size:.85em}
"""


def _page(ctx: _Context, sections: list[Section], meta: dict) -> str:
    esc = html.escape
    findings = "".join(f"<li>{esc(f)}</li>" for s in sections for f in s.findings)
    notes = "".join(f"<li>{esc(s.title)}: {esc(n)}</li>" for s in sections for n in s.notes)
    toc = "".join(f'<li><a href="#{s.key}">{esc(s.title)}</a></li>' for s in sections)
    body = []
    for s in sections:
        body.append(f'<h2 id="{s.key}">{esc(s.title)}</h2>')
        body.extend(s.parts)
        body.append(f'<p class="small">{s.seconds:.1f} s</p>')
    d = ctx.dims
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"/><meta name="viewport" content="width=device-width, initial-scale=1"/>
<title>Attention sinks: {esc(ctx.name)}</title><style>{_CSS}</style></head>
<body>
<h1>Attention sinks in {esc(ctx.name)}</h1>
<p class="small">{d.n_layers} layers, {d.n_heads} query heads, {d.n_kv_heads} key/value heads, d_model {d.d_model},
d_head {d.d_head}. Probes: N = {ctx.n} sequences of T = {ctx.T} tokens (natural text: standard-library docstrings;
uniformly random tokens; one token repeated), no BOS, seed {ctx.seed}. Built in {meta['seconds']:.0f} s.
Every number behind the figures is in report.json beside this page.</p>
<h2>Findings</h2><ul>{findings}</ul>
{f'<h2>Not applicable or not available</h2><ul>{notes}</ul>' if notes else ''}
<h2>Contents</h2><ul>{toc}</ul>
{''.join(body)}
<hr/><p class="small">Package versions: {esc(versions)}.</p>
</body></html>
"""


def build_report(
    model,
    out_dir,
    *,
    n: int = DEFAULT_N,
    T: int = 64,
    seed: int = 0,
    progress: bool = False,
    sections=None,
    batch_size: int | None = None,
) -> Path:
    """Run the analyses on ``model`` and write ``out_dir/report.html`` and ``out_dir/report.json``; return the HTML path.

    ``sections``: a subset of ``SECTIONS`` (default: all). Sections later in the chain reuse earlier results
    (the natural-text sink result, the spike dims) when those ran. A section that does not apply to the model
    says so; one that fails is reported with its error and the others go on. Nothing is written until every
    section has run, and then each file atomically; other files in ``out_dir`` are kept.
    """
    import matplotlib

    from analysis.versions import package_versions

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")
    dims = model_dims(model)  # a model without hooks fails here, before anything is written
    for name, v in (("n", n), ("T", T)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer; got {v!r}.")
    if n < 2:
        raise ValueError(f"the report compares inputs (first keys, leave-one-out means): give n >= 2 sequences; got {n}.")
    if T < 4:
        raise ValueError(f"the report needs T >= 4 tokens per sequence; got {T}.")
    if dims.n_ctx is not None and T > dims.n_ctx:
        raise ValueError(f"T={T} exceeds the model's context of {dims.n_ctx} tokens; use T <= {dims.n_ctx}.")
    if getattr(model, "tokenizer", None) is None:
        raise ValueError("the report builds text probes and needs model.tokenizer; this model has none.")
    keys = list(SECTIONS) if sections is None else list(sections)
    bad = [k for k in keys if k not in SECTIONS]
    if bad:
        raise ValueError(f"unknown report sections {bad}; choose among {list(SECTIONS)}.")
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder; give a folder for report.html and report.json.")

    t0 = time.perf_counter()
    ctx = _Context(model, int(n), int(T), int(seed), batch_size)
    done: list[Section] = []
    for key in keys:
        title, run = RUNNERS[key]
        sec = Section(key, title)
        if progress:
            print(f"[report] {title} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            run(ctx, sec)
        except ImportError as e:
            sec.note(f"This section needs a module that is not available in this install ({e}); it was left out.")
            sec.data = {"available": False, "reason": str(e)}
        except Exception as e:  # noqa: BLE001 - one failing analysis must not lose the others
            msg = f"{type(e).__name__}: {e}"
            sec.notes.append(f"failed ({msg}); the other sections are unaffected.")
            sec.parts.append(f'<div class="error">{html.escape(traceback.format_exc(limit=4))}</div>')
            sec.data = {"error": msg}
        sec.seconds = time.perf_counter() - t
        if progress:
            print(f"[report] {title}: {sec.seconds:.1f} s", file=sys.stderr, flush=True)
        done.append(sec)

    seconds = time.perf_counter() - t0
    meta = {"versions": package_versions(), "seconds": seconds}
    payload = {
        "model": ctx.name,
        "config": {"n": ctx.n, "T": ctx.T, "seed": ctx.seed, "bos": False, "probes": {k: p.source for k, p in ctx.probes.items()}},
        "dims": {"n_layers": dims.n_layers, "n_heads": dims.n_heads, "n_kv_heads": dims.n_kv_heads,
                 "d_model": dims.d_model, "d_head": dims.d_head},
        "findings": [f for s in done for f in s.findings],
        "notes": {s.key: s.notes for s in done if s.notes},
        "spike_dims": (ctx.massive.to_dict()["spike_dims"] if ctx.massive is not None else None),
        "spike_dims_hook": (f"hook_{ctx.massive.hook}" if ctx.massive is not None else None),
        "first_token_spike_dims": (ctx.massive.to_dict()["first_token_dims"] if ctx.massive is not None else None),
        "sections": {s.key: s.data for s in done},
        "seconds": {s.key: round(s.seconds, 2) for s in done} | {"total": round(seconds, 2)},
        "versions": meta["versions"],
    }
    text = json.dumps(jsonable(payload), allow_nan=False)
    page = _page(ctx, done, meta)
    write_atomic(out / "report.json", text)
    write_atomic(out / "report.html", page)
    return out / "report.html"
