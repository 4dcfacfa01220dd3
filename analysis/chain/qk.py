"""QK angles: is the first key special because of its angle to the queries, or its norm?

For each head of each attention layer, from the queries and keys the attention really uses (the family spec's
``query_hook``/``key_hook``, rotated per the spec where the bridge does not fire ``hook_rot_q``/``hook_rot_k``:
``analysis.model.rotary.rotate_as_spec``), reduced inside the hooks:

- ``cos_first``: mean over queries t >= 2 of cos(q_t, k_1)
- ``cos_other``: mean over queries t and keys 1 < j <= t of cos(q_t, k_j)
- the mean norms |q_t|, |k_1| and |k_j| (j > 1)
- histograms of both cosines over fixed bins, for the figure.

Hybrid models (Qwen3-Next, Qwen3.5, Jamba) run on their attention layers only, with their true indices; the
skipped layers are named in the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from analysis.model.contract import SinkModel
from analysis.model.hooks import (
    check_attention_layers,
    check_layers,
    check_tokens,
    model_facts,
    per_query_head,
    qk_hook_names,
)
from analysis.engine.passes import Accumulator, Batch, RunningSums, run_pass
from analysis.core.docs import model_tokens_min2, parameters_from
from analysis.core.results import Result, pass_options
from analysis.model.rotary import rotate_as_spec
from analysis.core.stats import permuted_copy

from analysis.core.defaults import QK_COS_BINS as N_BINS  # fixed bins of the cosine histograms

_STATS = ("cos_first", "cos_other", "q_norm", "k_first_norm", "k_other_norm")


def _cosines(qn: torch.Tensor, kn: torch.Tensor) -> torch.Tensor:
    """Unit queries (B,T,H,d) against unit keys (B,T,Hkv or H,d), each query head against its KV head's keys ->
    (B,H,T,T): the numbers of ``einsum("bihd,bjhd->bhij")`` on the keys repeated per query head, computed as einsum
    computes them (for B, T, H, d > 1 one batched product of fresh contiguous (B H, T, d) and (B H, d, T) operands,
    in that batch order: another order or layout can change the last bit), here with the keys transposed per KV head
    before they are repeated; else einsum itself, which multiplies strided views."""
    B, T, H, d = qn.shape
    if min(B, T, H, d) == 1:
        return torch.einsum("bihd,bjhd->bhij", qn, per_query_head(kn, H))
    left = qn.permute(0, 2, 1, 3).reshape(B * H, T, d)
    right = per_query_head(permuted_copy(kn, (0, 2, 3, 1)), H, dim=1).reshape(B * H, d, kn.shape[1])
    return torch.bmm(left, right).view(B, H, T, kn.shape[1])


def _cosine_hist(x: torch.Tensor) -> torch.Tensor:
    """Counts of cosines over ``N_BINS`` fixed bins on [-1, 1] (values outside are counted in the end bins)."""
    # the bin trunc((clamp(x, -1, 1) + 1) / 2 * N_BINS), capped at N_BINS - 1: (x + 1) * (N_BINS / 2) is the same float
    # (halving is exact), and clamping it to [0, N_BINS - 1] before truncating gives the same bin for x outside [-1, 1]
    idx = (x + 1).mul_(N_BINS / 2).clamp_(0, N_BINS - 1).int()
    idx += (torch.arange(x.shape[0], device=x.device, dtype=torch.int32) * N_BINS)[:, None]  # one bincount: (head, bin)
    return torch.bincount(idx.flatten(), minlength=x.shape[0] * N_BINS).reshape(x.shape[0], N_BINS).double()


def _other_keys(T: int, device) -> torch.Tensor:
    """Flat indices into a (T, T) cosine map of the (query t, key j) pairs with 1 <= j <= t, row-major."""
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=device))
    mask[:, 0] = False
    return mask.flatten().nonzero().squeeze(1)


@dataclass
class QKAngles(Result):
    """Per-head QK-angle statistics over query heads of the attention layers measured.

    Attributes
    ----------
    layers : list of int, length L
        The true layer index of each position on the layer axis.
    cos_first : torch.Tensor, shape (L, H)
        Mean over queries t >= 2 of cos(q_t, k_1).
    cos_other : torch.Tensor, shape (L, H)
        Mean over queries t and keys 1 < j <= t of cos(q_t, k_j).
    q_norm, k_first_norm, k_other_norm : torch.Tensor, shape (L, H)
        The mean norms |q_t|, |k_1| and |k_j| (j > 1).
    hist_first, hist_other : torch.Tensor, shape (L, H, N_BINS)
        Histograms of both cosines, as fractions.
    bin_edges : torch.Tensor, shape (N_BINS + 1,)
        The histogram's bin edges on [-1, 1].
    n_samples : int
        N, the number of sequences.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    skipped : str
        The layers left out (hybrids: linear-attention / Mamba layers), in words; "" when none.
    """

    layers: list[int]
    cos_first: torch.Tensor
    cos_other: torch.Tensor
    q_norm: torch.Tensor
    k_first_norm: torch.Tensor
    k_other_norm: torch.Tensor
    hist_first: torch.Tensor
    hist_other: torch.Tensor
    bin_edges: torch.Tensor
    n_samples: int = 0
    model_name: str | None = None
    kind: str | None = None
    skipped: str = ""  # the layers left out (hybrids: linear-attention / Mamba layers), in words

    def table(self) -> pd.DataFrame:
        L, H = self.cos_first.shape
        return pd.DataFrame(
            {
                "layer": torch.tensor(self.layers).repeat_interleave(H).numpy(),
                "head": torch.arange(H).repeat(L).numpy(),
                **{name: getattr(self, name).flatten().numpy() for name in _STATS},
            }
        )

    table_fields = ("heads=table",)

    def findings(self) -> list[str]:
        gap = self.cos_first - self.cos_other
        h = torch.nonzero(gap == gap.max())[0].tolist()
        skipped = [f"{self.skipped[0].upper()}{self.skipped[1:]}."] if self.skipped else []
        return [
            f"Over all heads queries meet the first key at mean cosine {float(self.cos_first.mean()):.2f} and other "
            f"keys at {float(self.cos_other.mean()):.2f}; the largest gap is in layer {self.layers[h[0]]}, head {h[1]} "
            f"({float(self.cos_first[h[0], h[1]]):.2f} against {float(self.cos_other[h[0], h[1]]):.2f}), where "
            f"|k_1| / |k_j| = {float(self.k_first_norm[h[0], h[1]] / self.k_other_norm[h[0], h[1]]):.2f}."
        ] + skipped

    def to_dict(self) -> dict:
        return {
            **self.header(),
            "layers": self.layers,
            "skipped": self.skipped,
            **self.table().drop(columns=["layer", "head"]).to_dict("list"),
            "text": self.text(),
        }


class QKAccumulator(Accumulator):
    """cos(q_t, k_1) and cos(q_t, k_j), the norms and the cosine histograms, from the q and k the attention uses.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    layers : sequence of int, optional
        Attention layers (None: all of them; a non-attention layer raises ValueError).
    kind : str, optional
        The input kind, a label.
    """

    def __init__(self, model, *, layers=None, kind: str | None = None):
        facts = model_facts(model)
        layers = list(facts.attention_layers) if layers is None else check_attention_layers(model, layers=layers)
        self.model, self.layers, self.kind = model, layers, kind
        self.spec = facts.family
        self.H = facts.dims.n_heads
        L = len(self.layers)
        self.index = {l: i for i, l in enumerate(self.layers)}
        self.sums = RunningSums(L)  # per head sums and cosine histograms, on each layer's device until the result
        self.counts = dict.fromkeys(("first", "other", "q", "k1", "kj", "n"), 0)
        self._other = torch.zeros(0, dtype=torch.long)  # flat indices of the keys 1 <= j <= t (``_other_keys``)

    def hooks(self):
        return {l: dict(zip(("q", "k"), qk_hook_names(self.model, l))) for l in self.layers}

    def vectors(self, layer: int, acts: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries and keys the attention of a layer uses, from the hooks (rotated per the family spec).

        Parameters
        ----------
        layer : int
        acts : dict
            The layer's activations, ``"q"`` and ``"k"``.

        Returns
        -------
        q : torch.Tensor, shape (B, T, H, d)
        k : torch.Tensor, shape (B, T, H_kv or H, d)
        """
        return rotate_as_spec(acts["q"], self.spec, layer), rotate_as_spec(acts["k"], self.spec, layer)

    def update(self, layer: int, acts: dict, batch: Batch) -> None:
        q, k = self.vectors(layer, acts)
        i, (B, T), H = self.index[layer], q.shape[:2], self.H
        (qn, q_norm), (kn, k_norm) = acts.units(q), acts.units(k)  # shared with the first-key manifold
        cos = _cosines(qn, kn).reshape(B * H, T * T)  # (B H, T T)
        first = cos[:, T::T].reshape(B, H, T - 1).transpose(0, 1).reshape(H, -1)  # (H, B (T-1)): cos(q_t, k_1), t > 1
        if self._other.numel() != T * (T - 1) // 2 or self._other.device != cos.device:
            self._other = _other_keys(T, cos.device)
        other = cos.index_select(1, self._other).view(B, H, -1).transpose(0, 1).reshape(H, -1)  # 1 <= j <= t
        kk = per_query_head(k_norm, H)  # (B,T,H)
        for name, x in (
            ("cos_first", first.sum(-1)),
            ("cos_other", other.sum(-1)),
            ("k_first_norm", kk[:, 0].sum(0)),
            ("q_norm", q_norm.sum(dim=(0, 1))),
            ("k_other_norm", kk[:, 1:].sum(dim=(0, 1))),
        ):
            self.sums.add(name, i, x)
        self.sums.add("hist_first", i, _cosine_hist(first))
        self.sums.add("hist_other", i, _cosine_hist(other))
        if i == 0:
            for key, n in (
                ("first", first.shape[1]),
                ("other", other.shape[1]),
                ("q", B * T),
                ("k1", B),
                ("kj", B * (T - 1)),
                ("n", B),
            ):
                self.counts[key] += n

    def result(self) -> QKAngles:
        norm = {"cos_first": "first", "cos_other": "other", "q_norm": "q", "k_first_norm": "k1", "k_other_norm": "kj"}
        h = self.sums.host
        out = {name: (h(name, (self.H,)) / self.counts[norm[name]]).float() for name in _STATS}
        return QKAngles(
            self.layers,
            **out,
            hist_first=(h("hist_first", (self.H, N_BINS)) / self.counts["first"]).float(),
            hist_other=(h("hist_other", (self.H, N_BINS)) / self.counts["other"]).float(),
            bin_edges=torch.linspace(-1, 1, N_BINS + 1),
            n_samples=self.counts["n"],
            model_name=getattr(self.model, "model_name", None),
            kind=self.kind,
            skipped=self.spec.skipped_text(),
        )


@parameters_from(pass_options)
@parameters_from(model_tokens_min2)
def qk_angles(
    model: SinkModel, tokens, *, layers=None, batch_size: int | None = None, kind: str | None = None
) -> QKAngles:
    """Cosines between queries and the first key against the other keys, per head of each attention layer, streamed.

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens_min2`.
    layers : sequence of int, optional
        Attention layers (true indices; default all).
    batch_size, kind
        As in :func:`pass_options`.

    Returns
    -------
    QKAngles
        Statistics of shape (L, H).
    """
    layers = check_attention_layers(model, layers=None if layers is None else check_layers(model, layers))
    tokens = check_tokens(model, tokens)
    return run_pass(model, tokens, [QKAccumulator(model, layers=layers, kind=kind)], batch_size=batch_size)[0]


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, register  # noqa: E402


register(
    Analysis(
        "qk",
        result=QKAngles,
        order=30,
        hooks=("q", "k"),
        doc="QK angles on the main kind.",
        accumulators=lambda p: [QKAccumulator(p.model, kind=p.kind)],
        exports=("qk_angles",),
    )
)
