"""The Triton sigmoid and elu+1 attention kernels (``analysis.model.reference.triton_attention``) against the eager
operations, forward and gradients (q, k, v and the learnable head bias), causal and sliding-window masks, with and
without an ALiBi-like additive bias; and through a model with ``attn_impl="triton"``. On the CPU they run under
Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py before any test module imports the kernels:
tests/report/test_protocol.py imports every module of the package), at small shapes."""

import pytest
import torch

pytest.importorskip("triton")

from analysis.model.reference.attention import build_attention_op, causal_mask  # noqa: E402
from analysis.model.reference.triton_attention import triton_elementwise  # noqa: E402
from analysis.train import ModelConfig, SinkLM  # noqa: E402
from tests.conftest import tol  # noqa: E402


@pytest.mark.parametrize(
    "name, bias_kind, window, pos_bias, T",
    [
        ("sigmoid", "learnable", None, False, 20),  # causal, a learnable bias per head (its gradient too)
        ("sigmoid", "fixed", 7, True, 19),  # a window, -log T, an additive position bias; T off the block size
        ("elu1", "none", 5, False, 18),
    ],
)
def test_triton_kernels_equal_the_eager_operation(name, bias_kind, window, pos_bias, T, device):
    torch.manual_seed(0)
    op = build_attention_op(
        ModelConfig(d_vocab=23, n_ctx=32, d_model=32, n_heads=2, attention=name, sigmoid_bias=bias_kind)
    ).to(device)
    q, k, v = (torch.randn(1, 2, T, 16, device=device, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, T, T, device=device) * 0.5 if pos_bias else None
    z = triton_elementwise(op, q, k, v, window=window, score_bias=bias)
    want = op(q, k, v, causal_mask(T, window=window, device=device), bias)
    torch.testing.assert_close(z, want, atol=tol(device, 1e-5), rtol=1e-4)
    g = torch.randn_like(z)
    inputs = [q, k, v, *op.parameters()]
    for got, ref, n in zip(torch.autograd.grad(z, inputs, g), torch.autograd.grad(want, inputs, g), "qkvb"):
        torch.testing.assert_close(got, ref, atol=tol(device, 1e-5), rtol=1e-4, msg=n)


def test_a_model_trains_through_the_triton_kernel(device):
    """attn_impl="triton": the kernel runs in every layer (no fallback recorded) and gives the eager model's loss
    and gradients."""
    torch.manual_seed(0)
    cfg = dict(
        d_vocab=23, n_ctx=16, d_model=32, n_layers=1, n_heads=2, attention="elu1", positional_embedding_type="alibi"
    )
    eager = SinkLM(ModelConfig(attn_impl="eager", **cfg)).to(device)
    fused = SinkLM(ModelConfig(attn_impl="triton", **cfg)).to(device)
    fused.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, 23, (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    out_f, out_e = fused(tokens), eager(tokens)
    assert [b.attn.last_path for b in fused.blocks] == ["triton"]
    assert fused.attention_kernel(device, torch.float32) == {"kernel": "triton"}
    torch.testing.assert_close(out_f, out_e, atol=tol(device, 2e-5), rtol=1e-4)
    out_f.square().mean().backward()
    out_e.square().mean().backward()
    for (n, pe), pf in zip(eager.named_parameters(), fused.parameters()):
        torch.testing.assert_close(pf.grad, pe.grad, atol=tol(device, 1e-5), rtol=1e-3, msg=n)


def test_the_throughput_benchmark_times_the_triton_path_and_prints_the_targets(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_attention_ops.py"
    spec = importlib.util.spec_from_file_location("bench_attention_ops", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "throughput.json"
    bench.main(
        [
            "--device",
            "cpu",
            "--ops",
            "softmax,elu1,sigmoid-norm",
            "--impl",
            "sdpa,triton",
            "--d-model",
            "32",
            "--n-layers",
            "1",
            "--n-heads",
            "2",
            "--n-ctx",
            "16",
            "--batch",
            "1",
            "--iters",
            "1",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--vocab",
            "64",
            "--json",
            str(out),
        ]
    )
    rows = {(r["op"], r["impl"]): r["path"] for r in json.loads(out.read_text())["rows"]}
    assert rows == {("softmax", "sdpa"): "sdpa", ("elu1", "triton"): "triton"}
    text = capsys.readouterr().out
    assert "sigmoid-norm: no triton path (it ran eager: this operation has no triton kernel" in text
    assert "MFU not judged (a CPU run)" in text and "elu1 (triton) / softmax (sdpa)" in text and "target >= 1.0" in text
