"""One profile pass gives the same numbers as each analysis run alone; the hook contract's helpers."""

import pandas as pd
import pytest
import torch

from analysis import profile
from analysis.causal.conditions import run_condition
from analysis.model.hooks import ModelContractError, act_name, kv_view, per_query_head
from analysis.causal.interventions import spike_ablation, value_ablation
from analysis.chain.key_manifold import first_key_manifold
from analysis.chain.massive import massive_activations
from analysis.engine.passes import Accumulator, LayerCollector, run_pass
from analysis.chain.qk import qk_angles
from analysis.sinks.metric import sink_metric
from analysis.chain.values import value_norms
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


def test_profile_spike_origin_equals_the_analysis_alone(planted, probes, prof):
    """The origin fed by the profile pass (spike dims from its massive activations) equals spike_origin run alone."""
    from analysis.chain.spike_writers import spike_origin

    alone = spike_origin(planted, probes["natural"], batch_size=4)
    assert prof.origin.dims == alone.dims == planted.planted.spike_dims
    pd.testing.assert_frame_equal(prof.origin.writes, alone.writes)
    assert torch.equal(prof.origin.trace.resid, alone.trace.resid) and torch.equal(
        prof.origin.trace.mlp, alone.trace.mlp
    )
    # the planted spike is added by a hook on the stream, not written by a block: the bookkeeping says so
    assert (prof.origin.bookkeeping.rel_err > 1e-3).all() and "does not add up" in prof.origin.text()


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
        return {
            l: {
                "q": act_name("q", l),
                "v": act_name("v", l),
                "pattern": act_name("pattern", l),
                "resid": act_name("resid_pre", l),
            }
            for l in (0, 1)
        }

    def update(self, layer, acts, batch):
        self.seen.append((layer, sorted(acts), acts["v"].shape[2], batch.offset))

    def result(self):
        return self.seen


def test_joint_reducer_hands_one_layer_over_together(planted):
    seen = run_pass(planted, planted_tokens(5, 8), [_Seen()], batch_size=3)[0]
    assert seen == [
        (0, ["pattern", "q", "resid", "v"], 2, 0),
        (1, ["pattern", "q", "resid", "v"], 2, 0),
        (0, ["pattern", "q", "resid", "v"], 2, 3),
        (1, ["pattern", "q", "resid", "v"], 2, 3),
    ]


def test_accumulators_of_one_layer_share_its_unit_vectors(planted):
    """Two accumulators fed the same layer get one LayerActs scratch: ``units`` of the same key tensor is computed
    once (the same objects) and equals unit_vectors."""
    from analysis.core.stats import unit_vectors

    class Units(Accumulator):
        def __init__(self):
            self.got = []

        def hooks(self):
            return {l: {"k": act_name("k", l)} for l in (0, 1)}

        def update(self, layer, acts, batch):
            self.got.append((layer, batch.offset, acts.units(acts["k"]), unit_vectors(acts["k"].float())))

        def result(self):
            return self.got

    a, b = run_pass(planted, planted_tokens(4, 8), [Units(), Units()], batch_size=2)
    assert len(a) == len(b) == 4
    for (la, oa, ua, ref), (lb, ob, ub, _) in zip(a, b):
        assert (la, oa) == (lb, ob) and ua[0] is ub[0] and ua[1] is ub[1]
        assert torch.equal(ua[0], ref[0]) and torch.equal(ua[1], ref[1])


def test_a_hook_that_never_fires_is_an_error_unless_optional(device):
    """Reference models without rotary list hook_rot_k but never run it."""
    from analysis.train import ModelConfig, SinkLM

    model = (
        SinkLM(
            ModelConfig(
                d_vocab=32,
                n_ctx=16,
                d_model=32,
                n_layers=1,
                n_heads=2,
                n_key_value_heads=2,
                d_head=16,
                d_mlp=64,
                positional_embedding_type="none",
            )
        )
        .to(device)
        .eval()
    )

    class Never(_Seen):
        def hooks(self):
            return {0: {"rot_k": act_name("rot_k", 0), "k": act_name("k", 0), "v": act_name("v", 0)}}

    with pytest.raises(ModelContractError, match=r"hooks \['blocks.0.attn.hook_rot_k'\] did not fire"):
        run_pass(model, torch.randint(0, 32, (2, 8)), [Never()])

    class Optional(Never):
        optional_keys = frozenset({"rot_k"})

    seen = run_pass(model, torch.randint(0, 32, (2, 8)), [Optional()])[0]
    assert seen == [(0, ["k", "v"], 2, 0)]


def test_kv_view_undoes_the_repetition_of_kv_heads():
    k = torch.randn(2, 5, 3, 4)
    assert torch.equal(kv_view(per_query_head(k, 6), 3), k) and torch.equal(kv_view(k, 3), k)
    with pytest.raises(ModelContractError):
        kv_view(torch.randn(2, 5, 4, 4), 3)
    assert (
        act_name("pattern", 2) == "blocks.2.attn.hook_pattern"
        and act_name("normalized", 0) == "blocks.0.ln1.hook_normalized"
    )
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


# ----------------------------------------------------------------------------------------------
# Resume points: the main pass keeps the residual entering its blocks; later passes start there
# ----------------------------------------------------------------------------------------------


def test_checkpoint_layers_fit_the_budget():
    from analysis.engine.passes import checkpoint_layers, resume_from

    mib = 2**20
    assert checkpoint_layers(30, 4 * mib, 256) == list(range(1, 30))  # all 29 fit (116 MiB)
    assert checkpoint_layers(30, 4 * mib, 40) == [3, 6, 9, 12, 15, 18, 21, 24, 27]  # 10 fit: every 3rd (9 kept)
    assert checkpoint_layers(30, 4 * mib, 3) == [] and checkpoint_layers(1, mib, 256) == []
    for n, budget in ((30, 40), (7, 9), (12, 100)):
        kept = checkpoint_layers(n, 4 * mib, budget)
        assert len(kept) * 4 <= budget and all(0 < b < n for b in kept)
    resid = {3: torch.zeros(1), 6: torch.ones(1)}
    assert resume_from(resid, 5).layer == 3 and resume_from(resid, 6).layer == 6 and resume_from(resid, 40).layer == 6
    assert resume_from(resid, 2) is None and resume_from({}, 9) is None and resume_from(None, 9) is None


def test_profile_keeps_the_residual_its_passes_resume_from(planted, probes, prof):
    """Profile.resid equals the residual entering each block (a capture pass of its own), the baseline carries it,
    and a small budget keeps every s-th block."""
    from analysis.engine.passes import ResidCapture

    nat = probes["natural"]
    n = planted.cfg.n_layers
    assert sorted(prof.resid) == list(range(1, n)) and prof.baseline.resid.keys() == prof.resid.keys()
    alone = run_pass(planted, nat, [ResidCapture(range(1, n))], batch_size=4)[0]
    for b in range(1, n):
        assert torch.equal(prof.resid[b], alone[b]) and prof.resid[b].shape == (*nat.shape, planted.cfg.d_model)
    block = nat.numel() * planted.cfg.d_model * 4 / 2**20
    small = profile(planted, {"natural": nat}, analyses=("resid",), batch_size=4, resid_budget_mib=1.5 * block)
    assert sorted(small.resid) == [3]  # 1 block fits: every 3rd of blocks 1..3
    none = profile(planted, {"natural": nat}, analyses=("sink",), batch_size=4)
    assert none.resid == {} and none.baseline is None


def test_passes_resume_at_the_last_kept_block_and_equal_whole_passes(planted, probes, prof):
    """A condition whose hooks start at block 3 resumes at block 2 when only 2 is kept; norm_gain_trace resumes at its
    layer. Both equal whole passes, and block 0 does not run."""
    import dataclasses
    import warnings

    from analysis.chain.norm_gain import norm_gain_trace

    nat = probes["natural"]
    calls = []
    handle = planted.blocks[0].original_component.register_forward_hook(lambda *a: calls.append(1))
    try:
        hooks = [(act_name("resid_pre", 3), lambda x, hook: x * 0.5)]
        only2 = dataclasses.replace(prof.baseline, resid={2: prof.resid[2]})
        part = run_condition(planted, nat, hooks=hooks, batch_size=4, baseline=only2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = norm_gain_trace(planted, nat, 2, spike_dims=[7, 21], batch_size=4, resid=prof.resid)
    finally:
        handle.remove()
    assert calls == []
    full = run_condition(planted, nat, hooks=hooks, batch_size=4)
    assert torch.allclose(full.alpha, part.alpha, atol=1e-5) and part.loss == pytest.approx(full.loss, abs=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = norm_gain_trace(planted, nat, 2, spike_dims=[7, 21], batch_size=4)
    pd.testing.assert_frame_equal(traced.stages, whole.stages, rtol=1e-5)
    pd.testing.assert_frame_equal(traced.heads, whole.heads, rtol=1e-5)


def test_conditions_stacked_in_one_pass_equal_a_pass_each(planted, probes, prof):
    """Three conditions (the stream entering block 3 scaled by 0.5, 1 and 2) as one pass over the sequences repeated
    three times (run_condition's ``groups``, as the writer cuts run), in batches of 5 that split the conditions,
    resumed at block 2: each condition's alpha, attention shares, loss and first-token loss equal its own pass."""
    import dataclasses

    nat = probes["natural"]
    N, scales, at = nat.shape[0], (0.5, 1.0, 2.0), {"offset": 0}
    base = dataclasses.replace(prof.baseline, resid={2: prof.resid[2]})

    def by_row(x, hook):
        x = x.clone()
        for c, s in enumerate(scales):
            lo, hi = max(c * N - at["offset"], 0), min((c + 1) * N - at["offset"], x.shape[0])
            x[lo : max(lo, hi)] *= s
        return x

    stacked = run_condition(
        planted,
        nat.repeat(3, 1),
        hooks=[(act_name("resid_pre", 3), by_row)],
        batch_size=5,
        on_batch_start=lambda b: at.update(offset=b.offset),
        baseline=base,
        groups=3,
    )
    assert len(stacked) == 3 and N % 5  # the batches cross the conditions' boundaries
    for s, got in zip(scales, stacked):
        want = run_condition(
            planted, nat, hooks=[(act_name("resid_pre", 3), lambda x, hook, s=s: x * s)], batch_size=4, baseline=base
        )
        assert got.alpha.shape == want.alpha.shape and torch.allclose(got.alpha, want.alpha, atol=1e-6)
        assert torch.allclose(got.where, want.where, atol=1e-6)
        assert got.loss == pytest.approx(want.loss, rel=1e-6)
        assert torch.allclose(got.loss_first, want.loss_first, atol=1e-5)
    assert abs(stacked[0].loss - stacked[2].loss) > 1e-3  # the conditions differ: the check can tell them apart
    with pytest.raises(ValueError, match="groups must divide"):
        run_condition(planted, nat, groups=N + 1)


def test_a_resume_read_once_per_condition_gives_the_tiled_rows_without_tiling():
    from analysis.engine.passes import Resume

    resid = torch.randn(4, 3, 2)
    once = Resume(2, resid, repeat=3)
    tiled = torch.cat([resid] * 3)
    for offset, size in [(0, 5), (3, 4), (7, 5), (11, 1)]:
        assert torch.equal(once.rows(offset, size), tiled[offset : offset + size])
    assert once.resid.data_ptr() == resid.data_ptr()  # kept as given: one copy whatever the number of conditions
