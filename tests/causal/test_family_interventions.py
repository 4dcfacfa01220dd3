"""Interventions on every kind of family (issue 8): GPT-J and OPT, whose ``hook_pattern`` is read-only (it fires
after the attention output), a hybrid (Jamba: attention layers 1 and 3 only, Mamba layers 0 and 2) and a Llama.

Each tiny random model carries a planted first-token spike (a permanent hook adds ``SPIKE_VALUES`` to the first
token's ``hook_resid_post`` of layer 0), so every ablation has something to remove. The value ablation is checked
against the same edit made by hand on ``hook_z`` (z_t -= A[t, 1] v_1 with A and v_1 of the unchanged pass, exact
because only one layer is ablated), on both the pattern-live and the read-only-pattern families.
"""

import warnings

import pytest
import torch

from analysis import load_model
from analysis.causal.conditions import run_condition
from analysis.model.families import get_family
from analysis.model.hooks import ModelContractError, act_name, kv_view, model_device, per_query_head
from analysis.causal.interventions import ValueRemoval, first_key_ablation, spike_ablation, value_ablation
from tests.families import make_family_dir
from tests.planted import SPIKE_DIMS, _add_spike

FAMILIES = ["gptj", "opt", "jamba", "llama"]
N, T = 4, 12


@pytest.fixture(scope="module")
def spiked(tmp_path_factory, device):
    """family -> its tiny model with the planted first-token spike after layer 0."""
    root, cache = tmp_path_factory.mktemp("family-interventions"), {}

    def get(family: str):
        if family not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = load_model(str(make_family_dir(family, root / family)), device=device)
            model.add_perma_hook("blocks.0.hook_resid_post", _add_spike(+1.0))
            cache[family] = model
        return cache[family]

    return get


@pytest.fixture(scope="module")
def toks():
    return torch.randint(3, 96, (N, T), generator=torch.Generator().manual_seed(0))


def _loss(model, toks, hooks=()) -> float:
    toks = toks.to(model_device(model))
    with torch.inference_mode():
        logits = model.run_with_hooks(toks, fwd_hooks=list(hooks))
    return float(
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), toks[:, 1:].reshape(-1))
    )


def _by_hand(model, toks, layer: int, heads: list[int], first_query: bool = True, v_mean=None) -> float:
    """The loss with z_t -= A[t, 1] (v_1 - v_mean) in ``heads`` of ``layer``, A and v_1 from the unchanged pass."""
    dims = model.cfg
    kept = {}

    def keep(name):
        def fn(x, hook):
            kept[name] = x.detach().clone()

        return fn

    _loss(model, toks, [(act_name("pattern", layer), keep("p")), (act_name("v", layer), keep("v"))])
    a1 = kept["p"][:, heads, :, 0]  # (N, h, T)
    v1 = per_query_head(kv_view(kept["v"], dims.n_key_value_heads or dims.n_heads), dims.n_heads)[:, 0, heads]
    if v_mean is not None:
        v1 = v1 - v_mean.to(v1)
    contrib = a1.permute(0, 2, 1)[..., None] * v1[:, None]  # (N, T, h, d)
    if not first_query:
        contrib[:, 0] = 0

    def edit(z, hook):
        z = z.clone()
        z[:, :, heads] -= contrib
        return z

    return _loss(model, toks, [(act_name("z", layer), edit)])


@pytest.mark.parametrize("family", FAMILIES)
def test_value_ablation_equals_the_edit_by_hand(family, spiked, toks):
    model = spiked(family)
    spec = get_family(model)
    layer = spec.attention_layers[0]
    heads = [0, 1]  # Jamba: 4 query heads on 2 KV heads, so heads 0 and 1 are one whole KV group
    r = value_ablation(model, toks, sink_heads=[(layer, h) for h in heads], all_heads=False)
    s = r.conditions.set_index("condition")
    assert s.loc["baseline", "loss"] == pytest.approx(_loss(model, toks), rel=1e-5)
    for cond, fq in (("sink_heads", True), ("sink_heads_later", False)):
        assert s.loc[cond, "loss"] == pytest.approx(_by_hand(model, toks, layer, heads, fq), rel=1e-5, abs=1e-6), cond
        assert abs(s.loc[cond, "delta_loss"]) > 1e-6, cond  # the edit reached the output
    assert list(r.heads["layer"]) == [layer, layer]


@pytest.mark.parametrize("family", ["llama", "jamba"])
def test_value_edit_on_hook_v_equals_the_pattern_edit(family, spiked, toks):
    """The read-only-pattern path (v_1 edited at hook_v) gives the pattern path's loss and attention (Llama, whose
    pattern is live, runs both); the mean condition too."""
    model = spiked(family)
    layer = get_family(model).attention_layers[-1]
    heads = [(layer, 0), (layer, 1)]
    v_mean = {layer: torch.randn(N, model.cfg.n_heads, model.cfg.d_head, generator=torch.Generator().manual_seed(1))}
    v_mean[layer][:, 1] = v_mean[layer][:, 0]  # one KV group shares its value
    if family == "jamba":
        assert not get_family(model).pattern_live
        by_hand = _by_hand(model, toks, layer, [0, 1], True, v_mean[layer][:, [0, 1]])
        removal = ValueRemoval(model, heads, mode="mean", v_mean=v_mean)
        got = run_condition(model, toks, hooks=removal.hooks(), on_batch_start=removal.start)
        assert got.loss == pytest.approx(by_hand, rel=1e-5)
        return
    for mode in ("zero", "mean"):
        for fq in (True, False):
            live = ValueRemoval(model, heads, mode=mode, v_mean=v_mean, first_query=fq)
            on_v = ValueRemoval(model, heads, mode=mode, v_mean=v_mean, first_query=fq)
            on_v.live = False
            a = run_condition(model, toks, hooks=live.hooks(), on_batch_start=live.start)
            b = run_condition(model, toks, hooks=on_v.hooks(), on_batch_start=on_v.start)
            assert a.loss == pytest.approx(b.loss, rel=1e-5) and torch.allclose(a.alpha, b.alpha, atol=1e-5), (mode, fq)


def test_value_ablation_refuses_part_of_a_kv_group_and_mamba_layers(spiked, toks):
    model = spiked("jamba")  # hook_pattern read-only, hook_v holds 2 KV heads for 4 query heads
    with pytest.raises(ModelContractError, match="whole groups"):
        value_ablation(model, toks, sink_heads=[(2, 0)], all_heads=False, later=False)  # Jamba-v0.1: attention at 2
    with pytest.raises(ValueError, match="not an attention layer"):
        value_ablation(model, toks, sink_heads=[(3, 0)])


@pytest.mark.parametrize("family", FAMILIES)
def test_spike_ablation_on_every_family(family, spiked, toks):
    model = spiked(family)
    spec = get_family(model)
    r = spike_ablation(model, toks, spike_dims={0: SPIKE_DIMS})
    s = r.conditions.set_index("condition")
    assert r.has_spike and r.means["0:7"] == pytest.approx(400.0, abs=5.0)
    assert abs(s.loc["zero", "delta_loss"]) > 1e-4  # removing a 400-sized spike changes the output
    assert abs(s.loc["mean", "delta_loss"]) < 0.5 * abs(s.loc["zero", "delta_loss"])  # its mean barely does
    assert list(r.per_layer["layer"]) == list(spec.attention_layers)  # true indices (Jamba: [1, 3])
    assert (spec.skipped_layers != {}) == ("skipped" in r.message)


@pytest.mark.parametrize("family", FAMILIES)
def test_first_key_ablation_on_every_family(family, spiked, toks):
    model = spiked(family)
    spec = get_family(model)
    r = first_key_ablation(model, toks, spike_dims=SPIKE_DIMS)
    assert r.has_spike and r.layers == list(spec.attention_layers)  # one list of dims: every attention layer
    pl = r.per_layer.set_index(["condition", "layer"])
    l = next(l for l in r.layers if l >= 1)  # a layer whose input carries the spike (it is added after layer 0)
    # the edited first key reached the attention (random weights: a small change, but an unchanged pass gives 0 exactly)
    assert abs(pl.loc[("ablated", l), "first"] - pl.loc[("baseline", l), "first"]) > 1e-6
    assert sorted(set(r.per_layer["layer"])) == list(spec.attention_layers)
