"""The attention-sink metric of Gu et al. (2025), computed by a reducer on ``hook_pattern``.

For head (l, h), sample s and key position k (1-based), the mean attention the key receives from the
queries that can see it is

    alpha_k = 1 / (T - k + 1) * sum_{i = k..T} A[i, k]

and ``Sink_k^eps`` is 100 x the share of (sample, layer, head) triples with alpha_k > eps (strict),
eps = 0.3 by default. Only alpha for keys 1..k_max is kept: memory per batch is O(layers x heads x k_max); with
k_max = T, alpha at every position (the column sums of each pattern, reduced in the hook).

``sink_metric`` chooses the path: the transformers backend (``analysis.engine.backends``: alpha from q, k and the
fused kernel's log-sum-exp) where it is exact, the bridge's streamed ``hook_pattern`` otherwise; one accumulator,
``SinkAccumulator``, reduces either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import pandas as pd
import torch

from analysis.core.docs import model_tokens, parameters_from
from analysis.model.contract import SinkModel
from analysis.core.defaults import SINK_EPS, SINK_HEAD_MIN_SHARE, SINK_K_MAX
from analysis.model.hooks import act_name, bos_record, bos_sentence, check_tokens, model_facts
from analysis.model.reference.attention import pattern_note
from analysis.engine.attention import attention_of
from analysis.engine.passes import Accumulator, Batch, LayerCollector, Reduction, run_pass
from analysis.core.results import LayerAxis, Result, layers_text


def check_eps(eps: float) -> float:
    """The sink threshold, checked.

    Parameters
    ----------
    eps : float
        The threshold on alpha; must lie in (0, 1).

    Returns
    -------
    float
        ``eps`` as a float (ValueError outside (0, 1)).
    """
    eps = float(eps)
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps must lie in (0, 1) (the paper uses 0.3); got {eps}.")
    return eps


def alpha_from_pattern(pattern: torch.Tensor, k_max: int) -> torch.Tensor:
    """alpha_k for keys 1..k_max from attention maps.

    Entries above the diagonal (queries before the key) are ignored even if non-zero.

    Parameters
    ----------
    pattern : torch.Tensor, shape (..., T_query, T_key), or AttentionWeights
        Attention probabilities (``hook_pattern`` as either backend hands it), e.g. (B, H, T, T).
    k_max : int
        The keys kept: 1..k_max (capped at T).

    Returns
    -------
    torch.Tensor, shape (..., k_max)
        alpha_k: the mean attention key k receives from the queries i >= k, float32
        (``analysis.engine.attention.AttentionWeights.alpha``).
    """
    return attention_of(pattern).alpha(k_max)


def slot_share(pattern: torch.Tensor) -> torch.Tensor:
    """The attention each query gives to no input token (an extra slot: a learned sink logit, a sink token, K/KV
    biases): 1 - the row sum of its pattern, summed in float32.

    A bf16 / fp16 pattern row sums to one only to its rounding (at most eps / 2 of the row, ~0.004 in bf16) with no
    slot at all: a share within ``torch.finfo(pattern.dtype).eps`` of zero is zero.

    Parameters
    ----------
    pattern : torch.Tensor, shape (B, H, T, T), or AttentionWeights
        Attention probabilities (``hook_pattern``, as either backend hands it).

    Returns
    -------
    torch.Tensor, shape (B, H, T)
        float32.
    """
    rest = 1.0 - attention_of(pattern).row_sums()
    return rest.masked_fill(rest.abs() <= torch.finfo(pattern.dtype).eps, 0.0)


@dataclass
class SinkResult(Result, LayerAxis):
    """alpha for every sample, layer, head and key 1..k_max, with the metric and tables on top.

    ``sink_rate`` is in percent (the paper's unit); ``min_share`` arguments are fractions.

    Layers: the tensors' layer axis L runs over ``layers``, the TRUE layer indices of the attention layers
    measured (all layers of a plain transformer; on a hybrid such as Qwen3-Next or Jamba only its attention
    layers, e.g. [1, 3]). Tables, ``sink_heads`` and ``extreme_layers`` give true indices; ``pos(layer)`` maps a
    true index to its position on the L axis.

    Attributes
    ----------
    alpha : torch.Tensor, shape (N, L, H, K)
        alpha_k: the mean attention key k (1..K = k_max) receives from the queries that see it, per sample, layer
        and query head; float32 on the CPU.
    eps : float
        The threshold of ``sink_rate`` (alpha_k > eps, strict).
    T : int
        The sequence length.
    model_name, kind : str or None
        The model measured and the input kind ("natural", "random", ...).
    meta : dict
        How it was computed: ``"path"`` ("fused" or "eager") and, where the fused path was refused,
        ``"fused_unsupported"`` (why).
    slot : torch.Tensor, shape (N, L, H), or None
        Mean over queries of the attention that goes to no input token (a learned sink logit, a sink token, K / KV
        biases: 1 - the row sum of ``hook_pattern``); None on the fused path.
    layers : list of int, length L
        The true layer index of each position on the layer axis.
    skipped : str
        The layers left out (not attention layers) and why, in one sentence; "" when none.
    n_samples : int
        N, the number of sequences (a property).
    """

    alpha: torch.Tensor  # (N, L, H, K) float32, on CPU
    eps: float
    T: int
    model_name: str | None = None
    kind: str | None = None
    meta: dict = field(default_factory=dict)
    slot: torch.Tensor | None = None  # (N, L, H): mean over queries of the attention that goes to no input token
    layers: list[int] | None = None  # true layer index of each position on the L axis (None: 0..L-1)
    skipped: str = ""  # the layers left out (not attention layers), in one sentence; "" when none

    def __post_init__(self):
        L = int(self.alpha.shape[1])
        self.layers = list(range(L)) if self.layers is None else [int(l) for l in self.layers]
        if len(self.layers) != L:
            raise ValueError(f"layers names {len(self.layers)} layers but alpha has {L} on its layer axis.")

    @property
    def k_max(self) -> int:
        return self.alpha.shape[-1]

    @property
    def n_samples(self) -> int:
        return int(self.alpha.shape[0])

    def _k(self, k: int) -> int:
        k = int(k)
        if not 1 <= k <= self.T:
            raise ValueError(f"k must lie in [1, T={self.T}] (1 is the first token); got {k}.")
        if k > self.k_max:
            raise ValueError(f"alpha was kept for keys 1..{self.k_max} only; rerun sink_metric with k_max >= {k}.")
        return k - 1

    def sink_rate(self, k: int = 1, eps: float | None = None) -> float:
        """Sink_k^eps in percent."""
        e = self.eps if eps is None else check_eps(eps)
        return float((self.alpha[..., self._k(k)] > e).float().mean() * 100)

    @property
    def has_slot(self) -> bool:
        """True where some attention goes to an extra slot rather than to an input token: a learned sink logit
        (gpt-oss), a learnable sink token, K or KV biases. The slot's share of a query's attention is
        1 - the sum of its ``hook_pattern`` row over the input tokens."""
        return self.slot is not None and float(self.slot.abs().max()) > 1e-4

    def slot_sink_rate(self, eps: float | None = None) -> float:
        """Sink on the extra slot, in percent: the share of (sample, layer, head) whose mean attention on the slot
        exceeds eps (0 for a model without one)."""
        if self.slot is None:
            return 0.0
        e = self.eps if eps is None else check_eps(eps)
        return float((self.slot > e).float().mean() * 100)

    def per_head_slot(self) -> torch.Tensor:
        """The slot's mean share of each head's attention over samples and queries, (L, H)."""
        if self.slot is None:
            raise ValueError("this result has no slot shares (the fused path keeps none); rerun with path='eager'.")
        return self.slot.mean(0)

    def slot_per_head(self) -> pd.DataFrame:
        """One row per (true layer, head): mean alpha_1 and the learned sink's (slot's) mean share beside it."""
        df = self.per_head(1)
        df["slot_share"] = self.per_head_slot().flatten().numpy()
        df["slot_sink_pct"] = ((self.slot > self.eps).float().mean(0) * 100).flatten().numpy()
        return df

    def sink_rates(self, eps: float | None = None) -> torch.Tensor:
        """Sink_k^eps for k = 1..k_max, in percent."""
        e = self.eps if eps is None else check_eps(eps)
        return (self.alpha > e).float().mean(dim=(0, 1, 2)) * 100

    @property
    def per_head_alpha(self) -> torch.Tensor:
        """alpha averaged over samples, (L, H, K)."""
        return self.alpha.mean(dim=0)

    def head_sink_share(self, k: int = 1) -> torch.Tensor:
        """Per head, the percent of samples with alpha_k > eps, (L, H)."""
        return (self.alpha[..., self._k(k)] > self.eps).float().mean(dim=0) * 100

    def per_head(self, k: int = 1) -> pd.DataFrame:
        """One row per (layer, head): mean alpha_k, its spread over samples, share of samples above eps."""
        i = self._k(k)
        a = self.alpha[..., i]
        L, H = a.shape[1:]
        return pd.DataFrame(
            {
                "layer": torch.tensor(self.layers).repeat_interleave(H).numpy(),
                "head": torch.arange(H).repeat(L).numpy(),
                f"alpha_{k}": a.mean(0).flatten().numpy(),
                f"alpha_{k}_std": a.std(0, unbiased=False).flatten().numpy(),
                f"sink_{k}_pct": ((a > self.eps).float().mean(0) * 100).flatten().numpy(),
            }
        )

    def per_layer(self, k: int = 1) -> pd.DataFrame:
        """One row per layer: Sink_k over that layer's heads, mean and max head alpha_k."""
        i = self._k(k)
        a = self.alpha[..., i]
        return pd.DataFrame(
            {
                "layer": self.layers,
                f"sink_{k}_pct": ((a > self.eps).float().mean(dim=(0, 2)) * 100).numpy(),
                f"mean_alpha_{k}": a.mean(dim=(0, 2)).numpy(),
                f"max_head_alpha_{k}": a.mean(0).max(dim=-1).values.numpy(),
            }
        )

    def sink_heads(self, k: int = 1, min_share: float = SINK_HEAD_MIN_SHARE) -> list[tuple[int, int]]:
        """(layer, query head) pairs whose alpha_k exceeds eps on at least ``min_share`` (a fraction) of samples."""
        if not 0.0 < float(min_share) <= 1.0:
            raise ValueError(f"min_share is a fraction of samples in (0, 1]; got {min_share}.")
        share = self.head_sink_share(k)
        return [(self.layers[i], h) for i, h in (share >= 100 * float(min_share) - 1e-9).nonzero().tolist()]

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        out = {"per_layer": self.per_layer(1), "per_head": self.per_head(1)}
        return out | ({"slot_per_head": self.slot_per_head()} if self.has_slot else {})

    def findings(self) -> list[str]:
        """Sink_1, then the layers that sink (the report states Sink_1 once, from ``sink_table_text``, and keeps the
        rest: ``findings()[1:]``), the extra slot, and the layers left out."""
        pl = self.per_layer(1)
        sinky = pl[pl.sink_1_pct > 50].layer.tolist()
        on = f" on {self.kind} inputs" if self.kind else ""
        out = [
            f"Sink_1 (eps = {self.eps:g}) of {self.model_name or 'the model'}{on} is {self.sink_rate(1):.1f}% "
            f"(N = {self.n_samples} sequences of T = {self.T} tokens; key positions k are 1-based, k = 1 the first "
            "token)."
        ]
        none = pl[pl.sink_1_pct < 5].layer.tolist()
        out.append(
            f"{len(sinky)} of {len(pl)} layers have Sink_1 above 50%"
            + (f"; the layers without a sink (below 5%) are {layers_text(none)}." if sinky and none else ".")
        )
        if self.has_slot:
            out.append(
                f"An extra slot (learned sink or bias) takes {100 * float(self.slot.mean()):.1f}% of the attention "
                f"on average; Sink on the slot is {self.slot_sink_rate():.1f}%."
            )
        bos = self.meta.get("bos")
        first = [bos_sentence(bos, asked=bos.get("asked"))] if bos else []
        proxy = self.meta.get("pattern")
        out[0] += f" Sink_1 is measured on a {proxy}: its weights do not sum to one." if proxy else ""
        return out + ([self.skipped] if self.skipped else []) + first

    def extreme_layers(self, k: int = 1) -> tuple[int, int]:
        """The layer with the most sink and the one with the least (Sink_k, then mean alpha_k)."""
        pl = self.per_layer(k)
        order = pl.sort_values([f"sink_{k}_pct", f"mean_alpha_{k}"], kind="stable")
        return int(order.iloc[-1].layer), int(order.iloc[0].layer)

    def to_dict(self) -> dict:
        return {
            **self.header(),
            "eps": self.eps,
            "T": self.T,
            "k_max": self.k_max,
            "positions": "1-based: k = 1 is the first token",
            "layers": list(self.layers),  # true layer index of each [layer] entry below
            **({"bos": self.meta["bos"]} if self.meta.get("bos") else {}),  # does the first token hold the BOS?
            **({"pattern": self.meta["pattern"]} if self.meta.get("pattern") else {}),  # a non-softmax model's proxy
            **({"skipped": self.skipped} if self.skipped else {}),
            **({"kernels": self.meta["kernels"]} if self.meta.get("kernels") else {}),  # the fused path's kernels
            "sink_k_pct": [round(float(x), 4) for x in self.sink_rates()],
            "per_head_alpha": self.per_head_alpha.permute(2, 0, 1).tolist(),  # [k][layer][head]
            **(
                {"sink_slot_pct": round(self.slot_sink_rate(), 4), "per_head_slot": self.per_head_slot().tolist()}
                if self.has_slot
                else {}
            ),
            "text": self.text(),
        }


def sink_stats(acts: dict, *, k_max: int) -> dict:
    """One layer's reduce for the sink metric: alpha_1..k_max (B, H, k_max) and the mean share on no input token
    (B, H), from the map (the bridge) or q, k and the lse (the other backends).

    Parameters
    ----------
    acts : dict
        {"pattern": the map (B, H, T, T) or ``AttentionWeights``}.
    k_max : int

    Returns
    -------
    dict of str to torch.Tensor
        "alpha" (B, H, k_max), "slot" (B, H).
    """
    attn = attention_of(acts["pattern"])
    return {"alpha": attn.alpha(k_max), "slot": slot_share(attn).mean(-1)}


class SinkAccumulator(Accumulator):
    """alpha_k for keys 1..k_max from every attention layer's ``hook_pattern`` (true indices), per sample."""

    def __init__(self, model, T: int, *, eps: float = SINK_EPS, k_max: int | None = None, kind: str | None = None):
        facts = model_facts(model)
        self.eps, self.T, self.kind = check_eps(eps), int(T), kind
        self.k_max = check_k_max(k_max, T)
        self.model_name = getattr(model, "model_name", None)
        self.layers = list(facts.attention_layers)
        self.skipped = facts.skipped
        self.alpha = LayerCollector(self.layers)
        self.slot = LayerCollector(self.layers)
        self.pattern = pattern_note(model)  # a sigmoid / linear reference model: Sink_1 of the normalised proxy

    def hooks(self):
        return {l: {"pattern": act_name("pattern", l)} for l in self.layers}

    def reduction(self, layer: int) -> Reduction:
        return Reduction(sink_stats, {"k_max": self.k_max})

    def fold(self, layer: int, stats: dict, batch: Batch) -> None:
        self.alpha.put(layer, stats["alpha"])
        self.slot.put(layer, stats["slot"])

    def end_batch(self, batch: Batch, logits) -> None:
        self.alpha.end_batch()
        self.slot.end_batch()

    def result(self) -> SinkResult:
        return SinkResult(
            self.alpha.result(),
            self.eps,
            self.T,
            self.model_name,
            self.kind,
            slot=self.slot.result(),
            layers=self.layers,
            skipped=self.skipped,
            meta={"pattern": self.pattern} if self.pattern else {},
        )


def check_k_max(k_max: int | None, T: int) -> int:
    """The number of key positions whose alpha is kept, checked.

    Parameters
    ----------
    k_max : int, optional
        Keys 1..k_max; None: min(T, 16).
    T : int
        The sequence length.

    Returns
    -------
    int
        k_max in [1, T] (ValueError otherwise).
    """
    k_max = min(T, SINK_K_MAX) if k_max is None else k_max
    if not 1 <= int(k_max) <= T:
        raise ValueError(f"k_max must lie in [1, T={T}]; got {k_max}.")
    return int(k_max)


@parameters_from(model_tokens)
def sink_metric(
    model: SinkModel,
    tokens,
    *,
    eps: float = SINK_EPS,
    k_max: int | None = None,
    batch_size: int | None = None,
    progress: bool = False,
    kind: str | None = None,
    path: str = "auto",
) -> SinkResult:
    """The sink metric of Gu et al.: alpha_k of every sample, attention layer, head and key 1..k_max.

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens`.
    eps : float
        The threshold of Sink_k^eps (alpha_k > eps); the paper's 0.3 by default.
    k_max : int, optional
        The key positions whose alpha is kept, 1..k_max (default min(T, 16)); ``k_max = T``: every position, as
        ``analysis.positions.every_sink`` uses it (the fused path then takes the column sums in blocks of query rows, never
        a T x T map).
    batch_size : int, optional
        Sequences per batch (default: ``analysis.engine.passes.default_batch_size``).
    progress : bool
        Show a progress bar.
    kind : str, optional
        The input kind, a label ("natural", "random").
    path : {"auto", "fused", "eager"}
        "fused" computes alpha from q, k and the fused attention kernel's log-sum-exp (``analysis.engine.backends``: no
        T x T map, about the cost of an SDPA forward); "eager" streams every layer's ``hook_pattern``; "auto" takes
        the fused path where it is exact for the model and the eager one otherwise (``result.meta["path"]`` says
        which, and ``result.meta["fused_unsupported"]`` why not fused).

    Returns
    -------
    SinkResult
        ``alpha`` of shape (N, L, H, k_max); ``sink_rate(k)`` is Sink_k^eps in percent.
    """
    return sink_pass(
        model, tokens, eps=eps, k_max=k_max, batch_size=batch_size, progress=progress, kind=kind, path=path
    )[0]


PATH_BACKENDS = {"auto": "auto", "fused": "transformers", "eager": "transformer_lens"}  # sink_metric's path
RAN_PATH = {"transformers": "fused", "transformer_lens": "eager", "nnsight": "nnsight"}  # the backend that ran -> path


@parameters_from(sink_metric)
def sink_pass(
    model: SinkModel,
    tokens,
    *,
    make_accumulators: Callable[[], Sequence[Accumulator]] = list,
    eps: float = SINK_EPS,
    k_max: int | None = None,
    batch_size: int | None = None,
    progress: bool = False,
    kind: str | None = None,
    path: str = "auto",
) -> tuple[SinkResult, list]:
    """The sink metric and other analyses from one pass of ``model`` over ``tokens``.

    Parameters
    ----------
    model, tokens, eps, k_max, batch_size, progress, kind
        As in :func:`sink_metric`.
    make_accumulators : callable returning a sequence of Accumulator
        Builds the other analyses' accumulators, fed in the same pass.
    path : {"auto", "fused", "eager"}
        The backend (``analysis.engine.backends``): "fused" the transformers backend (alpha from q, k and the fused
        kernel's log-sum-exp), "eager" the bridge's ``hook_pattern``, "auto" the former where it gives what the pass
        reads on this model (on a model loaded with ``backend="nnsight"``: nnsight's traces, ``meta["path"]``
        "nnsight").

    Returns
    -------
    tuple of (SinkResult, list)
        The sink result and each accumulator's result, in order.
    """
    if path not in PATH_BACKENDS:
        raise ValueError(f"path must be 'auto', 'fused' or 'eager'; got {path!r}.")
    tokens = check_tokens(model, tokens)
    accs = list(make_accumulators())
    sink = SinkAccumulator(model, tokens.shape[1], eps=eps, k_max=k_max, kind=kind)
    record: dict = {}
    own = path == "auto" and getattr(model, "pass_backend", None) == "nnsight"  # load_model(..., backend="nnsight")
    res, *rest = run_pass(
        model,
        tokens,
        [sink, *accs],
        batch_size=batch_size,
        progress=progress,
        backend=None if own else PATH_BACKENDS[path],
        record=record,
    )
    fused = record["backend"] == "transformers"
    res.meta.update(
        {
            "path": RAN_PATH[record["backend"]],
            "backend": record["backend"],
            "why": record["why"],
            **({"kernels": record["kernels"]} if record.get("kernels") else {}),
            **{k: record[k] for k in ("requests", "bytes") if k in record},  # a remote nnsight pass's traces
            **(
                {"fused_unsupported": record["why"].removeprefix("auto: ")}
                if not fused and path == "auto" and not own
                else {}
            ),
            "bos": bos_record(model, tokens),
        }
    )
    return res, rest


def sink_table_text(results: dict[str, SinkResult], *, k: int = 1) -> str:
    """Sink_k across input kinds in one sentence.

    Parameters
    ----------
    results : dict of str to SinkResult
        One result per input kind, e.g. ``{"natural": ..., "random": ...}``.
    k : int
        The key position (1: the first token).

    Returns
    -------
    str
    """
    first = next(iter(results.values()))
    rates = [f"{r.sink_rate(k):.1f}% on {kind} inputs" for kind, r in results.items()]
    listed = rates[0] if len(rates) == 1 else ", ".join(rates[:-1]) + " and " + rates[-1]
    return (
        f"Sink_{k} (eps = {first.eps:g}) is {listed} (N = {first.n_samples} sequences of T = {first.T} tokens, no BOS)."
    )


@parameters_from(sink_table_text)
def sink_table(results: dict[str, SinkResult], *, k: int = 1) -> pd.DataFrame:
    """Sink_k (%) for each named result (e.g. natural / random / repeated).

    Parameters
    ----------
    results, k
        As in :func:`sink_table_text`.

    Returns
    -------
    pandas.DataFrame
        Indexed by ``input`` (the names), one column ``Sink_k (%)``.
    """
    return pd.DataFrame(
        {"input": list(results), f"Sink_{k} (%)": [r.sink_rate(k) for r in results.values()]}
    ).set_index("input")


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, Section, register  # noqa: E402


def _with_bos(outputs: list, inputs, got: dict) -> SinkResult:
    """The sink result, recording the first token: a BOS or not, and whether the probe asked for one."""
    res = outputs[0]
    res.meta["bos"] = {**bos_record(inputs.model, inputs.tokens), "asked": getattr(inputs.probe, "bos", None)}
    return res


register(
    Analysis(
        "sink",
        result=SinkResult,
        every_kind=True,
        order=10,
        hooks=("pattern",),
        doc="Input kind -> the sink metric (``alpha`` (N, L, H, k_max)).",
        accumulators=lambda p: [SinkAccumulator(p.model, p.tokens.shape[1], eps=p.eps, k_max=p.k_max, kind=p.kind)],
        finish=_with_bos,
        table=lambda by_kind: sink_table(by_kind).reset_index(),
        sections=(
            Section("Sink metric", "attention", 10, needs=("sink", "gates"), runner="analysis.report.sections:_sink"),
            Section(
                "Attention views (circuitsvis, offline)",
                "attention",
                20,
                key="views",
                needs=("sink",),
                runner="analysis.report.sections:_views",
            ),
        ),
        exports=("SinkResult", "sink_metric", "sink_table"),
    )
)
