"""nnsight: the traces sent to NDIF (``load_model(name, backend="nnsight", remote=True)``, run here through
``load_nnsight``) give the bridge's per-head alpha and massive table to 1e-6 on the tiny families, the SmolLM2 probes
through them, the trace's code within NDIF's import whitelist, the same trace through nnsight's local simulation of a
remote run, the request plan of Llama-3.1-405B under NDIF's size limit; and the commands through the nnsight backend
(``--backend nnsight`` here: every pass's reads and edits inside nnsight traces) print the bridge's numbers, the
whole report included."""

from __future__ import annotations

import ast
import inspect
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
from analysis.chain.nnsight_tables import nnsight_sink_metric, nnsight_tables  # noqa: E402
from analysis.core import reductions  # noqa: E402
from analysis.engine import remote_reductions  # noqa: E402
from analysis.engine.nnsight_pass import REQUEST_LIMIT_BYTES, plan_requests, request_bytes, trace_batch  # noqa: E402
from analysis.engine.remote_reductions import attention_alpha, stats_bytes  # noqa: E402
from analysis.model.nnsight_model import NnsightUnsupported, wrap_nnsight  # noqa: E402
from analysis.positions.every_sink import sink_positions  # noqa: E402
from analysis.positions.nnsight_positions import nnsight_sink_positions  # noqa: E402
from analysis.sinks.metric import sink_metric  # noqa: E402

NDIF_ALLOWED = {"torch", "numpy", "einops", "math", "collections", "typing", "pandas", "__future__"}
SHIPPED = (reductions, remote_reductions)  # the modules whose functions run inside the trace (by value)
FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3_moe", "deepseek_v3"]


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


@pytest.mark.parametrize("family", FAMILIES)
def test_nnsight_gives_the_bridges_alpha_and_massive_table(family, family_bridge, nn_family):
    bridge, nn, tokens = family_bridge(family), nn_family(family), _tokens()
    ref = sink_metric(bridge, tokens, k_max=16, path="eager")
    res, mass = nnsight_tables(nn, tokens, k_max=16, abs_threshold=0.02, ratio_threshold=2.0)
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
    want, got = sink_positions(bridge, tokens, path="eager", **kw), nnsight_sink_positions(nn, tokens, **kw)
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
    with pytest.raises(NnsightUnsupported, match="learned sink logits"):
        load_nnsight(str(family_dir("gpt_oss")))
    with pytest.raises(ValueError, match="backend='nnsight'"):
        load_model("smollm2-135m", remote=True)


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
        got, want = nnsight_sink_metric(nn, tokens, kind=kind), sink_metric(smollm2, tokens, path="eager")
        torch.testing.assert_close(got.alpha, want.alpha, atol=1e-5, rtol=0)  # 30 layers of float32 rounding
        assert got.sink_rate() == want.sink_rate()


def _imports(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
    return names


def _forbidden(source: str) -> set[str]:
    shipped = {m.__name__ for m in SHIPPED}
    return {n for n in _imports(source) if n.split(".")[0] not in NDIF_ALLOWED and n not in shipped}


def test_the_code_shipped_in_the_trace_imports_only_what_ndif_allows():
    for module in SHIPPED:
        bad = _forbidden(inspect.getsource(module))
        assert not bad, f"{module.__name__} imports {bad}: NDIF allows only {sorted(NDIF_ALLOWED)}"
    # the check sees a forbidden import, and lets the shipped modules import each other
    assert _forbidden("import scipy.special\nfrom analysis.model import hooks\nimport torch") == {
        "scipy.special",
        "analysis.model",
    }
    assert "analysis.core.reductions" in _imports(inspect.getsource(remote_reductions))


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

    import analysis.engine.nnsight_pass as nnsight_pass

    nn, tokens = load_nnsight(str(family_dir("llama"))), _tokens()
    layers = list(nn.spec.attention_layers)
    here = trace_batch(nn, tokens, k_max=8, sink_layers=layers, massive_layers=layers, positions=True)
    restore = _as_if_pip_installed(monkeypatch)
    register = nnsight_pass.register_shipped
    try:
        with warnings.catch_warnings():  # the reductions shipped by value: the trace runs where the package is not
            warnings.simplefilter("ignore")
            there = trace_batch(
                nn, tokens, k_max=8, sink_layers=layers, massive_layers=layers, positions=True, remote="local"
            )
        for a, b in zip(here[0], there[0]):
            assert torch.equal(a, b)
        assert all(torch.equal(x[k], y[k]) for x, y in zip(here[1], there[1]) for k in ("top", "cos", "peak", "dim"))
        monkeypatch.setattr(nnsight_pass, "register_shipped", lambda: None)  # not shipped: it cannot run there
        for module in SHIPPED:
            if module.__name__ in cloudpickle.list_registry_pickle_by_value():
                cloudpickle.unregister_pickle_by_value(module)
        with warnings.catch_warnings(), pytest.raises(ModuleNotFoundError, match="analysis"):
            warnings.simplefilter("ignore")
            trace_batch(nn, tokens, k_max=8, sink_layers=layers, massive_layers=layers, remote="local")
    finally:
        register()
        restore()


def test_request_bytes_bound_what_a_trace_saves(family_dir):
    nn, tokens = load_nnsight(str(family_dir("qwen3"))), _tokens(n=4)
    layers = list(nn.spec.attention_layers)
    alphas, resid = trace_batch(nn, tokens, k_max=8, sink_layers=layers, massive_layers=layers)
    saved = stats_bytes(alphas) + stats_bytes(resid)
    dims = dict(n_heads=nn.spec.n_heads, k_max=8, d_model=nn.spec.d_model)
    bound = request_bytes(4, len(layers), **dims)
    assert stats_bytes(alphas) + sum(stats_bytes({k: v for k, v in r.items() if k != "cand"}) for r in resid) <= saved
    assert saved <= bound
    _, with_positions = trace_batch(nn, tokens, k_max=8, sink_layers=[], massive_layers=layers, positions=True)
    assert stats_bytes(with_positions) - stats_bytes(resid) == request_bytes(
        4, len(layers), positions=20, **dims
    ) - request_bytes(4, len(layers), **dims)  # cosine, peak and dim: 12 bytes a position


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
    plan = plan_requests(100, list(spec.attention_layers), n_heads=spec.n_heads, k_max=16, d_model=spec.d_model)
    assert plan.bytes_per_request < REQUEST_LIMIT_BYTES and plan.n_requests >= 2
    assert plan.bytes_total > REQUEST_LIMIT_BYTES  # one request would not do
    sink_only = plan_requests(
        100, list(spec.attention_layers), n_heads=spec.n_heads, k_max=16, d_model=spec.d_model, massive=False
    )
    assert sink_only.bytes_per_request < REQUEST_LIMIT_BYTES and sink_only.n_requests < plan.n_requests
    with capsys.disabled():
        for what, p in (("sink + massive", plan), ("sink", sink_only)):
            print(
                f"\n405B {what}, N=100, T=64: {p.n_requests} requests of {p.samples} samples x "
                f"{len(p.layer_groups[0])} layers, {p.bytes_per_request / 2**20:.1f} MiB each, "
                f"{p.bytes_total / 2**20:.1f} MiB in all"
            )


def test_per_head_alpha_gathers_across_tensor_parallel_shards():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, 12, 16, generator=g), torch.randn(2, 2, 12, 16, generator=g)
    full = attention_alpha(q, k, None, 0.25, 6)
    shards = [attention_alpha(q[:, 4 * r : 4 * r + 4], k[:, r : r + 1], None, 0.25, 6) for r in range(2)]
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


def _same(a, b, path="") -> list[str]:
    """Where two JSON values differ (floats to 1e-5, relative, or 1e-6 absolute)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return ([f"{path}: keys {sorted(set(a) ^ set(b))}"] if set(a) != set(b) else []) + [
            d for k in a if k in b for d in _same(a[k], b[k], f"{path}.{k}")
        ]
    if isinstance(a, list) and isinstance(b, list):
        return (
            [f"{path}: lengths"]
            if len(a) != len(b)
            else [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{path}[{i}]")]
        )
    if isinstance(a, float) or isinstance(b, float):
        return [] if a == pytest.approx(b, rel=1e-5, abs=1e-6, nan_ok=True) else [f"{path}: {a} != {b}"]
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
    from tests.report.test_backends_equal import ON_THE_BRIDGE

    passes = [k for by in got["config"]["passes"].values() for k in by]
    assert any(k.startswith("nnsight:") for k in passes), passes
    # the rest on the bridge, each saying why: the pre-softmax scores (norm gain), which no module hands out
    left = [k for k in passes if not k.startswith("nnsight:")]
    assert all(k.startswith("transformer_lens: nnsight: ") and any(w in k for w in ON_THE_BRIDGE) for k in left), left
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
