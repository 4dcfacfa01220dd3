"""A non-softmax reference model (sigmoid, linear kernels) has attention weights that do not sum to one: Sink_1 is
then measured on the paper's normalised proxy, sim / sum sim, and every output says so (issue 37)."""

import json
from pathlib import Path

import torch

from analysis.__main__ import main
from analysis.model.reference.config import ModelConfig
from analysis.model.reference.sink_lm import SinkLM
from analysis.sinks.metric import sink_metric

SIGMOID = Path(__file__).resolve().parents[2] / "analysis/data/reference/synthetic-sigmoid"


def _tiny(attention: str) -> SinkLM:
    torch.manual_seed(0)
    return SinkLM(
        ModelConfig(d_vocab=17, n_ctx=16, d_model=16, n_layers=1, n_heads=2, attention=attention, attn_impl="eager")
    ).eval()


def test_sigmoid_and_linear_models_say_their_pattern_is_the_proxy():
    tokens = torch.randint(1, 17, (3, 12), generator=torch.Generator().manual_seed(0))
    for attention, proxy in (("sigmoid", "sim / sum sim"), ("linear-elu1", "|sim| / sum |sim|")):
        res = sink_metric(_tiny(attention), tokens)
        assert res.meta["pattern"] == f"normalised proxy ({proxy}), the model's attention is {attention}"
        assert res.to_dict()["pattern"] == res.meta["pattern"]
        assert f"Sink_1 is measured on a normalised proxy ({proxy})" in res.text()
    plain = sink_metric(_tiny("softmax"), tokens)
    assert "pattern" not in plain.meta and "pattern" not in plain.to_dict() and "proxy" not in plain.text()


def test_the_sink_command_prints_the_proxy_of_a_sigmoid_model(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert (
        main(
            ["sink", "--model", str(SIGMOID), "--n", "2", "--T", "16", "--quiet", "--device", "cpu", "--json", str(out)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "pattern: normalised proxy (sim / sum sim), the model's attention is sigmoid" in printed
    assert json.loads(out.read_text())["inputs"]["natural"]["pattern"].startswith("normalised proxy")
