"""The propositions and Sink_1 per positional encoding on every trained run of a sweep (analysis.positions.encodings):
writes propositions.csv (one row per run), propositions_summary.csv (spread over seeds), first_vs_t.csv (the first
token's attention against t with its closed form) and propositions_meta.json into the sweep folder (or --out), and
appends the command to propositions_command.txt.

    python scripts/positions_propositions.py data/emergence/positions
"""

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.positions.encodings import encoding_grid, save_encoding_grid  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", type=Path, help="a sweep folder whose runs kept their weights")
    p.add_argument("--out", type=Path, help="where to write the tables (default: the sweep folder)")
    p.add_argument("--n", type=int, default=100, help="sequences per probe kind")
    p.add_argument("--T", type=int, default=64, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0, help="probe seed (the task's held-out sequences use 2024 + seed)")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = args.out or args.sweep
    t0 = time.perf_counter()
    grid = encoding_grid(args.sweep, n=args.n, T=args.T, seed=args.seed, progress=print)
    save_encoding_grid(grid, out)
    with open(out / "propositions_command.txt", "w") as f:
        f.write(shlex.join(["python", *sys.argv]) + "\n")
    print(grid.text())
    print(f"{len(grid.runs)} runs in {time.perf_counter() - t0:.0f} s -> {out}")


if __name__ == "__main__":
    main()
