"""attention-sinks: the mechanistic interpretability of attention sinks, on TransformerLens hooks.

Start with::

    from analysis import load_model, probe_sets, sink_metric
    model = load_model("smollm2-135m")            # embedded, offline
    probes = probe_sets(model.tokenizer, n=100, T=64)
    res = sink_metric(model, probes["natural"].tokens)
    res.sink_rate(k=1)                            # Sink_1^0.3 in percent
"""
from analysis.hooks import ModelContractError, model_dims, run_with_reducers
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

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL", "ModelContractError", "ModelNotFoundError", "PROBE_KINDS", "ProbeSet", "SinkResult",
    "available_models", "load_model", "make_probe", "model_dims", "natural_probe", "probe_sets",
    "random_probe", "repeated_probe", "rotary_base", "run_with_reducers", "sink_metric", "sink_table",
    "text_probe",
]
