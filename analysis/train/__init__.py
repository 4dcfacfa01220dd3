"""Pre-train reference language models with swappable attention, and load them for analysis.

The model (``SinkLM``) is a LLaMA-style decoder written as a TransformerLens ``HookedRootModule`` with
the hook names of ``TransformerBridge``, so every analysis of this package runs on it unchanged.

    python -m analysis.train --preset synthetic --attention sigmoid --out runs/sigmoid
    python -m analysis.train --list

    from analysis.train import load_reference
    model = load_reference("data/reference/synthetic-softmax")

See docs/training.md.
"""
from analysis.model.reference.attention import AttentionOp, available_attention, register
from analysis.model.reference.checkpoint import CheckpointError, load_reference
from analysis.model.reference.config import ModelConfig, TrainConfig
from analysis.dynamics.metrics import first_token_stats, sink_rate, slot_sink_rate
from analysis.model.reference.sink_lm import SinkLM
from analysis.train.presets import PRESETS
from analysis.train.trainer import train

__all__ = [
    "AttentionOp", "CheckpointError", "ModelConfig", "PRESETS", "SinkLM", "TrainConfig", "available_attention",
    "first_token_stats", "load_reference", "register", "sink_rate", "slot_sink_rate", "train",
]
