"""QK angles: streamed statistics equal the ones computed from the full cache; the real model's sink."""

import torch
import pytest

from analysis import probe_sets, sink_metric
from analysis.chain.qk import qk_angles
from tests.conftest import cpu_cache


def test_qk_angles_match_the_cache(tiny_llama):
    tokens = torch.randint(3, 96, (3, 10), generator=torch.Generator().manual_seed(0))
    ang = qk_angles(tiny_llama, tokens, batch_size=2)
    _, cache = cpu_cache(tiny_llama, tokens)
    for l in range(2):
        q = cache[f"blocks.{l}.attn.hook_rot_q"]
        k = cache[f"blocks.{l}.attn.hook_rot_k"].repeat_interleave(2, dim=2)
        for h in range(4):
            first = [torch.cosine_similarity(q[b, t, h], k[b, 0, h], dim=0) for b in range(3) for t in range(1, 10)]
            other = [
                torch.cosine_similarity(q[b, t, h], k[b, j, h], dim=0)
                for b in range(3)
                for t in range(10)
                for j in range(1, t + 1)
            ]
            assert ang.cos_first[l, h] == pytest.approx(float(torch.stack(first).mean()), abs=1e-5)
            assert ang.cos_other[l, h] == pytest.approx(float(torch.stack(other).mean()), abs=1e-5)
            assert ang.k_first_norm[l, h] == pytest.approx(float(k[:, 0, h].norm(dim=-1).mean()), rel=1e-5)
    assert torch.allclose(ang.hist_first.sum(-1), torch.ones(2, 4))


def test_layers_out_of_range(tiny_llama):
    with pytest.raises(ValueError, match=r"layers \[5\] out of range: this model has layers 0..1"):
        qk_angles(tiny_llama, torch.zeros(1, 4, dtype=torch.long) + 3, layers=[5])


def test_real_model_first_key_is_closer_in_angle_in_sink_heads(smollm2):
    tokens = probe_sets(smollm2.tokenizer, n=6, T=64, kinds=("natural",))["natural"].tokens
    ang = qk_angles(smollm2, tokens)
    sink = sink_metric(smollm2, tokens).head_sink_share(1)
    gap = ang.cos_first - ang.cos_other
    sinky, plain = sink >= 50, sink == 0
    assert sinky.any() and plain.any()
    # In heads that sink, queries point at k_1 much more than at other keys; in heads that don't, barely.
    assert gap[sinky].mean() > 0.3
    assert gap[sinky].mean() > gap[plain].mean() + 0.2
    # The angle, not the norm: the first key is not longer than the others in sink heads.
    assert (ang.k_first_norm[sinky] < ang.k_other_norm[sinky]).float().mean() > 0.8


def test_models_without_rotary_read_the_unrotated_hooks(device):
    """Reference models list hook_rot_q/k even with NoPE (they never fire there): use hook_q/hook_k."""
    from analysis.chain.qk import qk_hook_names
    from analysis.train import ModelConfig, SinkLM

    torch.manual_seed(0)
    model = (
        SinkLM(
            ModelConfig(
                d_vocab=32,
                n_ctx=16,
                d_model=32,
                n_layers=1,
                n_heads=2,
                n_key_value_heads=2,
                d_head=16,
                d_mlp=64,
                positional_embedding_type="none",
            )
        )
        .eval()
        .to(device)
    )
    assert qk_hook_names(model, 0) == ("blocks.0.attn.hook_q", "blocks.0.attn.hook_k")
    ang = qk_angles(model, torch.randint(0, 32, (2, 12)))
    assert torch.isfinite(ang.cos_first).all() and torch.isfinite(ang.k_other_norm).all()
