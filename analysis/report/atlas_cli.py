"""``python -m analysis atlas MODEL [MODEL ...]``: many models in one resumable run (``analysis.report.atlas``); the
table printed, the rows, CSV, JSON and page written under ``--out``.

This module imports nothing heavy: the parser and its checks run before torch loads."""

from __future__ import annotations

import sys
from pathlib import Path

from analysis.core.options import SINK_N, HelpFormatter, command_doc, sink_command_options


def add_parser(sub) -> None:
    """Add the ``atlas`` subcommand, with the shared options of ``sink`` (no ``--model``: the models are positional).

    Parameters
    ----------
    sub : argparse._SubParsersAction

    Returns
    -------
    None
    """
    a = sub.add_parser(
        "atlas",
        parents=sink_command_options(n=SINK_N, model_flag=False),
        formatter_class=HelpFormatter,
        help="many models in one resumable run: Sink_1, the largest activation and the facts of each",
    )
    a.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help="names from `python -m analysis models`, local Hugging Face folders or .gguf files, hub ids",
    )
    a.add_argument(
        "--models-file",
        default=None,
        help="a text file with one model a line (# starts a comment), measured after the MODELs",
    )
    a.add_argument(
        "--out",
        required=True,
        help="output folder: atlas.csv, atlas.json, atlas.html and models/ (one row per model; the same "
        "command again skips the models finished there)",
    )
    a.set_defaults(func=cmd_atlas, check=check_atlas_args, outputs=(("out", True),))


def _read_models_file(path) -> list[str]:
    """The models of a file: one a line; blank lines and ``#`` comments (whole lines or after a model) left out."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no models file {path}: give a text file with one model a line (--models-file).")
    names = [line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [n for n in names if n]


@command_doc("None", "ValueError or FileNotFoundError, saying what to give, otherwise.")
def check_atlas_args(args) -> None:
    """The models (positional and ``--models-file``), read and checked before torch loads; kept as ``args.model_list``."""
    names = list(args.models) + (_read_models_file(args.models_file) if args.models_file else [])
    if not names:
        raise ValueError(
            "give the models to measure: `atlas MODEL [MODEL ...]` or `atlas --models-file FILE` (one "
            "model a line); `python -m analysis models` lists the names known without a network."
        )
    args.model_list = list(dict.fromkeys(names))


def _kinds_text(kinds: dict | None) -> str:
    """ "; kinds nop 75% / broadcast 0% / mixed 25% of 8 sink heads", or "" where not measured."""
    if not kinds:
        return ""
    if not kinds["n_sink_heads"]:
        return "; no sink head"
    return (
        "; kinds "
        + " / ".join(f"{k} {kinds[k]:.0%}" for k in ("nop", "broadcast", "mixed"))
        + f" of {kinds['n_sink_heads']} sink heads"
    )


def _format_atlas_table(rows: list[dict]) -> str:
    """The printed table: Sink_1 per kind (the paper's in brackets where it gives one), the largest activation."""
    lines = [
        f"{'model':<28} {'natural':>15} {'random':>15} {'repeated':>15}  largest |a| (layer, dim, position, token; x median)"
    ]
    for r in rows:
        name = r["model"] if len(r["model"]) <= 28 else "..." + r["model"][-25:]
        if r["status"] != "ok":
            lines.append(f"{name:<28} failed: {r['error'][:160]}")
            continue
        paper = r.get("paper") or {}
        cells = [
            f"{r['sink_1_pct'][k]:.2f}" + (f" [{paper[k]:.2f}]" if paper.get(k) is not None else "")
            for k in ("natural", "random", "repeated")
        ]
        big = r["largest_activation"]["natural"]
        token = repr(big["token"]) + ("" if big["token_share"] == 1 else f" ({big['token_share']:.0%} of sequences)")
        lines.append(
            f"{name:<28} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15}  {big['abs']:.3g} (L{big['layer']}, "
            f"d{big['dim']}, pos {big['position']} {token}; x{big['ratio']:.0f}"
            f"{', massive' if big['massive'] else ''}){_kinds_text(r.get('kinds'))}"
        )
    lines.append(
        "Sink_1 (%) per input kind; [..]: Gu et al.'s published figure for the model of that name; kinds: "
        "the share of sink heads on natural text that are nop / broadcast / mixed (analysis.causal.sink_kind)."
    )
    return "\n".join(lines)


@command_doc(
    "int",
    "0; 1 where a model failed (its error is in its row, the others were measured); 130 on Ctrl-C (every finished",
    "model is kept: the same command again goes on).",
)
def cmd_atlas(args) -> int:
    """Run ``python -m analysis atlas``."""
    # import time: torch loads once the options are checked
    from analysis.core.io import parse_dtype
    from analysis.model.loading import load_model
    from analysis.model.placement import placement_from_args
    from analysis.report.atlas import AtlasConfig, run_atlas

    p = placement_from_args(args)
    split = p.kwargs() if p.split else {}
    dtype = parse_dtype(args.dtype)

    def load(name: str):
        return load_model(name, device=args.device, dtype=dtype, backend=args.backend, remote=args.remote, **split)

    config = AtlasConfig(
        n=args.n, T=args.T, seed=args.seed, eps=args.eps, bos=args.bos, dtype=args.dtype, backend=args.backend
    )
    try:
        rows = run_atlas(args.model_list, args.out, load=load, config=config, progress=not args.quiet)
    except KeyboardInterrupt:
        print(
            f"interrupted: every model finished so far is kept in {Path(args.out) / 'models'} and in the atlas "
            "there; the same command again goes on from the first model not finished.",
            file=sys.stderr,
        )
        return 130
    print(_format_atlas_table(rows))
    out = Path(args.out)
    print(
        f"wrote {out / 'atlas.html'}, {out / 'atlas.csv'} and {out / 'atlas.json'} (one row per model in {out / 'models'})"
    )
    failed = [r["model"] for r in rows if r["status"] != "ok"]
    if failed:
        print(
            f"error: {len(failed)} model(s) failed, each with its error in its row: {', '.join(failed)}. The same "
            "command again tries them again and keeps the others.",
            file=sys.stderr,
        )
    return 1 if failed else 0
