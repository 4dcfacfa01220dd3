"""Checkpoints and reference models: safetensors for tensors, JSON for everything else, atomic writes.

Nothing here unpickles: model weights, optimizer moments and RNG states are safetensors files;
step counters, configs and hyper-parameters are JSON. Every file is written to a temporary name and
moved into place with ``os.replace``; a checkpoint directory becomes visible only when complete, and
``latest.json`` (itself replaced atomically) names the newest one, so a run killed at any moment
resumes from the last complete checkpoint.

Layout of a run directory ``OUT``::

    OUT/config.json          {"format": "attention-sinks-reference", "model": {...}, "train": {...}, ...}
    OUT/model.safetensors    final weights (written when the run ends)
    OUT/tokenizer.json       when the data has a tokenizer
    OUT/command.txt          the command that produced the run
    OUT/train_log.jsonl      one JSON record per logged step
    OUT/checkpoints/latest.json, OUT/checkpoints/step-000500/{model,optimizer,rng}.safetensors + state.json
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from analysis.core.io import REFERENCE_FORMAT, parse_dtype, replace_dir, write_atomic, write_json
from analysis.model.contract import check_model
from analysis.model.reference.config import ModelConfig
from analysis.model.reference.sink_lm import SinkLM

FORMAT_VERSION = 1
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token")  # the tokenizer's, kept in config.json


class CheckpointError(ValueError):
    """A checkpoint or reference model that is missing, corrupt, or does not match the configuration."""


# ----------------------------------------------------------------------------- atomic file writes


def _write_tensors(path, tensors: dict[str, torch.Tensor], *, metadata: Optional[dict] = None) -> None:
    """Tensors written as safetensors (with string ``metadata``), atomically."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def _read_tensors(path) -> dict[str, torch.Tensor]:
    """Tensors read from a safetensors file; CheckpointError, saying what to do, where it is missing or corrupt."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist.")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"could not read {path}: it is corrupt or truncated ({type(e).__name__}: {e}). Delete it (for a "
            "checkpoint, also its folder) and resume from an earlier checkpoint, or retrain."
        ) from e


def read_json(path) -> dict:
    """A JSON file read.

    Parameters
    ----------
    path : path-like

    Returns
    -------
    dict
        CheckpointError where the file is missing or corrupt.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist.")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the file is corrupt: delete it or retrain.") from e


# ----------------------------------------------------------------------------- model weights


def _load_weights(model: SinkLM, tensors: dict[str, torch.Tensor], source) -> None:
    """Strictly load ``tensors`` into ``model``; a clear CheckpointError, naming ``source``, on any mismatch."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [
        f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(expected) & set(tensors))
        if tensors[k].shape != expected[k].shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append(f"shape mismatch {shapes[:3]}")
        raise CheckpointError(
            f"the weights in {source} do not match the model configuration ({'; '.join(parts)}). Load them "
            "with the config.json written beside them, or pass the same model options as the run that wrote them."
        )
    with torch.no_grad():
        for k, v in expected.items():
            v.copy_(tensors[k].to(v.dtype))


# ----------------------------------------------------------------------------- optimizer state


def _optimizer_tensors(optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state as named tensors plus JSON hyper-parameters. ``names`` lists the parameter names in
    the optimizer's parameter order."""
    sd = optimizer.state_dict()
    tensors = {}
    for idx, state in sd["state"].items():
        for key, val in state.items():
            t = val if torch.is_tensor(val) else torch.tensor(val)
            tensors[f"{names[idx]}::{key}"] = t
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": g["params"]} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "param_names": names}


def _load_optimizer(optimizer, tensors: dict[str, torch.Tensor], meta: dict, names: list[str], source) -> None:
    """Restore AdamW's state from named tensors (``name::field`` -> state) and ``meta`` (``param_names``,
    ``param_groups``); ``names``: the parameter names in the optimizer's order; ``source`` is named in errors."""
    if meta.get("param_names") != names:
        raise CheckpointError(
            f"the optimizer state in {source} was written for different parameters; resume with the same "
            "model options, or start a new run in another --out folder."
        )
    state: dict[int, dict] = {}
    index = {n: i for i, n in enumerate(names)}
    for key, val in tensors.items():
        name, _, field = key.rpartition("::")
        if name not in index:
            raise CheckpointError(f"{source}: optimizer entry {key!r} names no parameter of the model.")
        state.setdefault(index[name], {})[field] = val
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# ----------------------------------------------------------------------------- RNG state


def _rng_tensors() -> dict[str, torch.Tensor]:
    """The random number generators' states (CPU, and CUDA where used)."""
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    return out


def _restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    """Restore the random number generators' states (as :func:`_rng_tensors` made them)."""
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])


# ----------------------------------------------------------------------------- training checkpoints


def save_checkpoint(out: Path, step: int, model: SinkLM, optimizer, names: list[str], state: dict, keep: int) -> Path:
    """Write checkpoint ``step`` completely, then point ``latest.json`` at it; prune old ones.

    Parameters
    ----------
    out : pathlib.Path
        The run's folder.
    step : int
    model : torch.nn.Module
    optimizer : torch.optim.Optimizer
    names : list of str
        The parameter names in the optimizer's order.
    state : dict
        The loop's state (JSON).
    keep : int
        Checkpoints kept.

    Returns
    -------
    pathlib.Path
        The checkpoint's folder.
    """
    root = Path(out) / "checkpoints"

    def fill(tmp: Path) -> None:
        _write_tensors(tmp / "model.safetensors", model.state_dict())
        opt_t, opt_meta = _optimizer_tensors(optimizer, names)
        _write_tensors(tmp / "optimizer.safetensors", opt_t)
        _write_tensors(tmp / "rng.safetensors", _rng_tensors())
        write_json(
            tmp / "state.json",
            {**state, "step": step, "optimizer": opt_meta, "format_version": FORMAT_VERSION},
            indent=2,
        )

    final = replace_dir(root / f"step-{step:07d}", fill)
    write_json(root / "latest.json", {"step": step, "dir": final.name}, indent=2)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(out: Path) -> Optional[Path]:
    """The folder of a run's latest checkpoint.

    Parameters
    ----------
    out : path-like
        The run's folder.

    Returns
    -------
    pathlib.Path or None
        None where the run has none.
    """
    root = Path(out) / "checkpoints"
    if not (root / "latest.json").is_file():
        return None
    latest = read_json(root / "latest.json")
    path = root / str(latest.get("dir", ""))
    if not path.is_dir():
        raise CheckpointError(
            f"{root / 'latest.json'} points to {path}, which does not exist; delete "
            "latest.json to start over, or restore the folder."
        )
    return path


def load_checkpoint(path: Path, model: SinkLM, optimizer, names: list[str]) -> dict:
    """Restore model, optimizer and RNG from a checkpoint folder; returns its state.json.

    Parameters
    ----------
    path : pathlib.Path
        A checkpoint folder.
    model : torch.nn.Module
    optimizer : torch.optim.Optimizer
    names : list of str

    Returns
    -------
    dict
    """
    path = Path(path)
    state = read_json(path / "state.json")
    _load_weights(model, _read_tensors(path / "model.safetensors"), path / "model.safetensors")
    _load_optimizer(
        optimizer,
        _read_tensors(path / "optimizer.safetensors"),
        state["optimizer"],
        names,
        path / "optimizer.safetensors",
    )
    _restore_rng(_read_tensors(path / "rng.safetensors"))
    return state


# ----------------------------------------------------------------------------- reference models


def save_reference(out: Path, model: SinkLM, config: dict) -> None:
    """Final weights + config.json (with the reference format key) + tokenizer.json when there is one.

    Parameters
    ----------
    out : pathlib.Path
        The run's folder.
    model : SinkLM
    config : dict
        The model and training configs.

    Returns
    -------
    None
    """
    out = Path(out)
    _write_tensors(out / "model.safetensors", model.state_dict(), metadata={"format": REFERENCE_FORMAT})
    tok = getattr(model, "tokenizer", None)
    if tok is not None and hasattr(tok, "backend_tokenizer"):
        write_atomic(out / "tokenizer.json", lambda tmp: tok.backend_tokenizer.save(tmp))
        config = {**config, "tokenizer": {"file": "tokenizer.json", **{k: getattr(tok, k) for k in _SPECIAL_TOKENS}}}
    write_json(out / "config.json", {"format": REFERENCE_FORMAT, "format_version": FORMAT_VERSION, **config}, indent=2)


def _resolve_reference(path_or_dir) -> Path:
    p = Path(path_or_dir).expanduser()
    if p.is_file():
        p = p.parent
    if not p.is_dir():
        raise CheckpointError(f"{p} is not a folder with a reference model (config.json + model.safetensors).")
    return p


def load_reference(path_or_dir, *, device=None, dtype=None):
    """Load a model trained by ``analysis.train`` (a run folder, or its config.json / model.safetensors).

    Returns the ``SinkLM`` in eval mode, with ``.tokenizer`` (or None for the synthetic task) and
    ``.reference_config`` (the whole config.json: training options, data description, final metrics).

    Parameters
    ----------
    path_or_dir : path-like
    device : str, optional
    dtype : torch.dtype or str, optional

    Returns
    -------
    SinkLM
    """
    d = _resolve_reference(path_or_dir)
    cfg = read_json(d / "config.json")
    if cfg.get("format") != REFERENCE_FORMAT:
        raise CheckpointError(
            f'{d / "config.json"} has no "format": "{REFERENCE_FORMAT}" key: it was not '
            "written by analysis.train (for a Hugging Face folder use analysis.load_model)."
        )
    if "model" not in cfg:
        raise CheckpointError(f"{d / 'config.json'} has no 'model' section; the file is incomplete.")
    try:
        mcfg = ModelConfig.from_dict(cfg["model"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{d / 'config.json'}: invalid model config ({e}).") from e
    tokenizer = None
    tok_info = cfg.get("tokenizer")
    if tok_info and (d / tok_info.get("file", "tokenizer.json")).is_file():
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(d / tok_info.get("file", "tokenizer.json")),
            **{k: tok_info.get(k) for k in _SPECIAL_TOKENS},
        )
    model = SinkLM(mcfg, tokenizer=tokenizer)
    _load_weights(model, _read_tensors(d / "model.safetensors"), d / "model.safetensors")
    model.reference_config = cfg
    model.model_name = d.name
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = parse_dtype(dtype)
    model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return check_model(model.eval())  # the model contract, checked once, at load
