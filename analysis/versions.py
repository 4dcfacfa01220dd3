"""Package versions recorded beside every result."""
from __future__ import annotations

import platform
from importlib import metadata

PACKAGES = ("attention-sink-lens", "torch", "transformer-lens", "transformers", "gguf", "circuitsvis", "numpy", "scikit-learn")


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out
