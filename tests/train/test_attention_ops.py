"""Every attention operation against a naive reference written here with loops and plain formulas.

The model runs on random tokens; the test reads the rotated queries/keys and values from the hooks,
recomputes the attention weights and outputs element by element, and compares with the model's
hook_z, hook_pattern, hook_raw_pattern and hook_sink_pattern.
"""

import math

import pytest
import torch

from analysis.model.reference.kernels import FLEX_MIN_HEAD_DIM, KernelChoice, attention_kernel
from analysis.train import ModelConfig, SinkLM, available_attention
from tests.conftest import tol

B, T, D, H, HKV = 2, 6, 32, 4, 2
d = D // H
G = H // HKV


def build(attention, device="cpu", **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_vocab=23,
        n_ctx=16,
        d_model=D,
        n_layers=1,
        n_heads=H,
        n_key_value_heads=HKV,
        attention=attention,
        attn_impl="eager",
        **kw,
    )
    model = SinkLM(cfg)
    with torch.no_grad():  # make the weights large enough for non-trivial patterns
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(8.0)
    return model.to(device)


def capture(model, tokens):
    """The attention hooks' values over ``tokens`` (run on the model's device), on the CPU."""
    names = [
        "hook_q",
        "hook_k",
        "hook_v",
        "hook_rot_q",
        "hook_rot_k",
        "hook_z",
        "hook_pattern",
        "hook_raw_pattern",
        "hook_sink_pattern",
        "hook_attn_scores",
    ]
    got = {}
    hooks = [
        (f"blocks.0.attn.{n}", (lambda n: lambda x, hook: got.__setitem__(n, x.detach().cpu()))(n))
        for n in names
        if f"blocks.0.attn.{n}" in model.hook_dict
    ]
    model.run_with_hooks(tokens.to(model.device), fwd_hooks=hooks)
    q = got.get("hook_rot_q", got["hook_q"])
    k = got.get("hook_rot_k", got["hook_k"])
    return q, k, got["hook_v"], got


def dot(a, b):
    return sum(float(x) * float(y) for x, y in zip(a, b))


def naive(q, k, v, sim_fn, combine, window=None, bias=None):
    """Generic loop reference. sim_fn(b, h, i, j, s) -> similarity from logit s (or from b,h,i,j);
    combine(sims: list over visible j) -> (weights used for v, pattern weights)."""
    z = torch.zeros(B, T, H, d)
    pattern = torch.zeros(B, H, T, T)
    raw = torch.zeros(B, H, T, T)
    for b in range(B):
        for h in range(H):
            g = h // G  # the key/value head of query head h
            for i in range(T):
                js = [j for j in range(i + 1) if window is None or i - j < window]
                sims = []
                for j in js:
                    s = dot(q[b, i, h], k[b, j, g]) / math.sqrt(d)
                    if bias is not None:
                        s += float(bias[h, i, j])
                    sims.append(sim_fn(b, h, i, j, s))
                w_raw, w_pat = combine(sims)
                for j, wr, wp in zip(js, w_raw, w_pat):
                    z[b, i, h] += wr * v[b, j, g]
                    raw[b, h, i, j] = wr
                    pattern[b, h, i, j] = wp
    return z, pattern, raw


def softmax_list(xs, alpha=1.0):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [alpha * x / sum(e) for x in e]


def normalise(xs):
    return [x / sum(xs) for x in xs]


def abs_normalise(xs):
    return [abs(x) / sum(abs(y) for y in xs) for x in xs]


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def elu1(x):
    return x + 1 if x > 0 else math.exp(x)


def check(model, z, pattern, raw, got, atol=1e-4):
    atol = tol(model.device.type, atol)  # the loops run on the CPU, the model on its device
    torch.testing.assert_close(got["hook_z"], z, atol=atol, rtol=1e-4)
    torch.testing.assert_close(got["hook_pattern"], pattern, atol=atol, rtol=1e-4)
    torch.testing.assert_close(got["hook_raw_pattern"], raw, atol=atol, rtol=1e-4)


TOKENS = torch.randint(0, 23, (B, T), generator=torch.Generator().manual_seed(1))

ELEMENTWISE = {
    # name: (sim from logit, combine sims -> (raw, pattern))
    "softmax": (lambda b, h, i, j, s: s, lambda xs: (softmax_list(xs), softmax_list(xs))),
    "softmax-scaled": (lambda b, h, i, j, s: s, lambda xs: (softmax_list(xs, 0.5), softmax_list(xs))),
    "sigmoid": (lambda b, h, i, j, s: sigmoid(s), lambda xs: (xs, normalise(xs))),
    "sigmoid-norm": (lambda b, h, i, j, s: sigmoid(s), lambda xs: (normalise(xs), normalise(xs))),
    "elu1": (lambda b, h, i, j, s: elu1(s), lambda xs: (xs, normalise(xs))),
    "elu1-norm": (lambda b, h, i, j, s: elu1(s), lambda xs: (normalise(xs), normalise(xs))),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_ops_match_naive(name, device):
    model = build(name, device, attn_alpha=0.5)
    q, k, v, got = capture(model, TOKENS)
    sim_fn, combine = ELEMENTWISE[name]
    z, pattern, raw = naive(q, k, v, sim_fn, combine)
    check(model, z, pattern, raw, got)


def test_softmax_pnorm_matches_naive(device):
    p = 3.0
    model = build("softmax-pnorm", device, attn_p=p)
    q, k, v, got = capture(model, TOKENS)

    def combine(xs):
        e = [math.exp(x) for x in xs]
        norm = sum(x**p for x in e) ** (1 / p)
        return [x / norm for x in e], normalise(e)

    z, pattern, raw = naive(q, k, v, lambda b, h, i, j, s: s, combine)
    check(model, z, pattern, raw, got)


def test_softpick_matches_naive(device):
    model = build("softpick", device)
    q, k, v, got = capture(model, TOKENS)

    def combine(xs):
        m = max(xs)
        e = [math.exp(x - m) - math.exp(-m) for x in xs]
        den = sum(abs(x) for x in e) + 1e-6
        w = [max(x, 0.0) / den for x in e]
        return w, w

    z, pattern, raw = naive(q, k, v, lambda b, h, i, j, s: s, combine)
    check(model, z, pattern, raw, got)


@pytest.mark.parametrize("bias_kind", ["fixed", "learnable"])
def test_sigmoid_bias_matches_naive(bias_kind, device):
    model = build("sigmoid", device, sigmoid_bias=bias_kind)
    if bias_kind == "learnable":
        with torch.no_grad():
            model.blocks[0].attn.op.bias.copy_(torch.tensor([-1.0, -2.0, 0.5, -3.0]).view(H, 1, 1))
        bias = [-1.0, -2.0, 0.5, -3.0]
    else:
        bias = [-math.log(T)] * H
    q, k, v, got = capture(model, TOKENS)
    z, pattern, raw = naive(q, k, v, lambda b, h, i, j, s: sigmoid(s + bias[h]), lambda xs: (xs, normalise(xs)))
    check(model, z, pattern, raw, got)


@pytest.mark.parametrize("kernel", ["identity", "elu1", "mlp"])
@pytest.mark.parametrize("norm", [False, True])
def test_linear_kernels_match_naive(kernel, norm, device):
    name = f"linear-{kernel}" + ("-norm" if norm else "")
    model = build(name, device)
    op = model.blocks[0].attn.op
    q, k, v, got = capture(model, TOKENS)

    def phi(x):
        if kernel == "identity":
            return x
        if kernel == "elu1":
            return torch.tensor([xi + 1 if xi > 0 else math.exp(xi) for xi in x.tolist()])
        w1, b1, w2, b2 = (
            p.detach().cpu() for p in (op.phi[0].weight, op.phi[0].bias, op.phi[2].weight, op.phi[2].bias)
        )
        hidden = torch.nn.functional.gelu(w1 @ x + b1)
        return w2 @ hidden + b2

    def sim_fn(b, h, i, j, s):
        return dot(phi(q[b, i, h]), phi(k[b, j, h // G])) / math.sqrt(d)

    def combine(xs):
        Z = max(abs(sum(xs)), 1.0) if norm else 1.0
        return [x / Z for x in xs], abs_normalise(xs)

    with torch.no_grad():
        z, pattern, raw = naive(q, k, v, sim_fn, combine)
    check(model, z, pattern, raw, got)


def rope_naive(x, pos, base=10000.0):
    """Rotate pairs (x_i, x_{i + d/2}) by angle pos * base^(-2i/d) (LLaMA's rotate-half convention)."""
    half = x.shape[-1] // 2
    out = x.clone()
    for i in range(half):
        theta = pos * base ** (-2 * i / x.shape[-1])
        c, s = math.cos(theta), math.sin(theta)
        out[..., i] = x[..., i] * c - x[..., i + half] * s
        out[..., i + half] = x[..., i + half] * c + x[..., i] * s
    return out


def test_rope_matches_naive_rotation(device):
    model = build("softmax", device)
    _, _, _, got = capture(model, TOKENS)
    for t in range(T):
        torch.testing.assert_close(
            got["hook_rot_q"][:, t], rope_naive(got["hook_q"][:, t], t), atol=tol(device, 1e-5), rtol=1e-5
        )
        torch.testing.assert_close(
            got["hook_rot_k"][:, t], rope_naive(got["hook_k"][:, t], t), atol=tol(device, 1e-5), rtol=1e-5
        )


def slot_naive(q, k, v, k_slot, v_slot, slot_bias=None):
    """Softmax over [slot, keys 0..i]; returns z, pattern (real keys), sink weight (B, H, T)."""
    z = torch.zeros(B, T, H, d)
    pattern = torch.zeros(B, H, T, T)
    sink = torch.zeros(B, H, T)
    for b in range(B):
        for h in range(H):
            g = h // G
            for i in range(T):
                logits = [dot(q[b, i, h], k_slot[h]) / math.sqrt(d) + (0.0 if slot_bias is None else slot_bias[h][i])]
                logits += [dot(q[b, i, h], k[b, j, g]) / math.sqrt(d) for j in range(i + 1)]
                w = softmax_list(logits)
                sink[b, h, i] = w[0]
                if v_slot is not None:
                    z[b, i, h] += w[0] * v_slot[h]
                for j in range(i + 1):
                    pattern[b, h, i, j] = w[j + 1]
                    z[b, i, h] += w[j + 1] * v[b, j, g]
    return z, pattern, sink


@pytest.mark.parametrize("name", ["kv-bias", "k-bias"])
def test_kv_biases_match_naive(name, device):
    model = build(name, device)
    op = model.blocks[0].attn.op
    q, k, v, got = capture(model, TOKENS)
    k_slot = op.k_bias[:, 0].detach().cpu()
    v_slot = None if name == "k-bias" else op.v_bias[:, 0].detach().cpu()
    z, pattern, sink = slot_naive(q, k, v, k_slot, v_slot)
    check(model, z, pattern, pattern, got)
    torch.testing.assert_close(got["hook_sink_pattern"], sink, atol=tol(device, 1e-4), rtol=1e-4)
    torch.testing.assert_close(got["hook_pattern"].sum(-1) + sink, torch.ones(B, H, T), atol=1e-5, rtol=0)


def test_v_bias_matches_naive(device):
    model = build("v-bias", device)
    vb = model.blocks[0].attn.op.v_bias[:, 0].detach().cpu()
    q, k, v, got = capture(model, TOKENS)
    z, pattern, raw = naive(q, k, v, lambda b, h, i, j, s: s, lambda xs: (softmax_list(xs), softmax_list(xs)))
    for h in range(H):
        z[:, :, h] += vb[h]
    check(model, z, pattern, raw, got)


def test_sink_token_matches_naive(device):
    """The learnable sink token is an extra first token: its key/value come from its own residual stream
    (it attends only to itself), rotated at position -1 relative to the real tokens at 0..T-1."""
    model = build("sink-token", device)
    q, k, v, got = capture(model, TOKENS)
    model = model.cpu()  # the slot's key and value are computed here from its weights
    blk = model.blocks[0]
    s = model.sink_token.detach()
    s_norm = s / torch.sqrt((s**2).mean() + model.cfg.eps) * blk.ln1.w.detach()
    k_slot = torch.stack([rope_naive(s_norm @ blk.attn.W_K[h // G].detach(), -1) for h in range(H)])
    v_slot = torch.stack([s_norm @ blk.attn.W_V[h // G].detach() for h in range(H)])
    z, pattern, sink = slot_naive(q, k, v, k_slot, v_slot)
    check(model, z, pattern, pattern, got, atol=tol(device, 1e-4))
    torch.testing.assert_close(got["hook_sink_pattern"], sink, atol=tol(device, 1e-4), rtol=1e-4)


def test_sink_token_equals_prepending_a_token(device):
    """Two layers: the side-stream implementation equals running the sequence with the sink token's
    embedding really prepended (positions shifted by one), read off at the real positions."""
    torch.manual_seed(0)
    cfg = dict(d_vocab=23, n_ctx=16, d_model=D, n_layers=2, n_heads=H, n_key_value_heads=HKV, attn_impl="eager")
    model = SinkLM(ModelConfig(attention="sink-token", **cfg))
    plain = SinkLM(ModelConfig(attention="softmax", **cfg))
    state = {k: v for k, v in model.state_dict().items() if k != "sink_token"}
    plain.load_state_dict(state)
    model, plain = model.to(device), plain.to(device)
    emb = model.sink_token.detach().view(1, 1, D).expand(B, 1, D)
    tokens_plus = torch.cat([torch.zeros(B, 1, dtype=torch.long), TOKENS], dim=1).to(device)
    logits_plain = plain.run_with_hooks(
        tokens_plus, fwd_hooks=[("hook_embed", lambda x, hook: torch.cat([emb, x[:, 1:]], 1))]
    )
    torch.testing.assert_close(model(TOKENS.to(device)), logits_plain[:, 1:], atol=tol(device, 1e-4), rtol=1e-4)


def test_alibi_and_relative_bias_match_naive(device):
    from analysis.model.reference.positions import alibi_slopes

    model = build("softmax", device, positional_embedding_type="alibi")
    q, k, v, got = capture(model, TOKENS)
    slopes = alibi_slopes(H).tolist()
    assert slopes == pytest.approx([2 ** (-8 * (h + 1) / H) for h in range(H)])
    bias = torch.tensor([[[-slopes[h] * (i - j) for j in range(T)] for i in range(T)] for h in range(H)])
    z, pattern, raw = naive(
        q, k, v, lambda b, h, i, j, s: s, lambda xs: (softmax_list(xs), softmax_list(xs)), bias=bias
    )
    check(model, z, pattern, raw, got)

    model = build("sigmoid", device, positional_embedding_type="relative")
    table = model.blocks[0].attn.relative.weight
    with torch.no_grad():
        table.copy_(torch.randn(table.shape, device=table.device))
    q, k, v, got = capture(model, TOKENS)
    # T5 buckets: distances below num_buckets / 2 = 16 are their own bucket
    tab = table.detach().cpu()
    bias = torch.tensor(
        [[[float(tab[i - j, h]) if j <= i else 0.0 for j in range(T)] for i in range(T)] for h in range(H)]
    )
    z, pattern, raw = naive(q, k, v, lambda b, h, i, j, s: sigmoid(s), lambda xs: (xs, normalise(xs)), bias=bias)
    check(model, z, pattern, raw, got)


@pytest.mark.parametrize("name", ["softmax", "sigmoid", "linear-identity-norm"])
def test_sliding_window_matches_naive(name, device):
    window = 3
    model = build(name, device, sliding_window=window)
    q, k, v, got = capture(model, TOKENS)
    if name == "softmax":
        fns = ELEMENTWISE["softmax"]
    elif name == "sigmoid":
        fns = ELEMENTWISE["sigmoid"]
    else:
        fns = (lambda b, h, i, j, s: s, lambda xs: ([x / max(abs(sum(xs)), 1.0) for x in xs], abs_normalise(xs)))
    z, pattern, raw = naive(q, k, v, *fns, window=window)
    check(model, z, pattern, raw, got)


@pytest.mark.parametrize(
    "name,impl",
    [
        ("softmax", "sdpa"),
        ("softmax", "flex"),
        ("softmax-scaled", "sdpa"),
        ("v-bias", "sdpa"),
        ("kv-bias", "sdpa"),
        ("k-bias", "sdpa"),
        ("sink-token", "sdpa"),
        ("sigmoid", "flex"),
        ("sigmoid-norm", "flex"),
        ("elu1", "flex"),
        ("elu1-norm", "flex"),
    ],
)
@pytest.mark.parametrize("pe,window", [("rotary", None), ("alibi", 3)])
def test_fused_paths_equal_eager(name, impl, pe, window, device):
    """SDPA / FlexAttention (forced on CPU) give the eager path's output and gradients (FlexAttention has
    no backward on CPU: its gradients are checked only with ``--device cuda``). On CUDA the heads are 16 wide,
    the smallest FlexAttention takes there (``analysis.model.reference.kernels``)."""
    torch.manual_seed(0)
    d_model = D if device == "cpu" else H * FLEX_MIN_HEAD_DIM
    cfg = dict(
        d_vocab=23,
        n_ctx=16,
        d_model=d_model,
        n_layers=2,
        n_heads=H,
        n_key_value_heads=HKV,
        attention=name,
        positional_embedding_type=pe,
        sliding_window=window,
        sigmoid_bias="learnable",
    )
    eager = SinkLM(ModelConfig(attn_impl="eager", **cfg))
    fused = SinkLM(ModelConfig(attn_impl=impl, **cfg))
    fused.load_state_dict(eager.state_dict())
    grads = impl == "sdpa" or device == "cuda"
    eager, fused = eager.to(device), fused.to(device)
    tokens = TOKENS.to(device)
    with _no_fallback(), torch.set_grad_enabled(grads):
        out_f = fused(tokens)
        out_e = eager(tokens)
    torch.testing.assert_close(out_f, out_e, atol=tol(device, 2e-5), rtol=1e-4)  # CUDA: other kernels, other orders
    assert [blk.attn.last_path for blk in fused.blocks] == [impl] * 2  # the fused kernel ran, not the eager fallback
    if not grads:
        return
    out_f.square().mean().backward()
    out_e.square().mean().backward()
    for (n, pe_), pf in zip(eager.named_parameters(), fused.parameters()):
        torch.testing.assert_close(pf.grad, pe_.grad, atol=tol(device, 1e-5), rtol=1e-3, msg=n)
    assert fused.attention_kernel(device, out_f.dtype) == {"kernel": impl}  # no fallback recorded


class _no_fallback:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.filterwarnings("error", message="fused attention")
        warnings.filterwarnings(
            "ignore", category=UserWarning, message=".*flex_attention called without torch.compile.*"
        )
        warnings.filterwarnings("ignore", category=FutureWarning)

    def __exit__(self, *a):
        return self._w.__exit__(*a)


def test_pattern_hook_forces_eager_path(device):
    torch.manual_seed(0)
    model = SinkLM(ModelConfig(d_vocab=23, n_ctx=16, d_model=D, n_heads=H, attn_impl="sdpa")).to(device)
    seen = []
    model.run_with_hooks(
        TOKENS.to(device), fwd_hooks=[("blocks.0.attn.hook_pattern", lambda x, hook: seen.append(x.shape))]
    )
    assert seen == [(B, H, T, T)]


def test_every_registered_operation_is_tested_here():
    tested = (
        set(ELEMENTWISE)
        | {"softmax-pnorm", "softpick", "kv-bias", "k-bias", "v-bias", "sink-token"}
        | {f"linear-{k}{n}" for k in ("identity", "elu1", "mlp") for n in ("", "-norm")}
    )
    assert set(available_attention()) == tested


def test_unknown_attention_lists_known_names():
    with pytest.raises(ValueError) as e:
        ModelConfig(attention="softmx")
    msg = str(e.value)
    assert "softmx" in msg and "softmax" in msg and "sigmoid" in msg and "linear-mlp-norm" in msg


def test_linear_attention_rejects_additive_position_bias():
    with pytest.raises(ValueError, match="rotary"):
        ModelConfig(attention="linear-mlp", positional_embedding_type="alibi")


BF16, F32 = torch.bfloat16, torch.float32
FLEX_OPS, TRITON_OPS, SDPA_OPS = ("flex",), ("flex", "triton"), ("sdpa", "flex")


@pytest.mark.parametrize(
    "supported, impl, device_type, dtype, d, bias, triton_ok, kernel, stated",
    [
        (SDPA_OPS, "auto", "cuda", BF16, 64, None, False, "sdpa", ""),
        (SDPA_OPS, "auto", "cpu", F32, 64, None, False, "eager", ""),  # auto fuses on CUDA only, by design
        (TRITON_OPS, "auto", "cuda", BF16, 64, None, True, "flex", ""),  # the first kernel until triton is measured
        (
            TRITON_OPS,
            "auto",
            "cuda",
            BF16,
            8,
            None,
            True,
            "eager",
            "head sizes >= 16",
        ),  # issue 36: known before the call
        (FLEX_OPS, "flex", "cuda", F32, 8, "alibi", False, "eager", "head sizes >= 16"),
        (FLEX_OPS, "flex", "cpu", F32, 8, None, False, "flex", ""),  # unfused on the CPU: any head size
        (TRITON_OPS, "triton", "cuda", BF16, 64, "alibi", True, "triton", ""),
        (TRITON_OPS, "triton", "cuda", BF16, 64, None, False, "eager", "needs Triton"),
        (TRITON_OPS, "triton", "cuda", BF16, 48, None, True, "eager", "power-of-two head sizes"),
        (TRITON_OPS, "triton", "cuda", BF16, 64, "relative", True, "eager", "relative position bias"),
        (FLEX_OPS, "triton", "cuda", BF16, 64, None, True, "eager", "no triton kernel"),  # a normalised operation
        (SDPA_OPS[:1], "flex", "cuda", BF16, 64, None, True, "eager", "no flex kernel"),
        ((), "auto", "cuda", BF16, 64, None, True, "eager", ""),  # linear attention: no fused kernel at all
        (SDPA_OPS, "eager", "cuda", BF16, 64, None, True, "eager", ""),
    ],
)
def test_attention_kernel_table(supported, impl, device_type, dtype, d, bias, triton_ok, kernel, stated):
    got = attention_kernel(supported, impl, device_type, dtype, d, bias=bias, triton_ok=triton_ok)
    assert got.kernel == kernel and (stated in got.fallback if stated else got.fallback == "")


def test_a_model_knows_its_kernel_before_the_call_and_says_why_once(caplog):
    """Heads 8 wide on CUDA with FlexAttention asked for: the eager path, stated once in the log and recorded, read
    without running a kernel (no CUDA needed)."""
    model = SinkLM(ModelConfig(d_vocab=23, n_ctx=16, d_model=D, n_heads=H, attention="sigmoid", attn_impl="flex"))
    with caplog.at_level("WARNING", logger="analysis.model.reference.kernels"):
        rec = model.attention_kernel("cuda", BF16)
        model.attention_kernel("cuda", BF16)
        for blk in model.blocks:
            blk.attn.kernel("cuda", BF16)
    assert rec["kernel"] == "eager" and "head sizes >= 16; this model's is 8" in rec["fallback"]
    assert sum("head sizes >= 16" in r.getMessage() for r in caplog.records) <= 1  # once per process
    assert model.attention_kernel("cpu", F32) == {"kernel": "flex"}
    assert isinstance(model.blocks[0].attn.kernel("cuda", BF16), KernelChoice)
    with pytest.raises(ValueError, match="attn_impl must be"):
        attention_kernel(SDPA_OPS, "flash", "cuda", BF16, 64)
