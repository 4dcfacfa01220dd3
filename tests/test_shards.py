"""``pytest --shard i/n`` (tests/shards.py): every test in exactly one shard, cut by file, the files that use the
embedded model (carried to the GPU machine last) in the last shard."""

import re
import subprocess
import sys

import pytest

from tests.shards import ROOT, assign, parse_shard, uses_embedded_model

FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("**/test_*.py"))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_file_is_in_exactly_one_shard(n):
    counts = {f: len(re.findall(r"^def test_", (ROOT / f).read_text(), re.MULTILINE)) for f in FILES}
    where = assign(counts, n)
    assert set(where) == set(FILES) and set(where.values()) <= set(range(1, n + 1))
    assert where == assign(dict(reversed(list(counts.items()))), n), "the cut depends on the order of collection"
    if n > 1:
        assert all(where[f] == n for f in FILES if uses_embedded_model(ROOT / f))
        assert {where[f] for f in FILES if not uses_embedded_model(ROOT / f)} == set(range(1, n))
    assert where["tests/test_cli.py"] == n, "runs `python -m analysis sink` on the embedded model"


def test_bad_shard_says_what_to_give():
    assert parse_shard(" 2/3 ") == (2, 3)
    for bad in ("0/2", "3/2", "2", "a/b"):
        with pytest.raises(ValueError, match="i/n"):
            parse_shard(bad)


def test_the_option_deselects_the_other_shards():
    """One collection (a subprocess: about 10 s): the first of two shards holds the files without the embedded model,
    every test of them, and nothing of tests/test_cli.py."""
    files = ["tests/test_layout.py", "tests/test_cli.py"]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files, "--shard", "1/2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    got = [line for line in out.stdout.splitlines() if "::" in line]
    n_layout = len(re.findall(r"^def test_", (ROOT / files[0]).read_text(), re.MULTILINE))
    assert {t.split("::")[0] for t in got} == {files[0]} and len(got) >= n_layout
    assert re.search(r"\d+ deselected", out.stdout)
