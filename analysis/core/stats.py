"""Small statistics shared by the analyses (each written once)."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from analysis.core import reductions

_NUMPY_FLOATS = (torch.float32, torch.float64)


def pair_cosine(unit_sum: torch.Tensor, n: int) -> torch.Tensor:
    """Mean cosine over the n (n - 1) ordered pairs of n unit vectors, from their sum s (..., d):
    (|s|^2 - n) / (n (n - 1)); NaN for n < 2. Lets a streamed pass keep only the running sum.

    Parameters
    ----------
    unit_sum : torch.Tensor, shape (..., d)
        The sum of n unit vectors.
    n : int

    Returns
    -------
    torch.Tensor, shape (...)
    """
    if n < 2:
        return torch.full(unit_sum.shape[:-1], float("nan"))
    return (((unit_sum * unit_sum).sum(-1) - n) / (n * (n - 1))).float()


def mean_pairwise_cosine(x: torch.Tensor, *, groups: torch.Tensor | None = None) -> float:
    """Mean cosine over pairs of different rows of ``x`` (n, d); with ``groups`` (n,), only over pairs from
    different groups (e.g. tokens of different sequences).

    Parameters
    ----------
    x : torch.Tensor, shape (n, d)
    groups : torch.Tensor, shape (n,), optional

    Returns
    -------
    float
        NaN for fewer than 2 rows (or no pair from different groups).
    """
    if x.shape[0] < 2:
        return float("nan")
    u = torch.nn.functional.normalize(x.double(), dim=-1)
    if groups is None:
        return float(pair_cosine(u.sum(0), x.shape[0]))
    mask = groups[:, None] != groups[None, :]
    return float((u @ u.T)[mask].mean()) if mask.any() else float("nan")


def host_selection(x: torch.Tensor) -> bool:
    """Whether ``x`` takes numpy's selection on the host (a float32/float64 CPU tensor, where numpy's partition
    is the fastest exact selection, a view, no copy); elsewhere the work stays on the tensor's device.

    Parameters
    ----------
    x : torch.Tensor

    Returns
    -------
    bool
    """
    return x.device.type == "cpu" and x.dtype in _NUMPY_FLOATS


def lower_median(x: torch.Tensor, *, dim: int = -1, overwrite: bool = False, nonnegative: bool = False) -> torch.Tensor:
    """``x.median(dim).values`` (the lower of the two middle values for an even count; NaN where a slice holds a
    NaN), found by selection on the CPU instead of torch's full sort: numpy's partition, or on long slices a bracket
    (:func:`_bracketed_kth`, about 2x faster again). ``overwrite``: x may be used as scratch (its order along ``dim``
    may be lost), saving a copy. ``nonnegative``: x holds no negative numbers (e.g. absolute values), whose bit
    patterns order as integers do: selecting on the integers is faster. Other devices and dtypes select on the
    tensor's own device (``analysis.core.reductions.lower_median``: a radix select over the bit patterns, never a
    sort), so nothing goes to the host.

    Parameters
    ----------
    x : torch.Tensor
    dim : int
        The axis reduced.
    overwrite : bool
    nonnegative : bool

    Returns
    -------
    torch.Tensor
        ``x``'s shape without ``dim``.
    """
    if not host_selection(x) or x.numel() == 0:
        return reductions.lower_median(x, dim=dim)
    a = np.moveaxis(x.detach().numpy(), dim, -1)
    n = a.shape[-1]
    k = (n - 1) // 2
    keys = a.view(np.int32 if a.dtype == np.float32 else np.int64) if nonnegative else a
    if n >= _BRACKET_MIN:
        rows = a.reshape(-1, n)  # a copy only where the reduced axis was not the last one
        med = _bracketed_kth(keys.reshape(-1, n), k).view(a.dtype)
        nan = np.isnan(rows).any(-1)
        if nan.any():
            med = np.where(nan, np.nan, med).astype(a.dtype)
        return torch.from_numpy(med.reshape(a.shape[:-1]))
    if overwrite and a.flags.writeable:
        keys.partition(k, axis=-1)
        part = a
    else:
        part = np.partition(keys, k, axis=-1).view(a.dtype)
    med = np.array(part[..., k])  # a contiguous copy, 0-d for a 1-d x
    nan = np.isnan(part[..., k:]).any(-1)  # NaNs sort last (as floats, and as the integers of positive NaNs)
    if nan.any():
        med = np.where(nan, np.nan, med).astype(a.dtype)
    return torch.from_numpy(med)


_BRACKET_MIN = 8192  # slices at least this long take the bracketed selection (shorter: numpy's partition)
_BRACKET_SAMPLE = 2048  # values per slice sampled for the bracket
_BRACKET_Z = 4.5  # its half-width in standard errors of a sampled order statistic


_SAMPLES: dict = {}  # (n, m) -> _sample_index's positions (a plain dict: a remote trace ships this code by value)


def _sample_index(n: int, m: int) -> np.ndarray:
    """m distinct positions out of n, the same on every call (a fixed seed): spread over a slice's whole layout."""
    got = _SAMPLES.get((n, m))
    if got is None:
        if len(_SAMPLES) >= 8:
            _SAMPLES.clear()
        got = _SAMPLES[(n, m)] = np.sort(np.random.default_rng(0).choice(n, size=m, replace=False))
    return got


def _bracketed_kth(keys: np.ndarray, k: int) -> np.ndarray:
    """The k-th smallest (0-based) of each row of ``keys`` (R, n), exactly ``np.partition(keys, k, -1)[:, k]``.

    A sample of each row brackets it: [lo, hi] are the sample's order statistics ``_BRACKET_Z`` standard errors
    either side of k / n. One comparison pass counts the values below lo and inside the bracket; only those inside
    (about a tenth) are copied out and selected. A row whose bracket missed the k-th value (a chance of about 1e-5,
    or a NaN drawn into the sample) is selected whole. The passes are vectorised where numpy's introselect steps
    through every value several times. NaNs are the caller's to flag (``lower_median`` does).
    """
    R, n = keys.shape
    m = min(_BRACKET_SAMPLE, n)
    sample = keys[:, _sample_index(n, m)]
    q = (k + 0.5) / n
    half = _BRACKET_Z * (q * (1.0 - q) / m) ** 0.5 + 1.0 / m
    r_lo, r_hi = max(0, int((q - half) * m)), min(m - 1, int((q + half) * m) + 1)
    sample.partition((r_lo, r_hi), axis=1)
    lo, hi = sample[:, r_lo : r_lo + 1], sample[:, r_hi : r_hi + 1]
    below_lo = keys < lo
    below = np.count_nonzero(below_lo, axis=1)
    inside = keys <= hi
    inside &= ~below_lo
    count = np.count_nonzero(inside, axis=1)
    values = np.compress(inside.ravel(), keys.ravel())  # row after row
    ends = np.cumsum(count)
    out = np.empty(R, keys.dtype)
    for r in range(R):
        j = k - int(below[r])
        if 0 <= j < count[r]:
            seg = values[ends[r] - count[r] : ends[r]]
            out[r] = np.partition(seg, j)[j]
        else:  # the bracket missed: the whole row
            out[r] = np.partition(keys[r], k)[k]
    return out


def unit_vectors(x: torch.Tensor, *, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(``torch.nn.functional.normalize(x, dim=dim)``, ``x.norm(dim=dim)``): the unit vectors, bit for bit as
    ``normalize`` makes them, and the norms they were divided by, from one norm computation.

    Parameters
    ----------
    x : torch.Tensor, shape (..., d)
    dim : int
        The axis normalised.

    Returns
    -------
    units : torch.Tensor, shape (..., d)
    norms : torch.Tensor, shape (...)
    """
    norm = x.norm(dim=dim, keepdim=True)
    return x / norm.clamp_min(1e-12).expand_as(x), norm.squeeze(dim)


def permuted_copy(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``x.permute(dims).contiguous()`` in a fresh tensor: the same numbers and layout, copied by numpy on the CPU,
    whose strided copy is about twice as fast as torch's where the permutation moves the last dimension.

    Parameters
    ----------
    x : torch.Tensor
    dims : tuple of int
        The permutation.

    Returns
    -------
    torch.Tensor
    """
    if not host_selection(x):
        return x.permute(dims).contiguous()
    out = torch.empty([x.shape[d] for d in dims], dtype=x.dtype)
    np.copyto(out.numpy(), x.detach().numpy().transpose(dims))
    return out


def flat_above(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices into ``x.flatten()`` of the elements above ``threshold``, ascending (as ``(x.flatten() >
    threshold).nonzero()``); through numpy on the CPU, where torch's threaded nonzero is slow on a busy machine.

    Parameters
    ----------
    x : torch.Tensor
    threshold : float

    Returns
    -------
    torch.LongTensor, shape (n,)
    """
    if not host_selection(x):
        return (x.flatten() > threshold).nonzero().squeeze(1)
    return torch.from_numpy(np.flatnonzero(x.detach().numpy() > threshold))


@contextmanager
def one_thread():
    """Torch's CPU ops on one thread for the duration (the thread count restored after); also a decorator,
    ``@one_thread()``. The streamed reductions work on a few MB per call, where a second thread gains little and,
    on a busy machine, every threaded op waits for a descheduled worker: an accumulator's update then costs
    several times more (measured 5-7x on a shared 2-core machine). Results do not depend on the thread count.

    Returns
    -------
    contextlib.AbstractContextManager
    """
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)
