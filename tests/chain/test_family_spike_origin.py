"""Where the spike comes from, on a tiny model of every family (tests/families.py) with a writer planted by hand.

The writer is one MLP neuron of block 0 that fires on the first token only and writes a large value into one
residual dimension: its output column of W_out is set to that dimension alone (and no other neuron writes there), by
weights, and a permanent hook on the neuron's activation (``MlpSpec.neuron_hook``) makes it fire on position 0 only,
as tests/planted.py plants its spike. Where the MLP's output passes a post-norm (Gemma 2/3, OLMo-2) the norm's gain
on that dimension is raised, so that the normalised write is still massive; Granite's residual multiplier scales it.
``spike_origin`` must find the dimension, name block 0's MLP as its writer and, inside it, that neuron, with the
bookkeeping adding up; ``why_first_token``'s decomposition of its pre-activations must add up to the hooks', and
zeroing it on the first token (``spike_cuts``) must remove the spike while a random neuron does not. Mixture-of-experts blocks (gpt-oss, Qwen3-Next) hold no neuron hook: there the spike is added
on the block's output by a hook, and the analysis names the block and says the write is none of its experts'.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from analysis import load_model
from analysis.model.mlp_spec import get_mlp, mlp_projections
from analysis.chain.first_token_cause import why_first_token
from analysis.causal.writer_cuts import spike_cuts
from analysis.chain.spike_writers import spike_origin
from tests.conftest import tol
from tests.families import FAMILIES, layout

BLOCK, NEURON, DIM, WRITE = 0, 5, 11, 1000.0
N, T = 3, 12


def plant_writer(model, block: int = BLOCK, neuron: int = NEURON, dim: int = DIM, write: float = WRITE) -> None:
    """Make ``neuron`` of ``block``'s MLP fire on the first token only and write ``write`` into ``dim`` alone."""
    spec = get_mlp(model)
    D = int(model.cfg.d_model)
    if not spec.has_neurons(block):

        def add(x, hook):
            x = x.clone()
            x[:, 0, dim] += write
            return x

        model.add_perma_hook(f"blocks.{block}.hook_mlp_out", add)
        return
    out = mlp_projections(model.blocks[block].mlp)["out"]  # mlp.out, or mlp.dense_out (Jamba's dense blocks)
    with torch.no_grad():
        w = out.weight
        if w.shape[0] == D:  # nn.Linear: (d_model, d_mlp)
            w[dim, :] = 0.0
            w[:, neuron] = 0.0
            w[dim, neuron] = 1.0
        else:  # GPT-2's Conv1D: (d_mlp, d_model)
            w[:, dim] = 0.0
            w[neuron, :] = 0.0
            w[neuron, dim] = 1.0
        if getattr(out, "bias", None) is not None:
            out.bias[dim] = 0.0
        value = write / spec.output_scale
        if spec.output == "post_norm":  # normalised: the write is about gain x sqrt(d_model); raise the gain
            norm = model.blocks[block].ln2_post.original_component
            gain = write / D**0.5
            norm.weight[dim] = gain - spec.output_norm.gain_offset
            value = 100.0

    def fire(a, hook):
        a = a.clone()
        a[:, 0, neuron] = value
        a[:, 1:, neuron] = 0.0
        return a

    model.add_perma_hook(spec.neuron_hook(block), fire)


@pytest.fixture(scope="module")
def planted_models(family_dir, device):
    cache = {}

    def get(family):
        if family not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = load_model(str(family_dir(family)), device=device)  # its own copy: the weights and hooks change
            plant_writer(model)
            cache[family] = model
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_planted_writer_is_found_with_its_block_and_neuron(family, planted_models, device):
    model = planted_models(family)
    tokens = torch.randint(3, 96, (N, T), generator=torch.Generator().manual_seed(0))
    o = spike_origin(model, tokens, ratio_threshold=100)  # 100x: Gemma's residual median is ~1 (sqrt(d) embedding)
    assert DIM in o.dims
    w = o.writers(DIM)
    assert list(w[w.component == "mlp"].block) == [BLOCK] and o.writing_blocks(DIM) == [BLOCK]
    assert float(o.values(DIM)[:, BLOCK + 1].mean()) == pytest.approx(WRITE, rel=0.05)
    assert float(o.bookkeeping.set_index("dim").loc[DIM, "rel_err"]) < 1e-5
    assert f"MLP {BLOCK}" in o.text()
    if BLOCK in layout(family)["moe"]:  # no hook holds the experts' neurons: the block and its experts are named
        (e,) = [e for e in o.experts if e.dim == DIM]
        left = e.table.set_index("expert").loc["unaccounted", "mean_write"]
        assert left == pytest.approx(WRITE, rel=1e-3) and "no neuron is named" in e.text()
        assert not [n for n in o.neurons if n.dim == DIM]
        assert "Nothing to cut" in spike_cuts(model, tokens, o).text()
        return
    n = o.mlp_neurons(DIM, BLOCK)
    assert n.neurons(0.9) == [NEURON] and n.neurons(0.99) == [NEURON]
    assert n.sum_error < 1e-3 * WRITE
    row = n.table().iloc[0]
    assert row.neuron == NEURON and row.act_first > 0 and row.act_other == 0.0
    assert ("gate_first" in row) == (get_mlp(model).kind == "gated")
    assert (len([q for q in o.quadratic if q.dim == DIM]) == 1) == (get_mlp(model).kind == "gated")
    # the writer's pre-activations split over what feeds it (norm scale held: LayerNorm centring, 1 + w gains, no
    # norm for OLMo-2, the block's input for parallel blocks) add up to the hooks' values
    c = why_first_token(model, tokens, o, later=T // 2)
    assert c.max_error < tol(device, 1e-3) and set(c.neurons.neuron) == {NEURON}
    cuts = spike_cuts(model, tokens, o, roles=("writers",), n_random=1)  # zeroing it removes the spike
    kept = cuts.summary.set_index(["role", "mode", "chosen", "dim"])["kept_mean"]
    assert abs(kept[("writers", "zero", "named", DIM)]) < 0.05 and kept[("writers", "zero", "random", DIM)] > 0.95
