"""Many models, one resumable run: the sink table, the largest activation and the facts of each model, side by side.

``run_atlas(models, out)`` loads each model in turn (``load``: ``analysis.load_model`` by default; the command line
passes its device, dtype, device map and backend) and measures on the paper's probe (``model_probe_sets``: natural,
random and repeated tokens; a reference model of the synthetic task is probed with its own task):

- Sink_1 (%) on each input kind (eps 0.3 by default), with Sink on a learned slot where the model has one;
- the largest activation of the residual stream on natural text, as ``analysis.chain.massive`` reports it per layer
  (``MassiveActivations.per_layer``): the layer whose mean top-1 |a| over the sequences is largest, that mean, its
  most frequent dimension, position and token (with how often each is the top one), the mean median |a| of the hidden
  state there and their ratio, and whether the layer holds a massive activation by the criterion of
  ``massive.spike_criterion`` (Sun et al.'s: |a| > 100 and >= 1000x the median, relative only for a narrow model);
- the model's facts (``analysis.model.card.model_card``: family, parameters, attention kind, positions, norm);
- the published Sink_1 of the model where Gu et al. give one (``analysis.core.published``), beside ours, never as ours;
- the share of sink heads by kind (nop / broadcast / mixed) on natural text (``analysis.causal.sink_kind``:
  ``SinkKinds.shares``; ``kinds: null`` through nnsight, which has no such pass, ``KINDS_NOTE``).

Each finished model's row is written at once to ``out/models/<name>.json`` (atomically), and after every model the
summary (``atlas.json``, ``atlas.csv``, ``atlas.html``) is rewritten from the rows on disk: an interrupted run loses
only the model it was measuring, and the same command again skips every model whose row holds a result measured with
the same probe (``AtlasConfig``) and its kinds (a row from before the kinds were measured is measured again). A model that fails (it does not load, its probe does not fit) gets its error in its
row and the run goes on; a rerun tries it again.
"""

from __future__ import annotations

import gc
import hashlib
import json
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from analysis.chain.massive import MassiveActivations, criterion_text
from analysis.core.defaults import SINK_EPS
from analysis.core.io import write_atomic, write_json
from analysis.core.published import published_sink
from analysis.core.versions import package_versions
from analysis.model.card import model_card
from analysis.model.contract import SinkModel
from analysis.model.hooks import model_dims
from analysis.model.nnsight_model import NnsightModel
from analysis.model.probes import PROBE_KINDS as KINDS, model_probe_sets  # the atlas measures every probe kind
from analysis.report.atlas_page import atlas_page
from analysis.report.one_pass import profile

ROWS = "models"  # out/models/<name>.json: one row per model
KINDS_NOTE = (
    "sink kinds (nop / broadcast / mixed) on natural text: the share of sink heads (mean alpha_1 > eps) "
    "of each kind, by analysis.causal.sink_kind (a nop's first value is small and it writes less when it "
    "sinks; a broadcast's first value is large and its outputs on sinking queries are one vector per "
    "sequence; thresholds chosen on the ground-truth models nop-task and broadcast-task). A model measured "
    "through nnsight holds kinds: null (no such pass there)."
)


@dataclass(frozen=True)
class AtlasConfig:
    """What a row was measured with: a row measured otherwise is measured again.

    Attributes
    ----------
    n, T : int
        Sequences per input kind and tokens per sequence.
    seed : int
        The probes' seed.
    eps : float
        The sink threshold.
    bos : bool
        The tokenizer's BOS first in every sequence.
    dtype : str
        The model's dtype.
    backend : str
        "transformer_lens" or "nnsight".
    """

    n: int = 100
    T: int = 64
    seed: int = 0
    eps: float = SINK_EPS
    bos: bool = False
    dtype: str = "float32"
    backend: str = "transformer_lens"

    def to_dict(self) -> dict:
        return asdict(self)


def row_path(out, name: str) -> Path:
    """Where a model's row is kept: ``out/models/<name, file-safe>-<hash of name>.json``.

    Parameters
    ----------
    out : path-like
        The atlas folder.
    name : str
        The model as given (a name, a folder, a hub id).

    Returns
    -------
    pathlib.Path
    """
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._")[-60:] or "model"
    return Path(out) / ROWS / f"{safe}-{hashlib.sha1(str(name).encode()).hexdigest()[:8]}.json"


def finished_row(out, name: str, config: AtlasConfig) -> dict | None:
    """The model's row on disk where it holds a result measured with ``config`` (else None: measure it).

    Parameters
    ----------
    out : path-like
    name : str
    config : AtlasConfig

    Returns
    -------
    dict or None
    """
    path = row_path(out, name)
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = row.get("status") == "ok" and row.get("model") == str(name) and row.get("config") == config.to_dict()
    measured_kinds = "kinds" in row and (row["kinds"] is not None or config.backend == "nnsight")
    return row if ok and measured_kinds else None


def largest_activation(massive: MassiveActivations) -> dict:
    """The largest activation of the residual stream as ``MassiveActivations.per_layer`` reports it.

    Parameters
    ----------
    massive : MassiveActivations
        Of one input kind.

    Returns
    -------
    dict
        ``abs`` (the mean over the sequences of the top-1 |a| at the layer where it is largest), ``layer``, ``hook``,
        ``dim``, ``position`` (0-based), ``token`` (the most frequent top-1 dimension, position and token there, with
        ``dim_share``, ``position_share`` and ``token_share``: how often each is the top one; at position 0 of
        natural text the first tokens differ, so the token named is one of them), ``median`` (the mean median |a| of the
        hidden state there), ``ratio`` (abs / median), ``massive`` (the layer holds a dimension flagged by
        ``criterion`` on at least ``min_share`` of the sequences) and ``criterion``.
    """
    per_layer = massive.per_layer
    i = int(per_layer["top1"].idxmax())
    r, layer = per_layer.loc[i], int(per_layer.loc[i, "layer"])
    tokens = massive.top_token[:, i, 0]  # the top-1 token of each sequence there: how often the one named is it
    return {
        "abs": float(r["top1"]),
        "layer": layer,
        "hook": f"hook_{massive.hook}",
        "dim": int(r["top1_dim"]),
        "dim_share": float(r["top1_dim_share"]),
        "position": int(r["top1_pos"]),
        "position_share": float(r["top1_pos_share"]),
        "token": str(r["top1_token"]),
        "token_share": float((tokens == tokens.mode().values).float().mean()),
        "median": float(r["median"]),
        "ratio": float(r["top1_over_median"]),
        "massive": bool(massive.spike_dims.get(layer)),
        "criterion": criterion_text(massive.abs_threshold, massive.ratio_threshold),
        "min_share": massive.min_share,
    }


def _measure_model(model: SinkModel, *, config: AtlasConfig = AtlasConfig(), progress: bool = False) -> dict:
    """One model's atlas numbers: Sink_1 per input kind, the largest activation, the facts.

    The dict holds ``facts``, ``probes`` (each kind's source), ``sink_1_pct`` and ``sink_slot_pct`` (by kind; the slot
    only where the model has one), ``pattern`` (a non-softmax model's proxy, else None), ``largest_activation`` (by
    kind, :func:`largest_activation`) and ``kinds`` (the share of sink heads of each kind on natural text and their
    number, ``SinkKinds.shares``; None through nnsight, ``KINDS_NOTE``).
    """
    dims = model_dims(model)
    if dims.n_ctx is not None and config.T > dims.n_ctx:
        raise ValueError(
            f"T={config.T} exceeds the model's context of {dims.n_ctx} tokens; use --T {dims.n_ctx} or "
            "less (the atlas measures every model at one T)."
        )
    probes = model_probe_sets(model, n=config.n, T=config.T, bos=config.bos, seed=config.seed)
    # one profile pass per input kind, or nnsight traces: the weights may be on NDIF, no sink kinds (they read W_O)
    remote = isinstance(model, NnsightModel)
    analyses = ("sink", "massive") if remote else ("sink", "massive", "sink_kind")
    prof = profile(model, probes, analyses=analyses, eps=config.eps, progress=progress)
    sink, massive, kinds = prof.sink, prof.massive, None if remote else prof.sink_kind.shares()
    first = next(iter(sink.values()))
    return {
        "facts": model_card(model),
        "probes": {k: p.source for k, p in probes.items()},
        "sink_1_pct": {k: round(s.sink_rate(1), 4) for k, s in sink.items()},
        "sink_slot_pct": {k: round(s.slot_sink_rate(), 4) for k, s in sink.items()} if first.has_slot else None,
        "pattern": first.meta.get("pattern"),
        "skipped_layers": first.skipped or None,
        "largest_activation": {k: largest_activation(m) for k, m in massive.items()},
        "kinds": kinds,
    }


def atlas_row(name: str, load: Callable, *, config: AtlasConfig = AtlasConfig(), progress: bool = False) -> dict:
    """Load and measure one model; a failure is the row's ``error`` (KeyboardInterrupt goes through).

    Parameters
    ----------
    name : str
        The model as given.
    load : callable
        ``load(name)`` -> a model.
    config : AtlasConfig
    progress : bool

    Returns
    -------
    dict
        ``model``, ``status`` ("ok" or "failed"), ``error`` (None or "Type: message", with ``traceback``),
        ``config``, ``paper`` (the published Sink_1 row or None), ``seconds``, ``versions`` and
        :func:`_measure_model`'s fields.
    """
    paper = published_sink(name)
    row = {
        "model": str(name),
        "status": "ok",
        "error": None,
        "config": config.to_dict(),
        "paper": paper.to_dict() if paper is not None else None,
    }
    t = time.perf_counter()
    model = None
    try:
        model = load(name)
        row.update(_measure_model(model, config=config, progress=progress))
    except Exception as e:  # noqa: BLE001 - the row keeps the error and the run goes on to the next model
        row.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=6))
    finally:
        del model
        _free_memory()
    row.update(seconds=round(time.perf_counter() - t, 2), versions=package_versions())
    return row


def _free_memory() -> None:
    """Give the last model's memory back before the next one loads."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_atlas(
    models, out, *, load: Callable | None = None, config: AtlasConfig = AtlasConfig(), progress: bool = False, log=print
) -> list[dict]:
    """Measure every model, skipping those already finished in ``out``; write each row and the summary as it goes.

    Parameters
    ----------
    models : sequence of str
        Names, folders, .gguf files or hub ids (``analysis.load_model``).
    out : path-like
        The atlas folder (rows in ``out/models/``, the summary in ``atlas.json``, ``atlas.csv``, ``atlas.html``).
    load : callable, optional
        ``load(name)`` -> a model (default ``analysis.load_model(name)``).
    config : AtlasConfig
    progress : bool
        Progress bars over batches.
    log : callable
        Where one line per model goes (``print``; None: nowhere).

    Returns
    -------
    list of dict
        The rows, in the order of ``models`` (a model listed twice once).
    """
    from analysis.model.loading import load_model  # import time: the loader pulls transformers only when called

    load = load or load_model
    names = list(dict.fromkeys(str(m) for m in models))
    if not names:
        raise ValueError("give at least one model (MODEL ... or --models-file FILE).")
    log = log or (lambda *_: None)
    rows = []
    for i, name in enumerate(names, 1):
        row = finished_row(out, name, config)
        if row is not None:
            log(f"[atlas {i}/{len(names)}] {name}: finished before, kept ({row_path(out, name).name})")
        else:
            log(f"[atlas {i}/{len(names)}] {name} ...")
            row = atlas_row(name, load, config=config, progress=progress)
            write_json(row_path(out, name), row, indent=1)
            log(f"[atlas {i}/{len(names)}] {name}: {_row_text(row)} ({row['seconds']:.1f} s)")
        rows.append(row)
        _write_atlas(out, rows, config=config, pending=names[i:])
    return rows


def _row_text(row: dict) -> str:
    if row["status"] != "ok":
        return f"failed: {row['error']}"
    return "Sink_1 " + " / ".join(f"{k} {v:.2f}" for k, v in row["sink_1_pct"].items()) + " %"


def atlas_table(rows: list[dict]) -> pd.DataFrame:
    """One flat row per model: the CSV.

    Parameters
    ----------
    rows : list of dict
        Of :func:`atlas_row`.

    Returns
    -------
    pandas.DataFrame
        model, status, the facts, Sink_1 per kind (``sink1_<kind>``) and the paper's (``paper_<kind>``), the
        largest activation on natural text (``largest_*``), the kinds' shares and sink heads (``kinds_*``; empty
        where not measured), error.
    """
    out = []
    for r in rows:
        facts, paper = r.get("facts") or {}, r.get("paper") or {}
        big = (r.get("largest_activation") or {}).get("natural") or {}
        kinds = r.get("kinds") or {}
        out.append(
            {
                "model": r["model"],
                "status": r["status"],
                **{
                    k: facts.get(k)
                    for k in ("family", "architecture", "n_params", "attention", "positions", "norm", "n_layers")
                },
                **{f"sink1_{k}": (r.get("sink_1_pct") or {}).get(k) for k in KINDS},
                "paper_model": paper.get("model"),
                **{f"paper_{k}": paper.get(k) for k in KINDS},
                **{
                    f"largest_{k}": big.get(k)
                    for k in ("abs", "layer", "dim", "position", "token", "token_share", "median", "ratio", "massive")
                },
                **{f"kinds_{k}": kinds.get(k) for k in ("nop", "broadcast", "mixed", "n_sink_heads")},
                "error": r.get("error"),
            }
        )
    ints = ["n_params", "n_layers", "largest_layer", "largest_dim", "largest_position", "kinds_n_sink_heads"]
    return pd.DataFrame(out).astype({c: "Int64" for c in ints})  # integers stay integers beside a failed row


def _write_atlas(out, rows: list[dict], *, config: AtlasConfig, pending=()) -> Path:
    """Write ``atlas.json``, ``atlas.csv`` and ``atlas.html`` into ``out``, each atomically."""
    out = Path(out)
    table = atlas_table(rows)
    payload = {
        "config": config.to_dict(),
        "models": rows,
        "pending": list(pending),
        "kinds": KINDS_NOTE,
        "largest_activation": "on natural text, per MassiveActivations.per_layer: the layer with the largest mean "
        "top-1 |a| (positions 0-based)",
        "versions": package_versions(),
    }
    write_json(out / "atlas.json", payload, indent=1)
    write_atomic(out / "atlas.csv", table.to_csv(index=False))
    write_atomic(
        out / "atlas.html", atlas_page(table, rows, config=config.to_dict(), pending=list(pending), note=KINDS_NOTE)
    )
    return out / "atlas.html"
