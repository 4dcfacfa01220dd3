"""One streamed pass per input kind that feeds every analysis at once: ``analysis.profile(model, probes)``.

The main kind (natural text by default) feeds the sink metric, massive activations, QK angles, the first-key
manifold, value norms and the interventions' shared baseline (loss, attention shares, the first token's
residual stream and values) in the same forward pass; every other kind feeds the sink metric and massive
activations. Each result equals the analysis run alone on the same tokens (``tests/report/test_profile.py``).

The main pass also keeps the residual stream entering its blocks (``Profile.resid``: every block while they fit in
``resid_budget_mib``, else every s-th), so that later passes over the same tokens (the interventions' conditions,
``norm_gain_trace``) start at the last kept block before the first one they change instead of at the embedding.
The same pass keeps the first token's stream, writes and neurons for ``analysis.chain.spike_writers`` (``Profile.origin``).
Two follow-ups of the origin run after the pass when asked for (``follow_ups()``, on the first ``SPIKE_CUT_SAMPLES``
main-kind sequences, only where the first token has a spike): why the first token (``Profile.cause``,
``analysis.chain.first_token_cause``) and the causal cuts of the writer neurons (``Profile.cuts``,
``analysis.causal.writer_cuts``).

Every analysis here is a registered one (``analysis.core.registry``): ``Profile`` has one typed field per registered
pass analysis, in its ``order``, and ``profile`` runs each one's accumulators, ``finish`` and follow-ups. The modules
that register are imported by ``discover()`` (found by reading the package's source), so that adding an analysis
edits no module here.
"""

from __future__ import annotations

import time

import dataclasses
import importlib
from dataclasses import field
from functools import lru_cache
from pathlib import Path

import pandas as pd

from analysis.model.contract import SinkModel
from analysis.core import registry
from analysis.core.defaults import RESID_BUDGET_MIB, SINK_EPS, SPIKE_CUT_SAMPLES
from analysis.core.docs import parameters_from
from analysis.core.registry import Analysis, PassInputs
from analysis.core.results import Result
from analysis.chain.massive import spike_criterion
from analysis.engine.passes import run_pass
from analysis.model.hooks import check_tokens


def discover() -> list[str]:
    """Import every module of the package that registers an analysis (found by reading the source: ``declared``).

    Returns
    -------
    list of str
        The modules, imported.
    """
    modules = list(registry.declared(Path(__file__).resolve().parents[1]))
    for m in modules:
        importlib.import_module(m)
    return modules


discover()


def pass_analyses() -> list[Analysis]:
    """The registered analyses of the profile pass and their follow-ups, in ``order``.

    Returns
    -------
    list of Analysis
    """
    return [a for a in registry.analyses() if a.in_pass]


def __getattr__(name: str):
    """``ANALYSES`` (every pass analysis but the follow-ups), ``MAIN_ANALYSES`` (those run on the main kind only) and
    ``FOLLOW_UPS``, read from the registry when asked for (a test may register one for a while)."""
    if name == "ANALYSES":
        return tuple(a.name for a in pass_analyses() if a.follows is None)
    if name == "MAIN_ANALYSES":
        return tuple(a.name for a in pass_analyses() if a.follows is None and not a.every_kind)
    if name == "FOLLOW_UPS":
        return tuple(a.name for a in pass_analyses() if a.follows is not None)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _field(a: Analysis) -> tuple:
    """``Profile``'s field of an analysis: a dict by kind, its ``empty`` default, or its result or None."""
    rt = a.results[0] if len(a.results) == 1 else object
    if a.every_kind:
        return a.name, dict[str, rt], field(default_factory=dict)
    if a.empty is not None:
        return a.name, rt, field(default_factory=a.empty)
    return a.name, rt | None, field(default=None)


def _attribute_doc(a: Analysis) -> str:
    rt = a.results[0].__name__ if len(a.results) == 1 else "object"
    kind = f"dict of str to {rt}" if a.every_kind else (rt if a.empty is not None else f"{rt} or None")
    return f"{a.name} : {kind}\n    {a.doc}"


_HEAD = """Every analysis' result: those run on every input kind by kind (``sink``, ``massive``), the others on the main
kind only; one field per registered pass analysis (``analysis.core.registry``), in its order.

Attributes
----------
"""
_TAIL = """main : str
    The main input kind.
model_name : str or None
    The model measured.
n_samples : int
    N, the sequences of the main kind.
backend : dict
    Input kind -> {"backend": the backend its pass ran on, "why": why} (``analysis.engine.backends``).
kind : str
    ``main`` (a property).
results : dict
    Every result with a text, by name ("sink/natural", "massive/random", "key_manifold", ...) (a property).
"""


def _results(self) -> dict:
    """Every result with a text, by name ("sink/natural", "massive/random", "key_manifold", ...)."""
    out = {f"{name}/{k}": r for name in self._by_kind for k, r in getattr(self, name).items()}
    return out | {k: getattr(self, k) for k in self._main if getattr(self, k) is not None}


def _tables(self) -> dict[str, pd.DataFrame]:
    return {name: make(getattr(self, name)) for name, make in self._tables_of.items() if getattr(self, name)}


def _findings(self) -> list[str]:
    return [f for r in self.results.values() for f in r.findings()]


def _to_dict(self) -> dict:
    return {
        **self.header(),
        "backend": self.backend,
        "results": {k: r.to_dict() for k, r in self.results.items()},
        "text": self.text(),
    }


def _profile_type(chosen: tuple[Analysis, ...], base: type = Result) -> type:
    """The ``Profile`` dataclass of these analyses (on ``base``: a later registration extends the class)."""
    tail = [
        ("main", str, field(default="natural")),
        ("model_name", str | None, field(default=None)),
        ("n_samples", int, field(default=0)),
        ("backend", dict, field(default_factory=dict)),
    ]
    names = [a.name for a in chosen]
    namespace = {
        "__module__": __name__,
        "__doc__": _HEAD + "".join(_attribute_doc(a) + "\n" for a in chosen) + _TAIL,
        "_analyses": names,
        "_by_kind": [a.name for a in chosen if a.every_kind],
        "_main": [a.name for a in chosen if not a.every_kind and not a.product],
        "_tables_of": {a.name: a.table for a in chosen if a.table is not None},
        "kind": property(lambda self: self.main),  # the input kind: the main one
        "results": property(_results),
        "tables": property(_tables),
        "findings": _findings,
        "to_dict": _to_dict,
    }
    if base is not Result:  # the fields already there stay; the new ones follow them
        namespace.update(
            {k: base.__dict__[k] + v for k, v in namespace.items() if k in ("_analyses", "_by_kind", "_main")}
        )
        namespace["_tables_of"] = base._tables_of | namespace["_tables_of"]
        tail = []
    return dataclasses.make_dataclass("Profile", [_field(a) for a in chosen] + tail, bases=(base,), namespace=namespace)


Profile = _profile_type(tuple(pass_analyses()))


@lru_cache(maxsize=None)
def _extended(extra: tuple[Analysis, ...]) -> type:
    return _profile_type(extra, base=Profile)


def profile_class() -> type:
    """``Profile``, or where analyses were registered after it was built (a test, a notebook), a subclass of it with
    their fields.

    Returns
    -------
    type
    """
    extra = tuple(a for a in pass_analyses() if a.name not in Profile._analyses)
    return _extended(extra) if extra else Profile


@parameters_from(run_pass)
def profile(
    model: SinkModel,
    probes,
    *,
    analyses=None,
    main: str = "natural",
    eps: float = SINK_EPS,
    k_max: int | None = None,
    batch_size: int | None = None,
    progress: bool = False,
    resid_budget_mib: float = RESID_BUDGET_MIB,
    spike_thresholds: tuple[float, float] | None = None,
    follow_up_samples: int = SPIKE_CUT_SAMPLES,
    backend: str | None = None,
) -> Profile:
    """Every analysis from one streamed pass per input kind.

    Each result equals the analysis run alone on the same tokens (``tests/report/test_profile.py``).

    Parameters
    ----------
    model, batch_size, progress
        As in :func:`run_pass`.
    probes : dict of str to ProbeSet or torch.Tensor
        {kind: ProbeSet or token ids of shape (N, T)}; must hold ``main``.
    analyses : sequence of str, optional
        Registered pass analyses and follow-ups (default ``ANALYSES``: every one but the follow-ups); those not run on
        every kind (``MAIN_ANALYSES``) run on ``probes[main]`` only. Each needs those it ``requires``: ``"origin"``
        needs ``"massive"``, the follow-ups ``"cause"`` and ``"cuts"`` need ``"origin"`` and ``"baseline"``;
        ``"resid"`` keeps the main kind's residual stream entering its blocks (``Profile.resid``; the baseline
        carries it too, so that its conditions resume).
    main : str
        The main input kind.
    eps : float
        The sink threshold.
    k_max : int, optional
        Keys whose alpha is kept (default min(T, 16)).
    resid_budget_mib : float
        The most MiB of residual stream ``"resid"`` keeps (every block while they fit, else every s-th).
    spike_thresholds : tuple of float, optional
        (abs_threshold, ratio_threshold) of the massive activations, and so of the spike dims the spike origin
        traces; None: ``massive.spike_criterion(model)`` (Sun et al.'s, relative only for a model narrower than 256).
    follow_up_samples : int
        The main-kind sequences the follow-ups run on (the first ones).
    backend : {"auto", "transformer_lens", "transformers"}, optional
        What runs each kind's pass (``analysis.engine.backends``): "auto" the Hugging Face model in its own attention
        where it gives every hook the chosen analyses read (no T x T map), else the bridge; None: the model's own
        (``load_model(backend=...)``). ``Profile.backend`` records which ran, and why.

    Returns
    -------
    Profile
    """
    chosen = chosen_analyses(tuple(__getattr__("ANALYSES") if analyses is None else analyses))
    if main not in probes:
        raise ValueError(f"the main input kind {main!r} is not among the probes {list(probes)}.")
    out = profile_class()(main=main, model_name=getattr(model, "model_name", None))
    spike = tuple(spike_thresholds) if spike_thresholds is not None else spike_criterion(model)
    for kind, p in probes.items():
        tokens = check_tokens(model, getattr(p, "tokens", p))
        inputs = PassInputs(
            model,
            tokens,
            kind,
            kind == main,
            p,
            eps=eps,
            k_max=k_max,
            spike=spike,
            budget_mib=resid_budget_mib,
            batch_size=batch_size,
            follow_up_samples=follow_up_samples,
        )
        out.backend[kind] = _one_kind(
            out,
            inputs,
            [a for a in chosen if a.accumulators is not None and (a.every_kind or kind == main)],
            progress,
            backend,
        )
        if kind == main:
            out.n_samples = tokens.shape[0]
            for a in chosen:  # the follow-ups: passes of their own after the pass, on the main kind
                if a.follows is not None:
                    setattr(out, a.name, a.run(inputs, out))
    return out


def chosen_analyses(names: tuple[str, ...]) -> list[Analysis]:
    """The registered analyses asked for, in ``order``, each with those it requires (else a one-line error).

    Parameters
    ----------
    names : tuple of str

    Returns
    -------
    list of Analysis
    """
    known = pass_analyses()
    bad = [a for a in names if a not in {k.name for k in known}]
    if bad:
        raise ValueError(f"unknown analyses {bad}; choose among {[k.name for k in known]}.")
    chosen = [a for a in known if a.name in names]
    for a in chosen:
        missing = [r for r in a.requires if r not in names]
        if missing:
            raise ValueError(f"the analysis {a.name!r} starts from {missing}: add {missing} to analyses.")
    return chosen


def _one_kind(out, inputs: PassInputs, chosen: list[Analysis], progress: bool, backend: str) -> dict:
    """One streamed pass over one input kind feeding every chosen analysis; each one's ``finish`` gives its result.
    Returns the backend that ran it, and why."""
    accs = {a.name: list(a.accumulators(inputs)) for a in chosen}
    flat = [acc for group in accs.values() for acc in group]
    record: dict = {}
    t = time.perf_counter()
    results = iter(
        run_pass(
            inputs.model,
            inputs.tokens,
            flat,
            batch_size=inputs.batch_size,
            progress=progress,
            backend=backend,
            record=record,
        )
    )
    record["seconds"] = round(time.perf_counter() - t, 3)  # the pass alone (the follow-ups run passes of their own)
    got = {name: [next(results) for _ in group] for name, group in accs.items()}
    for a in chosen:
        if not got[a.name]:  # nothing to run (no gate in the model, no block to keep): the field's default
            continue
        res = a.finish(got[a.name], inputs, got) if a.finish is not None else got[a.name][0]
        if a.every_kind:
            getattr(out, a.name)[inputs.kind] = res
        else:
            setattr(out, a.name, res)
    return record
