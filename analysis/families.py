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

The MLP of each block is described by :class:`MlpSpec` (``get_mlp(model)``, measured on first use and kept as
``model.mlp_spec``): the hooks of its neuron activations and gate / up pre-activations, its weights in one
orientation (:func:`mlp_weights`), the activation, whether it reads the block's input (parallel blocks), its input
norm, how its output reaches the residual stream (as it is, scaled, or through a post-norm), the token mixers without
``hook_attn_out``, and for mixtures of experts the routed experts' writes (:func:`expert_writes`).
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

# Families whose rotary rotates adjacent pairs (x0, x1), (x2, x3)... ("rotate_every_two") instead of the two
# halves of the rotary dims (HF "rotate_half", GPT-NeoX style, every other family here).
INTERLEAVED_ROTARY = frozenset({"gptj", "codegen"})
# Families with ALiBi biases instead of rotary (Falcon has it as a config switch, read from ``config.alibi``).
ALIBI = frozenset({"bloom", "mpt"})
# What a skipped layer type is, in words.
LAYER_TYPE_WORDS = {
    "linear_attention": "linear attention (Gated DeltaNet): no softmax attention pattern",
    "mamba": "Mamba state-space layer: no attention pattern",
    "mamba2": "Mamba-2 state-space layer: no attention pattern",
    "conv": "short convolution layer: no attention pattern",
}
# Families whose blocks each read only the residual stream entering them (no state carried from one block to the
# next besides it), so a pass can resume at a block from that residual with the earlier blocks skipped
# (``passes.Resume``); each is checked against the full pass by tests/test_interventions.py.
RESUMABLE = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo2",
                       "granite", "stablelm", "starcoder2", "gpt2", "gpt_neox", "gptj", "opt", "falcon",
                       "gpt_oss", "qwen3_next", "qwen3_5_text", "jamba"})
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


@dataclass(frozen=True)
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
    rotary_base: float | None  # theta of the (full-attention) rotary layers
    rotary_bases: dict[int, float]  # per attention layer (Gemma 3: sliding layers use another theta)
    rotary_dim: int | None  # dims of a head that are rotated (partial rotary: < d_head)
    rotary_style: str | None  # "half" (HF rotate_half) | "interleaved" (GPT-J rotate_every_two)
    rope_type: str | None  # "default", "yarn", "llama3", ... (scaled types change inv_freq, not theta)
    norm: NormSpec | None  # the norm on the attention input (None: post-norm only, or no norm)
    norm_placement: str  # "pre" | "post" (OLMo-2: after attention) | "sandwich" (Gemma 2/3: before and after)
    post_norm: NormSpec | None  # the norm on the attention output, where there is one
    parallel_block: bool  # attention and MLP read the same input (GPT-J, GPT-NeoX, Phi, Falcon)
    qk_norm: NormSpec | None  # the norm on keys (Qwen3, OLMo-2, Gemma 3, Qwen3-Next ...)
    qk_norm_scope: str | None  # "head" (over d_head) | "all_heads" (OLMo-2: over n_kv_heads * d_head)
    fused_qkv: bool  # one projection makes q, k and v (GPT-2, GPT-NeoX, Phi-3, Falcon, BLOOM)
    key_rotated: bool  # key_hook holds keys after the rotary (False: apply it yourself)
    pattern_live: bool  # hook_pattern fires before the attention output and edits to it change the output
    learned_sinks: bool  # a learned sink logit per head (gpt-oss): pattern rows sum to < 1
    gate: str | None  # attention-output gate: "sigmoid(hook_q_gate), per head and dim" or None
    sliding_window: int | None
    sliding_layers: tuple[int, ...]
    attn_scale: float  # scores = attn_scale * q . k
    attn_softcap: float | None  # Gemma 2: scores = cap * tanh(scores / cap)
    notes: tuple[str, ...] = ()
    _key_hook: str = "blocks.{layer}.attn.hook_k"
    _query_hook: str = "blocks.{layer}.attn.hook_q"
    _gate_hook: str | None = None
    _scores_hook: str | None = "blocks.{layer}.attn.hook_attn_scores"
    fired_hooks: frozenset[str] = field(default_factory=frozenset, repr=False)

    # ------------------------------------------------------------------ hook names
    def _check_attention_layer(self, layer: int) -> int:
        layer = int(layer)
        if layer in self.skipped_layers:
            raise ValueError(f"layer {layer} of this {self.family} model is not an attention layer "
                             f"({self.skipped_layers[layer]}); attention layers: {list(self.attention_layers)}.")
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

    def skipped_text(self) -> str:
        if not self.skipped_layers:
            return ""
        groups: dict[str, list[int]] = {}
        for l, why in sorted(self.skipped_layers.items()):
            groups.setdefault(why, []).append(l)
        return "; ".join(f"layers {ls} skipped ({why})" for why, ls in groups.items())

    def text(self) -> str:
        """The family in words, one sentence per fact the analyses depend on."""
        pos = {"rotary": (f"rotary positions (theta {self.rotary_base:g}, {self.rotary_dim} of {self.d_head} dims, "
                          f"{'interleaved pairs' if self.rotary_style == 'interleaved' else 'rotate-half pairs'}"
                          f"{', ' + self.rope_type + ' scaling' if self.rope_type not in (None, 'default') else ''})")
                         if self.rotary_base is not None else "rotary positions",
               "alibi": "ALiBi position biases (no rotation)", "absolute": "learned absolute positions",
               "none": "no position encoding"}.get(self.positions, self.positions)
        parts = [f"{self.family} ({self.architecture}): {len(self.attention_layers)} attention layers of "
                 f"{self.n_layers}, {self.n_heads} heads, {self.n_kv_heads} KV heads, d_head {self.d_head}; {pos}."]
        if self.skipped_layers:
            st = self.skipped_text()
            parts.append(st[0].upper() + st[1:] + ".")
        if self.norm is not None or self.post_norm is not None:
            n = self.norm or self.post_norm
            parts.append(f"{self.norm_placement.capitalize()}-norm {n.text()}"
                         f"{'; attention and MLP in parallel' if self.parallel_block else ''}.")
        if self.qk_norm is not None:
            parts.append(f"Keys pass a {self.qk_norm.text()} over "
                         f"{'each head' if self.qk_norm_scope == 'head' else 'all heads together'}.")
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
        d = asdict(self)
        d.pop("fired_hooks")
        for k in ("_key_hook", "_query_hook", "_gate_hook", "_scores_hook"):
            d[k.lstrip("_")] = d.pop(k)
        d["skipped_layers"] = {str(k): v for k, v in self.skipped_layers.items()}
        d["rotary_bases"] = {str(k): v for k, v in self.rotary_bases.items()}
        d["attention_layers"] = list(self.attention_layers)
        d["sliding_layers"] = list(self.sliding_layers)
        d["notes"] = list(self.notes)
        return d


# ----------------------------------------------------------------------------------------------
# Reading a model
# ----------------------------------------------------------------------------------------------


def hf_config(model):
    """The Hugging Face config behind a bridge.

    Parameters
    ----------
    model
        A TransformerBridge (or any model with ``original_model.config``).

    Returns
    -------
    transformers.PretrainedConfig or None
        None for the package's reference models.
    """
    return getattr(getattr(model, "original_model", None), "config", None)


def rope_parameters(config, *, layer_type: str | None = None) -> dict:
    """The rope parameters of a Hugging Face config.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        Transformers 5 ``rope_parameters`` (nested per layer type for Gemma 3), or transformers 4 ``rope_theta`` /
        ``rope_scaling``.
    layer_type : str, optional
        The layer type whose parameters to read where they are nested ("full_attention" by default).

    Returns
    -------
    dict
        E.g. ``{"rope_theta": 100000.0, "rope_type": "default"}``; empty without rotary.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        if params and all(isinstance(v, dict) for v in params.values()):
            params = params.get(layer_type or "full_attention") or next(iter(params.values()))
        return dict(params)
    out = {}
    if getattr(config, "rope_theta", None) is not None:
        out["rope_theta"] = config.rope_theta
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        out.update(scaling)
        out.setdefault("rope_type", scaling.get("type"))
    return out


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
    if theta is None:
        theta = getattr(config, "rotary_emb_base", None) or getattr(config, "rope_theta", None)
    return float(theta) if theta is not None else None


def rotary_base(model) -> float | None:
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
    hf_cfg = hf_config(model)
    if hf_cfg is not None and rope_theta(hf_cfg) is not None:
        return rope_theta(hf_cfg)
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "positional_embedding_type", "rotary") != "rotary":
        return None
    base = getattr(cfg, "rotary_base", None)
    return float(base) if base is not None else None


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


def probe_norm(module, *, model=None) -> NormSpec | None:
    """Measure a norm module's form: run it on a probe and match RMSNorm / LayerNorm with gain w or 1 + w.

    Parameters
    ----------
    module : torch.nn.Module
        A norm module with a 1-d gain (``weight``, or ``w`` in the reference models).
    model : TransformerBridge, optional
        The model the module belongs to, to name its Hugging Face path.

    Returns
    -------
    NormSpec or None
        None where the module is not a plain RMSNorm / LayerNorm.
    """
    w = getattr(module, "weight", None)
    if w is None:
        w = getattr(module, "w", None)  # analysis.train's Norm
    if not isinstance(w, torch.Tensor) or w.ndim != 1:
        return None
    b = getattr(module, "bias", None)
    if b is None:
        b = getattr(module, "b", None)
    b = b if isinstance(b, torch.Tensor) else None
    eps = next((float(getattr(module, a)) for a in ("eps", "variance_epsilon", "epsilon") if getattr(module, a, None)
                is not None), 1e-5)
    D = w.shape[0]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, D, generator=g) + 3.0).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        y = module(x).float().cpu()
    x = x.float().cpu()
    wf = w.detach().float().cpu()
    bf = b.detach().float().cpu() if b is not None else torch.zeros(D)
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


def fired_hooks(model, *, names: list[str] | None = None) -> frozenset[str]:
    """The attention hook names (aliases included) called in one forward pass over two tokens.

    Parameters
    ----------
    model
        A model with TransformerLens hooks.
    names : list of str, optional
        The hooks to watch; None: every attention hook of the blocks.

    Returns
    -------
    frozenset of str
    """
    return _dry_run(model, names)[0]


def _dry_run(model, names: list[str] | None = None) -> tuple[frozenset[str], bool]:
    """One forward pass over two tokens: the attention hooks called, and whether ``hook_attn_scores`` holds the
    softmax pattern (not the scores) in the first attention layer."""
    hook_dict = getattr(model, "hook_dict", {})
    if names is None:
        names = [n for n in hook_dict if n.startswith("blocks.") and ".attn." in n and not n.endswith(_FLAGGED)]
    canonical = {n: getattr(hook_dict[n], "name", n) for n in names}
    seen: set[str] = set()
    first: dict[str, torch.Tensor] = {}

    def rec(x, hook):
        seen.add(hook.name)
        kind = hook.name.rsplit(".", 1)[-1]
        if kind in ("hook_attn_scores", "hook_pattern") and kind not in first and isinstance(x, torch.Tensor):
            first[kind] = x.detach().float().cpu()

    try:
        device = next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        device = torch.device("cpu")
    tokens = torch.tensor([[1, 2]], device=device) % max(int(getattr(model.cfg, "d_vocab", 3) or 3), 3)
    hooks, done = [], set()
    for n in names:
        if canonical[n] not in done:
            hooks.append((n, rec))
            done.add(canonical[n])
    with torch.inference_mode():
        model.run_with_hooks(tokens, fwd_hooks=hooks)
    s, p = first.get("hook_attn_scores"), first.get("hook_pattern")
    scores_are_pattern = s is not None and p is not None and s.shape == p.shape and torch.allclose(s, p, atol=1e-6)
    return frozenset(n for n in names if canonical[n] in seen), scores_are_pattern


def pattern_is_live(model, layer: int) -> bool:
    """Whether editing ``blocks.{layer}.attn.hook_pattern`` changes the model's output.

    TransformerLens' generic AttentionBridge (GPT-J, OPT, Jamba) lets Hugging Face compute the attention and only then
    reports the pattern: the hook fires after ``hook_z`` and is read-only there, so pattern interventions must edit
    ``hook_z`` instead.

    Parameters
    ----------
    model
        A model with TransformerLens hooks.
    layer : int
        An attention layer.

    Returns
    -------
    bool
    """
    device = next(model.parameters()).device
    tokens = torch.tensor([[1, 2]], device=device) % max(int(getattr(model.cfg, "d_vocab", 3) or 3), 3)
    with torch.inference_mode():
        base = model(tokens)
        edited = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_pattern",
                                                          lambda p, hook: torch.zeros_like(p))])
    return not torch.equal(base, edited)


def _layer_types(config, n_layers: int) -> list[str] | None:
    types = getattr(config, "layers_block_type", None)  # Jamba: "mamba" / "attention"
    if types is None:
        types = getattr(config, "layer_types", None)
    return list(types)[:n_layers] if types is not None else None


def _rotary_dim(hf, config, family: str, d_head: int) -> int | None:
    for mod in hf.modules():
        rd = getattr(mod, "rotary_dim", None) or getattr(mod, "rotary_ndims", None)
        if isinstance(rd, int) and rd > 0:
            return rd
    for name, buf in hf.named_buffers():
        if name.endswith("inv_freq") and "original" not in name:
            return 2 * buf.numel()
    frac = rope_parameters(config).get("partial_rotary_factor") or getattr(config, "rotary_pct", None)
    return int(d_head * float(frac)) if frac else d_head


def _attn_scale(hf_attn, d_head: int) -> float:
    if hf_attn is not None:
        s = getattr(hf_attn, "scaling", None)
        if isinstance(s, (int, float)):
            return float(s)
        s = getattr(hf_attn, "inv_norm_factor", None)
        if isinstance(s, (int, float)):
            return float(s)
        s = getattr(hf_attn, "scale_attn", None)
        if isinstance(s, (int, float, torch.Tensor)):
            return 1.0 / float(s)
    return d_head ** -0.5


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
    out = {"positions": positions, "rotary_base": None, "rotary_bases": {}, "rotary_dim": None, "rotary_style": None,
           "rope_type": None}
    if positions != "rotary":
        return out
    bases = out["rotary_bases"]
    for l in attention_layers:
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
    block = model.blocks[first]
    norm = (probe_norm(_bridge_submodule(model, first, "ln1"), model=model)
            if getattr(block, "ln1", None) is not None else None)
    post = (probe_norm(_bridge_submodule(model, first, "ln1_post"), model=model)
            if getattr(block, "ln1_post", None) is not None else None)
    placement = "sandwich" if norm and post else ("post" if post else ("pre" if norm else "none"))
    qk_norm, qk_scope = None, None
    if getattr(block.attn, "k_norm", None) is not None and k_normed_fires:
        qk_norm = probe_norm(_bridge_submodule(model, first, "attn.k_norm"), model=model)
        if qk_norm is not None:
            qk_scope = "head" if qk_norm.size == d_head else "all_heads"
    return {"norm": norm, "norm_placement": placement, "post_norm": post, "qk_norm": qk_norm, "qk_norm_scope": qk_scope}


def _notes(config, rotary_unhooked: bool, pattern_read_only: bool, scores_are_pattern: bool, gate_in_q: bool) -> list[str]:
    """What an analysis of this family must know about its hooks, one sentence each."""
    notes = []
    if rotary_unhooked:
        notes.append("The bridge does not fire hook_rot_q/hook_rot_k here: keys are taken from hook_k, before the rotary.")
    if pattern_read_only:
        notes.append("hook_pattern is read-only here (it fires after the attention output, hook_z): interventions "
                     "must edit hook_z (or the keys / values), not the pattern.")
    if scores_are_pattern:
        notes.append("The bridge's hook_attn_scores holds the softmax pattern here, not the scores: rebuild scores "
                     "from the query and key hooks.")
    if gate_in_q:
        notes.append("hook_q (q.hook_out) holds the query and the gate interleaved per head ((B, T, H, 2 * d_head)); "
                     "use hook_rot_q / hook_q_normed for queries.")
    if getattr(config, "residual_multiplier", None) not in (None, 1.0):
        notes.append(f"Residual branches scaled by {config.residual_multiplier:g}, embeddings by "
                     f"{getattr(config, 'embedding_multiplier', 1.0):g}.")
    return notes


def _skipped(types, n_layers: int, attention_layers) -> dict[int, str]:
    """{layer: why no attention analysis runs there} for the layers that are not attention layers."""
    skipped = {}
    for l in range(n_layers):
        if l not in attention_layers:
            t = types[l] if types else None
            skipped[l] = LAYER_TYPE_WORDS.get(t, f"{t} layer: no attention pattern" if t else
                                              "no attention-pattern hook (blocks.{l}.attn.hook_pattern)".format(l=l))
    return skipped


def family_spec(model) -> FamilySpec:
    """Read the family facts of a loaded model (a TransformerBridge, or a reference model of ``analysis.train``).

    Runs one forward pass of two tokens to record which hooks fire; the loader calls this once and keeps the result as
    ``model.family`` (use :func:`get_family`).

    Parameters
    ----------
    model
        A loaded model.

    Returns
    -------
    FamilySpec
    """
    cfg = model.cfg
    config = hf_config(model)
    hook_dict = getattr(model, "hook_dict", {})
    n_layers = int(cfg.n_layers)
    attention_layers = tuple(l for l in range(n_layers) if f"blocks.{l}.attn.hook_pattern" in hook_dict)
    types = _layer_types(config, n_layers) if config is not None else None
    skipped = _skipped(types, n_layers, attention_layers)
    n_heads, d_head, d_model = int(cfg.n_heads), int(cfg.d_head), int(cfg.d_model)
    n_kv = int(getattr(cfg, "n_key_value_heads", None) or n_heads)
    fired, scores_are_pattern = _dry_run(model)
    first = attention_layers[0] if attention_layers else 0

    def fires_everywhere(suffix: str) -> bool:
        return bool(attention_layers) and all(f"blocks.{l}.attn.{suffix}" in fired for l in attention_layers)

    tl_pos = getattr(cfg, "positional_embedding_type", None)
    if config is None:
        return _reference_spec(model, attention_layers, skipped, n_heads, n_kv, d_head, d_model, fired, fires_everywhere,
                               scores_are_pattern)

    hf = model.original_model
    family = str(getattr(config, "model_type", "unknown"))
    architecture = type(hf).__name__
    hf_attn = _bridge_submodule(model, first, "attn") if attention_layers else None

    pos = _positions(hf, config, family, types, attention_layers, tl_pos, d_head)

    norms = _norms(model, first, fires_everywhere("hook_k_normed"), d_head)
    block = model.blocks[first]
    fused = getattr(block.attn, "qkv", None) is not None
    key_rotated = pos["positions"] == "rotary" and fires_everywhere("hook_rot_k") and fires_everywhere("hook_rot_q")
    key_hook = "blocks.{layer}.attn.hook_rot_k" if key_rotated else "blocks.{layer}.attn.hook_k"
    query_hook = "blocks.{layer}.attn.hook_rot_q" if key_rotated else "blocks.{layer}.attn.hook_q"
    gate_hook = "blocks.{layer}.attn.hook_q_gate" if fires_everywhere("hook_q_gate") else None
    live = pattern_is_live(model, first) if attention_layers else False
    scores_hook = ("blocks.{layer}.attn.hook_attn_scores" if fires_everywhere("hook_attn_scores") and not scores_are_pattern
                   else None)
    learned_sinks = hf_attn is not None and isinstance(getattr(hf_attn, "sinks", None), torch.Tensor)

    window, sliding = _sliding(config, types, attention_layers)

    notes = _notes(config, pos["positions"] == "rotary" and not key_rotated, bool(attention_layers) and not live,
                   scores_are_pattern, bool(gate_hook) and f"blocks.{first}.attn.hook_q" in fired)
    return FamilySpec(
        family=family, architecture=architecture, n_layers=n_layers, attention_layers=attention_layers,
        skipped_layers=skipped, n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head, d_model=d_model,
        **pos, **norms, parallel_block=bool(getattr(cfg, "parallel_attn_mlp", False)),
        fused_qkv=fused, key_rotated=key_rotated, pattern_live=live, learned_sinks=learned_sinks,
        gate="sigmoid(hook_q_gate), per head and dim, multiplies the attention output before o_proj" if gate_hook
        else None,
        sliding_window=int(window) if window else None, sliding_layers=tuple(sliding),
        attn_scale=_attn_scale(hf_attn, d_head), attn_softcap=getattr(config, "attn_logit_softcapping", None),
        notes=tuple(notes), _key_hook=key_hook, _query_hook=query_hook, _gate_hook=gate_hook, _scores_hook=scores_hook,
        fired_hooks=fired,
    )


def _reference_spec(model, attention_layers, skipped, n_heads, n_kv, d_head, d_model, fired, fires_everywhere,
                    scores_are_pattern=False):
    """The package's own reference models (``analysis.train``): read from ``model.cfg`` and the hooks."""
    cfg = model.cfg
    pos = getattr(cfg, "positional_embedding_type", None)
    positions = {"rotary": "rotary", "alibi": "alibi", "standard": "absolute", "learned": "absolute",
                 "sinusoidal": "absolute", "relative": "relative"}.get(pos, "none")
    post = getattr(cfg, "norm_position", "pre") == "post"
    key_rotated = positions == "rotary" and fires_everywhere("hook_rot_k")
    base = getattr(model, "rope_theta", None) or getattr(cfg, "rotary_base", None)
    first = attention_layers[0] if attention_layers else 0
    ln = getattr(model.blocks[first], "ln1", None)
    norm = probe_norm(ln) if ln is not None else None
    return FamilySpec(
        family="reference", architecture=type(model).__name__, n_layers=int(cfg.n_layers),
        attention_layers=attention_layers, skipped_layers=skipped, n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head,
        d_model=d_model, positions=positions, rotary_base=float(base) if positions == "rotary" and base else None,
        rotary_bases={l: float(base) for l in attention_layers} if positions == "rotary" and base else {},
        rotary_dim=(getattr(cfg, "rotary_dim", None) or d_head) if positions == "rotary" else None,
        rotary_style="half" if positions == "rotary" else None, rope_type="default" if positions == "rotary" else None,
        norm=None if post else norm, norm_placement=("post" if post else "pre") if norm else "none",
        post_norm=norm if post else None, parallel_block=False, qk_norm=None,
        qk_norm_scope=None, fused_qkv=False, key_rotated=key_rotated,
        pattern_live=pattern_is_live(model, first) if attention_layers else False, learned_sinks=False, gate=None,
        sliding_window=None, sliding_layers=(), attn_scale=d_head ** -0.5, attn_softcap=None,
        _key_hook="blocks.{layer}.attn.hook_rot_k" if key_rotated else "blocks.{layer}.attn.hook_k",
        _query_hook="blocks.{layer}.attn.hook_rot_q" if key_rotated else "blocks.{layer}.attn.hook_q",
        _scores_hook=("blocks.{layer}.attn.hook_attn_scores" if fires_everywhere("hook_attn_scores")
                      and not scores_are_pattern else None),
        fired_hooks=fired,
    )


def _kept(model, attr: str, cls, read):
    """``model.<attr>`` where it is a ``cls``; else ``read(model)``, kept there (for a model that takes new attributes)."""
    spec = getattr(model, attr, None)
    if isinstance(spec, cls):
        return spec
    spec = read(model)
    try:
        setattr(model, attr, spec)
    except (AttributeError, TypeError):  # pragma: no cover - a model that refuses new attributes
        pass
    return spec


def get_family(model) -> FamilySpec:
    """``model.family``, read (and kept on the model) on first use for models not loaded by ``load_model``.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.

    Returns
    -------
    FamilySpec
    """
    return _kept(model, "family", FamilySpec, family_spec)


def attention_layers(model) -> list[int]:
    """True indices of the softmax-attention layers (all layers but the linear-attention / Mamba ones).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.

    Returns
    -------
    list of int
    """
    return list(get_family(model).attention_layers)


def sink_logits(model, layer: int) -> torch.Tensor:
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


# ----------------------------------------------------------------------------------------------
# MLP blocks: where the neurons are, their weights, and how an MLP's write reaches the residual stream
# ----------------------------------------------------------------------------------------------

# The activations an MLP neuron may apply, by name (matched against the model's own activation module on a probe).
ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": lambda x: torch.nn.functional.gelu(x),
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu2": lambda x: torch.relu(x) ** 2,
}
# The per-block hooks the MLP dry run reads (aliases; the bridge maps hook_pre / hook_pre_linear / hook_post to
# mlp.gate.hook_out / mlp.in.hook_out / mlp.out.hook_in, the reference models have them under these names).
_MLP_PROBE_HOOKS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out",
                    "mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post", "mlp.hook_in", "mlp.hook_expert_indices")


@dataclass(frozen=True)
class MlpWeights:
    """One MLP's weights in one orientation for every family (float32, CPU).

    Neuron n reads ``W_in[n]`` (and ``W_gate[n]``) from the MLP input and writes ``W_out[:, n]`` into the residual
    stream (before ``output`` scaling, see :class:`MlpSpec`).

    Attributes
    ----------
    layer : int
        The block.
    W_out : torch.Tensor, shape (d_model, d_mlp)
        The output projection.
    b_out : torch.Tensor, shape (d_model,), or None
    W_in : torch.Tensor, shape (d_mlp, d_model)
        The up projection of a gated MLP, the input projection of a plain one.
    b_in : torch.Tensor, shape (d_mlp,), or None
    W_gate : torch.Tensor, shape (d_mlp, d_model), or None
        The gate projection (gated MLPs only).
    b_gate : torch.Tensor, shape (d_mlp,), or None
    """

    layer: int
    W_out: torch.Tensor  # (d_model, d_mlp)
    b_out: torch.Tensor | None  # (d_model,)
    W_in: torch.Tensor  # (d_mlp, d_model): the up projection of a gated MLP, the input projection of a plain one
    b_in: torch.Tensor | None  # (d_mlp,)
    W_gate: torch.Tensor | None  # (d_mlp, d_model), gated MLPs only
    b_gate: torch.Tensor | None  # (d_mlp,)


@dataclass(frozen=True)
class MlpSpec:
    """What the MLP of each block computes and how its write reaches the residual stream.

    Measured on one loaded model by :func:`mlp_spec` (one forward pass over a few tokens, hooks on every block; cached
    by :func:`get_mlp`). A dense MLP's neuron n computes a_n = act(g_n) u_n (``kind="gated"``: SwiGLU / GeGLU, g =
    W_gate x + b_gate, u = W_in x + b_in) or a_n = act(u_n) (``"plain"``), x the MLP input (``input_norm`` of the
    residual ``input_resid``), and the block adds ``output(W_out a + b_out)`` to the residual stream: the identity
    (``"add"``), a constant factor (``"scaled"``, Granite's residual multiplier) or a norm (``"post_norm"``: Gemma 2/3
    and OLMo-2 normalise the MLP output before adding it). ``"moe"`` blocks (gpt-oss, Qwen3-Next, Jamba's expert layers)
    route each token to a few experts whose neurons no hook holds: their writes are measured per block, and per expert
    by calling the block's router and experts (``moe_parts``). The facts of the first dense block stand for every dense
    block.

    Attributes
    ----------
    family : str
        The model family (``FamilySpec.family``).
    kind : {"gated", "plain", "moe", "none"}
        "none": no MLP hook fires.
    activation : str or None
        Measured on the model's activation module: a key of ``ACTIVATIONS``, or "unknown".
    d_mlp : int or None
        The number of neurons per dense MLP.
    parallel : bool
        The MLP reads the block's input (``hook_resid_pre``), as the attention does (GPT-J, NeoX, Phi, Falcon).
    input_resid : {"resid_pre", "resid_mid"}
        The residual the MLP input is made from.
    input_norm : NormSpec or None
        The norm on that residual (None: the MLP reads the raw residual, OLMo-2).
    input_norm_module : str or None
        The block's attribute holding it ("ln1" or "ln2").
    output : {"add", "scaled", "post_norm", "unknown"}
        How W_out a + b_out reaches the residual stream.
    output_scale : float
        ``hook_mlp_out / (W_out a + b_out)`` where ``output == "scaled"`` (1.0 otherwise).
    output_norm : NormSpec or None
        The norm on the MLP output where ``output == "post_norm"``.
    output_norm_module : str or None
        Its block attribute ("ln2_post").
    additive : bool
        ``hook_resid_post = hook_resid_pre + the attention (mixer) write + hook_mlp_out`` on every block.
    mixer_layers : tuple of int
        Blocks whose token mixer has no ``hook_attn_out`` (Mamba, linear attention): their write is
        ``hook_resid_mid - hook_resid_pre``.
    moe_layers : tuple of int
        Blocks whose MLP is a mixture of experts.
    n_experts, top_k : int or None
        Experts per mixture-of-experts block, and experts routed per token.
    notes : tuple of str
        Further facts, in sentences.
    """

    family: str
    kind: str  # "gated" | "plain" | "moe" | "none" (no MLP hook fires)
    activation: str | None  # measured on the model's activation module: a key of ACTIVATIONS, or "unknown"
    d_mlp: int | None
    parallel: bool  # the MLP reads the block's input (hook_resid_pre), as the attention does (GPT-J, NeoX, Phi, Falcon)
    input_resid: str  # "resid_pre" | "resid_mid": the residual the MLP input is made from
    input_norm: NormSpec | None  # the norm on that residual (None: the MLP reads the raw residual, OLMo-2)
    input_norm_module: str | None  # the block's attribute holding it ("ln1" | "ln2")
    output: str  # "add" | "scaled" | "post_norm" | "unknown"
    output_scale: float  # hook_mlp_out / (W_out a + b_out) where output == "scaled" (1.0 otherwise)
    output_norm: NormSpec | None  # the norm on the MLP output where output == "post_norm"
    output_norm_module: str | None  # its block attribute ("ln2_post")
    additive: bool  # hook_resid_post = hook_resid_pre + the attention (mixer) write + hook_mlp_out, on every block
    mixer_layers: tuple[int, ...]  # blocks whose token mixer has no hook_attn_out (Mamba, linear attention): their
    # write is hook_resid_mid - hook_resid_pre
    moe_layers: tuple[int, ...]  # blocks whose MLP is a mixture of experts
    n_experts: int | None = None
    top_k: int | None = None
    notes: tuple[str, ...] = ()
    _neuron_hook: str | None = None  # (B, T, d_mlp): the out projection's input, a_n
    _gate_hook: str | None = None  # (B, T, d_mlp): g_n (gated)
    _up_hook: str | None = None  # (B, T, d_mlp): u_n (gated: the linear branch; plain: the pre-activation)
    _input_hook: str | None = None  # (B, T, d_model): the MLP input x where a hook holds it

    # ------------------------------------------------------------------ hook names
    def check_layer(self, layer: int, n_layers: int) -> int:
        layer = int(layer)
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} out of range: this model has blocks 0..{n_layers - 1}.")
        return layer

    def has_neurons(self, layer: int) -> bool:
        """Whether a hook holds the neuron activations of block ``layer``'s MLP (dense gated or plain MLPs)."""
        return self.kind in ("gated", "plain") and int(layer) not in self.moe_layers

    def _hook(self, template: str | None, layer: int, what: str) -> str:
        if template is None or not self.has_neurons(layer):
            why = ("a mixture of experts: no hook holds its experts' neurons" if int(layer) in self.moe_layers or
                   self.kind == "moe" else f"{self.kind} MLP")
            raise ValueError(f"block {layer} of this {self.family} model has no {what} hook ({why}).")
        return template.format(layer=int(layer))

    def neuron_hook(self, layer: int) -> str:
        """The hook holding the MLP's neuron activations a (B, T, d_mlp): the input of the output projection."""
        return self._hook(self._neuron_hook, layer, "neuron-activation")

    def gate_hook(self, layer: int) -> str:
        """The hook holding the gate pre-activations g (B, T, d_mlp) of a gated MLP."""
        return self._hook(self._gate_hook, layer, "gate")

    def up_hook(self, layer: int) -> str:
        """The hook holding u (B, T, d_mlp): a gated MLP's linear branch, a plain MLP's pre-activation."""
        return self._hook(self._up_hook, layer, "up / pre-activation")

    def attn_write_hook(self, layer: int) -> str | None:
        """The hook holding the token mixer's write into the residual stream (``hook_attn_out``), or None where the
        mixer has none (its write is hook_resid_mid - hook_resid_pre)."""
        return None if int(layer) in self.mixer_layers else f"blocks.{int(layer)}.hook_attn_out"

    def act(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"the MLP activation of this {self.family} model is {self.activation!r}.")
        return ACTIVATIONS[self.activation](x)

    # ------------------------------------------------------------------ protocol
    def text(self) -> str:
        """The MLP in words, one sentence per fact the analyses depend on."""
        if self.kind == "none":
            return f"{self.family}: no MLP hook fires; the MLP's neurons cannot be read."
        what = {"gated": f"gated MLP (act(gate) x up, {self.activation})", "plain": f"plain MLP ({self.activation})",
                "moe": "mixture-of-experts MLP"}[self.kind]
        parts = [f"{self.family}: {what}" + (f" with {self.d_mlp} neurons" if self.d_mlp else "") + "; it reads "
                 + (f"{self.input_norm.text()} of " if self.input_norm else "the raw ")
                 + ("the block's input (in parallel with attention)." if self.parallel else "the residual after attention.")]
        if self.moe_layers and self.kind != "moe":
            parts.append(f"Blocks {list(self.moe_layers)} are mixtures of {self.n_experts} experts (top {self.top_k}).")
        elif self.kind == "moe":
            parts.append(f"Every MLP routes each token to {self.top_k} of {self.n_experts} experts; no hook holds an "
                         "expert's neurons, so writes are resolved per block and per expert, not per neuron.")
        parts.append({"add": "Its output is added to the residual stream as it is.",
                      "scaled": f"Its output is scaled by {self.output_scale:g} before it is added (residual multiplier).",
                      "post_norm": f"Its output passes a {self.output_norm.text() if self.output_norm else 'norm'} "
                                   "before it is added (per-token scale).",
                      "unknown": "How its output reaches the residual stream could not be measured."}[self.output])
        if self.mixer_layers:
            parts.append(f"Blocks {list(self.mixer_layers)} mix tokens without softmax attention; their write is "
                         "hook_resid_mid - hook_resid_pre.")
        if not self.additive:
            parts.append("hook_resid_post is not the stream before the MLP plus hook_mlp_out (a post-norm stream, or a "
                         "hook that edits the stream): the writes do not add up to the stream.")
        parts.extend(self.notes)
        return " ".join(parts)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("_neuron_hook", "_gate_hook", "_up_hook", "_input_hook"):
            d[k.lstrip("_")] = d.pop(k)
        d["mixer_layers"], d["moe_layers"], d["notes"] = list(self.mixer_layers), list(self.moe_layers), list(self.notes)
        return d


def _mlp_module(model, layer: int):
    """The model's own MLP module of block ``layer`` (the Hugging Face module behind a bridge; the reference
    model's MLP)."""
    mlp = getattr(model.blocks[layer], "mlp", None)
    if mlp is None:
        return None
    return getattr(mlp, "original_component", None) or mlp


def _is_moe(model, layer: int) -> bool:
    if f"blocks.{layer}.mlp.hook_expert_indices" in getattr(model, "hook_dict", {}):
        return True
    mod = _mlp_module(model, layer)
    return mod is not None and getattr(mod, "experts", None) is not None


def moe_parts(model, layer: int):
    """The (router, experts) modules of a mixture-of-experts block.

    ``router(x)`` gives (logits, weights, indices) and ``experts(x, indices, weights)`` the routed experts' weighted
    sum, for x (n_tokens, d_model) (the form of gpt-oss and Qwen3-Next in transformers 5).

    Parameters
    ----------
    model
        A loaded model.
    layer : int
        A mixture-of-experts block (ValueError where the block does not have this form).

    Returns
    -------
    tuple of (torch.nn.Module, torch.nn.Module)
    """
    mod = _mlp_module(model, layer)
    experts = getattr(mod, "experts", None)
    router = getattr(mod, "router", None) or getattr(mod, "gate", None)
    router = getattr(router, "original_component", None) or router
    if experts is None or router is None:
        raise ValueError(f"block {layer}'s MLP is not a mixture of experts with a router and experts module.")
    return router, experts


def expert_writes(model, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Who writes a mixture-of-experts block's output, from the block's router and experts (``moe_parts``) and the block
    itself, all run on ``x``.

    Parameters
    ----------
    model
        A loaded model.
    layer : int
        A mixture-of-experts block.
    x : torch.Tensor, shape (n, d_model)
        The MLP inputs of n tokens.

    Returns
    -------
    indices : torch.Tensor, shape (n, top_k)
        The routed experts of each token.
    writes : torch.Tensor, shape (n, top_k, d_model)
        Each routed expert's weighted output alone.
    rest : torch.Tensor, shape (n, d_model)
        What the block adds beyond them (a shared expert, Qwen3-Next; zero for gpt-oss).
    """
    router, experts = moe_parts(model, layer)
    block = _mlp_module(model, layer)
    x = _on_model(model, x)  # the trace keeps x on the CPU
    with torch.no_grad():
        _, weights, idx = router(x)
        slots = torch.stack([experts(x, idx[:, j : j + 1], weights[:, j : j + 1]) for j in range(idx.shape[1])], 1)
        total = block(x[None])
        total = (total[0] if isinstance(total, tuple) else total)[0]
    return idx.cpu(), slots.float().cpu(), (total.float() - slots.float().sum(1)).cpu()


def _rounding(dtype: torch.dtype) -> float:
    """A few rounding units of a model computing in bf16 / fp16 (0 in float32 / float64): how far the checks that
    rebuild its activations from its weights in float32 must let them differ (a bf16 value carries 8 bits)."""
    return 4 * torch.finfo(dtype).eps if dtype.is_floating_point and torch.finfo(dtype).bits < 32 else 0.0


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, *, atol: float, rtol: float) -> bool:
    """``torch.allclose(a, b, atol, rtol)`` (float32 tolerances), widened for a model computing in ``dtype`` to its
    rounding: ``_rounding(dtype)`` of each value and of b's largest |value| (a sum of rounded terms)."""
    u = _rounding(dtype)
    return torch.allclose(a, b, atol=max(atol, u * float(b.abs().max())), rtol=max(rtol, u))


def _as_linear(module, d_in: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W (d_out, d_in), b (d_out,) or None) of a linear module, whichever way it stores its weight (nn.Linear:
    (out, in); GPT-2's Conv1D: (in, out)): the orientation is the one whose product rebuilds ``module(probe)``."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        raise ValueError(f"{type(module).__name__} has no 2-d weight to read.")
    p = torch.randn(2, d_in, generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    with torch.no_grad():
        y = module(p).float()
        zero = module(torch.zeros_like(p[:1])).float()[0]
    wf = w.detach().float()
    for W in ([wf] if wf.shape[1] == d_in else []) + ([wf.T] if wf.shape[0] == d_in else []):
        if _close(p.float() @ W.T + zero, y, w.dtype, atol=1e-4, rtol=1e-3):  # a bf16 module rounds its output
            b = zero.cpu() if zero.abs().max() > 0 else None
            return W.contiguous().cpu(), b
    raise ValueError(f"{type(module).__name__} (weight {tuple(w.shape)}) is not a linear map of its input.")


def mlp_weights(model, layer: int) -> MlpWeights:
    """The weights of a block's dense MLP, read from the bridge's out / in / gate projections (their orientation
    measured) or the reference model's W_in / W_gate / W_out.

    Parameters
    ----------
    model
        A loaded model.
    layer : int
        A block with a dense MLP (ValueError, saying why, otherwise).

    Returns
    -------
    MlpWeights
    """
    spec = get_mlp(model)
    layer = spec.check_layer(layer, int(model.cfg.n_layers))
    if not spec.has_neurons(layer):
        spec.neuron_hook(layer)  # raises, saying why
    mlp = model.blocks[layer].mlp
    D = int(model.cfg.d_model)
    if isinstance(getattr(mlp, "W_out", None), torch.nn.Parameter) and getattr(mlp, "original_component", None) is None:
        gate = getattr(mlp, "W_gate", None)  # analysis.train's MLP: x @ W_in, x @ W_gate, a @ W_out
        return MlpWeights(layer, mlp.W_out.detach().float().T.contiguous().cpu(), None,
                          mlp.W_in.detach().float().T.contiguous().cpu(), None,
                          None if gate is None else gate.detach().float().T.contiguous().cpu(), None)
    mods = {k: getattr(getattr(mlp, k, None), "original_component", None) for k in ("in", "gate", "out")}
    if mods["out"] is None or mods["in"] is None:
        raise ValueError(f"block {layer}'s MLP bridge has no in / out projections (mlp.in, mlp.out).")
    W_in, b_in = _as_linear(mods["in"], D)
    W_out, b_out = _as_linear(mods["out"], W_in.shape[0])
    W_gate, b_gate = _as_linear(mods["gate"], D) if spec.kind == "gated" else (None, None)
    return MlpWeights(layer, W_out, b_out, W_in, b_in, W_gate, b_gate)


def _activation_name(model, layer: int, pre: torch.Tensor | None, up: torch.Tensor | None, post: torch.Tensor | None,
                     gated: bool) -> str:
    """The activation, matched on the model's own activation module over [-6, 6] (a module without parameters
    inside the MLP); else on the hooks' pre-activations and activations; "unknown" if nothing matches."""
    x = torch.linspace(-6, 6, 241)
    mod = _mlp_module(model, layer)
    cands = [m for m in (mod.modules() if isinstance(mod, torch.nn.Module) else ())
             if m is not mod and not list(m.parameters()) and not list(m.children())
             and not isinstance(m, (torch.nn.Dropout, torch.nn.Identity)) and "hook" not in type(m).__name__.lower()]
    for m in cands:
        try:
            with torch.no_grad():
                y = m(x).float()
        except Exception:  # noqa: BLE001 - not an elementwise activation
            continue
        if y.shape == x.shape:
            errs = {n: float((f(x) - y).abs().max()) for n, f in ACTIVATIONS.items()}
            best = min(errs, key=errs.get)
            if errs[best] < 1e-4:
                return best
    name = getattr(getattr(model, "cfg", None), "act_fn", None)  # the reference models: "swiglu" | "gelu" | "relu"
    if getattr(model, "original_model", None) is None and name in ("swiglu", "gelu", "relu"):
        return "silu" if name == "swiglu" else name
    if post is not None and (pre if gated else up) is not None:
        g = pre if gated else up
        errs = {n: float((f(g) * (up if gated else 1.0) - post).abs().max()) for n, f in ACTIVATIONS.items()}
        best = min(errs, key=errs.get)
        if errs[best] < max(1e-5, _rounding(next(model.parameters()).dtype)) * max(1.0, float(post.abs().max())):
            return best
    return "unknown"


def block_norm(model, layer: int, name: str | None):
    """A norm module of a block as the model runs it.

    Parameters
    ----------
    model
        A loaded model.
    layer : int
        The block.
    name : str or None
        "ln1", "ln2" or "ln2_post".

    Returns
    -------
    torch.nn.Module or None
        The Hugging Face module behind the bridge's; None where the block has none (or ``name`` is None).
    """
    mod = getattr(model.blocks[layer], name, None) if name else None
    return getattr(mod, "original_component", None) or mod if mod is not None else None


def norm_weights(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gain and bias of a norm module (Hugging Face ``weight`` / ``bias``; the reference models' ``w`` / ``b``).

    Parameters
    ----------
    module : torch.nn.Module

    Returns
    -------
    weight : torch.Tensor, shape (size,)
        float32 on the CPU.
    bias : torch.Tensor, shape (size,), or None
    """
    w = getattr(module, "weight", None)
    w = getattr(module, "w", None) if w is None else w
    b = getattr(module, "bias", None)
    b = getattr(module, "b", None) if b is None else b
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{type(module).__name__} has no gain weight.")
    return w.detach().float().cpu(), (b.detach().float().cpu() if isinstance(b, torch.Tensor) else None)


def mlp_input(model, layer: int, resid: torch.Tensor) -> torch.Tensor:
    """The MLP input of a block made from the residual it reads (``get_mlp(model).input_resid``): the block's input norm
    applied (none: the residual itself).

    Parameters
    ----------
    model
        A loaded model.
    layer : int
        The block.
    resid : torch.Tensor, shape (..., d_model)
        The residual stream the MLP reads.

    Returns
    -------
    torch.Tensor, shape (..., d_model)
        float32, on ``resid``'s device.
    """
    spec = get_mlp(model)
    mod = block_norm(model, int(layer), spec.input_norm_module)
    if mod is None:
        return resid.float()
    with torch.no_grad():
        return mod(_on_model(model, resid)).float().to(resid.device)


def final_logits(model, resid: torch.Tensor) -> torch.Tensor:
    """The logits the model makes from its last residual stream: the final norm, the unembedding and, where the config
    soft-caps the logits (Gemma 2), the cap.

    Parameters
    ----------
    model
        A loaded model.
    resid : torch.Tensor, shape (..., d_model)
        The residual stream after the last block.

    Returns
    -------
    torch.Tensor, shape (..., d_vocab)
        float32.
    """
    with torch.no_grad():
        logits = model.unembed(model.ln_final(resid)).float()
    cap = getattr(hf_config(model), "final_logit_softcapping", None)
    return cap * torch.tanh(logits / cap) if cap else logits


def _on_model(model, x: torch.Tensor) -> torch.Tensor:
    """``x`` (e.g. kept on the CPU) on the model's device and in its dtype, to run through one of its modules."""
    param = next(model.parameters())
    return x.to(param.device, param.dtype)


def _mlp_input(model, layer: int, got: dict, W: MlpWeights, target: torch.Tensor, kind: str):
    """(residual, norm module name) whose normalised value rebuilds the MLP's first pre-activation ``target``."""
    W_first, b_first = (W.W_gate, W.b_gate) if kind == "gated" else (W.W_in, W.b_in)
    for resid, norm in (("resid_mid", "ln2"), ("resid_pre", "ln1"), ("resid_pre", "ln2"), ("resid_mid", None),
                        ("resid_pre", None)):
        h = got.get(f"blocks.{layer}.hook_{resid}")
        mod = block_norm(model, layer, norm)
        if h is None or (norm is not None and mod is None):
            continue
        with torch.no_grad():
            x = (mod(_on_model(model, h)) if mod is not None else h).float().cpu()
        pre = x @ W_first.T + (b_first if b_first is not None else 0)
        if _close(pre, target, next(model.parameters()).dtype, atol=1e-4, rtol=1e-3):
            return resid, norm, mod
    return None, None, None


def _mlp_output(model, layer: int, got: dict, W: MlpWeights, a: torch.Tensor) -> tuple[str, float, object, str | None]:
    """How the out projection's output W_out a + b_out becomes hook_mlp_out: (kind, scale, norm module, its name)."""
    proj = a @ W.W_out.T + (W.b_out if W.b_out is not None else 0)
    out = got[f"blocks.{layer}.hook_mlp_out"]
    dtype = next(model.parameters()).dtype  # bf16 / fp16: the hooks hold the projections rounded to it
    if _close(out, proj, dtype, atol=1e-5, rtol=1e-4):
        return "add", 1.0, None, None
    mod = block_norm(model, layer, "ln2_post")
    if mod is not None:
        with torch.no_grad():
            y = mod(_on_model(model, proj)).float().cpu()
        if _close(y, out, dtype, atol=1e-4, rtol=1e-3):
            return "post_norm", 1.0, mod, "ln2_post"
    scale = float((out * proj).sum() / (proj * proj).sum().clamp_min(1e-30))
    if _close(out, scale * proj, dtype, atol=1e-5, rtol=1e-4):
        return "scaled", scale, None, None
    return "unknown", 1.0, None, None


def _adds_up(got: dict, l: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether block ``l``'s MLP write (with the attention write where the two run in parallel) is what its residual
    stream gains: hook_resid_post - hook_resid_mid (or - hook_resid_pre), to the rounding of the stream in the
    model's ``dtype`` (float32, or a few units of bf16 / fp16)."""
    b = f"blocks.{l}."
    post, mlp = got.get(b + "hook_resid_post"), got.get(b + "hook_mlp_out")
    if post is None or mlp is None:
        return False
    mid = got.get(b + "hook_resid_mid")
    write = mlp if mid is not None else mlp + got.get(b + "hook_attn_out", torch.zeros_like(mlp))
    delta = post - (mid if mid is not None else got[b + "hook_resid_pre"])
    return float((delta - write).abs().max()) <= 1e-4 + max(1e-5, _rounding(dtype)) * float(post.abs().max())


def mlp_spec(model) -> MlpSpec:
    """Measure the MLP facts of a loaded model (a TransformerBridge or a reference model).

    One forward pass over five tokens records, on every block, which MLP hooks fire, the residual, attention and MLP
    writes; the MLP's input norm, activation and output scaling are read by rebuilding the first dense MLP from its
    weights.

    Parameters
    ----------
    model
        A loaded model.

    Returns
    -------
    MlpSpec
    """
    hook_dict = getattr(model, "hook_dict", {})
    n_layers = int(model.cfg.n_layers)
    family = get_family(model).family
    names = [f"blocks.{l}.{s}" for l in range(n_layers) for s in _MLP_PROBE_HOOKS if f"blocks.{l}.{s}" in hook_dict]
    canonical = {n: getattr(hook_dict[n], "name", n) for n in names}
    seen: dict[str, torch.Tensor] = {}

    def rec(x, hook):
        if isinstance(x, torch.Tensor):
            seen.setdefault(hook.name, x.detach().float().cpu())

    device = next(model.parameters()).device
    tokens = (torch.arange(1, 6, device=device) % max(int(getattr(model.cfg, "d_vocab", 6) or 6), 6))[None]
    hooks = list({canonical[n]: (n, rec) for n in names}.values())
    with torch.inference_mode():
        model.run_with_hooks(tokens, fwd_hooks=hooks)
    got = {n: seen[canonical[n]] for n in names if canonical[n] in seen}
    moe = tuple(l for l in range(n_layers) if _is_moe(model, l))
    mixers = tuple(l for l in range(n_layers) if f"blocks.{l}.hook_attn_out" not in got)

    def neurons(l, s):  # a dense block's hook (MoE bridges alias hook_pre / hook_post to the block's input / output)
        return None if l in moe else got.get(f"blocks.{l}.mlp.{s}")

    dense = [l for l in range(n_layers) if l not in moe and neurons(l, "hook_post") is not None and neurons(l, "hook_pre") is not None]
    kind = "moe" if moe and not dense else ("none" if not dense else
                                            ("gated" if neurons(dense[0], "hook_pre_linear") is not None else "plain"))
    additive = all(_adds_up(got, l, next(model.parameters()).dtype) for l in range(n_layers))
    n_exp, top_k, notes = None, None, []
    if moe:
        router, experts = moe_parts(model, moe[0])
        n_exp = int(getattr(experts, "num_experts", 0) or getattr(router, "num_experts", 0)) or None
        top_k = int(getattr(router, "top_k", 0)) or None
    fields = dict(family=family, kind=kind, parallel=bool(get_family(model).parallel_block), additive=additive,
                  mixer_layers=mixers, moe_layers=moe, n_experts=n_exp, top_k=top_k)
    in_hook = "blocks.{layer}.mlp.hook_in" if all(f"blocks.{b}.mlp.hook_in" in got for b in range(n_layers)) else None
    if kind in ("moe", "none"):
        if kind == "none":
            notes.append("No hook holds the MLP's neuron activations (blocks.{l}.mlp.hook_post).")
        return MlpSpec(**fields, activation=None, d_mlp=None, input_resid="resid_pre" if fields["parallel"] else "resid_mid",
                       input_norm=None, input_norm_module=None, output="unknown", output_scale=1.0, output_norm=None,
                       output_norm_module=None, notes=tuple(notes), _input_hook=in_hook)
    l = dense[0]
    pre, up, post = neurons(l, "hook_pre"), neurons(l, "hook_pre_linear"), neurons(l, "hook_post")
    if kind == "plain":
        pre, up = None, pre
    tmpl = {k: canonical[f"blocks.{l}.mlp.{s}"].replace(f"blocks.{l}.", "blocks.{layer}.", 1)
            for k, s in (("neuron", "hook_post"), ("gate", "hook_pre"), ("up", "hook_pre_linear" if kind == "gated" else "hook_pre"))}
    partial_spec = MlpSpec(**fields, activation=None, d_mlp=int(post.shape[-1]), input_resid="resid_mid", input_norm=None,
                           input_norm_module=None, output="unknown", output_scale=1.0, output_norm=None,
                           output_norm_module=None, _neuron_hook=tmpl["neuron"],
                           _gate_hook=tmpl["gate"] if kind == "gated" else None, _up_hook=tmpl["up"])
    model.mlp_spec = partial_spec  # mlp_weights reads the kind from it while the spec is being measured
    try:
        W = mlp_weights(model, l)
    finally:
        del model.mlp_spec
    resid, norm_name, norm_mod = _mlp_input(model, l, got, W, pre if kind == "gated" else up, kind)
    if resid is None:
        notes.append("The MLP input could not be rebuilt from the residual stream and a norm of the block.")
    output, scale, out_mod, out_name = _mlp_output(model, l, got, W, post)
    return MlpSpec(**{**fields, "parallel": resid == "resid_pre" if resid else fields["parallel"]},
                   activation=_activation_name(model, l, pre, up, post, kind == "gated"), d_mlp=int(post.shape[-1]),
                   input_resid=resid or "resid_mid",
                   input_norm=probe_norm(norm_mod, model=model) if norm_mod is not None else None,
                   input_norm_module=norm_name, output=output, output_scale=scale,
                   output_norm=probe_norm(out_mod, model=model) if out_mod is not None else None,
                   output_norm_module=out_name,
                   notes=tuple(notes), _neuron_hook=tmpl["neuron"], _gate_hook=partial_spec._gate_hook,
                   _up_hook=tmpl["up"], _input_hook=in_hook)


def get_mlp(model) -> MlpSpec:
    """``model.mlp_spec``, measured (:func:`mlp_spec`) and kept on the model on first use.

    Parameters
    ----------
    model
        A loaded model.

    Returns
    -------
    MlpSpec
    """
    return _kept(model, "mlp_spec", MlpSpec, mlp_spec)

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
