"""The one place that knows model families: what each layer computes on the way to its attention pattern.

``family_spec(model)`` reads a loaded model once (the loader stores the result as ``model.family``) and
returns a :class:`FamilySpec`: which layers are attention layers (hybrids keep their true layer indices;
linear-attention and Mamba layers are listed as skipped, with the reason), the positions (rotary with its
true base, rotary dim and pairing; ALiBi; absolute; none), the norm that feeds attention (RMSNorm or
LayerNorm, with or without bias, gain ``w`` or Gemma's ``1 + w``, pre- / post- / sandwich placement), q/k
norms, fused QKV, learned sink logits (gpt-oss), the attention-output gate (Qwen3-Next / Qwen3.5), sliding
windows, KV heads and the true score scale.

Analyses ask the spec instead of guessing from hook names: ``spec.key_hook(layer)`` names the hook that holds
the key the attention really uses (``hook_rot_k`` where the bridge fires it; ``hook_k`` otherwise, and then
``spec.key_rotated`` is False and the analysis applies the rotary itself with ``spec.rotary_dim``,
``spec.rotary_style`` and ``spec.rotary_bases[layer]``).

Where the facts live:

- the Hugging Face config (rope parameters per layer type, sliding windows, layer types) and modules (rotary
  ``inv_freq`` buffers give the rotary dim, attention ``scaling``, ``sinks`` parameters);
- the norm forms are *measured*: each norm module is run on a probe vector and matched against RMSNorm /
  LayerNorm with gain ``w`` or ``1 + w`` (so a new family with a zero-centred gain is read right, not assumed);
- which hooks fire is *measured* too: one two-token forward pass at load time records the hooks the bridge
  really calls (TransformerLens lists ``hook_rot_k`` on fused-QKV and GPT-J attention, but never calls it);
- the few facts no config states (GPT-J-style interleaved rotary pairs) are in the tables below.

The MLP of each block is described in ``analysis.model.mlp_spec`` (:class:`MlpSpec`).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Iterator
import warnings

import torch

from analysis.model.contract import SinkModel
from analysis.model.placement import input_device
from analysis.model.weights import reads_module_weights

# Families whose rotary rotates adjacent pairs (x0, x1), (x2, x3)... ("rotate_every_two") instead of the two
# halves of the rotary dims (HF "rotate_half", GPT-NeoX style, every other family here). Cohere and GLM rotate
# adjacent pairs too (their own rotate_half takes x[..., ::2] and x[..., 1::2]).
INTERLEAVED_ROTARY = frozenset({"gptj", "codegen", "cohere", "cohere2", "glm", "glm4", "llama4", "llama4_text"})
# Families with ALiBi biases instead of rotary (Falcon has it as a config switch, read from ``config.alibi``).
ALIBI = frozenset({"bloom", "mpt"})
# What a skipped layer type is, in words.
LAYER_TYPE_WORDS = {
    "linear_attention": "linear attention (Gated DeltaNet): no softmax attention pattern",
    "mamba": "Mamba state-space layer: no attention pattern",
    "mamba2": "Mamba-2 state-space layer: no attention pattern",
    "conv": "short convolution layer: no attention pattern",
}
# Families whose config names its Mamba-2 layers "linear_attention" (Bamba's layers_block_type).
MAMBA2_AS_LINEAR_ATTENTION = frozenset({"bamba"})
# Families whose blocks each read only the residual stream entering them (no state carried from one block to the
# next besides it), so a pass can resume at a block from that residual with the earlier blocks skipped
# (``passes.Resume``); each is checked against the full pass by tests/causal/test_interventions.py.
RESUMABLE = frozenset(
    "llama mistral qwen2 qwen3 gemma gemma2 gemma3_text phi phi3 olmo2 granite stablelm starcoder2 gpt2 gpt_neox gptj "
    "opt falcon gpt_oss qwen3_next qwen3_5_text jamba deepseek_v3 qwen3_moe qwen2_moe mixtral olmoe smollm3 "
    "llama4_text glm4 cohere granitemoe falcon_h1 phimoe".split()
)
# Hooks the bridge refuses unless a flag is set; the dry run leaves them out.
_FLAGGED = ("hook_result", "hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input")


@dataclass(frozen=True)
class NormSpec:
    """A normalisation module: y = norm(x) * (gain_offset + w) (+ b).

    Attributes
    ----------
    kind : {"RMSNorm", "LayerNorm"}
        The normalisation, measured on a probe vector.
    gain_offset : float
        0.0: the gain is w; 1.0: the gain is 1 + w (Gemma, Qwen3-Next, Qwen3.5).
    bias : bool
        Whether the norm adds a bias b.
    eps : float
        The norm's epsilon.
    size : int
        The normalised dimension (d_model; d_head for per-head q / k norms).
    module : str
        The Hugging Face module path ("" where no model was given).
    """

    kind: str  # "RMSNorm" | "LayerNorm"
    gain_offset: float  # 0.0: gain w; 1.0: gain 1 + w (Gemma, Qwen3-Next, Qwen3.5)
    bias: bool
    eps: float
    size: int  # the normalised dimension (d_model; d_head for per-head q/k norms)
    module: str  # the Hugging Face module path

    @property
    def gain_form(self) -> str:
        return "1 + w" if self.gain_offset else "w"

    def text(self) -> str:
        return f"{self.kind} (gain {self.gain_form}{', with bias' if self.bias else ''}, eps {self.eps:g})"


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """What the analyses need to know about a model family, read from one loaded model (:func:`family_spec`).

    Attributes
    ----------
    family : str
        The Hugging Face ``model_type`` ("llama", "gpt_neox", ...), or "reference" for the package's models.
    architecture : str
        The Hugging Face class ("LlamaForCausalLM"), or the model's class.
    n_layers : int
        L, the number of blocks.
    attention_layers : tuple of int
        The true layer indices of the softmax-attention layers.
    skipped_layers : dict of int to str
        Layer -> why no attention analysis runs there (linear attention, Mamba, ...).
    n_heads, n_kv_heads, d_head, d_model : int
        Query heads, key/value heads, the width of a head and of the residual stream.
    positions : {"rotary", "alibi", "absolute", "relative", "none"}
        The position encoding ("relative": T5 buckets, in the reference models).
    rotary_base : float or None
        The rope theta of the (full-attention) rotary layers: the true one, not the bridge's ``cfg.rotary_base``.
    rotary_bases : dict of int to float
        Theta per rotary attention layer (Gemma 3's sliding layers use another one).
    rotary_dim : int or None
        The dims of a head that are rotated (partial rotary: fewer than d_head).
    rotary_style : {"half", "interleaved"} or None
        The pairing: Hugging Face ``rotate_half``, or GPT-J's ``rotate_every_two``.
    rope_type : str or None
        "default", "yarn", "llama3", ... (scaled types change inv_freq, not theta).
    rope_freqs : dict of int to (tuple of float, float)
        A scaled type's, per rotary layer: its inverse frequencies and the scale Hugging Face puts on cos and sin, read
        from the model's rotary module at load (``apply_spec_rotary`` rotates with them); empty for the plain theta.
    norm : NormSpec or None
        The norm on the attention input (None: post-norm only, or no norm).
    norm_placement : {"pre", "post", "sandwich"}
        "post": after attention (OLMo-2); "sandwich": before and after (Gemma 2 / 3).
    post_norm : NormSpec or None
        The norm on the attention output, where there is one.
    parallel_block : bool
        Attention and MLP read the same input (GPT-J, GPT-NeoX, Phi, Falcon).
    qk_norm : NormSpec or None
        The norm on keys (Qwen3, OLMo-2, Gemma 3, Qwen3-Next, ...).
    qk_norm_scope : {"head", "all_heads"} or None
        Over d_head, or over n_kv_heads * d_head (OLMo-2).
    qk_l2_norm : bool
        Queries and keys L2-normalised after the rotary (Llama 4's ``use_qk_norm``).
    fused_qkv : bool
        One projection makes q, k and v (GPT-2, GPT-NeoX, Phi-3, Falcon, BLOOM).
    key_rotated : bool
        ``key_hook(layer)`` holds keys after the rotary (False: apply it yourself with ``rotary_dim``,
        ``rotary_style`` and ``rotary_bases[layer]``).
    pattern_live : bool
        ``hook_pattern`` fires before the attention output and editing it changes the output.
    learned_sinks : bool
        A learned sink logit per head (gpt-oss): pattern rows sum to less than 1.
    gate : str or None
        The attention-output gate ("sigmoid(hook_q_gate), per head and dim"), or None.
    sliding_window : int or None
        The window of the sliding-window layers.
    sliding_layers : tuple of int
        The layers with a sliding window.
    attn_scale : float
        The true score scale: scores = attn_scale * q . k.
    attn_softcap : float or None
        Gemma 2's soft cap: scores = cap * tanh(scores / cap).
    notes : tuple of str
        Further facts, in sentences.
    nope_layers : tuple of int
        Attention layers without position encoding in a rotary model (NoPE: SmolLM3's and Llama 4's every 4th
        layer): no rotary step in their key path, and no entry in ``rotary_bases``.
    latent : dict or None
        Multi-head latent attention (DeepSeek-V2 / V3; :func:`latent_attention`): {"kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "d_head", "rope_interleave"}; None for
        attention with a per-head W_K.
    fired_hooks : frozenset of str
        The attention hooks called in the load-time forward pass (aliases included).
    """

    family: str  # Hugging Face model_type ("llama", "gpt_neox", ...), or "reference"
    architecture: str  # Hugging Face class ("LlamaForCausalLM"), or the model's class
    n_layers: int
    attention_layers: tuple[int, ...]  # true layer indices of softmax-attention layers
    skipped_layers: dict[int, str]  # layer -> why no analysis runs there
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    positions: str  # "rotary" | "alibi" | "absolute" | "relative" (T5 buckets, reference models) | "none"
    rotary_base: float | None = None  # theta of the (full-attention) rotary layers
    rotary_bases: dict[int, float] = field(
        default_factory=dict
    )  # per attention layer (Gemma 3: sliding layers use another theta)
    rotary_dim: int | None = None  # dims of a head that are rotated (partial rotary: < d_head)
    rotary_style: str | None = None  # "half" (HF rotate_half) | "interleaved" (GPT-J rotate_every_two)
    rope_type: str | None = None  # "default", "yarn", "llama3", ... (scaled types change inv_freq, not theta)
    rope_freqs: dict = field(default_factory=dict)  # a scaled type's, per layer: (inv_freq, HF's scale on cos and sin)
    norm: NormSpec | None  # the norm on the attention input (None: post-norm only, or no norm)
    norm_placement: str  # "pre" | "post" (OLMo-2: after attention) | "sandwich" (Gemma 2/3: before and after)
    post_norm: NormSpec | None = None  # the norm on the attention output, where there is one
    parallel_block: bool = False  # attention and MLP read the same input (GPT-J, GPT-NeoX, Phi, Falcon)
    qk_norm: NormSpec | None = None  # the norm on keys (Qwen3, OLMo-2, Gemma 3, Qwen3-Next ...)
    qk_norm_scope: str | None = None  # "head" (over d_head) | "all_heads" (OLMo-2: over n_kv_heads * d_head)
    qk_l2_norm: bool = False  # q and k L2-normalised after the rotary (Llama 4's use_qk_norm)
    fused_qkv: bool = False  # one projection makes q, k and v (GPT-2, GPT-NeoX, Phi-3, Falcon, BLOOM)
    key_rotated: bool  # key_hook holds keys after the rotary (False: apply it yourself)
    pattern_live: bool  # hook_pattern fires before the attention output and edits to it change the output
    learned_sinks: bool = False  # a learned sink logit per head (gpt-oss): pattern rows sum to < 1
    gate: str | None = None  # attention-output gate: "sigmoid(hook_q_gate), per head and dim" or None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    attn_scale: float  # scores = attn_scale * q . k
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    notes: tuple[str, ...] = ()
    nope_layers: tuple[int, ...] = ()  # attention layers without rotary in a rotary model (NoPE)
    latent: dict | None = None  # multi-head latent attention (DeepSeek-V2 / V3): latent_attention(config)
    _key_hook: str = "blocks.{layer}.attn.hook_k"
    _query_hook: str = "blocks.{layer}.attn.hook_q"
    _gate_hook: str | None = None
    _scores_hook: str | None = "blocks.{layer}.attn.hook_attn_scores"
    fired_hooks: frozenset[str] = field(default_factory=frozenset, repr=False)

    # ------------------------------------------------------------------ hook names
    def _check_attention_layer(self, layer: int) -> int:
        layer = int(layer)
        if layer in self.skipped_layers:
            raise ValueError(
                f"layer {layer} of this {self.family} model is not an attention layer "
                f"({self.skipped_layers[layer]}); attention layers: {list(self.attention_layers)}."
            )
        if layer not in self.attention_layers:
            raise ValueError(f"layer {layer} out of range: attention layers are {list(self.attention_layers)}.")
        return layer

    def key_hook(self, layer: int) -> str:
        """The hook holding the keys this layer's attention uses ((B, T, n_kv_heads, d_head)); rotated iff
        ``key_rotated``."""
        return self._key_hook.format(layer=self._check_attention_layer(layer))

    def query_hook(self, layer: int) -> str:
        """The hook holding the queries ((B, T, n_heads, d_head)); rotated iff ``key_rotated``."""
        return self._query_hook.format(layer=self._check_attention_layer(layer))

    def pattern_hook(self, layer: int) -> str:
        return f"blocks.{self._check_attention_layer(layer)}.attn.hook_pattern"

    def scores_hook(self, layer: int) -> str | None:
        """The hook holding the pre-softmax scores (B, H, T, T), or None where the bridge's ``hook_attn_scores``
        holds the softmax pattern instead (TransformerLens' generic AttentionBridge: GPT-J, OPT, Jamba)."""
        return None if self._scores_hook is None else self._scores_hook.format(layer=self._check_attention_layer(layer))

    def gate_hook(self, layer: int) -> str | None:
        """The attention-output gate logits ((B, T, n_heads * d_head); the gate is their sigmoid), or None."""
        return None if self._gate_hook is None else self._gate_hook.format(layer=self._check_attention_layer(layer))

    def fires(self, hook: str) -> bool:
        """Whether ``hook`` (an alias or canonical name) was called in the load-time forward pass."""
        return hook in self.fired_hooks

    # ------------------------------------------------------------------ protocol
    @property
    def rotary(self) -> bool:
        return self.positions == "rotary"

    def rotary_at(self, layer: int) -> bool:
        """Whether attention layer ``layer`` rotates its queries and keys (False on NoPE layers and without rotary)."""
        return self.rotary and int(layer) not in self.nope_layers

    def skipped_text(self) -> str:
        if not self.skipped_layers:
            return ""
        groups: dict[str, list[int]] = {}
        for l, why in sorted(self.skipped_layers.items()):
            groups.setdefault(why, []).append(l)
        return "; ".join(f"layers {ls} skipped ({why})" for why, ls in groups.items())

    def text(self) -> str:
        """The family in words, one sentence per fact the analyses depend on."""
        pos = {
            "rotary": (
                f"rotary positions (theta {self.rotary_base:g}, {self.rotary_dim} of {self.d_head} dims, "
                f"{'interleaved pairs' if self.rotary_style == 'interleaved' else 'rotate-half pairs'}"
                f"{', ' + self.rope_type + ' scaling' if self.rope_type not in (None, 'default') else ''})"
            )
            if self.rotary_base is not None
            else "rotary positions",
            "alibi": "ALiBi position biases (no rotation)",
            "absolute": "learned absolute positions",
            "none": "no position encoding",
        }.get(self.positions, self.positions)
        parts = [
            f"{self.family} ({self.architecture}): {len(self.attention_layers)} attention layers of "
            f"{self.n_layers}, {self.n_heads} heads, {self.n_kv_heads} KV heads, d_head {self.d_head}; {pos}."
        ]
        if self.nope_layers:
            parts.append(f"Layers {list(self.nope_layers)} have no position encoding (NoPE): no rotary step.")
        if self.skipped_layers:
            st = self.skipped_text()
            parts.append(st[0].upper() + st[1:] + ".")
        if self.norm is not None or self.post_norm is not None:
            n = self.norm or self.post_norm
            parts.append(
                f"{self.norm_placement.capitalize()}-norm {n.text()}"
                f"{'; attention and MLP in parallel' if self.parallel_block else ''}."
            )
        if self.qk_norm is not None:
            parts.append(
                f"Keys pass a {self.qk_norm.text()} over "
                f"{'each head' if self.qk_norm_scope == 'head' else 'all heads together'}."
            )
        if self.fused_qkv:
            parts.append("Fused QKV projection.")
        if self.learned_sinks:
            parts.append("A learned sink logit per head: attention rows sum to less than 1.")
        if self.gate:
            parts.append(f"Attention output gated: {self.gate}.")
        if self.sliding_window:
            parts.append(f"Sliding window of {self.sliding_window} tokens on layers {list(self.sliding_layers)}.")
        if self.attn_softcap:
            parts.append(f"Attention logits soft-capped at {self.attn_softcap:g}.")
        parts.extend(self.notes)
        return " ".join(parts)

    def to_dict(self) -> dict:
        d = _spec_dict(self)
        d.pop("fired_hooks"), d.pop("rope_freqs")
        d["skipped_layers"] = {str(k): v for k, v in self.skipped_layers.items()}
        d["rotary_bases"] = {str(k): v for k, v in self.rotary_bases.items()}
        return d


def _spec_dict(spec) -> dict:
    """A spec dataclass as plain data: its private hook templates under their public names, its tuples as lists."""
    return {k.lstrip("_"): list(v) if isinstance(v, tuple) else v for k, v in asdict(spec).items()}


# ----------------------------------------------------------------------------- Reading a model


def _hf_config(model: SinkModel):
    """The Hugging Face config behind a bridge (``original_model.config``); None for the package's reference models."""
    return getattr(getattr(model, "original_model", None), "config", None)


def rope_parameters(config, *, layer_type: str | None = None) -> dict:
    """The rope parameters of a Hugging Face config.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        Its ``rope_parameters`` (nested per layer type for Gemma 3), else its ``rope_theta``.
    layer_type : str, optional
        The layer type whose parameters to read where they are nested ("full_attention" by default).

    Returns
    -------
    dict
        E.g. ``{"rope_theta": 100000.0, "rope_type": "default"}``; empty without rotary.
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):  # a config of its own (remote code) may keep only rope_theta
        theta = getattr(config, "rope_theta", None)
        return {} if theta is None else {"rope_theta": theta}
    if params and all(isinstance(v, dict) for v in params.values()):
        params = params.get(layer_type or "full_attention") or next(iter(params.values()))
    return dict(params)


def rope_theta(config, *, layer_type: str | None = None) -> float | None:
    """The true rotary base of a Hugging Face config (transformers 5 keeps it in ``rope_parameters``).

    Parameters
    ----------
    config : transformers.PretrainedConfig
    layer_type : str, optional
        As in :func:`rope_parameters`.

    Returns
    -------
    float or None
    """
    theta = rope_parameters(config, layer_type=layer_type).get("rope_theta")
    return float(theta) if theta is not None else None


def rotary_base(model: SinkModel) -> float | None:
    """The rotary base a model really uses, from ``model.family``.

    The bridge's ``cfg.rotary_base`` can be wrong: SmolLM2 reads 10000 there while its rope theta is 100000.

    Parameters
    ----------
    model
        A loaded model (a TransformerBridge or a reference model).

    Returns
    -------
    float or None
        None for models without rotary embeddings.
    """
    spec = getattr(model, "family", None)
    if isinstance(spec, FamilySpec):
        return spec.rotary_base
    theta = getattr(model, "rope_theta", None)
    if theta is not None:
        return float(theta)
    hf_cfg = _hf_config(model)
    theta = rope_theta(hf_cfg) if hf_cfg is not None else None
    if theta is not None:
        return theta
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "positional_embedding_type", "rotary") != "rotary":
        return None
    base = getattr(cfg, "rotary_base", None)
    return float(base) if base is not None else None


# ----------------------------------------------------------------------- Multi-head latent attention (DeepSeek-V2 / V3)


def latent_attention(config) -> dict | None:
    """The multi-head latent attention (MLA) shape of a Hugging Face config, or None for other attention.

    MLA makes each head's key from two parts: ``qk_nope_head_dim`` dims decompressed (``kv_b_proj``) from a latent of
    ``kv_lora_rank`` dims that ``kv_a_layernorm`` normalises (its gain is the key's norm gain), and ``qk_rope_head_dim``
    dims of a rotary key (``kv_a_proj_with_mqa``'s last dims) shared by every head. The attention's keys are
    ``[k_nope, rotary(k_rope)]``: the rotary part is the last dims of the head.

    Parameters
    ----------
    config : transformers.PretrainedConfig or None

    Returns
    -------
    dict or None
        {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "d_head", "rope_interleave"}
        (d_head: nope + rope; rope_interleave: the rotary dims come in interleaved pairs
        (x_0, x_1), ... and leave the rotary de-interleaved, as rotate-half halves).
    """
    if (
        config is None
        or getattr(config, "kv_lora_rank", None) is None
        or getattr(config, "qk_rope_head_dim", None) is None
    ):
        return None
    out = {k: int(getattr(config, k)) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    out["d_head"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    out["rope_interleave"] = bool(getattr(config, "rope_interleave", False))
    return out


def _heads_after_positions(model, layers, n_heads: int, v_head_dim: int) -> bool:
    """TransformerLens' MLA bridge fires hook_q / hook_k / hook_v heads first ((B, H, T, d)); every other bridge, and
    every analysis, has the heads after the positions ((B, T, H, d)). Give these hooks that layout: each call
    transposes in, runs the hooks (which see and may edit (B, T, H, d)) and transposes back, so the model computes
    what it did. hook_z is split into heads of ``v_head_dim`` (the bridge splits it by ``cfg.d_head``, which MLA
    configs set to the rotary dims). Returns whether any hook was changed."""
    from transformer_lens.hook_points import HookPoint  # import time: the bridge's hook class, only for MLA models

    class HeadsAfterPositions(HookPoint):
        def __call__(self, x, *args, **kwargs):
            return super().__call__(x.transpose(1, 2), *args, **kwargs).transpose(1, 2)

    changed = False
    for l in layers:
        attn = model.blocks[l].attn
        for name in ("hook_q", "hook_k", "hook_v"):
            hook = getattr(attn, name, None)
            if isinstance(hook, HookPoint) and getattr(hook, "pos_dim", 1) == 2:
                hook.__class__ = HeadsAfterPositions
                hook.pos_dim = 1
                changed = True
        conv = getattr(getattr(getattr(attn, "o", None), "hook_in", None), "hook_conversion", None)
        if conv is not None and hasattr(conv, "d_head"):
            conv.n_heads, conv.d_head = n_heads, v_head_dim
    return changed


def _bridge_submodule(model, layer: int, path: str):
    obj = model.blocks[layer]
    for part in path.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    return getattr(obj, "original_component", None) if obj is not None else None


def _module_path(model, module) -> str:
    hf = getattr(model, "original_model", None)
    if hf is not None:
        for name, m in hf.named_modules():
            if m is module:  # the bridge wraps HF modules; name the HF path
                return name.replace("._original_component", "")
    return type(module).__name__


def _gain_and_bias(module) -> tuple:
    """A norm module's gain and bias as it stores them: Hugging Face ``weight`` / ``bias``, else analysis.train's
    ``w`` / ``b`` (None where absent)."""
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    return (getattr(module, "w", None) if w is None else w), (getattr(module, "b", None) if b is None else b)


@reads_module_weights  # the real gain on a model split by a device map (offloaded weights)
def probe_norm(module, *, model: SinkModel = None) -> NormSpec | None:
    """Measure a norm module's form: run it on a probe and match RMSNorm / LayerNorm with gain w or 1 + w.

    Parameters
    ----------
    module : torch.nn.Module
        A norm module with a gain per dim (``weight``, or ``w`` in the reference models; Command R+'s q/k norms: one
        per head, (heads, d_head), normalising each head's d_head).
    model : TransformerBridge, optional
        The model the module belongs to, to name its Hugging Face path.

    Returns
    -------
    NormSpec or None
        None where the module is not a plain RMSNorm / LayerNorm.
    """
    w, b = _gain_and_bias(module)
    if not isinstance(w, torch.Tensor) or w.ndim not in (1, 2):
        return None
    b = b if isinstance(b, torch.Tensor) else None
    eps = next(
        (
            float(getattr(module, a))
            for a in ("eps", "variance_epsilon", "epsilon")
            if getattr(module, a, None) is not None
        ),
        1e-5,
    )
    D = w.shape[-1]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, *w.shape, generator=g) + 3.0).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        y = module(x).float().cpu()
    x = x.float().cpu()
    wf = w.detach().float().cpu()
    bf = b.detach().float().cpu() if b is not None else torch.zeros(w.shape)
    best = None
    for kind in ("RMSNorm", "LayerNorm"):
        xc = x - x.mean(-1, keepdim=True) if kind == "LayerNorm" else x
        n = xc / (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        for offset in (0.0, 1.0):
            err = float((n * (offset + wf) + bf - y).abs().max())
            if best is None or err < best[0]:
                best = (err, kind, offset)
    err, kind, offset = best
    tol = max(1e-3, 8 * torch.finfo(w.dtype).eps) if w.dtype.is_floating_point else 1e-3
    if err > tol * max(1.0, float(y.abs().max())):
        return None  # not a plain RMSNorm / LayerNorm
    return NormSpec(kind, offset, b is not None, eps, int(D), _module_path(model, module) if model is not None else "")


def _probe_tokens(model: SinkModel, n: int) -> torch.Tensor:
    """Tokens 1..n (modulo the vocabulary) on the model's input device, shape (1, n): a probe pass's input."""
    return (
        torch.arange(1, n + 1, device=input_device(model)) % max(int(getattr(model.cfg, "d_vocab", 0) or 0), n + 1)
    )[None]


def _record_hooks(model: SinkModel, names: list[str], n_tokens: int) -> tuple[dict, dict[str, str]]:
    """One forward pass over ``n_tokens`` probe tokens with each of ``names`` (aliases welcome) hooked once: ({canonical
    name: its first value, float32 on the CPU (None where not a tensor)} of the hooks called, in call order,
    {name: canonical name})."""
    hook_dict = getattr(model, "hook_dict", {})
    canonical = {n: getattr(hook_dict[n], "name", n) for n in names}
    seen: dict[str, torch.Tensor | None] = {}

    def rec(x, hook):
        if seen.get(hook.name) is None:
            seen[hook.name] = x.detach().float().cpu() if isinstance(x, torch.Tensor) else None

    with torch.inference_mode():
        model.run_with_hooks(
            _probe_tokens(model, n_tokens), fwd_hooks=list({canonical[n]: (n, rec) for n in names}.values())
        )
    return seen, canonical


def _dry_run(model) -> tuple[frozenset[str], bool]:
    """One forward pass over two tokens: the attention hooks called (aliases included), and whether
    ``hook_attn_scores`` holds the softmax pattern (not the scores) in the first attention layer."""
    hook_dict = getattr(model, "hook_dict", {})
    names = [n for n in hook_dict if n.startswith("blocks.") and ".attn." in n and not n.endswith(_FLAGGED)]
    seen, canonical = _record_hooks(model, names, 2)

    def first(kind: str) -> torch.Tensor | None:  # the first value of this hook kind: the first attention layer's
        return next((x for n, x in seen.items() if n.endswith("." + kind) and x is not None), None)

    s, p = first("hook_attn_scores"), first("hook_pattern")
    scores_are_pattern = s is not None and p is not None and s.shape == p.shape and torch.allclose(s, p, atol=1e-6)
    return frozenset(n for n in names if canonical[n] in seen), scores_are_pattern


def _pattern_is_live(model: SinkModel, layer: int) -> bool:
    """Whether editing ``blocks.{layer}.attn.hook_pattern`` changes the model's output.

    TransformerLens' generic AttentionBridge (GPT-J, OPT, Jamba) lets Hugging Face compute the attention and only then
    reports the pattern: the hook fires after ``hook_z`` and is read-only there, so pattern interventions must edit
    ``hook_z`` instead."""
    tokens = _probe_tokens(model, 2)
    with torch.inference_mode(), warnings.catch_warnings():  # the bridge warns where the edit is discarded: the probe
        warnings.filterwarnings("ignore", message="A hook on .*hook_pattern returned a modified tensor")
        base = model(tokens)
        edited = model.run_with_hooks(
            tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_pattern", lambda p, hook: torch.zeros_like(p))]
        )
    return not torch.equal(base, edited)


def _layer_types(config, n_layers: int) -> list[str] | None:
    types = getattr(config, "layers_block_type", None)  # Jamba: "mamba" / "attention"
    if types is None:
        types = getattr(config, "layer_types", None)
    if types is None:
        return None
    mamba2 = getattr(config, "model_type", None) in MAMBA2_AS_LINEAR_ATTENTION
    return [("mamba2" if mamba2 and t == "linear_attention" else t) for t in list(types)[:n_layers]]


def _rotary_dim(hf, config, family: str, d_head: int) -> int | None:
    for mod in hf.modules():
        rd = getattr(mod, "rotary_dim", None) or getattr(mod, "rotary_ndims", None)
        if isinstance(rd, int) and rd > 0:
            return rd
    for name, buf in hf.named_buffers():
        if name.endswith("inv_freq") and "original" not in name.rsplit(".", 1)[-1]:
            return 2 * buf.numel()
    frac = rope_parameters(config).get("partial_rotary_factor") or getattr(config, "rotary_pct", None)
    return int(d_head * float(frac)) if frac else d_head


def _attn_scale(hf_attn, d_head: int) -> float:
    """The score scale a Hugging Face attention module keeps (``scaling``, Falcon's ``inv_norm_factor``, GPT-J's
    divisor ``scale_attn``), else 1 / sqrt(d_head)."""
    for attr, divisor in (("scaling", False), ("inv_norm_factor", False), ("scale_attn", True)):
        s = getattr(hf_attn, attr, None)
        if isinstance(s, (int, float)) or (divisor and isinstance(s, torch.Tensor)):
            return 1.0 / float(s) if divisor else float(s)
    return d_head**-0.5


def _positions(hf, config, family: str, types, attention_layers, tl_pos, d_head: int) -> dict:
    """The FamilySpec position fields: positions, rotary_base, rotary_bases, rotary_dim, rotary_style, rope_type."""
    if family in ALIBI or getattr(config, "alibi", False) or tl_pos == "alibi":
        positions = "alibi"
    elif tl_pos == "rotary" or any(n.endswith("inv_freq") for n, _ in hf.named_buffers()):
        positions = "rotary"
    elif tl_pos == "standard":
        positions = "absolute"
    else:
        positions = "none"
    out = dict.fromkeys(("rotary_base", "rotary_dim", "rotary_style", "rope_type"))  # None without rotary
    out.update(positions=positions, rotary_bases={}, nope_layers=())
    if positions != "rotary":
        return out
    # the attention layers left without rotary: no_rope_layers (SmolLM3, Llama 4: one flag per layer, 0 = NoPE)
    flags = getattr(config, "no_rope_layers", None)
    if isinstance(flags, (list, tuple)) and len(flags) >= max(attention_layers, default=-1) + 1:
        out["nope_layers"] = tuple(l for l in attention_layers if not flags[l])
    bases = out["rotary_bases"]
    for l in (l for l in attention_layers if l not in out["nope_layers"]):
        t = types[l] if types and types[l] in ("sliding_attention", "full_attention") else None
        theta = rope_theta(config, layer_type=t)
        if theta is None and family in INTERLEAVED_ROTARY:
            theta = 10000.0  # GPT-J / CodeGen: fixed base, not in the config
        if theta is not None:
            bases[l] = theta
    base = rope_theta(config, layer_type="full_attention") if bases else None
    out["rotary_base"] = base if base is not None or not bases else bases[max(bases)]
    out["rotary_dim"] = _rotary_dim(hf, config, family, d_head)
    out["rotary_style"] = "interleaved" if family in INTERLEAVED_ROTARY else "half"
    out["rope_type"] = rope_parameters(config).get("rope_type") or "default"
    if out["rope_type"] != "default":  # its frequencies and cos/sin scale, as the model's rotary module holds them
        s = next((float(m.attention_scaling) for m in hf.modules() if hasattr(m, "attention_scaling")), 1.0)
        inv = _layer_inv_freq(hf, types)
        out["rope_freqs"] = {l: (tuple(inv[l].tolist()), s) for l in bases if inv[l] is not None and not inv[l].is_meta}
    return out


def _sliding(config, types, attention_layers) -> tuple[int | None, tuple[int, ...]]:
    """(the sliding window, the layers it applies to), or (None, ())."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None, ()
    if types and any(t in ("sliding_attention", "full_attention") for t in types):
        sliding = tuple(l for l in attention_layers if types[l] == "sliding_attention")
    else:
        sliding = tuple(attention_layers)
    return (window, sliding) if sliding else (None, tuple(sliding))


def _norms(model, first: int, k_normed_fires: bool, d_head: int) -> dict:
    """The FamilySpec norm fields, measured on the modules the bridge maps (ln1 feeds attention, ln1_post is on its
    output, attn.k_norm on the keys): norm, norm_placement, post_norm, qk_norm, qk_norm_scope."""
    norm, post = (probe_norm(_bridge_submodule(model, first, p), model=model) for p in ("ln1", "ln1_post"))
    placement = "sandwich" if norm and post else ("post" if post else ("pre" if norm else "none"))
    qk_norm, qk_scope = None, None
    if k_normed_fires:
        qk_norm = probe_norm(_bridge_submodule(model, first, "attn.k_norm"), model=model)
        if qk_norm is not None:
            qk_scope = "head" if qk_norm.size == d_head else "all_heads"
    return {"norm": norm, "norm_placement": placement, "post_norm": post, "qk_norm": qk_norm, "qk_norm_scope": qk_scope}


def _gate_and_scores_hooks(fires_everywhere, scores_are_pattern: bool) -> tuple[str | None, str | None]:
    """(the attention-output gate hook template, the pre-softmax scores hook template), each None where it does not
    fire on every attention layer (or, for the scores, holds the pattern)."""
    gate = "blocks.{layer}.attn.hook_q_gate" if fires_everywhere("hook_q_gate") else None
    scores = (
        "blocks.{layer}.attn.hook_attn_scores"
        if fires_everywhere("hook_attn_scores") and not scores_are_pattern
        else None
    )
    return gate, scores


def _qk_hooks(positions: str, fires_everywhere, mla: dict | None) -> tuple[bool, str, str]:
    """(key_rotated, key hook template, query hook template): the hooks that hold the keys and queries the attention
    uses. MLA: hook_k / hook_q hold the whole key and query, their rotary dims already rotated (hook_rot_k holds only
    the shared rotary key)."""
    if mla is not None:
        return True, "blocks.{layer}.attn.hook_k", "blocks.{layer}.attn.hook_q"
    key_rotated = positions == "rotary" and fires_everywhere("hook_rot_k") and fires_everywhere("hook_rot_q")
    if key_rotated:
        return True, "blocks.{layer}.attn.hook_rot_k", "blocks.{layer}.attn.hook_rot_q"
    return False, "blocks.{layer}.attn.hook_k", "blocks.{layer}.attn.hook_q"


def _notes(
    config,
    rotary_unhooked: bool,
    pattern_read_only: bool,
    scores_are_pattern: bool,
    gate_in_q: bool,
    mla: dict | None = None,
) -> list[str]:
    """What an analysis of this family must know about its hooks, one sentence each."""
    notes = []
    if mla is not None:
        notes.append(
            f"Multi-head latent attention: each head's key is {mla['qk_nope_head_dim']} dims decompressed from a "
            f"{mla['kv_lora_rank']}-dim latent (normalised by kv_a_layernorm, whose gain is the key's norm "
            f"gain) and {mla['qk_rope_head_dim']} rotary dims shared by the heads, last in the head."
        )
    if rotary_unhooked:
        notes.append(
            "The bridge does not fire hook_rot_q/hook_rot_k here: keys are taken from hook_k, before the rotary."
        )
    if pattern_read_only:
        notes.append(
            "hook_pattern is read-only here (it fires after the attention output, hook_z): interventions "
            "must edit hook_z (or the keys / values), not the pattern."
        )
    if scores_are_pattern:
        notes.append(
            "The bridge's hook_attn_scores holds the softmax pattern here, not the scores: rebuild scores "
            "from the query and key hooks."
        )
    if gate_in_q:
        notes.append(
            "hook_q (q.hook_out) holds the query and the gate interleaved per head ((B, T, H, 2 * d_head)); "
            "use hook_rot_q / hook_q_normed for queries."
        )
    if getattr(config, "residual_multiplier", None) not in (None, 1.0):
        notes.append(
            f"Residual branches scaled by {config.residual_multiplier:g}, embeddings by "
            f"{getattr(config, 'embedding_multiplier', 1.0):g}."
        )
    return notes


def _skipped(types, n_layers: int, attention_layers) -> dict[int, str]:
    """{layer: why no attention analysis runs there} for the layers that are not attention layers."""
    skipped = {}
    for l in (l for l in range(n_layers) if l not in attention_layers):
        t = types[l] if types else None
        if t in LAYER_TYPE_WORDS:
            skipped[l] = LAYER_TYPE_WORDS[t]
        elif t and "attention" in t:  # Nemotron-H: a generic mixer bridge
            skipped[l] = f"{t} layer the bridge exposes no attention-pattern hook for (blocks.{l}.attn.hook_pattern)"
        else:
            skipped[l] = (
                f"{t} layer: no attention pattern" if t else f"no attention-pattern hook (blocks.{l}.attn.hook_pattern)"
            )
    return skipped


def family_spec(model: SinkModel) -> FamilySpec:
    """Read the family facts of a loaded model (a TransformerBridge, or a reference model of ``analysis.train``).

    Runs one forward pass of two tokens to record which hooks fire; the loader calls this once and keeps the result as
    ``model.family`` (use :func:`get_family`).

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    FamilySpec
    """
    cfg = model.cfg
    config = _hf_config(model)
    hook_dict = getattr(model, "hook_dict", {})
    n_layers = int(cfg.n_layers)
    attention_layers = tuple(l for l in range(n_layers) if f"blocks.{l}.attn.hook_pattern" in hook_dict)
    types = _layer_types(config, n_layers) if config is not None else None
    skipped = _skipped(types, n_layers, attention_layers)
    n_heads, d_head, d_model = int(cfg.n_heads), int(cfg.d_head), int(cfg.d_model)
    n_kv = int(getattr(cfg, "n_key_value_heads", None) or n_heads)
    mla = latent_attention(config)
    if mla is not None:  # every head has its own key (decompressed from the latent), d_head = nope + rope dims
        n_kv, d_head = n_heads, mla["d_head"]
        _heads_after_positions(model, attention_layers, n_heads, mla["v_head_dim"])
    fired, scores_are_pattern = _dry_run(model)

    def fires_everywhere(suffix: str) -> bool:
        return bool(attention_layers) and all(f"blocks.{l}.attn.{suffix}" in fired for l in attention_layers)

    shape = dict(
        n_layers=n_layers,
        attention_layers=attention_layers,
        skipped_layers=skipped,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        d_head=d_head,
        d_model=d_model,
    )
    if config is None:
        return _reference_spec(model, shape, fired, fires_everywhere, scores_are_pattern)
    return _bridge_spec(model, config, types, shape, fired, fires_everywhere, scores_are_pattern, mla)


def _bridge_spec(
    model, config, types, shape: dict, fired, fires_everywhere, scores_are_pattern: bool, mla: dict | None
) -> FamilySpec:
    """A TransformerBridge's family facts, read from its Hugging Face config and modules and the hooks that fired;
    ``shape`` holds its layers, heads and widths."""
    attention_layers, d_head = shape["attention_layers"], shape["d_head"]
    first = attention_layers[0] if attention_layers else 0
    hf = model.original_model
    family = str(getattr(config, "model_type", "unknown"))
    tl_pos = getattr(model.cfg, "positional_embedding_type", None)
    pos = _positions(hf, config, family, types, attention_layers, tl_pos, d_head)
    norms = _norms(model, first, fires_everywhere("hook_k_normed"), d_head)
    attn = _attention_facts(
        model, config, types, attention_layers, d_head, pos["positions"], fires_everywhere, scores_are_pattern, mla
    )
    if mla is not None:
        pos["rotary_dim"] = mla["qk_rope_head_dim"]
    notes = _notes(
        config,
        pos["positions"] == "rotary" and not attn["key_rotated"],
        bool(attention_layers) and not attn["pattern_live"],
        scores_are_pattern,
        bool(attn["_gate_hook"]) and f"blocks.{first}.attn.hook_q" in fired,
        mla,
    )
    return FamilySpec(
        family=family,
        architecture=type(hf).__name__,
        **shape,
        **pos,
        **norms,
        **attn,
        parallel_block=bool(getattr(model.cfg, "parallel_attn_mlp", False)),
        notes=tuple(notes),
        latent=mla,
        fired_hooks=fired,
    )


def _attention_facts(
    model,
    config,
    types,
    attention_layers: tuple,
    d_head: int,
    positions: str,
    fires_everywhere,
    scores_are_pattern: bool,
    mla: dict | None,
) -> dict:
    """A TransformerBridge's attention facts, as FamilySpec fields: the fused projection, the hooks holding the
    (rotated) keys and queries, the output gate and the scores, whether the pattern is live, learned sinks, the sliding
    window, the scale and the softcap."""
    first = attention_layers[0] if attention_layers else 0
    hf_attn = _bridge_submodule(model, first, "attn") if attention_layers else None
    fused = getattr(getattr(model.blocks[first], "attn", None), "qkv", None) is not None
    key_rotated, key_hook, query_hook = _qk_hooks(positions, fires_everywhere, mla)
    gate_hook, scores_hook = _gate_and_scores_hooks(fires_everywhere, scores_are_pattern)
    live = _pattern_is_live(model, first) if attention_layers else False
    learned_sinks = hf_attn is not None and isinstance(getattr(hf_attn, "sinks", None), torch.Tensor)
    window, sliding = _sliding(config, types, attention_layers)
    return dict(
        fused_qkv=fused,
        key_rotated=key_rotated,
        pattern_live=live,
        learned_sinks=learned_sinks,
        qk_l2_norm=getattr(hf_attn, "qk_norm", None) is not None,
        gate="sigmoid(hook_q_gate), per head and dim, multiplies the attention output before o_proj"
        if gate_hook
        else None,
        sliding_window=int(window) if window else None,
        sliding_layers=tuple(sliding),
        attn_scale=_attn_scale(hf_attn, d_head),
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        _key_hook=key_hook,
        _query_hook=query_hook,
        _gate_hook=gate_hook,
        _scores_hook=scores_hook,
    )


def _reference_spec(model, shape: dict, fired, fires_everywhere, scores_are_pattern: bool) -> FamilySpec:
    """The package's own reference models (``analysis.train``): read from ``model.cfg`` and the hooks; ``shape`` holds
    its layers, heads and widths."""
    cfg = model.cfg
    attention_layers, d_head = shape["attention_layers"], shape["d_head"]
    pos = getattr(cfg, "positional_embedding_type", None)
    positions = {
        "rotary": "rotary",
        "alibi": "alibi",
        "standard": "absolute",
        "learned": "absolute",
        "sinusoidal": "absolute",
        "relative": "relative",
    }.get(pos, "none")
    post = getattr(cfg, "norm_position", "pre") == "post"
    key_rotated, key_hook, query_hook = _qk_hooks(positions, fires_everywhere, None)  # hook_rot_q / _k fire together
    base = getattr(model, "rope_theta", None) or getattr(cfg, "rotary_base", None)
    first = attention_layers[0] if attention_layers else 0
    ln = getattr(model.blocks[first], "ln1", None)
    norm = probe_norm(ln) if ln is not None else None
    return FamilySpec(
        family="reference",
        architecture=type(model).__name__,
        **shape,
        positions=positions,
        rotary_base=float(base) if positions == "rotary" and base else None,
        rotary_bases={l: float(base) for l in attention_layers} if positions == "rotary" and base else {},
        rotary_dim=(getattr(cfg, "rotary_dim", None) or d_head) if positions == "rotary" else None,
        rotary_style="half" if positions == "rotary" else None,
        rope_type="default" if positions == "rotary" else None,
        norm=None if post else norm,
        norm_placement=("post" if post else "pre") if norm else "none",
        post_norm=norm if post else None,
        key_rotated=key_rotated,
        pattern_live=_pattern_is_live(model, first) if attention_layers else False,
        attn_scale=d_head**-0.5,
        _key_hook=key_hook,
        _query_hook=query_hook,
        _scores_hook=_gate_and_scores_hooks(fires_everywhere, scores_are_pattern)[1],
        fired_hooks=fired,
    )


def _kept(model, attr: str, cls, read):
    """``model.<attr>`` where it is a ``cls``; else ``read(model)``, kept there (for a model that takes new attributes)."""
    spec = getattr(model, attr, None)
    if isinstance(spec, cls):
        return spec
    spec = read(model)
    with contextlib.suppress(AttributeError, TypeError):  # pragma: no cover - a model that refuses new attributes
        setattr(model, attr, spec)
    return spec


def get_family(model: SinkModel) -> FamilySpec:
    """``model.family``, read (and kept on the model) on first use for models not loaded by ``load_model``.

    Parameters
    ----------
    model : SinkModel
        Any model with TransformerLens hook names.

    Returns
    -------
    FamilySpec
    """
    return _kept(model, "family", FamilySpec, family_spec)


def attention_layers(model: SinkModel) -> list[int]:
    """True indices of the softmax-attention layers (all layers but the linear-attention / Mamba ones).

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    list of int
    """
    return list(get_family(model).attention_layers)


def sink_logits(model: SinkModel, layer: int) -> torch.Tensor:
    """The learned sink logit of each head of a layer (gpt-oss).

    Parameters
    ----------
    model
        A model whose family has ``learned_sinks`` (ValueError otherwise).
    layer : int
        An attention layer.

    Returns
    -------
    torch.Tensor, shape (n_heads,)
        float32 on the CPU.
    """
    spec = get_family(model)
    if not spec.learned_sinks:
        raise ValueError(f"this {spec.family} model has no learned sink logits (only gpt-oss-style attention does).")
    attn = _bridge_submodule(model, spec._check_attention_layer(layer), "attn")
    return attn.sinks.detach().float().cpu()


def config_attention_layers(config) -> list[int]:
    """The softmax-attention layers a Hugging Face config declares (for a bare Hugging Face model, without hooks).

    Every layer but those whose layer type (``layer_types`` / Jamba's ``layers_block_type``) is a linear-attention,
    Mamba or convolution layer (``LAYER_TYPE_WORDS``).

    Parameters
    ----------
    config : transformers.PretrainedConfig

    Returns
    -------
    list of int
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = int(cfg.num_hidden_layers)
    types = _layer_types(cfg, n)
    return [l for l in range(n) if not types or types[l] not in LAYER_TYPE_WORDS]


@dataclass(frozen=True)
class DecoderPositions:
    """Where a bare Hugging Face causal LM puts its tokens, per decoder layer: what a KV cache that drops tokens and moves
    the rest must know (``analysis.streaming``'s sink cache re-rotates kept keys with ``inv_freq``).

    Attributes
    ----------
    family : str
        ``config.model_type``.
    positions : {"rotary", "alibi", "absolute", "none"}
    inv_freq : tuple of (torch.Tensor or None)
        Per decoder layer, the inverse frequencies its keys are rotated with, read from the model's rotary module (so a
        scaled rope type's are the scaled ones; Gemma 3's sliding layers have their own); None on a NoPE layer and
        without rotary. Partial rotary rotates the first ``2 * inv_freq.numel()`` dims of a head.
    rotary_style : {"half", "interleaved"} or None
    rope_type : str or None
        "default", "linear", "llama3", "yarn", "dynamic", "longrope"...
    sliding_window : int or None
        The window of the sliding-window layers.
    chunk : int or None
        Llama 4's chunked attention: the chunk size.
    other_layers : dict of int to str
        The layers that are not softmax attention (linear attention, Mamba, hybrid mixers), in words.
    latent : bool
        Multi-head latent attention (DeepSeek): the rotary key is the last dims of the head.
    """

    family: str
    positions: str
    inv_freq: tuple
    rotary_style: str | None
    rope_type: str | None
    sliding_window: int | None
    chunk: int | None
    other_layers: dict
    latent: bool


def _layer_inv_freq(hf, types) -> list:
    """Per layer, the rotary module's inverse frequencies for that layer's type (``{type}_inv_freq``), else its one
    ``inv_freq``."""
    leaves = [(n.rsplit(".", 1)[-1], b) for n, b in hf.named_buffers()]  # the bridge's wrap: "._original_component."
    bufs = {n: b for n, b in leaves if n.endswith("inv_freq") and "original" not in n}
    plain = [b for n, b in leaves if n == "inv_freq"]
    if len(plain) > 1 and any(not torch.equal(b, plain[0]) for b in plain):
        raise ValueError(
            f"{type(hf).__name__} has {len(plain)} different rotary embeddings that its layers "
            "cannot be matched with; only per-layer-type ones ({type}_inv_freq) are read."
        )
    n = len(types) if types else int(hf.config.get_text_config(decoder=True).num_hidden_layers)
    return [bufs.get(f"{types[l]}_inv_freq" if types else "", plain[0] if plain else None) for l in range(n)]


def decoder_positions(hf) -> DecoderPositions:
    """The position facts of a bare Hugging Face causal LM (no bridge, no hooks): the rotary frequencies of each layer,
    NoPE layers, sliding window, the layers that are not attention.

    Parameters
    ----------
    hf : transformers.PreTrainedModel
        A causal LM (``AutoModelForCausalLM``, or ``analysis.model.contract.hf_module`` of a loaded model).

    Returns
    -------
    DecoderPositions
    """
    config = hf.config.get_text_config(decoder=True)
    family = str(getattr(config, "model_type", "unknown"))
    n = int(config.num_hidden_layers)
    types = _layer_types(config, n)
    attention = config_attention_layers(config)
    other = _skipped(types, n, [l for l in attention if not types or types[l] != "hybrid"])
    learned = any(
        isinstance(m, torch.nn.Embedding)
        and name.rsplit(".", 1)[-1] in ("wpe", "embed_positions", "position_embeddings")
        for name, m in hf.named_modules()
    )
    tl_pos = "rotary" if family in INTERLEAVED_ROTARY else "standard" if learned else None  # GPT-J: no inv_freq buffer
    pos = _positions(hf, config, family, types, attention, tl_pos, 0)
    inv = [None] * n
    if pos["positions"] == "rotary":
        inv = [None if l in pos["nope_layers"] or l in other else f for l, f in enumerate(_layer_inv_freq(hf, types))]
        rd, base = pos["rotary_dim"], pos["rotary_base"]
        inv = [
            f
            if f is not None or l not in pos["rotary_bases"] or not rd
            else 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
            for l, f in enumerate(inv)
        ]
    window, _ = _sliding(config, types, attention)
    return DecoderPositions(
        family=family,
        positions=pos["positions"],
        inv_freq=tuple(inv),
        rotary_style=pos["rotary_style"],
        rope_type=pos["rope_type"],
        sliding_window=int(window) if window else None,
        chunk=getattr(config, "attention_chunk_size", None),
        other_layers=other,
        latent=latent_attention(config) is not None,
    )


@contextlib.contextmanager
def attention_implementation(hf, name: str) -> Iterator[None]:
    """Run the Hugging Face model ``hf`` under attention implementation ``name`` (a built-in one or one registered
    with ``transformers.AttentionInterface``) while inside the block, restoring the model's choice after.

    Through ``set_attn_implementation``, which checks the name and sets the sub-configs of multimodal models too.
    The package's one owner of this switch (the fused sink path and streaming perplexity both use it).

    Parameters
    ----------
    hf : transformers.PreTrainedModel
        The Hugging Face model.
    name : str
        The attention implementation ("sdpa", "eager", or a registered name).

    Yields
    ------
    None
    """
    old = hf.config._attn_implementation
    if old == name:
        yield
        return
    hf.set_attn_implementation(name)
    try:
        yield
    finally:
        hf.set_attn_implementation(old)
