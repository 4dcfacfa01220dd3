"""The decoder's linear layers and where their inputs can be reached: one ``LinearSite`` per linear map.

A Hugging Face causal LM: every ``nn.Linear`` inside the decoder's layer list (the ``ModuleList`` as long as the
config's layer count; the LM head is not a decoder linear), reached by a forward pre-hook. A reference model
(``analysis.streaming.reference.ReferenceLM`` around a ``SinkLM``) has no ``nn.Linear``: its maps are einsums on
weights, reached at the TransformerLens hook points that feed them (``ln1.hook_normalized``: W_Q, W_K, W_V;
``attn.hook_z``: W_O; ``ln2.hook_normalized``: W_in, W_gate; ``mlp.hook_post``: W_out).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from analysis.model.contract import SinkModel
from analysis.streaming.backbone import stream_lm

# SinkLM's maps: hook point (under blocks.{l}) -> (site name, [(weight name, its input axes)])
REFERENCE_SITES = {
    "ln1.hook_normalized": ("attn.W_QKV", [("attn.W_Q", (1,)), ("attn.W_K", (1,)), ("attn.W_V", (1,))]),
    "attn.hook_z": ("attn.W_O", [("attn.W_O", (0, 1))]),
    "ln2.hook_normalized": ("mlp.W_in", [("mlp.W_in", (0,)), ("mlp.W_gate", (0,))]),
    "mlp.hook_post": ("mlp.W_out", [("mlp.W_out", (0,))]),
}


@dataclass
class LinearSite:
    """One linear map of the decoder (or several that share one input).

    Attributes
    ----------
    layer : int
        The decoder layer.
    name : str
        The linear's name inside its layer (``mlp.down_proj``, ``self_attn.q_proj``, ``attn.W_O``).
    module : torch.nn.Module
        Where its input is reached: the ``nn.Linear`` (a pre-hook) or the hook point feeding it (a forward hook).
    pre_hook : bool
        True: the input is the module's input; False: the module's output.
    weights : list of (torch.nn.Parameter, tuple of int)
        The weights it multiplies and their input axes.
    """

    layer: int
    name: str
    module: nn.Module
    pre_hook: bool
    weights: list = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.layer}.{self.name}"

    def hook(self, fn):
        """Register ``fn(x) -> x`` on the site's input; returns the handle."""
        if self.pre_hook:
            return self.module.register_forward_pre_hook(lambda m, args: (fn(args[0]), *args[1:]))
        return self.module.register_forward_hook(lambda m, args, out: fn(out))


def _decoder_layers(hf) -> nn.ModuleList | None:
    cfg = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    n = getattr(cfg, "num_hidden_layers", None)
    for _, mod in hf.named_modules():
        if isinstance(mod, nn.ModuleList) and n is not None and len(mod) == n:
            return mod
    return None


def _reference_sites(sink_lm) -> list[LinearSite]:
    sites = []
    for l, block in enumerate(sink_lm.blocks):
        for hook_name, (name, weights) in REFERENCE_SITES.items():
            hook = block.get_submodule(hook_name)
            ws = []
            for w_name, axes in weights:
                parent, attr = w_name.split(".")
                p = getattr(block.get_submodule(parent), attr, None)
                if isinstance(p, torch.Tensor):
                    ws.append((p, axes))
            sites.append(LinearSite(l, name, hook, False, ws))
    return sites


def linear_sites(model: SinkModel) -> list[LinearSite]:
    """Every linear map of the decoder, in layer order.

    Parameters
    ----------
    model : SinkModel
        What ``analysis.load_model`` returns, or the causal LM ``analysis.streaming.backbone.causal_lm`` gives (the
        sites hook that causal LM: pass the same ``model`` to ``calibrate`` and ``mean_nll``).

    Returns
    -------
    list of LinearSite
        ValueError where none can be reached.
    """
    hf = stream_lm(model, where="linear_sites")
    inner = getattr(hf, "model", None)
    if type(inner).__name__ == "SinkLM":
        return _reference_sites(inner)
    layers = _decoder_layers(hf) if hasattr(hf, "config") else None
    sites = []
    for l, layer in enumerate(layers or []):
        sites += [LinearSite(l, n, m, True, [(m.weight, (1,))]) for n, m in layer.named_modules()
                  if isinstance(m, nn.Linear)]
    if not sites:
        raise ValueError(f"cannot reach the linear layers of {type(hf).__name__}: quantisation hooks the inputs of "
                         "nn.Linear modules inside the decoder's layer list (a ModuleList of config.num_hidden_layers "
                         "layers) or a reference SinkLM's hook points; load a Hugging Face causal LM whose layers "
                         "use nn.Linear (not a fused or already-quantised checkpoint).")
    return sites
