"""The spike writers through nnsight (``load_nnsight``: the traces a remote model runs on NDIF, run here): the MLP
spec and weights read from the Hugging Face modules equal the bridge's, and the report's spike-writers section (its
origin, first-token cause and writer cuts, their reads, neuron sets and loss in the traces) equals the bridge's, on
tiny Llama and Gemma 2 (a norm on each write). About 20 s (the tiny families' first load included)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nnsight")

from analysis.model.loading import load_nnsight  # noqa: E402
from analysis.model.mlp_spec import get_mlp, mlp_weights  # noqa: E402

FAMILIES = ["llama", "gemma2"]  # a plain block, and one whose writes pass a norm before they add
HOOKS = ("neuron_hook", "gate_hook", "up_hook")  # the bridge's canonical names; nnsight's are their aliases


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mlp_spec_and_weights_of_an_nnsight_model_are_the_bridges(family, family_bridge, family_dir):
    bridge, nn = family_bridge(family), load_nnsight(str(family_dir(family)))
    want, got = get_mlp(bridge).to_dict(), get_mlp(nn).to_dict()
    assert {k: v for k, v in got.items() if k not in HOOKS} == {k: v for k, v in want.items() if k not in HOOKS}
    assert got["kind"] == "gated" and got["input_norm"]["module"]  # measured, not defaulted
    for layer in (0, 1):
        w, g = mlp_weights(bridge, layer), mlp_weights(nn, layer)
        for name, x in vars(w).items():
            y = getattr(g, name)
            assert y == x if not isinstance(x, torch.Tensor) else torch.equal(y, x), name
