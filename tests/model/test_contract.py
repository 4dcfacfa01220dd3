"""The one model contract (``analysis.model.contract``): every public function of the package that takes a model
types it with the contract (read from the source with ``ast``), none takes a name or a bare Hugging Face model, and
the check at load refuses a model missing something, in one line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import analysis
from analysis.model.contract import (
    ModelContractError,
    SinkModel,
    check_model,
    hf_module,
    is_model,
    model_dtype,
    runs_bridge_components,
)

ROOT = Path(analysis.__file__).resolve().parent
EXEMPT = ()  # none: every floor, the report included, takes the contract
# Functions of the floors under the analyses that take something else than the contract's model, by what they take.
OTHER_TYPES = {
    "torch.nn.Module": ("model/placement.py", "model/weights.py", "train/trainer.py"),  # any module: HF, bridge, SinkLM
    "NnsightModel": ("engine/remote.py", "report/build.py"),  # a model on NDIF: its config, no hooks
    "SinkLM": ("model/reference/checkpoint.py", "train/trainer.py"),  # the reference model's own checkpoints
    "dict": ("train/sweep.py",),  # a model config
    "object": (
        "model/contract.py",
        "model/causal.py",
        "core/docs.py",
    ),  # the contract checks (check_model, require_model) take anything; core/docs.py's stubs only document it
}
RAW = ("str", "Path", "os.PathLike", "PreTrainedModel", "transformers.PreTrainedModel", "TransformerBridge")


def _public_model_params():
    """(path, line, function, annotation or None) of every ``model`` parameter of a public module-level function or
    public method of a public class."""
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        defs += [
            m
            for c in tree.body
            if isinstance(c, ast.ClassDef) and not c.name.startswith("_")
            for m in c.body
            if isinstance(m, ast.FunctionDef)
        ]
        for fn in defs:
            if fn.name.startswith("_"):
                continue
            for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
                if a.arg == "model":
                    yield rel, fn.lineno, fn.name, ast.unparse(a.annotation) if a.annotation else None


def test_every_public_model_parameter_is_typed_with_the_contract_and_none_takes_a_name_or_a_bare_hf_model():
    params = list(_public_model_params())
    assert len(params) > 120  # the reader sees the package
    raw = [
        f"{p}:{l} {f}(model: {a})"
        for p, l, f, a in params
        if a is not None and any(t in RAW for t in a.replace(" ", "").split("|"))
    ]
    assert not raw, "public functions typing their model as a name or a bare Hugging Face model:\n" + "\n".join(raw)
    bad = [
        f"{p}:{l} {f}(model: {a})"
        for p, l, f, a in params
        if not p.startswith(EXEMPT) and a != "SinkModel" and p not in OTHER_TYPES.get(a or "", ())
    ]
    assert not bad, (
        "public functions whose `model` parameter is not annotated `SinkModel` (analysis.model.contract), "
        "on the signature line:\n" + "\n".join(bad)
    )


# The cache passes' helpers that read the causal LM the contract gives (``causal_lm``): its config, its modules. They
# are no analyses; every analysis above them takes the model of the contract.
PASS_HELPERS = {
    "streaming/cache.py": {"rope_spec"},
    "streaming/perplexity.py": {"decode_attention"},
    "quant/passes.py": {"__init__"},
    "streaming/generate.py": {"sink_cache"},
}  # the cache for hf.generate: built for the LM that generates
FLOOR_OF_ANALYSES = ("sinks/", "chain/", "positions/", "causal/", "dynamics/", "streaming/", "quant/", "figures/")


def test_no_analysis_takes_a_bare_hugging_face_module_but_the_cache_passes_helpers():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if not rel.startswith(FLOOR_OF_ANALYSES):
            continue
        tree = ast.parse(path.read_text())
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        defs += [
            m
            for c in tree.body
            if isinstance(c, ast.ClassDef) and not c.name.startswith("_")
            for m in c.body
            if isinstance(m, ast.FunctionDef)
        ]
        for fn in defs:
            args = [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg != "self"]
            if (
                (fn.name == "__init__" or not fn.name.startswith("_"))
                and args[:1] in (["hf"], ["hf_model"], ["tl_model"])
                and fn.name not in PASS_HELPERS.get(rel, ())
            ):
                found.append(f"{rel}:{fn.lineno} {fn.name}({args[0]})")
    assert not found, "public analyses taking a bare Hugging Face module (take `model: SinkModel`):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "drop, named",
    [
        ("hook_dict", "hook_dict"),
        ("cfg.n_heads", "cfg.n_heads"),
        ("patterns", "attention-pattern hooks"),
        ("tokenizer", "tokenizer"),
    ],
)
def test_the_check_at_load_refuses_a_model_missing_something_in_one_line(drop, named):
    from analysis.model.reference.config import ModelConfig
    from analysis.model.reference.sink_lm import SinkLM

    model = SinkLM(ModelConfig(d_vocab=16, n_ctx=8, d_model=16, n_heads=2, n_layers=1))
    assert is_model(model) and check_model(model) is model and hf_module(model) is None
    assert model_dtype(model) == torch.float32
    if drop == "cfg.n_heads":
        model.cfg.n_heads = None
    elif drop == "patterns":
        model.hook_dict = {k: v for k, v in model.hook_dict.items() if not k.endswith("hook_pattern")}
    else:
        delattr(model, drop)
    with pytest.raises(ModelContractError, match=f"lacks .*{named}.*load_model") as e:
        check_model(model)
    assert "\n" not in str(e.value)


def test_a_loaded_model_meets_the_contract_and_a_name_or_bare_model_is_refused(tiny_llama, tiny_llama_dir):
    from analysis.model.causal import own_causal_lm, require_model

    assert isinstance(tiny_llama, SinkModel) and hf_module(tiny_llama) is tiny_llama.original_model
    assert not is_model(str(tiny_llama_dir)) and not is_model(tiny_llama.original_model)
    assert require_model(tiny_llama, "f") is tiny_llama
    for given, what in ((str(tiny_llama_dir), "the name"), (tiny_llama.original_model, "a LlamaForCausalLM")):
        with pytest.raises(
            TypeError,
            match=f"^f takes the model analysis.load_model returns, not {what}.*call "
            r"f\(load_model\(name_or_path\), \.\.\.\)",
        ):
            require_model(given, "f")
    with own_causal_lm(tiny_llama) as hf:  # the bridge's own module, its wrappers off for the block
        assert hf is tiny_llama.original_model and not runs_bridge_components(hf)
    assert runs_bridge_components(tiny_llama.original_model)
