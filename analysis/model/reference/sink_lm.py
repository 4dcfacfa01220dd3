"""A LLaMA-style decoder with swappable attention, written as a TransformerLens ``HookedRootModule``.

nanoGPT-style: the whole model is in this file and configured by one dataclass
(``analysis.model.reference.config.ModelConfig``). Pre-norm (or post-norm) blocks with RMSNorm (or LayerNorm),
RoPE / NoPE / learned / sinusoidal / ALiBi / T5-relative positions, SwiGLU / GELU / ReLU MLPs,
grouped-query attention, and any attention operation of ``analysis.model.reference.attention``.

Hook names and shapes are those of TransformerLens' ``TransformerBridge`` on a LLaMA model
(B batch, T tokens, H query heads, Hkv key/value heads, d head dim)::

    hook_embed (B,T,D)                        hook_pos_embed (B,T,D)   learned / sinusoidal only
    blocks.{l}.hook_resid_pre|mid|post (B,T,D)  blocks.{l}.hook_attn_out|hook_mlp_out (B,T,D)
    blocks.{l}.ln1|ln2.hook_scale (B,T,1)     blocks.{l}.ln1|ln2.hook_normalized (B,T,D)
    blocks.{l}.attn.hook_q|hook_rot_q (B,T,H,d)   blocks.{l}.attn.hook_k|hook_v|hook_rot_k (B,T,Hkv,d)
    blocks.{l}.attn.hook_attn_scores|hook_pattern (B,H,T,T)   blocks.{l}.attn.hook_z (B,T,H,d)
    blocks.{l}.mlp.hook_pre|hook_post (B,T,d_mlp)   ln_final.hook_scale|hook_normalized
plus this package's own ``attn.hook_raw_pattern`` (B,H,T,T) (the weights that multiply the values)
and ``attn.hook_sink_pattern`` (B,H,T) (weight on the sink-token / K-bias slot).

Weights use TransformerLens' layout: ``W_Q`` (H,D,d), ``W_K``/``W_V`` (Hkv,D,d), ``W_O`` (H,d,D),
``ln1.w`` (D,), ``W_E`` (V,D), ``W_U`` (D,V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, repeat
from torch import nn

from transformer_lens.HookedRootModule import HookedRootModule
from transformer_lens.hook_points import HookPoint

from analysis.model.hooks import validate_token_ids
from analysis.model.reference.attention import _REGISTRY, Slot, build_attention_op, canonical_name, causal_mask
from analysis.model.reference.config import ModelConfig
from analysis.model.reference.kernels import KernelChoice, attention_kernel, state
from analysis.model.reference.positions import (
    RelativeBias,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    rope_cos_sin,
    sinusoidal_table,
)


def _identity(x):
    return x


class Norm(nn.Module):
    """RMSNorm or LayerNorm with TransformerLens' ``hook_scale`` (the denominator) and ``hook_normalized``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.eps = cfg.eps
        self.centre = cfg.normalization_type == "LN"
        self.w = nn.Parameter(torch.ones(cfg.d_model))
        if self.centre:
            self.b = nn.Parameter(torch.zeros(cfg.d_model))
        else:
            self.register_parameter("b", None)
        self.hook_scale = HookPoint()
        self.hook_normalized = HookPoint()

    def forward(self, x: torch.Tensor, hooked: bool = True) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        if self.centre:
            x = x - x.mean(-1, keepdim=True)
        scale = (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        scale = self.hook_scale(scale) if hooked else scale
        x = x / scale
        x = self.hook_normalized(x) if hooked else x
        x = x * self.w
        if self.b is not None:
            x = x + self.b
        return x.to(dtype)


class MLP(nn.Module):
    """SwiGLU (gate, in, out) or a plain GELU / ReLU MLP, with ``hook_pre`` / ``hook_post``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, M = cfg.d_model, cfg.d_mlp
        self.act_fn = cfg.act_fn
        self.W_in = nn.Parameter(torch.empty(D, M))
        self.W_gate = nn.Parameter(torch.empty(D, M)) if cfg.act_fn == "swiglu" else None
        self.W_out = nn.Parameter(torch.empty(M, D))
        self.hook_pre = HookPoint()  # swiglu: the gate's pre-activation (as the bridge)
        self.hook_pre_linear = HookPoint()  # swiglu: the linear branch
        self.hook_post = HookPoint()

    def forward(self, x: torch.Tensor, hooked: bool = True) -> torch.Tensor:
        hk = (lambda hp: hp) if hooked else (lambda hp: _identity)
        if self.act_fn == "swiglu":
            pre = hk(self.hook_pre)(x @ self.W_gate)
            lin = hk(self.hook_pre_linear)(x @ self.W_in)
            post = hk(self.hook_post)(F.silu(pre) * lin)
        else:
            pre = hk(self.hook_pre)(x @ self.W_in)
            post = hk(self.hook_post)(F.gelu(pre) if self.act_fn == "gelu" else F.relu(pre))
        return post @ self.W_out


@dataclass
class Positions:
    """Per-forward position data shared by all blocks.

    Attributes
    ----------
    T : int
        The sequence length.
    allowed : torch.Tensor, shape (T, T) or (B, 1, T, T)
        bool, which keys each query sees (the second with intra-document masking).
    distance : torch.Tensor, shape (T, T)
        i - j, long.
    cos, sin : torch.Tensor, shape (T, d), or None
        The rotary tables.
    slot_cos, slot_sin : torch.Tensor, shape (1, d), or None
        Those of the sink token, which sits at position -1.
    cache : transformers.Cache or None
        A cache the new keys and values join (``SinkLM.decode``).
    bias_cos, bias_sin : torch.Tensor, shape (1, d), or None
        Decode steps turn unrotated K / V-bias slots by the evictions.
    """

    T: int
    allowed: torch.Tensor  # (T, T) bool, or (B, 1, T, T) with intra-document masking
    distance: torch.Tensor  # (T, T) long, i - j
    cos: Optional[torch.Tensor] = None  # (T, d)
    sin: Optional[torch.Tensor] = None
    slot_cos: Optional[torch.Tensor] = None  # (1, d): the sink token sits at position -1
    slot_sin: Optional[torch.Tensor] = None
    cache: Optional[object] = None  # a transformers Cache the new keys and values join (``SinkLM.decode``)
    bias_cos: Optional[torch.Tensor] = None  # (1, d): decode steps turn unrotated K/V-bias slots by the evictions
    bias_sin: Optional[torch.Tensor] = None


class Attention(nn.Module):
    """Multi-head (grouped-query) attention around a swappable operation ``self.op``."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        H, Hkv, D, d = cfg.n_heads, cfg.n_key_value_heads, cfg.d_model, cfg.d_head
        self.group = H // Hkv
        self.W_Q = nn.Parameter(torch.empty(H, D, d))
        self.W_K = nn.Parameter(torch.empty(Hkv, D, d))
        self.W_V = nn.Parameter(torch.empty(Hkv, D, d))
        self.W_O = nn.Parameter(torch.empty(H, d, D))
        self.b_Q = self.b_K = self.b_V = self.b_O = None
        self.op = build_attention_op(cfg)
        self.relative = (
            RelativeBias(H, cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance)
            if cfg.positional_embedding_type == "relative"
            else None
        )
        if cfg.positional_embedding_type == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(H) * cfg.alibi_slope_scale, persistent=False)
        for name in ("q", "k", "v", "rot_q", "rot_k", "attn_scores", "pattern", "raw_pattern", "z"):
            setattr(self, f"hook_{name}", HookPoint())
        if self.op.uses_sink_token or hasattr(self.op, "k_bias"):
            self.hook_sink_pattern = HookPoint()
        else:
            self.hook_sink_pattern = None
        self._kernels: dict[tuple[str, torch.dtype], KernelChoice] = {}
        self.last_path = None  # "sdpa" / "flex" / "triton" / "eager": the path the last forward took

    # -- positions
    def score_bias(self, pos: Positions) -> Optional[torch.Tensor]:
        if self.relative is not None:
            return self.relative(pos.distance)
        return alibi_bias(self.alibi_slopes, pos.distance) if self.cfg.positional_embedding_type == "alibi" else None

    def slot_bias(self, pos: Positions) -> Optional[torch.Tensor]:
        """(H, T) positional bias of the sink token (at position -1: distance i + 1)."""
        if self.relative is None and self.cfg.positional_embedding_type != "alibi":
            return None
        dist = torch.arange(1, pos.T + 1, device=pos.distance.device)
        return self.relative(dist) if self.relative is not None else alibi_bias(self.alibi_slopes, dist)

    # -- projections
    def project_kv(self, x):
        k = einsum(x, self.W_K, "b t D, h D d -> b t h d")
        v = einsum(x, self.W_V, "b t D, h D d -> b t h d")
        return k, v

    def cached_kv(self, k, v, cache):
        """The new keys and values (B, T, Hkv, d) joined to ``cache`` (a transformers Cache): every kept key and
        value (B, L, Hkv, d)."""
        keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def moved_bias_slot(self, pos: Positions) -> Slot:
        """The K/V-bias slot of a decode step. Its key is not rotated, so a query at position p sees it as a key at
        position 0; queries here sit at stream positions, E evictions past their cache positions, so the key is
        turned by E (``pos.bias_cos``) to be seen as the query at its cache position sees it."""
        sl = self.op.slot(None, None)
        k = apply_rope(rearrange(sl.k, "b h t d -> b t h d"), pos.bias_cos, pos.bias_sin)
        return Slot(rearrange(k, "b t h d -> b h t d"), sl.v, sl.bias)

    def expand_kv(self, x):
        """(B, T, Hkv, d) -> (B, H, T, d); query head h reads key/value head h // group."""
        return repeat(x, "b t hk d -> b (hk g) t d", g=self.group)

    def kernel(self, device_type: str, dtype: torch.dtype) -> KernelChoice:
        """The kernel this layer takes on ``device_type`` in ``dtype`` (``analysis.model.reference.kernels``' table,
        read once per device and dtype; a fallback is logged once).

        Parameters
        ----------
        device_type, dtype
            As in :meth:`SinkLM.attention_kernel`.

        Returns
        -------
        KernelChoice
        """
        key = (device_type, dtype)
        if key not in self._kernels:
            bias = (
                self.cfg.positional_embedding_type
                if self.cfg.positional_embedding_type in ("alibi", "relative")
                else None
            )
            choice = attention_kernel(
                self.op.kernels, self.cfg.attn_impl, device_type, dtype, self.cfg.d_head, bias=bias
            )
            if choice.kernel != "eager" and (self.cfg.prefix_attention or self.cfg.document_token is not None):
                choice = KernelChoice(
                    "eager",
                    "the fused kernels take a causal or sliding-window mask only, not "
                    "prefix or document attention: the eager path",
                )
            self._kernels[key] = choice
            state(self.op.op_name, choice)
        return self._kernels[key]

    def _impl(self, device: torch.device, dtype: torch.dtype) -> Optional[str]:
        """Which fused kernel to take, or None for the eager path (any pattern hook forces eager)."""
        hooks = (self.hook_attn_scores, self.hook_pattern, self.hook_raw_pattern, self.hook_sink_pattern)
        if any(h is not None and h.has_hooks() for h in hooks):
            return None
        k = self.kernel(device.type, dtype).kernel
        return None if k == "eager" else k

    def forward(self, x: torch.Tensor, pos: Positions, sink: Optional[torch.Tensor] = None):
        """x (B, T, D) normalised input; ``sink`` (1, 1, D) normalised sink-token state or None.

        Returns (attention output (B, T, D), sink-token attention output (1, 1, D) or None).
        """
        q = self.hook_q(einsum(x, self.W_Q, "b t D, h D d -> b t h d"))
        k, v = self.project_kv(x)
        k, v = self.hook_k(k), self.hook_v(v)
        if pos.cos is not None:
            q = self.hook_rot_q(apply_rope(q, pos.cos, pos.sin))
            k = self.hook_rot_k(apply_rope(k, pos.cos, pos.sin))
        allowed = pos.allowed
        if pos.cache is not None:  # a decode step: attend to every kept key, the new ones causally
            k, v = self.cached_kv(k, v, pos.cache)
            allowed = causal_mask(q.shape[1], device=x.device, n_keys=k.shape[1])
        qh = rearrange(q, "b t h d -> b h t d")
        kh, vh = self.expand_kv(k), self.expand_kv(v)
        score_bias = self.score_bias(pos)

        slot, sink_out = None, None
        if self.op.uses_sink_token:
            ks, vs = self.project_kv(sink)  # (1, 1, Hkv, d)
            if pos.slot_cos is not None:
                ks = apply_rope(ks, pos.slot_cos, pos.slot_sin)
            slot = Slot(self.expand_kv(ks), self.expand_kv(vs), self.slot_bias(pos))
            # The sink token sees only itself: its attention output is its own value.
            sink_out = einsum(rearrange(slot.v, "b h t d -> b t h d"), self.W_O, "b t h d, h d D -> b t D")
        elif pos.bias_cos is not None and hasattr(self.op, "k_bias"):
            slot = self.moved_bias_slot(pos)

        z = None
        impl = None if pos.cache is not None else self._impl(x.device, qh.dtype)
        if impl is not None:  # the table knows the kernel's limits: no error is caught here
            z = self.op.fused(qh, kh, vh, impl=impl, window=self.cfg.sliding_window, score_bias=score_bias, slot=slot)
        if z is None:
            z = self.op(qh, kh, vh, allowed, score_bias, slot, hooks=self)
            self.last_path = "eager"
        else:
            self.last_path = impl
        z = self.hook_z(rearrange(z, "b h t d -> b t h d"))
        return einsum(z, self.W_O, "b t h d, h d D -> b t D"), sink_out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.ln1 = Norm(cfg)
        self.attn = Attention(cfg, layer)
        self.ln2 = Norm(cfg)
        self.mlp = MLP(cfg)
        for name in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"):
            setattr(self, f"hook_{name}", HookPoint())

    def forward(self, x, pos: Positions, sink=None):
        resid_pre = self.hook_resid_pre(x)
        if self.pre_norm:
            attn_out, sink_attn = self.attn(
                self.ln1(resid_pre), pos, None if sink is None else self.ln1(sink, hooked=False)
            )
            resid_mid = self.hook_resid_mid(resid_pre + self.hook_attn_out(attn_out))
            mlp_out = self.hook_mlp_out(self.mlp(self.ln2(resid_mid)))
            resid_post = self.hook_resid_post(resid_mid + mlp_out)
            if sink is not None:
                sink = sink + sink_attn
                sink = sink + self.mlp(self.ln2(sink, hooked=False), hooked=False)
        else:
            attn_out, sink_attn = self.attn(resid_pre, pos, sink)
            resid_mid = self.hook_resid_mid(self.ln1(resid_pre + self.hook_attn_out(attn_out)))
            mlp_out = self.hook_mlp_out(self.mlp(resid_mid))
            resid_post = self.hook_resid_post(self.ln2(resid_mid + mlp_out))
            if sink is not None:
                sink = self.ln1(sink + sink_attn, hooked=False)
                sink = self.ln2(sink + self.mlp(sink, hooked=False), hooked=False)
        return resid_post, sink


class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))

    def forward(self, tokens):
        return F.embedding(tokens, self.W_E)


class Unembed(nn.Module):
    def __init__(self, cfg: ModelConfig, embed: Embed):
        super().__init__()
        self._tied = [embed] if cfg.tie_embeddings else None  # a list: not registered as a submodule
        self.W_U = None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))

    @property
    def weight(self):
        return self._tied[0].W_E.T if self._tied else self.W_U

    def forward(self, x):
        return x @ self.weight


class SinkLM(HookedRootModule):
    """The decoder. ``model(tokens)`` -> logits (B, T, V); all TransformerLens hook utilities work
    (``run_with_hooks``, ``run_with_cache``, ``hooks``)."""

    def __init__(self, cfg: ModelConfig, tokenizer=None):
        super().__init__()
        if isinstance(cfg, dict):
            cfg = ModelConfig.from_dict(cfg)
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_name = cfg.model_name
        self.rope_theta = cfg.rotary_base if cfg.positional_embedding_type == "rotary" else None
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()
        pe = cfg.positional_embedding_type
        if pe == "learned":
            self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))
        elif pe == "sinusoidal":
            self.register_buffer("W_pos", sinusoidal_table(cfg.n_ctx, cfg.d_model), persistent=False)
        else:
            self.W_pos = None
        self.hook_pos_embed = HookPoint() if pe in ("learned", "sinusoidal") else None
        self.sink_token = nn.Parameter(torch.empty(cfg.d_model)) if self.blocks_need_sink(cfg) else None
        self.blocks = nn.ModuleList([Block(cfg, l) for l in range(cfg.n_layers)])
        self.ln_final = Norm(cfg) if cfg.norm_position == "pre" else None
        self.unembed = Unembed(cfg, self.embed)
        self.init_weights()
        self.setup()

    def attention_kernel(self, device_type: str, dtype: torch.dtype) -> dict:
        """The attention kernel the layers take on this device and dtype, and why not the one asked for where they
        cannot (``analysis.model.reference.kernels``): the run's record of its attention path.

        Parameters
        ----------
        device_type : str
        dtype : torch.dtype

        Returns
        -------
        dict
            {"kernel": name, "fallback": reason (only where there is one)}.
        """
        return self.blocks[0].attn.kernel(device_type, dtype).to_dict()

    @staticmethod
    def blocks_need_sink(cfg: ModelConfig) -> bool:
        return bool(_REGISTRY[canonical_name(cfg.attention)][0].uses_sink_token)

    # -- weights
    def init_weights(self) -> None:
        """Normal(0, init_std) for matrices and embeddings (output projections scaled by 1/sqrt(2 n_layers)),
        ones / zeros for norm gains / biases, zeros for relative-position tables. Parameters owned by an
        attention operation (K/V biases, sigmoid bias, MLP kernel) keep the operation's own init."""
        std, cfg = self.cfg.init_std, self.cfg
        out_std = std / (2 * cfg.n_layers) ** 0.5
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, Norm):
                    m.w.fill_(1.0)
                    if m.b is not None:
                        m.b.zero_()
                elif isinstance(m, Attention):
                    for p in (m.W_Q, m.W_K, m.W_V):
                        p.normal_(0.0, std)
                    m.W_O.normal_(0.0, out_std)
                    if m.relative is not None:
                        m.relative.weight.zero_()
                elif isinstance(m, MLP):
                    for p in (m.W_in, m.W_gate):
                        if p is not None:
                            p.normal_(0.0, std)
                    m.W_out.normal_(0.0, out_std)
            self.embed.W_E.normal_(0.0, std)
            if self.unembed.W_U is not None:
                self.unembed.W_U.normal_(0.0, std)
            if isinstance(self.W_pos, nn.Parameter):
                self.W_pos.normal_(0.0, std)
            if self.sink_token is not None:
                self.sink_token.normal_(0.0, std)

    @property
    def W_E(self) -> torch.Tensor:
        return self.embed.W_E

    @property
    def W_U(self) -> torch.Tensor:
        return self.unembed.weight

    @property
    def device(self) -> torch.device:
        return self.embed.W_E.device  # where the token ids go (the embedding's weight)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def n_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.W_E.numel() + (0 if self.cfg.tie_embeddings else self.W_U.numel())
        return n

    # -- inputs
    def check_tokens(self, tokens) -> torch.Tensor:
        if (
            isinstance(tokens, (str, list))
            and self.tokenizer is not None
            and (isinstance(tokens, str) or (tokens and isinstance(tokens[0], str)))
        ):
            return self.to_tokens(tokens)
        return validate_token_ids(
            tokens, self.cfg.n_ctx, self.cfg.d_vocab, hint=" (or train a model with a larger --n-ctx)", sync=False
        )

    def to_tokens(self, text, prepend_bos: bool = True) -> torch.Tensor:
        """Tokenize a string or list of strings of equal token length (needs ``self.tokenizer``)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (synthetic task): pass token ids (LongTensor).")
        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        if prepend_bos and self.tokenizer.bos_token_id is not None:
            ids = [[self.tokenizer.bos_token_id] + i for i in ids]
        if len({len(i) for i in ids}) != 1:
            raise ValueError("texts tokenize to different lengths; tokenize and pad them yourself.")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def to_string(self, tokens) -> str | list[str]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (synthetic task).")
        tokens = torch.as_tensor(tokens)
        if tokens.ndim == 1:
            return self.tokenizer.decode(tokens.tolist())
        return [self.tokenizer.decode(t.tolist()) for t in tokens]

    def attention_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """Which keys each query sees: (T, T), or (B, 1, T, T) with intra-document masking.

        Causal (within ``sliding_window``); the first ``prefix_attention`` tokens also see each other
        (prefix LM); with ``document_token`` a query sees only keys of its own document, a document
        starting at each occurrence of that token (the separator acts as the document's BOS).
        """
        cfg, T = self.cfg, tokens.shape[1]
        allowed = causal_mask(T, window=cfg.sliding_window, device=tokens.device)
        p = min(cfg.prefix_attention, T)
        if p:
            allowed = allowed.clone()
            allowed[:p, :p] = True
        if cfg.document_token is not None:
            doc = torch.cumsum(tokens == cfg.document_token, dim=1)  # (B, T) document index
            allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
        return allowed

    def positions(self, T: int, device, tokens: Optional[torch.Tensor] = None) -> Positions:
        cfg = self.cfg
        idx = torch.arange(T, device=device)
        allowed = (
            causal_mask(T, window=cfg.sliding_window, device=device) if tokens is None else self.attention_mask(tokens)
        )
        pos = Positions(T, allowed, idx[:, None] - idx[None, :])
        if cfg.positional_embedding_type == "rotary":
            dtype = self.dtype
            pos.cos, pos.sin = rope_cos_sin(idx, cfg.d_head, cfg.rotary_base, dtype=dtype)
            if self.sink_token is not None:
                pos.slot_cos, pos.slot_sin = rope_cos_sin(
                    torch.tensor([-1], device=device), cfg.d_head, cfg.rotary_base, dtype=dtype
                )
        return pos

    # -- forward
    def forward(self, tokens, return_type: Optional[str] = "logits", targets: Optional[torch.Tensor] = None):
        """Logits (B, T, V) for token ids (B, T).

        ``return_type``: "logits", "loss" (mean next-token cross-entropy; ``targets`` (B, T) with -100
        for ignored positions, default: the tokens shifted by one), "both" (logits, loss) or None.
        """
        tokens = self.check_tokens(tokens)
        logits = self._logits(tokens, self.positions(tokens.shape[1], tokens.device, tokens))
        if return_type == "logits":
            return logits
        if return_type is None:
            return None
        if targets is None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
        else:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None; got {return_type!r}.")

    def _logits(self, tokens: torch.Tensor, pos: Positions) -> torch.Tensor:
        B, T = tokens.shape
        x = self.hook_embed(self.embed(tokens))
        if self.W_pos is not None:
            x = x + self.hook_pos_embed(self.W_pos[:T].to(x.dtype).expand(B, T, -1))
        sink = None if self.sink_token is None else self.sink_token.view(1, 1, -1).to(x.dtype)
        for block in self.blocks:
            x, sink = block(x, pos, sink)
        if self.ln_final is not None:
            x = self.ln_final(x)
        return self.unembed(x)

    # -- decoding with a KV cache
    def check_decodable(self) -> None:
        """Raise unless token-by-token decoding with a KV cache gives this model's own forward: the keys must carry
        their positions (rotary) or have none, and a query must see every earlier kept token."""
        cfg = self.cfg
        why = []
        if cfg.positional_embedding_type not in ("rotary", "none"):
            why.append(f"{cfg.positional_embedding_type} positions live outside the keys (use rotary or none)")
        if cfg.sliding_window is not None or cfg.prefix_attention or cfg.document_token is not None:
            why.append("its attention mask is not plain causal (sliding window, prefix LM or documents)")
        if why:
            raise ValueError(
                f"{self.model_name} cannot be decoded with a KV cache: {'; '.join(why)}. Train the "
                "model with --positions rotary (or none) and plain causal attention to stream it."
            )

    def cache_positions(self, positions: torch.Tensor, cache) -> Positions:
        """Positions of T new tokens at stream positions ``positions`` (T,) that continue ``cache``. Keys are
        rotated at their stream positions; the sink token sits one position before the oldest kept token (at
        -1 until the cache evicts, then at evictions - 1), as StreamingLLM numbers a cache from 0."""
        cfg, T = self.cfg, positions.numel()
        pos = Positions(T, None, None, cache=cache)
        if cfg.positional_embedding_type == "rotary":
            cap = getattr(cache, "capacity", None)
            evicted = 0 if cap is None else max(0, int(positions[-1]) + 1 - cap)
            at = torch.tensor([evicted - 1, evicted], device=positions.device)
            (pos.cos, pos.sin), (cos, sin) = (
                rope_cos_sin(p, cfg.d_head, cfg.rotary_base, dtype=self.dtype) for p in (positions, at)
            )
            pos.slot_cos, pos.slot_sin = cos[:1], sin[:1]  # the sink token: one before the oldest kept token
            pos.bias_cos, pos.bias_sin = cos[1:], sin[1:]  # K/V biases: where position 0 of the cache is
        return pos

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """Logits (B, T, V) of tokens (B, T) that continue a KV cache (a ``transformers.Cache``, e.g.
        ``analysis.streaming.StreamingCache``; its layer i takes block i's keys and values) at stream positions
        ``positions`` (T,). Decoding a sequence in pieces this way gives ``forward`` on the whole sequence."""
        self.check_decodable()
        return self._logits(tokens, self.cache_positions(positions.to(tokens.device), cache))
