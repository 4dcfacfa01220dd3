"""Streaming the project's reference models (``analysis.train.SinkLM``), the learnable sink token included: the
bounded cache equals naive re-computation, the learned slot's share is the model's own, clear errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers.cache_utils import DynamicCache

from analysis.model.loading import load_model
from analysis.streaming import Policy, run_policies, streaming_perplexity
from analysis.streaming.cache import rope_spec
from analysis.streaming.reference import ReferenceLM
from analysis.train import TrainConfig, train
from analysis.model.reference.config import ModelConfig
from analysis.model.reference.sink_lm import SinkLM
from tests.conftest import tol
from tests.streaming.test_streaming import POLICIES, naive_logits

VOCAB = 97


def tiny(attention: str, n_layers: int = 1, positions: str = "rotary", seed: int = 0, device: str = "cpu") -> SinkLM:
    """Random weights, large enough (std 0.3) that attention is sharp and depends on position; on ``device``."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        d_vocab=VOCAB,
        n_ctx=64,
        d_model=32,
        n_layers=n_layers,
        n_heads=4,
        n_key_value_heads=2,
        d_head=8,
        d_mlp=64,
        attention=attention,
        init_std=0.3,
        positional_embedding_type=positions,
    )
    m = SinkLM(cfg).to(device).eval()
    m.model_name = f"tiny-{attention}"
    return m


def _tokens(n, seed=0):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attention", ["sink-token", "softmax", "kv-bias", "sigmoid"])
def test_reference_cache_matches_naive_recomputation(attention, device):
    """One layer: the kept tokens' keys and values do not depend on their context, so the bounded cache (keys
    rotated at stream positions, sinks re-rotated, the sink token one position before the oldest kept token) must
    equal the model's own forward on the kept tokens at positions 0..L-1, at every step."""
    m = tiny(attention, device=device)
    hf = ReferenceLM(m)
    assert rope_spec(hf) is not None
    tokens = _tokens(60)
    runs = run_policies(m, tokens, POLICIES, newline=5, keep_logits=True)
    for pol, run in zip(POLICIES, runs):
        torch.testing.assert_close(
            run.logits,
            naive_logits(hf, tokens, pol),
            atol=tol(device, 1e-4),
            rtol=0,
            msg=lambda m: f"{attention} {pol.label}: {m}",
        )


def test_the_sink_token_position_is_what_makes_it_exact(monkeypatch, device):
    """Kept at position -1 as the window moves (not one before the oldest kept token), the cache differs from the
    naive re-computation: the test above can fail."""
    orig = SinkLM.cache_positions

    def sink_token_at_minus_one(self, positions, cache):
        pos = orig(self, positions, cache)
        fixed = orig(self, positions, DynamicCache())  # a cache without capacity: the sink token stays at -1
        pos.slot_cos, pos.slot_sin = fixed.slot_cos, fixed.slot_sin
        return pos

    monkeypatch.setattr(SinkLM, "cache_positions", sink_token_at_minus_one)
    m = tiny("sink-token", device=device)
    hf = ReferenceLM(m)
    tokens, pol = _tokens(60), Policy("sinks", 16, 2)
    run = run_policies(m, tokens, [pol], keep_logits=True)[0]
    assert (run.logits[20:] - naive_logits(hf, tokens, pol)[20:]).abs().max() > 1e-3


@pytest.mark.parametrize("attention", ["sink-token", "softmax"])
def test_multilayer_decode_equals_forward(attention, device):
    """Decoding in pieces through a KV cache gives the forward pass on the whole sequence (3 layers)."""
    m = tiny(attention, n_layers=3, device=device)
    tokens = _tokens(50, seed=1)[None].repeat(2, 1)
    on = tokens.to(device)
    with torch.no_grad():
        full = m(on)
        cache = DynamicCache()
        parts = [m.decode(on[:, :20], torch.arange(20, device=device), cache)]
        parts += [m.decode(on[:, t : t + 1], torch.tensor([t], device=device), cache) for t in range(20, 50)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=tol(device, 1e-4), rtol=0)  # cached against SDPA
    dense = run_policies(m, tokens[0], [Policy("dense")], prefill=7, keep_logits=True)[0]
    torch.testing.assert_close(dense.logits, full[0, :-1].cpu(), atol=tol(device, 1e-4), rtol=0)


def _naive_slot_share(m, tokens, window):
    """Mean weight of the last query on the sink token, over heads and the token-by-token steps (naive; the first
    ``window`` tokens are prefilled, unmeasured)."""
    got, tokens = [], tokens.to(m.device)

    def keep(w, hook):
        got.append(w[0, :, -1].mean())

    with torch.no_grad(), m.hooks(fwd_hooks=[("blocks.0.attn.hook_sink_pattern", keep)]):
        for t in range(window, len(tokens) - 1):
            m(tokens[max(0, t + 1 - window) : t + 1][None])
    return float(torch.stack(got).mean())


def test_learned_sink_share_is_the_models_own(device):
    """The share reported for the sink token equals the weight the model itself puts on it (its
    ``hook_sink_pattern``), re-computed naively; a model without a learned slot reports none."""
    m, tokens = tiny("sink-token", device=device), _tokens(60, seed=3)
    run = run_policies(m, tokens, [Policy("window", 16)])[0]  # a model of the contract: decoded as a ReferenceLM
    assert 0 < run.learned_share < 1
    assert run.learned_share == pytest.approx(_naive_slot_share(m, tokens, 16), abs=tol(device, 1e-5))
    plain = run_policies(tiny("softmax", device=device), tokens, [Policy("window", 16)])[0]
    assert plain.learned_share is None and 0 < plain.sink_share < 1


def test_models_that_cannot_stream_say_why():
    with pytest.raises(ValueError, match="cannot be decoded with a KV cache.*rotary"):
        ReferenceLM(tiny("softmax", positions="alibi"))
    m = tiny("softmax")
    with pytest.raises(ValueError, match="window 128 is larger than the context .*64"):
        streaming_perplexity(m, _tokens(300), window=128)
    with pytest.raises(ValueError, match="no tokenizer and no synthetic training task"):
        streaming_perplexity(m, window=16, n_tokens=100)


@pytest.fixture(scope="module")
def trained_sink_token(tmp_path_factory, device):
    """A sink-token model trained for a few steps on the synthetic task, saved as a reference folder."""
    out = tmp_path_factory.mktemp("ref") / "sink-token"
    mcfg = ModelConfig(
        d_vocab=65, n_ctx=64, d_model=32, n_layers=1, n_heads=2, d_head=16, d_mlp=64, attention="sink-token"
    )
    tcfg = TrainConfig(
        dataset="synthetic",
        steps=3,
        batch_size=4,
        eval_every=0,
        log_every=1,
        progress=False,
        probe_size=4,
        out=str(out),
        device=device,
    )
    train(mcfg, tcfg)
    return out


def test_reference_folder_streams_its_own_task_from_the_cli(trained_sink_token, tmp_path, device):
    """``python -m analysis stream`` on a reference folder: the stream is drawn from the model's synthetic task
    (no tokenizer, so no newline sinks), the table has the learned slot's share, the JSON round-trips."""
    from analysis.streaming import StreamResult

    out = tmp_path / "s.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "analysis",
            "stream",
            "--model",
            str(trained_sink_token),
            "--window",
            "16",
            "--sinks",
            "0,1",
            "--tokens",
            "80",
            "--kv-bits",
            "",
            "--recompute-every",
            "4",
            "--quiet",
            "--json",
            str(out),
            "--device",
            device,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "learned_sink_attention" in r.stdout and "learned sink slot" in r.stdout
    assert "newline sinks left out: the model has no tokenizer" in r.stdout
    res = StreamResult.load(out)
    assert "synthetic bigram-copy task" in res.stream["source"] and res.stream["n_tokens"] == 80
    assert res.tokens[0] == 0  # the task's BOS
    t = res.table.set_index("policy")
    assert set(t.index) == {"dense", "0+16", "1+15", "recompute 16"}
    assert 0 < t.loc["0+16", "learned_sink_attention"] < 1
    assert np.isfinite(t.loc["1+15", "ppl_at_recompute"])


COMMITTED = ["synthetic-softmax", "synthetic-sink-token", "synthetic-kv-bias"]


@pytest.mark.cpu_only  # per-position NLL to 1e-4 against the committed run, which was decoded on the CPU
@pytest.mark.parametrize("name", COMMITTED)
def test_committed_reference_run_reproduces_on_its_first_tokens(name):
    """The committed full run (data/streaming/reference-NAME.json) re-run on its first 400 tokens with the same
    command: the stream is the same prefix and every policy's per-position NLL matches to 1e-4."""
    from analysis.core.io import DATA_DIR
    from analysis.streaming import StreamResult

    full = StreamResult.load(DATA_DIR / "streaming" / f"reference-{name}.json")
    n = 400
    sinks = sorted(
        {
            r.policy.sinks
            for r in full.runs
            if r.policy.kind in ("window", "sinks") and r.policy.bits is None and r.policy.sink_tokens == "first"
        }
    )
    small = streaming_perplexity(
        load_model(name, device="cpu"),
        window=full.window,
        n_tokens=n,
        sinks=sinks,
        bits=(),
        dense=False,
        recompute_every=None,
        seed=full.stream["seed"],
    )
    assert small.tokens == full.tokens[:n]
    for run in small.runs:
        ref = full.run(run.policy.label).nll[: n - 1]
        np.testing.assert_allclose(run.nll, ref, atol=1e-4, err_msg=run.policy.label)
