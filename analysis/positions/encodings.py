"""The propositions and the sink per positional encoding, over the trained models of a sweep.

For every run folder of a sweep over ``--positional-embedding-type`` (``sinklens sweep``, weights kept),
``encoding_point`` loads nothing itself: given a model it measures Sink_1 on the three probe kinds of
``analysis.model.probes.model_probe_sets`` (natural: held-out task sequences or text; random; one token repeated) and
runs ``analysis.positions.repeated_tokens`` on the repeated probe (does every position keep the same hidden state,
does the attention follow its closed form). ``encoding_grid`` does it for every run of a sweep folder and
``EncodingGrid`` holds the rows, their spread over seeds and the first token's attention against t; the committed
grid (``data/emergence/positions``, written by ``scripts/positions_propositions.py``) is read back by
``load_encoding_grid``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from analysis.model.contract import SinkModel
from analysis.core.defaults import REPEATED_TOL, SINK_EPS
from analysis.core.io import EMERGENCE_DIR, write_json
from analysis.core.results import Result
from analysis.model.probes import model_probe_sets
from analysis.positions.repeated_tokens import CLOSED_FORMS, repeated_tokens
from analysis.sinks.metric import sink_metric

ENCODING_GRID_DIR = EMERGENCE_DIR / "positions"
KINDS = ("natural", "random", "repeated")
_FILES = {"runs": "propositions.csv", "curves": "first_vs_t.csv"}


def encoding_point(
    model: SinkModel, *, n: int = 100, T: int = 64, seed: int = 0, eps: float = SINK_EPS
) -> tuple[dict, pd.DataFrame]:
    """One model: Sink_1 per probe kind and the propositions on its repeated probe.

    Parameters
    ----------
    model
        A loaded model (a reference model of the synthetic task, or one with a tokenizer).
    n, T, seed : int
        The probes' size and seed (``model_probe_sets``).
    eps : float
        Sink_1's threshold.

    Returns
    -------
    tuple of (dict, pandas.DataFrame)
        The row (``encoding``, ``sink_1_<kind>``, ``max_relative_deviation``, ``gap_last``, ``gap_first``,
        ``first_at_T``, ``form_first_at_T``, ``xi_max``, ``premise_holds``, ``form_holds``) and the first token's
        attention against t (``RepeatedTokens.first_vs_t``).
    """
    probes = model_probe_sets(model, n=n, T=T, seed=seed)
    row = {
        f"sink_1_{k}": sink_metric(model, p.tokens, k_max=1, eps=eps, kind=k).sink_rate(1) for k, p in probes.items()
    }
    rep = repeated_tokens(model, probes["repeated"].tokens, eps=eps)
    d = rep.to_dict()
    premise = d["max_relative_deviation"] < REPEATED_TOL
    gaps = [g for g in (d["max_gap_last"], d["max_gap_first"]) if g is not None]
    row = {
        "encoding": rep.encoding,
        **row,
        "max_relative_deviation": d["max_relative_deviation"],
        "gap_last": d["max_gap_last"],
        "gap_first": d["max_gap_first"],
        "first_at_T": float(rep.last[..., 0].mean()),
        "form_first_at_T": float(rep.form_last[..., 0].mean()),
        "xi_max": float(rep.xi.max()),
        "premise_holds": premise,
        "form_holds": (premise and max(gaps) <= REPEATED_TOL) if rep.has_form and gaps else None,
    }
    return row, rep.first_vs_t()


def _run_facts(run_dir: Path) -> dict:
    cfg = json.loads((run_dir / "config.json").read_text())
    model, train = cfg.get("model", {}), cfg.get("train", {})
    return {
        "run": run_dir.name,
        "seed": train.get("seed"),
        "positional_embedding_type": model.get("positional_embedding_type"),
        "alibi_slope_scale": model.get("alibi_slope_scale", 1.0),
        "steps": train.get("steps"),
        "dataset": train.get("dataset"),
        "val_loss": cfg.get("final", {}).get("val_loss"),
        "sink_1_trainer": cfg.get("final", {}).get("sink_1"),
    }


def encoding_grid(
    sweep_dir, *, n: int = 100, T: int = 64, seed: int = 0, eps: float = SINK_EPS, progress=None
) -> "EncodingGrid":
    """``encoding_point`` on every run folder with weights (``model.safetensors``) under ``sweep_dir``.

    Parameters
    ----------
    sweep_dir : path-like
        A sweep folder (``sinklens sweep ... --keep-models``).
    n, T, seed, eps
        As in ``encoding_point``.
    progress : callable, optional
        Called with each run's name.

    Returns
    -------
    EncodingGrid
    """
    # lazy for import time: the reference package loads transformer_lens, needed only to load the runs
    from analysis.model.reference.checkpoint import load_reference

    runs = sorted(d for d in Path(sweep_dir).iterdir() if (d / "model.safetensors").is_file())
    if not runs:
        raise ValueError(f"{sweep_dir} holds no run folder with model.safetensors: train the sweep with --keep-models.")
    rows, curves = [], []
    for d in runs:
        if progress is not None:
            progress(d.name)
        row, curve = encoding_point(load_reference(d, device="cpu"), n=n, T=T, seed=seed, eps=eps)
        facts = _run_facts(d)
        scale = facts["alibi_slope_scale"]
        label = row["encoding"] + (f" (slopes x{scale:g})" if scale not in (None, 1, 1.0) else "")
        rows.append({**facts, "label": label, **row})
        curves.append(curve.assign(run=d.name, encoding=row["encoding"], seed=facts["seed"]))
    return EncodingGrid(
        pd.DataFrame(rows),
        pd.concat(curves, ignore_index=True),
        meta={"n": n, "T": T, "probe_seed": seed, "eps": eps, "source": str(sweep_dir)},
    )


def _spread(values: pd.Series) -> str:
    return f"{values.mean():.1f}% ({values.min():.1f}-{values.max():.1f})"


@dataclass
class EncodingGrid(Result):
    """Sink_1 per input kind and the propositions per positional encoding, one row per trained run.

    Attributes
    ----------
    runs : pandas.DataFrame
        One row per run: its facts (``run``, ``seed``, ``encoding``, ``label``: the grid point, ...), ``sink_1_natural`` / ``_random`` /
        ``_repeated`` (%), and the repeated-token measurements of ``encoding_point``.
    curves : pandas.DataFrame
        Per run, layer, head and t: the first token's attention and its closed form (``first_vs_t``).
    model_name, kind : str or None
    meta : dict
        The probes (n, T, seed, eps) and where the runs were read.
    """

    runs: pd.DataFrame
    curves: pd.DataFrame
    model_name: str | None = "positions grid"
    kind: str | None = None
    meta: dict = field(default_factory=dict)

    @property
    def n_samples(self) -> int:
        return int(len(self.runs) * self.meta.get("n", 0))

    @property
    def encodings(self) -> list[str]:
        return list(dict.fromkeys(self.runs["encoding"]))

    @property
    def _key(self) -> str:
        """The column that names a grid point: ``label`` (the encoding, with its slope scale where not 1)."""
        return "label" if "label" in self.runs else "encoding"

    def summary(self) -> pd.DataFrame:
        """Per encoding: seeds, Sink_1 per kind (mean, std, min, max over seeds), whether the premise and the closed
        form hold in every seed, the largest deviation and gap."""
        g = self.runs.groupby(self._key, sort=False)
        out = g.size().rename("n_seeds").to_frame()
        for k in KINDS:
            out = out.join(g[f"sink_1_{k}"].agg(["mean", "std", "min", "max"]).add_prefix(f"sink_1_{k}_"))
        out["premise_holds"] = g["premise_holds"].all()
        out["form_holds"] = g["form_holds"].agg(lambda s: None if s.isna().all() else bool(s.astype(bool).all()))
        out["max_relative_deviation"] = g["max_relative_deviation"].max()
        out["max_gap_last"] = g["gap_last"].max()
        return out.reset_index()

    table_fields = ("runs", "summary", "curves")

    def findings(self) -> list[str]:
        """Per encoding: the premise, the closed form, and Sink_1 on each kind with its spread over seeds."""
        out = [
            f"Sink_1 (eps = {self.meta.get('eps', SINK_EPS):g}) is given as the mean over seeds (min-max), on "
            f"N = {self.meta.get('n')} sequences of T = {self.meta.get('T')} tokens per kind."
        ]
        for label, r in self.runs.groupby(self._key, sort=False):
            sinks = ", ".join(f"{k} {_spread(r[f'sink_1_{k}'])}" for k in KINDS)
            pe = r.encoding.iloc[0]
            out.append(f"With the {label} encoding ({len(r)} seeds): {self._premise(r, pe)}; Sink_1 {sinks}.")
        return out

    @staticmethod
    def _premise(r: pd.DataFrame, pe: str) -> str:
        dev = float(r.max_relative_deviation.max())
        if not r.premise_holds.all():
            return f"the hidden states of one repeated token differ across positions (up to {dev:.3g} of |h_0|)"
        if pe not in CLOSED_FORMS:
            return f"equal hidden states (deviation {dev:.1e})"
        what = "stays under the bound" if pe == "rotary" else "equals its closed form"
        verdict = what if r.form_holds.astype(bool).all() else "does not always follow its closed form"
        return f"equal hidden states (deviation at most {dev:.1e}) and the attention {verdict} (gap {r.gap_last.max():.1e})"

    json_fields = ("*meta", "summary", "runs")


def save_encoding_grid(grid: EncodingGrid, out) -> None:
    """Write ``propositions.csv`` (the runs), ``propositions_summary.csv`` and ``first_vs_t.csv`` into ``out``.

    Parameters
    ----------
    grid : EncodingGrid
    out : path-like

    Returns
    -------
    None
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    grid.runs.to_csv(out / _FILES["runs"], index=False)
    grid.summary().to_csv(out / "propositions_summary.csv", index=False)
    grid.curves.to_csv(out / _FILES["curves"], index=False, float_format="%.8g")
    write_json(out / "propositions_meta.json", {k: v for k, v in grid.meta.items() if k != "source"})


def load_encoding_grid(path=ENCODING_GRID_DIR) -> EncodingGrid:
    """The committed grid (``scripts/positions_propositions.py``'s CSVs).

    Parameters
    ----------
    path : path-like
        The folder holding ``propositions.csv`` and ``first_vs_t.csv``.

    Returns
    -------
    EncodingGrid
    """
    path = Path(path)
    missing = [f for f in _FILES.values() if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} lacks {missing}: run scripts/positions_propositions.py on the sweep first.")
    runs = pd.read_csv(path / _FILES["runs"])
    runs["form_holds"] = runs["form_holds"].astype(object).where(runs["form_holds"].notna(), None)
    meta = (
        json.loads((path / "propositions_meta.json").read_text()) if (path / "propositions_meta.json").is_file() else {}
    )
    return EncodingGrid(runs, pd.read_csv(path / _FILES["curves"]), meta={**meta, "source": str(path)})
