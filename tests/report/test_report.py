"""The report: one self-contained HTML page and a strict JSON, written atomically, for any model."""

import json
import re
import sys

import pytest
import torch

from analysis import ModelContractError
from analysis.report.build import LINKS, SECTIONS, ReportError, build_report
from tests.planted import SINK_LAYERS, planted, planted_model, planted_nospike  # noqa: F401


def _strict_json(path):
    def no_nan(x):
        raise AssertionError(f"non-finite number {x} in {path}")

    return json.loads(path.read_text(), parse_constant=no_nan)


def _sentences(d) -> list[str]:
    """Every finding of report.json: each link's headline and details."""
    return [f for c in d["findings"] for f in [c["headline"], *c["details"]]]


def _assert_whole_sentences(d):
    """No finding was cut mid-sentence: each ends a sentence and starts one (so not with 'k_1;' or lowercase)."""
    for f in _sentences(d):
        assert f == f.strip() and f[-1] in ".!)", f"finding ends mid-sentence: {f!r}"
        assert not f[0].islower() and not f.startswith("k_1;"), f"finding starts mid-sentence: {f!r}"


def _assert_one_headline_per_link(d, page: str):
    """The Findings section: one headline per link of the chain, in LINKS order, each with its numbers, and the
    details folded under it."""
    order = [k for k, _ in LINKS]
    links = [c["link"] for c in d["findings"]]
    assert links == sorted(links, key=order.index) and len(set(links)) == len(links)
    assert all(re.search(r"\d", c["headline"]) for c in d["findings"])
    findings = page.split("<h2>Findings</h2>", 1)[1].split("<h2", 1)[0]
    titles = re.findall(r'class="link">(?:<summary>)?<b>([^<]+)\.</b>', findings)
    assert titles == [c["title"] for c in d["findings"]]
    assert findings.count("<details") == sum(bool(c["details"]) for c in d["findings"])


def _assert_self_contained(page: str):
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script[^>]+src=", page), "a script loaded from elsewhere"
    assert not re.search(r"<link[^>]+href=", page), "a stylesheet loaded from elsewhere"
    assert not re.search(r"""src=["']https?://""", page)
    assert "unpkg.com" not in page and "jsdelivr" not in page


@pytest.fixture(scope="module")
def planted_report(planted, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    (out / "keep.txt").write_text("mine")
    (out / "report.json").write_text("{}")  # an older report is replaced
    path = build_report(planted, out, n=8, T=24)
    return out, path


def test_files_are_written_atomically_and_others_kept(planted_report):
    out, path = planted_report
    assert path == out / "report.html" and path.is_file()
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "report.html", "report.json"]  # no temp files left


def test_page_is_self_contained_with_figures_and_views(planted_report):
    out, path = planted_report
    page = path.read_text()
    _assert_self_contained(page)
    assert page.count("data:image/png;base64,") >= 8
    assert page.count("data:image/png;base64,") == 26  # every figure drew (a failed one would fail the report)
    assert page.count("CircuitsVis") >= 2  # two attention views with their JavaScript inline
    for s in (
        "Sink metric",
        "Massive activations",
        "Norm gain",
        "first key",
        "Value norms",
        "Interventions",
        "Every sink",
        "What a sink does for its head",
        "kind: nop or broadcast",
        "Sink against context length and eps",
    ):
        assert s in page


def test_json_holds_the_planted_answers(planted_report):
    out, _ = planted_report
    d = _strict_json(out / "report.json")
    assert set(d["sections"]) == set(SECTIONS)
    assert not any("error" in s for s in d["sections"].values() if isinstance(s, dict))
    # The planted spike: dims 7 and 21 in the residual stream after blocks 0 and 1.
    assert d["spike_dims"] == {"0": [7, 21], "1": [7, 21]} and d["spike_dims_hook"] == "hook_resid_post"
    sink = d["sections"]["sink"]
    assert sink["per_layer"]["natural"]["sink_1_pct"] == [0.0, 100.0, 100.0, 0.0]
    assert set(sink["sink_1_pct"]) == {"natural", "random", "repeated"}
    assert len(sink["results"]["natural"]["per_head_alpha"][0]) == 4  # [k][layer][head]
    assert d["sections"]["norm_gain"]["layer"] in SINK_LAYERS and d["sections"]["norm_gain"]["has_spike"]
    km = d["sections"]["key_manifold"]
    assert km["summary"]["sink"]["cos_first_pair"] > 0.999 and len(km["scatter"]) == 2
    assert d["sections"]["value_norms"]["summary"]["median_ratio_sink"] < 0.01
    iv = d["sections"]["interventions"]
    assert {"spike_ablation", "value_ablation", "first_key_ablation"} <= set(iv)
    zero = [r for r in iv["spike_ablation"]["conditions"] if r["condition"] == "zero"][0]
    assert zero["sink_1_pct"] < 5
    dormant = d["sections"]["dormant"]  # every head of the planted sink layers sinks on every query
    assert {(r["layer"], r["head"]) for r in dormant["heads"] if r["sinking_share"] == 1.0} == {
        (l, h) for l in SINK_LAYERS for h in range(4)
    }
    assert dormant["summary"]["n_always_sinking"] == 8 and dormant["verdict"]["norm"] == "untested"
    # Every finding is a whole sentence with a number; one headline per link of the chain, in order.
    assert len(_sentences(d)) >= 10 and all(re.search(r"\d", f) for f in _sentences(d))
    assert [c["link"] for c in d["findings"]] == [k for k, _ in LINKS]  # every section ran: every link has findings
    _assert_whole_sentences(d)
    _assert_one_headline_per_link(d, (out / "report.html").read_text())
    sink_1 = [f for f in _sentences(d) if re.search(r"Sink_1 \(eps = [\d.]+\)( of \S+)? (on|is)", f)]
    assert len(sink_1) == 1 and sink_1[0] == d["findings"][3]["headline"]  # Sink_1 stated once: the attention link
    assert d["versions"]["torch"] == torch.__version__
    assert d["seconds"]["total"] > 0
    # every section's time in the JSON, the profile passes apart from the sink section that first reads them
    assert set(d["seconds"]) == {"profile", *SECTIONS, "figures", "total"} and d["seconds"]["profile"] > 0
    assert sum(v for k, v in d["seconds"].items() if k != "total") <= d["seconds"]["total"] + 0.05  # not counted twice


def test_every_sink_and_context_sections(planted_report, planted):
    """The planted sink heads sink on the first token in the sink table; the context section holds every T it ran."""
    out, _ = planted_report
    d = _strict_json(out / "report.json")
    pos = d["sections"]["positions"]
    first = [r for r in pos["sinks"] if r["position"] == 0]
    assert len(first) == 8 and all({tuple(h) for h in r["heads"]} >= set(planted.planted.sink_heads) for r in first)
    assert all(r["massive"] and set(r["massive_dims"]) >= set(planted.planted.spike_dims) for r in first)
    runs = d["sections"]["context"]["computed"]["runs"]
    assert sorted({r["T"] for r in runs}) == [16, 32, 64, 128] and {r["n"] for r in runs} == {4}
    assert any("context length" in f for f in _sentences(d))


def test_model_whose_first_token_carries_no_spike(planted_nospike, tmp_path):
    build_report(planted_nospike, tmp_path, n=6, T=24, sections=["sink", "massive", "norm_gain", "interventions"])
    d = _strict_json(tmp_path / "report.json")
    assert d["spike_dims"] == {} and d["first_token_spike_dims"] == {}
    text = " ".join(_sentences(d))
    assert "carries no massive activation" in text
    assert "no spike" in text  # the norm-gain trace and the ablations say so plainly
    assert d["sections"]["interventions"]["spike_ablation"]["has_spike"] is False
    assert "no massive activation" in (tmp_path / "report.html").read_text()


def test_model_without_norm_gain(tmp_path, device):
    model = planted_model(device=device)
    model.cfg.normalization_type = None  # no norm gain to trace (as for a model without normalisation)
    build_report(model, tmp_path, n=4, T=16, sections=["massive", "norm_gain"])
    d = _strict_json(tmp_path / "report.json")
    assert d["sections"]["norm_gain"]["applicable"] is False
    assert "No norm gain to trace" in " ".join(d["notes"]["norm_gain"])
    assert "No norm gain to trace" in (tmp_path / "report.html").read_text()


# What breaks -> (object to patch, attribute, the error it raises, the ReportError message, report.json's "errors").
BROKEN = {
    "section": (
        "analysis.chain.values:ValueNorms",
        "to_dict",
        RuntimeError("boom"),
        r"1 report section\(s\) failed: value_norms \(RuntimeError: boom\)",
        {"value_norms": ["RuntimeError: boom"]},
    ),
    "figure": (
        "analysis.figures.sink",
        "plot_sink_by_layer",
        ValueError("no axes"),
        r"sink \(figure 'Sink_1 per layer': ValueError: no axes\)",
        {"sink": ["figure 'Sink_1 per layer': ValueError: no axes"]},
    ),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_failure_is_reported_and_the_rest_is_kept(broken, planted, tmp_path, monkeypatch):
    """A failing section (its result's to_dict raises) or figure fails the report, naming it; the page and the JSON
    keep everything that worked."""
    import importlib

    where, attr, exc, match, errors = BROKEN[broken]
    module, _, cls = where.partition(":")
    target = importlib.import_module(module)
    target = getattr(target, cls) if cls else target

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(target, attr, fail)
    with pytest.raises(ReportError, match=match):
        build_report(planted, tmp_path, n=4, T=16, sections=["sink", "value_norms"])
    d = _strict_json(tmp_path / "report.json")
    assert d["errors"] == errors
    assert d["sections"]["sink"]["sink_1_pct"]["natural"] == 50.0  # the numbers are kept
    page = (tmp_path / "report.html").read_text()
    if broken == "section":
        assert d["sections"]["value_norms"] == {"error": "RuntimeError: boom"} and "RuntimeError" in page
    else:
        assert page.count("data:image/png;base64,") == 2 + 2  # the other sink figures and the value-norm figures
    assert str(exc) in page and "Value norms" in page  # the error is shown and the section's title kept


def test_the_cli_exits_non_zero_when_the_report_fails(monkeypatch, tmp_path, capsys):
    import analysis.__main__ as cli

    def failing(*args, **kwargs):
        raise ReportError("1 report section(s) failed: sink (boom).")

    monkeypatch.setattr("analysis.report.build.build_report", failing)  # the CLI imports both once the options pass
    monkeypatch.setattr("analysis.model.loading.load_model", lambda *a, **k: None)
    assert cli.main(["report", "--out", str(tmp_path)]) == 1
    assert "sink (boom)" in capsys.readouterr().err


def test_a_missing_module_is_left_out_and_said(planted, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "analysis.causal.interventions", None)  # import now raises ImportError
    build_report(planted, tmp_path, n=4, T=16, sections=["interventions"])
    d = _strict_json(tmp_path / "report.json")
    assert d["sections"]["interventions"]["available"] is False
    assert "not available" in " ".join(d["notes"]["interventions"])


def test_bad_input_writes_nothing(planted, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ModelContractError, match="hook"):
        build_report(torch.nn.Linear(3, 3), out)
    with pytest.raises(ValueError, match=r"n \(--n\) must be at least 2 sequences"):
        build_report(planted, out, n=1)
    with pytest.raises(ValueError, match=r"T \(--T, tokens per sequence\) must be at least 4; got 3"):
        build_report(planted, out, n=4, T=3)
    with pytest.raises(ValueError, match="unknown report sections"):
        build_report(planted, out, sections=["sink", "tea"])
    assert not out.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        build_report(planted, tmp_path / "file", n=4, T=16)


def test_real_model_report(smollm2, tmp_path, monkeypatch):
    import functools

    from analysis.report import build, one_pass

    # the causal cuts on the first 2 of the 4 sequences (SPIKE_CUT_SAMPLES of 32 in a default report): a subset
    monkeypatch.setattr(build, "profile", functools.partial(one_pass.profile, follow_up_samples=2))
    path = build_report(smollm2, tmp_path, n=4, T=64)
    page = path.read_text()
    _assert_self_contained(page)
    d = _strict_json(tmp_path / "report.json")
    assert not any("error" in s for s in d["sections"].values() if isinstance(s, dict))
    sink = d["sections"]["sink"]["sink_1_pct"]
    assert sink["natural"] > 50 and sink["random"] > 50 and sink["repeated"] < 5
    # The embedded model has a massive activation on the first token, read by later sink layers.
    assert d["spike_dims"] and d["first_token_spike_dims"]
    assert d["sections"]["norm_gain"]["has_spike"]
    assert d["sections"]["value_norms"]["correlation"]["ratio"]["pearson_r"] < -0.5
    # Where a head of the embedded model sinks a query's attention, it writes little there (the sink as a gate).
    assert d["sections"]["dormant"]["summary"]["median_rho_norm"] < -0.3
    assert d["sections"]["dormant"]["verdict"]["norm"] == "yes"
    assert len(_sentences(d)) >= 12
    _assert_whole_sentences(d)
    _assert_one_headline_per_link(d, page)
    norm = next(c for c in d["findings"] if c["link"] == "key")  # the sentence the old report split in two
    assert any("of the logit q_t·k_1; alpha_1 is" in f for f in [norm["headline"], *norm["details"]])
    assert d["sections"]["positions"]["sinks"][0]["position"] == 0
    assert max(r["T"] for r in d["sections"]["context"]["committed"]["runs"]) == 8192  # analysis/data/sink_context/
    # Where the spike comes from: the writing MLPs, their writer neurons with their shares, the cut against random.
    so = d["sections"]["spike_writers"]
    mlps = [w for w in so["writers"] if w["component"] == "mlp"]
    assert mlps and all(sum(n["share"] for n in w["neurons"]) > 0.9 for w in mlps)
    assert so["origin"]["writing_blocks"] and so["origin"]["erasing_blocks"]
    cut = {(r["role"], r["mode"], r["chosen"]): r for r in so["cuts"]["summary"]}
    assert cut[("writers", "zero", "named")]["kept_mean"] < 0.2 < 0.9 < cut[("writers", "zero", "random")]["kept_min"]
    assert "Where the spike comes from" in page
    # Issue 37: the cuts' Sink_1 is on their subset: their headline says so, and the first lines give both numbers.
    top, s = _first_lines(page), d["samples"]
    base = next(r for r in so["cuts"]["conditions"] if r["role"] == "baseline")
    assert s["cuts_n"] == 2 and s["cuts_sink_1_pct"] == base["sink_1_pct"] and s["sink_1_pct"] == sink["natural"]
    assert "first 2 of these sequences" in top and f"{base['sink_1_pct']:.1f}%" in top and "N = 100" in top
    assert next(c for c in d["findings"] if c["link"] == "cuts")["headline"].startswith(
        "On the first 2 of the 4 natural sequences"
    )
    assert "first 2" not in json.dumps(d["notes"]) and "first 2 of the 4" in " ".join(d["about"]["spike_writers"])


def _first_lines(page: str) -> str:
    """The page above its Findings: the header and what it says first."""
    import html

    return html.unescape(page.split("<h2>Findings</h2>", 1)[0])


def test_the_first_lines_say_which_sequences_each_sink_1_is_on(planted, tmp_path):
    """Issue 37: `sink` prints Sink_1 over N = 100, the report over its own N; the report's first lines state its
    number and why they differ, and its notes hold only what is not applicable (the massive-activation criterion is
    said in its section)."""
    build_report(planted, tmp_path, n=10, T=24, sections=["sink", "massive"])
    d = _strict_json(tmp_path / "report.json")
    top = _first_lines((tmp_path / "report.html").read_text())
    s = d["samples"]
    assert s["n"] == 10 and s["sink_command_n"] == 100 and s["cuts_n"] is None
    sink_1 = d["sections"]["sink"]["sink_1_pct"]["natural"]
    assert s["sink_1_pct"] == sink_1 and f"{sink_1:.1f}% over this report's N = 10" in top and "N = 100" in top
    assert "criterion" not in json.dumps(d["notes"]) and "criterion" in " ".join(d["about"]["massive"])


def test_a_headline_from_committed_data_says_so(planted, tmp_path, monkeypatch):
    """Issue 37: the context-length headline read from analysis/data/sink_context/ (not this run) says so in itself."""
    from analysis.positions import context_length

    monkeypatch.setattr(
        context_length, "committed_sink_context", lambda name: context_length.load_sink_context("smollm2-135m")
    )
    monkeypatch.setattr("analysis.report.sections.CONTEXT_TS", (8, 16))  # the computed range, short: not what is tested
    build_report(planted, tmp_path, n=4, T=16, sections=["context"])
    d = _strict_json(tmp_path / "report.json")
    head = next(c for c in d["findings"] if c["link"] == "context")["headline"]
    assert head.startswith("From the committed run analysis/data/sink_context/") and "not this report's run" in head
    assert "T = 8192" in head or "8,192" in head or "8192" in head
