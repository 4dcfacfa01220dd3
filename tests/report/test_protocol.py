"""Every result class of the package keeps the one result protocol (``analysis.core.results.Result``).

The classes are found by walking the package's modules for subclasses of ``Result``, so a new one cannot be forgotten:
each must have a builder here that makes it on a tiny model (a Llama of ``tests/families.py`` with a writer neuron
planted by hand, so that the spike's origin has neurons, a quadratic form, a cause and cuts; Qwen3-Next's for the
output gates and the experts; a one-layer Llama for the streamed perplexity) or, for the training-time order of the
chain, from its committed tables. Each built result must give strict JSON (``to_dict()``), its finding as a non-empty
list of whole sentences (``findings()``), a non-empty ``text()``, named DataFrames (``tables``), and the header
(``model_name``, ``kind``, ``n_samples``).

The results of the registered pass analyses (``analysis.core.registry``) are read off one ``profile`` by the registry
(``from_profile``), so a newly registered analysis is checked with no edit here (``tests/core/test_registry.py``).
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re
import warnings

import pandas as pd
import pytest
import torch

import analysis
from analysis import load_model
from analysis.core import registry
from analysis.core.results import Result
from tests.core.test_facts import facts_results
from tests.chain.test_family_spike_origin import plant_writer
from tests.tiny import make_tiny_llama_dir

N, T = 4, 16


def _result_classes() -> dict[str, type]:
    """Every concrete subclass of ``Result`` defined in a module of the package, by name."""
    out = {}
    for info in pkgutil.walk_packages(analysis.__path__, "analysis."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, Result)
                and obj is not Result
                and obj.__module__ == info.name
                and not inspect.isabstract(obj)
            ):
                out[name] = obj
    return out


def from_profile(prof) -> dict[str, Result]:
    """Each registered pass analysis' result in ``prof`` by its class name (the main kind's, for those run on every
    kind): the builders the registry gives."""
    out = {}
    for a in registry.analyses():
        got = getattr(prof, a.name, None) if a.in_pass and not a.product else None
        if a.every_kind and got:
            got = got.get(prof.main)
        if isinstance(got, Result):
            out[type(got).__name__] = got
    return out


def _planted(family_dir, family: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(str(family_dir(family)), device="cpu")  # its own copy: plant_writer adds hooks
    plant_writer(model)
    return model


@pytest.fixture(scope="module")
def built(family_dir, tmp_path_factory) -> dict[str, Result]:
    """One instance of every result class (by class name), built on tiny models."""
    from analysis import dormant_heads, first_key_ablation, norm_gain_trace, profile, repeated_tokens, sink_positions
    from analysis import load_encoding_grid, sink_vs_context
    from analysis import spike_ablation, value_ablation
    from analysis.causal.attribution import attribution_check
    from analysis.dynamics.formation import load_formation
    from analysis.report.one_pass import ANALYSES, FOLLOW_UPS
    from analysis.quant.run import quant_study
    from analysis.streaming import streaming_perplexity

    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(3, 96, (N, T), generator=gen)
    llama = _planted(family_dir, "llama")
    prof = profile(
        llama,
        {"natural": toks, "random": torch.randint(3, 96, (N, T), generator=gen)},
        analyses=ANALYSES + FOLLOW_UPS,
        spike_thresholds=(100.0, 100.0),
    )
    o = prof.origin
    out: dict[str, Result] = {
        "Profile": prof,
        **from_profile(prof),
        "MlpNeurons": o.neurons[0],
        "QuadraticForm": o.quadratic[0],
    }
    out["SpikeAblation"] = spike_ablation(llama, toks, ratio_threshold=100.0)
    out["ValueAblation"] = value_ablation(llama, toks, sink_heads=[(1, 0)])
    out["FirstKeyAblation"] = first_key_ablation(llama, toks, ratio_threshold=100.0)
    out["NormGainTrace"] = norm_gain_trace(llama, toks, 1, ratio_threshold=100.0)
    dh = dormant_heads(llama, toks[:2], mean_ablation=False)
    out["DormantHeads"] = dh
    out["AttributionCheck"] = attribution_check(llama, toks[:2], [(1, 0)], result=dh)
    out["SinkPositions"] = sink_positions(llama, toks)
    out["RepeatedTokens"] = repeated_tokens(llama, torch.full((2, T), 5))
    out["EncodingGrid"] = load_encoding_grid()  # the committed positions grid
    out["SinkContext"] = sink_vs_context(
        llama, Ts=(8, 12), n=2, seeds=(0,), texts=[" ".join(f"w{i}" for i in range(200))]
    )
    qwen = _planted(family_dir, "qwen3_next")  # gated attention, and experts in every block
    out |= from_profile(profile(qwen, {"natural": toks}, analyses=("gates",)))  # GateResult
    out["ExpertWrites"] = analysis.spike_origin(qwen, toks[:3], ratio_threshold=100.0).experts[0]
    one = make_tiny_llama_dir(tmp_path_factory.mktemp("protocol-llama"), n_layers=1, n_ctx=64)
    out["StreamResult"] = streaming_perplexity(
        analysis.load_model(str(one)),  # streaming and quant take the loaded model
        torch.randint(3, 96, (48,), generator=gen),
        window=16,
        sinks=(0, 1),
        bits=(),
        newline_sinks=None,
        recompute_every=None,
    )
    out["FormationOrder"] = load_formation("induction/formation")  # committed: its runs take minutes to measure
    out.update(facts_results(llama, toks, one))  # ActivationMap ... PolicyRun (tests/core/test_facts.py)
    out["QuantResult"] = quant_study(
        analysis.load_model("synthetic-softmax"),
        a_bits=(4,),
        granularities=("tensor",),
        T=48,
        n_eval=2,
        calib_tokens=48,
        seeds=(0,),
        prefix_len=1,
        n_candidates=1,
        kv_bits=(),
        origin=False,
    )
    return out


def test_every_result_class_has_a_builder(built):
    classes = _result_classes()
    missing = sorted(set(classes) - set(built))
    assert not missing, f"result classes without a builder in tests/report/test_protocol.py: {missing}; add one."
    wrong = {k: type(v).__name__ for k, v in built.items() if type(v) is not classes.get(k)}
    assert not wrong, f"builders returning another class than their name: {wrong}"


SENTENCE = re.compile(r"^[A-Z0-9].*[.!?]$", re.S)


@pytest.mark.parametrize("name", sorted(_result_classes()))
def test_result_keeps_the_protocol(built, name):
    assert_protocol(name, built[name])


def assert_protocol(name: str, r: Result) -> None:
    """The protocol, checked on one built result."""
    json.dumps(r.to_dict(), allow_nan=False)  # strict JSON
    f = r.findings()
    assert isinstance(f, list) and f, f"{name}.findings() is empty"
    bad = [s for s in f if not isinstance(s, str) or not SENTENCE.match(s.strip())]
    assert not bad, f"{name}.findings() holds items that are not whole sentences: {bad}"
    assert isinstance(r.text(), str) and r.text().strip()
    tables = r.tables
    assert isinstance(tables, dict) and all(
        isinstance(k, str) and isinstance(v, pd.DataFrame) for k, v in tables.items()
    ), f"{name}.tables: {tables!r}"
    assert isinstance(int(r.n_samples), int) and hasattr(r, "model_name") and hasattr(r, "kind")


@pytest.mark.parametrize(
    "name, keys",
    [
        ("ExpertWrites", "dim block role write experts text"),  # json_header = False
        ("GateResult", "model kind n_samples T layers gate_first gate_other per_head skipped text"),  # "skipped?" set
        ("SinkKinds", "model kind n_samples T layers thresholds shares by_layer heads text"),  # "skipped?" empty
        (
            "NormGainTrace",  # renamed fields, and the tables ("*tables") between fields
            "model kind n_samples layer spike_dims has_spike message norm rotary rotary_base key_norm path T "
            "stages gain heads key_dims constancy rebuild text",
        ),
    ],
)
def test_declared_fields_give_the_keys_in_order(built, name, keys):
    """A result that declares its JSON (``Result.json_fields``) writes the keys report.json has always had, in order."""
    assert list(built[name].to_dict()) == keys.split()


def test_result_and_accumulator_are_abstract():
    from analysis.engine.passes import Accumulator

    class NoFindings(Result):
        kind = model_name = None
        n_samples = 0

    class NoResult(Accumulator):
        def hooks(self):
            return {}

    for cls in (NoFindings, NoResult):
        with pytest.raises(TypeError, match="abstract"):
            cls()
