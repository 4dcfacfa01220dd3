"""First-key manifold: the streamed statistics equal a naive scikit-learn computation on the cache; a first
key planted off the other keys' subspace is found there; the real model's sink heads; bad input."""

import json

import numpy as np
import pytest
import torch
from sklearn.decomposition import PCA

from analysis import ModelContractError, probe_sets
from analysis.chain.key_manifold import first_key_manifold
from tests.planted import SINK_LAYERS, SPIKE_DIMS, planted, planted_model, planted_nospike, planted_tokens  # noqa: F401
from tests.conftest import cpu_cache

NON_SINK_LAYERS = (0, 3)


def _zero_spike_dims_after_first(resid, hook):
    """Clear the spike dims at every position but the first: the other keys then have no component on the
    key dim the spike writes to, so k_1 lies off their subspace by construction."""
    out = resid.clone()
    out[:, 1:, SPIKE_DIMS] = 0.0
    return out


@pytest.fixture(scope="module")
def planted_off_subspace():
    model = planted_model(spike=True)
    for l in range(max(SINK_LAYERS)):  # the residual read by every sink layer
        model.add_perma_hook(f"blocks.{l}.hook_resid_post", _zero_spike_dims_after_first)
    return model


@pytest.fixture(scope="module")
def tokens():
    return planted_tokens(n=10, T=24, seed=1)


def test_streamed_statistics_equal_a_naive_computation_on_the_cache(planted, tokens):
    r = 4
    km = first_key_manifold(planted, tokens, n_components=r, batch_size=3, scatter_heads=None)
    _, cache = cpu_cache(planted, tokens)
    N, T = tokens.shape
    for l in range(planted.cfg.n_layers):
        k = cache[f"blocks.{l}.attn.hook_rot_k"].double()  # (N, T, 2, 16)
        q = cache[f"blocks.{l}.attn.hook_rot_q"].double()  # (N, T, 4, 16)
        for h in range(2):
            row = km.head(l, h)
            other = k[:, 1:, h].reshape(-1, 16).numpy()
            first = k[:, 0, h].numpy()
            pca = PCA(n_components=r, svd_solver="full").fit(other)
            c = first - pca.mean_
            perp = c - (c @ pca.components_.T) @ pca.components_
            rel = np.linalg.norm(perp, axis=1) / np.linalg.norm(c, axis=1)
            assert row.r == r
            assert row.resid_first == pytest.approx(rel.mean(), rel=1e-4, abs=1e-6)
            assert row.resid_other == pytest.approx(
                np.sqrt(1 - pca.explained_variance_ratio_.sum()), rel=1e-4, abs=1e-6
            )
            assert row.k1_norm == pytest.approx(np.linalg.norm(first, axis=1).mean(), rel=1e-5)
            u = first / np.linalg.norm(first, axis=1, keepdims=True)
            pairs = [u[a] @ u[b] for a in range(N) for b in range(N) if a != b]
            assert row.cos_first_pair == pytest.approx(np.mean(pairs), abs=1e-5)
            # cos(q_t, k_1) and cos(q_t, k_j), 1 < j <= t, over the query heads that read KV head h.
            cf, co = [], []
            for qh in (2 * h, 2 * h + 1):
                for b in range(N):
                    for t in range(1, T):
                        cf.append(torch.cosine_similarity(q[b, t, qh], k[b, 0, h], dim=0))
                        co += [torch.cosine_similarity(q[b, t, qh], k[b, j, h], dim=0) for j in range(1, t + 1)]
            assert row.cos_q_k1 == pytest.approx(float(torch.stack(cf).mean()), abs=1e-5)
            assert row.cos_q_kj == pytest.approx(float(torch.stack(co).mean()), abs=1e-5)


def test_batching_does_not_change_the_result(planted, tokens):
    a = first_key_manifold(planted, tokens, scatter_heads=None)
    b = first_key_manifold(planted, tokens, batch_size=3, scatter_heads=None)
    cols = ["resid_first", "resid_other", "cos_first_pair", "cos_q_k1", "cos_q_kj", "alpha_1_max", "first_n90", "r"]
    np.testing.assert_allclose(a.table[cols].to_numpy(float), b.table[cols].to_numpy(float), rtol=1e-4, atol=1e-5)


def test_planted_first_key_lies_off_the_other_keys_subspace(planted_off_subspace, tokens):
    km = first_key_manifold(planted_off_subspace, tokens)
    for l in SINK_LAYERS:
        for h in range(2):
            row = km.head(l, h)
            assert row.alpha_1_max > 0.95  # the planted sink
            assert row.resid_first > 0.99  # orthogonal to the others' principal subspace
            assert row.offsub_z > 10 * row.resid_other
            assert row.cos_first_pair > 0.9999 and row.first_var_rel < 1e-6 and row.first_n90 == 0  # one point
            assert row.cos_q_k1 > 0.9 and row.cos_q_kj < 0.5
    for l in NON_SINK_LAYERS:
        for h in range(2):
            row = km.head(l, h)
            assert row.alpha_1_max < 0.3
            assert row.resid_first < 0.8 and row.offsub_z < 3
            assert row.cos_first_pair < 0.5


def test_planted_spike_makes_identical_distant_first_keys(planted, tokens):
    """Without clearing the spike dims elsewhere the other keys also vary along the key dim, so k_1 lies on
    their principal axis, but far out on it and the same for every input."""
    km = first_key_manifold(planted, tokens)
    sink = km.table[km.table.layer.isin(SINK_LAYERS)]
    plain = km.table[km.table.layer.isin(NON_SINK_LAYERS)]
    assert (sink.cos_first_pair > 0.9999).all() and (sink.first_n90 == 0).all()
    assert (sink.centroid_z > 5).all() and (plain.centroid_z < 2).all()
    assert (sink.axis_z > 5).all()
    assert (sink.norm_ratio > 5).all()
    assert (sink.cos_q_k1 > sink.cos_q_kj + 0.5).all()
    assert set(km.sink_kv_heads()) == {(l, h) for l in SINK_LAYERS for h in range(2)}


def test_model_without_a_spike_runs_and_shows_no_special_first_key(planted_nospike, tokens):
    km = first_key_manifold(planted_nospike, tokens)
    assert km.sink_kv_heads() == []
    assert (km.table.cos_first_pair < 0.5).all()
    assert (km.table.alpha_1_max < 0.3).all()
    json.dumps(km.to_dict(), allow_nan=False)


def test_scatter_auto_picks_a_sink_and_a_non_sink_head(planted, tokens):
    km = first_key_manifold(planted, tokens, batch_size=4)  # the pick is made on the first batch
    (sink_head, sink), (plain_head, plain) = list(km.scatter.items())
    assert sink_head[0] in SINK_LAYERS and plain_head[0] in NON_SINK_LAYERS
    for s in (sink, plain):
        assert s["coords"].shape == (10, 24, 2) and s["axis_coords"].shape == (10, 24, 2)
        assert 0 < s["evr"][1] <= s["evr"][0] < 1
    assert sink["alpha_1_max"] > 0.95 and plain["alpha_1_max"] < 0.3
    assert sink["axis_z"] > 5
    # The axis view's x is the projection on the line to the first keys' mean: they sit apart.
    assert sink["axis_coords"][:, 0, 0].min() > sink["axis_coords"][:, 1:, 0].max()


def test_explicit_scatter_heads_outside_the_analysed_layers(planted, tokens):
    km = first_key_manifold(planted, tokens, layers=[1], heads=[1], scatter_heads=[(3, 0), (1, 1)])
    assert km.layers == [1] and km.kv_heads == [1] and len(km.table) == 1
    assert set(km.scatter) == {(3, 0), (1, 1)}
    assert km.scatter[(3, 0)]["alpha_1_max"] is None  # (3, 0) was kept for the figure only
    d = km.to_dict()
    assert {(s["layer"], s["kv_head"]) for s in d["scatter"]} == {(3, 0), (1, 1)}
    json.dumps(d, allow_nan=False)


def test_unrotated_keys_agree_at_the_first_position(planted, tokens):
    rot = first_key_manifold(planted, tokens, scatter_heads=None)
    raw = first_key_manifold(planted, tokens, rotated=False, scatter_heads=None)
    assert rot.rotated and not raw.rotated
    np.testing.assert_allclose(rot.table.k1_norm, raw.table.k1_norm, rtol=1e-5)  # no rotation at position 1
    np.testing.assert_allclose(rot.table.cos_first_pair, raw.table.cos_first_pair, atol=1e-5)


def test_figures(planted, tokens):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis.figures.key_manifold import plot_key_pca, plot_manifold_summary

    km = first_key_manifold(planted, tokens)
    fig = plot_key_pca(km)
    assert len(fig.axes) == 2 * 2 * 2  # 2 views x 2 heads, each with a colour bar
    fig2 = plot_manifold_summary(km)
    assert len(fig2.axes) == 4
    with pytest.raises(ValueError, match="no scatter coordinates"):
        plot_key_pca(km, heads=[(0, 1)] if (0, 1) not in km.scatter else [(2, 1)])
    with pytest.raises(ValueError, match="views must be among"):
        plot_key_pca(km, views=["tsne"])
    plt.close("all")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"layers": [4]}, r"layers \[4\] out of range: this model has layers 0..3"),
        ({"heads": [2]}, r"KV heads \[2\] out of range"),
        ({"n_components": 16}, r"n_components=16 must lie in \[1, d_head - 1 = 15\]"),
        ({"n_components": 1.5}, r"must lie in \(0, 1\)"),
        ({"n_components": 0}, r"n_components=0"),
        ({"scatter_heads": [(9, 0)]}, r"layers \[9\] out of range"),
        ({"scatter_heads": "some"}, "scatter_heads must be"),
    ],
)
def test_bad_arguments(planted, tokens, kwargs, match):
    with pytest.raises(ValueError, match=match):
        first_key_manifold(planted, tokens, **kwargs)


def test_too_few_samples(planted):
    with pytest.raises(ValueError, match="at least 2 sequences"):
        first_key_manifold(planted, planted_tokens(n=1, T=24))
    with pytest.raises(ValueError, match="T >= 3"):
        first_key_manifold(planted, planted_tokens(n=4, T=2))
    with pytest.raises(ValueError, match="too few samples for a PCA with 8 components: 6 other keys"):
        first_key_manifold(planted, planted_tokens(n=2, T=4), n_components=8)


def test_model_without_hooks():
    with pytest.raises(ModelContractError, match="hook"):
        first_key_manifold(torch.nn.Linear(3, 3), torch.zeros(2, 4, dtype=torch.long))


def test_real_model_first_keys_in_sink_heads(smollm2):
    tokens = probe_sets(smollm2.tokenizer, n=12, T=64, seed=2, kinds=("natural",))["natural"].tokens
    km = first_key_manifold(smollm2, tokens)
    s = km.summary()
    sink, other = s["sink"], s["non_sink"]
    assert s["n_sink_kv_heads"] > 30 and s["n_other_kv_heads"] > 3
    # Queries point at k_1, not at the other keys, in sink heads (the angle) ...
    assert sink["cos_q_k1"] > sink["cos_q_kj"] + 0.3
    assert sink["cos_q_k1"] > other["cos_q_k1"] + 0.2
    # ... though k_1 is shorter than the other keys there (not the norm).
    assert sink["norm_ratio"] < 0.6 < other["norm_ratio"]
    # First keys of different inputs nearly coincide, more than keys at a fixed later position do.
    assert sink["cos_first_pair"] > 0.98 and sink["cos_first_pair"] > sink["cos_mid_pair"] + 0.1
    assert sink["first_n90"] < sink["mid_n90"]
    # And they lie farther off the other keys' principal subspace than in non-sink heads.
    assert sink["offsub_z"] > other["offsub_z"]
    assert set(km.scatter) and list(km.scatter.values())[0]["alpha_1_max"] > 0.8
    json.dumps(km.to_dict(), allow_nan=False)


@pytest.mark.parametrize("norm, pos, kv", [("LN", "none", None), ("LN", "learned", 2), ("RMS", "rotary", 2)])
def test_reference_models_with_layernorm_without_rotary_or_gqa(norm, pos, kv, device):
    """The package's own models: LayerNorm or RMSNorm, NoPE / learned / rotary positions, with or without GQA.
    Without rotary they list hook_rot_k but never run it: the plain keys are read instead."""
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
    km = first_key_manifold(model, tokens, scatter_heads=[(1, 0)])
    assert km.rotated == (pos == "rotary")
    n_kv = kv or 4
    assert len(km.table) == 2 * n_kv and km.scatter[(1, 0)]["coords"].shape == (5, 12, 2)
    _, cache = cpu_cache(model, tokens)
    for l in range(2):
        k = cache[f"blocks.{l}.attn.{'hook_rot_k' if pos == 'rotary' else 'hook_k'}"]
        for h in range(n_kv):
            assert km.head(l, h).k1_norm == pytest.approx(float(k[:, 0, h].norm(dim=-1).mean()), rel=1e-5)
            assert km.head(l, h).kj_norm == pytest.approx(float(k[:, 1:, h].norm(dim=-1).mean()), rel=1e-5)
