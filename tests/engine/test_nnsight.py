"""nnsight: the traces sent to NDIF (``load_model(name, backend="nnsight", remote=True)``, run here through
``load_nnsight``) give the bridge's per-head alpha and massive table to 1e-6 on the tiny families, the SmolLM2 probes
through them, the trace's code within NDIF's import whitelist, the same trace through nnsight's local simulation of a
remote run, the request plan of Llama-3.1-405B under NDIF's size limit; and the commands through the nnsight backend
(``--backend nnsight`` here: every pass's reads and edits inside nnsight traces) print the bridge's numbers, the
whole report included."""

from __future__ import annotations

import inspect
import re
import sys
import warnings

import numpy as np
import pandas as pd

import pytest
import torch

pytest.importorskip("nnsight")

from analysis import load_model  # noqa: E402
from analysis.model.loading import load_nnsight  # noqa: E402
from analysis.chain.massive import massive_activations  # noqa: E402
from analysis.chain.massive import MassiveAccumulator  # noqa: E402
from analysis.chain.values import ValueNormsAccumulator  # noqa: E402
from analysis.chain.key_manifold import first_key_manifold, key_manifold_accumulator  # noqa: E402
from analysis.causal.sink_kind import SinkKindAccumulator  # noqa: E402
from analysis.engine.passes import Capture, Reduction  # noqa: E402
from analysis.engine.attention import AttentionWeights  # noqa: E402
from analysis.engine.remote import (  # noqa: E402
    REQUEST_LIMIT_BYTES,
    in_trace,
    pass_plan,
    plan_requests,
    reduction_bytes,
    stats_bytes,
    trace_batch,
)
from analysis.model.nnsight_model import NnsightUnsupported, TraceWeight, wrap_nnsight  # noqa: E402
from analysis.positions.every_sink import PositionAccumulator, sink_positions  # noqa: E402
from analysis.sinks.metric import SinkAccumulator, sink_metric  # noqa: E402

NDIF_ALLOWED = {"torch", "numpy", "einops", "math", "collections", "typing", "pandas", "builtins", "__future__"}
FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3_moe", "deepseek_v3", "gpt_oss"]  # gpt-oss: sinks
LAYOUTS = ["gpt2", "gpt_neox", "gptj", "opt", "llama4_text"]  # module paths from TransformerLens' adapter


def _tokens(n=3, T=20, seed=0):
    return torch.randint(3, 96, (n, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def nn_family(family_dir):
    cache: dict = {}

    def get(family):
        if family not in cache:
            cache[family] = load_nnsight(str(family_dir(family)))
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES + LAYOUTS)
def test_nnsight_gives_the_bridges_alpha_and_massive_table(family, family_bridge, nn_family):
    bridge, nn, tokens = family_bridge(family), nn_family(family), _tokens()
    ref = sink_metric(bridge, tokens, k_max=16, path="eager")
    res = sink_metric(nn, tokens, k_max=16)
    mass = massive_activations(nn, tokens, abs_threshold=0.02, ratio_threshold=2.0)
    assert res.layers == ref.layers and res.meta["path"] == "nnsight"
    torch.testing.assert_close(res.alpha, ref.alpha, atol=1e-6, rtol=0)
    want = massive_activations(bridge, tokens, abs_threshold=0.02, ratio_threshold=2.0)
    for name in ("top_values", "median", "first_mean", "first_abs", "other_abs_max"):  # activations: float32 rounding
        torch.testing.assert_close(getattr(mass, name), getattr(want, name), atol=1e-6, rtol=1e-5)
    for name in ("top_pos", "top_dim", "flag_samples", "flag_first"):
        assert torch.equal(getattr(mass, name), getattr(want, name)), name
    assert len(mass.flagged) == len(want.flagged) > 0  # the low thresholds flag some, on both paths
    assert mass.spike_dims == want.spike_dims


@pytest.mark.parametrize("family", ["llama", "gemma2", "deepseek_v3"])  # plain, soft cap + sliding window, MLA
def test_nnsight_gives_the_bridges_sink_positions(family, family_bridge, nn_family):
    bridge, nn, tokens = family_bridge(family), nn_family(family), _tokens(T=24)
    kw = dict(
        eps=0.1, abs_threshold=0.02, ratio_threshold=2.0
    )  # low thresholds: later sinks and flags on random weights
    want, got = sink_positions(bridge, tokens, path="eager", **kw), sink_positions(nn, tokens, **kw)
    assert got.meta["path"] == "nnsight" and (got.layers, got.resid_layers) == (want.layers, want.resid_layers)
    torch.testing.assert_close(got.alpha, want.alpha, atol=1e-6, rtol=0)
    for name in ("cos_first", "peak_abs", "median"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-5)
    assert torch.equal(got.peak_dim, want.peak_dim) and torch.equal(got.tokens, want.tokens)
    pd.testing.assert_frame_equal(got.flagged, want.flagged, atol=1e-5, rtol=1e-5)
    ours, theirs = got.tables, want.tables
    assert (ours["sinks"].position > 0).any()  # later sinks, not only the first token
    assert all(np.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(ours["sinks"].alpha, theirs["sinks"].alpha))
    for name in theirs:
        drop = ["alpha"] if name == "sinks" else []
        pd.testing.assert_frame_equal(
            ours[name].drop(columns=drop), theirs[name].drop(columns=drop), atol=1e-5, rtol=1e-5
        )
    assert got.findings() == want.findings()


def test_a_family_it_cannot_measure_is_refused_before_the_work(family_dir):
    with pytest.raises(NnsightUnsupported, match="ALiBi"):
        load_nnsight(str(family_dir("bloom")))
    with pytest.raises(ValueError, match="backend='nnsight'"):
        load_model("smollm2-135m", remote=True)


def _weight(acts, W):
    return W


@pytest.mark.parametrize("family", LAYOUTS)
def test_a_layouts_weights_read_in_a_trace_are_the_bridges_or_refused(family, family_bridge, nn_family):
    """W_O, W_K and ln1's gain as a trace reads them (GPT-2's Conv1D transposed, each in TransformerLens' layout)
    equal the bridge's; a fused qkv projection (GPT-2, GPT-NeoX) has no key projection to read W_K from: refused."""
    block, nn = family_bridge(family).blocks[0], nn_family(family)
    for name, want in (("W_O", block.attn.W_O), ("W_K", block.attn.W_K), ("ln1.w", block.ln1.weight)):
        if name == "W_K" and family in ("gpt2", "gpt_neox"):
            with pytest.raises(NnsightUnsupported, match="fused qkv"):
                in_trace(nn, 0, Reduction(_weight, {"W": TraceWeight(name, 0)}))
            continue
        torch.testing.assert_close(in_trace(nn, 0, Reduction(_weight, {"W": TraceWeight(name, 0)})), want.detach())


@pytest.mark.parametrize(
    "family, site, why",
    [
        ("gpt2", "k_in", "fused qkv"),
        ("gpt_neox", "hook_k_proj", "fused qkv"),
        ("gpt_neox", "hook_resid_mid", "parallel block"),
        ("gptj", "hook_resid_mid", "parallel block"),
    ],
)
def test_a_site_a_layout_lacks_is_refused_before_the_trace(family, site, why, nn_family, family_dir, monkeypatch):
    """A site this family's layer has no module for (a fused qkv: no key projection; a parallel block: no stream
    between attention and MLP) is refused, naming the bridge, before any trace runs; Falcon's attention calls no
    attention function: refused at load."""
    nn = nn_family(family)
    monkeypatch.setattr(type(nn.lm), "trace", lambda *a, **k: pytest.fail("a trace ran"))
    with pytest.raises(NnsightUnsupported, match=f"{why}.*--backend transformer_lens"):
        trace_batch(nn, _tokens(n=1, T=4), [], edits={0: {site: Reduction(_weight, {"W": 0.0})}})
    with pytest.raises(NnsightUnsupported, match="attention function"):
        load_nnsight(str(family_dir("falcon")))


def test_opts_queries_are_the_bridges_though_it_scales_them_before_the_call(family_bridge, nn_family):
    """OPT multiplies q by its scale before the attention call (scaling=1.0 there): hook_q undoes that, so the logits
    a reduction forms from it with the family's scale are the bridge's (the norm gain's heads table; its logit shares,
    ratios to a near-zero total, to float rounding)."""
    from analysis.chain.norm_gain import norm_gain_trace

    got, want = (
        norm_gain_trace(m, _tokens(), 1, spike_dims=[3, 7]).heads for m in (nn_family("opt"), family_bridge("opt"))
    )
    shares = [c for c in want.columns if c.startswith("logit_share")]
    assert want.logit_first.abs().max() > 1e-2  # logits the pre-scaling would scale eightfold
    pd.testing.assert_frame_equal(got.drop(columns=shares), want.drop(columns=shares), atol=1e-6, rtol=1e-5)
    pd.testing.assert_frame_equal(got[shares], want[shares], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, blocks", [("gpt2", "transformer.h"), ("gpt_neox", "gpt_neox.layers")])
def test_a_layouts_meta_model_has_its_paths_from_the_config_alone(family, blocks):
    """NDIF's case, weights on the meta device: the adapter's paths, the attention call and the sink and massive pass
    plans come from the config alone; the fused key projection is refused there too, before any work."""
    import transformers
    from tests.families import FAMILY_CONFIGS, word_tokenizer

    cls, kw = FAMILY_CONFIGS[family]
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw))
    nn = wrap_nnsight(hf, tokenizer=word_tokenizer(), name=family)
    assert nn.layout.paths["blocks"] == blocks and nn.attention_call(1) is not None
    plan = pass_plan(nn, [SinkAccumulator(nn, 16, k_max=4), MassiveAccumulator(nn, range(2), nn.spec.d_model)])
    assert [p[0] for p in plan] == [0, 1] and all(p[1] for p in plan)  # each layer's attention call
    with pytest.raises(NnsightUnsupported, match="fused qkv"):
        trace_batch(nn, _tokens(n=1, T=4), [], edits={1: {"k_in": Reduction(_weight, {"W": 0.0})}})


def test_a_folder_that_is_not_a_model_is_refused_in_one_line(tmp_path):
    from analysis.model.loading import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="no config.json"):  # not transformers' tokenizer traceback
        load_nnsight(str(tmp_path))


def test_remote_needs_a_hosted_hub_id_and_a_key_before_any_request(monkeypatch, no_network):
    with pytest.raises(ValueError, match="hub id"):
        load_model("smollm2-135m", backend="nnsight", remote=True)
    monkeypatch.delenv("NDIF_API_KEY", raising=False)
    with pytest.raises(NnsightUnsupported, match="NDIF_API_KEY"):
        load_model("meta-llama/Llama-3.1-405B", backend="nnsight", remote=True)
    with pytest.raises(ValueError, match="one device"):
        load_model("smollm2-135m", backend="nnsight", device_map="auto", max_memory={"cpu": "1GiB"})
    assert not no_network


def test_smollm2_probes_through_nnsight_equal_the_bridge(smollm2):
    from analysis.model.probes import model_probe_sets

    nn = load_nnsight("smollm2-135m")
    probes = model_probe_sets(nn, n=2, T=16)
    assert torch.equal(probes["natural"].tokens, model_probe_sets(smollm2, n=2, T=16)["natural"].tokens)
    for kind in ("natural", "random"):
        tokens = probes[kind].tokens
        assert not (tokens[:, 0] == nn.tokenizer.bos_token_id).any()  # no BOS: the probes decide, not the tokenizer
        got, want = sink_metric(nn, tokens, kind=kind), sink_metric(smollm2, tokens, path="eager")
        torch.testing.assert_close(got.alpha, want.alpha, atol=1e-5, rtol=0)  # 30 layers of float32 rounding
        assert got.sink_rate() == want.sink_rate()


def _accumulators(nn, T=20):
    """The accumulators whose reductions a remote pass ships: the sink metric, the massive table, every position, the
    value norms, the sink kinds (W_O read in the trace), the first-key manifold (its scatter's candidates: the first
    batch) and a captured map (a view)."""
    layers = list(range(nn.spec.n_layers))
    return [
        SinkAccumulator(nn, T, k_max=8),
        MassiveAccumulator(nn, layers, nn.spec.d_model, abs_threshold=0.02, ratio_threshold=2.0),
        PositionAccumulator(layers),
        ValueNormsAccumulator(nn, list(nn.spec.attention_layers), T),
        SinkKindAccumulator(nn, list(nn.spec.attention_layers), T, eps=0.1),
        key_manifold_accumulator(nn, (3, T)),
        Capture("blocks.0.attn.hook_pattern", 0),
    ]


def _reached(obj, seen=None) -> set[str]:
    """The modules outside this package that a shipped function (or class) reaches: what it names from them, and
    through every function and class of the package it names (cloudpickle ships those by value), transitively."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return set()
    seen.add(id(obj))
    if inspect.isclass(obj):
        return set().union(
            *(
                _reached(v, seen)
                for v in vars(obj).values()
                if inspect.isfunction(v) or isinstance(v, (classmethod, staticmethod, property))
            )
        )
    if isinstance(obj, (classmethod, staticmethod)):
        return _reached(obj.__func__, seen)
    if isinstance(obj, property):
        return set().union(*(_reached(f, seen) for f in (obj.fget, obj.fset) if f is not None))
    if not inspect.isfunction(obj):
        return set()
    out: set[str] = set()
    codes = [obj.__code__]
    while codes:
        code = codes.pop()
        codes += [c for c in code.co_consts if inspect.iscode(c)]
        for name in code.co_names:
            v = obj.__globals__.get(name)
            mod = v.__name__ if inspect.ismodule(v) else getattr(v, "__module__", None)
            if v is None or mod is None:
                continue
            if mod.split(".")[0] == "analysis" and callable(v) and not (inspect.isfunction(v) or inspect.isclass(v)):
                out.add(f"{mod}.{name} (a wrapper, pickled by reference)")  # e.g. functools.lru_cache
            elif mod.split(".")[0] == "analysis":
                out |= _reached(v, seen)
            elif inspect.ismodule(v) or inspect.isfunction(v) or inspect.isclass(v) or inspect.isbuiltin(v):
                out.add(mod)
    return out


def test_every_reduction_that_ships_reaches_only_what_ndif_allows(family_dir, nn_family):
    """Each reduction a remote pass runs (and the attention weights it builds), with all it reaches: torch, numpy,
    math and typing only (NDIF's import whitelist), whatever the modules they live in import."""
    nn = nn_family("llama")
    shipped = [red.fn for _, _, _, jobs in pass_plan(nn, _accumulators(nn)) for _, red, _ in jobs]
    assert {f.__name__ for f in shipped} == {
        "sink_stats",
        "massive_stats",
        "position_stats",
        "value_stats",
        "kind_stats",
        "key_stats",
        "captured",
    }
    for fn in [*shipped, AttentionWeights]:
        bad = {m for m in _reached(fn) if m.split(".")[0] not in NDIF_ALLOWED}
        assert not bad, f"{fn.__name__} reaches {bad}: NDIF allows only {sorted(NDIF_ALLOWED)}"
    from analysis.report.build import build_report  # the check sees what NDIF lacks where a function reaches it

    assert {m.split(".")[0] for m in _reached(build_report)} - NDIF_ALLOWED


def here_and_there(monkeypatch, run) -> dict:
    """{False: ``run(False)`` (a trace here), "local": ``run("local")`` (nnsight's simulation of a remote run, this
    package hidden as on NDIF: :func:`_as_if_pip_installed`)}."""
    runs = {}
    for where in (False, "local"):
        restore = _as_if_pip_installed(monkeypatch) if where else (lambda: None)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                runs[where] = run(where)
        finally:
            restore()
    return runs


def _as_if_pip_installed(monkeypatch):
    """What NDIF has of this package: nothing. nnsight ships, once per process, every package importable from the
    working tree and not pip-installed (``pull_env``: a checkout run from its folder ships all of ``analysis``), and an
    editable install's import hook (CI's) finds the package where nnsight's simulation hides the rest: take both out,
    so the simulation sees only what ``register_shipped`` sends."""
    import cloudpickle
    import nnsight.ndif

    import analysis

    monkeypatch.setattr(nnsight.ndif, "_PULLED_ENV", True)
    monkeypatch.setattr(
        sys,
        "meta_path",
        [f for f in sys.meta_path if "__editable__" not in f"{getattr(f, '__module__', '')} {type(f).__module__}"],
    )
    if analysis.__name__ in cloudpickle.list_registry_pickle_by_value():
        cloudpickle.unregister_pickle_by_value(analysis)
        return lambda: cloudpickle.register_pickle_by_value(analysis)
    return lambda: None


def test_the_remote_trace_runs_through_nnsights_local_simulation(family_dir, monkeypatch):
    import cloudpickle

    import analysis
    import analysis.engine.remote as remote

    nn, tokens = load_nnsight(str(family_dir("llama"))), _tokens()
    plan = pass_plan(nn, _accumulators(nn))
    here = trace_batch(nn, tokens, plan, remote=False)
    restore = _as_if_pip_installed(monkeypatch)
    register = remote.register_shipped
    try:
        with warnings.catch_warnings():  # the reductions shipped by value: the trace runs where the package is not
            warnings.simplefilter("ignore")
            there = trace_batch(nn, tokens, plan, remote="local")
        assert [(j, l) for j, l, _ in here] == [(j, l) for j, l, _ in there] and len(here) == 6 * nn.spec.n_layers + 1
        for (_, _, a), (_, _, b) in zip(here, there):
            a, b = (x if isinstance(x, dict) else {"x": x} for x in (a, b))  # a captured map: one tensor
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        monkeypatch.setattr(remote, "register_shipped", lambda: None)  # not shipped: it cannot run there
        if analysis.__name__ in cloudpickle.list_registry_pickle_by_value():
            cloudpickle.unregister_pickle_by_value(analysis)
        with warnings.catch_warnings(), pytest.raises(ModuleNotFoundError, match="analysis"):
            warnings.simplefilter("ignore")
            trace_batch(nn, tokens, plan, remote="local")
    finally:
        register()
        restore()


def test_reduction_bytes_bound_what_a_trace_saves(family_dir):
    nn, tokens = load_nnsight(str(family_dir("qwen3"))), _tokens(n=4)
    plan = pass_plan(nn, _accumulators(nn))
    per, fixed = reduction_bytes(nn, tokens, plan)
    saved = trace_batch(nn, tokens, plan, remote=False)
    by_layer: dict = {}
    for _, layer, r in saved:
        by_layer[layer] = by_layer.get(layer, 0) + stats_bytes(r)
    assert 0 < max(by_layer.values()) <= 4 * per + fixed
    positions = pass_plan(nn, [PositionAccumulator(range(nn.spec.n_layers))])
    assert reduction_bytes(nn, tokens, positions) == (12 * 20, 0)  # cosine, peak and dim: 12 bytes a position


def test_a_remote_pass_refuses_what_it_cannot_ship_before_the_work(family_dir, nn_family):
    from analysis.engine.backends import BackendUnsupported
    from analysis.engine.passes import Accumulator, run_pass

    class OwnUpdate(Accumulator):  # reduces in update: runs here only
        hooks = lambda self: {0: {"x": "blocks.0.hook_resid_post"}}  # noqa: E731
        update = result = lambda self, *a: None  # noqa: E731

    class Logits(PositionAccumulator):
        needs_logits = True

    nn = nn_family("llama")
    with pytest.raises(NnsightUnsupported, match="reduces in its own update"):
        pass_plan(nn, [OwnUpdate()])

    class Scores(PositionAccumulator):  # the scores before the mask and softmax: no site a trace reads
        hooks = lambda self: {0: {"x": "blocks.0.attn.hook_attn_scores"}}  # noqa: E731

    with pytest.raises(NnsightUnsupported, match="blocks.0.attn.hook_attn_scores"):
        pass_plan(nn, [Scores([0])])
    with pytest.raises(BackendUnsupported, match="reads activations only"):
        run_pass(nn, _tokens(), [Logits([0])])
    with pytest.raises(BackendUnsupported, match="reads activations only"):
        run_pass(nn, _tokens(), [PositionAccumulator([0])], fwd_hooks=[("blocks.0.hook_resid_post", lambda x, h: x)])


def llama_405b_config():
    """Llama-3.1-405B's config, typed from its published numbers."""
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=126,
        hidden_size=16384,
        num_attention_heads=128,
        num_key_value_heads=8,
        intermediate_size=53248,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


def test_a_405b_sink_table_fits_ndifs_requests(capsys):
    from transformers import AutoModelForCausalLM

    from tests.families import word_tokenizer

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(llama_405b_config())
    nn = wrap_nnsight(hf, tokenizer=word_tokenizer(), name="meta-llama/Llama-3.1-405B")
    spec = nn.spec
    assert nn.attention_call(125) is not None  # the attention function's call, where the trace reads q and k
    assert (spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.d_model) == (126, 128, 8, 16384)
    sink, massive = SinkAccumulator(nn, 64, k_max=16), MassiveAccumulator(nn, range(126), spec.d_model)
    layers = list(range(126))
    both = plan_requests(
        100, layers, **dict(zip(("per", "fixed"), reduction_bytes(nn, _tokens(T=64), pass_plan(nn, [sink, massive]))))
    )
    sink_only = plan_requests(
        100, layers, **dict(zip(("per", "fixed"), reduction_bytes(nn, _tokens(T=64), pass_plan(nn, [sink]))))
    )
    for plan in (both, sink_only):
        assert plan.bytes_per_request < REQUEST_LIMIT_BYTES and plan.n_requests >= 2
        assert plan.bytes_total > REQUEST_LIMIT_BYTES  # one request would not do
    assert sink_only.n_requests < both.n_requests
    from analysis.report.build import NNSIGHT_SECTIONS, remote_requests

    with pytest.raises(TypeError, match="remote=True"):
        remote_requests(hf, n=32, T=64)  # a Hugging Face model, not one loaded for NDIF: refused before any work
    report = remote_requests(nn, n=32, T=64)  # the report's default N and T, every section a remote model serves
    assert set(report) == {"natural", "random", "repeated"}
    assert all(p.bytes_per_request < REQUEST_LIMIT_BYTES and p.n_requests >= 2 for p in report.values())
    assert report["natural"].bytes_total > remote_requests(nn, n=32, T=64, sections=("sink",))["natural"].bytes_total
    with capsys.disabled():
        for kind, p in report.items():
            print(
                f"\n405B report ({', '.join(NNSIGHT_SECTIONS)}), {kind}, N=32, T=64: {p.n_requests} requests of "
                f"{p.samples} samples x {len(p.layer_groups[0])} layers, {p.bytes_total / 2**20:.1f} MiB in all"
            )
    with capsys.disabled():
        for what, p in (("sink + massive", both), ("sink", sink_only)):
            print(
                f"\n405B {what}, N=100, T=64: {p.n_requests} requests of {p.samples} samples x "
                f"{len(p.layer_groups[0])} layers, {p.bytes_per_request / 2**20:.1f} MiB each, "
                f"{p.bytes_total / 2**20:.1f} MiB in all"
            )


def test_per_head_alpha_gathers_across_tensor_parallel_shards():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, 12, 16, generator=g), torch.randn(2, 2, 12, 16, generator=g)
    full = AttentionWeights.from_qk(q, k, scale=0.25).alpha(6)
    shards = [AttentionWeights.from_qk(q[:, 4 * r : 4 * r + 4], k[:, r : r + 1], scale=0.25).alpha(6) for r in range(2)]
    torch.testing.assert_close(torch.cat(shards, 1), full, atol=0, rtol=0)


def test_the_sink_command_prints_the_bridges_table_through_nnsight(smollm2, capsys):
    from analysis.__main__ import main
    from analysis.model.probes import model_probe_sets

    assert main(["sink", "--remote", "--n", "2", "--T", "16"]) == 2  # --remote without --backend nnsight: refused
    assert "--backend nnsight" in capsys.readouterr().err
    assert main(["sink", "--backend", "nnsight", "--n", "2", "--T", "16", "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    want = {
        kind: sink_metric(smollm2, p.tokens, path="eager").sink_rate()
        for kind, p in model_probe_sets(smollm2, n=2, T=16).items()
    }
    assert out[2:5] == [f"{kind:<10} {v:>10.2f}" for kind, v in want.items()]


def test_the_sinks_command_prints_the_bridges_table_through_nnsight(family_dir, tmp_path, capsys):
    import json

    from analysis.__main__ import main

    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"w{(7 * i) % 90}" for i in range(24)), encoding="utf-8")
    args = ["sinks", "--model", str(family_dir("qwen3")), "--text", str(text), "--eps", "0.1", "--quiet"]
    assert main(args) == 0
    want = capsys.readouterr().out.splitlines()
    assert main(args + ["--backend", "nnsight", "--json", str(tmp_path / "s.json")]) == 0
    got = capsys.readouterr().out.splitlines()
    assert (
        "nnsight path" in got[0] and len(got) > 4 and got[1:-1] == want[1:]
    )  # the header names the path; then "wrote"
    payload = json.loads((tmp_path / "s.json").read_text())
    assert payload["backend"] == "nnsight" and payload["path"] == "nnsight" and len(payload["sinks"]) == len(got) - 4


def _same(a, b, path="", loose=()) -> list[str]:
    """Where two JSON values differ (floats to 1e-5, relative, or 1e-6 absolute; under a key in ``loose`` to 1e-3: a
    ratio to a sum that cancels; the numbers a text prints to its own 4 digits)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return ([f"{path}: keys {sorted(set(a) ^ set(b))}"] if set(a) != set(b) else []) + [
            d for k in a if k in b for d in _same(a[k], b[k], f"{path}.{k}", loose)
        ]
    if isinstance(a, list) and isinstance(b, list):
        return (
            [f"{path}: lengths"]
            if len(a) != len(b)
            else [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{path}[{i}]", loose)]
        )
    if isinstance(a, float) or isinstance(b, float):
        rel = 1e-3 if set(re.findall(r"\.(\w+)", path)[-1:]) & set(loose) else 1e-5
        return [] if a == pytest.approx(b, rel=rel, abs=1e-6, nan_ok=True) else [f"{path}: {a} != {b}"]
    if isinstance(a, str) and isinstance(b, str) and a != b:  # a text's numbers as printed (4 digits), or noise
        num = r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
        (wa, na), (wb, nb) = ((re.split(num, x), [float(n) for n in re.findall(num, x)]) for x in (a, b))
        close = len(na) == len(nb) and all(x == pytest.approx(y, rel=1e-3, abs=1e-6) for x, y in zip(na, nb))
        if wa == wb and close:
            return []
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))  # where they part
        return [f"{path} at {i}: {a[max(i - 60, 0) : i + 60]!r} != {b[max(i - 60, 0) : i + 60]!r}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def test_the_report_through_nnsight_runs_every_section_in_nnsight_traces(family_bridge, family_dir, tmp_path):
    """``report --backend nnsight``: every section, its passes inside nnsight traces (those reading what no module hands
    out on the bridge, stated), no section a note; the sink and massive numbers are the bridge's (SmolLM2's whole report.json: tests/report/test_backends_equal.py)."""
    import json

    from analysis.__main__ import main
    from analysis.report.build import NNSIGHT_SECTIONS, SECTIONS, build_report

    build_report(family_bridge("llama"), tmp_path / "b", sections=list(NNSIGHT_SECTIONS), n=2, T=24, eps=0.1)
    assert (
        main(
            [
                "report",
                "--model",
                str(family_dir("llama")),
                "--backend",
                "nnsight",
                "--n",
                "2",
                "--T",
                "24",
                "--eps",
                "0.1",
                "--out",
                str(tmp_path / "n"),
                "--quiet",
            ]
        )
        == 0
    )
    want, got = (json.loads((tmp_path / d / "report.json").read_text()) for d in "bn")
    assert not got["errors"] and set(got["sections"]) == set(SECTIONS)
    assert not any("not available" in note.lower() for notes in got["notes"].values() for note in notes)
    passes = [k for by in got["config"]["passes"].values() for k in by]
    assert passes and all(k.startswith("nnsight:") for k in passes), passes  # the norm-gain trace's too
    assert want["sections"]["sink"]["sink_1_pct"]["natural"] > 0
    assert not _same(got["sections"]["sink"], want["sections"]["sink"])
    # the tiny word tokenizer reads the natural probes as mostly '<unk>': equal top values at several positions, whose
    # tie either path may break (the top positions are compared on random tokens above)
    ties = [f"top{i}_{w}" for i in (1, 2, 3) for w in ("pos", "token")]
    mass = [
        {
            k: {**v, "per_layer": [{c: x for c, x in r.items() if c not in ties} for r in v["per_layer"]]}
            for k, v in j["sections"]["massive"].items()
            if k == "natural"
        }
        for j in (got, want)
    ]
    assert not _same(*mass)
    assert got["spike_dims"] == want["spike_dims"] and got["findings"][:1] == want["findings"][:1]


def test_the_report_of_a_remote_model_equals_the_bridges_on_the_sections_that_ship(family_bridge, family_dir, tmp_path):
    """A model loaded for NDIF (here ``load_nnsight``: the same traces, run locally): all 12 sections run from the
    accumulators' shipped reductions (none refused), and the sink, massive and spike-writers sections equal the
    bridge's report (the spike writers' every step with a spike: tests/engine/test_nnsight_spike_writers.py)."""
    import json

    from analysis.report.build import NNSIGHT_SECTIONS, NOT_REMOTE, SECTIONS, build_report

    assert set(NNSIGHT_SECTIONS) == set(SECTIONS) and len(SECTIONS) == 12 and not NOT_REMOTE
    nn = load_nnsight(str(family_dir("llama")))
    build_report(family_bridge("llama"), tmp_path / "b", sections=list(NNSIGHT_SECTIONS), n=2, T=24, eps=0.1)
    build_report(nn, tmp_path / "n", sections=list(SECTIONS), n=2, T=24, eps=0.1)
    want, got = (json.loads((tmp_path / d / "report.json").read_text()) for d in "bn")
    assert not got["errors"] and not any(s.get("available", True) is False for s in got["sections"].values())
    assert not _same(got["sections"]["spike_writers"], want["sections"]["spike_writers"])
    passes = {k for by in got["config"]["passes"].values() for k in by}
    assert passes == {"nnsight: the remote trace, run here"}
    assert not _same(got["sections"]["sink"], want["sections"]["sink"])
    ties = [f"top{i}_{w}" for i in (1, 2, 3) for w in ("pos", "token")]  # natural probes: tied top values (see above)
    strip = lambda v: {**v, "per_layer": [{c: x for c, x in r.items() if c not in ties} for r in v["per_layer"]]}  # noqa: E731
    g, w = got["sections"]["massive"], want["sections"]["massive"]
    assert not _same(strip(g["natural"]), strip(w["natural"]))
    assert not _same(g["random"], w["random"]) and g["activation_map_layer"] == w["activation_map_layer"]
    assert got["sections"]["views"] == want["sections"]["views"]  # the layers drawn and the sequence
    assert not _same(got["sections"]["sink_kind"], want["sections"]["sink_kind"])  # W_O read in the trace
    assert not _same(got["sections"]["key_manifold"], want["sections"]["key_manifold"])  # the scatter's keys included
    g, w = got["sections"]["value_norms"], want["sections"]["value_norms"]
    assert not _same(
        {k: v for k, v in g.items() if k != "correlation"}, {k: v for k, v in w.items() if k != "correlation"}
    )
    # a Pearson r over a few heads amplifies float32 rounding of the attention (the map here, q, k and the lse there)
    r = [(c["pearson_r"], d["pearson_r"]) for c, d in zip(g["correlation"].values(), w["correlation"].values())]
    assert r and all(a == pytest.approx(b, rel=1e-4) for a, b in r)
    # the dormant heads, their backward in the trace: on these '<unk>' probes many queries tie, and the rank
    # statistics break ties by float32 rounding, so the per-head numbers without ranks or quantiles are compared
    # (every statistic and the text on random tokens: test_the_dormant_heads_of_a_remote_model_...)
    plain = ("layer", "head", "sink_attn", "sinking_share", "n_sinking", "n_other", "median_norm", "median_abs_effect")
    g, w = ([{c: h[c] for c in plain} for h in j["sections"]["dormant"]["heads"]] for j in (got, want))
    assert g and not _same(g, w)
    provenance = ("path", "backend", "why", "requests", "bytes", "kernels", "seconds")  # which engine ran, how long
    for key in ("positions", "context"):
        diff = _same(got["sections"][key], want["sections"][key])
        assert diff and not [d for d in diff if not any(p in d for p in provenance)], key


def test_value_norms_of_a_remote_model_equal_the_bridges(family_bridge, nn_family):
    """``value_norms`` takes a model loaded for NDIF as it takes the bridge (its layers from the config): the same
    numbers and text on a grouped-query family."""
    from analysis.chain.values import value_norms

    tokens = _tokens(n=4, T=24)
    got, want = value_norms(nn_family("qwen3"), tokens), value_norms(family_bridge("qwen3"), tokens)
    torch.testing.assert_close(got.v_norm_by_pos, want.v_norm_by_pos, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.first_value_share, want.first_value_share, atol=1e-6, rtol=1e-5)
    assert got.text() == want.text()
    with pytest.raises(ValueError, match="not attention layers"):
        value_norms(nn_family("qwen3"), tokens, layers=[99])


@pytest.mark.parametrize("family", ["llama", "gemma2", "deepseek_v3"])  # plain, soft cap + window, MLA (d_v != d_qk)
def test_the_sink_kinds_of_a_remote_model_read_w_o_in_the_trace(family, family_bridge, nn_family):
    """``sink_kinds`` on a model loaded for NDIF: W_O is read inside the trace (``TraceWeight``; on NDIF it never
    leaves), its Gram's root taken there; every head's numbers and kind equal the bridge's."""
    from analysis.causal.sink_kind import SinkKindAccumulator, sink_kinds
    from analysis.model.nnsight_model import TraceWeight

    nn, tokens = nn_family(family), _tokens(n=4, T=24)
    acc = SinkKindAccumulator(nn, list(nn.spec.attention_layers), 24, eps=0.1)
    assert acc.roots is None and acc.reduction(nn.spec.attention_layers[0]).params["W_O"] == TraceWeight(
        "W_O", nn.spec.attention_layers[0]
    )
    got, want = sink_kinds(nn, tokens, eps=0.1), sink_kinds(family_bridge(family), tokens, eps=0.1)
    for name in ("alpha_1", "sinking_share", "value_ratio", "out_ratio", "pr", "cos", "n_seqs"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-5, equal_nan=True)
    assert got.text() == want.text() and torch.isfinite(got.out_ratio).any()  # outputs |z R| of sinking queries


def test_the_key_manifold_of_a_remote_model_equals_the_bridges(family_bridge, nn_family):
    """``first_key_manifold`` on a model loaded for NDIF: the same table, scatter heads and coordinates and text on a
    grouped-query family, its scatter heads chosen on the first of two batches (the second batch's reductions return
    the chosen heads' keys only); ``rotated=False`` (keys before the rotary, which the trace does not read) is refused
    before the work."""
    tokens, nn = _tokens(n=4, T=24), nn_family("qwen3")
    got, want = (first_key_manifold(m, tokens, batch_size=2) for m in (nn, family_bridge("qwen3")))
    pd.testing.assert_frame_equal(got.table, want.table, atol=1e-5, rtol=1e-4)
    assert list(got.scatter) == list(want.scatter) and len(got.scatter) == 2 and got.text() == want.text()
    for key, s in want.scatter.items():
        np.testing.assert_allclose(got.scatter[key]["coords"], s["coords"], atol=1e-4)
    with pytest.raises(NnsightUnsupported, match="rotated=False"):
        first_key_manifold(nn, tokens, rotated=False)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])  # plain; soft cap + sliding window; sink logits
def test_the_dormant_heads_of_a_remote_model_run_their_backward_in_the_trace(family, family_bridge, nn_family):
    """``dormant_heads`` on a model loaded for NDIF: the heads' mean outputs from a shipped reduction, then one trace
    per request with its backward pass (W_O read there, the gradient x activation reduced there); every per-query
    statistic and the text equal the bridge's. Exact removal, a pass per head, is refused before the work."""
    from analysis.causal.dormant_heads import dormant_heads

    nn, tokens = nn_family(family), _tokens(n=3, T=16)
    got, want = dormant_heads(nn, tokens, eps=0.1), dormant_heads(family_bridge(family), tokens, eps=0.1)
    for name in ("sink_attn", "out_norm", "effect", "effect_mean", "z_mean"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-4)
    assert got.mass is None and float(got.effect.abs().max()) > 0
    assert got.text() == want.text()
    mask = torch.zeros(3, 16, dtype=torch.bool)
    mask[:, :2] = True  # a mask of sink keys per sequence (the sink-token models' form)
    got = dormant_heads(nn, tokens, sink_positions=mask, mean_ablation=False)
    torch.testing.assert_close(
        got.sink_attn,
        dormant_heads(family_bridge(family), tokens, sink_positions=mask, mean_ablation=False).sink_attn,
        atol=1e-5,
        rtol=1e-4,
    )
    from analysis.model.nnsight_model import NnsightUnsupported

    with pytest.raises(NnsightUnsupported, match="exact=False"):
        dormant_heads(nn, tokens, exact=True)


def test_the_backward_trace_ships_only_what_ndif_allows_and_runs_in_nnsights_simulation(family_dir, monkeypatch):
    """The dormant heads' trace with its backward pass (``grad_trace``): its reductions and loss reach only NDIF's
    whitelist, and nnsight's local simulation of a remote run (package hidden) returns what the trace returns here."""
    import analysis.engine.remote as remote
    from analysis.causal.dormant_heads import grad_effects, head_stats, summed_loss
    from analysis.causal.head_removal import head_sums
    from analysis.engine.passes import Reduction
    from analysis.model.nnsight_model import TraceWeight

    for fn in (head_stats, grad_effects, summed_loss, head_sums):
        bad = {m for m in _reached(fn) if m.split(".")[0] not in NDIF_ALLOWED}
        assert not bad, f"{fn.__name__} reaches {bad}: NDIF allows only {sorted(NDIF_ALLOWED)}"
    nn, tokens = load_nnsight(str(family_dir("llama"))), _tokens(n=2, T=12)
    jobs = {
        l: (Reduction(head_stats, {"sinks": (0,), "W_O": TraceWeight("W_O", l)}), Reduction(grad_effects))
        for l in nn.spec.attention_layers
    }
    here = remote.grad_trace(nn, tokens, jobs, summed_loss, remote=False)
    restore = _as_if_pip_installed(monkeypatch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            there = remote.grad_trace(nn, tokens, jobs, summed_loss, remote="local")
    finally:
        restore()
    assert [l for l, _, _ in here] == [l for l, _, _ in there] == list(nn.spec.attention_layers)
    for (_, f, b), (_, f2, b2) in zip(here, there):
        assert f.keys() == f2.keys() == {"sink", "slot", "norm"} and b.keys() == b2.keys() == {"effect"}
        assert all(torch.equal(f[k], f2[k]) for k in f) and all(torch.equal(b[k], b2[k]) for k in b)
        assert float(b["effect"].abs().max()) > 0
