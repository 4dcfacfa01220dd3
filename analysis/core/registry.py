"""The registry of analyses: each analysis module declares itself once, at its bottom, with ``register(Analysis(...))``.

What is built from it: ``analysis.profile`` and ``Profile`` (one typed field per registered pass analysis, in
``order``), the report's sections and their order (``Section.order``), the package's public exports
(``Analysis.exports``) and the protocol test's builders. A section shows its result through the protocol (its
findings, its tables, the figures it declares: ``analysis.report.sections.generic``) and names a runner only where it
does more. The figures and the report sit above the analyses, so a declaration names its figures and any runner by
dotted path (``"analysis.figures.value_norms:plot_value_norms"``), resolved only when the report runs (``resolve``). A test or a notebook adds an analysis for a while with ``registered(...)``.

The registry sits on the bottom floor and imports nothing of the package: the report's floor imports the modules
that register (``analysis.report.one_pass.discover``); ``declared()`` reads the declarations from the source, so that
``import analysis`` stays light.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

_MARK = re.compile(r"^register\(\s*Analysis\(", re.MULTILINE)  # a registration's start, in any layout of its lines


@dataclass(frozen=True)
class PassInputs:
    """What an accumulator factory of the profile pass is handed: one input kind's pass.

    Attributes
    ----------
    model
        The model measured.
    tokens : torch.Tensor
        The kind's token ids, shape (N, T).
    kind : str
        The input kind.
    main : bool
        Whether it is the main kind.
    probe
        The probe as given (a ProbeSet or the tokens).
    eps : float
        The sink threshold.
    k_max : int or None
        Keys whose alpha is kept.
    spike : tuple of float
        (abs_threshold, ratio_threshold) of the massive activations.
    budget_mib : float
        The most MiB of residual stream kept.
    batch_size : int or None
        Sequences per batch.
    follow_up_samples : int
        The main-kind sequences the follow-ups run on.
    """

    model: Any  # an analysis.model.contract.SinkModel (the registry sits on the floor below the model contract)
    tokens: Any
    kind: str
    main: bool
    probe: Any = None
    eps: float = 0.3
    k_max: int | None = None
    spike: tuple = (100.0, 1000.0)
    budget_mib: float = 0.0
    batch_size: int | None = None
    follow_up_samples: int = 0


@dataclass(frozen=True)
class Section:
    """An analysis' section of the report.

    Attributes
    ----------
    title : str
        Its heading.
    link : str
        The link of the chain its findings go to (``analysis.report.html.LINKS``).
    order : int
        Its place on the page (lower first).
    key : str or None
        Its name in the report and its JSON (default: the analysis' name).
    needs : tuple of str or None
        The pass analyses it reads (default: the analysis itself, where it runs in the pass).
    runner : str or callable or None
        ``"module:function"`` or a function ``(ctx, sec)`` for a section that does more than show its result (runs
        its analysis outside the pass, reads several results, adds text); None: ``analysis.report.sections.generic``
        shows the result's findings (its ``caveats()`` as notes), its tables, its figures and
        its ``to_dict()``.
    figures : tuple of (str or callable, str)
        The figures ``generic`` draws of the result: ``("module:function", caption)``, the function taking the result
        (a section with a runner draws its own).
    tables : tuple of str or None
        The result's tables ``generic`` shows, by name (None: every one; ``to_dict()`` holds them all).
    """

    title: str
    link: str
    order: int
    key: str | None = None
    needs: tuple[str, ...] | None = None
    runner: str | Callable | None = None
    figures: tuple[tuple[str | Callable, str], ...] = ()
    tables: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.runner is not None and (self.figures or self.tables is not None):
            raise ValueError(
                f"section {self.title!r} names a runner, which lays out its own figures and tables: "
                "declare figures= and tables= only on a section without one."
            )


@dataclass(frozen=True)
class Analysis:
    """One analysis, declared once by its module.

    Attributes
    ----------
    name : str
        Its name: the ``Profile`` field, the ``analyses`` option of ``profile``.
    result : type or tuple of type
        What it returns (a ``analysis.core.results.Result``; a pass product such as the residual stream: its type).
    doc : str
        One line: what the ``Profile`` field holds.
    accumulators : callable or None
        ``accumulators(inputs: PassInputs) -> list`` of accumulators for the profile pass; None: it runs outside it
        (its section's runner calls it).
    hooks : tuple of str
        The activations its accumulators read, by the keys they give them in ``hooks()`` (``pattern``, ``resid``,
        ``q``, ...; checked against the accumulators by ``tests/core/test_registry.py``).
    finish : callable or None
        ``finish(outputs, inputs, got) -> result``: the accumulators' outputs to its result (``got``: every
        analysis' outputs of the pass, by name); None: the first output.
    every_kind : bool
        Runs on every input kind (a dict by kind in ``Profile``), else on the main kind only.
    requires : tuple of str
        The analyses it reads, which must be asked for with it.
    follows : str or None
        The analysis it follows up: it runs after the pass, on the main kind, asked for by name only.
    run : callable or None
        A follow-up's ``run(inputs, profile) -> result or None``.
    product : bool
        A pass product others read (the baseline, the residual stream), not a result in ``Profile.results``.
    empty : callable or None
        The ``Profile`` field's default factory where it is not None (``dict`` for the residual stream).
    table : callable or None
        ``table(by_kind) -> DataFrame``: its table in ``Profile.tables`` (analyses run on every kind).
    order : int
        Its place in the profile pass and in ``Profile``'s fields (lower first).
    sections : tuple of Section
        Its sections of the report (each declares the figures it draws).
    exports : tuple of str
        The names ``analysis`` exports from its module.
    module : str
        The module that registered it (set by ``register``).
    """

    name: str
    result: type | tuple
    doc: str
    accumulators: Callable | None = None
    hooks: tuple[str, ...] = ()
    finish: Callable | None = None
    every_kind: bool = False
    requires: tuple[str, ...] = ()
    follows: str | None = None
    run: Callable | None = None
    product: bool = False
    empty: Callable | None = None
    table: Callable | None = None
    order: int = 1000
    sections: tuple[Section, ...] = ()
    exports: tuple[str, ...] = ()
    module: str = field(default="", compare=False)

    @property
    def in_pass(self) -> bool:
        """Whether it runs in the profile pass (an accumulator factory) or after it (a follow-up)."""
        return self.accumulators is not None or self.follows is not None

    @property
    def results(self) -> tuple:
        """Its result types, as a tuple."""
        return self.result if isinstance(self.result, tuple) else (self.result,)


_REGISTRY: dict[str, Analysis] = {}


def register(analysis: Analysis) -> Analysis:
    """Add an analysis to the registry (once per name), recording the module that registers it.

    Parameters
    ----------
    analysis : Analysis

    Returns
    -------
    Analysis
        As registered (with its module).
    """
    if analysis.name in _REGISTRY:
        raise ValueError(
            f"an analysis named {analysis.name!r} is already registered (by "
            f"{_REGISTRY[analysis.name].module}); pick another name."
        )
    if analysis.module == "":
        caller = inspect.currentframe().f_back
        object.__setattr__(analysis, "module", caller.f_globals.get("__name__", "") if caller else "")
    _REGISTRY[analysis.name] = analysis
    return analysis


@contextlib.contextmanager
def registered(*new: Analysis) -> Iterator[tuple[Analysis, ...]]:
    """Register analyses for the duration of a ``with`` block (a test, a notebook cell), then unregister them.

    Parameters
    ----------
    *new : Analysis

    Yields
    ------
    tuple of Analysis
    """
    done = []
    try:
        for a in new:
            if a.module == "":  # declared in a test or a notebook: the module of its result
                object.__setattr__(a, "module", a.results[0].__module__)
            done.append(register(a))
        yield tuple(done)
    finally:
        for a in done:
            _REGISTRY.pop(a.name, None)


def analyses() -> list[Analysis]:
    """Every registered analysis, in ``order``.

    Returns
    -------
    list of Analysis
    """
    return sorted(_REGISTRY.values(), key=lambda a: (a.order, a.name))


def get(name: str) -> Analysis:
    """The registered analysis ``name``.

    Parameters
    ----------
    name : str

    Returns
    -------
    Analysis
    """
    return _REGISTRY[name]


def sections() -> list[tuple[Analysis, Section]]:
    """Every registered section with its analysis, in page order.

    Returns
    -------
    list of tuple of (Analysis, Section)
    """
    out = [(a, s) for a in _REGISTRY.values() for s in a.sections]
    return sorted(out, key=lambda p: (p[1].order, section_key(*p)))


def section_key(analysis: Analysis, section: Section) -> str:
    """A section's name: its own key, else its analysis' name.

    Parameters
    ----------
    analysis : Analysis
    section : Section

    Returns
    -------
    str
    """
    return section.key or analysis.name


def section_needs(analysis: Analysis, section: Section) -> tuple[str, ...]:
    """The pass analyses a section reads: its own ``needs``, else its analysis where that runs in the pass.

    Parameters
    ----------
    analysis : Analysis
    section : Section

    Returns
    -------
    tuple of str
    """
    if section.needs is not None:
        return section.needs
    return (analysis.name,) if analysis.in_pass else ()


def resolve(ref: str | Callable) -> Callable:
    """A ``"module:function"`` reference (a runner or a figure on a floor above the analyses) as the function.

    Parameters
    ----------
    ref : str or callable

    Returns
    -------
    callable
    """
    return ref if callable(ref) else pkgutil.resolve_name(ref)


def _declared_exports(tree: ast.Module) -> tuple[str, ...]:
    """The names the module-level ``register(Analysis(..., exports=(...)))`` calls of a parsed module export."""
    names: list[str] = []
    for stmt in tree.body:
        match stmt:
            case ast.Expr(ast.Call(ast.Name("register"), [ast.Call(ast.Name("Analysis"), keywords=keywords), *_])):
                names += [n for kw in keywords if kw.arg == "exports" for n in ast.literal_eval(kw.value)]
    return tuple(names)


def declared(root: str | Path) -> dict[str, tuple[str, ...]]:
    """The modules under ``root`` that register an analysis, with the names each exports, read from their source
    (nothing imported): what ``analysis``'s lazy exports and the report's discovery read.

    Parameters
    ----------
    root : path-like
        The package's folder (``analysis/``).

    Returns
    -------
    dict of str to tuple of str
        Module -> its exported names.
    """
    root = Path(root)
    out: dict[str, tuple[str, ...]] = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if not (found := _MARK.search(text)):  # most modules register nothing
            continue
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        tail = ast.parse(text[found.start() :])  # the registrations, at the module's bottom: only they are parsed
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = _declared_exports(tail)
    return out
