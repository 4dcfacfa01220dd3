"""The full report (``python -m analysis report``) against a plain forward pass, in one run.

    .venv/bin/python benchmarks/bench_report.py [--model smollm2-135m] [--n 32] [--T 64] [--repeat 3]

On the same N natural-text sequences of T tokens (the report's own natural probe) it measures:
  (a) plain forward   the model's forward over the N sequences, same batches, no hooks (best of --repeat)
  (b) report          analysis.report.build_report into a temporary folder (every section)
and prints wall time and peak memory of each and their ratios to (a), then the report's time per section.
Peak memory: peak resident memory of the process on CPU (VmHWM, reset before each measurement through
/proc/self/clear_refs, as in bench_sink.py) above the resident memory before it, and the process's peak; on
CUDA, torch.cuda.max_memory_allocated. The report runs one ``analysis.profile`` pass per probe kind (3), a
partial pass for the norm-gain trace (which also keeps the residual stream where the interventions start), and
5 intervention passes (2 spike, 2 value, 1 first-key) on top of the profile's shared baseline, each resumed at the
first block it changes (``hooks.Resume``: on SmolLM2 blocks 11, 2 and 12, so 38 of their 150 blocks are not run),
so its time is best read in forward passes. Targets (issue 10): <= 8x the forward pass in time and <= 1.3x its
peak memory; the last line says whether they are met.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from analysis.memory import measure

TIME_TARGET, MEMORY_TARGET = 8.0, 1.3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--T", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="plain forward passes to time (best is kept)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    from analysis import load_model, natural_probe
    from analysis.hooks import batches, default_batch_size
    from analysis.report import build_report

    model = load_model(args.model, device=args.device)
    tokens = natural_probe(model.tokenizer, n=args.n, T=args.T, seed=args.seed).tokens
    bs = default_batch_size(tokens)

    def forward():
        with torch.inference_mode():
            for b in batches(tokens, bs):
                model(b.to(args.device))

    forward()  # warm-up (first-call allocations, lazy inits)
    runs = [measure(forward, args.device) for _ in range(max(1, args.repeat))]
    fwd = min(runs, key=lambda r: r[0])
    print(f"plain forward: {fwd[0]:.2f} s, peak {fwd[1]:.0f} MiB (best of {len(runs)}); now the report ...", flush=True)
    with tempfile.TemporaryDirectory() as out:
        rep = measure(lambda: build_report(model, out, n=args.n, T=args.T, seed=args.seed), args.device)
        seconds = json.loads((Path(out) / "report.json").read_text())["seconds"]
        size = {f.name: f.stat().st_size for f in Path(out).iterdir()}

    where = "GPU allocated" if args.device == "cuda" else "process RSS"
    print(f"model {args.model}, N={args.n} natural sequences x T={args.T} tokens, batch {bs}, {args.device}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'':<16}{'wall (s)':>10}{'x forward':>11}{'peak MiB':>11}{'+MiB':>9}{'x forward':>11}   ({where})")
    print(f"{'plain forward':<16}{fwd[0]:>10.2f}{1.0:>11.1f}{fwd[1]:>11.0f}{fwd[2]:>9.0f}{1.0:>11.1f}")
    print(f"{'full report':<16}{rep[0]:>10.2f}{rep[0] / fwd[0]:>11.1f}{rep[1]:>11.0f}{rep[2]:>9.0f}"
          f"{rep[1] / max(fwd[1], 1e-9):>11.2f}")
    print("report sections (s): " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    t_ratio, m_ratio = rep[0] / fwd[0], rep[1] / max(fwd[1], 1e-9)
    print(f"targets: time {t_ratio:.1f}x <= {TIME_TARGET:g}x {'met' if t_ratio <= TIME_TARGET else 'NOT met'}; "
          f"peak memory {m_ratio:.2f}x <= {MEMORY_TARGET:g}x {'met' if m_ratio <= MEMORY_TARGET else 'NOT met'}")
    print("files: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in size.items()))


if __name__ == "__main__":
    main()
