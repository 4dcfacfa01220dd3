"""The norm-gain trace on a model loaded for NDIF (``load_nnsight``: the traces a remote model sends, run here): its
reduction (``norm_gain_stats``) runs in the trace with the norm's gain, W_K and the key norm read there
(``TraceWeight``), and every table, vector and sentence equals the bridge's; the reduction and the key path it ships
reach only NDIF's whitelist and run in nnsight's simulation of a remote run; the report's section equals the
bridge's; Llama-3.1-405B's norm-gain pass fits NDIF's requests (a meta-device dry run). About 25 s in all."""

from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest
import torch

pytest.importorskip("nnsight")

from analysis.chain.norm_gain import norm_gain_accumulator, norm_gain_stats, norm_gain_trace  # noqa: E402
from analysis.engine.remote import REQUEST_LIMIT_BYTES, pass_plan, plan_requests, reduction_bytes  # noqa: E402
from analysis.model.contract import ModelContractError  # noqa: E402
from analysis.model.key_path import KeyOps, NormOps  # noqa: E402
from analysis.model.loading import load_nnsight  # noqa: E402
from analysis.model.nnsight_model import TraceWeight  # noqa: E402
from tests.engine.test_nnsight import NDIF_ALLOWED, _reached, _same, _tokens  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "llama4_qk_norm", "cohere_qk_norm"])  # plain; gain
# 1 + w, cap and window; sink logits; q and k L2-normalised after the rotary; a q/k LayerNorm with a gain per head
def test_the_norm_gain_of_a_remote_model_equals_the_bridges(family, family_bridge, family_dir):
    """Given and found spike dims alike: the stages, gain, heads and key-dim tables, the vectors, the constancy and
    the text; the rebuild checks against the model's own key projection, keys, scores and pattern hold there too."""
    nn, bridge, tokens = load_nnsight(str(family_dir(family))), family_bridge(family), _tokens(n=3, T=20)
    layer = nn.spec.attention_layers[1]
    acc, _ = norm_gain_accumulator(nn, tokens, layer, spike_dims=[3, 7])
    W_K = acc.reduction(layer).params["path"].W_K
    assert W_K == TraceWeight("W_K", layer, (nn.spec.n_kv_heads, nn.spec.d_model, W_K.shape[-1]))  # read there
    for kw in (dict(spike_dims=[3, 7]), dict(abs_threshold=0.01, ratio_threshold=1.5, min_share=0.3)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, want = (norm_gain_trace(m, tokens, layer, **kw) for m in (nn, bridge))
        assert got.spike_dims == want.spike_dims and got.findings() == want.findings()
        for name in ("stages", "gain", "heads", "key_dims"):
            pd.testing.assert_frame_equal(getattr(got, name), getattr(want, name), atol=1e-6, rtol=1e-5)
        for name in ("gain_vector", "first_normalised_mean", "other_normalised_abs", "first_resid_mean"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-6, rtol=1e-5)
        assert not _same(got.constancy, want.constancy)
        g, w = dict(got.rebuild), dict(want.rebuild)
        assert g.pop("key_hook") == f"blocks.{layer}.attn.hook_k_proj" and g.pop("normalised_rel_err") is None
        if family == "llama4_qk_norm":  # the bridge fires no rotated key and no scores; the trace has the call's
            assert max(g.pop("rotated_key_max_abs_err"), g.pop("score_max_abs_err")) < 1e-5
            assert g.pop("final_key_hook") == f"blocks.{layer}.attn.hook_rot_k"
        assert not _same(g, {k: v for k, v in w.items() if k in g})


def test_the_norm_gain_reduction_ships_within_ndifs_whitelist_and_runs_in_nnsights_simulation(family_dir, monkeypatch):
    """The reduction and what ships with it (the key path's plain classes, its weights resolved in the trace) reach
    only NDIF's whitelist; nnsight's local simulation of a remote run, this package hidden, returns what the trace
    returns here. Latent attention (DeepSeek-V3) is refused before any work."""
    from tests.engine.test_nnsight import _as_if_pip_installed
    from analysis.engine.remote import trace_batch

    for obj in (norm_gain_stats, KeyOps, NormOps):
        bad = {m for m in _reached(obj) if m.split(".")[0] not in NDIF_ALLOWED}
        assert not bad, f"{obj.__name__} reaches {bad}: NDIF allows only {sorted(NDIF_ALLOWED)}"
    nn, tokens = load_nnsight(str(family_dir("qwen3"))), _tokens(n=2, T=12)  # a key norm: its gain read there too
    acc, _ = norm_gain_accumulator(nn, tokens, 1, spike_dims=[3])
    plan = pass_plan(nn, [acc])
    here = trace_batch(nn, tokens, plan, remote=False)
    restore = _as_if_pip_installed(monkeypatch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            there = trace_batch(nn, tokens, plan, remote="local")
    finally:
        restore()
    flat = lambda r: {f"{k}.{j}": v for k, d in r.items() for j, v in (d if isinstance(d, dict) else {"": d}).items()}  # noqa: E731
    a, b = flat(here[0][2]), flat(there[0][2])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if a[k] is not None)
    with pytest.raises(ModelContractError, match="latent attention"):
        norm_gain_accumulator(load_nnsight(str(family_dir("deepseek_v3"))), tokens, 1, spike_dims=[3])


def test_the_reports_norm_gain_section_of_a_remote_model_equals_the_bridges(family_bridge, family_dir, tmp_path):
    """The report runs the section on a model loaded for NDIF (in ``NNSIGHT_SECTIONS``, not refused) through the
    remote pass, and its JSON equals the bridge's but for the key projection's site and the normalised input's check
    (no such site in a trace)."""
    from analysis.report.build import NNSIGHT_SECTIONS, NOT_REMOTE, build_report

    assert "norm_gain" in NNSIGHT_SECTIONS and "norm_gain" not in NOT_REMOTE
    keys = ["sink", "massive", "norm_gain"]
    build_report(family_bridge("llama"), tmp_path / "b", sections=keys, n=2, T=24, eps=0.1)
    build_report(load_nnsight(str(family_dir("llama"))), tmp_path / "n", sections=keys, n=2, T=24, eps=0.1)
    want, got = (json.loads((tmp_path / d / "report.json").read_text()) for d in "bn")
    assert not got["errors"] and {k for by in got["config"]["passes"].values() for k in by} == {
        "nnsight: the remote trace, run here"
    }
    g, w = got["sections"]["norm_gain"], want["sections"]["norm_gain"]
    assert g["applicable"] and g["rebuild"].pop("key_hook").endswith("hook_k_proj")
    assert g["rebuild"].pop("normalised_rel_err") is None
    for k in ("key_hook", "normalised_rel_err"):
        w["rebuild"].pop(k)
    assert not _same(g, w)


def test_a_405b_norm_gain_pass_fits_ndifs_requests(capsys):
    """Llama-3.1-405B's norm-gain pass at one layer (the report runs one, its own pass), planned on the meta device: every
    request under NDIF's limit; the sizes docs/remote.md gives."""
    from transformers import AutoModelForCausalLM

    from analysis.model.nnsight_model import wrap_nnsight
    from tests.engine.test_nnsight import llama_405b_config
    from tests.families import word_tokenizer

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(llama_405b_config())
    nn = wrap_nnsight(hf, tokenizer=word_tokenizer(), name="meta-llama/Llama-3.1-405B")
    tokens = torch.zeros(32, 64, dtype=torch.long)
    acc, _ = norm_gain_accumulator(nn, tokens, 2, spike_dims=[788, 1384])
    assert acc.path.text().startswith("Key path of layer 2: RMSNorm (gain w)")
    per, fixed = reduction_bytes(nn, tokens, pass_plan(nn, [acc]))
    p = plan_requests(32, [2], per=per, fixed=fixed)
    assert p.bytes_per_request < REQUEST_LIMIT_BYTES
    with capsys.disabled():
        print(
            f"\n405B norm gain, N=32, T=64: {p.n_requests} request(s) of {p.samples} samples, "
            f"{p.bytes_total / 2**20:.1f} MiB in all ({per / 2**10:.0f} KiB a sample)"
        )
