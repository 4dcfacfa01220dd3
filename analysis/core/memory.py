"""Wall time and peak memory of one call, shared by the benchmarks and ``analysis.streaming``.

Peak memory is the process's peak resident memory on CPU (VmHWM, reset before each measurement through
/proc/self/clear_refs), or torch.cuda.max_memory_allocated on CUDA.
"""

from __future__ import annotations

import ctypes
import gc
import time
from contextlib import contextmanager

import torch


M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting threshold, held there


def return_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Have glibc serve every allocation of ``threshold`` bytes or more from a mapping of its own, unmapped when freed,
    for the rest of the process (``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc from raising the threshold).

    glibc starts there but raises the threshold each time a large block is freed, after which a pass's per-layer
    activations come from its heap, where small blocks kept between them pin the freed pages. A trade, so opt-in:
    measured on SmolLM2's report (``benchmarks/bench_report.py --return-freed-memory``, idle 2-core machine), the
    peak went from 1.31x to 1.17x a forward's, but every fresh mapping is faulted in page by page and the report
    took 1.6x as long (system time 15 s -> 205 s). For a machine short of memory, not of time. Elsewhere than glibc
    (macOS, musl) nothing changes and it returns False.

    Parameters
    ----------
    threshold : int
        Bytes from which an allocation gets its own mapping.

    Returns
    -------
    bool
        Whether the allocator took it.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold <= 0:
        raise ValueError(f"threshold must be a positive number of bytes (an int); got {threshold!r}.")
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def share_arenas() -> bool:
    """Have glibc make no new malloc arena for the rest of the process (``mallopt(M_ARENA_MAX, 1)``): threads started
    later allocate from the arenas there. Called before the pass engine starts its second thread
    (``engine.passes._feed``), whose own arena kept the blocks it freed: 0.1x a forward's memory more at SmolLM2's
    report's peak (measured: 2,159 MiB against 2,008-2,020 MiB with this). Elsewhere than glibc it returns False.

    Returns
    -------
    bool
        Whether the allocator took it.
    """
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):
        return False


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak(device) -> float:
    """Reset the peak counter; return the current memory (MiB) it starts from.

    Parameters
    ----------
    device : str or torch.device

    Returns
    -------
    float
    """
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        pass
    return _status_kib("VmRSS") / 1024


def peak_mib(device) -> float:
    """Peak memory (MiB) since the last ``reset_peak``.

    Parameters
    ----------
    device
        As in :func:`reset_peak`.

    Returns
    -------
    float
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _status_kib("VmHWM") / 1024


def measure(fn, device: str) -> tuple[float, float, float]:
    """(seconds, peak MiB, peak above the starting memory MiB).

    Parameters
    ----------
    fn : callable
        Called once, without arguments.
    device : str

    Returns
    -------
    tuple of (float, float, float)
    """
    start = reset_peak(device)
    t = time.perf_counter()
    fn()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    sec = time.perf_counter() - t
    peak = peak_mib(device)
    return sec, peak, peak - start


@contextmanager
def frozen_heap():
    """The objects alive on entry (the model, the imported modules: about half a million on SmolLM2) left out of
    Python's cyclic garbage collector for the duration (``gc.freeze``), so that a full collection, which scans every
    tracked object, does not walk them again and again during a long job (about 0.4 s each on the 2-core machine).
    They are handed back on exit (``gc.unfreeze``); where the process froze its heap itself, it is left as it is.

    Returns
    -------
    contextlib.AbstractContextManager
    """
    own = gc.get_freeze_count() == 0
    if own:
        gc.freeze()
    try:
        yield
    finally:
        if own:
            gc.unfreeze()
