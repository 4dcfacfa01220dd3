"""The report's sections: ``generic`` shows a registered analysis' result through the protocol (its findings, its
caveats as notes, the tables and figures its section declares: ``analysis.core.registry.Section``); a runner here
lays out a section that does more (a registration names it by dotted path, ``"analysis.report.sections:_sink"``): it
calls its analysis for a pass of its own, reads several results, or adds the report's own text. They compute no
number of their own. Each runner imports its figures and analysis inside (optional dependencies: what a section whose
module or matplotlib cannot be imported does is ``build._run_section``'s)."""

from __future__ import annotations

from analysis.chain.massive import criterion_text
from analysis.chain.spike_writers import writer_summary
from analysis.core.defaults import SPIKE_ABS
from analysis.core.registry import Analysis, resolve
from analysis.core.registry import Section as Declared
from analysis.model.families import get_family
from analysis.model.hooks import ModelContractError
from analysis.report.html import Section, table_html


def _sink(ctx, sec: Section) -> None:
    # lazy: an optional dependency (the module docstring says what a missing one does)
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
    skipped = getattr(result, "skipped", "")
    return [f for f in result.findings() if not skipped or f != skipped]


def _mechanism_tables(ctx, nat, sec: Section) -> None:
    """Beside alpha_1 per head: the learned sink's mass (gpt-oss) and the attention-output gate (Qwen3-Next)."""
    if nat.has_slot:
        slot = nat.slot_per_head()
        sec.parts.append("<h3>Learned sink: attention mass on the sink slot per head, beside alpha_1</h3>")
        sec.parts.append(
            table_html(
                slot.rename(columns={"slot_share": "learned-sink mass", "slot_sink_pct": "Sink on the slot (%)"})
            )
        )
        sec.data["learned_sink_per_head"] = slot.to_dict("records")
    gates = ctx.profile.gates
    if gates is not None:
        sec.say(_unskipped(gates))
        df = nat.per_head(1)[["layer", "head", "alpha_1"]].merge(gates.table(), on=["layer", "head"])
        sec.parts.append("<h3>Gate on token 1 / elsewhere (mean sigmoid gate per head), beside alpha_1</h3>")
        sec.parts.append(
            table_html(df.rename(columns={"gate_first": "gate on token 1", "gate_other": "gate elsewhere"}))
        )
        sec.data["gates"] = gates.to_dict()


def _views(ctx, sec: Section) -> None:
    from analysis.figures.views import attention_view_html  # lazy: optional (module doc)

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


def _massive(ctx, sec: Section) -> None:
    # lazy: an optional dependency (the module docstring says what a missing one does)
    from analysis.figures.massive import plot_activation_map, plot_spike_dims_by_kind, plot_top_activations
    from analysis.chain.activation_map import activation_map
    from analysis.chain.massive import kinds_text

    by_kind = ctx.profile.massive
    ma = by_kind["natural"]
    sec.data = {
        "natural": ma.to_dict(),
        **{
            k: {
                "spike_dims": r.to_dict()["spike_dims"],
                "first_token_dims": r.to_dict()["first_token_dims"],
                "text": r.text(),
            }
            for k, r in by_kind.items()
            if k != "natural"
        },
    }
    sec.say(ma.findings(), headline=0)
    sec.explain(
        f"Every section of this report flags a massive activation by one criterion: "
        f"{criterion_text(ma.abs_threshold, ma.ratio_threshold)}, on {ma.min_share:.0%} of samples."
    )
    if ma.abs_threshold < SPIKE_ABS:
        sec.explain(
            f"{ctx.name} is {ctx.dims.d_model} wide, so its massive activations are those at least "
            f"{ma.ratio_threshold:g}x the median |a| of their hidden state, with no absolute floor: Sun et al.'s "
            f"|a| > {SPIKE_ABS:g} presumes a model of LLM width (analysis.chain.massive.spike_criterion)."
        )
    if len(ma.dims):
        sec.parts.append(table_html(ma.dims, digits=1))
    sec.say(kinds_text(by_kind, skip="natural"))
    layer = ma.peak_layer()
    sec.figure(lambda: plot_top_activations(ma), "largest |activation| and the median per layer (natural text)")
    amap = activation_map(ctx.model, ctx.natural, layer, sample=0)
    sec.data["activation_map_layer"] = layer
    sec.figure(lambda: plot_activation_map(amap), f"|h| over positions x dims at layer {layer}, first natural sequence")
    sec.figure(lambda: plot_spike_dims_by_kind(by_kind), "the first token's spike dims across layers, per input kind")


def _norm_gain(ctx, sec: Section) -> None:
    import warnings

    # lazy: an optional dependency (the module docstring says what a missing one does)
    from analysis.figures.norm_gain import plot_constancy, plot_gain_profile, plot_head_attribution, plot_stage_shares
    from analysis.chain.norm_gain import choose_layer, norm_gain_trace

    first = ctx.massive.first_token_dims  # hook_resid_post: block l reads the spikes of layer l - 1
    layer = choose_layer(
        ctx.profile.sink.get("natural"),
        first,
        ctx.dims.n_layers,
        attention_layers=get_family(ctx.model).attention_layers,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # starts at the profile's residual there
            tr = norm_gain_trace(
                ctx.model,
                ctx.natural,
                layer,
                spike_dims=first.get(layer - 1, []),
                batch_size=ctx.batch_size,
                kind="natural",
                resid=ctx.profile.resid,
                **ctx.criterion,
            )
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
    sec.figure(
        lambda: plot_head_attribution(tr),
        f"alpha_1 per head of layer {layer}: full key, spike part only, spike removed",
    )
    sec.figure(lambda: plot_constancy(tr), "how constant the first token's vectors are across inputs")


def _interventions(ctx, sec: Section) -> None:
    from analysis.figures import interventions as figs  # lazy: optional (module doc)
    from analysis.causal.interventions import first_key_ablation, spike_ablation, value_ablation

    ma, kw = ctx.massive, {"batch_size": ctx.batch_size, "eps": ctx.eps}  # the report's eps, as its baseline's
    base = ctx.profile.baseline  # with the profile's residuals: each condition resumes at the block its hooks start
    runs = {
        "spike_ablation": lambda: spike_ablation(
            ctx.model, ctx.natural, spike_dims=ma.first_token_dims, baseline=base, **kw, **ctx.criterion
        ),
        "value_ablation": lambda: value_ablation(
            ctx.model, ctx.natural, all_heads=False, later=False, baseline=base, **kw
        ),
        "first_key_ablation": lambda: first_key_ablation(
            ctx.model, ctx.natural, spike_dims=ma.input_dims(ctx.dims.n_layers), baseline=base, **kw, **ctx.criterion
        ),
    }
    captions = {
        "spike_ablation": "Sink_1 and loss with the first token's spike dims unchanged, zeroed, or set to their mean",
        "value_ablation": "loss with the first token's value removed from the sink heads",
        "first_key_ablation": "where the attention goes when the spike-driven part of the first key is removed",
    }
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
            sec.say(
                f"Setting of this cut: the spike map of this report's criterion ({criterion_text(**ctx.criterion)}), "
                f"found on the {ctx.n} natural sequences of T = {ctx.T} and zeroed at every layer it flags; another "
                "map (notebook 06's lenient >= 100x one, which adds the early spike) zeroes more dims and gives "
                "another number."
            )
        sec.parts.append(table_html(r.conditions, digits=3))
        sec.figure(lambda r=r, name=name: getattr(figs, f"plot_{name}")(r), captions[name])


def _positions(ctx, sec: Section) -> None:
    """Every sink, not only the first token: the sink table of the natural probes (``analysis.positions.every_sink``)."""
    # lazy: an optional dependency (the module docstring says what a missing one does)
    from analysis.figures.positions import plot_cos_first, plot_later_sink_heads, plot_sink_positions
    from analysis.positions.every_sink import sink_positions

    res = sink_positions(
        ctx.model, ctx.natural, eps=ctx.eps, batch_size=ctx.batch_size, kind="natural", **ctx.criterion
    )
    sec.say(_unskipped(res), headline=0)
    sec.data = res.to_dict()  # one record per sink position under "sinks"
    sec.parts.append("<h3>Later sink positions by token</h3>")
    sec.parts.append(table_html(res.by_token(), digits=2, max_rows=15))
    cols = [
        "sample",
        "position",
        "token",
        "n_heads",
        "layers",
        "max_alpha",
        "massive",
        "massive_dims",
        "peak_dim",
        "peak_abs",
        "peak_ratio",
        "peak_layer",
        "created_layer",
        "lifetime",
    ]
    sec.parts.append("<h3>Sink positions (first rows; every row in report.json)</h3>")
    sec.parts.append(table_html(res.sinks[cols], digits=2, max_rows=25))
    sec.figure(lambda: plot_sink_positions(res), "heads sinking at each position of one natural sequence")
    sec.figure(lambda: plot_later_sink_heads(res), "which heads sink on a later position")
    sec.figure(lambda: plot_cos_first(res), "cosine of each position's hidden state to the first token's, per layer")


from analysis.core.defaults import REPORT_CONTEXT_TS as CONTEXT_TS  # noqa: E402  (the report's context lengths)


def _context(ctx, sec: Section) -> None:
    """Sink_1 and the later sinks against context length and eps: a cheap range computed here, and the committed
    long-T points of the model where analysis/data/sink_context/ has them."""
    from analysis.figures.positions import plot_sink_vs_context, plot_sink_vs_eps  # lazy: optional (module doc)
    from analysis.positions.context_length import committed_sink_context, sink_vs_context

    if getattr(ctx.model, "tokenizer", None) is None:
        sec.note(f"{ctx.name} has no tokenizer, so there is no natural text to cut at other context lengths.")
        sec.data = {"applicable": False}
        return
    Ts = [t for t in CONTEXT_TS if ctx.dims.n_ctx is None or t <= ctx.dims.n_ctx]
    res = sink_vs_context(
        ctx.model, Ts=Ts, n=4, seeds=(ctx.seed, ctx.seed + 1, ctx.seed + 2), batch_size=ctx.batch_size
    )
    long = committed_sink_context(ctx.name)
    found = res.findings()  # what was measured, then Sink_1 against T: the headline, unless the long runs give it
    sec.say(found, headline=None if long is not None else min(1, len(found) - 1))
    sec.data = {"computed": res.to_dict()}
    sec.parts.append(table_html(res.by_T(), digits=2))
    sec.figure(lambda: plot_sink_vs_context(res), "Sink_1 and later sinks against context length (N = 4 per seed)")
    sec.figure(lambda: plot_sink_vs_eps(res), "Sink_1 and later sinks against eps")
    if long is not None:
        sec.parts.append("<h3>Committed long-context points (scripts/sink_context.py)</h3>")
        path = f"analysis/data/sink_context/{ctx.name}.csv"  # not this run's: each finding says so first
        found = [f"From the committed run {path} (not this report's run): {f}" for f in long.findings()]
        sec.say(found, headline=min(1, len(found) - 1))
        sec.data["committed"] = long.to_dict()
        sec.figure(lambda: plot_sink_vs_context(long), f"Sink_1 and later sinks up to T = {max(long.Ts)} (committed)")


def _spike_writers(ctx, sec: Section) -> None:
    """Where the spike comes from: the writing and erasing blocks, the writer neurons, why the first token, the cuts
    (all from the profile: its origin and the origin's follow-ups)."""
    from analysis.figures import spike_writers as figs  # lazy: optional (module doc)

    o = ctx.profile.origin
    sec.data = {"origin": o.to_dict(), "writers": writer_summary(o)}
    if not o.has_spike:
        sec.note(o.text())
        return
    for d in o.dims:
        sec.say(o.dim_findings(d), headline=0)
    sec.parts.append(table_html(o.writes.drop(columns=["write_min", "write_max"]), digits=3))
    sec.figure(
        lambda: figs.plot_spike_path(o),
        "the main spike dim on the first token through the blocks, with each block's attention and MLP writes",
    )
    for n in o.neurons:
        sec.say(n.findings())
    if o.neurons:
        sec.parts.append(table_html(o.tables["neurons"], digits=3))
        sec.figure(
            lambda: figs.plot_neuron_contributions(o),
            "the writer neurons' contributions to each writing MLP's write (first token), and their cumulative share",
        )
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
        sec.figure(
            lambda: figs.plot_first_token_cause(cause),
            "the main writer neuron's gate over what feeds it: position 1 against the same token later",
        )
    cuts = ctx.profile.cuts
    sec.data["cuts"] = cuts.to_dict()
    sec.parts.append("<h3>Cutting the writer and eraser neurons</h3>")
    if cuts.message:
        sec.note(cuts.message)
        return
    sec.explain(
        f"The first-token cause and the cuts run on the first {cuts.n_samples} of the {ctx.n} natural "
        f"sequences (the cuts: {cuts.n_random} random draws; the conditions that change the same first block share "
        f"one pass)."
    )
    sec.say(_on_subset(cuts.findings(), cuts.n_samples, ctx.n), link="cuts", headline=0)
    sec.parts.append(table_html(cuts.summary, digits=3))
    sec.figure(
        lambda: figs.plot_spike_cuts(cuts),
        "the spike, Sink_1 and the loss with the writer or eraser neurons "
        "cut on the first token, against as many random neurons",
    )


def _on_subset(found: list[str], k: int, n: int) -> list[str]:
    """The cuts' findings, the first said on its sample (the first ``k`` of the ``n`` natural sequences), so that its
    Sink_1 is not read as the sink section's."""
    if not found or k >= n:
        return found
    return [f"On the first {k} of the {n} natural sequences (their own Sink_1 baseline): {found[0]}", *found[1:]]


def _dormant(ctx, sec: Section) -> None:
    """What a sink does for its head: sink attention against the head's output norm and loss effect per query."""
    from analysis.causal.dormant_heads import dormant_heads  # lazy: optional (module doc)
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
    sec.parts.append(
        '<p class="small">Per head and query (queries after the first token, before the last one): the '
        "attention on the first token (or on an extra slot), the norm of the head's output z W_O there, and "
        "the change in the sequence's loss when that output is set to zero or to the head's mean output, "
        "estimated by gradient x activation. A query is quiet (inert) when its output norm (|loss effect|) "
        "lies below the head's median. Cost: one streamed forward pass for the heads' mean outputs and one "
        "forward + backward pass over the natural probes (batches of about 256 tokens).</p>"
    )
    if len(res.mixed_heads()):
        sec.parts.append("<h3>Per layer: medians over the heads that sink on some queries and not on others</h3>")
        sec.parts.append(table_html(res.layer_table(), digits=2))
    heads = res.example_heads(4)
    if heads:
        sec.figure(
            lambda: plot_sink_vs_norm(res, heads=heads),
            "attention on the sink against the head's output norm, "
            "one point per query, coloured by the loss effect (natural text)",
        )
    sec.figure(
        lambda: plot_head_correlations(res),
        "per head: Spearman rho of the sink attention with the output norm and with the loss effect",
    )


def generic(ctx, sec: Section, *, analysis: Analysis, section: Declared) -> None:
    """Lay out a registered pass analysis whose section names no runner: its result through the protocol
    (``_show``), and its ``to_dict()`` (by kind where it runs on every kind).

    Parameters
    ----------
    ctx
        The report's context (``analysis.report.build``): the model, the probes, the profile.
    sec : Section
        The section filled.
    analysis : analysis.core.registry.Analysis
        The analysis laid out.
    section : analysis.core.registry.Section
        Its declared section: the figures drawn and the tables shown.

    Returns
    -------
    None
    """
    got = getattr(ctx.profile, analysis.name)
    by_kind = got if analysis.every_kind else ({} if got is None else {ctx.profile.main: got})
    if not by_kind:
        sec.note(f"{analysis.name} gave no result on {ctx.name}.")
        sec.data = {"applicable": False}
        return
    for kind, res in by_kind.items():
        if analysis.every_kind:
            sec.parts.append(f"<h3>{kind}</h3>")
        _show(
            sec,
            res,
            section,
            headline=0 if kind == ctx.profile.main else None,
            label=f" ({kind})" if analysis.every_kind else "",
        )
    sec.data = {k: r.to_dict() for k, r in by_kind.items()} if analysis.every_kind else got.to_dict()


def _show(sec: Section, res, section: Declared, *, headline: int | None = 0, label: str = "") -> None:
    """One result through the protocol: its findings, its ``caveats()`` as notes, then the tables (``section.tables``,
    None: all) and the figures (``section.figures``, each caption with ``label``) its section declares."""
    sec.say(_unskipped(res), headline=headline)
    for note in res.caveats():
        sec.note(note)
    for name, df in res.tables.items():
        if section.tables is None or name in section.tables:
            sec.parts.append(table_html(df))
    for ref, caption in section.figures:
        sec.figure(lambda ref=ref: resolve(ref)(res), caption + label)
