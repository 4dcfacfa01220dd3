"""The propositions on t repeated tokens (Gu et al., appendix), measured by ``analysis.repeated_tokens``.

Each encoding gets a two-layer reference model built here with large random weights (so the logits are far from
uniform), and the closed forms are computed in the test, not by the module: NoPE 1/t, ALiBi the softmax of the
model's slopes times distance, relative PE the softmax of the learned bias by distance, rotary the bound
e^{2 xi} / (e^{2 xi} + t - 1) with xi read from the cached rotated queries and keys. SmolLM2 (rotary) runs once.
"""

from __future__ import annotations

import math

import pytest
import torch

from analysis import repeated_tokens, sink_metric
from analysis.core.defaults import REPEATED_TOL
from analysis.train import ModelConfig, SinkLM

T = 24


def _model(pe: str) -> SinkLM:
    torch.manual_seed(0)
    m = SinkLM(
        ModelConfig(d_vocab=32, n_ctx=32, d_model=32, n_layers=2, n_heads=4, positional_embedding_type=pe, init_std=0.3)
    ).eval()
    if pe == "relative":  # the learned bias starts at zero; give it a shape
        with torch.no_grad():
            for b in m.blocks:
                for p in b.attn.relative.parameters():
                    p.normal_(0, 2)
    return m


def _softmax_by_distance(bias: torch.Tensor, t: int) -> torch.Tensor:
    """(H, t): key j of the query at position t - 1 weighted e^{bias(t-1-j)} / sum, in float64."""
    b = bias[:, :t].double().flip(-1)
    return torch.softmax(b, dim=-1)


def _expected_rows(model, pe: str, t: int) -> torch.Tensor:
    """(L, H, t) the closed-form row of the query seeing t copies, computed here."""
    H, L = model.cfg.n_heads, model.cfg.n_layers
    d = torch.arange(T)
    if pe == "none":
        return torch.full((L, H, t), 1 / t, dtype=torch.float64)
    if pe == "alibi":
        return torch.stack([_softmax_by_distance(-b.attn.alibi_slopes[:, None] * d, t) for b in model.blocks])
    with torch.no_grad():
        return torch.stack([_softmax_by_distance(b.attn.relative(d), t) for b in model.blocks])


@pytest.mark.parametrize("pe", ["none", "alibi", "relative"])
def test_closed_forms_hold_to_1e6(pe):
    """Equal hidden states at every position, and the last row and the first token against t equal the closed form
    computed in the test to 1e-6; Sink_1 is the sink metric's."""
    model = _model(pe)
    tokens = torch.full((3, T), 5)
    res = repeated_tokens(model, tokens)
    assert res.encoding == pe
    assert float(res.relative_deviation().max()) < 1e-6
    assert torch.allclose(res.last.double(), _expected_rows(model, pe, T)[None].expand_as(res.last), atol=1e-6, rtol=0)
    for t in (1, 2, 7, T):
        expected = _expected_rows(model, pe, t)[..., 0]
        assert torch.allclose(res.first[..., t - 1].double(), expected[None].expand(3, -1, -1), atol=1e-6, rtol=0)
    assert float(res.gap("last").max()) < 1e-6 and float(res.gap("first").max()) < 1e-6
    if pe == "alibi":  # the slopes decay with distance: the first token gets the least
        assert (res.last[..., 0] < res.last[..., -1]).all()
    assert res.sink_rate() == pytest.approx(sink_metric(model, tokens, k_max=1).sink_rate(1))
    assert "so the proposition holds" in res.text()


def test_rotary_weights_stay_under_the_bound():
    """Rotary: every weight of every row is at most e^{2 xi} / (e^{2 xi} + t - 1), xi = |q||k| / sqrt(d) read from the
    cache here; the result's xi is the same, and the bound is tight enough to mean something at t = 1 (it is 1)."""
    model = _model("rotary")
    tokens = torch.full((2, T), 9)
    res = repeated_tokens(model, tokens)
    _, cache = model.run_with_cache(tokens)
    t = torch.arange(1, T + 1, dtype=torch.float64)[:, None]
    for l in range(model.cfg.n_layers):
        q, k = cache[f"blocks.{l}.attn.hook_rot_q"], cache[f"blocks.{l}.attn.hook_rot_k"]  # (B, T, H, d)
        xi = q.norm(dim=-1)[:, -1] * k.norm(dim=-1)[:, -1] / math.sqrt(model.cfg.d_head)  # (B, H)
        assert torch.allclose(res.xi[:, l], xi, atol=1e-6, rtol=1e-6)
        e = torch.exp(2 * xi.double())[:, :, None, None]
        A = cache[f"blocks.{l}.attn.hook_pattern"].double()  # (B, H, T, T)
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
        assert (A <= e / (e + t - 1) + 1e-6)[..., causal].all()
    assert float(res.gap("last").max()) <= 1e-6 and float(res.gap("first").max()) <= 1e-6
    assert float(res.relative_deviation().max()) < 1e-6
    assert "never exceeds it" in res.text()


@pytest.mark.parametrize("pe", ["learned", "sinusoidal"])
def test_absolute_encodings_break_the_premise(pe):
    """Absolute PE adds a different vector at each position: the hidden states differ, no closed form is claimed."""
    res = repeated_tokens(_model(pe), torch.full((2, T), 3))
    assert res.encoding == pe and not res.has_form
    assert float(res.relative_deviation().amax(0)[0]) > 0.1  # already at the first layer's input
    assert res.form_first.isnan().all() and res.gap("last").isnan().all()
    assert "premise fails" in res.text()
    d = res.to_dict()
    assert d["max_gap_last"] is None and d["per_layer"][0]["layer"] == 0


def test_rejects_rows_that_are_not_one_token():
    tokens = torch.full((2, T), 5)
    tokens[1, 3] = 6
    with pytest.raises(ValueError, match=r"one token repeated \(rows \[1\]"):
        repeated_tokens(_model("none"), tokens)


def test_smollm2_is_rotary_with_equal_states_and_no_sink(smollm2):
    """On SmolLM2 (rotary, 30 layers): the hidden states stay equal across positions, no weight exceeds the bound,
    and one repeated token gives (almost) no sink, as in the paper's Table 1."""
    res = repeated_tokens(smollm2, n=2, T=32)
    assert res.encoding == "rotary" and res.first.shape == (2, 30, 9, 32)
    assert float(res.relative_deviation().max()) < REPEATED_TOL
    assert float(res.gap("last").max()) <= REPEATED_TOL and float(res.gap("first").max()) <= REPEATED_TOL
    assert res.sink_rate() < 5
    assert len(res.tables["first_vs_t"]) == 30 * 9 * 32


def test_alibi_slope_scale_scales_every_head_and_rejects_zero():
    """``--alibi-slope-scale`` (the slope runs of data/positions/alibi_slopes): the model's slopes are Press et al.'s
    times the factor, and the repeated-token closed form follows them."""
    from analysis.model.reference.positions import alibi_slopes

    m = SinkLM(
        ModelConfig(
            d_vocab=32,
            n_ctx=32,
            d_model=32,
            n_layers=1,
            n_heads=4,
            positional_embedding_type="alibi",
            alibi_slope_scale=0.25,
            init_std=0.3,
        )
    ).eval()
    assert torch.allclose(m.blocks[0].attn.alibi_slopes, alibi_slopes(4) * 0.25)
    res = repeated_tokens(m, torch.full((1, T), 4))
    assert float(res.gap("last").max()) < 1e-6
    with pytest.raises(ValueError, match="alibi_slope_scale must be > 0"):
        ModelConfig(positional_embedding_type="alibi", alibi_slope_scale=0.0)
