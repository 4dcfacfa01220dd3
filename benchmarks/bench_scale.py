"""The analyses at scale against an SDPA forward of the same model and tokens, measured in one run (issue 22, step 2).

    .venv/bin/python benchmarks/bench_scale.py --shape llama3-8b --dtype bfloat16 --seq 1024,8192,32768 \\
        --out results/scale-8b.jsonl --budget-s 420
    .venv/bin/python benchmarks/bench_scale.py --shape smollm2 --dtype bfloat16,float32 --out results/scale-smollm2.jsonl
    .venv/bin/python benchmarks/bench_scale.py --shape tiny --seq 32,64 --device cpu --out /tmp/scale.jsonl  # smoke run

Shapes:
  llama3-8b  Llama-3-8B's config (hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocab 128256, RoPE theta
             5e5, RMSNorm eps 1e-5, untied unembedding, context max(8192, the largest T)) with random weights (normal,
             std 0.02, seed --seed) built directly on the device in the requested dtype: no hub, no CPU copy of 8B
             parameters, nothing on disk. ``--layers N`` keeps N of its 32 layers when time or memory is short: every
             method runs the same blocks, so the ratios are per layer and hold for the full depth, except for what
             comes once per model: the embedding and the forward's unembedding weigh more in a shallower model, and
             the streamed passes stop after the last hook they need (sink-streamed after the last layer's attention
             pattern, skipping that layer's MLP: with 1 layer it skips most of the model, with 32 a 64th).
  smollm2    the embedded SmolLM2-135M (``load_model("smollm2-135m", dtype=...)``), natural text (the standard-library
             docstring probe) at each T the corpus holds, else random tokens (the ``tokens`` field says which); T above
             its 8,192-token context is skipped.
  tiny       a random 2-layer Llama (d 64, 4 heads, 2 KV heads) for CPU smoke runs.
The random shapes get a byte-level BPE tokenizer of 8,192 ids trained on standard-library docstrings
(``random_shape_tokenizer``: the bridge and the report's text probes need one; it needs no file carried) and are measured on random token ids (``analysis.model.probes.random_probe``, seeded, over the
model's whole vocabulary); they have no massive activation and no sink to speak of, so their Sink_1 and spike values
only show that the analyses ran.

Methods (``--methods``; every one on the same N = --batch sequences of T tokens, one batch):
  forward        the unit: the Hugging Face model's own forward with logits, attn_implementation "sdpa", no KV cache
  forward-base   the same without the unembedding (what the fused sink runs)
  sink-fused     ``sink_metric(path="fused")``: alpha_1..16 from q, k and the fused kernel's log-sum-exp
  sink-cli       what ``python -m analysis sink`` runs per probe kind: ``profile(..., analyses=("sink",))`` through
                 ``--backend auto``
  massive-fused  the massive-activation accumulator fed by the same fused pass (``sink_pass``), as the profile feeds it
  massive        ``massive_activations`` (the streamed pass through the bridge, its eager attention)
  sink-streamed  ``sink_metric(path="eager")``: every layer's hook_pattern reduced in the hook, one T x T map at a time
  sink-eager     Hugging Face eager attention with output_attentions=True: every layer's maps of the batch kept, alpha
                 computed from them (the peer method); tried at every T, "oom" where it does not fit
  report         ``analysis.report.build.build_report`` on --report-n natural sequences of --report-t tokens (once per
                 dtype, after the smallest T), against the SDPA forward over the report's own natural probe
Each row names the attention implementation the method ran with (``attn``).

Time: the least wall time of --repeat runs after one warm-up run (the report: one run, no warm-up), synchronised on
CUDA (``analysis.core.memory.measure``). Peak memory: torch.cuda.max_memory_allocated on CUDA, the process's peak resident
memory on CPU (VmHWM, as bench_sink.py and bench_report.py), both taken above the memory held when the measurement
starts (the model's weights and the tokens): "peak above weights", the largest over the runs. Ratios are to the
forward at the same T (time and peak above weights), in one run. Out of memory on CUDA is recorded as "oom" (the
cache is emptied and the run goes on); a T beyond the context, or a measurement left when --budget-s has passed,
as "skipped". Every measurement is appended to --out as one JSON line, flushed as it is made, so a run cut short
keeps what it measured; the markdown table is printed after each T and at the end.

--budget-s is checked between measurements only: set it one measurement's length (on the 8B shape at T = 32k a
method takes well under a minute; the report a few minutes) below the command's own time limit. One configuration
(a shape and a dtype) per command keeps each inside a 10-minute limit, e.g.
    --shape llama3-8b --dtype bfloat16 --methods forward,forward-base,sink-fused,massive-fused,massive,sink-streamed,sink-eager
    --shape llama3-8b --dtype float32 --seq 1024 --methods forward,sink-fused,report
    --shape smollm2 --dtype bfloat16,float32
each with --out on the same file and --budget-s 420.

Targets (issue 22): the fused sink metric <= 1.1x the forward in time and in peak memory above weights at every T;
the report within minutes on the 8B shape (judged here as <= 5 minutes). A measurement that fails (an error, not an
out-of-memory) makes the run exit 1 after the others are done.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.core.defaults import SINK_EPS, SINK_K_MAX  # noqa: E402
from analysis.model.families import attention_implementation  # noqa: E402
from analysis.engine import kernels  # noqa: E402
from analysis.engine.backends import PASS_ATTENTION as ATTN_NAME, unbridged  # noqa: E402
from analysis.engine.kernels import SINK_KERNELS  # noqa: E402
from analysis.model.contract import hf_module as hf_model  # noqa: E402
from analysis.core.io import cache_dir, parse_dtype, replace_dir  # noqa: E402
from analysis.chain.massive import massive_accumulator, massive_activations  # noqa: E402
from analysis.core.memory import measure  # noqa: E402
from analysis.model.loading import bridge_hf, load_model  # noqa: E402
from analysis.model.probes import natural_probe, random_probe  # noqa: E402
from analysis.report.build import ReportError, build_report  # noqa: E402
from analysis.report.one_pass import profile  # noqa: E402
from analysis.sinks.metric import alpha_from_pattern, sink_metric, sink_pass  # noqa: E402
from analysis.model.reference.data import stdlib_docstrings, train_bpe  # noqa: E402
from analysis.core.versions import package_versions  # noqa: E402

SHAPES = {  # Llama-shaped random models: LlamaConfig fields (vocab None: the tokenizer's)
    "llama3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=None,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
}
METHODS = (
    "forward",
    "forward-base",
    "sink-fused",
    "sink-cli",
    "massive-fused",
    "massive",
    "sink-streamed",
    "sink-eager",
    "report",
)
TIME_TARGET = MEMORY_TARGET = 1.1  # the fused sink metric against the forward
# issue 39's targets, as (time, memory) ratios to the SDPA forward and the T they are judged at (None: every T)
TARGETS = {
    "sink-fused": (1.1, 1.1, None),
    "sink-cli": (1.1, 1.1, None),
    "massive-fused": (1.2, 1.2, None),
    "sink-streamed": (2.0, None, 8192),
    "massive": (1.5, 1.5, None),
}
REPORT_TARGET_S = 300.0  # "the report within minutes on the 8B shape"


# ----------------------------------------------------------------------------------------------
# Models and tokens
# ----------------------------------------------------------------------------------------------


def random_shape_tokenizer():
    """The random shapes' tokenizer: a byte-level BPE of 8,192 ids trained on 1M characters of standard-library
    docstrings (a few seconds, once; kept in the package's cache folder). It needs nothing carried: the embedded model's file is not there yet
    in the first calls of a lent GPU machine (docs/gpu.md)."""
    target = cache_dir() / "bench-scale-tokenizer"  # a folder: the bridge reloads its tokenizer by name_or_path
    if not (target / "tokenizer.json").is_file():
        tok = train_bpe(iter(stdlib_docstrings(max_chars=1_000_000)), 8192)
        replace_dir(target, tok.save_pretrained)
    return AutoTokenizer.from_pretrained(target)


def build_model(shape: str, dtype: torch.dtype, device: str, *, layers: int | None, max_T: int, seed: int):
    """The bridge of ``shape`` in ``dtype`` on ``device``: SmolLM2 loaded, or a random Llama built on the device."""
    if shape == "smollm2":
        return load_model("smollm2-135m", device=device, dtype=dtype)
    tok = random_shape_tokenizer()
    spec = dict(SHAPES[shape])
    theta = spec.pop("rope_theta")
    spec["vocab_size"] = spec["vocab_size"] or len(tok)
    spec["num_hidden_layers"] = layers or spec["num_hidden_layers"]
    spec["max_position_embeddings"] = max(spec["max_position_embeddings"], max_T)
    cfg = LlamaConfig(
        **spec,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(device):  # parameters created and initialised on the device, in dtype
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    name = f"{shape} (random weights, {spec['num_hidden_layers']} layers)"
    return bridge_hf(hf.eval(), tokenizer=tok, name=name, device=device)


def probe_tokens(model, shape: str, n: int, T: int, seed: int) -> tuple[torch.Tensor, str]:
    """(N, T) token ids and what they are: natural text for SmolLM2 where the corpus holds T tokens, else random ids
    over the model's vocabulary."""
    if shape == "smollm2":
        try:
            return natural_probe(model.tokenizer, n=n, T=T, seed=seed).tokens, "natural (stdlib docstrings)"
        except ValueError:  # the corpus holds fewer than T tokens
            pass
    vocab = hf_model(model).config.vocab_size
    return random_probe(model.tokenizer, n=n, T=T, seed=seed, vocab_size=vocab).tokens, "random"


def weights_mib(model) -> float:
    hf = hf_model(model)
    return sum(t.numel() * t.element_size() for t in [*hf.parameters(), *hf.buffers()]) / 2**20


# ----------------------------------------------------------------------------------------------
# Methods: each returns (attention implementation, {result fields})
# ----------------------------------------------------------------------------------------------


def _forward(model, tokens, *, base: bool):
    hf = hf_model(model)
    with unbridged(hf), attention_implementation(hf, "sdpa"), torch.inference_mode():
        attn = hf.config._attn_implementation
        (hf.base_model if base else hf)(input_ids=tokens, use_cache=False)
    return attn, {}


def _sink_fields(alpha: torch.Tensor) -> dict:
    """Sink_1 (a fraction) and alpha_1 (N, L, H), kept to compare the paths."""
    a1 = alpha[..., 0].float().cpu()
    return {"sink_1": float((a1 > SINK_EPS).float().mean()), "mean_alpha_1": float(a1.mean()), "_alpha_1": a1}


def _massive_fields(res) -> dict:
    top = res.top_values[..., 0]  # (N, L): each sample and layer's largest |a|
    ratio = top / res.median.clamp_min(1e-30)
    return {
        "top_abs": float(top.max()),
        "top_over_median": float(ratio.max()),
        "first_token_spike_dims": sorted({d for ds in res.first_token_dims.values() for d in ds}),
    }


def sink_fused(model, tokens):
    res = sink_metric(model, tokens, path="fused", batch_size=tokens.shape[0])
    return f"{ATTN_NAME} (fused kernel + lse: {_kernels(res.meta)})", _sink_fields(res.alpha)


def _kernels(meta: dict) -> str:
    """The kernels the fused pass took, with any fallback's reason."""
    return ", ".join(k + (f" [{why}]" if why else "") for k, why in meta.get("kernels", {}).items()) or "?"


def massive_fused(model, tokens):
    res, (mass,) = sink_pass(
        model,
        tokens,
        path="fused",
        batch_size=tokens.shape[0],
        make_accumulators=lambda: [massive_accumulator(model, tokens.shape)],
    )
    return f"{ATTN_NAME} (fused kernel + lse: {_kernels(res.meta)})", {
        **_sink_fields(res.alpha),
        **_massive_fields(mass),
    }


def sink_cli(model, tokens):
    """What ``python -m analysis sink`` runs per probe kind: the profile pass of the sink alone, through ``auto``."""
    prof = profile(model, {"natural": tokens}, analyses=("sink",), batch_size=tokens.shape[0], backend="auto")
    ran = prof.backend["natural"]
    return f"{ran['backend']} ({_kernels(ran)})", _sink_fields(prof.sink["natural"].alpha)


def massive(model, tokens):
    res = massive_activations(model, tokens, batch_size=tokens.shape[0])
    return f"bridge ({hf_model(model).config._attn_implementation})", _massive_fields(res)


def sink_streamed(model, tokens):
    res = sink_metric(model, tokens, path="eager", batch_size=tokens.shape[0])
    return f"bridge ({hf_model(model).config._attn_implementation}, hook_pattern)", _sink_fields(res.alpha)


def sink_eager(model, tokens):
    hf = hf_model(model)
    k_max = min(SINK_K_MAX, tokens.shape[1])
    with unbridged(hf), attention_implementation(hf, "eager"), torch.inference_mode():
        attn = hf.config._attn_implementation
        maps = hf.base_model(input_ids=tokens, output_attentions=True, use_cache=False).attentions  # L x (N, H, T, T)
        alpha = torch.stack([alpha_from_pattern(m, k_max) for m in maps], 1)  # (N, L, H, k_max)
        del maps
    return f"{attn} (output_attentions, every map kept)", _sink_fields(alpha)


def report(model, tokens, *, n: int, T: int, seed: int):
    """``python -m analysis report``: the whole report, through ``--backend auto`` (the command line's default)."""
    old, model.pass_backend = getattr(model, "pass_backend", "transformer_lens"), "auto"
    try:
        with tempfile.TemporaryDirectory() as out:
            error = None
            try:
                build_report(model, out, n=n, T=T, seed=seed)
            except ReportError as e:  # the page is written; the failed sections are named
                error = str(e)
            payload = json.loads((Path(out) / "report.json").read_text())
    finally:
        model.pass_backend = old
    fields = {
        "sink_1": payload["sections"].get("sink", {}).get("sink_1_pct", {}).get("natural"),
        "first_token_spike_dims": payload.get("first_token_spike_dims"),
        "report_errors": payload.get("errors"),
        "report_seconds": payload.get("seconds"),
        "_error": error,
    }
    if fields["sink_1"] is not None:
        fields["sink_1"] /= 100
    ran = sorted({v["backend"] for v in (payload["config"].get("backend") or {}).values()})
    return f"auto: the profile pass on {', '.join(ran)}", fields


RUNS = {
    "forward": lambda m, t: _forward(m, t, base=False),
    "forward-base": lambda m, t: _forward(m, t, base=True),
    "sink-fused": sink_fused,
    "sink-cli": sink_cli,
    "massive-fused": massive_fused,
    "massive": massive,
    "sink-streamed": sink_streamed,
    "sink-eager": sink_eager,
}


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------


def _free(device: str) -> None:
    """Collect what the last run left and give CUDA's cached blocks back (cheap: the model's objects are frozen out of
    the collector's reach after the build)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def timed(fn, device: str, *, repeat: int, warmup: bool = True) -> dict:
    """The least wall time and largest peak (total and above the start) of ``repeat`` runs of ``fn`` after an optional
    warm-up, and the last run's result; {"status": "oom"} when CUDA runs out of memory."""
    box: dict = {}
    runs = []
    oom = False
    try:
        if warmup:
            fn()
            _free(device)
        for _ in range(max(1, repeat)):
            runs.append(measure(lambda: box.__setitem__("out", fn()), device))
            _free(device)
    except RuntimeError as e:  # torch.OutOfMemoryError, or a library's allocation failure (cuBLAS) on CUDA
        if not (isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower() or "ALLOC_FAILED" in str(e)):
            raise
        oom = True  # the exception (and the frames holding its tensors) is dropped before the cache is emptied
    if oom:
        box.clear()
        _free(device)
        return {"status": "oom"}
    attn, fields = box["out"]
    return {
        "status": "ok",
        "attn": attn,
        "wall_s": min(r[0] for r in runs),
        "peak_mib": max(r[1] for r in runs),
        "peak_above_mib": max(r[2] for r in runs),
        "repeats": len(runs),
        **fields,
    }


def ratios(row: dict, unit: dict | None) -> None:
    """x forward in time and in peak above weights (None where the forward has no measurement)."""
    ok = unit is not None and unit.get("status") == "ok" and row.get("status") in ("ok", "error") and "wall_s" in row
    row["x_forward_time"] = row["wall_s"] / unit["wall_s"] if ok and unit["wall_s"] > 0 else None
    row["x_forward_mem"] = row["peak_above_mib"] / unit["peak_above_mib"] if ok and unit["peak_above_mib"] > 0 else None


class Writer:
    """Appends one JSON object per measurement to ``path`` (flushed at once) and keeps the rows."""

    def __init__(self, path: str | None):
        self.path, self.rows = path, []
        if path:
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict) -> None:
        row = {k: v for k, v in row.items() if not k.startswith("_")}
        self.rows.append(row)
        if self.path:
            with open(Path(self.path).expanduser(), "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()


# ----------------------------------------------------------------------------------------------
# Printing
# ----------------------------------------------------------------------------------------------


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    """The measurements as a markdown table."""
    head = (
        "| dtype | T | N | method | attention | status | time (s) | x forward | peak above weights (MiB) "
        "| x forward | Sink_1 | top abs(a) |"
    )
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        if r["method"] == "build":
            continue
        lines.append(
            f"| {r['dtype']} | {r['T']} | {r.get('batch', '-')} | {r['method']} | {r.get('attn', '-')} | {r['status']} "
            f"| {_num(r.get('wall_s'), '.3f')} | {_num(r.get('x_forward_time'), '.2f')} "
            f"| {_num(r.get('peak_above_mib'), '.0f')} | {_num(r.get('x_forward_mem'), '.2f')} "
            f"| {_num(r.get('sink_1'), '.3f')} | {_num(r.get('top_abs'), '.1f')} |"
        )
    return "\n".join(lines)


def _target_line(r: dict) -> str | None:
    """A method's ratios against its target (``TARGETS``), met or not; None for a method or T not judged."""
    t_max, m_max, at = TARGETS.get(r["method"], (None, None, None))
    if t_max is None or r["status"] != "ok" or r.get("x_forward_time") is None or (at is not None and r["T"] != at):
        return None
    t, m = r["x_forward_time"], r["x_forward_mem"]
    if m_max is not None and m is None:
        verdict = "not judged: the forward held no memory above the weights (process RSS on a small CPU model)"
    else:
        verdict = "met" if t <= t_max and (m_max is None or m <= m_max) else "NOT met"
    want = f"<= {t_max:g}x in time" + (f" and <= {m_max:g}x in memory" if m_max is not None else "")
    if r["method"] == "sink-fused":
        want = f"<= {t_max:g}x in both"
    return (
        f"{r['dtype']} T={r['T']}: {r['method']} costs {t:.2f}x the SDPA forward's time and {_num(m, '.2f')}x its "
        f"peak memory above weights; target {want}: {verdict}."
    )


def targets(rows: list[dict]) -> list[str]:
    """One line per measurement that has a target (``TARGETS``) and per report: against its target, met or not."""
    out = []
    for r in rows:
        line = _target_line(r)
        if line:
            out.append(line)
        if r["method"] == "report" and r["status"] in ("ok", "error") and "wall_s" in r:
            met = r["wall_s"] <= REPORT_TARGET_S and r["status"] == "ok"
            out.append(
                f"{r['dtype']}: the report (N={r['batch']}, T={r['T']}) takes {r['wall_s']:.1f} s "
                f"({r['wall_s'] / 60:.1f} min, {_num(r.get('x_forward_time'), '.1f')}x a forward over its probe)"
                f"{'' if r['status'] == 'ok' else ' and FAILED'}; target <= {REPORT_TARGET_S / 60:g} min: "
                f"{'met' if met else 'NOT met'}."
            )
    return out


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["llama3-8b", "smollm2", "tiny"], default="llama3-8b")
    p.add_argument("--layers", type=int, help="keep this many layers of a random shape (the ratios are per layer)")
    p.add_argument("--dtype", type=_csv(str), default=["bfloat16"], help="comma-separated: bfloat16,float32")
    p.add_argument("--seq", type=_csv(int), default=[1024, 8192, 32768], help="comma-separated sequence lengths T")
    p.add_argument("--batch", type=int, default=1, help="N sequences per T, run as one batch")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="append one JSON line per measurement to this file")
    p.add_argument(
        "--methods",
        type=_csv(str),
        default=list(METHODS),
        help=f"comma-separated among {','.join(METHODS)} (forward, the unit, always runs)",
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="timed runs per method after a warm-up; the least time is kept"
    )
    p.add_argument("--report-n", type=int, default=8, help="natural sequences per probe kind of the report")
    p.add_argument("--report-t", type=int, default=64, help="tokens per sequence of the report")
    p.add_argument("--budget-s", type=float, help="start no new measurement once this many seconds have passed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 on a shared machine)")
    p.add_argument(
        "--sink-kernel",
        choices=list(SINK_KERNELS),
        help="the fused sink path's kernel where the device "
        "has it (default: analysis.engine.kernels.sink_kernel's table), to compare kernels in one run",
    )
    args = p.parse_args(argv)
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"unknown methods {bad}; choose among {','.join(METHODS)}.")
    if args.layers is not None and (args.shape == "smollm2" or args.layers < 1):
        p.error("--layers takes a positive number and applies to the random shapes (llama3-8b, tiny) only.")
    if not args.seq or min(args.seq) < 2:
        p.error("give sequence lengths T >= 2 (alpha_1 is 1 with one token).")
    args.dtypes = [parse_dtype(d) for d in args.dtype]
    args.methods = ["forward", *[m for m in METHODS if m in args.methods and m != "forward"]]
    args.seq = sorted(set(args.seq))
    return args


def run(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """Every measurement of ``args``, written as it is made; returns (rows, what was skipped for the budget)."""
    t0 = time.perf_counter()
    kernels.PREFER = getattr(args, "sink_kernel", None)
    writer, skipped = Writer(args.out), []
    device = args.device
    gpu = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None
    per_T = [m for m in args.methods if m != "report"]
    for dtype, dname in zip(args.dtypes, args.dtype):
        base = {"shape": args.shape, "dtype": dname, "device": device, "gpu": gpu, "layers": args.layers}
        plan = [
            (T, m)
            for i, T in enumerate(args.seq)  # the report once, after the smallest T
            for m in per_T + (["report"] if i == 0 and "report" in args.methods else [])
        ]
        if args.budget_s is not None and time.perf_counter() - t0 >= args.budget_s:  # not even the model
            for T, m in plan:
                skipped.append(f"{dname} T={args.report_t if m == 'report' else T} {m}")
                writer.write(
                    {
                        **base,
                        "T": args.report_t if m == "report" else T,
                        "method": m,
                        "status": "skipped",
                        "reason": "budget",
                    }
                )
            continue
        built = time.perf_counter()
        model = build_model(args.shape, dtype, device, layers=args.layers, max_T=max(args.seq), seed=args.seed)
        gc.collect()
        gc.freeze()  # the libraries' and the model's objects: every later collection skips them
        try:
            writer.write(
                {
                    **base,
                    "T": None,
                    "method": "build",
                    "status": "ok",
                    "model": model.model_name,
                    "wall_s": time.perf_counter() - built,
                    "weights_mib": weights_mib(model),
                    "n_layers": model.cfg.n_layers,
                    "n_ctx": model.cfg.n_ctx,
                    "versions": package_versions(),
                }
            )
            base.update(model=model.model_name, layers=model.cfg.n_layers)
            print(
                f"{model.model_name} in {dname} on {device}{f' ({gpu})' if gpu else ''}: {weights_mib(model):.0f} "
                f"MiB of weights, built in {writer.rows[-1]['wall_s']:.1f} s",
                flush=True,
            )
            units: dict[int, dict] = {}  # T -> the forward's row
            alpha: dict[int, torch.Tensor] = {}  # T -> the fused path's alpha_1 (N, L, H)
            for i, (T, method) in enumerate(plan):
                if args.budget_s is not None and time.perf_counter() - t0 >= args.budget_s:
                    row = {
                        **base,
                        "T": args.report_t if method == "report" else T,
                        "method": method,
                        "status": "skipped",
                        "reason": "budget",
                    }
                    skipped.append(f"{dname} T={row['T']} {method}")
                else:
                    row = measure_one(model, method, T, args, base, units, alpha)
                writer.write(row)
                _print_row(row)
                if i + 1 == len(plan) or plan[i + 1][0] != T:
                    done = [r for r in writer.rows if r["dtype"] == dname and r["T"] == T]
                    print("\n" + "\n".join([table(done), *targets(done)]) + "\n", flush=True)
        finally:
            gc.unfreeze()
        del model
        _free(device)
    return writer.rows, skipped


def measure_one(model, method: str, T: int, args, base: dict, units: dict, alpha: dict) -> dict:
    """One method at one T (the report: on its own probe), as a row: measured, "oom", "skipped" (beyond the
    context) or "error"; ratios to the forward at T, and alpha_1's largest difference from the fused path's."""
    device = args.device
    n, T_run = (args.report_n, args.report_t) if method == "report" else (args.batch, T)
    row = {**base, "T": T_run, "batch": n, "method": method}
    n_ctx = model.cfg.n_ctx
    if n_ctx is not None and T_run > n_ctx:
        return {**row, "status": "skipped", "reason": f"T beyond the model's context of {n_ctx}"}
    tokens, kind = probe_tokens(model, "smollm2" if method == "report" else args.shape, n, T_run, args.seed)
    tokens = tokens.to(device)
    row["tokens"] = "natural (the report's probe)" if method == "report" else kind
    unit = units.get(T)
    try:
        if method == "report":  # its unit: the SDPA forward over the report's natural probe
            unit = timed(lambda: RUNS["forward"](model, tokens), device, repeat=args.repeat)
            row.update(
                timed(lambda: report(model, tokens, n=n, T=T_run, seed=args.seed), device, repeat=1, warmup=False),
                forward_wall_s=unit.get("wall_s"),
            )
        else:
            row.update(timed(lambda: RUNS[method](model, tokens), device, repeat=args.repeat))
            if method == "forward":
                unit = units[T] = row
        if row.get("_error"):
            row.update(status="error", error=row["_error"])
    except Exception as e:  # a failed measurement is recorded, the others still run; the exit code says so
        row.update(
            status="error",
            error=f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}",
            traceback=traceback.format_exc(limit=-3),
        )
    del tokens
    _free(device)
    ratios(row, unit)
    a1 = row.get("_alpha_1")
    if a1 is not None and method == "sink-fused":
        alpha[T] = a1
    elif a1 is not None and T in alpha and alpha[T].shape == a1.shape:
        row["max_abs_diff_alpha_1_vs_fused"] = float((a1 - alpha[T]).abs().max())
    return row


def _print_row(r: dict) -> None:
    print(
        f"  {r['dtype']} T={r['T']:<6} {r['method']:<14} {r['status']:<8} {_num(r.get('wall_s'), '9.3f')} s "
        f"x{_num(r.get('x_forward_time'), '.2f')}  {_num(r.get('peak_above_mib'), '9.0f')} MiB above weights "
        f"x{_num(r.get('x_forward_mem'), '.2f')}  Sink_1 {_num(r.get('sink_1'), '.3f')}"
        + (f"  ({r['error']})" if r["status"] == "error" else f"  ({r['reason']})" if "reason" in r else ""),
        flush=True,
    )


def main(argv=None) -> int:
    """Parse ``argv``, run, print the table, the targets and what the budget skipped; 1 if a measurement failed."""
    args = parse(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> int:
    print(
        f"bench_scale: {args.shape}, dtypes {args.dtype}, T {args.seq}, N {args.batch}, methods {args.methods}, "
        f"device {args.device}, torch {torch.__version__}"
        + (f", budget {args.budget_s:g} s" if args.budget_s is not None else ""),
        flush=True,
    )
    rows, skipped = run(args)
    print(
        "\nAll measurements (time: best of the runs; memory: peak above the weights held at the start, "
        "torch.cuda.max_memory_allocated on CUDA, process RSS on CPU; ratios to the SDPA forward at the same T; "
        "the report's to a forward over its own probe):\n"
    )
    print(table(rows))
    print()
    for line in targets(rows):
        print(line)
    if skipped:
        print(
            f"\nskipped: the budget of {args.budget_s:g} s had passed before {len(skipped)} measurement(s): "
            + "; ".join(skipped)
        )
    failed = [r for r in rows if r["status"] == "error"]
    for r in failed:
        print(f"FAILED: {r['dtype']} T={r['T']} {r['method']}: {r['error']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
