"""Pre-train reference language models with swappable attention, and load them for analysis.

The model (``SinkLM``) is a LLaMA-style decoder written as a TransformerLens ``HookedRootModule`` with
the hook names of ``TransformerBridge``, so every analysis of this package runs on it unchanged.

    sinklens train --preset synthetic --attention sigmoid --out runs/sigmoid
    sinklens train --list

    from analysis.train import load_reference
    model = load_reference("analysis/data/reference/synthetic-softmax")

See docs/training.md.
"""

from analysis.core.lazy import lazy_exports

_EXPORTS = {  # name -> the module that defines it, imported when the name is first asked for
    **dict.fromkeys(["AttentionOp", "available_attention", "register"], "analysis.model.reference.attention"),
    **dict.fromkeys(["CheckpointError", "load_reference"], "analysis.model.reference.checkpoint"),
    **dict.fromkeys(["ModelConfig", "TrainConfig"], "analysis.model.reference.config"),
    **dict.fromkeys(["first_token_stats", "sink_rate", "slot_sink_rate"], "analysis.dynamics.metrics"),
    **dict.fromkeys(["SinkLM"], "analysis.model.reference.sink_lm"),
    **dict.fromkeys(["PRESETS"], "analysis.train.presets"),
    **dict.fromkeys(["train"], "analysis.train.trainer"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
