"""attention-sinks: the mechanistic interpretability of attention sinks, on TransformerLens hooks.

Start with::

    from analysis import load_model, probe_sets, sink_metric
    model = load_model("smollm2-135m")            # embedded, offline
    probes = probe_sets(model.tokenizer, n=100, T=64)
    res = sink_metric(model, probes["natural"].tokens)
    res.sink_rate(k=1)                            # Sink_1^0.3 in percent
    prof = profile(model, probes)                 # every analysis, one streamed pass per input kind
    print(prof.text())
"""
from analysis.families import FamilySpec, attention_layers, get_family
from analysis.hooks import ModelContractError, act_name, attention_layers_of, model_dims, run_with_reducers, stream
from analysis.models import DEFAULT_MODEL, ModelNotFoundError, available_models, load_model, rotary_base
from analysis.probes import (
    PROBE_KINDS,
    ProbeSet,
    make_probe,
    natural_probe,
    probe_sets,
    random_probe,
    repeated_probe,
    text_probe,
)
from analysis.sink import SinkResult, sink_metric, sink_table


def __getattr__(name):
    # The mechanism modules load on first use (they pull in scikit-learn and matplotlib).
    lazy = {
        "qk_angles": "analysis.qk", "massive_activations": "analysis.massive", "norm_gain_trace": "analysis.norm_gain",
        "first_key_manifold": "analysis.key_manifold", "value_norms": "analysis.value_norms",
        "spike_ablation": "analysis.interventions", "value_ablation": "analysis.interventions",
        "first_key_ablation": "analysis.interventions", "build_report": "analysis.report",
        "attention_view": "analysis.attention_view", "profile": "analysis.profiling", "Profile": "analysis.profiling",
        "attention_gates": "analysis.gates", "spike_origin": "analysis.spike_origin",
        "why_first_token": "analysis.first_token_cause", "spike_cuts": "analysis.spike_cuts",
    }
    if name in lazy:
        import importlib

        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(f"module 'analysis' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL", "ModelContractError", "act_name", "stream", "ModelNotFoundError", "PROBE_KINDS", "ProbeSet", "SinkResult",
    "available_models", "load_model", "make_probe", "model_dims", "natural_probe", "probe_sets",
    "random_probe", "repeated_probe", "rotary_base", "run_with_reducers", "sink_metric", "sink_table",
    "text_probe", "qk_angles", "massive_activations", "norm_gain_trace", "first_key_manifold", "value_norms",
    "spike_ablation", "value_ablation", "first_key_ablation", "build_report", "attention_view", "profile", "Profile",
    "FamilySpec", "get_family", "attention_layers", "attention_layers_of", "attention_gates", "spike_origin",
    "why_first_token", "spike_cuts",
]
