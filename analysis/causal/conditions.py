"""The condition runner of the causal tests: one streamed pass under intervention hooks, and the shared baseline.

``run_condition(model, tokens, hooks=hooks)`` runs one pass with intervention hooks (functions returning the changed
activation) and folds the attention into per-(sample, layer, head) alpha, the attention shares of later queries on
the first key, the previous key, themselves and the rest (``where_shares``), and the next-token loss: a
:class:`PassResult`. The unchanged model's pass, the :class:`Baseline`, also records what the ablations of
``analysis.causal.interventions`` need (the first token's residual stream, the value statistics of every head): it is
computed once and shared (``baseline_pass``, or ``analysis.profile``), and a condition pass resumes at the last block
before its hooks whose input the baseline kept (``Baseline.resid``).

Every family: the attention is read on the attention layers only (``check_attention_layers``: a hybrid's
linear-attention / Mamba layers are skipped, results keep the true layer index and say which were skipped).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.model.hooks import act_name, check_tokens, hook_layer, kv_view, model_facts, per_query_head
from analysis.engine.attention import attention_of
from analysis.engine.passes import Accumulator, Batch, LayerCollector, Resume, can_resume, resume_from, run_pass
from analysis.engine.passes import Reduction
from analysis.engine.remote import remote_pass
from analysis.model.nnsight_model import NnsightModel, NnsightUnsupported
from analysis.core.results import LayerAxis, compact_repr
from analysis.core.defaults import SINK_EPS
from analysis.core.docs import fill_parameters, model_tokens, parameters_from
from analysis.sinks.metric import SinkResult, alpha_from_pattern, check_eps

WHERE_KEYS = ("first", "previous", "self", "other")
from analysis.core.defaults import INTERVENTION_K_MAX as K_MAX  # alpha kept for keys 1..4 in every intervention pass

LOSS_ROWS = 1  # sequences per chunk of the streamed next-token loss (the log-softmax is never built for a whole batch)

# ----------------------------------------------------------------------------- One streamed pass under interventions


@dataclass
class PassResult(LayerAxis):
    """What one pass over the tokens leaves: alpha per (sample, layer, head, key), attention shares, loss.

    The layer axis L runs over ``layers``, the true indices of the attention layers (all layers but a hybrid's
    linear-attention / Mamba layers, which ``skipped`` names).

    Attributes
    ----------
    alpha : torch.Tensor, shape (N, L, H, K)
        alpha_k for keys 1..K = k_max.
    where : torch.Tensor, shape (L, H, 4)
        The mean attention share of queries t >= 3 on the first, previous, own and other keys.
    loss : float
        The mean next-token loss over every position.
    eps : float
        The sink threshold.
    T : int
        The sequence length.
    layers : list of int, length L
        The true layer index of each position on the layer axis.
    skipped : str
        The layers left out (not attention layers), in one sentence; "" when none.
    loss_first : torch.Tensor or None, shape (N,)
        Each sequence's loss on the first token's own prediction (the second token), from the same logits; None
        where T = 1 or the pass did not keep it.
    """

    alpha: torch.Tensor  # (N, L, H, K)
    where: torch.Tensor  # (L, H, 4) mean attention share of queries t >= 3 on first/previous/self/other keys
    loss: float
    eps: float
    T: int
    layers: list[int] | None = None  # true layer index of each position on the L axis (None: 0..L-1)
    skipped: str = ""
    loss_first: torch.Tensor | None = None  # (N,) the first token's own next-token loss

    __repr__ = compact_repr  # shapes, never tensor values

    def __post_init__(self):
        self.layers = list(range(self.alpha.shape[1])) if self.layers is None else [int(l) for l in self.layers]

    def sink(self, model_name=None, kind=None) -> SinkResult:
        return SinkResult(self.alpha, self.eps, self.T, model_name, kind, layers=self.layers, skipped=self.skipped)

    def sink_rate(self, k: int = 1) -> float:
        return float((self.alpha[..., k - 1] > self.eps).float().mean() * 100)

    def sink_per_layer(self, k: int = 1) -> torch.Tensor:
        return (self.alpha[..., k - 1] > self.eps).float().mean(dim=(0, 2)) * 100


def _loss_stats(logits: torch.Tensor, tokens: torch.Tensor, *, groups=(slice(None),), rows: int = LOSS_ROWS) -> dict:
    """Each group's summed next-token cross-entropy ("sum", float64 (G,)), ``rows`` sequences at a time (peak memory:
    one chunk's log-softmax, not the batch's), and with T > 1 each sequence's loss on the first token's own prediction
    ("first", (B,)): torch only, so a remote trace runs it on the logits."""
    F, tokens, sums = torch.nn.functional, tokens.to(logits.device), []
    for g in groups:
        lg, tk, total = logits[g, :-1], tokens[g, 1:], torch.zeros((), dtype=torch.float64, device=logits.device)
        for i in range(0, lg.shape[0], rows):
            ce = F.cross_entropy(lg[i : i + rows].float().flatten(0, 1), tk[i : i + rows].flatten(), reduction="sum")
            total = total + ce.double()
        sums.append(total)
    first = F.cross_entropy(logits[:, 0].float(), tokens[:, 1], reduction="none") if tokens.shape[1] > 1 else None
    return {"sum": torch.stack(sums), **({} if first is None else {"first": first})}


def _pass_stats(acts: dict, *, k_max: int, T: int) -> dict:
    """:class:`PassAccumulator`'s reduce of {"pattern"}: "alpha" (B, H, k_max) and with T >= 3 "where" (B, H, 4)."""
    p = acts["pattern"]
    return {"alpha": alpha_from_pattern(p, k_max), **({"where": where_shares(p)} if T >= 3 else {})}


def where_shares(pattern: torch.Tensor) -> torch.Tensor:
    """Attention shares of queries t >= 3 (1-based) on the first key, the previous key, itself and the rest.

    The four categories are disjoint and sum to 1 for every query.

    Parameters
    ----------
    pattern : torch.Tensor, shape (B, H, T, T), or AttentionWeights
        Attention probabilities (``hook_pattern`` as either backend hands it).

    Returns
    -------
    torch.Tensor, shape (B, H, 4)
        Summed over those queries (divide by T - 2 for the mean).
    """
    A = attention_of(pattern)  # queries t = 2..T-1 (0-based) below
    first, prev, self_ = A.column(0)[..., 2:], A.diagonal(1)[..., 1:], A.diagonal(0)[..., 2:]
    other = A.row_sums()[..., 2:] - first - prev - self_
    return torch.stack([first, prev, self_, other], -1).sum(-2)


def condition_rows(offset: int, size: int, rows: int) -> list[tuple[int, slice]]:
    """For conditions of ``rows`` sequences each, stacked one after another in a pass (``run_condition``'s
    ``groups``): (condition, its rows within the batch of ``size`` sequences starting at ``offset``), for each
    condition the batch holds.

    Parameters
    ----------
    offset, size : int
        The batch's first sequence in the pass, and its number of sequences.
    rows : int
        Sequences per condition.

    Returns
    -------
    list of (int, slice)
    """
    return [
        (g, slice(max(g * rows - offset, 0), min((g + 1) * rows - offset, size)))
        for g in range(offset // rows, (offset + size - 1) // rows + 1)
    ]


class PassAccumulator(Accumulator):
    """alpha for keys 1..k_max per sample, the attention shares of :func:`where_shares` and the next-token loss, on the
    attention layers from ``start`` on (a pass resumed at block ``start``).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    T : int
        The sequence length.
    eps : float
        The sink threshold.
    k_max : int
        Keys whose alpha is kept.
    start : int
        The block the pass starts at.
    group_rows : int, optional
        The pass's rows are conditions of this many sequences each, one after another (``run_condition``'s
        ``groups``): the attention shares and the loss are kept per condition, and ``result`` gives one PassResult
        per condition.
    """

    needs_logits = True

    def __init__(
        self, model, T: int, *, eps: float = SINK_EPS, k_max: int = K_MAX, start: int = 0, group_rows: int | None = None
    ):
        facts = model_facts(model)
        self.T, self.eps, self.k_max = int(T), check_eps(eps), min(int(k_max), int(T))
        self.layers, self.skipped = [l for l in facts.attention_layers if l >= start], facts.skipped
        self.pos = {l: i for i, l in enumerate(self.layers)}
        self.alpha = LayerCollector(self.layers)
        self.group_rows = None if group_rows is None else int(group_rows)
        self.where: list[torch.Tensor] = []  # per condition, (L, H, 4)
        self.loss_sum: list[float] = []  # per condition: the summed loss, its predictions and sequences
        self.n_pred: list[int] = []
        self.n: list[int] = []
        self.H = facts.dims.n_heads
        self.first: list[torch.Tensor] = []  # per batch, (B,) the first position's loss

    def hooks(self):
        return {l: {"pattern": act_name("pattern", l)} for l in self.layers}

    def _groups(self, batch: Batch) -> list[tuple[int, slice]]:
        """(condition, its rows in this batch) for each condition the batch holds; one, the whole batch, ungrouped."""
        if self.group_rows is None:
            return [(0, slice(None))]
        return condition_rows(batch.offset, batch.size, self.group_rows)

    def _condition(self, g: int) -> None:
        while len(self.where) <= g:
            self.where.append(torch.zeros(len(self.layers), self.H, 4, dtype=torch.float64))
            self.loss_sum.append(0.0)
            self.n_pred.append(0)
            self.n.append(0)

    def reduction(self, layer: int) -> Reduction:
        return Reduction(_pass_stats, {"k_max": self.k_max, "T": self.T})

    def fold(self, layer: int, s: dict, batch: Batch) -> None:
        self.alpha.put(layer, s["alpha"])
        if "where" in s:
            shares = s["where"].double()
            for g, rows in self._groups(batch):
                self._condition(g)
                self.where[g][self.pos[layer]] += shares[rows].sum(0).cpu()

    def fold_loss(self, s: dict, batch: Batch) -> None:
        """Fold what :func:`_loss_stats` gave for a batch (here, or in a remote trace)."""
        for (g, rows), total in zip(self._groups(batch), s["sum"].tolist()):
            self._condition(g)
            tokens = batch.tokens[rows]
            self.loss_sum[g] += total
            self.n_pred[g] += tokens.shape[0] * (tokens.shape[1] - 1)
            self.n[g] += tokens.shape[0]
        if "first" in s:
            self.first.append(s["first"].cpu())

    def end_batch(self, batch: Batch, logits) -> None:
        self.alpha.end_batch()
        if logits is not None:  # a remote pass folds the loss_stats its trace ran (fold_loss)
            self.fold_loss(_loss_stats(logits, batch.tokens, groups=[r for _, r in self._groups(batch)]), batch)

    def result(self) -> PassResult | list[PassResult]:
        alpha, first = self.alpha.result(), torch.cat(self.first) if self.first else None
        out = []
        for g in range(len(self.n)):
            rows = slice(None) if self.group_rows is None else slice(g * self.group_rows, (g + 1) * self.group_rows)
            loss = self.loss_sum[g] / max(self.n_pred[g], 1) if self.T > 1 else float("nan")
            out.append(
                PassResult(
                    alpha[rows],
                    (self.where[g] / (self.n[g] * max(self.T - 2, 1))).float(),
                    loss,
                    self.eps,
                    self.T,
                    self.layers,
                    self.skipped,
                    None if first is None else first[rows],
                )
            )
        return out if self.group_rows is not None else out[0]


def run_condition(
    model: SinkModel,
    tokens,
    *,
    hooks=(),
    eps: float = SINK_EPS,
    k_max: int = K_MAX,
    batch_size: int | None = None,
    on_batch_start=None,
    baseline: Baseline | None = None,
    groups: int = 1,
    edits=None,
    accumulators=(),
) -> PassResult | list[PassResult]:
    """One pass with intervention hooks plus the attention reducers: alpha, attention shares and loss.

    Parameters
    ----------
    model, tokens, eps, batch_size
        As in :func:`baseline_pass`.
    hooks : sequence of (str, callable)
        Intervention hooks (functions returning the changed activation).
    k_max : int
        Keys whose alpha is kept.
    on_batch_start : callable, optional
        ``on_batch_start(batch)`` runs before each batch (hooks that need sample indices read ``batch.offset``).
    baseline : Baseline, optional
        The unchanged model's pass over these tokens (same batches). Where it holds the residual stream entering a
        block at or before the first one the hooks touch (``Baseline.resid``), the pass resumes at the last such block:
        the blocks before it are not run, and their alpha and attention shares, which no hook changes, are the
        baseline's.
    groups : int
        ``tokens`` holds this many conditions of the same sequences, one after another (the sequences repeated; the
        hooks tell the conditions apart by row, with ``on_batch_start``), run in one pass as one longer input:
        fewer, fuller batches than a pass each. The baseline is that of one condition's sequences.
    edits : callable, optional
        ``edits(batch)``: the hooks' interventions as trace edits ({layer: {site: Reduction}},
        ``analysis.engine.remote.trace_batch``), for a model loaded for NDIF (``NnsightModel``), whose pass runs them
        from the embedding in its traces instead of the hooks.
    accumulators : sequence of Accumulator
        More accumulators run in the same pass (each keeps its own result).

    Returns
    -------
    PassResult, or a list of one per condition with ``groups`` > 1
    """
    tokens = check_tokens(model, tokens)
    G = int(groups)
    if G < 1 or tokens.shape[0] % G:
        raise ValueError(f"groups must divide the {tokens.shape[0]} sequences into equal conditions; got {groups}.")
    rows = tokens.shape[0] // G
    if isinstance(model, NnsightModel):  # its traces make the edits, each from the embedding (no resume)
        if hooks and edits is None:
            raise NnsightUnsupported("these interventions have no trace edits (edits=) for a remote model.")
        acc = PassAccumulator(model, tokens.shape[1], eps=eps, k_max=k_max, group_rows=rows if G > 1 else None)
        return _remote_run(model, tokens, [acc, *accumulators], edits=edits, batch_size=batch_size)[0]
    resume = _resume(model, hooks, baseline, eps, min(int(k_max), tokens.shape[1]))
    if resume is not None and G > 1:  # one condition's residual, read once per condition (never tiled in memory)
        resume = Resume(resume.layer, resume.resid[:rows], repeat=G)
    acc = PassAccumulator(
        model,
        tokens.shape[1],
        eps=eps,
        k_max=k_max,
        start=resume.layer if resume else 0,
        group_rows=rows if G > 1 else None,
    )
    run = run_pass(
        model,
        tokens,
        [acc, *accumulators],
        fwd_hooks=hooks,
        batch_size=batch_size,
        on_batch_start=on_batch_start,
        resume=resume,
    )[0]
    if G == 1:
        return _with_prefix(run, baseline.run) if resume else run
    return [_with_prefix(r, baseline.run) if resume else r for r in run]


def _remote_run(model: NnsightModel, tokens: torch.Tensor, accumulators: list, *, edits=None, batch_size=None) -> list:
    """:func:`run_pass` with ``edits`` (as :func:`run_condition`'s) for a model loaded for NDIF
    (``analysis.engine.remote.remote_pass``), each trace making every edit from the embedding; the loss, for the
    accumulator that ``needs_logits``, a reduction in each batch's last trace."""
    acc = next((a for a in accumulators if a.needs_logits), None)

    def logits(batch: Batch):
        groups = [r for _, r in acc._groups(batch)]
        return Reduction(_loss_stats, {"groups": groups}), lambda s: acc.fold_loss(s, batch)

    loss = logits if acc is not None else None
    remote_pass(model, tokens, accumulators, make_batch=Batch, batch_size=batch_size, edits=edits, logits=loss)
    return [a.result() for a in accumulators]


def _resume(model, hooks, baseline: Baseline | None, eps: float, k_max: int) -> Resume | None:
    """Where a condition pass can resume: the last block the baseline kept the input of (``Baseline.resid``) at or
    before the first block its hooks touch, if the baseline has alpha for the same keys and eps; None: run the
    whole model."""
    layers = [hook_layer(name) for name, _ in hooks]
    if not hooks or baseline is None or any(l is None or l < 0 for l in layers):
        return None
    # a block's output (hook_resid_post) is the next block's input: the block itself runs unchanged
    first = min(l + name.endswith(".hook_resid_post") for l, (name, _) in zip(layers, hooks))
    same = baseline.run.eps == eps and baseline.run.alpha.shape[-1] == k_max
    return resume_from(baseline.resid, first) if same and can_resume(model) else None


def _with_prefix(run: PassResult, base: PassResult) -> PassResult:
    """A resumed pass completed with the baseline's alpha and attention shares on the layers before it."""
    early = [i for i, l in enumerate(base.layers) if l < run.layers[0]] if run.layers else list(range(len(base.layers)))
    alpha, where = torch.cat([base.alpha[:, early], run.alpha], 1), torch.cat([base.where[early], run.where])
    return replace(run, alpha=alpha, where=where, layers=base.layers, skipped=base.skipped)


# ---------------------------------- The shared baseline: the unchanged model, with what each intervention needs from it


def _first_position(acts: dict) -> torch.Tensor:
    """:class:`FirstTokenResidAccumulator`'s reduce of {"resid"}: the first token's residual stream, (B, D) float32."""
    return acts["resid"][:, 0].float()


def _value_head_stats(acts: dict, *, H: int, K: int) -> dict:
    """:class:`ValueStatsAccumulator`'s reduce of {"pattern", "v", "z"}: per query head, summed over the batch, alpha_1
    ("a1"), |v_1| ("v1") and over t > 1 the means of |v_t| ("vj"), |A[t, 1] v_1| ("contrib") and |z_t| ("z"); each
    sample's v_1 per query head ("first_v", (B, H, d)). H and K: query and KV heads."""
    a1 = attention_of(acts["pattern"]).column(0)  # (B, H, T)
    v = kv_view(acts["v"], K).float()  # (B, T, H_kv, d)
    norms = per_query_head(v.norm(dim=-1), H)  # (B, T, H): |v| per KV head, repeated
    contrib = a1.permute(0, 2, 1) * norms[:, :1]  # (B, T, H): |A_t1 v_1| = A_t1 |v_1|
    later = (lambda x: x[:, 1:].mean(1).sum(0).cpu()) if v.shape[1] > 1 else (lambda x: torch.zeros(H))  # noqa: E731
    return {
        "a1": a1.mean(-1).sum(0).cpu(),
        "v1": norms[:, 0].sum(0).cpu(),
        "vj": later(norms),
        "contrib": later(contrib),
        "z": later(acts["z"].float().norm(dim=-1)),
        "first_v": per_query_head(v[:, 0], H, dim=1),
    }


class FirstTokenResidAccumulator(Accumulator):
    """The first token's residual stream after every block (``hook_resid_post``), (N, L, D): the means the spike
    ablation sets the spike dims to.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    """

    def __init__(self, model):
        self.layers = list(range(model_facts(model).dims.n_layers))
        self.first = LayerCollector(self.layers)

    def hooks(self):
        return {l: {"resid": act_name("resid_post", l)} for l in self.layers}

    def reduction(self, layer: int) -> Reduction:
        return Reduction(_first_position)

    def fold(self, layer: int, first: torch.Tensor, batch: Batch) -> None:
        self.first.put(layer, first)

    def end_batch(self, batch: Batch, logits) -> None:
        self.first.end_batch()

    def result(self) -> torch.Tensor:
        return self.first.result()


class ValueStatsAccumulator(Accumulator):
    """Per layer and query head: alpha_1, |v_1|, mean |v_j|, |A[t, 1] v_1| and |z_t| (means over t > 1), and each
    sample's v_1 (N, H, d) for the leave-one-out mean.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    """

    def __init__(self, model):
        facts = model_facts(model)
        dims = facts.dims
        self.H, self.K, self.layers = dims.n_heads, dims.n_kv_heads, list(facts.attention_layers)
        self.sums = {l: dict.fromkeys(("a1", "v1", "vj", "contrib", "z"), 0) for l in self.layers}
        self.v1 = LayerCollector(self.layers)
        self.n = 0

    def hooks(self):
        return {l: {n: act_name(n, l) for n in ("pattern", "v", "z")} for l in self.layers}

    def reduction(self, layer: int) -> Reduction:
        return Reduction(_value_head_stats, {"H": self.H, "K": self.K})

    def fold(self, layer: int, stats: dict, batch: Batch) -> None:
        s = self.sums[layer]
        for key in s:  # a1, v1, vj, contrib, z
            s[key] = s[key] + stats[key]
        self.v1.put(layer, stats["first_v"])
        if layer == self.layers[0]:
            self.n += stats["first_v"].shape[0]

    def end_batch(self, batch: Batch, logits) -> None:
        self.v1.end_batch()

    def result(self) -> dict:
        """{"heads": one row per (attention layer, query head), "v1": (N, L, H, d) on the attention layers."""
        names = {"alpha_1": "a1", "v1_norm": "v1", "v_other_norm": "vj", "first_contrib_norm": "contrib"}
        names["output_norm"] = "z"
        rows = [
            {"layer": l, "head": h, **{n: float(self.sums[l][key][h] / self.n) for n, key in names.items()}}
            for l in self.layers
            for h in range(self.H)
        ]
        return {"heads": pd.DataFrame(rows), "v1": self.v1.result()}


@dataclass
class Baseline:
    """The unchanged model's pass, shared by the interventions.

    Attributes
    ----------
    run : PassResult
        Its alpha, attention shares and loss.
    first_resid : torch.Tensor, shape (N, L, D)
        The first token's ``hook_resid_post`` after every block.
    value_heads : pandas.DataFrame
        One row per (attention layer, query head): alpha_1, |v_1|, |v_j|, |A v_1|, |z|.
    v1 : torch.Tensor, shape (N, L_attn, H, d)
        The first token's value per query head (on the attention layers, ``run.layers``).
    resid : dict of int to torch.Tensor
        Block -> the residual entering it, (N, T, D) (``passes.ResidCapture``): condition passes resume at the last kept
        block before their hooks (``run_condition``); optional, ``analysis.profile`` fills it.
    """

    run: PassResult
    first_resid: torch.Tensor  # (N, L, D) the first token's hook_resid_post
    value_heads: pd.DataFrame  # one row per (layer, query head): alpha_1, |v_1|, |v_j|, |A v_1|, |z|
    v1: torch.Tensor  # (N, L, H, d) the first token's value, per query head (L: the attention layers, run.layers)
    resid: dict = field(default_factory=dict)  # block -> (N, T, D) residual entering it: the resume points

    __repr__ = compact_repr  # shapes, never tensor values


@parameters_from(PassAccumulator)
def baseline_accumulators(model: SinkModel, T: int, *, eps: float = SINK_EPS) -> list[Accumulator]:
    """What the baseline pass runs (:func:`baseline_from` turns their results into a :class:`Baseline`).

    Parameters
    ----------
    model, T
        As in :func:`PassAccumulator`.
    eps
        As in :func:`baseline_pass`.

    Returns
    -------
    list of Accumulator
    """
    return [
        PassAccumulator(model, T, eps=eps, k_max=K_MAX),
        FirstTokenResidAccumulator(model),
        ValueStatsAccumulator(model),
    ]


def baseline_from(results: list, *, resid: dict | None = None) -> Baseline:
    """The :class:`Baseline` of the results of :func:`baseline_accumulators`.

    Parameters
    ----------
    results : list
        Their results, in order.
    resid : dict of int to torch.Tensor, optional
        Residuals kept by the same pass, {block: (N, T, D)}.

    Returns
    -------
    Baseline
    """
    run, first, values = results
    return Baseline(run, first, values["heads"], values["v1"], dict(resid or {}))


@parameters_from(model_tokens)
def baseline_pass(model: SinkModel, tokens, *, eps: float = SINK_EPS, batch_size: int | None = None) -> Baseline:
    """One pass of the unchanged model with everything the three interventions need.

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens`.
    eps : float
        The sink threshold.
    batch_size : int, optional
        Sequences per batch (default: ``analysis.engine.passes.default_batch_size``).

    Returns
    -------
    Baseline
    """
    tokens = check_tokens(model, tokens)
    accs = baseline_accumulators(model, tokens.shape[1], eps=eps)
    run = _remote_run if isinstance(model, NnsightModel) else run_pass  # remote: the loss a reduction in the trace
    return baseline_from(run(model, tokens, accs, batch_size=batch_size))


# Parameters written once, in baseline_pass: the factory's eps, and run_condition's model, tokens, eps, batch_size.
fill_parameters(baseline_accumulators, baseline_pass)
fill_parameters(run_condition, baseline_pass)


@parameters_from(model_tokens)
def baseline_for(model: SinkModel, tokens, baseline: Baseline | None, eps: float, batch_size) -> Baseline:
    """A given baseline checked against these tokens and eps or, when None, the :func:`baseline_pass` of the tokens.

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens`.
    baseline : Baseline or None
    eps : float
        The sink threshold.
    batch_size : int or None
        Sequences per batch.

    Returns
    -------
    Baseline
        ValueError where the given one was run on other tokens or another eps.
    """
    if baseline is None:
        return baseline_pass(model, tokens, eps=eps, batch_size=batch_size)
    if baseline.run.alpha.shape[0] != tokens.shape[0] or baseline.run.eps != eps:
        raise ValueError(
            f"the baseline was run on {baseline.run.alpha.shape[0]} sequences with eps {baseline.run.eps}; "
            f"these are {tokens.shape[0]} with eps {eps}: pass the baseline of these tokens, or none."
        )
    return baseline


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, register  # noqa: E402


register(
    Analysis(
        "baseline",
        result=Baseline,
        order=60,
        hooks=("pattern", "resid", "v", "z"),
        product=True,
        doc="The interventions' shared baseline on the main kind.",
        # none on a remote model (its pass gives no logits): each intervention runs baseline_pass there
        accumulators=lambda p: (
            [] if isinstance(p.model, NnsightModel) else baseline_accumulators(p.model, p.tokens.shape[1], eps=p.eps)
        ),
        # with the main kind's resume points, so that its conditions resume
        finish=lambda outputs, p, got: baseline_from(outputs, resid=got["resid"][0] if got.get("resid") else {}),
    )
)
