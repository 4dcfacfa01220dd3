"""Parameter docs written once: a function that takes the options of another (an accumulator factory and its public
function, or functions of one module with the same options) names them in its ``Parameters`` as one group, ``a, b, c``
over the line ``As in :func:`source`.``; when the module is imported the source's own entries replace the group (in
the order of the signature), so ``help()`` shows every entry in full while the text stands in one place.

Three ways to say it, by where the functions stand:

- ``@share_parameters(factory)`` on the source, defined after the factories it fills (``massive_activations``);
- ``@parameters_from(source)`` on a function defined after its source (``value_ablation``);
- ``fill_parameters(target, source)`` after both, where a decorator would sit beside a one-line signature.

A group naming an option its source does not document is an error at import.
"""

from __future__ import annotations

import inspect
from typing import Callable


def _is_title(lines: list[str], i: int) -> bool:
    return i + 1 < len(lines) and bool(lines[i].strip()) and set(lines[i + 1].strip()) == {"-"}


def parameter_entries(doc: str | None) -> list[tuple[list[str], list[str]]]:
    """The entries of a numpy-doc ``Parameters`` section, in order.

    Parameters
    ----------
    doc : str or None
        A docstring.

    Returns
    -------
    list of (list of str, list of str)
        Per entry: the names it documents (``a, b : float`` documents a and b; ``**kwargs`` kwargs) and its lines,
        dedented (the ``name : type`` line first).
    """
    lines = inspect.cleandoc(doc or "").splitlines()
    out: list[tuple[list[str], list[str]]] = []
    inside = False
    for i, line in enumerate(lines):
        if _is_title(lines, i):
            inside = line.strip() == "Parameters"
        elif not inside or set(line.strip()) == {"-"}:
            continue
        elif line.strip() and not line.startswith(" "):
            out.append(([n.strip().lstrip("*") for n in line.split(" : ")[0].split(",")], [line]))
        elif out:
            out[-1][1].append(line)
    return [(names, _trim(body)) for names, body in out]


def _trim(body: list[str]) -> list[str]:
    while body and not body[-1].strip():
        body = body[:-1]
    return body


def fill_parameters(target: Callable, source: Callable) -> None:
    """Replace ``target``'s group ``a, b, ...`` / ``As in :func:`source`.`` by ``source``'s entries for those names.

    Parameters
    ----------
    target : callable
        The function whose docstring names the shared options (its ``__doc__`` is rewritten).
    source : callable
        The function whose docstring documents them.

    Returns
    -------
    None
        ValueError where ``target`` has no such group or ``source`` does not document a name of it.
    """
    marker = f"As in :func:`{source.__name__}`."
    lines = (target.__doc__ or "").splitlines()
    at = next((i for i in range(1, len(lines)) if lines[i].strip() == marker), None)
    if at is None or " : " in lines[at - 1]:
        raise ValueError(
            f"{target.__qualname__}'s docstring has no group of names over the line {marker!r}; write "
            f"the shared names there (see analysis.core.docs)."
        )
    names = [n.strip() for n in lines[at - 1].split(",")]
    indent = lines[at - 1][: len(lines[at - 1]) - len(lines[at - 1].lstrip())]
    entries = parameter_entries(source.__doc__)
    missing = [n for n in names if not any(n in e for e, _ in entries)]
    if missing:
        raise ValueError(
            f"{source.__qualname__}'s Parameters do not document {missing}, which {target.__qualname__} takes from it."
        )
    taken = [body for e, body in entries if set(e) & set(names)]
    lines[at - 1 : at + 1] = [indent + line if line.strip() else "" for body in taken for line in body]
    lines = _in_signature_order(lines, indent, list(inspect.signature(target).parameters))
    target.__doc__ = "\n".join(lines) + ("\n" if (target.__doc__ or "").endswith("\n") else "")


def _in_signature_order(lines: list[str], indent: str, params: list[str]) -> list[str]:
    """The docstring ``lines`` with the entries of its Parameters section in the order of ``params``."""
    start = next(i for i, line in enumerate(lines) if line.strip() == "Parameters" and _is_title(lines, i)) + 2
    end = next((i for i in range(start, len(lines)) if _is_title(lines, i)), len(lines))
    entries: list[list[str]] = []
    for line in lines[start:end]:
        if line.startswith(indent) and line.strip() and not line[len(indent)].isspace():
            entries.append([line])
        elif entries:
            entries[-1].append(line)
    while entries and entries[-1][-1].strip() == "" and end < len(lines):  # the blank line before the next section
        entries[-1].pop()

    def rank(entry: list[str]) -> int:
        names = [n.strip().lstrip("*") for n in entry[0].split(" : ")[0].split(",")]
        return min((params.index(n) for n in names if n in params), default=len(params))

    ordered = [line for entry in sorted(entries, key=rank) for line in entry]
    return lines[:start] + ordered + ([""] if end < len(lines) else []) + lines[end:]


def parameters_from(source: Callable) -> Callable:
    """Decorator of a function defined after ``source`` whose docstring names options of ``source`` over the line
    ``As in :func:`source`.``: fills that group with ``source``'s entries at import.

    Parameters
    ----------
    source : callable
        The function whose docstring documents the shared options.

    Returns
    -------
    callable
        The decorator; it returns the function unchanged.
    """

    def decorate(target: Callable) -> Callable:
        fill_parameters(target, source)
        return target

    return decorate


def share_parameters(*targets: Callable) -> Callable:
    """Decorator of the function whose ``Parameters`` are the source: fills each target's shared group at import.

    Parameters
    ----------
    *targets : callable
        Functions defined before the source (the accumulator factories it builds on) whose docstrings name the
        shared options over the line ``As in :func:`source`.``.

    Returns
    -------
    callable
        The decorator; it returns the source unchanged.
    """

    def decorate(source: Callable) -> Callable:
        for target in targets:
            fill_parameters(target, source)
        return source

    return decorate


def model_tokens(model: object, tokens) -> None:
    """The two arguments every analysis takes first, documented once: a function names them ``model, tokens`` over the
    line ``As in :func:`model_tokens`.`` (with ``@parameters_from(model_tokens)``).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    tokens : torch.Tensor, shape (N, T)
        Token ids.

    Returns
    -------
    None
    """


def model_tokens_min2(model: object, tokens) -> None:
    """``model, tokens`` of an analysis that sets the first token against the others, so needs T >= 2: a function names
    them over the line ``As in :func:`model_tokens_min2`.``.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    tokens : torch.Tensor, shape (N, T)
        Token ids, T >= 2.

    Returns
    -------
    None
    """
