"""The backends: the transformers backend (the Hugging Face model in its own attention, alpha from q, k and the
kernel's log-sum-exp) equals the bridge's hook_pattern path; what it cannot run is refused before the work, and
``auto`` then takes the bridge; the kernel table."""

import pytest
import torch

from analysis import natural_probe
from analysis.core.reductions import alpha_from_lse
from analysis.engine.backends import _by_call, BackendUnsupported, choose_backend
from analysis.engine.attention import row_lse
from analysis.engine.kernels import fused_attention, sink_kernel
from analysis.model.contract import hf_module
from analysis.sinks.metric import alpha_from_pattern, sink_metric
from tests.conftest import tol

TOL = 1e-5


def _eager(model, tokens, k_max=16):
    """The eager path (``hook_pattern`` reducers), whatever ``sink_metric``'s default path is."""
    import inspect

    extra = {"path": "eager"} if "path" in inspect.signature(sink_metric).parameters else {}
    return sink_metric(model, tokens, k_max=k_max, **extra)


def _qkv(B=2, H=4, H_kv=2, T=24, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, d, generator=g)
    k, v = (torch.randn(B, H_kv, T, d, generator=g) for _ in range(2))
    return q, k, v


def _window(T, w, B=2):
    i = torch.arange(T)
    return ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < w))[None, None].expand(B, 1, T, T)


@pytest.mark.parametrize("window", [None, 5])
def test_alpha_from_lse_equals_alpha_of_the_softmax_map(window, device):
    q, k, v = (x.to(device) for x in _qkv())  # on CUDA: the efficient-attention kernel's lse
    T, scale = q.shape[-2], 0.3
    mask = None if window is None else _window(T, window).to(device)
    out, lse = fused_attention(q, k, v, mask, scale)
    allowed = _window(T, T if window is None else window).to(device)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    A = scores.softmax(-1)
    assert torch.allclose(out, A @ v.repeat_interleave(2, 1), atol=tol(device, 1e-5))
    assert torch.allclose(lse, scores.logsumexp(-1), atol=tol(device, 1e-5))
    assert torch.allclose(
        alpha_from_lse(q, k, lse, scale, 6, mask=mask), alpha_from_pattern(A, 6), atol=tol(device, 1e-6)
    )
    # The fall-back's lse in blocks of rows is the same with blocks that split the rows unevenly.
    assert torch.allclose(row_lse(q, k, scale, mask=mask, chunk_elements=1), lse, atol=tol(device, 1e-5))


def test_smollm2_fused_equals_eager(smollm2, device):
    tokens = natural_probe(smollm2.tokenizer, n=3, T=48).tokens
    eager = _eager(smollm2, tokens)
    fused = sink_metric(smollm2, tokens, k_max=16, path="fused")
    assert fused.meta["backend"] == "transformers" and eager.meta["backend"] == "transformer_lens"
    assert fused.alpha.shape == eager.alpha.shape == (3, 30, 9, 16)
    assert (fused.alpha - eager.alpha).abs().max() < tol(device, TOL)
    assert fused.sink_rate(1) == eager.sink_rate(1) > 50  # the embedded model sinks on natural text
    # The bridge got its own modules back: its eager path and hooks still work after the fused run.
    assert torch.equal(_eager(smollm2, tokens).alpha, eager.alpha)
    assert hf_module(smollm2).config._attn_implementation == "eager"  # the bridge's own, restored


# llama: grouped-query attention; mistral: a sliding window (8) shorter than T; gpt_neox: partial rotary;
# gemma: its own q scaling and head size; qwen2: q/k/v biases; gemma2_cap: soft-capped scores (in blocks of rows: no
# fused kernel takes the cap); gpt_oss: learned sink logits joined to the kernel's rows; opt: its MLP on flattened
# tokens, and the bridge's own relay hooks on it, which are no user's; deepseek_v3: latent attention, its v narrower.
FUSED = ["llama", "qwen2", "mistral", "gpt_neox", "gemma", "gemma2_cap", "gpt_oss", "opt", "deepseek_v3"]


@pytest.mark.parametrize("family", FUSED)
def test_tiny_family_fused_equals_eager(family, tmp_path, device):
    from analysis import load_model
    from tests.families import make_family_dir

    bridge = load_model(str(make_family_dir(family, tmp_path / family)), device=device)
    tokens = torch.randint(3, 96, (3, 40), generator=torch.Generator().manual_seed(1))
    eager = _eager(bridge, tokens)
    assert choose_backend(bridge, backend="auto")[0] == "transformers"
    fused = sink_metric(bridge, tokens, k_max=16, path="fused", batch_size=2)
    assert (fused.alpha - eager.alpha).abs().max() < tol(device, TOL)


def test_q_and_k_before_the_rotary_are_read_where_the_rotary_is_the_last_step(family_bridge, tmp_path):
    """The partial-rotary families' key paths read q and k before the rotary: the transformers backend turns the
    interface's back (the profile's equality on every family checks the numbers); not where a norm follows the rotary
    (Llama 4's L2 q/k norm), where the bridge runs and says why."""
    from analysis import load_model
    from tests.families import make_family_dir

    names = ["blocks.0.attn.hook_k", "blocks.0.attn.hook_q"]
    for family in ("gpt_neox", "phi3"):  # a joint QKV projection: from the call
        model = family_bridge(family)
        assert model.family.key_hook(0) == names[0]  # the premise: their key paths read hook_k
        assert _by_call(model, model.family, names[0])
        assert choose_backend(model, backend="auto", names=names)[0] == "transformers"
    l2 = load_model(str(make_family_dir("llama4_qk_norm", tmp_path / "l4")))
    assert l2.family.qk_l2_norm and not family_bridge("llama4_text").family.qk_l2_norm
    assert not _by_call(l2, l2.family, names[0])  # its own k projection's output, ahead of the rotary and the norm
    assert choose_backend(l2, backend="auto", names=names)[0] == "transformers"
    ((_, tl), (_, hf)) = (_captured(l2, names, b) for b in ("transformer_lens", "transformers"))
    assert all(torch.equal(a, b) for a, b in zip(tl, hf))


def _captured(model, names, backend, fwd_hooks=()):
    from analysis.engine.passes import Capture, run_pass

    record, tokens = {}, torch.randint(3, 90, (2, 10), generator=torch.Generator().manual_seed(3))
    caps = [Capture(n, int(n.split(".")[1])) for n in names]
    run_pass(model, tokens, caps, fwd_hooks=list(fwd_hooks), backend=backend, record=record)
    return record["backend"], [c.result() for c in caps]


# Hooks that are a part of a module's activation (``access.module_part``), each read on one family of the matrix, and
# whether the transformers backend applies an edit there
PARTS = [
    ("qwen3_next", "blocks.3.attn.hook_q_gate", True),
    ("qwen3_next", "blocks.3.attn.hook_z", True),
    ("qwen3_next", "blocks.3.attn.hook_q", True),  # query and gate, interleaved per head
    ("phi3", "blocks.0.mlp.gate.hook_out", True),
    ("phi3", "blocks.0.mlp.in.hook_out", True),
    ("granite", "blocks.0.hook_attn_out", True),
    ("llama", "blocks.0.attn.hook_k", True),
    ("opt", "blocks.0.ln1.hook_normalized", False),
]


@pytest.mark.parametrize("family,site,edits", PARTS, ids=[f"{f}-{s.rpartition('.')[2]}" for f, s, _ in PARTS])
def test_a_part_of_a_modules_activation_is_read_and_edited_as_on_the_bridge(family, site, edits, family_bridge):
    """The bridge's hooks that no Hugging Face module gives whole (a joint projection's halves, a gated q and its gate,
    a gated z, a scaled contribution, a norm's normalised input) read as the bridge gives them; an edit of the first
    token's entries there changes the later residual as on the bridge, or, where the backend cannot edit (the
    normalised input, which the bridge computes beside the module), sends the pass to the bridge."""
    model = family_bridge(family)
    after = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    (b, tl), (h, hf) = (_captured(model, [site, after], b) for b in ("transformer_lens", "auto"))
    assert (b, h) == ("transformer_lens", "transformers") and tl[0].shape == hf[0].shape
    assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(tl, hf))
    plain = tl[1]

    def double_first(x, hook):
        x = x.clone()
        x[:, 0] *= 2
        return x

    (b, tl), (h, hf) = (_captured(model, [after], b, [(site, double_first)]) for b in ("transformer_lens", "auto"))
    assert h == ("transformers" if edits else "transformer_lens")
    assert torch.allclose(tl[0], hf[0], rtol=1e-5, atol=1e-5) and not torch.allclose(tl[0], plain, atol=1e-4)


def test_attention_outside_the_interface_is_refused_and_the_bridge_survives(tmp_path, device):
    from analysis import load_model
    from tests.families import make_family_dir

    # Falcon keeps its own attention module outside transformers' AttentionInterface (GPT-J did before transformers
    # 5.24, which moved it onto the interface; then the fused path is exact there too).
    bridge = load_model(str(make_family_dir("falcon", tmp_path / "falcon")), device=device)
    assert not hf_module(bridge)._can_set_attn_implementation()  # the premise: outside the interface
    tokens = torch.randint(3, 96, (2, 20))
    before = _eager(bridge, tokens).alpha
    with pytest.raises(BackendUnsupported, match="AttentionInterface"):
        sink_metric(bridge, tokens, k_max=4, path="fused")
    auto = sink_metric(bridge, tokens, k_max=16)
    assert auto.meta["backend"] == "transformer_lens" and "AttentionInterface" in auto.meta["fused_unsupported"]
    assert torch.equal(auto.alpha, before) and torch.equal(_eager(bridge, tokens).alpha, before)


def test_hooks_attached_to_the_bridge_force_the_bridge(tiny_llama):
    with tiny_llama.hooks(fwd_hooks=[("blocks.0.attn.hook_z", lambda x, hook: x * 0)]):
        assert "hooks are attached" in choose_backend(tiny_llama, backend="auto")[1]
        with pytest.raises(BackendUnsupported, match="hooks"):
            sink_metric(tiny_llama, torch.randint(3, 90, (1, 8)), k_max=2, path="fused")
    assert choose_backend(tiny_llama, backend="auto")[0] == "transformers"


def test_bad_inputs_say_what_to_do(tiny_llama):
    with pytest.raises(ValueError, match="k_max must lie in"):
        sink_metric(tiny_llama, torch.randint(3, 90, (1, 8)), k_max=9, path="fused")
    with pytest.raises(ValueError, match="exceeds the model's context of 128"):
        sink_metric(tiny_llama, torch.randint(3, 90, (1, 129)), k_max=2, path="fused")
    with pytest.raises(ValueError, match="token ids must lie in"):
        sink_metric(tiny_llama, torch.full((1, 8), 500), k_max=2, path="fused")
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_backend(tiny_llama, backend="flash")
    # an edit the transformers backend would not apply takes the bridge, never a silent no-op
    for name in ("blocks.0.attn.hook_pattern", "blocks.0.attn.hook_rot_q", "blocks.0.ln1.hook_normalized"):
        assert choose_backend(tiny_llama, backend="auto", names=[], edits=[name])[0] == "transformer_lens"
    for name in ("blocks.0.attn.hook_v", "blocks.0.attn.hook_k"):  # at the call; at the k projection's output
        assert choose_backend(tiny_llama, backend="auto", edits=[name])[0] == "transformers"


def test_sink_metric_paths(tiny_llama, device):
    tokens = torch.randint(3, 90, (3, 20), generator=torch.Generator().manual_seed(2))
    fused, eager, auto = (sink_metric(tiny_llama, tokens, k_max=8, path=p) for p in ("fused", "eager", "auto"))
    assert (fused.meta["path"], eager.meta["path"], auto.meta["path"]) == ("fused", "eager", "fused")
    # the kernels taken are recorded (bf16/fp16 on CUDA: flash; this float32 model there: the efficient kernel, a
    # stated fallback)
    few = fused.meta["kernels"]
    assert fused.to_dict()["kernels"] == few
    assert (few == {"cpu-flash": ""}) if device == "cpu" else (set(few) <= {"flash", "efficient"})
    assert (fused.alpha - eager.alpha).abs().max() < tol(device, TOL) and torch.equal(auto.alpha, fused.alpha)
    with tiny_llama.hooks(fwd_hooks=[("blocks.0.attn.hook_pattern", lambda x, hook: x * 0)]):
        hooked = sink_metric(tiny_llama, tokens, k_max=8)  # "auto" must not skip the hook
        assert hooked.meta["path"] == "eager" and "hooks are attached" in hooked.meta["fused_unsupported"]
        assert hooked.alpha[:, 0].abs().max() == 0 < eager.alpha[:, 0].min()  # the hook ran
        with pytest.raises(BackendUnsupported):
            sink_metric(tiny_llama, tokens, path="fused")
    with pytest.raises(ValueError, match="path must be"):
        sink_metric(tiny_llama, tokens, path="flash")


BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "device_type, dtype, d, gqa, masked, name, native, stated",
    [
        ("cuda", BF16, 128, True, False, "flash", "native", False),  # the 8B shape: flash, native GQA, no fallback
        ("cuda", F16, 64, False, False, "flash", "none", False),
        ("cuda", BF16, 128, True, True, "efficient", "repeat", True),  # a sliding window or padding mask
        ("cuda", F32, 64, True, False, "efficient", "repeat", True),  # flash takes 16-bit floats only
        ("cuda", BF16, 12, False, False, "efficient", "none", True),  # head size not a multiple of 8
        ("cuda", BF16, 512, True, False, "efficient", "repeat", True),  # head size above flash's 256
        ("cpu", F32, 8, True, True, "cpu-flash", "native", False),
        ("cpu", BF16, 128, True, False, "cpu-flash", "native", False),
        ("mps", F16, 64, True, False, "reference", "native", True),
    ],
)
def test_sink_kernel_table(device_type, dtype, d, gqa, masked, name, native, stated):
    k = sink_kernel(device_type, dtype, d, gqa=gqa, masked=masked)
    assert (k.name, k.gqa, bool(k.fallback)) == (name, native, stated)
    if stated:  # the fallback says why in words
        assert any(w in k.fallback for w in ("mask", "dtype", "head size", "no fused kernel"))


def test_sink_kernel_table_preferences_and_bad_names():
    assert sink_kernel("cuda", BF16, 128, gqa=True, masked=False, prefer="efficient").name == "efficient"
    assert "asked for" in sink_kernel("cuda", BF16, 128, gqa=True, masked=False, prefer="efficient").fallback
    assert sink_kernel("cuda", BF16, 128, gqa=True, masked=False, prefer="reference").name == "reference"
    assert sink_kernel("cpu", F32, 8, gqa=False, masked=False, prefer="flash").name == "cpu-flash"  # not on a CPU
    with pytest.raises(ValueError, match="prefer must be one of"):
        sink_kernel("cuda", BF16, 128, gqa=True, masked=False, prefer="flashy")


def test_fused_attention_the_reference_kernel_equals_the_table_kernel(device):
    """Every kernel the table can name on this device gives the same output and lse (the reference anywhere)."""
    q, k, v = (x.to(device) for x in _qkv(d=16))
    ref = sink_kernel("mps", q.dtype, 16, gqa=True, masked=False)
    got, want = fused_attention(q, k, v, None, 0.3), fused_attention(q, k, v, None, 0.3, kernel=ref)
    assert all(torch.allclose(a, b, atol=tol(device, 1e-5)) for a, b in zip(got, want))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernel runs on CUDA only")
def test_flash_kernel_native_gqa_lse_on_cuda():
    """bf16, head size 64, 4 query heads per KV head: flash's lse and output against float32 math."""
    q, k, v = (x.cuda().bfloat16() for x in _qkv(B=1, H=8, H_kv=2, T=64, d=64))
    kern = sink_kernel("cuda", torch.bfloat16, 64, gqa=True, masked=False)
    out, lse = fused_attention(q, k, v, None, 0.125, kernel=kern)
    scores = q.float() @ k.float().repeat_interleave(4, 1).transpose(-1, -2) * 0.125
    scores = scores.masked_fill(~_window(64, 64, B=1).cuda(), float("-inf"))
    assert kern.name == "flash" and torch.allclose(lse, scores.logsumexp(-1), atol=2e-2)
    assert torch.allclose(out.float(), scores.softmax(-1) @ v.float().repeat_interleave(4, 1), atol=2e-2)


@pytest.mark.parametrize("backend", ["transformer_lens", "transformers"])
def test_a_reading_hook_runs_where_it_reads_and_raises_if_it_changes_its_activation(tiny_llama, backend, device):
    """``engine.passes.reading``: a marked hook is no edit (the transformers backend keeps the pass), sees the site on
    every backend, and one that returns a change raises there rather than being applied or dropped unannounced."""
    from analysis.engine.passes import Capture, reading, run_pass

    tokens, seen, record = torch.randint(3, 90, (2, 12), device=device), [], {}
    site = "blocks.1.attn.hook_pattern"
    good = reading(lambda x, hook: seen.append((hook.name, tuple(x.shape))))
    run_pass(tiny_llama, tokens, [Capture("blocks.0.hook_resid_post", 0)], fwd_hooks=[(site, good)], backend=backend, record=record)  # fmt: skip
    assert record["backend"] == backend and seen == [(site, (2, tiny_llama.cfg.n_heads, 12, 12))]
    bad = reading(lambda x, hook: x)
    with pytest.raises(RuntimeError, match="blocks.1.attn.hook_pattern marked as reading only"):
        run_pass(tiny_llama, tokens, [Capture("blocks.0.hook_resid_post", 0)], fwd_hooks=[(site, bad)], backend=backend)  # fmt: skip
