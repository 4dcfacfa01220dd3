"""The command line's one vocabulary: the options every subcommand of ``python -m analysis`` shares, defined once.

Each group is an argparse parent parser (``add_parser(..., parents=[...])``), so an option has the same name, default
and help text in every subcommand that takes it, and ``--help`` shows its default (``HelpFormatter``):

- ``model_options``: ``--model --device --dtype --threads --quiet`` (every subcommand that loads a model);
- ``probe_options``: ``--n --T --seed`` (the subcommands that draw probes; ``stream`` takes ``--seed`` from
  ``seed_options``);
- ``sink_options``: ``--eps --bos`` (every subcommand that measures the sink);
- ``backend_options``: ``--backend --remote`` (``sink``: the table through nnsight, here or on NDIF).

Output paths (``--json``, ``--csv``, ``--out``) are checked with ``analysis.core.io.check_output`` before the model loads.
"""
from __future__ import annotations

import argparse

from analysis.core.defaults import SINK_EPS

CLI_DTYPES = ("float32", "bfloat16", "float16")  # --dtype: the weights' and activations' dtype; metrics reduce in float32
DEFAULT_T = 64  # the paper's probe length


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every option's default shown (``(default: ...)``), descriptions kept as written."""


def model_options(default_model: str) -> argparse.ArgumentParser:
    """``--model --device --dtype --threads --quiet``, as a parent parser.

    Parameters
    ----------
    default_model : str
        The model taken without ``--model``.

    Returns
    -------
    argparse.ArgumentParser
    """
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=default_model,
                   help="a name from `python -m analysis models`, a local Hugging Face folder or .gguf file, or a hub id")
    g.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:1, mps ...; None: cuda when available, else cpu (cuda without CUDA is an error)")
    g.add_argument("--dtype", default="float32",
                   help=f"the model's dtype: {', '.join(CLI_DTYPES)} (every metric is reduced in float32)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (None: torch's default)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def probe_options(*, n: int) -> argparse.ArgumentParser:
    """``--n --T --seed``, as a parent parser.

    Parameters
    ----------
    n : int
        The default of ``--n`` for this subcommand (``sink``: the paper's 100; ``report``: 32, the sample its published
        numbers were measured on).

    Returns
    -------
    argparse.ArgumentParser
    """
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("probes")
    g.add_argument("--n", type=int, default=n, help="sequences per input kind (paper: 100)")
    g.add_argument("--T", type=int, default=DEFAULT_T, help="tokens per sequence, the BOS included (paper: 64)")
    _add_seed(g)
    return p


def seed_options() -> argparse.ArgumentParser:
    """``--seed``, as a parent parser.

    Returns
    -------
    argparse.ArgumentParser
    """
    p = argparse.ArgumentParser(add_help=False)
    _add_seed(p)
    return p


def _add_seed(p) -> None:
    p.add_argument("--seed", type=int, default=0, help="the seed of the probes (stream: of the stream's text order)")


def sink_options() -> argparse.ArgumentParser:
    """``--eps --bos``, as a parent parser.

    Returns
    -------
    argparse.ArgumentParser
    """
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sink")
    g.add_argument("--eps", type=float, default=SINK_EPS, help="a head sinks on key k when alpha_k > eps (paper: 0.3)")
    g.add_argument("--bos", action="store_true",
                   help="put the tokenizer's BOS token first (paper: no BOS; the results say whether one is first)")
    return p


def backend_options() -> argparse.ArgumentParser:
    """``--backend --remote``, as a parent parser (the subcommands whose tables nnsight can compute).

    Returns
    -------
    argparse.ArgumentParser
    """
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("backend")
    g.add_argument("--backend", choices=("transformer_lens", "nnsight"), default="transformer_lens",
                   help="run the model through TransformerLens' bridge or nnsight (the 'remote' extra; docs/remote.md)")
    g.add_argument("--remote", action="store_true",
                   help="with --backend nnsight: run the traces on NDIF (needs NDIF_API_KEY; docs/remote.md)")
    return p


def check_flags(args) -> None:
    """The shared options' values, checked before any work (ValueError naming the flag otherwise).

    Parameters
    ----------
    args : argparse.Namespace

    Returns
    -------
    None
    """
    n = getattr(args, "n", None)
    if n is not None and n < 1:
        raise ValueError(f"--n must be at least 1 sequence; got {n}.")
    dtype = getattr(args, "dtype", None)
    if dtype is not None and dtype not in CLI_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(CLI_DTYPES)}; got {dtype!r}. The model runs in that dtype "
                         "(bfloat16 halves its memory, mostly on a GPU); every metric is reduced in float32 either way.")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be at least 1; got {threads}.")
    if getattr(args, "remote", False) and getattr(args, "backend", None) != "nnsight":
        raise ValueError("--remote runs through nnsight: add --backend nnsight (docs/remote.md).")
    eps = getattr(args, "eps", None)
    if eps is not None and not 0 < eps < 1:
        raise ValueError(f"--eps must lie in (0, 1); got {eps}. alpha_k > eps makes a head sink on key k (paper: 0.3).")
