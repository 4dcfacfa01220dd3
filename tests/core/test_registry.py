"""An analysis is one declaration (``analysis.core.registry``): a small analysis registered inside a test (how the
queries meet the first key, read from q and k, beside the first token's residual norm) is run by ``profile`` on every
backend, typed in ``Profile``, laid out in the report's HTML (its findings, table and figure, with no runner) and JSON
and checked by the protocol test's checks, with no other edit; it is gone once unregistered."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch

from analysis.core import registry
from analysis.core.defaults import BACKENDS
from analysis.core.registry import Analysis, Section
from analysis.core.results import Result
from analysis.engine.passes import Accumulator
from analysis.model.hooks import act_name, model_dims, qk_hook_names
from tests.conftest import cpu_cache
from tests.report.test_protocol import assert_protocol, from_profile

N, T = 3, 12
CAPTION = "cos(q_t, k_1) and the first token's norm per layer"


@dataclasses.dataclass(repr=False)
class FirstKey(Result):
    """Per layer: the mean cosine of the later queries with the first key, and the first token's residual norm.

    Attributes
    ----------
    cos_first : list of float
        Mean cos(q_t, k_1) over t > 1, heads and sequences, per layer.
    first_norm : list of float
        Mean norm of the first token's residual stream after each block.
    kind : str or None
    model_name : str or None
    n_samples : int
    """

    cos_first: list
    first_norm: list
    kind: str | None = None
    model_name: str | None = None
    n_samples: int = 0

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {
            "first_key": pd.DataFrame(
                {"layer": range(len(self.cos_first)), "cos_first": self.cos_first, "first_norm": self.first_norm}
            )
        }

    def findings(self) -> list[str]:
        top = max(range(len(self.cos_first)), key=self.cos_first.__getitem__)
        return [
            f"The queries meet the first key most closely in layer {top}, at mean cosine "
            f"{self.cos_first[top]:.3f}, where the first token's residual norm is {self.first_norm[top]:.2f}."
        ]


def cos_first(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per sequence: the mean cos(q_t, k_1) over the queries t > 1 and the heads (k's heads repeated for GQA)."""
    k1 = k[:, :1].float().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.nn.functional.cosine_similarity(q[:, 1:].float(), k1, dim=-1).mean(dim=(1, 2))


class FirstKeyAccumulator(Accumulator):
    """Sums of cos(q_t, k_1) and of the first token's residual norm per layer."""

    def __init__(self, model, *, kind=None):
        self.model, self.kind, self.name = model, kind, getattr(model, "model_name", None)
        self.L = model_dims(model).n_layers
        self.cos, self.norm, self.n = [0.0] * self.L, [0.0] * self.L, 0

    def hooks(self):
        return {
            l: {**dict(zip(("q", "k"), qk_hook_names(self.model, l))), "resid": act_name("resid_post", l)}
            for l in range(self.L)
        }

    def update(self, layer, acts, batch):
        self.cos[layer] += float(cos_first(acts["q"], acts["k"]).sum())
        self.norm[layer] += float(acts["resid"][:, 0].float().norm(dim=-1).sum())
        self.n += batch.size if layer == 0 else 0

    def result(self):
        return FirstKey(
            [c / self.n for c in self.cos],
            [s / self.n for s in self.norm],
            kind=self.kind,
            model_name=self.name,
            n_samples=self.n,
        )


def plot_first_key(res: FirstKey):
    """The section's one figure, drawn by the report's generic layout from the declaration."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot(res.cos_first, label="cos(q_t, k_1)")
    ax.plot(res.first_norm, label="|h_1|")
    ax.legend()
    return fig


FIRST_KEY = Analysis(
    "first_key",
    result=FirstKey,
    order=95,
    hooks=("q", "k", "resid"),
    doc="Queries against the first key per layer.",
    accumulators=lambda p: [FirstKeyAccumulator(p.model, kind=p.kind)],
    sections=(Section("The queries and the first key", "key", 65, figures=((plot_first_key, CAPTION),)),),
)


@pytest.fixture
def first_key():
    """FIRST_KEY registered for the test, unregistered after it."""
    with registry.registered(FIRST_KEY) as done:
        yield done[0]


def expected(model, tokens) -> tuple[list, list]:
    """The numbers from the bridge's own cache (run_with_cache), computed apart from the pass."""
    _, cache = cpu_cache(model, tokens)
    L = model_dims(model).n_layers
    cos = [float(cos_first(*(cache[h] for h in qk_hook_names(model, l))).mean()) for l in range(L)]
    return cos, [float(cache[act_name("resid_post", l)][:, 0].norm(dim=-1).mean()) for l in range(L)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_registered_analysis_reaches_profile_report_and_json_on_every_backend(
    first_key, backend, tiny_llama, tmp_path, monkeypatch
):
    """About 5 s per backend on the CPU (the profile, then the report of this one section)."""
    from analysis import profile
    from analysis.report import build, one_pass

    tokens = torch.randint(3, 96, (N, T), generator=torch.Generator().manual_seed(0))
    if backend == "nnsight":
        pytest.importorskip("nnsight")
    prof = profile(tiny_llama, {"natural": tokens}, analyses=("first_key",), backend=backend)
    ran = prof.backend["natural"]["backend"]
    assert ran == {"transformer_lens": "transformer_lens", "nnsight": "nnsight"}.get(backend, "transformers"), (
        prof.backend
    )
    assert "first_key" in one_pass.ANALYSES and "first_key" in build.SECTIONS
    field = {f.name: f.type for f in dataclasses.fields(prof)}["first_key"]
    assert field == FirstKey | None and isinstance(prof, one_pass.Profile)
    cos, norm = expected(tiny_llama, tokens)
    assert prof.first_key.cos_first == pytest.approx(cos, rel=1e-4, abs=1e-5)
    assert prof.first_key.first_norm == pytest.approx(norm, rel=1e-4)
    assert prof.to_dict()["results"]["first_key"] == prof.first_key.to_dict()
    for name, r in from_profile(prof).items():  # the protocol test's checks, FirstKey among them
        assert_protocol(name, r)
    assert "FirstKey" in from_profile(prof)

    # the report on the same backend: its section laid out by the generic layout, the figure from the declaration
    monkeypatch.setattr(tiny_llama, "pass_backend", backend)
    monkeypatch.setattr(
        "analysis.report.html.figure_html",
        lambda fig, caption="", dpi=90: f"<figure><figcaption>{caption}</figcaption></figure>",
    )
    page = build.build_report(tiny_llama, tmp_path, n=N, T=T, sections=["first_key"])
    d = json.loads((tmp_path / "report.json").read_text())
    assert d["config"]["backend"]["natural"]["backend"] == ran
    got = d["sections"]["first_key"]  # its to_dict() on the report's own probes
    assert got["n_samples"] == N and [r["layer"] for r in got["first_key"]] == list(range(len(cos)))
    said = "The queries meet the first key most closely in layer"
    assert any(said in f for c in d["findings"] if c["link"] == "key" for f in [c["headline"], *c["details"]])
    html = page.read_text()
    assert 'id="first_key">The queries and the first key</h2>' in html and said in html
    assert f"<figcaption>{CAPTION}</figcaption>" in html and "cos_first" in html  # the figure and the table


def test_a_registered_analysis_is_gone_once_unregistered(tiny_llama):
    from analysis import profile
    from analysis.report import build, one_pass

    with registry.registered(FIRST_KEY):
        assert "first_key" in one_pass.ANALYSES and "first_key" in build.SECTIONS
    assert "first_key" not in one_pass.ANALYSES and "first_key" not in build.SECTIONS
    with pytest.raises(ValueError, match="unknown analyses"):
        profile(tiny_llama, {"natural": torch.randint(3, 96, (2, 8))}, analyses=("first_key",))


def test_the_registry_refuses_a_second_analysis_of_a_name(first_key):
    with pytest.raises(ValueError, match="already registered"):
        registry.register(dataclasses.replace(FIRST_KEY))


def test_a_section_with_a_runner_declares_no_figures():
    """Its runner draws its own: a figure declared beside it would not be drawn."""
    with pytest.raises(ValueError, match="names a runner"):
        Section("x", "key", 1, runner="analysis.report.sections:_sink", figures=((plot_first_key, "x"),))


def test_declared_hooks_are_those_the_accumulators_read(tiny_llama):
    """Each registered pass analysis names the activations its accumulators ask for (their keys per layer)."""
    from analysis.chain.massive import spike_criterion
    from analysis.report.one_pass import pass_analyses

    tokens = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = registry.PassInputs(
        tiny_llama, tokens, "natural", True, eps=0.3, spike=spike_criterion(tiny_llama), budget_mib=64.0
    )
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
    assert list(build.SECTIONS) == [
        "sink",
        "views",
        "massive",
        "spike_writers",
        "norm_gain",
        "key_manifold",
        "value_norms",
        "interventions",
        "dormant",
        "sink_kind",
        "positions",
        "context",
    ]
