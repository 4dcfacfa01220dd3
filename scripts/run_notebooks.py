"""Execute the notebooks in place, so they are committed with their figures and printed tables, and stamp each one
with a hash of its code cells' sources (``metadata["attention_sink_lens"]["source_sha256"]``).

    .venv/bin/python scripts/run_notebooks.py              # every notebook in notebooks/, one after the other
    .venv/bin/python scripts/run_notebooks.py 01 05        # those whose file name starts with 01 or 05
    .venv/bin/python scripts/run_notebooks.py --check      # execute nothing: list the notebooks that need a run

Each notebook runs top to bottom in a fresh kernel from notebooks/ (nbclient, as nbmake does in CI). A notebook
whose run fails is left as it was and the command exits 1 after the others, naming it. The stamp lets
``tests/test_notebooks_published.py`` fail, without executing anything, when a committed notebook has no outputs
or when its code changed after it was executed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
COMMAND = ".venv/bin/python scripts/run_notebooks.py"  # from the repository root
STAMP = "attention_sink_lens"  # the notebook metadata key of the stamp
TIMEOUT_S = 1800  # per cell


def notebooks(names=()) -> list[Path]:
    """The notebooks in notebooks/, sorted; ``names``: keep those whose file name starts with one of them."""
    found = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    if not names:
        return found
    keep = [p for p in found if any(p.name.startswith(n) for n in names)]
    missing = [n for n in names if not any(p.name.startswith(n) for p in found)]
    if missing:
        raise SystemExit(f"no notebook in {NOTEBOOK_DIR} starts with {missing}; there are {[p.name for p in found]}.")
    return keep


def source_hash(nb) -> str:
    """sha256 of the notebook's code cells' sources, in order (markdown and outputs do not count)."""
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    return hashlib.sha256(json.dumps(sources, ensure_ascii=False).encode()).hexdigest()


def stamp(nb) -> str | None:
    """The source hash the notebook was stamped with when it was last executed (None: never)."""
    return nb.metadata.get(STAMP, {}).get("source_sha256")


def is_current(nb) -> bool:
    return stamp(nb) == source_hash(nb)


def execute(path: Path, timeout: int = TIMEOUT_S) -> float:
    """Run ``path`` top to bottom in a fresh kernel, stamp it and write it back in place; the seconds it took. A
    failing cell raises (nbclient's CellExecutionError) and the file is left as it was."""
    from nbclient import NotebookClient  # lazy: import time (the published-notebooks test reads this file)

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=nb.metadata.get("kernelspec", {}).get("name", "python3"),
        resources={"metadata": {"path": str(path.parent)}},
        record_timing=False,
    ).execute()
    seconds = time.perf_counter() - t0
    nb.metadata[STAMP] = {"source_sha256": source_hash(nb), "command": f"{COMMAND} {path.name[:2]}"}
    tmp = path.with_name(path.name + ".tmp")
    nbformat.write(nb, tmp)
    os.replace(tmp, path)
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "names", nargs="*", help="run only the notebooks whose file name starts with one of these (01 05 ...)"
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="execute nothing; list the notebooks whose stamp is missing or stale and exit 1 if there are any",
    )
    ap.add_argument("--timeout", type=int, default=TIMEOUT_S, help=f"seconds per cell (default {TIMEOUT_S})")
    args = ap.parse_args(argv)
    paths = notebooks(args.names)
    if args.check:
        stale = [p.name for p in paths if not is_current(nbformat.read(p, as_version=4))]
        print("\n".join(f"needs a run: {n}" for n in stale) or f"all {len(paths)} notebooks are current.")
        return 1 if stale else 0
    failed = []
    for p in paths:
        print(f"[notebooks] {p.name} ...", file=sys.stderr, flush=True)
        try:
            seconds = execute(p, args.timeout)
        except Exception as e:  # noqa: BLE001 - the other notebooks still run; the command fails at the end
            failed.append(p.name)
            print(
                f"[notebooks] {p.name} FAILED (left as it was): {type(e).__name__}: {str(e)[-2000:]}",
                file=sys.stderr,
                flush=True,
            )
            continue
        print(f"[notebooks] {p.name}: {seconds:.0f} s, {p.stat().st_size / 1e6:.2f} MB", file=sys.stderr, flush=True)
    if failed:
        print(f"[notebooks] {len(failed)} of {len(paths)} failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
