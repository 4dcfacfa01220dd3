"""Norm-gain tracing: exact answers on the planted model, the rebuilt key against the real model's hooks, bad input."""

import json
import math

import pytest
import torch

from tests.planted import KEY_DIM, SPIKE_DIMS, SPIKE_GAIN, planted, planted_ln_model, planted_nospike, planted_tokens  # noqa: F401

from analysis import ModelContractError
from analysis.chain.norm_gain import norm_gain_trace
from analysis.model.rotary import rotate


@pytest.fixture(scope="module")
def trace(planted):
    return norm_gain_trace(planted, planted_tokens(8, 24), layer=1)


def test_planted_spike_found_and_its_share(trace):
    assert trace.has_spike and trace.spike_dims == SPIKE_DIMS
    st = trace.stages.set_index("stage")
    assert st.loc["normalised", "first_share"] > 0.999  # the spike is the first token's whole normalised vector
    assert st.loc["normalised", "other_share"] < 0.2  # ordinary tokens: 2 of 64 dims, ~3%
    assert abs(st.loc["normalised", "first_norm"] - 8.0) < 1e-3  # RMSNorm output has norm sqrt(d_model)
    assert st.loc["gain", "first_share"] > 0.999 and st.loc["key", "first_share"] > 0.999


def test_planted_gain(trace):
    g = trace.gain.set_index("dim")
    for d in SPIKE_DIMS:
        assert g.loc[d, "gain"] == pytest.approx(SPIKE_GAIN)
        assert g.loc[d, "over_rest_median"] == pytest.approx(SPIKE_GAIN)
        assert g.loc[d, "percentile"] == 100.0
    s = trace.gain_summary()
    assert s["gain_at_spike"] == [SPIKE_GAIN, SPIKE_GAIN] and s["gain_rest_median_abs"] == 1.0


def test_planted_key_and_attention_come_from_the_spike(trace):
    h = trace.heads
    assert len(h) == 4 and list(h["kv_head"]) == [0, 0, 1, 1]  # GQA: 2 query heads per KV head
    assert (h["cos_k1_spike"] > 0.999).all() and (h["k1_share_spike"] > 0.999).all()
    assert (h["logit_share_spike"] > 0.99).all()
    assert (h["alpha_1"] > 0.99).all() and (h["alpha_1_spike_only"] > 0.99).all()
    assert (h["alpha_1_no_spike"] < 0.3).all()  # without the spike part the first key is ordinary
    assert (h["logit_first"] > h["logit_other"] + 5).all()


def test_planted_constancy(trace):
    c = trace.constancy
    assert c["cos_first_normalised"] > 0.999 and min(c["cos_first_key"]) > 0.999
    assert c["cos_other_normalised"] < 0.3


def test_rebuilt_key_equals_the_hooks(trace):
    r = trace.rebuild
    assert r["key_rel_err"] < 1e-5 and r["rotated_key_max_abs_err"] < 1e-4 and r["normalised_rel_err"] < 1e-5
    assert r["score_max_abs_err"] < 1e-4


def test_to_dict_json(trace):
    d = json.loads(json.dumps(trace.to_dict()))
    assert d["spike_dims"] == SPIKE_DIMS and d["layer"] == 1 and len(d["heads"]) == 4
    assert "text" in d and "spike dims" in d["text"]


def test_layer_without_spike_says_so(planted):
    with pytest.warns(UserWarning, match="no spike"):
        t = norm_gain_trace(planted, planted_tokens(4, 16), layer=3)
    assert not t.has_spike and t.spike_dims == [] and "no spike" in t.text()
    assert math.isnan(t.stages.set_index("stage").loc["normalised", "first_share"])
    assert t.rebuild["key_rel_err"] < 1e-5  # the rest of the trace still runs
    d = json.loads(json.dumps(t.to_dict()))
    assert d["has_spike"] is False and d["stages"][1]["first_share"] is None


def test_model_without_spike(planted_nospike):
    with pytest.warns(UserWarning, match="no spike"):
        t = norm_gain_trace(planted_nospike, planted_tokens(4, 16), layer=1)
    assert not t.has_spike and t.constancy["cos_first_normalised"] < 0.5


def test_given_spike_dims(planted):
    t = norm_gain_trace(planted, planted_tokens(4, 16), layer=1, spike_dims=[7])
    assert t.spike_dims == [7]
    assert 0.6 < t.stages.set_index("stage").loc["normalised", "first_share"] < 0.8  # 400^2 / (400^2 + 250^2)


@pytest.mark.parametrize("arch", ["gpt2", "neox"])
def test_layernorm_models(arch):
    m = planted_ln_model(arch)
    t = norm_gain_trace(m, planted_tokens(4, 16), layer=1)
    assert t.norm_kind == "LN" and t.spike_dims == SPIKE_DIMS
    assert t.rotary == (arch == "neox")
    assert t.rebuild["key_rel_err"] < 1e-5 and t.rebuild["score_max_abs_err"] < 1e-4  # centring, bias, partial rotary
    assert t.stages.set_index("stage").loc["normalised", "first_share"] > 0.99


def test_bad_input(planted):
    toks = planted_tokens(2, 8)
    with pytest.raises(ValueError, match="out of range"):
        norm_gain_trace(planted, toks, layer=4)
    with pytest.raises(ValueError, match="out of range"):
        norm_gain_trace(planted, toks, layer=1, spike_dims=[64])
    with pytest.raises(ValueError, match="must be at least 2"):
        norm_gain_trace(planted, toks[:, :1], layer=1)


def test_model_without_norm_gain(planted, monkeypatch):
    monkeypatch.setattr(planted.cfg, "normalization_type", None)
    with pytest.raises(ModelContractError, match="no pre-attention norm with a gain"):
        norm_gain_trace(planted, planted_tokens(2, 8), layer=1)
    monkeypatch.undo()
    monkeypatch.setattr(planted.blocks[1].ln1, "w", None, raising=False)
    monkeypatch.setattr("analysis.model.key_path.live_tensor", lambda *a, **k: None)  # nor through the wrapped module
    with pytest.raises(ModelContractError, match="raw weights"):
        norm_gain_trace(planted, planted_tokens(2, 8), layer=1)


def test_rotate_is_hf_rotate_half():
    x = torch.randn(5, 2, 8)
    pos = torch.arange(5)
    y = rotate(x, pos, 10000.0)
    assert torch.allclose(y[0], x[0])  # position 0: identity
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation
    # pair (i, i + d/2) rotates by pos * base^(-2i/d)
    ang = 3 * 10000.0 ** (-2 * 1 / 8)
    c, s = math.cos(ang), math.sin(ang)
    assert torch.allclose(y[3, :, 1], x[3, :, 1] * c - x[3, :, 5] * s, atol=1e-5)


# ----- the embedded SmolLM2 -----


@pytest.fixture(scope="module")
def smol_tokens(smollm2):
    from analysis import natural_probe

    return natural_probe(smollm2.tokenizer, n=6, T=32).tokens


def test_smollm2_rebuilt_key_matches_hook_rot_k(smollm2, smol_tokens):
    t = norm_gain_trace(smollm2, smol_tokens, layer=14)
    r = t.rebuild
    assert r["key_rel_err"] < 1e-5
    assert r["rotated_key_max_abs_err"] < 1e-3 and r["score_max_abs_err"] < 1e-3
    assert t.has_spike and t.spike_dims
    st = t.stages.set_index("stage")
    assert st.loc["normalised", "first_share"] > 0.5 > st.loc["normalised", "other_share"]
    assert t.constancy["cos_first_normalised"] > 0.99 > t.constancy["cos_other_normalised"]
    g = t.gain.set_index("dim")
    for d in t.spike_dims:
        assert g.loc[d, "gain"] == pytest.approx(float(smollm2.blocks[14].ln1.w[d].detach()))
    h = t.heads
    assert h["alpha_1_no_spike"].mean() < h["alpha_1"].mean()
    json.dumps(t.to_dict())


def test_smollm2_wrong_rotary_base_breaks_the_rebuild(smollm2, smol_tokens, monkeypatch):
    """A key path that misses the model's keys fails, saying so, rather than give the shares of another key."""
    from dataclasses import replace

    # 10000: what the bridge's cfg.rotary_base wrongly says (SmolLM2's theta is 1e5); the trace takes the base
    # from the family spec, so a spec with the wrong base must show in the rebuild
    spec = smollm2.family
    monkeypatch.setattr(
        smollm2, "family", replace(spec, rotary_base=10000.0, rotary_bases={l: 10000.0 for l in spec.rotary_bases})
    )
    with pytest.raises(
        ModelContractError,
        match=r"Key path of layer 2: .*theta 10000\); .*\(blocks.2.attn.hook_rot_k\) only to .* misses a step",
    ):
        norm_gain_trace(smollm2, smol_tokens[:2], layer=2, spike_dims=[])


@pytest.mark.parametrize("norm, pe", [("RMS", "rotary"), ("LN", "rotary"), ("LN", "none")])
def test_reference_models(norm, pe, device):
    """This package's own HookedRootModule models (analysis.train), with the same planted spike hooks."""
    from analysis.model.reference.config import ModelConfig
    from analysis.model.reference.sink_lm import SinkLM
    from tests.planted import FADE_LAYER, FIRST_LAYER, _add_spike

    torch.manual_seed(0)
    m = (
        SinkLM(
            ModelConfig(
                d_vocab=100,
                n_ctx=64,
                d_model=64,
                n_layers=4,
                n_heads=4,
                n_key_value_heads=2,
                normalization_type=norm,
                positional_embedding_type=pe,
                rotary_base=5000.0,
            )
        )
        .eval()
        .to(device)
    )
    m.add_perma_hook(f"blocks.{FIRST_LAYER}.hook_resid_post", _add_spike(+1.0))
    m.add_perma_hook(f"blocks.{FADE_LAYER}.hook_resid_post", _add_spike(-1.0))
    t = norm_gain_trace(m, planted_tokens(4, 16), layer=2)
    assert t.spike_dims == SPIKE_DIMS and t.norm_kind == norm and t.rotary == (pe == "rotary")
    assert t.rebuild["key_rel_err"] < 1e-5 and t.rebuild["score_max_abs_err"] < 1e-4
    if pe == "rotary":
        assert t.rebuild["rotated_key_max_abs_err"] < 1e-4


def test_post_norm_reference_model_traces_the_raw_residual_into_w_k(device):
    """A post-norm block (norm after attention, like OLMo-2) feeds attention the raw residual: the trace follows
    h -> W_K with no gain (norm kind 'none'), and its rebuilt keys equal the model's."""
    from analysis.model.reference.config import ModelConfig
    from analysis.model.reference.sink_lm import SinkLM
    from tests.planted import FADE_LAYER, FIRST_LAYER, _add_spike

    torch.manual_seed(0)
    m = (
        SinkLM(
            ModelConfig(
                d_vocab=100,
                n_ctx=64,
                d_model=64,
                n_layers=4,
                n_heads=4,
                n_key_value_heads=2,
                normalization_type="RMS",
                positional_embedding_type="rotary",
                norm_position="post",
            )
        )
        .eval()
        .to(device)
    )
    m.add_perma_hook(f"blocks.{FIRST_LAYER}.hook_resid_post", _add_spike(+1.0))
    m.add_perma_hook(f"blocks.{FADE_LAYER}.hook_resid_post", _add_spike(-1.0))
    t = norm_gain_trace(m, planted_tokens(4, 16), layer=1, spike_dims=SPIKE_DIMS)  # layer 1 reads the spike as added
    assert t.norm_kind == "none" and t.spike_dims == SPIKE_DIMS and "no norm before attention" in t.text()
    assert t.rebuild["key_rel_err"] < 1e-5 and t.rebuild["final_key_max_abs_err"] < 1e-3
    assert set(t.top_dims(2)) == set(SPIKE_DIMS)
