"""Sink_1 and the secondary sinks against context length, computed once offline into a CSV.

    .venv/bin/python scripts/sink_context.py --model smollm2-135m --out analysis/data/sink_context/smollm2-135m.csv \
        --T 16 32 64 128 256 512 1024 2048 4096 8192 --n 32 32 32 16 16 8 8 4 2 2 --seeds 0 1 2

For each T (with its own N sequences per seed) and probe seed: natural-text windows of the offline docstring corpus,
alpha of every key from one pass (the fused path, exact on SmolLM2), and the rates of ``analysis.positions.context_length`` at
every eps of its grid. The CSV is rewritten after each (T, seed), so a stopped run keeps what it finished, and
``--resume`` keeps the (T, seed) pairs an existing CSV holds and runs only the others; the run's command, machine and
time go to ``command.txt`` beside it. ``analysis.positions.context_length.load_sink_context`` reads it back.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analysis import load_model  # noqa: E402
from analysis.positions.context_length import COLUMNS, load_sink_context, sink_vs_context  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", required=True, help="the CSV to write (its folder gets command.txt)")
    p.add_argument("--T", type=int, nargs="+", required=True)
    p.add_argument("--n", type=int, nargs="+", required=True, help="sequences per seed: one value, or one per T")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--path", default="auto", choices=["auto", "fused", "eager"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--resume", action="store_true", help="keep the (T, seed) pairs already in --out; run the others")
    args = p.parse_args()
    if len(args.n) not in (1, len(args.T)):
        p.error(f"give one --n, or one per T ({len(args.T)} values); got {len(args.n)}.")
    if args.threads:
        torch.set_num_threads(args.threads)
    ns = dict(zip(args.T, args.n * len(args.T) if len(args.n) == 1 else args.n))
    out = Path(args.out)
    kept = pd.read_csv(out) if args.resume and out.is_file() else pd.DataFrame(columns=COLUMNS)
    done = set(zip(kept["T"].astype(int), kept["seed"].astype(int)))
    model = load_model(args.model, device=args.device)
    t0 = time.perf_counter()

    def save(rows):
        out.parent.mkdir(parents=True, exist_ok=True)
        pd.concat([kept, rows]).sort_values(["T", "seed", "eps"]).to_csv(out, index=False, float_format="%.6g")
        last = rows.iloc[-1]
        print(
            f"T={int(last['T']):>5} seed={int(last['seed'])} n={int(last['n'])}: Sink_1 {last['sink_1_pct']:.1f}% at "
            f"eps {last['eps']:g}, {last['seconds']:.1f} s ({time.perf_counter() - t0:.0f} s in all)",
            flush=True,
        )

    for T in args.T:
        seeds = [s for s in args.seeds if (T, s) not in done]
        if seeds:
            part = sink_vs_context(model, Ts=[T], n=ns, seeds=seeds, path=args.path, on_run=save)
            kept = pd.concat([kept, part.runs])
    seconds = time.perf_counter() - t0
    res = load_sink_context(out)
    command = " ".join(["python", "scripts/sink_context.py", *sys.argv[1:]])
    with open(out.parent / "command.txt", "a") as f:
        f.write(
            f"{command}\n  {platform.platform()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, device {args.device or 'default'}, {time.strftime('%Y-%m-%d')}; "
            f"{seconds / 60:.1f} minutes for {len(args.T) * len(args.seeds) - len(done)} (T, seed) pairs.\n"
        )
    print(res.text())


if __name__ == "__main__":
    main()
