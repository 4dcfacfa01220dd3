"""Every figure function of the analyses is drawn once, on the planted model's results."""

import importlib
import inspect

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from analysis import profile  # noqa: E402
from tests.planted import planted, planted_tokens  # noqa: F401, E402

MODULES = ("sink", "massive", "norm_gain", "key_manifold", "value_norms", "interventions", "sink_kind")


@pytest.fixture(scope="module")
def results(planted):
    import warnings

    from analysis.causal.interventions import first_key_ablation, spike_ablation, value_ablation
    from analysis.chain.activation_map import activation_map
    from analysis.chain.norm_gain import norm_gain_trace

    toks = planted_tokens(6, 20, seed=3)
    prof = profile(planted, {"natural": toks, "random": planted_tokens(4, 20, seed=4)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traces = {l: norm_gain_trace(planted, toks, layer=l) for l in (1, 3)}
    kw = {"baseline": prof.baseline}
    return {
        "prof": prof,
        "amap": activation_map(planted, toks, layer=0),
        "trace": traces[1],
        "traces": traces,
        "spike": spike_ablation(planted, toks, **kw),
        "value": value_ablation(planted, toks, all_heads=False, **kw),
        "first_key": first_key_ablation(planted, toks, **kw),
    }


def _calls(r):
    p = r["prof"]
    nat = p.sink["natural"]
    return {
        "sink.plot_sink_rates": lambda f: f(p.sink),
        "sink.plot_head_alpha": lambda f: f(nat),
        "sink.plot_sink_by_layer": lambda f: f(p.sink),
        "sink.plot_qk_angles": lambda f: f(p.qk),
        "massive.plot_top_activations": lambda f: f(p.massive["natural"]),
        "massive.plot_activation_map": lambda f: f(r["amap"]),
        "massive.plot_spike_dims_by_kind": lambda f: f(p.massive),
        "norm_gain.plot_stage_shares": lambda f: f(r["trace"]),
        "norm_gain.plot_gain_profile": lambda f: f(r["trace"]),
        "norm_gain.plot_head_attribution": lambda f: f(r["trace"]),
        "norm_gain.plot_constancy": lambda f: f({f"layer {l}": t for l, t in r["traces"].items()}),
        "key_manifold.plot_key_pca": lambda f: f(p.key_manifold),
        "key_manifold.plot_manifold_summary": lambda f: f(p.key_manifold),
        "value_norms.plot_value_norms": lambda f: f(p.value_norms),
        "value_norms.plot_value_alpha": lambda f: f(p.value_norms),
        "value_norms.plot_value_profile": lambda f: f(p.value_norms),
        "sink_kind.plot_sink_kinds": lambda f: f(p.sink_kind),
        "sink_kind.plot_kind_traces": lambda f: f(p.sink_kind),
        "interventions.plot_spike_ablation": lambda f: f(r["spike"]),
        "interventions.plot_value_ablation": lambda f: f(r["value"]),
        "interventions.plot_first_key_ablation": lambda f: f(r["first_key"]),
    }


def _figure_functions():
    out = {}
    for m in MODULES:
        mod = importlib.import_module(f"analysis.figures.{m}")
        out |= {
            f"{m}.{name}": fn
            for name, fn in inspect.getmembers(mod, inspect.isfunction)
            if name.startswith("plot_") and fn.__module__ == mod.__name__
        }
    return out


def test_every_figure_function_draws(results):
    functions = _figure_functions()
    calls = _calls(results)
    assert set(functions) == set(calls), "a figure function without a call here (or a call without a function)"
    for name, fn in functions.items():
        fig = calls[name](fn)
        fig = fig if fig is not None else plt.gcf()
        assert fig.axes and all(ax.has_data() or ax.images or ax.collections for ax in fig.axes[:1]), name
        fig.canvas.draw()  # render: a figure that fails only when drawn fails here
        plt.close("all")
