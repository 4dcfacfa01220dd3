"""The CPU guard for GPU device bugs (tests/device_guard.py): the analyses a CUDA run takes, run on the CPU with every
tensor tagged as on the model's device or on the host, find no operation that would mix them and no ``.numpy()`` of a
device tensor; the guard itself catches both kinds of bug when they are planted.

The numpy shortcuts of analysis/core/stats.py are taken only for CPU tensors; the guard turns them off
(``_NUMPY_FLOATS``), so the torch path that a GPU takes runs here.
"""

import warnings

import pytest
import torch

from tests.device_guard import DEVICE, DeviceGuard


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir):
    from analysis import load_model
    from analysis.model.probes import model_probe_sets

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(str(tiny_llama_dir), device="cpu")  # its own copy: the guard tags its weights
    return model, model_probe_sets(model, n=3, T=24, seed=0)


@pytest.fixture
def gpu_branches(monkeypatch):
    import analysis.core.stats as stats

    monkeypatch.setattr(stats, "_NUMPY_FLOATS", ())


def test_the_analyses_would_run_on_a_gpu(guarded, gpu_branches):
    """The one-pass profile with every analysis and follow-up, the sink metric (fused and eager), the massive table,
    every sink's positions (fused and eager) and a streaming run, on host tokens (the passes send them to the model)."""
    from analysis.chain.massive import massive_activations
    from analysis.positions.every_sink import sink_positions
    from analysis.report.one_pass import ANALYSES, FOLLOW_UPS, profile
    from analysis.sinks.metric import sink_metric
    from analysis.streaming.cache import Policy
    from analysis.streaming.perplexity import run_policies

    model, probes = guarded
    tokens = probes["natural"].tokens
    guard = DeviceGuard(model)
    with guard:
        profile(model, probes, analyses=ANALYSES + FOLLOW_UPS)
        sink_metric(model, tokens, path="fused")
        sink_metric(model, tokens, path="eager")
        massive_activations(model, tokens)
        sink_positions(model, tokens, path="fused")
        sink_positions(model, tokens, path="eager")
        run_policies(model, tokens[0], [Policy("sinks", 8, 2)], prefill=0)
    assert not guard.found, "would fail on a GPU:\n" + "\n".join(guard.found)


def test_the_guard_finds_planted_device_bugs(guarded):
    model, probes = guarded
    w = model.original_model.get_input_embeddings().weight
    guard = DeviceGuard(model)
    with guard, torch.no_grad():
        acc = torch.zeros(w.shape[1])  # built without a device: the host
        acc += w.sum(0)  # a device tensor added to it, without .cpu()
        w.sum(0).detach().numpy()  # numpy of a device tensor
        acc += w.sum(0).cpu()  # right
        acc.to(w.device).add_(w.sum(0))  # right: w.device is the model's device
        assert w.device == DEVICE and torch.zeros(1).device != DEVICE
    found = "\n".join(guard.found)
    assert "add_ mixes a host tensor" in found and "numpy() of a device tensor" in found and len(guard.found) == 2
