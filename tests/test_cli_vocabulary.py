"""One vocabulary over every command of `sinklens` (`python -m analysis`: sink, sinks, report, stream, quant, models,
train, sweep): one name per meaning, no old spelling left, docs/cli.md listing every option, and `--help` or a refusal
answered before torch, transformers or TransformerLens load."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.core.options import VOCABULARY

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("sink", "sinks", "report", "stream", "quant", "models", "atlas", "train", "sweep")
# The spellings the package dropped before its first release (issue 49), each with the command that took it.
OLD_SPELLINGS = {
    "stream": ["--bits"],
    "quant": ["--bits", "--w-bits", "--seeds"],
    "train": ["--sink-eps", "--probe-size", "--probe-len", "--progress", "--no-progress"],
    "sweep": ["--sink-eps", "--probe-size", "--probe-len", "--no-progress"],
}
SAME_COMMAND = {"sweep": "train"}  # a sweep's options are train's fields, as comma lists: one command's vocabulary
HEAVY = ("torch", "transformers", "transformer_lens", "pandas")


def _commands() -> dict[str, argparse.ArgumentParser]:
    from analysis.__main__ import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _live(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Option -> action, the help left out."""
    return {
        a.option_strings[0]: a
        for a in parser._actions
        if a.option_strings and a.option_strings[0] not in ("-h", "--help")
    }


def _meaning(action: argparse.Action) -> str | None:
    """The help as a meaning: without its default and a command's own clause after '; '."""
    if not action.help or action.help == argparse.SUPPRESS:
        return None
    return re.sub(r"\s*\(default: [^)]*\)\s*$", "", action.help.split("; comma-separated list")[0]).strip()


def vocabulary_clashes(commands: dict[str, argparse.ArgumentParser]) -> list[str]:
    """Every name that means two things, and every meaning with two names, over the commands given."""
    live = {c: _live(p) for c, p in commands.items()}
    takers: dict[str, list[tuple[str, argparse.Action]]] = {}
    for c, opts in live.items():
        for flag, a in opts.items():
            takers.setdefault(flag, []).append((c, a))
    out = []
    for flag, used in takers.items():
        if len({SAME_COMMAND.get(c, c) for c, _ in used}) < 2:  # train and sweep: one command's fields, one generator
            continue
        if flag not in VOCABULARY:
            out.append(f"{flag} is taken by {[c for c, _ in used]} but not in analysis.core.options.VOCABULARY")
            continue
        if VOCABULARY[flag] is not None:
            out += [
                f"{flag} in {c} means {a.help!r}, not {VOCABULARY[flag]!r}"
                for c, a in used
                if not (a.help or "").startswith(VOCABULARY[flag])
            ]
        switches = {c: a.nargs == 0 for c, a in used if c != "sweep"}  # a sweep takes comma lists
        if len(set(switches.values())) > 1:
            out.append(f"{flag} is a switch in some commands and takes a value in others: {switches}")
    names_of: dict[str, set[str]] = {}
    for opts in live.values():
        for flag, a in opts.items():
            if _meaning(a):
                names_of.setdefault(_meaning(a), set()).add(flag)
    out += [f"one meaning, two names: {sorted(n)} ({m!r})" for m, n in names_of.items() if len(n) > 1]
    return out


def test_the_nine_commands_are_all_seen():
    assert set(COMMANDS) == set(_commands())


def test_one_name_per_meaning_and_one_meaning_per_name():
    clashes = vocabulary_clashes(_commands())
    assert not clashes, "\n".join(clashes)


def test_the_checker_sees_both_kinds_of_clash():
    a, b = argparse.ArgumentParser(), argparse.ArgumentParser()
    a.add_argument("--eps", type=float, help="the norms' epsilon")
    b.add_argument("--eps", type=float, help=VOCABULARY["--eps"])
    b.add_argument("--sink-eps", help=VOCABULARY["--eps"])
    clashes = "\n".join(vocabulary_clashes({"a": a, "b": b}))
    assert "--eps in a means" in clashes and "one meaning, two names" in clashes


@pytest.mark.parametrize("command", sorted(OLD_SPELLINGS))
def test_old_spellings_are_refused(command, capsys):
    """No spelling kept "for one release" in a package never released: argparse refuses each, exit 2."""
    from analysis.__main__ import main

    for old in OLD_SPELLINGS[command]:
        with pytest.raises(SystemExit) as e:
            main([command, old, *([] if old in ("--progress", "--no-progress") else ["4"])])
        assert e.value.code == 2 and f"unrecognized arguments: {old}" in capsys.readouterr().err, old


def test_train_alias_is_the_same_command():
    """`python -m analysis.train [sweep]` (the alias the committed runs' records use) takes train's and sweep's
    options as `sinklens train` / `sinklens sweep` do."""
    from analysis.train.cli import _parser, _sweep_parser

    commands = _commands()
    assert sorted(_live(_parser())) == sorted(_live(commands["train"]))
    assert sorted(_live(_sweep_parser())) == sorted(_live(commands["sweep"]))


def test_shared_options_take_one_default_device():
    for c, parser in _commands().items():
        opts = _live(parser)
        if "--device" in opts and c not in ("train", "sweep"):  # train's defaults come from TrainConfig
            assert opts["--device"].default == "auto", c
    from analysis.model.reference.config import TrainConfig

    assert TrainConfig().device == "auto"


def _doc_sections() -> dict[str, str]:
    text = (ROOT / "docs/cli.md").read_text()
    parts = re.split(r"^### `sinklens (\w+)`\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_docs_cli_lists_every_command_and_option():
    sections = _doc_sections()
    missing = []
    for c, parser in _commands().items():
        if c not in sections:
            missing.append(f"no section '### `sinklens {c}`'")
            continue
        missing += [f"{c} {flag}" for flag in _live(parser) if f"`{flag}" not in sections[c]]
    assert not missing, f"docs/cli.md lacks: {missing}"
    table = (ROOT / "docs/interface.md").read_text()
    assert "`quant`" in table.split("## Checks before the work")[0]


def test_constants_named_for_a_light_parser_agree_with_their_owners():
    from analysis.quant.cli import CONDITIONS
    from analysis.quant.study import CONDITIONS as STUDY_CONDITIONS

    assert CONDITIONS == STUDY_CONDITIONS


_PROBE = """
import json, runpy, sys
rcs = {}
for argv in %s:
    sys.argv = argv
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        rcs[" ".join(argv)] = e.code
print(json.dumps({"rc": rcs, "heavy": sorted(m for m in %r if m in sys.modules)}))
"""


def test_help_and_refusals_answer_before_torch_loads(tmp_path):
    """`--help` and the quickest refusals parse and check before torch, transformers, TransformerLens (and pandas)
    load (measured once by hand: docs/cli.md)."""
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    runs = [
        ["analysis", "--help"],
        *[["analysis", c, "--help"] for c in COMMANDS],
        ["analysis", "sink", "--n", "0"],
        ["analysis", "report", "--out", f"{afile}/x"],
        ["analysis", "sink", "--json", f"{afile}/x.json"],
        ["analysis", "stream", "--window", "0"],
        ["analysis", "train", "--out", f"{afile}/x"],
        ["analysis", "sweep", "--seed", "0,1"],
        ["analysis.train", "--help"],
        ["analysis.train", "sweep", "--help"],
        ["analysis.train", "--out", f"{afile}/x"],
        ["analysis.train", "sweep", "--seed", "0,1"],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE % (json.dumps(runs), HEAVY)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["heavy"] == [], got
    assert [got["rc"][" ".join(r)] for r in runs] == [0] * (1 + len(COMMANDS)) + [2] * 6 + [0, 0, 2, 2], got["rc"]
