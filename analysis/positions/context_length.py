"""The sink against context length and threshold: Sink_1 and the secondary sinks for T from 16 up to the model's
context, and against eps, with their spread over probe seeds.

For each T and probe seed, ``sink_vs_context`` cuts N natural-text windows of T tokens (``analysis.model.probes``, the
offline docstring corpus unless ``texts`` is given), computes alpha_k of every key in one pass per T over the windows
of every seed (``sink_metric`` with
k_max = T: the fused path where it is exact, so no T x T map at long T) and keeps, for every eps of a grid, the
rates of ``analysis.positions.every_sink.sink_rates``: Sink_1 (%), the percent of (sample, layer, head) that sink on a
later position (secondary), and the later sink positions per sequence. Nothing else is kept: O(N x L x H x T)
numbers at a time, one T at a time.

Long T is costly on a CPU (T = 8192 is about 40 s a sequence on 2 cores), so the long-T points of a model are
computed once by ``scripts/sink_context.py`` into a CSV (``analysis/data/sink_context/``), read back by ``load_sink_context``;
notebooks, the report and CI compute a cheap range.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.core.defaults import SINK_EPS
from analysis.model.hooks import model_dims
from analysis.model.probes import model_probe_sets, natural_probe, stdlib_texts
from analysis.core.io import PACKAGE_DATA_DIR
from analysis.core.results import Result
from analysis.sinks.metric import check_eps, sink_metric
from analysis.positions.every_sink import default_min_queries, sink_rates

from analysis.core.defaults import BARBERO_EPS, CONTEXT_EPS_GRID as EPS_GRID  # Barbero et al. (2025): eps = 0.8

SINK_CONTEXT_DIR = PACKAGE_DATA_DIR / "sink_context"  # committed long-T runs, per model (package data)
RATES = ("sink_1_pct", "secondary_pct", "later_sinks_per_sequence")
COLUMNS = ["model", "T", "seed", "n", "eps", *RATES, "path", "seconds"]


@dataclass
class SinkContext(Result):
    """Sink rates per context length T, probe seed and threshold eps.

    Attributes
    ----------
    runs : pandas.DataFrame
        One row per (T, seed, eps): ``n`` sequences, ``sink_1_pct``, ``secondary_pct`` (percent of (sample, layer,
        head) sinking on a later position), ``later_sinks_per_sequence``, the ``path`` taken and the ``seconds`` the T's
        pass took (over every seed's windows), divided among its seeds.
    model_name : str or None
        The model measured.
    source : str
        Where the numbers come from ("computed", or the CSV they were read from).
    kind : str
        The probe kind ("natural").
    meta : dict
        Further facts of the runs.
    """

    runs: pd.DataFrame
    model_name: str | None = None
    source: str = "computed"
    kind: str = "natural"
    meta: dict = field(default_factory=dict)

    @property
    def n_samples(self) -> int:
        """Sequences over every T and seed (each counted once, not once per eps)."""
        return int(self.runs.drop_duplicates(["T", "seed"])["n"].sum())

    @property
    def Ts(self) -> list[int]:
        return sorted(int(t) for t in self.runs["T"].unique())

    @property
    def seeds(self) -> list[int]:
        return sorted(int(s) for s in self.runs["seed"].unique())

    def _at(self, col: str, value: float) -> pd.DataFrame:
        df = self.runs[(self.runs[col] - value).abs() < 1e-9]
        if not len(df):
            raise ValueError(f"no runs at {col} = {value}; this result has {col} in {sorted(self.runs[col].unique())}.")
        return df

    @staticmethod
    def _spread(df: pd.DataFrame, by: str) -> pd.DataFrame:
        """Mean, min and max over probe seeds of each rate, per value of ``by``."""
        g = df.groupby(by)
        out = pd.DataFrame({"n_seeds": g["seed"].nunique(), "n_per_seed": g["n"].min()})
        for r in RATES:
            out[f"{r}_mean"], out[f"{r}_min"], out[f"{r}_max"] = g[r].mean(), g[r].min(), g[r].max()
        return out.reset_index()

    def by_T(self, eps: float = SINK_EPS) -> pd.DataFrame:
        """One row per T at ``eps``: each rate's mean, min and max over probe seeds."""
        return self._spread(self._at("eps", eps), "T")

    def by_eps(self, T: int | None = None) -> pd.DataFrame:
        """One row per eps at context length ``T`` (default the largest): each rate's mean, min and max over seeds."""
        return self._spread(self._at("T", max(self.Ts) if T is None else T), "eps")

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        out = {"by_T": self.by_T(), "by_eps": self.by_eps()} if self._has_eps(SINK_EPS) else {}
        if self._has_eps(BARBERO_EPS):
            out["by_T_eps_0.8"] = self.by_T(BARBERO_EPS)
        return out | {"runs": self.runs}

    def _has_eps(self, eps: float) -> bool:
        return bool(((self.runs["eps"] - eps).abs() < 1e-9).any())

    def trend(self, rate: str = "sink_1_pct", eps: float = SINK_EPS) -> float:
        """Spearman's rank correlation of a rate's seed mean with T (+1: it grows with every longer context)."""
        df = self.by_T(eps)
        if len(df) < 3 or df[f"{rate}_mean"].nunique() < 2:
            return float("nan")
        from scipy.stats import spearmanr  # lazy for import time: scipy.stats costs ~0.5 s, needed only here

        return float(spearmanr(df["T"], df[f"{rate}_mean"]).statistic)

    def _curve_text(self, rate: str, what: str, eps: float, unit: str = "%") -> str:
        df = self.by_T(eps)
        lo, hi = df.iloc[0], df.iloc[-1]
        if df[f"{rate}_mean"].nunique() < 2:  # the same at every T: no rank correlation to give
            return (
                f"At eps = {eps:g}, {what} is {float(lo[f'{rate}_mean']):.1f}{unit} at every T from {int(lo['T'])} to "
                f"{int(hi['T'])} ({len(df)} lengths)."
            )
        rho = self.trend(rate, eps)
        if rho != rho:  # fewer than 3 lengths: no rank correlation
            return (
                f"At eps = {eps:g}, {what} is {float(lo[f'{rate}_mean']):.1f}{unit} at T = {int(lo['T'])} and "
                f"{float(hi[f'{rate}_mean']):.1f}{unit} at T = {int(hi['T'])}."
            )
        verb = "grows with T" if rho > 0.7 else "falls with T" if rho < -0.7 else "does not change monotonically with T"
        span = lambda r: (
            f"{r[f'{rate}_mean']:.1f}{unit} (seeds {r[f'{rate}_min']:.1f}-{r[f'{rate}_max']:.1f})"
            if r["n_seeds"] > 1
            else f"{r[f'{rate}_mean']:.1f}{unit}"
        )
        return (
            f"At eps = {eps:g}, {what} {verb} (Spearman {rho:+.2f} over {len(df)} lengths): {span(lo)} at T = "
            f"{int(lo['T'])} and {span(hi)} at T = {int(hi['T'])}."
        )

    def findings(self) -> list[str]:
        """Sink_1 and the secondary sinks against T (at eps 0.3 and Barbero et al.'s 0.8), and against eps."""
        name = self.model_name or "the model"
        n = self.runs.drop_duplicates(["T", "seed"]).groupby("T")["n"].sum()
        out = [
            f"Sink against context length on {name} ({self.kind} text, T = {self.Ts[0]} to {self.Ts[-1]}, "
            f"{len(self.seeds)} probe seed(s), {_range(int(n.min()), int(n.max()))} sequences per T; {self.source})."
        ]
        if len(self.Ts) >= 2 and self._has_eps(SINK_EPS):
            out.append(self._curve_text("sink_1_pct", "Sink_1", SINK_EPS))
            out.append(
                self._curve_text(
                    "secondary_pct", "the share of (sample, layer, head) sinking on a later position", SINK_EPS
                )
            )
        if len(self.Ts) >= 2 and self._has_eps(BARBERO_EPS):
            out.append(self._curve_text("sink_1_pct", "Sink_1", BARBERO_EPS))
        if self._has_eps(SINK_EPS) and self.runs["eps"].nunique() > 1:
            e = self.by_eps().set_index("eps")
            T = max(self.Ts)
            pts = ", ".join(f"{e.loc[x, 'sink_1_pct_mean']:.1f}% at eps = {x:g}" for x in e.index[[0, len(e) // 2, -1]])
            out.append(
                f"Against the threshold at T = {T}, Sink_1 is {pts}, and the secondary share "
                f"{e.iloc[0]['secondary_pct_mean']:.1f}% at eps = {e.index[0]:g} and "
                f"{e.iloc[-1]['secondary_pct_mean']:.1f}% at eps = {e.index[-1]:g}."
            )
        return out

    json_fields = ("source", "Ts", "seeds", "runs")

    def to_csv(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.runs.to_csv(path, index=False, float_format="%.6g")
        return path


def load_sink_context(path, *, model_name: str | None = None) -> SinkContext:
    """A ``SinkContext`` from a CSV written by ``SinkContext.to_csv``: a path, or the name of a model whose run is
    committed in ``analysis/data/sink_context/`` (e.g. ``"smollm2-135m"``).

    Parameters
    ----------
    path : path-like or str
        A CSV path, or a model name whose run is committed.
    model_name : str, optional
        The model's name (default: the CSV's ``model`` column).

    Returns
    -------
    SinkContext
    """
    path = Path(path)
    if not path.is_file() and (SINK_CONTEXT_DIR / f"{path}.csv").is_file():
        path = SINK_CONTEXT_DIR / f"{path}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"no sink-context CSV at {path}; compute one with scripts/sink_context.py.")
    runs = pd.read_csv(path)
    missing = [c for c in COLUMNS if c not in runs.columns]
    if missing:
        raise ValueError(f"{path} is not a sink-context CSV: it lacks the columns {missing}.")
    name = model_name or (str(runs["model"].iloc[0]) if len(runs) else None)
    return SinkContext(runs, model_name=name, source=f"read from {path.name}")


def committed_sink_context(model_name: str | None) -> SinkContext | None:
    """The committed long-T run of ``model_name`` (``analysis/data/sink_context/<name>.csv``), or None where there is none.

    Parameters
    ----------
    model_name : str or None

    Returns
    -------
    SinkContext or None
    """
    path = SINK_CONTEXT_DIR / f"{model_name}.csv"
    return load_sink_context(path) if model_name and path.is_file() else None


def sink_vs_context(
    model: SinkModel,
    *,
    Ts: Sequence[int] = (16, 32, 64, 128),
    n: int | Mapping[int, int] = 4,
    seeds: Iterable[int] = (0, 1, 2),
    eps_grid: Sequence[float] = EPS_GRID,
    path: str = "auto",
    texts: Sequence[str] | None = None,
    batch_size: int | None = None,
    on_run: Callable[[pd.DataFrame], None] | None = None,
) -> SinkContext:
    """Sink_1 and the secondary sinks of ``model`` on natural text for each context length in ``Ts`` and probe seed, at
    every eps of ``eps_grid``.

    Parameters
    ----------
    model
        A model with TransformerLens hook names; without a tokenizer (a reference model of the synthetic task) its
        natural text is held-out task sequences (``model_probe_sets``).
    Ts : sequence of int
        Context lengths, each in [2, the model's context].
    n : int or mapping of int to int
        Sequences per (T, seed): one number, or {T: n}.
    seeds : iterable of int
        Probe seeds (each cuts other windows of the corpus).
    eps_grid : sequence of float
        Thresholds in (0, 1).
    path : {"auto", "fused", "eager"}
        "auto": fused where exact, as in ``analysis.sink_metric``.
    texts : sequence of str, optional
        The natural texts (default the offline standard-library docstrings).
    batch_size : int, optional
        Sequences per batch.
    on_run : callable, optional
        Called with the rows (a DataFrame) of each (T, seed) as they are done (e.g. to write a CSV as the run goes):
        a T's seeds after its pass.

    Returns
    -------
    SinkContext
    """
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None and texts is not None:
        raise ValueError("sink_vs_context cuts `texts` with model.tokenizer; this model has none: leave texts out.")
    eps_grid = [check_eps(e) for e in eps_grid]
    n_ctx = model_dims(model).n_ctx
    Ts = [int(t) for t in Ts]
    bad = [t for t in Ts if t < 2 or (n_ctx is not None and t > n_ctx)]
    if bad:
        raise ValueError(f"context lengths {bad} are outside [2, {n_ctx}] (the model's context); choose T in it.")
    seeds = [int(s) for s in seeds]
    corpus = (stdlib_texts() if texts is None else list(texts)) if tokenizer else None
    name = getattr(model, "model_name", None)
    rows = []
    for T in Ts:  # one pass per T over every seed's windows (a pass over 4 short sequences is mostly fixed cost)
        n_T = int(n[T] if isinstance(n, Mapping) else n)
        t0 = time.perf_counter()
        tokens = torch.cat(
            [
                natural_probe(tokenizer, n=n_T, T=T, seed=seed, texts=corpus).tokens
                if tokenizer
                else model_probe_sets(model, n=n_T, T=T, seed=seed)["natural"].tokens
                for seed in seeds
            ]
        )
        res = sink_metric(model, tokens, k_max=T, path=path, batch_size=batch_size)
        seconds = (time.perf_counter() - t0) / len(seeds)  # the T's pass, shared by its seeds
        for i, seed in enumerate(seeds):
            alpha = res.alpha[i * n_T : (i + 1) * n_T]
            rows += [
                {
                    "model": name,
                    "T": T,
                    "seed": seed,
                    "n": n_T,
                    "eps": e,
                    **sink_rates(alpha, e, default_min_queries(T)),
                    "path": res.meta.get("path"),
                    "seconds": round(seconds, 2),
                }
                for e in eps_grid
            ]
            if on_run is not None:
                on_run(pd.DataFrame(rows, columns=COLUMNS))
    return SinkContext(pd.DataFrame(rows, columns=COLUMNS), model_name=name)


def _range(lo: int, hi: int) -> str:
    """'12' for 12-12, '1-32' otherwise."""
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, Section, register  # noqa: E402


register(
    Analysis(
        "context",
        result=SinkContext,
        order=240,
        doc="The sink against context length and eps (passes of their own).",
        sections=(
            Section(
                "Sink against context length and eps",
                "context",
                110,
                needs=(),
                runner="analysis.report.sections:_context",
            ),
        ),
        exports=("SinkContext", "sink_vs_context"),
    )
)
