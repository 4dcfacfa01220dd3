"""Lazy exports for a package's ``__init__`` (PEP 562): ``from analysis import load_model`` imports the module that
defines ``load_model`` when the name is first asked for, so that ``python -m analysis --help`` (which runs
``analysis/__init__.py`` first) answers before torch, transformers and TransformerLens load."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's ``__getattr__`` and ``__dir__`` for names defined in its submodules.

    Parameters
    ----------
    package : str
        The package's ``__name__``.
    exports : dict of str to str
        Exported name -> the module that defines it.

    Returns
    -------
    tuple of (callable, callable)
        ``(__getattr__, __dir__)``, to assign at the package's top level.
    """

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)  # asked once: a plain attribute from then on
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
