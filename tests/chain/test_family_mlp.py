"""The MLP facts of every family (``analysis.model.mlp_spec.MlpSpec``), measured at first use, rebuild the model's own MLP:
from the residual the MLP reads, its input norm, W_gate / W_in (with biases, in the orientation measured), the
activation, W_out and the output scaling (Granite's multiplier, Gemma 2/3 and OLMo-2's post-norm) give the hooks'
gate and up pre-activations, neuron activations and ``hook_mlp_out`` on every dense block of the tiny model of each
family (tests/families.py), the reference models and SmolLM2. Mixture-of-experts blocks (gpt-oss, Qwen3-Next) have
no neuron hook: their routed experts' outputs plus what the block adds beyond them rebuild ``hook_mlp_out``.
"""

from __future__ import annotations

import pytest
import torch

from analysis.model.mlp_spec import block_norm, expert_writes, get_mlp, mlp_input, mlp_weights
from analysis.model.hooks import model_device
from tests.families import FAMILIES, family_config, layout
from tests.conftest import tol

PARALLEL = {"phi", "gpt_neox", "gptj", "falcon", "cohere"}
# Mixtures of experts with a shared expert (or a dense branch) beside the routed ones: what the block adds beyond them.
SHARED_EXPERT = {"qwen3_next", "deepseek_v3", "qwen2_moe", "llama4_text"}
PLAIN = {"phi", "starcoder2", "gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon"}
POST_NORM = {"gemma2", "gemma3", "olmo2", "glm4"}  # GLM-4: post_mlp_layernorm


def _capture(model, tokens, names):
    """The activations of ``names`` over ``tokens``, float32 on the CPU."""
    got = {}

    def keep(x, hook):
        got[hook.name] = x.detach().float().cpu()

    with torch.no_grad():
        model.run_with_hooks(tokens.to(model_device(model)), fwd_hooks=[(n, keep) for n in dict.fromkeys(names)])
    return {n: got[model.hook_dict[n].name] for n in names}


def _check_rebuild(model, tokens, atol: float = 1e-5):
    """The MLP of every block rebuilt on the CPU from its weights equals its hooks (``atol``: tol(device, 1e-5))."""
    spec = get_mlp(model)
    for l in range(model.cfg.n_layers):
        if not spec.has_neurons(l):
            continue
        names = [
            f"blocks.{l}.hook_{spec.input_resid}",
            spec.neuron_hook(l),
            spec.up_hook(l),
            f"blocks.{l}.hook_mlp_out",
        ]
        names += [spec.gate_hook(l)] if spec.kind == "gated" else []
        got = _capture(model, tokens, names)
        W = mlp_weights(model, l)
        assert W.W_out.shape == (model.cfg.d_model, spec.d_mlp) and W.W_in.shape == (spec.d_mlp, model.cfg.d_model)
        x = mlp_input(model, l, got[names[0]])
        up = x @ W.W_in.T + (0 if W.b_in is None else W.b_in)
        torch.testing.assert_close(up, got[spec.up_hook(l)], atol=atol, rtol=1e-4)
        if spec.kind == "gated":
            gate = x @ W.W_gate.T + (0 if W.b_gate is None else W.b_gate)
            torch.testing.assert_close(gate, got[spec.gate_hook(l)], atol=atol, rtol=1e-4)
            a = spec.act(gate) * up
        else:
            a = spec.act(up)
        torch.testing.assert_close(a, got[spec.neuron_hook(l)], atol=atol, rtol=1e-4)
        proj = a @ W.W_out.T + (0 if W.b_out is None else W.b_out)
        if spec.output == "post_norm":
            with torch.no_grad():
                out = block_norm(model, l, spec.output_norm_module)(proj.to(model_device(model))).cpu()
        else:
            out = spec.output_scale * proj
        torch.testing.assert_close(out, got[f"blocks.{l}.hook_mlp_out"], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_facts_rebuild_the_mlp(family, family_bridge, device):
    model = family_bridge(family)
    spec = get_mlp(model)
    tokens = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    assert spec.additive  # every family here adds the writes of hook_attn_out / hook_mlp_out to its residual stream
    assert spec.parallel == (family in PARALLEL)
    assert set(spec.mixer_layers) == set(model.family.skipped_layers)  # Mamba / linear attention: no hook_attn_out
    moe = layout(family)["moe"]  # the layout of the released checkpoints: which blocks are mixtures of experts
    assert spec.moe_layers == moe
    if moe:
        config = family_config(family)
        n_exp = next(
            getattr(config, k) for k in ("num_local_experts", "num_experts", "n_routed_experts") if hasattr(config, k)
        )
        assert (spec.n_experts, spec.top_k) == (n_exp, config.num_experts_per_tok)
        with pytest.raises(ValueError, match="mixture of experts"):
            spec.neuron_hook(moe[0])
    for l in moe:  # the routed experts' writes plus what the block adds beyond them (a shared expert) rebuild it
        got = _capture(model, tokens, [spec._input_hook.format(layer=l), f"blocks.{l}.hook_mlp_out"])
        x = got[spec._input_hook.format(layer=l)].flatten(0, 1)
        idx, slots, rest = expert_writes(model, l, x)
        assert idx.shape == (x.shape[0], spec.top_k)
        torch.testing.assert_close(
            slots.sum(1) + rest, got[f"blocks.{l}.hook_mlp_out"].flatten(0, 1), atol=tol(device, 1e-5), rtol=1e-4
        )
        assert (float(rest.abs().max()) < 1e-6) == (family not in SHARED_EXPERT)  # rounding of the sum of the slots
    if len(moe) == model.cfg.n_layers:
        assert spec.kind == "moe" and not spec.has_neurons(0)
        assert (spec.output, spec.output_scale) == (
            ("scaled", pytest.approx(0.22)) if family == "granitemoe" else ("add", 1.0)
        )
        return
    assert spec.kind == ("plain" if family in PLAIN else "gated")
    assert spec.output == ("post_norm" if family in POST_NORM else "scaled" if family == "granite" else "add")
    if family == "granite":
        assert spec.output_scale == pytest.approx(0.22)
    assert (spec.input_norm is None) == (family == "olmo2")  # OLMo-2's MLP reads the raw residual
    assert spec.activation == {
        "gemma": "gelu_tanh",
        "gemma2": "gelu_tanh",
        "gemma3": "gelu_tanh",
        "opt": "relu",
        "gpt_neox": "gelu",
        "falcon": "gelu",
    }.get(family, spec.activation)
    _check_rebuild(model, tokens, tol(device, 1e-5))


def test_mlp_facts_of_smollm2_and_the_reference_model(smollm2, device):
    from analysis import load_model

    spec = get_mlp(smollm2)
    assert (spec.kind, spec.activation, spec.d_mlp, spec.output, spec.parallel) == ("gated", "silu", 1536, "add", False)
    assert spec.neuron_hook(3) == "blocks.3.mlp.out.hook_in"
    assert (spec.gate_hook(3), spec.up_hook(3)) == ("blocks.3.mlp.gate.hook_out", "blocks.3.mlp.in.hook_out")
    assert spec.additive and "gated MLP" in spec.text()
    _check_rebuild(
        smollm2, torch.randint(0, 49152, (1, 6), generator=torch.Generator().manual_seed(0)), tol(device, 1e-5)
    )
    ref = load_model("synthetic-softmax", device=device)
    rspec = get_mlp(ref)
    assert (rspec.kind, rspec.activation, rspec.neuron_hook(0)) == ("gated", "silu", "blocks.0.mlp.hook_post")
    _check_rebuild(ref, torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)), tol(device, 1e-5))


def test_bad_layer(smollm2):
    with pytest.raises(ValueError, match="out of range"):
        mlp_weights(smollm2, 30)
