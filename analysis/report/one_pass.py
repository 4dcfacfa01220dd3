"""One streamed pass per input kind that feeds every analysis at once: ``analysis.profile(model, probes)``.

The main kind (natural text by default) feeds the sink metric, massive activations, QK angles, the first-key
manifold, value norms and the interventions' shared baseline (loss, attention shares, the first token's
residual stream and values) in the same forward pass; every other kind feeds the sink metric and massive
activations. Each result equals the analysis run alone on the same tokens (``tests/test_profile.py``).

The main pass also keeps the residual stream entering its blocks (``Profile.resid``: every block while they fit in
``resid_budget_mib``, else every s-th), so that later passes over the same tokens (the interventions' conditions,
``norm_gain_trace``) start at the last kept block before the first one they change instead of at the embedding.
The same pass keeps the first token's stream, writes and neurons for ``analysis.chain.spike_writers`` (``Profile.origin``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from analysis.causal.conditions import baseline_accumulators, baseline_from
from analysis.core.defaults import RESID_BUDGET_MIB, SINK_EPS
from analysis.sinks.output_gates import GateAccumulator, has_gate
from analysis.model.hooks import attention_layers_of, bos_record, check_tokens, model_dims
from analysis.chain.key_manifold import key_manifold_accumulator
from analysis.chain.massive import massive_accumulator, spike_criterion
from analysis.engine.passes import ResidCapture, can_resume, checkpoint_layers, run_pass
from analysis.chain.qk import QKAccumulator
from analysis.core.results import Result
from analysis.sinks.metric import SinkAccumulator, sink_table
from analysis.chain.spike_writers import SpikeOriginAccumulator, origin_from
from analysis.chain.values import ValueNormsAccumulator

MAIN_ANALYSES = ("qk", "key_manifold", "value_norms", "baseline", "gates", "resid", "origin")
ANALYSES = ("sink", "massive") + MAIN_ANALYSES


@dataclass
class Profile(Result):
    """Every analysis' result: ``sink`` and ``massive`` per input kind; the others on the main kind only.

    Attributes
    ----------
    sink : dict of str to SinkResult
        Input kind -> the sink metric (``alpha`` (N, L, H, k_max)).
    massive : dict of str to MassiveActivations
        Input kind -> massive activations.
    qk : QKAngles or None
        QK angles on the main kind.
    key_manifold : KeyManifold or None
        The first-key manifold on the main kind.
    value_norms : ValueNorms or None
        Value norms on the main kind.
    baseline : analysis.causal.conditions.Baseline or None
        The interventions' shared baseline on the main kind.
    gates : GateResult or None
        The attention-output gates (gated attention only: Qwen3-Next, Qwen3.5).
    resid : dict of int to torch.Tensor
        Block -> the residual stream entering it on the main kind, shape (N, T, D): the resume points.
    origin : SpikeOrigin or None
        Where the main kind's first-token spike comes from (the spike dims of ``massive``).
    main : str
        The main input kind.
    model_name : str or None
        The model measured.
    n_samples : int
        N, the sequences of the main kind.
    kind : str
        ``main`` (a property).
    results : dict
        Every result with a text, by name ("sink/natural", "massive/random", "key_manifold", ...) (a property).
    """

    sink: dict = field(default_factory=dict)  # kind -> SinkResult
    massive: dict = field(default_factory=dict)  # kind -> MassiveActivations
    qk: object | None = None  # QKAngles
    key_manifold: object | None = None  # KeyManifold
    value_norms: object | None = None  # ValueNorms
    baseline: object | None = None  # conditions.Baseline
    gates: object | None = None  # gates.GateResult (gated attention only: Qwen3-Next, Qwen3.5)
    resid: dict = field(default_factory=dict)  # block -> (N, T, D) residual entering it on the main kind (resume points)
    origin: object | None = None  # spike_origin.SpikeOrigin (the spike dims of massive on the main kind)
    main: str = "natural"
    model_name: str | None = None
    n_samples: int = 0

    @property
    def kind(self) -> str:
        return self.main

    @property
    def results(self) -> dict:
        """Every result with a text, by name ("sink/natural", "massive/random", "key_manifold", ...)."""
        out = {f"sink/{k}": r for k, r in self.sink.items()} | {f"massive/{k}": r for k, r in self.massive.items()}
        return out | {k: getattr(self, k) for k in ("qk", "key_manifold", "value_norms", "gates", "origin")
                      if getattr(self, k) is not None}

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {"sink": sink_table(self.sink).reset_index()} if self.sink else {}

    def findings(self) -> list[str]:
        return [f for r in self.results.values() for f in r.findings()]

    def to_dict(self) -> dict:
        return {**self.header(), "results": {k: r.to_dict() for k, r in self.results.items()}, "text": self.text()}


def _resid_capture(model, tokens, budget_mib: float) -> list:
    """The main pass's resume points (``checkpoint_layers``); none where the model cannot resume a pass."""
    if not can_resume(model):
        return []
    block_bytes = tokens.numel() * model_dims(model).d_model * next(model.parameters()).element_size()
    layers = checkpoint_layers(model_dims(model).n_layers, block_bytes, budget_mib)
    return [ResidCapture(layers)] if layers else []


def _accumulators(model, tokens, kind: str, main: bool, analyses, eps: float, k_max, budget_mib: float,
                  spike: tuple[float, float]) -> dict:
    T = tokens.shape[1]
    layers = attention_layers_of(model)  # the attention analyses run on the attention layers (true indices)
    make = {
        "sink": lambda: [SinkAccumulator(model, T, eps=eps, k_max=k_max, kind=kind)],
        "massive": lambda: [massive_accumulator(model, tokens.shape, abs_threshold=spike[0], ratio_threshold=spike[1],
                                                 kind=kind)],
        "qk": lambda: [QKAccumulator(model, layers=layers, kind=kind)],
        "key_manifold": lambda: [key_manifold_accumulator(model, tokens.shape, kind=kind)],
        "value_norms": lambda: [ValueNormsAccumulator(model, layers, T, kind=kind)],
        "baseline": lambda: baseline_accumulators(model, T, eps=eps),
        # no gate: nothing to run
        "gates": lambda: [GateAccumulator(model, layers=layers, kind=kind)] if has_gate(model) else [],
        "resid": lambda: _resid_capture(model, tokens, budget_mib),
        "origin": lambda: [SpikeOriginAccumulator(model, kind=kind)],
    }
    return {name: make[name]() for name in analyses if main or name not in MAIN_ANALYSES}


def profile(model, probes, *, analyses=ANALYSES, main: str = "natural", eps: float = SINK_EPS,
            k_max: int | None = None, batch_size: int | None = None, progress: bool = False,
            resid_budget_mib: float = RESID_BUDGET_MIB, spike_thresholds: tuple[float, float] | None = None) -> Profile:
    """Every analysis from one streamed pass per input kind.

    Each result equals the analysis run alone on the same tokens (``tests/test_profile.py``).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    probes : dict of str to ProbeSet or torch.Tensor
        {kind: ProbeSet or token ids of shape (N, T)}; must hold ``main``.
    analyses : sequence of str
        Among ``ANALYSES``; those in ``MAIN_ANALYSES`` run on ``probes[main]`` only. ``"origin"`` needs
        ``"massive"``; ``"resid"`` keeps the main kind's residual stream entering its blocks (``Profile.resid``; the
        baseline carries it too, so that its conditions resume).
    main : str
        The main input kind.
    eps : float
        The sink threshold.
    k_max : int, optional
        Keys whose alpha is kept (default min(T, 16)).
    batch_size : int, optional
        Sequences per batch.
    progress : bool
        Show a progress bar over batches.
    resid_budget_mib : float
        The most MiB of residual stream ``"resid"`` keeps (every block while they fit, else every s-th).
    spike_thresholds : tuple of float, optional
        (abs_threshold, ratio_threshold) of the massive activations, and so of the spike dims the spike origin
        traces; None: ``massive.spike_criterion(model)`` (Sun et al.'s, relative only for a model narrower than 256).

    Returns
    -------
    Profile
    """
    bad = [a for a in analyses if a not in ANALYSES]
    if bad:
        raise ValueError(f"unknown analyses {bad}; choose among {list(ANALYSES)}.")
    if "origin" in analyses and "massive" not in analyses:
        raise ValueError("the spike origin traces the spike dims massive activations find: add 'massive' to analyses.")
    if main not in probes:
        raise ValueError(f"the main input kind {main!r} is not among the probes {list(probes)}.")
    out = Profile(main=main, model_name=getattr(model, "model_name", None))
    spike = tuple(spike_thresholds) if spike_thresholds is not None else spike_criterion(model)
    for kind, p in probes.items():
        tokens = check_tokens(model, getattr(p, "tokens", p))
        accs = _accumulators(model, tokens, kind, kind == main, analyses, eps, k_max, resid_budget_mib, spike)
        flat = [a for group in accs.values() for a in group]
        results = iter(run_pass(model, tokens, flat, batch_size=batch_size, progress=progress))
        got = {name: [next(results) for _ in group] for name, group in accs.items()}
        for name in ("sink", "massive"):
            if name in got:
                getattr(out, name)[kind] = got[name][0]
        if "sink" in got:  # the first token: a BOS or not, and whether the probe asked for one
            got["sink"][0].meta["bos"] = {**bos_record(model, tokens), "asked": getattr(p, "bos", None)}
        if kind == main:
            out.n_samples = tokens.shape[0]
            for name in ("qk", "key_manifold", "value_norms", "gates"):
                if got.get(name):
                    setattr(out, name, got[name][0])
            if got.get("resid"):
                out.resid = got["resid"][0]
            if "baseline" in got:
                out.baseline = baseline_from(got["baseline"], resid=out.resid)
            if got.get("origin"):
                out.origin = origin_from(model, got["origin"][0], massive=out.massive[kind], kind=kind)
    return out
