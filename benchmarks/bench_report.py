"""The full report (``python -m analysis report``) against a plain forward pass, measured in one run.

    .venv/bin/python benchmarks/bench_report.py [--model smollm2-135m] [--n 32] [--T 64] [--repeat 3] [--reports 2]

On the same N natural-text sequences of T tokens (the report's own natural probe) it measures:
  (a) plain forward   the model's forward over the N sequences, same batches, no hooks (--repeat times before the
                      reports and once after each; the best is the unit)
  (b) report          analysis.report.build_report into a temporary folder (every section), --reports times
and prints wall time and peak memory of each and their ratios to (a), then the report's time per section.
Peak memory: peak resident memory of the process on CPU (VmHWM, reset before each measurement through
/proc/self/clear_refs, as in bench_sink.py) above the resident memory before it, and the process's peak; on
CUDA, torch.cuda.max_memory_allocated. The report runs one ``analysis.profile`` pass per probe kind (3), which
also keeps the natural pass's residual stream entering every block (``Profile.resid``); the norm-gain trace and
the 5 intervention passes (2 spike, 2 value, 1 first-key) then start at the block they change (on SmolLM2: 24;
12, 2 and 12), so 30 + 30 + 30 + 1 + 110 blocks run where whole passes would run 300. Its time is best read in
forward passes. Targets (issue 10): <= 8x the forward pass in time and <= 1.3x its peak memory, judged on the
median report; the last line says whether they are met. On a shared machine, read the ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import statistics
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
    p.add_argument("--repeat", type=int, default=3, help="plain forward passes to time before the reports (best is kept)")
    p.add_argument("--reports", type=int, default=2, help="reports to time (each followed by one more forward)")
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
    fwds = [measure(forward, args.device) for _ in range(max(1, args.repeat))]
    print(f"plain forward: {min(f[0] for f in fwds):.2f} s (best of {len(fwds)}); now the reports ...", flush=True)
    reps = []
    for _ in range(max(1, args.reports)):
        with tempfile.TemporaryDirectory() as out:
            rep = measure(lambda: build_report(model, out, n=args.n, T=args.T, seed=args.seed), args.device)
            seconds = json.loads((Path(out) / "report.json").read_text())["seconds"]
            size = {f.name: f.stat().st_size for f in Path(out).iterdir()}
        reps.append((rep, seconds))
        fwds.append(measure(forward, args.device))
    _print(args, bs, min(fwds, key=lambda r: r[0]), fwds, reps, size)


def _print(args, bs: int, fwd, fwds, reps, size) -> None:
    where = "GPU allocated" if args.device == "cuda" else "process RSS"
    print(f"model {args.model}, N={args.n} natural sequences x T={args.T} tokens, batch {bs}, {args.device}, "
          f"{torch.get_num_threads()} threads; forward runs (s): {', '.join(f'{f[0]:.2f}' for f in fwds)}")
    print(f"{'':<16}{'wall (s)':>10}{'x forward':>11}{'peak MiB':>11}{'+MiB':>9}{'x forward':>11}   ({where})")
    print(f"{'plain forward':<16}{fwd[0]:>10.2f}{1.0:>11.1f}{fwd[1]:>11.0f}{fwd[2]:>9.0f}{1.0:>11.1f}")
    for i, (rep, seconds) in enumerate(reps):
        print(f"{f'full report {i + 1}':<16}{rep[0]:>10.2f}{rep[0] / fwd[0]:>11.1f}{rep[1]:>11.0f}{rep[2]:>9.0f}"
              f"{rep[1] / max(fwd[1], 1e-9):>11.2f}")
        print("  sections (s): " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    t_ratio = statistics.median(r[0][0] for r in reps) / fwd[0]
    m_ratio = statistics.median(r[0][1] for r in reps) / max(fwd[1], 1e-9)
    print(f"targets (median report): time {t_ratio:.1f}x <= {TIME_TARGET:g}x {'met' if t_ratio <= TIME_TARGET else 'NOT met'}; "
          f"peak memory {m_ratio:.2f}x <= {MEMORY_TARGET:g}x {'met' if m_ratio <= MEMORY_TARGET else 'NOT met'}")
    print("files: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in size.items()))


if __name__ == "__main__":
    main()
