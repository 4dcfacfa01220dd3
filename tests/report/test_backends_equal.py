"""Equal numbers on every backend: the profile (every registered pass analysis) of each family of the matrix through
``auto`` against the bridge's hook points, number by number; where ``auto`` takes the bridge it says why; the
whole report of SmolLM2 through ``auto`` against the bridge's report.json. (The tiny families' reports read their
word tokenizer's natural probe, on which every position's value has the same norm: ratios of equal numbers are
float noise there, so their reports are compared through the profile on random tokens instead.)"""

from __future__ import annotations

import importlib.util
import json
import math
import warnings

import pytest
import torch

from analysis.report.build import build_report
from analysis.report.one_pass import ANALYSES, profile
from tests.families import FAMILIES

RTOL = 1e-5
# Absolute floor: SmolLM2 carries a 23,000 activation on the first token, where float32 resolves 2e-3; quantities
# downstream of it (alpha on a repeated token at layer 11, a writer neuron's activation on other tokens) move by up
# to 4e-6 between two exact orders of summation.
ATOL = 1e-5
# Where a number may differ without any error: the argmax position among values equal to float noise (a token
# repeated: every position carries the same activation), and figures rounded to 4 decimals for the page.
LOOSE = ("_pos", "coords", "top_token")
# Correlations and their p-values over a few heads of a tiny random model amplify float32 noise in their inputs by
# 1 / their spread: they lie in [-1, 1] and are compared to 1e-3 absolute (their inputs are compared as every number).
# The tiny GraniteMoE's attention multiplier (1/128, the released one) makes its attention near uniform: alpha_1
# spans 3e-5 over its heads, and 1.5e-8 of rounding moves r by 3e-4.
CORRELATIONS = ("pearson", "spearman", "rho", "_p")


def flat(x, pre: str = ""):
    """(path, number) for every number of a JSON-able tree."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from flat(v, f"{pre}/{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from flat(v, f"{pre}[{i}]")
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield pre, float(x)


def differences(a: dict, b: dict, *, skip=("seconds", "backend", "versions", "text", "passes")) -> list:
    """The numbers of ``a`` that ``b`` lacks or holds more than RTOL (relative, 1e-6 absolute floor) away."""
    fa = {k: v for k, v in flat(a) if not any(f"/{s}" in k for s in skip)}
    fb = dict(flat(b))
    out = []
    for k, v in fa.items():
        w = fb.get(k)
        if w is None or (math.isnan(v) != math.isnan(w)):
            out.append((k, v, w))
        elif math.isnan(v) or any(s in k for s in LOOSE):
            continue
        elif abs(v - w) > (
            1e-3 if any(s in k.rpartition("/")[2] for s in CORRELATIONS) else RTOL * max(abs(v), abs(w)) + ATOL
        ):
            out.append((k, v, w))
    return out


def _probes(seed: int = 0, n: int = 3, T: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"natural": torch.randint(3, 96, (n, T), generator=g), "random": torch.randint(3, 96, (n, T), generator=g)}


@pytest.fixture(scope="module")
def bridge_profile(family_bridge):
    """The bridge's profile of a family (each computed once, for every backend compared with it)."""
    cache: dict = {}

    def get(family):
        if family not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[family] = profile(family_bridge(family), _probes(), analyses=ANALYSES, backend="transformer_lens")
            ran = cache[family].backend["natural"]
            assert ran.pop("seconds") > 0 and ran == {"backend": "transformer_lens", "why": "asked for"}
        return cache[family].to_dict()

    return get


# Outside the matrix (tests/families.py): Gemma 2 with a soft cap that bites; Llama 4 as released (q and k
# L2-normalised), with Scout's llama3 rope scaling; Command R+'s q/k LayerNorms (a gain per head)
EXTRA = ["gemma2_cap", "llama4_qk_norm", "llama4_scout", "cohere_qk_norm"]


@pytest.mark.parametrize("family", FAMILIES + EXTRA)
def test_profile_is_the_same_on_every_backend(family, family_bridge, bridge_profile):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = profile(family_bridge(family), _probes(), analyses=ANALYSES, backend="auto")
    ran = auto.backend["natural"]
    assert ran["backend"] in ("transformers", "transformer_lens") and ran["why"].startswith("auto: ")
    assert differences(bridge_profile(family), auto.to_dict()) == []


NNSIGHT_RUNS = (
    "llama",
    "qwen2",
    "gemma2",
    "gemma3",
    "gpt2",
    "opt",
    "phi",
    "olmo2",
    "jamba",
    "gpt_oss",
    "deepseek_v3",
    "qwen3_moe",
    "falcon_h1",
)  # nnsight, not the bridge
# The families whose attention neither the transformers backend nor nnsight computes exactly (docs/architecture.md):
# BLOOM's ALiBi and Falcon's own attention module bypass the attention interface.
ON_THE_BRIDGE_ONLY = {"bloom", "falcon"}


@pytest.mark.parametrize("family", FAMILIES)
def test_profile_through_nnsight_is_the_bridges(family, family_bridge, bridge_profile):
    """The model's backend nnsight (``load_model(..., backend="nnsight")``): the pass inside nnsight traces where it
    gives every hook, the bridge where not, with the reason; the same numbers either way."""
    pytest.importorskip("nnsight")
    model = family_bridge(family)
    model.pass_backend = "nnsight"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nn = profile(model, _probes(), analyses=ANALYSES)
    finally:
        model.pass_backend = "transformer_lens"
    ran = nn.backend["natural"]
    assert ran["backend"] == "nnsight" if family in NNSIGHT_RUNS else ran["backend"] in ("nnsight", "transformer_lens")
    assert ran["backend"] == "nnsight" or ran["why"].startswith("nnsight: "), ran
    assert differences(bridge_profile(family), nn.to_dict()) == []


def test_the_transformers_backend_runs_where_the_family_allows(family_bridge):
    """auto is not the bridge in disguise: the plain decoders run every pass analysis on the transformers backend."""
    for family in ("llama", "qwen2", "mistral", "gemma", "qwen3"):
        prof = profile(family_bridge(family), _probes(), analyses=ANALYSES, backend="auto")
        assert {r["backend"] for r in prof.backend.values()} == {"transformers"}, (family, prof.backend)


def _report(model, path, backend):
    model.pass_backend = backend
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_report(model, path, n=4, T=16)
    finally:
        model.pass_backend = "transformer_lens"
    return json.loads((path / "report.json").read_text())


@pytest.fixture(scope="module")
def smollm2_bridge_report(smollm2, tmp_path_factory):
    return _report(smollm2, tmp_path_factory.mktemp("tl"), "transformer_lens")


@pytest.mark.slow
def test_smollm2_report_is_the_same_on_every_backend(smollm2, smollm2_bridge_report, tmp_path):
    bridge, auto = smollm2_bridge_report, _report(smollm2, tmp_path / "auto", "auto")
    assert {r["backend"] for r in auto["config"]["backend"].values()} == {"transformers"}
    # every pass on the Hugging Face forward: the interventions' resumed and edited passes, the norm-gain trace too
    assert set(_ran_on(auto)) == {"transformers"} and _ran_on(auto)["transformers"] >= 15, _ran_on(auto)
    assert differences(bridge, auto) == []
    assert bridge["findings"] == auto["findings"]


def _ran_on(report: dict) -> dict[str, int]:
    """The passes of the report by the backend they ran on (``config.passes``: section -> "backend: why" -> count)."""
    out: dict[str, int] = {}
    for by in report["config"]["passes"].values():
        for k, n in by.items():
            out[k.partition(":")[0]] = out.get(k.partition(":")[0], 0) + n
    return out


@pytest.mark.slow
def test_smollm2_whole_report_through_nnsight_equals_the_bridges(smollm2, smollm2_bridge_report, tmp_path):
    """Every section, every pass inside nnsight traces (the interventions' edits and resumed passes, the norm-gain
    trace too); the bridge's report.json number by number."""
    bridge, nn = smollm2_bridge_report, _report(smollm2, tmp_path / "nn", "nnsight")
    assert set(_ran_on(nn)) == {"nnsight"}, _ran_on(nn)
    assert not nn["errors"] and set(nn["sections"]) == set(bridge["sections"])
    assert differences(bridge, nn) == []
    assert bridge["findings"] == nn["findings"]


def _random_natural(monkeypatch):
    """The report's natural probe drawn at random (a tiny model's word-tokenizer text gives every position's value the
    same norm, so its ratios are float noise), and its figures drawn but not encoded."""
    import dataclasses

    import analysis.report.build as build

    made = build.model_probe_sets

    def probes(model, **kw):
        out = made(model, **kw)
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(3, 96, tuple(out["natural"].tokens.shape), generator=g)
        return {**out, "natural": dataclasses.replace(out["natural"], tokens=tokens)}

    monkeypatch.setattr(build, "model_probe_sets", probes)
    monkeypatch.setattr("analysis.report.html.figure_html", _no_png)


def _no_png(fig, caption: str = "", dpi: int = 90) -> str:
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "<figure></figure>"


@pytest.mark.parametrize("family", FAMILIES + EXTRA)
def test_every_report_section_is_the_same_on_every_backend(family, family_bridge, tmp_path, monkeypatch):
    """The whole report of each family of the matrix through auto and through nnsight: every section runs, every
    number is the bridge's; every pass leaves the bridge (the norm-gain trace's too), but on the families whose
    attention only the bridge computes exactly."""
    _random_natural(monkeypatch)
    model = family_bridge(family)
    bridge = _report(model, tmp_path / "tl", "transformer_lens")
    backends = ("auto", "nnsight") if importlib.util.find_spec("nnsight") else ("auto",)
    for backend in backends:
        other = _report(model, tmp_path / backend, backend)
        assert not other["errors"] and set(other["sections"]) == set(bridge["sections"]), backend
        assert differences(bridge, other) == [], backend
        assert bridge["findings"] == other["findings"], backend
        ran = _ran_on(other)
        if family in ON_THE_BRIDGE_ONLY:
            assert set(ran) == {"transformer_lens"}, ran
            continue
        assert set(ran) == {"transformers" if backend == "auto" else "nnsight"}, (backend, other["config"]["passes"])
