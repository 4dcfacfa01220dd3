"""``pytest --shard i/n``: the suite in n parts, one per device call (docs/gpu.md), cut by test file.

A file is never split, so one shard's workers build a file's module fixtures once. Files that use the embedded model
(SmolLM2, whose GGUF file reaches the GPU machine only with the last carrying call) all go to the last shard; the
others are balanced over the first n - 1 shards by their measured seconds (``tests/shard_weights.json``, from the
first GPU run; a file it did not reach counts ``PER_TEST_S`` a test). The cut depends only on the collected files,
so every xdist worker makes the same one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PER_TEST_S = 3.0
_EMBEDDED = re.compile(r"smollm2|default_model|load_model\(\)|embedded[ _]model", re.IGNORECASE)


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` as (i, n), 1 <= i <= n; ValueError saying what to give otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"--shard takes i/n with 1 <= i <= n (e.g. 2/3); got {text!r}.")
    return int(m.group(1)), int(m.group(2))


def uses_embedded_model(path: Path) -> bool:
    """Whether a test file names the embedded model (its fixture, its name, its folder, or the default model). The
    helper modules do not load it (tests/planted.py's ``load_smollm2`` is for notebooks)."""
    return bool(_EMBEDDED.search(Path(path).read_text()))


def weights() -> dict[str, float]:
    return {
        k: v
        for k, v in json.loads((ROOT / "tests" / "shard_weights.json").read_text()).items()
        if not k.startswith("_")
    }


def assign(counts: dict[str, int], n: int, embedded: set[str] = frozenset()) -> dict[str, int]:
    """Test file (path relative to the repository) -> its shard, 1..n.

    Parameters
    ----------
    counts : dict of str to int
        The collected files and their number of tests.
    n : int
    embedded : set of str
        Files known to use the embedded model (e.g. through a ``smollm2`` fixture), beside those that name it.

    Returns
    -------
    dict of str to int
    """
    if n == 1:
        return {f: 1 for f in counts}
    measured = weights()
    cost = {f: measured.get(f, PER_TEST_S * k) for f, k in counts.items()}
    out = {f: n for f in counts if f in embedded or uses_embedded_model(ROOT / f)}
    load = [0.0] * (n - 1)
    for f in sorted(set(counts) - set(out), key=lambda f: (-cost[f], f)):
        i = min(range(n - 1), key=lambda j: (load[j], j))
        out[f] = i + 1
        load[i] += cost[f]
    return out
