"""An analysis is one declaration (``analysis.core.registry``): a small analysis registered inside this test (the mean
norm of the first token's residual stream per layer) is run by ``profile``, typed in ``Profile``, laid out in the
report's HTML and JSON and checked by the protocol test's checks, with no other edit; it is gone once unregistered."""
from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch

from analysis.core import registry
from analysis.core.registry import Analysis, Section
from analysis.core.results import Result
from analysis.engine.passes import Accumulator
from analysis.model.hooks import act_name, model_dims
from tests.conftest import cpu_cache
from tests.report.test_protocol import assert_protocol, from_profile

N, T = 3, 12


@dataclasses.dataclass(repr=False)
class FirstNorm(Result):
    """The mean norm of the first token's residual stream after each block.

    Attributes
    ----------
    norms : list of float
        Per layer.
    kind : str or None
    model_name : str or None
    n_samples : int
    """

    norms: list
    kind: str | None = None
    model_name: str | None = None
    n_samples: int = 0

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {"first_norm": pd.DataFrame({"layer": range(len(self.norms)), "norm": self.norms})}

    def findings(self) -> list[str]:
        top = max(range(len(self.norms)), key=self.norms.__getitem__)
        return [f"The first token's residual stream is largest after block {top}, with a mean norm of "
                f"{self.norms[top]:.2f}."]


class FirstNormAccumulator(Accumulator):
    """Sums of the first token's residual norm per layer, on the layer's device."""

    def __init__(self, model, *, kind=None):
        self.L, self.kind, self.name = model_dims(model).n_layers, kind, getattr(model, "model_name", None)
        self.sums, self.n = [0.0] * self.L, 0

    def hooks(self):
        return {l: {"resid": act_name("resid_post", l)} for l in range(self.L)}

    def update(self, layer, acts, batch):
        self.sums[layer] = self.sums[layer] + acts["resid"][:, 0].float().norm(dim=-1).sum()
        self.n += batch.size if layer == 0 else 0

    def result(self):
        return FirstNorm([float(s) / self.n for s in self.sums], kind=self.kind, model_name=self.name, n_samples=self.n)


FIRST_NORM = Analysis(
    "first_norm", result=FirstNorm, order=95, hooks=("resid",), doc="The first token's residual norm per layer.",
    accumulators=lambda p: [FirstNormAccumulator(p.model, kind=p.kind)],
    sections=(Section("The first token's norm", "attention", 15),))


def test_a_registered_analysis_reaches_profile_report_and_protocol(tiny_llama, tmp_path, monkeypatch):
    from analysis import profile
    from analysis.report import build, one_pass

    monkeypatch.setattr("analysis.report.html.figure_html", lambda fig, caption="", dpi=90: "")
    tokens = torch.randint(3, 96, (N, T), generator=torch.Generator().manual_seed(0))
    with registry.registered(FIRST_NORM):
        assert "first_norm" in one_pass.ANALYSES and "first_norm" in build.SECTIONS
        prof = profile(tiny_llama, {"natural": tokens}, analyses=("sink", "first_norm"))
        field = {f.name: f.type for f in dataclasses.fields(prof)}["first_norm"]
        assert field == FirstNorm | None and isinstance(prof, one_pass.Profile)
        _, cache = cpu_cache(tiny_llama, tokens)
        want = [float(cache[act_name("resid_post", l)][:, 0].norm(dim=-1).mean()) for l in range(len(prof.first_norm.norms))]
        assert prof.first_norm.norms == pytest.approx(want, rel=1e-4)
        assert prof.to_dict()["results"]["first_norm"] == prof.first_norm.to_dict()
        for name, r in from_profile(prof).items():  # the protocol test's checks, FirstNorm among them
            assert_protocol(name, r)
        assert "FirstNorm" in from_profile(prof)

        page = build.build_report(tiny_llama, tmp_path, n=N, T=T, sections=["sink", "first_norm"])
        d = json.loads((tmp_path / "report.json").read_text())
        assert list(d["sections"]) == ["sink", "first_norm"]  # in the registered order
        got = d["sections"]["first_norm"]  # its to_dict() on the report's own probes
        assert got["n_samples"] == N and [r["layer"] for r in got["first_norm"]] == list(range(len(want)))
        said = "The first token's residual stream is largest after block"
        assert any(said in f for c in d["findings"] if c["link"] == "attention" for f in [c["headline"], *c["details"]])
        html = page.read_text()
        assert 'id="first_norm">The first token&#x27;s norm</h2>' in html and said.replace("'", "&#x27;") in html
    assert "first_norm" not in one_pass.ANALYSES and "first_norm" not in build.SECTIONS
    with pytest.raises(ValueError, match="unknown analyses"):
        profile(tiny_llama, {"natural": tokens}, analyses=("first_norm",))


def test_the_registry_refuses_a_second_analysis_of_a_name():
    with registry.registered(FIRST_NORM), pytest.raises(ValueError, match="already registered"):
        registry.register(dataclasses.replace(FIRST_NORM))
    assert "first_norm" not in {a.name for a in registry.analyses()}


def test_declared_hooks_are_those_the_accumulators_read(tiny_llama):
    """Each registered pass analysis names the activations its accumulators ask for (their keys per layer)."""
    from analysis.chain.massive import spike_criterion
    from analysis.engine.passes import model_facts
    from analysis.report.one_pass import pass_analyses

    tokens = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = registry.PassInputs(tiny_llama, tokens, "natural", True, eps=0.3, spike=spike_criterion(tiny_llama),
                                 budget_mib=64.0, facts=model_facts(tiny_llama))
    wrong = {}
    for a in pass_analyses():
        if a.accumulators is None:
            continue
        asked = {k for acc in a.accumulators(inputs) for keys in acc.hooks().values() for k in keys}
        if not asked <= set(a.hooks):
            wrong[a.name] = sorted(asked - set(a.hooks))
    assert not wrong, f"registered analyses reading activations they do not declare in hooks=: {wrong}"


def test_every_registered_section_goes_to_a_link_of_the_chain():
    """A section's findings are gathered under its link in the Findings section: a link not in ``LINKS`` would hide
    them there."""
    from analysis.report import build
    from analysis.report.html import LINKS

    links = {k for k, _ in LINKS}
    wrong = {key: s.link for key, (a, s) in build.registered_sections().items() if s.link not in links}
    assert not wrong, f"sections registered with a link outside analysis.report.html.LINKS: {wrong}"
    assert list(build.SECTIONS) == ["sink", "views", "massive", "spike_writers", "norm_gain", "key_manifold",
                                    "value_norms", "interventions", "dormant", "sink_kind", "positions", "context"]
