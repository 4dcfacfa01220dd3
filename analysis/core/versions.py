"""Package versions recorded beside every result."""

from __future__ import annotations

import platform
from importlib import metadata

PACKAGES = (
    "attention-sink-lens",
    "torch",
    "transformer-lens",
    "transformers",
    "gguf",
    "circuitsvis",
    "numpy",
    "scikit-learn",
)


def package_versions() -> dict[str, str]:
    """The versions of Python and of the packages results depend on.

    Returns
    -------
    dict of str to str
        Name -> version ("not installed" where missing).
    """
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out
