"""Massive activations: exact answers on the planted-spike model, the known spike on SmolLM2, bad input."""

import json

import pytest
import torch

from tests.planted import SPIKE_DIMS, SPIKE_VALUES, planted, planted_ln_model, planted_nospike, planted_tokens  # noqa: F401

from analysis.chain.activation_map import activation_map
from analysis.chain.massive import massive_activations, massive_by_kind, spike_table


@pytest.fixture(scope="module")
def ma(planted):
    return massive_activations(planted, planted_tokens(8, 24))


def test_planted_spike_dims_layers_and_position(ma, planted):
    p = planted.planted
    assert ma.spike_dims == {0: SPIKE_DIMS, 1: SPIKE_DIMS}
    assert ma.first_token_dims == ma.spike_dims
    assert (ma.first_layer, ma.last_layer) == (p.first_layer, p.last_layer)
    assert ma.has_spike
    # Every flagged activation is on the first token, in the planted dims and layers.
    f = ma.flagged
    assert len(f) == 8 * len(SPIKE_DIMS)
    assert set(f["position"]) == {0} and set(f["dim"]) == set(SPIKE_DIMS)
    assert set(f["first_layer"]) == {0} and set(f["last_layer"]) == {1}
    assert ma.first_token_share == 1.0
    pl = ma.per_layer.set_index("layer")
    for layer in (0, 1):
        assert pl.loc[layer, "top1_pos"] == 0 and pl.loc[layer, "top1_dim"] == 7 and pl.loc[layer, "top2_dim"] == 21
        assert abs(pl.loc[layer, "top1"] - abs(SPIKE_VALUES[7])) < 2
        assert abs(pl.loc[layer, "top2"] - abs(SPIKE_VALUES[21])) < 2
        assert pl.loc[layer, "median"] < 1
    assert pl.loc[2, "top1"] < 5 and pl.loc[3, "top1"] < 5  # faded
    d = ma.dims.set_index("dim")
    assert d.loc[7, "layers"] == "0-1" and abs(d.loc[21, "first_token_mean"] - SPIKE_VALUES[21]) < 2
    assert list(ma.carriers["carrier"].unique()) == ["<first token>"]


def test_planted_to_dict_is_json(ma):
    d = json.loads(json.dumps(ma.to_dict()))
    assert d["spike_dims"] == {"0": SPIKE_DIMS, "1": SPIKE_DIMS}
    assert d["first_layer"] == 0 and d["last_layer"] == 1 and d["has_spike"] is True
    assert len(d["per_layer"]) == 4 and "top1" in d["per_layer"][0]


def test_resid_pre_and_input_dims(planted, ma):
    pre = massive_activations(planted, planted_tokens(4, 16), hook="resid_pre")
    assert pre.spike_dims == {1: SPIKE_DIMS, 2: SPIKE_DIMS}
    assert ma.input_dims(n_layers=4) == {1: SPIKE_DIMS, 2: SPIKE_DIMS}
    assert pre.input_dims() == pre.first_token_dims


def test_layer_subset_stops_early(planted):
    r = massive_activations(planted, planted_tokens(4, 16), layers=[1])
    assert r.layers == [1] and r.spike_dims == {1: SPIKE_DIMS}


def test_thresholds_are_parameters(planted):
    toks = planted_tokens(4, 16)
    assert not massive_activations(planted, toks, abs_threshold=500).has_spike  # 400 and 250 < 500
    r = massive_activations(planted, toks, abs_threshold=300)
    assert r.spike_dims == {0: [7], 1: [7]}
    assert not massive_activations(planted, toks, ratio_threshold=1e7).has_spike


def test_no_spike_is_said_plainly(planted_nospike):
    r = massive_activations(planted_nospike, planted_tokens(4, 16))
    assert not r.has_spike and r.first_layer is None and r.last_layer is None
    assert r.spike_dims == {} and len(r.flagged) == 0 and r.dims.empty
    assert "No massive activations" in r.text()
    d = json.loads(json.dumps(r.to_dict()))
    assert d["has_spike"] is False and d["spike_dims"] == {}


def test_layernorm_model_finds_planted_spike(device):
    m = planted_ln_model("gpt2", device=device)
    r = massive_activations(m, planted_tokens(4, 16))
    assert r.spike_dims == {0: SPIKE_DIMS, 1: SPIKE_DIMS}


def test_activation_map(planted):
    am = activation_map(planted, planted_tokens(2, 12), layer=0, sample=1)
    assert am.values.shape == (12, 64)
    top = am.top(2)
    assert list(top["position"]) == [0, 0] and list(top["dim"]) == [7, 21]
    json.dumps(am.to_dict())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"layers": [4]}, "out of range"),
        ({"layers": [-1]}, "out of range"),
        ({"layers": []}, "empty"),
        ({"top_k": 0}, "top_k"),
        ({"hook": "resid_foo"}, "hook must be"),
        ({"min_share": 0}, "min_share"),
        ({"abs_threshold": -1}, ">= 0"),
        ({"median_over": "batch"}, "median_over"),
    ],
)
def test_bad_input(planted, kwargs, match):
    with pytest.raises(ValueError, match=match):
        massive_activations(planted, planted_tokens(2, 8), **kwargs)


def test_bad_tokens_and_sample(planted):
    with pytest.raises(ValueError, match="token ids"):
        massive_activations(planted, torch.full((2, 8), 500))
    with pytest.raises(ValueError, match="sample"):
        activation_map(planted, planted_tokens(2, 8), layer=0, sample=5)
    with pytest.raises(ValueError, match="out of range"):
        activation_map(planted, planted_tokens(2, 8), layer=9)


# ----- the embedded SmolLM2 -----


@pytest.fixture(scope="module")
def smol_kinds(smollm2):
    from analysis import probe_sets

    probes = probe_sets(smollm2.tokenizer, n=6, T=32, kinds=("natural", "repeated"))
    return massive_by_kind(smollm2, probes, ratio_threshold=100.0)


def test_smollm2_first_token_spike(smol_kinds, smollm2):
    nat = smol_kinds["natural"]
    assert nat.has_spike
    # The dimension with the largest first-token activation is a spike dim, flagged on the first token.
    peak = int(nat.first_abs.max(0).values.argmax())
    assert peak in nat.all_spike_dims
    layers = nat.spike_layers(peak)
    assert layers and nat.first_layer >= 1  # not in the embeddings' output layer 0
    pl = nat.per_layer.set_index("layer")
    assert (pl.loc[layers, "top1_dim"] == peak).mean() > 0.8
    assert (pl.loc[layers, "top1_pos"] == 0).mean() > 0.8
    assert nat.dims.set_index("dim").loc[peak, "first_token_share"] > 0.3
    # Sun et al.'s strict criterion still finds it (a subset of the lenient one).
    mid = layers[len(layers) // 2]
    strict = massive_activations(smollm2, smollm_tokens(smollm2), layers=[mid])
    assert strict.first_token_dims.get(mid, []) and set(strict.all_spike_dims) <= set(nat.spike_dims[mid])


def smollm_tokens(model):
    from analysis import natural_probe

    return natural_probe(model.tokenizer, n=6, T=32).tokens


def test_smollm2_repeated_tokens_all_carry_the_spike(smol_kinds):
    nat, rep = smol_kinds["natural"], smol_kinds["repeated"]
    peak = int(nat.first_abs.max(0).values.argmax())
    l = nat.spike_layers(peak)[-1]
    i = nat.layers.index(l)
    # With one token repeated, every position carries the spike: the first token holds a small share of flags.
    assert rep.other_abs_max[i, peak] > 0.5 * rep.first_abs[i, peak]
    assert rep.flagged[rep.flagged["dim"] == peak]["position"].gt(0).mean() > 0.8
    table = spike_table(smol_kinds)
    assert set(table["kind"]) == {"natural", "repeated"}
