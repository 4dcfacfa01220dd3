"""The attention-output gate (Qwen3-Next, Qwen3.5): how open it is on the first token and elsewhere.

Gated attention multiplies each head's attention output at query position t by ``sigmoid(g_t)`` (one gate per
head and head dim) before the output projection; Qiu et al. (2025) report that the gate removes the attention
sink. The bridge fires the gate logits in ``hook_q_gate`` (the family spec names it: ``spec.gate_hook(layer)``).
Per attention layer and head, from N sequences of T tokens:

- ``first``: the mean gate value (sigmoid of the logits, averaged over head dims) at the first token's position;
- ``other``: the same averaged over positions 2..T.

A gate near 0 on the first token shuts its output off (a head that attends there writes little of it), a gate
near 0 elsewhere lets a head write nothing without sinking. ``GateResult.table`` sits beside alpha_1 in the
report's sink section.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.model.hooks import check_attention_layers, check_tokens, model_facts, skipped_note
from analysis.engine.passes import Accumulator, Batch, run_pass
from analysis.core.docs import parameters_from
from analysis.core.results import Result, pass_options


def gate_means(logits: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The mean gate value per head: the sigmoid of the gate logits, then the mean over each head's dims.

    Parameters
    ----------
    logits : torch.Tensor, shape (B, T, H * d_head)
        The gate logits (``hook_q_gate``).
    n_heads : int
        H.

    Returns
    -------
    torch.Tensor, shape (B, T, H)
    """
    return torch.sigmoid(logits.float()).unflatten(-1, (n_heads, -1)).mean(-1)


@dataclass
class GateResult(Result):
    """Mean gate value per (attention layer, head) on the first token and on the other positions.

    Attributes
    ----------
    layers : list of int, length L
        The true layer index of each position on the layer axis.
    first : torch.Tensor, shape (L, H)
        The mean sigmoid gate at position 1.
    other : torch.Tensor, shape (L, H)
        The mean sigmoid gate over positions 2..T.
    n_samples : int
        N, the number of sequences.
    T : int
        The sequence length.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    skipped : str
        The layers left out (not attention layers) and why, in one sentence; "" when none.
    """

    layers: list[int]
    first: torch.Tensor  # (L, H) mean sigmoid gate at position 1
    other: torch.Tensor  # (L, H) mean sigmoid gate over positions 2..T
    n_samples: int
    T: int
    model_name: str | None = None
    kind: str | None = None
    skipped: str = ""

    def table(self) -> pd.DataFrame:
        """One row per (true layer, head): ``gate_first`` (token 1) and ``gate_other`` (elsewhere)."""
        L, H = self.first.shape
        return pd.DataFrame(
            {
                "layer": torch.tensor(self.layers).repeat_interleave(H).numpy(),
                "head": torch.arange(H).repeat(L).numpy(),
                "gate_first": self.first.flatten().numpy(),
                "gate_other": self.other.flatten().numpy(),
            }
        )

    table_fields = ("per_head=table",)

    def findings(self) -> list[str]:
        lo = int((self.first < self.other).sum())
        out = (
            f"The attention-output gate (sigmoid, mean over head dims) is {float(self.first.mean()):.3f} on the first "
            f"token and {float(self.other.mean()):.3f} elsewhere, averaged over {self.first.numel()} heads of "
            f"{len(self.layers)} attention layers (N = {self.n_samples} sequences of T = {self.T} tokens); {lo} heads "
            "gate the first token more closed than the others."
        )
        return [out] + ([self.skipped] if self.skipped else [])

    json_fields = ("T", "layers", "gate_first=first", "gate_other=other", "per_head=table", "skipped?")


class GateAccumulator(Accumulator):
    """Sums of the mean gate value per head at position 1 and over positions 2..T, per attention layer.

    Parameters
    ----------
    model
        A model whose family has an attention-output gate (ValueError otherwise).
    layers : sequence of int, optional
        Attention layers (default all).
    kind : str, optional
        The input kind, a label.
    """

    def __init__(self, model, *, layers=None, kind: str | None = None):
        facts = model_facts(model)
        spec = facts.family
        if spec.gate is None:
            raise ValueError(f"this {spec.family} model has no attention-output gate (Qwen3-Next / Qwen3.5 have one).")
        self.model, self.kind, self.spec = model, kind, spec
        self.layers = list(facts.attention_layers) if layers is None else check_attention_layers(model, layers=layers)
        self.index = {l: i for i, l in enumerate(self.layers)}
        self.first = torch.zeros(len(self.layers), spec.n_heads, dtype=torch.float64)
        self.other = torch.zeros_like(self.first)
        self.n, self.T = 0, 0

    def hooks(self):
        return {l: {"gate": self.spec.gate_hook(l)} for l in self.layers}

    def update(self, layer: int, acts: dict, batch: Batch) -> None:
        g = gate_means(acts["gate"], self.spec.n_heads)  # (B, T, H)
        i = self.index[layer]
        self.first[i] += g[:, 0].double().sum(0).cpu()
        if g.shape[1] > 1:
            self.other[i] += g[:, 1:].double().mean(1).sum(0).cpu()
        if i == 0:
            self.n, self.T = self.n + g.shape[0], g.shape[1]

    def result(self) -> GateResult:
        n = max(self.n, 1)
        return GateResult(
            self.layers,
            (self.first / n).float(),
            (self.other / n).float(),
            self.n,
            self.T,
            getattr(self.model, "model_name", None),
            self.kind,
            skipped_note(self.model),
        )


@parameters_from(pass_options)
def attention_gates(
    model: SinkModel, tokens, *, layers=None, batch_size: int | None = None, kind: str | None = None
) -> GateResult:
    """The mean attention-output gate per (attention layer, head) on the first token and elsewhere, streamed through
    ``hook_q_gate`` (Qwen3-Next, Qwen3.5).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
        ValueError for a model without a gate.
    tokens : torch.Tensor, shape (N, T)
        Token ids, T >= 2.
    layers : sequence of int, optional
        Attention layers (true indices; default all).
    batch_size, kind
        As in :func:`pass_options`.

    Returns
    -------
    GateResult
        ``first`` and ``other`` of shape (L, H).
    """
    tokens = check_tokens(model, tokens)
    return run_pass(model, tokens, [GateAccumulator(model, layers=layers, kind=kind)], batch_size=batch_size)[0]


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, register  # noqa: E402


register(
    Analysis(
        "gates",
        result=GateResult,
        order=70,
        hooks=("gate",),
        doc="The attention-output gates (gated attention only: Qwen3-Next, Qwen3.5).",
        # no gate: nothing to run
        accumulators=lambda p: (
            [GateAccumulator(p.model, kind=p.kind)]
            if getattr(model_facts(p.model).family, "gate", None) is not None
            else []
        ),
        exports=("attention_gates",),
    )
)
