"""The command line's one vocabulary: the options its commands share, defined once.

Each group is an argparse parent parser (``add_parser(..., parents=[...])``), so an option has the same name, help and
meaning in every command that takes it, and ``--help`` shows its default (``HelpFormatter``):

- ``model_options``: ``--model --device --dtype --threads --quiet`` (every command that loads a model);
- ``_probe_options``: ``--n --T --seed`` (the commands that draw probes; ``stream`` and ``quant`` take ``--seed``, and
  ``quant`` its window length ``--T``, alone from ``shared_option``);
- ``sink_options``: ``--eps --bos`` (every command that measures the sink);
- ``placement_options``: ``--device-map --max-memory --offload-folder`` (a model split over devices).
- ``backend_options``: ``--backend --remote`` (what runs the passes; on NDIF through nnsight).

``VOCABULARY`` holds the help of every option more than one command takes (``train`` and ``sweep`` included, whose
config fields take these names: ``TRAIN_FIELD_FLAGS``). ``tests/test_cli_vocabulary.py`` holds every command's options
to it.

This module imports nothing heavy: the command line parses and checks before torch loads. Output paths (``--json``,
``--csv``, ``--out``) are checked with ``analysis.core.paths.check_output``.
"""

from __future__ import annotations

import argparse
import inspect
import shlex
import sys
from typing import Callable

from analysis.core.defaults import BACKENDS, CLI_BACKEND, SINK_EPS

CLI_DTYPES = (
    "float32",
    "bfloat16",
    "float16",
)  # --dtype: the weights' and activations' dtype; metrics reduce in float32
DEFAULT_T = 64  # the paper's probe length
DEFAULT_MODEL = "smollm2-135m"  # the embedded model (analysis.model.loading.DEFAULT_MODEL)
SINK_N = 100  # `sink --n`: the paper's probe
REPORT_N = 32  # `report --n`: the sample its published numbers were measured on
REPORT_MIN_T = 4  # tokens per sequence the report needs
REPORT_T_WHY = (
    "The report's attention shares read the queries from the third token on, against the first, previous "
    "and own keys; the paper's probe uses T = 64."
)

# One help text per shared option name: the option means this in every command that takes it. None: the option names
# one output, whose help says what each command writes there.
VOCABULARY = {
    "--model": "a name from `sinklens models`, a local Hugging Face folder or .gguf file, or a hub id",
    "--device": "auto, cpu, cuda, cuda:1, mps ...; auto: cuda when available, else cpu (cuda without CUDA is an error)",
    "--dtype": f"the model's dtype: {', '.join(CLI_DTYPES)} (every metric is reduced in float32)",
    "--threads": "torch CPU threads (None: torch's default)",
    "--quiet": "no progress bars",
    "--n": "sequences per probe (per input kind; paper: 100)",
    "--T": "tokens per sequence, the BOS included (paper: 64)",
    "--seed": "the seed of what the command draws: the probes (sink, report), the stream's text order (stream), the "
    "calibration draws (quant, a comma list), the initialisation and batches (train; sweep: a comma list)",
    "--eps": "a head sinks on key k when alpha_k > eps (paper: 0.3)",
    "--bos": "put the tokenizer's BOS token first in every sequence (paper: no BOS; the results say whether one is "
    "first)",
    "--kv-bits": "bits of the quantised KV cache, comma-separated ('' to leave it out)",
    "--device-map": "'auto', a JSON map {module: device} or a .json file; devices cuda:N / N, cpu, disk (not with "
    "--device)",
    "--max-memory": "per-device budgets for --device-map auto, e.g. 0=70GiB,cpu=120GiB",
    "--offload-folder": "where weights mapped to 'disk' are kept",
    "--preset": "a named starting configuration (sinklens train --list)",
    "--backend": "what runs the passes: 'auto' (the Hugging Face model in its own attention, no T x T map, wherever it "
    "gives what a pass reads; else the bridge), 'transformers', 'transformer_lens' (the bridge's hook "
    "points) or 'nnsight' (the same reads inside nnsight traces; the 'remote' extra; docs/remote.md); the "
    "JSON records which ran and why",
    "--remote": "with --backend nnsight: run the traces on NDIF, for the sink and massive tables (needs NDIF_API_KEY; "
    "docs/remote.md)",
    "--json": None,
    "--out": None,
}

# train and sweep: config field -> option, where the field's own name would clash with the vocabulary.
TRAIN_FIELD_FLAGS = {"eps": "--norm-eps", "sink_eps": "--eps", "probe_size": "--n", "probe_len": "--T"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every option's default shown (``(default: ...)``), descriptions kept as written."""


def _parent(title: str | None, *options: tuple[str, dict]) -> argparse.ArgumentParser:
    """A parent parser holding ``options`` (flag, ``add_argument`` keywords), each with its ``VOCABULARY`` help, in
    the argument group ``title`` (None: no group)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group(title) if title else p
    for flag, kwargs in options:
        g.add_argument(flag, help=VOCABULARY[flag], **kwargs)
    return p


def model_options(default_model: str = DEFAULT_MODEL, *, model_flag: bool = True) -> argparse.ArgumentParser:
    """``--model --device --dtype --threads --quiet``, as a parent parser.

    Parameters
    ----------
    default_model : str
        The model taken without ``--model``.
    model_flag : bool
        Add ``--model`` (False: a command that names its models otherwise, ``atlas MODEL [MODEL ...]``).

    Returns
    -------
    argparse.ArgumentParser
    """
    return _parent(
        "model",
        *([("--model", dict(default=default_model))] if model_flag else []),
        ("--device", dict(default="auto")),
        ("--dtype", dict(default="float32")),
        ("--threads", dict(type=int, default=None)),
        ("--quiet", dict(action="store_true")),
    )


def _probe_options(*, n: int, T: int = DEFAULT_T) -> argparse.ArgumentParser:
    """``--n --T --seed``, as a parent parser.

    ``n`` is this command's default of ``--n`` (``sink``: the paper's 100; ``report``: 32, the sample its published
    numbers were measured on).
    """
    return _parent(
        "probes",
        ("--n", dict(type=int, default=n)),
        ("--T", dict(type=int, default=T)),
        ("--seed", dict(type=int, default=0)),
    )


def shared_option(flag: str, **kwargs) -> argparse.ArgumentParser:
    """One option of the vocabulary alone, as a parent parser (``stream``: ``--seed``; ``quant``: ``--T``, the length
    of its scored windows, and ``--seed`` as a comma list of calibration draws, parsed by the command).

    Parameters
    ----------
    flag : str
        A ``VOCABULARY`` option (its help is taken from there).
    **kwargs
        ``add_argument``'s keywords (its type and default).

    Returns
    -------
    argparse.ArgumentParser
    """
    return _parent(None, (flag, kwargs))


def sink_options() -> argparse.ArgumentParser:
    """``--eps --bos``, as a parent parser.

    Returns
    -------
    argparse.ArgumentParser
    """
    return _parent("sink", ("--eps", dict(type=float, default=SINK_EPS)), ("--bos", dict(action="store_true")))


def placement_options() -> argparse.ArgumentParser:
    """``--device-map --max-memory --offload-folder``, as a parent parser (parsed by
    ``analysis.model.placement.placement_from_args``).

    Returns
    -------
    argparse.ArgumentParser
    """
    flags = ("--device-map", "--max-memory", "--offload-folder")
    return _parent(
        "split a model over devices (accelerate; see docs/scale.md)", *((f, dict(default=None)) for f in flags)
    )


def backend_options() -> argparse.ArgumentParser:
    """``--backend --remote``, as a parent parser (the subcommands whose tables nnsight can compute).

    Returns
    -------
    argparse.ArgumentParser
    """
    return _parent(
        "backend", ("--backend", dict(choices=BACKENDS, default=CLI_BACKEND)), ("--remote", dict(action="store_true"))
    )


def sink_command_options(*, n: int, model_flag: bool = True) -> list[argparse.ArgumentParser]:
    """The parents of the commands that measure the sink on probes (``sink``, ``report``, ``atlas``).

    Parameters
    ----------
    n : int
        The default of ``--n`` (as in :func:`_probe_options`).
    model_flag : bool
        Add ``--model`` (as in :func:`model_options`).

    Returns
    -------
    list of argparse.ArgumentParser
        The model, probe, sink, placement and backend options.
    """
    return [
        model_options(model_flag=model_flag),
        _probe_options(n=n),
        sink_options(),
        placement_options(),
        backend_options(),
    ]


def command_doc(returns: str, *more: str) -> Callable:
    """Decorator of a function of the parsed options: its docstring gets the sections every such function has,
    ``Parameters`` (``args : argparse.Namespace``) and ``Returns`` (``returns``, then the lines ``more``), written once.

    Parameters
    ----------
    returns : str
        The returned type (``int``: an exit status; ``None``: a check).
    *more : str
        The lines that say what it returns.

    Returns
    -------
    callable
        The decorator; it returns the function, its docstring completed.
    """
    tail = ["", "", "Parameters", "----------", "args : argparse.Namespace", "", "Returns", "-------", returns]

    def decorate(fn: Callable) -> Callable:
        fn.__doc__ = inspect.cleandoc(fn.__doc__ or "") + "\n".join(tail + ["    " + line for line in more])
        return fn

    return decorate


def write_output(path, what, *, flag: str = "--json") -> None:
    """Write one output of a command where its flag asks for it, sparing what is there if it fails
    (``analysis.core.io.write_or_spare``), then say where.

    Parameters
    ----------
    path : path-like or None
        The flag's value (None or empty: nothing is written).
    what : dict or callable
        A payload written as JSON, or a function that writes the file it is given.
    flag : str
        The flag, for the error.

    Returns
    -------
    None
    """
    if not path:
        return
    from analysis.core.io import write_json, write_or_spare  # import time: torch loads once the options are checked

    write_or_spare(path, what if callable(what) else lambda p: write_json(p, what), flag=flag)
    print(f"wrote {path}")


@command_doc("None")
def check_flags(args) -> None:
    """The shared options' values, checked before any work (ValueError naming the flag otherwise)."""
    n = getattr(args, "n", None)
    if n is not None and n < 1:
        raise ValueError(f"--n must be at least 1 sequence; got {n}.")
    dtype = getattr(args, "dtype", None)
    if dtype is not None and dtype not in CLI_DTYPES:
        raise ValueError(
            f"--dtype must be one of {', '.join(CLI_DTYPES)}; got {dtype!r}. The model runs in that dtype "
            "(bfloat16 halves its memory, mostly on a GPU); every metric is reduced in float32 either way."
        )
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1; got {threads}.")
    if getattr(args, "remote", False) and getattr(args, "backend", None) != "nnsight":
        raise ValueError("--remote runs through nnsight: add --backend nnsight (docs/remote.md).")
    eps = getattr(args, "eps", None)
    if eps is not None and not 0 < eps < 1:
        raise ValueError(f"--eps must lie in (0, 1); got {eps}. alpha_k > eps makes a head sink on key k (paper: 0.3).")


def cli_argv(argv=None) -> list[str]:
    """The arguments a command parses: ``argv`` (default ``sys.argv[1:]``) without a leading ``--``, which torchrun
    hands on (``torchrun ... -m analysis -- train --n 8``: without the ``--`` torchrun reads ``--n`` as its own
    ``--nnodes``, an abbreviation).

    Parameters
    ----------
    argv : list of str, optional

    Returns
    -------
    list of str
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    return argv[1:] if argv[:1] == ["--"] else argv


def command_line(argv=None) -> str:
    """The command line that made a result, for its record: ``python -m analysis ...`` (``sinklens ...`` is the same
    command; the module form names no script on PATH).

    Parameters
    ----------
    argv : list of str, optional
        The arguments after the program (default ``sys.argv[1:]``).

    Returns
    -------
    str
    """
    return shlex.join(["python", "-m", "analysis", *(sys.argv[1:] if argv is None else argv)])
