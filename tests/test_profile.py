"""One profile pass gives the same numbers as each analysis run alone; the hook contract's helpers."""
import numpy as np
import pandas as pd
import pytest
import torch

from analysis import profile
from analysis.hooks import Accumulator, LayerCollector, ModelContractError, act_name, kv_view, per_query_head, stream
from analysis.interventions import baseline_pass, run_condition, spike_ablation, value_ablation
from analysis.key_manifold import first_key_manifold
from analysis.massive import massive_activations
from analysis.qk import qk_angles
from analysis.sink import sink_metric
from analysis.value_norms import value_norms
from tests.planted import planted, planted_tokens  # noqa: F401


@pytest.fixture(scope="module")
def probes():
    return {"natural": planted_tokens(6, 20, seed=1), "random": planted_tokens(4, 20, seed=2)}


@pytest.fixture(scope="module")
def prof(planted, probes):
    return profile(planted, probes, batch_size=4)


def test_profile_equals_each_analysis_alone(planted, probes, prof):
    nat = probes["natural"]
    for kind, toks in probes.items():
        alone = sink_metric(planted, toks, batch_size=4, kind=kind)
        assert torch.allclose(prof.sink[kind].alpha, alone.alpha, atol=1e-7) and prof.sink[kind].kind == kind
        ma = massive_activations(planted, toks, batch_size=4, kind=kind)
        assert prof.massive[kind].spike_dims == ma.spike_dims
        assert torch.allclose(prof.massive[kind].top_values, ma.top_values)
        pd.testing.assert_frame_equal(prof.massive[kind].flagged, ma.flagged)
    assert set(prof.sink) == {"natural", "random"} and prof.qk is not None and prof.n_samples == 6
    qk = qk_angles(planted, nat, batch_size=4)
    assert torch.allclose(prof.qk.cos_first, qk.cos_first) and torch.allclose(prof.qk.hist_other, qk.hist_other)
    km = first_key_manifold(planted, nat, batch_size=4)
    pd.testing.assert_frame_equal(prof.key_manifold.table, km.table, rtol=1e-6)
    assert list(prof.key_manifold.scatter) == list(km.scatter)
    vn = value_norms(planted, nat, batch_size=4)
    for name in ("v1_norm", "vj_norm", "alpha_1", "first_value_share", "v1_cos_pair"):
        assert torch.allclose(getattr(prof.value_norms, name), getattr(vn, name), atol=1e-6), name


def test_the_shared_baseline_equals_a_pass_of_its_own(planted, probes, prof):
    nat = probes["natural"]
    run = run_condition(planted, nat, batch_size=4)
    assert torch.allclose(prof.baseline.run.alpha, run.alpha) and prof.baseline.run.loss == pytest.approx(run.loss)
    assert torch.allclose(prof.baseline.run.where, run.where, atol=1e-6)
    shared = spike_ablation(planted, nat, baseline=prof.baseline, batch_size=4)
    alone = spike_ablation(planted, nat, batch_size=4)
    pd.testing.assert_frame_equal(shared.conditions, alone.conditions)
    assert shared.means == pytest.approx(alone.means)
    v_shared = value_ablation(planted, nat, all_heads=False, baseline=prof.baseline, batch_size=4)
    v_alone = value_ablation(planted, nat, all_heads=False, batch_size=4)
    pd.testing.assert_frame_equal(v_shared.heads, v_alone.heads)
    pd.testing.assert_frame_equal(v_shared.conditions, v_alone.conditions)
    with pytest.raises(ValueError, match="baseline was run on 6 sequences"):
        spike_ablation(planted, nat[:3], baseline=prof.baseline)


def test_profile_protocol(prof):
    import json

    d = prof.to_dict()
    json.dumps(d, allow_nan=False)
    assert {"sink/natural", "sink/random", "massive/natural", "qk", "key_manifold", "value_norms"} <= set(d["results"])
    for r in prof.results.values():
        assert r.text() and r.model_name == prof.model_name and r.n_samples in (4, 6)
        assert all(isinstance(t, pd.DataFrame) for t in r.tables.values())
    with pytest.raises(ValueError, match="unknown analyses"):
        profile(None, {"natural": None}, analyses=("sink", "tea"))


class _Seen(Accumulator):
    """Records which keys arrive together and stops the pass after layer 1."""

    def __init__(self):
        self.seen = []

    def hooks(self):
        return {l: {"q": act_name("q", l), "v": act_name("v", l), "pattern": act_name("pattern", l),
                    "resid": act_name("resid_pre", l)} for l in (0, 1)}

    def update(self, layer, acts, batch):
        self.seen.append((layer, sorted(acts), acts["v"].shape[2], batch.offset))

    def result(self):
        return self.seen


def test_joint_reducer_hands_one_layer_over_together(planted):
    seen = stream(planted, planted_tokens(5, 8), [_Seen()], batch_size=3)[0]
    assert seen == [(0, ["pattern", "q", "resid", "v"], 2, 0), (1, ["pattern", "q", "resid", "v"], 2, 0),
                    (0, ["pattern", "q", "resid", "v"], 2, 3), (1, ["pattern", "q", "resid", "v"], 2, 3)]


def test_a_hook_that_never_fires_is_an_error_unless_optional():
    """Reference models without rotary list hook_rot_k but never run it."""
    from analysis.train import ModelConfig, SinkLM

    model = SinkLM(ModelConfig(d_vocab=32, n_ctx=16, d_model=32, n_layers=1, n_heads=2, n_key_value_heads=2,
                               d_head=16, d_mlp=64, positional_embedding_type="none")).eval()

    class Never(_Seen):
        def hooks(self):
            return {0: {"rot_k": act_name("rot_k", 0), "k": act_name("k", 0), "v": act_name("v", 0)}}

    with pytest.raises(ModelContractError, match=r"hooks \['blocks.0.attn.hook_rot_k'\] did not fire"):
        stream(model, torch.randint(0, 32, (2, 8)), [Never()])

    class Optional(Never):
        optional_keys = frozenset({"rot_k"})

    seen = stream(model, torch.randint(0, 32, (2, 8)), [Optional()])[0]
    assert seen == [(0, ["k", "v"], 2, 0)]


def test_kv_view_undoes_the_repetition_of_kv_heads():
    k = torch.randn(2, 5, 3, 4)
    assert torch.equal(kv_view(per_query_head(k, 6), 3), k) and torch.equal(kv_view(k, 3), k)
    with pytest.raises(ModelContractError):
        kv_view(torch.randn(2, 5, 4, 4), 3)
    assert act_name("pattern", 2) == "blocks.2.attn.hook_pattern" and act_name("normalized", 0) == "blocks.0.ln1.hook_normalized"
    with pytest.raises(ValueError, match="unknown activation"):
        act_name("tea", 0)


def test_layer_collector_stacks_batches_and_names_missing_layers():
    c = LayerCollector([0, 1])
    for b in range(2):
        c.put(0, torch.zeros(3, 2) + b)
        c.put(1, torch.ones(3, 2))
        c.end_batch()
    assert c.result().shape == (6, 2, 2)
    c.put(0, torch.zeros(1, 2))
    with pytest.raises(ModelContractError, match=r"layers \[1\]"):
        c.end_batch()
