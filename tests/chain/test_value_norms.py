"""Value norms: streamed statistics equal the cache; values planted by construction; the real model; bad input."""

import json

import numpy as np
import pytest
import torch

from analysis import ModelContractError, probe_sets, sink_metric
from analysis.chain.values import correlation, value_norms
from tests.planted import SINK_LAYERS, planted, planted_model, planted_nospike, planted_tokens  # noqa: F401
from tests.conftest import cpu_cache

NON_SINK_LAYERS = (0, 3)


@pytest.fixture(scope="module")
def tokens():
    return planted_tokens(n=10, T=24, seed=2)


def test_streamed_statistics_equal_the_cache(planted, tokens):
    vn = value_norms(planted, tokens, batch_size=3)
    _, cache = cpu_cache(planted, tokens)
    for l in range(4):
        v = cache[f"blocks.{l}.attn.hook_v"]  # (N, T, 2, 16)
        A = cache[f"blocks.{l}.attn.hook_pattern"]  # (N, 4, T, T)
        norms = v.norm(dim=-1)  # (N, T, 2)
        assert torch.allclose(vn.v1_norm[l], norms[:, 0].mean(0), rtol=1e-5)
        assert torch.allclose(vn.vj_norm[l], norms[:, 1:].mean((0, 1)), rtol=1e-5)
        assert torch.allclose(vn.v_norm_by_pos[l], norms.mean(0).T, rtol=1e-5)
        per_q = norms.repeat_interleave(2, dim=2).permute(0, 2, 1)  # (N, 4, T)
        share = (A[..., 0] * per_q[..., :1]) / (A * per_q[:, :, None, :]).sum(-1)  # (N, 4, T)
        assert torch.allclose(vn.first_value_share[l], share[..., 1:].mean((0, 2)), atol=1e-5)
        for h in range(2):
            u1 = torch.nn.functional.normalize(v[:, 0, h], dim=-1)
            uj = torch.nn.functional.normalize(v[:, 1:, h].reshape(-1, 16), dim=-1)
            off = lambda u: (u @ u.T)[~torch.eye(len(u), dtype=torch.bool)].mean()  # noqa: E731
            assert vn.v1_cos_pair[l, h] == pytest.approx(float(off(u1)), abs=1e-5)
            assert vn.vj_cos_pair[l, h] == pytest.approx(float(off(uj)), abs=1e-5)
    assert torch.allclose(vn.alpha_1, sink_metric(planted, tokens, k_max=1).per_head_alpha[..., 0], atol=1e-5)
    assert torch.allclose(vn.ratio, vn.v1_norm / vn.vj_norm)


def test_value_known_by_construction(tokens):
    """Layer 1, KV head 0: W_V = 0 and b_V = b with |b| = 3, so every value is b: |v_1| = |v_j| = 3."""
    model = planted_model(spike=True)
    v_proj = model.original_model.model.layers[1].self_attn.v_proj
    with torch.no_grad():
        v_proj.weight[:16] = 0.0
        v_proj.bias[:16] = 0.0
        v_proj.bias[0], v_proj.bias[1] = 3.0 * 0.6, 3.0 * 0.8
    vn = value_norms(model, tokens)
    assert vn.v1_norm[1, 0] == pytest.approx(3.0, rel=1e-6)
    assert vn.vj_norm[1, 0] == pytest.approx(3.0, rel=1e-6)
    assert torch.allclose(vn.v_norm_by_pos[1, 0], torch.full((24,), 3.0))
    assert vn.v1_cos_pair[1, 0] == pytest.approx(1.0) and vn.vj_cos_pair[1, 0] == pytest.approx(1.0)  # one vector
    # The head still sinks (the keys are untouched) and now draws all of its value mass from the first token
    # in proportion to alpha: A_t1 |b| / sum_j A_tj |b| = A_t1.
    assert vn.first_value_share[1, :2].min() > 0.95


def test_planted_sink_has_a_tiny_first_value(planted, tokens):
    vn = value_norms(planted, tokens)
    t = vn.table()
    sink, plain = t[t.layer.isin(SINK_LAYERS)], t[t.layer.isin(NON_SINK_LAYERS)]
    # W_V ignores the spike dims and the spike dominates the first token's normalised residual.
    assert (sink.ratio < 0.01).all()
    assert plain.ratio.between(0.8, 1.25).all()
    assert (sink.alpha_1_mean > 0.95).all() and (plain.alpha_1_mean < 0.3).all()
    c = vn.correlation()
    assert c["n"] == 8 and c["pearson_r"] < -0.9 and c["spearman_rho"] < -0.6  # ranks within each group are noise
    s = vn.summary()
    assert s["n_sink_kv_heads"] == 4 and s["median_ratio_sink"] < 0.01 < 0.8 < s["median_ratio_other"]
    json.dumps(vn.to_dict(), allow_nan=False)


def test_no_spike_model_runs_and_first_values_are_ordinary(planted_nospike, tokens):
    vn = value_norms(planted_nospike, tokens)
    assert vn.ratio.min() > 0.7 and vn.ratio.max() < 1.4
    assert vn.summary()["n_sink_kv_heads"] == 0 and vn.summary()["median_ratio_sink"] is None
    json.dumps(vn.to_dict(), allow_nan=False)


def test_alpha_from_a_sink_result_and_group_reduction(planted, tokens):
    res = sink_metric(planted, tokens, kind="natural")
    vn = value_norms(planted, tokens, sink=res, layers=[1, 3], reduce="max")
    assert vn.layers == [1, 3] and vn.v1_norm.shape == (2, 2)
    assert torch.allclose(vn.alpha_1, res.per_head_alpha[[1, 3], :, 0])
    assert "sink_metric" in vn.alpha_source and "natural" in vn.alpha_source
    t = vn.table()
    assert "alpha_1_max" in t.columns
    assert np.allclose(t.alpha_1_max, vn.alpha_1.reshape(2, 2, 2).max(-1).values.flatten())
    assert np.allclose(vn.table("mean").alpha_1_mean, vn.alpha_1.reshape(2, 2, 2).mean(-1).flatten())


def test_correlation_edge_cases():
    c = correlation([1.0, 1.0, 1.0], [0.1, 0.2, 0.3])
    assert c["pearson_r"] is None and "constant" in c["note"]
    assert correlation([1.0, 2.0], [1.0, 2.0])["pearson_r"] is None
    c = correlation([1, 2, 3, 4, np.nan], [4, 3, 2, 1, 0])
    assert c["n"] == 4 and c["pearson_r"] == pytest.approx(-1.0) and c["spearman_rho"] == pytest.approx(-1.0)


def test_figures(planted, tokens):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis.figures.value_norms import plot_value_alpha, plot_value_norms, plot_value_profile

    vn = value_norms(planted, tokens)
    for fig in (
        plot_value_norms(vn),
        plot_value_alpha(vn),
        plot_value_alpha(vn, reduce="max"),
        plot_value_profile(vn, layers=[0, 1]),
    ):
        assert fig.axes
    with pytest.raises(ValueError, match="were not analysed"):
        plot_value_profile(vn, layers=[7])
    plt.close("all")


def test_bad_arguments(planted, tokens):
    with pytest.raises(ValueError, match=r"layers \[-1\] out of range: this model has layers 0..3"):
        value_norms(planted, tokens, layers=[-1])
    with pytest.raises(ValueError, match="reduce must be one of"):
        value_norms(planted, tokens, reduce="median")
    with pytest.raises(ValueError, match="must be at least 2"):
        value_norms(planted, tokens[:, :1])
    with pytest.raises(ValueError, match="must be a SinkResult"):
        value_norms(planted, tokens, sink={"alpha": 1})
    from analysis.sinks.metric import SinkResult

    with pytest.raises(ValueError, match="has 3 layers x 4 heads but the model has 4 x 4"):
        value_norms(planted, tokens, sink=SinkResult(torch.rand(2, 3, 4, 1), eps=0.3, T=24))


def test_model_without_hooks():
    with pytest.raises(ModelContractError, match="hook"):
        value_norms(torch.nn.Linear(3, 3), torch.zeros(2, 4, dtype=torch.long))


def test_real_model_small_first_values_in_sink_heads(smollm2):
    tokens = probe_sets(smollm2.tokenizer, n=8, T=64, seed=4, kinds=("natural",))["natural"].tokens
    vn = value_norms(smollm2, tokens)
    s = vn.summary()
    assert s["n_sink_kv_heads"] > 30 and s["n_other_kv_heads"] > 3
    assert s["median_ratio_sink"] < 0.4 < 0.7 < s["median_ratio_other"]
    c = vn.correlation()
    assert c["n"] == 90 and c["pearson_r"] < -0.5 and c["spearman_rho"] < -0.5
    # The small first value is also nearly the same for every input: a constant, not noise.
    assert s["mean_v1_cos_pair_sink"] > s["mean_vj_cos_pair_sink"] + 0.2
    json.dumps(vn.to_dict(), allow_nan=False)


@pytest.mark.parametrize("norm, pos, kv", [("LN", "none", None), ("RMS", "rotary", 2)])
def test_reference_models_with_layernorm_or_without_gqa(norm, pos, kv, device):
    from analysis.train import ModelConfig, SinkLM

    torch.manual_seed(0)
    cfg = ModelConfig(
        d_vocab=65,
        n_ctx=32,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_key_value_heads=kv,
        normalization_type=norm,
        positional_embedding_type=pos,
    )
    model = SinkLM(cfg).eval().to(device)
    tokens = torch.randint(0, 65, (5, 12), generator=torch.Generator().manual_seed(0))
    vn = value_norms(model, tokens)
    _, cache = cpu_cache(model, tokens)
    for l in range(2):
        norms = cache[f"blocks.{l}.attn.hook_v"].norm(dim=-1)
        assert torch.allclose(vn.v1_norm[l], norms[:, 0].mean(0), rtol=1e-5)
        assert torch.allclose(vn.vj_norm[l], norms[:, 1:].mean((0, 1)), rtol=1e-5)
    assert vn.v1_norm.shape == (2, kv or 4) and vn.alpha_1.shape == (2, 4)
