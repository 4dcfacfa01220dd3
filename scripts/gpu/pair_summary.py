"""Step 4 of a GPU session: the trained softmax / sigmoid pair, side by side, in one JSON file: each run's final
losses, its mechanism chain (Sink_1, the first-token spike, value norms, the first key; ``analysis.dynamics.compare.
mechanism_chain``) and where its spike comes from (``analysis.chain.spike_writers.spike_origin``), on a held-out probe of
its own corpus, with the report's spike criterion for the model's width (``analysis.chain.massive.spike_criterion``).

    python scripts/gpu/pair_summary.py RUN_DIR [RUN_DIR ...] --out pair.json [--probe-seed 2024] [--n 100 --T 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from analysis.core.io import jsonable  # noqa: E402
from analysis.chain.massive import spike_criterion  # noqa: E402
from analysis.chain.spike_writers import spike_origin  # noqa: E402
from analysis.train import TrainConfig, load_reference  # noqa: E402
from analysis.dynamics.compare import mechanism_chain  # noqa: E402
from analysis.model.placement import input_device  # noqa: E402
from analysis.model.reference.data import build_data  # noqa: E402


def summarise(run: Path, *, probe_seed: int, n: int, T: int) -> dict:
    model = load_reference(run)
    tcfg = model.reference_config["train"]
    data = build_data(TrainConfig.from_dict({**tcfg, "seed": probe_seed}), model.cfg.n_ctx)
    probe = data.probe(n, T).to(input_device(model))
    chain = mechanism_chain(model, probe)
    abs_threshold, ratio_threshold = spike_criterion(model)  # the report's criterion for this model's width
    origin = spike_origin(model, probe, abs_threshold=abs_threshold, ratio_threshold=ratio_threshold).to_dict()
    return {
        "run": str(run),
        "attention": model.cfg.attention,
        "final": model.reference_config.get("final"),
        "chain": chain,
        "spike_origin": origin,
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--probe-seed", type=int, default=2024)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--T", type=int, default=64)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = [summarise(run, probe_seed=args.probe_seed, n=args.n, T=args.T) for run in args.runs]
    args.out.write_text(json.dumps(jsonable(rows), indent=1) + "\n")
    for r in rows:
        c = r["chain"]
        print(
            f"{r['attention']:10s} val loss {(r['final'] or {}).get('val_loss', float('nan')):.3f}  "
            f"Sink_1 {c['sink_1']:.1f}%  spike {c['spike_ratio_sequence']:.0f}x the sequence median"
        )
    print(f"written {args.out}")
    return rows


if __name__ == "__main__":
    main()
