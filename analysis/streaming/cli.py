"""``python -m analysis stream``: the policy table for one model, optionally saved as JSON and CSV."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import torch

from analysis.model.loading import load_causal_lm
from analysis.model.placement import add_placement_args, placement_from_args
from analysis.streaming.run import streaming_perplexity, write_csv_atomic


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers such as 0,1,4; got {text!r}.") from None


def add_parser(sub, default_model: str) -> None:
    """Add the ``stream`` subcommand to ``python -m analysis``.

    Parameters
    ----------
    sub : argparse._SubParsersAction
        The main parser's subcommands.
    default_model : str
        The model taken without ``--model``.

    Returns
    -------
    None
    """
    s = sub.add_parser("stream", help="streaming perplexity under dense, window, sinks + window and quantised KV caches")
    s.add_argument("--model", default=default_model, help="a name, a local Hugging Face folder, or a hub id")
    s.add_argument("--window", type=int, default=256, help="tokens the cache keeps, sinks included (StreamingLLM: 1024)")
    s.add_argument("--sinks", default="0,1,2,4,8", help="sink counts s (0 = the plain window)")
    s.add_argument("--tokens", type=int, default=2048, help="stream length (offline docstring corpus)")
    s.add_argument("--newline-sinks", type=int, default=4, help="also s newline tokens as sinks (0: leave out)")
    s.add_argument("--bits", default="8,4", help="simulated KV quantisation of the sinks + window cache ('' to leave out)")
    s.add_argument("--quant-sinks", type=int, default=4, help="sinks of the quantised caches")
    s.add_argument("--recompute-every", type=int, default=8,
                   help="score the sliding-window re-computation ceiling at every k-th position (0: leave out)")
    s.add_argument("--no-dense", action="store_true", help="leave out the dense cache")
    s.add_argument("--seed", type=int, default=0, help="order of the docstring stream")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    s.add_argument("--device", default=None)
    s.add_argument("--json", help="write every number (per-position NLL, table, stream record, versions) here")
    s.add_argument("--csv", help="write the policy table here")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    add_placement_args(s)
    s.set_defaults(func=cmd_stream)


def cmd_stream(args) -> int:
    """Run ``python -m analysis stream``: the streaming perplexity, printed and written where asked.

    Parameters
    ----------
    args : argparse.Namespace

    Returns
    -------
    int
        The exit status.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    placement, model, tokenizer = placement_from_args(args), args.model, None
    if placement.split:
        model, tokenizer = load_causal_lm(args.model, placement=placement)
    res = streaming_perplexity(
        model, tokenizer=tokenizer, window=args.window, n_tokens=args.tokens, sinks=_ints(args.sinks),
        newline_sinks=args.newline_sinks or None, bits=_ints(args.bits), quant_sinks=args.quant_sinks,
        dense=not args.no_dense, recompute_every=args.recompute_every or None, seed=args.seed,
        device=args.device, progress=not args.quiet,
    )
    if args.json:
        res.save(args.json)
        print(f"wrote {args.json}")
    if args.csv:
        write_csv_atomic(res.table, Path(args.csv))
        print(f"wrote {args.csv}")
    cols = ["policy", "ppl", "ppl_past_window", "ppl_at_recompute", "tokens_per_s", "kv_cache_mib", "sink_attention"]
    cols += ["learned_sink_attention"] if res.table["learned_sink_attention"].notna().any() else []
    print(res.table[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(res.text())
    return 0


def command_line(argv=None) -> str:
    """The command line that made a result, for its record.

    Parameters
    ----------
    argv : list of str, optional
        The arguments (default ``sys.argv[1:]``).

    Returns
    -------
    str
    """
    return "python -m analysis " + shlex.join(sys.argv[1:] if argv is None else argv)
