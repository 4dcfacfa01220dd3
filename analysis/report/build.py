"""One self-contained HTML report and a JSON with every number behind it, for any model with TransformerLens hooks.

``build_report(model, out_dir)`` runs ``analysis.profile`` on natural, random and repeated probes (one streamed
pass per kind feeds every analysis) and lays out what it found:

1. the sink metric (Sink_1 table, per-head alpha), with offline circuitsvis attention views;
2. massive activations (the spike dims per layer, ``spike_dims`` in the JSON);
   where the spike comes from: the writing and erasing blocks, the writer neurons with their shares, why the first
   token, and the cut of the writer neurons against random ones (``analysis.chain.spike_writers``);
3. the norm-gain trace of one sink layer that reads the spike;
4. the first key's manifold (PCA of the keys, QK angles);
5. value norms against alpha_1;
6. interventions (spike, value and first-key ablations, sharing the profile's baseline pass);
7. what a sink does for its head (``analysis.causal.dormant_heads``: sink attention against the head's output norm and loss
   effect per query; one forward + backward pass of its own);
8. every sink: the positions besides the first token that sink, their heads, massive activations and alignment with
   the first token (``analysis.positions.every_sink``, a pass of its own: alpha of every key);
9. the sink against context length and eps (``analysis.positions.context_length``: T = 16..128 here, N = 4 per probe seed, 3
   seeds; the committed long-T points of the model where ``analysis/data/sink_context/`` has them);

Each section is a registered analysis' (``analysis.core.registry``: its title, its link of the chain, what it reads
from the profile pass, the figures ``analysis.report.sections.generic`` draws or the runner there of a section that
does more), in the registered order; the HTML kit is
``analysis.report.html``. It writes ``report.html`` (figures as inline PNG, circuitsvis views with their JavaScript inline, no CDN, no
network) and ``report.json`` into ``out_dir``, each atomically; other files in ``out_dir`` are left alone. The
findings are the results' own ``findings()``, whole sentences as each result builds them (never split here),
grouped by link of the chain (``LINKS``: the spike, the norm, the key, the attention, the value, the causal cuts, then
what a sink does for its head, every sink and the context length): the page's Findings section gives each link one
headline sentence with its details folded under it, and report.json keeps them grouped the same way. A section
whose analysis does not apply to the model (no norm gain to trace, ...) says so in a note; a section or a figure
that fails is shown with its error, the page keeps every section that worked, and ``build_report`` then raises
``ReportError`` naming the failed sections.
"""

from __future__ import annotations

import functools
import html
import sys
import time
from pathlib import Path

import numpy as np
import torch

from analysis.core import registry
from analysis.core.defaults import SINK_EPS
from analysis.model.contract import SinkModel
from analysis.model.families import get_family
from analysis.model.hooks import check_length, model_dims
from analysis.model.placement import placement_record
from analysis.core.io import check_output, write_atomic, write_json, write_or_spare
from analysis.core.memory import frozen_heap
from analysis.engine.passes import pass_log
from analysis.sinks.metric import check_eps
from analysis.report.one_pass import chosen_analyses, profile
from analysis.report.sections import generic
from analysis.report.html import Section, chain_findings, page, render_figures
from analysis.report.html import LINKS, Finding, figure_html, table_html  # noqa: F401 (their home; named here too)
from analysis.chain.massive import criterion_text, width_criterion
from analysis.model.nnsight_model import NnsightModel
from analysis.model.probes import model_probe_sets
from analysis.core.options import REPORT_MIN_T, REPORT_N, REPORT_T_WHY, SINK_N
from analysis.core.versions import package_versions

# The report's N and T limits, and the sink command's N (the report says why its own Sink_1 differs), are owned by
# the command line's light options module, which the parser reads before torch loads.
DEFAULT_N, SINK_COMMAND_N = REPORT_N, SINK_N
# a remote model's (docs/remote.md); the others, and why each is refused there (docs/architecture.md)
NNSIGHT_SECTIONS = (
    "sink",
    "views",
    "massive",
    "norm_gain",
    "key_manifold",
    "value_norms",
    "sink_kind",
    "dormant",
    "positions",
    "context",
    "interventions",
    "spike_writers",
)
NOT_REMOTE: dict[str, str] = {}  # none: every section's passes ship their reductions


def registered_sections() -> dict[str, tuple]:
    """The report's sections, in page order: key -> (analysis, section), from the registry.

    Returns
    -------
    dict of str to tuple of (analysis.core.registry.Analysis, analysis.core.registry.Section)
    """
    return {registry.section_key(a, s): (a, s) for a, s in registry.sections()}


def __getattr__(name: str):
    """``SECTIONS``: the registered sections' keys in page order, read when asked for (a test may register one)."""
    if name == "SECTIONS":
        return tuple(registered_sections())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ReportError(RuntimeError):
    """Some sections or figures failed; the report was written with the sections that worked."""


class _Context:
    """What the sections share: the model, the probes, and the one profile pass."""

    def __init__(
        self,
        model: SinkModel,
        n: int,
        T: int,
        seed: int,
        batch_size: int | None,
        keys: list[str],
        *,
        eps: float = SINK_EPS,
        bos: bool = False,
    ):
        self.model, self.n, self.T, self.seed, self.batch_size = model, n, T, seed, batch_size
        self.eps, self.bos = eps, bos
        self.dims = model_dims(model)
        # one massive-activation criterion for every section (the profile's own: spike_criterion)
        self.criterion = dict(zip(("abs_threshold", "ratio_threshold"), width_criterion(self.dims.d_model)))
        self.name = getattr(model, "model_name", None) or type(model).__name__
        self.probes = model_probe_sets(model, n=n, T=T, bos=bos, seed=seed)  # text, or a reference model's own task
        self.natural = self.probes["natural"].tokens
        sections = registered_sections()
        self.analyses = tuple(dict.fromkeys(a for k in keys for a in registry.section_needs(*sections[k])))
        self.keys = keys
        self._profile = None
        self.profile_seconds = 0.0  # the profile passes' time, counted apart from the section that first asked
        self.passes: dict[str, dict[str, int]] = {}  # section -> its passes by "backend: why" (report.json config)

    @property
    def profile(self):
        if self._profile is None:
            t = time.perf_counter()
            self._profile = profile(
                self.model, self.probes, analyses=self.analyses, eps=self.eps, batch_size=self.batch_size
            )
            self.profile_seconds = time.perf_counter() - t
        return self._profile

    @property
    def massive(self):
        return self.profile.massive.get("natural") if "massive" in self.analyses else None


def head_dims(model: SinkModel, dims) -> dict:
    """Each head's widths named for what they are: the query/key width and the value width, and under multi-head
    latent attention the key's decompressed and rotary parts (MLA's ``head_dim`` is its rotary part only).

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    dims : analysis.model.hooks.ModelDims

    Returns
    -------
    dict
        ``d_head_qk``, ``d_head_v`` (and under MLA ``d_head_qk_nope``, ``d_head_qk_rope``), ``text``.
    """
    mla = getattr(model.spec if isinstance(model, NnsightModel) else get_family(model), "latent", None)
    if mla is None:
        return {
            "d_head": dims.d_head,
            "d_head_qk": dims.d_head,
            "d_head_v": dims.d_head,
            "text": f"d_head {dims.d_head}",
        }
    qk, nope, rope, v = mla["d_head"], mla["qk_nope_head_dim"], mla["qk_rope_head_dim"], mla["v_head_dim"]
    return {
        "d_head_qk": qk,
        "d_head_qk_nope": nope,
        "d_head_qk_rope": rope,
        "d_head_v": v,
        "text": f"query/key head dim {qk} ({nope} decompressed from the latent + {rope} rotary), value head dim {v} "
        f"(multi-head latent attention)",
    }


def samples_text(ctx: _Context, sections: list[Section]) -> dict:
    """Which sequences each Sink_1 of the report is measured on, and why it differs from ``python -m analysis sink``'s
    (the paper's probe, N = 100): the first lines of the page.

    Parameters
    ----------
    ctx : _Context
    sections : list of Section

    Returns
    -------
    dict
        ``n``, ``sink_1_pct`` (this report's natural probe), ``sink_command_n``, ``cuts_n`` and ``cuts_sink_1_pct``
        (None without cuts), ``text``.
    """
    data = {s.key: s.data for s in sections}
    sink = data.get("sink", {}).get("sink_1_pct", {}).get("natural")
    cuts = data.get("spike_writers", {}).get("cuts") or {}
    base = [r for r in cuts.get("conditions", []) if r.get("role") == "baseline"]
    k = cuts.get("n_samples") if base else None
    here = (
        f"Sink_1 on natural text is {sink:.1f}% over this report's N = {ctx.n} sequences of T = {ctx.T}"
        if sink is not None
        else f"This report's probes are N = {ctx.n} sequences of T = {ctx.T}"
    )
    text = (
        f"{here}; `python -m analysis sink` measures the same metric over N = {SINK_COMMAND_N} (the paper's "
        f"probe), so it prints another number, from more sequences (pass --n {SINK_COMMAND_N} here to get that "
        f"one)."
    )
    if base and k < ctx.n:
        text += (
            f" The causal cuts of the spike's writer neurons run on the first {k} of these sequences (one pass "
            f"per condition), whose own Sink_1 is {base[0]['sink_1_pct']:.1f}%: the baseline of their headline."
        )
    return {
        "n": ctx.n,
        "sink_1_pct": sink,
        "sink_command_n": SINK_COMMAND_N,
        "cuts_n": k,
        "cuts_sink_1_pct": base[0]["sink_1_pct"] if base else None,
        "text": text,
    }


def _intro(ctx: _Context, meta: dict) -> str:
    """The page's first paragraph: the model's dims, the probes, the time taken."""
    esc, d = html.escape, ctx.dims
    return f"""<p class="small">{d.n_layers} layers, {d.n_heads} query heads, {d.n_kv_heads} key/value heads, d_model {d.d_model},
{esc(head_dims(ctx.model, d)["text"])}. Probes: N = {ctx.n} sequences of T = {ctx.T} tokens (natural text: standard-library docstrings;
uniformly random tokens; one token repeated), no BOS, seed {ctx.seed}. Built in {meta["seconds"]:.0f} s
(the one profile pass per probe kind that the sections read: {ctx.profile_seconds:.0f} s; drawing and encoding the figures:
{meta["figures"]:.0f} s; each section's own time under it).
Every number behind the figures is in report.json beside this page.</p>"""


def _page(ctx: _Context, sections: list[Section], meta: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    return page(ctx.name, _intro(ctx, meta), samples_text(ctx, sections)["text"], sections, versions)


def build_report(
    model: SinkModel,
    out_dir,
    *,
    n: int = DEFAULT_N,
    T: int = 64,
    seed: int = 0,
    eps: float = SINK_EPS,
    bos: bool = False,
    progress: bool = False,
    sections=None,
    batch_size: int | None = None,
) -> Path:
    """Run the analyses on ``model`` and write ``out_dir/report.html`` and ``out_dir/report.json``.

    One ``analysis.profile`` pass per probe kind feeds every section. A section that does not apply to the model says
    so in a note. A section or figure that fails is shown with its error; nothing is written until every section has
    run, then each file atomically (other files in ``out_dir`` are kept), and then ``ReportError`` names the failed
    sections.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names (``analysis.load_model``).
    out_dir : path-like
        The folder written.
    n : int
        N, the sequences per probe kind.
    T : int
        Tokens per sequence.
    seed : int
        The probes' seed.
    eps : float
        The sink threshold (alpha_k > eps) of the sink metric.
    bos : bool
        Put the tokenizer's BOS token first in the probes (the paper: none).
    progress : bool
        Show progress bars.
    sections : sequence of str, optional
        A subset of ``SECTIONS`` (default: all).
    batch_size : int, optional
        Sequences per batch.

    Returns
    -------
    pathlib.Path
        The HTML page's path.
    """
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")
    dims = model_dims(model)  # a model without hooks fails here, before anything is written
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError(
            f"n (--n) must be at least 2 sequences: the report compares inputs (first keys, leave-one-out "
            f"means); got {n!r}."
        )
    check_length(T, minimum=REPORT_MIN_T, why=REPORT_T_WHY)
    check_eps(eps)
    if dims.n_ctx is not None and T > dims.n_ctx:
        raise ValueError(f"T={T} exceeds the model's context of {dims.n_ctx} tokens; use T <= {dims.n_ctx}.")
    if getattr(model, "tokenizer", None) is None and not getattr(model, "reference_config", None):
        raise ValueError(
            "the report builds text probes and needs model.tokenizer; this model has none (reference "
            "models of the synthetic task are probed with their own task instead)."
        )
    known = tuple(registered_sections())
    keys = list(known) if sections is None else list(sections)
    bad = [k for k in keys if k not in known]
    if bad:
        raise ValueError(f"unknown report sections {bad}; choose among {list(known)}.")
    out = check_output(out_dir, flag="out_dir (--out)", folder=True)  # before any work

    t0 = time.perf_counter()
    refused = {k: _remote_refusal(model, k) for k in keys} if isinstance(model, NnsightModel) else {}
    run = [k for k in keys if refused.get(k) is None]
    with frozen_heap():  # the model's objects not scanned by every full garbage collection of the run
        ctx = _Context(model, int(n), int(T), int(seed), batch_size, run, eps=float(eps), bos=bool(bos))
        done = [
            _run_section(ctx, key, progress) if key in run else _not_through_nnsight(key, refused[key]) for key in keys
        ]
        t = time.perf_counter()
        n_figures = render_figures(done)  # every section's figures made together (on the CPUs the passes freed)
        figures = time.perf_counter() - t
    if progress:
        print(f"[report] {n_figures} figures drawn and encoded: {figures:.1f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    meta = {"versions": package_versions(), "seconds": seconds, "figures": figures}
    payload, page = _payload(ctx, done, meta, dims), _page(ctx, done, meta)

    def write(folder: Path) -> None:  # each file atomically: a failed write leaves what was there
        write_json(folder / "report.json", payload)
        write_atomic(folder / "report.html", page)

    write_or_spare(out, write, flag="--out")
    failed = [s for s in done if s.errors]
    if failed:
        raise ReportError(
            f"{len(failed)} report section(s) failed: "
            + "; ".join(f"{s.key} ({'; '.join(s.errors)})" for s in failed)
            + f". The sections that worked are in {out / 'report.html'}."
        )
    return out / "report.html"


def remote_requests(
    model: NnsightModel, *, n: int = DEFAULT_N, T: int = 64, eps: float = SINK_EPS, sections=NNSIGHT_SECTIONS
):
    """The NDIF requests of a remote model's profile pass for ``sections``, per input kind, planned without running
    it: the sections' accumulators, as the profile builds them, and their reductions on activations of the model's
    shapes (a meta-device model does: only its config is read). The every-sink and context sections run passes of
    their own after it, planned the same way when they run.

    Parameters
    ----------
    model : analysis.model.nnsight_model.NnsightModel
    n, T : int
        Sequences per input kind and their length.
    eps : float
    sections : sequence of str

    Returns
    -------
    dict of str to analysis.engine.remote.RequestPlan
        One plan per input kind (natural, random, repeated).
    """
    if not isinstance(model, NnsightModel):
        raise TypeError(
            f"remote_requests plans a remote model's requests: give load_model(name, backend='nnsight', remote=True) "
            f"(or load_nnsight(name)); got {type(model).__name__}."
        )
    from analysis.core.registry import PassInputs  # import time: the report's own imports stay light
    from analysis.engine.remote import pass_plan, plan_requests, reduction_bytes

    table = registered_sections()
    needs = tuple(dict.fromkeys(a for k in sections for a in registry.section_needs(*table[k])))
    chosen = chosen_analyses(needs)
    tokens = torch.zeros(int(n), int(T), dtype=torch.long)
    spike = width_criterion(model_dims(model).d_model)
    plans = {}
    for kind in ("natural", "random", "repeated"):
        inputs = PassInputs(model, tokens, kind, kind == "natural", eps=eps, spike=spike)
        accs = [
            acc
            for a in chosen
            if a.accumulators is not None and (a.every_kind or inputs.main)
            for acc in a.accumulators(inputs)
        ]
        plan = pass_plan(model, accs)
        per, fixed = reduction_bytes(model, tokens, plan)
        plans[kind] = plan_requests(int(n), [p[0] for p in plan], per=per, fixed=fixed)
    return plans


def _remote_refusal(model: NnsightModel, key: str) -> str | None:
    """Why report section ``key`` is refused before any work on ``model`` (loaded through nnsight), or None."""
    if key not in NNSIGHT_SECTIONS:
        why = NOT_REMOTE.get(key, "this section has none")
        return f"on NDIF a pass runs the accumulators' shipped reductions only, and {why}"
    return None


def _not_through_nnsight(key: str, why: str) -> Section:
    """A section a remote model (``load_model(..., backend="nnsight", remote=True)``) does not serve, refused before
    any work with the reason: a note, not a failure."""
    _, spec = registered_sections()[key]
    sec = Section(key, spec.title, spec.link)
    reason = f"not run on a remote model: {why} (docs/remote.md)"
    sec.note(f"Not available remotely: {reason}. Run the report on a model loaded here for it.")
    sec.data = {"available": False, "reason": reason}
    return sec


def _run_section(ctx: _Context, key: str, progress: bool) -> Section:
    """Run one section; a missing optional module is a note, any other error is kept on the section."""
    analysis, spec = registered_sections()[key]
    title = spec.title
    sec = Section(key, title, spec.link)
    if progress:
        print(f"[report] {title} ...", file=sys.stderr, flush=True)
    t, before = time.perf_counter(), ctx.profile_seconds
    try:
        run = (
            registry.resolve(spec.runner)
            if spec.runner is not None
            else functools.partial(generic, analysis=analysis, section=spec)
        )
        with pass_log() as passes:
            run(ctx, sec)
        ctx.passes[key] = dict(passes)
    except ImportError as e:
        sec.note(f"This section needs a module that is not available in this install ({e}); it was left out.")
        sec.data = {"available": False, "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - the page keeps the other sections; build_report raises at the end
        sec.error("", e)
        sec.data = {"error": f"{type(e).__name__}: {e}"}
    sec.seconds = time.perf_counter() - t - (ctx.profile_seconds - before)  # the profile passes: their own entry
    if progress:
        print(f"[report] {title}: {sec.seconds:.1f} s", file=sys.stderr, flush=True)
    return sec


def _payload(ctx: _Context, done: list[Section], meta: dict, dims) -> dict:
    ma = ctx.massive if ctx._profile is not None else None
    return {
        "model": ctx.name,
        "config": {
            "n": ctx.n,
            "T": ctx.T,
            "seed": ctx.seed,
            "eps": ctx.eps,
            "bos": ctx.bos,
            "probes": {k: p.source for k, p in ctx.probes.items()},
            "dtype": str(next(ctx.model.parameters()).dtype).removeprefix("torch."),
            **placement_record(ctx.model),  # where the work ran ("device") and the weights are
            # the profile pass of each probe kind: which backend ran it, and why (analysis.engine.backends)
            "backend": getattr(ctx._profile, "backend", None)
            or {"pass": getattr(ctx.model, "pass_backend", "nnsight")},
            # every pass by section, "backend: why" -> how many (the profile passes in the first section to ask)
            "passes": ctx.passes,
            "criteria": {
                "sink": f"alpha_k > eps = {ctx.eps:g}",
                "massive_activation": criterion_text(**ctx.criterion),
                **ctx.criterion,
            },
            "positions": "the sink metric's key positions k are 1-based (k = 1 the first token); every sink's "
            "positions are 0-based (position 0 the first token)",
        },
        "samples": samples_text(ctx, done),
        "dims": {
            "n_layers": dims.n_layers,
            "n_heads": dims.n_heads,
            "n_kv_heads": dims.n_kv_heads,
            "d_model": dims.d_model,
            **{k: v for k, v in head_dims(ctx.model, dims).items() if k != "text"},
        },
        "findings": chain_findings(done),
        "notes": {s.key: s.notes for s in done if s.notes},
        "about": {s.key: s.about for s in done if s.about},
        "errors": {s.key: s.errors for s in done if s.errors},
        "spike_dims": (ma.to_dict()["spike_dims"] if ma is not None else None),
        "spike_dims_hook": (f"hook_{ma.hook}" if ma is not None else None),
        "first_token_spike_dims": (ma.to_dict()["first_token_dims"] if ma is not None else None),
        "sections": {s.key: s.data for s in done},
        "seconds": (
            {"profile": round(ctx.profile_seconds, 2)}
            | {s.key: round(s.seconds, 2) for s in done}
            | {"figures": round(meta["figures"], 2), "total": round(meta["seconds"], 2)}
        ),
        # profile: the one pass per probe kind all sections read; figures: every section's figures drawn and encoded
        "versions": meta["versions"],
    }
