"""``python -m analysis quant``: perplexity under activation / weight fake quantisation against the sink, the site of
every per-tensor scale, and the packed low-bit KV cache; the table printed, everything in the JSON."""

from __future__ import annotations

from analysis.core.checks import resolve_device
from analysis.core.options import (
    VOCABULARY,
    HelpFormatter,
    backend_options,
    command_doc,
    command_line,
    shared_option,
    write_output,
)
from analysis.core.versions import package_versions
from analysis.streaming.cli import _ints

CONDITIONS = ("as_is", "sinks_fp", "prefix")  # analysis.quant.study.CONDITIONS, named here so --help needs no torch
QUANT_BACKEND_WHY = (
    "--backend runs quant's analysis passes (the sink positions kept in full precision, the spike's "
    "writers): auto, transformers or transformer_lens. The quantised passes and the KV caches hook "
    "the model's own linear layers and run its own attention with a cache (the transformers backend) "
    "whatever --backend says; nnsight cannot run them (they hook the local Hugging Face module, which "
    "the nnsight backend does not hand out)."
)


def add_parser(sub, *, parents=()) -> None:
    """Add the ``quant`` subcommand.

    Parameters
    ----------
    sub : argparse._SubParsersAction
    parents : sequence of argparse.ArgumentParser
        The shared options (``analysis.core.options.model_options``: ``--model --device --dtype --threads --quiet``);
        ``--T``, ``--seed`` (a comma list) and ``--backend`` are added here from the same vocabulary.

    Returns
    -------
    None
    """
    seeds = shared_option("--seed", type=str, default="0")  # a comma list: one calibration draw each
    q = sub.add_parser(
        "quant",
        parents=[*parents, shared_option("--T", type=int, default=256), seeds, backend_options()],
        formatter_class=HelpFormatter,
        help="perplexity under activation/weight quantisation against the sink; low-bit KV cache",
        description="Perplexity under activation / weight fake quantisation against the sink, the site "
        "of every per-tensor scale, and the packed low-bit KV cache. " + QUANT_BACKEND_WHY,
    )
    q.add_argument("--act-bits", default="8,4", help="activation bits, comma-separated (8, 4)")
    q.add_argument("--granularity", default="tensor,token", help="tensor (static, calibrated) and/or token (dynamic)")
    q.add_argument("--weight-bits", default="fp", help="weight bits per output channel: fp, 8, 4 (comma-separated)")
    q.add_argument("--condition", default=",".join(CONDITIONS), help=f"among {', '.join(CONDITIONS)}")
    q.add_argument("--windows", type=int, default=8, help="held-out windows scored")
    q.add_argument("--calib-tokens", type=int, default=1024, help="calibration text in tokens (at least one window)")
    q.add_argument("--prefix", type=int, default=3, help="longest searched prefix (tokens)")
    q.add_argument("--candidates", type=int, default=3, help="candidate outlier tokens of the prefix search")
    q.add_argument(
        "--kv-bits", default="4,2", help=VOCABULARY["--kv-bits"] + "; a packed cache, sinks in full precision"
    )
    q.add_argument("--no-origin", action="store_true", help="do not trace which neurons wrote each scale")
    q.add_argument("--json", help="write every number here")
    q.set_defaults(func=cmd_quant, check=check_quant_args, outputs=(("json", False),))


@command_doc("None")
def check_quant_args(args) -> None:
    """The quant command's own options, checked before torch loads (ValueError naming the flag otherwise)."""
    if getattr(args, "dtype", "float32") != "float32":
        raise ValueError(
            f"quant measures quantisation against the float32 model; --dtype must be float32, got {args.dtype}."
        )
    if getattr(args, "backend", "auto") == "nnsight":
        raise ValueError("--backend nnsight does not apply to quant: " + QUANT_BACKEND_WHY)
    _ints(args.act_bits), _ints(args.weight_bits, none_word="fp"), _ints(args.seed), _ints(args.kv_bits)


def format_quant_table(res) -> str:
    """The printed table: scheme, condition, perplexity (mean and range over seeds), ratio, the largest scale's site.

    Parameters
    ----------
    res : QuantResult

    Returns
    -------
    str
    """
    s = res.summary()
    big = res.schemes.groupby(["scheme", "condition"], sort=False).scale_absmax.max().values
    lines = [f"{'scheme':<22} {'condition':<9} {'ppl':>9} {'range':>17} {'x fp':>6}  largest scale (|x|)"]
    for (_, r), b in zip(s.iterrows(), big):
        lines.append(
            f"{r.scheme:<22} {r.condition:<9} {r.ppl:>9.2f} {f'{r.ppl_min:.2f}-{r.ppl_max:.2f}':>17} "
            f"{r.ratio:>6.2f}  {r.site} ({b:,.0f})"
        )
    for _, r in res.kv.iterrows():
        lines.append(f"KV {r.cache:<38} ppl {r.ppl:8.2f}  {r.kv_bytes / 1024:9.1f} KiB held per window")
    return "\n".join(lines)


@command_doc("int")
def cmd_quant(args) -> int:
    """Run ``python -m analysis quant``."""
    # import time: torch loads once the options are checked
    from analysis.model.loading import load_model
    from analysis.quant.run import quant_study
    from analysis.quant.study import check_conditions, schemes_of

    grid = dict(
        a_bits=_ints(args.act_bits),
        granularities=[g.strip() for g in args.granularity.split(",") if g.strip()],
        w_bits=_ints(args.weight_bits, none_word="fp"),
    )
    conditions = check_conditions([c.strip() for c in args.condition.split(",") if c.strip()])
    schemes_of(**grid)  # bad bits or granularities: before the model loads
    # a name goes through load_model first; its backend runs the analysis passes (QUANT_BACKEND_WHY)
    model = load_model(args.model, device=resolve_device(args.device), backend=args.backend)
    res = quant_study(
        model,
        **grid,
        conditions=conditions,
        T=args.T,
        n_eval=args.windows,
        calib_tokens=args.calib_tokens,
        seeds=_ints(args.seed),
        prefix_len=args.prefix,
        n_candidates=args.candidates,
        kv_bits=_ints(args.kv_bits),
        origin=not args.no_origin,
    )
    print(format_quant_table(res))
    print(res.text())
    if args.json:
        backend = {"passes": args.backend, "quantised passes": "transformers", "why": QUANT_BACKEND_WHY}
        payload = {
            **res.to_dict(),
            "command": command_line(),
            "backend": backend,
            "device": resolve_device(args.device),
            "dtype": "float32",
            "versions": package_versions(),
        }
        write_output(args.json, payload)
    return 0
