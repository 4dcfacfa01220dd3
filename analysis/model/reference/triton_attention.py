"""Sigmoid and elu+1 attention in Triton, forward and backward: z_i = sum_{j visible} f(s_ij) v_j with
s_ij = q_i . k_j * scale + b_h (+ a position bias), f = sigmoid or elu + 1, no normalisation.

Unlike softmax, f needs no running maximum and no log-sum-exp: each block of query rows adds f(S) V over its key blocks
in one pass, and the backward recomputes S from q and k (nothing T x T is stored): dV = f(S)^T dO,
dS = (dO V^T) * f'(S), dQ = dS K * scale, dK = dS^T Q * scale, and the head bias's gradient is the sum of dS. One
transcendental per score (sigmoid; exp only on the negative side for elu + 1), where FlexAttention's softmax
computes two (log f as a score modifier, then exp of the lse to undo the normalisation).

Masks: causal, and a sliding window (query i sees keys i - window < j <= i); the loops visit only the key blocks a
query block can see. Position biases: an additive (H, T, T) tensor (ALiBi; no gradient), read tile by tile. The
structure (one program per block of query rows and head, a second pass per key block for dK and dV) follows the
FlashAttention-2 Triton tutorial; the kernels are written for this package.

Limits (``analysis.model.reference.kernels``): head sizes a power of two >= 16, float16 / bfloat16 / float32, CUDA
or the CPU under ``TRITON_INTERPRET=1`` (the tests). Triton is an optional dependency (``pip install
attention-sink-lens[triton]``).
"""

from __future__ import annotations

import os

import torch
import triton  # optional: imported only where the kernel table chose this kernel
import triton.language as tl

KINDS = {"sigmoid": 0, "elu1": 1}


def _block() -> int:
    """Rows and keys per block: 64 on a GPU; 16 under the interpreter (numpy per element: small blocks)."""
    return 16 if os.environ.get("TRITON_INTERPRET") == "1" else 64


@triton.jit
def _f(s, KIND: tl.constexpr):
    if KIND == 0:
        return tl.sigmoid(s)
    else:
        return tl.where(s < 0, tl.exp(tl.minimum(s, 0.0)), s + 1.0)


@triton.jit
def _df(s, KIND: tl.constexpr):
    if KIND == 0:
        g = tl.sigmoid(s)
        return g * (1.0 - g)
    else:
        return tl.where(s < 0, tl.exp(tl.minimum(s, 0.0)), 1.0)


@triton.jit
def _tile(ptr, base, offs, offs_d, st, T):
    """Rows ``offs`` (zeros past T) of a (T, D) slice at ``ptr + base``."""
    return tl.load(ptr + base + offs[:, None] * st + offs_d[None, :], mask=offs[:, None] < T, other=0.0)


@triton.jit
def _keys_seen(pid_m, T, BM: tl.constexpr, BN: tl.constexpr, WINDOW: tl.constexpr):
    """The key range (block-aligned start, end) a block of query rows sees: causal, within the window."""
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(pid_m * BM - WINDOW + 1, 0) // BN * BN
    return lo, tl.minimum((pid_m + 1) * BM, T)


@triton.jit
def _scores(q, k, offs_m, offs_n, hb, bias_ptr, sbm, sbn, T, scale, WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The block's scores (fp32) and which of them a query sees."""
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale + hb
    inside = (offs_m[:, None] < T) & (offs_n[None, :] < T)
    if HAS_BIAS:
        s += tl.load(bias_ptr + offs_m[:, None] * sbm + offs_n[None, :] * sbn, mask=inside, other=0.0).to(tl.float32)
    keep = inside & (offs_n[None, :] <= offs_m[:, None])
    if WINDOW > 0:
        keep = keep & (offs_m[:, None] - offs_n[None, :] < WINDOW)
    return s, keep


@triton.jit
def _rows(
    Q,
    K,
    V,
    DO,
    OUT,
    HB,
    BIAS,
    sb,
    sh,
    st,
    sbh,
    sbm,
    sbn,
    H,
    T,
    scale,
    KIND: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    D: tl.constexpr,
    GRAD: tl.constexpr,
):
    """One block of query rows over the keys it sees: z = f(S) V (the forward), or with ``GRAD``
    dQ = ((dO V^T) * f'(S)) K * scale (``DO`` is read only then)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    h = bh % H
    base = (bh // H) * sb + h * sh
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rows = offs_m[:, None] < T
    q = _tile(Q, base, offs_m, offs_d, st, T)
    if GRAD:
        do = _tile(DO, base, offs_m, offs_d, st, T)
    hb = tl.load(HB + h)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    lo, hi = _keys_seen(pid_m, T, BM, BN, WINDOW)
    for start in range(lo, hi, BN):
        offs_n = start + tl.arange(0, BN)
        k = _tile(K, base, offs_n, offs_d, st, T)
        v = _tile(V, base, offs_n, offs_d, st, T)
        s, keep = _scores(q, k, offs_m, offs_n, hb, BIAS + h * sbh, sbm, sbn, T, scale, WINDOW, HAS_BIAS)
        if GRAD:
            ds = tl.where(keep, tl.dot(do, tl.trans(v)).to(tl.float32) * _df(s, KIND), 0.0)
            acc += tl.dot(ds.to(k.dtype), k).to(tl.float32)
        else:
            p = tl.where(keep, _f(s, KIND), 0.0)
            acc += tl.dot(p.to(v.dtype), v).to(tl.float32)
    if GRAD:
        acc = acc * scale
    tl.store(OUT + base + offs_m[:, None] * st + offs_d[None, :], acc.to(OUT.dtype.element_ty), mask=rows)


@triton.jit
def _bwd_kv(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    HB,
    DHB,
    BIAS,
    sb,
    sh,
    st,
    sbh,
    sbm,
    sbn,
    H,
    T,
    scale,
    KIND: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    D: tl.constexpr,
):
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    h = bh % H
    base = (bh // H) * sb + h * sh
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    cols = offs_n[:, None] < T
    k = _tile(K, base, offs_n, offs_d, st, T)
    v = _tile(V, base, offs_n, offs_d, st, T)
    hb = tl.load(HB + h)
    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, D], dtype=tl.float32)
    dhb = tl.zeros([BN], dtype=tl.float32)
    lo = pid_n * BN // BM * BM
    hi = T
    if WINDOW > 0:
        hi = tl.minimum((pid_n + 1) * BN + WINDOW - 1, T)
    for start in range(lo, hi, BM):
        offs_m = start + tl.arange(0, BM)
        q = _tile(Q, base, offs_m, offs_d, st, T)
        do = _tile(DO, base, offs_m, offs_d, st, T)
        s, keep = _scores(q, k, offs_m, offs_n, hb, BIAS + h * sbh, sbm, sbn, T, scale, WINDOW, HAS_BIAS)
        p = tl.where(keep, _f(s, KIND), 0.0)
        dv += tl.dot(tl.trans(p).to(do.dtype), do).to(tl.float32)
        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        ds = tl.where(keep, dp * _df(s, KIND), 0.0)
        dk += tl.dot(tl.trans(ds).to(q.dtype), q).to(tl.float32)
        dhb += tl.sum(ds, 0)
    tl.store(DK + base + offs_n[:, None] * st + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=cols)
    tl.store(DV + base + offs_n[:, None] * st + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=cols)
    tl.atomic_add(DHB + h, tl.sum(dhb, 0))


def _launch(q, bias, kind: int, window):
    """The kernels' grid, the arguments after the tensors (strides, H, T) and their constants."""
    B, H, T, D = q.shape
    bm = _block()
    strides = (q.stride(0), q.stride(1), q.stride(2), *(bias.stride() if bias is not None else (0, 0, 0)))
    constants = dict(KIND=kind, WINDOW=int(window or 0), HAS_BIAS=bias is not None, BM=bm, BN=bm, D=D)
    return (triton.cdiv(T, bm), B * H), (*strides, H, T), constants


class ElementwiseAttention(torch.autograd.Function):
    """Autograd wrapper of the Triton kernels: (q, k, v, head_bias, score_bias) -> z."""

    @staticmethod
    def forward(ctx, q, k, v, head_bias, score_bias, scale: float, kind: int, window):
        q, k, v = (x.contiguous() for x in (q, k, v))
        hb = head_bias.float().contiguous()
        bias_t = score_bias if score_bias is not None else q.new_zeros(1, 1, 1)
        grid, args, constants = _launch(q, score_bias, kind, window)
        o = torch.empty_like(q)
        _rows[grid](q, k, v, q, o, hb, bias_t, *args, scale, **constants, GRAD=False)
        ctx.save_for_backward(q, k, v, hb, bias_t)
        ctx.launch = (grid, args, scale, constants)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, hb, bias_t = ctx.saved_tensors
        grid, args, scale, constants = ctx.launch
        do = do.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dhb = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
        _bwd_kv[grid](q, k, v, do, dk, dv, hb, dhb, bias_t, *args, scale, **constants)
        _rows[grid](q, k, v, do, dq, hb, bias_t, *args, scale, **constants, GRAD=True)
        return dq, dk, dv, dhb, None, None, None, None


def triton_elementwise(op, q, k, v, *, window=None, score_bias=None):
    """An unnormalised sigmoid or elu+1 attention operation through the Triton kernels (forward and backward).

    Parameters
    ----------
    op : AttentionOp
        ``Sigmoid`` or ``Elu1`` (its ``op_name``, ``scale`` and ``extra_bias``).
    q, k, v : torch.Tensor, shape (B, H, T, d)
        K and V already repeated per query group.
    window : int, optional
        A sliding window.
    score_bias : torch.Tensor, shape (H, T, T), optional
        An additive position bias (ALiBi; no gradient flows into it).

    Returns
    -------
    torch.Tensor, shape (B, H, T, d)
    """
    kind = KINDS[op.op_name]
    H, T = q.shape[1], q.shape[2]
    extra = op.extra_bias(T)
    if extra is None:
        hb = torch.zeros(H, device=q.device)
    elif torch.is_tensor(extra):
        hb = extra.reshape(H)
    else:
        hb = torch.full((H,), float(extra), device=q.device)
    bias = None if score_bias is None else score_bias.detach().float().contiguous()
    return ElementwiseAttention.apply(q, k, v, hb, bias, float(op.scale), kind, window)
