"""``python -m analysis stream``: the policy table for one model, optionally saved as JSON and CSV."""

from __future__ import annotations

from pathlib import Path

from analysis.core.options import (
    VOCABULARY,
    HelpFormatter,
    backend_options,
    command_doc,
    model_options,
    placement_options,
    shared_option,
    write_output,
)

# --backend on `stream`: the cache passes decode the Hugging Face model itself, in its own attention (the transformers
# backend); the bridge's attention keeps no KV cache and nnsight traces hold none either.
STREAM_BACKENDS = ("auto", "transformers")
STREAM_BACKEND_WHY = (
    "stream decodes token by token with a bounded KV cache, which only the Hugging Face model's own "
    "attention keeps (the transformers backend): --backend auto and transformers run it; "
    "transformer_lens (the bridge keeps no KV cache) and nnsight (its traces hold no cache across "
    "steps) cannot."
)


def _ints(text: str, *, none_word: str | None = None) -> list:
    """A comma list of integers (``stream --sinks``, ``quant --act-bits``); ``none_word`` (and 16, 32): None, full
    precision."""
    out = []
    for x in text.split(","):
        x = x.strip()
        if none_word is not None and x in (none_word, "16", "32"):
            out.append(None)
        elif x:
            try:
                out.append(int(x))
            except ValueError:
                raise ValueError(f"expected comma-separated integers such as 0,1,4 or 8,4; got {text!r}.") from None
    return out


def add_parser(sub, default_model: str, *, parents=()) -> None:
    """Add the ``stream`` subcommand to ``python -m analysis``.

    Parameters
    ----------
    sub : argparse._SubParsersAction
        The main parser's subcommands.
    default_model : str
        The model taken without ``--model``.
    parents : sequence of argparse.ArgumentParser
        The shared options it takes (``analysis.core.options``: the model's options, ``--seed``, the placement
        options and ``--backend``); none given: those four groups.

    Returns
    -------
    None
    """
    seed = shared_option("--seed", type=int, default=0)
    parents = list(parents) or [model_options(default_model), seed, placement_options(), backend_options()]
    s = sub.add_parser(
        "stream",
        parents=parents,
        formatter_class=HelpFormatter,
        help="streaming perplexity under dense, window, sinks + window and quantised KV caches",
        description="Streaming perplexity under dense, window, sinks + window and quantised KV caches. "
        + STREAM_BACKEND_WHY,
    )
    g = s.add_argument_group("stream")
    g.add_argument(
        "--window", type=int, default=256, help="tokens the cache keeps, sinks included (StreamingLLM: 1024)"
    )
    g.add_argument("--sinks", default="0,1,2,4,8", help="sink counts s (0 = the plain window)")
    g.add_argument("--tokens", type=int, default=2048, help="stream length (offline docstring corpus)")
    g.add_argument("--newline-sinks", type=int, default=4, help="also s newline tokens as sinks (0: leave out)")
    g.add_argument("--kv-bits", default="8,4", help=VOCABULARY["--kv-bits"] + "; simulated on the sinks + window cache")
    g.add_argument("--quant-sinks", type=int, default=4, help="sinks of the quantised caches")
    g.add_argument(
        "--recompute-every",
        type=int,
        default=8,
        help="score the sliding-window re-computation ceiling at every k-th position (0: leave out)",
    )
    g.add_argument("--no-dense", action="store_true", help="leave out the dense cache")
    o = s.add_argument_group("output")
    o.add_argument("--json", help="write every number (per-position NLL, table, stream record, versions) here")
    o.add_argument("--csv", help="write the policy table here")
    s.set_defaults(func=cmd_stream, check=check_stream_args, outputs=(("json", False), ("csv", False)))


@command_doc("None")
def check_stream_args(args) -> None:
    """The stream's own options, checked before the model loads (ValueError naming the flag otherwise)."""
    sinks, bits = _ints(args.sinks), _ints(args.kv_bits)
    if getattr(args, "backend", "auto") not in STREAM_BACKENDS:
        raise ValueError(f"--backend {args.backend} does not apply to stream: {STREAM_BACKEND_WHY}")
    if args.window < 1:
        raise ValueError(f"--window must be at least 1 token; got {args.window}.")
    bad = [x for x in sinks if x >= args.window] + (
        [args.quant_sinks] if bits and args.quant_sinks >= args.window else []
    )
    if bad:
        raise ValueError(
            f"--sinks / --quant-sinks {bad} must each be smaller than the window (--window "
            f"{args.window}); the window counts the sinks."
        )
    if args.tokens <= args.window:
        raise ValueError(
            f"--tokens ({args.tokens}) must be larger than --window ({args.window}): nothing would ever be evicted."
        )


@command_doc("int", "The exit status (1 where an output could not be written; the table is printed first either way).")
def cmd_stream(args) -> int:
    """Run ``python -m analysis stream``: the streaming perplexity, printed, then written where asked."""
    # import time: torch, transformers and TransformerLens load once the options are checked
    from analysis.model.loading import load_model
    from analysis.model.placement import placement_from_args
    from analysis.streaming.run import streaming_perplexity, write_csv_atomic

    placement = placement_from_args(args)
    # a name goes through load_model first; the cache passes decode its own Hugging Face module (no second copy)
    model = load_model(
        args.model,
        device=None if placement.split else args.device,
        dtype=args.dtype,
        **(placement.kwargs() if placement.split else {}),
    )
    res = streaming_perplexity(
        model,
        window=args.window,
        n_tokens=args.tokens,
        sinks=_ints(args.sinks),
        newline_sinks=args.newline_sinks or None,
        bits=_ints(args.kv_bits),
        quant_sinks=args.quant_sinks,
        dense=not args.no_dense,
        recompute_every=args.recompute_every or None,
        seed=args.seed,
        progress=not args.quiet,
    )
    table = res.table
    table["timing"] = [f"shared by {b}" if b > 1 else "own" for b in table["batch"]]
    cols = "policy ppl ppl_past_window ppl_at_recompute tokens_per_s timing kv_cache_mib sink_attention".split()
    cols += ["learned_sink_attention"] if table["learned_sink_attention"].notna().any() else []
    print(table[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(
        f"tokens_per_s: the policies whose timing says 'shared by k' were decoded together, k rows in one batch, and "
        f"share that batch's one timing ({res.device}, {res.dtype})."
    )
    print(res.text())
    write_output(args.json, res.save)
    write_output(args.csv, lambda p: write_csv_atomic(res.table, Path(p)), flag="--csv")
    return 0
