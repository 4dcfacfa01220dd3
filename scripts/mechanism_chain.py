"""The mechanism chain (analysis.dynamics.compare.mechanism_chain) of every run of a sweep with kept models, one row
per run, written to DIR/chain.csv.

    python scripts/mechanism_chain.py data/emergence/mechanism
"""

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.train import load_reference  # noqa: E402
from analysis.dynamics.compare import mechanism_chain  # noqa: E402
from analysis.model.reference.data import build_data  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", type=Path)
    p.add_argument("--probe-seed", type=int, default=2024, help="seed of the held-out probe (100 x 64 tokens)")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for run in sorted(args.sweep.glob("*/model.safetensors")):
        model = load_reference(run.parent)
        tcfg = model.reference_config["train"]
        from analysis.train import TrainConfig

        data = build_data(TrainConfig.from_dict({**tcfg, "seed": args.probe_seed}), model.cfg.n_ctx)
        chain = mechanism_chain(model, data.probe(100, 64))
        rows.append(
            {
                "run": run.parent.name,
                "attention": model.cfg.attention,
                "seed": tcfg["seed"],
                "val_loss": model.reference_config["final"]["val_loss"],
                **{k: v for k, v in chain.items() if k != "spike_dims"},
                "spike_dims": str(chain["spike_dims"]),
            }
        )
        print(rows[-1])
    out = args.sweep / "chain.csv"
    pd.DataFrame(rows).to_csv(out, index=False)
    print(f"written {out}")


if __name__ == "__main__":
    main()
