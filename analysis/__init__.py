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
from analysis.model.families import FamilySpec, attention_layers, get_family, rotary_base
from analysis.sinks.output_gates import attention_gates
from analysis.model.hooks import ModelContractError, act_name, model_dims
from analysis.causal.interventions import first_key_ablation, spike_ablation, value_ablation
from analysis.chain.key_manifold import first_key_manifold
from analysis.chain.massive import massive_activations
from analysis.model.loading import DEFAULT_MODEL, ModelNotFoundError, available_models, load_model
from analysis.chain.norm_gain import norm_gain_trace
from analysis.report.one_pass import Profile, profile
from analysis.engine.passes import run_pass, run_with_reducers
from analysis.model.probes import (
    PROBE_KINDS,
    ProbeSet,
    make_probe,
    natural_probe,
    probe_sets,
    random_probe,
    repeated_probe,
    text_probe,
)
from analysis.positions.every_sink import SinkPositions, sink_positions
from analysis.chain.first_token_cause import why_first_token
from analysis.chain.qk import qk_angles
from analysis.report.build import build_report
from analysis.sinks.metric import SinkResult, sink_metric, sink_table
from analysis.positions.context_length import SinkContext, sink_vs_context
from analysis.positions.repeated_tokens import RepeatedTokens, repeated_tokens
from analysis.positions.encodings import EncodingGrid, encoding_grid, load_encoding_grid
from analysis.causal.dormant_heads import dormant_heads
from analysis.causal.writer_cuts import spike_cuts
from analysis.chain.spike_writers import spike_origin
from analysis.chain.values import value_norms
from analysis.figures.views import attention_view

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
