"""MkDocs hooks (``hooks:`` in mkdocs.yml): the site mirrors the repository, so every link in README.md, docs/ and
the notebooks resolves on the site as it does on a code host, and the API reference follows ``analysis.__all__``.

- README.md is the home page (``README.md`` becomes ``index.html``), docs/ keeps its folder (``docs/cli.md`` ->
  ``docs/cli/``), the notebooks sit at ``notebooks/`` (rendered by mkdocs-jupyter with their committed outputs),
  and any other repository file a page links to (``../data/scale/offload.json``) is copied as is.
- ``api/<subpackage>.md``: one page per subpackage of the public names (``analysis._EXPORTS``: name -> defining
  module), each name through mkdocstrings, and ``api/index.md`` listing them all; a new export gets its entry with
  no edit here.
- A nav entry whose value holds a ``*`` (``notebooks/*.ipynb``) lists the matching pages not already in the nav.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections import defaultdict
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/**/*", "notebooks/*.ipynb")  # the repository files the site is made of
LINK = re.compile(r"\]\(\s*<?([^)\s>#]+)")
MODULE_OPTIONS = (
    "    options:\n      members: false\n      show_root_heading: false\n      show_root_toc_entry: false\n"
)
ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc):(?=<code>)")  # a Sphinx role before its name


def public_names() -> dict[str, str]:
    """Every public name of ``analysis`` -> the module that defines it (read without importing torch)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # this checkout's package, whatever the venv's editable install points at
    import analysis

    return {name: analysis._EXPORTS[name] for name in analysis.__all__}


def api_pages() -> dict[str, str]:
    """``api/<subpackage>.md`` -> its markdown (one mkdocstrings entry per public name), and ``api/index.md``."""
    groups = defaultdict(list)
    for name, module in public_names().items():
        groups[module.split(".")[1]].append(f"{module}.{name}")
    pages = {
        "api/index.md": "# API reference\n\nEvery public name, imported as `from analysis import NAME`.\n\n"
        f"::: analysis\n{MODULE_OPTIONS}\n"
        "| name | defined in |\n| --- | --- |\n"
    }
    for sub, paths in sorted(groups.items()):
        entries = "\n".join(f"::: {path}\n" for path in paths)
        pages[f"api/{sub}.md"] = f"# analysis.{sub}\n\n::: analysis.{sub}\n{MODULE_OPTIONS}\n{entries}"
        pages["api/index.md"] += "".join(
            f"| [`{p.rsplit('.', 1)[1]}`][{p}] | `{p.rsplit('.', 1)[0]}` |\n" for p in paths
        )
    return pages


def _sources() -> list[str]:
    return sorted({p.relative_to(ROOT).as_posix() for pattern in PAGES for p in ROOT.glob(pattern) if p.is_file()})


def on_config(config):
    """Expand the nav's ``*`` entries over the site's pages (the repository's and the generated API pages)."""
    pages = _sources() + sorted(api_pages())
    listed = set()

    def walk(items):
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                walk(value)
            elif isinstance(value, str):
                listed.add(value)

    def expand(items):
        out = []
        for item in items:
            key, value = next(iter(item.items())) if isinstance(item, dict) else (None, item)
            if isinstance(value, list):
                out.append({key: expand(value)})
            elif isinstance(value, str) and "*" in value:
                found = [p for p in pages if fnmatch.fnmatch(p, value) and p not in listed]
                out += found if key is None else [{key: found}]
            else:
                out.append(item)
        return out

    walk(config.nav or [])
    config.nav = expand(config.nav or [])
    return config


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns the .ipynb files into pages
def on_files(files, config):
    """The site's files: the repository's pages at their repository paths, the files they link to, the API pages."""
    site = dict(dest_dir=config.site_dir, use_directory_urls=config.use_directory_urls)
    out = [File(path, src_dir=str(ROOT), **site) for path in _sources()]
    linked = set()
    for f in out:
        if f.src_uri.endswith(".md"):
            for target in LINK.findall(Path(f.abs_src_path).read_text()):
                path = (ROOT / f.src_uri).parent.joinpath(target).resolve()
                if "://" not in target and path.is_file() and ROOT in path.parents:
                    linked.add(path.relative_to(ROOT).as_posix())
    out += [File(path, src_dir=str(ROOT), **site) for path in sorted(linked - set(_sources()))]
    out += [File.generated(config, uri, content=text) for uri, text in api_pages().items()]
    return Files(out + [f for f in files if f.src_dir != config.docs_dir])  # the theme's files, not docs/ again


def on_page_content(html, page, config, files):
    """Drop the Sphinx roles (``:func:``) that some docstrings put before a name: the name stays, as code."""
    return ROLE.sub("", html) if page.file.src_uri.startswith("api/") else html
