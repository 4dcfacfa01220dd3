"""Tiny models whose attention-sink mechanism is planted by construction (shared test helpers).

``planted_model()`` builds a 4-layer LLaMA (``transformers.LlamaForCausalLM``: d_model 64, 4 query
heads, 2 KV heads (GQA), d_head 16, RMSNorm, RoPE theta 1e4, q/k/v/o biases, char-level vocabulary of
100 tokens), saves it to a temporary folder and boots it with ``analysis.model.loading.load_hf`` (a
``TransformerBridge`` with raw weights, like the embedded SmolLM2). Then the whole sink chain is planted:

1. Massive activations: a permanent hook on ``blocks.{first_layer}.hook_resid_post`` adds
   ``SPIKE_VALUES`` ({7: +400, 21: -250}) to the FIRST token (position 0, whatever its id), and a
   hook on ``blocks.{fade_layer}.hook_resid_post`` takes them away again. So the residual stream
   (``hook_resid_post``) carries the spike at layers first_layer..fade_layer-1 (0..1) and only there,
   and ``hook_resid_pre`` of layers first_layer+1..fade_layer (1..2) carries it.
2. Norm gain: in the layers that read the spike (``SINK_LAYERS`` = 1, 2) the ln1 gain is ``SPIKE_GAIN``
   (2.0) at the spike dims and 1 elsewhere.
3. First key: in those layers W_K maps the spike dims onto dim ``KEY_DIM`` (7, the lowest-frequency
   rotary pair, so rotation barely moves it) of every KV head, and every query head has a bias b_Q
   along the same dim. So q_t . k_1 is large for every query: all heads of layers 1 and 2 are sink heads,
   driven by the spike dims alone (remove them from k_1 and the sink goes).
4. Value: in those layers W_V ignores the spike dims, so the first token's value is tiny.

Layers 0 and 3 keep their random weights (near-uniform attention: no sink at T >= 16).
``planted_model(spike=False)`` is the same model with none of the hooks: its first token carries no
spike (the weights of steps 2-4 are still there, but without the spike they do nothing special).

The known answers are on ``model.planted`` (a ``Planted``). The hooks are permanent hooks:
``model.reset_hooks(including_permanent=True)`` removes the spike.

``planted_ln_model("gpt2" | "neox")`` plants the same spike hooks in a tiny LayerNorm model (centring, bias;
GPT-2 without rotary, GPT-NeoX with partial rotary) for the LayerNorm code paths.
``load_smollm2()`` loads the embedded SmolLM2 once per process (in tests, prefer conftest's ``smollm2``).
"""

from __future__ import annotations

import functools
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

SPIKE_VALUES = {7: 400.0, 21: -250.0}  # residual dim -> value added at position 0
SPIKE_DIMS = sorted(SPIKE_VALUES)
FIRST_LAYER = 0  # hook_resid_post of this layer first carries the spike
FADE_LAYER = 2  # hook_resid_post of this layer no longer does
SINK_LAYERS = (1, 2)  # layers whose ln1 reads the spike; all their heads are sink heads
SPIKE_GAIN = 2.0  # ln1 gain at the spike dims in SINK_LAYERS (1.0 elsewhere)
KEY_DIM = 7  # head dim of k (and b_Q) the spike is written to
KEY_WEIGHT = 1.0  # W_K entry from each spike dim (sign of the spike) into KEY_DIM
QUERY_BIAS = 3.0  # b_Q[KEY_DIM] for every query head in SINK_LAYERS

N_LAYERS, D_MODEL, N_HEADS, N_KV_HEADS, D_HEAD, D_MLP, VOCAB = 4, 64, 4, 2, 16, 128, 100
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class Planted:
    """What was planted, i.e. the answers an analysis of the planted model should find."""

    spike: bool
    spike_dims: list[int] = field(default_factory=lambda: list(SPIKE_DIMS))
    spike_values: dict[int, float] = field(default_factory=lambda: dict(SPIKE_VALUES))
    position: int = 0
    first_layer: int = FIRST_LAYER  # first layer whose hook_resid_post has the spike
    last_layer: int = FADE_LAYER - 1  # last layer whose hook_resid_post has the spike
    sink_layers: tuple[int, ...] = SINK_LAYERS
    spike_gain: float = SPIKE_GAIN
    key_dim: int = KEY_DIM
    n_layers: int = N_LAYERS
    n_heads: int = N_HEADS
    n_kv_heads: int = N_KV_HEADS

    @property
    def sink_heads(self) -> list[tuple[int, int]]:
        return [(l, h) for l in self.sink_layers for h in range(self.n_heads)] if self.spike else []


def char_tokenizer():
    """A character-level fast tokenizer: <unk>=0, <s>=1, </s>=2, then tab, newline and printable ASCII."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\t": 3, "\n": 4}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    assert len(vocab) == 100
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@functools.lru_cache(maxsize=None)
def _hf_folder(seed: int) -> str:
    """Build and save the tiny LLaMA (with the planted weights) once per process; return its folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(tempfile.mkdtemp(prefix="planted-llama-"))
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=D_MLP,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        head_dim=D_HEAD,
        max_position_embeddings=256,
        rope_theta=ROPE_THETA,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        attention_bias=True,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in SINK_LAYERS:
            blk = hf.model.layers[layer]
            for d in SPIKE_DIMS:
                blk.input_layernorm.weight[d] = SPIKE_GAIN
            kw = blk.self_attn.k_proj.weight  # (n_kv * d_head, d_model)
            kw[:, SPIKE_DIMS] = 0.0
            for kv in range(N_KV_HEADS):
                kw[kv * D_HEAD + KEY_DIM, :] = 0.0  # the key dim reads nothing but the spike dims
                for d in SPIKE_DIMS:
                    kw[kv * D_HEAD + KEY_DIM, d] = KEY_WEIGHT * (1.0 if SPIKE_VALUES[d] > 0 else -1.0)
            qb = blk.self_attn.q_proj.bias
            qb.zero_()
            for h in range(N_HEADS):
                qb[h * D_HEAD + KEY_DIM] = QUERY_BIAS
            blk.self_attn.v_proj.weight[:, SPIKE_DIMS] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(folder)
        char_tokenizer().save_pretrained(folder)
    return str(folder)


def _add_spike(sign: float):
    dims = torch.tensor(SPIKE_DIMS)
    vals = torch.tensor([SPIKE_VALUES[d] for d in SPIKE_DIMS])

    def fn(resid, hook):
        out = resid.clone()
        out[:, 0, dims] += sign * vals.to(resid.device, resid.dtype)
        return out

    return fn


def planted_model(spike: bool = True, seed: int = 0, device: str = "cpu"):
    """The tiny planted-sink LLaMA as a TransformerBridge on ``device`` (see the module docstring); ``.planted`` holds
    the answers."""
    from analysis.model.loading import load_hf

    model = load_hf(_hf_folder(seed), device=device)
    model.model_name = "planted-llama" + ("" if spike else "-nospike")
    if spike:
        model.add_perma_hook(f"blocks.{FIRST_LAYER}.hook_resid_post", _add_spike(+1.0))
        model.add_perma_hook(f"blocks.{FADE_LAYER}.hook_resid_post", _add_spike(-1.0))
    model.planted = Planted(spike=spike)
    return model


@functools.lru_cache(maxsize=None)
def _ln_folder(arch: str, seed: int) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    folder = Path(tempfile.mkdtemp(prefix=f"planted-{arch}-"))
    torch.manual_seed(seed)
    if arch == "gpt2":
        hf = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_positions=256,
                n_embd=D_MODEL,
                n_layer=N_LAYERS,
                n_head=N_HEADS,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
    elif arch == "neox":
        hf = GPTNeoXForCausalLM(
            GPTNeoXConfig(
                vocab_size=VOCAB,
                max_position_embeddings=256,
                hidden_size=D_MODEL,
                num_hidden_layers=N_LAYERS,
                num_attention_heads=N_HEADS,
                intermediate_size=D_MLP,
                rotary_pct=0.5,
                rotary_emb_base=ROPE_THETA,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
    else:
        raise ValueError(f"arch must be 'gpt2' or 'neox'; got {arch!r}.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(folder)
        char_tokenizer().save_pretrained(folder)
    return str(folder)


def planted_ln_model(arch: str = "gpt2", spike: bool = True, seed: int = 0, device: str = "cpu"):
    """A tiny LayerNorm model (centring and bias) with the same planted spike hooks, random weights otherwise.

    ``arch="gpt2"``: GPT-2 (learned absolute positions, no rotary, 4 heads, no GQA, b_K present);
    ``arch="neox"``: GPT-NeoX (partial rotary: half of each head's dims, parallel attention and MLP).
    Only the spike (step 1 of ``planted_model``) is planted: no sink is built into the weights.
    """
    from analysis.model.loading import load_hf

    model = load_hf(_ln_folder(arch, seed), device=device)
    model.model_name = f"planted-{arch}" + ("" if spike else "-nospike")
    if spike:
        model.add_perma_hook(f"blocks.{FIRST_LAYER}.hook_resid_post", _add_spike(+1.0))
        model.add_perma_hook(f"blocks.{FADE_LAYER}.hook_resid_post", _add_spike(-1.0))
    model.planted = Planted(spike=spike, sink_layers=(), spike_gain=1.0, n_kv_heads=N_HEADS)
    return model


def planted_tokens(n: int = 8, T: int = 24, seed: int = 0) -> torch.Tensor:
    """Random ordinary tokens (ids 5..99: no specials), (n, T); position 0 is a random token too."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, VOCAB, (n, T), generator=g)


@functools.lru_cache(maxsize=None)
def load_smollm2():
    """The embedded SmolLM2-135M-Instruct, loaded once per process (tests: use conftest's ``smollm2`` fixture)."""
    from analysis.model.loading import load_model

    return load_model("smollm2-135m", device="cpu")


try:  # pytest fixtures to import into a test module: ``from tests.planted import planted, planted_nospike``
    import pytest

    @pytest.fixture(scope="module")
    def planted(device):
        return planted_model(spike=True, device=device)

    @pytest.fixture(scope="module")
    def planted_nospike(device):
        return planted_model(spike=False, device=device)
except ImportError:  # pragma: no cover - used outside pytest
    pass


MARK_DIM = 3  # the residual dim that marks position 0 in planted_gpt2_dir's learned position embedding
WRITER = 0  # the neuron of block 0's MLP that writes the spike in planted_gpt2_dir


def planted_gpt2_dir(path) -> Path:
    """Save to ``path`` a tiny GPT-2 (LayerNorm, learned positions, 4 layers, d_model 64, 4 heads, char vocabulary)
    whose whole sink chain is written into its weights, no hooks: the position-0 embedding carries a marker
    (``MARK_DIM``), neuron ``WRITER`` of block 0's MLP fires on it alone and writes ``SPIKE_VALUES`` into the first
    token's residual, and in ``SINK_LAYERS`` the ln_1 gain, W_K, b_Q and W_V are planted as in ``planted_model``.
    Loaded with ``load_model(path)`` like any Hugging Face folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=256,
            n_embd=D_MODEL,
            n_layer=N_LAYERS,
            n_head=N_HEADS,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    d_head = D_MODEL // N_HEADS
    with torch.no_grad():
        hf.transformer.wpe.weight[0, MARK_DIM] = 10.0  # LayerNorm turns it into about sqrt(d_model) = 8
        mlp = hf.transformer.h[0].mlp
        mlp.c_fc.weight[:, WRITER] = 0.0
        mlp.c_fc.weight[MARK_DIM, WRITER] = 2.0
        mlp.c_fc.bias[WRITER] = -8.0  # about +8 on the first token, about -8 +- 2 elsewhere (GELU: 0)
        mlp.c_proj.weight[WRITER] = 0.0
        for d, v in SPIKE_VALUES.items():
            mlp.c_proj.weight[WRITER, d] = v / 8.0
        for layer in SINK_LAYERS:
            blk = hf.transformer.h[layer]
            blk.ln_1.weight[SPIKE_DIMS] = SPIKE_GAIN
            w, b = blk.attn.c_attn.weight, blk.attn.c_attn.bias  # (d_model, 3 d_model): q | k | v
            w[SPIKE_DIMS, D_MODEL:] = 0.0  # keys and values ignore the spike dims ...
            b[:D_MODEL] = 0.0
            for h in range(N_HEADS):
                col = D_MODEL + h * d_head + KEY_DIM
                w[:, col] = 0.0  # ... but for one key dim, which reads them alone
                for d in SPIKE_DIMS:
                    w[d, col] = KEY_WEIGHT * (1.0 if SPIKE_VALUES[d] > 0 else -1.0)
                b[h * d_head + KEY_DIM] = QUERY_BIAS
    path = Path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(path)
        char_tokenizer().save_pretrained(path)
    return path
