"""The committed positions grid (``data/emergence/positions``: six encodings x 3 seeds, weights kept): one point per
encoding (seed 0) is re-measured from its committed weights and must give the committed row, and the propositions
hold or fail there as the paper states them (equal hidden states and the closed form for NoPE, ALiBi, relative PE and
rotary; neither for the absolute encodings)."""

from __future__ import annotations

import pytest

from analysis.positions.encodings import ENCODING_GRID_DIR, encoding_point, load_encoding_grid
from analysis.positions.repeated_tokens import ENCODINGS

GRID = load_encoding_grid()


def test_the_grid_holds_six_encodings_with_three_seeds_and_their_weights():
    counts = GRID.runs.groupby("encoding").seed.nunique()
    assert sorted(counts.index) == sorted(ENCODINGS) and (counts == 3).all()
    for run in GRID.runs.run:
        weights = ENCODING_GRID_DIR / run / "model.safetensors"
        assert weights.is_file() and weights.stat().st_size < 1_000_000  # a synthetic model is small


@pytest.mark.parametrize("pe", ENCODINGS)
def test_one_point_per_encoding_reproduces(pe):
    """Seed 0 of each encoding, loaded from its weights and measured again: the committed row."""
    from analysis.train import load_reference

    row = GRID.runs[(GRID.runs.encoding == pe) & (GRID.runs.seed == 0)].iloc[0]
    meta = GRID.meta
    new, curve = encoding_point(
        load_reference(ENCODING_GRID_DIR / row.run, device="cpu"),
        n=meta["n"],
        T=meta["T"],
        seed=meta["probe_seed"],
        eps=meta["eps"],
    )
    assert new["encoding"] == pe
    for kind in ("natural", "random", "repeated"):
        assert new[f"sink_1_{kind}"] == pytest.approx(row[f"sink_1_{kind}"], abs=1e-6)
    assert new["max_relative_deviation"] == pytest.approx(row.max_relative_deviation, abs=1e-6)
    assert new["premise_holds"] == (pe not in ("learned", "sinusoidal"))  # absolute PE breaks the premise
    if pe in ("learned", "sinusoidal"):
        assert new["form_holds"] is None and new["max_relative_deviation"] > 0.1
    else:
        assert new["form_holds"] is True and new["gap_last"] <= 1e-6
        assert new["sink_1_repeated"] == 0.0  # Propositions 1-3 and the rotary bound: no sink on a repeated token
    assert curve.attention.between(0, 1).all()


def test_the_encoding_figures_draw():
    """The three figures of notebook 15, on the committed grid and on one reference model of it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis import repeated_tokens
    from analysis.figures.positions import plot_first_vs_t, plot_hidden_deviation, plot_sink_by_encoding
    from analysis.train import load_reference

    run = GRID.runs[(GRID.runs.encoding == "learned") & (GRID.runs.seed == 0)].run.item()
    res = repeated_tokens(load_reference(ENCODING_GRID_DIR / run, device="cpu"), n=2, T=16)
    for fig in (plot_first_vs_t(GRID), plot_hidden_deviation({"learned": res}), plot_sink_by_encoding(GRID)):
        assert fig.axes[0].has_data()
        fig.canvas.draw()
    assert len(plot_first_vs_t(GRID, encodings=["none", "alibi"]).axes) == 2
    plt.close("all")
