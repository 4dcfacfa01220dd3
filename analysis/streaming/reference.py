"""The project's reference models (``analysis.train.SinkLM``) behind the causal-LM face the streaming decoder drives.

``ReferenceLM`` wraps a ``SinkLM`` so that ``run_policies`` and ``recompute_nll`` treat it as they treat a Hugging
Face model: ``model(input_ids=..., position_ids=..., past_key_values=cache)`` continues a ``StreamingCache``
through ``SinkLM.decode`` (keys rotated at their stream positions, the sinks re-rotated by the cache, the
learnable sink token one position before the oldest kept token), and ``model(input_ids=...)`` is the plain
forward. Inside the decoder's ``recording`` the attention each step gives the marked cache slots, and the weight
on a learned sink slot (the sink token, or K/KV biases), are read from the model's own hooks
(``attn.hook_pattern``, ``attn.hook_sink_pattern``) and reduced there.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from torch import nn

from analysis.streaming.attention import active_recorder


class _Config:
    """The few configuration fields the decoder reads (context, layers, attention implementation)."""

    def __init__(self, model):
        self.max_position_embeddings = model.cfg.n_ctx
        self.num_hidden_layers = model.cfg.n_layers
        self.name_or_path = model.model_name
        self._attn_implementation = "eager"

    def get_text_config(self, decoder: bool = True):
        return self


class _Rotary(nn.Module):
    """Holds the model's rotary frequencies where ``cache.rope_spec`` looks for them (``inv_freq``)."""

    def __init__(self, d_head: int, base: float):
        super().__init__()
        inv = 1.0 / (base ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head))
        self.register_buffer("inv_freq", inv.float(), persistent=False)


def _on_pattern(pattern: torch.Tensor, hook) -> None:  # (B, H, T, L): the last query's weights
    rec = active_recorder()
    if rec is not None:
        rec.add(pattern[:, :, -1:, :])


def _on_sink_pattern(weight: torch.Tensor, hook) -> None:  # (B, H, T): weight on the learned slot
    rec = active_recorder()
    if rec is not None:
        rec.add_learned(weight[:, :, -1])


class ReferenceLM(nn.Module):
    """A ``SinkLM`` as the streaming decoder's causal LM. ``model``: the SinkLM (``.model``)."""

    def __init__(self, model):
        super().__init__()
        model.check_decodable()
        self.model = model
        self.config = _Config(model)
        cfg = model.cfg
        self.rotary = _Rotary(cfg.d_head, cfg.rotary_base) if cfg.positional_embedding_type == "rotary" else None
        self.hook_names = [f"blocks.{l}.attn.hook_pattern" for l in range(cfg.n_layers)]
        self.sink_hook_names = [
            f"blocks.{l}.attn.hook_sink_pattern"
            for l, b in enumerate(model.blocks)
            if b.attn.hook_sink_pattern is not None
        ]

    def get_output_embeddings(self):
        return self.model.unembed  # ``.weight`` (D, V): its device is the model's

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name  # one eager path: the name is only recorded

    def _hooks(self):
        if active_recorder() is None:
            return contextlib.nullcontext()
        return self.model.hooks(
            fwd_hooks=[(n, _on_pattern) for n in self.hook_names]
            + [(n, _on_sink_pattern) for n in self.sink_hook_names]
        )

    def forward(
        self,
        input_ids,
        position_ids=None,
        past_key_values=None,
        use_cache: bool = True,
        output_attentions: bool = False,
        logits_to_keep: int = 0,
        **kwargs,
    ):
        if past_key_values is None:
            if position_ids is not None and not torch.equal(position_ids[0].cpu(), torch.arange(input_ids.shape[1])):
                raise ValueError(
                    "without a cache the reference model runs at positions 0..T-1; pass a cache to "
                    "decode at other positions."
                )
            logits = self.model(input_ids)
        else:
            positions = torch.arange(input_ids.shape[1]) if position_ids is None else position_ids[0]
            with self._hooks():
                logits = self.model.decode(input_ids, positions, past_key_values)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits, attentions=None)
