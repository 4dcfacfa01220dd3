"""The sink metric measures an extra slot directly: its share of each head's attention (1 - the row sum of
``hook_pattern`` over the input tokens), for a learnable sink token, K/KV biases and learned sink logits."""

import pytest
import torch

from analysis.sinks.metric import sink_metric
from analysis.train import ModelConfig, SinkLM


def slot_model(attention: str, device: str = "cpu") -> SinkLM:
    torch.manual_seed(0)
    model = (
        SinkLM(ModelConfig(d_vocab=32, n_ctx=16, d_model=32, n_heads=2, n_layers=2, attention=attention))
        .eval()
        .to(device)
    )
    if attention in ("kv-bias", "k-bias"):  # a large key bias: the slot takes a visible share of the attention
        for block in model.blocks:
            with torch.no_grad():
                block.attn.op.k_bias.mul_(300.0)
    return model


@pytest.mark.parametrize("attention", ["kv-bias", "k-bias", "sink-token"])
def test_slot_share_equals_the_models_own_slot_weights(attention, device):
    model = slot_model(attention, device)
    tokens = torch.randint(0, 32, (6, 16), generator=torch.Generator().manual_seed(1))
    res = sink_metric(model, tokens, k_max=2, path="eager")
    direct = []
    model.run_with_hooks(
        tokens.to(device),
        fwd_hooks=[
            (f"blocks.{l}.attn.hook_sink_pattern", lambda x, hook: direct.append(x.mean(-1).cpu())) for l in range(2)
        ],
    )
    expected = torch.stack(direct, dim=1)  # (N, L, H): mean over queries of the weight on the slot
    assert res.has_slot and torch.allclose(res.slot, expected, atol=1e-5)
    assert res.slot_sink_rate() == pytest.approx(100 * float((expected > 0.3).float().mean()))
    assert "sink_slot_pct" in res.to_dict() and "slot" in res.text()


def test_a_plain_softmax_model_has_no_slot(device):
    model = slot_model("softmax", device)
    res = sink_metric(model, torch.randint(0, 32, (4, 16)), path="eager")
    assert not res.has_slot and res.slot_sink_rate() == 0.0 and "sink_slot_pct" not in res.to_dict()
    assert float(res.slot.abs().max()) < 1e-5
