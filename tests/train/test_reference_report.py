"""`python -m analysis report` on the reference pair (tokenizer-less models of the synthetic task, probed with
their own task): every section runs, and the report carries the mechanism's numbers under softmax and their
absence under sigmoid."""

import json

import pytest

from analysis.__main__ import main


@pytest.fixture(scope="module")
def reports(tmp_path_factory, device):
    out = {}
    for name in ("synthetic-softmax", "synthetic-sigmoid"):
        d = tmp_path_factory.mktemp(name)
        assert main(["report", "--model", name, "--out", str(d), "--n", "16", "--device", device]) == 0
        out[name] = json.loads((d / "report.json").read_text())
        assert (d / "report.html").stat().st_size > 10_000
    return out


def test_every_section_runs_on_the_pair(reports):
    for name, rep in reports.items():
        assert not rep["errors"], (name, rep["errors"])
        assert set(rep["sections"]) >= {"sink", "massive", "norm_gain", "key_manifold", "value_norms", "interventions"}
        assert rep["config"]["probes"]["natural"].startswith("synthetic bigram-copy task")


def test_the_softmax_report_shows_the_mechanism_and_the_sigmoid_report_none(reports):
    soft, sig = reports["synthetic-softmax"]["sections"], reports["synthetic-sigmoid"]["sections"]
    assert soft["sink"]["sink_1_pct"]["natural"] >= 30.0 and sig["sink"]["sink_1_pct"]["natural"] <= 5.0
    assert soft["sink"]["sink_1_pct"]["repeated"] == 0.0  # one token repeated: no sink, as in the paper
    vn = soft["value_norms"]["summary"]
    assert vn["n_sink_kv_heads"] >= 1 and vn["median_ratio_sink"] <= 0.5  # the first token's value is small
    km = soft["key_manifold"]["summary"]["sink"]
    assert km["cos_q_k1"] > 0.5 > km["cos_q_kj"]  # queries meet k_1 at a small angle, other keys at a large one
    assert km["cos_first_pair"] > 0.99  # one first key for every input
    assert sig["value_norms"]["summary"]["n_sink_kv_heads"] == 0
