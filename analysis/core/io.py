"""Files and plain data: atomic writes, strict JSON, dtype names, the cache folder. Used by the CLI, the report, the
loader, the trainer and notebooks."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from analysis.core.paths import OutputError, check_output, write_or_spare  # noqa: F401 (their home; named here too)

# The committed data, one owner for where it lives. What the package reads at run time ships inside it (package data,
# in the wheel too): the reference models and the long-context runs. The research runs (emergence grids, positions,
# streaming, quant) stay in the clone's data/; the functions that read them by name find them only in a clone.
PACKAGE_DATA_DIR = Path(__file__).resolve().parents[1] / "data"
DATA_DIR = Path(__file__).resolve().parents[2] / "data"  # the clone's data/ (absent where the wheel is installed)
EMERGENCE_DIR = DATA_DIR / "emergence"  # the committed emergence grids
REFERENCE_FORMAT = "attention-sinks-reference"  # the "format" key of a reference model's config.json (analysis.train)
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}


def parse_dtype(dtype, *, default: torch.dtype | None = None) -> torch.dtype | None:
    """A torch dtype from a name (``"bf16"``, ``"float32"`` ...) or a dtype; ``default`` for None.

    Parameters
    ----------
    dtype : str, torch.dtype or None
    default : torch.dtype, optional

    Returns
    -------
    torch.dtype or None
    """
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}.")
    return DTYPES[dtype]


def jsonable(obj):
    """A strictly JSON-serialisable copy: tensors, arrays and DataFrames to lists, NaN/inf to None, tuple keys
    to "a,b" strings, objects with ``to_dict()`` through it.

    Parameters
    ----------
    obj : object

    Returns
    -------
    dict, list, str, int, float, bool or None
    """
    kind = type(obj)  # the common leaves first: a report holds about 10^5 of them
    if kind is float:
        return obj if math.isfinite(obj) else None
    if kind is int or kind is str or kind is bool or obj is None:
        return obj
    if isinstance(obj, dict):
        return {(",".join(map(str, k)) if isinstance(k, tuple) else str(k)): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return jsonable(obj.detach().cpu().tolist())
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, pd.DataFrame):
        return jsonable(obj.to_dict("records"))
    if isinstance(obj, (np.bool_, bool)):
        return bool(obj)
    if isinstance(obj, (np.integer, int)):
        return int(obj)
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return v if math.isfinite(v) else None
    if obj is None or isinstance(obj, str):
        return obj
    return jsonable(obj.to_dict()) if hasattr(obj, "to_dict") else str(obj)


def records(df: pd.DataFrame) -> list[dict]:
    """A DataFrame as JSON-clean records (NaN -> None).

    Parameters
    ----------
    df : pandas.DataFrame

    Returns
    -------
    list of dict
    """
    return jsonable(df.to_dict("records"))


def write_atomic(path, text_or_write) -> None:
    """Write ``path`` through a temporary file in the same folder, synced, then ``os.replace``: an existing file is
    only ever replaced by a complete new one. ``text_or_write``: the text, or ``write(tmp_path)`` for other
    writers (tensors, tokenizers).

    Parameters
    ----------
    path : path-like
    text_or_write : str or callable

    Returns
    -------
    None
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        if callable(text_or_write):
            text_or_write(tmp)
        else:
            Path(tmp).write_text(text_or_write, encoding="utf-8")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def replace_dir(target, fill) -> Path:
    """Build a folder with ``fill(tmp_dir)`` in a temporary folder beside ``target``, then swap it in: ``target``
    is either the old complete folder or the new complete one, never half written.

    Parameters
    ----------
    target : path-like
    fill : callable
        ``fill(tmp_dir)`` writes the folder's content.

    Returns
    -------
    pathlib.Path
        ``target``.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_json(path, payload, *, indent: int | None = None) -> None:
    """Strict JSON (``jsonable``: no NaN), newline-terminated, written atomically; ``indent`` as in ``json.dumps``.

    Parameters
    ----------
    path : path-like
    payload : object
        Anything :func:`jsonable` takes.
    indent : int, optional

    Returns
    -------
    None
    """
    write_atomic(path, json.dumps(jsonable(payload), allow_nan=False, indent=indent) + "\n")


def read_log(run_dir, *, missing_ok: bool = False) -> list[dict]:
    """A training run's ``train_log.jsonl``: one record per logged step (the trainer writes it, the sweep and the
    figures read it).

    Parameters
    ----------
    run_dir : path-like
        The run's folder.
    missing_ok : bool
        Return [] for a run without a log (else FileNotFoundError).

    Returns
    -------
    list of dict
    """
    path = Path(run_dir, "train_log.jsonl")
    if missing_ok and not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cache_dir() -> Path:
    """The package's cache folder: ``$ATTENTION_SINKS_CACHE``, default ``~/.cache/attention-sink-lens`` (the embedded
    model's safetensors copy in ``smollm2-135m-instruct/``, tokenized training streams in ``train/``).

    Returns
    -------
    pathlib.Path
    """
    return Path(os.environ.get("ATTENTION_SINKS_CACHE", Path.home() / ".cache" / "attention-sink-lens"))
