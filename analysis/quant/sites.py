"""The decoder's linear layers and where their inputs can be reached: one ``LinearSite`` per linear map.

Which modules those are is the model floor's knowledge (``analysis.model.causal.linear_maps``): a Hugging Face
model's ``nn.Linear`` modules inside its decoder layers (reached by a forward pre-hook, the same modules whether the
bridge or the model's own attention runs them), a reference model's weights at the hook points that feed them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from analysis.model.causal import linear_maps
from analysis.model.contract import SinkModel


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


def linear_sites(model: SinkModel) -> list[LinearSite]:
    """Every linear map of the decoder, in layer order.

    Parameters
    ----------
    model : SinkModel
        What ``analysis.load_model`` returns (the sites hook its modules: pass the same ``model`` to ``calibrate`` and
        ``mean_nll``).

    Returns
    -------
    list of LinearSite
        ValueError where none can be reached.
    """
    sites = [LinearSite(*m) for m in linear_maps(model, where="linear_sites")]
    if not sites:
        raise ValueError(
            f"cannot reach the linear layers of {model.model_name}: quantisation hooks the inputs of "
            "nn.Linear modules inside the decoder's layer list (a ModuleList of config.num_hidden_layers "
            "layers) or a reference SinkLM's hook points; load a Hugging Face causal LM whose layers "
            "use nn.Linear (not a fused or already-quantised checkpoint)."
        )
    return sites
