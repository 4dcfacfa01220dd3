"""Grid sweeps: attention operation x learning rate x weight decay, one table of final loss and Sink_1."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Optional

import pandas as pd

from analysis.train.checkpoint import read_json
from analysis.train.cli import build_configs

GRID_KEYS = ("attention", "lr", "weight_decay")


def run_name(attention: str, lr: float, wd: float) -> str:
    return f"{attention}_lr{lr:g}_wd{wd:g}"


def run_sweep(preset_name: Optional[str], options: dict, command: Optional[str] = None) -> pd.DataFrame:
    """Train each grid point into ``OUT/<attention>_lr<lr>_wd<wd>`` (skipping finished ones) and write
    ``OUT/sweep.csv``. ``options`` holds config fields; the grid keys may be lists."""
    from analysis.train.trainer import train

    options = dict(options)
    out = Path(options.pop("out"))
    base_m, base_t = build_configs(preset_name, {})
    grid = {k: options.pop(k, None) for k in GRID_KEYS}
    defaults = {"attention": base_m.attention, "lr": base_t.lr, "weight_decay": base_t.weight_decay}
    grid = {k: (v if isinstance(v, list) else [defaults[k] if v is None else v]) for k, v in grid.items()}
    rows = []
    for attention, lr, wd in itertools.product(grid["attention"], grid["lr"], grid["weight_decay"]):
        run_dir = out / run_name(attention, lr, wd)
        if (run_dir / "config.json").is_file():
            final = read_json(run_dir / "config.json").get("final", {})
        else:
            mcfg, tcfg = build_configs(preset_name, {**options, "attention": attention, "lr": lr,
                                                     "weight_decay": wd, "out": str(run_dir)})
            tcfg.resume = (run_dir / "checkpoints").is_dir()
            final = train(mcfg, tcfg, command=command).final
        rows.append({"attention": attention, "lr": lr, "weight_decay": wd, "loss": final.get("loss"),
                     "val_loss": final.get("val_loss"), "sink_1": final.get("sink_1"),
                     "sink_slot": final.get("sink_slot"), "run": run_dir.name})
    table = pd.DataFrame(rows)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".sweep.csv.tmp"
    table.to_csv(tmp, index=False)
    tmp.replace(out / "sweep.csv")
    return table
