"""The key path of one attention layer, rebuilt from the model's weights as its family computes it.

``key_path(model, layer)`` reads the norm on the attention input (RMSNorm or LayerNorm, gain ``w`` or ``1 + w``,
bias; none where the block normalises after attention), W_K and b_K (the bridge's split of a fused QKV), the key
norm (per head or over all heads) and the rotary (the family spec's dim, pairing and base), and returns a
:class:`KeyPath` that rebuilds the keys from the residual stream: ``keys_from_resid(h, positions)`` end to end, and
each link on its own (``norm``, ``project``, ``key_norm``, ``rotate``). Used by ``analysis.chain.norm_gain`` (the trace)
and ``analysis.causal.interventions`` (the first-key ablation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from analysis.model.families import get_family
from analysis.model.hooks import ModelContractError, act_name, check_attention_layers, check_layers, hook_names, model_dims
from analysis.model.rotary import apply_spec_rotary
from analysis.core.results import compact_repr
from analysis.model.weights import live_tensor, reads_block_weights


@dataclass
class NormParams:
    """A norm with its weights: y = g * norm(h) (+ b), g = offset + w.

    Attributes
    ----------
    kind : {"RMS", "LN", "none"}
        RMSNorm (no centring), LayerNorm (centring, bias) or the identity.
    w : torch.Tensor, shape (D,)
        The raw gain weight.
    b : torch.Tensor, shape (D,), or None
        The bias.
    eps : float
        The norm's epsilon.
    offset : float
        1 for Gemma-style zero-centred gains (g = 1 + w), else 0.
    gain : torch.Tensor, shape (D,)
        ``offset + w`` (a property).
    """

    kind: str
    w: torch.Tensor  # (D,)
    b: torch.Tensor | None  # (D,) or None
    eps: float
    offset: float = 0.0

    @property
    def gain(self) -> torch.Tensor:
        return self.offset + self.w.float()

    def centre(self, h: torch.Tensor) -> torch.Tensor:
        h = h.float()
        return h - h.mean(-1, keepdim=True) if self.kind == "LN" else h

    def scale(self, h: torch.Tensor) -> torch.Tensor:
        """The factor (..., 1) the norm divides by: 1 / sqrt(mean(centred h^2) + eps); 1 for 'none'."""
        if self.kind == "none":
            return torch.ones_like(h[..., :1], dtype=torch.float32)
        return (self.centre(h).pow(2).mean(-1, keepdim=True) + self.eps).rsqrt()

    def normalise(self, h: torch.Tensor) -> torch.Tensor:
        """n = norm(h) before the gain, in float32."""
        return self.centre(h) * self.scale(h) if self.kind != "none" else h.float()

    def affine(self, n: torch.Tensor) -> torch.Tensor:
        """x = g * n (+ b)."""
        if self.kind == "none":
            return n.float()
        x = n * self.gain.to(n.device)
        return x + self.b.float().to(n.device) if self.b is not None else x

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.affine(self.normalise(h))

    def linear_part(self, part: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """The norm's output share of ``part`` of its input ``full`` (norm(full) = sum of the parts' shares + b):
        centred, at full's scale, times the gain."""
        if self.kind == "none":
            return part.float()
        return self.centre(part) * self.scale(full) * self.gain.to(part.device)

    def adjoint(self, y: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """The transpose of ``linear_part`` at ``full`` applied to y: part . adjoint(y) = linear_part(part) . y."""
        if self.kind == "none":
            return y.float()
        return self.centre(y.float() * self.gain.to(y.device) * self.scale(full))

    def text(self) -> str:
        if self.kind == "none":
            return "no norm"
        return f"{'RMSNorm' if self.kind == 'RMS' else 'LayerNorm'} (gain {'1 + w' if self.offset else 'w'})"


_KINDS = {"RMSNorm": "RMS", "LayerNorm": "LN"}


def norm_kind(model) -> str | None:
    """The normalisation of a model, from ``cfg.normalization_type``.

    Parameters
    ----------
    model
        A loaded model.

    Returns
    -------
    {"RMS", "LN"} or None
        None: no normalisation.
    """
    t = getattr(getattr(model, "cfg", None), "normalization_type", None)
    if t is None:
        return None
    t = str(t).upper()
    if t.startswith("RMS"):
        return "RMS"
    if t.startswith("LN"):
        return "LN"
    return None


@reads_block_weights
def norm_params(model, layer: int) -> NormParams:
    """The norm the attention input of a layer passes (the spec's form: gain w or 1 + w, bias, eps), with its weights.

    Parameters
    ----------
    model
        A loaded model.
    layer : int
        The block (an attention layer).

    Returns
    -------
    NormParams
        The identity (kind "none") where the block has no norm before attention (post-norm: OLMo-2; or no norm at
        all). ModelContractError for a pre-norm model whose norm gain is not kept as a weight.
    """
    (layer,) = check_layers(model, [layer])
    spec = get_family(model)
    blocks = getattr(model, "blocks", None)
    ln = getattr(blocks[layer], "ln1", None) if blocks is not None else None
    if spec.norm is None and (spec.norm_placement == "post" or getattr(ln, "w", None) is None):
        D = int(spec.d_model)
        return NormParams("none", torch.ones(D), None, 0.0)
    kind = norm_kind(model)
    w = live_tensor(ln, "w", "weight") if ln is not None else None
    if ln is None or w is None or kind is None:
        raise ModelContractError(
            f"layer {layer} has no pre-attention norm with a gain to trace (model.blocks[{layer}].ln1.w; "
            f"cfg.normalization_type={getattr(getattr(model, 'cfg', None), 'normalization_type', None)!r}). "
            "Norm-gain tracing needs RMSNorm or LayerNorm with its gain kept as a weight: load the model with "
            "raw weights (`analysis.load_model`), not with the norms folded into W_Q/W_K/W_V, and not a model "
            "without normalisation."
        )
    ns = spec.norm
    kind = _KINDS.get(ns.kind, kind) if ns is not None else kind
    b = live_tensor(ln, "b", "bias") if kind == "LN" else None
    eps = ns.eps if ns is not None else float(getattr(model.cfg, "eps", 1e-5) or 1e-5)
    return NormParams(kind, w.detach().float().cpu(), None if b is None else b.detach().float().cpu(), eps,
                      ns.gain_offset if ns is not None else 0.0)


@reads_block_weights
def key_norm_params(model, layer: int) -> NormParams | None:
    """The norm on the keys after W_K (the spec's ``qk_norm``: per head, or over all heads together).

    Parameters
    ----------
    model
        A loaded model.
    layer : int
        The block (an attention layer).

    Returns
    -------
    NormParams or None
        None where the family has no key norm.
    """
    ns = get_family(model).qk_norm
    if ns is None:
        return None
    kn = getattr(model.blocks[layer].attn, "k_norm", None)
    w = live_tensor(kn, "w", "weight")
    if w is None:
        raise ModelContractError(f"the {ns.text()} on the keys of layer {layer} has no weight "
                                 f"(model.blocks[{layer}].attn.k_norm.w); load the model with raw weights.")
    b = live_tensor(kn, "b", "bias") if ns.bias else None
    return NormParams(_KINDS.get(ns.kind, "RMS"), w.detach().float().cpu(),
                      None if b is None else b.detach().float().cpu(), ns.eps, ns.gain_offset)


@reads_block_weights
def key_weights(model, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The key weights of a layer, float32 on the CPU.

    Parameters
    ----------
    model
        A loaded model.
    layer : int
        The block (an attention layer).

    Returns
    -------
    W_K : torch.Tensor, shape (H_kv, D, d_head)
    b_K : torch.Tensor, shape (H_kv, d_head), or None
    """
    attn = getattr(model.blocks[layer], "attn", None)
    try:
        W_K = getattr(attn, "W_K", None)
    except NotImplementedError as e:  # TransformerLens' MLA bridge (DeepSeek-V2 / V3) raises for W_K
        raise ModelContractError(f"layer {layer} has multi-head latent attention: no per-head W_K (each key is decompressed "
                                 "from a normalised latent, plus a rotary key shared by the heads); the key path does not "
                                 "rebuild MLA keys yet.") from e
    if W_K is None:
        raise ModelContractError(f"model.blocks[{layer}].attn has no W_K; the key path needs the key weights.")
    if W_K.ndim != 3:
        raise ModelContractError(f"W_K of layer {layer} has shape {tuple(W_K.shape)}; expected (heads, d_model, d_head).")
    b_K = getattr(attn, "b_K", None)
    return W_K.detach().float().cpu(), (None if b_K is None else b_K.detach().float().cpu().reshape(W_K.shape[0], -1))


@dataclass
class KeyPath:
    """Everything needed to rebuild a layer's keys from its residual input, as the family computes them.

    Attributes
    ----------
    layer : int
        The attention layer.
    norm : NormParams
        The norm on the attention input (kind "none": post-norm, the raw residual).
    W_K : torch.Tensor, shape (H_kv, D, d_head)
        The key weights.
    b_K : torch.Tensor, shape (H_kv, d_head), or None
        The key bias.
    k_norm : NormParams or None
        The norm on the keys after W_K.
    k_norm_scope : {"head", "all_heads"} or None
        Over d_head, or over H_kv * d_head.
    spec : FamilySpec
        The model's family facts.
    group : int
        Query heads per KV head.
    key_hook : str
        The key projection (``blocks.l.attn.hook_k``), before any key norm and the rotary.
    final_key_hook : str
        The key the attention uses (``spec.key_hook``: rotated iff ``spec.key_rotated``).
    query_hook : str
        The query the attention uses (``spec.query_hook``).
    """

    layer: int
    norm: NormParams  # the norm on the attention input (kind 'none': post-norm, the raw residual)
    W_K: torch.Tensor  # (H_kv, D, d_head)
    b_K: torch.Tensor | None
    k_norm: NormParams | None  # the norm on the keys after W_K, or None
    k_norm_scope: str | None  # "head" (over d_head) | "all_heads" (over H_kv * d_head)
    spec: object  # the FamilySpec
    group: int  # query heads per KV head
    key_hook: str  # the key projection (blocks.l.attn.hook_k), before any key norm and the rotary
    final_key_hook: str  # the key the attention uses (spec.key_hook: rotated iff spec.key_rotated)
    query_hook: str  # the query the attention uses (spec.query_hook)

    def __repr__(self) -> str:
        return compact_repr(self)  # shapes, never tensor values

    @property
    def rotary(self) -> bool:
        return self.spec.rotary_at(self.layer)  # False on a NoPE layer

    @property
    def base(self) -> float | None:
        return self.spec.rotary_bases.get(self.layer, self.spec.rotary_base) if self.rotary else None

    @property
    def rot_dim(self) -> int | None:
        return self.spec.rotary_dim if self.rotary else None

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The spec's rotary (identity without one) on queries or keys (..., T, heads, d_head), float32."""
        return apply_spec_rotary(x, self.spec, self.layer, positions=positions)

    def project(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """x (..., T, D) W_K (+ b_K) -> (..., T, H_kv, d_head): the key projection, before the key norm."""
        k = torch.einsum("...td,hde->...the", x.float(), self.W_K.to(x.device))
        return k + self.b_K.to(x.device) if bias and self.b_K is not None else k

    def _heads_apply(self, fn, k: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
        """Apply a norm function over each head (d_head) or over all heads together (H_kv * d_head)."""
        if self.k_norm_scope != "all_heads":
            return fn(k, *more)
        flat = [t.flatten(-2) for t in (k, *more)]
        return fn(*flat).unflatten(-1, k.shape[-2:])

    def key_norm(self, k: torch.Tensor) -> torch.Tensor:
        """The key norm on projected keys (..., H_kv, d_head); identity where the family has none."""
        return k.float() if self.k_norm is None else self._heads_apply(self.k_norm, k)

    def key_norm_part(self, part: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """The key norm's output share of ``part`` of the projected key ``full`` (linear at full's scale)."""
        return part.float() if self.k_norm is None else self._heads_apply(self.k_norm.linear_part, part, full)

    def key_norm_adjoint(self, y: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return y.float() if self.k_norm is None else self._heads_apply(self.k_norm.adjoint, y, full)

    def key_norm_scale(self, k: torch.Tensor) -> torch.Tensor:
        """How much the key norm divides each key by (..., H_kv): 1 / rms, per head or shared by all heads."""
        if self.k_norm is None:
            return torch.ones(k.shape[:-1], device=k.device)
        if self.k_norm_scope == "all_heads":
            return self.k_norm.scale(k.flatten(-2)).expand(*k.shape[:-1])
        return self.k_norm.scale(k)[..., 0]

    def keys(self, x: torch.Tensor, positions: torch.Tensor, bias: bool = True, rotary: bool = True) -> torch.Tensor:
        """The key projection of the gain-scaled normalised input x (..., T, D) -> (..., T, H_kv, d_head), rotated
        (``rotary``); linear in x (no key norm): the part of ``hook_k`` a part of x makes."""
        k = self.project(x, bias)
        return self.rotate(k, positions) if rotary else k

    def full_keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys the attention uses, from x: projection, key norm, rotary."""
        return self.rotate(self.key_norm(self.project(x)), positions)

    def keys_from_resid(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.full_keys(self.norm(h), positions)

    def text(self) -> str:
        """The path in words: norm -> W_K -> key norm -> rotary -> score scale (and soft-cap)."""
        sp = self.spec
        parts = [f"{self.norm.text()} on the attention input" if self.norm.kind != "none"
                 else "no norm before attention (the block normalises after it)",
                 f"W_K{' + b_K' if self.b_K is not None else ''}{' (split from the fused QKV)' if sp.fused_qkv else ''}"]
        if self.k_norm is not None:
            parts.append(f"{self.k_norm.text()} over {'each head' if self.k_norm_scope == 'head' else 'all heads together'}")
        if self.rotary:
            parts.append(f"rotary ({self.rot_dim} of {self.W_K.shape[-1]} dims, "
                         f"{'interleaved' if sp.rotary_style == 'interleaved' else 'rotate-half'} pairs, theta {self.base:g})")
        else:
            parts.append({"alibi": "no rotation (ALiBi biases on the scores)", "absolute": "no rotation (absolute "
                          "positions)", "rotary": "no rotation (a NoPE layer)"}.get(sp.positions, "no rotation"))
        cap = f", soft-capped at {sp.attn_softcap:g}" if sp.attn_softcap else ""
        return f"Key path of layer {self.layer}: " + " -> ".join(parts) + f"; scores = {sp.attn_scale:g} q·k{cap}."


def key_path(model, layer: int) -> KeyPath:
    """Read the norm, key weights, key norm and rotary of an attention layer.

    Parameters
    ----------
    model
        A loaded model.
    layer : int
        The block (an attention layer).

    Returns
    -------
    KeyPath
        ModelContractError with what is missing; ValueError for a layer that is not an attention layer.
    """
    (layer,) = check_attention_layers(model, layers=check_layers(model, [layer]))
    spec = get_family(model)
    norm = norm_params(model, layer)
    W_K, b_K = key_weights(model, layer)
    if spec.rotary_at(layer) and spec.rotary_bases.get(layer, spec.rotary_base) is None:
        raise ModelContractError("the model uses rotary embeddings but its rotary base is unknown (model.family.rotary_bases).")
    kh = act_name("k", layer)
    missing = [n for n in (act_name("resid_pre", layer), kh, spec.key_hook(layer), spec.query_hook(layer))
               if n not in hook_names(model)]
    if missing:
        raise ModelContractError(f"the model has no hook(s) {missing}; the key path needs TransformerLens hook names.")
    return KeyPath(layer, norm, W_K, b_K, key_norm_params(model, layer), spec.qk_norm_scope, spec,
                   model_dims(model).n_heads // W_K.shape[0], kh, spec.key_hook(layer), spec.query_hook(layer))
