"""Tiny randomly initialised models, one per decoder family, built from ``transformers`` configs (no network).

``make_family_dir(family, path)`` saves a Hugging Face folder (config, safetensors, a word-level tokenizer)
that ``analysis.load_model(path)`` opens offline. Every model is small (64-dim residual, 2-4 layers, vocab 96)
so the whole matrix builds in seconds. The configs turn on the feature that makes each family different
(sliding window shorter than the probe, partial rotary, q/k norms, ALiBi, learned sinks, gated attention,
linear-attention and Mamba layers) so the tests exercise it.

``write_llama_gguf(model, tokenizer_vocab, path)`` writes a LlamaForCausalLM to a GGUF file (float32, with a
GPT-2-style tokenizer in its metadata) the way llama.cpp's converter lays it out, for the GGUF loading test.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96
D = 64
N_CTX = 128
SPECIALS = ["<unk>", "<s>", "</s>"]


def vocab_map(vocab: int = VOCAB) -> dict[str, int]:
    return {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(vocab - len(SPECIALS))])}


def word_tokenizer(vocab: int = VOCAB):
    """A word-level fast tokenizer: "<unk>", "<s>", "</s>", then "w0".."wN"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab_map(vocab), unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


def byte_tokenizer(vocab: int = VOCAB):
    """A byte-level BPE fast tokenizer of single characters (no merges): the specials, then space, newline,
    letters, digits and punctuation, cut to ``vocab``. For families whose tokenizer class rebuilds a byte-level
    BPE from the saved vocabulary (Qwen2: a word-level vocabulary would give no token from text)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\u0120", "\u010a"] + list(
        string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    )
    tk = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate((SPECIALS + chars)[:vocab])}, merges=[], unk_token="<unk>")
    )
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )


# Families whose tokenizer class needs a byte-level BPE vocabulary (the others take the word-level one).
BYTE_LEVEL_TOKENIZER = frozenset({"qwen2"})

_IDS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
_LLAMA_LIKE = dict(
    hidden_size=D,
    intermediate_size=2 * D,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=N_CTX,
    **_IDS,
)


def _rope(theta: float, **extra) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **extra}}


# family -> (config class name in transformers, config kwargs). Rotary bases differ per family on purpose, so a
# spec that reads the wrong field shows it.
FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(**_LLAMA_LIKE, **_rope(10000.0))),
    "mistral": ("MistralConfig", dict(**_LLAMA_LIKE, sliding_window=8, **_rope(1e6))),
    "qwen2": ("Qwen2Config", dict(**_LLAMA_LIKE, **_rope(1e6))),
    "qwen3": ("Qwen3Config", dict(**_LLAMA_LIKE, head_dim=16, **_rope(1e6))),
    "gemma": ("GemmaConfig", dict(**_LLAMA_LIKE, head_dim=16, **_rope(10000.0))),
    "gemma2": (
        "Gemma2Config",
        dict(
            **_LLAMA_LIKE,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            **_rope(10000.0),
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            **{**_LLAMA_LIKE, "num_hidden_layers": 6},
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "phi": ("PhiConfig", dict(**_LLAMA_LIKE, **_rope(10000.0, partial_rotary_factor=0.5))),
    "phi3": (
        "Phi3Config",
        dict(**_LLAMA_LIKE, original_max_position_embeddings=N_CTX, **_rope(10000.0, partial_rotary_factor=0.5)),
    ),
    "olmo2": ("Olmo2Config", dict(**_LLAMA_LIKE, **_rope(500000.0))),
    "granite": (
        "GraniteConfig",
        dict(
            **_LLAMA_LIKE,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
            logits_scaling=8.0,
            **_rope(10000.0),
        ),
    ),
    "stablelm": (
        "StableLmConfig",
        dict(**_LLAMA_LIKE, use_qkv_bias=True, **_rope(10000.0, partial_rotary_factor=0.25)),
    ),
    "starcoder2": ("Starcoder2Config", dict(**_LLAMA_LIKE, sliding_window=8, use_bias=True, **_rope(100000.0))),
    "gpt2": ("GPT2Config", dict(n_embd=D, n_layer=2, n_head=4, n_positions=N_CTX, n_inner=2 * D, **_IDS)),
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(
            **{k: v for k, v in _LLAMA_LIKE.items() if k != "num_key_value_heads"},
            **_rope(10000.0, partial_rotary_factor=0.25),
        ),
    ),
    "gptj": ("GPTJConfig", dict(n_embd=D, n_layer=2, n_head=4, n_positions=N_CTX, n_inner=2 * D, rotary_dim=8, **_IDS)),
    "opt": (
        "OPTConfig",
        dict(
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=2 * D,
            max_position_embeddings=N_CTX,
            word_embed_proj_dim=D,
            **_IDS,
        ),
    ),
    "bloom": ("BloomConfig", dict(hidden_size=D, n_layer=2, n_head=4, **_IDS)),
    "falcon": (
        "FalconConfig",
        dict(
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=True,
            parallel_attn=True,
            new_decoder_architecture=False,
            alibi=False,
            bias=False,
            max_position_embeddings=N_CTX,
            ffn_hidden_size=2 * D,
            **_IDS,
            **_rope(10000.0),
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(
            **_LLAMA_LIKE,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            **_rope(150000.0),
        ),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            **{**_LLAMA_LIKE, "num_hidden_layers": 4},
            head_dim=16,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=D,
            shared_expert_intermediate_size=D,
            **_rope(10000000.0, partial_rotary_factor=0.25),
        ),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        dict(
            **{**_LLAMA_LIKE, "num_hidden_layers": 4},
            head_dim=16,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            **_rope(10000000.0, partial_rotary_factor=0.25),
        ),
    ),
    # Jamba-v0.1 / 1.5: one attention layer in 8 (offset 4; here one in 4, offset 2) on a dense MLP, experts every
    # other layer (offset 1: on Mamba layers), 16 experts top 2 (here 4, top 2).
    "jamba": (
        "JambaConfig",
        dict(
            **{**_LLAMA_LIKE, "num_hidden_layers": 4},
            num_experts=4,
            num_experts_per_tok=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            attn_layer_period=4,
            attn_layer_offset=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
        ),
    ),
    # ---- mixtures of experts, latent attention, NoPE layers, new hybrids: each in its released checkpoints' layout
    # DeepSeek-V3: multi-head latent attention (q and kv LoRA ranks, a decoupled rotary key shared by the heads,
    # interleaved rotary pairs), the first layers dense (first_k_dense_replace: 3 of 61), then routed experts with
    # one shared expert.
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            **{**_LLAMA_LIKE, "num_hidden_layers": 3, "num_key_value_heads": 4},
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,  # narrower than q and k (16), as DeepSeek-V3's 128 against 192
            head_dim=8,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
            rope_interleave=True,
            **_rope(10000.0),
        ),
    ),
    # Qwen3-MoE: q/k norms; every layer routed (decoder_sparse_step 1) except those in mlp_only_layers (dense).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            **{**_LLAMA_LIKE, "num_hidden_layers": 3},
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            **_rope(1e6),
        ),
    ),
    # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): every layer routed, with a gated shared expert.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            **_LLAMA_LIKE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            **_rope(1e6),
        ),
    ),
    # Mixtral 8x7B: every layer 8 experts, top 2 (here 4, top 2), no sliding window.
    "mixtral": ("MixtralConfig", dict(**_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2, **_rope(1e6))),
    # Phi-MoE (Phi-3.5-MoE): 16 experts top 2 on every layer, LayerNorm, biases on q/k/v/o and the LM head.
    "phimoe": (
        "PhimoeConfig",
        dict(
            **_LLAMA_LIKE,
            num_local_experts=4,
            num_experts_per_tok=2,
            attention_bias=True,
            lm_head_bias=True,
            **_rope(10000.0),
        ),
    ),
    # OLMoE: every layer 64 experts, top 8 (here 4, top 2); q/k norms over all heads.
    "olmoe": ("OlmoeConfig", dict(**_LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, **_rope(10000.0))),
    # SmolLM3: every 4th layer NoPE (no rotary), the others rotary.
    "smollm3": (
        "SmolLM3Config",
        dict(**{**_LLAMA_LIKE, "num_hidden_layers": 4}, no_rope_layer_interval=4, **_rope(2e6)),
    ),
    # Llama 4 Maverick: every 4th layer NoPE (no rotary; global), the rotary ones chunked (8192 tokens: longer
    # than any probe here, so the chunk never binds), no q/k norm (Scout has an L2 one); MoE every other layer
    # (interleave_moe_layer_step 2), one routed expert per token plus a shared expert.
    "llama4_text": (
        "Llama4TextConfig",
        dict(
            **{**_LLAMA_LIKE, "num_hidden_layers": 4},
            head_dim=16,
            intermediate_size_mlp=2 * D,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=4,
            attention_chunk_size=8192,
            use_qk_norm=False,
            **_rope(500000.0),
        ),
    ),
    # GLM-4: partial rotary (half the head), sandwich norms, fused gate/up projection.
    "glm4": ("Glm4Config", dict(**_LLAMA_LIKE, head_dim=16, **_rope(10000.0, partial_rotary_factor=0.5))),
    # Cohere (Command R): attention and MLP in parallel, LayerNorm without bias, interleaved rotary pairs.
    "cohere": ("CohereConfig", dict(**_LLAMA_LIKE, logit_scale=0.0625, **_rope(10000.0))),
    # Granite-MoE: every layer routed (here 4 experts, top 2), Granite's multipliers.
    "granitemoe": (
        "GraniteMoeConfig",
        dict(
            **_LLAMA_LIKE,
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
            logits_scaling=8.0,
            **_rope(10000.0),
        ),
    ),
    # Bamba (Bamba-9B): Mamba-2 layers with attention at three of 32 (attn_layer_indices 9, 18, 27), rotary on half
    # of each head, dense MLPs: here attention at layer 2 of 4.
    "bamba": (
        "BambaConfig",
        dict(
            **{**_LLAMA_LIKE, "num_hidden_layers": 4},
            attn_layer_indices=[2],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=8,
            **_rope(10000.0),
        ),
    ),
    # Falcon-H1: attention and a Mamba-2 mixer in parallel in every layer, then an MLP.
    "falcon_h1": (
        "FalconH1Config",
        dict(
            **_LLAMA_LIKE,
            head_dim=16,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=8,
            **_rope(10000.0),
        ),
    ),
}
FAMILIES = list(FAMILY_CONFIGS)

# Families the matrix cannot test, with their configs (docs/families.md says why):
# Nemotron-H: the bridge wraps every layer's mixer as one generic SSM2MixerBridge, attention layers included, so no
# attention hook (hook_q / hook_k / hook_pattern) exists on any layer. Gemma 3n: the bridge has no text-only
# adapter (only Gemma3nForConditionalGeneration). Gemma 4 (text): the bridge loads it, but its global layers have
# their own head dim and partial ("proportional") rotary, which the one-head-dim family spec does not hold, and the
# bridge keeps its norms' gains only inside the wrapped Hugging Face modules (no ln1.w, no attn.k_norm.w).
NOT_IN_MATRIX: dict[str, tuple[str, dict]] = {
    # Gemma 2 with a cap that bites on a random model's scores (at most about 0.07; Gemma 2's 50 leaves them as they are):
    # where the backends compute the soft cap themselves (blocks of rows, q, k and the lse), this family checks it.
    "gemma2_cap": ("Gemma2Config", {**FAMILY_CONFIGS["gemma2"][1], "attn_logit_softcapping": 0.1}),
    # Llama 4 as released (use_qk_norm): q and k L2-normalised after the rotary on its rotary layers.
    "llama4_qk_norm": ("Llama4TextConfig", {**FAMILY_CONFIGS["llama4_text"][1], "use_qk_norm": True}),
    # Scaled rope types, whose frequencies (and longrope's cos/sin scale) the family spec reads from the model: Llama 4
    # Scout's llama3 scaling (its original context cut to 16 here, so that the scaling bites at these lengths) and
    # Phi-3.5's longrope (its short factors below its original context; cos and sin scaled by sqrt(1 + ln 4 / ln 128)).
    "llama4_scout": (
        "Llama4TextConfig",
        {
            **FAMILY_CONFIGS["llama4_text"][1],
            "use_qk_norm": True,
            **_rope(
                500000.0,
                rope_type="llama3",
                factor=16.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        },
    ),
    # Command R+ (use_qk_norm): a LayerNorm on each head's q and k, with a gain per head ((heads, d_head) weights).
    "cohere_qk_norm": ("CohereConfig", {**FAMILY_CONFIGS["cohere"][1], "use_qk_norm": True}),
    # Gemma 3 as released from 4B up: linear scaling (factor 8) on its full-attention layers only.
    "gemma3_linear": (
        "Gemma3TextConfig",
        {
            **FAMILY_CONFIGS["gemma3"][1],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    "phi3_longrope": (
        "Phi3Config",
        {
            **FAMILY_CONFIGS["phi3"][1],
            "max_position_embeddings": 4 * N_CTX,
            **_rope(
                10000.0,
                rope_type="longrope",
                partial_rotary_factor=0.5,
                short_factor=[1.0, 1.5, 2.0, 4.0],
                long_factor=[1.0, 2.0, 4.0, 8.0],
            ),
        },
    ),
    # Nemotron-H (8B): Mamba-2, MLP and attention blocks, each its own layer ("M-M-M-M*-..."; here "M-*-").
    "nemotron_h": (
        "NemotronHConfig",
        dict(
            **{k: v for k, v in _LLAMA_LIKE.items() if k != "num_hidden_layers"},
            head_dim=16,
            hybrid_override_pattern="M-*-",
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=1,
            chunk_size=8,
            use_mamba_kernels=False,
        ),
    ),
    # Gemma 3n (E2B: 30 layers, 4 sliding : 1 global, the last 10 reuse the KV of the last earlier layer of their
    # type; AltUp over 4 streams, laurel, per-layer inputs, sparse MLPs in the first 10 layers): here 10 layers, the
    # last 5 sharing KV (layers 3 and 4 store it), the first 5 with the sparse (0.95) MLP. A valid config; the bridge
    # does not load the text model.
    "gemma3n_text": (
        "Gemma3nTextConfig",
        dict(
            **{**_LLAMA_LIKE, "num_hidden_layers": 10, "intermediate_size": 2 * D},
            head_dim=16,
            sliding_window=8,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=5,
            altup_num_inputs=4,
            laurel_rank=8,
            layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
            activation_sparsity_pattern=[0.95] * 5 + [0.0] * 5,
        ),
    ),
    # Gemma 4 (text; the config's defaults, google/gemma-4-e2b-it): 5 sliding : 1 global, the global layers with a
    # wider head (global_head_dim) and proportional rotary on a quarter of it, per-layer inputs, q/k/v norms.
    "gemma4_text": (
        "Gemma4TextConfig",
        dict(
            **{**_LLAMA_LIKE, "num_hidden_layers": 6},
            head_dim=16,
            global_head_dim=32,
            sliding_window=8,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
        ),
    ),
}

# The layout each tiny model is built in (the released checkpoints' pattern, shortened), typed here from the configs
# above so the tests check the specs against it: attention layers (the others are Mamba / linear attention / MLP-only
# blocks), mixture-of-experts blocks, NoPE layers, sliding-window layers. Families not listed: every layer attention,
# dense, rotary where the family is, no sliding window.
LAYOUT: dict[str, dict[str, tuple[int, ...]]] = {
    "mistral": dict(sliding=(0, 1)),
    "gemma2": dict(sliding=(0, 1)),
    "gemma3": dict(sliding=(0, 1, 2, 3, 4)),
    "starcoder2": dict(sliding=(0, 1)),
    "gpt_oss": dict(moe=(0, 1), sliding=(0,)),
    "qwen3_next": dict(attention=(3,), moe=(0, 1, 2, 3)),
    "qwen3_5": dict(attention=(3,)),
    "jamba": dict(attention=(2,), moe=(1, 3)),
    "deepseek_v3": dict(moe=(1, 2)),
    "qwen3_moe": dict(moe=(1, 2)),
    "qwen2_moe": dict(moe=(0, 1)),
    "mixtral": dict(moe=(0, 1)),
    "phimoe": dict(moe=(0, 1)),
    "bamba": dict(attention=(2,)),
    "olmoe": dict(moe=(0, 1)),
    "smollm3": dict(nope=(3,)),
    "llama4_text": dict(moe=(1, 3), nope=(3,)),
    "granitemoe": dict(moe=(0, 1)),
}


def layout(family: str) -> dict[str, tuple[int, ...]]:
    """{"attention", "moe", "nope", "sliding": layers} of the tiny ``family`` model (``LAYOUT``, defaults filled in)."""
    n = family_config(family).num_hidden_layers
    return {"attention": tuple(range(n)), "moe": (), "nope": (), "sliding": (), **LAYOUT.get(family, {})}


def family_config(family: str):
    import transformers

    configs = {**FAMILY_CONFIGS, **NOT_IN_MATRIX}
    if family not in configs:
        raise ValueError(f"unknown family {family!r}; known: {list(configs)}.")
    cls_name, kwargs = configs[family]
    return getattr(transformers, cls_name)(**kwargs)


def make_family_model(family: str, seed: int = 0):
    """A randomly initialised Hugging Face causal LM of ``family`` (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    return model.eval()


# The architecture a released checkpoint's config.json names where it differs from the transformers class save_pretrained
# writes: Phi-3.5-MoE's config says "PhiMoEForCausalLM" (its remote-code class; transformers' is PhimoeForCausalLM),
# which is the name TransformerLens' bridge knows.
CHECKPOINT_ARCHITECTURES = {"phimoe": "PhiMoEForCausalLM"}


def make_family_dir(family: str, path: Path, seed: int = 0) -> Path:
    """Save a random ``family`` model and its tokenizer (word-level; byte-level BPE for ``BYTE_LEVEL_TOKENIZER``)
    to ``path``."""
    import json

    path = Path(path)
    make_family_model(family, seed).save_pretrained(path)
    if family in CHECKPOINT_ARCHITECTURES:  # the class name the released config.json gives, not transformers' own
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "architectures": [CHECKPOINT_ARCHITECTURES[family]]}))
    (byte_tokenizer() if family in BYTE_LEVEL_TOKENIZER else word_tokenizer()).save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------
# GGUF: a Llama written the way llama.cpp's convert_hf_to_gguf.py lays it out
# ----------------------------------------------------------------------------------------------


def _permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores q/k rows for interleaved rotary; transformers' GGUF reader undoes this permutation."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, path: Path, vocab: int = VOCAB) -> Path:
    """Write a LlamaForCausalLM (float32 tensors) and a GPT-2-style BPE tokenizer of the word vocabulary to
    ``path`` (a .gguf file)."""
    import gguf
    import numpy as np

    cfg = model.config
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(cfg.hidden_size // n_head)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = list(vocab_map(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (vocab - len(SPECIALS)))
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)

    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for l in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{l}.{hf}.weight"] = f"blk.{l}.{gg}.weight"
    for hf_name, gg_name in names.items():
        t = sd[hf_name]
        if hf_name.endswith("q_proj.weight"):
            t = _permute_rope(t, n_head)
        elif hf_name.endswith("k_proj.weight"):
            t = _permute_rope(t, n_kv)
        w.add_tensor(gg_name, np.ascontiguousarray(t.numpy().astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_attention(spec, model, layer: int, q, k):
    """The attention a family computes, rebuilt by hand from the spec: q (B, T, H, d) and k (B, T, H_kv, d) as
    the attention uses them (rotated) -> scores (B, H, T, T), the visible-key mask (T, T) (causal, sliding
    window) and the pattern (learned sink logits in the softmax where the spec has them), in float64."""
    from analysis.model.families import sink_logits

    T = q.shape[1]
    k = k.repeat_interleave(spec.n_heads // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * spec.attn_scale
    if spec.attn_softcap:
        scores = spec.attn_softcap * torch.tanh(scores / spec.attn_softcap)
    seen = torch.ones(T, T, dtype=torch.bool).tril()
    if layer in spec.sliding_layers:
        seen &= ~torch.ones(T, T, dtype=torch.bool).tril(-spec.sliding_window)
    logits = scores.masked_fill(~seen, float("-inf"))
    if spec.learned_sinks:
        sink = sink_logits(model, layer).double()[None, :, None, None].expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], -1)
    return scores, seen, torch.softmax(logits, -1)[..., :T]


# Where an analysis does not run on a family yet: the exact error it raises, by what fails. The tests mark these cases
# xfail(strict=True): when the analysis runs, the test turns red and the entry must go (docs/families.md says why).
KNOWN_FAILURES: dict[str, dict[str, str]] = {
    "key_path": {},
}


def matrix(what: str | None = None, raises: type | None = None, families: list[str] | None = None) -> list:
    """``families`` (default: the whole matrix) as pytest parameters, those in ``KNOWN_FAILURES[what]`` marked
    xfail(strict=True, raises=``raises``) with their error."""
    import pytest

    known = KNOWN_FAILURES.get(what, {}) if what else {}
    return [
        pytest.param(f, marks=pytest.mark.xfail(strict=True, raises=raises, reason=known[f])) if f in known else f
        for f in (FAMILIES if families is None else families)
    ]
