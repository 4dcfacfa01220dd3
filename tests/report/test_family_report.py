"""The report on every decoder family: one tiny random model per family (tests/families.py), loaded from its folder.

For each family ``build_report`` writes report.html with no failed section (it raises ``ReportError`` otherwise).
Hybrids (Qwen3-Next, Qwen3.5, Jamba) measure their attention layers under their true indices and the report
notes name the skipped layers; the gated families show the gate beside alpha_1, gpt-oss the learned-sink mass.
The gate means equal sigmoid of the gate Hugging Face's own modules compute; the learned-sink mass equals
1 - the row sum of Hugging Face eager attention. ``python -m analysis report`` exits 0 on a hybrid.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from analysis.report.build import build_report
from tests.conftest import tol
from tests.families import FAMILIES, KNOWN_FAILURES, family_config, layout

N, T = 3, 16
HYBRIDS = {f for f in FAMILIES if layout(f)["attention"] != tuple(range(family_config(f).num_hidden_layers))}
GATED = {"qwen3_next", "qwen3_5"}
# Families whose figures are rendered to PNG; the others draw every figure but skip the PNG encoding (most of a
# tiny model's report time), so figure code still runs (and may fail the report) on every family.
PNG_FAMILIES = {"qwen3_next", "qwen3_5", "jamba", "gpt_oss", "llama"}
ROOT = Path(__file__).resolve().parents[2]


def _no_png(fig, caption: str = "", dpi: int = 90) -> str:
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f"<figure><figcaption>{caption}</figcaption></figure>"


@pytest.fixture(scope="session")
def family_dirs(family_dir, family_bridge):
    """family -> (folder, bridge loaded from it): conftest's, each built once per session."""
    return lambda family: (family_dir(family), family_bridge(family))


def _tokens(seed: int = 0, n: int = N) -> torch.Tensor:
    return torch.randint(3, 96, (n, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_report_has_no_failed_section(family, family_dirs, tmp_path, monkeypatch):
    """Every section runs (no ReportError); hybrids keep true layer indices and note the skipped layers; the
    gate table appears for gated models and the learned-sink table for gpt-oss, and only there."""
    _, model = family_dirs(family)
    if family not in PNG_FAMILIES:
        monkeypatch.setattr("analysis.report.html.figure_html", _no_png)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        page = build_report(model, tmp_path, n=N, T=T).read_text()
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["errors"] == {}
    sink, attn = data["sections"]["sink"], list(model.family.attention_layers)
    assert sink["results"]["natural"]["layers"] == attn
    assert sorted(int(l) for l in sink["per_layer"]["natural"]["layer"]) == attn
    assert set(data["sections"]["views"]["layers"]) <= set(attn)
    assert data["sections"]["value_norms"]["layers"] == attn
    if family in HYBRIDS:
        words = f"Layers {sorted(model.family.skipped_layers)} skipped"
        for key in ("sink", "views", "value_norms"):
            assert any(words in n for n in data["notes"][key]), (key, data["notes"].get(key))
        assert words in page and "Layer 0:" not in page
    else:
        assert "skipped" not in json.dumps(data["notes"])
    norm_gain = data["sections"]["norm_gain"]  # a family without a key path says so as the section's note
    assert norm_gain["applicable"] == (family not in KNOWN_FAILURES["key_path"])
    if not norm_gain["applicable"]:
        assert KNOWN_FAILURES["key_path"][family] in norm_gain["reason"] and "No norm gain to trace" in page
    assert ("Gate on token 1 / elsewhere" in page) == (family in GATED)
    assert ("gates" in sink) == (family in GATED)
    assert ("Learned sink" in page) == (family == "gpt_oss")
    if family in GATED:
        rows = sink["gates"]["per_head"]
        assert [r["layer"] for r in rows] == [l for l in attn for _ in range(model.family.n_heads)]
        assert all(0 < r["gate_first"] < 1 and 0 < r["gate_other"] < 1 for r in rows)
    if family == "gpt_oss":
        rows = sink["learned_sink_per_head"]
        assert len(rows) == len(attn) * model.family.n_heads and min(r["slot_share"] for r in rows) > 0.05


def _hf_eager(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.mark.parametrize("family", sorted(GATED))
def test_gate_means_equal_sigmoid_of_hf_gate(family, family_dirs, device):
    """The gate means equal sigmoid of the gate Hugging Face computes (the second half of each head's q_proj
    output), averaged over head dims, at position 1 and over positions 2..T, per attention layer and head."""
    from analysis.sinks.output_gates import attention_gates

    folder, model = family_dirs(family)
    tokens = _tokens(5)
    res = attention_gates(model, tokens)
    assert res.layers == list(model.family.attention_layers) == [3] and "Layers [0, 1, 2] skipped" in res.text()
    hf, spec, got = _hf_eager(folder), model.family, {}  # the reference: Hugging Face on the CPU
    hooks = [
        hf.model.layers[l].self_attn.q_proj.register_forward_hook(lambda m, i, o, l=l: got.__setitem__(l, o.detach()))
        for l in res.layers
    ]
    with torch.no_grad():
        hf(tokens)
    for h in hooks:
        h.remove()
    for i, l in enumerate(res.layers):
        gate = got[l].view(*tokens.shape, spec.n_heads, 2 * spec.d_head)[..., spec.d_head :]  # (N, T, H, d)
        g = torch.sigmoid(gate).mean(-1)  # (N, T, H)
        torch.testing.assert_close(res.first[i], g[:, 0].mean(0), atol=tol(device, 1e-5), rtol=0)
        torch.testing.assert_close(res.other[i], g[:, 1:].mean((0, 1)), atol=tol(device, 1e-5), rtol=0)
    assert not torch.equal(res.first, res.other)


def test_learned_sink_mass_per_head_equals_hf(family_dirs, device):
    """gpt-oss: SinkResult's per-head slot share (the table beside alpha_1) is 1 - the row sum of HF eager
    attention, averaged over queries and samples; Sink on the slot counts heads above eps."""
    from analysis import sink_metric

    folder, model = family_dirs("gpt_oss")
    tokens = _tokens(6)
    res = sink_metric(model, tokens, k_max=1)
    with torch.no_grad():
        att = [a for a in _hf_eager(folder)(tokens, output_attentions=True).attentions if a is not None]
    theirs = torch.stack([(1 - a.sum(-1)).mean(-1) for a in att], 1)  # (N, L, H)
    torch.testing.assert_close(res.per_head_slot(), theirs.mean(0), atol=tol(device, 1e-5), rtol=0)
    table = res.slot_per_head()
    assert table.layer.tolist() == [l for l in res.layers for _ in range(model.family.n_heads)]
    assert table.slot_sink_pct.tolist() == pytest.approx(((theirs > res.eps).float().mean(0) * 100).flatten().tolist())


@pytest.mark.parametrize("family", ["qwen3_next", "jamba"])
def test_fused_sink_path_on_a_hybrid(family, family_dirs, device):
    """The fused sink path measures a hybrid's attention layers (the linear-attention / Mamba layers never reach
    the attention function) and gives the eager path's alpha under the same true indices."""
    from analysis import sink_metric

    _, model = family_dirs(family)
    tokens = _tokens(7, 2)
    fused, eager = sink_metric(model, tokens, k_max=2, path="fused"), sink_metric(model, tokens, k_max=2, path="eager")
    assert fused.meta["backend"] == "transformers"
    assert fused.meta["path"] == "fused" and fused.layers == eager.layers == list(model.family.attention_layers)
    assert fused.skipped == eager.skipped != ""
    torch.testing.assert_close(fused.alpha, eager.alpha, atol=tol(device, 1e-5), rtol=0)


def test_explicit_non_attention_layers_fail_clearly(family_dirs):
    """The one helper: None gives the attention layers; a linear-attention layer asked for by hand is a ValueError
    that names the attention layers, in every analysis that reads attention hooks."""
    from analysis.model.hooks import check_attention_layers
    from analysis.chain.values import value_norms
    from analysis.figures.views import attention_pattern

    _, model = family_dirs("qwen3_next")
    assert check_attention_layers(model) == [3] and check_attention_layers(model, layers=[3]) == [3]
    match = r"layer 0 of this qwen3_next model is not an attention layer .*attention layers: \[3\]"
    for call in (
        lambda: check_attention_layers(model, layers=[0, 1]),
        lambda: value_norms(model, _tokens(), layers=[0]),
        lambda: attention_pattern(model, _tokens(n=1), 0),
    ):
        with pytest.raises(ValueError, match=match):
            call()
    with pytest.raises(ValueError, match=r"layers \[7\] out of range: this model has layers 0..3"):
        check_attention_layers(model, layers=[7])


def test_cli_on_a_hybrid(family_dirs, tmp_path, capsys, device):
    """``python -m analysis report`` exits 0 on Jamba; the ``sink`` table says which layers it measured."""
    from analysis.__main__ import main

    folder, _ = family_dirs("jamba")
    out = tmp_path / "rep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "analysis",
            "report",
            "--model",
            str(folder),
            "--out",
            str(out),
            "--n",
            str(N),
            "--T",
            str(T),
            "--quiet",
            "--device",
            device,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "report.html").is_file() and json.loads((out / "report.json").read_text())["errors"] == {}
    assert main(["sink", "--model", str(folder), "--n", "2", "--T", str(T), "--quiet", "--device", device]) == 0
    table = capsys.readouterr().out
    assert "measured on attention layers [2]; Layers [0, 1, 3] skipped (Mamba state-space layer" in table


def test_mla_header_names_each_head_dim(family_dirs, tmp_path):
    """Issue 37: MLA's config head_dim (8 here) is its rotary part only; the header names the query/key width (8
    decompressed + 8 rotary = 16) and the value width (12), and report.json keeps them apart."""
    _, model = family_dirs("deepseek_v3")
    page = build_report(model, tmp_path, n=2, T=16, sections=[]).read_text()
    head = page.split("<h2>Findings</h2>", 1)[0]
    assert "d_head 8" not in head
    assert "query/key head dim 16 (8 decompressed from the latent + 8 rotary), value head dim 12" in head
    dims = json.loads((tmp_path / "report.json").read_text())["dims"]
    assert (dims["d_head_qk"], dims["d_head_qk_rope"], dims["d_head_v"]) == (16, 8, 12) and "d_head" not in dims
