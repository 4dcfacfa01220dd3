"""Causal tests: on the planted model the answers are known by construction; on SmolLM2 the contrasts
(zero vs mean, value removed vs set to its mean, first key without its spike part) are computed."""
import json

import pytest
import torch

from tests.planted import SPIKE_DIMS, SPIKE_VALUES, planted, planted_nospike, planted_tokens  # noqa: F401

from analysis.interventions import (
    first_key_ablation,
    run_condition,
    spike_ablation,
    value_ablation,
    where_shares,
)
from analysis.sink import sink_metric


@pytest.fixture(scope="module")
def toks():
    return planted_tokens(8, 24)


def test_run_condition_matches_sink_metric(planted, toks):
    r = run_condition(planted, toks)
    assert r.sink_rate(1) == pytest.approx(sink_metric(planted, toks).sink_rate(1))
    assert torch.allclose(r.where.sum(-1), torch.ones_like(r.where.sum(-1)), atol=1e-4)


def test_where_shares_categories():
    T = 6
    p = torch.zeros(1, 1, T, T)
    for t in range(T):
        p[0, 0, t, max(t - 1, 0)] = 1.0  # previous-token head
    w = where_shares(p)[0, 0] / (T - 2)
    assert w.tolist() == pytest.approx([0, 1, 0, 0])
    p = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    w = where_shares(p[None, None])[0, 0]
    assert float(w.sum()) == pytest.approx(T - 2)


def test_spike_ablation_planted(planted, toks):
    r = spike_ablation(planted, toks)
    assert r.has_spike and r.spike_dims == {0: SPIKE_DIMS, 1: SPIKE_DIMS}
    s = r.conditions.set_index("condition")
    assert s.loc["baseline", "sink_1_pct"] == pytest.approx(50.0)  # layers 1 and 2 of 4, all heads
    assert s.loc["zero", "sink_1_pct"] < 10
    assert s.loc["mean", "sink_1_pct"] == pytest.approx(s.loc["baseline", "sink_1_pct"])
    assert abs(s.loc["mean", "delta_loss"]) < 1e-3
    pl = r.per_layer.set_index("layer")
    assert pl.loc[1, "baseline"] == 100 and pl.loc[1, "zero"] == 0
    assert r.means["0:7"] == pytest.approx(SPIKE_VALUES[7], abs=0.5)
    assert r.means["1:21"] == pytest.approx(SPIKE_VALUES[21], abs=0.5)
    json.loads(json.dumps(r.to_dict()))
    assert "Sink_1" in r.text()


def test_spike_ablation_where_appear(planted, toks):
    r = spike_ablation(planted, toks, where="appear")
    assert r.spike_dims == {0: SPIKE_DIMS}
    assert r.conditions.set_index("condition").loc["zero", "sink_1_pct"] < 10


def test_spike_ablation_without_spike(planted_nospike, toks):
    r = spike_ablation(planted_nospike, toks)
    assert not r.has_spike and list(r.conditions["condition"]) == ["baseline"]
    assert "no spike" in r.text()
    json.dumps(r.to_dict())


def test_spike_ablation_bad_input(planted, toks):
    with pytest.raises(ValueError, match="dict"):
        spike_ablation(planted, toks, spike_dims=[7, 21])
    with pytest.raises(ValueError, match="out of range"):
        spike_ablation(planted, toks, spike_dims={9: [7]})
    with pytest.raises(ValueError, match="out of range"):
        spike_ablation(planted, toks, spike_dims={0: [640]})
    with pytest.raises(ValueError, match="where"):
        spike_ablation(planted, toks, where="somewhere")
    with pytest.raises(ValueError, match="at least 2"):
        spike_ablation(planted, toks[:1])


def test_value_ablation_planted(planted, toks):
    r = value_ablation(planted, toks)
    assert r.sink_heads == planted.planted.sink_heads
    s = r.conditions.set_index("condition")
    assert abs(s.loc["sink_heads", "delta_loss"]) < 1e-3  # W_V ignores the spike dims: v_1 ~ 0
    assert abs(s.loc["sink_heads_mean", "delta_loss"]) < 1e-3
    h = r.heads
    assert (h["v1_norm"] < 0.01 * h["v_other_norm"]).all() and (h["alpha_1"] > 0.99).all()
    json.loads(json.dumps(r.to_dict()))


def test_value_ablation_given_heads_and_bad_heads(planted, toks):
    r = value_ablation(planted, toks, sink_heads=[(1, 0), (2, 3)], all_heads=False)
    assert r.sink_heads == [(1, 0), (2, 3)] and list(r.heads["head"]) == [0, 3]
    assert "all_heads" not in set(r.conditions["condition"])
    with pytest.raises(ValueError, match="out of range"):
        value_ablation(planted, toks, sink_heads=[(1, 9)])
    with pytest.raises(ValueError, match="pairs"):
        value_ablation(planted, toks, sink_heads=[1])


def test_value_ablation_no_sink_heads(planted_nospike, toks):
    r = value_ablation(planted_nospike, toks)
    assert r.sink_heads == [] and "no sink heads" in r.text()
    json.dumps(r.to_dict())


def test_first_key_ablation_planted(planted, toks):
    r = first_key_ablation(planted, toks)
    assert r.layers == list(planted.planted.sink_layers) and r.spike_dims == {1: SPIKE_DIMS, 2: SPIKE_DIMS}
    s = r.conditions.set_index("condition")
    assert s.loc["baseline", "first"] > 0.99 and s.loc["ablated", "first"] < 0.2
    assert s.loc["baseline", "sink_1"] == 100 and s.loc["ablated", "sink_1"] < 20
    # The attention goes back to the ordinary keys, as in the layers without a sink (layer 0).
    pl = r.per_layer.set_index(["condition", "layer"])
    assert pl.loc[("ablated", 1), "other"] > 0.5
    json.loads(json.dumps(r.to_dict()))
    assert "first token" in r.text()


def test_first_key_ablation_without_spike(planted_nospike, toks):
    r = first_key_ablation(planted_nospike, toks)
    assert not r.has_spike and r.layers == [] and "no spike" in r.text()


def test_first_key_ablation_given_dims(planted, toks):
    r = first_key_ablation(planted, toks, layers=[1], spike_dims=SPIKE_DIMS)
    assert r.layers == [1]
    pl = r.per_layer.set_index(["condition", "layer"])
    assert pl.loc[("ablated", 1), "sink_1"] < 20 and pl.loc[("ablated", 2), "first"] > 0.9  # layer 2 untouched
    with pytest.raises(ValueError, match="out of range"):
        first_key_ablation(planted, toks, layers=[7], spike_dims=SPIKE_DIMS)


# ----- the embedded SmolLM2 -----

@pytest.fixture(scope="module")
def smol(smollm2):
    from analysis import natural_probe
    from analysis.massive import massive_activations

    toks = natural_probe(smollm2.tokenizer, n=8, T=32).tokens
    ma = massive_activations(smollm2, toks, ratio_threshold=100.0)
    return toks, ma


def test_smollm2_zero_vs_mean(smollm2, smol):
    toks, ma = smol
    r = spike_ablation(smollm2, toks, spike_dims=ma.first_token_dims)
    s = r.conditions.set_index("condition")
    d_zero = s.loc["zero", "sink_1_pct"] - s.loc["baseline", "sink_1_pct"]
    d_mean = s.loc["mean", "sink_1_pct"] - s.loc["baseline", "sink_1_pct"]
    assert d_zero < -20 and abs(d_zero) > 5 * abs(d_mean)
    assert s.loc["zero", "delta_loss"] > 0.5 and abs(s.loc["mean", "delta_loss"]) < 0.1 * s.loc["zero", "delta_loss"]


def test_smollm2_first_value_is_a_constant(smollm2, smol):
    toks, _ = smol
    r = value_ablation(smollm2, toks, all_heads=False)
    assert len(r.sink_heads) > 50
    s = r.conditions.set_index("condition")
    # Whatever zeroing v_1 does, setting it to its mean over the other inputs does far less.
    assert abs(s.loc["sink_heads_mean", "delta_loss"]) < 0.2 * abs(s.loc["sink_heads", "delta_loss"])
    assert (r.heads["v1_norm"] < r.heads["v_other_norm"]).mean() > 0.8


def test_smollm2_first_key_without_spike(smollm2, smol):
    toks, ma = smol
    r = first_key_ablation(smollm2, toks, spike_dims=ma.input_dims(smollm2.cfg.n_layers))
    s = r.conditions.set_index("condition")
    assert s.loc["ablated", "first"] < s.loc["baseline", "first"] - 0.1
    assert s.loc["ablated", "sink_1"] < s.loc["baseline", "sink_1"] - 20


def test_layernorm_and_reference_models_run():
    """LayerNorm (GPT-2: no rotary, no GQA, biases) and this package's own model: every intervention runs."""
    from analysis.train.config import ModelConfig
    from analysis.train.model import SinkLM
    from tests.planted import FADE_LAYER, FIRST_LAYER, _add_spike, planted_ln_model

    torch.manual_seed(0)
    ref = SinkLM(ModelConfig(d_vocab=100, n_ctx=64, d_model=64, n_layers=4, n_heads=4, n_key_value_heads=2,
                             normalization_type="LN")).eval()
    ref.add_perma_hook(f"blocks.{FIRST_LAYER}.hook_resid_post", _add_spike(+1.0))
    ref.add_perma_hook(f"blocks.{FADE_LAYER}.hook_resid_post", _add_spike(-1.0))
    toks = planted_tokens(4, 16)
    for m in (planted_ln_model("gpt2"), ref):
        s = spike_ablation(m, toks)
        assert s.spike_dims == {0: SPIKE_DIMS, 1: SPIKE_DIMS}
        assert abs(s.conditions.set_index("condition").loc["mean", "delta_loss"]) < 1e-2
        f = first_key_ablation(m, toks)
        assert f.layers == [1, 2] and f.has_spike
        v = value_ablation(m, toks, sink_heads=[(1, 0), (2, 1)], all_heads=False)
        assert len(v.conditions) == 4
