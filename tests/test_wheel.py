"""The package as `pip install` gives it (issue 49): the sdist and wheel built with `build`, the wheel installed (not
editable) into a fresh virtual environment without a network, and run from outside the clone. The reference models and
the committed long-context run are package data, so they load there; the console script `sinklens` is installed.

The new environment takes the dependencies of this one (a .pth naming its site-packages; the .pth files there, among
them an editable install's finder, are not read), so nothing is downloaded; `analysis` must come from the wheel.
Measured on the shared 2-core machine: 68 s (build and install 6 s, the four commands 62 s, most of it
SmolLM2's load), 174 s at a load average of 15."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import analysis

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = sorted(d.name for d in (ROOT / "analysis/data/reference").iterdir() if (d / "config.json").is_file())


def _run(cmd, cwd: Path, *, timeout: int = 300) -> str:
    """Run ``cmd`` without PYTHONPATH (which names the clone) in ``cwd``; its stdout, or a failure with its stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Build the sdist and wheel, install the wheel into a fresh venv; its paths."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, ROOT], cwd=tmp)
    wheel = next(dist.glob("*.whl"))
    assert next(dist.glob("*.tar.gz")).stat().st_size > 0
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    py = venv / "bin" / "python"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
    (purelib / "_deps_of_the_test_env.pth").write_text("".join(f"{p}\n" for p in sorted(ours) if Path(p).is_dir()))
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            py,
            "install",
            "--no-index",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            wheel,
        ],
        cwd=tmp,
    )
    work = tmp / "elsewhere"  # outside the clone: no analysis/ or data/ beside the working directory
    work.mkdir()
    return {"wheel": wheel, "py": py, "bin": venv / "bin", "purelib": purelib, "work": work}


@pytest.mark.slow
def test_the_wheel_holds_the_package_data(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    for model in REFERENCE:
        assert f"analysis/data/reference/{model}/model.safetensors" in names, model
    assert "analysis/data/sink_context/smollm2-135m.csv" in names
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "sinklens = analysis.__main__:main" in zipfile.ZipFile(installed["wheel"]).read(entry).decode()


@pytest.mark.slow
def test_the_installed_wheel_runs_outside_the_clone(installed):
    py, work, sinklens = installed["py"], installed["work"], installed["bin"] / "sinklens"
    probe = (
        "import analysis, json; from analysis.positions.context_length import committed_sink_context; "
        "longest = max(committed_sink_context('smollm2-135m').Ts); "
        "print(json.dumps([analysis.__file__, analysis.__version__, longest]))"
    )
    where, version, longest = json.loads(_run([py, "-c", probe], cwd=work))
    assert Path(where).is_relative_to(installed["purelib"]), where  # the wheel's copy, not the clone's
    assert version == analysis.__version__ and longest == 8192

    listed = _run([sinklens, "models"], cwd=work)
    assert set(REFERENCE) | {"smollm2-135m"} <= {line.split()[0] for line in listed.splitlines()}, listed

    out = work / "sink.json"
    table = _run([sinklens, "sink", "--n", "4", "--T", "16", "--quiet", "--json", out], cwd=work)
    data = json.loads(out.read_text())
    assert data["model"] == "smollm2-135m" and data["n"] == 4 and data["T"] == 16 and "natural" in table
    assert data["sink_1_pct"]["natural"] > 30 and data["sink_1_pct"]["repeated"] < 5  # as tests/test_cli.py finds

    table = _run(
        [py, "-m", "analysis", "sink", "--model", "synthetic-sink-token", "--n", "4", "--T", "16", "--quiet"], cwd=work
    )
    assert "Sink_1 (eps=0.3) of synthetic-sink-token" in table and "Sink on slot" in table, table
