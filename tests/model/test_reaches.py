"""Nothing outside ``analysis/model/`` reaches into Hugging Face or TransformerLens internals (#47, point 6): the
model floor owns that knowledge behind typed functions, and every analysis asks it. This test counts the places that
still reach past it (read from the source with ``ast``, well under a second) and fails when one is added.

A **reach** is, in a module of ``analysis/`` outside ``analysis/model/``:

- an import of ``transformers`` or ``transformer_lens`` (any submodule);
- a read, write or ``getattr`` / ``hasattr`` / ``setattr`` of a member in :data:`INTERNALS` on anything but ``self``
  (an object's own member of that name is its own): TransformerLens' blocks, config and wrapped model
  (``blocks``, ``cfg``, ``original_model``, ``original_component``), a Hugging Face model's config and modules
  (``config``, ``self_attn``, ``embed_tokens``, ``lm_head``, ``rotary_emb``, ``layer_idx``, ``hf_device_map``) and
  the private members either rewrites (``_modules``, ``_attn_implementation``, ...);
- a private one of those names as a string key or in an ``in`` test (``b._modules["_original_component"]``).

A **place** is a source line with one reach or more. ``ALLOWED`` lists, per file, how many places may remain and why;
a new reach goes into ``analysis/model/`` as a typed function (``analysis.model.contract`` and the modules beside it),
or here with its reason. On main before this test: 64 places (37 outside streaming/ and quant/); after moving them
into ``analysis.model.access`` and ``model_facts``: 27, all in streaming/ and quant/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import analysis

ROOT = Path(analysis.__file__).resolve().parent
LIBS = ("transformers", "transformer_lens")
INTERNALS = frozenset(
    {
        "blocks",
        "cfg",
        "original_model",
        "original_component",
        "_original_component",  # TransformerLens' bridge
        "config",
        "self_attn",
        "embed_tokens",
        "lm_head",
        "rotary_emb",
        "layer_idx",
        "hf_device_map",  # Hugging Face's
        "_modules",
        "_attn_implementation",
        "_can_set_attn_implementation",
    }
)  # the private members they rewrite
ACCESSORS = frozenset({"getattr", "hasattr", "setattr", "delattr"})

STREAMING_QUANT = "the streaming / quant cache passes, moved by their own change (#47 point 6's shims)"
# file (under analysis/) -> (the most places it may keep, why). None outside streaming/ and quant/.
ALLOWED = {
    "quant/kv_cache.py": (1, STREAMING_QUANT),
    "quant/passes.py": (2, STREAMING_QUANT),
    "quant/sites.py": (3, STREAMING_QUANT),
    "streaming/attention.py": (3, STREAMING_QUANT),
    "streaming/backbone.py": (10, STREAMING_QUANT),
    "streaming/cache.py": (1, STREAMING_QUANT),
    "streaming/generate.py": (1, STREAMING_QUANT),
    "streaming/perplexity.py": (1, STREAMING_QUANT),
    "streaming/reference.py": (5, STREAMING_QUANT),
}


def _own(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _private(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in INTERNALS and node.value.startswith("_")


def _reach(n: ast.AST) -> str | None:
    """What reach ``n`` is, in words; None where it is none."""
    if isinstance(n, ast.Import):
        hit = [a.name for a in n.names if a.name.split(".")[0] in LIBS]
        return f"import {hit[0]}" if hit else None
    if isinstance(n, ast.ImportFrom):
        return f"from {n.module} import" if n.level == 0 and (n.module or "").split(".")[0] in LIBS else None
    if isinstance(n, ast.Attribute):
        return f".{n.attr}" if n.attr in INTERNALS and not _own(n.value) else None
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ACCESSORS and len(n.args) >= 2:
        name = n.args[1]
        hit = isinstance(name, ast.Constant) and name.value in INTERNALS and not _own(n.args[0])
        return f"{n.func.id}({name.value!r})" if hit else None
    if isinstance(n, ast.Subscript) and _private(n.slice):
        return f"[{n.slice.value!r}]"
    if isinstance(n, ast.Compare) and _private(n.left) and any(isinstance(o, (ast.In, ast.NotIn)) for o in n.ops):
        return f"{n.left.value!r} in"
    return None


def reaches(source: str) -> dict[int, str]:
    """The places of ``source`` that reach into Hugging Face or TransformerLens internals: {line: what}."""
    out: dict[int, str] = {}
    for n in ast.walk(ast.parse(source)):
        what = _reach(n)
        if what is not None:
            out.setdefault(n.lineno, what)
    return dict(sorted(out.items()))


def package_reaches() -> dict[str, dict[int, str]]:
    """{file under analysis/: its places}, for every module outside analysis/model/ with one."""
    found = {
        p.relative_to(ROOT).as_posix(): reaches(p.read_text())
        for p in sorted(ROOT.rglob("*.py"))
        if p.relative_to(ROOT).parts[0] != "model"
    }
    return {f: r for f, r in found.items() if r}


def test_the_scan_sees_each_kind_of_reach_and_leaves_the_rest():
    src = (
        "import transformers\nfrom transformer_lens.hook_points import HookPoint\nx = model.blocks[0].attn\n"
        "n = model.cfg.n_layers\nc = getattr(hf, 'config', None)\nb._modules['_original_component'] = m\n"
        "ok = '_original_component' in b._modules\n"
        "self.blocks = []\nout['blocks'] = 1\nfrom analysis.model.hooks import model_dims\nimport torch\n"
        "d = model_dims(model).n_layers\ny = self.config\n"
    )
    assert reaches(src) == {
        1: "import transformers",
        2: "from transformer_lens.hook_points import",
        3: ".blocks",
        4: ".cfg",
        5: "getattr('config')",
        6: "['_original_component']",
        7: "'_original_component' in",
    }


def test_no_new_reach_into_hugging_face_or_transformer_lens_internals():
    found = package_reaches()
    over = {f: (len(r), ALLOWED.get(f, (0,))[0], r) for f, r in found.items() if len(r) > ALLOWED.get(f, (0,))[0]}
    assert not over, (
        "places outside analysis/model/ reach into Hugging Face or TransformerLens internals (file: (found, allowed, "
        "{line: what})); move each into a typed function of analysis/model/ (analysis.model.contract and the modules "
        f"beside it) and call that, or list it in ALLOWED here with its reason: {over}"
    )
    stale = sorted(f for f in ALLOWED if not (ROOT / f).exists())
    assert not stale, f"ALLOWED names files that are gone: {stale}"
    assert sum(map(len, found.values())) <= sum(n for n, _ in ALLOWED.values())


def test_model_facts_are_derived_once_per_model_and_again_when_its_family_changes(tiny_llama):
    import dataclasses

    from analysis.model.hooks import model_dims, model_facts

    facts = model_facts(tiny_llama)
    assert model_facts(tiny_llama) is facts  # kept: every accumulator asks, none is handed them
    assert facts.dims == model_dims(tiny_llama) and facts.family is tiny_llama.family
    kept = tiny_llama.family
    try:
        tiny_llama.family = dataclasses.replace(kept, attention_layers=kept.attention_layers[:1])
        again = model_facts(tiny_llama)
        assert again is not facts and again.attention_layers == tuple(kept.attention_layers[:1])
    finally:
        tiny_llama.family = kept
    assert model_facts(tiny_llama).attention_layers == tuple(kept.attention_layers)


def test_the_typed_reads_answer_on_a_bridge_and_refuse_what_it_is_not(tiny_llama):
    import pytest
    import torch

    from analysis.model import access
    from analysis.model.contract import ModelContractError
    from analysis.model.hooks import model_dims

    d = model_dims(tiny_llama)
    assert access.head_output_weights(tiny_llama, 0).shape == (d.n_heads, d.d_head, d.d_model)
    assert access.can_skip_blocks(tiny_llama) and access.interface_refusal(tiny_llama) is None
    assert access.attention_operation(tiny_llama) == "softmax" and access.attention_window(tiny_llama) is None
    wrapped = [b._modules["_original_component"] for b in tiny_llama.blocks]
    x = torch.randn(1, 3, d.d_model)
    with access.skipped_blocks(tiny_llama, 1):
        assert tiny_llama.blocks[0]._modules["_original_component"](x) is x  # handed on unchanged
        assert tiny_llama.blocks[1]._modules["_original_component"] is wrapped[1]
    assert [b._modules["_original_component"] for b in tiny_llama.blocks] == wrapped  # restored
    with pytest.raises(ModelContractError, match="not a reference model"):
        access.reference_config(tiny_llama)
