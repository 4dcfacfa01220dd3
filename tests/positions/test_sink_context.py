"""The sink against context length and eps: rates by hand from every key's alpha, the spread over seeds, the CSV."""

import pandas as pd
import pytest

from analysis.model.probes import natural_probe
from analysis.sinks.metric import sink_metric
from analysis.positions.context_length import SinkContext, committed_sink_context, load_sink_context, sink_vs_context

WORDS = [" ".join(f"w{3 + (7 * i + j) % 90}" for j in range(200)) for i in range(5)]


def test_rates_by_hand_and_spread_over_seeds(tiny_llama, tmp_path):
    ctx = sink_vs_context(tiny_llama, Ts=(8, 24), n={8: 3, 24: 2}, seeds=(0, 1), eps_grid=(0.1, 0.3), texts=WORDS)
    assert isinstance(ctx, SinkContext) and ctx.Ts == [8, 24] and ctx.seeds == [0, 1] and ctx.n_samples == 10
    for r in ctx.runs.itertuples():
        tokens = natural_probe(tiny_llama.tokenizer, n=r.n, T=r.T, seed=r.seed, texts=WORDS).tokens
        a = sink_metric(tiny_llama, tokens, k_max=r.T, path="eager").alpha
        m = min(16, r.T // 2)  # keys seen by at least min(16, T // 2) queries
        later = a[..., 1 : r.T - m + 1] > r.eps
        assert r.sink_1_pct == pytest.approx(float((a[..., 0] > r.eps).float().mean() * 100), abs=1e-4)
        assert r.secondary_pct == pytest.approx(float(later.any(-1).float().mean() * 100), abs=1e-4)
        assert r.later_sinks_per_sequence == pytest.approx(float(later.flatten(1, 2).any(1).sum(-1).float().mean()))
        assert r.path == "fused"
    by_T = ctx.by_T(0.1).set_index("T")
    runs = ctx.runs[ctx.runs.eps == 0.1]
    for T in (8, 24):
        x = runs[runs["T"] == T]["sink_1_pct"]
        assert by_T.loc[T, ["sink_1_pct_mean", "sink_1_pct_min", "sink_1_pct_max"]].tolist() == pytest.approx(
            [x.mean(), x.min(), x.max()]
        )
    assert ctx.by_eps(8)["eps"].tolist() == [0.1, 0.3] and "Sink_1" in ctx.text()
    back = load_sink_context(ctx.to_csv(tmp_path / "c.csv"))
    pd.testing.assert_frame_equal(back.by_T(0.3), ctx.by_T(0.3), check_dtype=False, atol=1e-4)
    assert back.source == "read from c.csv"


def test_bad_inputs(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"outside \[2, 128\]"):
        sink_vs_context(tiny_llama, Ts=(16, 256), texts=WORDS)
    with pytest.raises(ValueError, match=r"eps must lie in \(0, 1\)"):
        sink_vs_context(tiny_llama, Ts=(16,), eps_grid=(0.3, 1.0), texts=WORDS)
    with pytest.raises(FileNotFoundError, match="scripts/sink_context.py"):
        load_sink_context(tmp_path / "none.csv")
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="lacks the columns"):
        load_sink_context(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="no runs at eps = 0.55"):
        load_sink_context("smollm2-135m").by_T(0.55)


def test_committed_smollm2_run():
    """analysis/data/sink_context/smollm2-135m.csv: T from 16 to the context (8192), three probe seeds, the eps grid."""
    ctx = committed_sink_context("smollm2-135m")
    assert ctx.Ts[0] == 16 and ctx.Ts[-1] == 8192 and ctx.seeds == [0, 1, 2]
    assert set(ctx.runs.path) == {"fused"} and ctx.runs.eps.nunique() == 9
    assert (ctx.runs.groupby(["T", "seed"]).size() == 9).all()
    assert committed_sink_context("no-such-model") is None


def test_a_model_without_a_tokenizer_reads_its_task():
    """A reference model without a tokenizer: its natural text is held-out task sequences (model_probe_sets)."""
    from analysis import load_model
    from analysis.model.probes import model_probe_sets

    model = load_model("synthetic-softmax", device="cpu")
    ctx = sink_vs_context(model, Ts=(16,), n=2, seeds=(0,), eps_grid=(0.3,))
    tokens = model_probe_sets(model, n=2, T=16, seed=0)["natural"].tokens
    a = sink_metric(model, tokens, k_max=16, path="eager").alpha
    assert ctx.runs.sink_1_pct.iloc[0] == pytest.approx(float((a[..., 0] > 0.3).float().mean() * 100), abs=1e-4)
    with pytest.raises(ValueError, match="has none: leave texts out"):
        sink_vs_context(model, Ts=(16,), texts=WORDS)
