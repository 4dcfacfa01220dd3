"""The model: TransformerBridge hook names/shapes, LLaMA equivalence, causality, weights, errors."""

import pytest
import torch

from analysis.model.hooks import model_device
from analysis.train import ModelConfig, SinkLM, available_attention
from tests.conftest import tol

# Hook names the brief requires to match TransformerLens' TransformerBridge on a LLaMA model.
BLOCK_HOOKS = [
    "hook_resid_pre",
    "hook_resid_mid",
    "hook_resid_post",
    "hook_attn_out",
    "hook_mlp_out",
    "ln1.hook_scale",
    "ln1.hook_normalized",
    "ln2.hook_scale",
    "ln2.hook_normalized",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_rot_q",
    "attn.hook_rot_k",
    "attn.hook_attn_scores",
    "attn.hook_pattern",
    "attn.hook_z",
    "mlp.hook_pre",
    "mlp.hook_post",
]
TOP_HOOKS = ["hook_embed", "ln_final.hook_scale", "ln_final.hook_normalized"]
L, D, H, HKV, V, DMLP = 2, 64, 4, 2, 100, 128


def required_names(n_layers=L):
    return TOP_HOOKS + [f"blocks.{l}.{h}" for l in range(n_layers) for h in BLOCK_HOOKS]


@pytest.fixture(scope="module")
def bridge_and_hf(tmp_path_factory, device):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformer_lens import TransformerBridge

    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=V,
            hidden_size=D,
            intermediate_size=DMLP,
            num_hidden_layers=L,
            num_attention_heads=H,
            num_key_value_heads=HKV,
            max_position_embeddings=32,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
        )
    ).eval()
    hf.save_pretrained(d)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="t1", eos_token="t2", unk_token="t0", pad_token="t3"
    ).save_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    hf = hf.to(device)  # the bridge records the device of a model passed in but does not move it
    bridge = TransformerBridge.boot_transformers(str(d), hf_model=hf, tokenizer=tok, device=device)
    return bridge, hf


def sink_lm_from_hf(hf) -> SinkLM:
    """Copy a LlamaForCausalLM's weights into SinkLM (TransformerLens layout), on the LlamaForCausalLM's device."""
    c = hf.config
    model = SinkLM(
        ModelConfig(
            d_vocab=V,
            n_ctx=32,
            d_model=D,
            n_layers=L,
            n_heads=H,
            n_key_value_heads=HKV,
            d_mlp=DMLP,
            eps=c.rms_norm_eps,
            rotary_base=10000.0,
        )
    )
    dh = D // H
    with torch.no_grad():
        model.embed.W_E.copy_(hf.model.embed_tokens.weight)
        model.unembed.W_U.copy_(hf.lm_head.weight.T)
        model.ln_final.w.copy_(hf.model.norm.weight)
        for l, layer in enumerate(hf.model.layers):
            blk, a = model.blocks[l], layer.self_attn
            blk.ln1.w.copy_(layer.input_layernorm.weight)
            blk.ln2.w.copy_(layer.post_attention_layernorm.weight)
            blk.attn.W_Q.copy_(a.q_proj.weight.T.reshape(D, H, dh).permute(1, 0, 2))
            blk.attn.W_K.copy_(a.k_proj.weight.T.reshape(D, HKV, dh).permute(1, 0, 2))
            blk.attn.W_V.copy_(a.v_proj.weight.T.reshape(D, HKV, dh).permute(1, 0, 2))
            blk.attn.W_O.copy_(a.o_proj.weight.T.reshape(H, dh, D))
            blk.mlp.W_gate.copy_(layer.mlp.gate_proj.weight.T)
            blk.mlp.W_in.copy_(layer.mlp.up_proj.weight.T)
            blk.mlp.W_out.copy_(layer.mlp.down_proj.weight.T)
    return model.eval().to(hf.device)


def run_cache(model, tokens, names):
    """Logits and the named hooks' values over ``tokens`` (moved to the model's device), on the CPU."""
    cache = {}
    hooks = [(n, (lambda n: lambda x, hook: cache.__setitem__(n, x.detach().cpu()))(n)) for n in names]
    logits = model.run_with_hooks(tokens.to(model_device(model)), fwd_hooks=hooks)
    return logits.cpu(), cache


def test_hook_names_and_shapes_match_transformer_bridge(bridge_and_hf):
    bridge, hf = bridge_and_hf
    model = sink_lm_from_hf(hf)
    tokens = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(0))
    names = required_names()
    assert set(names) <= set(bridge.hook_dict), sorted(set(names) - set(bridge.hook_dict))
    assert set(names) <= set(model.hook_dict), sorted(set(names) - set(model.hook_dict))
    _, ours = run_cache(model, tokens, names)
    _, theirs = run_cache(bridge, tokens, names)
    assert {n: tuple(ours[n].shape) for n in names} == {n: tuple(theirs[n].shape) for n in names}


def test_same_weights_give_the_bridges_logits_and_activations(bridge_and_hf):
    """With LLaMA weights copied in, every required hook carries the bridge's values (RoPE convention,
    GQA head mapping, norm scale convention, SwiGLU hook placement)."""
    bridge, hf = bridge_and_hf
    model = sink_lm_from_hf(hf)
    tokens = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    names = required_names()
    logits, ours = run_cache(model, tokens, names)
    ref_logits, theirs = run_cache(bridge, tokens, names)
    atol = tol(str(hf.device.type), 1e-4)  # two implementations: on CUDA their kernels sum in other orders
    torch.testing.assert_close(logits, ref_logits, atol=atol, rtol=1e-4)
    for n in names:
        a, b = ours[n], theirs[n]
        if n.endswith("hook_attn_scores"):  # masked entries: both use a huge negative number
            keep = torch.tril(torch.ones(7, 7, dtype=torch.bool))
            a, b = a[..., keep], b[..., keep]
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=n)


def test_weights_and_cfg_are_exposed_like_the_bridge(bridge_and_hf):
    bridge, hf = bridge_and_hf
    model = sink_lm_from_hf(hf)
    for ours, theirs in ((model, bridge),):
        a, b = ours.blocks[0].attn, theirs.blocks[0].attn
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            assert getattr(a, name).shape == getattr(b, name).shape, name
            torch.testing.assert_close(getattr(a, name).detach(), getattr(b, name).detach())
        assert a.b_Q is None and a.b_K is None and a.b_V is None
        assert ours.blocks[0].ln1.w.shape == (D,) and ours.blocks[0].ln1.b is None
        assert ours.W_E.shape == theirs.W_E.shape and ours.W_U.shape == theirs.W_U.shape
    for attr in (
        "n_layers",
        "n_heads",
        "n_key_value_heads",
        "d_model",
        "d_head",
        "d_vocab",
        "positional_embedding_type",
        "normalization_type",
    ):
        assert getattr(model.cfg, attr) == getattr(bridge.cfg, attr), attr
    assert model.cfg.rotary_base == 10000.0 and model.cfg.attention == "softmax"
    ln = SinkLM(ModelConfig(normalization_type="LN"))
    assert ln.blocks[0].ln1.b.shape == (64,)


def test_gqa_query_head_reads_kv_head_h_div_group(device):
    torch.manual_seed(0)
    model = SinkLM(ModelConfig(d_vocab=11, n_heads=4, n_key_value_heads=2, d_model=32, attn_impl="eager")).to(device)
    # zero the values of kv head 1: query heads 2 and 3 (h // 2 == 1) must output zeros, heads 0, 1 not
    with torch.no_grad():
        model.blocks[0].attn.W_V[1].zero_()
    _, cache = run_cache(model, torch.randint(0, 11, (1, 5)), ["blocks.0.attn.hook_z"])
    z = cache["blocks.0.attn.hook_z"]
    assert z[:, :, 2:].abs().max() == 0 and z[:, :, :2].abs().max() > 0


VARIANTS = (
    [dict(attention=a) for a in available_attention()]
    + [dict(positional_embedding_type=pe) for pe in ("none", "learned", "sinusoidal", "alibi", "relative")]
    + [
        dict(norm_position="post"),
        dict(normalization_type="LN"),
        dict(act_fn="gelu"),
        dict(act_fn="relu"),
        dict(sliding_window=3),
        dict(attention="sink-token", positional_embedding_type="alibi"),
        dict(attention="sink-token", norm_position="post", positional_embedding_type="relative"),
        dict(tie_embeddings=True),
        dict(n_key_value_heads=1),
    ]
)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
def test_no_output_depends_on_a_later_token(variant, device):
    """d logits[:, i] / d embedding[:, j] is zero for every j > i (and non-zero for some j <= i)."""
    torch.manual_seed(0)
    T = 6
    model = SinkLM(ModelConfig(d_vocab=17, n_ctx=8, d_model=32, n_layers=2, n_heads=4, attn_impl="eager", **variant))
    model = model.to(device)
    tokens = torch.randint(0, 17, (2, T), generator=torch.Generator().manual_seed(0)).to(device)
    leaf = {}

    def grab(x, hook):
        x = x.detach().requires_grad_(True)
        leaf["x"] = x
        return x

    for i in range(T):
        logits = model.run_with_hooks(tokens, fwd_hooks=[("hook_embed", grab)])
        logits[:, i].sum().backward()
        g = leaf["x"].grad.abs().sum(dim=(0, 2))
        assert torch.all(g[i + 1 :] == 0), (i, g)
        assert g[: i + 1].sum() > 0


def test_hooks_shapes_for_variants(device):
    torch.manual_seed(0)
    model = SinkLM(
        ModelConfig(
            d_vocab=17, n_ctx=8, d_model=32, n_heads=4, attention="kv-bias", positional_embedding_type="learned"
        )
    ).to(device)
    names = [
        "hook_pos_embed",
        "blocks.0.attn.hook_sink_pattern",
        "blocks.0.attn.hook_pattern",
        "blocks.0.attn.hook_raw_pattern",
    ]
    _, c = run_cache(model, torch.randint(0, 17, (3, 5)), names)
    assert c["hook_pos_embed"].shape == (3, 5, 32)
    assert c["blocks.0.attn.hook_sink_pattern"].shape == (3, 4, 5)
    assert c["blocks.0.attn.hook_pattern"].shape == (3, 4, 5, 5)
    rows = c["blocks.0.attn.hook_pattern"].sum(-1) + c["blocks.0.attn.hook_sink_pattern"]
    torch.testing.assert_close(rows, torch.ones(3, 4, 5))
    assert "blocks.0.attn.hook_rot_q" in model.hook_dict  # rotary off: hook exists but does not fire
    assert "hook_pos_embed" not in SinkLM(ModelConfig()).hook_dict


def test_pattern_hook_edits_change_the_output(device):
    """hook_pattern is live: zeroing all attention except to token 0 changes hook_z accordingly."""
    torch.manual_seed(0)
    model = SinkLM(ModelConfig(d_vocab=17, n_heads=4, d_model=32)).to(device)
    tokens = torch.randint(0, 17, (1, 5)).to(device)

    def to_first(p, hook):
        q = torch.zeros_like(p)
        q[..., 0] = 1.0
        return q

    _, c = run_cache(model, tokens, ["blocks.0.attn.hook_v"])
    z = {}
    model.run_with_hooks(
        tokens,
        fwd_hooks=[
            ("blocks.0.attn.hook_pattern", to_first),
            ("blocks.0.attn.hook_z", lambda x, hook: z.setdefault("z", x)),
        ],
    )
    v0 = c["blocks.0.attn.hook_v"][:, 0]  # (1, H, d), on the CPU
    torch.testing.assert_close(z["z"].cpu(), v0[:, None].expand_as(z["z"]))


def test_hooks_context_manager_and_run_with_cache(device):
    torch.manual_seed(0)
    model = SinkLM(ModelConfig(d_vocab=17, n_heads=4, d_model=32)).to(device)
    tokens = torch.randint(0, 17, (2, 5)).to(device)
    seen = []
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: seen.append(hook.name))]):
        model(tokens)
    model(tokens)
    assert seen == ["blocks.0.hook_resid_post"]
    logits, cache = model.run_with_cache(tokens)
    assert cache["blocks.0.attn.hook_pattern"].shape == (2, 4, 5, 5)
    torch.testing.assert_close(logits, model(tokens))


def test_forward_errors_are_clear():
    model = SinkLM(ModelConfig(d_vocab=17, n_ctx=8))
    with pytest.raises(ValueError, match="exceeds the model's context of 8 tokens"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 17\)"):
        model(torch.full((1, 4), 17))
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="no tokenizer"):
        model.to_tokens("hello")
    with pytest.raises(ValueError, match="n_key_value_heads"):
        ModelConfig(n_heads=4, n_key_value_heads=3)
    with pytest.raises(ValueError, match="positional_embedding_type"):
        ModelConfig(positional_embedding_type="xpos")


def test_loss_return_types(device):
    torch.manual_seed(0)
    model = SinkLM(ModelConfig(d_vocab=17)).to(device)
    tokens = torch.randint(0, 17, (2, 6)).to(device)
    logits, loss = model(tokens, return_type="both")
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 17), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, ref)
    assert model(tokens, return_type=None) is None
