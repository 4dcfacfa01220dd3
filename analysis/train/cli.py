"""The ``train`` and ``sweep`` subcommands of ``sinklens`` (``python -m analysis``): ``sinklens train [--preset NAME]
[--FIELD VALUE ...]`` and ``sinklens sweep --attention a,b --weight-decay u,v --seed 0,1,2 --out DIR`` (any field may be
a comma-separated list; see ``analysis.train.sweep``). ``python -m analysis.train [sweep] ...`` is their alias (the
commands recorded in the committed runs use it).

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
import sys
import typing
from pathlib import Path
from typing import Optional, Sequence

from analysis.core.checks import check_device
from analysis.core.options import TRAIN_FIELD_FLAGS, VOCABULARY, cli_argv, command_line
from analysis.core.paths import check_output
from analysis.model.reference.config import ModelConfig, TrainConfig
from analysis.train.presets import PRESETS, build_configs, preset

RUN_FILES = ("model.safetensors", "config.json", "train_log.jsonl", "checkpoints")  # a folder with one holds a run
NORM_EPS_MAX = 1e-3  # train --eps below this is no sink threshold: a norms' epsilon, which is --norm-eps


def _parse_optional(base):
    def parse(text: str):
        return None if text.lower() in ("none", "null", "") else base(text)

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
def _field_help(cls) -> dict[str, str]:
    """Each dataclass field's help (``cls``: ModelConfig or TrainConfig): its description in the class docstring's
    Attributes section, else the trailing comment of its definition."""
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^=]+=.*?#\s*(.+)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    doc = inspect.getdoc(cls) or ""
    attrs = doc.split("Attributes\n----------\n", 1)[-1] if "Attributes\n" in doc else ""
    for name, text in re.findall(r"^(\w+) : [^\n]+\n((?:    [^\n]*\n?)+)", attrs, flags=re.M):
        out[name] = " ".join(text.split())
    return out


def _add_config_options(parser: argparse.ArgumentParser, *, list_fields: Sequence[str] = ()) -> None:
    """One option per config field; defaults suppressed (the groups' ``argument_default``) so only explicit options
    override a preset. Fields in ``list_fields`` take comma-separated lists (for sweeps). A field named in
    ``TRAIN_FIELD_FLAGS`` takes the command line's shared name; ``progress`` is ``--quiet``."""
    for cls, title in ((ModelConfig, "model"), (TrainConfig, "training")):
        group = parser.add_argument_group(f"{title} options", argument_default=argparse.SUPPRESS)
        for f in dataclasses.fields(cls):
            if f.name == "preset":
                continue
            if f.name == "progress":  # --quiet, as in every command
                group.add_argument(
                    "--quiet", dest="progress", action="store_const", const=False, help=VOCABULARY["--quiet"]
                )
                continue
            # --field-name, or its name in the command line's vocabulary (eps is --norm-eps, sink_eps is --eps, ...)
            flag = TRAIN_FIELD_FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
            base, optional = _field_type(cls, f)
            default = f.default if f.default is not dataclasses.MISSING else None
            helptext = f"{VOCABULARY.get(flag) or _field_help(cls).get(f.name, '')} (default: {default})".strip()
            if f.name in list_fields and base is bool:  # --bos true,false (a grid), or --bos / --no-bos
                group.add_argument(
                    flag,
                    dest=f.name,
                    nargs="?",
                    const=[True],
                    type=lambda s: [_parse_bool(x) for x in s.split(",")],
                    help=helptext + "; or a comma-separated list of true/false",
                )
                group.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_const", const=[False])
                continue
            parse = _parse_optional(base) if optional else base
            if f.name in list_fields:
                kwargs = dict(type=lambda s, p=parse: [p(x) for x in s.split(",")])
                helptext += "; comma-separated list"
            elif base is bool:
                kwargs = dict(action=argparse.BooleanOptionalAction)
            else:
                kwargs = dict(type=parse)
            group.add_argument(flag, dest=f.name, help=helptext, **kwargs)


TRAIN_HELP = "pre-train a reference language model with a chosen attention operation"
TRAIN_DESCRIPTION = (
    "Pre-train a reference language model with a chosen attention operation. Every option is checked "
    "before any data is prepared; bad input exits 2 with one line that says what to do."
)
SWEEP_HELP = "train every combination of the options given as comma-separated lists"
SWEEP_DESCRIPTION = (
    "Train every combination of the options given as comma-separated lists (any config field, e.g. "
    "--weight-decay 0,0.5,5 --seed 0,1,2); write DIR/sweep.csv (one row per run), DIR/summary.csv "
    "(mean/std over seeds), DIR/curves.csv (Sink_1 through training) and DIR/command.txt. Completed runs "
    "are skipped when rerun."
)


def _train_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``p`` with the options of ``train``: ``--preset --list --threads`` and one per config field."""
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help=VOCABULARY["--preset"])
    p.add_argument("--list", action="store_true", help="list attention operations and presets, then exit")
    p.add_argument("--threads", type=int, default=None, help=VOCABULARY["--threads"])
    _add_config_options(p)
    return p


def _sweep_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``p`` with the options of ``sweep``: ``--preset --jobs --keep-models --reuse`` and a comma list per config
    field."""
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help=VOCABULARY["--preset"])
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once, one process and thread each")
    p.add_argument(
        "--keep-models",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep each run's model.safetensors (--no-keep-models: only its config, statistics and log)",
    )
    p.add_argument(
        "--reuse",
        default="",
        help="comma-separated sweep folders: a grid point whose configuration "
        "equals a finished run there is copied instead of retrained",
    )
    fields = [
        f.name
        for cls in (ModelConfig, TrainConfig)
        for f in dataclasses.fields(cls)
        if f.name not in ("preset", "out", "progress", "compile", "resume")
    ]
    _add_config_options(p, list_fields=fields)
    return p


def add_parsers(sub) -> None:
    """Add ``train`` and ``sweep`` to the command line's subcommands (``python -m analysis``). They check their own
    options (``own_checks``), before any data is prepared.

    Parameters
    ----------
    sub : argparse._SubParsersAction

    Returns
    -------
    None
    """
    _train_options(sub.add_parser("train", help=TRAIN_HELP, description=TRAIN_DESCRIPTION))
    sub.choices["train"].set_defaults(func=run_train, own_checks=True)
    _sweep_options(sub.add_parser("sweep", help=SWEEP_HELP, description=SWEEP_DESCRIPTION))
    sub.choices["sweep"].set_defaults(func=run_sweep, own_checks=True)


def _parser() -> argparse.ArgumentParser:
    return _train_options(argparse.ArgumentParser(prog="python -m analysis.train", description=TRAIN_DESCRIPTION))


def _sweep_parser() -> argparse.ArgumentParser:
    return _sweep_options(argparse.ArgumentParser(prog="python -m analysis.train sweep", description=SWEEP_DESCRIPTION))


def _print_list() -> None:
    from analysis.model.reference.attention import available_attention  # import time: torch only for --list

    print("attention operations (--attention NAME):")
    for name, desc in available_attention().items():
        print(f"  {name:22s} {desc}")
    print("\npresets (--preset NAME):")
    for name in PRESETS:
        print(f"  {name}")


def _default_out(values: dict) -> str:
    """Where a run without ``--out`` goes: ``runs/<preset>-<attention>-seed<seed>`` (printed, never thrown away);
    ``values``: the preset's fields updated with the command line's."""
    return f"runs/{values.get('preset') or 'custom'}-{values.get('attention', 'softmax')}-seed{values.get('seed', 0)}"


def _check_run_args(ns: dict) -> None:
    """Everything a training run can check before any data is prepared (ValueError, naming the flag, otherwise):
    where it writes (``--out``: a folder that can be written and holds no run, unless ``--resume``), the sink
    threshold (``--eps``, once the norms' epsilon), and the device (``cuda`` without CUDA is an error)."""
    check_output(ns["out"], flag="--out", folder=True)
    out = Path(ns["out"]).expanduser()
    held = [name for name in RUN_FILES if (out / name).exists()] if out.is_dir() else []  # the run files there
    if held and not ns.get("resume"):
        raise ValueError(
            f"--out {ns['out']} already holds a run ({', '.join(held)}); pass --resume to continue it, or "
            "give a new folder to --out. Nothing was changed."
        )
    _check_devices_and_eps(ns)


def _check_devices_and_eps(ns: dict) -> None:
    """``--eps`` (each value of a sweep's list) is a sink threshold; each ``--device`` exists here."""
    for eps in _as_list(ns.get("sink_eps", [])):
        if not NORM_EPS_MAX <= eps < 1:
            raise ValueError(
                f"--eps {eps}: --eps is the sink threshold, in [{NORM_EPS_MAX}, 1) (paper: 0.3), as in "
                "python -m analysis; the norms' epsilon, once --eps here, is --norm-eps."
            )
    for device in _as_list(ns.get("device", "auto")):
        check_device(device)


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _options(args) -> dict:
    """The options given, as the config builders take them: without the command line's own keys."""
    return {k: v for k, v in vars(args).items() if k not in ("command", "func", "own_checks")}


def run_sweep(args, *, command: str) -> int:
    """``sinklens sweep``: checked before any run starts, then the grid.

    Parameters
    ----------
    args : argparse.Namespace
        Of ``_sweep_options`` (defaults suppressed: the fields given only).
    command : str
        The command line, for the grid's record.

    Returns
    -------
    int
        The exit status (2 for bad input).
    """
    ns = _options(args)
    preset_name, jobs, keep = ns.pop("preset"), ns.pop("jobs"), ns.pop("keep_models")
    reuse = [r for r in ns.pop("reuse").split(",") if r]
    if "out" not in ns:
        return _fail(
            "sweep: --out DIR is required: the folder of the grid's runs and tables (the same --out again "
            "skips the runs already finished)."
        )
    if jobs < 1:
        return _fail(f"--jobs must be at least 1; got {jobs}.")
    try:
        check_output(ns["out"], flag="--out", folder=True)
        _check_devices_and_eps(ns)
        ns = {k: (v[0] if isinstance(v, list) and len(v) == 1 and k != "seed" else v) for k, v in ns.items()}
        from analysis.train.sweep import run_sweep as sweep  # import time: torch loads once the options are checked

        table = sweep(preset_name, ns, command=command, jobs=jobs, keep_models=keep, reuse=reuse)
    except ValueError as e:
        return _fail(str(e))
    print(table.to_string(index=False))
    return 0


def run_train(args, *, command: str) -> int:
    """``sinklens train``: one model, every option checked before any data is prepared.

    Parameters
    ----------
    args : argparse.Namespace
        Of ``_train_options`` (config defaults suppressed: the fields given only).
    command : str
        The command line, for the run's record (``command.txt``).

    Returns
    -------
    int
        The exit status (2 for bad input).
    """
    ns = _options(args)
    if ns.pop("list"):
        _print_list()
        return 0
    preset_name, threads = ns.pop("preset"), ns.pop("threads")
    if threads is not None and threads < 1:
        return _fail(f"--threads must be at least 1; got {threads}.")
    try:
        named = "out" in ns
        if not named:
            ns["out"] = _default_out({**(preset(preset_name) if preset_name else {}), "preset": preset_name, **ns})
        _check_run_args(ns)
        mcfg, tcfg = build_configs(preset_name, ns)
        if not named:
            print(f"no --out given: the run is written to {ns['out']} (pass --out DIR to choose)")
        import torch

        from analysis.train.trainer import train  # import time: torch loads once the options are checked

        if threads:
            torch.set_num_threads(threads)
        result = train(mcfg, tcfg, command=command)
    except ValueError as e:
        return _fail(str(e))
    shown = ("step", "loss", "val_loss", "sink_1", "sink_slot", "resid_norm_ratio", "value_norm_ratio")
    if result.final:
        print({k: v for k, v in result.final.items() if k in shown})
    print(f"model written to {tcfg.out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m analysis.train [sweep] ...``, the alias of ``sinklens train`` / ``sinklens sweep``: the same options
    and checks. Bad input exits 2 with one line that says what to do, and nothing already written is touched.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status (2 for bad input).
    """
    argv = cli_argv(argv)
    if argv[:1] == ["sweep"]:
        return run_sweep(_sweep_parser().parse_args(argv[1:]), command=command_line(argv))
    return run_train(_parser().parse_args(argv), command=command_line(["train", *argv]))
