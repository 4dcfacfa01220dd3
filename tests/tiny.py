"""Tiny Hugging Face models built by the tests (no downloads): a LLaMA with a word-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_llama_dir(
    path: Path,
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    vocab: int = 96,
    n_ctx: int = 128,
    seed: int = 0,
    init_std: float = 0.02,
    rope_theta: float = 10000.0,
) -> Path:
    """Save a random LlamaForCausalLM and a matching tokenizer ("w0".."wN" words) to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    specials = ["<unk>", "<s>", "</s>"]
    vocab_map = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab - len(specials))])}
    tk = Tokenizer(models.WordLevel(vocab_map, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d_model,
        intermediate_size=2 * d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=n_ctx,
        initializer_range=init_std,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
