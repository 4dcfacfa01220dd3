"""Where a model's weights live: one device, or accelerate's device map (several GPUs, CPU and disk offload).

A :class:`Placement` is what ``load_model(..., device_map=, max_memory=, offload_folder=)`` takes, checked before any
weight is read: the devices a map names exist, a ``max_memory`` budget too small for the model has somewhere to
offload to, the offload folder can be written, and ``device`` is not given beside a map. ``split_device_map`` writes
an explicit map that puts chosen blocks on chosen devices (e.g. blocks 10-29 of SmolLM2 on "disk").

The command line's ``--device-map`` / ``--max-memory`` / ``--offload-folder`` come from
``analysis.core.options.placement_options`` and are parsed by :func:`placement_from_args`.

:func:`input_device` is the one answer to "where do a model's inputs go": the execution device of the module that
takes the token ids (the embedding's, under accelerate's hook), never the device of "the first parameter" (on a split
model that may be a disk-offload placeholder on "meta", or a module that runs elsewhere). :func:`placement_record`
says, for the JSONs, where the weights are and where the work ran.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from analysis.model.weights import execution_device

_OFFLOAD = ("cpu", "disk")


@dataclass(frozen=True)
class Placement:
    """accelerate's big-model placement of one model.

    Attributes
    ----------
    device_map : "auto", "balanced", "sequential", dict or None
        A module-name -> device map ("cuda:0", 0, "cpu", "disk"), or one of accelerate's strategies; None: one device.
    max_memory : dict or None
        Per-device budgets for the strategies, e.g. {0: "70GiB", "cpu": "120GiB"}.
    offload_folder : str or None
        Where "disk" weights are written (None: a temporary folder when the map offloads to disk).
    """

    device_map: object = None
    max_memory: dict | None = None
    offload_folder: str | None = None

    @property
    def split(self) -> bool:
        """True when a device map is given."""
        return self.device_map is not None

    def kwargs(self) -> dict:
        """The ``from_pretrained`` keywords (``device_map``, ``max_memory``, ``offload_folder``) that are set."""
        out = {"device_map": self.device_map}
        if self.max_memory is not None:
            out["max_memory"] = self.max_memory
        if self.offload_folder is not None:
            out["offload_folder"] = self.offload_folder
        return out


def _device_exists(value) -> str | None:
    """None when the device exists here; else what is wrong, in words."""
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        value = f"cuda:{value}"
    v = str(value).strip().lower()
    if v in _OFFLOAD:
        return None
    if v == "meta":
        return "'meta' holds no weights; use 'cpu' or 'disk' to offload"
    try:
        dev = torch.device(v)
    except RuntimeError:
        return f"{value!r} is not a device (give cuda:N, N, 'cpu' or 'disk')"
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= n:
            return f"{value!r} does not exist here ({n} CUDA device{'s' if n != 1 else ''} visible)"
    elif dev.type not in ("cpu", "mps", "xpu"):
        return f"{value!r} is not a device this package places weights on (cuda:N, cpu, disk)"
    return None


def _check_folder(folder) -> None:
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(
            f"the offload folder {path} cannot be written ({type(e).__name__}: {e.strerror or e}); give "
            "--offload-folder (offload_folder=) a folder you can write, on a disk with room for the "
            "offloaded weights."
        ) from None


def check_placement(placement: Placement, *, device=None) -> Placement:
    """Check a placement before any weight is read.

    Parameters
    ----------
    placement : Placement
    device : str, optional
        The single device also asked for (must be None with a device map).

    Returns
    -------
    Placement
        The same placement; ValueError, saying what to do, for a device that does not exist, ``device`` beside a map,
        a ``max_memory`` without a map, or an offload folder that cannot be written.
    """
    dm = placement.device_map
    if dm is None:
        if placement.max_memory is not None or placement.offload_folder is not None:
            raise ValueError(
                "max_memory and offload_folder place a split model: give a device map with them "
                "(--device-map auto, or a JSON map), or leave them out."
            )
        return placement
    if device is not None:
        raise ValueError(
            f"give either a device ({device!r}) or a device map, not both: --device puts the whole model "
            "on one device, --device-map splits it (e.g. --device-map auto); drop one of them."
        )
    if isinstance(dm, str):
        if dm not in ("auto", "balanced", "balanced_low_0", "sequential"):
            bad = _device_exists(dm)
            if bad:
                raise ValueError(f"device map {dm!r}: {bad}; give 'auto', a JSON map or a map file.")
    elif isinstance(dm, dict):
        if not dm:
            raise ValueError(
                "the device map is empty: map module names to devices, e.g. "
                '{"model.embed_tokens": 0, "model.layers.0": 0, ..., "lm_head": "cpu"}, or give "auto".'
            )
        for module, dev in dm.items():
            bad = _device_exists(dev)
            if bad:
                raise ValueError(
                    f"the device map puts {module!r} on {bad}; map it to a device this machine has "
                    "(see torch.cuda.device_count()), 'cpu' or 'disk'."
                )
    else:
        raise ValueError(f"device_map must be 'auto', a dict or None; got {type(dm).__name__}.")
    for key in placement.max_memory or {}:
        bad = _device_exists(key)
        if bad:
            raise ValueError(
                f"max_memory names {bad}; give budgets for devices this machine has, e.g. 0=70GiB,cpu=120GiB."
            )
    if placement.offload_folder is not None:
        _check_folder(placement.offload_folder)
    return placement


def parse_max_memory(text: str | None) -> dict | None:
    """``--max-memory`` ("0=70GiB,cpu=120GiB") as accelerate's dict ({0: "70GiB", "cpu": "120GiB"}).

    Parameters
    ----------
    text : str or None

    Returns
    -------
    dict or None
    """
    if text is None or not str(text).strip():
        return None
    from accelerate.utils import convert_file_size_to_int  # import time: accelerate loads once a budget is given

    out = {}
    for part in str(text).split(","):
        key, sep, size = part.partition("=")
        if not sep or not key.strip() or not size.strip():
            raise ValueError(f"--max-memory takes device=size pairs such as 0=70GiB,cpu=120GiB; got {text!r}.")
        key, size = key.strip(), size.strip()
        try:  # accelerate's own reading of the size, which it applies to the budget later
            convert_file_size_to_int(size)
        except ValueError:
            raise ValueError(f"{size!r} is not a memory size; write e.g. 70GiB, 512MiB or 2GB.") from None
        out[int(key) if key.isdigit() else key] = size
    return out


def parse_device_map(text: str | None):
    """``--device-map``: "auto" (or another accelerate strategy), a JSON dict, or a ``.json`` file holding one.

    Parameters
    ----------
    text : str or None

    Returns
    -------
    str, dict or None
        Digit strings among the devices become ints (accelerate's GPU indices).
    """
    if text is None or not str(text).strip():
        return None
    text = str(text).strip()
    if text.startswith("{"):
        try:
            dm = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"--device-map is not valid JSON ({e.msg} at column {e.colno}); write e.g. "
                '\'{"model.layers.0": 0, "model.layers.1": "cpu"}\' or give a .json file.'
            ) from None
    elif text.endswith(".json") or os.sep in text:
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"no device-map file {path}; give 'auto', a JSON dict, or the path of a .json file.")
        try:
            dm = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e.msg}, line {e.lineno}).") from None
    else:
        return text
    if not isinstance(dm, dict):
        raise ValueError(f"a device map is a JSON object (module name -> device); got {type(dm).__name__}.")
    return {str(k): (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in dm.items()}


def placement_from_args(args) -> Placement:
    """The checked :class:`Placement` of parsed ``--device-map`` / ``--max-memory`` / ``--offload-folder``.

    Parameters
    ----------
    args : argparse.Namespace
        With ``device_map``, ``max_memory``, ``offload_folder`` (and ``device``, checked against the map).

    Returns
    -------
    Placement
    """
    p = Placement(
        parse_device_map(getattr(args, "device_map", None)),
        parse_max_memory(getattr(args, "max_memory", None)),
        getattr(args, "offload_folder", None),
    )
    return check_placement(p, device=getattr(args, "device", None))


def _block_list(model) -> tuple[str, torch.nn.ModuleList]:
    """(name, module) of the decoder's list of blocks (the longest ModuleList of ``_no_split_modules`` classes)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and (not names or type(mod[0]).__name__ in names):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no list of decoder blocks to split; give a device map by hand.")
    return best


def split_device_map(model: torch.nn.Module, blocks: dict[int, object], *, default="cpu") -> dict[str, object]:
    """An explicit device map: the given blocks on the given devices, every other module on ``default``.

    Parameters
    ----------
    model : transformers.PreTrainedModel, its config, or a folder / hub id
        The model (a config or folder is built on the meta device: no weights are read).
    blocks : dict of int -> device
        E.g. ``{l: "disk" for l in range(10, 30)}``.
    default : device
        Where everything else goes (embedding, norms, head, the other blocks).

    Returns
    -------
    dict
        Module name -> device, covering every parameter once.
    """
    if not isinstance(model, torch.nn.Module):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = model if not isinstance(model, (str, os.PathLike)) else AutoConfig.from_pretrained(str(model))
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(cfg)
    prefix, layers = _block_list(model)
    bad = sorted(set(blocks) - set(range(len(layers))))
    if bad:
        raise ValueError(f"blocks {bad} do not exist: the model has {len(layers)} blocks (0..{len(layers) - 1}).")
    out: dict[str, object] = {}

    def walk(name: str, mod: torch.nn.Module) -> None:
        if name == prefix:
            out.update({f"{prefix}.{i}": blocks.get(i, default) for i in range(len(layers))})
            return
        if not (prefix + ".").startswith(name + "." if name else ""):
            out[name] = default
            return
        if any(True for _ in mod.parameters(recurse=False)) or any(True for _ in mod.buffers(recurse=False)):
            raise ValueError(f"{name or 'the model'} holds weights of its own beside its blocks; give the map by hand.")
        for child, sub in mod.named_children():
            walk(f"{name}.{child}" if name else child, sub)

    walk("", model)
    return out


def _hf_of(model):
    """The Hugging Face model inside a TransformerBridge (``original_model``), or the model itself."""
    hf = getattr(model, "original_model", None)
    return hf if isinstance(hf, torch.nn.Module) else model


def _input_module(model) -> torch.nn.Module | None:
    """The module that takes the token ids: the Hugging Face input embedding, a bridge's or a reference model's
    ``embed``; None when the model has neither."""
    hf = _hf_of(model)
    get = getattr(hf, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
        if isinstance(emb, torch.nn.Module):
            return emb
    emb = getattr(model, "embed", None)
    return emb if isinstance(emb, torch.nn.Module) else None


def input_device(model: torch.nn.Module) -> torch.device:
    """Where a model's inputs go and its work starts: the execution device of the module that takes the token ids.

    Under accelerate's device map that is the embedding's hook's ``execution_device`` (its weights may sit on disk,
    "meta" placeholders on the module); on one device, the embedding's weight's device. The first parameter of a
    model is never asked: it may be an offload placeholder, or a module that runs elsewhere.

    Parameters
    ----------
    model : torch.nn.Module
        A TransformerBridge, a Hugging Face model or a reference model.

    Returns
    -------
    torch.device
        The CPU for a model with no real weight and no hook.
    """
    emb = _input_module(model)
    dev = execution_device(emb) if emb is not None else None
    if dev is None or dev.type == "meta":
        dev = execution_device(_hf_of(model))
    return dev if dev is not None and dev.type != "meta" else torch.device("cpu")


def _weight_devices(model: torch.nn.Module) -> dict[str, int]:
    """Where a model's weights are kept: device name ("cuda:0", "cpu", "disk") -> number of parameters there,
    sorted by device name. Under accelerate's device map a module's weights count where the map keeps them ("cpu",
    "disk", "cuda:N"), not as the "meta" placeholder left on the module."""
    hf = _hf_of(model)
    dm = {k: _device_name(v) for k, v in (getattr(hf, "hf_device_map", None) or {}).items()}
    out: dict[str, int] = {}
    for name, mod in hf.named_modules():
        params = list(mod.parameters(recurse=False))
        if not params:
            continue
        keys = [k for k in dm if k == "" or name == k or name.startswith(k + ".")]
        where = dm[max(keys, key=len)] if keys else str(params[0].device)
        out[where] = out.get(where, 0) + sum(p.numel() for p in params)
    return dict(sorted(out.items()))


def _device_name(value) -> str:
    """A device-map value (0, "cuda:0", "cpu", "disk") as a device name ("cuda:0", "cpu", "disk")."""
    return f"cuda:{value}" if isinstance(value, int) or str(value).isdigit() else str(value)


def placement_record(model: torch.nn.Module) -> dict:
    """What a result's JSON says about where its model ran.

    Parameters
    ----------
    model : torch.nn.Module

    Returns
    -------
    dict
        ``device``: where the inputs went and the work started (:func:`input_device`); ``weights_on``: device ->
        parameters kept there (:func:`_weight_devices`), e.g. {"cpu": 1200, "disk": 3400} for a split model.
    """
    return {"device": str(input_device(model)), "weights_on": _weight_devices(model)}
