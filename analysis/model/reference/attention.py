"""Attention operations, each selectable by name (``ModelConfig.attention`` / ``--attention``).

Every operation maps rotated queries and keys ``q, k`` (B, H, T, d) and values ``v`` (B, H, T, d)
(key/value heads already repeated for GQA) to the per-head output ``z`` (B, H, T, d). On the way it
passes these tensors through the attention module's hook points (so a hook can read or edit them):

- ``hook_attn_scores`` (B, H, T, T): the arguments of the similarity, q k^T / sqrt(d) plus positional
  biases, masked entries at the dtype's minimum (for linear kernels: the kernel similarities, masked to 0);
- ``hook_pattern`` (B, H, T, T): attention weights normalised to sum to one over visible keys, the
  quantity the sink metric reads. For operations without normalisation this is the paper's proxy:
  sim_ij / sum_j' sim_ij' (sigmoid, elu+1) or |sim_ij| / sum_j' |sim_ij'| (linear kernels);
- ``hook_raw_pattern`` (B, H, T, T): the weights that really multiply the values (sigmoid scores,
  alpha x softmax, ...); editing it changes the output. Equal to ``hook_pattern`` for plain softmax;
- ``hook_sink_pattern`` (B, H, T), slot operations only: the weight on the extra slot of the sink-token
  and K/KV-bias variants (``hook_pattern`` then covers the real tokens; its rows sum to 1 - sink).

To add an operation: subclass ``AttentionOp``, implement ``forward`` and decorate the class with
``@register("name", description)``; ``docs/training.md`` walks through an example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from analysis.model.contract import SinkModel
from analysis.model.reference.flex import flex_elementwise, flex_softmax

_REGISTRY: dict[str, tuple[type, dict, str]] = {}
_ALIASES = {
    "elu+1": "elu1",
    "elu+1-norm": "elu1-norm",
    "sigmoid-normalized": "sigmoid-norm",
    "sigmoid_norm": "sigmoid-norm",
    "elu1_norm": "elu1-norm",
    "sink_token": "sink-token",
    "kv_bias": "kv-bias",
    "k_bias": "k-bias",
    "v_bias": "v-bias",
    "linear": "linear-identity",
    "mlp-kernel": "linear-mlp",
    "identity-kernel": "linear-identity",
}
_ADDITIVE_BIAS_PE = ("alibi", "relative")


class NoHooks:
    """Stand-in for the attention module's hook points when an operation is called on its own."""

    @staticmethod
    def _identity(x):
        return x

    hook_attn_scores = hook_pattern = hook_raw_pattern = hook_sink_pattern = _identity


NO_HOOKS = NoHooks()


@dataclass
class Slot:
    """An extra key/value slot visible to every query: the learnable sink token's per-layer key and value, and its
    additive positional bias.

    Attributes
    ----------
    k : torch.Tensor, shape (B or 1, H, 1, d)
        The slot's key.
    v : torch.Tensor, shape (B or 1, H, 1, d), or None
        The slot's value.
    bias : torch.Tensor, shape (H, T), or None
        The slot's positional bias.
    """

    k: torch.Tensor
    v: Optional[torch.Tensor]
    bias: Optional[torch.Tensor] = None


def register(name: str, description: str, **kwargs):
    """Class decorator: make an ``AttentionOp`` subclass available under ``name``.

    Parameters
    ----------
    name : str
    description : str
        One line.
    **kwargs
        Passed to the class when it is built.

    Returns
    -------
    callable
        The decorator.
    """

    def deco(cls):
        _REGISTRY[name] = (cls, kwargs, description)
        return cls

    return deco


def available_attention() -> dict[str, str]:
    """{name: one-line description} of every registered attention operation.

    Returns
    -------
    dict of str to str
    """
    return {name: desc for name, (_, _, desc) in _REGISTRY.items()}


def pattern_note(model: SinkModel) -> Optional[str]:
    """What the sink metric reads where a model's attention weights do not sum to one (sigmoid, elu+1, linear
    kernels, p-norm): ``hook_pattern`` then holds the paper's normalised proxy, sim / sum sim, not the weights.

    Parameters
    ----------
    model : torch.nn.Module
        Any model; only the reference model's ``AttentionOp`` modules can carry a proxy.

    Returns
    -------
    str or None
        E.g. "normalised proxy (sim / sum sim), the model's attention is sigmoid"; None where the pattern is the
        attention itself (softmax and every Hugging Face model).
    """
    ops = {m.op_name: m.pattern_proxy for m in model.modules() if isinstance(m, AttentionOp) and m.pattern_proxy}
    if not ops:
        return None
    proxies = " / ".join(sorted(set(ops.values())))
    return f"normalised proxy ({proxies}), the model's attention is {', '.join(sorted(ops))}"


def canonical_name(name: str) -> str:
    """The registered name of an attention operation (aliases resolved).

    Parameters
    ----------
    name : str
        A name or an alias (``--attention``), any case.

    Returns
    -------
    str
        ValueError naming the known operations otherwise.
    """
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        raise ValueError(
            f"unknown attention operation {name!r}. Known operations: {sorted(_REGISTRY)} "
            f"(aliases: {sorted(_ALIASES)})."
        )
    return key


def check_attention(name: str, cfg) -> str:
    """Canonical operation name; raises ValueError for unknown names and impossible combinations.

    Parameters
    ----------
    name : str
    cfg : ModelConfig

    Returns
    -------
    str
    """
    key = canonical_name(name)
    cls = _REGISTRY[key][0]
    if getattr(cls, "kernel_based", False) and cfg.positional_embedding_type in _ADDITIVE_BIAS_PE:
        raise ValueError(
            f"attention={key!r} uses feature-map kernels and cannot add the score biases of "
            f"positional_embedding_type={cfg.positional_embedding_type!r}; use rotary, none, learned "
            "or sinusoidal positions with linear attention."
        )
    return key


def build_attention_op(cfg) -> "AttentionOp":
    """The attention operation a model config asks for.

    Parameters
    ----------
    cfg : ModelConfig

    Returns
    -------
    AttentionOp
    """
    key = canonical_name(cfg.attention)
    cls, kwargs, _ = _REGISTRY[key]
    op = cls(cfg, **kwargs)
    op.op_name = key  # not `.name`: HookedRootModule.setup() names every submodule
    return op


# ----------------------------------------------------------------------------- helpers


def qk_logits(q, k, scale: float, *, score_bias=None):
    """Scores q . k * scale (+ a positional bias).

    Parameters
    ----------
    q : torch.Tensor, shape (B, H, T, d)
    k : torch.Tensor, shape (B, H, n_keys, d)
    scale : float
    score_bias : torch.Tensor, shape (H, T, n_keys), optional

    Returns
    -------
    torch.Tensor, shape (B, H, T, n_keys)
    """
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if score_bias is None else s + score_bias


def mask_min(s, allowed):
    """Masked entries set to the dtype's minimum (as TransformerLens' bridge reports scores).

    Parameters
    ----------
    s : torch.Tensor, shape (..., T, n_keys)
        Scores.
    allowed : torch.Tensor, shape (T, n_keys)
        bool.

    Returns
    -------
    torch.Tensor
    """
    return s.masked_fill(~allowed, torch.finfo(s.dtype).min)


def row_normalise(w, *, tiny: float = 1e-12):
    """Rows divided by their sum.

    Parameters
    ----------
    w : torch.Tensor, shape (..., n_keys)
    tiny : float
        The smallest divisor.

    Returns
    -------
    torch.Tensor, shape (..., n_keys)
    """
    return w / w.sum(-1, keepdim=True).clamp_min(tiny)


class AttentionOp(nn.Module):
    """Base class. ``forward(q, k, v, allowed, score_bias, slot, hooks)`` -> z (B, H, T, d).

    ``allowed`` (T, T) bool: query i may attend to key j (causal, optional sliding window).
    ``score_bias`` (H, T, T) or None: ALiBi / relative position bias added to the logits.
    ``slot``: only for operations with ``uses_sink_token``.
    ``hooks``: an object with the four hook points (the model's attention module), or None.
    """

    op_name = "?"
    pattern_proxy: Optional[str] = None  # what hook_pattern holds where it is not the weights the values get
    fused_kind: Optional[str] = None  # "sdpa" / "flex": the kernel ``fused`` uses under attn_impl="auto"
    uses_sink_token = False  # the model must supply a Slot from its learnable sink-token stream
    kernel_based = False

    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.d_head = cfg.d_head
        self.scale = 1.0 / math.sqrt(cfg.d_head)

    def forward(self, q, k, v, allowed, score_bias=None, slot: Optional[Slot] = None, hooks=None):
        raise NotImplementedError

    @property
    def kernels(self) -> tuple[str, ...]:
        """The fused kernels ``fused`` takes, preferred first (``analysis.model.reference.kernels``' table)."""
        return (self.fused_kind,) if self.fused_kind else ()

    def fused(self, q, k, v, *, impl: str, window, score_bias=None, slot=None) -> Optional[torch.Tensor]:
        """Output z without materialised patterns (SDPA / FlexAttention / Triton), or None if unsupported."""
        return None


# ----------------------------------------------------------------------------- softmax family


def _sdpa_mask(T: int, window, score_bias, extra_cols: int = 0, slot_bias=None, device=None, dtype=None):
    """None (plain causal) or an additive float mask (H or 1, T, extra + T) for SDPA."""
    if score_bias is None and window is None and extra_cols == 0:
        return None
    allowed = causal_mask(T, window=window, device=device)
    m = torch.zeros(T, T, device=device, dtype=dtype).masked_fill(~allowed, float("-inf"))
    m = m[None] if score_bias is None else m[None] + score_bias.to(dtype)
    if extra_cols:
        sb = torch.zeros(m.shape[0], T, 1, device=device, dtype=dtype)
        if slot_bias is not None:
            sb = sb + slot_bias.to(dtype)[..., None]
            m = m.expand(slot_bias.shape[0], T, T)
        m = torch.cat([sb.expand(m.shape[0], T, 1), m], dim=-1)
    return m


def causal_mask(T: int, *, window=None, device=None, n_keys: int | None = None) -> torch.Tensor:
    """(T, n_keys) bool: key j visible from query i iff j <= i (and i - j < window). ``n_keys`` >= T: the T
    queries are the last T of ``n_keys`` tokens (a step that continues a KV cache); default T.

    Parameters
    ----------
    T : int
        Queries.
    window : int, optional
        A sliding window.
    device : torch.device, optional
    n_keys : int, optional
        Keys (default T).

    Returns
    -------
    torch.Tensor, shape (T, n_keys)
    """
    L = T if n_keys is None else n_keys
    i = torch.arange(L - T, L, device=device)[:, None]
    j = torch.arange(L, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    return allowed


@register("softmax", "standard softmax attention")
class Softmax(AttentionOp):
    fused_kind = "sdpa"

    @property
    def kernels(self) -> tuple[str, ...]:
        return ("sdpa", "flex") if type(self) is Softmax else ("sdpa",)  # flex: the baseline of the flex path

    def forward(self, q, k, v, allowed, score_bias=None, slot=None, hooks=None):
        h = hooks or NO_HOOKS
        s = h.hook_attn_scores(mask_min(qk_logits(q, k, self.scale, score_bias=score_bias), allowed))
        w = h.hook_raw_pattern(h.hook_pattern(torch.softmax(s, dim=-1)))
        return torch.matmul(w, v)

    def fused(self, q, k, v, *, impl, window, score_bias=None, slot=None):
        if impl == "flex" and type(self) is Softmax:  # the softmax baseline of the FlexAttention path
            return flex_softmax(q, k, v, scale=self.scale, window=window, score_bias=score_bias)
        if impl not in ("sdpa", "auto"):
            return None
        T = q.shape[-2]
        m = _sdpa_mask(T, window, score_bias, device=q.device, dtype=q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None, scale=self.scale)


@register("softmax-scaled", "softmax with scaled normalisation: divide by Z/alpha (--attn-alpha)")
class SoftmaxScaled(Softmax):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.alpha = float(cfg.attn_alpha)

    def forward(self, q, k, v, allowed, score_bias=None, slot=None, hooks=None):
        h = hooks or NO_HOOKS
        s = h.hook_attn_scores(mask_min(qk_logits(q, k, self.scale, score_bias=score_bias), allowed))
        p = h.hook_pattern(torch.softmax(s, dim=-1))
        raw = h.hook_raw_pattern(self.alpha * p)
        return torch.matmul(raw, v)

    def fused(self, q, k, v, **kw):
        z = super().fused(q, k, v, **kw)
        return None if z is None else self.alpha * z


@register("softmax-pnorm", "exp similarities divided by their p-norm, (sum_j sim^p)^(1/p) (--attn-p)")
class SoftmaxPNorm(AttentionOp):
    pattern_proxy = "sim / sum sim"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.p = float(cfg.attn_p)

    def forward(self, q, k, v, allowed, score_bias=None, slot=None, hooks=None):
        h = hooks or NO_HOOKS
        s = h.hook_attn_scores(mask_min(qk_logits(q, k, self.scale, score_bias=score_bias), allowed))
        # sim / ||sim||_p is invariant to a common factor: subtract the row max for stability.
        sim = torch.exp(s - s.amax(-1, keepdim=True)) * allowed
        h.hook_pattern(row_normalise(sim))
        raw = h.hook_raw_pattern(sim / sim.pow(self.p).sum(-1, keepdim=True).pow(1.0 / self.p))
        return torch.matmul(raw, v)


@register("softpick", "softpick (Zuhri et al. 2025): ReLU(e^(x-m) - e^(-m)) / (sum |e^(x-m) - e^(-m)| + eps)")
class Softpick(AttentionOp):
    eps = 1e-6

    def forward(self, q, k, v, allowed, score_bias=None, slot=None, hooks=None):
        h = hooks or NO_HOOKS
        s = h.hook_attn_scores(mask_min(qk_logits(q, k, self.scale, score_bias=score_bias), allowed))
        m = s.amax(-1, keepdim=True)
        e = (torch.exp(s - m) - torch.exp(-m)) * allowed
        w = h.hook_raw_pattern(h.hook_pattern(F.relu(e) / (e.abs().sum(-1, keepdim=True) + self.eps)))
        return torch.matmul(w, v)


class _SlotSoftmax(AttentionOp):
    """Softmax over [extra slot, real keys]; the slot's weight goes to ``hook_sink_pattern``."""

    fused_kind = "sdpa"

    def slot(self, q, slot: Optional[Slot]) -> Slot:
        raise NotImplementedError

    def forward(self, q, k, v, allowed, score_bias=None, slot=None, hooks=None):
        h = hooks or NO_HOOKS
        sl = self.slot(q, slot)
        s = h.hook_attn_scores(mask_min(qk_logits(q, k, self.scale, score_bias=score_bias), allowed))
        s_slot = torch.matmul(q, sl.k.transpose(-1, -2)) * self.scale  # (B, H, T, 1)
        if sl.bias is not None:
            s_slot = s_slot + sl.bias[..., None]
        w = torch.softmax(torch.cat([s_slot, s], dim=-1), dim=-1)
        w_slot = h.hook_sink_pattern(w[..., 0])
        w_real = h.hook_raw_pattern(h.hook_pattern(w[..., 1:]))
        z = torch.matmul(w_real, v)
        if sl.v is not None:
            z = z + w_slot[..., None] * sl.v
        return z

    def fused(self, q, k, v, *, impl, window, score_bias=None, slot=None):
        if impl not in ("sdpa", "auto"):
            return None
        sl = self.slot(q, slot)
        B, H, T, d = q.shape
        ks = sl.k.expand(B, H, 1, d).to(k.dtype)
        vs = torch.zeros_like(ks) if sl.v is None else sl.v.expand(B, H, 1, d).to(v.dtype)
        m = _sdpa_mask(T, window, score_bias, extra_cols=1, slot_bias=sl.bias, device=q.device, dtype=q.dtype)
        return F.scaled_dot_product_attention(
            q, torch.cat([ks, k], dim=2), torch.cat([vs, v], dim=2), attn_mask=m, scale=self.scale
        )


@register("sink-token", "softmax with a learnable sink token prepended to every sequence (Xiao et al.)")
class SinkToken(_SlotSoftmax):
    uses_sink_token = True

    def slot(self, q, slot):
        if slot is None:
            raise RuntimeError("attention='sink-token' needs the model's sink-token stream (a Slot).")
        return slot


@register("kv-bias", "softmax with learnable key and value biases k*, v* as an extra slot (not rotated)")
class KVBias(_SlotSoftmax):
    def __init__(self, cfg, learn_v: bool = True):
        super().__init__(cfg)
        self.k_bias = nn.Parameter(torch.randn(cfg.n_heads, 1, cfg.d_head) * cfg.init_std)
        self.v_bias = nn.Parameter(torch.randn(cfg.n_heads, 1, cfg.d_head) * cfg.init_std) if learn_v else None

    def slot(self, q, slot):
        if slot is not None:  # the model's moved slot of a decode step (``Attention.moved_bias_slot``)
            return slot
        return Slot(self.k_bias[None], None if self.v_bias is None else self.v_bias[None])


@register("k-bias", "softmax with a learnable key bias k* as an extra slot whose value is v* = 0")
class KBias(KVBias):
    def __init__(self, cfg):
        super().__init__(cfg, learn_v=False)


@register("v-bias", "control: softmax(QK^T) V + v* (a learnable value bias, no extra slot)")
class VBias(Softmax):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.v_bias = nn.Parameter(torch.randn(cfg.n_heads, 1, cfg.d_head) * cfg.init_std)

    def forward(self, q, k, v, allowed, score_bias=None, slot=None, hooks=None):
        return super().forward(q, k, v, allowed, score_bias, hooks=hooks) + self.v_bias

    def fused(self, q, k, v, **kw):
        z = super().fused(q, k, v, **kw)
        return None if z is None else z + self.v_bias.to(z.dtype)


# ----------------------------------------------------------------------------- elementwise similarities


class _Elementwise(AttentionOp):
    """sim_ij = f(q_i k_j^T / sqrt(d) + bias); z_i = sum_j sim_ij v_j (/ sum_j sim_ij if normalised)."""

    normalise = False
    fused_kind = "flex"

    @property
    def pattern_proxy(self) -> Optional[str]:
        return None if self.normalise else "sim / sum sim"

    def f(self, s):
        raise NotImplementedError

    def log_f(self, s):  # log f(s), for the FlexAttention path
        raise NotImplementedError

    def logits(self, q, k, score_bias):
        return qk_logits(q, k, self.scale, score_bias=score_bias)

    def forward(self, q, k, v, allowed, score_bias=None, slot=None, hooks=None):
        h = hooks or NO_HOOKS
        s = h.hook_attn_scores(mask_min(self.logits(q, k, score_bias), allowed))
        sim = self.f(s) * allowed
        pattern = h.hook_pattern(row_normalise(sim))
        raw = h.hook_raw_pattern(pattern if self.normalise else sim)
        return torch.matmul(raw, v)

    def extra_bias(self, T: int):
        return None

    @property
    def kernels(self) -> tuple[str, ...]:
        return ("flex",) if self.normalise else ("flex", "triton")  # triton: unnormalised sigmoid and elu+1

    def fused(self, q, k, v, *, impl, window, score_bias=None, slot=None):
        if impl == "triton" and not self.normalise:
            from analysis.model.reference.triton_attention import triton_elementwise  # optional (Triton)

            return triton_elementwise(self, q, k, v, window=window, score_bias=score_bias)
        if impl not in ("flex", "auto"):
            return None
        return flex_elementwise(self, q, k, v, window=window, score_bias=score_bias)


@register("sigmoid", "sigmoid attention without normalisation; bias by --sigmoid-bias none|fixed|learnable")
class Sigmoid(_Elementwise):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.bias_kind = cfg.sigmoid_bias
        if self.bias_kind == "learnable":
            self.bias = nn.Parameter(torch.full((cfg.n_heads, 1, 1), -math.log(cfg.n_ctx)))
        else:
            self.bias = None

    def extra_bias(self, T: int):
        return -math.log(T) if self.bias_kind == "fixed" else self.bias  # (H, 1, 1) or None

    def logits(self, q, k, score_bias):
        s = qk_logits(q, k, self.scale, score_bias=score_bias)
        b = self.extra_bias(k.shape[-2])
        return s if b is None else s + b

    def f(self, s):
        return torch.sigmoid(s)

    def log_f(self, s):
        return F.logsigmoid(s)


@register("sigmoid-norm", "sigmoid similarities normalised by their sum over keys")
class SigmoidNorm(Sigmoid):
    normalise = True


@register("elu1", "elu(x)+1 similarities without normalisation")
class Elu1(_Elementwise):
    def f(self, s):
        return F.elu(s) + 1

    def log_f(self, s):
        return torch.where(s < 0, s, torch.log1p(s.clamp_min(0)))


@register("elu1-norm", "elu(x)+1 similarities normalised by their sum over keys")
class Elu1Norm(Elu1):
    normalise = True


# ----------------------------------------------------------------------------- linear attention


class _Linear(AttentionOp):
    """sim_ij = phi(q_i) phi(k_j)^T / sqrt(d); z_i = sum_j sim_ij v_j, optionally / max(|sum_j sim_ij|, 1)."""

    kernel_based = True
    pattern_proxy = "|sim| / sum |sim|"

    def __init__(self, cfg, kernel: str, normalise: bool):
        super().__init__(cfg)
        self.kernel = kernel
        self.normalise = normalise
        if kernel == "mlp":
            hidden = cfg.kernel_hidden or cfg.d_head
            self.phi = nn.Sequential(nn.Linear(cfg.d_head, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_head))
        elif kernel not in ("identity", "elu1"):
            raise ValueError(f"unknown kernel {kernel!r}")

    def feature(self, x):
        if self.kernel == "identity":
            return x
        return F.elu(x) + 1 if self.kernel == "elu1" else self.phi(x)

    def forward(self, q, k, v, allowed, score_bias=None, slot=None, hooks=None):
        h = hooks or NO_HOOKS
        sim = torch.matmul(self.feature(q), self.feature(k).transpose(-1, -2)) * self.scale * allowed
        sim = h.hook_attn_scores(sim)
        h.hook_pattern(row_normalise(sim.abs()))
        raw = sim / sim.sum(-1, keepdim=True).abs().clamp_min(1.0) if self.normalise else sim
        return torch.matmul(h.hook_raw_pattern(raw), v)


for _kernel, _desc in (("identity", "identity kernel"), ("elu1", "elu+1 kernel"), ("mlp", "MLP kernel")):
    for _norm in (False, True):
        _name = f"linear-{_kernel}" + ("-norm" if _norm else "")
        _text = f"linear attention, {_desc}" + (", normalised by max(|Z_i|, 1)" if _norm else ", no normalisation")
        register(_name, _text, kernel=_kernel, normalise=_norm)(type(f"Linear_{_kernel}_{int(_norm)}", (_Linear,), {}))
