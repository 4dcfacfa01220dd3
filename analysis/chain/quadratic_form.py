"""The quadratic-form view of a gated MLP's write on one residual dimension (the notes, seeds/003), measured.

In a gated MLP neuron n writes a_n = act(g_n) u_n times W_out[d, n] into dimension d, with g_n = w_gate_n . x and
u_n = w_up_n . x for the MLP input x. Where act(g) is close to g (SiLU and GELU for large g), the write is
x^T A_d x with

    A_d = sum_n W_out[d, n] w_gate_n w_up_n^T = W_gate^T diag(W_out[d]) W_up      (d_model x d_model),

a quadratic form whose symmetric part S_d = (A_d + A_d^T) / 2 has real eigenvalues. The notes claim its spectrum is
dominated by one direction, so inputs along it are amplified enormously. :func:`quadratic_form` measures that: the
eigenvalues of S_d by magnitude, the top ones' shares, the cosine between the top eigenvectors and the first token's
MLP input, how much of x^T S_d x the top direction carries, and the linearised write against the real one. The
verdict "rank one" needs both: the top eigenvalue holds at least ``RANK_ONE_ENERGY`` of sum(lambda^2), and the first
token's input lies along its eigenvector (mean |cos| >= ``RANK_ONE_COS``). Biases (gpt-oss) are left out of A_d.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from analysis.core.defaults import RANK_ONE_COS, RANK_ONE_ENERGY, TINY
from analysis.core.results import Result, compact_repr


@dataclass
class QuadraticForm(Result):
    """The spectrum of S_d for one (dimension, block) and how the first token's MLP input meets it.

    Attributes
    ----------
    dim, block : int
        The residual dimension d and the block whose MLP writes it.
    eigenvalues : torch.Tensor, shape (d_model,)
        Eigenvalues of S_d (times the MLP's output factor), by decreasing magnitude.
    cos_top : torch.Tensor, shape (k,)
        Mean over samples of |cos| between the k top eigenvectors and the first token's MLP input.
    form_share_top : torch.Tensor, shape (k,)
        Mean over samples of lambda_i (v_i . x)^2 / x^T S_d x: the share of the linearised write each top direction
        carries on the first token.
    linearised_write, write : float
        Mean x^T S_d x (act(g) replaced by g, no biases) and the mean real write of the MLP on d, first token.
    energy_threshold : float
        The top eigenvalue's share of sum(lambda^2) above which the form is dominated by one direction.
    cos_threshold : float
        The |cos| with the first token's input above which that direction is aligned with it.
    n_samples : int
        N, the samples of the first token's MLP input.
    model_name, kind : str or None
        The model measured and the input kind (the result protocol).
    """

    dim: int
    block: int
    eigenvalues: torch.Tensor
    cos_top: torch.Tensor
    form_share_top: torch.Tensor
    linearised_write: float
    write: float
    energy_threshold: float = RANK_ONE_ENERGY
    cos_threshold: float = RANK_ONE_COS
    n_samples: int = 0
    model_name: str | None = None
    kind: str | None = None

    table_fields = ("top=table",)

    def __repr__(self) -> str:
        return compact_repr(self)  # shapes, never tensor values

    @property
    def energy_share(self) -> torch.Tensor:
        """lambda_i^2 / sum(lambda^2) of the top eigenvalues (k,)."""
        lam = self.eigenvalues.double()
        return (lam[: len(self.cos_top)] ** 2 / (lam**2).sum().clamp_min(TINY)).float()

    @property
    def abs_share(self) -> torch.Tensor:
        """|lambda_i| / sum |lambda| of the top eigenvalues (k,)."""
        lam = self.eigenvalues.double().abs()
        return (lam[: len(self.cos_top)] / lam.sum().clamp_min(TINY)).float()

    @property
    def dominated(self) -> bool:
        return float(self.energy_share[0]) >= self.energy_threshold

    @property
    def aligned(self) -> bool:
        return float(self.cos_top[0]) >= self.cos_threshold

    @property
    def rank_one(self) -> bool:
        """Whether the notes' "rank-one" claim holds: one dominant eigenvalue, and the first token's input along it."""
        return self.dominated and self.aligned

    @property
    def table(self) -> pd.DataFrame:
        """One row per top eigen-direction: eigenvalue, its shares, |cos| with the first token's input, form share."""
        k = len(self.cos_top)
        return pd.DataFrame(
            {
                "dim": self.dim,
                "block": self.block,
                "rank": range(1, k + 1),
                "eigenvalue": self.eigenvalues[:k].tolist(),
                "energy_share": self.energy_share.tolist(),
                "abs_share": self.abs_share.tolist(),
                "cos_first_input": self.cos_top.tolist(),
                "form_share": self.form_share_top.tolist(),
            }
        )

    def findings(self) -> list[str]:
        """What A_d's spectrum and the first token's input say, then whether the rank-one claim holds."""
        e, c, f = float(self.energy_share[0]), float(self.cos_top[0]), float(self.form_share_top[0])
        lin = (
            f"the linearised form gives {self.linearised_write:+.4g} on the first token against a real write of "
            f"{self.write:+.4g}"
        )
        head = (
            f"The quadratic-form view of MLP {self.block} on dim {self.dim}: A_d's top eigenvalue holds {e:.0%} of "
            f"sum(lambda^2) (the top 3: {float(self.energy_share[:3].sum()):.0%}), its eigenvector meets the first "
            f"token's MLP input at |cos| {c:.2f}, and carries {f:.0%} of the linearised write; {lin}."
        )
        if self.rank_one:
            verdict = (
                "The rank-one claim holds here: one direction dominates A_d and the first token's input lies along it."
            )
        elif self.dominated:
            verdict = (
                f"The rank-one claim holds only in part: one direction dominates A_d, but the first token's input "
                f"is not along it (|cos| {c:.2f} < {self.cos_threshold:g})."
            )
        elif self.aligned:
            verdict = (
                f"The rank-one claim does not hold: A_d's spectrum is spread (top eigenvalue {e:.0%} < "
                f"{self.energy_threshold:.0%} of sum(lambda^2)), although the first token's input lies along its "
                "top direction."
            )
        else:
            verdict = (
                f"The rank-one claim does not hold: A_d's spectrum is spread (top eigenvalue {e:.0%} < "
                f"{self.energy_threshold:.0%} of sum(lambda^2)) and the first token's input is not along its top "
                "direction."
            )
        return [head, verdict]

    json_header = False
    json_fields = (
        "dim",
        "block",
        "rank_one",
        "dominated",
        "aligned",
        "top=table",
        "linearised_write",
        "write",
        "eigenvalues",
    )


def quadratic_form(
    w_out_d: torch.Tensor,
    W_gate: torch.Tensor,
    W_up: torch.Tensor,
    x: torch.Tensor,
    *,
    dim: int,
    block: int,
    write: float,
    top: int = 3,
) -> QuadraticForm:
    """The quadratic-form view of one gated MLP's write on one dimension.

    Parameters
    ----------
    w_out_d : torch.Tensor, shape (d_mlp,)
        W_out[d, :] times the MLP's output factor (1, Granite's multiplier, or a post-norm's mean gain x scale).
    W_gate, W_up : torch.Tensor, shape (d_mlp, d_model)
        The gate and up projections (rows w_gate_n, w_up_n).
    x : torch.Tensor, shape (N, d_model)
        The first token's MLP input on N sequences.
    dim, block : int
        Which dimension and block (labels).
    write : float
        The MLP's mean real write on ``dim`` (first token), for the linearisation check.
    top : int
        How many top eigen-directions to report.

    Returns
    -------
    QuadraticForm
    """
    lam, cos, share, form = _form_spectrum({}, w_out_d=w_out_d, W_gate=W_gate, W_up=W_up, x=x, top=top)
    return QuadraticForm(int(dim), int(block), lam, cos, share, float(form), float(write), n_samples=int(x.shape[0]))


def _form_spectrum(acts, *, w_out_d, W_gate, W_up, x, top: int = 3) -> tuple:
    """:func:`quadratic_form`'s measures (eigenvalues, top |cos| and form shares, mean x^T S_d x), torch only: a remote
    trace ships it as a reduction of no activations (``acts`` unused), so W_gate and W_up stay on NDIF. A_d is summed
    in float64 over chunks of d_model neurons, so no chunk outweighs S."""
    c, dev = W_up.shape[1], W_up.device
    w = w_out_d.double().to(dev)
    S = sum(W_gate[i : i + c].double().T @ (w[i : i + c, None] * W_up[i : i + c].double()) for i in range(0, len(w), c))
    S = (S + S.T) / 2  # A_d = W_gate^T diag(w_out_d) W_up, symmetrised
    lam, V = torch.linalg.eigh(S)
    order = lam.abs().argsort(descending=True)
    lam, V = lam[order], V[:, order]
    k = min(int(top), lam.numel())
    xd = x.double().to(dev)
    proj = xd @ V[:, :k]  # (N, k)
    cos = (proj.abs() / xd.norm(dim=-1, keepdim=True).clamp_min(TINY)).mean(0)
    form = ((xd @ S) * xd).sum(-1)  # (N,)
    share = (
        lam[:k] * proj**2 / form[:, None].where(form[:, None].abs() > TINY, torch.full_like(form[:, None], TINY))
    ).mean(0)
    return lam.float(), cos.float(), share.float(), form.mean()
