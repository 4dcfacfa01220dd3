"""Exact removal of one head's output at one query: the change in each sequence's summed next-token loss when
z_t^h is set to 0 or to the head's mean output (``removal_effects``), one pass per head, resumed at its block where
the model can resume; the heads' mean outputs (``head_means``); the per-sequence loss (``sequence_losses``) and the
copy queries of the synthetic task (``copy_queries``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from analysis.core.docs import model_tokens, parameters_from
from analysis.model.access import vocab_size
from analysis.model.contract import SinkModel
from analysis.model.hooks import act_name, check_attention_layers, check_heads, check_tokens
from analysis.engine.passes import (
    Accumulator,
    Batch,
    Reduction,
    ResidCapture,
    Resume,
    can_resume,
    resume_from,
    run_pass,
)


def sequence_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of each sequence, (B,) float32, from ``logits`` (B, T, V).

    The loss is taken over the logits as they lie, (B T, V) rows with the last position's target ignored: the
    class axis stays the contiguous one (a (B, V, T) view of the same numbers costs about twice as much forward and
    three times as much backward on a CPU).

    Parameters
    ----------
    logits : torch.Tensor, shape (B, T, V)
    tokens : torch.Tensor, shape (B, T)

    Returns
    -------
    torch.Tensor, shape (B,)
    """
    B, T = tokens.shape
    target = torch.cat([tokens[:, 1:], tokens.new_full((B, 1), -100)], 1).to(logits.device)
    nll = torch.nn.functional.cross_entropy(
        logits.float().reshape(B * T, -1), target.reshape(-1), reduction="none", ignore_index=-100
    )
    return nll.view(B, T).sum(-1)


def head_sums(acts: dict, *, first: int) -> torch.Tensor:
    """A layer's summed head outputs z over the queries ``first``..T-2, (H, d_head) float64: the reduction of
    :func:`head_means` (torch only: it runs next to a remote model too).

    Parameters
    ----------
    acts : dict
        "z": (B, T, H, d_head).
    first : int
        The first query summed over.

    Returns
    -------
    torch.Tensor, shape (H, d_head)
    """
    return acts["z"][:, first:-1].double().sum((0, 1))


class _HeadMeans(Accumulator):
    """Each head's mean z over the queries first..T-2 of every sequence (``hook_z``), (L, H, d_head) float32."""

    def __init__(self, layers, first: int):
        self.layers, self.first = list(layers), int(first)
        self.sums: dict[int, torch.Tensor] = {}
        self.n = 0

    def hooks(self):
        return {l: {"z": act_name("z", l)} for l in self.layers}

    def reduction(self, layer: int) -> Reduction:
        return Reduction(head_sums, {"first": self.first})

    def fold(self, layer: int, stats: torch.Tensor, batch: Batch) -> None:
        self.sums[layer] = self.sums.get(layer, 0) + stats.cpu()
        if layer == self.layers[0]:
            self.n += batch.size * (batch.tokens.shape[1] - 1 - self.first)

    def result(self) -> torch.Tensor:
        return torch.stack([self.sums[l] / self.n for l in self.layers]).float()


@parameters_from(model_tokens)
def head_means(
    model: SinkModel, tokens, layers: Sequence[int], *, first: int = 1, batch_size: int | None = None
) -> torch.Tensor:
    """Each head's mean output z over the queries ``first``..T-2 (0-based) of every sequence, (L, H, d_head): the
    value mean ablation sets a head's output to. One streamed pass, stopping after the last of ``layers``.

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens`.
    layers : sequence of int
        Attention layers (true indices).
    first : int
        The first query averaged over.
    batch_size : int, optional
        Sequences per batch (default: ``analysis.engine.passes.default_batch_size``).

    Returns
    -------
    torch.Tensor, shape (L, H, d_head)
    """
    return run_pass(
        model,
        check_tokens(model, tokens),
        [_HeadMeans(check_attention_layers(model, layers=layers), first)],
        batch_size=batch_size,
    )[0]


def copy_queries(model: SinkModel, tokens) -> torch.Tensor:
    """(N, T) bool: the queries of the synthetic bigram-copy task (``analysis.train``, Guo et al.'s bigram-backcopy)
    where the next token copies the one before, i.e. whose own token is a trigger at position >= 2 (0-based). The
    triggers are read from the reference model's data config; ValueError for a model without that task.

    Parameters
    ----------
    model : analysis.train.SinkLM
        A reference model of the synthetic bigram-copy task.
    tokens : torch.Tensor, shape (N, T)
        Token ids.

    Returns
    -------
    torch.Tensor, shape (N, T)
        bool.
    """
    data = (getattr(model, "reference_config", None) or {}).get("data", {})
    triggers = data.get("triggers")
    if not triggers:
        raise ValueError(
            "this model was not trained on the synthetic bigram-copy task (no triggers in its reference "
            "config); give your own (N, T) mask of active queries."
        )
    tokens = check_tokens(model, tokens).cpu()
    out = torch.isin(tokens, torch.tensor(triggers))
    out[:, :2] = False
    return out


class _RowLosses(Accumulator):
    """The summed next-token loss of every row of a pass (needs the logits)."""

    needs_logits = True

    def __init__(self):
        self.kept: list[torch.Tensor] = []

    def hooks(self):
        return {}

    def end_batch(self, batch: Batch, logits) -> None:
        self.kept.append(sequence_losses(logits, batch.tokens).double().cpu())

    def result(self) -> torch.Tensor:
        return torch.cat(self.kept)


def check_queries(queries, T: int, first: int) -> list[int]:
    """Query positions (0-based) in [first, T - 2]; None: all of them.

    Parameters
    ----------
    queries : sequence of int or None
    T : int
        The sequence length.
    first : int
        The first query the statistics use.

    Returns
    -------
    list of int
    """
    if queries is None:
        return list(range(first, T - 1))
    qs = sorted({int(q) for q in queries})
    bad = [q for q in qs if not first <= q <= T - 2]
    if not qs or bad:
        raise ValueError(
            f"queries must lie in [{first}, {T - 2}] (0-based: after the sink, before the last token); "
            f"got {bad or 'none'}."
        )
    return qs


def removal_effects(
    model: SinkModel,
    tokens,
    heads,
    *,
    queries: Sequence[int] | None = None,
    first: int = 1,
    values: torch.Tensor | None = None,
    resid: dict | None = None,
    batch_size: int | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """The exact change of each sequence's summed next-token loss (nats) when one head's output at one query is
    removed (z_t^h set to 0, or to ``values[i]`` (n_heads, d_head) for the i-th head: its mean output for mean
    ablation, ``head_means``), (n_heads, N, Q) float64.

    One pass per head over N x (Q + 1) rows: each sequence unchanged, then once per query with that query's output
    removed, so every (sequence, query) is exact on its own. Where the model can resume (``passes.can_resume``) the
    pass starts at the head's block from the residual entering it: from ``resid`` ({block: (N, T, D)}, e.g.
    ``Profile.resid``: the last kept block at or before it) or from one capturing pass. ``queries``: 0-based
    positions in [first, T - 2] (default all). Cost: n_heads x (Q + 1) passes' worth of tokens; keep N and T small.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    tokens : torch.Tensor, shape (N, T)
        Token ids (keep N and T small).
    heads : sequence of (int, int)
        (true layer, query head) pairs.
    queries : sequence of int, optional
        0-based positions in [first, T - 2] (default all).
    first : int
        The first query position allowed.
    values : torch.Tensor, shape (n_heads, d_head), optional
        What each head's output is set to (default 0).
    resid : dict of int to torch.Tensor, optional
        {block: the residual entering it, (N, T, D)}.
    batch_size : int, optional
        Sequences per batch (default: ``analysis.engine.passes.default_batch_size``).
    progress : bool
        Show a progress bar over heads.

    Returns
    -------
    torch.Tensor, shape (n_heads, N, Q)
        float64, nats.
    """
    tokens = check_tokens(model, tokens)
    N, T = tokens.shape
    pairs = check_heads(model, heads)
    qs = check_queries(queries, T, first)
    R = len(qs) + 1
    rows = tokens.repeat_interleave(R, 0)
    layers = sorted({l for l, _ in pairs})
    if resid is None and can_resume(model):
        resid = run_pass(model, tokens, [ResidCapture([l for l in layers if l > 0])])[0] if any(layers) else {}
    if values is not None and (values.ndim != 2 or values.shape[0] != len(pairs)):
        raise ValueError(
            f"values must hold one output (d_head,) per head: shape ({len(pairs)}, d_head); got {tuple(values.shape)}."
        )
    qpos = torch.tensor([-1] + qs)  # row r of a sequence removes query qpos[r] (-1: none)
    vocab = vocab_size(model) or 50_000
    bs = batch_size or min(512, max(1, 2**26 // (T * vocab)))  # rows whose logits take at most 256 MiB
    out = []
    for i, (l, h) in enumerate(pairs):
        base = resume_from(resid, l) if can_resume(model) else None
        resume = None if base is None else Resume(base.layer, base.resid.repeat_interleave(R, 0))
        state = {"offset": 0}

        def on_start(batch, state=state):
            state["offset"] = batch.offset

        new = 0.0 if values is None else values[i]

        def remove(x, hook, h=h, state=state, new=new):
            idx = torch.arange(state["offset"], state["offset"] + x.shape[0]) % R
            keep = idx > 0
            if not keep.any():
                return x
            x = x.clone()
            b = torch.nonzero(keep).squeeze(1)
            x[b.to(x.device), qpos[idx[keep]].to(x.device), h] = new if values is None else new.to(x)
            return x

        losses = run_pass(
            model,
            rows,
            [_RowLosses()],
            fwd_hooks=[(act_name("z", l), remove)],
            batch_size=bs,
            on_batch_start=on_start,
            resume=resume,
            progress=progress,
        )[0].view(N, R)
        out.append(losses[:, 1:] - losses[:, :1])
    return torch.stack(out)


__all__ = ["removal_effects", "head_means", "copy_queries", "sequence_losses", "check_queries"]
