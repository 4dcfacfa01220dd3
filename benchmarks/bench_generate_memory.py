"""Peak memory of generating twice a model's context with ``analysis.sink_cache`` against the dense cache.

    .venv/bin/python benchmarks/bench_generate_memory.py sinks|dense [--context 512] [--window 64] [--sinks 4]

A random model in Llama's layout (4 layers, 8 KV heads of 32 dims, vocabulary 96, context ``--context``) generates
2 x context tokens greedily after a 16-token prompt (no end-of-text stop). Printed: the tokens, the most tokens any
layer's cache held at any step, the cache's size at the end, the process's peak memory over the loaded model
(``analysis/core/memory.py``: peak RSS on CPU) and the seconds. Run each policy in its own process.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("policy", choices=("sinks", "dense"))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, LlamaConfig

    from analysis import sink_cache
    from analysis.core.memory import peak_mib, reset_peak

    warnings.simplefilter("ignore")
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=args.context,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    ids = torch.randint(3, 96, (1, 16), generator=torch.Generator().manual_seed(0))
    cache, held = (sink_cache(hf, window=args.window, sinks=args.sinks) if args.policy == "sinks" else None), []
    for layer in cache.layers if cache is not None else ():

        def recorded(*a, _update=layer.update, **k):
            out = _update(*a, **k)
            held.append(out[0].shape[-2])
            return out

        layer.update = recorded
    base, t0 = reset_peak("cpu"), time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            ids,
            cache=cache,
            max_new_tokens=2 * args.context,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
        )
    seconds, used = time.perf_counter() - t0, out.cache if cache is None else cache
    mib = sum(t.numel() * t.element_size() for layer in used.layers for t in (layer.keys, layer.values)) / 2**20
    print(
        f"{args.policy}: {out.sequences.shape[1]} tokens (context {args.context}), at most "
        f"{max(held) if held else used.layers[0].keys.shape[-2]} tokens per layer, cache {mib:.2f} MiB at the end, "
        f"process peak +{peak_mib('cpu') - base:.1f} MiB over {base:.0f} MiB, {seconds:.0f} s"
    )


if __name__ == "__main__":
    main()
