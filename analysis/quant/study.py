"""``quant_study``: perplexity of a model with its decoder's linear inputs (and weights) fake-quantised, as is, with
the sink tokens kept in full precision, and behind a searched prefix that takes the massive activations; the
site of every per-tensor scale; and the packed low-bit KV cache beside the simulated one."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from analysis.core.io import jsonable
from analysis.core.results import Result
from analysis.model.hooks import readable_text
from analysis.quant.origin import quoted_token
from analysis.quant.passes import Scheme
from analysis.quant.quantizers import WEIGHT_BITS, check_bits, check_granularity

CONDITIONS = ("as_is", "sinks_fp", "prefix")
CONDITION_WORDS = {
    "as_is": "as is",
    "sinks_fp": "sink tokens in full precision",
    "prefix": "searched prefix (full-precision KV, not scored)",
}


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
    layers : pandas.DataFrame
        Per (seed, condition, layer): the largest calibrated input over the layer's linears (:func:`layer_scales`).
    spike_blocks : dict
        Seed -> spike dim -> {"writers", "erasers"}: the blocks whose MLPs write and erase the first token's spike
        (empty where the spike origin was not traced or there is no spike).
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
    layers: pd.DataFrame = field(default_factory=pd.DataFrame)
    spike_blocks: dict = field(default_factory=dict)

    table_fields = ("schemes", "scales", "kv", "layers")

    def summary(self) -> pd.DataFrame:
        """Mean and spread (min, max) over seeds of ppl and ratio per scheme and condition."""
        return _over_seeds(self.schemes, "ppl", "ppl_min", "ppl_max", "ratio", site=("site", "first"))

    def findings(self) -> list[str]:
        out, s = [], self.summary()
        for scheme in s.scheme.unique():
            r = s[s.scheme == scheme].set_index("condition")
            parts = [f"{CONDITION_WORDS[c]} {r.ppl[c]:.2f} (x{r.ratio[c]:.2f})" for c in r.index]
            out.append(f"{scheme}: perplexity " + ", ".join(parts) + ".")
        for seed, p in self.prefixes.items():
            out.append(f"Seed {seed}: the prefix search kept {len(p['ids'])} token(s) {p['text']!r}.")
        for _, r in self.kv.iterrows():
            out.append(f"KV cache {r.cache}: perplexity {r.ppl:.2f}, {r.kv_bytes / 2**20:.2f} MiB held per window.")
        return out + list(self.notes)

    def to_dict(self) -> dict:
        return jsonable(
            {
                **super().to_dict(),
                "summary": self.summary(),
                **{k: getattr(self, k) for k in "prefixes setting notes spike_blocks".split()},
            }
        )


# A column over seeds -> (the schemes table's column, its statistic)
_SPREAD = {
    "ppl": ("ppl", "mean"),
    "ppl_sd": ("ppl", "std"),
    "ppl_min": ("ppl", "min"),
    "ppl_max": ("ppl", "max"),
    "ratio": ("ratio", "mean"),
}


def _over_seeds(schemes: pd.DataFrame, *stats: str, **more) -> pd.DataFrame:
    """One row per scheme and condition, in their order: the ``_SPREAD`` columns ``stats``, then ``more``."""
    g = schemes.groupby(["scheme", "condition"], sort=False)
    return g.agg(**{k: _SPREAD[k] for k in stats}, **more).reset_index()


def load_run(path) -> dict:
    """A committed ``python -m analysis quant --json`` run, its tables as DataFrames.

    Parameters
    ----------
    path : str or path-like

    Returns
    -------
    dict
        "summary", "schemes", "scales", "kv", "layers" (DataFrames), "prefixes", "setting", "spike_blocks", "text",
        "command", "model" (a run made before a key existed: an empty table, or None).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no run at {p}: make it with the command in {p.parent / 'command.txt'}.")
    d = json.loads(p.read_text())
    out = {k: pd.DataFrame(d.get(k) or []) for k in ("summary", "schemes", "scales", "kv", "layers")}
    return {**out, **{k: d.get(k) for k in ("prefixes", "setting", "spike_blocks", "text", "command", "model")}}


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
    return _over_seeds(run["schemes"], *_SPREAD, seeds=("seed", "nunique"))


def fixed_notation(df: pd.DataFrame, *, digits: int = 4) -> pd.DataFrame:
    """A table for reading: every float in fixed notation with ``digits`` significant digits (at most 3 decimals,
    thousands separated), never ``5.461217e+01``.

    Parameters
    ----------
    df : pandas.DataFrame
    digits : int
        Significant digits of a float.

    Returns
    -------
    pandas.DataFrame
        Its float columns as strings.
    """

    def fmt(v) -> str:
        if not isinstance(v, float) or not math.isfinite(v):
            return "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
        places = 0 if v == 0 else min(3, max(0, digits - 1 - math.floor(math.log10(abs(v)))))
        return f"{v:,.{places}f}"

    out = df.copy()
    for c in out.columns[[pd.api.types.is_float_dtype(t) for t in out.dtypes]]:
        out[c] = out[c].map(fmt)
    return out


def layer_scales(scales: dict) -> pd.DataFrame:
    """Per layer, its largest calibrated input over its linears: the per-tensor scale the layer's worst linear gets.

    Parameters
    ----------
    scales : dict of str to ScaleSite
        Of ``analysis.quant.calibrate.calibrate``.

    Returns
    -------
    pandas.DataFrame
        One row per layer: ``layer``, ``site``, ``absmax``, ``window``, ``position``, ``dim``, ``token_id``.
    """
    df = pd.DataFrame([vars(s) for s in scales.values()])
    top = df.loc[df.groupby("layer").absmax.idxmax()].sort_values("layer")
    return top[["layer", "site", "absmax", "window", "position", "dim", "token_id"]].reset_index(drop=True)


def with_tokens(scales: pd.DataFrame, tokenizer) -> pd.DataFrame:
    """The scales table (:func:`load_run`'s ``scales``) with each scale's token shown readably, byte tokens escaped
    (``' \\xe2\\x94'``, not '\ufffd'): a ``token`` column, and the same token in ``origin``'s sentence.

    Parameters
    ----------
    scales : pandas.DataFrame
        With ``token_id`` and ``origin``.
    tokenizer : transformers tokenizer or None
        The model's.

    Returns
    -------
    pandas.DataFrame
    """
    out = scales.copy()
    out["token"] = [readable_text(tokenizer, [i]) for i in out.token_id]
    if tokenizer is not None and "origin" in out:  # the sentence quoted the token as the tokenizer decodes it
        out["origin"] = [
            o.replace(f"token {tokenizer.decode([int(i)])!r}", f"token {quoted_token(t)}", 1)
            for o, i, t in zip(out.origin, out.token_id, out.token)
        ]
    return out
