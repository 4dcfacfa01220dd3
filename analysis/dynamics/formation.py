"""The order in which the sink's chain forms during training: every link measured on each snapshot of a run.

A run trained with ``--snapshots`` (the ``induction`` preset keeps 16 log-spaced steps) holds its weights along
training under ``RUN/snapshots/step-NNNNNNN``. :func:`chain_links` measures, on one model and a held-out probe, every
link of the mechanism with the package's analyses:

- the sink (``sink_1``) and the spike (``spike_ratio``: the followed dims entering the sink layer; the chain's
  ``spike_ratio_token`` / ``spike_ratio_sequence``: any dim, any stream), ``analysis.dynamics.compare.mechanism_chain``;
- the spike's writer (``analysis.chain.spike_writers.spike_origin`` on the followed dims, no absolute floor): the component
  that writes the most of the main dim before the sink layer reads it (``writer_block``, ``writer_mlp``), the
  largest MLP write's share of the value the sink layer reads (``mlp_write_share``) and the neurons carrying 90% of
  that MLP's write (``writer_neurons_90``);
- the norm (``norm_share``: the followed dims' share of the first token's |x|^2 after the norm and its gain at the
  sink layer, ``analysis.chain.norm_gain``);
- the key and the value (``key_offsub_z``, ``cos_q_k1``, ``cos_q_kj``, ``value_ratio_sink_heads``: in the model's own
  sink heads, NaN while it has none; ``*_final_heads``: in the final model's sink heads, defined at every step);
- the cuts: Sink_1 with the writer neurons zeroed on the first token (``analysis.causal.writer_cuts.spike_cuts``) and with
  the followed dims zeroed on the first token in every stream (``mechanism_chain``), and the share of Sink_1 each
  keeps.

Every snapshot follows what the final model has: its spike dims (at least ``SPIKE_RATIO_FOLLOW`` x the first
token's median |activation| entering its sink layer), its sink layer and its sink heads. :func:`formation_order`
runs this over every snapshot (and the final model) of several runs and finds, per run and link, the first step
where the link meets its criterion (:data:`ONSETS`) and the first step where it is half-way from its first value to
its final value, so that the order does not hinge on one threshold.
"""

from __future__ import annotations

import ast
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch

from analysis.model.access import attention_operation, reference_config
from analysis.model.contract import SinkModel
from analysis.core.defaults import NEURON_SHARES, SINK_EPS, TINY
from analysis.core.docs import parameters_from
from analysis.core.io import EMERGENCE_DIR, write_json
from analysis.chain.massive import massive_activations
from analysis.chain.norm_gain import choose_layer, norm_gain_trace
from analysis.core.results import Result
from analysis.sinks.metric import sink_metric
from analysis.chain.spike_writers import spike_origin
from analysis.core.stats import one_thread
from analysis.model.reference.checkpoint import CheckpointError, load_reference, read_json
from analysis.dynamics.compare import mechanism_chain, sink_kv_heads
from analysis.model.reference.config import TrainConfig
from analysis.model.reference.data import build_data
from analysis.chain.values import value_norms
from analysis.causal.writer_cuts import spike_cuts

# The thresholds of formation (which dims are followed, the writer and cut floors, the onset criteria of ONSETS) are
# defaults: analysis.core.defaults documents each.
from analysis.core.defaults import (
    COS_ONSET,
    CUT_MIN_SINK_PCT,
    CUT_ONSET_KEPT,
    HALF_WAY,
    KEY_ONSET_Z,
    N_RANDOM_CUT,
    NORM_ONSET_SHARE,
    SINK_ONSET_PCT,
    SPIKE_ONSET_RATIO,
    SPIKE_RATIO_FOLLOW,
    VALUE_ONSET_RATIO,
    WRITER_MIN_RATIO,
    WRITER_ONSET_NEURONS,
    WRITER_ONSET_SHARE,
)

# Every link of the long table, in the order of the chain, with what it measures.
LINKS: dict[str, str] = {
    "sink_1": f"Sink_1 (%), eps {SINK_EPS:g}",
    "spike_ratio": "the followed dims' largest mean |a| on the first token entering the sink layer over the first "
    "token's median mean |a| there",
    "spike_ratio_token": "the first token's largest |a| over its own median |a|, any dim, largest over the streams",
    "spike_ratio_sequence": "the same over the median |a| of the sample's whole hidden state",
    "writer_block": "the block whose write (in the spike's sign) onto the main dim before the sink layer is the "
    "largest (-1: the embedding; NaN: none, or the main dim under the first token's median |a|)",
    "writer_mlp": "1 when that write is an MLP's, 0 when it is the embedding's or an attention's",
    "mlp_write_share": "the largest MLP write onto the main dim before the sink layer over the value the sink layer "
    "reads",
    "writer_neurons_90": "the fewest neurons carrying 90% of that MLP's write",
    "norm_share": "the followed dims' share of the first token's |x|^2 after the norm and its gain at the sink layer",
    "norm_share_other": "the same for ordinary tokens",
    "key_offsub_z": "k_1's distance off the other keys' principal subspace in units of theirs, own sink heads",
    "cos_q_k1": "mean cos(q_t, k_1), own sink heads",
    "cos_q_kj": "mean cos(q_t, k_j), j > 1, own sink heads",
    "key_offsub_z_final_heads": "key_offsub_z in the final model's sink heads",
    "cos_q_k1_final_heads": "cos_q_k1 in the final model's sink heads",
    "cos_q_kj_final_heads": "cos_q_kj in the final model's sink heads",
    "value_ratio_sink_heads": "median |v_1| / mean |v_j| over own sink KV heads",
    "value_ratio_other_heads": "the same over the other KV heads",
    "value_ratio_final_heads": "the same over the final model's sink KV heads",
    "sink_1_writers_cut": "Sink_1 (%) with the writer neurons zeroed on the first token",
    "cut_kept": "the share of Sink_1 the writer cut keeps (NaN where Sink_1 < 5%)",
    "cut_kept_random": "the same with as many random neurons of the same MLPs",
    "sink_1_spike_zeroed": "Sink_1 (%) with the followed dims zeroed on the first token in every stream",
    "zero_kept": "the share of Sink_1 that zeroing keeps (NaN where Sink_1 < 5%)",
}


@dataclass(frozen=True)
class Criterion:
    """A link has formed where ``value op threshold`` (``op`` ">=" or "<="); ``says`` puts it in words.

    Attributes
    ----------
    link : str
        The link of :data:`LINKS` it reads.
    op : str
        ">=" or "<=".
    threshold : float
        The value the link must reach.
    name : str
        A short name of the link ("spike", "sink", ...).
    says : str
        The criterion in words, for the text.
    """

    link: str
    op: str
    threshold: float
    name: str
    says: str

    def met(self, values: np.ndarray) -> np.ndarray:
        """(n,) bool: where ``values`` meet the criterion (NaN never does)."""
        v = np.asarray(values, dtype=float)
        with np.errstate(invalid="ignore"):
            return np.where(np.isnan(v), False, v >= self.threshold if self.op == ">=" else v <= self.threshold)

    @property
    def text(self) -> str:
        return f"{self.link} {self.op} {self.threshold:g}"


ONSETS: tuple[Criterion, ...] = (
    Criterion(
        "spike_ratio",
        ">=",
        SPIKE_ONSET_RATIO,
        "spike",
        f"the followed dims reach {SPIKE_ONSET_RATIO:g}x the first token's median entering the sink layer",
    ),
    Criterion(
        "mlp_write_share",
        ">=",
        WRITER_ONSET_SHARE,
        "MLP writer",
        f"one MLP writes at least {WRITER_ONSET_SHARE:.0%} of the main spike dim's first-token value the sink "
        "layer reads",
    ),
    Criterion(
        "writer_neurons_90",
        "<=",
        WRITER_ONSET_NEURONS,
        "few writer neurons",
        f"at most {WRITER_ONSET_NEURONS} neurons carry 90% of that MLP's write",
    ),
    Criterion(
        "norm_share",
        ">=",
        NORM_ONSET_SHARE,
        "norm share",
        f"the spike dims hold at least {NORM_ONSET_SHARE:.0%} of the first token's |x|^2 after the norm and gain",
    ),
    Criterion(
        "key_offsub_z_final_heads",
        ">=",
        KEY_ONSET_Z,
        "key off-subspace",
        f"k_1 lies at least {KEY_ONSET_Z:g}x as far off the other keys' subspace as a typical key",
    ),
    Criterion(
        "cos_q_k1_final_heads",
        ">=",
        COS_ONSET,
        "query-key alignment",
        f"queries meet k_1 at a mean cosine of at least {COS_ONSET:g}",
    ),
    Criterion(
        "value_ratio_final_heads",
        "<=",
        VALUE_ONSET_RATIO,
        "small value",
        f"|v_1| is at most {VALUE_ONSET_RATIO:g}x the mean |v_j|",
    ),
    Criterion("sink_1", ">=", SINK_ONSET_PCT, "sink", f"Sink_1 reaches {SINK_ONSET_PCT:g}%"),
    Criterion(
        "cut_kept",
        "<=",
        CUT_ONSET_KEPT,
        "writer cut",
        f"zeroing the writer neurons on the first token keeps at most {CUT_ONSET_KEPT:.0%} of Sink_1",
    ),
    Criterion(
        "zero_kept",
        "<=",
        CUT_ONSET_KEPT,
        "spike zeroed",
        f"zeroing the spike dims on the first token keeps at most {CUT_ONSET_KEPT:.0%} of Sink_1",
    ),
)


# ----------------------------------------------------------------------------- One model


@dataclass
class Followed:
    """What every snapshot of a run follows: the final model's sink layer, spike dims and sink heads.

    Attributes
    ----------
    sink_layer : int
        The final model's sinkiest layer whose input carries its spike (``analysis.chain.norm_gain.choose_layer``).
    dims : list of int
        The final model's first-token dims at least ``ratio`` x the first token's median |a| entering the sink layer
        (the largest one alone where none is).
    main_dim : int
        The one of ``dims`` with the largest ratio there: its writer is named.
    heads : list of (layer, kv_head)
        The final model's sink KV heads (alpha_1 > eps).
    ratio : float
        The spike criterion.
    found : bool
        Whether some dim met the criterion (else ``dims`` is the largest one alone).
    """

    sink_layer: int
    dims: list[int]
    main_dim: int
    heads: list[tuple[int, int]]
    ratio: float = SPIKE_RATIO_FOLLOW
    found: bool = True


def follow_final(
    model: SinkModel, tokens: torch.Tensor, *, eps: float = SINK_EPS, ratio: float = SPIKE_RATIO_FOLLOW
) -> Followed:
    """The sink layer, spike dims and sink heads of ``model`` (a run's final model) on ``tokens``.

    Parameters
    ----------
    model
        A run's final model.
    tokens : torch.Tensor, shape (N, T)
        The held-out probe.
    eps : float
        The sink threshold.
    ratio : float
        Spike dims: at least this many times the first token's median |a| entering the sink layer.

    Returns
    -------
    Followed
    """
    ma = massive_activations(
        model, tokens, hook="resid_pre", median_over="token", abs_threshold=0.0, ratio_threshold=ratio
    )
    sink = sink_metric(model, tokens, eps=eps, k_max=1)
    read_by = {l - 1: ds for l, ds in ma.first_token_dims.items() if l >= 1}  # resid_post numbering
    layer = choose_layer(sink, read_by, len(ma.layers))
    first_abs = ma.first_abs[ma.layers.index(layer)]
    ratios = first_abs / first_abs.median().clamp_min(TINY)
    dims = sorted(ma.first_token_dims.get(layer, []))
    main = max(dims, key=lambda d: float(ratios[d])) if dims else int(ratios.argmax())
    heads = sink_kv_heads(value_norms(model, tokens, sink=sink), eps)
    return Followed(int(layer), dims or [main], int(main), heads, float(ratio), bool(dims))


def _share_kept(after: float, before: float) -> float:
    return after / before if before >= CUT_MIN_SINK_PCT else float("nan")


def _writer(origin, dim: int, sink_layer: int, value: float, ratio: float) -> dict:
    """The largest write (in the spike's sign) onto ``dim`` before the sink layer reads it, and the largest MLP's
    (NaN where ``dim``'s ``ratio`` to the first token's median |a| is under ``WRITER_MIN_RATIO``)."""
    w = origin.writes
    w = w[(w.dim == dim) & (w.role != "eraser") & (w.block < sink_layer)]
    nan = float("nan")
    out = {"writer_block": nan, "writer_mlp": nan, "mlp_write_share": 0.0, "writer_neurons_90": nan}
    if ratio < WRITER_MIN_RATIO:
        return {**out, "mlp_write_share": nan}
    if not len(w):
        return out
    top = w.loc[w.write.abs().idxmax()]
    out.update(writer_block=float(top.block), writer_mlp=float(top.component == "mlp"))
    mlps = w[w.component == "mlp"]
    if len(mlps):
        m = mlps.loc[mlps.write.abs().idxmax()]
        out["mlp_write_share"] = float(m.write) / value if abs(value) > TINY else nan
        ns = [n for n in origin.neurons if n.dim == dim and n.block == int(m.block) and n.role == "writer"]
        out["writer_neurons_90"] = float(len(ns[0].neurons(NEURON_SHARES[0]))) if ns else nan
    return out


class ChainLinks(tuple, Result):
    """Every link of the chain on one model (:func:`chain_links`): the pair ``(links, writes)`` it always returned
    (``links, writes = chain_links(...)`` still unpacks it), with the result protocol.

    Attributes
    ----------
    links : dict of str to float
        link -> value (NaN where it does not apply), the keys of :data:`LINKS`.
    writes : pandas.DataFrame
        ``spike_origin``'s writes on the followed dims.
    kind, model_name, n_samples
        The input kind, the model measured and N, the number of sequences of the probe.
    tables : dict of str to pandas.DataFrame
        ``links`` (link, value, what it measures) and ``writes``.
    """

    def __new__(
        cls,
        links: dict,
        writes: pd.DataFrame,
        *,
        model_name: str | None = None,
        n_samples: int = 0,
        kind: str | None = None,
    ):
        self = super().__new__(cls, (links, writes))
        self.model_name, self.n_samples, self.kind = model_name, int(n_samples), kind
        return self

    def __getnewargs__(self):  # pickle / copy
        return tuple(self)

    @property
    def links(self) -> dict:
        return self[0]

    @property
    def writes(self) -> pd.DataFrame:
        return self[1]

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {
            "links": pd.DataFrame(
                {
                    "link": list(self.links),
                    "value": list(self.links.values()),
                    "measures": [LINKS.get(k, "") for k in self.links],
                }
            ),
            "writes": self.writes,
        }

    def findings(self) -> list[str]:
        g = {k: float(self.links.get(k, float("nan"))) for k in LINKS}
        return [
            f"Sink_1 is {g['sink_1']:.1f}%, and the followed dims reach {g['spike_ratio']:.1f}x the first token's "
            f"median |a| entering the sink layer; after the norm and its gain they hold {g['norm_share']:.2f} of "
            f"its |x|^2 (ordinary tokens: {g['norm_share_other']:.2f}).",
            f"Cutting the writer neurons keeps {g['cut_kept']:.2f} of Sink_1 (as many random neurons: "
            f"{g['cut_kept_random']:.2f}), and zeroing the followed dims keeps {g['zero_kept']:.2f}.",
        ]


@parameters_from(follow_final)
@torch.no_grad()
def chain_links(
    model: SinkModel,
    tokens: torch.Tensor,
    follow: Followed,
    *,
    eps: float = SINK_EPS,
    n_random: int = N_RANDOM_CUT,
    seed: int = 0,
) -> ChainLinks:
    """Every link of the chain (:data:`LINKS`) on one model, following ``follow`` (the final model's dims and heads).

    Parameters
    ----------
    model
        A model with TransformerLens hook names (a snapshot, ``load_reference``).
    tokens, eps
        As in :func:`follow_final`.
    follow : Followed
        The final model's sink layer, spike dims and sink heads (:func:`follow_final`).
    n_random : int
        Random-neuron draws in the writer cut.
    seed : int
        Seed of those draws.

    Returns
    -------
    ChainLinks
        The pair ``(links, writes)``: ``links`` maps link -> float (NaN where it does not apply), the keys of
        :data:`LINKS`; ``writes`` holds ``spike_origin``'s writes on the followed dims (one row per writing or erasing
        component and dim).
    """
    chain = mechanism_chain(model, tokens, eps=eps, ratio=follow.ratio, dims=follow.dims, heads=follow.heads)
    origin = spike_origin(model, tokens, dims=follow.dims, min_write=0.0)
    cuts = spike_cuts(model, tokens, origin, n_random=n_random, roles=("writers",), seed=seed, eps=eps)
    ng = norm_gain_trace(model, tokens, layer=follow.sink_layer, spike_dims=follow.dims)
    first = origin.trace.resid[:, follow.sink_layer]  # (N, D): the first token entering the sink layer
    first_abs = first.abs().mean(0)
    out = {
        k: float(chain[k])
        for k in (
            "sink_1 spike_ratio_token spike_ratio_sequence key_offsub_z cos_q_k1 cos_q_kj "
            "value_ratio_sink_heads value_ratio_other_heads sink_1_spike_zeroed".split()
        )
    }
    ratios = first_abs / first_abs.median().clamp_min(TINY)
    out["spike_ratio"] = float(ratios[follow.dims].max())
    out.update(
        _writer(
            origin,
            follow.main_dim,
            follow.sink_layer,
            float(first[:, follow.main_dim].mean()),
            float(ratios[follow.main_dim]),
        )
    )
    st = ng.stages.set_index("stage")
    out.update(norm_share=float(st.loc["gain", "first_share"]), norm_share_other=float(st.loc["gain", "other_share"]))
    out.update({f"{k}_final_heads": float(chain[f"{k}_heads"]) for k in ("key_offsub_z", "cos_q_k1", "cos_q_kj")})
    out["value_ratio_final_heads"] = float(chain["value_ratio_heads"])
    s = cuts.summary
    if not len(s):  # nothing to cut: no MLP writes the followed dims
        s = pd.DataFrame(columns=["role", "mode", "chosen", "sink_1_pct_mean"])
    pick = lambda chosen: s[(s.role == "writers") & (s["mode"] == "zero") & (s.chosen == chosen)]  # noqa: E731
    named, rnd = (pick(c) for c in ("named", "random"))
    out["sink_1_writers_cut"] = float(named.sink_1_pct_mean.iloc[0]) if len(named) else float("nan")
    out["cut_kept"] = _share_kept(out["sink_1_writers_cut"], out["sink_1"])
    out["cut_kept_random"] = (
        _share_kept(float(rnd.sink_1_pct_mean.iloc[0]), out["sink_1"]) if len(rnd) else float("nan")
    )
    out["zero_kept"] = _share_kept(out["sink_1_spike_zeroed"], out["sink_1"])
    return ChainLinks(
        {k: out[k] for k in LINKS},
        origin.writes,
        model_name=getattr(model, "model_name", None),
        n_samples=tokens.shape[0],
    )


# ----------------------------------------------------------------------------- Runs


def run_models(run_dir) -> list[tuple[int, Path, bool]]:
    """(step, folder, is the final model) of every snapshot of a run and its final model, by step; the final model
    replaces the snapshot of its own step (the same weights), and where the run has no final model yet (still
    training) its last snapshot stands in for it.

    Parameters
    ----------
    run_dir : path
        A run folder of ``analysis.train`` with ``snapshots/step-*``.

    Returns
    -------
    list of (int, pathlib.Path, bool)
    """
    run_dir = Path(run_dir)
    snaps = sorted(p for p in (run_dir / "snapshots").glob("step-*") if (p / "model.safetensors").is_file())
    found = {int(read_json(p / "config.json").get("step", int(p.name[5:]))): p for p in snaps}
    final = None
    if (run_dir / "model.safetensors").is_file():
        final = int(read_json(run_dir / "config.json").get("final", {}).get("step", max(found, default=0)))
        found[final] = run_dir
    if not found:
        raise CheckpointError(
            f"{run_dir} holds no snapshot (snapshots/step-*/model.safetensors) and no final "
            "model: train it with --snapshots (e.g. --preset induction), or give a run folder that "
            "has them."
        )
    last = final if final is not None else max(found)
    return [(s, found[s], s == last) for s in sorted(found)]


def _probe(model, probe_seed: int, n: int, T: int) -> torch.Tensor:
    """The held-out probe of a run's data (its training config with seed ``probe_seed``), (n, T)."""
    tcfg = model.reference_config["train"]
    return build_data(TrainConfig.from_dict({**tcfg, "seed": probe_seed}), reference_config(model).n_ctx).probe(n, T)


def onset_table(formation: pd.DataFrame, criteria: Sequence[Criterion] = ONSETS) -> pd.DataFrame:
    """Per run and criterion: the first step where the link meets it (``onset_step``; NaN: never) and the first
    step where it has moved at least half-way from its first finite value to its final value (``half_step``; NaN
    when it does not move), with those values.

    Parameters
    ----------
    formation : pandas.DataFrame
        The long table of :func:`formation_order` (run, attention, seed, step, final, link, value).
    criteria : sequence of Criterion
        The onset criteria (default :data:`ONSETS`).

    Returns
    -------
    pandas.DataFrame
        One row per (run, criterion): run, attention, seed, link, name, criterion, onset_step, half_step,
        first_value, final_value, final_step.
    """
    rows = []
    tags = ["run", "attention", "seed"]
    for key, df in formation.groupby(tags, sort=False):
        for c in criteria:
            s = df[df.link == c.link].sort_values("step")
            steps, v = s.step.to_numpy(), s.value.to_numpy(dtype=float)
            met = c.met(v)
            finite = np.flatnonzero(~np.isnan(v))
            final = v[-1] if len(v) else float("nan")
            half = float("nan")
            if len(finite) >= 2 and not np.isnan(final) and final != v[finite[0]]:
                start = v[finite[0]]
                progress = (v - start) / (final - start)
                with np.errstate(invalid="ignore"):
                    hit = np.flatnonzero(progress >= HALF_WAY)
                half = float(steps[hit[0]]) if len(hit) else float("nan")
            rows.append(
                {
                    **dict(zip(tags, key)),
                    "link": c.link,
                    "name": c.name,
                    "criterion": c.text,
                    "onset_step": float(steps[met][0]) if met.any() else float("nan"),
                    "half_step": half,
                    "first_value": v[finite[0]] if len(finite) else float("nan"),
                    "final_value": final,
                    "final_step": float(steps[-1]) if len(steps) else float("nan"),
                }
            )
    return pd.DataFrame(rows)


def _steps_text(steps: pd.Series) -> str:
    """'step 378 (225-635)': the median over runs and the range; 'never' when no run has one."""
    s = steps.dropna()
    if not len(s):
        return "never"
    med = f"step {s.median():,.0f}"
    return med if s.min() == s.max() else f"{med} ({s.min():,.0f}-{s.max():,.0f})"


@dataclass
class FormationOrder(Result):
    """Every link of the chain along training, per run, and when each forms.

    Attributes
    ----------
    formation : pandas.DataFrame
        The long table, one row per (run, model, link): ``run``, ``attention``, ``seed``, ``step``, ``final``
        (the run's final model, or the last snapshot standing in for it), ``link`` (:data:`LINKS`), ``value``.
    onsets : pandas.DataFrame
        One row per (run, criterion of :data:`ONSETS`): ``onset_step`` (first step meeting it), ``half_step``
        (first step half-way from the first to the final value), ``first_value``, ``final_value``, ``final_step``.
    followed : pandas.DataFrame
        One row per run: the final model's ``sink_layer``, ``dims``, ``main_dim``, ``sink_heads``; ``complete``
        (the run has its final model), ``n_models``, ``seconds`` (measuring them).
    writes : pandas.DataFrame
        ``spike_origin``'s writes on the followed dims at every step (run, step, dim, role, component, block,
        write, share).
    probe_seed : int
    n_samples, T : int
        The probe's shape.
    seconds_per_model : float
        Mean wall time of one model's links.
    model_name : str, optional
        The runs' folder names.
    kind : str, optional
        Unused (the result protocol's input kind).
    notes : list of str
        Runs without a final model, runs whose spike dims fall short of the follow criterion.
    """

    formation: pd.DataFrame
    onsets: pd.DataFrame
    followed: pd.DataFrame
    writes: pd.DataFrame
    probe_seed: int
    n_samples: int
    T: int
    seconds_per_model: float = float("nan")
    model_name: str | None = None
    kind: str | None = None
    notes: list = field(default_factory=list)

    table_fields = ("formation", "onsets", "followed", "writes")

    def wide(self) -> pd.DataFrame:
        """One row per (run, step), one column per link."""
        wide = self.formation.pivot_table(
            index=["run", "attention", "seed", "step"], columns="link", values="value", dropna=False
        )
        wide = wide[self.formation.groupby(["run", "attention", "seed", "step"]).size().reindex(wide.index).notna()]
        return wide[[k for k in LINKS if k in wide.columns]].reset_index()

    def _value_at(self, run: str, step: float, link: str) -> float:
        f = self.formation
        r = f[(f.run == run) & (f.step == step) & (f.link == link)]
        return float(r.value.iloc[0]) if len(r) else float("nan")

    def attention_text(self, attention: str) -> str:
        """The order of the links in the runs of one attention operation, as sentences."""
        on = self.onsets[self.onsets.attention == attention]
        runs = list(dict.fromkeys(on.run))
        seeds = ", ".join(str(s) for s in dict.fromkeys(on.seed))
        n = len(runs)
        by = on.groupby("name", sort=False)
        reached = by.onset_step.apply(lambda s: s.notna().all())
        order = by.onset_step.median()[reached].sort_values(kind="stable")
        crit = {c.name: c for c in ONSETS}
        runs_text = f"{n} {attention} run{'s' if n > 1 else ''} (seed{'s' if n > 1 else ''} {seeds})"
        out = []
        if len(order):
            parts = [f"{crit[k].says} at {_steps_text(on[on.name == k].onset_step)}" for k in order.index]
            out.append(
                f"Over {runs_text}, the links form in this order (the first snapshot meeting each criterion; "
                f"median over runs, range in parentheses): {'; '.join(parts)}."
            )
        never = [k for k in by.groups if not reached[k]]
        if never and n == 1:
            out.append(f"Not reached in that run: {'; '.join(crit[k].says for k in never)}.")
        elif never:
            parts = [
                f"{crit[k].says} (reached in {int(on[on.name == k].onset_step.notna().sum())} of {n})" for k in never
            ]
            out.append(f"Not reached in every one of the {runs_text}: {'; '.join(parts)}.")
        half = by.half_step.median().dropna().sort_values(kind="stable")
        if len(half):
            parts = [f"{crit[k].name} at {_steps_text(on[on.name == k].half_step)}" for k in half.index]
            out.append(
                f"Half-way from its first value to its final one, each link comes in this order: {'; '.join(parts)}."
            )
        out += self._questions(on, runs, attention)
        return " ".join(out)

    def _questions(self, on: pd.DataFrame, runs: list, attention: str) -> list[str]:
        """Does the spike come before the sink? Does the MLP writer exist before the spike is large?"""
        col = lambda name, c="onset_step": on[on.name == name].set_index("run")[c]  # noqa: E731
        spike, sink, writer, few = col("spike"), col("sink"), col("MLP writer"), col("few writer neurons")
        out = []
        both = [r for r in runs if not (np.isnan(spike[r]) or np.isnan(sink[r]))]
        if both:
            before = sum(spike[r] < sink[r] for r in both)
            same = sum(spike[r] == sink[r] for r in both)
            hs, hk = col("spike", "half_step"), col("sink", "half_step")
            defined = [r for r in runs if not (np.isnan(hs[r]) or np.isnan(hk[r]))]
            out.append(
                f"The spike reaches {SPIKE_ONSET_RATIO:g}x before Sink_1 reaches {SINK_ONSET_PCT:g}% in "
                f"{before} of {len(both)} {attention} runs where both form ({same} at the same snapshot); "
                f"half-way to their final values, the spike comes first in "
                f"{sum(hs[r] < hk[r] for r in defined)} of {len(defined)}."
            )
        elif len(runs):
            out.append(
                f"In no {attention} run do both the spike ({SPIKE_ONSET_RATIO:g}x) and the sink "
                f"(Sink_1 {SINK_ONSET_PCT:g}%) form, so their order is not defined."
            )
        for name, onset, says in (
            ("MLP writer", writer, f"an MLP writes at least {WRITER_ONSET_SHARE:.0%} of the main spike dim"),
            ("few writer neurons", few, f"at most {WRITER_ONSET_NEURONS} of its neurons carry 90% of that write"),
        ):
            has = [r for r in runs if not np.isnan(onset[r])]
            if not has:
                continue
            ratios = [self._value_at(r, onset[r], "spike_ratio") for r in has]
            early = sum(not np.isnan(spike[r]) and onset[r] < spike[r] for r in has)
            no_spike = sum(bool(np.isnan(spike[r])) for r in has)
            spread = f" (range {min(ratios):.1f}-{max(ratios):.1f}x)" if len(ratios) > 1 else ""
            tail = f"; the spike never reaches it in {no_spike}" if no_spike else ""
            out.append(
                f"{says[0].upper() + says[1:]} from {_steps_text(pd.Series([onset[r] for r in has]))}, while "
                f"the followed dims are {np.median(ratios):.1f}x the first token's median{spread}: earlier than "
                f"the spike reaches {SPIKE_ONSET_RATIO:g}x in {early} of {len(has)} {attention} runs where it "
                f"happens{tail}."
            )
        return out

    def findings(self) -> list[str]:
        """The order of the links per attention operation, what each snapshot follows, and the notes."""
        if not len(self.onsets):
            return ["No run was measured."]
        parts = [self.attention_text(a) for a in dict.fromkeys(self.onsets.attention)]
        f = self.followed
        parts.append(
            "Each snapshot follows its final model's spike dims, sink layer and sink heads ("
            + "; ".join(
                f"{r.run}: dims {r.dims} entering layer {r.sink_layer}, {len(r.sink_heads)} sink KV heads"
                for r in f.itertuples()
            )
            + ")."
        )
        return [p for p in parts if p] + self.notes

    def _criteria(self) -> list[dict]:
        return [asdict(c) for c in ONSETS]

    _links = LINKS  # what each link measures, written with the tables
    json_fields = ("probe_seed", "T", "seconds_per_model", "links=_links", "criteria=_criteria", "*tables", "notes")


def formation_order(
    run_dirs: Sequence,
    *,
    probe_seed: int = 2024,
    n_probe: int = 100,
    probe_len: int = 64,
    eps: float = SINK_EPS,
    ratio: float = SPIKE_RATIO_FOLLOW,
    n_random: int = N_RANDOM_CUT,
    device: str | None = "cpu",
    progress: Callable[[str], None] | None = None,
) -> FormationOrder:
    """The chain's links along training in each run, and the order in which they form.

    Parameters
    ----------
    run_dirs : sequence of path
        Run folders of ``analysis.train`` with snapshots (``RUN/snapshots/step-*``) and, once done, a final model.
    probe_seed : int
        Seed of the held-out probe built from each run's data config (``build_data(...).probe``).
    n_probe, probe_len : int
        The probe's shape (N, T).
    eps : float
        The sink threshold.
    ratio : float
        The final model's spike dims: at least this many times the first token's median |a| entering its sink layer.
    n_random : int
        Random-neuron draws in each writer cut.
    device : str, optional
        Where the models run (None: CUDA when available).
    progress : callable, optional
        Called with one line per model measured (e.g. ``print``).

    Returns
    -------
    FormationOrder
    """
    if not len(run_dirs):
        raise ValueError("give at least one run folder (with snapshots/step-*).")
    rows, writes, followed, notes, times = [], [], [], [], []
    N = T = 0
    with one_thread():
        for run_dir in run_dirs:
            models = run_models(run_dir)
            t_run = time.perf_counter()
            final_step, final_path, _ = next(m for m in models if m[2])
            final = load_reference(final_path, device=device)
            tokens = _probe(final, probe_seed, n_probe, probe_len)
            N, T = tokens.shape
            follow = follow_final(final, tokens, eps=eps, ratio=ratio)
            run, att = Path(run_dir).name, attention_operation(final)
            seed = int(final.reference_config["train"]["seed"])
            complete = (Path(run_dir) / "model.safetensors").is_file()
            notes += _run_notes(run, final_step, follow, complete=complete, ratio=ratio)
            tag = {"run": run, "attention": att, "seed": seed}
            got = _links_along_training(
                models, final, tokens, follow, tag, eps=eps, n_random=n_random, device=device, progress=progress
            )
            rows, writes, times = rows + got[0], writes + got[1], times + got[2]
            followed.append(
                {
                    **tag,
                    "final_step": final_step,
                    "complete": complete,
                    "sink_layer": follow.sink_layer,
                    "dims": follow.dims,
                    "main_dim": follow.main_dim,
                    "dims_found": follow.found,
                    "sink_heads": follow.heads,
                    "n_models": len(models),
                    "seconds": time.perf_counter() - t_run,
                }
            )
    formation = pd.DataFrame(rows)
    cols = ["run", "attention", "seed", "step", "dim", "role", "component", "block", "write", "share"]
    writes = pd.concat(writes, ignore_index=True)[cols] if writes else pd.DataFrame(columns=cols)
    return FormationOrder(
        formation,
        onset_table(formation),
        pd.DataFrame(followed),
        writes,
        int(probe_seed),
        int(N),
        int(T),
        float(np.mean(times)),
        model_name=", ".join(Path(r).name for r in run_dirs),
        notes=notes,
    )


def _run_notes(run: str, final_step: int, follow, *, complete: bool, ratio: float) -> list[str]:
    """What a reader of one run's links must know: a snapshot stands in for the final model, or no dim reaches the
    spike ratio (the largest is followed)."""
    notes = []
    if not complete:
        notes.append(f"Run {run} has no final model yet: its last snapshot (step {final_step:,}) stands in.")
    if not follow.found:
        notes.append(
            f"In run {run} no first-token dim reaches {ratio:g}x the median entering layer "
            f"{follow.sink_layer}: its largest, dim {follow.main_dim}, is followed."
        )
    return notes


def _links_along_training(
    models: list,
    final,
    tokens: torch.Tensor,
    follow,
    tag: dict,
    *,
    eps: float,
    n_random: int,
    device: str | None,
    progress: Callable[[str], None] | None,
) -> tuple[list, list, list]:
    """The chain's links (:func:`chain_links`) of every model of one run (``run_models``: its snapshots, then its
    final model, ``final`` already loaded): the rows of the formation table (each starting with ``tag``: the run,
    its attention and seed), the writes tables and the seconds per model."""
    rows, writes, times = [], [], []
    for step, path, is_final in models:
        t0 = time.perf_counter()
        model = final if is_final else load_reference(path, device=device)
        links, w = chain_links(model, tokens, follow, eps=eps, n_random=n_random)
        rows += [{**tag, "step": step, "final": is_final, "link": k, "value": v} for k, v in links.items()]
        writes.append(w.assign(**tag, step=step))
        times.append(time.perf_counter() - t0)
        if progress:
            progress(
                f"{tag['run']} step {step}: Sink_1 {links['sink_1']:.1f}%, spike {links['spike_ratio']:.1f}x "
                f"({times[-1]:.2f} s)"
            )
    return rows, writes, times


TABLE_FILES = {"formation": "formation.csv", "onsets": "onsets.csv", "followed": "followed.csv", "writes": "writes.csv"}


def save_formation(res: FormationOrder, out) -> None:
    """Write ``res`` into the folder ``out``: one CSV per table (:data:`TABLE_FILES`) and ``meta.json`` (the probe,
    the timing, the notes), which :func:`load_formation` reads back.

    Parameters
    ----------
    res : FormationOrder
    out : path
        The folder (created if missing).

    Returns
    -------
    None
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, file in TABLE_FILES.items():
        res.tables[name].to_csv(out / file, index=False)
    write_json(
        out / "meta.json",
        {k: getattr(res, k) for k in "probe_seed n_samples T seconds_per_model model_name notes".split()},
        indent=2,
    )


def load_formation(folder) -> FormationOrder:
    """A :class:`FormationOrder` written by :func:`save_formation` (``scripts/formation_order.py``), e.g. the committed
    ``data/emergence/induction/formation``: its tables, text and figure without the runs' snapshots.

    Parameters
    ----------
    folder : path
        The folder holding the CSVs of :data:`TABLE_FILES` and ``meta.json``, or one under ``data/emergence`` by
        its relative name (e.g. ``"induction/formation"``).

    Returns
    -------
    FormationOrder
    """
    folder = Path(folder)
    if not folder.is_dir() and (EMERGENCE_DIR / folder).is_dir():
        folder = EMERGENCE_DIR / folder
    missing = [f for f in (*TABLE_FILES.values(), "meta.json") if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder} lacks {missing}: write it with scripts/formation_order.py RUNS --out {folder}."
        )
    tables = {name: pd.read_csv(folder / file) for name, file in TABLE_FILES.items()}
    for col in ("dims", "sink_heads"):  # lists, written as their Python text
        tables["followed"][col] = tables["followed"][col].map(ast.literal_eval)
    meta = read_json(folder / "meta.json")
    return FormationOrder(
        **tables,  # formation, onsets, followed, writes: TABLE_FILES' keys are the fields
        probe_seed=int(meta["probe_seed"]),
        n_samples=int(meta["n_samples"]),
        T=int(meta["T"]),
        seconds_per_model=float(meta["seconds_per_model"]),
        model_name=meta.get("model_name"),
        notes=meta["notes"],
    )
