"""The mechanistic interpretability of attention sinks, on TransformerLens hooks: the distribution
``attention-sink-lens``, imported as ``analysis``.

Start with::

    from analysis import load_model, probe_sets, sink_metric
    model = load_model("smollm2-135m")            # embedded, offline
    probes = probe_sets(model.tokenizer, n=100, T=64)
    res = sink_metric(model, probes["natural"].tokens)
    res.sink_rate(k=1)                            # Sink_1^0.3 in percent
    prof = profile(model, probes)                 # every analysis, one streamed pass per input kind
    print(prof.text())
"""
from analysis.core.lazy import lazy_exports

_EXPORTS = {  # name -> the module that defines it, imported when the name is first asked for
    **dict.fromkeys(["FamilySpec", "attention_layers", "get_family", "rotary_base"], "analysis.model.families"),
    **dict.fromkeys(["attention_gates"], "analysis.sinks.output_gates"),
    **dict.fromkeys(["ModelContractError", "act_name", "model_dims"], "analysis.model.hooks"),
    **dict.fromkeys(["first_key_ablation", "spike_ablation", "value_ablation"], "analysis.causal.interventions"),
    **dict.fromkeys(["first_key_manifold"], "analysis.chain.key_manifold"),
    **dict.fromkeys(["massive_activations"], "analysis.chain.massive"),
    **dict.fromkeys([
        "DEFAULT_MODEL", "ModelNotFoundError", "available_models", "load_model"
    ], "analysis.model.loading"),
    **dict.fromkeys(["norm_gain_trace"], "analysis.chain.norm_gain"),
    **dict.fromkeys(["Profile", "profile"], "analysis.report.one_pass"),
    **dict.fromkeys(["run_pass", "run_with_reducers"], "analysis.engine.passes"),
    **dict.fromkeys([
        "PROBE_KINDS", "ProbeSet", "make_probe", "natural_probe", "probe_sets", "random_probe", "repeated_probe",
        "text_probe"
    ], "analysis.model.probes"),
    **dict.fromkeys(["SinkPositions", "sink_positions"], "analysis.positions.every_sink"),
    **dict.fromkeys(["why_first_token"], "analysis.chain.first_token_cause"),
    **dict.fromkeys(["qk_angles"], "analysis.chain.qk"),
    **dict.fromkeys(["build_report"], "analysis.report.build"),
    **dict.fromkeys(["SinkResult", "sink_metric", "sink_table"], "analysis.sinks.metric"),
    **dict.fromkeys(["SinkContext", "sink_vs_context"], "analysis.positions.context_length"),
    **dict.fromkeys(["RepeatedTokens", "repeated_tokens"], "analysis.positions.repeated_tokens"),
    **dict.fromkeys(["EncodingGrid", "encoding_grid", "load_encoding_grid"], "analysis.positions.encodings"),
    **dict.fromkeys(["dormant_heads"], "analysis.causal.dormant_heads"),
    **dict.fromkeys(["spike_cuts"], "analysis.causal.writer_cuts"),
    **dict.fromkeys(["spike_origin"], "analysis.chain.spike_writers"),
    **dict.fromkeys(["value_norms"], "analysis.chain.values"),
    **dict.fromkeys(["attention_view"], "analysis.figures.views"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL", "ModelContractError", "act_name", "run_pass", "ModelNotFoundError", "PROBE_KINDS", "ProbeSet", "SinkResult",
    "available_models", "load_model", "make_probe", "model_dims", "natural_probe", "probe_sets",
    "random_probe", "repeated_probe", "rotary_base", "run_with_reducers", "sink_metric", "sink_table",
    "text_probe", "qk_angles", "massive_activations", "norm_gain_trace", "first_key_manifold", "value_norms",
    "spike_ablation", "value_ablation", "first_key_ablation", "build_report", "attention_view", "profile", "Profile",
    "FamilySpec", "get_family", "attention_layers", "attention_gates",
    "sink_positions", "SinkPositions", "sink_vs_context", "SinkContext", "repeated_tokens", "RepeatedTokens",
    "encoding_grid", "load_encoding_grid", "EncodingGrid",
    "spike_origin",
    "why_first_token", "spike_cuts", "dormant_heads",
]
