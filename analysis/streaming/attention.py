"""The attention function the streaming decoder runs under: SDPA, except that one-token decode steps go
through a grouped-query softmax that also measures what the sink slots receive.

Registered with the transformers ``AttentionInterface`` (and its mask interface) as ``"streaming"``, so every
Hugging Face family that dispatches through the interface uses it. A decode step has one query per row and
the cache holds only the kept tokens, so the step needs no mask beyond the one transformers passes; keys and
values are read once per KV head (no ``repeat_kv`` copy of the cache, which made the eager path 2x slower
than SDPA at a 1,024-token cache and a batch of 10 policies). Inside :func:`recording`, each step adds, per
batch row, the attention its marked slots (the sinks, or the oldest kept token) receive, averaged over heads
and summed over layers: the share is reduced inside the layer, no attention map is kept.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "streaming"


class ShareRecorder:
    """Attention mass on marked cache slots. Set ``marks`` before a step: a function returning (B, L), 1.0 on
    the marked slots, called once per step at the first layer (after that layer's cache took the new token, so
    it sees the slots as the step's attention does); after the step ``take()`` gives the mean over layers and
    heads."""

    def __init__(self):
        self.marks = None
        self.slots: torch.Tensor | None = None
        self.total: torch.Tensor | None = None
        self.layers = 0
        self.learned: torch.Tensor | None = None  # weight on a learned sink slot (reference models, gpt-oss)
        self.learned_layers = 0

    def add(self, weights: torch.Tensor) -> None:  # (B, Hkv, G, L)
        if self.marks is None:
            return
        if self.slots is None:
            self.slots = self.marks()
        mass = torch.einsum("bhgl,bl->b", weights.float(), self.slots.to(weights.device, torch.float32))
        mass = mass / (weights.shape[1] * weights.shape[2])
        self.total = mass if self.total is None else self.total + mass
        self.layers += 1

    def add_learned(self, weight: torch.Tensor) -> None:  # (B, heads): one layer's weight on its learned sink slot
        if self.marks is None:
            return
        mass = weight.float().mean(dim=1)
        self.learned = mass if self.learned is None else self.learned + mass
        self.learned_layers += 1

    def take(self) -> torch.Tensor | None:
        """(B,) the head- and layer-mean share of the last step, and reset (``take_learned`` keeps its own)."""
        out = None if self.total is None else self.total / max(self.layers, 1)
        self.total, self.layers, self.slots = None, 0, None
        return out

    def take_learned(self) -> torch.Tensor | None:
        """(B,) the head- and layer-mean weight on learned sink slots in the last step (None: no such slot), and
        reset. Averaged over the layers that have one."""
        out = None if self.learned is None else self.learned / max(self.learned_layers, 1)
        self.learned, self.learned_layers = None, 0
        return out


_RECORDER: ShareRecorder | None = None


def active_recorder() -> ShareRecorder | None:
    """The recorder decode steps report to now (inside ``recording``), or None.

    Returns
    -------
    ShareRecorder or None
    """
    return _RECORDER


@contextlib.contextmanager
def recording(recorder: ShareRecorder):
    """Route decode steps' sink shares to ``recorder`` while inside.

    Parameters
    ----------
    recorder : ShareRecorder

    Yields
    ------
    ShareRecorder
        ``recorder``.
    """
    global _RECORDER
    old, _RECORDER = _RECORDER, recorder
    try:
        yield recorder
    finally:
        _RECORDER = old


def _mask_logits(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return scores
    mask = mask[..., -1, :].reshape(mask.shape[0], 1, 1, -1)[..., : scores.shape[-1]]  # (B|1, 1, 1, L)
    return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask


def _streaming_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
):
    """query (B, H, q, D), key/value (B, Hkv, L, D) -> (B, q, H, D) and the weights of a decode step."""
    B, H, q, D = query.shape
    Hkv = key.shape[1]
    if q != 1 or kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = D**-0.5 if scaling is None else scaling
    qg = query.reshape(B, Hkv, H // Hkv, D)  # query head h reads KV head h // (H / Hkv), as repeat_kv lays them out
    scores = torch.matmul(qg, key.transpose(-1, -2)) * scale  # (B, Hkv, G, L)
    softcap = getattr(module, "attn_logit_softcapping", None) or kwargs.get("softcap")
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    weights = torch.softmax(_mask_logits(scores, attention_mask).float(), dim=-1).to(query.dtype)
    if _RECORDER is not None:
        _RECORDER.add(weights)
    out = torch.matmul(weights, value)  # (B, Hkv, G, D)
    return out.reshape(B, H, 1, D).transpose(1, 2), weights.reshape(B, H, 1, -1)


AttentionInterface.register(NAME, _streaming_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
