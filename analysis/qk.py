"""QK angles: is the first key special because of its angle to the queries, or its norm?

For each head, from the rotated queries and keys (``hook_rot_q``/``hook_rot_k``; ``hook_q``/``hook_k``
for models without rotary), reduced inside the hooks:

- ``cos_first``: mean over queries t >= 2 of cos(q_t, k_1)
- ``cos_other``: mean over queries t and keys 1 < j <= t of cos(q_t, k_j)
- the mean norms |q_t|, |k_1| and |k_j| (j > 1)
- histograms of both cosines over fixed bins, for the figure.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
from einops import rearrange, repeat

from analysis.hooks import ModelContractError, check_layers, check_tokens, hook_names, model_dims, run_with_reducers

N_BINS = 40


def qk_hook_names(model, layer: int, rotated: bool = True) -> tuple[str, str]:
    """The (query, key) hooks of ``layer``: the rotated ones where the model uses rotary embeddings and has
    them (and ``rotated``), else ``hook_q``/``hook_k``. Some models list ``hook_rot_k`` without rotary (it
    never fires there), so the rotary is checked on the model, not on the hook names."""
    from analysis.models import rotary_base

    names = hook_names(model)
    rot = (f"blocks.{layer}.attn.hook_rot_q", f"blocks.{layer}.attn.hook_rot_k")
    if rotated and all(n in names for n in rot) and rotary_base(model) is not None:
        return rot
    plain = (f"blocks.{layer}.attn.hook_q", f"blocks.{layer}.attn.hook_k")
    missing = [n for n in plain if n not in names]
    if missing:
        raise ModelContractError(
            f"the model has no query/key hooks {missing}; QK analyses need TransformerLens hook names "
            "(`blocks.{l}.attn.hook_k`, or `hook_rot_k` with rotary): load it with `analysis.load_model`."
        )
    return plain


def head_cosines(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """cos(q_i, k_j) for every query head: q (B,T,H,d), k (B,T,Hkv,d) -> (B,H,T_q,T_k)."""
    group = q.shape[2] // k.shape[2]
    k = repeat(k, "b t kv d -> b t (kv g) d", g=group)
    qn = torch.nn.functional.normalize(q.float(), dim=-1)
    kn = torch.nn.functional.normalize(k.float(), dim=-1)
    return torch.einsum("bihd,bjhd->bhij", qn, kn)


@dataclass
class QKAngles:
    """Per-head QK-angle statistics (arrays are (L, H); hists are (L, H, N_BINS))."""

    layers: list[int]
    cos_first: torch.Tensor
    cos_other: torch.Tensor
    q_norm: torch.Tensor
    k_first_norm: torch.Tensor
    k_other_norm: torch.Tensor
    hist_first: torch.Tensor
    hist_other: torch.Tensor
    bin_edges: torch.Tensor

    def table(self) -> pd.DataFrame:
        L, H = self.cos_first.shape
        return pd.DataFrame(
            {
                "layer": torch.tensor(self.layers).repeat_interleave(H).numpy(),
                "head": torch.arange(H).repeat(L).numpy(),
                "cos_first": self.cos_first.flatten().numpy(),
                "cos_other": self.cos_other.flatten().numpy(),
                "q_norm": self.q_norm.flatten().numpy(),
                "k_first_norm": self.k_first_norm.flatten().numpy(),
                "k_other_norm": self.k_other_norm.flatten().numpy(),
            }
        )

    def to_dict(self) -> dict:
        return {"layers": self.layers, **{c: v for c, v in self.table().drop(columns=["layer", "head"]).to_dict("list").items()}}


def qk_angles(model, tokens, layers=None, batch_size: int | None = None) -> QKAngles:
    """Cosines between queries and the first key against the other keys, per head, streamed."""
    dims = model_dims(model)
    layers = check_layers(model, layers)
    tokens = check_tokens(model, tokens)
    if tokens.shape[1] < 2:
        raise ValueError("QK angles need T >= 2 tokens (a first key and at least one other).")
    L, H = len(layers), dims.n_heads
    edges = torch.linspace(-1, 1, N_BINS + 1)
    acc = {name: torch.zeros(L, H, dtype=torch.float64) for name in ("cos_first", "cos_other", "q_norm", "k_first_norm", "k_other_norm")}
    hist_first = torch.zeros(L, H, N_BINS, dtype=torch.float64)
    hist_other = torch.zeros(L, H, N_BINS, dtype=torch.float64)
    counts = {"first": 0, "other": 0, "q": 0, "k1": 0, "kj": 0}
    pending: dict[int, dict[str, torch.Tensor]] = {}

    def hist(x: torch.Tensor) -> torch.Tensor:  # x (H, n) -> (H, N_BINS)
        idx = ((x.clamp(-1, 1) + 1) / 2 * N_BINS).long().clamp(max=N_BINS - 1)
        return torch.zeros(x.shape[0], N_BINS, dtype=torch.float64).scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))

    def reduce(i: int, q: torch.Tensor, k: torch.Tensor) -> None:
        B, T = q.shape[:2]
        cos = head_cosines(q, k).cpu()  # (B,H,T,T)
        first = rearrange(cos[:, :, 1:, 0], "b h t -> h (b t)")
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        mask[:, 0] = False
        other = rearrange(cos[..., mask], "b h n -> h (b n)")
        acc["cos_first"][i] += first.sum(-1)
        acc["cos_other"][i] += other.sum(-1)
        hist_first[i] += hist(first)
        hist_other[i] += hist(other)
        kk = repeat(k, "b t kv d -> b t (kv g) d", g=dims.n_heads // k.shape[2]).float().norm(dim=-1).cpu()  # (B,T,H)
        acc["q_norm"][i] += q.float().norm(dim=-1).cpu().sum(dim=(0, 1))
        acc["k_first_norm"][i] += kk[:, 0].sum(0)
        acc["k_other_norm"][i] += kk[:, 1:].sum(dim=(0, 1))
        if i == 0:
            counts["first"] += first.shape[1]
            counts["other"] += other.shape[1]
            counts["q"] += B * T
            counts["k1"] += B
            counts["kj"] += B * (T - 1)

    def reducer(i: int, which: str):
        def fn(x, hook):
            slot = pending.setdefault(i, {})
            slot[which] = x
            if len(slot) == 2:
                reduce(i, slot["q"], slot["k"])
                del pending[i]
        return fn

    reducers = []
    for i, l in enumerate(layers):
        qn, kn = qk_hook_names(model, l)
        reducers += [(qn, reducer(i, "q")), (kn, reducer(i, "k"))]
    run_with_reducers(model, tokens, reducers, batch_size=batch_size)
    norm = {"cos_first": "first", "cos_other": "other", "q_norm": "q", "k_first_norm": "k1", "k_other_norm": "kj"}
    out = {name: (acc[name] / counts[norm[name]]).float() for name in acc}
    return QKAngles(layers, **out, hist_first=(hist_first / counts["first"]).float(), hist_other=(hist_other / counts["other"]).float(), bin_edges=edges)
