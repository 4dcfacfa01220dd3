"""Decoding cost per token with a sinks + window cache against a dense cache, at several stream lengths.

    .venv/bin/python benchmarks/bench_streaming.py [--model smollm2-135m] [--lengths 5000 10000 20000]
        [--window 1024] [--sinks 4] [--steps 32] [--threads 1]

For each stream length L and each policy, a fresh cache is put in the state it has after L tokens (the
dense cache holds L tokens, the sinks + window cache holds ``window``, evicted L - window times, its sinks
re-rotated accordingly), filled with random keys and values (the cost of a step depends on the cache's
size, not its content: decoding 20k real tokens on 2 CPU cores takes hours), then ``--steps`` tokens are
decoded one at a time through the Hugging Face model, under the attention function `analysis stream` uses
(``analysis.streaming.attention``: grouped-query decode steps). Printed: tokens/s, peak memory of the decode
(``analysis/core/memory.py``: process peak RSS on CPU, torch.cuda.max_memory_allocated on CUDA) and the KV
cache size, and the dense/sinks ratios, all from one run. Dense past the model's context (8192 for
SmolLM2) is measured for its cost only: its perplexity there would be meaningless.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from analysis.core.memory import measure  # noqa: E402


def primed_cache(hf, capacity, sinks, length, device):
    """A StreamingCache in the state it has after ``length`` tokens, with random keys and values."""
    from analysis.streaming.backbone import n_layers
    from analysis.streaming.cache import StreamingCache, rope_spec

    cfg = hf.config.get_text_config(decoder=True)
    H = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = StreamingCache(n_layers(hf), rope_spec(hf), capacity, [sinks])
    L = length if capacity is None else min(length, capacity)
    g = torch.Generator(device="cpu").manual_seed(0)
    for layer in cache.layers:
        k, v = (torch.randn(1, H, L, D, generator=g).to(device) for _ in range(2))
        layer.update(k, v)
        layer.n_seen = length  # as if the whole stream went through
        if capacity is not None:
            layer.ptr = torch.tensor([sinks + (length - capacity) % (capacity - sinks)], device=device)
    return cache


@torch.no_grad()
def decode(hf, cache, start, steps, device):
    ids = torch.randint(0, hf.config.vocab_size, (1, steps), device=device)
    for i in range(steps):
        hf(
            input_ids=ids[:, i : i + 1],
            position_ids=torch.tensor([[cache.position(start + i)]], device=device),
            past_key_values=cache,
            use_cache=True,
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", type=int, nargs="+", default=[5000, 10000, 20000])
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--steps", type=int, default=32, help="tokens decoded per measurement")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from analysis.model.families import attention_implementation
    from analysis.model.loading import load_model
    from analysis.streaming.backbone import causal_lm
    from analysis.streaming.perplexity import decode_attention

    model = load_model(args.model, device=args.device)
    with (
        causal_lm(model) as hf,
        attention_implementation(hf, decode_attention(hf)),
    ):  # what `analysis stream` decodes with
        return _measure(hf, model.model_name, args)


def _measure(hf, name: str, args) -> int:
    """The table, on the model's own causal LM ``hf``."""
    decode(
        hf, primed_cache(hf, args.window, args.sinks, args.window + 8, args.device), args.window + 8, 4, args.device
    )  # warm-up
    policies = {"dense": None, f"{args.sinks}+{args.window - args.sinks}": args.window}
    print(
        f"{name}, {args.device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
        f"{args.steps} tokens decoded after a stream of L tokens"
    )
    print(f"{'L':>7} {'policy':>10} {'tokens/s':>9} {'peak MiB':>9} {'KV MiB':>8}")
    rows = {}
    for L in args.lengths:
        for label, cap in policies.items():
            cache = primed_cache(hf, cap, args.sinks if cap else 0, L, args.device)
            kv = sum(cache.kv_bytes()) / 2**20
            sec, peak, _ = measure(lambda: decode(hf, cache, L, args.steps, args.device), args.device)
            rows[L, label] = (args.steps / sec, peak, kv)
            print(f"{L:>7} {label:>10} {args.steps / sec:>9.1f} {peak:>9.0f} {kv:>8.1f}", flush=True)
            del cache
    sink_label = list(policies)[1]
    print("\nratios (sinks + window / dense): tokens/s, KV MiB")
    for L in args.lengths:
        d, s = rows[L, "dense"], rows[L, sink_label]
        print(f"{L:>7} {s[0] / d[0]:>6.2f}x {s[2] / d[2]:>6.3f}x")
    first, last = args.lengths[0], args.lengths[-1]
    print(
        f"tokens/s from L={first} to L={last}: dense x{rows[last, 'dense'][0] / rows[first, 'dense'][0]:.2f}, "
        f"{sink_label} x{rows[last, sink_label][0] / rows[first, sink_label][0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
