"""One self-contained HTML report and a JSON with every number behind it, for any model with TransformerLens hooks.

``build_report(model, out_dir)`` runs ``analysis.profile`` on natural, random and repeated probes (one streamed
pass per kind feeds every analysis) and lays out what it found:

1. the sink metric (Sink_1 table, per-head alpha), with offline circuitsvis attention views;
2. massive activations (the spike dims per layer, ``spike_dims`` in the JSON);
   where the spike comes from: the writing and erasing blocks, the writer neurons with their shares, why the first
   token, and the cut of the writer neurons against random ones (``analysis.chain.spike_writers``);
3. the norm-gain trace of one sink layer that reads the spike;
4. the first key's manifold (PCA of the keys, QK angles);
5. value norms against alpha_1;
6. interventions (spike, value and first-key ablations, sharing the profile's baseline pass);
7. what a sink does for its head (``analysis.causal.dormant_heads``: sink attention against the head's output norm and loss
   effect per query; one forward + backward pass of its own);
8. every sink: the positions besides the first token that sink, their heads, massive activations and alignment with
   the first token (``analysis.positions.every_sink``, a pass of its own: alpha of every key);
9. the sink against context length and eps (``analysis.positions.context_length``: T = 16..128 here, N = 4 per probe seed, 3
   seeds; the committed long-T points of the model where ``data/sink_context/`` has them);

and writes ``report.html`` (figures as inline PNG, circuitsvis views with their JavaScript inline, no CDN, no
network) and ``report.json`` into ``out_dir``, each atomically; other files in ``out_dir`` are left alone. The
findings are the results' own ``findings()``, whole sentences as each result builds them (never split here),
grouped by link of the chain (``LINKS``: the spike, the norm, the key, the attention, the value, the causal cuts, then
what a sink does for its head, every sink and the context length): the page's Findings section gives each link one
headline sentence with its details folded under it, and report.json keeps them grouped the same way. A section
whose analysis does not apply to the model (no norm gain to trace, ...) says so in a note; a section or a figure
that fails is shown with its error, the page keeps every section that worked, and ``build_report`` then raises
``ReportError`` naming the failed sections.
"""
from __future__ import annotations

import base64
import html
import io
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from analysis.core.defaults import SINK_EPS, SPIKE_ABS
from analysis.model.families import get_family
from analysis.model.hooks import ModelContractError, check_length, model_dims
from analysis.model.placement import placement_record
from analysis.core.io import check_output, write_atomic, write_json, write_or_spare
from analysis.sinks.metric import check_eps
from analysis.report.one_pass import profile
from analysis.chain.massive import criterion_text, width_criterion
from analysis.model.nnsight_model import NnsightModel
from analysis.model.probes import model_probe_sets
from analysis.core.options import REPORT_MIN_T, REPORT_N, REPORT_T_WHY, SINK_N
from analysis.core.versions import package_versions

# The report's N and T limits, and the sink command's N (the report says why its own Sink_1 differs), are owned by
# the command line's light options module, which the parser reads before torch loads.
DEFAULT_N, SINK_COMMAND_N = REPORT_N, SINK_N
NNSIGHT_SECTIONS = ("sink", "massive")  # the sections the nnsight backend serves (docs/remote.md)
SECTIONS = ("sink", "views", "massive", "spike_writers", "norm_gain", "key_manifold", "value_norms", "interventions",
            "dormant", "positions", "context")
# What each section reads from the profile pass.
NEEDS = {"sink": ("sink", "gates"), "views": ("sink",), "massive": ("massive",), "norm_gain": ("sink", "massive", "resid"),
         "key_manifold": ("key_manifold", "massive"), "value_norms": ("value_norms",),
         "interventions": ("baseline", "massive", "resid"),  # resid: later passes resume from the profile's residuals
         "spike_writers": ("massive", "origin", "baseline", "resid", "cause", "cuts"),
         "dormant": (),  # its own forward + backward pass (gradients), which the profile's inference pass cannot give
         "positions": (), "context": ()}  # their own passes (every key's alpha; other context lengths)
# The chain, link by link, then what a sink does and where else sinks are: (key, title) in the order the Findings
# section gives them; each section's findings go to its link (SECTION_LINK) unless it names another.
LINKS = (("spike", "The spike"), ("norm", "The norm"), ("key", "The key"), ("attention", "The attention"),
         ("value", "The value"), ("cuts", "The causal cuts"), ("dormant", "What a sink does for its head"),
         ("every_sink", "Every sink"), ("context", "Context length"))
SECTION_LINK = {"sink": "attention", "views": "attention", "massive": "spike", "spike_writers": "spike",
                "norm_gain": "norm", "key_manifold": "key", "value_norms": "value", "interventions": "cuts",
                "dormant": "dormant", "positions": "every_sink", "context": "context"}


class ReportError(RuntimeError):
    """Some sections or figures failed; the report was written with the sections that worked."""


# ----------------------------------------------------------------------------------------------
# Small helpers: figures, tables, sentences
# ----------------------------------------------------------------------------------------------


def figure_html(fig, *, caption: str = "", dpi: int = 90) -> str:
    """A matplotlib figure as an inline base64 PNG ``<figure>``; closes the figure.

    The figure functions lay themselves out (fixed margins, ``analysis.figures.layout``), so it is drawn once, not
    measured by a draw first (``bbox_inches="tight"``). Glyphs are drawn unhinted (about a tenth of the drawing time
    saved; at 90 dpi they look the same), and zlib level 1 encodes the PNG in about half the time of the default 6, for
    ~5% more bytes.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
    caption : str
        The caption (and the image's alt text).
    dpi : int
        Resolution.

    Returns
    -------
    str
        HTML.
    """
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    with plt.rc_context({"text.hinting": "no_hinting"}):
        fig.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": 1})
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}"/>{cap}</figure>'


def table_html(df: pd.DataFrame, *, digits: int = 3, max_rows: int = 40) -> str:
    """A DataFrame as an HTML table.

    Parameters
    ----------
    df : pandas.DataFrame
    digits : int
        Decimals of floats.
    max_rows : int
        Rows shown (the first ones).

    Returns
    -------
    str
        HTML.
    """
    if len(df) > max_rows:
        df = df.head(max_rows)
    return df.to_html(index=False, float_format=lambda v: f"{v:.{digits}f}", classes="tbl", border=0, escape=True)


@dataclass
class Finding:
    """One finding: whole sentences as a result built them, the link of the chain it belongs to, and whether it is
    that link's headline.

    Attributes
    ----------
    link : str
        The link of the chain ("spike", "norm", "key", "attention", "value", "cuts", ...).
    text : str
        Whole sentences.
    headline : bool
        Whether it heads its link in the Findings section.
    """

    link: str
    text: str
    headline: bool = False


@dataclass
class Section:
    """One section of the report as it is built.

    Attributes
    ----------
    key : str
        Its name in ``SECTIONS`` and in the JSON.
    title : str
        Its heading.
    parts : list of str
        HTML fragments, in order.
    data : dict
        The JSON payload.
    findings : list of str
        Sentences, each one finding (also in the summary at the top).
    notes : list of str
        Plain statements: not applicable, not available.
    about : list of str
        How its numbers were measured (a criterion, a subset of the probes): shown in the section, not as notes.
    errors : list of str
        What failed (the section or one of its figures).
    seconds : float
        The time it took.
    """
    key: str
    title: str
    parts: list[str] = field(default_factory=list)  # HTML fragments
    data: dict = field(default_factory=dict)  # JSON payload
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # plain statements: not applicable, not available
    about: list[str] = field(default_factory=list)  # how its numbers were measured (criterion, subset)
    errors: list[str] = field(default_factory=list)  # what failed (the section or one of its figures)
    seconds: float = 0.0

    def say(self, findings: str | list[str], *, link: str | None = None, headline: int | None = None) -> None:
        """Findings, each a whole sentence (or a few) as the result built it: shown in the section and gathered by
        ``link`` (default: the section's) in the Findings section. ``headline``: the index of the one that heads
        its link (else the link's first finding does)."""
        for i, text in enumerate([findings] if isinstance(findings, str) else findings):
            if text:
                self.findings.append(Finding(link or SECTION_LINK[self.key], text, i == headline))
                self.parts.append(f'<p class="finding">{html.escape(text)}</p>')

    def note(self, sentence: str) -> None:
        self.notes.append(sentence)
        self.parts.append(f'<p class="note">{html.escape(sentence)}</p>')

    def explain(self, sentence: str) -> None:
        """How the section's numbers were measured (a criterion, a subset of the probes): said in the section."""
        self.about.append(sentence)
        self.parts.append(f'<p class="small">{html.escape(sentence)}</p>')

    def error(self, what: str, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        self.errors.append(f"{what}: {msg}" if what else msg)
        self.parts.append(f'<div class="error">{html.escape(what + chr(10) if what else "")}'
                          f"{html.escape(traceback.format_exc(limit=4))}</div>")

    def figure(self, make: Callable, caption: str) -> None:
        """Add a figure; one that fails is shown with its error and fails the report (its numbers stay in the JSON)."""
        try:
            self.parts.append(figure_html(make(), caption=caption))
        except Exception as e:  # noqa: BLE001 - the page keeps the other figures; build_report raises at the end
            self.error(f"figure '{caption}'", e)


# ----------------------------------------------------------------------------------------------
# The sections: lay out the profile's results (the analyses live in their modules)
# ----------------------------------------------------------------------------------------------


class _Context:
    """What the sections share: the model, the probes, and the one profile pass."""

    def __init__(self, model, n: int, T: int, seed: int, batch_size: int | None, keys: list[str], *,
                 eps: float = SINK_EPS, bos: bool = False):
        self.model, self.n, self.T, self.seed, self.batch_size = model, n, T, seed, batch_size
        self.eps, self.bos = eps, bos
        self.dims = report_dims(model)
        # one massive-activation criterion for every section (the profile's own: spike_criterion)
        self.criterion = dict(zip(("abs_threshold", "ratio_threshold"), width_criterion(self.dims.d_model)))
        self.name = getattr(model, "model_name", None) or type(model).__name__
        self.probes = model_probe_sets(model, n=n, T=T, bos=bos, seed=seed)  # text, or a reference model's own task
        self.natural = self.probes["natural"].tokens
        self.analyses = tuple(dict.fromkeys(a for k in keys for a in NEEDS[k]))
        self.keys = keys
        self._profile = None
        self.profile_seconds = 0.0  # the profile passes' time, counted apart from the section that first asked

    @property
    def profile(self):
        if self._profile is None:
            t = time.perf_counter()
            self._profile = (self._nnsight_profile() if isinstance(self.model, NnsightModel) else
                             profile(self.model, self.probes, analyses=self.analyses, eps=self.eps,
                                     batch_size=self.batch_size))
            self.profile_seconds = time.perf_counter() - t
        return self._profile

    def _nnsight_profile(self):
        """The sink and massive tables per probe kind from nnsight traces, as the profile's fields."""
        from types import SimpleNamespace

        from analysis.chain.nnsight_tables import nnsight_tables  # optional: nnsight is the "remote" extra

        tables = {k: nnsight_tables(self.model, p.tokens, eps=self.eps, batch_size=self.batch_size, kind=k,
                                    **self.criterion) for k, p in self.probes.items()}
        for k, (sink, _) in tables.items():  # what was asked of the probe's first token, as the profile records it
            sink.meta["bos"]["asked"] = getattr(self.probes[k], "bos", None)
        return SimpleNamespace(sink={k: s for k, (s, _) in tables.items()},
                               massive={k: m for k, (_, m) in tables.items()}, gates=None)

    @property
    def massive(self):
        return self.profile.massive.get("natural") if "massive" in self.analyses else None


def _sink(ctx: _Context, sec: Section) -> None:
    # lazy, an optional dependency: a section whose module (or matplotlib) cannot be imported is a note (_run_section)
    from analysis.figures.sink import plot_head_alpha, plot_sink_by_layer, plot_sink_rates
    from analysis.sinks.metric import sink_table, sink_table_text

    sink = ctx.profile.sink
    nat = sink["natural"]
    sec.say(sink_table_text(sink), headline=0)
    sec.say(_unskipped(nat)[1:])  # its first sentence, Sink_1 on natural text, is in the table's sentence above
    table = sink_table(sink)
    sec.parts.append(table_html(table.reset_index(), digits=2))
    sec.data = {
        "eps": nat.eps,
        "sink_1_pct": {k: float(v) for k, v in table["Sink_1 (%)"].items()},
        "per_layer": {k: r.per_layer(1).to_dict("list") for k, r in sink.items()},
        "results": {k: r.to_dict() for k, r in sink.items()},  # per-head alpha [k][layer][head]
        "sink_heads_natural": [list(h) for h in nat.sink_heads(1)],
    }
    if nat.skipped:
        sec.note(f"The sink metric runs on the attention layers {nat.layers} of {ctx.name}. {nat.skipped}")
    _mechanism_tables(ctx, nat, sec)
    sec.figure(lambda: plot_sink_rates(sink), "Sink_1 on natural, random and repeated tokens")
    sec.figure(lambda: plot_sink_by_layer(sink), "Sink_1 per layer")
    sec.figure(lambda: plot_head_alpha(nat), "mean alpha_1 per head (natural text)")


def _unskipped(result) -> list[str]:
    """A result's findings without its sentence on skipped layers (the section says it once, as a note)."""
    return [f for f in result.findings() if not result.skipped or f != result.skipped]


def _mechanism_tables(ctx: _Context, nat, sec: Section) -> None:
    """Beside alpha_1 per head: the learned sink's mass (gpt-oss) and the attention-output gate (Qwen3-Next)."""
    if nat.has_slot:
        slot = nat.slot_per_head()
        sec.parts.append("<h3>Learned sink: attention mass on the sink slot per head, beside alpha_1</h3>")
        sec.parts.append(table_html(slot.rename(columns={"slot_share": "learned-sink mass",
                                                         "slot_sink_pct": "Sink on the slot (%)"})))
        sec.data["learned_sink_per_head"] = slot.to_dict("records")
    gates = ctx.profile.gates
    if gates is not None:
        sec.say(_unskipped(gates))
        df = nat.per_head(1)[["layer", "head", "alpha_1"]].merge(gates.table(), on=["layer", "head"])
        sec.parts.append("<h3>Gate on token 1 / elsewhere (mean sigmoid gate per head), beside alpha_1</h3>")
        sec.parts.append(table_html(df.rename(columns={"gate_first": "gate on token 1", "gate_other": "gate elsewhere"})))
        sec.data["gates"] = gates.to_dict()


def _views(ctx: _Context, sec: Section) -> None:
    # lazy, an optional dependency: a section whose module (or matplotlib) cannot be imported is a note (_run_section)
    from analysis.figures.views import attention_view_html

    nat = ctx.profile.sink["natural"]
    per_layer = nat.per_layer(1).set_index("layer")
    layers = list(dict.fromkeys(nat.extreme_layers(1)))
    if nat.skipped:
        sec.note(f"Views are drawn on attention layers only. {nat.skipped}")
    tokens = ctx.natural[:1]
    for l, label in zip(layers, ("the layer with the most sink", "the layer with the least sink")):
        sec.parts.append(f"<h3>Layer {l}: {label} (Sink_1 {float(per_layer.sink_1_pct[l]):.0f}%)</h3>")
        sec.parts.append(f'<div class="cv">{attention_view_html(ctx.model, tokens, l)}</div>')
    sec.data = {"layers": layers, "sequence": tokens[0].tolist()}


def _massive(ctx: _Context, sec: Section) -> None:
    # lazy, an optional dependency: a section whose module (or matplotlib) cannot be imported is a note (_run_section)
    from analysis.figures.massive import plot_activation_map, plot_spike_dims_by_kind, plot_top_activations
    from analysis.chain.activation_map import activation_map
    from analysis.chain.massive import kinds_text

    by_kind = ctx.profile.massive
    ma = by_kind["natural"]
    sec.data = {"natural": ma.to_dict(), **{k: {"spike_dims": r.to_dict()["spike_dims"], "first_token_dims":
                                                r.to_dict()["first_token_dims"], "text": r.text()}
                                            for k, r in by_kind.items() if k != "natural"}}
    sec.say(ma.findings(), headline=0)
    sec.explain(f"Every section of this report flags a massive activation by one criterion: "
                f"{criterion_text(ma.abs_threshold, ma.ratio_threshold)}, on {ma.min_share:.0%} of samples.")
    if ma.abs_threshold < SPIKE_ABS:
        sec.explain(f"{ctx.name} is {ctx.dims.d_model} wide, so its massive activations are those at least "
                 f"{ma.ratio_threshold:g}x the median |a| of their hidden state, with no absolute floor: Sun et al.'s "
                 f"|a| > {SPIKE_ABS:g} presumes a model of LLM width (analysis.chain.massive.spike_criterion).")
    if len(ma.dims):
        sec.parts.append(table_html(ma.dims, digits=1))
    sec.say(kinds_text(by_kind, skip="natural"))
    layer = ma.peak_layer()
    sec.figure(lambda: plot_top_activations(ma), "largest |activation| and the median per layer (natural text)")
    if isinstance(ctx.model, NnsightModel):
        sec.note("The activation map (|h| over positions x dims) is not drawn through nnsight: its traces save "
                 "per-layer statistics, never a layer's residual stream.")
    else:
        amap = activation_map(ctx.model, ctx.natural, layer, sample=0)
        sec.data["activation_map_layer"] = layer
        sec.figure(lambda: plot_activation_map(amap), f"|h| over positions x dims at layer {layer}, first natural sequence")
    sec.figure(lambda: plot_spike_dims_by_kind(by_kind), "the first token's spike dims across layers, per input kind")


def _norm_gain(ctx: _Context, sec: Section) -> None:
    import warnings

    # lazy, an optional dependency: a section whose module (or matplotlib) cannot be imported is a note (_run_section)
    from analysis.figures.norm_gain import plot_constancy, plot_gain_profile, plot_head_attribution, plot_stage_shares
    from analysis.chain.norm_gain import choose_layer, norm_gain_trace

    first = ctx.massive.first_token_dims  # hook_resid_post: block l reads the spikes of layer l - 1
    layer = choose_layer(ctx.profile.sink.get("natural"), first, ctx.dims.n_layers,
                         attention_layers=get_family(ctx.model).attention_layers)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # starts at the profile's residual there
            tr = norm_gain_trace(ctx.model, ctx.natural, layer, spike_dims=first.get(layer - 1, []),
                                 batch_size=ctx.batch_size, kind="natural", resid=ctx.profile.resid, **ctx.criterion)
    except ModelContractError as e:
        sec.note(f"No norm gain to trace in {ctx.name}: {e}")
        sec.data = {"applicable": False, "reason": str(e)}
        return
    sec.data = {"applicable": True, **tr.to_dict()}
    sec.say(tr.norm_findings(), headline=0)
    sec.say(tr.key_findings(), link="key")
    if not tr.has_spike:
        return
    sec.parts.append(table_html(tr.stages))
    sec.figure(lambda: plot_stage_shares(tr), f"share of |.|^2 in the spike dims along the key path, layer {layer}")
    if tr.norm_kind != "none":  # post-norm (OLMo-2): no gain before W_K; the key norm is in the text and heads table
        sec.parts.append(table_html(tr.gain))
        sec.figure(lambda: plot_gain_profile(tr), f"ln1 gain of layer {layer}, spike dims marked")
    sec.figure(lambda: plot_head_attribution(tr), f"alpha_1 per head of layer {layer}: full key, spike part only, spike removed")
    sec.figure(lambda: plot_constancy(tr), "how constant the first token's vectors are across inputs")


def _key_manifold(ctx: _Context, sec: Section) -> None:
    # lazy, an optional dependency: a section whose module (or matplotlib) cannot be imported is a note (_run_section)
    from analysis.figures.key_manifold import plot_key_pca, plot_manifold_summary

    km = ctx.profile.key_manifold
    sec.data = km.to_dict()
    sec.say(km.findings(), headline=0)  # the first keys: one vector, in their own subspace
    if ctx.massive is not None:
        sec.data["by_spike"] = km.by_spike(ctx.massive.first_token_dims)
        sec.say(km.by_spike_text(ctx.massive.first_token_dims))
    sec.figure(lambda: plot_key_pca(km), "keys of a sink head and of a non-sink head (first keys: red crosses)")
    sec.figure(lambda: plot_manifold_summary(km), "first-key statistics per layer")


def _value_norms(ctx: _Context, sec: Section) -> None:
    # lazy, an optional dependency: a section whose module (or matplotlib) cannot be imported is a note (_run_section)
    from analysis.figures.value_norms import plot_value_alpha, plot_value_norms

    vn = ctx.profile.value_norms
    sec.data = vn.to_dict()
    sec.say(_unskipped(vn), headline=0)
    if vn.skipped:
        sec.note(f"Value norms are measured on the attention layers {vn.layers}. {vn.skipped}")
    c = vn.correlation()
    if c["pearson_r"] is None:
        sec.note(f"The correlation between |v_1| / |v_j| and alpha_1 is undefined here ({c.get('note')}).")
    sec.figure(lambda: plot_value_norms(vn), "|v_1| and mean |v_j| per layer")
    sec.figure(lambda: plot_value_alpha(vn), "|v_1| / |v_j| against alpha_1, per KV head")


def _interventions(ctx: _Context, sec: Section) -> None:
    # lazy, an optional dependency: a section whose module (or matplotlib) cannot be imported is a note (_run_section)
    from analysis.figures import interventions as figs
    from analysis.causal.interventions import first_key_ablation, spike_ablation, value_ablation

    ma, kw = ctx.massive, {"batch_size": ctx.batch_size}
    base = ctx.profile.baseline  # with the profile's residuals: each condition resumes at the block its hooks start
    runs = {
        "spike_ablation": lambda: spike_ablation(ctx.model, ctx.natural, spike_dims=ma.first_token_dims, baseline=base,
                                                 **kw, **ctx.criterion),
        "value_ablation": lambda: value_ablation(ctx.model, ctx.natural, all_heads=False, later=False, baseline=base, **kw),
        "first_key_ablation": lambda: first_key_ablation(ctx.model, ctx.natural, spike_dims=ma.input_dims(ctx.dims.n_layers),
                                                         baseline=base, **kw, **ctx.criterion),
    }
    captions = {"spike_ablation": "Sink_1 and loss with the first token's spike dims unchanged, zeroed, or set to their mean",
                "value_ablation": "loss with the first token's value removed from the sink heads",
                "first_key_ablation": "where the attention goes when the spike-driven part of the first key is removed"}
    for name, run in runs.items():
        try:
            r = run()
        except ModelContractError as e:
            sec.note(f"{name.replace('_', ' ').capitalize()} does not apply to {ctx.name}: {e}")
            sec.data[name] = {"applicable": False, "reason": str(e)}
            continue
        sec.data[name] = r.to_dict()
        sec.parts.append(f"<h3>{name.replace('_', ' ').capitalize()}</h3>")
        sec.say(r.findings())
        if name == "spike_ablation" and r.has_spike:  # the number depends on the map: name it beside the number
            sec.say(f"Setting of this cut: the spike map of this report's criterion ({criterion_text(**ctx.criterion)}), "
                    f"found on the {ctx.n} natural sequences of T = {ctx.T} and zeroed at every layer it flags; another "
                    "map (notebook 06's lenient >= 100x one, which adds the early spike) zeroes more dims and gives "
                    "another number.")
        sec.parts.append(table_html(r.conditions, digits=3))
        sec.figure(lambda r=r, name=name: getattr(figs, f"plot_{name}")(r), captions[name])


def _positions(ctx: _Context, sec: Section) -> None:
    """Every sink, not only the first token: the sink table of the natural probes (``analysis.positions.every_sink``)."""
    # lazy, an optional dependency: a section whose module (or matplotlib) cannot be imported is a note (_run_section)
    from analysis.figures.positions import plot_cos_first, plot_later_sink_heads, plot_sink_positions
    from analysis.positions.every_sink import sink_positions

    res = sink_positions(ctx.model, ctx.natural, eps=ctx.eps, batch_size=ctx.batch_size, kind="natural",
                         **ctx.criterion)
    sec.say(_unskipped(res), headline=0)
    sec.data = res.to_dict()  # one record per sink position under "sinks"
    sec.parts.append("<h3>Later sink positions by token</h3>")
    sec.parts.append(table_html(res.by_token(), digits=2, max_rows=15))
    cols = ["sample", "position", "token", "n_heads", "layers", "max_alpha", "massive", "massive_dims", "peak_dim",
            "peak_abs", "peak_ratio", "peak_layer", "created_layer", "lifetime"]
    sec.parts.append("<h3>Sink positions (first rows; every row in report.json)</h3>")
    sec.parts.append(table_html(res.sinks[cols], digits=2, max_rows=25))
    sec.figure(lambda: plot_sink_positions(res), "heads sinking at each position of one natural sequence")
    sec.figure(lambda: plot_later_sink_heads(res), "which heads sink on a later position")
    sec.figure(lambda: plot_cos_first(res), "cosine of each position's hidden state to the first token's, per layer")


CONTEXT_TS = (16, 32, 64, 128)  # the report's cheap range of context lengths (longer ones: scripts/sink_context.py)


def _context(ctx: _Context, sec: Section) -> None:
    """Sink_1 and the later sinks against context length and eps: a cheap range computed here, and the committed
    long-T points of the model where data/sink_context/ has them."""
    # lazy, an optional dependency: a section whose module (or matplotlib) cannot be imported is a note (_run_section)
    from analysis.figures.positions import plot_sink_vs_context, plot_sink_vs_eps
    from analysis.positions.context_length import committed_sink_context, sink_vs_context

    if getattr(ctx.model, "tokenizer", None) is None:
        sec.note(f"{ctx.name} has no tokenizer, so there is no natural text to cut at other context lengths.")
        sec.data = {"applicable": False}
        return
    Ts = [t for t in CONTEXT_TS if ctx.dims.n_ctx is None or t <= ctx.dims.n_ctx]
    res = sink_vs_context(ctx.model, Ts=Ts, n=4, seeds=(ctx.seed, ctx.seed + 1, ctx.seed + 2), batch_size=ctx.batch_size)
    long = committed_sink_context(ctx.name)
    found = res.findings()  # what was measured, then Sink_1 against T: the headline, unless the long runs give it
    sec.say(found, headline=None if long is not None else min(1, len(found) - 1))
    sec.data = {"computed": res.to_dict()}
    sec.parts.append(table_html(res.by_T(), digits=2))
    sec.figure(lambda: plot_sink_vs_context(res), "Sink_1 and later sinks against context length (N = 4 per seed)")
    sec.figure(lambda: plot_sink_vs_eps(res), "Sink_1 and later sinks against eps")
    if long is not None:
        sec.parts.append("<h3>Committed long-context points (scripts/sink_context.py)</h3>")
        found = [committed_text(f, f"data/sink_context/{ctx.name}.csv") for f in long.findings()]
        sec.say(found, headline=min(1, len(found) - 1))
        sec.data["committed"] = long.to_dict()
        sec.figure(lambda: plot_sink_vs_context(long), f"Sink_1 and later sinks up to T = {max(long.Ts)} (committed)")


def committed_text(finding: str, path: str) -> str:
    """A finding read from a committed file, not measured by this run, said so in its first words.

    Parameters
    ----------
    finding : str
        Whole sentences.
    path : str
        The committed file, relative to the repository.

    Returns
    -------
    str
    """
    return f"From the committed run {path} (not this report's run): {finding}"


def _spike_writers(ctx: _Context, sec: Section) -> None:
    """Where the spike comes from: the writing and erasing blocks, the writer neurons, why the first token, the cuts
    (all from the profile: its origin and the origin's follow-ups)."""
    # lazy, an optional dependency: a section whose module (or matplotlib) cannot be imported is a note (_run_section)
    from analysis.figures import spike_writers as figs

    o = ctx.profile.origin
    sec.data = {"origin": o.to_dict(), "writers": _writer_summary(o)}
    if not o.has_spike:
        sec.note(o.text())
        return
    for d in o.dims:
        sec.say(o.dim_findings(d), headline=0)
    sec.parts.append(table_html(o.writes.drop(columns=["write_min", "write_max"]), digits=3))
    sec.figure(lambda: figs.plot_spike_path(o), "the main spike dim on the first token through the blocks, with each "
               "block's attention and MLP writes")
    for n in o.neurons:
        sec.say(n.findings())
    if o.neurons:
        sec.parts.append(table_html(o.tables["neurons"], digits=3))
        sec.figure(lambda: figs.plot_neuron_contributions(o), "the writer neurons' contributions to each writing MLP's "
                   "write (first token), and their cumulative share")
    for e in o.experts:
        sec.say(e.findings())
    for q in o.quadratic:
        sec.say(q.findings())
    if o.quadratic:
        sec.parts.append(table_html(o.tables["quadratic"], digits=3))
        sec.figure(lambda: figs.plot_spectrum(o), "the spectrum of A_d for each writing gated MLP")
    for note in o.notes:
        sec.note(note)
    cause = ctx.profile.cause
    sec.data["why_first_token"] = cause.to_dict()
    sec.parts.append("<h3>Why the first token</h3>")
    sec.say(cause.findings())
    if len(cause.contributions):
        d, b = int(cause.contributions.dim.iloc[0]), int(cause.contributions.block.iloc[-1])
        sec.parts.append(table_html(cause.chain(d, b), digits=3))
        sec.figure(lambda: figs.plot_first_token_cause(cause), "the main writer neuron's gate over what feeds it: "
                   "position 1 against the same token later")
    cuts = ctx.profile.cuts
    sec.data["cuts"] = cuts.to_dict()
    sec.parts.append("<h3>Cutting the writer and eraser neurons</h3>")
    if cuts.message:
        sec.note(cuts.message)
        return
    sec.explain(f"The first-token cause and the cuts run on the first {cuts.n_samples} of the {ctx.n} natural "
                f"sequences (the cuts: one pass per condition, {cuts.n_random} random draws).")
    sec.say(_on_subset(cuts.findings(), cuts.n_samples, ctx.n), link="cuts", headline=0)
    sec.parts.append(table_html(cuts.summary, digits=3))
    sec.figure(lambda: figs.plot_spike_cuts(cuts), "the spike, Sink_1 and the loss with the writer or eraser neurons "
               "cut on the first token, against as many random neurons")


def _on_subset(found: list[str], k: int, n: int) -> list[str]:
    """The cuts' findings, the first said on its sample (the first ``k`` of the ``n`` natural sequences), so that its
    Sink_1 is not read as the sink section's."""
    if not found or k >= n:
        return found
    return [f"On the first {k} of the {n} natural sequences (their own Sink_1 baseline): {found[0]}", *found[1:]]


def _writer_summary(o) -> list[dict]:
    """The writing blocks and, inside each writing MLP, its writer neurons with their shares of the write."""
    out = []
    for r in o.writes[o.writes.role == "writer"].itertuples():
        row = {"dim": r.dim, "component": r.component, "block": r.block, "write": r.write, "share_of_value": r.share}
        if r.component == "mlp":
            n = next((n for n in o.neurons if n.dim == r.dim and n.block == r.block), None)
            if n is not None:
                t = n.table()
                row["neurons"] = [{"neuron": int(x.neuron), "share": float(x.share)} for x in t.itertuples()]
                row["n_90"], row["n_99"] = len(n.neurons(0.9)), len(n.neurons(0.99))
        out.append(row)
    return out


def _dormant(ctx: _Context, sec: Section) -> None:
    """What a sink does for its head: sink attention against the head's output norm and loss effect per query."""
    # lazy, an optional dependency: a section whose module (or matplotlib) cannot be imported is a note (_run_section)
    from analysis.causal.dormant_heads import dormant_heads
    from analysis.causal.head_removal import copy_queries
    from analysis.figures.dormant_heads import plot_head_correlations, plot_sink_vs_norm

    try:
        active = copy_queries(ctx.model, ctx.natural)  # the synthetic task's copy positions (reference models)
    except ValueError:
        active = None
    try:
        res = dormant_heads(ctx.model, ctx.natural, active=active, kind="natural")
    except ModelContractError as e:
        sec.note(f"What a sink does for its head cannot be measured on {ctx.name}: {e}")
        sec.data = {"applicable": False, "reason": str(e)}
        return
    sec.data = {**res.to_dict(), "layer_table": res.layer_table() if len(res.mixed_heads()) else []}
    found, verdict = _unskipped(res), res.verdict_text()
    sec.say(found, headline=found.index(verdict) if verdict in found else 0)
    sec.parts.append('<p class="small">Per head and query (queries after the first token, before the last one): the '
                     "attention on the first token (or on an extra slot), the norm of the head's output z W_O there, and "
                     "the change in the sequence's loss when that output is set to zero or to the head's mean output, "
                     "estimated by gradient x activation. A query is quiet (inert) when its output norm (|loss effect|) "
                     "lies below the head's median. Cost: one streamed forward pass for the heads' mean outputs and one "
                     "forward + backward pass over the natural probes (batches of about 256 tokens).</p>")
    if len(res.mixed_heads()):
        sec.parts.append("<h3>Per layer: medians over the heads that sink on some queries and not on others</h3>")
        sec.parts.append(table_html(res.layer_table(), digits=2))
    heads = res.example_heads(4)
    if heads:
        sec.figure(lambda: plot_sink_vs_norm(res, heads=heads), "attention on the sink against the head's output norm, "
                   "one point per query, coloured by the loss effect (natural text)")
    sec.figure(lambda: plot_head_correlations(res), "per head: Spearman rho of the sink attention with the output norm "
               "and with the loss effect")


RUNNERS: dict[str, tuple[str, Callable]] = {
    "sink": ("Sink metric", _sink),
    "views": ("Attention views (circuitsvis, offline)", _views),
    "massive": ("Massive activations", _massive),
    "spike_writers": ("Where the spike comes from", _spike_writers),
    "norm_gain": ("Norm gain: from the spike to the first key", _norm_gain),
    "key_manifold": ("The first key's manifold", _key_manifold),
    "value_norms": ("Value norms", _value_norms),
    "interventions": ("Interventions", _interventions),
    "dormant": ("What a sink does for its head", _dormant),
    "positions": ("Every sink", _positions),
    "context": ("Sink against context length and eps", _context),
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
.link{margin:.4em 0;padding:.3em .7em;border-left:4px solid #4c72b0;background:#f3f7fb}
details.link summary{cursor:pointer}details.link ul{margin:.4em 0;font-size:.95em}
"""


def chain_findings(sections: list[Section]) -> list[dict]:
    """The findings grouped by link of the chain, in ``LINKS`` order: per link with any finding its ``link`` key,
    ``title``, ``headline`` (the finding said as its headline, else its first) and ``details`` (the others, in the
    order the sections said them).

    Parameters
    ----------
    sections : list of Section
        The report's sections, each with its findings.

    Returns
    -------
    list of dict
    """
    out = []
    for key, title in LINKS:
        found = [f for s in sections for f in s.findings if f.link == key]
        if found:
            head = next((f for f in found if f.headline), found[0])
            out.append({"link": key, "title": title, "headline": head.text,
                        "details": [f.text for f in found if f is not head]})
    return out


def _findings_html(chain: list[dict]) -> str:
    """One headline per link; its details folded under it."""
    esc, out = html.escape, []
    for c in chain:
        head = f'<b>{esc(c["title"])}.</b> {esc(c["headline"])}'
        if c["details"]:
            items = "".join(f"<li>{esc(d)}</li>" for d in c["details"])
            out.append(f'<details class="link"><summary>{head}</summary><ul>{items}</ul></details>')
        else:
            out.append(f'<p class="link">{head}</p>')
    return "".join(out)


def head_dims(model, dims) -> dict:
    """Each head's widths named for what they are: the query/key width and the value width, and under multi-head
    latent attention the key's decompressed and rotary parts (MLA's ``head_dim`` is its rotary part only).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    dims : analysis.model.hooks.ModelDims

    Returns
    -------
    dict
        ``d_head_qk``, ``d_head_v`` (and under MLA ``d_head_qk_nope``, ``d_head_qk_rope``), ``text``.
    """
    mla = getattr(model.spec if isinstance(model, NnsightModel) else get_family(model), "latent", None)
    if mla is None:
        return {"d_head": dims.d_head, "d_head_qk": dims.d_head, "d_head_v": dims.d_head, "text": f"d_head {dims.d_head}"}
    qk, nope, rope, v = mla["d_head"], mla["qk_nope_head_dim"], mla["qk_rope_head_dim"], mla["v_head_dim"]
    return {"d_head_qk": qk, "d_head_qk_nope": nope, "d_head_qk_rope": rope, "d_head_v": v,
            "text": f"query/key head dim {qk} ({nope} decompressed from the latent + {rope} rotary), value head dim {v} "
                    f"(multi-head latent attention)"}


def samples_text(ctx: _Context, sections: list[Section]) -> dict:
    """Which sequences each Sink_1 of the report is measured on, and why it differs from ``python -m analysis sink``'s
    (the paper's probe, N = 100): the first lines of the page.

    Parameters
    ----------
    ctx : _Context
    sections : list of Section

    Returns
    -------
    dict
        ``n``, ``sink_1_pct`` (this report's natural probe), ``sink_command_n``, ``cuts_n`` and ``cuts_sink_1_pct``
        (None without cuts), ``text``.
    """
    data = {s.key: s.data for s in sections}
    sink = data.get("sink", {}).get("sink_1_pct", {}).get("natural")
    cuts = data.get("spike_writers", {}).get("cuts") or {}
    base = [r for r in cuts.get("conditions", []) if r.get("role") == "baseline"]
    k = cuts.get("n_samples") if base else None
    here = (f"Sink_1 on natural text is {sink:.1f}% over this report's N = {ctx.n} sequences of T = {ctx.T}"
            if sink is not None else f"This report's probes are N = {ctx.n} sequences of T = {ctx.T}")
    text = (f"{here}; `python -m analysis sink` measures the same metric over N = {SINK_COMMAND_N} (the paper's "
            f"probe), so it prints another number, from more sequences (pass --n {SINK_COMMAND_N} here to get that "
            f"one).")
    if base and k < ctx.n:
        text += (f" The causal cuts of the spike's writer neurons run on the first {k} of these sequences (one pass "
                 f"per condition), whose own Sink_1 is {base[0]['sink_1_pct']:.1f}%: the baseline of their headline.")
    return {"n": ctx.n, "sink_1_pct": sink, "sink_command_n": SINK_COMMAND_N, "cuts_n": k,
            "cuts_sink_1_pct": base[0]["sink_1_pct"] if base else None, "text": text}


def _page(ctx: _Context, sections: list[Section], meta: dict) -> str:
    esc = html.escape
    findings = _findings_html(chain_findings(sections))
    notes = "".join(f"<li>{esc(s.title)}: {esc(n)}</li>" for s in sections for n in s.notes)
    errors = "".join(f"<li>{esc(s.title)}: {esc(e)}</li>" for s in sections for e in s.errors)
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
{esc(head_dims(ctx.model, d)["text"])}. Probes: N = {ctx.n} sequences of T = {ctx.T} tokens (natural text: standard-library docstrings;
uniformly random tokens; one token repeated), no BOS, seed {ctx.seed}. Built in {meta['seconds']:.0f} s
(the one profile pass per probe kind that the sections read: {ctx.profile_seconds:.0f} s; each section's own time under it).
Every number behind the figures is in report.json beside this page.</p>
<p class="note">{esc(samples_text(ctx, sections)["text"])}</p>
<h2>Findings</h2><p class="small">The chain link by link, then what a sink does and where else sinks are: one
headline each; open it for the details.</p>{findings}
{f'<h2>Failed</h2><ul class="error">{errors}</ul>' if errors else ''}
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
    eps: float = SINK_EPS,
    bos: bool = False,
    progress: bool = False,
    sections=None,
    batch_size: int | None = None,
) -> Path:
    """Run the analyses on ``model`` and write ``out_dir/report.html`` and ``out_dir/report.json``.

    One ``analysis.profile`` pass per probe kind feeds every section. A section that does not apply to the model says
    so in a note. A section or figure that fails is shown with its error; nothing is written until every section has
    run, then each file atomically (other files in ``out_dir`` are kept), and then ``ReportError`` names the failed
    sections.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    out_dir : path-like
        The folder written.
    n : int
        N, the sequences per probe kind.
    T : int
        Tokens per sequence.
    seed : int
        The probes' seed.
    eps : float
        The sink threshold (alpha_k > eps) of the sink metric.
    bos : bool
        Put the tokenizer's BOS token first in the probes (the paper: none).
    progress : bool
        Show progress bars.
    sections : sequence of str, optional
        A subset of ``SECTIONS`` (default: all).
    batch_size : int, optional
        Sequences per batch.

    Returns
    -------
    pathlib.Path
        The HTML page's path.
    """
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")
    dims = report_dims(model)  # a model without hooks fails here, before anything is written
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError(f"n (--n) must be at least 2 sequences: the report compares inputs (first keys, leave-one-out "
                         f"means); got {n!r}.")
    check_length(T, minimum=REPORT_MIN_T, why=REPORT_T_WHY)
    check_eps(eps)
    if dims.n_ctx is not None and T > dims.n_ctx:
        raise ValueError(f"T={T} exceeds the model's context of {dims.n_ctx} tokens; use T <= {dims.n_ctx}.")
    if getattr(model, "tokenizer", None) is None and not getattr(model, "reference_config", None):
        raise ValueError("the report builds text probes and needs model.tokenizer; this model has none (reference "
                         "models of the synthetic task are probed with their own task instead).")
    keys = list(SECTIONS) if sections is None else list(sections)
    bad = [k for k in keys if k not in SECTIONS]
    if bad:
        raise ValueError(f"unknown report sections {bad}; choose among {list(SECTIONS)}.")
    out = check_output(out_dir, flag="out_dir (--out)", folder=True)  # before any work

    t0 = time.perf_counter()
    run = [k for k in keys if k in NNSIGHT_SECTIONS] if isinstance(model, NnsightModel) else keys
    ctx = _Context(model, int(n), int(T), int(seed), batch_size, run, eps=float(eps), bos=bool(bos))
    done = [_run_section(ctx, key, progress) if key in run else _not_through_nnsight(key) for key in keys]
    seconds = time.perf_counter() - t0
    meta = {"versions": package_versions(), "seconds": seconds}
    payload, page = _payload(ctx, done, meta, dims), _page(ctx, done, meta)

    def write(folder: Path) -> None:  # each file atomically: a failed write leaves what was there
        write_json(folder / "report.json", payload)
        write_atomic(folder / "report.html", page)

    write_or_spare(out, write, flag="--out")
    failed = [s for s in done if s.errors]
    if failed:
        raise ReportError(f"{len(failed)} report section(s) failed: " + "; ".join(
            f"{s.key} ({'; '.join(s.errors)})" for s in failed) + f". The sections that worked are in {out / 'report.html'}.")
    return out / "report.html"


def report_dims(model):
    """``model_dims`` of a bridge, the spec's dims of an nnsight model (``load_model(name, backend="nnsight")``).

    Parameters
    ----------
    model

    Returns
    -------
    analysis.model.hooks.ModelDims
    """
    return model.dims() if isinstance(model, NnsightModel) else model_dims(model)


def _not_through_nnsight(key: str) -> Section:
    """A section the nnsight backend does not serve: a note, not a failure."""
    sec = Section(key, RUNNERS[key][0])
    sec.note("Not available through nnsight: this section reads activations its traces do not save (through nnsight "
             "the report has the sink and massive sections; docs/remote.md). Run the report without --backend nnsight "
             "for it.")
    sec.data = {"available": False, "reason": "not available through the nnsight backend"}
    return sec


def _run_section(ctx: _Context, key: str, progress: bool) -> Section:
    """Run one section; a missing optional module is a note, any other error is kept on the section."""
    title, run = RUNNERS[key]
    sec = Section(key, title)
    if progress:
        print(f"[report] {title} ...", file=sys.stderr, flush=True)
    t, before = time.perf_counter(), ctx.profile_seconds
    try:
        run(ctx, sec)
    except ImportError as e:
        sec.note(f"This section needs a module that is not available in this install ({e}); it was left out.")
        sec.data = {"available": False, "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - the page keeps the other sections; build_report raises at the end
        sec.error("", e)
        sec.data = {"error": f"{type(e).__name__}: {e}"}
    sec.seconds = time.perf_counter() - t - (ctx.profile_seconds - before)  # the profile passes: their own entry
    if progress:
        print(f"[report] {title}: {sec.seconds:.1f} s", file=sys.stderr, flush=True)
    return sec


def _payload(ctx: _Context, done: list[Section], meta: dict, dims) -> dict:
    ma = ctx.massive if ctx._profile is not None else None
    return {
        "model": ctx.name,
        "config": {"n": ctx.n, "T": ctx.T, "seed": ctx.seed, "eps": ctx.eps, "bos": ctx.bos,
                   "probes": {k: p.source for k, p in ctx.probes.items()},
                   "dtype": str(next(ctx.model.parameters()).dtype).removeprefix("torch."),
                   **placement_record(ctx.model),  # where the work ran ("device") and the weights are
                   "criteria": {"sink": f"alpha_k > eps = {ctx.eps:g}",
                                "massive_activation": criterion_text(**ctx.criterion), **ctx.criterion},
                   "positions": "the sink metric's key positions k are 1-based (k = 1 the first token); every sink's "
                                "positions are 0-based (position 0 the first token)"},
        "samples": samples_text(ctx, done),
        "dims": {"n_layers": dims.n_layers, "n_heads": dims.n_heads, "n_kv_heads": dims.n_kv_heads,
                 "d_model": dims.d_model, **{k: v for k, v in head_dims(ctx.model, dims).items() if k != "text"}},
        "findings": chain_findings(done),
        "notes": {s.key: s.notes for s in done if s.notes},
        "about": {s.key: s.about for s in done if s.about},
        "errors": {s.key: s.errors for s in done if s.errors},
        "spike_dims": (ma.to_dict()["spike_dims"] if ma is not None else None),
        "spike_dims_hook": (f"hook_{ma.hook}" if ma is not None else None),
        "first_token_spike_dims": (ma.to_dict()["first_token_dims"] if ma is not None else None),
        "sections": {s.key: s.data for s in done},
        "seconds": ({"profile": round(ctx.profile_seconds, 2)} | {s.key: round(s.seconds, 2) for s in done}
                    | {"total": round(meta["seconds"], 2)}),  # profile: the one pass per probe kind all sections read
        "versions": meta["versions"],
    }
