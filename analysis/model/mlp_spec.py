"""The MLP of each block, measured: where its neurons are, its weights in one orientation, its activation, its input
norm, how its write reaches the residual stream, and for mixtures of experts the routed experts' writes.

Described by :class:`MlpSpec` (``get_mlp(model)``, measured on first use and kept as ``model.mlp_spec``); the
attention side of a family is ``analysis.model.families``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from analysis.model.contract import SinkModel
from analysis.model.weights import reads_block_weights
from analysis.model.families import NormSpec, _gain_and_bias, _kept, _record_hooks, _spec_dict, get_family, probe_norm

# The activations an MLP neuron may apply, by name (matched against the model's own activation module on a probe).
ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu": lambda x: torch.nn.functional.gelu(x),
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu2": lambda x: torch.relu(x) ** 2,
}
# The per-block hooks the MLP dry run reads (aliases; the bridge maps hook_pre / hook_pre_linear / hook_post to
# mlp.gate.hook_out / mlp.in.hook_out / mlp.out.hook_in, the reference models have them under these names).
_MLP_PROBE_HOOKS = tuple(
    "hook_resid_pre hook_resid_mid hook_resid_post hook_attn_out hook_mlp_out mlp.hook_pre "
    "mlp.hook_pre_linear mlp.hook_post mlp.hook_in mlp.hook_expert_indices".split()
)


@dataclass(frozen=True)
class MlpWeights:
    """One MLP's weights in one orientation for every family (float32, CPU).

    Neuron n reads ``W_in[n]`` (and ``W_gate[n]``) from the MLP input and writes ``W_out[:, n]`` into the residual
    stream (before ``output`` scaling, see :class:`MlpSpec`).

    Attributes
    ----------
    layer : int
        The block.
    W_out : torch.Tensor, shape (d_model, d_mlp)
        The output projection.
    b_out : torch.Tensor, shape (d_model,), or None
    W_in : torch.Tensor, shape (d_mlp, d_model)
        The up projection of a gated MLP, the input projection of a plain one.
    b_in : torch.Tensor, shape (d_mlp,), or None
    W_gate : torch.Tensor, shape (d_mlp, d_model), or None
        The gate projection (gated MLPs only).
    b_gate : torch.Tensor, shape (d_mlp,), or None
    """

    layer: int
    W_out: torch.Tensor  # (d_model, d_mlp)
    b_out: torch.Tensor | None  # (d_model,)
    W_in: torch.Tensor  # (d_mlp, d_model): the up projection of a gated MLP, the input projection of a plain one
    b_in: torch.Tensor | None  # (d_mlp,)
    W_gate: torch.Tensor | None  # (d_mlp, d_model), gated MLPs only
    b_gate: torch.Tensor | None  # (d_mlp,)
    TENSORS = ("W_out", "b_out", "W_in", "b_in", "W_gate", "b_gate")  # its tensors, in order (no field: unannotated)

    @staticmethod
    def slices(neurons=None, dims=None) -> dict[str, tuple]:
        """{field: (rows, then the index into those)} that keep ``neurons`` (rows of W_in, W_gate, their biases; W_out's
        columns) and ``dims`` (W_out's rows, b_out: alone, those only); None keeps all. Cut here, or read on NDIF."""
        n, d, every = (slice(None) if i is None else list(i) for i in (neurons, dims, None))
        ins = () if neurons is None and dims is not None else ("W_in", "b_in", "W_gate", "b_gate")
        return {"W_out": (d, (every, n)), "b_out": (d, every)} | {f: (n, every) for f in ins}

    def select(self, neurons=None, dims=None) -> MlpWeights:
        """These weights restricted to ``neurons`` and ``dims`` (:meth:`slices`; the fields it leaves out None)."""
        cut, kept = self.slices(neurons, dims), {}
        for f in self.TENSORS:
            t = getattr(self, f)
            kept[f] = t[cut[f][0]][cut[f][1]] if f in cut and t is not None else None
        return MlpWeights(self.layer, **kept)


@dataclass(frozen=True, kw_only=True)
class MlpSpec:
    """What the MLP of each block computes and how its write reaches the residual stream.

    Measured on one loaded model by :func:`mlp_spec` (one forward pass over a few tokens, hooks on every block; cached
    by :func:`get_mlp`). A dense MLP's neuron n computes a_n = act(g_n) u_n (``kind="gated"``: SwiGLU / GeGLU, g =
    W_gate x + b_gate, u = W_in x + b_in) or a_n = act(u_n) (``"plain"``), x the MLP input (``input_norm`` of the
    residual ``input_resid``), and the block adds ``output(W_out a + b_out)`` to the residual stream: the identity
    (``"add"``), a constant factor (``"scaled"``, Granite's residual multiplier) or a norm (``"post_norm"``: Gemma 2/3
    and OLMo-2 normalise the MLP output before adding it). ``"moe"`` blocks (gpt-oss, Qwen3-Next, Jamba's expert layers)
    route each token to a few experts whose neurons no hook holds: their writes are measured per block, and per expert
    by calling the block's router and experts (``_moe_parts``). The facts of the first dense block stand for every dense
    block.

    Attributes
    ----------
    family : str
        The model family (``FamilySpec.family``).
    kind : {"gated", "plain", "moe", "none"}
        "none": no MLP hook fires.
    activation : str or None
        Measured on the model's activation module: a key of ``ACTIVATIONS``, or "unknown".
    d_mlp : int or None
        The number of neurons per dense MLP.
    parallel : bool
        The MLP reads the block's input (``hook_resid_pre``), as the attention does (GPT-J, NeoX, Phi, Falcon).
    input_resid : {"resid_pre", "resid_mid"}
        The residual the MLP input is made from.
    input_norm : NormSpec or None
        The norm on that residual (None: the MLP reads the raw residual, OLMo-2).
    input_norm_module : str or None
        The block's attribute holding it ("ln1" or "ln2").
    output : {"add", "scaled", "post_norm", "unknown"}
        How W_out a + b_out reaches the residual stream.
    output_scale : float
        ``hook_mlp_out / (W_out a + b_out)`` where ``output == "scaled"`` (1.0 otherwise).
    output_norm : NormSpec or None
        The norm on the MLP output where ``output == "post_norm"``.
    output_norm_module : str or None
        Its block attribute ("ln2_post").
    additive : bool
        ``hook_resid_post = hook_resid_pre + the attention (mixer) write + hook_mlp_out`` on every block.
    mixer_layers : tuple of int
        Blocks whose token mixer has no ``hook_attn_out`` (Mamba, linear attention): their write is
        ``hook_resid_mid - hook_resid_pre``.
    moe_layers : tuple of int
        Blocks whose MLP is a mixture of experts.
    n_experts, top_k : int or None
        Experts per mixture-of-experts block, and experts routed per token.
    notes : tuple of str
        Further facts, in sentences.
    """

    family: str
    kind: str  # "gated" | "plain" | "moe" | "none" (no MLP hook fires)
    activation: str | None = None  # measured on the model's activation module: a key of ACTIVATIONS, or "unknown"
    d_mlp: int | None
    parallel: bool  # the MLP reads the block's input (hook_resid_pre), as the attention does (GPT-J, NeoX, Phi, Falcon)
    input_resid: str  # "resid_pre" | "resid_mid": the residual the MLP input is made from
    input_norm: NormSpec | None = None  # the norm on that residual (None: the MLP reads the raw residual, OLMo-2)
    input_norm_module: str | None = None  # the block's attribute holding it ("ln1" | "ln2")
    output: str  # "add" | "scaled" | "post_norm" | "unknown"
    output_scale: float  # hook_mlp_out / (W_out a + b_out) where output == "scaled" (1.0 otherwise)
    output_norm: NormSpec | None = None  # the norm on the MLP output where output == "post_norm"
    output_norm_module: str | None = None  # its block attribute ("ln2_post")
    additive: bool  # hook_resid_post = hook_resid_pre + the attention (mixer) write + hook_mlp_out, on every block
    mixer_layers: tuple[int, ...]  # blocks whose token mixer has no hook_attn_out (Mamba, linear attention): their
    # write is hook_resid_mid - hook_resid_pre
    moe_layers: tuple[int, ...]  # blocks whose MLP is a mixture of experts
    n_experts: int | None = None
    top_k: int | None = None
    notes: tuple[str, ...] = ()
    _neuron_hook: str | None = None  # (B, T, d_mlp): the out projection's input, a_n
    _gate_hook: str | None = None  # (B, T, d_mlp): g_n (gated)
    _up_hook: str | None = None  # (B, T, d_mlp): u_n (gated: the linear branch; plain: the pre-activation)
    _input_hook: str | None = None  # (B, T, d_model): the MLP input x where a hook holds it

    # ------------------------------------------------------------------ hook names
    def check_layer(self, layer: int, n_layers: int) -> int:
        layer = int(layer)
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} out of range: this model has blocks 0..{n_layers - 1}.")
        return layer

    def has_neurons(self, layer: int) -> bool:
        """Whether a hook holds the neuron activations of block ``layer``'s MLP (dense gated or plain MLPs)."""
        return self.kind in ("gated", "plain") and int(layer) not in self.moe_layers

    def _hook(self, template: str | None, layer: int, what: str) -> str:
        if template is None or not self.has_neurons(layer):
            why = (
                "a mixture of experts: no hook holds its experts' neurons"
                if int(layer) in self.moe_layers or self.kind == "moe"
                else f"{self.kind} MLP"
            )
            raise ValueError(f"block {layer} of this {self.family} model has no {what} hook ({why}).")
        return template.format(layer=int(layer))

    def neuron_hook(self, layer: int) -> str:
        """The hook holding the MLP's neuron activations a (B, T, d_mlp): the input of the output projection."""
        return self._hook(self._neuron_hook, layer, "neuron-activation")

    def gate_hook(self, layer: int) -> str:
        """The hook holding the gate pre-activations g (B, T, d_mlp) of a gated MLP."""
        return self._hook(self._gate_hook, layer, "gate")

    def up_hook(self, layer: int) -> str:
        """The hook holding u (B, T, d_mlp): a gated MLP's linear branch, a plain MLP's pre-activation."""
        return self._hook(self._up_hook, layer, "up / pre-activation")

    def attn_write_hook(self, layer: int) -> str | None:
        """The hook holding the token mixer's write into the residual stream (``hook_attn_out``), or None where the
        mixer has none (its write is hook_resid_mid - hook_resid_pre)."""
        return None if int(layer) in self.mixer_layers else f"blocks.{int(layer)}.hook_attn_out"

    def act(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"the MLP activation of this {self.family} model is {self.activation!r}.")
        return ACTIVATIONS[self.activation](x)

    # ------------------------------------------------------------------ protocol
    def text(self) -> str:
        """The MLP in words, one sentence per fact the analyses depend on."""
        if self.kind == "none":
            return " ".join([f"{self.family}: no MLP hook fires; the MLP's neurons cannot be read.", *self.notes[-1:]])
        what = {
            "gated": f"gated MLP (act(gate) x up, {self.activation})",
            "plain": f"plain MLP ({self.activation})",
            "moe": "mixture-of-experts MLP",
        }[self.kind]
        parts = [
            f"{self.family}: {what}"
            + (f" with {self.d_mlp} neurons" if self.d_mlp else "")
            + "; it reads "
            + (f"{self.input_norm.text()} of " if self.input_norm else "the raw ")
            + ("the block's input (in parallel with attention)." if self.parallel else "the residual after attention.")
        ]
        if self.moe_layers and self.kind != "moe":
            parts.append(f"Blocks {list(self.moe_layers)} are mixtures of {self.n_experts} experts (top {self.top_k}).")
        elif self.kind == "moe":
            parts.append(
                f"Every MLP routes each token to {self.top_k} of {self.n_experts} experts; no hook holds an "
                "expert's neurons, so writes are resolved per block and per expert, not per neuron."
            )
        parts.append(
            {
                "add": "Its output is added to the residual stream as it is.",
                "scaled": f"Its output is scaled by {self.output_scale:g} before it is added (residual multiplier).",
                "post_norm": f"Its output passes a {self.output_norm.text() if self.output_norm else 'norm'} "
                "before it is added (per-token scale).",
                "unknown": "How its output reaches the residual stream could not be measured.",
            }[self.output]
        )
        if self.mixer_layers:
            parts.append(
                f"Blocks {list(self.mixer_layers)} mix tokens without softmax attention; their write is "
                "hook_resid_mid - hook_resid_pre."
            )
        if not self.additive:
            parts.append(
                "hook_resid_post is not the stream before the MLP plus hook_mlp_out (a post-norm stream, or a "
                "hook that edits the stream): the writes do not add up to the stream."
            )
        parts.extend(self.notes)
        return " ".join(parts)

    def to_dict(self) -> dict:
        return _spec_dict(self)


def _mlp_module(model, layer: int):
    """The model's own MLP module of block ``layer`` (the Hugging Face module behind a bridge; the reference
    model's MLP), unwrapped as :func:`block_norm` unwraps a norm."""
    return block_norm(model, layer, "mlp")


def _is_moe(model, layer: int) -> bool:
    if f"blocks.{layer}.mlp.hook_expert_indices" in getattr(model, "hook_dict", {}):
        return True
    mod = _mlp_module(model, layer)
    return mod is not None and getattr(mod, "experts", None) is not None


def _moe_parts(model: SinkModel, layer: int):
    """The (router, experts) modules of a mixture-of-experts block.

    ``router(x)`` gives (logits, weights, indices) and ``experts(x, indices, weights)`` the routed experts' weighted
    sum, for x (n_tokens, d_model) (the form of gpt-oss and Qwen3-Next in transformers 5); ValueError where block
    ``layer`` does not have this form."""
    mod = _mlp_module(model, layer)
    experts = getattr(mod, "experts", None)
    router = getattr(mod, "router", None) or getattr(mod, "gate", None)
    router = getattr(router, "original_component", None) or router
    if experts is None or router is None:
        raise ValueError(f"block {layer}'s MLP is not a mixture of experts with a router and experts module.")
    return router, experts


def _moe_counts(model: SinkModel, moe_layers) -> tuple[int | None, int | None]:
    """(experts, experts per token) of the first mixture-of-experts block in ``moe_layers``; (None, None) for none."""
    router, experts = _moe_parts(model, moe_layers[0]) if moe_layers else (None, None)
    n = int(getattr(experts, "num_experts", 0) or getattr(router, "num_experts", 0)) or None
    return n, int(getattr(router, "top_k", 0)) or None


def expert_writes(model: SinkModel, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Who writes a mixture-of-experts block's output, from the block's router and experts (``_moe_parts``) and the block
    itself, all run on ``x``.

    Parameters
    ----------
    model : SinkModel
    layer : int
        A mixture-of-experts block.
    x : torch.Tensor, shape (n, d_model)
        The MLP inputs of n tokens.

    Returns
    -------
    indices : torch.Tensor, shape (n, top_k)
        The routed experts of each token.
    writes : torch.Tensor, shape (n, top_k, d_model)
        Each routed expert's weighted output alone.
    rest : torch.Tensor, shape (n, d_model)
        What the block adds beyond them (a shared expert, Qwen3-Next; zero for gpt-oss).
    """
    router, experts = _moe_parts(model, layer)
    if any(p.is_meta for p in experts.parameters()):
        raise ValueError(f"block {layer}'s experts are on the meta device (a model held on NDIF): they run there only")
    block = _mlp_module(model, layer)
    x = _on_model(model, x)  # the trace keeps x on the CPU
    spec = getattr(model, "mlp_spec", None)
    scale = spec.output_scale if isinstance(spec, MlpSpec) else 1.0  # Granite-MoE: the residual multiplier
    with torch.no_grad():
        routed = router(x)
        if len(routed) == 2:  # Llama 4: sigmoid scores (zero off the top k) scale each expert's input; all experts run
            scores, logits = routed
            idx = logits.topk(int(router.top_k), dim=-1).indices
            outs = experts(x.repeat(scores.shape[1], 1) * scores.T.reshape(-1, 1)).view(scores.shape[1], len(x), -1)
            slots = torch.stack([outs[idx[:, j], torch.arange(len(x))] for j in range(idx.shape[1])], 1)
        else:  # (logits, weights, indices): the weights scale each routed expert's output
            _, weights, idx = routed
            slots = torch.stack([experts(x, idx[:, j : j + 1], weights[:, j : j + 1]) for j in range(idx.shape[1])], 1)
        total = block(x[None])
        total = (total[0] if isinstance(total, tuple) else total).reshape(len(x), -1)  # Llama 4 returns (n, d_model)
    slots, total = scale * slots.float().cpu(), scale * total.float().cpu()
    return idx.cpu(), slots, total - slots.sum(1)


def _rounding(dtype: torch.dtype) -> float:
    """A few rounding units of a model computing in bf16 / fp16 (0 in float32 / float64): how far the checks that
    rebuild its activations from its weights in float32 must let them differ (a bf16 value carries 8 bits)."""
    return 4 * torch.finfo(dtype).eps if dtype.is_floating_point and torch.finfo(dtype).bits < 32 else 0.0


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, *, atol: float, rtol: float) -> bool:
    """``torch.allclose(a, b, atol, rtol)`` (float32 tolerances), widened for a model computing in ``dtype`` to its
    rounding: ``_rounding(dtype)`` of each value and of b's largest |value| (a sum of rounded terms)."""
    u = _rounding(dtype)
    return torch.allclose(a, b, atol=max(atol, u * float(b.abs().max())), rtol=max(rtol, u))


def _as_linear(module, d_in: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W (d_out, d_in), b (d_out,) or None) of a linear module, whichever way it stores its weight (nn.Linear:
    (out, in); GPT-2's Conv1D: (in, out)): the orientation is the one whose product rebuilds ``module(probe)``."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        raise ValueError(f"{type(module).__name__} has no 2-d weight to read.")
    p = torch.randn(2, d_in, generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    with torch.no_grad():
        y = module(p).float()
        zero = module(torch.zeros_like(p[:1])).float()[0]
    wf = w.detach().float()
    for W in ([wf] if wf.shape[1] == d_in else []) + ([wf.T] if wf.shape[0] == d_in else []):
        if _close(p.float() @ W.T + zero, y, w.dtype, atol=1e-4, rtol=1e-3):  # a bf16 module rounds its output
            b = zero.cpu() if zero.abs().max() > 0 else None
            return W.contiguous().cpu(), b
    raise ValueError(f"{type(module).__name__} (weight {tuple(w.shape)}) is not a linear map of its input.")


# Where a block's dense projections sit in its MLP bridge: ``in`` / ``gate`` / ``out`` on a dense MLP bridge; a bridge
# shared by the dense and the mixture-of-experts blocks of one model (Jamba's MoEBridge) names the dense blocks' ones
# ``dense_in`` / ``dense_gate`` / ``dense_out``. Read per block: one block's names say nothing about another's.
_PROJECTION_NAMES = {"in": ("in", "dense_in"), "gate": ("gate", "dense_gate"), "out": ("out", "dense_out")}


def mlp_projections(mlp) -> dict:
    """The dense projections of a block's MLP bridge, read on that block.

    Parameters
    ----------
    mlp : GeneralizedComponent
        A block's MLP bridge (``model.blocks[l].mlp``).

    Returns
    -------
    dict
        {"in" | "gate" | "out": the Hugging Face module of that projection, or None where the bridge has none}.
    """
    found = {}
    for role, names in _PROJECTION_NAMES.items():
        mods = [getattr(getattr(mlp, n, None), "original_component", None) for n in names]
        found[role] = next((m for m in mods if m is not None), None)
    return found


@reads_block_weights
def mlp_weights(model: SinkModel, layer: int, *, neurons=None, dims=None) -> MlpWeights:
    """The weights of a block's dense MLP, read from the bridge's out / in / gate projections (their orientation
    measured) or the reference model's W_in / W_gate / W_out.

    Parameters
    ----------
    model : SinkModel
    layer : int
        A block with a dense MLP (ValueError, saying why, otherwise).
    neurons, dims : sequence of int, optional
        Only these neurons and residual dims (:meth:`MlpWeights.select`): all that a model held on NDIF reads.

    Returns
    -------
    MlpWeights
    """
    if hasattr(model, "block_module"):  # no bridge blocks (NnsightModel): it reads its Hugging Face modules
        return model.mlp_weights(layer, neurons=neurons, dims=dims)
    if neurons is not None or dims is not None:
        return mlp_weights.__wrapped__(model, layer).select(neurons, dims)
    spec = get_mlp(model)
    layer = spec.check_layer(layer, int(model.cfg.n_layers))
    if not spec.has_neurons(layer):
        spec.neuron_hook(layer)  # raises, saying why
    mlp = model.blocks[layer].mlp
    D = int(model.cfg.d_model)
    if isinstance(getattr(mlp, "W_out", None), torch.nn.Parameter) and getattr(mlp, "original_component", None) is None:

        def rows(w):  # analysis.train's MLP: x @ W_in, x @ W_gate, a @ W_out; MlpWeights holds them transposed
            return None if w is None else w.detach().float().T.contiguous().cpu()

        return MlpWeights(layer, rows(mlp.W_out), None, rows(mlp.W_in), None, rows(getattr(mlp, "W_gate", None)), None)
    mods = mlp_projections(mlp)
    if mods["out"] is None or mods["in"] is None:
        raise ValueError(
            f"block {layer}'s MLP bridge has no in / out projections (mlp.in, mlp.out, or mlp.dense_in, mlp.dense_out)."
        )
    W_in, b_in = _as_linear(mods["in"], D)
    W_out, b_out = _as_linear(mods["out"], W_in.shape[0])
    W_gate, b_gate = _as_linear(mods["gate"], D) if spec.kind == "gated" else (None, None)
    return MlpWeights(layer, W_out, b_out, W_in, b_in, W_gate, b_gate)


def _activation_name(
    model, layer: int, pre: torch.Tensor | None, up: torch.Tensor | None, post: torch.Tensor | None, gated: bool
) -> str:
    """The activation, matched on the model's own activation module over [-6, 6] (a module without parameters
    inside the MLP); else on the hooks' pre-activations and activations; "unknown" if nothing matches."""
    x = torch.linspace(-6, 6, 241)
    mod = _mlp_module(model, layer)
    cands = [
        m
        for m in (mod.modules() if isinstance(mod, torch.nn.Module) else ())
        if m is not mod
        and not list(m.parameters())
        and not list(m.children())
        and not isinstance(m, (torch.nn.Dropout, torch.nn.Identity))
        and "hook" not in type(m).__name__.lower()
    ]
    for m in cands:
        try:
            with torch.no_grad():
                y = m(x).float()
        except Exception:  # noqa: BLE001 - not an elementwise activation
            continue
        if y.shape == x.shape:
            errs = {n: float((f(x) - y).abs().max()) for n, f in ACTIVATIONS.items()}
            best = min(errs, key=errs.get)
            if errs[best] < 1e-4:
                return best
    name = getattr(getattr(model, "cfg", None), "act_fn", None)  # the reference models: "swiglu" | "gelu" | "relu"
    if getattr(model, "original_model", None) is None and name in ("swiglu", "gelu", "relu"):
        return "silu" if name == "swiglu" else name
    if post is not None and (pre if gated else up) is not None:
        g = pre if gated else up
        errs = {n: float((f(g) * (up if gated else 1.0) - post).abs().max()) for n, f in ACTIVATIONS.items()}
        best = min(errs, key=errs.get)
        if errs[best] < max(1e-5, _rounding(next(model.parameters()).dtype)) * max(1.0, float(post.abs().max())):
            return best
    return "unknown"


def block_norm(model: SinkModel, layer: int, name: str | None):
    """A norm module of a block as the model runs it.

    Parameters
    ----------
    model : SinkModel
    layer : int
        The block.
    name : str or None
        "ln1", "ln2" or "ln2_post" (or "mlp": the MLP module itself).

    Returns
    -------
    torch.nn.Module or None
        The Hugging Face module behind the bridge's; None where the block has none (or ``name`` is None).
    """
    if hasattr(model, "block_module"):  # no bridge blocks (NnsightModel): it reads its Hugging Face modules
        return model.block_module(layer, name) if name else None
    mod = getattr(model.blocks[layer], name, None) if name else None
    return getattr(mod, "original_component", None) or mod if mod is not None else None


def norm_weights(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gain and bias of a norm module (Hugging Face ``weight`` / ``bias``; the reference models' ``w`` / ``b``).

    Parameters
    ----------
    module : torch.nn.Module

    Returns
    -------
    weight : torch.Tensor, shape (size,)
        float32 on the CPU.
    bias : torch.Tensor, shape (size,), or None
    """
    w, b = _gain_and_bias(module)
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"{type(module).__name__} has no gain weight.")
    return w.detach().float().cpu(), (b.detach().float().cpu() if isinstance(b, torch.Tensor) else None)


def mlp_input(model: SinkModel, layer: int, resid: torch.Tensor) -> torch.Tensor:
    """The MLP input of a block made from the residual it reads (``get_mlp(model).input_resid``): the block's input norm
    applied (none: the residual itself).

    Parameters
    ----------
    model : SinkModel
    layer : int
        The block.
    resid : torch.Tensor, shape (..., d_model)
        The residual stream the MLP reads.

    Returns
    -------
    torch.Tensor, shape (..., d_model)
        float32, on ``resid``'s device.
    """
    spec = get_mlp(model)
    mod = block_norm(model, int(layer), spec.input_norm_module)
    if mod is None:
        return resid.float()
    with torch.no_grad():
        return mod(_on_model(model, resid)).float().to(resid.device)


def _on_model(model, x: torch.Tensor) -> torch.Tensor:
    """``x`` (e.g. kept on the CPU) on the model's device and in its dtype, to run through one of its modules."""
    param = next(model.parameters())
    return x.to(param.device, param.dtype)


def _mlp_input(model, layer: int, got: dict, W: MlpWeights, target: torch.Tensor, kind: str):
    """(residual, norm module name) whose normalised value rebuilds the MLP's first pre-activation ``target``."""
    W_first, b_first = (W.W_gate, W.b_gate) if kind == "gated" else (W.W_in, W.b_in)
    for resid, norm in (
        ("resid_mid", "ln2"),
        ("resid_pre", "ln2"),  # a parallel block with a norm of its own for the MLP (GPT-NeoX): where ln1 is alike
        ("resid_pre", "ln1"),
        ("resid_mid", None),
        ("resid_pre", None),
    ):
        h = got.get(f"blocks.{layer}.hook_{resid}")
        mod = block_norm(model, layer, norm)
        if h is None or (norm is not None and mod is None):
            continue
        with torch.no_grad():
            x = (mod(_on_model(model, h)) if mod is not None else h).float().cpu()
        pre = x @ W_first.T + (b_first if b_first is not None else 0)
        if _close(pre, target, next(model.parameters()).dtype, atol=1e-4, rtol=1e-3):
            return resid, norm, mod
    return None, None, None


def _add_or_scaled(out: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> tuple[str, float] | None:
    """("add", 1.0) where ``out`` is ``y``, ("scaled", the factor) where it is a multiple of ``y`` (Granite's residual
    multiplier), else None: to the rounding of a model computing in ``dtype``."""
    if _close(out, y, dtype, atol=1e-5, rtol=1e-4):
        return "add", 1.0
    scale = float((out * y).sum() / (y * y).sum().clamp_min(1e-30))
    return ("scaled", scale) if _close(out, scale * y, dtype, atol=1e-5, rtol=1e-4) else None


def _mlp_output(model, layer: int, got: dict, W: MlpWeights, a: torch.Tensor) -> tuple[str, float, object, str | None]:
    """How the out projection's output W_out a + b_out becomes hook_mlp_out: (kind, scale, norm module, its name)."""
    proj = a @ W.W_out.T + (W.b_out if W.b_out is not None else 0)
    out = got[f"blocks.{layer}.hook_mlp_out"]
    dtype = next(model.parameters()).dtype  # bf16 / fp16: the hooks hold the projections rounded to it
    fit = _add_or_scaled(out, proj, dtype)
    if fit is not None and fit[0] == "add":
        return "add", 1.0, None, None
    mod = block_norm(model, layer, "ln2_post")
    if mod is not None:
        with torch.no_grad():
            y = mod(_on_model(model, proj)).float().cpu()
        if _close(y, out, dtype, atol=1e-4, rtol=1e-3):
            return "post_norm", 1.0, mod, "ln2_post"
    return (*fit, None, None) if fit is not None else ("unknown", 1.0, None, None)


def _moe_output(model, got: dict, layer: int) -> tuple[str, float]:
    """How a mixture-of-experts block's own output (its module run on ``mlp.hook_in``) becomes hook_mlp_out: ("add",
    1.0), ("scaled", the factor: Granite-MoE's residual multiplier) or ("unknown", 1.0)."""
    x, out = got.get(f"blocks.{layer}.mlp.hook_in"), got.get(f"blocks.{layer}.hook_mlp_out")
    if x is None or out is None:
        return "unknown", 1.0
    with torch.no_grad():
        y = _mlp_module(model, layer)(_on_model(model, x))
    y = (y[0] if isinstance(y, tuple) else y).float().cpu().reshape(out.shape)
    return _add_or_scaled(out, y, next(model.parameters()).dtype) or ("unknown", 1.0)


def _adds_up(got: dict, l: int, dtype: torch.dtype = torch.float32) -> bool:
    """Whether block ``l``'s MLP write (with the attention write where the two run in parallel) is what its residual
    stream gains: hook_resid_post - hook_resid_mid (or - hook_resid_pre), to the rounding of the stream in the
    model's ``dtype`` (float32, or a few units of bf16 / fp16)."""
    b = f"blocks.{l}."
    post, mlp = got.get(b + "hook_resid_post"), got.get(b + "hook_mlp_out")
    if post is None or mlp is None:
        return False
    mid = got.get(b + "hook_resid_mid")
    write = mlp if mid is not None else mlp + got.get(b + "hook_attn_out", torch.zeros_like(mlp))
    delta = post - (mid if mid is not None else got[b + "hook_resid_pre"])
    return float((delta - write).abs().max()) <= 1e-4 + max(1e-5, _rounding(dtype)) * float(post.abs().max())


def _probe_mlp_hooks(model, n_layers: int) -> tuple[dict, dict]:
    """One forward pass over five tokens: ({alias: activation (float32, CPU)} of the ``_MLP_PROBE_HOOKS`` that fired on
    every block, {alias: canonical hook name})."""
    hook_dict = getattr(model, "hook_dict", {})
    names = [f"blocks.{l}.{s}" for l in range(n_layers) for s in _MLP_PROBE_HOOKS if f"blocks.{l}.{s}" in hook_dict]
    seen, canonical = _record_hooks(model, names, 5)
    return {n: seen[canonical[n]] for n in names if seen.get(canonical[n]) is not None}, canonical


def mlp_spec(model: SinkModel) -> MlpSpec:
    """Measure the MLP facts of a loaded model (a TransformerBridge or a reference model).

    One forward pass over five tokens records, on every block, which MLP hooks fire, the residual, attention and MLP
    writes; the MLP's input norm, activation and output scaling are read by rebuilding the first dense MLP from its
    weights.

    Parameters
    ----------
    model : SinkModel

    Returns
    -------
    MlpSpec
    """
    n_layers = int(model.cfg.n_layers)
    got, canonical = _probe_mlp_hooks(model, n_layers)
    fields, dense, in_hook = _mlp_layout(model, got, n_layers)
    if fields["kind"] in ("moe", "none"):
        return _spec_without_neurons(model, got, fields, in_hook)
    return _dense_spec(model, got, canonical, fields, dense[0], in_hook)


def _mlp_layout(model: SinkModel, got: dict, n_layers: int) -> tuple[dict, list[int], str | None]:
    """What the hooks that fired say of the MLPs: the spec's fields (the family, the kind, the mixer and MoE blocks,
    whether the writes add up, the experts), the dense blocks, and the MLP input's hook when every block has one."""
    moe = tuple(l for l in range(n_layers) if _is_moe(model, l))  # read per block: dense and MoE blocks mix
    mixers = tuple(l for l in range(n_layers) if f"blocks.{l}.hook_attn_out" not in got)

    def neurons(l, s):  # a dense block's hook (MoE bridges alias hook_pre / hook_post to the block's input / output)
        return None if l in moe else got.get(f"blocks.{l}.mlp.{s}")

    dense = [
        l
        for l in range(n_layers)
        if l not in moe and neurons(l, "hook_post") is not None and neurons(l, "hook_pre") is not None
    ]
    kind = (
        "moe"
        if moe and not dense
        else ("none" if not dense else ("gated" if neurons(dense[0], "hook_pre_linear") is not None else "plain"))
    )
    additive = all(_adds_up(got, l, next(model.parameters()).dtype) for l in range(n_layers))
    n_exp, top_k = _moe_counts(model, moe)
    fields = dict(
        family=get_family(model).family,
        kind=kind,
        parallel=bool(get_family(model).parallel_block),
        additive=additive,
        mixer_layers=mixers,
        moe_layers=moe,
        n_experts=n_exp,
        top_k=top_k,
    )
    in_hook = "blocks.{layer}.mlp.hook_in" if all(f"blocks.{b}.mlp.hook_in" in got for b in range(n_layers)) else None
    return fields, dense, in_hook


def _spec_without_neurons(model: SinkModel, got: dict, fields: dict, in_hook: str | None) -> MlpSpec:
    """The spec of a model whose blocks hold no dense MLP's neurons: MoE blocks only (their output read from the
    first one, given the MLP input's hook), or no MLP hook found."""
    notes = []
    if fields["kind"] == "none":
        notes.append("No hook holds the MLP's neuron activations (blocks.{l}.mlp.hook_post).")
    moe_output = fields["kind"] == "moe" and in_hook
    output, scale = _moe_output(model, got, fields["moe_layers"][0]) if moe_output else ("unknown", 1.0)
    return MlpSpec(
        **fields,
        d_mlp=None,
        input_resid="resid_pre" if fields["parallel"] else "resid_mid",
        output=output,
        output_scale=scale,
        notes=tuple(notes),
        _input_hook=in_hook,
    )


def _dense_spec(model: SinkModel, got: dict, canonical: dict, fields: dict, l: int, in_hook: str | None) -> MlpSpec:
    """The spec of a model with dense MLPs, measured on its first dense block ``l``: the neuron hooks, then the MLP's
    input norm, activation and output scaling, read by rebuilding the MLP from its weights."""
    kind, notes = fields["kind"], []
    pre, up, post = (got.get(f"blocks.{l}.mlp.{s}") for s in ("hook_pre", "hook_pre_linear", "hook_post"))
    if kind == "plain":
        pre, up = None, pre
    tmpl = _neuron_hooks(canonical, l, kind)
    gate_hook = tmpl["gate"] if kind == "gated" else None
    partial_spec = MlpSpec(
        **fields,
        d_mlp=int(post.shape[-1]),
        input_resid="resid_mid",
        output="unknown",
        output_scale=1.0,
        _neuron_hook=tmpl["neuron"],
        _gate_hook=gate_hook,
        _up_hook=tmpl["up"],
    )
    model.mlp_spec = partial_spec  # mlp_weights reads the kind from it while the spec is being measured
    try:
        W = mlp_weights(model, l)
    finally:
        del model.mlp_spec
    resid, norm_name, norm_mod = _mlp_input(model, l, got, W, pre if kind == "gated" else up, kind)
    if resid is None:
        notes.append("The MLP input could not be rebuilt from the residual stream and a norm of the block.")
    output, scale, out_mod, out_name = _mlp_output(model, l, got, W, post)
    return replace(
        partial_spec,
        parallel=resid == "resid_pre" if resid else fields["parallel"],
        activation=_activation_name(model, l, pre, up, post, kind == "gated"),
        input_resid=resid or "resid_mid",
        input_norm=probe_norm(norm_mod, model=model) if norm_mod is not None else None,
        input_norm_module=norm_name,
        output=output,
        output_scale=scale,
        output_norm=probe_norm(out_mod, model=model) if out_mod is not None else None,
        output_norm_module=out_name,
        notes=tuple(notes),
        _input_hook=in_hook,
    )


def _neuron_hooks(canonical: dict, l: int, kind: str) -> dict[str, str]:
    """The neuron, gate and up hooks of block ``l``, by their canonical names, as templates over ``{layer}``."""
    up = "hook_pre_linear" if kind == "gated" else "hook_pre"
    return {
        k: canonical[f"blocks.{l}.mlp.{s}"].replace(f"blocks.{l}.", "blocks.{layer}.", 1)
        for k, s in (("neuron", "hook_post"), ("gate", "hook_pre"), ("up", up))
    }


def get_mlp(model: SinkModel) -> MlpSpec:
    """``model.mlp_spec``, measured (:func:`mlp_spec`) and kept on the model on first use.

    Parameters
    ----------
    model : SinkModel
        Any model with TransformerLens hook names (a TransformerBridge or a reference model).

    Returns
    -------
    MlpSpec
    """
    return _kept(model, "mlp_spec", MlpSpec, mlp_spec)
