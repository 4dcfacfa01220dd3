"""Where the spike comes from, on the embedded SmolLM2 and the project's reference models.

On SmolLM2 (natural text, N = 6, T = 48): the embedding plus the attention and MLP writes of the blocks before it
equal the first token's value of the spike dimension entering every block, to float32 rounding; inside each writing
MLP the neurons' contributions add up to its write; the writer neurons fire on the first token and not on the same
token later; zeroing the writer neurons on the first token removes most of the spike downstream and the sink, while
as many random neurons of the same MLPs change nothing. On the 1-layer reference model the spike is the BOS
token's own embedding and no neuron is named; without a spike there is nothing to trace.
"""

from __future__ import annotations

import json

import pytest
import torch

from analysis.chain.first_token_cause import why_first_token
from analysis.model.probes import probe_sets
from analysis.causal.writer_cuts import spike_cuts
from analysis.chain.spike_writers import spike_origin
from tests.conftest import tol

N, T = 6, 48


@pytest.fixture(scope="module")
def tokens(smollm2):
    return probe_sets(smollm2.tokenizer, n=N, T=T)["natural"].tokens


@pytest.fixture(scope="module")
def origin(smollm2, tokens):
    return spike_origin(smollm2, tokens, kind="natural")


def test_the_writes_add_up_to_the_value_at_every_block(origin):
    assert origin.has_spike and origin.dims
    tr = origin.trace
    for d in origin.dims:
        v = tr.resid[:, :, d].double()
        rebuilt = v[:, :1] + torch.cat(
            [torch.zeros(N, 1, dtype=torch.float64), (tr.attn[:, :, d].double() + tr.mlp[:, :, d].double()).cumsum(1)],
            1,
        )
        assert float((rebuilt - v).abs().max()) <= 1e-5 * float(v.abs().max()) + 1e-4
        err, rel = tr.bookkeeping(d)
        assert rel < 1e-5 and "bookkeeping adds up" in origin.dim_text(d)


def test_writers_and_neurons_of_smollm2(origin):
    d = max(origin.dims, key=lambda d: float(origin.values(d).abs().max()))
    blocks = origin.writing_blocks(d)
    assert blocks  # an MLP writes the spike ...
    peak = float(origin.values(d).mean(0).abs().max())
    main = origin.writers(d).sort_values("write", key=abs).iloc[-1]
    assert main.component == "mlp" and abs(main.write) > 0.5 * peak  # ... one of them nearly all of it
    assert origin.writing_blocks(d, "eraser")  # and later blocks erase it before the unembedding
    for n in origin.neurons:
        assert n.sum_error <= 1e-4 * abs(n.mean_write) + 1e-2  # the neuron contributions add up to the MLP's write
        ns = n.neurons(0.9)
        assert 0 < len(ns) <= len(n.neurons(0.99)) <= n.contributions.shape[1]
        assert float(n.mean_contributions[ns].sum() * (1 if n.mean_write > 0 else -1)) >= 0.9 * abs(
            n.mean_write - float(n.constant.mean())
        )
    top = origin.mlp_neurons(d, int(main.block)).table().iloc[0]
    assert abs(top.act_first) > 20 * abs(top.act_other)  # the largest writer fires on the first token only
    q = [q for q in origin.quadratic if q.block == int(main.block) and q.dim == d]
    assert len(q) == 1 and q[0].eigenvalues.shape == (576,) and ("rank-one claim" in q[0].text())
    json.dumps(origin.to_dict(), allow_nan=False)
    assert set(origin.tables) >= {"writes", "blocks", "neurons", "quadratic", "bookkeeping"}


def test_why_the_first_token(smollm2, tokens, origin, device):
    c = why_first_token(smollm2, tokens, origin, later=T // 2)
    assert c.max_error < tol(device, 1e-3)  # the components (from the weights, on the CPU) add up to the hooks' values
    total = c.contributions[c.contributions.component == "total"]
    hook = c.contributions[c.contributions.component == "hook"]
    assert torch.allclose(
        torch.tensor(total["first"].to_numpy()), torch.tensor(hook["first"].to_numpy()), atol=tol(device, 1e-3)
    )
    top = c.neurons.groupby("block").head(1)
    assert (top.act_first.abs() > 10 * top.act_later.abs()).all()  # at position 1 they fire, later they do not
    peak = c.spike.loc[c.spike["first"].abs().idxmax()]
    assert not peak.later_is_spike and "carries no spike" in c.text()
    chain = c.chain(int(top.dim.iloc[0]), int(top.block.iloc[0]))
    assert (
        list(chain.columns[:3]) == ["component", "gate_first", "gate_later"] and chain.component.iloc[0] == "embedding"
    )
    assert c.divergence.set_index("component").loc["embedding", "difference"] == 0.0
    with pytest.raises(ValueError, match="later must be a position"):
        why_first_token(smollm2, tokens, origin, later=T)


def test_zeroing_the_writers_removes_the_spike_and_random_neurons_do_not(smollm2, tokens, origin):
    cuts = spike_cuts(smollm2, tokens, origin, roles=("writers",), n_random=2, max_samples=4)
    s = cuts.summary.set_index(["role", "mode", "chosen", "dim"])
    d = max(origin.dims, key=lambda d: float(origin.values(d).abs().max()))
    named, rnd = s.loc[("writers", "zero", "named", d)], s.loc[("writers", "zero", "random", d)]
    base = cuts.conditions[cuts.conditions.role == "baseline"].iloc[0]
    assert named.kept_mean < 0.2 and rnd.kept_min > 0.9  # most of the spike goes with the writers, none with random
    assert named.sink_1_pct_mean < 0.5 * base.sink_1_pct and rnd.sink_1_pct_min > 0.9 * base.sink_1_pct
    assert s.loc[("writers", "mean", "named", d)].kept_mean < 0.2
    assert "random neurons" in cuts.text()
    # the first token's own loss, against the model's logits computed here (unchanged, and with the writers zeroed)
    on = tokens[:4]
    with torch.no_grad():
        first = torch.nn.functional.cross_entropy(smollm2(on)[:, 0].float(), on[:, 1])
    assert abs(base.loss_first - float(first)) <= 1e-4 * float(first)
    zero = {b: ns for b, ns in cuts.neurons["writers"].items()}

    def cut(a, hook, ns):
        a = a.clone()
        a[:, 0, ns] = 0.0
        return a

    from functools import partial

    from analysis.model.mlp_spec import get_mlp

    hooks = [(get_mlp(smollm2).neuron_hook(b), partial(cut, ns=ns)) for b, ns in zero.items()]
    with torch.no_grad():
        cut_first = torch.nn.functional.cross_entropy(
            smollm2.run_with_hooks(on, fwd_hooks=hooks)[:, 0].float(), on[:, 1]
        )
    assert abs(named.loss_first_mean - float(cut_first)) <= 1e-4 * float(cut_first)
    assert abs(float(cut_first) - float(first)) > 1e-3  # the cut changes it: the check can tell the two apart
    with pytest.raises(ValueError, match="not those the spike origin was measured on"):
        spike_cuts(smollm2, tokens.flip(0), origin)


def test_every_spike_origin_figure_draws(smollm2, tokens, origin):
    import inspect

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis.figures import spike_writers as figs

    cause = why_first_token(smollm2, tokens, origin)
    cuts = spike_cuts(smollm2, tokens, origin, roles=("erasers",), n_random=1, max_samples=2)
    calls = {
        "plot_spike_path": lambda f: f(origin),
        "plot_neuron_contributions": lambda f: f(origin),
        "plot_spectrum": lambda f: f(origin),
        "plot_first_token_cause": lambda f: f(cause),
        "plot_spike_cuts": lambda f: f(cuts),
    }
    functions = {n: fn for n, fn in inspect.getmembers(figs, inspect.isfunction) if n.startswith("plot_")}
    assert set(functions) == set(calls)
    for name, fn in functions.items():
        fig = calls[name](fn)
        assert fig.axes and fig.axes[0].has_data(), name
        fig.canvas.draw()
        plt.close("all")
    with pytest.raises(ValueError, match="no gated MLP writes dim 3"):
        figs.plot_spectrum(origin, dim=3)


def test_bad_input(smollm2, tokens, origin):
    with pytest.raises(ValueError, match=r"dims \[576\] out of range"):
        spike_origin(smollm2, tokens[:2, :8], dims=[576])
    with pytest.raises(ValueError, match=r"blocks \[30\] out of range"):
        spike_origin(smollm2, tokens[:2, :8], dims=[507], blocks=[30])
    with pytest.raises(ValueError, match="was not traced"):
        origin.values(3)


def test_the_reference_model_spike_is_its_bos_embedding(device):
    """The 1-layer softmax reference: BOS's embedding carries the spike (100x its own median, notebook 07's
    criterion); the analysis names the embedding, no neuron, and BOS later in the sequence carries it too."""
    from analysis import load_model
    from analysis.model.probes import model_probe_sets

    model = load_model("synthetic-softmax", device=device)
    toks = model_probe_sets(model, n=8, T=32)["natural"].tokens
    o = spike_origin(model, toks, median_over="token", abs_threshold=0.0, ratio_threshold=100.0)
    assert o.has_spike and all(o.embedding_origin(d) for d in o.dims)
    assert not o.writing_blocks() and not [n for n in o.neurons if n.role == "writer"]
    assert "own embedding" in o.text() and "no neuron is named" in o.text()
    c = why_first_token(model, toks, o)
    assert c.spike[c.spike.point == "embedding"].later_is_spike.all()
    assert "Nothing to cut" in spike_cuts(model, toks, o).text()


def test_no_spike_nothing_to_trace(device):
    from analysis import load_model
    from analysis.model.probes import model_probe_sets

    model = load_model("synthetic-sigmoid", device=device)
    toks = model_probe_sets(model, n=8, T=32)["natural"].tokens
    o = spike_origin(model, toks, median_over="token", abs_threshold=0.0, ratio_threshold=100.0)
    assert not o.has_spike and not o.neurons and not len(o.writes)
    assert "nothing to trace" in o.text()
    assert "nothing to trace back" in why_first_token(model, toks, o).text()
    assert "Nothing to cut" in spike_cuts(model, toks, o).text()


def test_a_spike_written_into_the_weights_one_row(tmp_path):
    """The planted GPT-2 (tests.planted.planted_gpt2_dir): the analysis finds the planted dims, names block 0's
    planted neuron as the writer (``main_dim``, ``origin_row``), has no quadratic view for an ungated MLP, and zeroing
    the writer removes the spike and the sink; a model without a spike gets its sentence in the row."""
    from analysis import load_model
    from analysis.causal.writer_cuts import origin_row
    from analysis.model.probes import model_probe_sets
    from tests.planted import SPIKE_DIMS, WRITER, planted_gpt2_dir

    model = load_model(str(planted_gpt2_dir(tmp_path / "gpt2")), device="cpu")
    toks = model_probe_sets(model, n=4, T=24)["natural"].tokens
    o = spike_origin(model, toks, kind="natural")
    assert o.dims == SPIKE_DIMS and o.main_dim == 7
    row = origin_row(model, toks, kind="natural", max_samples=4)
    assert row["dim"] == 7 and row["writers"] == [0] and row["top neurons (share)"][0][0] == WRITER
    assert (
        row["peak"] == pytest.approx(400, rel=0.05)
        and row["rank one"] is None
        and row["top eig share"] != row["top eig share"]
    )
    assert row["Sink_1"] > 40 and row["kept (cut)"] < 0.1 and row["Sink_1 (cut)"] < 5
    sig = load_model("synthetic-sigmoid", device="cpu")
    empty = origin_row(sig, model_probe_sets(sig, n=4, T=24)["natural"].tokens)
    assert empty["dim"] is None and "nothing to trace" in empty["finding"]
    assert spike_origin(sig, model_probe_sets(sig, n=4, T=24)["natural"].tokens).main_dim is None
