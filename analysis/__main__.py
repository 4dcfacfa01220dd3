"""The command line ``sinklens`` (``python -m analysis`` is the same parser):
``sinklens {sink,sinks,report,models,stream,quant,atlas,train,sweep} ...``; docs/cli.md has every option."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from analysis.core.checks import check_device, check_length
from analysis.core.defaults import SINK_K_MAX
from analysis.core.options import (
    DEFAULT_MODEL,
    REPORT_MIN_T,
    REPORT_N,
    REPORT_T_WHY,
    SINK_N,
    HelpFormatter,
    backend_options,
    check_flags,
    cli_argv,
    command_doc,
    model_options,
    placement_options,
    command_line,
    sink_command_options,
    sink_options,
    write_output,
)
from analysis.core.paths import OutputError, check_output
from analysis.quant.cli import add_parser as add_quant_parser
from analysis.report.atlas_cli import add_parser as add_atlas_parser
from analysis.streaming.cli import add_parser as add_stream_parser
from analysis.train.cli import add_parsers as add_train_parsers

if TYPE_CHECKING:
    from analysis.model.placement import Placement

# `sink --n` (SINK_N = 100) is the paper's probe, `report --n` (REPORT_N = 32) the sample its numbers were measured on:
# one shared default would change one of the two published tables. Everything heavy (torch, transformers,
# TransformerLens) is imported inside the command functions, after the options are parsed and checked.


def cli_dtype(name: str):
    """The torch dtype of a ``--dtype`` value.

    Parameters
    ----------
    name : str
        One of ``CLI_DTYPES``.

    Returns
    -------
    torch.dtype
    """
    check_flags(argparse.Namespace(dtype=name))  # one of CLI_DTYPES, else the --dtype error
    from analysis.core.io import parse_dtype  # import time: torch loads once the options are checked

    return parse_dtype(name)


def sink_report(
    model_name: str,
    n: int,
    T: int,
    eps: float,
    k_max: int,
    bos: bool,
    seed: int,
    device: str | None,
    *,
    progress: bool = True,
    dtype: str = "float32",
    placement: Placement | None = None,
    backend: str = "auto",
    remote: bool = False,
) -> dict:
    """Sink metric on natural, random and repeated probes; everything the JSON holds.

    Parameters
    ----------
    model_name : str
    n : int
        Sequences per probe kind.
    T : int
        Tokens per sequence.
    eps : float
    k_max : int
    bos : bool
    seed : int
    device : str or None
    progress : bool
    dtype : {"float32", "bfloat16", "float16"}
        The model's dtype (metrics are reduced in float32).
    placement : Placement, optional
        A device map, memory budgets and offload folder (``--device-map`` ...); the numbers are those of one device.
    backend : {"auto", "transformers", "transformer_lens", "nnsight"}
        What runs the passes (``analysis.engine.backends``); "nnsight" with ``remote``: the sink accumulator's
        reductions in nnsight traces on NDIF (``analysis.engine.remote``).
    remote : bool

    Returns
    -------
    dict
    """
    # import time: torch, transformers and TransformerLens load once the options are checked
    from analysis.core.versions import package_versions
    from analysis.model.hooks import model_dims
    from analysis.model.placement import placement_record
    from analysis.model.probes import model_probe_sets
    from analysis.report.one_pass import profile
    from analysis.sinks.metric import check_eps

    check_length(T)
    check_eps(eps)
    if not 1 <= k_max <= T:
        raise ValueError(f"--k-max must lie in [1, T={T}]; got {k_max}.")
    model = _load(model_name, device, dtype, backend, remote, placement)
    n_ctx = model_dims(model).n_ctx
    if n_ctx is not None and T > n_ctx:
        raise ValueError(f"T={T} exceeds the context of {model_name} ({n_ctx} tokens); use --T {n_ctx} or less.")
    probes = model_probe_sets(model, n=n, T=T, bos=bos, seed=seed)  # a reference model without tokenizer: its task
    prof = profile(model, probes, analyses=("sink",), eps=eps, k_max=k_max, progress=progress)
    sink = prof.sink
    kinds = {
        kind: {"source": probe.source, "tokens": probe.tokens.tolist(), **sink[kind].to_dict()}
        for kind, probe in probes.items()
    }
    return {
        **dict(model=model_name, n=n, T=T, eps=eps, k_max=k_max, bos=bos, seed=seed, dtype=dtype),  # the options
        "backend": prof.backend,  # input kind -> the backend its pass ran on, and why
        **({"remote": True, "device": "NDIF"} if remote else placement_record(model)),  # where the work went
        "positions": "1-based: Sink_k and per_head_alpha[k - 1] are about key k, k = 1 the first token",
        "sink_1_pct": {k: v["sink_k_pct"][0] for k, v in kinds.items()},
        "inputs": kinds,
        "versions": package_versions(),
    }


def _load(name: str, device: str | None, dtype: str, backend: str, remote: bool, placement: Placement | None):
    """``load_model`` with the shared options' device, dtype, backend, remote and placement (its device_map,
    max_memory and offload_folder where it splits the model)."""
    from analysis.model.loading import load_model  # import time: torch loads once the options are checked

    split = placement.kwargs() if placement is not None and placement.split else {}
    return load_model(name, device=device, dtype=cli_dtype(dtype), backend=backend, remote=remote, **split)


def _load_args(args):
    """:func:`_load` of the parsed options (``--model``, ``--device-map`` ...)."""
    from analysis.model.placement import placement_from_args  # import time: as _load's

    return _load(args.model, args.device, args.dtype, args.backend, args.remote, placement_from_args(args))


def format_sink_table(payload: dict) -> str:
    """The sink table ``python -m analysis sink`` prints.

    Parameters
    ----------
    payload : dict
        Of :func:`sink_report`.

    Returns
    -------
    str
    """
    lines = [
        f"Sink_1 (eps={payload['eps']}) of {payload['model']}: N={payload['n']} sequences of T={payload['T']} tokens, "
        f"{'BOS first' if payload['bos'] else 'no BOS'}"
        + (f", {payload['dtype']}" if payload.get("dtype", "float32") != "float32" else ""),
        f"{'input':<10} {'Sink_1 (%)':>10}",
    ]
    slot = {k: v.get("sink_slot_pct") for k, v in payload.get("inputs", {}).items()}
    has_slot = any(x is not None for x in slot.values())  # a learned sink or a bias slot: Sink on it too
    if has_slot:
        lines[-1] += f" {'Sink on slot (%)':>17}"
    for kind, v in payload["sink_1_pct"].items():
        extra = f" {slot.get(kind) or 0.0:>17.2f}" if has_slot else ""
        lines.append(f"{kind:<10} {v:>10.2f}{extra}")
    first = next(iter(payload.get("inputs", {}).values()), {})
    if first.get("pattern"):  # a sigmoid / linear reference model: what Sink_1 was measured on
        lines.append(f"pattern: {first['pattern']}; its weights do not sum to one")
    if first.get("skipped"):  # a hybrid: say which (true) layers were measured and which were not
        lines.append(f"measured on attention layers {first['layers']}; {first['skipped']}")
    return "\n".join(lines)


@command_doc("int", "The exit status.")
def cmd_sink(args) -> int:
    """``python -m analysis sink``: the sink table of one model, printed, then written where asked."""
    from analysis.model.placement import placement_from_args  # import time: torch loads once the options are checked

    k_max = min(args.T, SINK_K_MAX) if args.k_max is None else args.k_max
    payload = sink_report(
        args.model,
        args.n,
        args.T,
        args.eps,
        k_max,
        args.bos,
        args.seed,
        args.device,
        progress=not args.quiet,
        dtype=args.dtype,
        placement=placement_from_args(args),
        backend=args.backend,
        remote=args.remote,
    )
    print(format_sink_table(payload))
    write_output(args.json, payload)
    return 0


@command_doc("int", "The exit status.")
def cmd_sinks(args) -> int:
    """Every sink position of one text file: the table, and one JSON record per sink position."""
    # import time: torch, transformers and TransformerLens load once the options are checked
    from analysis.model.hooks import model_dims
    from analysis.model.probes import text_tokens
    from analysis.positions.every_sink import format_sinks, sink_positions

    path, text = _sinks_text(args)
    if not text.strip():
        raise ValueError(f"the text file {path} is empty: give a file with some text in it.")
    model = _load_args(args)
    if getattr(model, "tokenizer", None) is None:
        raise ValueError(
            f"{args.model} has no tokenizer, so it cannot read a text file; pass token ids to "
            "analysis.positions.every_sink.sink_positions in Python instead."
        )
    n_ctx = model_dims(model).n_ctx
    tokens = text_tokens(model.tokenizer, text, bos=args.bos, max_tokens=args.max_tokens, n_ctx=n_ctx)
    res = sink_positions(
        model, tokens, eps=args.eps, min_queries=args.min_queries, progress=not args.quiet, kind="text"
    )
    res.meta.setdefault("bos", {})["asked"] = args.bos
    print(format_sinks(res))
    print(res.text())
    if args.json:
        _write_sinks_json(args, model, path, res)
    return 0


def _sinks_text(args) -> tuple[Path, str]:
    """The ``sinks`` command's text file and its text, once its options are checked (before any model loads)."""
    path = Path(args.text)
    if not path.is_file():
        raise FileNotFoundError(f"no text file {path}: give the path of a UTF-8 text file with --text.")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2; got {args.max_tokens}. A sink needs queries after it.")
    if args.min_queries is not None and args.min_queries < 1:
        raise ValueError(f"--min-queries must be at least 1; got {args.min_queries}.")
    return path, path.read_text(encoding="utf-8", errors="replace")


def _write_sinks_json(args, model, path: Path, res) -> None:
    """The ``sinks`` command's JSON record (``--json``): the run's model, text, placement and versions, then every
    sink position."""
    # import time: as cmd_sinks's imports
    from analysis.core.versions import package_versions
    from analysis.model.placement import placement_record

    # on NDIF: the accumulators' reductions ran in nnsight traces (analysis.engine.remote)
    where = {"backend": "nnsight", "device": "NDIF"} if args.remote else placement_record(model)
    payload = {
        **dict(model=args.model, text_file=str(path), bos=args.bos, n_tokens=res.T),
        **where,
        "dtype": args.dtype,
        "positions": "0-based: position 0 is the first token",
        **res.to_dict(),
        "versions": package_versions(),
    }
    write_output(args.json, payload)


@command_doc("int", "The exit status (1 where a section failed or the folder could not be written).")
def cmd_report(args) -> int:
    """``python -m analysis report``: the HTML and JSON report."""
    # import time: torch, transformers and TransformerLens load once the options are checked
    from analysis.report.build import ReportError, build_report

    model = _load_args(args)
    try:
        path = build_report(
            model,
            Path(args.out),
            n=args.n,
            T=args.T,
            seed=args.seed,
            eps=args.eps,
            bos=args.bos,
            progress=not args.quiet,
        )
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} and {Path(path).with_name('report.json')}")
    return 0


@command_doc("int")
def cmd_models(args) -> int:
    """``python -m analysis models``: the models known by name."""
    from analysis.model.loading import available_models  # import time: torch loads once the options are checked

    for m in available_models():
        print(f"{m.name:<24} {m.kind:<10} {m.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: every subcommand takes the shared options of ``analysis.core.options`` (one
    definition each: the same name, default and help everywhere; ``--help`` shows the defaults).

    Returns
    -------
    argparse.ArgumentParser
    """
    p = argparse.ArgumentParser(
        prog="sinklens",
        formatter_class=HelpFormatter,
        description="Attention-sink analyses on TransformerLens hooks, and the reference models "
        "they run on. `python -m analysis` is the same command.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    add = functools.partial(sub.add_parser, formatter_class=HelpFormatter)  # --help shows the defaults
    s = add("sink", parents=sink_command_options(n=SINK_N), help="Sink_1 table on natural, random and repeated inputs")
    s.add_argument("--k-max", type=int, default=None, help="report alpha for keys 1..K (None: min(T, 16))")
    s.add_argument("--json", help="write every number (tokens, per-head alpha, Sink_k, versions) to this file")
    s.set_defaults(func=cmd_sink, outputs=(("json", False),))

    t = add(
        "sinks",
        parents=[model_options(), sink_options(), placement_options(), backend_options()],
        help="every sink position of one text file (not only the first token); positions 0-based",
    )
    t.add_argument(
        "--text", required=True, help="a UTF-8 text file, read as one sequence (at most the model's context)"
    )
    t.add_argument("--max-tokens", type=int, default=None, help="keep the first N tokens of the text (None: all)")
    t.add_argument(
        "--min-queries", type=int, default=None, help="leave out keys seen by fewer queries (None: min(16, T // 2))"
    )
    t.add_argument("--json", help="write one record per sink position (position, token, heads, ...) to this file")
    t.set_defaults(func=cmd_sinks, outputs=(("json", False),))

    r = add(
        "report",
        parents=sink_command_options(n=REPORT_N),
        help="one self-contained HTML page and a JSON with every number",
    )
    r.add_argument("--out", required=True, help="output folder (other files in it are kept)")
    r.set_defaults(func=cmd_report, outputs=(("out", True),), min_T=REPORT_MIN_T, min_T_why=REPORT_T_WHY)

    sub.add_parser("models", help="list the models known without a network").set_defaults(func=cmd_models)

    add_stream_parser(sub, DEFAULT_MODEL)  # its model, seed, placement and backend options
    add_quant_parser(sub, parents=[model_options()])  # python -m analysis quant (analysis/quant/cli.py)
    add_atlas_parser(sub)  # python -m analysis atlas (analysis/report/atlas_cli.py)
    add_train_parsers(sub)  # train, sweep (analysis/train/cli.py; python -m analysis.train is their alias)
    return p


@command_doc("None", "ValueError, naming the flag, otherwise.")
def check_args(args) -> None:
    """Everything the command line can check before the model loads, and before torch is imported: the shared options,
    T, every output path (exists as the wrong kind, under a file, not writable), the command's own options, then the
    device (the one check that imports torch, to ask for a GPU; auto and cpu pass without it)."""
    check_flags(args)
    if getattr(args, "T", None) is not None:
        check_length(args.T, minimum=getattr(args, "min_T", 2), why=getattr(args, "min_T_why", ""))
    for name, folder in getattr(args, "outputs", ()):
        if getattr(args, name, None):
            check_output(getattr(args, name), flag=f"--{name}", folder=folder)
    if getattr(args, "check", None) is not None:
        args.check(args)
    if hasattr(args, "device"):
        check_device(args.device)
        args.device = None if args.device == "auto" else args.device  # the loaders take None for the default device


def main(argv=None) -> int:
    """``sinklens``, ``python -m analysis``: every subcommand.

    Parameters
    ----------
    argv : list of str, optional
        The arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status (2 for bad input, before any work; 1 where the work failed or its results could not be
        written).
    """
    argv = cli_argv(argv)
    args = build_parser().parse_args(argv)
    if getattr(args, "own_checks", False):  # train, sweep: analysis.train.cli checks them before any data is prepared
        return args.func(args, command=command_line(argv))
    try:
        check_args(args)
        if getattr(args, "threads", None):
            import torch  # import time: torch loads once the options are checked

            torch.set_num_threads(args.threads)
        return args.func(args)
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:  # analysis.model.loading.ModelNotFoundError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
