"""The README, docs/ and the notebooks' markdown say what is there and render as written.

- Every relative link in README.md, CHANGELOG.md and docs/**/*.md leads to a file or folder that exists, and every
  repository path and ``analysis.<module>`` name they mention exists (paths in inline code and in code blocks, modules anywhere).
- No "~" stands for "about" in README.md, docs/**/*.md or any markdown cell of notebooks/*.ipynb: a pair of single
  tildes renders as strikethrough in JupyterLab and on code hosts. Write "about" or "≈".

Reads files only; nothing is executed. Each checker is also run on made-up bad text, so that it can fail."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from analysis.core.registry import declared

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# Folders of the repository whose paths are checked wherever they appear (prose, inline code, code blocks).
TOP = ("analysis", "benchmarks", "data", "docs", "notebooks", "scripts", "tests", ".ci")
# Paths that are examples, not repository files: what a command writes (results/, runs/, the docs site's site/), a
# placeholder (DIR/), the inside of a training run folder (checkpoints/), what scripts/gpu/pack.sh builds (.gpu/,
# git-ignored), and the GPU results' folder the first GPU session creates (data/gpu/, see docs/gpu.md).
EXEMPT = ("results/", "runs/", "site/", "DIR/", "checkpoints/", ".gpu/", "data/gpu/")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
TOP_PATH = re.compile(r"(?<![\w./~$-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*-]*)")
SPAN_PATH = re.compile(r"[\w.][\w.-]*(?:/[\w.*-]*)+")
MODULE = re.compile(r"(?<![\w./])analysis(?:\.[A-Za-z_]\w*)+")


def split_code(text: str) -> tuple[str, str]:
    """(prose, code): the markdown text outside fenced blocks, and the fenced blocks' contents."""
    prose, code, fence = [], [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        else:
            (prose if fence is None else code).append(line)
            continue
        prose.append("")  # a fence line ends a paragraph
    return "\n".join(prose), "\n".join(code)


def _exists(path: str) -> bool:
    """A repository path, or a glob (``data/streaming/reference-*``) that matches one."""
    if path.startswith(EXEMPT):
        return True
    return any(ROOT.glob(path.rstrip("/"))) if "*" in path else (ROOT / path.rstrip("/")).exists()


def _module_exists(name: str) -> bool:
    """``analysis.a.b.c``: the longest prefix that is a module or package, then the next name defined in it."""
    parts = name.split(".")
    base, i = ROOT / parts[0], 1
    while i < len(parts) and ((base / parts[i]).is_dir() or (base / f"{parts[i]}.py").is_file()):
        base, i = base / parts[i], i + 1
    if i == len(parts):
        return True
    if base == ROOT / "analysis" and any(parts[i] in names for names in declared(base).values()):
        return True  # exported by a registered analysis (its registration's exports, read from the source)
    source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return re.search(rf"\b{re.escape(parts[i])}\b", source.read_text()) is not None


def broken_references(text: str, base: Path) -> list[str]:
    """The links, repository paths and ``analysis`` module names in markdown ``text`` (a file in folder ``base``)
    that do not exist."""
    prose, code = split_code(text)
    bad = []
    for target in LINK.findall(SPAN.sub("", prose)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, mailto:, or an anchor on this page
        path = target.split("#")[0]
        if not (base / path).exists():
            bad.append(f"link ({target})")
    spans = [m.group(2).strip() for m in SPAN.finditer(prose)]
    paths = [s for s in spans if SPAN_PATH.fullmatch(s)]
    paths += [p.rstrip(".,:;") for p in TOP_PATH.findall(prose + "\n" + code)]
    bad += [f"path {p}" for p in dict.fromkeys(paths) if not _exists(p)]
    bad += [f"module {m}" for m in dict.fromkeys(MODULE.findall(text)) if not _module_exists(m)]
    return bad


def tilde_problems(text: str) -> list[str]:
    """Paragraphs of markdown ``text`` (outside code spans and blocks) where "~" stands for "about": a tilde right
    before a number or "x" (``~30``, ``~1.2x``, ``~+150``), or two single tildes in one paragraph (strikethrough)."""
    prose, _ = split_code(text)
    bad = []
    for para in re.split(r"\n\s*\n", SPAN.sub("code", prose)):
        singles = re.findall(r"(?<!~)~(?!~)", para)
        if re.search(r"~[+\-−]?[\dx×]", para) or len(singles) >= 2:
            bad.append(" ".join(para.split())[:160])
    return bad


def markdown_sources() -> list[tuple[str, str]]:
    """(name, text) of README.md, docs/**/*.md and every markdown cell of notebooks/*.ipynb."""
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in DOCS]
    for p in NOTEBOOKS:
        nb = nbformat.read(p, as_version=4)
        out += [(f"{p.name} cell {i}", c.source) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"]
    return out


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_link_and_path_exists(path):
    bad = broken_references(path.read_text(), path.parent)
    assert not bad, (
        f"{path.relative_to(ROOT)} names what does not exist: {', '.join(bad)}. Fix the link or path "
        "(links are relative to the file; paths and modules to the repository root)."
    )


def test_no_tilde_for_about():
    bad = [f"{name}: {para}" for name, text in markdown_sources() for para in tilde_problems(text)]
    assert not bad, "'~' used for 'about' (a pair renders as strikethrough): write 'about' or '≈' in\n" + "\n".join(bad)


def test_the_docs_are_there():
    assert len(NOTEBOOKS) >= 10 and (ROOT / "docs" / "architecture.md") in DOCS
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, "README.md is the front page: at most 150 lines; move the rest to docs/."
    assert "from analysis import" in readme


def test_the_reference_checker_finds_a_bad_link(tmp_path):
    text = (
        "See [the layout](architecture.md), [a page that is not there](no_such_page.md#top), "
        "[a URL](https://example.org/x.md) and [here](#the-pipeline).\n\n"
        "`analysis/core/results.py`, `analysis/core/no_such_module.py`, `results/sink.json` (user output),\n"
        "`analysis.core.results.Result`, `analysis.core.no_such_name` and `analysis.no_such_floor.x`.\n\n"
        "The runs in `analysis/data/reference/synthetic-*` and `analysis/data/reference/no_such_run-*`.\n\n"
        "```bash\npython scripts/no_such_script.py --out runs/x && python scripts/setup.sh\n```\n"
    )
    bad = broken_references(text, ROOT / "docs")
    assert bad == [
        "link (no_such_page.md#top)",
        "path analysis/core/no_such_module.py",
        "path analysis/data/reference/no_such_run-*",
        "path scripts/no_such_script.py",
        "module analysis.core.no_such_name",
        "module analysis.no_such_floor.x",
    ], bad


def test_the_tilde_checker_finds_about(tmp_path):
    assert tilde_problems("Sink_1 falls to ~30% here.")
    assert tilde_problems("It costs ~1.2x a forward pass.")
    assert tilde_problems("MLPs write about +150 and\n~+520 on it.")
    assert tilde_problems("a ~ b and c ~ d in one paragraph")  # renders as strikethrough
    assert not tilde_problems("one tilde: SiLU(g) ~ g for large g.\n\nAnd another paragraph: x ~ y.")
    assert not tilde_problems("The cache lives in `~/.cache/attention-sink-lens` or `~/.cache/other`.")
    assert not tilde_problems("```\nls ~/a ~/b ~30\n```\n\nabout 30, ≈ 0.5")
    assert not tilde_problems("~~~\n~30 ~x\n~~~\n")
