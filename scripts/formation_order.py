"""The order in which the sink's chain forms during training (analysis.dynamics.formation): every link on every snapshot
of every run under RUNS_DIR (folders with snapshots/step-*), written to DIR as formation.csv (one row per run, step and
link), onsets.csv (per run and link: the first step meeting its criterion and the first step half-way to its final
value), followed.csv, writes.csv and meta.json (``analysis.dynamics.formation.load_formation`` reads them back),
formation.png and command.txt.

    python scripts/formation_order.py /work/runs/induction --out results/formation
"""
import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.figures.formation import plot_formation  # noqa: E402
from analysis.dynamics.formation import N_RANDOM_CUT, SPIKE_RATIO_FOLLOW, formation_order, save_formation  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, help="a folder of runs (each with snapshots/step-*), or one run folder")
    p.add_argument("--out", type=Path, required=True, help="where to write formation.csv, onsets.csv, formation.png")
    p.add_argument("--probe-seed", type=int, default=2024, help="seed of the held-out probe (100 x 64 tokens)")
    p.add_argument("--ratio", type=float, default=SPIKE_RATIO_FOLLOW,
                   help="the final model's spike dims: at least this many times the first token's median")
    p.add_argument("--n-random", type=int, default=N_RANDOM_CUT, help="random-neuron draws in each writer cut")
    args = p.parse_args()
    torch.set_num_threads(1)
    runs = [args.runs] if (args.runs / "snapshots").is_dir() else sorted(
        d for d in args.runs.iterdir() if (d / "snapshots").is_dir())
    if not runs:
        sys.exit(f"{args.runs} holds no run folder with snapshots/ (train with --snapshots, e.g. --preset induction).")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "command.txt").write_text(shlex.join(["python", *sys.argv]) + "\n")
    t0 = time.perf_counter()
    res = formation_order(runs, probe_seed=args.probe_seed, ratio=args.ratio, n_random=args.n_random, progress=print)
    took = time.perf_counter() - t0
    save_formation(res, args.out)
    plot_formation(res).savefig(args.out / "formation.png", dpi=130)
    print(res.text())
    n = len(res.formation[["run", "step"]].drop_duplicates())
    print(f"{len(runs)} runs, {n} models in {took:.1f} s ({res.seconds_per_model:.2f} s a model on one thread); "
          f"written to {args.out}")


if __name__ == "__main__":
    main()
