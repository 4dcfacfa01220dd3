"""What a sink does for its head: a head built by hand that is dormant exactly when it sinks; gradient x activation
against exact removal (a tiny model, SmolLM2); the output norm against Hugging Face's own o_proj; the reference
models (softmax, sigmoid, slot); bad input."""

import numpy as np
import pytest
import torch

from analysis import ModelContractError, load_model, probe_sets
from analysis.causal.attribution import attribution_check
from analysis.causal.dormant_heads import dormant_heads
from analysis.causal.head_removal import copy_queries, head_means, removal_effects
from tests.conftest import cpu_cache, tol

LAYER, HEAD = 1, 2  # the hand-built head of the tiny Llama (2 layers, 4 query heads, 2 KV heads, d_head 16)
N, T = 4, 16


@pytest.fixture(scope="module")
def toks():
    return torch.randint(3, 96, (N, T), generator=torch.Generator().manual_seed(0))


def _sinks_on_even_queries(model):
    """Hooks making head LAYER.HEAD dormant exactly when it sinks: its KV head's first value is zero, and its queries
    at even positions (0-based) put all their attention on the first token, the others none (renormalised over the
    rest). So the head's output is exactly zero at even queries and not elsewhere."""
    kv = HEAD // (model.cfg.n_heads // model.cfg.n_key_value_heads)

    def zero_first_value(v, hook):
        v = v.clone()
        v[:, 0, kv] = 0.0
        return v

    def drive(p, hook):
        p = p.clone()
        t = p.shape[-1]
        even = torch.arange(t, device=p.device) % 2 == 0
        row = p[:, HEAD]
        one_hot = torch.zeros_like(row)
        one_hot[..., 0] = 1.0
        rest = row.clone()
        rest[..., 0] = 0.0
        rest = rest / rest.sum(-1, keepdim=True).clamp_min(1e-12)
        rest[:, 0] = one_hot[:, 0]  # query 0 sees only the first token
        p[:, HEAD] = torch.where(even[None, :, None], one_hot, rest)
        return p

    return [(f"blocks.{LAYER}.attn.hook_v", zero_first_value), (f"blocks.{LAYER}.attn.hook_pattern", drive)]


@pytest.fixture(scope="module")
def handmade(tiny_llama, toks):
    """The tiny Llama with the hand-built head (hooks held for the whole analysis), and its DormantHeads."""
    with tiny_llama.hooks(fwd_hooks=_sinks_on_even_queries(tiny_llama)):
        res = dormant_heads(tiny_llama, toks, batch_size=3)
    return res


def test_handmade_head_is_dormant_exactly_when_it_sinks(handmade):
    res = handmade
    q = res.query_positions
    assert q == list(range(3, T - 1))  # queries that see at least 4 keys: uniform attention gives the sink <= 0.3
    even = torch.zeros(N, T, dtype=torch.bool)
    even[:, [t for t in q if t % 2 == 0]] = True
    assert torch.equal(res.sinking_mask(LAYER, HEAD), even)  # the known sinking queries
    assert torch.equal(res.quiet_mask(LAYER, HEAD), even)  # ... are exactly the dormant ones
    norm = res.out_norm[:, res.pos(LAYER), HEAD]
    odd = [t for t in q if t % 2]
    assert float(norm[even].abs().max()) < 1e-6 and float(norm[:, odd].min()) > 1e-4
    assert float(res.effect[:, res.pos(LAYER), HEAD][even].abs().max()) < 1e-7  # zero output: zero effect
    row = res.head_table().set_index(["layer", "head"]).loc[(LAYER, HEAD)]
    assert row.sinking_share == pytest.approx(0.5) and row.sink_attn == pytest.approx(0.5, abs=1e-6)
    assert row.quiet_if_sinking == 1.0 and row.quiet_if_other == 0.0
    assert row.inert_if_sinking == 1.0 and row.inert_if_other == 0.0
    assert row.rho_norm < -0.8 and row.r_norm < -0.5 and row.rho_effect < -0.8  # the correlation's sign
    assert (LAYER, HEAD) in res.example_heads(4)
    # The other heads of the layer were left alone: no head there sinks on exactly the even queries.
    for h in set(range(4)) - {HEAD}:
        assert not torch.equal(res.sinking_mask(LAYER, h), even)


def test_handmade_head_result_protocol(handmade):
    res = handmade
    d = res.to_dict()
    assert d["n_samples"] == N and d["T"] == T and d["sink_positions"] == [0] and d["layers"] == [0, 1]
    assert len(d["heads"]) == 8 and set(d["verdict"]) == {"norm", "effect", "effect_mean"}
    assert "per-query" not in d and "sink_attn" not in d  # no per-query tensors in the JSON
    assert res.tables["heads"].shape[0] == 8
    text = res.text()
    assert "1 of 8 heads put more than 0.3" in text and "quiet" in text and "clearly the ones" in text
    df = res.queries(LAYER, HEAD)
    assert len(df) == N * len(res.query_positions)
    assert set(df.columns) >= {"sample", "query", "sink_attn", "out_norm", "effect", "effect_mean"}


def test_output_norm_equals_hugging_face_o_proj(tiny_llama, toks, device):
    """|z_t^h W_O^h| against the head's slice of Hugging Face's o_proj applied to hook_z by hand."""
    res = dormant_heads(tiny_llama, toks, mean_ablation=False)
    _, cache = cpu_cache(tiny_llama, toks)
    d = tiny_llama.cfg.d_head
    for l in (0, 1):
        W = tiny_llama.original_model.model.layers[l].self_attn.o_proj.weight.detach().cpu()  # (D, H * d)
        z = cache[f"blocks.{l}.attn.hook_z"]  # (N, T, H, d)
        for h in range(4):
            ref = (z[:, :, h] @ W[:, h * d : (h + 1) * d].T).norm(dim=-1)  # (N, T)
            assert torch.allclose(res.out_norm[:, l, h], ref, rtol=1e-4, atol=tol(device, 1e-6))
        pattern = cache[f"blocks.{l}.attn.hook_pattern"]
        assert torch.allclose(res.sink_attn[:, l], pattern[..., 0], atol=tol(device, 1e-6))


def test_attribution_close_to_exact_removal_on_a_tiny_model(tiny_llama, toks, device):
    """At a tiny random model's scale the loss is near-linear in one head's output: the estimate is close."""
    res = dormant_heads(tiny_llama, toks)
    for ablation in ("zero", "mean"):
        chk = attribution_check(tiny_llama, toks, [(0, 1), (1, 2)], ablation=ablation, result=res)
        p = chk.pooled()
        assert chk.exact.shape == (2, N, T - 4)
        assert p["pearson_r"] > 0.98 and p["relative_error"] < 0.2, p
    # the exact pass by hand for one (sequence, query): the summed loss with z zeroed there, minus without
    from analysis.causal.head_removal import sequence_losses

    def zero(x, hook):  # query 5 of head 2 in every sequence: the sequences do not see each other
        x = x.clone()
        x[:, 5, 2] = 0
        return x

    on = toks.to(device)
    with torch.inference_mode():
        base = sequence_losses(tiny_llama(on), on).cpu()
        cut = sequence_losses(tiny_llama.run_with_hooks(on, fwd_hooks=[("blocks.1.attn.hook_z", zero)]), on).cpu()
    exact = removal_effects(tiny_llama, toks, [(1, 2)], queries=[5])
    assert exact.shape == (1, N, 1)
    assert torch.allclose(exact[0, :, 0], (cut - base).double(), atol=tol(device, 1e-5))
    assert float(exact.abs().min()) > 0
    # mean ablation sets the output to the head's mean over the measured queries
    zm = head_means(tiny_llama, toks, [1])
    _, cache = cpu_cache(tiny_llama, toks)
    assert torch.allclose(zm[0], cache["blocks.1.attn.hook_z"][:, 1 : T - 1].mean((0, 1)), atol=tol(device, 1e-6))
    assert torch.allclose(
        res.z_mean[1], cache["blocks.1.attn.hook_z"][:, 3 : T - 1].mean((0, 1)), atol=tol(device, 1e-6)
    )


def test_attribution_against_exact_removal_on_smollm2(smollm2):
    """SmolLM2 (N = 2, T = 16, a few queries): exact removal resumed at the head's block, against the estimate."""
    toks = probe_sets(smollm2.tokenizer, n=2, T=16)["natural"].tokens
    res = dormant_heads(smollm2, toks, layers=[3, 14])
    chk = attribution_check(smollm2, toks, [(3, 0), (14, 3)], result=res, queries=[3, 5, 8, 11, 14])
    p = chk.pooled()
    assert p["n"] == 2 * 2 * 5 and p["pearson_r"] > 0.7 and p["spearman_abs"] > 0.6, p
    assert "Pearson r" in chk.text() and len(chk.table()) == 2 and chk.to_dict()["ablation"] == "zero"


@pytest.mark.parametrize(
    "name", ["synthetic-softmax", "synthetic-sigmoid", "synthetic-sink-token", "synthetic-kv-bias"]
)
def test_reference_models(name, device):
    """Softmax sinks on BOS and its copy head sinks less where it must copy; sigmoid has no sink but a total weight
    that follows the output norm; the slot models sink onto their slot."""
    from analysis.model.probes import task_probe_sets

    model = load_model(name, device=device)
    toks = task_probe_sets(model, n=8, T=64)["natural"].tokens
    res = dormant_heads(model, toks, active=copy_queries(model, toks))
    s = res.summary()
    c = s["copy_head"]
    if name != "synthetic-sigmoid":  # the head the copy needs writes there, and little elsewhere
        assert c["norm_active"] > 5 * c["norm_inactive"]
    if name == "synthetic-softmax":
        assert res.signal == "sink" and s["n_sinking_heads"] >= 1 and s["median_rho_norm"] < -0.3
        assert c["sink_attn_active"] < c["sink_attn_inactive"]
        # Where the model is certain (the copy), the gradient vanishes: exact removal sees the copy head's effect,
        # gradient x activation does not.
        ex = dormant_heads(model, toks, active=copy_queries(model, toks), exact=True, mean_ablation=False).summary()
        assert ex["copy_head"]["abs_effect_active"] > 0.1 > 0.01 > c["abs_effect_active"]
        assert ex["copy_head"]["abs_effect_active"] > 100 * ex["copy_head"]["abs_effect_inactive"]
    elif name == "synthetic-sigmoid":
        assert res.has_mass and s["n_sinking_heads"] == 0 and s["median_rho_mass_norm"] > 0
        assert s["quiet_mass"] < s["loud_mass"] and "small scores on every key" in res.text()
    else:
        assert res.signal == "slot" and res.has_slot and s["n_sinking_heads"] >= 1
        assert c["slot_attn_active"] < c["slot_attn_inactive"]


def test_bad_input(tiny_llama, toks):
    with pytest.raises(ValueError, match="out of range"):
        attribution_check(tiny_llama, toks, [(0, 9)])
    with pytest.raises(ValueError, match="out of range"):
        removal_effects(tiny_llama, toks, [(7, 0)])
    with pytest.raises(ValueError, match="pairs"):
        removal_effects(tiny_llama, toks, [3])
    with pytest.raises(ValueError, match="empty"):
        removal_effects(tiny_llama, toks, [])
    with pytest.raises(ValueError, match="queries must lie"):
        removal_effects(tiny_llama, toks, [(0, 0)], queries=[0])
    with pytest.raises(ValueError, match="queries must lie"):
        removal_effects(tiny_llama, toks, [(0, 0)], queries=[T - 1])
    with pytest.raises(ValueError, match="eps must lie"):
        dormant_heads(tiny_llama, toks, eps=1.5)
    with pytest.raises(ValueError, match="quantile"):
        dormant_heads(tiny_llama, toks, quantile=0.0)
    with pytest.raises(ValueError, match="sink positions"):
        dormant_heads(tiny_llama, toks, sink_positions=[T - 1])
    with pytest.raises(ValueError, match="empty"):
        dormant_heads(tiny_llama, toks, sink_positions=[])
    with pytest.raises(ValueError, match="sink mask"):
        dormant_heads(tiny_llama, toks, sink_positions=torch.zeros(N, T + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be at least 3; got 2. Dormant heads need a sink, a query"):
        dormant_heads(tiny_llama, toks[:, :2])
    with pytest.raises(ValueError, match="give T >= 5"):
        dormant_heads(tiny_llama, toks[:, :4])
    with pytest.raises(ValueError, match="active must be"):
        dormant_heads(tiny_llama, toks, active=torch.zeros(N, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="synthetic bigram-copy"):
        copy_queries(tiny_llama, toks)
    with pytest.raises(ModelContractError):
        dormant_heads(torch.nn.Linear(2, 2), toks)
    res = dormant_heads(tiny_llama, toks[:2], layers=[1], mean_ablation=False)
    with pytest.raises(ValueError, match="pass the result of these tokens"):
        attribution_check(tiny_llama, toks, [(1, 0)], result=res)
    with pytest.raises(ValueError, match="not in the result"):
        attribution_check(tiny_llama, toks[:2], [(0, 0)], result=res)
    with pytest.raises(ValueError, match="mean_ablation=True"):
        attribution_check(tiny_llama, toks[:2], [(1, 0)], result=res, ablation="mean")
    with pytest.raises(ValueError, match="ablation must be"):
        attribution_check(tiny_llama, toks[:2], [(1, 0)], result=res, ablation="half")
    with pytest.raises(ValueError, match="was not measured"):
        res.queries(0, 0)
    with pytest.raises(ValueError, match="out of range"):
        res.quiet_mask(1, 4)
    with pytest.raises(ValueError, match="measure must be"):
        res.verdict("loss")


def test_sink_positions_and_mask_agree(tiny_llama, toks, device):
    """A set of sink positions and the same keys as a mask give the same sink attention."""
    a = dormant_heads(tiny_llama, toks, sink_positions=(0, 1), mean_ablation=False)
    mask = torch.zeros(N, T, dtype=torch.bool)
    mask[:, :2] = True
    b = dormant_heads(tiny_llama, toks, sink_positions=mask, mean_ablation=False)
    assert a.query_positions == b.query_positions == list(range(6, T - 1))  # two sink keys: 2 / 7 <= 0.3
    assert torch.allclose(a.sink_attn, b.sink_attn, atol=1e-6)
    _, cache = cpu_cache(tiny_llama, toks)
    assert torch.allclose(
        a.sink_attn[:, 1], cache["blocks.1.attn.hook_pattern"][..., :2].sum(-1), atol=tol(device, 1e-6)
    )
    assert np.isfinite(a.head_table()["rho_norm"]).all()


def test_summary_follows_its_settings_and_cannot_be_changed_from_outside(handmade):
    """The summary is built once per setting: a changed min_share rebuilds it, and editing a returned one changes
    nothing the result says next."""
    import dataclasses

    res = dataclasses.replace(handmade)  # its own caches; the module's result is left as it is
    first = res.summary()
    assert first["n_sinking_heads"] >= 1  # the handmade head sinks on half its queries
    first["n_sinking_heads"] = -1  # a caller's edit of its own copy
    assert res.summary()["n_sinking_heads"] == handmade.summary()["n_sinking_heads"] >= 1
    res.min_share = 1.01  # no head sinks on more than all of its queries
    assert res.summary()["n_sinking_heads"] == 0 and res.verdict() == "untested"


def test_seed_spread_one_row_per_seed_and_a_sentence(tiny_llama, toks, handmade):
    """Notebook 12's per-seed table: each seed's summary (the hand-built head is the one mixed head), and a sentence,
    not a table of empty medians, where no seed has a mixed head."""
    from analysis.causal.dormant_result import seed_spread

    other = torch.randint(3, 96, (N, T), generator=torch.Generator().manual_seed(1))
    with tiny_llama.hooks(fwd_hooks=_sinks_on_even_queries(tiny_llama)):
        second = dormant_heads(tiny_llama, other)
    results = {0: handmade, 7: second}
    table, text = seed_spread(results)
    assert list(table.index) == [0, 7]
    for seed, r in results.items():
        mixed = r.mixed_heads()
        assert table.loc[seed, "n_mixed_heads"] == len(mixed) >= 1
        assert table.loc[seed, "median_rho_norm"] == pytest.approx(float(np.median(mixed.rho_norm)))
    assert text.startswith("Heads that sink on some queries and not on others, per probe seed: [")
    plain = {s: dormant_heads(tiny_llama, t) for s, t in ((0, toks), (1, other))}
    table, text = seed_spread(plain)
    assert (table.n_mixed_heads == 0).all() and text.startswith("No head of") and "no per-query contrast" in text
    assert "nan" not in text.lower()
    with pytest.raises(TypeError, match="dormant_heads result"):
        seed_spread({0: table})
