"""The real weights of a module, also on a model split by accelerate's device map with CPU or disk offload.

Under offload, accelerate keeps a module's weights in a CPU dictionary or in files of the offload folder and leaves
"meta" placeholders (shape, no data) on the module; its hook swaps the real tensors in only around the module's own
forward call, and TransformerLens' bridge does the same around each component's call. Code that reads a weight
directly (the key path's W_K and norm gains, the MLP's W_in / W_gate / W_out, a norm's form) would otherwise see the
placeholder. :func:`materialized` swaps every offloaded weight under a module in for the block of code that reads
it, on the module's execution device, and puts the placeholders back afterwards (one block's weights in memory at a
time, as in the forward pass).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch


def _offload_hook(module: torch.nn.Module):
    """The accelerate hook that holds ``module``'s own offloaded weights (also inside a SequentialHook), or None."""
    hook = module.__dict__.get("_hf_hook")  # its own: a bridge component delegates attributes to its wrapped module
    if hook is None:
        return None
    from accelerate.hooks import AlignDevicesHook  # optional: accelerate is needed only for a split model

    for h in getattr(hook, "hooks", None) or [hook]:
        if isinstance(h, AlignDevicesHook) and h.offload:
            return h
    return None


@contextlib.contextmanager
def materialized(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, every weight under ``module`` is real (read from accelerate's offload map if needed, on its
    layer's execution device); the offload placeholders come back after it. A no-op on a model that is not offloaded.

    While the block runs, the weights stay pinned: a sub-module's own forward inside it (which would otherwise load
    its weights again and put the placeholders back when it returns) leaves them alone.

    Parameters
    ----------
    module : torch.nn.Module
        A block, an MLP, a norm, or any module of a loaded model.

    Returns
    -------
    contextlib.AbstractContextManager
        Yields ``module``. Tensors read inside stay valid after the block (keep or copy what you need).
    """
    pinned = []
    try:
        for sub in module.modules():
            hook = _offload_hook(sub)
            if hook is not None:
                hook.pre_forward(sub)
                hook.offload = False
                pinned.append((sub, hook))
        yield module
    finally:
        for sub, hook in reversed(pinned):
            hook.offload = True
            hook.post_forward(sub, None)


def is_offloaded(model: torch.nn.Module) -> bool:
    """Whether any weight of ``model`` is kept off its module by accelerate (CPU or disk offload).

    Parameters
    ----------
    model : torch.nn.Module

    Returns
    -------
    bool
    """
    return any(_offload_hook(m) is not None for m in model.modules())


def execution_device(module: torch.nn.Module) -> torch.device | None:
    """The device a module computes on: its accelerate hook's execution device, else that of its first real weight.

    Parameters
    ----------
    module : torch.nn.Module

    Returns
    -------
    torch.device or None
        None for a module with no weights and no hook.
    """
    for sub in module.modules():
        hook = sub.__dict__.get("_hf_hook")
        for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
            dev = getattr(h, "execution_device", None)
            if dev is not None:
                return torch.device(dev if not isinstance(dev, int) else f"cuda:{dev}")
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return None


def materialize_components(bridge: torch.nn.Module) -> int:
    """Make each TransformerBridge component of an offloaded model materialise every weight under it for its call.

    TransformerLens 4.3 materialises only a component's own wrapped module around its call, and accelerate puts the
    placeholders back as each sub-module's call returns; a component that reads a weight of a sub-module directly
    (Qwen3-Next's and Qwen3.5's Gated DeltaNet read ``conv1d.weight`` for the causal convolution; Jamba's Mamba mixer
    reads ``dt_proj.bias`` after calling ``dt_proj``) would compute with accelerate's meta placeholder (wrong numbers
    or a crash). This wraps each component's call in :func:`materialized`: the outermost component called (a block)
    pins its weights for its call and the ones inside find them in place, so one block's weights are in memory at a
    time and each is read from the offload map once per forward pass, as in the plain offloaded forward.

    Parameters
    ----------
    bridge : transformer_lens.TransformerBridge
        A bridge around a model split by a device map (a no-op where nothing is offloaded).

    Returns
    -------
    int
        How many components were wrapped.
    """
    from transformer_lens.model_bridge.generalized_components.base import GeneralizedComponent  # optional: bridges only

    wrapped = 0
    for comp in list(bridge.modules()):
        inner = comp._modules.get("_original_component") if isinstance(comp, GeneralizedComponent) else None
        if inner is not None and any(_offload_hook(m) is not None for m in inner.modules()):
            open_ = []  # one ExitStack per call in flight (a component may be re-entered)

            def enter(mod, args, inner=inner, open_=open_):
                stack = contextlib.ExitStack()
                stack.enter_context(materialized(inner))
                open_.append(stack)

            def leave(mod, args, out, open_=open_):
                open_.pop().close()

            comp.register_forward_pre_hook(enter)
            comp.register_forward_hook(leave, always_call=True)
            wrapped += 1
    return wrapped


def reads_block_weights(fn):
    """Decorate ``fn(model, layer, ...)``, which reads weights of ``model.blocks[layer]`` directly: they are real
    (:func:`materialized`) while it runs.

    Parameters
    ----------
    fn : callable
        Takes the model and a block index first.

    Returns
    -------
    callable
    """

    @functools.wraps(fn)
    def run(model, layer, *args, **kwargs):
        blocks = getattr(model, "blocks", None)
        try:
            block = blocks[int(layer)] if blocks is not None else None
        except (IndexError, TypeError, ValueError):
            block = None  # fn says what is wrong with the layer
        if block is None:
            return fn(model, layer, *args, **kwargs)
        with materialized(block):
            return fn(model, layer, *args, **kwargs)

    return run


def reads_module_weights(fn):
    """Decorate ``fn(module, ...)``, which reads ``module``'s weights directly: they are real while it runs.

    Parameters
    ----------
    fn : callable
        Takes the module first.

    Returns
    -------
    callable
    """

    @functools.wraps(fn)
    def run(module, *args, **kwargs):
        if not isinstance(module, torch.nn.Module):
            return fn(module, *args, **kwargs)
        with materialized(module):
            return fn(module, *args, **kwargs)

    return run


def live_tensor(component, alias: str, name: str):
    """A bridge component's weight read from its wrapped module (``name``), not through the alias (``alias``)
    TransformerLens binds once at load: on an offloaded model that alias keeps accelerate's meta placeholder.

    Parameters
    ----------
    component : torch.nn.Module or None
        A bridge component (a norm, ...) or a reference model's module.
    alias : str
        The bridge's name, e.g. "w" or "b" (what a module without a wrapped one is read by).
    name : str
        The wrapped module's name, e.g. "weight" or "bias".

    Returns
    -------
    torch.Tensor or None
    """
    if component is None:
        return None
    inner = component._modules.get("_original_component") if isinstance(component, torch.nn.Module) else None
    if inner is not None and name in dict(inner.named_parameters(recurse=False)):
        return getattr(inner, name)
    return getattr(component, alias, None)
