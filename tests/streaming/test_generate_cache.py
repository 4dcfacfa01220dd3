"""Sink-aware generation (``analysis.sink_cache``): greedy ``model.generate`` with the cache equals StreamingLLM decoded
step by step by hand, on SmolLM2 and tiny models of three other families in their real layouts (a sliding-window one,
Gemma 3's local/global layers with two rotary bases, Phi's partial rotary); bad settings are refused before the work;
a generation twice the model's context long keeps ``window`` tokens per layer."""

from __future__ import annotations

import warnings

import pytest
import torch

from analysis import sink_cache
from analysis.model.contract import hf_module
from analysis.streaming import fake_quantize
from analysis.streaming.backbone import causal_lm
from tests.families import family_config

NEW = 64


def tiny(family: str, *, layers: int | None = None, **config):
    """A random ``family`` model in its real layout (tests/families.py), float32, with large weights: sharp,
    position-sensitive attention and varied greedy outputs."""
    from transformers import AutoModelForCausalLM

    cfg = family_config(family)
    cfg.initializer_range = 0.3
    if layers:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[-layers:]
    for k, v in config.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _kv(cache, layer: int):
    return cache.layers[layer].keys, cache.layers[layer].values


def streaming_reference(hf, prompt: torch.Tensor, *, window: int, sinks: int, new: int, bits: int | None = None):
    """StreamingLLM by hand, one token at a time, with the model's own plain ``DynamicCache`` and no rotation code: a
    kept token's keys and values are those computed when it entered (at its stream position t, so the recent ones sit
    at their true distance from the query); the sinks' are re-computed each step by running the sink tokens alone at
    positions E..E+s-1 (E: tokens evicted), which puts them at distance window-1-i from the query, StreamingLLM's
    positions (rotary attention depends on distances only). ``bits``: the window's keys and values quantised as they
    enter (before the step that enters them attends), the sinks kept in full precision. Returns the greedy tokens after ``prompt``."""
    from transformers import DynamicCache

    class Entering(DynamicCache):  # quantises what enters after it is armed: the stepped token's keys and values
        armed = None

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.armed:
                key_states, value_states = self.armed(key_states), self.armed(value_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    ids, kv, out = prompt.tolist(), [], []
    L = hf.config.num_hidden_layers
    with torch.no_grad():
        for t in range(len(prompt) + new - 1):
            kept = list(range(t)) if t <= window - 1 else list(range(sinks)) + list(range(t - (window - 1 - sinks), t))
            evicted = max(0, t - (window - 1))
            cache = Entering()
            if evicted and sinks:
                sink_kv = hf(
                    input_ids=torch.tensor([ids[:sinks]]),
                    position_ids=torch.arange(sinks)[None] + evicted,
                    use_cache=True,
                ).cache
            for layer in range(L):
                parts = [(*_kv(sink_kv, layer),)] if evicted and sinks else []
                parts += [kv[j][layer] for j in kept[sinks if evicted else 0 :]]
                if parts:
                    cache.update(torch.cat([p[0] for p in parts], -2), torch.cat([p[1] for p in parts], -2), layer)
            cache.armed = (lambda x: fake_quantize(x, bits)) if bits and t >= sinks else None
            res = hf(input_ids=torch.tensor([[ids[t]]]), position_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
            kv.append([(k[:, :, -1:], v[:, :, -1:]) for k, v in (_kv(res.cache, l) for l in range(L))])
            if t >= len(prompt) - 1:
                out.append(int(res.logits[0, -1].argmax()))
                ids.append(out[-1])
    return out


def naive_recompute(hf, prompt: torch.Tensor, *, window: int, sinks: int, new: int):
    """Each new token from scratch: the kept tokens (the sinks and the last window-sinks) at positions 0..len-1, no
    cache. Equal to the cached StreamingLLM only for one layer (a kept token's key and value then depend on the token
    alone, not on the context it entered with)."""
    ids, out = prompt.tolist(), []
    with torch.no_grad():
        for _ in range(new):
            kept = ids if len(ids) <= window else ids[:sinks] + ids[len(ids) - (window - sinks) :]
            out.append(
                int(
                    hf(input_ids=torch.tensor([kept]), position_ids=torch.arange(len(kept))[None])
                    .logits[0, -1]
                    .argmax()
                )
            )
            ids.append(out[-1])
    return out


def generated(hf, prompt: torch.Tensor, cache, new: int = NEW, **kwargs) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            prompt[None], cache=cache, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs
        )  # no end-of-text stop: the references do not stop either
    return out[0, len(prompt) :].tolist()


def _prompt(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# family -> (window, sinks, prompt length, bits): prompts shorter and longer than the window (the longer ones are fed a
# token at a time, prefill_chunk_size=1), one quantised window; every window evicts at least 40 times in 64 tokens.
CASES = {"mistral": (8, 2, 20, None), "gemma3": (8, 2, 6, None), "phi": (16, 4, 24, 4)}


@pytest.fixture
def smollm2_hf(smollm2):
    """SmolLM2's own causal LM in its own attention (the bridge's attention keeps no cache), for the test only."""
    with causal_lm(smollm2) as hf:
        yield hf


def _check(hf, prompt, *, window, sinks, bits=None, dense=True):
    chunk = {"prefill_chunk_size": 1} if len(prompt) > window else {}
    cache = sink_cache(hf, window=window, sinks=sinks, bits=bits)
    got = generated(hf, prompt, cache, **chunk)
    want = streaming_reference(hf, prompt, window=window, sinks=sinks, new=NEW, bits=bits)
    assert got == want
    assert len(set(got)) >= 8, f"a degenerate greedy output proves little: {got}"
    assert all(layer.keys.shape[-2] == window for layer in cache.layers)
    assert cache.layers[0].evictions == len(prompt) + NEW - 1 - window
    if dense:
        assert generated(hf, prompt, None) != got, "the evictions changed nothing: the test could not see a wrong cache"
    return got


@pytest.mark.slow
def test_generate_equals_streaming_llm_on_smollm2(smollm2, smollm2_hf):
    """Natural text (random tokens send SmolLM2 into a two-token loop)."""
    text = 'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed'
    _check(smollm2_hf, smollm2.tokenizer(text, return_tensors="pt").input_ids[0][:14], window=16, sinks=4, dense=False)


@pytest.mark.parametrize("family", list(CASES))
def test_generate_equals_streaming_llm_on_tiny_families(family):
    window, sinks, n, bits = CASES[family]
    hf = tiny(family)
    _check(hf, _prompt(n, hf.config.vocab_size), window=window, sinks=sinks, bits=bits)


@pytest.mark.parametrize("family", list(CASES))
def test_one_layer_generate_equals_naive_recomputation(family):
    """One layer: the cache must equal re-computing the kept tokens from scratch at positions 0..len-1."""
    window, sinks, n, _ = CASES[family]
    hf = tiny(family, layers=1)
    prompt = _prompt(min(n, window), hf.config.vocab_size, seed=1)
    got = generated(hf, prompt, sink_cache(hf, window=window, sinks=sinks))
    assert got == naive_recompute(hf, prompt, window=window, sinks=sinks, new=NEW)
    assert len(set(got)) >= 8


def test_two_contexts_in_bounded_memory():
    """Twice the model's context (64 tokens) generated: never more than ``window`` tokens in any layer."""
    hf = tiny("llama", max_position_embeddings=64)
    cache, held = sink_cache(hf, window=16, sinks=4), []
    for layer in cache.layers:

        def recorded(*args, _update=layer.update, **kwargs):
            keys, values = _update(*args, **kwargs)
            held.append(keys.shape[-2])
            return keys, values

        layer.update = recorded
    got = generated(hf, _prompt(8, 96), cache, new=128)
    assert len(got) == 128 and len(held) == 2 * 128 and max(held) == 16


@pytest.mark.parametrize(
    "family,kwargs,match",
    [
        ("llama", dict(window=8, sinks=8), "sinks=8 must be smaller than the window"),
        ("llama", dict(window=200, sinks=4), "use window <= 128"),
        ("mistral", dict(window=16, sinks=4), "sliding window \\(8\\).*use window <= 8"),
        ("gpt2", dict(window=16, sinks=4), "learned absolute positions"),
        ("bloom", dict(window=16, sinks=4), "ALiBi"),
        ("qwen3_next", dict(window=16, sinks=4), "linear attention .* layers \\(\\[0, 1, 2\\]\\)"),
        ("deepseek_v3", dict(window=16, sinks=4), "latent attention"),
        ("llama", dict(window=16, sinks=4, bits=5), "bits must be 8, 4, 3 or 2"),
    ],
)
def test_bad_settings_are_refused(family, kwargs, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from tests.families import make_family_model

        hf = make_family_model(family)
    with pytest.raises(ValueError, match=match):
        sink_cache(hf, **kwargs)


def test_the_bridge_is_refused(smollm2):
    """The bridge's Hugging Face module keeps no cache: generate would silently ignore the sink cache."""
    for model in (smollm2, hf_module(smollm2)):
        with pytest.raises(ValueError, match="keeps no KV cache.*causal_lm"):
            sink_cache(model, window=16, sinks=4)


def test_a_prompt_longer_than_the_window_needs_token_by_token_prefill():
    hf = tiny("llama")
    with pytest.raises(ValueError, match="prefill_chunk_size=1"):
        generated(hf, _prompt(20, 96), sink_cache(hf, window=16, sinks=4), new=2)
