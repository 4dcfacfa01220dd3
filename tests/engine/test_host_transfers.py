"""A profile pass hands the host only what its results keep: the elements that leave the device (``Tensor.cpu``,
``.numpy``, ``.tolist``, ``.item``, ``.to("cpu")`` and Python's bool/int/float of a tensor), counted by a
``TorchFunctionMode`` on two tiny models of different layers, heads and width, at two (N, T). On the CPU the
numpy selections (``analysis.core.stats.host_selection``) are switched off, as they are on a GPU."""

import dataclasses
import warnings

import pandas as pd
import pytest
import torch
from torch.overrides import TorchFunctionMode

from analysis import load_model, profile
from analysis.core import stats
from tests.tiny import make_tiny_llama_dir

HOST = {"cpu", "numpy", "tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__array__"}
ANALYSES = ("sink", "massive", "qk", "value_norms")
K_MAX, TOP_K = 16, 3


class HostCount(TorchFunctionMode):
    """Counts the elements of every tensor handed to the host."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_cpu = name == "to" and "cpu" in [a for a in (*args[1:], *kwargs.values()) if isinstance(a, str)]
        if (name in HOST or to_cpu) and args and isinstance(args[0], torch.Tensor):
            self.n += args[0].numel()
        return func(*args, **kwargs)


def _kept(result) -> int:
    """The elements a result keeps in its tensors and tables."""
    n = 0
    for f in dataclasses.fields(result):
        v = getattr(result, f.name)
        n += v.numel() if isinstance(v, torch.Tensor) else v.size if isinstance(v, pd.DataFrame) else 0
    return n


@pytest.fixture(scope="module")
def two_models(tiny_llama, tmp_path_factory, device):
    """The session's tiny LLaMA (2 layers, 4 heads, d_model 64) and a wider, deeper one (3, 8, 128)."""
    wide = dict(n_layers=3, d_model=128, n_heads=8, n_kv_heads=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = load_model(str(make_tiny_llama_dir(tmp_path_factory.mktemp("host-wide"), **wide)), device=device)
    return [(tiny_llama, dict(n_layers=2, d_model=64, n_heads=4)), (other, wide)]


def test_profile_hands_the_host_what_its_results_keep(two_models, monkeypatch):
    monkeypatch.setattr(stats, "host_selection", lambda x: False)  # as on a GPU: no numpy selection
    g = torch.Generator().manual_seed(0)
    for model, s in two_models:
        L, H, D = s["n_layers"], s["n_heads"], s["d_model"]
        counts = {}
        for N, T in ((4, 32), (8, 64)):
            tokens = torch.randint(3, 90, (N, T), generator=g)
            with HostCount() as c:
                prof = profile(
                    model,
                    {"natural": tokens},
                    analyses=ANALYSES,
                    k_max=K_MAX,
                    batch_size=4,
                    spike_thresholds=(1e30, 1e30),
                )  # no flags: their rows are kept by design
            kept = sum(_kept(r) for r in prof.results.values())
            counts[N, T] = c.n
            # what the results keep, and a few scalars per layer and head: nothing per token or per activation
            assert c.n <= kept + 16 * L * H + 64, (s, N, T, c.n, kept)
            # the per-sample part grows with layers x heads x k; the rest is per layer (x D, x T for value norms)
            assert c.n <= N * L * (H * K_MAX + 4 * TOP_K + 2) + L * (5 * D + 2 * H * T + 2 * H * 50) + 64
            assert c.n < N * T * D / 2
        # twice the sequences and twice the length: at most twice the elements (per sample), never four times
        assert counts[8, 64] < 2 * counts[4, 32]


def test_massive_activations_off_the_host_equal_the_host_path(tiny_llama_dir, monkeypatch, device):
    """The device selections (radix select; in bfloat16 one pass on 16-bit keys) give the numpy path's medians,
    top-k and flags, bit for bit."""
    from analysis.chain.massive import massive_activations

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(str(tiny_llama_dir), dtype=torch.bfloat16, device=device)
    tokens = torch.randint(3, 90, (4, 32), generator=torch.Generator().manual_seed(3))
    host = massive_activations(model, tokens, batch_size=2, abs_threshold=0.0, ratio_threshold=3.0)
    monkeypatch.setattr(stats, "host_selection", lambda x: False)
    dev = massive_activations(model, tokens, batch_size=2, abs_threshold=0.0, ratio_threshold=3.0)
    for name in ("median", "top_values", "top_pos", "top_dim", "top_token", "flag_samples", "flag_first"):
        assert torch.equal(getattr(host, name), getattr(dev, name)), name
    assert len(host.flagged) > 0
    pd.testing.assert_frame_equal(host.flagged, dev.flagged)
