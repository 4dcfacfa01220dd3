"""Streaming caches: exact against naive re-computation, sinks matter on SmolLM2, clear errors on bad input."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from analysis.model.contract import hf_module, runs_bridge_components
from analysis.model.loading import load_model
from analysis.streaming import Policy, StreamingCache, StreamResult, fake_quantize, run_policies, streaming_perplexity
from analysis.streaming.backbone import causal_lm
from tests.conftest import assert_refused_before_work, tol
from tests.tiny import make_tiny_llama_dir

NEWLINE = 5  # any id of the tiny vocabulary stands in for the newline token


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory, device):
    """One layer: a kept token's key and value depend only on the token (not on the context it was cached
    in), so a bounded cache must equal re-computing the kept tokens from scratch at positions 0..L-1.
    Large weights make attention sharp and position-sensitive. Loaded as every model is (a bridge)."""
    d = make_tiny_llama_dir(tmp_path_factory.mktemp("one-layer"), n_layers=1, init_std=0.3, n_ctx=256)
    return load_model(str(d), device=device)


@pytest.fixture(scope="module")
def two_layer_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("two-layer"), n_layers=2, init_std=0.3, n_ctx=64)


def _tokens(n, seed=0):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed))


def naive_logits(hf, tokens, policy, newline=NEWLINE):
    """Every step from scratch: the tokens the policy keeps, at positions 0..L-1, no cache (logits on the CPU); a
    loaded model runs its own Hugging Face module, a ``ReferenceLM`` itself."""
    if hf_module(hf) is not None:
        with causal_lm(hf) as lm:
            return naive_logits(lm, tokens, policy, newline)
    W, s = policy.window, policy.sinks
    device = hf.get_output_embeddings().weight.device
    tokens = tokens.to(device)
    if policy.sink_tokens == "newline":
        tokens[:s] = newline
    out = []
    with torch.no_grad():
        for t in range(len(tokens) - 1):
            kept = list(range(t + 1)) if t + 1 <= W else list(range(s)) + list(range(t + 1 - (W - s), t + 1))
            out.append(
                hf(input_ids=tokens[kept][None], position_ids=torch.arange(len(kept), device=device)[None]).logits[
                    0, -1
                ]
            )
    return torch.stack(out).cpu()


POLICIES = [Policy("window", 16), Policy("sinks", 16, 1), Policy("sinks", 16, 4), Policy("sinks", 16, 4, "newline")]


@pytest.mark.parametrize("prefill", [0, None])
def test_cache_matches_naive_recomputation(one_layer, prefill, device):
    tokens = _tokens(70)
    runs = run_policies(one_layer, tokens, POLICIES, newline=NEWLINE, prefill=prefill, keep_logits=True)
    for pol, run in zip(POLICIES, runs):
        ref = naive_logits(one_layer, tokens, pol)
        assert run.logits.shape == ref.shape
        torch.testing.assert_close(run.logits, ref, atol=tol(device, 1e-4), rtol=0, msg=lambda m: f"{pol.label}: {m}")
        # The NLL is that of the next token under those logits.
        nll = torch.nn.functional.cross_entropy(
            ref,
            (
                tokens.clone()
                if pol.sink_tokens == "first"
                else torch.cat([torch.full((pol.sinks,), NEWLINE), tokens[pol.sinks :]])
            )[1:],
            reduction="none",
        )
        np.testing.assert_allclose(run.nll, nll.numpy(), atol=tol(device, 1e-4))


def test_streaming_attention_equals_eager(two_layer_dir, monkeypatch, device):
    """The grouped-query decode function (analysis.streaming.attention) gives Hugging Face eager attention's
    logits and the same sinks' share, which the eager path reads from the returned attention maps."""
    import analysis.streaming.perplexity as perplexity

    hf = load_model(str(two_layer_dir), device=device)
    tokens, pols = _tokens(60, seed=2), POLICIES
    ours = run_policies(hf, tokens, pols, newline=NEWLINE, keep_logits=True)
    monkeypatch.setattr(perplexity, "decode_attention", lambda hf: "eager")
    eager = run_policies(hf, tokens, pols, newline=NEWLINE, keep_logits=True)
    for a, b in zip(ours, eager):
        torch.testing.assert_close(a.logits, b.logits, atol=tol(device, 1e-4), rtol=0)
        assert a.sink_share == pytest.approx(b.sink_share, abs=tol(device, 1e-6)) and 0 < a.sink_share < 1
    assert hf_module(hf).config._attn_implementation != "streaming"  # the model's own choice is restored


def test_rerotation_is_what_makes_it_exact(one_layer, monkeypatch):
    """Without re-rotating the sinks as the window moves, the cache no longer matches (the test can fail)."""
    import analysis.streaming.perplexity as perplexity

    tokens = _tokens(70)
    pol = Policy("sinks", 16, 4)
    monkeypatch.setattr(perplexity, "rope_spec", lambda hf: None)
    run = run_policies(one_layer, tokens, [pol], keep_logits=True)[0]
    assert (run.logits - naive_logits(one_layer, tokens, pol)).abs().max() > 1e-2


def test_multilayer_cache_equals_full_forward_until_eviction(two_layer_dir, device):
    """Before anything is evicted every policy is the dense model; the dense cache equals one forward pass."""
    hf = load_model(str(two_layer_dir), device=device)
    tokens = _tokens(40, seed=1)
    with torch.no_grad():
        full = hf(tokens.to(device)[None])[0, :-1].cpu()  # the bridge's own forward
    dense, win = (
        run_policies(hf, tokens, [Policy("dense")], prefill=10, keep_logits=True)[0],
        run_policies(hf, tokens, [Policy("sinks", 24, 2)], prefill=0, keep_logits=True)[0],
    )
    torch.testing.assert_close(dense.logits, full, atol=tol(device, 1e-4), rtol=0)
    torch.testing.assert_close(win.logits[:24], full[:24], atol=tol(device, 1e-4), rtol=0)
    assert (win.logits[30:] - full[30:]).abs().max() > 1e-3  # after eviction it is a different model


def test_fake_quantize_error_and_full_precision_sinks():
    x = torch.randn(2, 3, 10, 64)
    for bits in (8, 4):
        err = (fake_quantize(x, bits) - x).abs()
        step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / (2**bits - 1)
        assert (err <= step / 2 + 1e-6).all()
        assert err.mean() > 0
    cache = StreamingCache(1, None, capacity=8, sinks=[2, 2], bits=[4, 4], fp_tokens=[0, 2])
    k, v = torch.randn(2, 3, 5, 64), torch.randn(2, 3, 5, 64)
    keys, values = cache.update(k, v, 0)
    assert not torch.equal(keys[0, :, :2], k[0, :, :2])  # row 0 quantises its sinks
    assert torch.equal(keys[1, :, :2], k[1, :, :2]) and torch.equal(values[1, :, :2], v[1, :, :2])  # row 1 keeps them
    assert not torch.equal(keys[1, :, 2:], k[1, :, 2:])
    b0, b1 = cache.kv_bytes()
    assert b1 > b0  # full-precision sinks cost more than 4-bit ones


def test_sinks_rescue_the_window_on_smollm2(smollm2):
    """The embedded model, a short stream and a 32-token cache: the window collapses once token 1 leaves;
    4 sinks + 28 recent stay close to re-computing the window, and the sinks draw much of the attention."""
    res = streaming_perplexity(
        smollm2, window=32, n_tokens=192, sinks=(0, 4), newline_sinks=None, bits=(), dense=False, recompute_every=8
    )
    t = res.table.set_index("policy")
    win, sinks, rec = t.loc["0+32"], t.loc["4+28"], t.loc["recompute 32"]
    assert win["ppl_past_window"] > 1.5 * sinks["ppl_past_window"]
    assert sinks["ppl_at_recompute"] < 1.5 * rec["ppl_at_recompute"]
    assert sinks["sink_attention"] > 0.2 > win["sink_attention"]
    before, after = res.jump("0+32", width=16)
    assert after > before + 0.5  # the jump when token 1 leaves the cache
    again = StreamResult.from_dict(json.loads(json.dumps(res.to_dict())))
    np.testing.assert_allclose(again.table["ppl"], res.table["ppl"], rtol=1e-4)  # the JSON keeps 6 digits
    assert "0+32" in res.text() and "4+28" in res.text()


def test_bad_input_errors(one_layer, tmp_path, device):
    with pytest.raises(ValueError, match="smaller than the window"):
        Policy("sinks", 16, 16)
    with pytest.raises(ValueError, match="context"):
        streaming_perplexity(one_layer, _tokens(600), window=512, sinks=(0,), bits=(), newline_sinks=None)
    with pytest.raises(ValueError, match="not longer than the window"):
        streaming_perplexity(one_layer, _tokens(10), window=16, sinks=(0,), bits=(), newline_sinks=None)
    with pytest.raises(ValueError, match="smaller than the window"):
        streaming_perplexity(one_layer, _tokens(40), window=16, sinks=(0, 16), bits=(), newline_sinks=None)
    with pytest.raises(ValueError, match="larger than the context of synthetic-softmax .64 tokens.; use --window 64"):
        streaming_perplexity(load_model("synthetic-softmax", device=device), window=128)  # reference models stream


def test_a_name_or_a_bare_hf_model_is_refused_before_any_work(one_layer, tmp_path):
    """The 0.1.0 call forms are gone: a name, a path or a bare Hugging Face model gets one line saying what to do."""
    from analysis.streaming import recompute_nll

    calls = {
        "streaming_perplexity": lambda m: streaming_perplexity(m, _tokens(40), window=16),
        "run_policies": lambda m: run_policies(m, _tokens(40), [Policy("dense")]),
        "recompute_nll": lambda m: recompute_nll(m, _tokens(40), 16),
    }
    assert_refused_before_work(calls, ("smollm2-135m", tmp_path, hf_module(one_layer)), hf_module(one_layer))


def test_the_cache_passes_decode_the_loaded_models_own_module(one_layer, monkeypatch, device):
    """No second copy from disk: inside ``causal_lm`` the bridge's own Hugging Face module runs its own attention
    (same weights, same logits as the bridge), and the bridge is whole again after, even after an error."""
    from transformers import AutoModelForCausalLM

    def no_load(*a, **k):
        raise AssertionError("the streaming passes loaded a model from disk")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_load)
    tokens = _tokens(24).to(device)[None]
    with torch.no_grad():
        bridged = one_layer(tokens)
        with causal_lm(one_layer) as lm:
            assert lm is hf_module(one_layer) and not runs_bridge_components(lm)
            own = lm(input_ids=tokens).logits
        with pytest.raises(RuntimeError), causal_lm(one_layer):
            raise RuntimeError("inside the block")
        assert runs_bridge_components(hf_module(one_layer))
        torch.testing.assert_close(own, bridged, atol=tol(device, 1e-4), rtol=0)
        torch.testing.assert_close(one_layer(tokens), bridged, atol=0, rtol=0)
    res = streaming_perplexity(
        one_layer, _tokens(24), window=16, sinks=(2,), bits=(), newline_sinks=None, dense=False, recompute_every=None
    )
    assert res.backend["name"] == "transformers" and [r.policy.label for r in res.runs] == ["2+14"]


def test_cli_prints_the_table_and_writes_json(two_layer_dir, tmp_path, capsys, no_network, device):
    from analysis.__main__ import main

    out = tmp_path / "s.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecation from the package's own calls (cache=)
        rc = main(
            [
                "stream",
                "--model",
                str(two_layer_dir),
                "--window",
                "16",
                "--tokens",
                "48",
                "--sinks",
                "0,2",
                "--newline-sinks",
                "0",
                "--kv-bits",
                "4",
                "--quant-sinks",
                "2",
                "--recompute-every",
                "4",
                "--quiet",
                "--json",
                str(out),
                "--csv",
                str(tmp_path / "s.csv"),
                "--device",
                device,
            ]
        )
    text = capsys.readouterr().out
    assert rc == 0 and "2+14 int4 (sinks fp)" in text and "recompute 16" in text
    assert "shared by 4" in text and "decoded together" in text  # the cached policies share one timing, and say so
    assert text.index("recompute 16") < text.index("wrote")  # printed before written
    payload = json.loads(out.read_text())
    assert payload["stream"]["n_tokens"] == 48 and len(payload["runs"]) == 6
    assert payload["device"].startswith(device) and payload["dtype"] == "float32"
    assert payload["backend"]["name"] == "transformers"
    assert main(["stream", "--model", str(two_layer_dir), "--window", "16", "--sinks", "16"]) == 2
    assert "smaller than the window" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["transformer_lens", "nnsight"])
def test_cli_backend_that_keeps_no_cache_is_refused_before_the_model_loads(backend, capsys, monkeypatch):
    """`stream` decodes with a KV cache, which only the Hugging Face model's own attention keeps: auto and
    transformers run it; the bridge and nnsight are refused with the reason, before anything loads."""
    from analysis.__main__ import main

    monkeypatch.setattr("analysis.model.loading.load_model", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["stream", "--backend", backend]) == 2
    err = capsys.readouterr().err
    assert f"--backend {backend} does not apply to stream" in err and "KV cache" in err
