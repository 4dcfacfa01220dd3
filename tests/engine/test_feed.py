"""A layer's accumulators fed on two CPU threads (``engine.passes._feed``): the same results, bit for bit, as on one,
both threads used, one thread under a torch mode, and an error in any update stopping the pass."""

import threading
import time
from contextlib import nullcontext

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.core.registry import PassInputs
from analysis.engine import passes
from analysis.engine.passes import Accumulator, run_pass
from analysis.model.hooks import act_name


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield lambda k: torch.set_num_threads(k)
    torch.set_num_threads(n)


def _report_accumulators(model, n=4, T=24):
    """The accumulators of the report's natural pass (every section), fresh, and its tokens."""
    from analysis.chain.massive import spike_criterion
    from analysis.core.defaults import RESID_BUDGET_MIB, SPIKE_CUT_SAMPLES
    from analysis.report.build import SECTIONS, _Context
    from analysis.report.one_pass import chosen_analyses

    ctx = _Context(model, n, T, 0, None, list(SECTIONS))
    probe = ctx.probes["natural"]
    inputs = PassInputs(
        model, probe.tokens, "natural", True, probe, eps=ctx.eps, k_max=None, spike=tuple(spike_criterion(model)),
        budget_mib=RESID_BUDGET_MIB, batch_size=None, follow_up_samples=SPIKE_CUT_SAMPLES,
    )  # fmt: skip
    analyses = [a for a in chosen_analyses(ctx.analyses) if a.accumulators is not None]
    return probe.tokens, lambda: [acc for a in analyses for acc in a.accumulators(inputs)]


def _same(a, b) -> bool:
    """Equal to the bit (NaN where NaN), through results' fields, dicts, sequences, tensors, arrays and frames."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    if isinstance(a, (pd.DataFrame, pd.Series)):
        return a.equals(b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if hasattr(a, "__dict__") and not isinstance(a, torch.nn.Module):
        return _same(vars(a), vars(b))
    return a is b or a == b


class _Where(Accumulator):
    """Records the thread that fed each layer; raises ``error`` on ``fail_layer``."""

    def __init__(self, layers, fail_layer=None, error=None):
        self.layers, self.fail_layer, self.error, self.seen = layers, fail_layer, error, set()

    def hooks(self):
        return {l: {"x": act_name("resid_pre", l)} for l in self.layers}

    def update(self, layer, acts, batch):
        time.sleep(0.005)  # long enough for the second thread to take its end of the list
        self.seen.add(threading.current_thread().name)
        if layer == self.fail_layer:
            raise self.error

    def result(self):
        return None


def test_two_threads_give_the_one_thread_results_bit_for_bit(smollm2, threads, monkeypatch):
    if next(smollm2.parameters()).device.type != "cpu":
        pytest.skip("the second thread feeds a CPU pass only")
    tokens, fresh = _report_accumulators(smollm2)
    threads(2)  # the forward the same in both passes: only the feeding differs
    with monkeypatch.context() as m:
        feed = passes._feed
        m.setattr(passes, "_feed", lambda todo, layer, batch, side: feed(todo, layer, batch, False))
        one = run_pass(smollm2, tokens, fresh(), backend="auto")
    front, end = _Where(range(3)), _Where(range(3))  # the first and the last of each layer's list
    two = run_pass(smollm2, tokens, [front, *fresh(), end], backend="auto")[1:-1]
    assert len(one) == len(two) >= 8
    assert all(_same(a, b) for a, b in zip(one, two)), [type(a).__name__ for a, b in zip(one, two) if not _same(a, b)]
    assert (front.seen, {n.split("_")[0] for n in end.seen}) == ({"MainThread"}, {"analysis-feed"})


@pytest.mark.parametrize("error", [RuntimeError("boom"), IndexError("an update's own IndexError")])
def test_an_update_that_fails_on_either_thread_stops_the_pass(tiny_llama, threads, error):
    if next(tiny_llama.parameters()).device.type != "cpu":
        pytest.skip("the second thread feeds a CPU pass only")
    threads(2)
    for fail_first in (True, False):  # the front of the layer's list (this thread) or its far end (the second)
        accs = [_Where([0, 1]) for _ in range(3)]
        accs[0 if fail_first else -1] = _Where([0, 1], fail_layer=1, error=error)
        with pytest.raises(type(error), match=str(error.args[0])):
            run_pass(tiny_llama, torch.randint(0, 90, (2, 8)), accs, backend="auto")


def test_a_torch_mode_keeps_the_feeding_on_its_thread(tiny_llama, threads):
    """Modes are per thread (the CPU device guard, ``with torch.device``): under one, no second thread feeds."""
    if next(tiny_llama.parameters()).device.type != "cpu":
        pytest.skip("the second thread feeds a CPU pass only")
    threads(2)
    tokens = torch.randint(0, 90, (2, 8))
    for mode, expected in ((nullcontext(), {"MainThread", "analysis-feed"}), (torch.device("cpu"), {"MainThread"})):
        accs = [_Where([0, 1]) for _ in range(3)]
        with mode:
            run_pass(tiny_llama, tokens, accs, backend="auto")
        assert {n.split("_")[0] for a in accs for n in a.seen} == expected
