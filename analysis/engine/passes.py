"""The pass engine: one streamed pass of a model over tokens, feeding accumulators one layer at a time.

An analysis is an :class:`Accumulator`: it says which hooks it needs per layer (``hooks()``) and folds each layer's
activations into its own state (``update``); :func:`run_pass` runs the model over the tokens in batches and hands
every accumulator the activations of one layer together (a :class:`LayerActs`, the joint reducer), keeping only what
the accumulators reduce to, never the full activation cache. A pass can start at a block from the residual stream
entering it (:class:`Resume`, kept by :class:`ResidCapture`) instead of at the embedding. ``run_with_reducers`` is
the plain form for one-off hooks. The hook names and the model's dimensions come from ``analysis.model.hooks``.
"""

from __future__ import annotations

import abc
import contextvars
import os
import threading
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from analysis.model.access import can_skip_blocks, skipped_blocks
from analysis.model.contract import SinkModel
from analysis.engine.attention import AttentionWeights
from analysis.engine.backends import BackendUnsupported, NnsightTaps, Taps, _Named, choose_backend, run_hf_batch
from analysis.engine.remote import remote_pass
from analysis.model.nnsight_model import NnsightModel
from analysis.model.families import RESUMABLE, get_family
from analysis.model.hooks import (
    ModelContractError,
    act_name,
    check_tokens,
    hook_layer,
    hook_names,
    model_device,
    model_facts,
)
from analysis.core.docs import model_tokens, parameters_from
from analysis.core.memory import share_arenas
from analysis.core.stats import one_thread, unit_vectors

HookFn = Callable[[torch.Tensor, object], object]


def reading(fn: HookFn) -> HookFn:
    """Mark an intervention's hook as one that only reads its activation (what a later edit needs, e.g. the map that
    the value removal subtracts through): every backend runs it where it reads the site, the map included.

    Parameters
    ----------
    fn : callable
        ``fn(activation, hook)``, returning None.

    Returns
    -------
    callable
        ``fn``, marked, raising on every backend where it returns a change (a change would be dropped or applied).
    """

    def read(x, hook) -> None:
        if fn(x, hook) is not None:
            raise RuntimeError(f"a hook at {hook.name} marked as reading only (engine.passes.reading) changed it.")

    read.reads_only = True
    return read


def batches(tokens: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    """Consecutive slices of a batch of sequences.

    Parameters
    ----------
    tokens : torch.Tensor, shape (N, T)
    batch_size : int

    Yields
    ------
    torch.Tensor, shape (B, T)
        B = batch_size, the last one shorter where N is not a multiple.
    """
    for start in range(0, tokens.shape[0], batch_size):
        yield tokens[start : start + batch_size]


def default_batch_size(tokens: torch.Tensor) -> int:
    """A batch near 2k tokens on the CPU (attention maps are built per layer, one at a time).

    Parameters
    ----------
    tokens : torch.Tensor, shape (N, T)

    Returns
    -------
    int
        max(1, min(N, 2048 // T)).
    """
    T = tokens.shape[1]
    return max(1, min(tokens.shape[0], 2048 // max(T, 1)))


@dataclass
class Batch:
    """The batch being run.

    Attributes
    ----------
    tokens : torch.Tensor, shape (B, T)
        Its token ids, on the model's device.
    offset : int
        The index of its first sample in the pass's tokens.
    size : int
        B (a property).
    """

    tokens: torch.Tensor
    offset: int

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


class Accumulator(abc.ABC):
    """One analysis' state during a streamed pass: the abstract base class every accumulator of the package keeps.

    ``hooks()`` says which activations it needs, per layer: {layer: {key: hook name}}. For each batch and
    layer, once every activation of that layer (over all accumulators of the pass) has fired,
    ``update(layer, acts, batch)`` receives its own ``{key: tensor}`` together (a :class:`LayerActs`): the joint
    reducer. Then ``end_batch(batch, logits)`` once per batch; ``result()`` after the pass. ``needs_logits`` False
    lets the pass stop after the last layer any accumulator needs. A subclass must define ``hooks`` and ``result``,
    and ``update`` where ``hooks`` asks for any activation.
    """

    needs_logits = False
    optional_keys: frozenset = frozenset()  # keys whose hooks may be listed but never fire (passed when they do)
    call_keys: frozenset = frozenset()  # optional keys an attention call's weights give (read on the bridge only)
    reads_rows = False  # reads whole attention rows: fed first in its layer, so the others' columns come from its map

    @abc.abstractmethod
    def hooks(self) -> dict[int, dict[str, str]]:
        """{layer: {key: hook name}}: the activations this accumulator reads."""

    def reduction(self, layer: int) -> "Reduction | None":
        """How one layer's activations reduce to small tensors, as a pure function a remote trace can ship (None:
        this accumulator reduces in ``update`` and runs here only)."""
        return None

    def fold(self, layer: int, stats, batch: Batch) -> None:
        """Fold what :meth:`reduction` gave for one layer and batch into the state (here, after the trace)."""
        raise NotImplementedError(f"{type(self).__name__} has a reduction but no fold.")

    def update(self, layer: int, acts: dict[str, torch.Tensor], batch: Batch) -> None:
        """Reduce one layer's activations of one batch (needed where ``hooks`` asks for any): by default
        ``fold(reduction(acts))``, the same operations here as in a remote trace."""
        r = self.reduction(layer)
        if r is None:
            raise NotImplementedError(
                f"{type(self).__name__} asks for activations but does not reduce them (define reduction and fold, "
                "or update)."
            )
        self.fold(layer, r(acts), batch)

    def end_batch(self, batch: Batch, logits: torch.Tensor | None) -> None:
        """After each batch (``logits`` only where ``needs_logits``)."""

    @abc.abstractmethod
    def result(self):
        """The reduced result, after the pass."""


@dataclass(frozen=True)
class Reduction:
    """One layer's reduce: ``fn(acts, **params)`` -> small tensors, torch only, so that a remote trace ships it by
    value and runs it next to the model (``analysis.engine.remote``); the accumulator's ``fold`` takes the result.

    Attributes
    ----------
    fn : callable
        A module-level function of the activations ({key: tensor}, as ``hooks`` names them) and ``params``.
    params : dict
        Plain values (numbers, strings, small tensors).
    """

    fn: Callable
    params: Mapping = None

    def __call__(self, acts):
        return self.fn(acts, **(self.params or {}))


class LayerActs(dict):
    """One layer's activations as an accumulator asked for them ({key: tensor}), and what every accumulator fed
    the same layer in the pass shares: :meth:`units`, computed once per tensor. Built by the joint reducer for
    each layer and batch and dropped after it, so nothing derived outlives the layer."""

    def __init__(self, acts: Mapping[str, torch.Tensor], scratch: dict | None = None):
        super().__init__(acts)
        self.scratch = {} if scratch is None else scratch  # id(x) -> (x, derived): x held, so its id stays its own

    def units(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``unit_vectors(x.float())`` (unit vectors, norms) of queries or keys x (..., d) derived from this layer's
        activations: the QK angles and the first-key manifold of one pass compute them once."""
        hit = self.scratch.get(id(x))
        if hit is None:
            with _UNITS:  # once, where two threads feed the layer (``_feed``)
                hit = self.scratch.get(id(x))
                if hit is None:
                    hit = self.scratch[id(x)] = (x, unit_vectors(x.float()))
        return hit[1]


_UNITS = threading.Lock()


class LayerCollector:
    """Per-layer results of one batch -> (N, L, ...) after the pass (one tensor per layer and batch). Each stays on
    its layer's device until the batch ends, so no hook waits on a copy to the host."""

    def __init__(self, layers: Sequence[int]):
        self.layers = list(layers)
        self.current: dict[int, torch.Tensor] = {}
        self.chunks: list[torch.Tensor] = []

    def put(self, layer: int, x: torch.Tensor) -> None:
        self.current[layer] = x.detach()

    def end_batch(self) -> None:
        missing = [l for l in self.layers if l not in self.current]
        if missing:
            raise ModelContractError(f"no result for layers {missing}: their hooks did not fire.")
        self.chunks.append(torch.stack([self.current[l].cpu() for l in self.layers], dim=1))
        self.current.clear()

    def result(self) -> torch.Tensor:
        return torch.cat(self.chunks)


class RunningSums:
    """Running float64 sums per (name, layer position), each on the device of its first addend (the layer's own,
    also under a device map), so a hook adds without a copy to the host; ``host(name)`` stacks them (L, ...) on the
    host once, after the pass. Additions are the same float64 operations as on the host: identical sums."""

    def __init__(self, n_layers: int):
        self.n_layers = int(n_layers)
        self.sums: dict[tuple[str, int], torch.Tensor] = {}

    def add(self, name: str, i: int, x: torch.Tensor) -> None:
        t = self.sums.get((name, i))
        if t is None:
            t = self.sums[(name, i)] = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        t += x

    def host(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The sums of ``name`` as (L, *shape) float64 on the host (zeros for a layer never added to; ``shape`` is
        the addends' where none was)."""
        got = [self.sums.get((name, i)) for i in range(self.n_layers)]
        shape = next((tuple(g.shape) for g in got if g is not None), tuple(shape))
        return torch.stack([g.cpu() if g is not None else torch.zeros(shape, dtype=torch.float64) for g in got])


class SummingAccumulator(Accumulator):
    """An accumulator whose :meth:`reduction` gives statistics it sums over batches: ``sums`` (a :class:`RunningSums`
    over ``layers``), with ``n`` the samples seen.

    Parameters
    ----------
    layers : sequence of int
        The layers it reads (true indices).
    """

    def __init__(self, layers: Sequence[int]):
        self.layers = list(layers)
        self.index = {l: i for i, l in enumerate(self.layers)}
        self.sums, self.n = RunningSums(len(self.layers)), 0

    def fold(self, layer: int, stats: dict, batch: Batch) -> None:
        i = self.index[layer]
        for name, x in stats.items():
            self.sums.add(name, i, x)
        if i == 0:
            self.n += batch.size


class _Stop(Exception):
    """Raised inside a hook to end a forward pass early (nothing after the last needed layer runs)."""


def _stop(x, hook):
    raise _Stop


class Capture(Accumulator):
    """Keeps ``select(activation)`` of one hook (e.g. one layer's attention maps for a view), per batch; a map is
    built here only, from q, k and the rows' log-sum-exp, and on NDIF in the trace (what a view shows).

    Parameters
    ----------
    name : str
        A short activation name (``act_name``), e.g. "pattern".
    layer : int
        The block.
    select : callable
        Reduces the activation before it is kept (default: keep it whole); torch only where the pass is remote.
    """

    def __init__(self, name: str, layer: int, select: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.name, self.layer, self.select, self.kept = name, int(layer), select, []

    def hooks(self):
        return {self.layer: {"x": self.name}}

    def reduction(self, layer: int) -> Reduction:
        return Reduction(captured, {"select": self.select})

    def fold(self, layer: int, stats: torch.Tensor, batch: Batch) -> None:
        self.kept.append(stats.detach().float().cpu())

    def result(self) -> torch.Tensor:
        return torch.cat(self.kept)


def captured(acts: dict, *, select=None) -> torch.Tensor:
    """:class:`Capture`'s reduce: the activation (a map made dense), through ``select`` where given.

    Parameters
    ----------
    acts : dict
        {"x": the activation, or ``AttentionWeights``}.
    select : callable, optional

    Returns
    -------
    torch.Tensor
    """
    x = acts["x"]
    x = x.dense() if isinstance(x, AttentionWeights) else x
    return x if select is None else select(x)


class _JointReducer:
    """Holds the activations of one layer until all of them have fired, then feeds every accumulator, each on one CPU
    thread (``core.stats.one_thread``: the reductions work on a few MB each, where threads only wait on each other),
    two accumulators at a time on a CPU with two threads (``_feed``)."""

    def __init__(self, accumulators: Sequence[Accumulator], stop_early: bool):
        self.accs = sorted(accumulators, key=lambda a: not a.reads_rows)  # in a layer, whole rows first (one map)
        self.wants = [a.hooks() for a in self.accs]
        self.by_layer: dict[int, set[str]] = {}  # every hook of the layer
        self.required: dict[int, set[str]] = {}  # the hooks that must fire before the layer is handed over
        self.from_call: set[str] = set()  # the hooks the attention calls' weights stand in for (``call_keys``)
        for acc, w in zip(self.accs, self.wants):
            for layer, names in w.items():
                self.by_layer.setdefault(int(layer), set()).update(names.values())
                self.required.setdefault(int(layer), set()).update(
                    n for k, n in names.items() if k not in acc.optional_keys
                )
                self.from_call.update(n for k, n in names.items() if k in acc.call_keys)
        self.last = max(self.by_layer) if self.by_layer else None
        self.stop_early = stop_early
        self.slot: dict[int, dict[str, torch.Tensor]] = {}
        self.done: set[int] = set()
        self.batch: Batch | None = None
        self.side = True  # a second CPU thread feeds accumulators too (``_feed``); off where nnsight runs the hooks

    def fwd_hooks(self) -> list[tuple[str, HookFn]]:
        return [(name, self._hook(layer, name)) for layer, names in self.by_layer.items() for name in sorted(names)]

    def _hook(self, layer: int, name: str) -> HookFn:
        return lambda x, hook: self.fired(layer, name, x)

    def fired(self, layer: int, name: str, x: torch.Tensor) -> None:
        if layer in self.done:
            return
        slot = self.slot.setdefault(layer, {})
        slot[name] = x
        if not self.required[layer] <= slot.keys():
            return
        del self.slot[layer]
        self.done.add(layer)
        scratch: dict = {}  # shared by the layer's accumulators (LayerActs.units), dropped with the layer
        todo = [
            (acc, LayerActs({k: slot[n] for k, n in want[layer].items() if n in slot}, scratch))
            for acc, want in zip(self.accs, self.wants)
            if layer in want
        ]
        side = self.side and x.device.type == "cpu" and torch.get_num_threads() > 1 and not _modes()
        with one_thread():
            rows = any(acc.reads_rows for acc, _ in todo)
            for a in slot.values():
                if isinstance(a, AttentionWeights):
                    a.share(rows)  # the map as every read's source, or never kept: the same bits on one thread or two
            _feed(todo, layer, self.batch, side)
        if self.stop_early and layer == self.last:
            raise _Stop

    def start(self, batch: Batch) -> None:
        self.batch, self.slot, self.done = batch, {}, set()

    def check_fired(self) -> None:
        silent = sorted(set(self.by_layer) - self.done)
        if silent:
            never = sorted({n for l in silent for n in self.required[l] - set(self.slot.get(l, {}))})
            raise ModelContractError(
                f"hooks {never[:4]}{'...' if len(never) > 4 else ''} did not fire: the model lists hooks it does not "
                "run. Load it with `analysis.load_model` (or, for keys/queries, try rotated=False)."
            )


def _feed(todo: list, layer: int, batch: Batch, side: bool) -> None:
    """Each accumulator's update of one layer, one thread each. With ``side``, a second thread takes them from the
    list's far end while this one takes them from the front (the row readers, which build the layer's map, are
    first): on the CPU, while the forward waits, two cores reduce where one did. The threads share only the layer's
    activations and their caches, which are safe to read and fill from both; the second thread runs in this one's
    context, grad and inference modes. Under a torch function or dispatch mode the layer is fed on this thread only
    (``_modes``)."""
    work = deque(todo)

    def take(pop) -> None:
        while True:
            try:
                acc, acts = pop()
            except IndexError:  # the list is empty (an update's own IndexError propagates)
                return
            acc.update(layer, acts, batch)

    if not side or len(todo) < 2:
        return take(work.popleft)
    modes, ctx = (torch.is_grad_enabled(), torch.is_inference_mode_enabled()), contextvars.copy_context()

    def far() -> None:
        with torch.set_grad_enabled(modes[0]), torch.inference_mode(modes[1]), one_thread():
            take(work.pop)

    pid = os.getpid()
    if _SIDE.get(pid) is None:  # one worker per process (a forked child starts its own), in an arena there
        _SIDE.clear()
        share_arenas()
        _SIDE[pid] = ThreadPoolExecutor(1, thread_name_prefix="analysis-feed")
    job = _SIDE[pid].submit(ctx.run, far)
    try:
        take(work.popleft)
    except BaseException:
        work.clear()  # the second thread stops after its current update
        wait([job])
        raise
    job.result()


_SIDE: dict[int, ThreadPoolExecutor] = {}


def _modes() -> bool:
    """Whether a torch function or dispatch mode is active (``with torch.device(...)``, a tracer, a test's device
    guard). Modes hold for their own thread only: a second thread would compute outside them, so ``_feed`` keeps one."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return bool(torch.overrides._get_current_function_mode_stack() or _get_current_dispatch_mode_stack())


class ResidCapture(Accumulator):
    """The residual stream entering each block in ``layers`` (``hook_resid_pre``), in the model's dtype: what a pass
    resumed at that layer starts from (:class:`Resume`).

    Parameters
    ----------
    layers : iterable of int
        The blocks whose input to keep.

    Notes
    -----
    ``result()`` is {layer: torch.Tensor of shape (N, T, D)}.
    """

    def __init__(self, layers: Iterable[int]):
        self.layers = sorted({int(l) for l in layers})
        self.kept: dict[int, list[torch.Tensor]] = {l: [] for l in self.layers}

    def hooks(self):
        return {l: {"resid": act_name("resid_pre", l)} for l in self.layers}

    def update(self, layer: int, acts: dict, batch: Batch) -> None:
        self.kept[layer].append(acts["resid"].detach().clone().cpu())

    def result(self) -> dict[int, torch.Tensor]:
        return {l: torch.cat(chunks) for l, chunks in self.kept.items()}


@dataclass
class Resume:
    """Start a streamed pass at a block from the residual stream entering it, instead of at the embedding.

    Blocks 0..layer-1 are skipped, not run. Exact when nothing before ``layer`` is changed; no hook before ``layer``
    may be attached (``run_pass`` raises ValueError), but for intervention hooks on the stream the pass starts from
    (``hook_resid_post`` of block ``layer - 1``), which ``run_pass`` applies to ``resid`` itself. Only models where
    :func:`can_resume`.

    Attributes
    ----------
    layer : int
        The block the pass starts at.
    resid : torch.Tensor, shape (N, T, D)
        The residual stream entering it (``hook_resid_pre``, e.g. from :class:`ResidCapture` over the same tokens and
        batches).
    repeat : int
        The pass's sequences are these N repeated this many times, one copy after another (conditions stacked in one
        pass, ``causal.conditions.run_condition``'s ``groups``): each batch takes its rows, never a tiled copy.
    """

    layer: int
    resid: torch.Tensor
    repeat: int = 1

    def rows(self, offset: int, size: int) -> torch.Tensor:
        """The residual of the pass's sequences ``offset`` to ``offset + size - 1``, (size, T, D)."""
        if self.repeat == 1:
            return self.resid[offset : offset + size]
        index = torch.arange(offset, offset + size) % self.resid.shape[0]
        return self.resid.index_select(0, index.to(self.resid.device))


def checkpoint_layers(n_layers: int, block_bytes: int, budget_mib: float) -> list[int]:
    """The blocks whose input a pass keeps so that later passes over the same tokens can resume (:class:`ResidCapture`).

    Parameters
    ----------
    n_layers : int
        L, the number of blocks.
    block_bytes : int
        The size of one block's residual stream (N x T x D x bytes per number).
    budget_mib : float
        The memory allowed for all of them.

    Returns
    -------
    list of int
        Every block 1..L-1 when they fit, else every s-th block (s, 2s, ...) with the smallest s that fits; none when
        not even one fits.
    """
    if n_layers < 2 or block_bytes <= 0:
        return []
    fit = int(budget_mib * 2**20 // block_bytes)
    if fit < 1:
        return []
    step = -(-(n_layers - 1) // fit)  # ceil: (n_layers - 1) // step blocks kept
    return list(range(step, n_layers, step))


def resume_from(resid: dict[int, torch.Tensor] | None, layer: int) -> Resume | None:
    """A :class:`Resume` at the last kept block at or before ``layer``.

    Parameters
    ----------
    resid : dict of int to torch.Tensor, or None
        {block: the residual entering it, shape (N, T, D)}, e.g. ``Profile.resid``.
    layer : int
        The first block a pass changes.

    Returns
    -------
    Resume or None
        None when no kept block lies in 1..layer (run from the embedding).
    """
    kept = [b for b in (resid or {}) if 0 < b <= layer]
    return Resume(max(kept), resid[max(kept)]) if kept else None


def can_resume(model: SinkModel) -> bool:
    """Whether a pass of ``model`` can start at a block from the residual entering it.

    Parameters
    ----------
    model
        A loaded model.

    Returns
    -------
    bool
        True for a TransformerBridge whose blocks each read only the residual stream (``families.RESUMABLE``, checked
        by tests/causal/test_interventions.py). False on a model split by a device map: its checkpoints would gather whole
        residual streams of every layer onto one device (tests/model/test_device_map.py watches for it); the passes run
        from the embedding instead.
    """
    return can_skip_blocks(model) and get_family(model).family in RESUMABLE


def _check_resume(model, tokens, resume: Resume, names: Iterable[str]) -> None:
    if not can_resume(model):
        raise ModelContractError(f"{type(model).__name__} cannot resume a pass at a block (``can_resume``).")
    if (resume.resid.shape[0] * resume.repeat, resume.resid.shape[1]) != tuple(tokens.shape):
        raise ValueError(
            f"the residual to resume from has shape {tuple(resume.resid.shape)}"
            f"{f' (x {resume.repeat})' if resume.repeat > 1 else ''}; the tokens {tuple(tokens.shape)}."
        )
    early = sorted({n for n in names if hook_layer(n) is not None and hook_layer(n) < resume.layer})
    if early:
        raise ValueError(
            f"hooks {early[:4]} lie before layer {resume.layer}, where the pass resumes: they would not see "
            "the model's activations."
        )


def _check_hooks(model, names: Iterable[str]) -> None:
    missing = sorted(set(names) - hook_names(model))
    if missing:
        raise ModelContractError(
            f"the model has no hook(s) {missing[:4]}{'...' if len(missing) > 4 else ''}; "
            "this analysis needs TransformerLens hook names (load with `analysis.load_model`)."
        )


def _batches(model, tokens, batch_size, progress) -> Iterator[Batch]:
    device = model_device(model)
    bs = batch_size or default_batch_size(tokens)
    it = range(0, tokens.shape[0], bs)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, total=(tokens.shape[0] + bs - 1) // bs, desc="batches", leave=False)
    for start in it:
        yield Batch(tokens[start : start + bs].to(device), start)


_PASS_LOG: contextvars.ContextVar = contextvars.ContextVar("analysis_pass_log", default=None)


@contextmanager
def pass_log() -> Iterator[Counter]:
    """Count the passes run within the block by ``"backend: why"`` (what a report records of each section).

    Yields
    ------
    collections.Counter
    """
    log: Counter = Counter()
    token = _PASS_LOG.set(log)
    try:
        yield log
    finally:
        _PASS_LOG.reset(token)


@parameters_from(model_tokens)
def run_pass(
    model: SinkModel,
    tokens: torch.Tensor,
    accumulators: Sequence[Accumulator],
    *,
    fwd_hooks: Sequence[tuple[str, HookFn]] = (),
    batch_size: int | None = None,
    progress: bool = False,
    on_batch_start: Callable[[Batch], None] | None = None,
    resume: Resume | None = None,
    backend: str | None = None,
    record: dict | None = None,
) -> list:
    """One streamed pass of ``model`` over ``tokens`` feeding every accumulator.

    The pass stops after the last layer any accumulator needs unless one ``needs_logits`` or hooks change it.

    Parameters
    ----------
    model, tokens
        As in :func:`model_tokens`.
    accumulators : sequence of Accumulator
        The analyses fed, each with one layer's activations together (a :class:`LayerActs`).
    fwd_hooks : sequence of (str, callable)
        Plain hooks that may return a changed activation (interventions); they run before the accumulators' hooks,
        which see the changed activations.
    batch_size : int, optional
        Sequences per batch (default :func:`default_batch_size`).
    progress : bool
        Show a progress bar over batches.
    on_batch_start : callable, optional
        ``on_batch_start(batch)`` runs before each :class:`Batch`.
    resume : Resume, optional
        Start each batch at block ``resume.layer`` from its rows of ``resume.resid``.
    backend : {"transformer_lens", "transformers", "auto"}, optional
        What produces the activations (``analysis.engine.backends``): the bridge's hook points, or the Hugging Face
        model in its own attention (``hook_pattern`` then comes as ``AttentionWeights``, no T x T map); "auto" the
        latter where it gives every hook and edit asked for. None: the model's own (``load_model(backend=...)``).
    record : dict, optional
        Filled with ``{"backend": name, "why": sentence}``.

    Returns
    -------
    list
        Each accumulator's ``result()``, in order.
    """
    tokens = check_tokens(model, tokens)
    if isinstance(model, NnsightModel):  # nnsight's LanguageModel (on NDIF): the accumulators' reductions in traces
        return _run_remote(model, tokens, accumulators, fwd_hooks, batch_size, resume, backend, record)
    stop_early = not fwd_hooks and not any(a.needs_logits for a in accumulators)
    joint = _JointReducer(accumulators, stop_early)
    chosen, why = choose_backend(
        model,
        backend=backend,
        names=[*(n for names in joint.by_layer.values() for n in names - joint.from_call), *(n for n, _ in fwd_hooks)],
        edits=[n for n, fn in fwd_hooks if not getattr(fn, "reads_only", False)],  # not marked by ``reading``
    )
    if chosen != "transformer_lens":  # what the attention calls' weights give is not read
        joint.by_layer = {l: names - joint.from_call for l, names in joint.by_layer.items()}
    if record is not None:
        record.update(backend=chosen, why=why)
    if _PASS_LOG.get() is not None:
        _PASS_LOG.get()[f"{chosen}: {why}"] += 1
    if chosen in ("transformers", "nnsight"):
        nnsight = chosen == "nnsight"
        kernels = _run_taps(
            model, tokens, accumulators, joint, fwd_hooks, batch_size, progress, on_batch_start, resume, nnsight
        )
        if record is not None and not nnsight:
            record["kernels"] = kernels
        return [acc.result() for acc in accumulators]
    entry = _entry_hooks(fwd_hooks, resume)
    hooks = [h for h in fwd_hooks if h not in entry] + joint.fwd_hooks()
    _check_hooks(model, [n for n, _ in hooks + entry])
    if resume is not None:
        _check_resume(model, tokens, resume, [n for n, _ in hooks])

    def forward(batch: Batch):
        if resume is None:
            return model.run_with_hooks(batch.tokens, fwd_hooks=hooks)
        resid = _resumed_rows(batch, resume, entry, lambda name: model.hook_dict[name])
        return model.run_with_hooks(resid, fwd_hooks=hooks, start_at_layer=resume.layer)

    with torch.inference_mode(), skipped_blocks(model, resume.layer) if resume is not None else nullcontext():
        _each_batch(model, tokens, batch_size, progress, on_batch_start, joint, accumulators, forward)
    return [acc.result() for acc in accumulators]


def _run_remote(model, tokens, accumulators, fwd_hooks, batch_size, resume, backend, record) -> list:
    """The pass of a model in nnsight's ``LanguageModel`` (``load_model(..., backend="nnsight", remote=True)``):
    reads only, from the embedding (``analysis.engine.remote``)."""
    if backend not in (None, "auto", "nnsight"):
        raise BackendUnsupported(f"a model loaded with remote=True runs through nnsight only; got backend={backend!r}.")
    if fwd_hooks or resume is not None or any(a.needs_logits for a in accumulators):
        raise BackendUnsupported(
            "a remote nnsight pass reads activations only: edits (interventions), resumed passes and logits run "
            "on a model loaded here (drop remote=True)."
        )
    why = "nnsight: on NDIF" if model.remote else "nnsight: the remote trace, run here"
    sent = remote_pass(model, tokens, accumulators, make_batch=Batch, batch_size=batch_size)
    if record is not None:
        record.update(backend="nnsight", why=why, **sent)
    if _PASS_LOG.get() is not None:
        _PASS_LOG.get()[why] += 1
    return [acc.result() for acc in accumulators]


def _run_taps(
    model, tokens, accumulators, joint: _JointReducer, fwd_hooks, batch_size, progress, on_batch_start, resume, nnsight
):
    """The pass on the transformers backend, or on nnsight (``nnsight``): the Hugging Face model with ``Taps``
    (``NnsightTaps``: one nnsight trace per batch, its hooks on one thread) feeding the joint reducer. A resumed pass
    sets its first block's input to its residual, after the entry hooks (an edit there); the transformers backend
    skips the blocks before it as the bridge does (``skipped_blocks``: the unbridged model holds the stand-ins),
    nnsight runs them. Returns the kernels the layers took."""
    entry, rows = _entry_hooks(fwd_hooks, resume), [None]  # rows: the running batch's residual where the pass resumes
    edits = [h for h in fwd_hooks if h not in entry]
    if resume is not None:
        _check_resume(model, tokens, resume, [n for n, _ in edits + joint.fwd_hooks()])
        edits.insert(0, (act_name("resid_pre", resume.layer), lambda x, hook: rows[0]))
    taps = (NnsightTaps if nnsight else Taps)(model, joint.by_layer, edits, joint.fired)
    needs_logits = any(a.needs_logits for a in accumulators)

    def forward(batch: Batch):
        if resume is not None:
            rows[0] = _resumed_rows(batch, resume, entry, _Named)
        taps.tokens = tuple(batch.tokens.shape)
        if nnsight:
            return taps.run(batch.tokens, needs_logits=needs_logits)
        return run_hf_batch(model, batch.tokens, needs_logits=needs_logits)

    joint.side = not nnsight  # nnsight runs the hooks inside its interleaver
    skip = skipped_blocks(model, resume.layer) if resume is not None and not nnsight else nullcontext()
    with torch.inference_mode(), skip, nullcontext() if nnsight else taps.attached():
        _each_batch(model, tokens, batch_size, progress, on_batch_start, joint, accumulators, forward)
    return dict(taps.kernels)


def _entry_hooks(fwd_hooks, resume: Resume | None) -> list[tuple[str, HookFn]]:
    """The intervention hooks on the stream a resumed pass starts from (``hook_resid_post`` of the block before)."""
    if resume is None or resume.layer < 1:
        return []
    name = act_name("resid_post", resume.layer - 1)
    return [(n, fn) for n, fn in fwd_hooks if n == name]


def _resumed_rows(batch: Batch, resume: Resume, entry, hook_of) -> torch.Tensor:
    """The residual a resumed batch starts from: its rows of ``resume.resid`` with the ``entry`` hooks applied
    (``hook_of(name)``: the hook point each is called with)."""
    rows = resume.rows(batch.offset, batch.size).to(batch.tokens.device)
    for name, fn in entry:
        out = fn(rows, hook_of(name))
        rows = rows if out is None else out
    return rows


def _each_batch(model, tokens, batch_size, progress, on_batch_start, joint: _JointReducer, accumulators, forward):
    """Every batch of a pass: the joint reducer started, ``on_batch_start``, ``forward(batch)`` (the logits; None
    where the pass stopped after its last needed layer), then each accumulator's end."""
    for batch in _batches(model, tokens, batch_size, progress):
        joint.start(batch)
        if on_batch_start is not None:
            on_batch_start(batch)
        logits = None
        try:
            logits = forward(batch)
        except _Stop:
            pass
        joint.check_fired()
        for acc in accumulators:
            acc.end_batch(batch, logits)


@parameters_from(run_pass)
def run_with_reducers(
    model: SinkModel,
    tokens: torch.Tensor,
    reducers: Sequence[tuple[str, HookFn]],
    *,
    batch_size: int | None = None,
    progress: bool = False,
    on_batch: Callable[[torch.Tensor, torch.Tensor | None], None] | None = None,
    stop_after: str | None = None,
) -> None:
    """Run ``model`` over ``tokens`` in batches with plain reducers attached as forward hooks.

    Analyses use :func:`run_pass` with accumulators; this is the plain form for one-off hooks.

    Parameters
    ----------
    model, tokens, progress
        As in :func:`run_pass`.
    reducers : sequence of (str, callable)
        (hook name, ``fn(activation, hook)``): each folds the activation into its own state and returns None (or a
        replacement activation).
    batch_size : int, optional
        Sequences per batch.
    on_batch : callable, optional
        ``on_batch(tokens, logits)`` sees each batch's tokens (B, T) and logits (B, T, d_vocab).
    stop_after : str, optional
        A hook after which each pass ends early (``on_batch`` then gets ``logits=None``).

    Returns
    -------
    None
    """
    hooks = list(reducers) + ([(stop_after, _stop)] if stop_after else [])
    run_pass(model, tokens, [_OnBatch(on_batch)], fwd_hooks=hooks, batch_size=batch_size, progress=progress)


class _OnBatch(Accumulator):
    """Calls ``fn(tokens, logits)`` after each batch (``run_with_reducers``' ``on_batch``)."""

    needs_logits = True

    def __init__(self, fn):
        self.fn = fn

    def hooks(self):
        return {}

    def end_batch(self, batch: Batch, logits) -> None:
        if self.fn is not None:
            self.fn(batch.tokens, logits)

    def result(self) -> None:
        return None


# The registration (analysis.core.registry): this module's one declaration.
from analysis.core.registry import Analysis, register  # noqa: E402


def _resid_capture(inputs) -> list:
    """The main pass's resume points (``checkpoint_layers``); none where the model cannot resume a pass."""
    model, tokens = inputs.model, inputs.tokens
    facts = model_facts(model)
    if not can_resume(model):
        return []
    block_bytes = tokens.numel() * facts.dims.d_model * next(model.parameters()).element_size()
    layers = checkpoint_layers(facts.dims.n_layers, block_bytes, inputs.budget_mib)
    return [ResidCapture(layers)] if layers else []


register(
    Analysis(
        "resid",
        result=dict,
        order=80,
        hooks=("resid",),
        product=True,
        empty=dict,
        doc="Block -> the residual stream entering it on the main kind, shape (N, T, D): the resume points.",
        accumulators=_resid_capture,
    )
)
