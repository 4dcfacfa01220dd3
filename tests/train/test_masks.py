"""Attention masks of the reference models, checked by gradients: prefix LM and intra-document masking.

In a one-layer model, output i depends on input j exactly when query i attends to key j (j = i always,
through the residual stream), so the non-zero pattern of d logits_i / d embedding_j is the mask.
"""

import numpy as np
import pytest
import torch

from analysis.train import ModelConfig, SinkLM, TrainConfig
from analysis.model.reference.data import build_data


def dependence(model: SinkLM, tokens: torch.Tensor) -> torch.Tensor:
    """(T, T) bool, on the CPU: logits at i depend on the embedding at j (``tokens`` run on the model's device)."""
    T = tokens.shape[1]
    tokens = tokens.to(model.device)
    x = model.embed(tokens).detach().requires_grad_(True)
    logits = model.run_with_hooks(tokens, fwd_hooks=[("hook_embed", lambda a, hook: x)])
    dep = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        (g,) = torch.autograd.grad(logits[0, i].sum(), x, retain_graph=True)
        dep[i] = (g[0].abs().sum(-1) > 0).cpu()
    return dep


def tiny(device="cpu", **kw) -> SinkLM:
    torch.manual_seed(0)
    return SinkLM(ModelConfig(d_vocab=16, n_ctx=12, d_model=16, n_heads=2, n_layers=1, **kw)).eval().to(device)


@pytest.mark.parametrize("attention", ["softmax", "sigmoid", "linear-identity"])
def test_prefix_attends_bidirectionally_inside_itself_and_causally_after(attention, device):
    p, T = 4, 9
    model = tiny(device, prefix_attention=p, attention=attention)
    dep = dependence(model, torch.randint(1, 16, (1, T)))
    i, j = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    expected = (j <= i) | ((i < p) & (j < p))
    assert torch.equal(dep, expected)
    assert torch.equal(dependence(tiny(device, attention=attention), torch.randint(1, 16, (1, T))), j <= i)


def test_document_mask_keeps_attention_inside_each_document(device):
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 3, 4]])  # documents start at token 0 (the first is cut)
    model = tiny(device, document_token=0)
    dep = dependence(model, tokens)
    doc = torch.cumsum(tokens[0] == 0, 0)
    i, j = torch.meshgrid(torch.arange(9), torch.arange(9), indexing="ij")
    assert torch.equal(dep, (j <= i) & (doc[i] == doc[j]))
    assert not dep[3, 1] and dep[3, 2] and dep[8, 6]


def test_document_mask_with_a_sliding_window_and_batch(device):
    tokens = torch.tensor([[0, 1, 2, 3, 0, 5], [1, 2, 0, 4, 5, 6]], device=device)
    model = tiny(device, document_token=0, sliding_window=2)
    mask = model.attention_mask(tokens)
    assert mask.shape == (2, 1, 6, 6)
    assert mask[0, 0, 3].tolist() == [False, False, True, True, False, False]
    assert mask[1, 0, 2].tolist() == [False, False, True, False, False, False]
    with pytest.raises(ValueError, match="document_token"):
        ModelConfig(d_vocab=16, document_token=16)


def test_synthetic_documents_are_packed_and_probes_drop_the_fixed_token():
    cfg = TrainConfig(dataset="synthetic-docs", synthetic_vocab=16)
    data = build_data(cfg, n_ctx=32)
    batch = data.batch(0, 64)
    starts = (batch.inputs[:, 0] == 0).float().mean()
    assert starts < 0.3  # a window starts at an arbitrary token, not at BOS
    assert (batch.inputs == 0).any(1).float().mean() > 0.5  # documents inside windows start with BOS
    assert data.probe_without_fixed_token(8, 16) is None
    plain = build_data(TrainConfig(dataset="synthetic", synthetic_vocab=16), n_ctx=32)
    probe, no_bos = plain.probe(8, 16), plain.probe_without_fixed_token(8, 16)
    assert (probe[:, 0] == 0).all() and no_bos.shape == (8, 16)
    assert torch.equal(no_bos[:, :15], probe[:, 1:]) and (no_bos[:, 0] != 0).all()
    assert np.array_equal(data.batch(3, 4).inputs.numpy(), data.batch(3, 4).inputs.numpy())  # deterministic
