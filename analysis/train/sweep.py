"""Grid sweeps: any config fields x seeds, one table of every run's final held-out statistics.

``sinklens sweep --preset synthetic --weight-decay 0,0.5,5 --seed 0,1,2 --out DIR`` trains
every combination of the fields given as lists into ``DIR/<field>-<value>_..._seed-<s>/`` (finished runs are
skipped, interrupted ones resumed) and writes

- ``DIR/sweep.csv``: one row per run (the grid fields, the seed, and the final held-out statistics of
  ``analysis.train.trainer.evaluate``: loss, Sink_1, Sink_k, slot and prefix sinks, spike ratio, ...);
- ``DIR/summary.csv``: one row per grid point, mean / std / min / max over seeds of each statistic;
- ``DIR/curves.csv``: every logged evaluation of every run (Sink_1 and loss through training);
- ``DIR/command.txt``: the command that made them.

``jobs`` trains that many runs at once, each in its own process with one thread.
"""

from __future__ import annotations

import itertools
import json
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from analysis.core.io import EMERGENCE_DIR, read_log, write_atomic
from analysis.model.reference.checkpoint import read_json
from analysis.train.presets import build_configs
from analysis.train.trainer import train


METRICS = tuple(
    "loss val_loss sink_1 sink_k sink_slot sink_prefix sink_1_no_fixed val_loss_no_fixed sink_1_in_window "
    "sink_window_start spike_ratio value_norm_ratio resid_norm_ratio raw_first_mass".split()
)
CURVE_KEYS = ("step", "tokens", "loss", "val_loss", "sink_1", "sink_slot", "spike_ratio")  # curves.csv's columns


def run_name(point: dict) -> str:
    """``attention-softmax_lr-0.01_seed-0``: one directory name per grid point.

    Parameters
    ----------
    point : dict
        One grid point, {field: value}, in the grid's field order.

    Returns
    -------
    str
    """

    def fmt(v):
        return f"{v:g}" if isinstance(v, float) else str(v)

    return "_".join(f"{k.replace('_', '-')}-{fmt(v)}" for k, v in point.items())


def _train_one(args: tuple) -> dict:
    preset_name, options, run_dir, command, threads, keep_model = args
    if threads:
        import torch

        torch.set_num_threads(threads)

    mcfg, tcfg = build_configs(preset_name, {**options, "out": str(run_dir)})
    tcfg.resume = (Path(run_dir) / "checkpoints").is_dir()
    final = train(mcfg, tcfg, command=command).final
    if not keep_model:  # keep config.json (with the final statistics) and the log: the table's sources
        for name in ("model.safetensors", "tokenizer.json"):
            (Path(run_dir) / name).unlink(missing_ok=True)
    return final


# Options that do not change what a run trains (evaluation runs under no_grad on a fixed probe).
_NOT_CONFIG = tuple(
    "out progress resume preset d_vocab log_every eval_every checkpoint_every keep_checkpoints snapshots".split()
)


def _config_key(model: dict, train: dict) -> str:
    """What makes two runs the same run: every model and training field but output and logging options."""
    return json.dumps({k: v for k, v in {**model, **train}.items() if k not in _NOT_CONFIG}, sort_keys=True)


def _finished_runs(dirs: Sequence) -> dict[str, Path]:
    """{config key: run folder} of the finished runs (a config.json with final statistics) in ``dirs``."""
    found = {}
    for d in dirs:
        for cfg in sorted(Path(d).glob("*/config.json")):
            saved = read_json(cfg)
            if saved.get("final") and "model" in saved and "train" in saved:
                found.setdefault(_config_key(saved["model"], saved["train"]), cfg.parent)
    return found


def _reuse(preset_name, options: dict, run_dir: Path, reusable: dict[str, Path]) -> bool:
    """Copy a finished run with this exact configuration into ``run_dir`` (True), or do nothing."""
    mcfg, tcfg = build_configs(preset_name, {**options, "out": str(run_dir)})
    src = reusable.get(_config_key(mcfg.to_dict(), tcfg.to_dict()))
    if src is None or src.resolve() == run_dir.resolve():
        return False
    shutil.copytree(src, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    return True


def summarise(table: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Mean, std, min and max over seeds of every numeric statistic, one row per grid point.

    Parameters
    ----------
    table : pandas.DataFrame
        One row per run.
    keys : sequence of str
        The grid fields.

    Returns
    -------
    pandas.DataFrame
    """
    by = [k for k in keys if k != "seed"]
    stats = [c for c in table.columns if c not in keys and c != "run" and pd.api.types.is_numeric_dtype(table[c])]
    if not by:
        table = table.assign(_all="all")
        by = ["_all"]
    groups = table.groupby(by, sort=False, dropna=False)  # keep the points whose value is None (e.g. no window)
    agg = groups[stats].agg(["mean", "std", "min", "max"])
    agg.columns = [f"{c}_{s}" for c, s in agg.columns]
    agg.insert(0, "n_seeds", groups.size())
    return agg.reset_index().drop(columns=["_all"], errors="ignore")


def _row(point: dict, final: dict, run: str) -> dict:
    row = dict(point)
    for m in METRICS:
        v = final.get(m)
        if m == "sink_k":
            for k, x in enumerate(v or [], start=1):
                row[f"sink_{k}"] = x
        else:
            row[m] = v
    row["run"] = run
    return row


def run_sweep(
    preset_name: Optional[str],
    options: dict,
    *,
    command: Optional[str] = None,
    jobs: int = 1,
    keep_models: bool = True,
    reuse: Sequence = (),
) -> pd.DataFrame:
    """Train each grid point into ``OUT/<name>`` and write the tables of the module doc. ``options`` holds
    config fields; any may be a list (the grid). ``keep_models=False`` deletes each run's weights once its
    statistics are written (for committed sweeps). ``reuse``: sweep folders whose finished runs are copied
    where a grid point has exactly their configuration (the shared baseline of several grids is trained
    once). Returns the per-run table.

    Parameters
    ----------
    preset_name : str or None
    options : dict
    command : str, optional
        Recorded with each run.
    jobs : int
        Runs trained at once.
    keep_models : bool
    reuse : sequence of path-like
        Sweep folders whose finished runs are reused.

    Returns
    -------
    pandas.DataFrame
    """
    options = dict(options)
    out = Path(options.pop("out"))
    # the grid: a field given as a list is an axis, seed always one (last); one {field: value} per combination
    lists = {k: v for k, v in options.items() if isinstance(v, list)}
    lists.setdefault("seed", [options.get("seed", 0)])
    keys = [k for k in lists if k != "seed"] + ["seed"]
    points = [dict(zip(keys, combo)) for combo in itertools.product(*(lists[k] for k in keys))]
    fixed = {k: v for k, v in options.items() if k not in keys}
    reusable = _finished_runs([d for d in reuse if Path(d).is_dir()])
    todo, finals = [], {}
    for point in points:
        run_dir = out / run_name(point)
        if not (run_dir / "config.json").is_file() and reusable:
            _reuse(preset_name, {**fixed, **point}, run_dir, reusable)
        if (run_dir / "config.json").is_file():
            finals[run_dir.name] = read_json(run_dir / "config.json").get("final", {})
        else:
            todo.append(
                (
                    preset_name,
                    {**fixed, **point, "progress": jobs == 1 and fixed.get("progress", True)},
                    run_dir,
                    command,
                    1 if jobs > 1 else None,
                    keep_models,
                )
            )
    if jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for args, final in zip(todo, pool.map(_train_one, todo)):
                finals[Path(args[2]).name] = final
    else:
        for args in todo:
            finals[Path(args[2]).name] = _train_one(args)
    rows, curves = [], []
    for point in points:
        name = run_name(point)
        rows.append(_row(point, finals[name], name))
        for rec in read_log(out / name, missing_ok=True):
            if "sink_1" in rec:
                curves.append({**point, **{k: rec.get(k) for k in CURVE_KEYS}})
    table = pd.DataFrame(rows)
    write_atomic(out / "sweep.csv", lambda tmp: table.to_csv(tmp, index=False))
    write_atomic(out / "summary.csv", lambda tmp: summarise(table, keys).to_csv(tmp, index=False))
    write_atomic(out / "curves.csv", lambda tmp: pd.DataFrame(curves).to_csv(tmp, index=False))
    if command:
        write_atomic(out / "command.txt", command + "\n")
    return table


def load_sweep(path) -> dict[str, pd.DataFrame]:
    """The tables of a sweep directory: {"runs", "summary", "curves"} DataFrames. ``path``: a folder, or the
    name of a committed grid in ``data/emergence`` (e.g. ``"weight_decay"``).

    Parameters
    ----------
    path : path-like or str

    Returns
    -------
    dict of str to pandas.DataFrame
    """
    path = Path(path)
    if not path.is_dir() and (EMERGENCE_DIR / path).is_dir():
        path = EMERGENCE_DIR / path
    if not (path / "sweep.csv").is_file():
        raise FileNotFoundError(f"{path} holds no sweep.csv; run `sinklens sweep ... --out {path}`.")
    names = {"runs": "sweep.csv", "summary": "summary.csv", "curves": "curves.csv"}
    return {k: pd.read_csv(path / f) for k, f in names.items() if (path / f).is_file()}


def grid_label(value) -> str:
    """A grid value as text: ``none`` for None / NaN, numbers without trailing zeros.

    Parameters
    ----------
    value : object

    Returns
    -------
    str
    """
    if value is None or (isinstance(value, float) and value != value):
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def grid_text(runs: pd.DataFrame, field: str, *, metric: str = "sink_1", unit: str = "%") -> str:
    """One line per value of ``field``: the metric's mean, standard deviation and range over seeds.

    Parameters
    ----------
    runs : pandas.DataFrame
    field : str
    metric : str
    unit : str

    Returns
    -------
    str
    """
    lines = []
    for value, df in runs.groupby(field, sort=False, dropna=False):
        x = df[metric].astype(float)
        lines.append(
            f"{field} {grid_label(value)}: {metric} {x.mean():.2f}{unit} ± {x.std(ddof=1) if len(x) > 1 else 0:.2f} "
            f"(range {x.min():.2f}-{x.max():.2f}, {len(x)} seeds)"
        )
    return "\n".join(lines)
