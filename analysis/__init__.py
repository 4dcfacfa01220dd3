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

from pathlib import Path

from analysis.core.lazy import lazy_exports
from analysis.core.registry import declared

_EXPORTS = {  # name -> the module that defines it, imported when the name is first asked for
    **dict.fromkeys(["FamilySpec", "attention_layers", "get_family", "rotary_base"], "analysis.model.families"),
    **dict.fromkeys(["ModelContractError", "act_name", "model_dims"], "analysis.model.hooks"),
    **dict.fromkeys(
        ["DEFAULT_MODEL", "ModelNotFoundError", "available_models", "load_model"], "analysis.model.loading"
    ),
    **dict.fromkeys(["Profile", "profile"], "analysis.report.one_pass"),
    **dict.fromkeys(["run_pass", "run_with_reducers"], "analysis.engine.passes"),
    **dict.fromkeys(
        [
            "PROBE_KINDS",
            "ProbeSet",
            "make_probe",
            "model_probe_sets",
            "natural_probe",
            "probe_sets",
            "random_probe",
            "repeated_probe",
            "text_probe",
        ],
        "analysis.model.probes",
    ),
    **dict.fromkeys(["RepeatedTokens", "repeated_tokens"], "analysis.positions.repeated_tokens"),
    **dict.fromkeys(["EncodingGrid", "encoding_grid", "load_encoding_grid"], "analysis.positions.encodings"),
    **dict.fromkeys(["build_report"], "analysis.report.build"),
    **dict.fromkeys(["attention_view"], "analysis.figures.views"),
    **dict.fromkeys(["sink_cache"], "analysis.streaming.generate"),
}
# Each registered analysis' exports (``Analysis.exports``), read from its module's source: no import until asked for.
_EXPORTS |= {name: module for module, names in declared(Path(__file__).parent).items() for name in names}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"  # the one version: pyproject.toml reads it (dynamic), CHANGELOG.md says what it holds

__all__ = list(_EXPORTS)
