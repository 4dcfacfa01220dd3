"""Command line: ``python -m analysis.train [--preset NAME] [--FIELD VALUE ...]`` and
``python -m analysis.train sweep --attention a,b --weight-decay u,v --seed 0,1,2 --out DIR`` (any field
may be a comma-separated list; see ``analysis.train.sweep``).

Every field of ``ModelConfig`` and ``TrainConfig`` is an option (underscores become dashes); a preset
sets a group of fields first, options given on the command line win. ``--list`` prints the attention
operations and presets.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import shlex
import sys
import typing
from typing import Optional, Sequence

from analysis.model.reference.attention import available_attention
from analysis.model.reference.config import ModelConfig, TrainConfig
from analysis.train.presets import PRESETS, build_configs
from analysis.train.sweep import run_sweep
from analysis.train.trainer import train


def _parse_optional(base):
    def parse(text: str):
        if text.lower() in ("none", "null", ""):
            return None
        return base(text)

    parse.__name__ = base.__name__
    return parse


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("true", "1", "yes"):
        return True
    if t in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false; got {text!r}")


def _float_or_int(text: str):
    return int(float(text)) if "e" in text.lower() or "_" in text else int(text)


def _field_type(cls, f: dataclasses.Field):
    hints = typing.get_type_hints(cls)
    t = hints[f.name]
    optional = typing.get_origin(t) is typing.Union and type(None) in typing.get_args(t)
    if optional:
        t = next(a for a in typing.get_args(t) if a is not type(None))
    base = {int: _float_or_int, float: float, str: str, bool: bool}[t]
    return base, optional


@functools.lru_cache(maxsize=None)
def field_help(cls) -> dict[str, str]:
    """The trailing comments of the dataclass fields, used as option help.

    Parameters
    ----------
    cls : type
        ModelConfig or TrainConfig.

    Returns
    -------
    dict of str to str
    """
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^=]+=.*?#\s*(.+)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def add_config_options(parser: argparse.ArgumentParser, *, list_fields: Sequence[str] = ()) -> None:
    """One option per config field; defaults suppressed so only explicit options override a preset.
    Fields in ``list_fields`` take comma-separated lists (for sweeps).

    Parameters
    ----------
    parser : argparse.ArgumentParser
    list_fields : sequence of str

    Returns
    -------
    None
    """
    for cls, title in ((ModelConfig, "model"), (TrainConfig, "training")):
        group = parser.add_argument_group(f"{title} options")
        for f in dataclasses.fields(cls):
            if f.name in ("preset",):
                continue
            flag = "--" + f.name.replace("_", "-")
            base, optional = _field_type(cls, f)
            default = f.default if f.default is not dataclasses.MISSING else None
            helptext = f"{field_help(cls).get(f.name, '')} (default: {default})".strip()
            if f.name in list_fields and base is bool:  # --bos true,false (a grid), or --bos / --no-bos
                group.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, nargs="?", const=[True],
                                   type=lambda s: [_parse_bool(x) for x in s.split(",")],
                                   help=helptext + "; or a comma-separated list of true/false")
                group.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_const",
                                   const=[False], default=argparse.SUPPRESS)
            elif f.name in list_fields:
                parse = _parse_optional(base) if optional else base
                group.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, help=helptext + "; comma-separated list",
                                   type=lambda s, p=parse: [p(x) for x in s.split(",")])
            elif base is bool:
                group.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, action=argparse.BooleanOptionalAction,
                                   help=helptext)
            else:
                group.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, help=helptext,
                                   type=_parse_optional(base) if optional else base)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m analysis.train",
        description="Pre-train a reference language model with a chosen attention operation. "
                    "Subcommand: `sweep` (run `python -m analysis.train sweep -h`).",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="a named starting configuration")
    p.add_argument("--list", action="store_true", help="list attention operations and presets, then exit")
    add_config_options(p)
    return p


def _sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m analysis.train sweep",
        description="Train every combination of the options given as comma-separated lists (any config "
                    "field, e.g. --weight-decay 0,0.5,5 --seed 0,1,2); write DIR/sweep.csv (one row per run), "
                    "DIR/summary.csv (mean/std over seeds), DIR/curves.csv (Sink_1 through training) and "
                    "DIR/command.txt. Completed runs are skipped when rerun.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once, one process and thread each")
    p.add_argument("--keep-models", action=argparse.BooleanOptionalAction, default=True,
                   help="keep each run's model.safetensors (--no-keep-models: only its config, statistics and log)")
    p.add_argument("--reuse", default="", help="comma-separated sweep folders: a grid point whose configuration "
                                               "equals a finished run there is copied instead of retrained")
    fields = [f.name for cls in (ModelConfig, TrainConfig) for f in dataclasses.fields(cls)
              if f.name not in ("preset", "out", "progress", "compile", "resume")]
    add_config_options(p, list_fields=fields)
    return p


def _print_list() -> None:
    print("attention operations (--attention NAME):")
    for name, desc in available_attention().items():
        print(f"  {name:22s} {desc}")
    print("\npresets (--preset NAME):")
    for name in PRESETS:
        print(f"  {name}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m analysis.train``: train one model, or a grid (``sweep``).

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", "-m", "analysis.train", *argv])
    if argv and argv[0] == "sweep":
        ns = vars(_sweep_parser().parse_args(argv[1:]))
        preset_name, jobs, keep = ns.pop("preset"), ns.pop("jobs"), ns.pop("keep_models")
        reuse = [r for r in ns.pop("reuse").split(",") if r]
        if "out" not in ns:
            raise SystemExit("sweep: --out DIR is required")
        ns = {k: (v[0] if isinstance(v, list) and len(v) == 1 and k != "seed" else v) for k, v in ns.items()}
        table = run_sweep(preset_name, ns, command=command, jobs=jobs, keep_models=keep, reuse=reuse)
        print(table.to_string(index=False))
        return 0
    parser = _parser()
    ns = vars(parser.parse_args(argv))
    if ns.pop("list"):
        _print_list()
        return 0
    preset_name = ns.pop("preset")
    try:
        mcfg, tcfg = build_configs(preset_name, ns)
    except ValueError as e:
        parser.error(str(e))
    result = train(mcfg, tcfg, command=command)
    if result.final:
        print({k: v for k, v in result.final.items() if k in ("step", "loss", "val_loss", "sink_1", "sink_slot",
                                                               "resid_norm_ratio", "value_norm_ratio")})
    if tcfg.out:
        print(f"model written to {tcfg.out}")
    return 0
