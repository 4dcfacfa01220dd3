"""Streaming sink metric against a plain forward pass and the usual peer methods.

    .venv/bin/python benchmarks/bench_sink.py [--model smollm2-135m] [--n 100] [--T 64 1024]

For each T, on the same N natural-text sequences and the same batches, it measures:
  (a) plain forward     the TransformerBridge forward, no hooks
  (b) streaming sink    analysis.sink_metric: hook_pattern reducers, alpha for keys 1..16 only
  (c) HF eager maps     Hugging Face eager attention with output_attentions=True, all maps of a batch kept
  (d) TL run_with_cache TransformerLens run_with_cache, every activation of a batch kept
(c) and (d) then compute the same alpha from the kept maps. It prints wall time and peak memory (peak resident
memory of the process on CPU, reset between methods through /proc/self/clear_refs; peak allocated memory on
CUDA) and their ratios to (a). All in one run, so the ratios compare like with like.
"""
from __future__ import annotations

import argparse

import torch

from analysis import load_model, natural_probe, sink_metric
from analysis.hooks import batches, default_batch_size
from analysis.sink import alpha_from_pattern
from memory import measure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--T", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--batch-size", type=int, default=None, help="default: about 2k tokens a batch")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    bridge = load_model(args.model, device=args.device)
    # A separate Hugging Face model with eager attention for (c) (the bridge wraps its own copy's modules).
    from transformers import AutoModelForCausalLM

    from analysis.models import DEFAULT_MODEL, smollm2_dir

    src = str(smollm2_dir()) if args.model == DEFAULT_MODEL else args.model
    hf = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager", dtype=torch.float32).to(args.device).eval()
    print(f"model {args.model} on {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows = []
    for T in args.T:
        tokens = natural_probe(bridge.tokenizer, n=args.n, T=T).tokens
        bs = args.batch_size or default_batch_size(tokens)
        K = min(T, 16)
        L = bridge.cfg.n_layers

        def plain():
            with torch.inference_mode():
                for b in batches(tokens, bs):
                    bridge(b.to(args.device))

        def streaming():
            sink_metric(bridge, tokens, k_max=K, batch_size=bs)

        def hf_eager():
            with torch.inference_mode():
                out = []
                for b in batches(tokens, bs):
                    maps = hf(b.to(args.device), output_attentions=True).attentions  # L x (B,H,T,T)
                    out.append(torch.stack([alpha_from_pattern(m, K).cpu() for m in maps], 1))

        def tl_cache():
            with torch.inference_mode():
                out = []
                for b in batches(tokens, bs):
                    _, cache = bridge.run_with_cache(b.to(args.device))
                    out.append(torch.stack([alpha_from_pattern(cache[f"blocks.{l}.attn.hook_pattern"], K).cpu() for l in range(L)], 1))
                    del cache

        with torch.inference_mode():  # warm-up on one batch
            bridge(tokens[:bs].to(args.device))
        for name, fn in [("(a) plain forward", plain), ("(b) streaming sink", streaming), ("(c) HF eager maps", hf_eager), ("(d) TL run_with_cache", tl_cache)]:
            wall, peak, _ = measure(fn, args.device)
            rows.append((T, name, wall, peak))
            print(f"  T={T:<5} {name:<22} {wall:8.2f} s  {peak:9.0f} MiB", flush=True)

    print(f"\nN = {args.n} sequences, batches of about 2k tokens; ratios are to (a) at the same T")
    print(f"{'T':>5}  {'method':<22} {'time (s)':>9} {'x (a)':>6} {'peak (MiB)':>11} {'x (a)':>6}")
    for T in args.T:
        base = next(r for r in rows if r[0] == T and r[1].startswith("(a)"))
        for t, name, wall, peak in (r for r in rows if r[0] == T):
            print(f"{t:>5}  {name:<22} {wall:>9.2f} {wall / base[2]:>6.2f} {peak:>11.0f} {peak / base[3]:>6.2f}")


if __name__ == "__main__":
    main()
