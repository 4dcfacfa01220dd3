"""Named starting points for ``sinklens train --preset NAME``; any field can be overridden.

- ``synthetic``: the reference pair's configuration (1 layer, 4 heads, d_model 64, synthetic
  bigram-copy task, peak lr 1e-2, 4,000 steps of 32 x 64 tokens). Measured: 0.03 s of CPU per step with one
  thread (0.10 s per step on the shared 2-core machine at load 17), about 2 minutes of CPU for the run.
- ``induction``: the pair whose first-token spike an MLP writes (2 layers; the synthetic task with an induction
  rule on 12 keys at lags 1-3, so that second-layer heads have nothing to read for most queries; the first token is
  token 3, the most frequent content token, which only its position sets apart; 12,000 steps, weights kept at 16
  log-spaced steps, a checkpoint every 2,000 so an interrupted run resumes). Measured: 0.05 s of CPU per step with one
  thread (0.19 s per step at load 16), 10 minutes of CPU for the steps; about 25 minutes on one CPU core with its
  evaluations and snapshots.
- ``nop`` and ``broadcast``: the ground truth of the sink's kind (issue 50; ``docs/training.md``): 1 layer, d_model
  64. ``nop``: the ``synthetic`` configuration for 1,000 steps (the bigram-copy task needs a head at trigger
  positions only: a nop sink); ``broadcast``: 2 heads on ``synthetic-broadcast`` for 2,000 steps (a topic token
  first, needed at every position). 0.02-0.03 s of CPU per step with one thread; 8 to 15 minutes of wall time each
  on the shared 2-core machine at load 18.
- ``tiny-cpu``: a small natural-text model on Python standard-library docstrings. Measured on the shared 2-core
  machine: 0.15 s of CPU per step with one thread (``--threads 1``: 0.14 s per step at load 18, so its 600 steps take
  about 1.5 minutes after about 30 s of data preparation); with torch's two threads on that loaded machine a step
  takes 1.9 to 2.6 s (load 12 to 17: about 25 minutes for 600 steps), the two threads waiting for each other.
- ``paper-60m``: the paper's 60M LLaMA-style model (10 layers, d 768, 8 heads, SwiGLU 1536, RMSNorm,
  RoPE, pre-norm, context 2048, AdamW (0.9, 0.95), wd 0.1 on all parameters, clip 1.0, lr 4e-4
  constant after 100 warm-up steps, 20k steps of 1M tokens). For GPUs.
- ``natural-deep``: the deeper natural-text pair (8 layers, d 512, context 512). For a GPU.
"""

from __future__ import annotations

from typing import Optional

from analysis.core.options import TRAIN_FIELD_FLAGS
from analysis.model.reference.config import ModelConfig, TrainConfig, split_overrides

# What every preset shares; the reference pair's configuration (``synthetic``), which the other synthetic-task presets
# change in a few fields; what the natural-text GPU presets share.
_COMMON = dict(weight_decay=0.1, grad_clip=1.0, probe_size=100, probe_len=64)
_SYNTHETIC = dict(
    _COMMON,
    dataset="synthetic",
    n_layers=1,
    n_heads=4,
    steps=4000,
    n_ctx=64,
    d_model=64,
    d_mlp=256,
    act_fn="swiglu",
    normalization_type="RMS",
    positional_embedding_type="rotary",
    batch_size=32,
    lr=1e-2,
    warmup_steps=100,
    schedule="cosine",
    min_lr_ratio=0.1,
    beta1=0.9,
    beta2=0.95,
    log_every=50,
    eval_every=500,
    checkpoint_every=0,
)
_FINEWEB = dict(
    _COMMON,
    dataset="hf:HuggingFaceFW/fineweb-edu:sample-10BT",
    tokenizer="EleutherAI/gpt-neox-20b",
    n_heads=8,
    log_every=10,
    eval_every=500,
    checkpoint_every=1000,
)

PRESETS: dict[str, dict] = {
    "synthetic": _SYNTHETIC,
    "induction": dict(
        _SYNTHETIC,
        n_layers=2,
        fixed_token_position=1,
        fixed_token_id=3,
        synthetic_keys=12,
        synthetic_lags=3,
        steps=12000,
        eval_every=1000,
        checkpoint_every=2000,
        snapshots="log:16",
    ),
    "broadcast": dict(
        _SYNTHETIC,
        dataset="synthetic-broadcast",
        synthetic_vocab=32,
        synthetic_topics=4,
        synthetic_noise=0.2,
        n_heads=2,
        steps=2000,
    ),
    "tiny-cpu": dict(
        _COMMON,
        dataset="stdlib",
        tokenizer="bpe",
        tokenizer_vocab_size=2048,
        n_ctx=128,
        d_model=128,
        n_layers=2,
        n_heads=4,
        d_mlp=352,
        steps=600,
        batch_size=16,
        lr=3e-3,
        warmup_steps=50,
        schedule="cosine",
        log_every=20,
        eval_every=200,
        checkpoint_every=200,
        probe_size=64,
    ),
    "paper-60m": dict(
        _FINEWEB,
        corpus_max_chars=8_000_000_000,
        n_ctx=2048,
        d_model=768,
        n_layers=10,
        d_mlp=1536,
        act_fn="swiglu",
        normalization_type="RMS",
        norm_position="pre",
        positional_embedding_type="rotary",
        steps=20_000,
        batch_size=512,
        micro_batch_size=8,
        lr=4e-4,
        warmup_steps=100,
        schedule="constant",
        beta1=0.9,
        beta2=0.95,
        decay_all_params=True,
    ),
    "natural-deep": dict(
        _FINEWEB,
        corpus_max_chars=3_000_000_000,
        n_ctx=512,
        d_model=512,
        n_layers=8,
        d_mlp=1376,
        steps=10_000,
        batch_size=128,
        micro_batch_size=32,
        lr=1e-3,
        warmup_steps=200,
        schedule="cosine",
    ),
}

PRESETS["nop"] = {**PRESETS["synthetic"], "steps": 1000}  # the nop ground truth: the bigram-copy task as it is


def preset(name: str) -> dict:
    """The overrides of preset ``name`` (a copy).

    Parameters
    ----------
    name : str
        A key of ``PRESETS`` (ValueError, naming them, for another).

    Returns
    -------
    dict
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}.")
    return dict(PRESETS[name])


def build_configs(preset_name: Optional[str], overrides: dict) -> tuple[ModelConfig, TrainConfig]:
    """(ModelConfig, TrainConfig) of preset ``preset_name`` (or the defaults) with ``overrides`` applied.

    Parameters
    ----------
    preset_name : str or None
    overrides : dict

    Returns
    -------
    tuple of (ModelConfig, TrainConfig)
    """
    values = preset(preset_name) if preset_name else {}
    values.update(overrides)
    m, t = split_overrides(values)
    t["preset"] = preset_name
    return ModelConfig(**m), TrainConfig(**t)


def config_to_args(mcfg: ModelConfig, tcfg: TrainConfig) -> list[str]:
    """CLI options that rebuild these configs (relative to the preset, or to the defaults).

    Parameters
    ----------
    mcfg : ModelConfig
    tcfg : TrainConfig

    Returns
    -------
    list of str
    """
    base = preset(tcfg.preset) if tcfg.preset else {}
    args = ["--preset", tcfg.preset] if tcfg.preset else []
    dm, dt = ModelConfig(**split_overrides(base)[0]).to_dict(), TrainConfig(**split_overrides(base)[1]).to_dict()
    for cfg, default in ((mcfg.to_dict(), dm), (tcfg.to_dict(), dt)):
        for k, v in cfg.items():
            if k in ("preset", "d_vocab", "resume") or v == default.get(k):
                continue
            flag = TRAIN_FIELD_FLAGS.get(k, "--" + k.replace("_", "-"))
            if k == "progress":
                args += [] if v else ["--quiet"]
            elif isinstance(v, bool):
                args.append(flag if v else "--no-" + k.replace("_", "-"))
            else:
                args += [flag, "none" if v is None else str(v)]
    return args
