"""A secondary sink planted on a tiny random model of every family in the matrix (tests/families.py) is found by
``sink_positions`` at its position, with its heads, its massive activation and the layer it is created at.

The plant, all by temporary hooks on the shared bridge: every query of every attention layer gets a bias ``b`` along
the last dim of its head (the lowest-frequency rotary pair, or a dim the partial rotary leaves alone, so a key hook
taken before the rotary barely turns), the first token's key gets ``b`` along it too, and position ``P`` is given
the first token's key: q_i . k_0 = q_i . k_P then exceed every other score by about ``b^2`` x the family's score
scale (``BIAS`` = 12), so every head splits the attention of its queries i >= P between the two. The first token and position P also get a residual spike after block 0 ({7: +400, 21: -250}), so both
carry a massive activation and P's hidden state is aligned with the first token's from layer 0 on.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.families import FAMILIES

T, P = 11, 3  # every query i >= P sees P through a sliding window of 8 (i - P < 8)
BIAS = 12.0  # q . k bias of the planted keys, in units of the score (after the family's scale)
SPIKE = {7: 400.0, 21: -250.0}


def _plant(model) -> list:
    spec = model.family
    d = spec.d_head - 1
    scale = math.sqrt(BIAS / spec.attn_scale)

    def query(x, hook):
        x = x.clone()
        x[..., d] += scale
        return x

    def key(x, hook):
        x = x.clone()
        x[:, 0, ..., d] += scale
        x[:, P] = x[:, 0]  # the later token gets the first token's key
        return x

    def spike(x, hook):
        x = x.clone()
        for dim, v in SPIKE.items():
            x[:, [0, P], dim] += v
        return x

    hooks = [("blocks.0.hook_resid_post", spike)]
    for l in spec.attention_layers:
        hooks += [(spec.query_hook(l), query), (spec.key_hook(l), key)]
    return hooks


@pytest.mark.parametrize("family", FAMILIES)
def test_planted_secondary_sink_is_found_with_its_heads(family, family_bridge):
    from analysis.positions.every_sink import sink_positions

    model = family_bridge(family)
    spec = model.family
    tokens = torch.randint(3, 96, (2, T), generator=torch.Generator().manual_seed(3))
    with model.hooks(fwd_hooks=_plant(model)):
        res = sink_positions(model, tokens, ratio_threshold=100)  # Gemma scales its embeddings: the median is ~1
    assert res.meta["path"] == "eager"  # hooks attached: "auto" must not skip them
    every_head = sorted((l, h) for l in spec.attention_layers for h in range(spec.n_heads))
    df = res.sinks
    assert set(df.position) == {0, P}, df[["sample", "position", "token", "n_heads"]]
    for r in df[df.position == P].itertuples():
        assert sorted(r.heads) == every_head
        assert min(r.alpha) > res.eps and r.token == res.token(tokens[r.sample, P])
        assert r.massive and set(SPIKE) <= set(r.massive_dims)
        assert r.created_layer == 0 and r.lifetime >= 1
    assert sorted(df[df.position == P]["sample"]) == [0, 1]
    later = res.by_token()
    assert later.n_positions.sum() == 2 and (later.share_massive == 1).all()
