"""AttentionWeights: every quantity an analysis reads from a layer's attention, from q, k and the log-sum-exp (the
transformers backend) and from the map itself (the bridge), against the softmax map built whole: grouped-query heads,
a sliding window, blocks of a few query rows with an uneven last block."""

import pytest
import torch

from analysis.engine.attention import AttentionWeights, attention_of
from analysis.engine.kernels import fused_attention
from analysis.sinks.metric import alpha_from_pattern
from tests.conftest import tol


def _inputs(window, device):
    g = torch.Generator().manual_seed(0)
    B, H, H_kv, T, d = 2, 6, 2, 37, 8
    q = torch.randn(B, H, T, d, generator=g).to(device)
    k, v = (torch.randn(B, H_kv, T, d, generator=g).to(device) for _ in range(2))
    i = torch.arange(T, device=device)
    seen = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < (window or T))
    mask = None if window is None else seen[None, None].expand(B, 1, T, T)
    A = (q @ k.repeat_interleave(3, 1).transpose(-1, -2) * 0.4).masked_fill(~seen, float("-inf")).softmax(-1)
    return q, k, v, mask, A


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("chunk", [1, 2**9, 2**30])  # 16 rows a block, 28 rows a block, all rows at once
def test_weights_from_q_k_and_the_lse_equal_the_softmax_map(window, chunk, device):
    q, k, v, mask, A = _inputs(window, device)
    B, H, T, _ = A.shape
    out, lse = fused_attention(q, k, v, mask, 0.4)
    assert torch.allclose(out, A @ v.repeat_interleave(3, 1), atol=tol(device, 1e-5))  # the output the model gets
    x = torch.rand(B, H, T, device=device)
    i = torch.arange(T, device=device)
    for w in (AttentionWeights(query=q, key=k, lse=lse, scale=0.4, mask=mask, chunk_elements=chunk), attention_of(A)):
        assert w.shape == (B, H, T, T)
        close = lambda got, want: (got - want).abs().max() < tol(device, 1e-6)  # noqa: E731
        assert close(w.alpha(T), A.double().sum(-2) / (T - i)) and close(w.alpha(T), alpha_from_pattern(A, T))
        assert close(w.alpha(3), alpha_from_pattern(A, 3))
        assert close(w.columns(4), A[..., :4]) and close(w.column(2), A[..., 2])
        assert close(w.diagonal(0), A.diagonal(0, -2, -1)) and close(w.diagonal(1), A.diagonal(-1, -2, -1))
        assert close(w.row(-1), A[..., -1, :]) and close(w.row(4), A[..., 4, :])
        assert close(w.weighted(x), torch.einsum("bhij,bhj->bhi", A, x))
        assert close(w.row_sums(), torch.ones(B, H, T, device=device))
        assert close(w.dense(slice(30, 33)), A[..., 30:33, :])


def test_weights_need_the_map_or_q_k_and_the_lse():
    with pytest.raises(ValueError, match="needs the pattern, or the query, key and log-sum-exp"):
        AttentionWeights(query=torch.zeros(1, 1, 2, 2))
