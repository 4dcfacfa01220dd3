"""The sink metric: hand-computed cases, a naive full-attention reference, closed forms, the real model."""

import math

import pytest
import torch

from analysis import probe_sets, sink_metric
from analysis.sinks.metric import SinkResult, alpha_from_pattern, sink_table
from tests.conftest import cpu_cache


def test_alpha_by_hand():
    # One head, T = 3. Rows are queries, columns keys (causal).
    A = torch.tensor([[1.0, 0.0, 0.0], [0.6, 0.4, 0.0], [0.5, 0.2, 0.3]])
    alpha = alpha_from_pattern(A, k_max=3)
    # alpha_1 = (1 + .6 + .5) / 3; alpha_2 = (.4 + .2) / 2; alpha_3 = .3 / 1
    assert torch.allclose(alpha, torch.tensor([2.1 / 3, 0.3, 0.3]))


def test_alpha_ignores_entries_above_the_diagonal():
    A = torch.tensor([[0.5, 0.5], [0.5, 0.5]])  # a non-causal map: query 1 "sees" key 2
    assert torch.allclose(alpha_from_pattern(A, k_max=2), torch.tensor([0.5, 0.5]))


def test_sink_rate_is_strict_and_per_sample():
    # 2 samples, 1 layer, 2 heads, K = 1: alphas 0.3 (not > 0.3), 0.31, 0.9, 0.1
    alpha = torch.tensor([[[[0.3], [0.31]]], [[[0.9], [0.1]]]])
    res = SinkResult(alpha, eps=0.3, T=4)
    assert res.sink_rate(1) == pytest.approx(50.0)
    assert res.sink_rate(1, eps=0.05) == pytest.approx(100.0)
    # Per sample, not on the mean: head 1 has mean alpha .205 but one sample above eps.
    assert res.head_sink_share(1).tolist() == [[50.0, 50.0]]
    assert res.per_layer(1)["sink_1_pct"].tolist() == [50.0]


def test_true_layer_indices_of_a_hybrid():
    """A result over attention layers [1, 3] (a hybrid's): tables, sink heads and extreme layers give the true
    indices, ``pos`` maps them to the layer axis, the text names the skipped layers."""
    alpha = torch.tensor([[[[0.1], [0.2]], [[0.9], [0.8]]]]).expand(2, 2, 2, 1)  # layer 3 sinks in both heads
    res = SinkResult(alpha, eps=0.3, T=4, layers=[1, 3], skipped="Layers [0, 2] skipped (Mamba).")
    assert res.per_layer(1).layer.tolist() == [1, 3] and res.per_head(1).layer.tolist() == [1, 1, 3, 3]
    assert res.sink_heads(1) == [(3, 0), (3, 1)] and res.extreme_layers(1) == (3, 1)
    assert res.pos(3) == 1 and res.to_dict()["layers"] == [1, 3]
    assert res.text().endswith("Layers [0, 2] skipped (Mamba).")
    with pytest.raises(ValueError, match=r"layer 2 was not measured; this result holds layers \[1, 3\]"):
        res.pos(2)
    with pytest.raises(ValueError, match="layers names 3 layers but alpha has 2"):
        SinkResult(alpha, eps=0.3, T=4, layers=[0, 1, 3])


@pytest.mark.parametrize("k", [0, 5, -1])
def test_k_outside_range(k):
    res = SinkResult(torch.rand(2, 1, 2, 4), eps=0.3, T=4)
    with pytest.raises(ValueError, match=r"k must lie in \[1, T=4\]"):
        res.sink_rate(k)


def test_k_beyond_kept_keys_says_how_to_fix():
    res = SinkResult(torch.rand(2, 1, 2, 2), eps=0.3, T=8)
    with pytest.raises(ValueError, match="k_max >= 5"):
        res.sink_rate(5)


@pytest.mark.parametrize("eps", [0.0, 1.0, -0.2, 3])
def test_eps_outside_unit_interval(tiny_llama, eps):
    with pytest.raises(ValueError, match=r"eps must lie in \(0, 1\)"):
        sink_metric(tiny_llama, torch.zeros(1, 4, dtype=torch.long) + 5, eps=eps)


def test_streaming_matches_naive_full_attention(tiny_llama):
    """Against the full attention maps of every layer from run_with_cache, looped by hand."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 96, (5, 12), generator=g)
    res = sink_metric(tiny_llama, tokens, k_max=12, batch_size=2)
    _, cache = cpu_cache(tiny_llama, tokens)
    L, H, T = tiny_llama.cfg.n_layers, tiny_llama.cfg.n_heads, 12
    naive = torch.zeros(5, L, H, T)
    for l in range(L):
        A = cache[f"blocks.{l}.attn.hook_pattern"]
        for s in range(5):
            for h in range(H):
                for k in range(T):
                    naive[s, l, h, k] = sum(A[s, h, i, k] for i in range(k, T)) / (T - k)
    assert torch.allclose(res.alpha, naive, atol=1e-5)
    for k in (1, 3):
        assert res.sink_rate(k) == pytest.approx(float((naive[..., k - 1] > 0.3).float().mean() * 100))


def test_repeated_token_on_rope_gives_near_uniform_attention_and_no_sink(tiny_llama_dir, device):
    """With one token repeated, every position carries the same residual; with RoPE the scores differ only
    by rotation, so each weight lies within the closed-form bounds e^{+-2 xi} / (e^{+-2 xi} + t - 1) with
    xi = |q||k| / sqrt(d_head), and the sink metric finds no sink."""
    from analysis import load_model

    model = load_model(str(tiny_llama_dir), device=device)
    T = 48
    tokens = torch.full((2, T), 7)
    res = sink_metric(model, tokens, k_max=1)
    assert res.sink_rate(1) == 0.0
    _, cache = cpu_cache(model, tokens)
    d = model.cfg.d_head
    t = torch.arange(1, T + 1, dtype=torch.float32)[:, None]
    for l in range(model.cfg.n_layers):
        q = cache[f"blocks.{l}.attn.hook_rot_q"][0]  # (T, H, d)
        k = cache[f"blocks.{l}.attn.hook_rot_k"][0]  # (T, Hkv, d)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        xi = q.norm(dim=-1).max(0).values * k.norm(dim=-1).max(0).values / math.sqrt(d)  # (H,)
        A = cache[f"blocks.{l}.attn.hook_pattern"][0]  # (H, T, T)
        upper = torch.exp(2 * xi)[:, None, None] / (torch.exp(2 * xi)[:, None, None] + t - 1)
        lower = torch.exp(-2 * xi)[:, None, None] / (torch.exp(-2 * xi)[:, None, None] + t - 1)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
        assert (A <= upper + 1e-6)[:, causal].all()
        assert (A >= lower - 1e-6)[:, causal].all()
    # Near-uniform: alpha_1 is close to the NoPE closed form H_T / T.
    harmonic = sum(1 / i for i in range(1, T + 1)) / T
    assert res.alpha[..., 0].sub(harmonic).abs().max() < 0.02


def test_real_model_sinks_on_natural_not_on_repeated(smollm2):
    probes = probe_sets(smollm2.tokenizer, n=12, T=64, seed=3)
    results = {k: sink_metric(smollm2, p.tokens, kind=k) for k, p in probes.items()}
    table = sink_table(results)
    assert table.loc["natural", "Sink_1 (%)"] > 50
    assert table.loc["random", "Sink_1 (%)"] > 50
    assert table.loc["repeated", "Sink_1 (%)"] < 5
    # The sink is on the first token, not on later ones.
    nat = results["natural"]
    assert nat.sink_rate(1) > 5 * max(nat.sink_rates()[1:].max().item(), 1.0)
    heads = nat.sink_heads(1)
    assert len(heads) > 0 and all(0 <= l < 30 and 0 <= h < 9 for l, h in heads)
    per_head = nat.per_head(1)
    assert len(per_head) == 30 * 9 and per_head["alpha_1"].between(0, 1).all()


def test_model_without_attention_hooks():
    from analysis import ModelContractError

    with pytest.raises(ModelContractError, match="hook"):
        sink_metric(torch.nn.Linear(3, 3), torch.zeros(1, 4, dtype=torch.long))


def test_sequence_longer_than_context(tiny_llama):
    with pytest.raises(ValueError, match="exceeds the model's context of 128"):
        sink_metric(tiny_llama, torch.zeros(1, 200, dtype=torch.long) + 4)


def test_empty_and_malformed_tokens(tiny_llama):
    with pytest.raises(ValueError, match="empty"):
        sink_metric(tiny_llama, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        sink_metric(tiny_llama, torch.rand(1, 4))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 96\)"):
        sink_metric(tiny_llama, torch.tensor([[1, 2, 500]]))
