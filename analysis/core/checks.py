"""Checks the API and the command line share, light enough to run before anything heavy is imported: the sequence
length (``--T``) and the device (``--device``; torch is imported only to ask for a GPU)."""

from __future__ import annotations

import numbers

AUTO_DEVICES = (None, "auto")  # --device auto (the default everywhere): cuda when available, else cpu


def check_length(T: int, *, minimum: int = 2, why: str = "") -> int:
    """The one check of the sequence length T that the API and the command line share (``--T``).

    Parameters
    ----------
    T : int
        Tokens per sequence.
    minimum : int
        The shortest length allowed (2 for every sink analysis: alpha_1 is 1 with one token).
    why : str
        Why a longer minimum applies (one sentence), appended to the message.

    Returns
    -------
    int
        T; ValueError, the same message from the API and the CLI, otherwise.
    """
    if isinstance(T, bool) or not isinstance(T, numbers.Integral) or int(T) < minimum:
        reason = why or (
            "alpha_1 is the attention the queries give the first token: with one token the only query can "
            "attend to nothing else, so alpha_1 = 1 and Sink_1 is 100% for any model and input. The "
            "paper's probe uses T = 64."
        )
        raise ValueError(f"T (--T, tokens per sequence) must be at least {minimum}; got {T}. {reason}")
    return int(T)


def default_device() -> str:
    """ "cuda" when a GPU is available, else "cpu".

    Returns
    -------
    str
    """
    import torch  # import time: the command line checks its options before torch loads

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | None) -> str:
    """The device a model loads on, checked before anything loads: None or "auto" gives :func:`default_device`.

    Parameters
    ----------
    device : str or None
        "auto", "cpu", "cuda", "cuda:1", "mps", ... (``--device``).

    Returns
    -------
    str
        The device; ValueError, naming ``--device`` and what to give, where it does not exist here (``cuda`` without
        CUDA is an error, never a quiet fall back to the CPU).
    """
    if device in AUTO_DEVICES:
        return default_device()
    import torch  # import time: the command line checks its options before torch loads

    try:
        dev = torch.device(str(device))
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"--device {device!r} is not a device torch knows ({e}); use auto, cpu, cuda, cuda:1 or mps."
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {device}: CUDA is not available here (torch {torch.__version__}, "
                f"{'built without CUDA' if torch.version.cuda is None else 'no GPU visible'}); use "
                "--device cpu, or --device auto (the default) to take cuda only where it exists."
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}."
            )
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"--device {device}: MPS is not available here; use --device cpu.")
    return str(device)


def check_device(device: str | None) -> None:
    """``--device``, checked before any work; "auto" and "cpu" pass without importing torch.

    Parameters
    ----------
    device : str or None

    Returns
    -------
    None
        ValueError (:func:`resolve_device`) where the device does not exist here.
    """
    if device not in AUTO_DEVICES and device != "cpu":
        resolve_device(device)
