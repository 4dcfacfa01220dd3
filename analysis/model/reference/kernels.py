"""Which attention kernel a reference model's operation takes: one explicit table, a pure function of the kernels the
operation has, the one asked for (``ModelConfig.attn_impl``), the device, the dtype, the head size and the position
bias. Each kernel's limits are known here, before any call: an operation that cannot take the kernel asked for takes
the eager path and says why, once, in the log, and the training run records it (``SinkLM.attention_kernel``). No
kernel error is caught and turned into a warning.

=========  ==========================================================  ===============================================
kernel     operations                                                  limits
=========  ==========================================================  ===============================================
sdpa       softmax and its slot / scaled variants                      none (any device and dtype)
flex       softmax, sigmoid, elu+1 (and their normalised forms)        CUDA: head size >= 16 (Inductor's lowering),
                                                                       float16 / bfloat16 / float32
triton     sigmoid, elu+1 (unnormalised: ``triton_attention``)         Triton installed; CUDA, or the CPU under
                                                                       ``TRITON_INTERPRET=1``; head size a power of
                                                                       two >= 16; no learned relative bias
eager      every operation                                             none
=========  ==========================================================  ===============================================

``attn_impl="auto"`` takes the operation's first kernel on CUDA and the eager path elsewhere (not a fallback: the
CPU trains eagerly by design).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

LOG = logging.getLogger(__name__)
KERNELS = ("sdpa", "flex", "triton", "eager")
FLEX_MIN_HEAD_DIM = 16  # Inductor's FlexAttention lowering: "embedding dimension ... must be at least 16"
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what FlexAttention and the Triton kernel compute in


@dataclass(frozen=True)
class KernelChoice:
    """The kernel an attention layer takes.

    Attributes
    ----------
    kernel : str
        One of ``KERNELS``.
    fallback : str
        Why the kernel asked for was not taken ("" when it was, or when ``auto`` chose the eager path on a CPU).
    """

    kernel: str
    fallback: str = ""

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, **({"fallback": self.fallback} if self.fallback else {})}


def _triton_runs_on(device_type: str) -> bool:
    """Whether the Triton kernels can run on this device: Triton importable, and CUDA (or the CPU under
    ``TRITON_INTERPRET=1``, the interpreter the tests use)."""
    try:
        import triton  # noqa: F401  # optional
    except ImportError:
        return False
    return device_type == "cuda" or (device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _limits(kernel: str, device_type: str, dtype: torch.dtype, head_dim: int, bias: str | None, triton_ok: bool) -> str:
    """Why ``kernel`` cannot take these inputs ("" when it can)."""
    name = str(dtype).replace("torch.", "")
    if kernel == "flex" and device_type == "cuda":
        if head_dim < FLEX_MIN_HEAD_DIM:
            return f"FlexAttention on CUDA takes head sizes >= {FLEX_MIN_HEAD_DIM}; this model's is {head_dim}"
        if dtype not in FUSED_DTYPES:
            return f"FlexAttention takes float16, bfloat16 or float32, not {name}"
    if kernel == "triton":
        if not triton_ok:
            return (
                f"the Triton kernel needs Triton and CUDA (or TRITON_INTERPRET=1 on the CPU); not available "
                f"on {device_type!r}"
            )
        if head_dim < 16 or head_dim & (head_dim - 1):
            return f"the Triton kernel takes power-of-two head sizes >= 16; this model's is {head_dim}"
        if dtype not in FUSED_DTYPES:
            return f"the Triton kernel takes float16, bfloat16 or float32, not {name}"
        if bias == "relative":
            return "the Triton kernel takes ALiBi but not a learned relative position bias"
    return ""


def attention_kernel(
    supported: tuple[str, ...],
    impl: str,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    *,
    bias: str | None = None,
    triton_ok: bool | None = None,
) -> KernelChoice:
    """The kernel table (see the module's docstring).

    Parameters
    ----------
    supported : tuple of str
        The operation's fused kernels, preferred first (``AttentionOp.kernels``).
    impl : str
        "auto", "eager", "sdpa", "flex" or "triton" (``ModelConfig.attn_impl``).
    device_type : str
    dtype : torch.dtype
        The dtype the attention computes in (bfloat16 under autocast).
    head_dim : int
    bias : {"alibi", "relative"} or None
        The additive position bias.
    triton_ok : bool, optional
        Whether Triton runs on the device (default ``_triton_runs_on(device_type)``).

    Returns
    -------
    KernelChoice
    """
    if impl not in ("auto",) + KERNELS:
        raise ValueError(f"attn_impl must be 'auto' or one of {list(KERNELS)}; got {impl!r}.")
    if impl == "eager" or (impl == "auto" and (device_type != "cuda" or not supported)):
        return KernelChoice("eager")
    want = supported[0] if impl == "auto" else impl
    if want not in supported:
        has = ", ".join(supported) or "none"
        return KernelChoice("eager", f"this operation has no {want} kernel (its fused kernels: {has})")
    ok = _triton_runs_on(device_type) if triton_ok is None else triton_ok
    why = _limits(want, device_type, dtype, head_dim, bias, ok)
    return KernelChoice("eager", f"{why}: the eager path") if why else KernelChoice(want)


_STATED: set[tuple[str, str]] = set()


def state(op_name: str, choice: KernelChoice) -> None:
    """Log a fallback once per process and operation, plainly.

    Parameters
    ----------
    op_name : str
    choice : KernelChoice

    Returns
    -------
    None
    """
    if choice.fallback and (op_name, choice.fallback) not in _STATED:
        _STATED.add((op_name, choice.fallback))
        LOG.warning("attention %r: %s.", op_name, choice.fallback)
