"""The key path of every family: the first key the mechanism analyses rebuild, the queries and keys they read, and
a planted first-token spike they find, on one tiny random model per decoder family (tests/families.py).

1. ``norm_gain``'s key path (input norm with gain w or 1 + w and bias, W_K / b_K of a fused or split projection,
   the key norm per head or over all heads, the rotary per the spec) rebuilds the key the attention uses
   (``spec.key_hook``, rotated per the spec where the bridge does not rotate it) on every attention layer, and the
   trace's own checks (projection, key, scores, pattern) pass.
2. The queries and keys ``qk`` and ``key_manifold`` read, times ``spec.attn_scale`` and soft-capped, give the
   model's scores and pattern (causal mask, sliding window, learned sinks) on every non-ALiBi family; the
   analyses' statistics are those of these vectors.
3. A spike planted on the first token's residual (+400 / -250 in dims 7 and 21 after layer 0) is found by
   ``massive_activations``, and ``norm_gain_trace`` on the next attention layer attributes the first key to it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from analysis import load_model
from analysis.model.hooks import ModelContractError, kv_view, model_device
from analysis.model.rotary import rotate_as_spec
from tests.families import FAMILIES, matrix, reference_attention
from tests.conftest import tol

T = 12  # longer than the sliding windows (8) of Mistral, Gemma 2/3, Starcoder2 and gpt-oss
SPIKE = {7: 400.0, 21: -250.0}
KEY_NORM = {
    "qwen3",
    "gemma3",
    "olmo2",
    "qwen3_next",
    "qwen3_5",
    "qwen3_moe",
    "olmoe",
    "deepseek_v3",
    "llama4_qk_norm",
    "llama4_scout",
    "cohere_qk_norm",
}  # DeepSeek-V3: kv_a_layernorm on the key latent; Llama 4: q and k L2-normalised (no gain) after the rotary
ALL_HEADS_KEY_NORM = {"olmo2", "olmoe"}
SCALED_ROPE = ["llama4_scout", "phi3_longrope"]  # llama3's and longrope's frequencies (and longrope's cos/sin scale)
# as released: Llama 4's L2 q/k norm, Command R+'s q/k LayerNorms with a gain per head
RELEASED = ["llama4_qk_norm", "cohere_qk_norm", *SCALED_ROPE]
NOT_ALIBI = [f for f in FAMILIES if f != "bloom"] + RELEASED


@pytest.fixture(scope="module")
def family_dirs(family_dir):
    """family -> a saved tiny model folder (conftest's, built once per session)."""
    return family_dir


@pytest.fixture(scope="module")
def family_models(family_bridge):
    """family -> the bridge loaded from its folder (conftest's, shared; tests here add no hooks to it)."""
    return family_bridge


def _tokens(seed: int = 0, n: int = 3) -> torch.Tensor:
    return torch.randint(3, 96, (n, T), generator=torch.Generator().manual_seed(seed))


def _capture(model, tokens, names: list[str]) -> dict[str, torch.Tensor]:
    """The activations of ``names`` over ``tokens``, on the CPU."""
    got = {}

    def keep(x, hook):
        got[hook.name] = x.detach().cpu()

    hooks = list(dict.fromkeys(names))
    with torch.no_grad():
        model.run_with_hooks(tokens.to(model_device(model)), fwd_hooks=[(n, keep) for n in hooks])
    canonical = {n: getattr(model.hook_dict[n], "name", n) for n in hooks}
    return {n: got[canonical[n]] for n in hooks}


@pytest.mark.parametrize("family", matrix("key_path", ModelContractError) + RELEASED)
def test_rebuilt_first_key_equals_the_key_the_attention_uses(family, family_models, device):
    from analysis.model.key_path import key_path
    from analysis.chain.norm_gain import norm_gain_trace

    model = family_models(family)
    spec = model.family
    tokens = _tokens()
    for layer in spec.attention_layers:
        path = key_path(model, layer)
        got = _capture(model, tokens, [f"blocks.{layer}.hook_resid_pre", spec.key_hook(layer)])
        pos = torch.arange(T)
        rebuilt = path.keys_from_resid(got[f"blocks.{layer}.hook_resid_pre"], pos)  # (B, T, H_kv, d)
        used = kv_view(rotate_as_spec(got[spec.key_hook(layer)], spec, layer), rebuilt.shape[2])
        torch.testing.assert_close(rebuilt[:, 0], used[:, 0], atol=tol(device, 1e-4), rtol=1e-4)  # the first key
        torch.testing.assert_close(rebuilt, used, atol=tol(device, 1e-4), rtol=1e-4)  # and every other one
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = norm_gain_trace(model, tokens, layer, spike_dims=[7, 21])
        r = tr.rebuild
        assert r["key_rel_err"] < 1e-5 and r["final_key_max_abs_err"] < 1e-4 and r["pattern_max_abs_err"] < 1e-5
        assert r["final_key_hook"] == spec.key_hook(layer)
        assert r["score_max_abs_err"] is None if spec.scores_hook(layer) is None else r["score_max_abs_err"] < 1e-4
        assert (tr.norm_kind == "none") == (family == "olmo2")  # OLMo-2: no norm before attention ...
        normed = family in KEY_NORM and (not spec.qk_l2_norm or spec.rotary_at(layer))  # Llama 4 NoPE: none
        assert (tr.key_norm is not None) == normed  # ... but a key norm the trace follows
        if normed:
            assert "The keys then pass" in tr.text() and tr.heads["knorm_scale_first"].notna().all()
            assert ("all heads together" in tr.key_norm) == (family in ALL_HEADS_KEY_NORM)
        assert f"Key path of layer {layer}" in tr.text()


@pytest.mark.parametrize("family", ["gemma", "qwen3_next"])
def test_gain_one_plus_w_matters(family, family_models):
    """Gemma-style gains are 1 + w (w is zero at init): reading the gain as w would zero the key."""
    from analysis.model.key_path import key_path

    model = family_models(family)
    layer = model.family.attention_layers[0]
    path = key_path(model, layer)
    assert path.norm.offset == 1.0 and torch.equal(path.norm.gain, 1.0 + path.norm.w)
    h = _capture(model, _tokens(), [f"blocks.{layer}.hook_resid_pre"])[f"blocks.{layer}.hook_resid_pre"]
    path.norm.offset = 0.0
    try:
        assert float(path.keys_from_resid(h, torch.arange(T)).abs().max()) < 1e-6
    finally:
        path.norm.offset = 1.0


def _check_pattern(spec, model, layer, q, k, got, device):
    """q (B,T,H,d), k (B,T,H_kv,d) as the analyses read them -> scores and pattern of the model."""
    scores, seen, pattern = reference_attention(spec, model, layer, q, k)
    if spec.scores_hook(layer):
        torch.testing.assert_close(
            scores[..., seen].float(),
            got[spec.scores_hook(layer)][..., seen].float(),
            atol=tol(device, 1e-4),
            rtol=1e-4,
        )
    torch.testing.assert_close(pattern.float(), got[spec.pattern_hook(layer)].float(), atol=tol(device, 1e-5), rtol=0)


@pytest.mark.parametrize("family", NOT_ALIBI)
def test_qk_and_key_manifold_read_the_vectors_the_attention_uses(family, family_models, device):
    from analysis.chain.key_manifold import first_key_manifold, key_manifold_accumulator
    from analysis.chain.qk import QKAccumulator, qk_angles

    model = family_models(family)
    spec = model.family
    tokens = _tokens(1)
    qk_acc = QKAccumulator(model)
    km_acc = key_manifold_accumulator(model, tokens.shape, scatter_heads=None)
    assert qk_acc.layers == km_acc.layers == list(spec.attention_layers)  # hybrids: attention layers only
    names = [n for acc in (qk_acc, km_acc) for l in spec.attention_layers for n in acc.hooks()[l].values()]
    names += [spec.pattern_hook(l) for l in spec.attention_layers]
    names += [spec.scores_hook(l) for l in spec.attention_layers if spec.scores_hook(l)]
    got = _capture(model, tokens, names)
    for layer in spec.attention_layers:
        for acc in (qk_acc, km_acc):
            acts = {key: got[name] for key, name in acc.hooks()[layer].items()}
            q, k = acc.vectors(layer, acts)
            _check_pattern(spec, model, layer, q, k, got, device)
    # The analyses' statistics are those of these vectors: |k_1| per head.
    ang, km = qk_angles(model, tokens), first_key_manifold(model, tokens, scatter_heads=None)
    assert ang.layers == km.layers == list(spec.attention_layers)
    for i, layer in enumerate(spec.attention_layers):
        _, k = km_acc.vectors(layer, {"k": got[km_acc.hooks()[layer]["k"]]})
        k1 = k[:, 0].norm(dim=-1).mean(0)  # (H_kv,)
        torch.testing.assert_close(
            ang.k_first_norm[i], k1.repeat_interleave(spec.n_heads // k.shape[2]), rtol=1e-4, atol=1e-6
        )
        torch.testing.assert_close(
            torch.tensor(km.table[km.table.layer == layer].k1_norm.to_numpy(), dtype=torch.float32),
            k1,
            rtol=1e-4,
            atol=1e-6,
        )
    if spec.skipped_layers:
        assert spec.skipped_text() and "skipped" in ang.text() and "skipped" in km.text()


def _add_spike(resid, hook):
    out = resid.clone()
    for d, v in SPIKE.items():
        out[:, 0, d] += v
    return out


@pytest.mark.parametrize("family", matrix("key_path", ModelContractError))
def test_planted_spike_is_found_and_drives_the_first_key(family, family_dirs, device):
    from analysis.chain.massive import massive_activations
    from analysis.chain.norm_gain import norm_gain_trace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(str(family_dirs(family)), device=device)  # its own copy: the spike hook stays on it
    model.add_perma_hook("blocks.0.hook_resid_post", _add_spike)
    spec = model.family
    layer = min(l for l in spec.attention_layers if l > 0)  # the first attention layer reading the spike
    tokens = _tokens(2, 4)
    # 100x the median, not the default 1000x: Gemma scales its embeddings by sqrt(d_model), so its residual's median
    # is ~1 and a spike of 400 is ~400x it
    ma = massive_activations(model, tokens, ratio_threshold=100)
    assert set(SPIKE) <= set(ma.first_token_dims.get(0, []))
    tr = norm_gain_trace(model, tokens, layer, ratio_threshold=100)
    assert tr.has_spike and set(SPIKE) <= set(tr.spike_dims)
    assert set(tr.top_dims(2)) == set(SPIKE)  # the first key comes from the spike dims first
    assert tr.key_dims.set_index("dim").loc[list(SPIKE), "spike_dim"].all()
    assert tr.rebuild["final_key_max_abs_err"] < 1e-3 * max(1.0, float(tr.heads["k1_norm"].max()))
