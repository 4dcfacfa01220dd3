"""``quant_study``: perplexity of a model with its decoder's linear inputs (and weights) fake-quantised, as is, with
the sink tokens kept in full precision, and behind a searched prefix that takes the massive activations; the
site of every per-tensor scale; and the packed low-bit KV cache beside the simulated one."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from analysis.core.io import jsonable
from analysis.core.results import Result
from analysis.quant.passes import Scheme
from analysis.quant.quantizers import WEIGHT_BITS, check_bits, check_granularity

CONDITIONS = ("as_is", "sinks_fp", "prefix")
CONDITION_WORDS = {"as_is": "as is", "sinks_fp": "sink tokens in full precision",
                   "prefix": "searched prefix (full-precision KV, not scored)"}


def check_conditions(conditions) -> list[str]:
    """The conditions if known, else a ValueError.

    Parameters
    ----------
    conditions : sequence of str

    Returns
    -------
    list of str
    """
    bad = [c for c in conditions if c not in CONDITIONS]
    if bad or not conditions:
        raise ValueError(f"conditions must be among {', '.join(CONDITIONS)}; got {list(conditions)}.")
    return list(conditions)


def schemes_of(a_bits, granularities, w_bits) -> list[Scheme]:
    """Every scheme of the grid, checked before any work.

    Parameters
    ----------
    a_bits : sequence of int
    granularities : sequence of str
    w_bits : sequence of int or None

    Returns
    -------
    list of Scheme
    """
    a = [check_bits(b) for b in a_bits]
    g = [check_granularity(x) for x in granularities]
    w = [None if not b else check_bits(b, what="weight", allowed=WEIGHT_BITS) for b in w_bits]
    return [Scheme(ab, gr, wb) for wb in w for ab in a for gr in g]


@dataclass
class QuantResult(Result):
    """What ``quant_study`` measured.

    Attributes
    ----------
    model_name : str
    schemes : pandas.DataFrame
        One row per (seed, scheme, condition): ppl, fp_ppl (the same condition in full precision), ratio, the
        largest calibrated scale's site and its origin in words.
    scales : pandas.DataFrame
        Per (seed, condition): the linears with the largest calibrated input, where each comes from.
    kv : pandas.DataFrame
        The packed low-bit KV cache against the simulated one (empty where not measured).
    prefixes : dict
        Seed -> the searched prefix (token ids and text) and its scale cost after each step.
    setting : dict
        T, windows, calibration tokens, seeds, sources.
    kind : str or None
    n_samples : int
        Held-out windows.
    notes : list of str
    """

    model_name: str
    schemes: pd.DataFrame
    scales: pd.DataFrame
    kv: pd.DataFrame
    prefixes: dict
    setting: dict
    kind: str | None = "text"
    n_samples: int = 0
    notes: list = field(default_factory=list)

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {"schemes": self.schemes, "scales": self.scales, "kv": self.kv}

    def summary(self) -> pd.DataFrame:
        """Mean and spread (min, max) over seeds of ppl and ratio per scheme and condition."""
        g = self.schemes.groupby(["scheme", "condition"], sort=False)
        return g.agg(ppl=("ppl", "mean"), ppl_min=("ppl", "min"), ppl_max=("ppl", "max"), ratio=("ratio", "mean"),
                     site=("site", "first")).reset_index()

    def findings(self) -> list[str]:
        out, s = [], self.summary()
        for scheme in s.scheme.unique():
            r = s[s.scheme == scheme].set_index("condition")
            parts = [f"{CONDITION_WORDS[c]} {r.ppl[c]:.2f} (x{r.ratio[c]:.2f})" for c in r.index]
            out.append(f"{scheme}: perplexity " + ", ".join(parts) + ".")
        for seed, p in self.prefixes.items():
            out.append(f"Seed {seed}: the prefix search kept {len(p['ids'])} token(s) {p['text']!r}.")
        if len(self.kv):
            for _, r in self.kv.iterrows():
                out.append(f"KV cache {r.cache}: perplexity {r.ppl:.2f}, {r.kv_bytes / 2**20:.2f} MiB held per window.")
        return out + list(self.notes)

    def to_dict(self) -> dict:
        return jsonable({**super().to_dict(), "summary": self.summary(), "prefixes": self.prefixes,
                         "setting": self.setting, "notes": self.notes})


def load_run(path) -> dict:
    """A committed ``python -m analysis quant --json`` run, its tables as DataFrames.

    Parameters
    ----------
    path : str or path-like

    Returns
    -------
    dict
        "summary", "schemes", "scales", "kv" (DataFrames), "prefixes", "setting", "text", "command", "model".
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no run at {p}: make it with the command in {p.parent / 'command.txt'}.")
    d = json.loads(p.read_text())
    out = {k: pd.DataFrame(d.get(k) or []) for k in ("summary", "schemes", "scales", "kv")}
    return {**out, **{k: d.get(k) for k in ("prefixes", "setting", "text", "command", "model")}}


def seed_spread(run: dict) -> pd.DataFrame:
    """Per scheme and condition: perplexity mean, standard deviation and range over the calibration seeds, and
    the ratio to full precision.

    Parameters
    ----------
    run : dict
        Of :func:`load_run`.

    Returns
    -------
    pandas.DataFrame
    """
    g = run["schemes"].groupby(["scheme", "condition"], sort=False)
    return g.agg(ppl=("ppl", "mean"), ppl_sd=("ppl", "std"), ppl_min=("ppl", "min"), ppl_max=("ppl", "max"),
                 ratio=("ratio", "mean"), seeds=("seed", "nunique")).reset_index()
