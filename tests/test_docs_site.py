"""The documentation site (mkdocs.yml, scripts/mkdocs_hooks.py) builds strictly: no broken link or anchor, no page
left out of the nav, no docstring griffe cannot read; every public name of ``analysis`` has its API entry; the home
page is the README; each notebook is a page with its committed figures (rendered, not executed).

One build, into a temporary folder: about 10 s of CPU (30 s of wall time on a busy 2-core machine)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import analysis

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FIGURE = re.compile(r'<img [^>]*src="data:image/png')


def missing_entries(site: Path, exports: dict[str, str]) -> list[str]:
    """The public names (name -> defining module) without an API entry (the heading mkdocstrings anchors at the
    name's full path) on their subpackage's page, ``api/<subpackage>/index.html`` of the built ``site``."""
    missing = []
    for name, module in exports.items():
        page = site / "api" / module.split(".")[1] / "index.html"
        if not page.is_file() or f'id="{module}.{name}"' not in page.read_text():
            missing.append(f"{name} ({module})")
    return missing


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "NO_MKDOCS_2_WARNING": "1",
    }
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if not ln.startswith("INFO")]
    assert run.returncode == 0, "`mkdocs build --strict` failed; fix what it says:\n" + "\n".join(lines[-40:])
    return out


def test_every_public_name_has_an_api_entry(site):
    exports = {name: analysis._EXPORTS[name] for name in analysis.__all__}
    assert len(exports) >= 40
    missing = missing_entries(site, exports)
    assert not missing, f"public names with no entry in the API reference: {missing} (see scripts/mkdocs_hooks.py)"


def test_the_home_page_is_the_readme(site):
    home = (site / "index.html").read_text()
    readme = (ROOT / "README.md").read_text()
    for heading in re.findall(r"^#{1,2} (.+)$", readme, re.M):
        assert f">{heading}<" in home or f">{heading}<a" in home, f"README's heading {heading!r} not on the home page"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_each_notebook_is_a_page_with_its_figures(site, path):
    page = site / "notebooks" / path.stem / "index.html"
    assert page.is_file(), f"{path.name} has no page on the site"
    nb = nbformat.read(path, as_version=4)
    figures = sum("image/png" in out.get("data", {}) for c in nb.cells if c.cell_type == "code" for out in c.outputs)
    assert len(FIGURE.findall(page.read_text())) == figures, (
        f"{path.name}: its page does not show its {figures} figures"
    )


def test_the_entry_checker_finds_a_missing_name(tmp_path):
    (tmp_path / "api" / "model").mkdir(parents=True)
    (tmp_path / "api" / "model" / "index.html").write_text('<h2 id="analysis.model.loading.load_model">')
    exports = {
        "load_model": "analysis.model.loading",
        "probe_sets": "analysis.model.probes",
        "sink_metric": "analysis.sinks.metric",
    }
    assert missing_entries(tmp_path, exports) == [
        "probe_sets (analysis.model.probes)",
        "sink_metric (analysis.sinks.metric)",
    ]
