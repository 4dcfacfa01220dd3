"""The atlas' one self-contained page: the tables and figures of ``analysis.report.atlas``, laid out with the report's
HTML kit (``analysis.report.html``). Nothing here computes a number."""

from __future__ import annotations

import html

import pandas as pd

from analysis.figures.atlas import plot_atlas_activation, plot_atlas_kinds, plot_atlas_sink
from analysis.model.probes import PROBE_KINDS as _KINDS
from analysis.report.html import document, figure_html, table_html


def _sink_table(table: pd.DataFrame, rows: list[dict]) -> pd.DataFrame:
    """Sink_1 per kind, ours then the paper's, and what a number was measured on where it is not plain softmax."""
    ok = table[table["status"] == "ok"]
    notes = {
        r["model"]: "; ".join(
            x
            for x in (
                r.get("pattern"),
                r.get("skipped_layers"),
                "Sink on the learned slot " + " / ".join(f"{v:.2f}" for v in r["sink_slot_pct"].values()) + " %"
                if r.get("sink_slot_pct")
                else None,
            )
            if x
        )
        for r in rows
        if r["status"] == "ok"
    }
    out = ok[["model", "family", "n_params"] + [f"sink1_{k}" for k in _KINDS]].copy()
    for k in _KINDS:  # blank where the paper gives no figure for the model
        out[f"Gu et al. {k}"] = ok[f"paper_{k}"].map(lambda v: "" if pd.isna(v) else f"{v:.2f}")
    out["measured on"] = [notes.get(m, "") for m in ok["model"]]
    return out.rename(columns={f"sink1_{k}": f"Sink_1 {k}" for k in _KINDS})


def _activation_table(table: pd.DataFrame, rows: list[dict]) -> pd.DataFrame:
    """The largest activation of each model, with the criterion its "massive" is judged by (a narrow model's is
    relative only)."""
    ok = table[table["status"] == "ok"]
    cols = ["abs", "layer", "dim", "position", "token", "token_share", "median", "ratio", "massive"]
    out = ok[["model"] + [f"largest_{c}" for c in cols]].rename(columns={f"largest_{c}": c for c in cols})
    crit = {r["model"]: r["largest_activation"]["natural"]["criterion"] for r in rows if r["status"] == "ok"}
    out["criterion"] = [crit[m] for m in ok["model"]]
    return out


def _kinds_table(table: pd.DataFrame) -> pd.DataFrame:
    """The number of sink heads and the share of each kind, per model."""
    cols = {
        "kinds_n_sink_heads": "sink heads",
        "kinds_nop": "nop",
        "kinds_broadcast": "broadcast",
        "kinds_mixed": "mixed",
    }
    return table[table["status"] == "ok"][["model", *cols]].rename(columns=cols)


def _intro(config: dict, table: pd.DataFrame, pending: list[str]) -> str:
    esc = html.escape
    n_ok, n_failed = int((table["status"] == "ok").sum()), int((table["status"] != "ok").sum())
    parts = [
        f"<p>{n_ok} model(s) measured, {n_failed} failed, {len(pending)} not reached yet. Each on the paper's "
        f"probe: N = {config['n']} sequences of T = {config['T']} tokens per input kind (natural, random, "
        f"repeated; seed {config['seed']}, {'BOS first' if config['bos'] else 'no BOS'}), eps = {config['eps']:g}, "
        f"{esc(config['dtype'])}, backend {esc(config['backend'])}. Every number and each probe's source are in "
        "atlas.json; one row per model in models/.</p>"
    ]
    if pending:
        parts.append(
            f'<p class="note">Not reached yet (the same command again goes on): {esc(", ".join(pending))}.</p>'
        )
    parts.append(
        '<p class="small">The columns "Gu et al." are published figures (Gu et al. 2025, Table 1 and the '
        "base/chat comparison; Sink_1 %, eps 0.3, T = 64), shown beside the model of that name, never as "
        "results of this package.</p>"
    )
    return "".join(parts)


def _figures(table: pd.DataFrame) -> tuple[str, str, str]:
    """The three figures, or a note where no model has a result yet."""
    if not (table["status"] == "ok").any():
        note = '<p class="note">No model has a result yet: no figure.</p>'
        return note, note, note
    return (
        figure_html(
            plot_atlas_sink(table),
            caption="Sink_1 (%) by model and input kind; black ticks: Gu et "
            "al.'s published figures for the model of that name",
        ),
        figure_html(
            plot_atlas_activation(table),
            caption="The largest activation (mean top-1 |a| over the "
            "natural-text sequences, at the layer where it is largest) and the median |a| there, log "
            "scale; L = layer, d = dimension",
        ),
        figure_html(
            plot_atlas_kinds(table),
            caption="The share of each model's sink heads that are nop, broadcast "
            "or mixed, on natural text; right: the number of sink heads",
        ),
    )


def atlas_page(table: pd.DataFrame, rows: list[dict], *, config: dict, pending: list[str], note: str) -> str:
    """The atlas page.

    Parameters
    ----------
    table : pandas.DataFrame
        ``analysis.report.atlas.atlas_table``.
    rows : list of dict
        The models' rows (``analysis.report.atlas.atlas_row``).
    config : dict
        ``AtlasConfig.to_dict()``.
    pending : list of str
        Models listed but not measured yet.
    note : str
        What the sink-kinds section says (``KINDS_NOTE``).

    Returns
    -------
    str
        HTML.
    """
    esc = html.escape
    sink_fig, act_fig, kinds_fig = _figures(table)
    failed = table[table["status"] != "ok"][["model", "error"]]
    body = [
        _intro(config, table, pending),
        "<h2>Sink_1 by model and input kind</h2>",
        table_html(_sink_table(table, rows), digits=2, max_rows=500),
        sink_fig,
        "<h2>Largest activation</h2>",
        '<p class="small">On natural text, in the residual stream after each block: the layer whose mean top-1 |a| '
        "over the sequences is largest, its most frequent top-1 dimension, position (0-based) and token "
        "(token_share: the share of sequences whose top-1 token it is), the mean median |a| there and the ratio; "
        '"massive": the layer holds a dimension that passes the criterion on at least half of the sequences.</p>',
        table_html(_activation_table(table, rows), digits=2, max_rows=500),
        act_fig,
        "<h2>Model facts</h2>",
        table_html(
            table[table["status"] == "ok"][
                ["model", "family", "architecture", "n_params", "attention", "positions", "norm", "n_layers"]
            ],
            max_rows=500,
        ),
        "<h2>Sink kinds (nop / broadcast / mixed)</h2>",
        f'<p class="small">{esc(note)}</p>',
        table_html(_kinds_table(table), digits=2, max_rows=500),
        kinds_fig,
    ]
    if len(failed):
        body += [
            "<h2>Failed</h2>",
            '<p class="small">Each failed model keeps its error in its row; the same command again tries it again.</p>',
            table_html(failed, max_rows=500),
        ]
    versions = next((r.get("versions") for r in rows if r.get("versions")), {})
    body.append(
        f'<hr/><p class="small">Package versions: {esc(", ".join(f"{k} {v}" for k, v in versions.items()))}.</p>'
    )
    return document(f"Attention-sink atlas of {len(rows)} model(s)", "\n".join(body))
