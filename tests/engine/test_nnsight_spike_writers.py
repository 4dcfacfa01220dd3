"""The spike writers through nnsight (``load_nnsight``: the traces a remote model runs on NDIF, run here): the MLP
spec and weights (whole, and the slices the steps read) read from the Hugging Face modules equal the bridge's, and the
report's spike-writers section (its origin, first-token cause and writer cuts, their reads, neuron sets and loss in the
traces) equals the bridge's, on tiny Llama, Gemma 2 and OLMo-2 (a norm on each write), also on a model held as NDIF
holds it (meta-device weights here, its traces in nnsight's simulation of a remote run); what ships
reads only NDIF's whitelist and runs in nnsight's simulation of a remote run; the origin's, cause's and a cut's reads
of Llama-3.1-405B fit NDIF's requests. About 100 s (the tiny families' first load included)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

pytest.importorskip("nnsight")

from analysis.causal.conditions import _loss_stats  # noqa: E402
from analysis.causal.writer_cuts import first_token_dims, set_neurons, spike_cuts  # noqa: E402
from analysis.chain.first_token_cause import CauseAccumulator, _readout, cause_stats, why_first_token  # noqa: E402
from analysis.chain.first_token_trace import SpikeOriginAccumulator, first_token_stats  # noqa: E402
from analysis.chain.mlp_neurons import _post_norm_reads  # noqa: E402
from analysis.chain.quadratic_form import _form_spectrum  # noqa: E402
from analysis.chain.spike_writers import spike_origin, writer_summary  # noqa: E402
from analysis.engine import remote  # noqa: E402
from analysis.report.build import _remote_refusal  # noqa: E402
from analysis.engine.passes import Accumulator, Reduction  # noqa: E402
from analysis.model.loading import load_nnsight  # noqa: E402
from analysis.model.mlp_spec import get_mlp, mlp_weights  # noqa: E402
from analysis.model.nnsight_model import NnsightUnsupported, wrap_nnsight  # noqa: E402
from tests.engine.test_nnsight import NDIF_ALLOWED, _as_if_pip_installed, _reached, _same, _tokens  # noqa: E402
from tests.engine.test_nnsight import here_and_there  # noqa: E402
from tests.engine.test_nnsight import llama_405b_config  # noqa: E402

# a plain block; writes through a norm before they add, with a norm before the MLP (Gemma 2) and without (OLMo-2);
# writes scaled by a residual multiplier (Granite: its spec only; its tiny random model names no writer neurons)
FAMILIES = ["llama", "gemma2", "olmo2", "llama4_text"]  # Llama 4: dense and mixture-of-experts blocks in turn
# plain MLPs: GPT-2's Conv1D weights, OPT's linears on the layer itself, parallel blocks with one norm (GPT-J, Phi)
PLAIN = ["gpt2", "gpt_neox", "gptj", "opt", "phi", "starcoder2"]
MOE = ["qwen3_moe", "deepseek_v3"]  # a dense block 0, then experts: its router named "gate" beside a gate_proj
DENSE = {"llama4_text": 2} | dict.fromkeys([*FAMILIES[:3], *PLAIN, "granite"], 1) | dict.fromkeys(MOE, 0)
HOOKS = ("neuron_hook", "gate_hook", "up_hook")  # the bridge's canonical names; nnsight's are their aliases


@pytest.mark.parametrize("family", [*FAMILIES, *PLAIN, *MOE, "granite"])
def test_the_mlp_spec_and_weights_of_an_nnsight_model_are_the_bridges(family, family_bridge, family_dir):
    bridge, nn = family_bridge(family), load_nnsight(str(family_dir(family)))
    want, got = get_mlp(bridge).to_dict(), get_mlp(nn).to_dict()
    # to 1e-5: the bridge measures Granite's residual multiplier (0.22000001), nnsight reads its config (0.22)
    assert not _same(
        {k: v for k, v in got.items() if k not in HOOKS}, {k: v for k, v in want.items() if k not in HOOKS}
    )
    measured = got["output_norm"] if family == "olmo2" else got["input_norm"]  # OLMo-2: no norm before the MLP
    assert got["kind"] == ("plain" if family in PLAIN else "gated") and measured["module"]  # measured, not defaulted
    d = DENSE[family]
    for layer, sel in [(0, {}), (d, {}), *((d, s) for s in SLICES)]:
        _equal(mlp_weights(nn, layer, **sel), mlp_weights(bridge, layer, **sel))


@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_a_joint_gate_and_up_projection_is_left_to_the_bridge_with_the_reason(family, family_dir):
    """Phi-3's and GLM-4's gate and up halves are one module's output, which no site through nnsight splits: the spec
    reads no neurons and its text says why and names the bridge, which reads them."""
    spec = get_mlp(load_nnsight(str(family_dir(family))))
    assert spec.kind == "none" and spec.d_mlp is None and "gate_up_proj" in spec.text()
    assert "--backend transformer_lens" in spec.text()


SLICES = ({"neurons": [3, 1]}, {"dims": [0, 5]}, {"neurons": [2], "dims": [4, 0]})  # what the spike writers read


def _equal(got, want):
    """Two MlpWeights hold the same tensors, exactly (or both None)."""
    for name, x in vars(want).items():
        y = getattr(got, name)
        assert y == x if not isinstance(x, torch.Tensor) else torch.equal(y, x), name


@pytest.mark.parametrize("family", [*FAMILIES, *PLAIN, *MOE])
def test_the_spike_writers_of_an_nnsight_model_equal_the_bridges(family, family_bridge, family_dir):
    """The section's results (origin, writers, first-token cause, writer cuts), their passes in nnsight traces:
    low thresholds name spike dims and writer neurons in the tiny random models, so every step runs."""
    bridge, nn, tokens = family_bridge(family), load_nnsight(str(family_dir(family))), _tokens(n=2, T=12)
    want, have = (_section(m, tokens)[0] for m in (bridge, nn))
    assert not _differences(family, have, want)
    cut = pd.DataFrame(have["cuts"]["conditions"])
    assert (cut.delta_loss.abs() > 0).any()  # the neurons set in the traces change the model


def _differences(family: str, have: dict, want: dict) -> list[str]:
    """Where the section's results differ, once every step ran: neurons, quadratic forms (of a gated MLP: a plain one
    has none) and cut conditions. The plain families' writes are tiny: a share or ratio of a value that nearly
    cancels moves by 1e-5 to 1e-4 relative there (its parts agree to 1e-8 absolute), so those are compared to 1e-3."""
    assert min(want["n"][::2]) > 0 and (want["n"][1] > 0) == (family not in PLAIN) and have["n"] == want["n"]
    return _same(have, want, loose=("share", "sample_share_90", "ratio") if family in PLAIN else ())


def _section(m, tokens) -> tuple[dict, object]:
    """The section's steps on ``m`` (low thresholds name spike dims and writer neurons in the tiny random models, so
    every step runs): (their results as JSON, the origin)."""
    o = spike_origin(m, tokens, abs_threshold=0.0, ratio_threshold=2.0)
    cuts = spike_cuts(m, tokens, o, n_random=1, roles=("writers",), eps=0.1)
    got = {"origin": o.to_dict(), "writers": writer_summary(o), "cause": why_first_token(m, tokens, o).to_dict()}
    got["cuts"], got["n"] = cuts.to_dict(), (len(o.neurons), len(o.quadratic), len(cuts.conditions))
    return json.loads(json.dumps(got, default=str)), o


@pytest.mark.parametrize("family", [*FAMILIES, "gpt2", "gptj", "opt"])  # a Conv1D; a parallel block; no MLP module
def test_the_spike_writers_of_a_model_held_on_ndif_equal_the_bridges(family, family_bridge, family_dir, monkeypatch):
    """A model as NDIF holds it (``remote_meta_model``: meta-device weights here), its traces run in nnsight's
    simulation of a remote run on the real weights, put in only while one runs (the server's model): the slices
    ``mlp_weights`` reads there equal the bridge's exactly and a whole weight is refused; the report does not refuse
    the section, and its origin, writer table, quadratic forms, first-token cause and writer cuts equal the bridge's,
    Gemma 2's and OLMo-2's too (the norm on the MLP's write: its scale taken in the trace, ``_post_norm_reads``).
    About 10 s a family."""
    here, nn, tokens = family_bridge(family), load_nnsight(str(family_dir(family))), _tokens(n=2, T=12)
    want, o = _section(here, tokens)
    restore = _held_on_ndif(nn, monkeypatch)
    try:
        assert all(p.is_meta for p in nn.hf.parameters()) and _remote_refusal(nn, "spike_writers") is None
        with pytest.raises(NnsightUnsupported, match="never a whole weight"):
            mlp_weights(nn, DENSE[family])
        for sel in SLICES:
            _equal(mlp_weights(nn, DENSE[family], **sel), mlp_weights(here, DENSE[family], **sel))
        have, p = _section(nn, tokens)
    finally:
        restore()
    assert (get_mlp(nn).output == "post_norm") == (family in ("gemma2", "olmo2"))
    diff = _differences(family, have, want)
    if family == "llama4_text":  # its experts run here only: on NDIF a note stands in for each expert table
        assert o.experts and not p.experts and any("meta device (a model held on NDIF)" in n for n in p.notes)
        diff = [d for d in diff if not d.startswith((".origin.experts", ".origin.notes", ".origin.text"))]
    assert not diff
    for a, b in zip(p.quadratic + p.neurons, o.quadratic + o.neurons):  # the tensors too, to 1e-5
        assert all(torch.allclose(x, getattr(b, k), atol=1e-5) for k, x in vars(a).items() if torch.is_tensor(x))


def _held_on_ndif(nn, monkeypatch):
    """Hold ``nn`` as NDIF does: meta-device parameters here, the real ones in the model only while nnsight's
    simulation of a remote run (this package hidden: ``_as_if_pip_installed``) runs a trace; its traces go there."""
    from nnsight.intervention.backends.local import LocalSimulationBackend

    real = dict(nn.hf.named_parameters(remove_duplicate=False))
    meta = {n: torch.nn.Parameter(p.detach().to("meta"), requires_grad=False) for n, p in real.items()}

    def put(params):
        for name, p in params.items():
            mod, _, leaf = name.rpartition(".")
            nn.hf.get_submodule(mod)._parameters[leaf] = p

    def there(backend, tracer, run=LocalSimulationBackend.__call__):
        put(real)
        try:
            return run(backend, tracer)
        finally:
            put(meta)

    monkeypatch.setattr(LocalSimulationBackend, "__call__", there)
    trace, nn.remote = nn.lm.trace, True
    object.__setattr__(nn.lm, "trace", lambda *a, remote=None, **k: trace(*a, remote="local", **k))
    put(meta)
    return _as_if_pip_installed(monkeypatch)


def test_the_spike_writer_reductions_ship_only_what_ndif_allows(family_dir, monkeypatch):
    """Each reads only NDIF's whitelist; one trace with the origin's and the cause's reads, the cuts' neuron sets
    and spike dims and the loss, through nnsight's simulation of a remote run (this package hidden), returns what
    it returns here, and only the edited rows change."""
    for fn in (first_token_stats, cause_stats, set_neurons, first_token_dims, _form_spectrum, _post_norm_reads):
        bad = {m for m in _reached(fn) if m.split(".")[0] not in NDIF_ALLOWED}
        assert not bad, f"{fn.__name__} reaches {bad}: NDIF allows only {sorted(NDIF_ALLOWED)}"
    nn, tokens = load_nnsight(str(family_dir("llama"))), _tokens(n=2, T=12)
    o = spike_origin(nn, tokens, abs_threshold=0.0, ratio_threshold=2.0)
    writer = next(n for n in o.neurons if n.role == "writer")
    readout = _readout(nn, writer.dim, writer.block, writer.neurons(0.9)[:4])
    accs = [SpikeOriginAccumulator(nn), CauseAccumulator(nn, [readout], o.dims, 5, last=2)]
    accs.append(_Dims({l: {"x": f"blocks.{l}.hook_resid_post"} for l in range(nn.spec.n_layers)}))
    plan = remote.pass_plan(nn, accs)
    edits = {writer.block: {"mlp.hook_post": Reduction(set_neurons, {"sets": [(slice(0, 1), torch.tensor([3]), 0.0)]})}}
    runs = here_and_there(
        monkeypatch,
        lambda where: remote.trace_batch(nn, tokens, plan, edits=edits, logits=Reduction(_loss_stats), remote=where),
    )
    here, there = runs[False], runs["local"]
    assert [(j, l) for j, l, _ in here] == [(j, l) for j, l, _ in there] and here[-1][0] == -1
    for (_, _, a), (_, _, b) in zip(here, there):
        a, b = (dict(x) if isinstance(x, list) else x if isinstance(x, dict) else {"x": x} for x in (a, b))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = remote.trace_batch(nn, tokens, plan)
    last = nn.spec.n_layers - 1
    edited, unedited = (next(r for j, l, r in got if j == 2 and l == last) for got in (here, base))
    assert torch.equal(edited[1], unedited[1]) and not torch.equal(edited[0], unedited[0])


def test_the_spike_writer_reads_of_llama_405b_fit_ndifs_requests(capsys):
    """The origin's reads on the meta device (each block's first-token stream, writes, MLP input and 53,248
    neurons, and the other tokens' sums) cut into requests under NDIF's limit; the first-token cause's (two dims'
    writers at block 3, 8 neurons each) and a writer cut's (one condition of 32 sequences, the spike dims read from
    block 1 on) are sized the same way."""
    from transformers import AutoModelForCausalLM

    from analysis.causal.conditions import PassAccumulator
    from analysis.causal.writer_cuts import _SpikeValues
    from analysis.chain.first_token_cause import _Readout
    from analysis.model.key_path import NormParams
    from tests.families import word_tokenizer

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(llama_405b_config())
    nn = wrap_nnsight(hf, tokenizer=word_tokenizer(), name="meta-llama/Llama-3.1-405B")
    assert get_mlp(nn).d_mlp == 53248 and get_mlp(nn).kind == "gated"
    tokens, D = _tokens(n=32, T=64), nn.spec.d_model
    norm = NormParams("RMS", torch.ones(D), None, 1e-5)
    readouts = [
        _Readout(d, 3, list(range(8)), ["gate", "up"], torch.zeros(D, 16), torch.zeros(16), norm) for d in (0, 1)
    ]
    setter = type("Setter", (), {"start": 1, "L": nn.spec.n_layers, "dims": [0, 1]})
    steps = {
        "spike origin's reads": [SpikeOriginAccumulator(nn)],
        "first-token cause's pass": [CauseAccumulator(nn, readouts, [0, 1], 5, last=3)],
        "writer cut's condition": [PassAccumulator(nn, 64, eps=0.1), _SpikeValues(setter)],
    }
    for i, (step, accs) in enumerate(steps.items()):
        plan = remote.pass_plan(nn, accs)
        per, fixed = remote.reduction_bytes(nn, tokens, plan)
        req = remote.plan_requests(32, [p[0] for p in plan], per=per, fixed=fixed)
        assert req.bytes_per_request < remote.REQUEST_LIMIT_BYTES and (
            req.bytes_total > remote.REQUEST_LIMIT_BYTES
        ) == (i == 0)
        with capsys.disabled():
            print(
                f"\n405B {step}, N=32, T=64: {req.n_requests} requests of {req.samples} samples x "
                f"{len(req.layer_groups[0])} layers, {req.bytes_per_request / 2**20:.2f} MiB each, "
                f"{req.bytes_total / 2**20:.2f} MiB in all"
            )


class _Dims(Accumulator):
    """The cuts' record of the spike dims (dims 0 and 5) after each block."""

    def __init__(self, hooks):
        self._hooks = hooks

    def hooks(self):
        return self._hooks

    def reduction(self, layer):
        return Reduction(first_token_dims, {"dims": [0, 5]})

    def result(self):
        return None


def test_a_family_that_scales_its_writes_reads_them_as_the_bridge(family_bridge, family_dir):
    """Granite adds each write times its residual multiplier, which no module outputs: a trace reads the sublayers'
    outputs times it, as the bridge's hooks hold them, so the origin's first-token writes (read unscaled, they differ
    by the multiplier, 0.22) and its results are the bridge's."""
    tokens = _tokens(n=2, T=12)
    got, want = (
        spike_origin(m, tokens, abs_threshold=0.0)
        for m in (load_nnsight(str(family_dir("granite"))), family_bridge("granite"))
    )
    for name in ("resid", "attn", "mlp"):
        torch.testing.assert_close(getattr(got.trace, name), getattr(want.trace, name), rtol=1e-5, atol=1e-7)
    assert not _same(*(json.loads(json.dumps(o.to_dict(), default=str)) for o in (got, want)))
    nn, bridge = (
        load_nnsight(str(family_dir("granite"))),
        family_bridge("granite"),
    )  # an edit there: written back / 0.22
    edits = {0: {"hook_mlp_out": Reduction(_double)}}
    (_, _, last), *_ = remote.trace_batch(nn, tokens, [], edits=edits, logits=Reduction(_last_logits), remote=False)
    with torch.no_grad():
        ref = bridge.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_mlp_out", lambda x, hook: 2 * x)])[:, -1]
    torch.testing.assert_close(last, ref, rtol=1e-5, atol=1e-6)
    assert (last - bridge(tokens)[:, -1]).abs().max() > 1e-4  # the edit changed the logits


def _double(x):
    return 2 * x


def _last_logits(logits, tokens):
    return logits[:, -1]
