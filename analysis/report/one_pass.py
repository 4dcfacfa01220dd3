"""One streamed pass per input kind that feeds every analysis at once: ``analysis.profile(model, probes)``.

The main kind (natural text by default) feeds the sink metric, massive activations, QK angles, the first-key
manifold, value norms and the interventions' shared baseline (loss, attention shares, the first token's
residual stream and values) in the same forward pass; every other kind feeds the sink metric and massive
activations. Each result equals the analysis run alone on the same tokens (``tests/test_profile.py``).

The main pass also keeps the residual stream entering its blocks (``Profile.resid``: every block while they fit in
``resid_budget_mib``, else every s-th), so that later passes over the same tokens (the interventions' conditions,
``norm_gain_trace``) start at the last kept block before the first one they change instead of at the embedding.
The same pass keeps the first token's stream, writes and neurons for ``analysis.chain.spike_writers`` (``Profile.origin``).
Two follow-ups of the origin run after the pass when asked for (``FOLLOW_UPS``, on the first ``SPIKE_CUT_SAMPLES``
main-kind sequences, only where the first token has a spike): why the first token (``Profile.cause``,
``analysis.chain.first_token_cause``) and the causal cuts of the writer neurons (``Profile.cuts``,
``analysis.causal.writer_cuts``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from analysis.causal.conditions import baseline_accumulators, baseline_from
from analysis.core.defaults import RESID_BUDGET_MIB, SINK_EPS, SPIKE_CUT_SAMPLES
from analysis.sinks.output_gates import GateAccumulator
from analysis.model.hooks import bos_record, check_tokens
from analysis.chain.key_manifold import key_manifold_accumulator
from analysis.chain.massive import massive_accumulator, spike_criterion
from analysis.engine.passes import ModelFacts, ResidCapture, can_resume, checkpoint_layers, model_facts, run_pass
from analysis.chain.qk import QKAccumulator
from analysis.core.results import Result
from analysis.sinks.metric import SinkAccumulator, sink_table
from analysis.chain.first_token_trace import SpikeOriginAccumulator
from analysis.chain.spike_writers import origin_from
from analysis.chain.values import ValueNormsAccumulator
from analysis.chain.first_token_cause import why_first_token
from analysis.causal.writer_cuts import spike_cuts

MAIN_ANALYSES = ("qk", "key_manifold", "value_norms", "baseline", "gates", "resid", "origin")
ANALYSES = ("sink", "massive") + MAIN_ANALYSES
# Follow-ups of the origin: passes of their own after the profile pass, on the main kind, asked for by name only.
FOLLOW_UPS = ("cause", "cuts")


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
    cause : FirstTokenCause or None
        Why the first token: what feeds the main writer neurons (follow-up "cause"; None without a spike).
    cuts : SpikeCuts or None
        The spike, Sink_1 and the loss with the writer or eraser neurons cut (follow-up "cuts"; None without a spike).
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
    origin: object | None = None  # spike_writers.SpikeOrigin (the spike dims of massive on the main kind)
    cause: object | None = None  # first_token_cause.FirstTokenCause (follow-up)
    cuts: object | None = None  # writer_cuts.SpikeCuts (follow-up)
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
        return out | {k: getattr(self, k) for k in ("qk", "key_manifold", "value_norms", "gates", "origin", "cause", "cuts")
                      if getattr(self, k) is not None}

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return {"sink": sink_table(self.sink).reset_index()} if self.sink else {}

    def findings(self) -> list[str]:
        return [f for r in self.results.values() for f in r.findings()]

    def to_dict(self) -> dict:
        return {**self.header(), "results": {k: r.to_dict() for k, r in self.results.items()}, "text": self.text()}


def _resid_capture(model, tokens, budget_mib: float, facts: ModelFacts) -> list:
    """The main pass's resume points (``checkpoint_layers``); none where the model cannot resume a pass."""
    if not can_resume(model):
        return []
    block_bytes = tokens.numel() * facts.dims.d_model * next(model.parameters()).element_size()
    layers = checkpoint_layers(facts.dims.n_layers, block_bytes, budget_mib)
    return [ResidCapture(layers)] if layers else []


def _accumulators(model, tokens, kind: str, main: bool, analyses, eps: float, k_max, budget_mib: float,
                  spike: tuple[float, float], facts: ModelFacts) -> dict:
    """The accumulators of one pass, each handed the model's facts the profile read once."""
    T = tokens.shape[1]
    layers = list(facts.attention_layers)  # the attention analyses run on the attention layers (true indices)
    make = {
        "sink": lambda: [SinkAccumulator(model, T, eps=eps, k_max=k_max, kind=kind, facts=facts)],
        "massive": lambda: [massive_accumulator(model, tokens.shape, abs_threshold=spike[0], ratio_threshold=spike[1],
                                                 kind=kind, facts=facts)],
        "qk": lambda: [QKAccumulator(model, kind=kind, facts=facts)],
        "key_manifold": lambda: [key_manifold_accumulator(model, tokens.shape, kind=kind, facts=facts)],
        "value_norms": lambda: [ValueNormsAccumulator(model, layers, T, kind=kind, facts=facts)],
        "baseline": lambda: baseline_accumulators(model, T, eps=eps, facts=facts),
        # no gate: nothing to run
        "gates": lambda: [GateAccumulator(model, kind=kind, facts=facts)] if facts.family.gate is not None else [],
        "resid": lambda: _resid_capture(model, tokens, budget_mib, facts),
        "origin": lambda: [SpikeOriginAccumulator(model, kind=kind, facts=facts)],
    }
    return {name: make[name]() for name in analyses if name in make and (main or name not in MAIN_ANALYSES)}


def profile(model, probes, *, analyses=ANALYSES, main: str = "natural", eps: float = SINK_EPS,
            k_max: int | None = None, batch_size: int | None = None, progress: bool = False,
            resid_budget_mib: float = RESID_BUDGET_MIB, spike_thresholds: tuple[float, float] | None = None,
            follow_up_samples: int = SPIKE_CUT_SAMPLES) -> Profile:
    """Every analysis from one streamed pass per input kind.

    Each result equals the analysis run alone on the same tokens (``tests/test_profile.py``).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    probes : dict of str to ProbeSet or torch.Tensor
        {kind: ProbeSet or token ids of shape (N, T)}; must hold ``main``.
    analyses : sequence of str
        Among ``ANALYSES`` and ``FOLLOW_UPS``; those in ``MAIN_ANALYSES`` run on ``probes[main]`` only. ``"origin"``
        needs ``"massive"``, the follow-ups ``"cause"`` and ``"cuts"`` need ``"origin"`` (``"cuts"`` also
        ``"baseline"``); ``"resid"`` keeps the main kind's residual stream entering its blocks (``Profile.resid``; the
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
    follow_up_samples : int
        The main-kind sequences the follow-ups run on (the first ones).

    Returns
    -------
    Profile
    """
    bad = [a for a in analyses if a not in ANALYSES + FOLLOW_UPS]
    if bad:
        raise ValueError(f"unknown analyses {bad}; choose among {list(ANALYSES + FOLLOW_UPS)}.")
    if "origin" in analyses and "massive" not in analyses:
        raise ValueError("the spike origin traces the spike dims massive activations find: add 'massive' to analyses.")
    if any(a in analyses for a in FOLLOW_UPS) and not {"origin", "baseline"} <= set(analyses):
        raise ValueError("the follow-ups 'cause' and 'cuts' start from the spike origin and the baseline: add 'massive', "
                         "'origin' and 'baseline' to analyses.")
    if main not in probes:
        raise ValueError(f"the main input kind {main!r} is not among the probes {list(probes)}.")
    out = Profile(main=main, model_name=getattr(model, "model_name", None))
    spike = tuple(spike_thresholds) if spike_thresholds is not None else spike_criterion(model)
    facts = model_facts(model)  # read once, handed to every accumulator of every pass
    for kind, p in probes.items():
        tokens = check_tokens(model, getattr(p, "tokens", p))
        accs = _accumulators(model, tokens, kind, kind == main, analyses, eps, k_max, resid_budget_mib, spike, facts)
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
            _follow_ups(model, tokens, out, analyses, follow_up_samples, batch_size)
    return out


def _follow_ups(model, tokens, out: Profile, analyses, n: int, batch_size: int | None) -> None:
    """Why the first token and the writer cuts, from the main kind's spike origin (where the first token has a spike)."""
    if out.origin is None or not out.origin.has_spike:
        return
    if "cause" in analyses:
        out.cause = why_first_token(model, tokens[:n], out.origin, batch_size=batch_size)
    if "cuts" in analyses:
        out.cuts = spike_cuts(model, tokens, out.origin, baseline=out.baseline, max_samples=n, batch_size=batch_size)
