"""The sink's kind (issue 50): the diagnostic calls the ground-truth models' sink heads by their known kind on every
seed, gives the same numbers on both backends, and lays out its result.

Cheap: each ground-truth model is one pass of 100 x 64 tokens through a 1-layer model (0.2-1 s each after the first's
imports; the file took about 20 s of wall time on the shared 2-core machine); the backend test is two passes of 3 x 16
tokens through a tiny llama.
"""

import math
import warnings

import pytest
import torch

from analysis.causal.sink_kind import KINDS, SinkKindAccumulator, call_kind, sink_kinds
from analysis.core.defaults import KIND_BROADCAST_COS, KIND_BROADCAST_PR, KIND_OUT_RATIO, KIND_VALUE_RATIO
from analysis.engine.passes import run_pass
from analysis.model.loading import load_model
from analysis.model.probes import task_probe_sets

SEEDS = (0, 1, 2)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["nop", "broadcast"])
def test_the_ground_truth_models_sink_heads_are_called_by_their_kind(kind, seed):
    model = load_model(f"{kind}-task-s{seed}")
    res = sink_kinds(model, task_probe_sets(model, n=100, T=64)["natural"].tokens, kind="natural")
    heads = res.heads[lambda d: d["sink"]]
    assert len(heads) >= 1
    assert (heads["sink_kind"] == kind).all(), heads
    assert res.shares()[kind] == 1.0 and res.shares()["n_sink_heads"] == len(heads)
    # every trace on its side of its threshold, not only the call
    if kind == "nop":
        assert (heads["value_ratio"] < KIND_VALUE_RATIO).all() and (heads["out_ratio"] < KIND_OUT_RATIO).all()
        assert (heads["pr"] > KIND_BROADCAST_PR).all() and (heads["cos"] < KIND_BROADCAST_COS).all()
    else:
        assert (heads["value_ratio"] > KIND_VALUE_RATIO).all() and (heads["out_ratio"] > KIND_OUT_RATIO).all()
        assert (heads["pr"] < KIND_BROADCAST_PR).all() and (heads["cos"] > KIND_BROADCAST_COS).all()
    text = res.text()
    assert f"{len(heads)} are {kind} (100%)" in text and "ground-truth" in text and "layer 0:" in text


def test_a_head_is_mixed_where_its_traces_disagree():
    assert call_kind(0.1, 0.2, 2.0, 0.7) == "nop"
    assert call_kind(3.0, 5.0, 1.0, 1.0) == "broadcast"
    assert call_kind(0.1, 5.0, 2.0, 0.7) == "mixed"  # a small value, yet it writes more when it sinks
    assert call_kind(3.0, 5.0, 2.0, 0.7) == "mixed"  # a large value, several directions: no broadcast
    assert call_kind(3.0, 5.0, math.nan, math.nan) == "mixed"  # no sequence to measure the rank on
    assert call_kind(0.05, math.nan, 1.3, 0.9) == "nop"  # sinks on every query: the value decides


def test_the_sink_kind_is_the_same_on_both_backends(family_bridge):
    model = family_bridge("llama")
    tokens = torch.randint(3, 96, (3, 16), generator=torch.Generator().manual_seed(0))
    got, records = {}, {}
    for backend in ("transformer_lens", "transformers"):
        acc = SinkKindAccumulator(model, [0, 1], 16, eps=0.1)
        records[backend] = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (got[backend],) = run_pass(model, tokens, [acc], backend=backend, record=records[backend])
    assert records["transformers"]["backend"] == "transformers"
    a, b = got["transformer_lens"].heads, got["transformers"].heads
    assert (a["sink"] == b["sink"]).all() and a["sink"].any()
    for c in ("alpha_1", "sinking_share", "value_ratio", "out_ratio", "pr", "cos"):
        assert torch.allclose(
            torch.tensor(a[c].values), torch.tensor(b[c].values), rtol=1e-4, atol=1e-6, equal_nan=True
        ), c
    assert a["sink_kind"].equals(b["sink_kind"])


def test_the_result_keeps_the_protocol_and_refuses_short_sequences():
    model = load_model("broadcast-task-s1")
    res = sink_kinds(model, task_probe_sets(model, n=8, T=32)["natural"].tokens)
    d = res.to_dict()
    assert set(d["shares"]) == {*KINDS, "n_sink_heads"} and d["thresholds"]["pr"] == KIND_BROADCAST_PR
    assert set(res.tables) == {"layers", "sink_heads"} and list(res.tables["layers"]["layer"]) == [0]
    with pytest.raises(ValueError, match="must be at least 6; got 5. The sink.s kind reads queries from position 3"):
        sink_kinds(model, task_probe_sets(model, n=2, T=5)["natural"].tokens)
