"""A Hugging Face causal LM through nnsight (``load_model(name, backend="nnsight")``): the model contract the nnsight
pass (``analysis.engine.remote``) reads, locally or on NDIF (``remote=True``).

Its module paths are TransformerLens' own, from the architecture adapter for its class (:func:`_layout`: from the
config alone, so a model on the meta device has them). q and k are read where the attention hands them to transformers'
attention function (``attention_interface(self, q, k, v, mask, scaling=...)``, through nnsight's ``.source``): after
the rotary and any q/k norm, before grouped-query heads repeat, with the mask of any sliding window. What the pass
cannot measure exactly (ALiBi, learned sinks, an attention without that call: Falcon; a site a layer has no module
for: a fused qkv's key projection, a parallel block's hook_resid_mid) is refused before any work, naming the bridge.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import reduce
from typing import NamedTuple

import torch

from analysis.model.contract import SinkModel
from analysis.model import families
from analysis.model.families import LAYER_TYPE_WORDS, FamilySpec, config_attention_layers, latent_attention
from analysis.model.mlp_spec import MlpSpec, MlpWeights, _activation_name, _moe_counts

CALL_PREFIX = "attention_interface_"  # nnsight's names for the attention-function calls in a forward's source
_BRIDGE = "run this on the bridge (--backend transformer_lens)"


class NnsightUnsupported(ValueError):
    """The nnsight pass cannot measure this model exactly; the reason says why and what to use."""


@dataclass(frozen=True)
class TraceWeight:
    """A weight a reduction reads where the model runs, by its TransformerLens name: in a trace on NDIF it is read
    there (``NnsightModel.weight``), so only what the reduction returns comes back, never the weight.

    Attributes
    ----------
    name : str
        "W_O": the per-head output weights (H, d_head, d_model); the key path's (``KeyPath.in_trace``): "ln1.w",
        "ln1.b" (the attention input's norm), "W_K" (H_kv, d_model, d_head), "b_K" (H_kv, d_head), "k_norm.w",
        "k_norm.b"; the quadratic form's "mlp.W_gate", "mlp.W_in" (d_mlp, d_model); the writer table's "mlp.W_out"
        (d_model, d_mlp), "mlp.b_out" (None where the MLP has no bias); gpt-oss's "sinks" (n_heads,).
    layer : int
    shape : tuple of int, optional
        Its shape, for a dry run's stand-in (``analysis.engine.remote``).
    """

    name: str
    layer: int
    shape: tuple | None = None


@dataclass
class NnsightSpec:
    """What the nnsight pass needs of a family, from its config.

    Attributes
    ----------
    family : str
        The config's ``model_type``.
    n_layers, n_heads, n_kv_heads, d_model : int
    attention_layers : tuple of int
        The softmax-attention layers (true indices), as ``families.config_attention_layers``.
    skipped : dict of int to str
        The other layers and why.
    sliding_window : int or None
        The window (its mask reaches the attention function; alpha counts hidden entries as zero).
    softcap : float or None
        Gemma 2's attention-logit soft cap.
    latent : dict or None
        Multi-head latent attention (``families.latent_attention``): every head its own key.
    """

    family: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    attention_layers: tuple[int, ...]
    skipped: dict[int, str] = field(default_factory=dict)
    sliding_window: int | None = None
    softcap: float | None = None
    latent: dict | None = None


def _nnsight_spec(config) -> NnsightSpec:
    """The spec of a Hugging Face config."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = int(cfg.num_hidden_layers)
    layers = tuple(config_attention_layers(cfg))
    types = getattr(cfg, "layers_block_type", None) or getattr(cfg, "layer_types", None)
    skipped = {l: LAYER_TYPE_WORDS.get(types[l], str(types[l])) for l in range(n) if l not in layers and types}
    mla = latent_attention(cfg)
    heads = int(cfg.num_attention_heads)
    return NnsightSpec(
        family=str(cfg.model_type),
        n_layers=n,
        n_heads=heads,
        n_kv_heads=heads if mla else int(getattr(cfg, "num_key_value_heads", None) or heads),
        d_model=int(cfg.hidden_size),
        attention_layers=layers,
        skipped=skipped,
        sliding_window=getattr(cfg, "sliding_window", None),
        softcap=getattr(cfg, "attn_logit_softcapping", None),
        latent=mla,
    )


@dataclass
class NnsightModel:
    """A Hugging Face causal LM in nnsight's ``LanguageModel``, with what the analyses need beside it.

    Attributes
    ----------
    lm : nnsight.LanguageModel
    tokenizer
        The tokenizer the probes use (ids chosen explicitly: no BOS unless asked).
    model_name : str
    spec : NnsightSpec
    remote : bool
        Traces run on NDIF (``remote=True``) rather than here.
    """

    lm: object
    tokenizer: object
    model_name: str
    spec: NnsightSpec
    remote: bool = False
    pass_backend = "nnsight"  # what its passes run on (``analysis.engine.remote``), as a bridge's ``pass_backend``

    @property
    def hf(self):
        """The Hugging Face model inside (meta-device weights for a remote model)."""
        return self.lm._module

    original_model = hf  # as a bridge's ``original_model``: where ``analysis.model.placement`` looks

    def parameters(self):
        """The Hugging Face model's parameters (their dtype and device, as the report records them)."""
        return self.hf.parameters()

    def modules(self):
        """The Hugging Face model's modules (what ``analysis.model.reference.attention.pattern_note`` looks through)."""
        return self.hf.modules()

    @property
    def n_ctx(self) -> int | None:
        """The context length of the config (``max_position_embeddings``; None where it has none)."""
        return int(n) if (n := getattr(self.hf.config.get_text_config(), "max_position_embeddings", None)) else None

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary size of the config (``vocab_size``; None where it has none)."""
        return int(n) if (n := getattr(self.hf.config.get_text_config(), "vocab_size", None)) else None

    @property
    def layout(self) -> _Layout:
        """The family's module paths (:func:`_layout`), kept (no cached_property: its lock would not pickle)."""
        return vars(self).get("_layout") or vars(self).setdefault("_layout", _layout(self.hf))

    def decoder_layers(self):
        """The envoys of the decoder layers (the adapter's blocks: ``model.layers``, ``transformer.h``, ...)."""
        return reduce(getattr, self.layout.paths["blocks"].split("."), self.lm)

    def part(self, layer: int, comp: str, *, need: bool = False):
        """The envoy of layer ``layer``'s TransformerLens component ``comp`` ("": the layer; "attn", "attn.k", "ln2",
        "mlp.out", ...); None where this family's layer has no such module, or NnsightUnsupported if ``need``."""
        path = self.layout.paths.get(comp) if comp else ""
        env = None if path is None else self.decoder_layers()[layer]
        for name in path.split(".") if path else ():
            env = getattr(env, name) if env is not None and hasattr(env._module, name) else None
        if env is None and need:
            why = " (a fused qkv projection)" if comp[:-1] == "attn." and "attn.qkv" in self.layout.paths else ""
            raise NnsightUnsupported(f"{self.spec.family}: layer {layer} has no {comp} module{why}: {_BRIDGE}.")
        return env

    def weight(self, w: TraceWeight):
        """``w`` (a :class:`TraceWeight`) in TransformerLens' layout, read where the trace runs (inside a trace: on
        NDIF, the weight there): W_O (H, d_head, d_model) from the attention's output projection (d_model, H * d_head;
        a Conv1D's transposed); W_K (H_kv, d_model, d_head) from its own key projection (none in a fused qkv: refused);
        the others as the modules keep them."""
        if w.name == "sinks":  # gpt-oss's learned sink logit per head
            return self.part(w.layer, "attn", need=True).sinks
        where, _, leaf = w.name.replace("k_norm", "attn.k_norm").rpartition(".")  # W_X of component x: "mlp.W_out"
        kind, _, x = leaf.partition("_")  # a norm's "w" / "b": "ln1.b", "k_norm.w"
        env = self.part(w.layer, f"{where or 'attn'}.{x.lower()}" if x else where, need=True)
        attr = {"W": "weight", "w": "weight", "b": "bias"}.get(kind, "")
        if getattr(env._module, attr, None) is None:
            if attr == "bias":
                return None  # a module without a bias (b_out of an MLP that has none, as MlpWeights holds it)
            raise NnsightUnsupported(f"{self.spec.family}: no {w.name} a trace can read at layer {w.layer}.")
        t, s = getattr(env, attr), self.spec
        t = t.T if _conv1d(env, attr) else t
        if w.name == "W_O":
            return t.T.reshape(s.n_heads, -1, s.d_model)
        if w.name == "W_K":
            return t.T.reshape(s.d_model, s.n_kv_heads, -1).permute(1, 0, 2)
        return t.reshape(s.n_kv_heads, -1) if w.name == "b_K" else t

    def site(self, layer: int, name: str):
        """Where layer ``layer``'s forward reaches the TransformerLens site ``name`` (a key of :data:`BLOCK_SITES` but
        "call"): (the envoy of the first of its components the layer has, "input" or "output", the factor the bridge's
        hook holds it times: Granite's residual multiplier on a write, else 1). NnsightUnsupported where the layer has
        none (a fused qkv: no key projection; a parallel block: no stream between attention and MLP)."""
        comps, side = BLOCK_SITES[name]
        scale = getattr(self.hf.config.get_text_config(), "residual_multiplier", None) or 1.0
        if name == "hook_resid_mid" and self.layout.parallel:
            raise NnsightUnsupported(f"{self.spec.family}: a parallel block has no {name}: {_BRIDGE}.")
        for comp in comps:
            env = self.part(layer, comp, need=comp == comps[-1])
            if env is not None:
                return env, side, scale if name in ("hook_attn_out", "hook_mlp_out") else 1.0

    @property
    def family(self) -> FamilySpec:
        """The family facts (``analysis.model.families.FamilySpec``) read from the Hugging Face model and its
        config, once: what ``get_family`` gives (the key path of the norm-gain trace reads it)."""
        return vars(self).get("_family") or vars(self).setdefault("_family", _nnsight_family(self))

    @property
    def mlp_spec(self) -> MlpSpec:
        """The MLP facts (``analysis.model.mlp_spec.MlpSpec``) read from the Hugging Face modules and config, once:
        what ``get_mlp`` gives (the spike writers' neurons, their quadratic form and first-token cause read it)."""
        return vars(self).get("_mlp") or vars(self).setdefault("_mlp", _nnsight_mlp(self))

    def block_module(self, layer: int, name: str):
        """Layer ``layer``'s Hugging Face module by the bridge's name ("ln1", "ln2": the MLP's input norm,
        "ln2_post": the norm on its write, "mlp": the layer itself where its MLP has no module, OPT), as
        ``analysis.model.mlp_spec.block_norm`` reads a bridge's; None where the layer has none."""
        env = self.part(layer, "" if name == "mlp" and not self.layout.paths["mlp"] else name)
        mod = getattr(env, "_module", None)
        if self.remote and name != "mlp" and mod is not None and any(p.is_meta for p in mod.parameters()):
            every = slice(None)  # a model held on NDIF: the norm's parameters read there, once, into its module here
            got = self.read_in_trace([(env, k, every, every, False) for k, _ in mod.named_parameters()])
            for p, t in zip(mod.to_empty(device="cpu").parameters(), got):
                p.data.copy_(t)
        return mod

    def mlp_weights(self, layer: int, *, neurons=None, dims=None) -> MlpWeights:
        """Layer ``layer``'s dense MLP weights (the out, in and any gate projection) as the bridge's ``mlp_weights``
        gives them (float32, CPU), restricted to ``neurons`` and ``dims`` (``MlpWeights.select``). Where they are on
        NDIF (a meta-device model) only those slices are read, in one trace there (:meth:`read_in_trace`);
        NnsightUnsupported for a whole weight there, or a layer with no dense MLP."""
        out, up, gate = (self.part(layer, c) for c in ("mlp.out", "mlp.in", "mlp.gate"))
        if not self.mlp_spec.has_neurons(layer):
            raise NnsightUnsupported(f"{self.spec.family}: layer {layer} has no dense MLP.")
        meta = up._module.weight.is_meta
        if meta and neurons is None and dims is None:
            raise NnsightUnsupported(
                f"{self.model_name}'s MLP weights are on NDIF: read the slices an analysis uses (mlp_weights(model, "
                "layer, neurons=..., dims=...)), never a whole weight."
            )
        pairs = ((e, a) for e in (out, up, gate) if e is not None for a in ("weight", "bias"))  # a plain MLP: no gate
        where = {f: p for f, p in zip(MlpWeights.TENSORS, pairs) if getattr(p[0]._module, p[1]) is not None}
        cut = MlpWeights.slices(neurons, dims).items()  # field -> (rows, then the index into those), as select's
        todo = {f: (*where[f], i, j, _conv1d(*where[f])) for f, (i, j) in cut if f in where}
        reads = list(todo.values())  # (envoy, parameter, rows, index, turned)
        if meta:
            got = self.read_in_trace(reads)
        else:
            got = [(getattr(e._module, a).T if t else getattr(e._module, a))[i][j] for e, a, i, j, t in reads]
        t = {f: x.detach().float().cpu() for f, x in zip(todo, got) if f[0] == "W" or (x != 0).any()}  # 0 bias: none
        return MlpWeights(int(layer), **{f: t.get(f) for f in MlpWeights.TENSORS})

    def read_in_trace(self, reads) -> list:
        """Parameter slices read where the model runs, in one trace of one token: ``reads`` lists (a module's envoy,
        its parameter's name, the rows, then the index into those, and whether the parameter is turned first: a
        Conv1D's weight to a Linear's layout); on NDIF (``remote``) only the slices come back."""
        import nnsight  # optional: the "remote" extra

        with torch.no_grad(), self.lm.trace({"input_ids": torch.zeros(1, 1, dtype=torch.long)}, remote=self.remote):
            got = nnsight.save([(getattr(e, a).T if t else getattr(e, a))[i][j] for e, a, i, j, t in reads])
        return list(got)

    def attention_call_name(self, layer: int) -> str:
        """The name of layer ``layer``'s call to the attention function among its forward's source entries."""
        return call_name(self.part(layer, "attn", need=True).source.names, self.spec.family)

    def attention_call(self, layer: int):
        """The nnsight source entry of layer ``layer``'s call to the attention function (its ``.inputs`` are
        ``((module, q, k, v, mask), kwargs)``)."""
        return getattr(self.part(layer, "attn", need=True).source, self.attention_call_name(layer))


# Where a decoder layer's forward reaches each TransformerLens site (and "k_in", the key projection's input, edited), in
# order: (the block's components holding it, the first the layer has: a write's norm in Gemma 2/3 and OLMo-2; OLMo-2
# has no ln2, OPT no mlp module; "input" or "output"); "call": the attention function's call (q, k, v, pattern, z).
BLOCK_SITES = {
    "hook_resid_pre": (("",), "input"),
    "k_in": (("attn.k",), "input"),
    "hook_k_proj": (("attn.k",), "output"),
    "call": None,
    "hook_attn_out": (("ln1_post", "attn"), "output"),
    "hook_resid_mid": (("ln2", "mlp", "mlp.in"), "input"),
    "mlp.hook_in": (("mlp", "mlp.in"), "input"),
    "mlp.hook_pre": (("mlp.gate", "mlp.in"), "output"),
    "mlp.hook_pre_linear": (("mlp.in",), "output"),
    "mlp.hook_post": (("mlp.out",), "input"),
    "hook_mlp_out": (("ln2_post", "mlp", "mlp.out"), "output"),
    "hook_resid_post": (("",), "output"),
}


class _Layout(NamedTuple):
    """Where a family's decoder layers keep a TransformerLens block's components (:func:`_layout`)."""

    paths: dict  # "blocks": the layer list's path; each component ("ln1", "attn.k", "mlp.out"): its path in a layer
    parallel: bool  # attention and MLP both read the layer's input (GPT-J, GPT-NeoX, Phi): no hook_resid_mid
    positions: str | None  # the adapter's positional_embedding_type


def _layout(hf) -> _Layout:
    """The layout of a Hugging Face causal LM from TransformerLens' own architecture adapter for it (the adapter's
    ``component_mapping``): built from the config alone, so a model whose weights are on the meta device (NDIF) has
    it too. NnsightUnsupported where TransformerLens has none."""
    from transformer_lens.factories.architecture_adapter_factory import ArchitectureAdapterFactory
    from transformer_lens.model_bridge.sources import build_bridge_config_from_hf
    from transformer_lens.model_bridge.sources.transformers import determine_architecture_from_hf_config

    try:
        arch = determine_architecture_from_hf_config(hf.config)  # as the bridge picks it (PhiMoEForCausalLM)
    except ValueError:
        arch = type(hf).__name__  # a config built in memory names no architectures: its class
    try:
        cfg = build_bridge_config_from_hf(hf.config, arch, "nnsight", torch.float32)
        adapter = ArchitectureAdapterFactory.select_architecture_adapter(cfg)
    except ValueError as e:
        raise NnsightUnsupported(f"{arch}: TransformerLens has no adapter for it ({e}).") from None
    blocks = adapter.component_mapping["blocks"]
    paths, todo = {"blocks": blocks.name}, [("", "", blocks.submodules)]
    while todo:  # (the component's key prefix, its path in a layer, its submodules)
        key, path, subs = todo.pop()
        for k, c in (subs or {}).items():
            paths[key + k] = ".".join(x for x in (path, c.name) if x) if c.name else None  # None: no module of its own
            todo.append((f"{key}{k}.", paths[key + k] or path, c.submodules))
    for k in [k for k in paths if k.startswith("mlp.dense_")]:  # an MoE family's dense linears, as every other's
        paths["mlp." + k.removeprefix("mlp.dense_")] = paths[k]  # (its router, "mlp.gate", is read from the module)
    return _Layout(paths, bool(getattr(adapter.cfg, "parallel_attn_mlp", False)), adapter.cfg.positional_embedding_type)


def _nnsight_family(model: NnsightModel) -> FamilySpec:
    """The family facts of a model loaded through nnsight, read with the readers of the bridge's
    (``analysis.model.families``) from its Hugging Face modules and config. Its queries and keys are read where the
    attention function receives them, after the rotary and any q/k norm (``hook_rot_q``, ``hook_rot_k``); its norms
    are measured on a probe (of a copy, where the weights are on the meta device)."""
    s, hf, layers = model.spec, model.hf, model.spec.attention_layers
    cfg = hf.config.get_text_config()
    d_head = int(getattr(cfg, "head_dim", None) or s.d_model // s.n_heads)
    types = families._layer_types(cfg, s.n_layers)
    window, sliding = families._sliding(cfg, types, layers)
    norm, kn = (_probe(getattr(model.part(layers[0], c), "_module", None)) for c in ("ln1", "attn.k_norm"))
    attn = model.part(layers[0], "attn", need=True)._module
    return FamilySpec(
        family=s.family,
        architecture=type(hf).__name__,
        n_layers=s.n_layers,
        attention_layers=layers,
        skipped_layers=dict(s.skipped),
        n_heads=s.n_heads,
        n_kv_heads=s.n_kv_heads,
        d_head=d_head,
        d_model=s.d_model,
        **families._positions(hf, cfg, s.family, types, layers, model.layout.positions, d_head),
        norm=norm,
        norm_placement="pre" if norm else "none",
        parallel_block=model.layout.parallel,
        qk_norm=kn,
        qk_norm_scope=None if kn is None else ("head" if kn.size == d_head else "all_heads"),
        qk_l2_norm=getattr(attn, "qk_norm", None) is not None,
        learned_sinks=isinstance(getattr(attn, "sinks", None), torch.Tensor),
        fused_qkv="attn.qkv" in model.layout.paths,
        key_rotated=True,
        pattern_live=True,
        sliding_window=int(window) if window else None,
        sliding_layers=tuple(sliding),
        attn_scale=families._attn_scale(attn, d_head),
        attn_softcap=s.softcap,
        latent=s.latent,
        _key_hook="blocks.{layer}.attn.hook_rot_k",
        _query_hook="blocks.{layer}.attn.hook_rot_q",
        _scores_hook=None,
    )


def _nnsight_mlp(model: NnsightModel) -> MlpSpec:
    """The MLP facts of a model loaded through nnsight, from its Hugging Face modules: dense MLPs (an in and an out
    projection, gated where a gate projection is beside them; the activation matched on the module's own) after the
    input norm ("ln2"; "ln1" in a parallel block without one) on the stream the MLP reads, each write added (or
    normalised first, Gemma 2/3: "ln2_post"); the layers whose MLP has ``experts`` are mixtures of experts."""
    s, par, part, mod = model.spec, model.layout.parallel, model.part, model.block_module
    moe = tuple(l for l in range(s.n_layers) if hasattr(getattr(part(l, "mlp"), "_module", None), "experts"))
    dense = [l for l in range(s.n_layers) if l not in moe and None not in (part(l, "mlp.in"), part(l, "mlp.out"))]
    l0 = dense[0] if dense else None
    gated = l0 is not None and part(l0, "mlp.gate") is not None
    out_norm = _probe(mod(l0, "ln2_post"), model) if dense else None
    in_name = "ln2" if not dense or mod(l0, "ln2") or not par else "ln1"  # GPT-J, Phi: one norm for both
    in_norm = _probe(mod(l0, in_name), model) if dense else None
    scale = float(getattr(model.hf.config.get_text_config(), "residual_multiplier", None) or 1.0)  # Granite
    fc = part(l0, "mlp.in")._module if dense else None
    hook = "blocks.{layer}.mlp.hook_%s"
    return MlpSpec(
        family=s.family,
        kind=("gated" if gated else "plain") if dense else ("moe" if moe else "none"),
        activation=_activation_name(model, l0, None, None, None, gated) if dense else None,
        d_mlp=getattr(fc, "out_features", None) or getattr(fc, "nf", None),  # a Linear's, a Conv1D's (GPT-2)
        parallel=par,
        input_resid="resid_pre" if par else "resid_mid",
        input_norm=in_norm,
        input_norm_module=in_name if in_norm else None,
        output="post_norm" if out_norm else ("scaled" if scale != 1.0 else "add"),
        output_scale=scale,
        output_norm=out_norm,
        output_norm_module="ln2_post" if out_norm else None,
        additive=True,
        mixer_layers=tuple(s.skipped),
        moe_layers=moe,
        **dict(zip(("n_experts", "top_k"), _moe_counts(model, moe))),
        _neuron_hook=hook % "post" if dense else None,
        _gate_hook=hook % "pre" if gated else None,
        _up_hook=(hook % ("pre_linear" if gated else "pre")) if dense else None,
        _input_hook=hook % "in",
        notes=()
        if dense or moe or part(0, "mlp") is None
        else (f"No site holds them apart (a joint gate_up_proj): {_BRIDGE}.",),
    )


def _conv1d(env, attr: str) -> bool:
    """Whether ``env``'s parameter ``attr`` is a weight a Conv1D keeps as (in, out): GPT-2's; a Linear's is (out, in)."""
    return attr == "weight" and type(env._module).__name__ == "Conv1D"


def _probe(module, model: NnsightModel | None = None):
    """``families.probe_norm`` of a norm module (None: no module; named in ``model``'s Hugging Face model where
    given), on a copy with random weights where they are on the meta device (a model held on NDIF): its form does
    not depend on the values."""
    if module is None:
        return None
    if any(p.is_meta for p in module.parameters()):
        import copy  # import time: a meta model's dry run only

        module = copy.deepcopy(module).to_empty(device="cpu")
        for p in module.parameters():
            p.data.normal_()
    return families.probe_norm(module, model=model)


def weights_in_trace(model: SinkModel) -> bool:
    """Whether an analysis reads ``model``'s weights inside its traces (:class:`TraceWeight`) rather than here: a model
    loaded through nnsight, whose weights may stay on NDIF.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    bool
    """
    return isinstance(model, NnsightModel)


def call_name(names, family: str) -> str:
    """The last of a forward's source entries named ``attention_interface_<i>``: the call (the first may be the
    lookup ``ALL_ATTENTION_FUNCTIONS.get_interface``).

    Parameters
    ----------
    names : sequence of str
        nnsight's names of the forward's operations (``.source.names``).
    family : str
        For the message.

    Returns
    -------
    str
        NnsightUnsupported where the forward calls no attention function.
    """
    calls = [n for n in names if n.startswith(CALL_PREFIX) and n[len(CALL_PREFIX) :].isdigit()]
    if not calls:
        raise NnsightUnsupported(
            f"{family}: its attention does not call transformers' attention function, where the "
            "nnsight pass reads q and k after the rotary; use the bridge (backend='transformer_lens')."
        )
    return max(calls, key=lambda n: int(n[len(CALL_PREFIX) :]))


def _unsupported(hf) -> str | None:
    """Why the nnsight pass cannot give this model's exact alpha (None when it can), from its config and modules."""
    cfg = hf.config.get_text_config()
    if getattr(cfg, "alibi", False) or getattr(cfg, "model_type", "") in ("bloom", "mpt"):
        return "an ALiBi position bias is added to the scores outside q . k."
    if getattr(cfg, "is_decoder", True) is False and getattr(cfg, "is_encoder_decoder", False):
        return "an encoder-decoder model: alpha here is defined for causal attention."
    return None


def wrap_nnsight(hf, *, tokenizer, name: str = "in-memory model", remote: bool = False) -> NnsightModel:
    """Wrap a Hugging Face causal LM in nnsight's ``LanguageModel`` (refusing what the pass cannot measure).

    Parameters
    ----------
    hf : transformers.PreTrainedModel
    tokenizer
    name : str
    remote : bool
        Run the traces on NDIF (the model there is the hub's ``name``).

    A meta-device ``hf`` is wrapped in nnsight's plain ``NNsight`` for a dry run: its spec, its attention calls and
    the request plan, no trace.

    Returns
    -------
    NnsightModel
    """
    from nnsight import LanguageModel, NNsight  # optional: the "remote" extra

    if reason := _unsupported(hf):
        raise NnsightUnsupported(f"{type(hf).__name__}: {reason}")
    hf.eval()
    import warnings  # import time: the deprecation note below only

    if next(hf.parameters()).is_meta:  # a dry run (plans, spec, source checks): no pipeline, which would move it
        lm = NNsight(hf)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # LanguageModel's rename notice (nnsight 0.8); same class, same behaviour
            lm = LanguageModel(hf, tokenizer=tokenizer)
    model = NnsightModel(lm, tokenizer, name, _nnsight_spec(hf.config), remote=bool(remote))
    if model.spec.attention_layers:
        model.attention_call(model.spec.attention_layers[0])  # refuse a family without the call now
    return model


def remote_meta_model(repo_id: str) -> NnsightModel:
    """A hub model held on NDIF: nnsight's ``LanguageModel(repo_id)`` loads only its config and tokenizer here
    (meta-device weights), and the traces run remotely.

    Parameters
    ----------
    repo_id : str

    Returns
    -------
    NnsightModel
    """
    from nnsight import LanguageModel  # optional: the "remote" extra

    if not os.environ.get("NDIF_API_KEY"):
        raise NnsightUnsupported(
            "remote=True needs an NDIF key: set NDIF_API_KEY (docs/remote.md says how to get one)."
        )
    lm = LanguageModel(repo_id)
    return NnsightModel(lm, lm.tokenizer, repo_id, _nnsight_spec(lm.config), remote=True)
