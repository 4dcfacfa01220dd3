"""Causal tests: on the planted model the answers are known by construction; on SmolLM2 the contrasts
(zero vs mean, value removed vs set to its mean, first key without its spike part) are computed."""

import json

import pytest
import torch

from tests.families import FAMILIES
from tests.planted import SPIKE_DIMS, SPIKE_VALUES, planted, planted_nospike, planted_tokens  # noqa: F401

from analysis.causal.conditions import run_condition, where_shares
from analysis.model.hooks import act_name
from analysis.model.families import get_family
from analysis.causal.interventions import first_key_ablation, spike_ablation, value_ablation
from analysis.sinks.metric import sink_metric


@pytest.fixture(scope="module")
def toks():
    return planted_tokens(8, 24)


def test_run_condition_matches_sink_metric(planted, toks):
    r = run_condition(planted, toks)
    assert r.sink_rate(1) == pytest.approx(sink_metric(planted, toks).sink_rate(1))
    assert torch.allclose(r.where.sum(-1), torch.ones_like(r.where.sum(-1)), atol=1e-4)


def test_where_shares_categories():
    T = 6
    p = torch.zeros(1, 1, T, T)
    for t in range(T):
        p[0, 0, t, max(t - 1, 0)] = 1.0  # previous-token head
    w = where_shares(p)[0, 0] / (T - 2)
    assert w.tolist() == pytest.approx([0, 1, 0, 0])
    p = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    w = where_shares(p[None, None])[0, 0]
    assert float(w.sum()) == pytest.approx(T - 2)


def test_spike_ablation_planted(planted, toks):
    r = spike_ablation(planted, toks)
    assert r.has_spike and r.spike_dims == {0: SPIKE_DIMS, 1: SPIKE_DIMS}
    s = r.conditions.set_index("condition")
    assert s.loc["baseline", "sink_1_pct"] == pytest.approx(50.0)  # layers 1 and 2 of 4, all heads
    assert s.loc["zero", "sink_1_pct"] < 10
    assert s.loc["mean", "sink_1_pct"] == pytest.approx(s.loc["baseline", "sink_1_pct"])
    assert abs(s.loc["mean", "delta_loss"]) < 1e-3
    pl = r.per_layer.set_index("layer")
    assert pl.loc[1, "baseline"] == 100 and pl.loc[1, "zero"] == 0
    assert r.means["0:7"] == pytest.approx(SPIKE_VALUES[7], abs=0.5)
    assert r.means["1:21"] == pytest.approx(SPIKE_VALUES[21], abs=0.5)
    json.loads(json.dumps(r.to_dict()))
    assert "Sink_1" in r.text()


def test_spike_ablation_where_appear(planted, toks):
    r = spike_ablation(planted, toks, where="appear")
    assert r.spike_dims == {0: SPIKE_DIMS}
    assert r.conditions.set_index("condition").loc["zero", "sink_1_pct"] < 10


def test_spike_ablation_without_spike(planted_nospike, toks):
    r = spike_ablation(planted_nospike, toks)
    assert not r.has_spike and list(r.conditions["condition"]) == ["baseline"]
    assert "no spike" in r.text()
    json.dumps(r.to_dict())


def test_spike_ablation_bad_input(planted, toks):
    with pytest.raises(ValueError, match="dict"):
        spike_ablation(planted, toks, spike_dims=[7, 21])
    with pytest.raises(ValueError, match="out of range"):
        spike_ablation(planted, toks, spike_dims={9: [7]})
    with pytest.raises(ValueError, match="out of range"):
        spike_ablation(planted, toks, spike_dims={0: [640]})
    with pytest.raises(ValueError, match="where"):
        spike_ablation(planted, toks, where="somewhere")
    with pytest.raises(ValueError, match="at least 2"):
        spike_ablation(planted, toks[:1])


def test_value_ablation_planted(planted, toks):
    r = value_ablation(planted, toks)
    assert r.sink_heads == planted.planted.sink_heads
    s = r.conditions.set_index("condition")
    assert abs(s.loc["sink_heads", "delta_loss"]) < 1e-3  # W_V ignores the spike dims: v_1 ~ 0
    assert abs(s.loc["sink_heads_mean", "delta_loss"]) < 1e-3
    h = r.heads
    assert (h["v1_norm"] < 0.01 * h["v_other_norm"]).all() and (h["alpha_1"] > 0.99).all()
    json.loads(json.dumps(r.to_dict()))


def test_value_ablation_given_heads_and_bad_heads(planted, toks):
    r = value_ablation(planted, toks, sink_heads=[(1, 0), (2, 3)], all_heads=False)
    assert r.sink_heads == [(1, 0), (2, 3)] and list(r.heads["head"]) == [0, 3]
    assert "all_heads" not in set(r.conditions["condition"])
    with pytest.raises(ValueError, match="out of range"):
        value_ablation(planted, toks, sink_heads=[(1, 9)])
    with pytest.raises(ValueError, match="pairs"):
        value_ablation(planted, toks, sink_heads=[1])


def test_value_ablation_no_sink_heads(planted_nospike, toks):
    r = value_ablation(planted_nospike, toks)
    assert r.sink_heads == [] and "no sink heads" in r.text()
    json.dumps(r.to_dict())


def test_first_key_ablation_planted(planted, toks):
    r = first_key_ablation(planted, toks)
    assert r.layers == list(planted.planted.sink_layers) and r.spike_dims == {1: SPIKE_DIMS, 2: SPIKE_DIMS}
    s = r.conditions.set_index("condition")
    assert s.loc["baseline", "first"] > 0.99 and s.loc["ablated", "first"] < 0.2
    assert s.loc["baseline", "sink_1"] == 100 and s.loc["ablated", "sink_1"] < 20
    # The attention goes back to the ordinary keys, as in the layers without a sink (layer 0).
    pl = r.per_layer.set_index(["condition", "layer"])
    assert pl.loc[("ablated", 1), "other"] > 0.5
    json.loads(json.dumps(r.to_dict()))
    assert "first token" in r.text()


def test_first_key_ablation_without_spike(planted_nospike, toks):
    r = first_key_ablation(planted_nospike, toks)
    assert not r.has_spike and r.layers == [] and "no spike" in r.text()


def test_first_key_ablation_given_dims(planted, toks):
    r = first_key_ablation(planted, toks, layers=[1], spike_dims=SPIKE_DIMS)
    assert r.layers == [1]
    pl = r.per_layer.set_index(["condition", "layer"])
    assert pl.loc[("ablated", 1), "sink_1"] < 20 and pl.loc[("ablated", 2), "first"] > 0.9  # layer 2 untouched
    with pytest.raises(ValueError, match="out of range"):
        first_key_ablation(planted, toks, layers=[7], spike_dims=SPIKE_DIMS)


# ----- the embedded SmolLM2 -----


@pytest.fixture(scope="module")
def smol(smollm2):
    from analysis import natural_probe
    from analysis.chain.massive import massive_activations

    toks = natural_probe(smollm2.tokenizer, n=8, T=32).tokens
    ma = massive_activations(smollm2, toks, ratio_threshold=100.0)
    return toks, ma


def test_smollm2_zero_vs_mean(smollm2, smol):
    toks, ma = smol
    r = spike_ablation(smollm2, toks, spike_dims=ma.first_token_dims)
    s = r.conditions.set_index("condition")
    d_zero = s.loc["zero", "sink_1_pct"] - s.loc["baseline", "sink_1_pct"]
    d_mean = s.loc["mean", "sink_1_pct"] - s.loc["baseline", "sink_1_pct"]
    assert d_zero < -20 and abs(d_zero) > 5 * abs(d_mean)
    assert s.loc["zero", "delta_loss"] > 0.5 and abs(s.loc["mean", "delta_loss"]) < 0.1 * s.loc["zero", "delta_loss"]


def test_smollm2_first_value_is_a_constant(smollm2, smol):
    toks, _ = smol
    r = value_ablation(smollm2, toks, all_heads=False)
    assert len(r.sink_heads) > 50
    s = r.conditions.set_index("condition")
    # Whatever zeroing v_1 does, setting it to its mean over the other inputs does far less.
    assert abs(s.loc["sink_heads_mean", "delta_loss"]) < 0.2 * abs(s.loc["sink_heads", "delta_loss"])
    assert (r.heads["v1_norm"] < r.heads["v_other_norm"]).mean() > 0.8


def test_smollm2_first_key_without_spike(smollm2, smol):
    toks, ma = smol
    r = first_key_ablation(smollm2, toks, spike_dims=ma.input_dims(smollm2.cfg.n_layers))
    s = r.conditions.set_index("condition")
    assert s.loc["ablated", "first"] < s.loc["baseline", "first"] - 0.1
    assert s.loc["ablated", "sink_1"] < s.loc["baseline", "sink_1"] - 20


def test_layernorm_and_reference_models_run(device):
    """LayerNorm (GPT-2: no rotary, no GQA, biases) and this package's own model: every intervention runs."""
    from analysis.model.reference.config import ModelConfig
    from analysis.model.reference.sink_lm import SinkLM
    from tests.planted import FADE_LAYER, FIRST_LAYER, _add_spike, planted_ln_model

    torch.manual_seed(0)
    ref = (
        SinkLM(
            ModelConfig(
                d_vocab=100, n_ctx=64, d_model=64, n_layers=4, n_heads=4, n_key_value_heads=2, normalization_type="LN"
            )
        )
        .eval()
        .to(device)
    )
    ref.add_perma_hook(f"blocks.{FIRST_LAYER}.hook_resid_post", _add_spike(+1.0))
    ref.add_perma_hook(f"blocks.{FADE_LAYER}.hook_resid_post", _add_spike(-1.0))
    toks = planted_tokens(4, 16)
    for m in (planted_ln_model("gpt2", device=device), ref):
        s = spike_ablation(m, toks)
        assert s.spike_dims == {0: SPIKE_DIMS, 1: SPIKE_DIMS}
        assert abs(s.conditions.set_index("condition").loc["mean", "delta_loss"]) < 1e-2
        f = first_key_ablation(m, toks)
        assert f.layers == [1, 2] and f.has_spike
        v = value_ablation(m, toks, sink_heads=[(1, 0), (2, 1)], all_heads=False)
        assert len(v.conditions) == 4


# ----------------------------------------------------------------------------------------------
# Resumed condition passes: the blocks before the first one an intervention touches are not run
# ----------------------------------------------------------------------------------------------


class _Calls:
    """Counts the forward calls of one module (a forward hook on it)."""

    def __init__(self, module):
        self.n, self.handle = 0, module.register_forward_hook(self.count)

    def count(self, module, args, out):
        self.n += 1


def _whole_and_resumed(model, toks, hooks, base):
    """The condition ``hooks`` as a whole pass and resumed from ``base``; and how often block 0 ran in the latter."""
    full = run_condition(model, toks, hooks=hooks, batch_size=4)
    calls = _Calls(model.blocks[0].original_component)
    try:
        part = run_condition(model, toks, hooks=hooks, batch_size=4, baseline=base)
    finally:
        calls.handle.remove()
    return full, part, calls.n


def _with_resid(model, toks, base, layers, batch_size):
    from analysis.engine.passes import ResidCapture, run_pass

    base.resid = run_pass(model, toks, [ResidCapture(layers)], batch_size=batch_size)[0]
    return base


def test_smollm2_resumed_interventions_equal_full_passes(smollm2, smol):
    """The report's three interventions with passes resumed at the first block their hooks touch (from the baseline's
    residual there) give the tables of whole passes, and block 0 does not run in them."""
    from analysis.causal.conditions import baseline_pass
    from analysis.causal.interventions import resume_layers

    toks, ma = smol
    spikes, inputs = ma.first_token_dims, ma.input_dims(smollm2.cfg.n_layers)
    base = baseline_pass(smollm2, toks, batch_size=4)
    layers = resume_layers(smollm2, base, spikes, inputs)
    assert layers and min(layers) >= 1  # SmolLM2: sink heads from layer 2, spikes from layer 11
    resumed = _with_resid(smollm2, toks, baseline_pass(smollm2, toks, batch_size=4), layers, 4)
    runs = {
        "spike": lambda b: spike_ablation(smollm2, toks, spike_dims=spikes, baseline=b, batch_size=4),
        "value": lambda b: value_ablation(smollm2, toks, all_heads=False, later=False, baseline=b, batch_size=4),
        "first_key": lambda b: first_key_ablation(smollm2, toks, spike_dims=inputs, baseline=b, batch_size=4),
    }
    for name, run in runs.items():
        full = run(base)
        calls = _Calls(smollm2.blocks[0].original_component)
        try:
            part = run(resumed)
        finally:
            calls.handle.remove()
        assert calls.n == 0, name  # the resumed passes skip block 0
        a, b = full.conditions.set_index("condition"), part.conditions.set_index("condition")
        assert list(a.index) == list(b.index) and len(a) >= 2, name
        assert (a - b).abs().max().max() < 1e-5, name
        for c, r in getattr(full, "results", {}).items():
            assert torch.allclose(r.alpha, part.results[c].alpha, atol=1e-5) and torch.allclose(
                r.where, part.results[c].where, atol=1e-5
            )


def test_a_hook_on_the_stream_a_pass_resumes_from_is_applied_to_it(family_bridge):
    """An edit of block s-1's output (hook_resid_post) lets the pass resume at block s: the edit is applied to the
    kept residual, block s-1 does not run, and the pass equals the whole one."""
    from analysis.causal.conditions import baseline_pass

    model = family_bridge("llama")
    toks = torch.randint(3, 90, (6, 16), generator=torch.Generator().manual_seed(1))
    base = _with_resid(model, toks, baseline_pass(model, toks, batch_size=4), [1], 4)
    hooks = [(act_name("resid_post", 0), lambda x, hook: torch.cat([x[..., :8] * 4, x[..., 8:]], -1))]
    full, part, block0_runs = _whole_and_resumed(model, toks, hooks, base)
    assert block0_runs == 0 and part.layers == full.layers
    assert torch.allclose(full.alpha, part.alpha, atol=1e-5) and part.loss == pytest.approx(full.loss, abs=1e-5)
    assert abs(part.loss - base.run.loss) > 1e-3  # the edit did change the pass


@pytest.mark.parametrize("family", FAMILIES)
def test_resumed_pass_equals_full_pass_on_every_resumable_family(family, family_bridge):
    """A condition resumed at block s (its hook's block) equals the whole pass: alpha, shares and loss, on each
    resumable family's tiny model; the blocks before s do not run. The others cannot resume."""
    from analysis.model.families import RESUMABLE, get_family
    from analysis.engine.passes import can_resume
    from analysis.causal.conditions import baseline_pass

    model = family_bridge(family)
    if get_family(model).family not in RESUMABLE:
        # BLOOM's blocks take ALiBi and the mask from the model; Bamba's blocks take more than the residual stream
        assert family in ("bloom", "bamba") and not can_resume(model)
        return
    toks = torch.randint(3, 90, (6, 16), generator=torch.Generator().manual_seed(0))
    last = max(get_family(model).attention_layers) + 1  # resuming after the last attention layer leaves no pattern
    base = _with_resid(model, toks, baseline_pass(model, toks, batch_size=4), range(1, last), 4)
    for s in range(1, last):
        hooks = [(act_name("resid_pre", s), lambda x, hook: x * 0.5)]
        full, part, block0_runs = _whole_and_resumed(model, toks, hooks, base)
        assert block0_runs == 0
        assert part.layers == full.layers
        assert torch.allclose(full.alpha, part.alpha, atol=1e-5) and torch.allclose(full.where, part.where, atol=1e-5)
        assert part.loss == pytest.approx(full.loss, abs=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_resumed_pass_through_auto_runs_on_the_hf_forward_and_equals_the_bridges(family, family_bridge):
    """Through ``auto`` a condition resumed at block s runs where the whole pass would (the Hugging Face forward but
    for the families refused there), its blocks before s skipped; its alpha, shares and loss equal the bridge's."""
    from analysis.causal.conditions import baseline_pass
    from analysis.engine.backends import choose_backend
    from analysis.engine.passes import can_resume, pass_log

    model = family_bridge(family)
    if not can_resume(model):
        return
    toks = torch.randint(3, 90, (6, 16), generator=torch.Generator().manual_seed(0))
    s = max(get_family(model).attention_layers)
    base = _with_resid(model, toks, baseline_pass(model, toks, batch_size=4), [s], 4)
    hooks = [(act_name("resid_pre", s), lambda x, hook: x * 0.5)]
    bridge, hf, calls = _whole_and_resumed(model, toks, hooks, base)[1], None, None
    model.pass_backend = "auto"
    try:
        with pass_log() as log:
            calls = _Calls(model.blocks[0].original_component)
            hf = run_condition(model, toks, hooks=hooks, batch_size=4, baseline=base)
    finally:
        model.pass_backend = "transformer_lens"
        if calls is not None:
            calls.handle.remove()
    names = [act_name("pattern", l) for l in get_family(model).attention_layers if l >= s]
    whole = choose_backend(model, backend="auto", names=names, edits=[n for n, _ in hooks])  # the pass from block 0
    assert calls.n == 0 and list(log) == [": ".join(whole)], log
    assert part_equal(bridge, hf)


def part_equal(a, b) -> bool:
    return (
        a.layers == b.layers
        and torch.allclose(a.alpha, b.alpha, atol=1e-5)
        and torch.allclose(a.where, b.where, atol=1e-5)
        and a.loss == pytest.approx(b.loss, abs=1e-5)
    )


def test_resume_refuses_early_hooks_and_other_models(family_bridge):
    """Hooks before the resumed block would see no activations: ValueError; a model that cannot resume (BLOOM,
    whose blocks take ALiBi from the model) raises instead of running wrong, and its conditions run whole."""
    from analysis.model.hooks import ModelContractError
    from analysis.engine.passes import Resume, can_resume, run_pass
    from analysis.causal.conditions import baseline_pass

    model = family_bridge("llama")
    toks = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    resid = torch.zeros(2, 8, model.cfg.d_model)
    with pytest.raises(ValueError, match="before layer 1"):
        run_pass(model, toks, [], fwd_hooks=[("blocks.0.hook_resid_mid", lambda x, hook: x)], resume=Resume(1, resid))
    bloom = family_bridge("bloom")
    assert can_resume(model) and not can_resume(bloom)
    with pytest.raises(ModelContractError):
        run_pass(bloom, toks, [], resume=Resume(1, resid))
    base = _with_resid(bloom, toks, baseline_pass(bloom, toks), [1], None)
    hooks = [("blocks.1.hook_resid_pre", lambda x, hook: x * 0.5)]
    resumed = run_condition(bloom, toks, hooks=hooks, baseline=base)
    assert resumed.loss == pytest.approx(run_condition(bloom, toks, hooks=hooks).loss)
