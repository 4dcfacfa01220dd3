"""The chain along training (analysis.dynamics.formation): one row per snapshot and link, the final model's values
those of mechanism_chain on the same probe, onsets that are the first snapshot meeting their criterion, NaN where
no sink head exists, and the figure."""

import json
import math
import shutil
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch

from analysis.core.stats import one_thread
from analysis.model.loading import REFERENCE_DIR
from analysis.train import CheckpointError, ModelConfig, SinkLM, TrainConfig, load_reference, train
from analysis.model.reference.checkpoint import save_reference
from analysis.dynamics.compare import mechanism_chain
from analysis.model.reference.data import build_data
from analysis.dynamics.formation import LINKS, ONSETS, Criterion, formation_order, onset_table, run_models
from analysis.train.presets import build_configs

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[2]
N, T = 16, 32
STEPS = [10, 100, 200]
OWN_SINK_LINKS = ("key_offsub_z", "cos_q_k1", "cos_q_kj", "value_ratio_sink_heads")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A small induction run (2 layers, d 32) of 200 steps keeping its weights at steps 10, 100 and 200, trained on
    the CPU whatever --device says: the tests' expectations (no sink in the early snapshots) come from CPU training
    ("auto" would train in bf16 on a GPU); the analyses of its snapshots run on the device."""
    out = tmp_path_factory.mktemp("formation") / "attention-softmax_seed-0"
    m, t = build_configs(
        "induction",
        dict(
            steps=200,
            d_model=32,
            d_mlp=64,
            n_heads=2,
            batch_size=16,
            warmup_steps=20,
            snapshots=",".join(map(str, STEPS)),
            eval_every=0,
            checkpoint_every=0,
            log_every=50,
            out=str(out),
            progress=False,
            device="cpu",
        ),
    )
    with one_thread():  # a second thread only waits on a busy machine (analysis.core.stats.one_thread)
        train(m, t)
    return out


@pytest.fixture(scope="module")
def result(run_dir, device):
    return formation_order([run_dir], n_probe=N, probe_len=T, device=device)


@pytest.fixture(scope="module")
def sink_run(tmp_path_factory):
    """A run whose final model sinks (the committed synthetic softmax reference) and whose first snapshot is the same
    model untrained: sink heads at the end, none at the start."""
    out = tmp_path_factory.mktemp("formation-sink") / "synthetic-softmax"
    ref = REFERENCE_DIR / "synthetic-softmax"
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ref / name, out / name)
    cfg = json.loads((ref / "config.json").read_text())
    torch.manual_seed(0)
    untrained = SinkLM(ModelConfig.from_dict(cfg["model"]))
    save_reference(out / "snapshots" / "step-0000001", untrained, {**cfg, "step": 1, "final": {"step": 1}})
    return out


@pytest.fixture(scope="module")
def sink_result(sink_run, device):
    return formation_order([sink_run], n_probe=N, probe_len=T, device=device)


def test_one_row_per_model_and_link_and_the_final_model_replaces_its_snapshot(run_dir, result):
    models = run_models(run_dir)
    assert [s for s, _, _ in models] == STEPS and [f for _, _, f in models] == [False, False, True]
    assert models[-1][1] == run_dir  # the final model, not the snapshot of the same step
    f = result.formation
    assert len(f) == len(STEPS) * len(LINKS)
    assert f.groupby(["step", "link"]).size().eq(1).all()
    assert sorted(f.step.unique()) == STEPS and set(f.link) == set(LINKS)
    assert f[f.final].step.unique().tolist() == [STEPS[-1]]
    assert set(result.onsets.link) == {c.link for c in ONSETS} and len(result.onsets) == len(ONSETS)
    assert len(result.followed) == 1 and bool(result.followed.complete.iloc[0])
    d = json.loads(json.dumps(result.to_dict(), allow_nan=False))  # strict JSON: NaN as null
    assert len(d["formation"]) == len(f) and d["n_samples"] == N and d["text"] == result.text()


def test_the_final_model_gives_the_values_of_mechanism_chain_on_the_same_probe(run_dir, result, device):
    model = load_reference(run_dir, device=device)  # where formation_order measured it
    tokens = build_data(
        TrainConfig.from_dict({**model.reference_config["train"], "seed": 2024}), model.cfg.n_ctx
    ).probe(N, T)
    fol = result.followed.iloc[0]
    with one_thread():
        chain = mechanism_chain(model, tokens, eps=0.3, ratio=20.0, dims=fol.dims, heads=fol.sink_heads)
    final = result.formation[result.formation.final].set_index("link").value
    for link in (
        "sink_1",
        "spike_ratio_token",
        "spike_ratio_sequence",
        "value_ratio_other_heads",
        "sink_1_spike_zeroed",
    ):
        assert final[link] == pytest.approx(chain[link], rel=1e-6, abs=1e-9), link
    for link in OWN_SINK_LINKS:  # NaN on both sides where the model has no sink head
        assert np.isclose(final[link], chain[link], equal_nan=True), link


def test_no_sink_head_gives_nan_and_not_an_error(result):
    w = result.wide().set_index("step")
    no_sink = w.sink_1 == 0
    assert no_sink.any()  # the early snapshots of so short a run have no sink
    for link in OWN_SINK_LINKS:
        assert w.loc[no_sink, link].isna().all(), link
    assert w.cut_kept.isna().all()  # Sink_1 under 5%: no share of it is defined


def test_onsets_are_the_first_snapshot_meeting_the_criterion(result, sink_result):
    for res in (result, sink_result):
        f = res.formation
        crit = {c.link: c for c in ONSETS}
        for r in res.onsets.itertuples():
            s = f[(f.run == r.run) & (f.link == r.link)].sort_values("step")
            met = crit[r.link].met(s.value.to_numpy())
            if math.isnan(r.onset_step):
                assert not met.any(), r.link
            else:
                first = s.step.to_numpy()[met][0]
                assert r.onset_step == first and not met[s.step.to_numpy() < r.onset_step].any(), r.link


def test_onsets_and_half_way_steps_of_a_known_table():
    steps = [10, 20, 30, 40, 50]
    rows = [
        {"run": "r", "attention": "softmax", "seed": 0, "step": s, "final": s == 50, "link": link, "value": v}
        for link, vals in (
            ("sink_1", [0, 5, 12, 8, 30]),
            ("value_ratio_final_heads", [1.0, 0.8, 0.4, 0.6, 0.3]),
            ("norm_share", [np.nan, 0.1, 0.2, 0.2, 0.2]),
        )
        for s, v in zip(steps, vals)
    ]
    crit = (
        Criterion("sink_1", ">=", 10, "sink", ""),
        Criterion("value_ratio_final_heads", "<=", 0.5, "value", ""),
        Criterion("norm_share", ">=", 0.5, "norm", ""),
    )
    on = onset_table(pd.DataFrame(rows), crit).set_index("link")
    assert on.loc["sink_1", "onset_step"] == 30 and on.loc["sink_1", "half_step"] == 50  # 15 is half of 30
    assert on.loc["value_ratio_final_heads", ["onset_step", "half_step"]].tolist() == [30, 30]  # 0.65 is half-way
    assert math.isnan(on.loc["norm_share", "onset_step"])  # never reaches 0.5
    assert on.loc["norm_share", ["half_step", "first_value"]].tolist() == [30, 0.1]  # from the first finite value


def test_a_sinking_final_model_is_followed_into_its_untrained_snapshot(sink_result):
    res = sink_result
    fol = res.followed.iloc[0]
    assert fol.sink_layer == 0 and len(fol.sink_heads) > 0
    w = res.wide().set_index("step")
    assert list(w.index) == [1, 4000]
    assert w.loc[4000, "sink_1"] > 50 and w.loc[1, "sink_1"] < 10
    assert w.loc[1, OWN_SINK_LINKS].isna().all() and w.loc[4000, OWN_SINK_LINKS].notna().all()
    # the final model's sink heads are measured at every step, and at the end they are the model's own sink heads
    assert w[["key_offsub_z_final_heads", "cos_q_k1_final_heads", "value_ratio_final_heads"]].notna().all().all()
    assert w.loc[4000, "cos_q_k1_final_heads"] == pytest.approx(w.loc[4000, "cos_q_k1"])
    assert w.loc[4000, "value_ratio_final_heads"] == pytest.approx(w.loc[4000, "value_ratio_sink_heads"])
    # the spike is the first token's own embedding (BOS is a token of its own): no MLP writes it, nothing to cut
    assert w.loc[4000, "writer_mlp"] == 0 and w.loc[4000, "writer_block"] == -1
    assert math.isnan(w.loc[4000, "sink_1_writers_cut"])
    text = res.text()
    assert "Sink_1 reaches 10%" in text and "has no final model" not in text


def test_a_folder_without_snapshots_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no snapshot"):
        run_models(tmp_path)
    with pytest.raises(ValueError, match="at least one run"):
        formation_order([])


def test_the_figure_draws_every_link(result):
    from analysis.figures.formation import FIGURE_LINKS, plot_formation

    fig = plot_formation(result)
    drawn = [ax for ax in fig.axes if ax.get_visible()]
    assert len(drawn) == len(FIGURE_LINKS)
    assert all(ax.get_xscale() == "log" and ax.lines for ax in drawn)
    assert [ax.get_title() for ax in drawn] == list(FIGURE_LINKS.values())
    fig.canvas.draw()
    with pytest.raises(ValueError, match="not in this result"):
        plot_formation(result, ["no_such_link"])


def test_a_saved_formation_loads_back_with_the_same_tables_and_text(sink_result, tmp_path):
    from analysis.dynamics.formation import load_formation, save_formation

    save_formation(sink_result, tmp_path / "f")
    back = load_formation(tmp_path / "f")
    assert back.text() == sink_result.text()
    pd.testing.assert_frame_equal(back.onsets, sink_result.onsets, check_dtype=False)
    assert back.followed.dims.tolist() == sink_result.followed.dims.tolist()
    with pytest.raises(FileNotFoundError, match="formation_order.py"):
        load_formation(tmp_path)


def _formation_script():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("formation_order", ROOT / "scripts" / "formation_order.py")
    mod = importlib.util.module_from_spec(spec)
    sys.argv, argv = ["formation_order.py"], sys.argv
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.argv = argv
    return mod


def test_append_adds_runs_and_a_run_measured_again_replaces_its_rows():
    """scripts/formation_order.py --append: the committed runs stay, a re-measured run's rows are the new ones."""
    import dataclasses

    from analysis.dynamics.formation import load_formation

    script = _formation_script()
    old = load_formation(ROOT / "data" / "emergence" / "induction" / "formation")
    run = "attention-softmax_seed-1"
    new = dataclasses.replace(
        old,
        **{
            name: getattr(old, name)[getattr(old, name).run == run].copy()
            for name in ("formation", "onsets", "followed", "writes")
        },
        notes=[],
    )
    new.formation["value"] = new.formation["value"] + 1.0  # the re-measured run, told apart by its values
    both = script.appended(old, new)
    assert len(both.formation) == len(old.formation) and set(both.followed.run) == set(old.followed.run)
    mine = both.formation[both.formation.run == run]
    assert np.allclose(mine["value"].dropna().to_numpy(), new.formation["value"].dropna().to_numpy())
    others = both.formation[both.formation.run != run].reset_index(drop=True)
    ref = old.formation[old.formation.run != run].reset_index(drop=True)
    pd.testing.assert_frame_equal(others, ref)
    with pytest.raises(SystemExit, match="probe"):
        script.appended(old, dataclasses.replace(new, T=old.T + 1))


def test_append_to_a_folder_without_tables_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "runs" / "run-a" / "snapshots").mkdir(parents=True)  # a run folder, so the refusal is --append's
    dest = tmp_path / "out"
    dest.mkdir()
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "formation_order.py"),
            str(tmp_path / "runs"),
            "--out",
            str(dest),
            "--append",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    err = out.stderr.strip()
    assert err.startswith("--append:") and "lacks" in err and len(err.splitlines()) == 1
    assert not any(dest.iterdir())  # nothing written
