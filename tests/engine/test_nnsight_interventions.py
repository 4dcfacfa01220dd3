"""The interventions on a model loaded for NDIF (``load_nnsight``: the remote traces, run here): the spike, value and
first-key ablations edit inside the trace (``analysis.engine.remote.trace_batch``), run no resume, and bring back only
the reductions (alpha and the attention shares from q, k and the lse; the loss from the logits); every table equals
the bridge's, the report's section included; the edits and reductions that ship reach only NDIF's whitelist and run
the same through nnsight's local simulation of a remote run. About 30 s on two CPU cores."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

pytest.importorskip("nnsight")

from analysis.causal.conditions import _first_position, _loss_stats, _pass_stats, _value_head_stats  # noqa: E402
from analysis.causal.interventions import _set_first, _value_removed  # noqa: E402
from analysis.causal.interventions import first_key_ablation, spike_ablation, value_ablation  # noqa: E402
from analysis.engine.passes import Reduction  # noqa: E402
from analysis.model.hooks import ModelContractError  # noqa: E402
from analysis.model.loading import load_nnsight  # noqa: E402
from tests.engine.test_nnsight import NDIF_ALLOWED, _reached, _same, here_and_there  # noqa: E402


def _tokens(n=3, T=16):
    return torch.randint(3, 96, (n, T), generator=torch.Generator().manual_seed(0))


def _ablations(model, tokens):
    """The three ablations, with spike dims given (the tiny models carry no spike) and eps low enough for sink heads."""
    return [
        spike_ablation(model, tokens, spike_dims={0: [1, 5], 1: [3]}, eps=0.1),
        value_ablation(model, tokens, eps=0.1),
        first_key_ablation(model, tokens, spike_dims=[1, 5, 7], eps=0.1),
    ]


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma2_cap"])  # plain GQA; sliding window; a cap that bites
def test_the_ablations_of_a_remote_model_equal_the_bridges(family, family_bridge, family_dir):
    nn, tokens = load_nnsight(str(family_dir(family))), _tokens()
    for got, want in zip(_ablations(nn, tokens), _ablations(family_bridge(family), tokens)):
        assert got.message == want.message and got.findings() == want.findings()
        for name, table in want.tables.items():
            pd.testing.assert_frame_equal(got.tables[name], table, rtol=1e-5, atol=1e-6)
    assert len(want.conditions) == 2 and want.conditions["loss"].diff().abs().iloc[1] > 0  # the key edit did something


def test_multi_head_latent_attention_refuses_the_remote_key_edit_before_the_work(family_dir):
    with pytest.raises(ModelContractError, match="k_proj"):
        first_key_ablation(load_nnsight(str(family_dir("deepseek_v3"))), _tokens(), spike_dims=[1])


def test_the_edit_trace_ships_only_what_ndif_allows_and_runs_in_nnsights_simulation(family_dir, monkeypatch):
    import analysis.engine.remote as remote
    from analysis.causal.conditions import FirstTokenResidAccumulator, PassAccumulator, ValueStatsAccumulator

    for fn in (_pass_stats, _first_position, _value_head_stats, _loss_stats, _set_first, _value_removed):
        bad = {m for m in _reached(fn) if m.split(".")[0] not in NDIF_ALLOWED}
        assert not bad, f"{fn.__name__} reaches {bad}: NDIF allows only {sorted(NDIF_ALLOWED)}"
    nn, tokens = load_nnsight(str(family_dir("llama"))), _tokens(n=2, T=12)
    accs = [PassAccumulator(nn, 12), FirstTokenResidAccumulator(nn), ValueStatsAccumulator(nn)]
    plan = remote.pass_plan(nn, accs)
    dims = torch.tensor([1, 5])
    edits = {
        0: {"k_in": Reduction(_set_first, {"dims": dims, "value": 0.0})},
        1: {
            "z": Reduction(_value_removed, {"heads": torch.tensor([0, 1]), "H": 4, "K": 2}),
            "resid_post": Reduction(_set_first, {"dims": dims, "value": torch.ones(2, 2)}),
        },
    }
    runs = here_and_there(
        monkeypatch,
        lambda where: remote.trace_batch(nn, tokens, plan, edits=edits, logits=Reduction(_loss_stats), remote=where),
    )
    (*here, (_, _, loss)), (*there, (_, _, loss2)) = runs[False], runs["local"]
    assert [(j, l) for j, l, _ in here] == [(j, l) for j, l, _ in there] and len(here) == 3 * 2
    for (_, _, a), (_, _, b) in zip(here, there):
        a, b = (x if isinstance(x, dict) else {"x": x} for x in (a, b))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(loss[k], loss2[k]) for k in loss) and set(loss) == {"sum", "first"}
    unedited = remote.trace_batch(nn, tokens, plan, logits=Reduction(_loss_stats))[-1][2]
    assert float(unedited["sum"][0]) != pytest.approx(float(loss["sum"][0]), rel=1e-6)  # the edits took


def test_the_interventions_section_of_a_remote_models_report_equals_the_bridges(family_bridge, family_dir, tmp_path):
    from analysis.report.build import build_report

    build_report(family_bridge("llama"), tmp_path / "b", sections=["interventions"], n=2, T=24, eps=0.1)
    build_report(load_nnsight(str(family_dir("llama"))), tmp_path / "n", sections=["interventions"], n=2, T=24, eps=0.1)
    want, got = (json.loads((tmp_path / d / "report.json").read_text()) for d in "bn")
    assert not got["errors"] and got["sections"]["interventions"].get("available", True)
    assert len(got["sections"]["interventions"]["value_ablation"]["conditions"]) > 1  # conditions ran in the traces
    assert not _same(got["sections"]["interventions"], want["sections"]["interventions"])
