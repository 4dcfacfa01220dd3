"""The house's rules that well-kept tools check, as their configuration in pyproject.toml: import-linter keeps the
floors (imports point down the pipeline, in-function imports counted; every subpackage is a floor; no circle among
the modules of one package), ruff keeps pyflakes' and pycodestyle's rules over the code and its layout (``ruff
format``: fix with ``ruff format analysis tests benchmarks scripts``).

What stays hand-written in tests/test_layout.py, because no rule of these tools checks it: a circle through a
package's ``__init__`` and its own modules (import-linter's ``acyclic_siblings`` counts a package with its modules
as one), the comment saying why an import is lazy, keyword-only options, numpy-doc sections naming every parameter
(pydocstyle's numpy convention checks a section's layout, not that it names each parameter, and would ask for
edits all over the tree), and the 60-line cap on a function's body (ruff's PLR0915 counts statements and C901
branches, not lines). Not selected: ruff's I (isort: 117 findings in the tree, its imports are not sorted) and D
(pydocstyle, numpy convention: 1325 findings in analysis/ alone, mostly the summary line's form).

Time: about 1 s (lint-imports 0.6 s without its cache, ruff check 0.1 s, ruff format --check 0.1 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINTED = ("analysis", "tests", "benchmarks", "scripts")


def _run(*cmd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's analysis, not an installed one
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _script(name: str) -> str:
    """A console script of the environment running the tests (next to its python)."""
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        pytest.fail(f"{name} is not installed next to {sys.executable}: pip install -e '.[dev]'")
    return str(path)


def test_imports_keep_the_floors():
    out = _run(_script("lint-imports"), "--no-cache", "--no-logo")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_layers_contract_names_the_floors_of_the_layout_test():
    """The contract's floors are the ones tests/test_layout.py (the tests' folders) and docs/architecture.md name."""
    from tests.test_layout import FLOORS

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    assert layers == ["__main__", *reversed(FLOORS)], layers


def test_ruff_finds_nothing():
    out = _run(sys.executable, "-m", "ruff", "check", "--no-cache", *LINTED)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_finds_nothing():
    """The code is laid out as ``ruff format`` writes it (pyproject.toml's [tool.ruff.format]), over what ``ruff
    check`` reads."""
    out = _run(sys.executable, "-m", "ruff", "format", "--check", "--no-cache", *LINTED)
    assert out.returncode == 0, f"run `ruff format {' '.join(LINTED)}`:\n" + out.stdout + out.stderr
