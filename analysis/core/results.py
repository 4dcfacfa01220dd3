"""The one result protocol every analysis follows, and the small formatters results share.

Every result has ``kind`` (the input kind, e.g. "natural", or None), ``model_name``, ``n_samples`` (the
number of sequences), ``tables`` (named DataFrames), ``findings()`` (the finding as a list of whole sentences, each
built as one: the report lays them out one by one and never splits a text), ``caveats()`` (how it was measured, shown as
notes), ``text()`` (those sentences joined: what
the notebooks print) and ``to_dict()`` (strict-JSON-ready). Shares are fractions in [0, 1] everywhere;
``_pct`` in a name marks a percentage. Heads named ``kv_head`` are key/value heads (GQA), ``head`` query heads.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import itertools
from typing import ClassVar, Sequence

import pandas as pd

from analysis.core.io import jsonable


class Result(abc.ABC):
    """The result protocol, an abstract base class every result of the package keeps (``tests/report/test_protocol.py``
    builds each one and checks it).

    Subclasses set ``kind``, ``model_name`` and ``n_samples`` (fields or properties), must define ``findings()`` (a
    list of whole sentences) and name their tables in ``table_fields`` (or define ``tables``); ``text()`` joins the
    findings and ``to_dict()`` writes the header, the fields ``json_fields`` names (the tables by default) and the text.

    Attributes
    ----------
    kind : str or None
        The input kind ("natural", "random", ...).
    model_name : str or None
        The model measured.
    n_samples : int
        N, the number of sequences.
    tables : dict of str to pandas.DataFrame
        Named tables (a property; none by default).
    """

    kind: str | None
    model_name: str | None

    #: The named tables ``tables`` returns, in order: entries as in ``json_fields`` (an attribute's name, a method called
    #: with no argument, or ``"key=name"``), so that a result declares its tables instead of writing the property.
    table_fields: ClassVar[tuple[str, ...]] = ()

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        return dict(self._entry(e) for e in self.table_fields)

    @abc.abstractmethod
    def findings(self) -> list[str]:
        """The finding in words, as a list of whole sentences (each item one or more complete sentences)."""

    def caveats(self) -> list[str]:
        """What a reader must know beside the findings, how the numbers were measured (layers left out, a number
        undefined here): the report shows them as notes. Default: the sentence on the layers left out (``skipped``)
        where the findings say it, which the report then moves out of them."""
        skipped = getattr(self, "skipped", "")
        return [skipped] if isinstance(skipped, str) and skipped and skipped in self.findings() else []

    def text(self) -> str:
        """The findings joined into one paragraph."""
        return " ".join(self.findings())

    def header(self) -> dict:
        return {"model": self.model_name, "kind": self.kind, "n_samples": int(self.n_samples)}

    #: What ``to_dict()`` writes between the header and the text, in order: data, as dataclasses' fields are, so that a
    #: result declares its JSON instead of writing a method. An entry is an attribute's name (a method is called with
    #: no argument), ``"key=name"`` to write attribute ``name`` under ``key``, ``"name?"`` to leave it out when it is
    #: empty, or ``"*name"`` for each item of the dict ``name`` (``"*tables"``: every named table). Default: the tables.
    json_fields: ClassVar[tuple[str, ...]] = ("*tables",)
    #: Whether ``to_dict()`` starts with the header (model, kind, n_samples).
    json_header: ClassVar[bool] = True

    def to_dict(self) -> dict:
        """The header, the ``json_fields`` and the text, each value made strict JSON by ``jsonable``."""
        out = self.header() if self.json_header else {}
        for entry in self.json_fields:
            key, value = self._entry(entry)
            if entry.startswith("*"):
                out.update(value)
            elif not entry.endswith("?") or value:
                out[key] = value
        return jsonable({**out, "text": self.text()})

    def _entry(self, entry: str) -> tuple[str, object]:
        """(key, value) of a ``json_fields`` / ``table_fields`` entry."""
        key, _, name = entry.strip("*?").partition("=")
        value = getattr(self, name or key)
        return key, value() if inspect.ismethod(value) else value

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__repr__" not in cls.__dict__:  # set before @dataclass runs, so that its field-dump repr is not generated
            cls.__repr__ = Result.__repr__

    def __repr__(self) -> str:
        """One or two lines: the kind of result, the model, N, T and the headline (``text()`` holds the findings)."""
        try:
            headline = self.findings()[0]
        except Exception:  # a repr never raises: the headline is left out
            headline = ""
        return _short_repr(
            self,
            headline=headline,
            model=self.model_name,
            kind=self.kind,
            N=getattr(self, "n_samples", None),
            T=getattr(self, "T", None),
        )


class MappingResult(dict, Result):
    """A result that is also the dict its analysis returned before it kept the protocol: ``r["sink_1"]``, ``r.items()``
    and ``dict(r)`` work as before, and ``findings()`` / ``text()`` / ``to_dict()`` / ``tables`` as for every result.

    Subclasses define ``findings()``; ``tables`` holds the numbers as a table ``values`` (name, value).

    Attributes
    ----------
    kind : str or None
        The input kind.
    model_name : str or None
        The model measured.
    n_samples : int
        N, the number of sequences.
    tables : dict of str to pandas.DataFrame
        ``values``: one row per number of the dict (name, value).
    """

    def __init__(self, values: dict, *, model_name: str | None = None, n_samples: int = 0, kind: str | None = None):
        super().__init__(values)
        self.model_name, self.n_samples, self.kind = model_name, int(n_samples), kind

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        numbers = {k: v for k, v in self.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return {"values": pd.DataFrame({"name": list(numbers), "value": [float(v) for v in numbers.values()]})}

    def __reduce__(self):  # pickle / copy: the dict, the header and any attribute a subclass adds
        return (_mapping_result, (type(self), dict(self), self.model_name, self.n_samples, self.kind), vars(self))


def _mapping_result(cls, values, model_name, n_samples, kind):
    return cls(values, model_name=model_name, n_samples=n_samples, kind=kind)


def _short_repr(obj, *, headline: str = "", width: int = 160, **fields) -> str:
    """A repr of one or two lines: the class, the named fields that are set, and a headline cut to ``width``.

    ``fields`` are short facts (model, kind, N, T ...); None values are left out.
    """
    facts = ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in fields.items() if v is not None)
    head = f"<{type(obj).__name__} {facts}>" if facts else f"<{type(obj).__name__}>"
    headline = " ".join(str(headline).split())
    if len(headline) > width:
        headline = headline[: width - 3].rstrip() + "..."
    return head + (f"\n  {headline}" if headline else "")


def pass_options(*, batch_size: int | None = None, kind: str | None = None) -> dict:
    """A streamed analysis's pass options, documented once: ``batch_size, kind`` / ``As in :func:`pass_options`.``.

    Parameters
    ----------
    batch_size : int, optional
        Sequences per batch (default: ``analysis.engine.passes.default_batch_size``).
    kind : str, optional
        The input kind, a label ("natural", "random").

    Returns
    -------
    dict
    """
    return {"batch_size": batch_size, "kind": kind}


class LayerAxis:
    """Mixin of results whose tensors have a layer axis L over ``layers``, the TRUE indices of the layers measured (all
    layers of a plain transformer; a hybrid's attention layers only, ``skipped`` saying which were left out).

    Attributes
    ----------
    layers : list of int, length L
        The true layer index of each position on the layer axis.
    skipped : str
        The layers left out and why, in one sentence; "" when none.
    """

    layers: list[int]
    skipped: str

    def pos(self, layer: int) -> int:
        """The position of true layer index ``layer`` on the layer axis (ValueError if it was not measured)."""
        if int(layer) not in self.layers:
            raise ValueError(
                f"layer {layer} was not measured; this result holds layers {self.layers}"
                f"{' (' + self.skipped.rstrip('.') + ')' if self.skipped else ''}."
            )
        return self.layers.index(int(layer))

    def positions(self, layers: Sequence[int]) -> list[int]:
        """The positions of true layer indices ``layers`` on the layer axis."""
        return [self.pos(l) for l in layers]


def runs(layers: Sequence[int]) -> list[list[int]]:
    """Runs of consecutive layers: [2, 3, 4, 7] -> [[2, 3, 4], [7]].

    Parameters
    ----------
    layers : sequence of int

    Returns
    -------
    list of list of int
    """
    ordered = sorted(int(l) for l in layers)  # a run: the layers whose index minus their rank is the same
    return [[l for _, l in run] for _, run in itertools.groupby(enumerate(ordered), lambda il: il[1] - il[0])]


def layer_runs(layers: Sequence[int]) -> str:
    """Layers as runs in words: [2, 3, 4, 7] -> '2-4, 7'.

    Parameters
    ----------
    layers : sequence of int

    Returns
    -------
    str
    """
    return ", ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs(layers))


def layers_text(layers: Sequence[int]) -> str:
    """Layers in words: [3, 4, 5, 9] -> 'layers 3-5, 9'; [2] -> 'layer 2'.

    Parameters
    ----------
    layers
        As in :func:`layer_runs`.

    Returns
    -------
    str
    """
    return ("layer " if len(layers) == 1 else "layers ") + layer_runs(layers)


def dims_by_layer_text(spikes: dict[int, list[int]]) -> str:
    """Spike dims by layer in words: {0: [7], 1: [7, 21]} -> 'dim 7 at layers 0-1; dim 21 at layer 1'.

    Parameters
    ----------
    spikes : dict of int to list of int
        {layer: dims}.

    Returns
    -------
    str
    """
    by_dim: dict[int, list[int]] = {}
    for l, ds in spikes.items():
        for d in ds:
            by_dim.setdefault(d, []).append(l)
    return "; ".join(f"dim {d} at {layers_text(ls)}" for d, ls in sorted(by_dim.items()))


def compact_repr(obj, *, width: int = 200) -> str:
    """A one-line repr of a dataclass that holds tensors: its scalar fields, and the shape of each tensor, array or
    table (never their values).

    Parameters
    ----------
    obj : object
        A dataclass instance.
    width : int
        The most characters of the line.

    Returns
    -------
    str
    """

    parts = []
    for f in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else []:
        v = getattr(obj, f.name, None)
        if hasattr(v, "shape") and not isinstance(v, (int, float)):
            parts.append(f"{f.name}: {tuple(v.shape)}")
        elif isinstance(v, (bool, int, float, str)) or v is None:
            text = repr(v)
            parts.append(f"{f.name}={text if len(text) <= 40 else text[:37] + '...'}")
        elif isinstance(v, (list, tuple, dict, set)):
            parts.append(f"{f.name}: {len(v)} items")
    line = f"<{type(obj).__name__} " + ", ".join(parts) + ">"
    return line if len(line) <= width else line[: width - 4] + "...>"
