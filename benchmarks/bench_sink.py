"""The sink metric against a Hugging Face SDPA forward pass (the floor) and the usual peer methods.

    .venv/bin/python benchmarks/bench_sink.py [--model smollm2-135m] [--T 64 1024 8192] [--n 100 10 2]

For each T (with its own N: one --n for all, or one per T), on the same natural-text sequences and the same
batches (about 2k tokens each), each method runs in its own fresh process (so no method inherits another's
allocator state or peak) and reports wall time, process CPU time and peak memory (``analysis/core/memory.py``);
with --repeat R every method runs R times, in rotating order, and the table keeps its least time (the least
disturbed run on a shared machine) and its largest peak:
  (a) SDPA forward       Hugging Face model, attn_implementation="sdpa", logits, no KV cache: the floor
  (b) SDPA base model    the same without the unembedding (what the fused sink runs)
  (c) fused sink         the transformers backend (analysis.engine.backends): alpha_1..16 from q, k and the fused
                         kernel's log-sum-exp
  (c') fused, every key  the same for every key k = 1..T (the sink at any position, ``analysis.positions.every_sink``):
                         the column sums of exp(q.k * scale - lse) in blocks of query rows, never a T x T map
  (d) eager sink         analysis.sink_metric on the bridge's hook_pattern (every T x T map built, one at a time)
  (d') eager, every key  the same for every key (column sums of each map, reduced in the hook)
  (e) HF eager maps      output_attentions=True, all maps of a batch kept, alpha computed from them
  (f) TL run_with_cache  every activation of a batch kept, alpha computed from the patterns
(e) and (f) run only for T <= --peers-max-T (at T = 8192 one batch of their maps alone is 70+ GiB). Each process
saves its alpha; the table prints the largest |difference| from the eager sink's (d) (for (c'), from (d') where it
ran, else over the keys (d) keeps). Ratios are to (a) at the same T, all from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from analysis.core.memory import measure  # noqa: E402

METHODS = {
    "sdpa": "(a) SDPA forward",
    "sdpa_base": "(b) SDPA base model",
    "fused": "(c) fused sink",
    "fused_all": "(c') fused, every key",
    "eager": "(d) eager sink",
    "eager_all": "(d') eager, every key",
    "hf_maps": "(e) HF eager maps",
    "tl_cache": "(f) TL run_with_cache",
}
PEERS = ("hf_maps", "tl_cache")
K_MAX = 16
TARGET = 1.5  # the every-key metric (c') against the SDPA forward (a), in time and peak memory


def _hf(model_name: str, attn: str, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from analysis.model.loading import DEFAULT_MODEL, smollm2_dir

    src = str(smollm2_dir()) if model_name == DEFAULT_MODEL else model_name
    hf = AutoModelForCausalLM.from_pretrained(src, attn_implementation=attn, dtype=torch.float32).to(device).eval()
    return hf, AutoTokenizer.from_pretrained(src)


def _eager_sink(bridge, tokens, bs, k_max=K_MAX):
    import inspect

    from analysis.sinks.metric import sink_metric

    extra = {"path": "eager"} if "path" in inspect.signature(sink_metric).parameters else {}
    return sink_metric(bridge, tokens, k_max=k_max, batch_size=bs, **extra).alpha


def run_one(method: str, model_name: str, n: int, T: int, device: str, out: str) -> None:
    """Child process: load what ``method`` needs, warm up on one batch, measure the whole run, write JSON."""
    from analysis import load_model, natural_probe
    from analysis.engine.passes import batches, default_batch_size
    from analysis.sinks.metric import alpha_from_pattern

    bridge = hf = None
    if method in ("sdpa", "sdpa_base", "hf_maps"):
        hf, tok = _hf(model_name, "eager" if method == "hf_maps" else "sdpa", device)
    else:
        bridge = load_model(model_name, device=device)
        tok = bridge.tokenizer
    tokens = natural_probe(tok, n=n, T=T).tokens
    bs = default_batch_size(tokens)
    alpha: list[torch.Tensor] = []

    def sdpa(base: bool):
        m = hf.base_model if base else hf
        with torch.inference_mode():
            for b in batches(tokens, bs):
                m(input_ids=b.to(device), use_cache=False)

    def fused(k_max=K_MAX):
        from analysis.sinks.metric import sink_metric

        alpha.append(sink_metric(bridge, tokens, k_max=k_max, batch_size=bs, path="fused").alpha)

    def hf_maps():
        with torch.inference_mode():
            for b in batches(tokens, bs):
                maps = hf(b.to(device), output_attentions=True, use_cache=False).attentions  # L x (B, H, T, T)
                alpha.append(torch.stack([alpha_from_pattern(m, K_MAX).cpu() for m in maps], 1))

    def tl_cache():
        L = bridge.cfg.n_layers
        with torch.inference_mode():
            for b in batches(tokens, bs):
                _, cache = bridge.run_with_cache(b.to(device))
                alpha.append(
                    torch.stack(
                        [alpha_from_pattern(cache[f"blocks.{l}.attn.hook_pattern"], K_MAX).cpu() for l in range(L)], 1
                    )
                )
                del cache

    fns = {
        "sdpa": lambda: sdpa(False),
        "sdpa_base": lambda: sdpa(True),
        "fused": fused,
        "fused_all": lambda: fused(T),
        "eager": lambda: alpha.append(_eager_sink(bridge, tokens, bs)),
        "eager_all": lambda: alpha.append(_eager_sink(bridge, tokens, bs, T)),
        "hf_maps": hf_maps,
        "tl_cache": tl_cache,
    }
    warm = tokens[:1, : min(T, 64)]
    with torch.inference_mode():  # a short warm-up (thread pools, first allocations), outside the measurement
        (hf(input_ids=warm.to(device), use_cache=False) if hf is not None else bridge(warm.to(device)))
    cpu = time.process_time()
    wall, peak, _ = measure(fns[method], device)
    cpu = time.process_time() - cpu
    if alpha:
        torch.save(torch.cat(alpha), out + ".alpha.pt")
    with open(out, "w") as f:
        json.dump({"wall": wall, "cpu": cpu, "peak": peak, "batch_size": bs}, f)


def spawn(method: str, args, n: int, T: int, workdir: str) -> dict:
    """Run ``method`` in a fresh process; its alpha (if any) is left in ``workdir``."""
    out = os.path.join(workdir, f"{method}-{T}.json")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        method,
        "--model",
        args.model,
        "--n",
        str(n),
        "--T",
        str(T),
        "--device",
        args.device,
        "--out",
        out,
    ] + (["--threads", str(args.threads)] if args.threads else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{METHODS[method]} at T={T} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def alpha_diffs(rows: list[dict], workdir: str) -> None:
    """max |alpha - eager alpha| for each method that computes alpha, where an eager sink ran at that T: (d') for
    the every-key methods where it ran, else (d) over the keys it keeps."""
    path = lambda m, T: os.path.join(workdir, f"{m}-{T}.json.alpha.pt")
    for r in rows:
        r["max_abs_diff"] = None
        refs = ["eager_all", "eager"] if r["method"].endswith("_all") else ["eager"]
        ref = next((m for m in refs if m != r["method"] and os.path.exists(path(m, r["T"]))), None)
        if ref is not None and os.path.exists(path(r["method"], r["T"])):
            a, b = torch.load(path(r["method"], r["T"])), torch.load(path(ref, r["T"]))
            k = min(a.shape[-1], b.shape[-1])
            r["max_abs_diff"] = float((a[..., :k] - b[..., :k]).abs().max())


def best(runs: list[dict]) -> dict:
    """Over repeated runs of one method: the least wall and CPU time (the least disturbed run), the largest peak."""
    return {
        **runs[0],
        "wall": min(r["wall"] for r in runs),
        "cpu": min(r["cpu"] for r in runs),
        "peak": max(r["peak"] for r in runs),
        "repeats": len(runs),
    }


def table(rows: list[dict]) -> str:
    lines = [
        f"{'T':>5} {'N':>4}  {'method':<22} {'wall (s)':>9} {'x (a)':>6} {'CPU (s)':>8} {'x (a)':>6}"
        f" {'peak (MiB)':>11} {'x (a)':>6} {'max |d alpha|':>14}"
    ]
    for r in rows:
        a = next(b for b in rows if b["T"] == r["T"] and b["method"] == "sdpa")
        d = "" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        lines.append(
            f"{r['T']:>5} {r['n']:>4}  {METHODS[r['method']]:<22} {r['wall']:>9.2f} {r['wall'] / a['wall']:>6.2f}"
            f" {r['cpu']:>8.2f} {r['cpu'] / a['cpu']:>6.2f} {r['peak']:>11.0f} {r['peak'] / a['peak']:>6.2f}"
            f" {d:>14}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--T", type=int, nargs="+", default=[64, 1024, 8192])
    p.add_argument("--n", type=int, nargs="+", default=[100, 10, 2], help="N sequences: one value, or one per T")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each method this many times (rounds interleave "
        "the methods); the table keeps the least time and the largest peak",
    )
    p.add_argument("--peers-max-T", type=int, default=1024, help="run (e) and (f) only up to this T")
    p.add_argument("--threads", type=int, default=None, help="torch threads in each process (default: torch's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--child", choices=list(METHODS), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        return run_one(args.child, args.model, args.n[0], args.T[0], args.device, args.out)
    if len(args.n) not in (1, len(args.T)):
        p.error(f"give one --n, or one per T ({len(args.T)} values); got {len(args.n)}.")
    ns = args.n * len(args.T) if len(args.n) == 1 else args.n
    if "sdpa" not in args.methods:
        args.methods = ["sdpa", *args.methods]  # the floor every ratio is taken to
    print(
        f"model {args.model} on {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        "each method in its own process",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for T, n in zip(args.T, ns):
            methods = [m for m in args.methods if not (m in PEERS and T > args.peers_max_T)]
            runs: dict[str, list[dict]] = {m: [] for m in methods}
            for rep in range(args.repeat):
                for m in methods[rep % len(methods) :] + methods[: rep % len(methods)]:  # rotate the order
                    r = {"T": T, "n": n, "method": m, **spawn(m, args, n, T, workdir)}
                    runs[m].append(r)
                    print(
                        f"  T={T:<5} N={n:<4} {METHODS[m]:<22} {r['wall']:8.2f} s wall {r['cpu']:8.2f} s CPU "
                        f"{r['peak']:9.0f} MiB",
                        flush=True,
                    )
            rows += [best(runs[m]) for m in methods]
        alpha_diffs(rows, workdir)
    print(
        f"\nbest of {args.repeat} run(s) per method; ratios to (a) at the same T; CPU = process CPU time (user + "
        "system, all threads); max |d alpha| is the largest difference from (d) over every alpha kept"
    )
    print(table(rows))
    for r in (r for r in rows if r["method"] == "fused_all"):
        a = next(b for b in rows if b["T"] == r["T"] and b["method"] == "sdpa")
        cpu, wall, peak = r["cpu"] / a["cpu"], r["wall"] / a["wall"], r["peak"] / a["peak"]
        ok = "met" if max(cpu, peak) <= TARGET else "NOT met"
        print(
            f"T={r['T']}: alpha at every position (c') costs {cpu:.2f}x the SDPA forward's CPU time ({wall:.2f}x its "
            f"wall time) and {peak:.2f}x its peak memory; target <= {TARGET}x in CPU time and memory: {ok}"
        )


if __name__ == "__main__":
    main()
