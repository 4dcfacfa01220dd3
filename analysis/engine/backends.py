"""The backends a pass runs on: what produces the TransformerLens-named activations the accumulators read.

- ``transformer_lens``: TransformerLens' ``TransformerBridge`` and its hook points (every hook name; each attention
  layer builds its T x T map eagerly);
- ``transformers``: the Hugging Face model itself, unbridged, in its own attention (transformers'
  ``AttentionInterface``): forward hooks on the decoder layers give the residual stream, and the attention function
  gives q and k after the rotary and any q/k norm, v, the head outputs z, and ``hook_pattern`` as
  ``AttentionWeights`` (q, k and each row's log-sum-exp from the fused kernel: no T x T map). Interventions on the
  residual stream, v and z are applied where the activation is made;
- ``nnsight``: the same reads and edits inside one nnsight trace per batch (:class:`NnsightTaps`): each module's
  ``.input`` / ``.output`` envoy, and the attention function's call read through ``.source`` (q, k, v, mask, scale in,
  z out; ``hook_pattern`` as ``AttentionWeights`` with the rows' log-sum-exp taken from q and k). Here it runs the
  whole report; on NDIF (``remote=True``) the accumulators' reductions run in the traces of ``analysis.engine.remote`` for the sink and massive
  tables (docs/remote.md);
- ``auto``: ``transformers`` where it gives every hook and edit the pass asks for on this model, the bridge
  elsewhere. :func:`choose_backend` says which and why; the results record it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterable, Sequence

import torch

from analysis.model.access import attention_layer_index, hooked_modules, interface_refusal, register_attention
from analysis.model.access import module_part, unwrap_component
from analysis.model.causal import unbridged  # its home is the model floor
from analysis.model.contract import BACKENDS, ModelContractError, SinkModel, hf_module
from analysis.model.families import attention_implementation, get_family
from analysis.model.hooks import hook_layer
from analysis.model.rotary import apply_spec_rotary
from analysis.model.nnsight_model import call_name
from analysis.engine.attention import AttentionWeights
from analysis.engine.kernels import _refuse_extras, _interface_attention

PASS_ATTENTION = "attention_sinks_pass"  # the name registered in transformers' attention and mask interfaces
_TAPS: contextvars.ContextVar = contextvars.ContextVar("attention_sinks_taps", default=None)

# The attention hooks the attention function gives (q and k as the attention used them, v, z, the weights); every
# other hook is the input or output of the Hugging Face module the bridge's component wraps (``_module_site``).
ATTENTION_HOOKS = ("hook_pattern", "hook_rot_q", "hook_rot_k", "hook_q", "hook_k", "hook_v", "hook_z")
# bridge components inside the attention function: their outputs are the bridge's own; the inputs of the q, k and v
# projections are those modules' inputs (the output projection's is z, which the attention function gives)
_ATTENTION_PARTS = (".attn.q", ".attn.k", ".attn.v", ".attn.o")


class BackendUnsupported(ModelContractError):
    """The backend cannot give what a pass asks for on this model (a hook, an edit, a family's attention)."""


def _check_backend(backend: str) -> str:
    """``backend`` checked against :data:`BACKENDS` (ValueError otherwise)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}.")
    return backend


def _site(name: str) -> str:
    """The hook's last part: ``hook_pattern`` of ``blocks.3.attn.hook_pattern``."""
    return name.rpartition(".")[2]


def _model_reason(model: SinkModel) -> str | None:
    """Why the transformers backend cannot run ``model`` at all (None when it can): not a Hugging Face model, attention
    the interface does not compute, hooks attached to the bridge."""
    if reason := interface_refusal(model):
        return reason
    if hooked := hooked_modules(model, bridged=model is not hf_module(model)):
        return f"hooks are attached ({hooked[0]}{', ...' if len(hooked) > 1 else ''}); they run only on the bridge"
    return None


def _hf_modules(model: SinkModel) -> set[int]:
    """The ids of the Hugging Face model's own modules (those its forward runs), the bridge's wrappers aside."""
    with unbridged(hf_module(model)) as hf:
        return {id(m) for m in hf.modules()}


def _module_site(model: SinkModel, name: str, *, own: set[int] | None = None, points=None) -> tuple:
    """The Hugging Face module whose input (``"in"``) or output (``"out"``) is the bridge's hook ``name``, and the
    hook's part of it: None where it is all of it, else (take, put) (``access.module_part``: q and k by head, a joint
    projection's half, Granite's scaled contribution, Qwen3-Next's gate and gated z, a norm's normalised input).

    The bridge names its hooks after its components (``blocks.3.hook_mlp_out`` is ``blocks.3.mlp.hook_out``), and
    each component wraps one Hugging Face module: its ``hook_in`` / ``hook_out`` are that module's input and output.

    ``own`` (:func:`_hf_modules`) and ``points`` (``model.hook_dict``, which the bridge builds anew, aliases and all, on
    every read) are given where the caller has them. BackendUnsupported where no Hugging Face module's input or output
    holds that hook (a component the bridge made up that no part names is no module the model runs)."""
    if part := module_part(model, name, get_family(model)):
        return part[0], part[1], part[2:]
    point = (model.hook_dict if points is None else points).get(name)
    canonical = getattr(point, "name", None) or name
    path, _, which = canonical.rpartition(".")
    inside = path.endswith(_ATTENTION_PARTS) and (which == "hook_out" or path.endswith(".attn.o"))
    if which not in ("hook_in", "hook_out") or inside:
        raise BackendUnsupported(f"the hook {name} is no Hugging Face module's input or output")
    try:
        bridged = model.get_submodule(path)
    except AttributeError:
        raise BackendUnsupported(f"the hook {name} names no component of the bridge ({path})") from None
    inner = unwrap_component(bridged)
    if inner is bridged or id(inner) not in (_hf_modules(model) if own is None else own):
        raise BackendUnsupported(f"the bridge's component {path} ({name}) wraps no module the Hugging Face model runs")
    return inner, which[len("hook_") :], None


def _by_call(model: SinkModel, spec, name: str) -> bool:
    """Whether the attention function gives the hook ``name`` (else a module's input or output, ``_module_site``): q
    and k where no projection of their own gives them (a joint QKV, MLA), v, z (but a gated one) and the weights."""
    site = _site(name)
    if ".attn.hook_" not in name or site not in ATTENTION_HOOKS or (site == "hook_z" and spec.gate is not None):
        return False
    return site not in ("hook_q", "hook_k") or module_part(model, name, spec) is None


def _hooks_reason(model: SinkModel, names: Iterable[str], *, edits: Iterable[str] = ()) -> str | None:
    """Why the transformers backend cannot give these hooks or apply these edits on ``model`` (None when it can).

    ``names`` are the hooks the accumulators read, ``edits`` the hooks that interventions change."""
    spec = get_family(model)
    # hook_q/hook_k from the interface's q and k: as they are (MLA), or turned back by the spec's rotary where no q/k
    # norm follows it and the frequencies are the plain theta's
    turns_back = spec.positions != "rotary" or spec.rope_type == "default"
    qk_exact = spec.latent is not None or (spec.qk_norm is None and not spec.qk_l2_norm and turns_back)
    own, points = _hf_modules(model), model.hook_dict
    for n in sorted({*names, *edits}):
        site = _site(n)
        if hook_layer(n) is None:
            return f"the hook {n} lies outside the blocks"
        if _by_call(model, spec, n):
            if site in ("hook_q", "hook_k") and not qk_exact:
                return f"{n} holds q/k before the rotary or the q/k norm, which the attention interface never sees"
            if site in ("hook_pattern", "hook_rot_q", "hook_rot_k", "hook_q", "hook_k") and n in edits:
                return f"an edit of {n}: the transformers backend reads q, k and the map, it does not change them"
            continue
        try:
            part = _module_site(model, n, own=own, points=points)[2]
        except BackendUnsupported as e:
            return str(e)
        if n in edits and part and part[1] is None:
            return f"an edit of {n}: the bridge computes it beside the module, which reads it only"
    return None


def choose_backend(
    model: SinkModel, *, backend: str | None = None, names: Iterable[str] = (), edits: Iterable[str] = ()
) -> tuple[str, str]:
    """The backend a pass runs on, and why.

    Parameters
    ----------
    model : SinkModel
    backend : {"auto", "transformer_lens", "transformers"}, optional
        "auto": the transformers backend where it gives everything asked for on this model, else the bridge. None:
        the model's own (``model.pass_backend``, set by ``load_model``; "transformer_lens" on a model without one).
    names, edits : iterable of str
        The hooks read and changed.

    Returns
    -------
    tuple of (str, str)
        The backend, and why (a sentence). BackendUnsupported where "transformers" was asked for and cannot run.
    """
    own = backend is None
    backend = _check_backend(getattr(model, "pass_backend", "transformer_lens") if backend is None else backend)
    if backend == "transformer_lens":
        return backend, "asked for"
    if backend == "nnsight":
        return _choose_nnsight(model, names, edits, own)
    reason = _model_reason(model) or _hooks_reason(model, names, edits=edits)
    if reason is None:
        return "transformers", (
            "asked for"
            if backend == "transformers"
            else "auto: the Hugging Face model in its own attention gives every hook this pass reads"
        )
    if backend == "transformers":
        raise BackendUnsupported(
            f"the transformers backend cannot run this pass: {reason}. Use backend='auto' or 'transformer_lens'."
        )
    return "transformer_lens", f"auto: {reason}"


def _choose_nnsight(model: SinkModel, names, edits, own: bool) -> tuple[str, str]:
    """``choose_backend`` for "nnsight": it, where it gives every hook and edit (resumed passes included); else the
    bridge, stated, when the model's own backend is nnsight (``load_model(..., backend="nnsight")``: every section of
    the report runs), and BackendUnsupported when the call asked for nnsight."""
    reason = _model_reason(model) or _hooks_reason(model, names, edits=edits)
    if reason is None:
        return "nnsight", "asked for" if not own else "the model's backend: nnsight gives every hook this pass reads"
    if not own:
        raise BackendUnsupported(f"the nnsight backend cannot run this pass: {reason}. Use backend='transformer_lens'.")
    return "transformer_lens", f"nnsight: {reason}"


class Taps:
    """One pass's reads and edits on the Hugging Face modules: forward hooks on the modules the bridge's components
    wrap (:func:`_module_site`) and the attention function (:func:`_pass_attention_forward`), each handing
    ``fire(layer, name, x)`` the activation under its TransformerLens name after the edits asked for at that name.

    Parameters
    ----------
    model : SinkModel
        A TransformerBridge around a Hugging Face model.
    wanted : dict of int to set of str
        Layer -> the hook names read there.
    edits : sequence of (str, callable)
        Interventions ``fn(activation, hook) -> changed or None`` by hook name.
    fire : callable
        ``fire(layer, name, x)``: the pass's joint reducer.
    """

    def __init__(self, model: SinkModel, wanted: dict[int, set[str]], edits: Sequence, fire):
        self.hf, self.fire, self.spec = hf_module(model), fire, get_family(model)
        self.tokens = (0, 0)  # the running batch's (B, T)
        self.read: dict[str, list[int]] = {}  # hook name -> the layers of the reducer that read it
        for layer, names in wanted.items():
            for n in names:
                self.read.setdefault(n, []).append(int(layer))
        self.edits: dict[str, list] = {}
        for name, fn in edits:
            self.edits.setdefault(name, []).append(fn)
        self.attn: dict[int, set[str]] = {}  # layer -> the attention sites read or changed there
        self.kernels: dict[str, str] = {}  # the kernels the layers took -> why not the table's first ("" if it was)
        self.sites: dict[tuple[int, str], tuple[torch.nn.Module, list[str]]] = {}  # (id, in/out) -> module, names
        own, points = _hf_modules(model), model.hook_dict
        self.parts: dict[str, tuple] = {}  # hook name -> (take, put) where it is part of its module's activation
        for name in sorted({*self.read, *self.edits}):
            if _by_call(model, self.spec, name):
                self.attn.setdefault(hook_layer(name), set()).add(_site(name))
                continue
            module, which, part = _module_site(model, name, own=own, points=points)
            self.sites.setdefault((id(module), which), (module, []))[1].append(name)
            if part:
                self.parts[name] = part

    def _give(self, name: str, x):
        """Apply the edits at ``name``, then hand the activation to the reducer where it is read. Tokens a layer
        flattens around its MLP (OPT: (B * T, d)) are read and edited as (B, T, d), as the bridge gives them."""
        B, T = self.tokens
        flat = isinstance(x, torch.Tensor) and x.ndim == 2 and x.shape[0] == B * T
        whole = x.view(B, T, -1) if flat else x
        take, put = self.parts.get(name, (None, None))
        y = y0 = take(whole) if take else whole
        for fn in self.edits.get(name, ()):
            out = fn(y, _Named(name))
            y = y if out is None else out
        for layer in self.read.get(name, ()):
            self.fire(layer, name, y)
        if y is y0:
            return x
        y = put(whole, y) if put else y
        return y.reshape(x.shape) if flat else y

    def _pre(self, names: list[str]):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            y = x
            for name in names:
                y = self._give(name, y)
            if y is x:
                return None
            return ((y, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": y})

        return hook

    def _post(self, names: list[str]):
        def hook(module, args, output):
            x = output[0] if isinstance(output, (tuple, list)) else output
            y = x
            for name in names:
                y = self._give(name, y)
            if y is x:
                return None
            return (y, *output[1:]) if isinstance(output, (tuple, list)) else y

        return hook

    @contextlib.contextmanager
    def attached(self):
        """The modules' hooks and the attention function, for the duration."""
        handles = []
        for (_, which), (module, names) in self.sites.items():
            handles.append(
                module.register_forward_pre_hook(self._pre(names), with_kwargs=True)
                if which == "in"
                else module.register_forward_hook(self._post(names))
            )
        _register()
        token = _TAPS.set(self)
        try:
            with unbridged(self.hf), attention_implementation(self.hf, PASS_ATTENTION):
                yield
        finally:
            _TAPS.reset(token)
            for h in handles:
                h.remove()

    def _qk(self, layer: int, sites: set, module, query, key, scale: float) -> None:
        """A call's q and k reads, as the bridge's hooks hold them: ``hook_q``/``hook_k`` turned back to before the
        rotary (``_hooks_reason`` allows them where that is exact); OPT's q, which it scales by its module's scale
        before a call at 1.0, unscaled."""
        q = query * (scale / module.scaling) if getattr(module, "scaling", scale) != scale else query
        pos = torch.arange(query.shape[-2], device=query.device)
        for site, x in (("hook_rot_q", q), ("hook_q", q), ("hook_rot_k", key), ("hook_k", key)):
            if site in sites:
                x = x.transpose(1, 2)
                if site in ("hook_q", "hook_k") and self.spec.latent is None:  # MLA's hold them rotated
                    x = apply_spec_rotary(x, self.spec, layer, positions=pos, inverse=True).to(x.dtype)
                self._give(f"blocks.{layer}.attn.{site}", x)

    def attention(self, module, query, key, value, mask, scale: float, softcap=None, sinks=None) -> torch.Tensor:
        """One layer's attention: its reads and edits, the output from the fused kernel (soft-capped scores: in blocks
        of rows; learned sink logits joined to its rows), as (B, T, H, d)."""
        layer = attention_layer_index(module)
        sites, at = self.attn.get(layer, set()), f"blocks.{layer}.attn."
        self._qk(layer, sites, module, query, key, scale)
        if "hook_v" in sites:
            value = self._give(at + "hook_v", value.transpose(1, 2)).transpose(1, 2)
        extras = dict(softcap=softcap, sinks=sinks)
        out, lse, (name, why) = _interface_attention(query, key, value, mask, scale, **extras)
        self.kernels.setdefault(name, why)
        if "hook_pattern" in sites:
            weights = AttentionWeights(query=query, key=key, lse=lse, scale=scale, mask=mask, **extras)
            self._give(at + "hook_pattern", weights)
        out = out.transpose(1, 2)
        if "hook_z" in sites:
            out = self._give(at + "hook_z", out)
        return out.contiguous()


class NnsightTaps(Taps):
    """The reads and edits of :class:`Taps`, made inside one nnsight trace per batch: the same sites by their
    envoys (``.input`` / ``.output``), the attention function's call by ``.source`` (q, k, v, mask and scale in, z
    out), visited in the order the forward reaches them (nnsight refuses a site the model has run past), which one
    short forward with plain hooks records first. ``hook_pattern`` is ``AttentionWeights`` of q, k and the rows'
    log-sum-exp (``AttentionWeights.from_qk``): no T x T map.

    Parameters
    ----------
    model, wanted, edits, fire
        As :class:`Taps`.
    """

    def __init__(self, model: SinkModel, wanted: dict[int, set[str]], edits: Sequence, fire):
        super().__init__(model, wanted, edits, fire)
        self.impl = "eager" if self.spec.attn_softcap or self.spec.learned_sinks else "sdpa"  # SDPA takes neither
        self.attn_modules = {l: unwrap_component(model.get_submodule(f"blocks.{l}.attn")) for l in self.attn}
        with unbridged(self.hf) as hf:
            self.paths = {id(m): n for n, m in hf.named_modules()}
            self.events = self._order(hf)

    def _order(self, hf) -> list[tuple]:
        """The sites and attention calls in the order a forward reaches them."""
        seen: list[tuple] = []
        handles = []
        wanted = {id(m): m for m, _ in self.sites.values()} | {id(m): m for m in self.attn_modules.values()}
        for key, module in wanted.items():
            handles.append(module.register_forward_pre_hook(lambda m, a, key=key: seen.append((key, "in"))))
            handles.append(module.register_forward_hook(lambda m, a, o, key=key: seen.append((key, "out"))))
        try:
            with torch.inference_mode(), attention_implementation(hf, self.impl):
                hf(input_ids=torch.zeros(1, 2, dtype=torch.long, device=hf.device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        calls = {id(m): l for l, m in self.attn_modules.items()}
        z = {f"blocks.{l}.attn.hook_z": l for l in self.attn_modules}  # read at an input after the call (a gated z)
        before = {k: z[n] for (k, which), (_, names) in self.sites.items() if which == "in" for n in names if n in z}
        events = []
        for key, which in dict.fromkeys(seen):  # first time each is reached
            # the call: after the projections' inputs, before the output projection's input and the module's output
            layer = calls.get(key) if which == "out" else before.get(key)
            if layer is not None and ("attn", layer) not in events:
                events.append(("attn", layer))
            if (key, which) in self.sites:
                events.append(("site", key, which))
        return events

    def _envoy(self, lm, key: int):
        envoy = lm
        for part in self.paths[key].split("."):
            envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
        return envoy

    def run(self, tokens: torch.Tensor, *, needs_logits: bool):
        """One batch in one trace: every event visited in order; the logits, or None (the trace stops after the
        last event)."""
        from nnsight import NNsight  # optional: the "remote" extra

        box: dict = {}
        with unbridged(self.hf) as hf, attention_implementation(hf, self.impl):
            lm = NNsight(hf)
            for m in self.attn_modules.values():  # each forward's source, made before any site inside it is read
                self._envoy(lm, id(m)).source
            with lm.trace(input_ids=tokens, use_cache=False) as tracer:
                for event in self.events:
                    self._visit(lm, event)
                if needs_logits:
                    box["logits"] = lm.output.logits
                else:
                    tracer.stop()
        return box.get("logits")

    def _visit(self, lm, event: tuple) -> None:
        if event[0] == "attn":
            return self._attention_call(lm, event[1])
        _, key, which = event
        envoy, names = self._envoy(lm, key), self.sites[(key, which)][1]
        out = envoy.input if which == "in" else envoy.output
        x = out[0] if isinstance(out, (tuple, list)) else out
        y = x
        for name in names:
            y = self._give(name, y)
        if y is not x:
            new = (y, *out[1:]) if isinstance(out, (tuple, list)) else y
            if which == "in":
                envoy.input = new
            else:
                envoy.output = new
        return None

    def _attention_call(self, lm, layer: int) -> None:
        """One layer's attention call: the reads and edits of :meth:`Taps.attention` on the model's own attention."""
        src = self._envoy(lm, id(self.attn_modules[layer])).source
        call = getattr(src, call_name(src.names, self.spec.family))
        args, kwargs = call.inputs
        module, query, key, value, mask = args[:5]
        _refuse_extras(module, mask, kwargs.get("is_causal"), kwargs)
        sites, at = self.attn[layer], f"blocks.{layer}.attn."
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        self._qk(layer, sites, module, query, key, scale)
        if "hook_v" in sites:
            v = self._give(at + "hook_v", value.transpose(1, 2)).transpose(1, 2)
            if v is not value:
                call.inputs = ((module, query, key, v, mask, *args[5:]), kwargs)
        if "hook_pattern" in sites:
            extras = dict(softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
            self._give(at + "hook_pattern", AttentionWeights.from_qk(query, key, scale=scale, mask=mask, **extras))
        if "hook_z" in sites:
            out = call.output
            z = self._give(at + "hook_z", out[0])
            if z is not out[0]:
                call.output = (z, *out[1:])


class _Named:
    """What an intervention's ``hook`` argument offers on the transformers backend: the hook's ``name``."""

    def __init__(self, name: str):
        self.name = name


def _pass_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """The ``AttentionInterface`` function of the transformers backend: the active pass's :class:`Taps` read and
    change the layer's q, k, v, attention and output (same contract as transformers' ``sdpa_attention_forward``).

    ``module.layer_idx`` names the layer; evaluation only (no dropout). It returns the output, shape (B, T, H, d), and
    no weights."""
    taps = _TAPS.get()
    if taps is None:
        raise RuntimeError(f"the {PASS_ATTENTION!r} attention runs only inside a pass on the transformers backend.")
    _refuse_extras(module, attention_mask, is_causal, kwargs)
    if query.shape[-2] != key.shape[-2]:
        raise BackendUnsupported("queries and keys differ in length (a KV cache); run without a cache.")
    mask = attention_mask
    if mask is not None and mask.ndim == 4 and mask.shape[-1] > key.shape[-2]:
        mask = mask[..., : key.shape[-2]]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    extras = kwargs.get("softcap"), kwargs.get("s_aux")
    return taps.attention(module, query, key, value, mask, scale, *extras), None


def _register() -> None:
    register_attention(PASS_ATTENTION, _pass_attention_forward)


def run_hf_batch(model: SinkModel, tokens: torch.Tensor, *, needs_logits: bool):
    """One batch through the Hugging Face model (``Taps`` attached by the caller): the logits, or None.

    Parameters
    ----------
    model : SinkModel
    tokens : torch.Tensor, shape (B, T)
    needs_logits : bool

    Returns
    -------
    torch.Tensor or None
    """
    hf = hf_module(model)
    if needs_logits:
        return hf(input_ids=tokens, use_cache=False).logits
    hf.base_model(input_ids=tokens, use_cache=False)
    return None
