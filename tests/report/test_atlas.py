"""``atlas``: many models in one resumable run (``analysis.report.atlas``, ``python -m analysis atlas``).

Over SmolLM2, a reference model, three tiny families (one saved as a folder named ``gpt2-xl``, so that Gu et al.'s
published row shows beside it) and a folder with a broken config, at N = 2, T = 16: the rows, the CSV, the JSON and the
page; a run stopped by Ctrl-C half-way and run again redoes nothing finished (load counts, row mtimes) and its rows equal
the uninterrupted run's; the failed model keeps its error and the models after it are measured; through nnsight the
numbers are the bridge's. Measured alone: 68 s of CPU (SmolLM2's load and the imports included; its 6 sequences of 16
tokens are measured twice), 234 s wall on the 2-core machine shared at load average 13.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.core.published import GU_TABLE1, published_sink
from analysis.report.atlas import AtlasConfig, KINDS_NOTE, row_path, run_atlas

CONFIG = AtlasConfig(n=2, T=16)
VOLATILE = ("seconds", "versions", "traceback")  # what two runs of the same row may differ in


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2, family_bridge, family_dir):
    """name -> a loaded model (each loaded once: the loader the atlas is given looks them up), and the broken one."""
    import shutil

    from analysis import load_model

    root = tmp_path_factory.mktemp("atlas-models")
    xl = root / "gpt2-xl"  # a tiny GPT-2 in a folder named as Gu et al.'s GPT2-XL
    shutil.copytree(family_dir("gpt2"), xl)
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-family"}')
    loaded = {
        "smollm2-135m": smollm2,
        "synthetic-softmax": load_model("synthetic-softmax"),
        str(family_dir("llama")): family_bridge("llama"),
        str(family_dir("qwen3")): family_bridge("qwen3"),
        str(xl): load_model(str(xl)),
    }
    return loaded, str(broken)


class Loader:
    """The atlas' ``load``: the models loaded once, a count of the calls, and Ctrl-C at the model named ``stop``."""

    def __init__(self, loaded: dict, stop: str | None = None):
        self.loaded, self.stop, self.calls = loaded, stop, []

    def __call__(self, name: str):
        from analysis import load_model

        self.calls.append(name)
        if name == self.stop:
            raise KeyboardInterrupt  # what Ctrl-C raises
        return self.loaded[name] if name in self.loaded else load_model(name)


def _names(models) -> list[str]:
    loaded, broken = models
    names = list(loaded)
    return names[:3] + [broken] + names[3:]  # the broken folder mid-list


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in VOLATILE}


@pytest.fixture(scope="module")
def uninterrupted(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("atlas-whole")
    loader = Loader(models[0])
    rows = run_atlas(_names(models), out, load=loader, config=CONFIG, log=None)
    return out, rows, loader


def test_every_model_gets_its_row_and_the_broken_one_its_error(models, uninterrupted):
    out, rows, loader = uninterrupted
    names = _names(models)
    assert [r["model"] for r in rows] == names and loader.calls == names
    by = {r["model"]: r for r in rows}
    bad = by[models[1]]
    assert bad["status"] == "failed" and bad["error"] and "sink_1_pct" not in bad
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 5, [r["error"] for r in rows]  # the models after the broken one were measured
    for r in ok:
        assert set(r["sink_1_pct"]) == {"natural", "random", "repeated"}
        assert all(0 <= v <= 100 for v in r["sink_1_pct"].values())
        big = r["largest_activation"]["natural"]
        assert big["abs"] >= big["median"] > 0 and 0 <= big["position"] < CONFIG.T and big["token"]
        kinds = r["kinds"]  # the share of sink heads of each kind (analysis.causal.sink_kind)
        assert kinds["n_sink_heads"] >= 0 and (
            kinds["n_sink_heads"] == 0 or abs(sum(kinds[k] for k in ("nop", "broadcast", "mixed")) - 1) < 1e-9
        )
        assert json.loads(row_path(out, r["model"]).read_text())["sink_1_pct"] == r["sink_1_pct"]
    smol = by["smollm2-135m"]
    assert smol["facts"]["family"] == "llama" and smol["facts"]["n_params"] > 1e8
    assert smol["largest_activation"]["natural"]["dim"] == 507 and smol["largest_activation"]["natural"]["massive"]
    assert smol["sink_1_pct"]["repeated"] < smol["sink_1_pct"]["natural"]
    assert by["synthetic-softmax"]["facts"]["family"] == "reference"


def test_the_facts_come_from_the_family_spec(models, uninterrupted):
    facts = {Path(r["model"]).name: r["facts"] for r in uninterrupted[1] if r["status"] == "ok"}
    assert facts["gpt2-xl"]["positions"] == "absolute" and "LayerNorm" in facts["gpt2-xl"]["norm"]
    assert facts["llama"]["positions"] == "rotary" and "RMSNorm" in facts["llama"]["norm"]
    assert facts["llama"]["attention"].startswith("softmax, GQA")  # 4 query heads, 2 KV heads
    assert facts["gpt2-xl"]["attention"].startswith("softmax, MHA")


def test_the_papers_figures_stand_beside_a_model_of_that_name(uninterrupted):
    out, rows, _ = uninterrupted
    xl = next(r for r in rows if Path(r["model"]).name == "gpt2-xl")
    assert xl["paper"]["model"] == "GPT2-XL" and (xl["paper"]["natural"], xl["paper"]["repeated"]) == (77.00, 62.28)
    assert xl["sink_1_pct"]["natural"] != 77.00  # ours is measured on the tiny random model, not copied
    assert all(r["paper"] is None for r in rows if r is not xl)
    table = pd.read_csv(out / "atlas.csv")
    assert table.loc[table.model == xl["model"], "paper_random"].item() == 70.29
    page = (out / "atlas.html").read_text()
    assert "Gu et al." in page and "Sink kinds" in page and page.count("data:image/png;base64") == 3


def test_csv_json_and_page_hold_every_row(uninterrupted):
    out, rows, _ = uninterrupted
    table = pd.read_csv(out / "atlas.csv")
    assert list(table.model) == [r["model"] for r in rows] and (table.status == "failed").sum() == 1
    ok = table[table.status == "ok"]
    assert (ok.kinds_n_sink_heads >= 0).all() and table.loc[table.status == "failed", "kinds_nop"].isna().all()
    soft = table.loc[table.model == "synthetic-softmax"].iloc[0]  # every head of the nop-task model sinks: nop
    assert (soft.kinds_n_sink_heads, soft.kinds_nop) == (4, 1.0)
    payload = json.loads((out / "atlas.json").read_text())
    assert payload["kinds"] == KINDS_NOTE and payload["pending"] == [] and len(payload["models"]) == len(rows)
    assert payload["config"] == CONFIG.to_dict()


def test_stopped_half_way_the_rerun_redoes_nothing_finished(models, uninterrupted, tmp_path):
    names = _names(models)
    first = Loader(models[0], stop=names[4])
    with pytest.raises(KeyboardInterrupt):
        run_atlas(names, tmp_path, load=first, config=CONFIG, log=None)
    done = {n: row_path(tmp_path, n).stat().st_mtime_ns for n in names[:4]}
    assert not row_path(tmp_path, names[4]).exists()
    payload = json.loads((tmp_path / "atlas.json").read_text())  # the summary of what finished is there already
    assert [r["model"] for r in payload["models"]] == names[:4] and payload["pending"] == names[4:]
    again = Loader(models[0])
    rows = run_atlas(names, tmp_path, load=again, config=CONFIG, log=None)
    assert again.calls == [models[1], *names[4:]]  # the failed model is tried again, the finished ones are not
    assert {n: row_path(tmp_path, n).stat().st_mtime_ns for n in names[:4] if n != models[1]} == {
        n: t for n, t in done.items() if n != models[1]
    }
    assert [_stable(r) for r in rows] == [_stable(r) for r in uninterrupted[1]]
    other = Loader(models[0])
    run_atlas(names[2:3], tmp_path, load=other, config=AtlasConfig(n=3, T=16), log=None)
    assert other.calls == names[2:3]  # a row measured on another probe is measured again


def test_the_command_reads_a_models_file_and_goes_on_after_ctrl_c(family_dir, tmp_path, monkeypatch, capsys, device):
    from analysis.__main__ import main
    from analysis.model import loading

    a, b = str(family_dir("llama")), str(family_dir("qwen3"))
    listed = tmp_path / "models.txt"
    listed.write_text(f"# two tiny families\n{a}\n\n{b}  # the second\n")
    argv = [
        "atlas",
        "--models-file",
        str(listed),
        "--out",
        str(tmp_path / "out"),
        "--n",
        "2",
        "--T",
        "16",
        "--quiet",
        "--device",
        device,
    ]
    real = loading.load_model

    def stop_at_b(name, **kwargs):
        if name == b:
            raise KeyboardInterrupt
        return real(name, **kwargs)

    monkeypatch.setattr(loading, "load_model", stop_at_b)
    assert main(argv) == 130 and "the same command again goes on" in capsys.readouterr().err
    kept = row_path(tmp_path / "out", a).stat().st_mtime_ns
    monkeypatch.setattr(loading, "load_model", real)
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert (
        "finished before, kept" in printed and "sink heads on natural text that are nop / broadcast / mixed" in printed
    )
    assert row_path(tmp_path / "out", a).stat().st_mtime_ns == kept
    assert len(pd.read_csv(tmp_path / "out" / "atlas.csv")) == 2


def test_help_and_refusals_before_torch(tmp_path):
    probe = (
        "import json, runpy, sys\nrcs = []\nfor argv in %r:\n    sys.argv = argv\n    try:\n"
        "        runpy.run_module('analysis', run_name='__main__', alter_sys=True)\n    except SystemExit as e:\n"
        "        rcs.append(e.code)\nprint(json.dumps([rcs, 'torch' in sys.modules]))\n"
    )
    runs = [
        ["analysis", "atlas", "--help"],
        ["analysis", "atlas", "--out", str(tmp_path)],
        ["analysis", "atlas", "--models-file", str(tmp_path / "none.txt"), "--out", str(tmp_path)],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", probe % runs],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    rcs, torch_loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rcs == [0, 2, 2] and not torch_loaded, proc.stderr
    assert "give the models to measure" in proc.stderr and "no models file" in proc.stderr


def test_the_published_table_is_the_papers():
    table1 = {r.model: (r.natural, r.random, r.repeated) for r in GU_TABLE1[:4]}
    assert table1 == {
        "GPT2-XL": (77.00, 70.29, 62.28),
        "Mistral-7B": (97.49, 75.21, 0.00),
        "LLaMA2-7B Base": (92.47, 90.13, 0.00),
        "LLaMA3-8B Base": (99.02, 91.23, 0.00),
    }
    assert published_sink("meta-llama/Llama-2-7b-hf").natural == 92.47
    assert published_sink("/models/Meta-Llama-3-8B/").model == "LLaMA3-8B Base"
    assert published_sink("meta-llama/Llama-2-7b-chat-hf").natural == 92.88
    assert published_sink("gpt2") is None and published_sink("smollm2-135m") is None


def test_through_nnsight_the_rows_numbers_are_the_bridges(models, uninterrupted, family_dir, tmp_path):
    from analysis import load_model

    name = str(family_dir("llama"))
    row = run_atlas(
        [name],
        tmp_path,
        load=lambda n: load_model(n, backend="nnsight"),
        config=AtlasConfig(n=2, T=16, backend="nnsight"),
        log=None,
    )[0]
    bridge = next(r for r in uninterrupted[1] if r["model"] == name)
    assert row["status"] == "ok", row["error"]
    assert row["sink_1_pct"] == bridge["sink_1_pct"]
    ours, theirs = row["largest_activation"]["natural"], bridge["largest_activation"]["natural"]
    # a random model's top-1 position is a near tie between tokens: the values, not which position wins by 1e-7
    assert ours["layer"] == theirs["layer"] and ours["abs"] == pytest.approx(theirs["abs"], rel=1e-5)
    assert ours["median"] == pytest.approx(theirs["median"], rel=1e-5)
    # here nnsight runs the bridge's passes in its traces: the facts are the bridge's (on NDIF: "not read through nnsight")
    assert row["facts"]["n_params"] == bridge["facts"]["n_params"] and row["facts"]["norm"] == bridge["facts"]["norm"]


def test_a_row_from_before_the_kinds_were_measured_is_measured_again(tmp_path):
    from analysis.core.io import write_json
    from analysis.report.atlas import finished_row

    row = {"model": "m", "status": "ok", "config": CONFIG.to_dict(), "kinds": None}
    write_json(row_path(tmp_path, "m"), row)
    assert finished_row(tmp_path, "m", CONFIG) is None
    write_json(
        row_path(tmp_path, "m"), {**row, "kinds": {"nop": 1.0, "broadcast": 0.0, "mixed": 0.0, "n_sink_heads": 1}}
    )
    assert finished_row(tmp_path, "m", CONFIG)["kinds"]["nop"] == 1.0
