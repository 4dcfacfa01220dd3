"""A model split by accelerate's device map gives the numbers of the whole model (CPU + disk offload on CPU).

Tiny models of several families with half of their blocks offloaded to disk are compared with the same model on
one device: per-head alpha, the massive table, the spike origin, the causal cuts and the report's JSON. A spy on the
accumulators' updates shows each reduction runs where its layer's output lives and no whole (N, T, d) activation is
moved. The embedded SmolLM2 with blocks 10-29 on disk gives the single-device sink table.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from analysis import load_model
from analysis.model.placement import Placement, check_placement, parse_device_map, parse_max_memory, split_device_map
from analysis.model.weights import execution_device, is_offloaded, materialized
from tests.families import make_family_dir

CLOCK = {
    "seconds",
    "elapsed_s",
    "wall_s",
    "timings",
    "versions",
    "device",
    "weights_on",
    "created",
    "out_dir",
    "path",
}  # not numbers of the model
FAMILIES = ["llama", "qwen3", "gemma2", "gpt_oss", "qwen3_next"]


def _close(a, b, path="", tol=1e-6):
    """Every number of two JSON-like trees agrees to tol (absolute, or relative for large numbers)."""
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys differ: {set(a) ^ set(b)}"
        for k in set(a) - CLOCK:
            _close(a[k], b[k], f"{path}.{k}", tol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]", tol)
    elif isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            assert math.isnan(a) and math.isnan(b), f"{path}: {a} vs {b}"
        else:
            assert abs(a - b) <= tol * max(1.0, abs(a)), f"{path}: {a} vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    d = make_family_dir(request.param, tmp_path_factory.mktemp(request.param) / "model")
    whole = load_model(str(d), device="cpu")
    n = whole.cfg.n_layers
    dm = split_device_map(str(d), {l: "disk" for l in range(n // 2, n)})
    split = load_model(str(d), device_map=dm, offload_folder=str(d.parent / "offload"))
    return request.param, whole, split


def _probes(model, n=3, T=24):
    from analysis.model.probes import model_probe_sets

    return model_probe_sets(model, n=n, T=T, seed=0)


class Spy:
    """Records, for every accumulator update, the layer, the device of its activation and the layer's execution
    device; and every tensor of a whole activation's size that an accumulator sends to a device (``.cpu()``, or
    ``.to`` with a device) while it reduces: on a real split that would gather whole activations onto one device."""

    def __init__(self, model, monkeypatch, T):
        from analysis.engine import passes

        self.updates, self.moved, self.inside, self.T = [], [], False, T
        real = passes._JointReducer.fired
        spy = self

        def fired(self_, layer, name, x):
            spy.updates.append((layer, name, x.device, execution_device(model.blocks[layer])))
            spy.inside = True
            try:
                return real(self_, layer, name, x)
            finally:
                spy.inside = False

        monkeypatch.setattr(passes._JointReducer, "fired", fired)
        d = int(model.cfg.d_model)
        for meth in ("to", "cpu"):
            orig = getattr(torch.Tensor, meth)

            def moved(t, *a, _orig=orig, _m=meth, **k):
                to_device = _m == "cpu" or "device" in k or any(isinstance(v, (str, torch.device)) for v in a)
                if spy.inside and to_device and t.ndim >= 3 and t.shape[-1] == d and t.shape[-2] >= spy.T:
                    spy.moved.append((_m, tuple(t.shape)))
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, meth, moved)


def test_split_is_offloaded_and_same_model(pair):
    fam, whole, split = pair
    assert is_offloaded(split.original_model) and not is_offloaded(whole.original_model)
    assert split.family == whole.family
    assert (split.cfg.n_layers, split.cfg.d_model, split.cfg.n_heads) == (
        whole.cfg.n_layers,
        whole.cfg.d_model,
        whole.cfg.n_heads,
    )
    assert set(split.hook_dict) == set(whole.hook_dict)
    last = split.original_model.model.layers[-1]
    assert any(p.device.type == "meta" for p in last.parameters()), "the offloaded block keeps placeholders"
    with materialized(last):
        assert all(p.device.type == "cpu" for p in last.parameters())
    assert any(p.device.type == "meta" for p in last.parameters()), "the placeholders come back"


def test_profile_agrees_on_split_model(pair, monkeypatch):
    from analysis.report.one_pass import profile

    fam, whole, split = pair
    probes = _probes(whole)
    a = profile(whole, probes, progress=False)
    spy = Spy(split, monkeypatch, T=24)
    b = profile(split, probes, progress=False)
    monkeypatch.undo()
    _close(json.loads(json.dumps(a.to_dict(), default=str)), json.loads(json.dumps(b.to_dict(), default=str)))
    assert spy.updates, "the spy saw no reduction"
    wrong = [(l, n, str(x), str(d)) for l, n, x, d in spy.updates if d is not None and x != d]
    assert not wrong, f"reductions on another device than their layer's: {wrong[:3]}"
    assert not spy.moved, f"whole activations moved: {spy.moved[:3]}"


def test_weight_readers_read_real_weights(pair):
    from analysis.model.hooks import check_attention_layers
    from analysis.model.key_path import key_path
    from analysis.model.mlp_spec import get_mlp, mlp_weights

    fam, whole, split = pair
    last = whole.cfg.n_layers - 1
    attn = [l for l in check_attention_layers(whole) if l >= whole.cfg.n_layers // 2]
    for l in attn[-1:]:
        p, q = key_path(whole, l), key_path(split, l)
        assert torch.equal(p.W_K, q.W_K) and torch.equal(p.norm.w, q.norm.w)
    if get_mlp(whole).has_neurons(last):
        a, b = mlp_weights(whole, last), mlp_weights(split, last)
        assert torch.equal(a.W_out, b.W_out) and torch.equal(a.W_in, b.W_in)


def test_analyses_agree_on_split_model(pair):
    """Per-head alpha, the massive table, the spike origin and the causal cuts, on the offloaded model."""
    from analysis.causal.writer_cuts import spike_cuts
    from analysis.chain.massive import massive_activations
    from analysis.chain.spike_writers import spike_origin
    from analysis.sinks.metric import sink_metric

    fam, whole, split = pair
    tokens = _probes(whole)["natural"].tokens

    def same(fn, *args, **kw):
        try:
            a = fn(whole, tokens, *args, **kw)
        except ValueError as e:  # does not apply to this family: the split model says the same
            with pytest.raises(ValueError) as got:
                fn(split, tokens, *args, **kw)
            assert str(got.value) == str(e)
            return None
        b = fn(split, tokens, *args, **kw)
        _close(json.loads(json.dumps(a.to_dict(), default=str)), json.loads(json.dumps(b.to_dict(), default=str)))
        return a, b

    same(sink_metric)
    same(massive_activations)
    origin = same(spike_origin)
    if origin is not None and origin[0].dims and origin[0].neurons:
        a = spike_cuts(whole, tokens, origin[0], n_random=1)
        b = spike_cuts(split, tokens, origin[1], n_random=1)
        _close(json.loads(json.dumps(a.to_dict(), default=str)), json.loads(json.dumps(b.to_dict(), default=str)))


def test_report_json_agrees(pair, tmp_path):
    from analysis.report.build import build_report

    fam, whole, split = pair
    if fam != "llama":
        pytest.skip("the report is compared on one family (cost); the profile test covers the others")
    ja, jb = tmp_path / "a", tmp_path / "b"
    build_report(whole, ja, n=3, T=24, seed=0, progress=False)
    build_report(split, jb, n=3, T=24, seed=0, progress=False)
    a, b = (json.loads((d / "report.json").read_text()) for d in (ja, jb))
    _close(a, b)


def test_smollm2_blocks_on_disk_give_the_table(tmp_path):
    from analysis.__main__ import sink_report

    dm = split_device_map(
        str(__import__("analysis.model.loading", fromlist=["x"]).smollm2_dir()), {l: "disk" for l in range(10, 30)}
    )
    one = sink_report("smollm2-135m", 12, 64, 0.3, 16, False, 0, "cpu", progress=False)
    split = sink_report(
        "smollm2-135m",
        12,
        64,
        0.3,
        16,
        False,
        0,
        None,
        progress=False,
        placement=Placement(dm, None, str(tmp_path / "off")),
    )
    assert split["sink_1_pct"] == one["sink_1_pct"]
    _close(one["inputs"], split["inputs"])


def test_bad_placements_say_what_to_do(tmp_path):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="does not exist here"):
        check_placement(Placement({"model.layers.0": f"cuda:{n + 2}"}))
    with pytest.raises(ValueError, match="not both"):
        check_placement(Placement("auto"), device="cpu")
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    if not os.access(ro, os.W_OK):  # root writes anywhere
        with pytest.raises(ValueError, match="cannot be written"):
            check_placement(Placement("auto", None, str(ro / "off")))
    with pytest.raises(ValueError, match="max-memory takes"):
        parse_max_memory("70GiB")
    assert parse_max_memory("0=70GiB,cpu=120GiB") == {0: "70GiB", "cpu": "120GiB"}
    assert parse_device_map('{"a": "0", "b": "disk"}') == {"a": 0, "b": "disk"}


def test_cli_flags(tmp_path, capsys):
    from analysis.__main__ import main

    assert main(["sink", "--n", "2", "--device", "cpu", "--device-map", "auto", "--quiet"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["sink", "--n", "2", "--device-map", '{"model.layers.0": "cuda:7"}', "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_small_max_memory_without_folder(tmp_path):
    d = make_family_dir("llama", tmp_path / "m")
    with pytest.raises(ValueError, match="offload"):
        load_model(str(d), device_map="auto", max_memory={"cpu": "20KB"})


def test_stream_cli_on_split_model(tmp_path, capsys):
    """``stream --device-map``: a tiny Llama with its second block on disk gives the one-device policy table (every
    NLL, perplexity and sink share), the map is refused for a reference model, and an unknown name is one line (no
    traceback)."""
    from analysis.__main__ import main

    d = make_family_dir("llama", tmp_path / "model")
    n = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    dm = tmp_path / "dm.json"
    dm.write_text(json.dumps(split_device_map(str(d), {l: "disk" for l in range(n // 2, n)})))
    assert "disk" in dm.read_text()
    args = [
        "stream",
        "--model",
        str(d),
        "--window",
        "16",
        "--sinks",
        "0,2",
        "--tokens",
        "48",
        "--newline-sinks",
        "0",
        "--quiet",
    ]
    assert main([*args, "--device", "cpu", "--json", str(tmp_path / "one.json")]) == 0
    assert (
        main(
            [
                *args,
                "--device-map",
                str(dm),
                "--offload-folder",
                str(tmp_path / "off"),
                "--json",
                str(tmp_path / "split.json"),
            ]
        )
        == 0
    )
    one, split = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "split.json"))
    speed = {"tokens_per_s", "seconds", "peak_mib", "peak_kv_mib"}
    assert len(one["runs"]) == len(split["runs"]) and len(one["table"]) == len(split["table"]) > 3
    for a, b in zip(one["runs"] + one["table"], split["runs"] + split["table"]):
        _close({k: v for k, v in a.items() if k not in speed}, {k: v for k, v in b.items() if k not in speed})
    capsys.readouterr()
    assert main(["stream", "--model", "synthetic-softmax", "--device-map", "auto", "--quiet"]) == 2
    assert "reference model" in capsys.readouterr().err
    assert main(["stream", "--model", "no-such-model-xyz", "--device-map", "auto", "--quiet"]) == 2
    assert "unknown model" in capsys.readouterr().err


# ---- where the inputs go: the embedding's execution device, never "the first parameter" (issue 36) ----------------


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2 folder, its one-device bridge, and the one-device per-head alpha of a few random tokens."""
    from analysis.sinks.metric import sink_metric

    d = make_family_dir("qwen2", tmp_path_factory.mktemp("qwen2") / "model")
    whole = load_model(str(d), device="cpu")
    tokens = torch.randint(3, whole.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    return d, whole, tokens, sink_metric(whole, tokens).alpha


def test_every_module_on_disk_loads_and_agrees(qwen2, tmp_path):
    """max_memory too small for any module: every weight (the embedding's too) sits on disk, "meta" placeholders on
    the modules. The load (family_spec's dry run) and the analyses send the tokens to the execution device."""
    from analysis.model.placement import placement_record
    from analysis.sinks.metric import sink_metric

    d, whole, tokens, alpha = qwen2
    split = load_model(str(d), device_map="auto", max_memory={"cpu": "1KB"}, offload_folder=str(tmp_path / "off"))
    assert set(split.original_model.hf_device_map.values()) == {"disk"}
    assert next(split.parameters()).device.type == "meta"
    rec = placement_record(split)
    assert rec == {"device": "cpu", "weights_on": {"disk": sum(p.numel() for p in whole.original_model.parameters())}}
    assert torch.equal(sink_metric(split, tokens).alpha, alpha)


def test_embedding_alone_on_disk_loads_and_agrees(qwen2, tmp_path):
    """The first parameter (the embedding's) is a disk placeholder while the work runs on the CPU."""
    from analysis.model.hooks import model_device
    from analysis.model.placement import input_device, placement_record
    from analysis.sinks.metric import sink_metric

    d, whole, tokens, alpha = qwen2
    dm = {**split_device_map(str(d), {}, default="cpu"), "model.embed_tokens": "disk"}
    split = load_model(str(d), device_map=dm, offload_folder=str(tmp_path / "off"))
    first = next(split.original_model.parameters())
    assert first.device.type == "meta" and first is split.original_model.get_input_embeddings().weight
    assert input_device(split) == model_device(split) == torch.device("cpu")
    rec = placement_record(split)
    assert rec["device"] == "cpu" and set(rec["weights_on"]) == {"cpu", "disk"}
    assert rec["weights_on"]["disk"] == whole.original_model.get_input_embeddings().weight.numel()
    assert torch.equal(sink_metric(split, tokens).alpha, alpha)


def test_first_parameter_elsewhere_than_the_work(qwen2):
    """A model whose first parameter is not the embedding and lives on another device ("meta") than the work: the
    inputs go to the embedding's device, and the record says where the weights are."""
    import copy

    from analysis.model.placement import input_device, placement_record

    d, whole, tokens, alpha = qwen2
    hf = copy.deepcopy(whole.original_model)
    hf._modules = {"aaa_probe": torch.nn.Linear(2, 2, device="meta"), **hf._modules}  # the first parameter now
    assert next(hf.parameters()).device.type == "meta"
    assert input_device(hf) == torch.device("cpu")
    assert placement_record(hf)["weights_on"] == {
        "cpu": sum(p.numel() for p in whole.original_model.parameters()),
        "meta": 6,
    }


def test_load_model_puts_the_weights_on_the_asked_device(tiny_llama_dir, monkeypatch):
    """TransformerLens leaves a model it is given where it is: the loader itself moves the Hugging Face model to
    ``device`` (on a GPU run, ``--device cuda`` kept every model on the CPU before)."""
    from transformers import PreTrainedModel

    moved = []
    real = torch.nn.Module.to

    def to(self, *args, **kwargs):
        if isinstance(self, PreTrainedModel):
            moved.append((id(self), str(args[0] if args else kwargs.get("device"))))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    model = load_model(str(tiny_llama_dir), device="cpu")
    assert (id(model.original_model), "cpu") in moved


def test_cli_json_records_where_the_work_and_weights_were(qwen2, tmp_path):
    """``sink --json`` on a model whose embedding is on disk: "device" is where the work ran, "weights_on" where the
    weights are kept (before: the first parameter's device, "meta", after a crash in the load)."""
    from analysis.__main__ import main

    d, whole, tokens, alpha = qwen2
    dm = tmp_path / "dm.json"
    dm.write_text(json.dumps({**split_device_map(str(d), {}, default="cpu"), "model.embed_tokens": "disk"}))
    out = tmp_path / "sink.json"
    assert (
        main(
            [
                "sink",
                "--model",
                str(d),
                "--n",
                "2",
                "--T",
                "8",
                "--quiet",
                "--device-map",
                str(dm),
                "--offload-folder",
                str(tmp_path / "off"),
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and set(data["weights_on"]) == {"cpu", "disk"}
