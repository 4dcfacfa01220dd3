"""Exact selections on the tensor's device (``analysis.core.reductions``): the radix select and the lower median
against ``torch.median`` / ``torch.kthvalue``, the top-k of |x| against ``torch.topk``, ties, NaN, +-inf and -0.0
included, in every float dtype; ``core.stats.lower_median`` takes them off the host."""

import pytest
import torch

from analysis.core import reductions, stats
from analysis.core.reductions import keys_to_floats, kth_smallest, lower_median, ordered_keys, radix_select, top_k_abs

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SPECIAL = torch.tensor([float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-40, 65504.0, -3.0, 3.0])


def _rows(dtype, n, seed, *, nan=False):
    """Five rows of n values with many ties (rounded), the specials, and a NaN in row 0 when asked."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, n, generator=g) * 3).round()
    x[1, : min(n, len(SPECIAL))] = SPECIAL[: min(n, len(SPECIAL))]
    x[2] = -0.0
    if nan:
        x[0, n // 2] = float("nan")
    return x.to(dtype)


def _same(got, want):
    assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("dtype", DTYPES)
def test_ordered_keys_order_as_the_floats_and_invert(dtype):
    x = torch.cat([SPECIAL, torch.randn(200)]).to(dtype)
    keys = ordered_keys(x)
    s = x.sort().values  # the test's reference order (a sort is fine here)
    ks = ordered_keys(s)
    assert ((ks[1:] >= ks[:-1]) | (s[1:] == s[:-1])).all()  # ascending but for -0.0 == 0.0, which sort may swap
    assert ordered_keys(torch.tensor([-0.0], dtype=dtype)) < ordered_keys(torch.tensor([0.0], dtype=dtype))
    assert torch.equal(keys_to_floats(keys, dtype).view(torch.uint8), x.view(torch.uint8))  # bit for bit, -0.0 too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["radix", "kthvalue"])
def test_lower_median_equals_torch_median(dtype, method):
    for seed, n in enumerate((1, 2, 9, 64, 257)):
        x = _rows(dtype, n, seed, nan=seed % 2 == 1)
        _same(lower_median(x, method=method), x.median(-1).values)
    _same(lower_median(x.T, dim=0, method=method), x.median(-1).values)  # another axis


@pytest.mark.parametrize("bits", [8, 16])
def test_radix_select_every_rank(bits):
    x = _rows(torch.float32, 40, 3)[1:]  # the specials and -0.0 rows among them
    every = x.repeat_interleave(40, 0)  # each row once per rank: every rank in one call
    ranks = torch.arange(40).repeat(x.shape[0])
    want = torch.stack([x.kthvalue(k + 1, -1).values for k in range(40)], 1).flatten()
    assert torch.equal(radix_select(every, ranks, bits=bits), want)
    assert torch.equal(kth_smallest(x, 7, method="radix"), x.kthvalue(8, -1).values)
    with pytest.raises(ValueError, match="k must lie"):
        kth_smallest(x, 40)
    with pytest.raises(ValueError, match="bits must divide"):
        radix_select(x, 0, bits=12)


def test_auto_keeps_the_histogram_off_the_cpu(monkeypatch):
    """auto on the CPU: kthvalue (a quickselect); the radix select when asked (the device's choice for few long
    slices)."""
    calls = []
    monkeypatch.setattr(
        reductions, "radix_select", lambda x, k, bits=16: calls.append(x.shape) or x.kthvalue(k + 1, -1).values
    )
    x = _rows(torch.float32, 50, 1)
    lower_median(x)  # CPU: kthvalue (a quickselect), never the histogram
    assert calls == []
    _same(lower_median(x, method="radix"), x.median(-1).values)
    assert calls == [(5, 50)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_top_k_abs_equals_topk_with_ties_and_nan(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 12, 10, generator=g).abs()
    a[1, 3, 4] = a[1, 7, 2] = a[1].max() + 1  # a tie at the top
    a[2] = 1.0  # every value tied
    a[3, 5, 5] = float("inf")
    a[4, 0, 0] = float("nan")
    a = a.to(dtype)
    v, i = top_k_abs(a, 3)
    want_v, _ = a.reshape(6, -1).topk(3, dim=-1)
    _same(v, want_v)
    picked = a.reshape(6, -1).gather(1, i)
    _same(picked, v)  # the indices point at the values (any of equal ones)
    assert all(len(set(r)) == 3 for r in i.tolist())


def test_stats_lower_median_off_the_host_selects_on_the_device(monkeypatch):
    """As on a GPU (no numpy path): the device selection, same numbers, and no torch.median (a sort on CUDA's
    one block per slice)."""
    x = _rows(torch.float32, 301, 5, nan=True).abs()
    want = stats.lower_median(x.clone(), nonnegative=True)
    monkeypatch.setattr(stats, "host_selection", lambda t: False)
    monkeypatch.setattr(torch.Tensor, "median", lambda *a, **k: pytest.fail("torch.median was called"))
    _same(stats.lower_median(x, nonnegative=True), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nonnegative", [False, True])
def test_stats_lower_median_on_long_slices_takes_the_bracket_and_equals_torch_median(dtype, nonnegative, monkeypatch):
    """Slices of at least ``_BRACKET_MIN`` values (a hidden state's positions x dims): the bracketed selection, the
    same numbers as torch.median: ties, specials, a NaN row, an all-equal row, sorted and reversed rows, outliers."""
    calls = []
    bracket = stats._bracketed_kth
    monkeypatch.setattr(stats, "_bracketed_kth", lambda *a: calls.append(1) or bracket(*a))
    n = stats._BRACKET_MIN + 37
    x = _rows(dtype, n, 11, nan=True)
    g = torch.Generator().manual_seed(3)
    x = torch.cat(
        [
            x,
            torch.randn(3, n, generator=g, dtype=dtype).exp(),
            torch.arange(n, dtype=dtype)[None],
            torch.arange(n, dtype=dtype).flip(0)[None],
            torch.full((1, n), 2.5, dtype=dtype),
        ]
    )
    x[5, :40] = 1e4  # a few massive values
    if nonnegative:
        x = x.abs()
    _same(stats.lower_median(x, nonnegative=nonnegative), x.median(-1).values)
    _same(stats.lower_median(x.T.contiguous(), dim=0, nonnegative=nonnegative), x.median(-1).values)  # another axis
    assert len(calls) == 2


def test_stats_bracketed_selection_is_exact_where_the_bracket_misses(monkeypatch):
    """A bracket far too narrow (no standard error either side, a sample of 64) misses the median in most rows: those
    rows are selected whole, and every row's value is still exactly the median."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, stats._BRACKET_MIN, generator=g).abs()
    monkeypatch.setattr(stats, "_BRACKET_Z", 0.0)
    monkeypatch.setattr(stats, "_BRACKET_SAMPLE", 64)
    whole = []
    partition = stats.np.partition
    monkeypatch.setattr(
        stats.np, "partition", lambda a, k, *r, **kw: whole.append(a.size == x.shape[1]) or partition(a, k, *r, **kw)
    )
    _same(stats.lower_median(x, nonnegative=True), x.median(-1).values)
    assert sum(whole) > 5  # the misses took the whole-row path
