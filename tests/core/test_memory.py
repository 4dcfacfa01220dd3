"""``return_freed_memory``: with glibc's mmap threshold held, the pages of freed activations leave the process even
where small blocks kept between them would pin them in the heap (the report command's peak memory)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

FRAGMENT = textwrap.dedent(
    """
    import ctypes, sys, torch
    from analysis.core.memory import return_freed_memory, _status_kib
    if sys.argv[1] == "held":
        assert return_freed_memory()
    else:  # where glibc has raised its threshold, as it does after freeing large blocks (here to its ceiling)
        ctypes.CDLL("libc.so.6").mallopt(-3, 32 << 20)
    before = _status_kib("VmRSS")
    big, keep = [], []
    for i in range(100):  # 100 MiB of activations, a small block kept after each (a pass's per-layer results)
        big.append(torch.ones(1 << 18))
        keep.append(torch.ones(2048 + 16 * i))
    del big
    print((_status_kib("VmRSS") - before) // 1024)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc")
def test_freed_activations_leave_the_process_once_the_threshold_is_held():
    kept = {
        mode: int(
            subprocess.run([sys.executable, "-c", FRAGMENT, mode], capture_output=True, text=True, check=True).stdout
        )
        for mode in ("raised", "held")
    }
    assert kept["raised"] > 50 and kept["held"] < 10, kept  # MiB still resident after the 100 MiB were freed


@pytest.mark.parametrize("bad", [0, -1, "128k", 1.5, True])
def test_a_threshold_that_is_not_a_positive_byte_count_is_refused_before_the_allocator_changes(bad):
    from analysis.core.memory import return_freed_memory

    with pytest.raises(ValueError, match="positive number of bytes"):
        return_freed_memory(bad)
