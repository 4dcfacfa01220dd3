"""The key path of one attention layer, rebuilt from the model's weights as its family computes it.

``key_path(model, layer)`` reads the norm on the attention input (RMSNorm or LayerNorm, gain ``w`` or ``1 + w``,
bias; none where the block normalises after attention), W_K and b_K (the bridge's split of a fused QKV), the key
norm (per head or over all heads) and the rotary (the family spec's dim, pairing and base), and returns a
:class:`KeyPath` that rebuilds the keys from the residual stream: ``keys_from_resid(h, positions)`` end to end, and
each link on its own (``norm``, ``project``, ``key_norm``, ``rotate``). Multi-head latent attention (DeepSeek-V2 / V3)
has no per-head W_K: :class:`LatentKeyPath` rebuilds its keys from the real path (``kv_a_proj_with_mqa``, then
``kv_a_layernorm`` on the latent, ``kv_b_proj``, and the rotary key shared by the heads). Used by ``analysis.chain.norm_gain`` (the trace)
and ``analysis.causal.interventions`` (the first-key ablation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from analysis.model.contract import SinkModel
from analysis.model.families import get_family
from analysis.model.hooks import (
    ModelContractError,
    act_name,
    check_attention_layers,
    check_layers,
    hook_names,
    kv_view,
    model_dims,
)
from analysis.model.nnsight_model import TraceWeight, weights_in_trace
from analysis.model.rotary import rotate, rotate_half
from analysis.core.results import compact_repr
from analysis.model.weights import live_tensor, reads_block_weights


KEY_KINDS = {"RMSNorm": "RMS", "LayerNorm": "LN"}  # a family's NormSpec.kind -> NormOps.kind


class NormOps:
    """A norm's arithmetic, y = g * norm(h) (+ b), on its fields (``kind``, ``w``, ``b``, ``eps``, ``offset``): a plain
    class of torch only, so that a remote trace ships it by value (``KeyOps``)."""

    def __init__(self, kind: str, w, b, eps: float, offset: float = 0.0):
        self.kind, self.w, self.b, self.eps, self.offset = kind, w, b, eps, offset

    @classmethod
    def of(cls, ns, w, b=None):
        """A family's norm (``NormSpec``: kind, eps, gain offset) with its weights ``w`` and ``b``."""
        return cls(KEY_KINDS.get(ns.kind, "RMS"), w, b, ns.eps, ns.gain_offset)

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


@dataclass
class NormParams(NormOps):
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


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    """A weight detached, float32 on the CPU (None stays None)."""
    return None if t is None else t.detach().float().cpu()


def norm_kind(model: SinkModel) -> str | None:
    """The normalisation of a model, from ``cfg.normalization_type``.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    {"RMS", "LN"} or None
        None: no normalisation.
    """
    t = str(getattr(getattr(model, "cfg", None), "normalization_type", None)).upper()  # "NONE" where it states none
    return next((kind for kind in ("RMS", "LN") if t.startswith(kind)), None)


@reads_block_weights
def _norm_params(model: SinkModel, layer: int) -> NormParams:
    """The norm the attention input of a layer passes (the spec's form: gain w or 1 + w, bias, eps), with its weights.

    The identity (kind "none") where the block has no norm before attention (post-norm: OLMo-2; or no norm at all);
    ModelContractError for a pre-norm model whose norm gain is not kept as a weight."""
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
    kind = KEY_KINDS.get(ns.kind, kind) if ns is not None else kind
    b = live_tensor(ln, "b", "bias") if kind == "LN" else None
    eps = ns.eps if ns is not None else float(getattr(model.cfg, "eps", 1e-5) or 1e-5)
    return NormParams(kind, _cpu(w), _cpu(b), eps, ns.gain_offset if ns is not None else 0.0)


@reads_block_weights
def _key_norm_params(model: SinkModel, layer: int) -> NormParams | None:
    """The norm on the keys after W_K (the spec's ``qk_norm``: per head, or over all heads together).

    None where the family has no key norm."""
    ns = (spec := get_family(model)).qk_norm
    if ns is None:
        return _l2_norm(spec, layer)
    kn = getattr(model.blocks[layer].attn, "k_norm", None)
    w = live_tensor(kn, "w", "weight")
    if w is None:
        raise ModelContractError(
            f"the {ns.text()} on the keys of layer {layer} has no weight "
            f"(model.blocks[{layer}].attn.k_norm.w); load the model with raw weights."
        )
    b = live_tensor(kn, "b", "bias") if ns.bias else None
    return NormParams.of(ns, _cpu(w), _cpu(b))


def _l2_norm(spec, layer: int) -> NormParams | None:
    """Llama 4's qk_norm on a rotary layer: an RMS norm without gain per head, after the rotary (before it alike)."""
    if spec.qk_l2_norm and spec.rotary_at(layer):
        return NormParams("RMS", torch.ones(spec.d_head), None, spec.norm.eps)


@reads_block_weights
def key_weights(model: SinkModel, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The key weights of a layer, float32 on the CPU.

    Parameters
    ----------
    model, layer
        As in :func:`_norm_params`.

    Returns
    -------
    W_K : torch.Tensor, shape (H_kv, D, d_head)
    b_K : torch.Tensor, shape (H_kv, d_head), or None
    """
    attn = getattr(model.blocks[layer], "attn", None)
    try:
        W_K = getattr(attn, "W_K", None)
    except NotImplementedError as e:  # TransformerLens' MLA bridge (DeepSeek-V2 / V3) raises for W_K
        raise ModelContractError(
            f"layer {layer} has multi-head latent attention: no per-head W_K (each key is decompressed "
            "from a normalised latent, plus a rotary key shared by the heads); use key_path(model, "
            "layer), which rebuilds MLA keys from kv_a_proj_with_mqa, kv_a_layernorm and kv_b_proj."
        ) from e
    if W_K is None:
        raise ModelContractError(f"model.blocks[{layer}].attn has no W_K; the key path needs the key weights.")
    if W_K.ndim != 3:
        raise ModelContractError(
            f"W_K of layer {layer} has shape {tuple(W_K.shape)}; expected (heads, d_model, d_head)."
        )
    b_K = _cpu(getattr(attn, "b_K", None))
    return _cpu(W_K), (None if b_K is None else b_K.reshape(W_K.shape[0], -1))


class KeyOps:
    """A layer's key path from its input norm's output to the key the attention uses, on its fields (``norm``,
    ``W_K``, ``b_K``, ``k_norm``, ``k_norm_scope``, ``rot``: the rotary's (base, dims, pairing, frequencies, scale)
    or None): torch only, so that a remote trace ships it by value, its weights read there (``KeyPath.in_trace``)."""

    def __init__(self, norm, W_K, b_K, k_norm, k_norm_scope, rot=None):
        self.norm, self.W_K, self.b_K, self.k_norm, self.k_norm_scope = norm, W_K, b_K, k_norm, k_norm_scope
        self.rot = rot

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rotary (identity without one) on queries or keys (..., T, heads, d_head), float32."""
        if self.rot is None:
            return x.float()
        base, dim, style, inv, scale = self.rot
        return rotate(x, positions, base, rot_dim=dim, style=style, inv_freq=inv, scale=scale)

    def with_weights(self, read) -> "KeyOps":
        """A copy whose weights are ``read(w)`` of each (a remote trace reads its weights there: each ``TraceWeight``)."""
        n, k = self.norm, self.k_norm
        r = lambda t: None if t is None else read(t)  # noqa: E731
        norm = NormOps(n.kind, r(n.w), r(n.b), n.eps, n.offset)
        k_norm = None if k is None else NormOps(k.kind, r(k.w), r(k.b), k.eps, k.offset)
        return KeyOps(norm, r(self.W_K), r(self.b_K), k_norm, self.k_norm_scope, self.rot)

    def project(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """x (..., T, D) W_K (+ b_K) -> (..., T, H_kv, d_head): the key projection, before the key norm."""
        k = torch.einsum("...td,hde->...the", x.float(), self.W_K.to(x.device, torch.float32))
        return k + self.b_K.to(x.device, torch.float32) if bias and self.b_K is not None else k

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

    def projection_heads(self, k: torch.Tensor) -> torch.Tensor:
        """The key projection as ``key_hook`` holds it -> (..., T, H_kv, d), the shape ``project`` returns."""
        return kv_view(k, self.W_K.shape[0])

    def key_norm_gain(self) -> torch.Tensor:
        """The key norm's gain per KV head (H_kv, d); None without a key norm."""
        if self.k_norm is None:
            return None
        Hkv, d = self.W_K.shape[0], self.W_K.shape[-1]
        return self.k_norm.gain.reshape(-1, d) if self.k_norm_scope == "all_heads" else self.k_norm.gain.expand(Hkv, d)


@dataclass
class KeyPath(KeyOps):
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
    k_norm_scope : {"head", "all_heads", "latent"} or None
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
    k_norm_scope: str | None  # "head" | "all_heads" (H_kv * d_head) | "latent" (MLA: kv_a_layernorm)
    spec: object  # the FamilySpec
    group: int  # query heads per KV head
    key_hook: str  # the key projection (blocks.l.attn.hook_k), before any key norm and the rotary
    final_key_hook: str  # the key the attention uses (spec.key_hook: rotated iff spec.key_rotated)
    query_hook: str  # the query the attention uses (spec.query_hook)

    __repr__ = compact_repr  # shapes, never tensor values

    @property
    def rotary(self) -> bool:
        return self.spec.rotary_at(self.layer)  # False on a NoPE layer

    @property
    def base(self) -> float | None:
        return self.spec.rotary_bases.get(self.layer, self.spec.rotary_base) if self.rotary else None

    @property
    def rot_dim(self) -> int | None:
        return self.spec.rotary_dim if self.rotary else None

    @property
    def rot(self) -> tuple | None:
        """The spec's rotary as :meth:`KeyOps.rotate` applies it: (base, dims, pairing, a scaled type's frequencies
        and scale (``FamilySpec.rope_freqs``)), or None."""
        scaled = self.spec.rope_freqs.get(self.layer, (None, 1.0))
        return (self.base, self.rot_dim, self.spec.rotary_style or "half", *scaled) if self.rotary else None

    def in_trace(self) -> KeyOps:
        """This path for a remote trace: its weights as :class:`TraceWeight` (read where the model is) where they
        are not here (meta tensors: a model loaded through nnsight)."""
        names = {
            id(t): n for n, t in (("ln1.w", self.norm.w), ("ln1.b", self.norm.b), ("W_K", self.W_K), ("b_K", self.b_K))
        }
        if self.k_norm is not None:
            names.update({id(self.k_norm.w): "k_norm.w", id(self.k_norm.b): "k_norm.b"})
        return self.with_weights(lambda t: TraceWeight(names[id(t)], self.layer, tuple(t.shape)) if t.is_meta else t)

    def key_norm_text(self) -> str | None:
        """The key norm in words (None without one)."""
        if self.k_norm is None:
            return None
        if self.k_norm_scope == "latent":
            return f"{self.k_norm.text()} over the {self.rank}-dim key latent (kv_a_layernorm), then kv_b_proj"
        if self.spec.qk_l2_norm:
            return "an L2 norm (RMS, no gain) over each head, on queries too (Llama 4's qk_norm, after the rotary)"
        return f"{self.k_norm.text()} over {'each head' if self.k_norm_scope == 'head' else 'all heads together'}"

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
        parts = [
            f"{self.norm.text()} on the attention input"
            if self.norm.kind != "none"
            else "no norm before attention (the block normalises after it)",
            f"W_K{' + b_K' if self.b_K is not None else ''}{' (split from the fused QKV)' if sp.fused_qkv else ''}",
        ]
        if self.k_norm is not None:
            parts.append(self.key_norm_text())
        if self.rotary:
            parts.append(
                f"rotary ({self.rot_dim} of {self.W_K.shape[-1]} dims, "
                f"{'interleaved' if sp.rotary_style == 'interleaved' else 'rotate-half'} pairs, theta {self.base:g})"
            )
        else:
            parts.append(
                {
                    "alibi": "no rotation (ALiBi biases on the scores)",
                    "absolute": "no rotation (absolute positions)",
                    "rotary": "no rotation (a NoPE layer)",
                }.get(sp.positions, "no rotation")
            )
        cap = f", soft-capped at {sp.attn_softcap:g}" if sp.attn_softcap else ""
        return f"Key path of layer {self.layer}: " + " -> ".join(parts) + f"; scores = {sp.attn_scale:g} q·k{cap}."


@dataclass(repr=False)
class LatentKeyPath(KeyPath):
    """The key path of multi-head latent attention (DeepSeek-V2 / V3), as Hugging Face's ``DeepseekV3Attention``
    computes it: x = ln1(h); c = x W_a (+ b_a) (``kv_a_proj_with_mqa``), split into a latent c_L (``kv_lora_rank``
    dims) and a rotary key c_R (``qk_rope_head_dim`` dims); each head's key is [kv_b_proj(kv_a_layernorm(c_L)) (its
    no-position part), rotary(c_R) (shared by the heads)]. The "projection" (``project``) is c, repeated for each
    head so the per-head arithmetic of :class:`KeyPath` holds; the "key norm" (``key_norm``) is the step c -> key
    before the rotary: ``kv_a_layernorm`` on the latent (its gain ``k_norm.gain`` is the gain of the latent-derived
    part), ``kv_b_proj``, and the rotary part passed on (de-interleaved where the checkpoint interleaves its pairs).
    The input norm's gain (``norm.gain``) scales both parts.

    Attributes
    ----------
    layer : int
        The attention layer.
    norm : NormParams
        The block's input norm (ln1): its gain scales the latent and the rotary key alike.
    W_K : torch.Tensor, shape (H, D, kv_lora_rank + qk_rope_head_dim)
        ``kv_a_proj_with_mqa``'s weight (transposed), one view per head (the same for all).
    b_K : torch.Tensor, shape (H, kv_lora_rank + qk_rope_head_dim), or None
        Its bias.
    k_norm : NormParams
        ``kv_a_layernorm`` (RMSNorm over the latent): "the gain" of the latent-derived key part.
    k_norm_scope : str
        "latent".
    spec : FamilySpec
        The model's family facts (``spec.latent``: the MLA shape).
    group : int
        1: every head has its own key.
    key_hook : str
        ``blocks.l.attn.kv_a_proj_with_mqa.hook_out``: the compressed projection, before the latent norm.
    final_key_hook : str
        ``blocks.l.attn.hook_k``: the whole key the attention uses, rotary dims rotated.
    query_hook : str
        ``blocks.l.attn.hook_q``.
    W_b : torch.Tensor, shape (H, kv_lora_rank, qk_nope_head_dim)
        ``kv_b_proj``'s key rows, per head.
    n_nope, n_rope, rank : int
        The no-position key dims, the rotary key dims, the latent dims.
    interleaved : bool
        The rotary dims come in interleaved pairs (``rope_interleave``).
    rotary_emb : torch.nn.Module or None
        The model's rotary embedding (cos, sin at the positions, scaled rope types included); None: the spec's theta.
    """

    W_b: torch.Tensor = None
    n_nope: int = 0
    n_rope: int = 0
    rank: int = 0
    interleaved: bool = False
    rotary_emb: object = None

    def projection_heads(self, k: torch.Tensor) -> torch.Tensor:
        """``kv_a_proj_with_mqa``'s output (..., T, rank + n_rope) -> one copy per head (..., T, H, rank + n_rope)."""
        return k.float()[..., None, :].expand(*k.shape[:-1], self.W_K.shape[0], k.shape[-1])

    def _order(self, r: torch.Tensor) -> torch.Tensor:
        return torch.cat([r[..., 0::2], r[..., 1::2]], -1) if self.interleaved else r

    def _unorder(self, r: torch.Tensor) -> torch.Tensor:
        if not self.interleaved:
            return r
        h = r.shape[-1] // 2
        return torch.stack([r[..., :h], r[..., h:]], -1).flatten(-2)

    def _decompress(self, lat: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        nope = torch.einsum("...hr,hre->...he", lat, self.W_b.to(lat.device))
        return torch.cat([nope, self._order(rope.float())], -1)

    def key_norm(self, k: torch.Tensor) -> torch.Tensor:
        return self._decompress(self.k_norm(k[..., : self.rank]), k[..., self.rank :])

    def key_norm_part(self, part: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return self._decompress(
            self.k_norm.linear_part(part[..., : self.rank], full[..., : self.rank]), part[..., self.rank :]
        )

    def key_norm_adjoint(self, y: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        lat = torch.einsum("...he,hre->...hr", y[..., : self.n_nope].float(), self.W_b.to(y.device))
        return torch.cat(
            [self.k_norm.adjoint(lat, full[..., : self.rank]), self._unorder(y[..., self.n_nope :].float())], -1
        )

    def key_norm_scale(self, k: torch.Tensor) -> torch.Tensor:
        return self.k_norm.scale(k[..., : self.rank])[..., 0]

    def key_norm_gain(self) -> torch.Tensor:
        return self.k_norm.gain.expand(self.W_K.shape[0], self.rank)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rotary on the last ``n_rope`` dims of the keys (..., T, H, d) (rotate-half pairs: ``key_norm``
        de-interleaved them), with the model's own cos / sin."""
        x = x.float()
        r = x[..., self.n_nope :]
        if self.rotary_emb is None:
            rr = rotate(r, positions, self.base, style="half")
        else:
            with torch.no_grad():
                cos, sin = self.rotary_emb(r, positions.to(r.device)[None])
            cos, sin = cos[0, :, None].float(), sin[0, :, None].float()  # (T, 1, n_rope)
            rr = r * cos + rotate_half(r) * sin
        return torch.cat([x[..., : self.n_nope], rr], -1)

    def keys(self, x: torch.Tensor, positions: torch.Tensor, bias: bool = True, rotary: bool = True) -> torch.Tensor:
        """The part of ``key_hook`` (``kv_a_proj_with_mqa``'s output, (..., T, rank + n_rope)) x (..., T, D) makes:
        linear in x; the latent norm and the rotary come after that hook, so ``rotary`` does not apply."""
        return self.project(x, bias)[..., 0, :]

    def text(self) -> str:
        sp = self.spec
        parts = [
            f"{self.norm.text()} on the attention input",
            f"kv_a_proj_with_mqa{' + bias' if self.b_K is not None else ''} (a latent of {self.rank} dims and a "
            f"rotary key of {self.n_rope} dims shared by the heads)",
            f"{self.k_norm.text()} on the latent (kv_a_layernorm: its gain is the gain of the latent part; "
            "the rotary part has only the input norm's gain)",
            f"kv_b_proj to {self.n_nope} no-position dims per head",
            f"rotary on the shared {self.n_rope} dims, last in each head"
            f"{' (interleaved pairs, de-interleaved)' if self.interleaved else ''}",
        ]
        cap = f", soft-capped at {sp.attn_softcap:g}" if sp.attn_softcap else ""
        return f"Key path of layer {self.layer}: " + " -> ".join(parts) + f"; scores = {sp.attn_scale:g} q·k{cap}."


def _latent_key_path(model, layer: int, spec, norm: NormParams) -> LatentKeyPath:
    """The MLA key path of a layer, from its Hugging Face attention module's weights."""
    la = spec.latent
    attn = getattr(model.blocks[layer], "attn", None)
    hf = getattr(attn, "original_component", None)
    kv_a, kv_norm, kv_b = (getattr(hf, n, None) for n in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"))
    if kv_a is None or kv_norm is None or kv_b is None:
        raise ModelContractError(
            f"layer {layer} has multi-head latent attention but its module lacks kv_a_proj_with_mqa, "
            "kv_a_layernorm or kv_b_proj; load a Hugging Face DeepSeek-V2 / V3 checkpoint."
        )
    H, r, dn, dv = spec.n_heads, la["kv_lora_rank"], la["qk_nope_head_dim"], la["v_head_dim"]
    W_a = kv_a.weight.detach().float().cpu().T  # (D, r + dr)
    b_a = _cpu(kv_a.bias)
    W_b = kv_b.weight.detach().float().cpu().reshape(H, dn + dv, r)[:, :dn].transpose(1, 2).contiguous()  # (H, r, dn)
    k_norm = NormParams(
        "RMS", _cpu(kv_norm.weight), None, float(getattr(kv_norm, "variance_epsilon", getattr(kv_norm, "eps", 1e-6)))
    )
    rotary_emb = getattr(getattr(getattr(model, "original_model", None), "model", None), "rotary_emb", None)
    kh = f"blocks.{layer}.attn.kv_a_proj_with_mqa.hook_out"
    return LatentKeyPath(
        layer,
        norm,
        W_a[None].expand(H, *W_a.shape),
        None if b_a is None else b_a[None].expand(H, -1),
        k_norm,
        "latent",
        spec,
        1,
        kh,
        spec.key_hook(layer),
        spec.query_hook(layer),
        W_b=W_b,
        n_nope=dn,
        n_rope=la["qk_rope_head_dim"],
        rank=r,
        interleaved=la["rope_interleave"],
        rotary_emb=rotary_emb,
    )


def key_path(model: SinkModel, layer: int) -> KeyPath:
    """Read the norm, key weights, key norm and rotary of an attention layer.

    Parameters
    ----------
    model, layer
        As in :func:`_norm_params`.

    Returns
    -------
    KeyPath
        ModelContractError with what is missing; ValueError for a layer that is not an attention layer.
    """
    (layer,) = check_attention_layers(model, layers=check_layers(model, [layer]))
    spec = get_family(model)
    if weights_in_trace(model):
        return _trace_key_path(model, layer, spec)
    norm = _norm_params(model, layer)
    if spec.latent is not None:
        path = _latent_key_path(model, layer, spec, norm)
        missing = [
            n
            for n in (act_name("resid_pre", layer), path.key_hook, path.final_key_hook, path.query_hook)
            if n not in hook_names(model)
        ]
        if missing:
            raise ModelContractError(f"the model has no hook(s) {missing}; the MLA key path needs them.")
        return path
    W_K, b_K = key_weights(model, layer)
    if spec.rotary_at(layer) and spec.rotary_bases.get(layer, spec.rotary_base) is None:
        raise ModelContractError(
            "the model uses rotary embeddings but its rotary base is unknown (model.family.rotary_bases)."
        )
    kh = act_name("k", layer)
    missing = [
        n
        for n in (act_name("resid_pre", layer), kh, spec.key_hook(layer), spec.query_hook(layer))
        if n not in hook_names(model)
    ]
    if missing:
        raise ModelContractError(f"the model has no hook(s) {missing}; the key path needs TransformerLens hook names.")
    return KeyPath(
        layer,
        norm,
        W_K,
        b_K,
        _key_norm_params(model, layer),
        spec.qk_norm_scope,
        spec,
        model_dims(model).n_heads // W_K.shape[0],
        kh,
        spec.key_hook(layer),
        spec.query_hook(layer),
    )


def _trace_key_path(model, layer: int, spec) -> KeyPath:
    """The key path of a model loaded through nnsight (``NnsightModel``), its weights meta tensors of their shapes:
    a remote trace reads them where the model is (:meth:`KeyPath.in_trace`); its key projection is the site
    ``blocks.l.attn.hook_k_proj`` (``k_proj``'s output)."""
    k_proj, ln = (getattr(model.part(layer, c), "_module", None) for c in ("attn.k", "ln1"))
    if spec.latent is not None or k_proj is None or (spec.norm is not None and ln is None):
        why = "latent attention" if spec.latent else "a fused qkv projection" if spec.fused_qkv else "no such modules"
        raise ModelContractError(
            f"a remote trace reads the key path from the attention's input norm and its key projection (and k_norm); "
            f"layer {layer} of this {spec.family} model has {why}: trace its norm gain on a model loaded here."
        )
    meta = lambda *shape: torch.empty(*shape, device="meta")  # noqa: E731
    D, Hkv, ns, ks = spec.d_model, spec.n_kv_heads, spec.norm, spec.qk_norm
    d = k_proj.weight.shape[0] // Hkv
    norm = NormParams("none", torch.ones(D), None, 0.0)
    if ns is not None:
        norm = NormParams.of(ns, meta(D), meta(D) if ns.bias else None)
    k_norm = NormParams.of(ks, meta(ks.size), meta(ks.size) if ks.bias else None) if ks else _l2_norm(spec, layer)
    b_K = meta(Hkv, d) if k_proj.bias is not None else None
    hooks = (f"blocks.{layer}.attn.hook_k_proj", spec.key_hook(layer), spec.query_hook(layer))
    return KeyPath(layer, norm, meta(Hkv, D, d), b_K, k_norm, spec.qk_norm_scope, spec, spec.n_heads // Hkv, *hooks)
