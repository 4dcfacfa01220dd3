"""The family matrix: one tiny random model per decoder family, saved to a folder and loaded offline.

For each family: ``load_model(folder)`` works without a network; ``model.family`` states the facts of the
Hugging Face config and modules; per-head alpha_1 of ``sink_metric`` equals Hugging Face eager attention; the
spec's key/query hooks, rotary (dim, pairing, base) and score scale rebuild the attention scores the model
computes (hybrids: on their attention layers, under their true indices). gpt-oss: the learned-sink mass
(1 - row sum) of ``hook_pattern`` equals Hugging Face's. A GGUF file loads like a folder.

Where an analysis does not run on a family yet the case is ``xfail(strict=True)`` with the exact error: when
it is fixed the test turns red and the mark must go.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from analysis import load_model, rotary_base, sink_metric
from analysis.model.families import FamilySpec, get_family
from tests.families import FAMILIES, family_config, layout, make_family_model, reference_attention, write_llama_gguf
from tests.conftest import tol

T = 16  # longer than the sliding windows (8) of Mistral, Gemma 2/3, Starcoder2 and gpt-oss
HYBRIDS = {f for f in FAMILIES if layout(f)["attention"] != tuple(range(family_config(f).num_hidden_layers))}

# Facts each family is known for (the tiny configs in tests/families.py turn each feature on).
# positions, rotary pairing, norm kind, gain offset, norm placement, q/k norm scope, fused QKV, key rotated in
# a hook, learned sinks, gated output, parallel attention + MLP.
EXPECT = {
    "llama": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, False, False, False),
    "mistral": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, False, False, False),
    "qwen2": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, False, False, False),
    "qwen3": ("rotary", "half", "RMSNorm", 0.0, "pre", "head", False, True, False, False, False),
    "gemma": ("rotary", "half", "RMSNorm", 1.0, "pre", None, False, True, False, False, False),
    "gemma2": ("rotary", "half", "RMSNorm", 1.0, "sandwich", None, False, True, False, False, False),
    "gemma3": ("rotary", "half", "RMSNorm", 1.0, "sandwich", "head", False, True, False, False, False),
    "phi": ("rotary", "half", "LayerNorm", 0.0, "pre", None, False, True, False, False, True),
    "phi3": ("rotary", "half", "RMSNorm", 0.0, "pre", None, True, False, False, False, False),
    "olmo2": ("rotary", "half", "RMSNorm", 0.0, "post", "all_heads", False, True, False, False, False),
    "granite": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, False, False, False),
    "stablelm": ("rotary", "half", "LayerNorm", 0.0, "pre", None, False, True, False, False, False),
    "starcoder2": ("rotary", "half", "LayerNorm", 0.0, "pre", None, False, True, False, False, False),
    "gpt2": ("absolute", None, "LayerNorm", 0.0, "pre", None, True, False, False, False, False),
    "gpt_neox": ("rotary", "half", "LayerNorm", 0.0, "pre", None, True, False, False, False, True),
    "gptj": ("rotary", "interleaved", "LayerNorm", 0.0, "pre", None, False, False, False, False, True),
    "opt": ("absolute", None, "LayerNorm", 0.0, "pre", None, False, False, False, False, False),
    "bloom": ("alibi", None, "LayerNorm", 0.0, "pre", None, True, False, False, False, False),
    "falcon": ("rotary", "half", "LayerNorm", 0.0, "pre", None, True, False, False, False, True),
    "gpt_oss": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, True, False, False),
    "qwen3_next": ("rotary", "half", "RMSNorm", 1.0, "pre", "head", False, True, False, True, False),
    "qwen3_5": ("rotary", "half", "RMSNorm", 1.0, "pre", "head", False, True, False, True, False),
    "jamba": ("none", None, "RMSNorm", 0.0, "pre", None, False, False, False, False, False),
    "deepseek_v3": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, False, False, False),
    "qwen3_moe": ("rotary", "half", "RMSNorm", 0.0, "pre", "head", False, True, False, False, False),
    "qwen2_moe": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, False, False, False),
    "mixtral": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, False, False, False),
    "phimoe": ("rotary", "half", "LayerNorm", 0.0, "pre", None, False, False, False, False, False),
    "olmoe": ("rotary", "half", "RMSNorm", 0.0, "pre", "all_heads", False, True, False, False, False),
    "smollm3": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, False, False, False),
    "llama4_text": ("rotary", "interleaved", "RMSNorm", 0.0, "pre", None, False, False, False, False, False),
    "glm4": ("rotary", "interleaved", "RMSNorm", 0.0, "sandwich", None, False, True, False, False, False),
    "cohere": ("rotary", "interleaved", "LayerNorm", 0.0, "pre", None, False, True, False, False, True),
    "granitemoe": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, False, False, False),
    "falcon_h1": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, False, False, False),
    "bamba": ("rotary", "half", "RMSNorm", 0.0, "pre", None, False, True, False, False, False),
}
NORM_WITHOUT_BIAS = {"cohere"}  # LayerNorm without a bias
# Families on TransformerLens' generic AttentionBridge: Hugging Face computes the attention, the pattern is reported after.
GENERIC_ATTENTION = {"gptj", "opt", "jamba", "llama4_text", "phimoe"}
assert set(EXPECT) == set(FAMILIES)


@pytest.fixture(scope="session")
def family_models(family_dir, family_bridge):
    """family -> (bridge loaded from its saved folder, the HF model reloaded from it with eager attention)."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[family] = AutoModelForCausalLM.from_pretrained(
                    family_dir(family), attn_implementation="eager", dtype=torch.float32
                ).eval()
        return family_bridge(family), cache[family]

    return get


def _tokens(seed: int = 0, n: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (n, T), generator=g)


def _hf_attentions(hf, tokens) -> list[torch.Tensor]:
    with torch.no_grad():
        out = hf(tokens, output_attentions=True)
    return [a for a in out.attentions if a is not None]


def _alpha_1(pattern: torch.Tensor) -> torch.Tensor:
    """(N, H, T, T) -> (N, H): mean attention key 1 gets from every query."""
    return pattern[..., :, 0].mean(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_offline_with_a_family_spec(family, family_models, no_network, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model, hf = family_models(family)
    spec = model.family
    assert isinstance(spec, FamilySpec) and get_family(model) is spec
    config = hf.config
    (positions, style, norm_kind, offset, placement, qk_scope, fused, key_rotated, sinks, gated, parallel) = EXPECT[
        family
    ]
    assert (spec.positions, spec.rotary_style) == (positions, style)
    norm = spec.norm or spec.post_norm
    assert (norm.kind, norm.gain_offset, spec.norm_placement) == (norm_kind, offset, placement)
    assert norm.bias == (norm_kind == "LayerNorm" and family not in NORM_WITHOUT_BIAS)
    assert spec.qk_norm_scope == qk_scope and (spec.qk_norm is None) == (qk_scope is None)
    assert (spec.fused_qkv, spec.key_rotated, spec.learned_sinks, spec.gate is not None, spec.parallel_block) == (
        fused,
        key_rotated,
        sinks,
        gated,
        parallel,
    )
    # Against the HF config: heads, layers, window, rotary base and dim.
    n_heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    n_kv = getattr(config, "num_key_value_heads", None) or (1 if getattr(config, "multi_query", False) else n_heads)
    assert (spec.n_heads, spec.n_kv_heads, spec.d_head) == (n_heads, n_kv, 16)
    types = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None)
    lay = layout(family)
    assert spec.attention_layers == lay["attention"]  # the layout of the released checkpoints (tests/families.py)
    assert set(spec.skipped_layers) == set(range(config.num_hidden_layers)) - set(lay["attention"])
    assert spec.nope_layers == lay["nope"] and all(l not in spec.rotary_bases for l in spec.nope_layers)
    if family in HYBRIDS:
        assert all(types[l] in ("linear_attention", "mamba", "mlp") for l in spec.skipped_layers)
        assert spec.skipped_text() and spec.skipped_layers[min(spec.skipped_layers)] in spec.text()
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    assert spec.sliding_window == window
    if window:
        expected = [l for l in spec.attention_layers if types is None or types[l] == "sliding_attention"]
        assert list(spec.sliding_layers) == expected
    if positions == "rotary":
        params = getattr(config, "rope_parameters", None) or {}
        if "full_attention" in params:  # Gemma 3: one theta per layer type
            for l in spec.attention_layers:
                assert spec.rotary_bases[l] == params[types[l]]["rope_theta"]
            params = params["full_attention"]
        theta = params.get("rope_theta", 10000.0)  # GPT-J: fixed 10000
        assert spec.rotary_base == theta == rotary_base(model)
        frac = params.get("partial_rotary_factor", 1.0)
        assert spec.rotary_dim == (
            getattr(config, "rotary_dim", None) or getattr(config, "qk_rope_head_dim", None) or int(16 * frac)
        )  # MLA: the decoupled rotary key's dims
    else:
        assert spec.rotary_base is None and rotary_base(model) is None
    assert spec.attn_scale == pytest.approx(getattr(config, "attention_multiplier", 16**-0.5))
    # TransformerLens' generic AttentionBridge reports the pattern after the output (read-only hook).
    assert spec.pattern_live == (family not in GENERIC_ATTENTION)
    assert (spec.scores_hook(spec.attention_layers[0]) is None) == (family in GENERIC_ATTENTION)
    assert spec.text().startswith(config.model_type) and spec.to_dict()["family"] == config.model_type
    assert no_network == []


@pytest.mark.parametrize("family", FAMILIES)
def test_sink_alpha_equals_hf_eager_attention(family, family_models, device):
    """alpha_1 per head equals HF eager attention on every attention layer; a hybrid's result holds its attention
    layers only, under their true indices, and says which layers it skipped."""
    model, hf = family_models(family)
    tokens = _tokens()
    res = sink_metric(model, tokens, k_max=1)
    hf_alpha = torch.stack([_alpha_1(a) for a in _hf_attentions(hf, tokens)], 1)  # (N, L_attn, H)
    assert res.layers == list(model.family.attention_layers)
    assert res.per_layer(1).layer.tolist() == res.layers
    assert res.alpha[..., 0].shape == hf_alpha.shape
    torch.testing.assert_close(res.alpha[..., 0], hf_alpha, atol=tol(device, 1e-5), rtol=0)
    if family in HYBRIDS:
        skipped = sorted(model.family.skipped_layers)
        assert f"Layers {skipped} skipped" in res.skipped and res.skipped in res.text()
    else:
        assert res.skipped == ""


def _rotate(x: torch.Tensor, spec: FamilySpec, layer: int, scaled=None) -> torch.Tensor:
    """A reference rotary for (B, T, heads, d) at positions 0..T-1: the spec's dim, pairing and base, or a scaled rope
    type's frequencies and cos/sin scale read here from the Hugging Face model's rotary module (``scaled``)."""
    rd, base = spec.rotary_dim, spec.rotary_bases[layer]
    inv = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)) if scaled is None else scaled.inv_freq
    ang = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv[None]  # (T, rd/2)
    xr, xp = x[..., :rd].double(), x[..., rd:].double()
    if spec.rotary_style == "interleaved":
        cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
        rot = torch.stack([-xr[..., 1::2], xr[..., ::2]], -1).flatten(-2)
    else:
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        rot = torch.cat([-xr[..., rd // 2 :], xr[..., : rd // 2]], -1)
    out = (xr * cos[:, None] + rot * sin[:, None]) * (1.0 if scaled is None else scaled.attention_scaling)
    return torch.cat([out, xp], -1).float()


@pytest.mark.parametrize(
    "family",
    [f for f in FAMILIES if EXPECT[f][0] != "alibi"]
    + ["llama4_qk_norm", "llama4_scout", "phi3_longrope", "cohere_qk_norm"],
)
def test_spec_rebuilds_the_attention_pattern(family, family_models, device):
    """Queries and keys from the spec's hooks, rotated where the spec says so (its rotary dim, pairing and base),
    times its score scale, soft-capped, masked (causal, sliding window) and softmaxed with the learned sink
    where it says so, give the model's ``hook_pattern``; and ``hook_attn_scores`` where the spec names it."""
    model, hf = family_models(family)
    spec = model.family
    got = {}
    scaled = (
        next(m for m in hf.modules() if hasattr(m, "inv_freq")) if spec.rope_type not in (None, "default") else None
    )

    def keep(name):
        def fn(x, hook):
            got[name] = x.detach().cpu()

        return fn

    hooks = []
    for l in spec.attention_layers:
        hooks += [
            (spec.query_hook(l), keep(("q", l))),
            (spec.key_hook(l), keep(("k", l))),
            (spec.pattern_hook(l), keep(("p", l))),
        ]
        if spec.scores_hook(l):
            hooks.append((spec.scores_hook(l), keep(("scores", l))))
    with torch.no_grad():
        model.run_with_hooks(_tokens(1, 2).to(device), fwd_hooks=hooks)
    for layer in spec.attention_layers:  # Gemma 3: sliding layers rotate with another base
        _check_layer(spec, model, layer, {k[0]: v for k, v in got.items() if k[1] == layer}, device, scaled)


@pytest.mark.parametrize("family", ["llama4_scout", "phi3_longrope", "gemma3_linear"])
def test_a_scaled_rope_types_frequencies_are_the_models_own(family, family_models):
    """The spec holds each rotary layer's frequencies and cos/sin scale as the model's rotary module keeps them (the
    bridge wraps that module: its buffers sit under ``_original_component``), per layer type where they differ
    (Gemma 3: scaled on its full-attention layers only)."""
    model, hf = family_models(family)
    spec, rot = model.family, hf.model.rotary_emb
    types = getattr(hf.config, "layer_types", None)
    assert sorted(spec.rope_freqs) == sorted(spec.rotary_bases) and spec.rope_type != "default"
    for layer, (inv, scale) in spec.rope_freqs.items():
        kind = f"{types[layer]}_" if types and hasattr(rot, f"{types[layer]}_inv_freq") else ""  # Llama 4: one
        torch.testing.assert_close(torch.tensor(inv, dtype=torch.float32), getattr(rot, f"{kind}inv_freq").float())
        assert scale == pytest.approx(getattr(rot, f"{kind}attention_scaling"))
    assert (spec.rope_freqs[0][1] != 1.0) == (family == "phi3_longrope")  # longrope's scale: 1.13


def _check_layer(spec, model, layer, got, device, scaled=None):
    q, k = got["q"], got["k"]
    assert q.shape[-1] == k.shape[-1] == spec.d_head  # the gated families' hook_q holds query and gate
    if spec.rotary_at(layer) and not spec.key_rotated:  # NoPE layers: no rotary
        q, k = _rotate(q, spec, layer, scaled), _rotate(k, spec, layer, scaled)
    if spec.qk_l2_norm and spec.rotary_at(layer):  # Llama 4 as released: then each head's q and k over their rms
        q, k = (x * x.double().pow(2).mean(-1, keepdim=True).add(spec.norm.eps).rsqrt() for x in (q, k))
    scores, seen, pattern = reference_attention(spec, model, layer, q, k)
    if "scores" in got:
        torch.testing.assert_close(
            scores[..., seen].float(), got["scores"][..., seen].float(), atol=tol(device, 1e-4), rtol=1e-4
        )
    torch.testing.assert_close(pattern.float(), got["p"].float(), atol=tol(device, 1e-5), rtol=0)


def test_gpt_oss_learned_sink_mass_equals_hf(family_models, device):
    model, hf = family_models("gpt_oss")
    tokens = _tokens(2)
    patterns = {}

    def keep(x, hook):
        patterns[hook.name] = x.detach().cpu()

    with torch.no_grad():
        model.run_with_hooks(
            tokens.to(device),
            fwd_hooks=[(f"blocks.{l}.attn.hook_pattern", keep) for l in model.family.attention_layers],
        )
    ours = torch.stack([1 - p.sum(-1) for p in patterns.values()], 1)  # (N, L, H, T)
    theirs = torch.stack([1 - a.sum(-1) for a in _hf_attentions(hf, tokens)], 1)
    torch.testing.assert_close(ours, theirs, atol=tol(device, 1e-6), rtol=0)
    assert float(ours.min()) > 0.05  # the sink takes real mass: a random sink logit against 16 keys at most


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_gate_hook_fires_with_one_gate_per_head_dim(family, family_models, device):
    model, _ = family_models(family)
    spec = model.family
    got = []
    with torch.no_grad():
        model.run_with_hooks(
            _tokens(3, 2).to(device),
            fwd_hooks=[(spec.gate_hook(l), lambda x, hook: got.append(x.shape)) for l in spec.attention_layers],
        )
    assert got == [torch.Size([2, T, spec.n_heads * spec.d_head])] * len(spec.attention_layers)
    with pytest.raises(ValueError, match=r"layer 0 .* not an attention layer \(linear attention"):
        spec.key_hook(0)


def test_skipped_layer_names_the_reason(family_models):
    model, _ = family_models("jamba")
    with pytest.raises(ValueError, match="Mamba state-space layer"):
        model.family.key_hook(0)  # layer 0 of the tiny Jamba is Mamba (attention: layer 2)


def test_bamba_mamba_layers_are_skipped_as_mamba2(family_models):
    """Bamba's config calls its Mamba-2 layers "linear_attention"; the spec names them for what they are."""
    model, _ = family_models("bamba")
    skipped = model.family.skipped_layers
    assert sorted(skipped) == [0, 1, 3] and all(r.startswith("Mamba-2 state-space layer") for r in skipped.values())


def test_gguf_file_loads_like_a_folder(tmp_path, no_network, monkeypatch, device):
    """A tiny Llama written to GGUF (llama.cpp's layout) loads with ``load_model(path)`` and gives the source
    model's logits."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    source = make_family_model("llama")
    path = write_llama_gguf(source, tmp_path / "tiny-llama.gguf")
    model = load_model(str(path), device=device)
    tokens = _tokens(4, 2)
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens.to(device)).cpu(), source(tokens).logits, atol=tol(device, 1e-5), rtol=0
        )
    assert model.family.family == "llama" and rotary_base(model) == family_config("llama").rope_parameters["rope_theta"]
    assert model.tokenizer.convert_ids_to_tokens([1, 5]) == ["<s>", "w2"]
    assert no_network == []


def test_gguf_path_that_is_not_gguf_fails_clearly(tmp_path):
    from analysis import ModelNotFoundError

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ModelNotFoundError, match="could not read .*broken.gguf as a GGUF model"):
        load_model(str(bad), device="cpu")


def test_nemotron_h_attention_is_not_exposed_by_the_bridge(tmp_path):
    """Nemotron-H is not in the matrix: TransformerLens' bridge wraps every layer's mixer, attention included, as one
    generic SSM2MixerBridge, so no layer has an attention-pattern hook (docs/families.md). The loader reads its family
    spec, which says every layer is skipped and why, and the model contract refuses it at load with that reason;
    when the bridge exposes the attention this fails and Nemotron-H joins."""
    from analysis.model.contract import ModelContractError
    from tests.families import NOT_IN_MATRIX, make_family_dir

    assert "nemotron_h" in NOT_IN_MATRIX
    with warnings.catch_warnings(), pytest.raises(ModelContractError) as err:
        warnings.simplefilter("ignore")
        load_model(str(make_family_dir("nemotron_h", tmp_path / "nemotron_h")), device="cpu")
    msg = str(err.value)
    assert "no layer exposes an attention pattern" in msg and "0 attention layers of 4" in msg
    assert "attention-pattern hook" in msg and "docs/families.md" in msg


def test_gemma3n_and_gemma4_text_limits(tmp_path):
    """Gemma 3n and Gemma 4 (text) are not in the matrix (docs/families.md). Gemma 3n: the tiny config in the E2B
    layout is valid (KV shared by the last layers, each type stored by an earlier layer), but TransformerLens' bridge
    has no adapter for the text model (Gemma3nForCausalLM). Gemma 4: the bridge loads it and the spec reads its 5
    sliding : 1 global layout and the key path of a sliding layer, but the global layer's head (32 dims) is wider
    than the spec's one head dim (16), so its weights cannot be split into heads. When the bridge or the spec gains
    per-layer head dims, this fails and the family joins the matrix."""
    import transformers
    from transformer_lens.model_bridge.sources._hf_format import determine_architecture_from_hf_config

    from analysis.model.key_path import key_path
    from tests.families import family_config, make_family_dir

    g3n = family_config("gemma3n_text")
    assert g3n.kv_sharing_modes == [None] * 3 + ["store"] * 2 + ["reuse"] * 5
    g3n.architectures = ["Gemma3nForCausalLM"]
    with pytest.raises(ValueError, match="Could not determine supported architecture"):
        determine_architecture_from_hf_config(g3n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(str(make_family_dir("gemma4_text", tmp_path / "gemma4_text")), device="cpu")
    spec, hf = model.family, model.original_model
    assert isinstance(hf, transformers.Gemma4ForCausalLM)
    assert spec.attention_layers == tuple(range(6)) and spec.sliding_layers == (0, 1, 2, 3, 4)
    assert hf.model.layers[5].self_attn.head_dim == 32 and spec.d_head == 16
    assert key_path(model, 0).W_K.shape[-1] == 16  # a sliding layer: its norm gains are read through the wrapped module
    with pytest.raises(Exception, match="attention geometry differs from the config-level scalars"):
        key_path(model, 5)  # the global layer's wider head: the bridge's weights split by the one config head dim
