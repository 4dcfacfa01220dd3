"""The order in which the sink's chain forms during training (analysis.dynamics.formation): every link on every snapshot
of every run under RUNS_DIR (folders with snapshots/step-*), written to DIR as formation.csv (one row per run, step and
link), onsets.csv (per run and link: the first step meeting its criterion and the first step half-way to its final
value), followed.csv, writes.csv and meta.json (``analysis.dynamics.formation.load_formation`` reads them back),
formation.png and command.txt.

    python scripts/formation_order.py /work/runs/induction --out results/formation

``--append`` adds the runs to the folder's committed ones (a run measured again replaces its rows) and appends the
command to its command.txt, so that seeds trained later join a table whose snapshots are gone.
"""

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.figures.formation import plot_formation  # noqa: E402
from analysis.dynamics.formation import (  # noqa: E402
    N_RANDOM_CUT,
    SPIKE_RATIO_FOLLOW,
    TABLE_FILES,
    formation_order,
    load_formation,
    save_formation,
)


def appended(old, new):
    """``old``'s tables with ``new``'s runs added (a run in both keeps ``new``'s rows), the notes and names joined."""
    if (old.probe_seed, old.n_samples, old.T) != (new.probe_seed, new.n_samples, new.T):
        sys.exit(
            f"--append: the folder's probe (seed {old.probe_seed}, {old.n_samples} x {old.T}) differs from this "
            f"run's (seed {new.probe_seed}, {new.n_samples} x {new.T}); pass the same --probe-seed."
        )
    tables = {}
    for name in TABLE_FILES:
        a, b = getattr(old, name), getattr(new, name)
        tables[name] = pd.concat([a[~a.run.isin(set(b.run))], b], ignore_index=True).sort_values(
            "run", kind="stable", ignore_index=True
        )
    runs = sorted(set(tables["followed"].run))
    n_old, n_new = (len(r.formation[["run", "step"]].drop_duplicates()) for r in (old, new))
    per_model = (old.seconds_per_model * n_old + new.seconds_per_model * n_new) / max(1, n_old + n_new)
    notes = [n for n in old.notes if not any(r in n for r in set(new.followed.run))] + list(new.notes)
    return dataclasses.replace(old, **tables, seconds_per_model=per_model, model_name=", ".join(runs), notes=notes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, help="a folder of runs (each with snapshots/step-*), or one run folder")
    p.add_argument("--out", type=Path, required=True, help="where to write formation.csv, onsets.csv, formation.png")
    p.add_argument("--probe-seed", type=int, default=2024, help="seed of the held-out probe (100 x 64 tokens)")
    p.add_argument(
        "--ratio",
        type=float,
        default=SPIKE_RATIO_FOLLOW,
        help="the final model's spike dims: at least this many times the first token's median",
    )
    p.add_argument("--n-random", type=int, default=N_RANDOM_CUT, help="random-neuron draws in each writer cut")
    p.add_argument(
        "--append",
        action="store_true",
        help="add these runs to the tables already in --out (written by this script), not replace them",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    runs = (
        [args.runs]
        if (args.runs / "snapshots").is_dir()
        else sorted(d for d in args.runs.iterdir() if (d / "snapshots").is_dir())
    )
    if not runs:
        sys.exit(f"{args.runs} holds no run folder with snapshots/ (train with --snapshots, e.g. --preset induction).")
    try:  # refused before any work, in one line, when the folder lacks the tables to append to
        old = load_formation(args.out) if args.append else None
    except FileNotFoundError as e:
        sys.exit(f"--append: {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = formation_order(runs, probe_seed=args.probe_seed, ratio=args.ratio, n_random=args.n_random, progress=print)
    took = time.perf_counter() - t0
    if old is not None:
        res = appended(old, res)
    command = shlex.join(["python", *sys.argv]) + "\n"
    previous = (args.out / "command.txt").read_text() if args.append and (args.out / "command.txt").is_file() else ""
    (args.out / "command.txt").write_text(previous + command)
    save_formation(res, args.out)
    plot_formation(res).savefig(args.out / "formation.png", dpi=130)
    print(res.text())
    n = len(res.formation[["run", "step"]].drop_duplicates())
    print(
        f"{len(runs)} runs, {n} models in {took:.1f} s ({res.seconds_per_model:.2f} s a model on one thread); "
        f"written to {args.out}"
    )


if __name__ == "__main__":
    main()
