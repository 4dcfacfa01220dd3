"""The notebooks are committed executed: with their outputs (figures where they plot), no error or warning box, not
edited since they ran (the source hash stamped by scripts/run_notebooks.py), and small. Nothing is executed here."""

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)

NOTEBOOKS = run_notebooks.notebooks()
MAX_BYTES = 2_000_000  # one interactive attention view (circuitsvis inlines ~1.8 MB of JavaScript) and the rest
PLOTS = re.compile(r"\bplot_\w+\(|\bplt\.")  # a cell that draws a figure
SHOWS = re.compile(r"\bprint\(|\bdisplay\(|plt\.show\(\)")  # a cell that must leave an output


def _redo(path: Path) -> str:
    return f"regenerate it with `{run_notebooks.COMMAND} {path.name[:2]}` (all of them: `{run_notebooks.COMMAND}`)"


def _code(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 10 and all(p.suffix == ".ipynb" for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_published(path):
    """Executed top to bottom in one run, after its code last changed, with its outputs and figures."""
    nb = nbformat.read(path, as_version=4)
    cells = _code(nb)
    if run_notebooks.stamp(nb) is None:
        pytest.fail(f"{path.name} was never executed by the publishing command: {_redo(path)}.", pytrace=False)
    if not run_notebooks.is_current(nb):
        pytest.fail(f"{path.name}'s code changed after it was executed: {_redo(path)}.", pytrace=False)
    counts = [c.execution_count for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name} was not executed top to bottom in one run (execution counts {counts}): {_redo(path)}."
    )
    silent = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and SHOWS.search(c.source) and not c.outputs]
    assert not silent, f"{path.name}: code cells {silent} print or show something but have no output: {_redo(path)}."
    outputs = [o for c in cells for o in c.outputs]
    assert outputs, f"{path.name} has no output at all: {_redo(path)}."
    errors = [o.get("ename") for o in outputs if o.output_type == "error"]
    assert not errors, f"{path.name} holds errors {errors}: fix them and {_redo(path)}."
    warned = [
        o.text.strip().splitlines()[0]
        for o in outputs
        if o.output_type == "stream" and o.name == "stderr" and "Warning" in o.text
    ]
    assert not warned, f"{path.name} shows a warning box: {warned}."
    if any(PLOTS.search(c.source) for c in cells):
        assert any("image/png" in o.get("data", {}) for o in outputs), (
            f"{path.name} plots but holds no figure: {_redo(path)}."
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_small(path):
    """At most one interactive (circuitsvis) view, and under MAX_BYTES in all."""
    nb = nbformat.read(path, as_version=4)
    views = [o for c in _code(nb) for o in c.outputs if "CircuitsVis" in str(o.get("data", {}).get("text/html", ""))]
    assert len(views) <= 1, f"{path.name} holds {len(views)} circuitsvis views: keep one, draw the others as figures."
    size = path.stat().st_size
    assert size <= MAX_BYTES, (
        f"{path.name} is {size / 1e6:.1f} MB (at most {MAX_BYTES / 1e6:g}): show figures, not views."
    )


def test_the_stamp_follows_the_code_only():
    """The hash changes with a code cell's source and with the order of code cells, not with outputs or markdown."""
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("# t"),
            nbformat.v4.new_code_cell("x = 1"),
            nbformat.v4.new_code_cell("print(x)"),
        ]
    )
    h = run_notebooks.source_hash(nb)
    nb.cells[0].source = "# another title"
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    assert run_notebooks.source_hash(nb) == h
    nb.cells[1].source = "x = 2"
    assert run_notebooks.source_hash(nb) != h
    nb.cells[1].source = "x = 1"
    nb.cells[1], nb.cells[2] = nb.cells[2], nb.cells[1]
    assert run_notebooks.source_hash(nb) != h
    nb.metadata[run_notebooks.STAMP] = {"source_sha256": run_notebooks.source_hash(nb)}
    assert run_notebooks.is_current(nb)
