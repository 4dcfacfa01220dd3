"""Training throughput (forward + backward + AdamW step) of every attention operation at one configuration.

    python benchmarks/bench_attention_ops.py                 # CPU defaults (about a minute on 2 cores)
    python benchmarks/bench_attention_ops.py --device cuda   # GPU defaults: bf16 autocast, fused kernels
    python benchmarks/bench_attention_ops.py --device cuda --compile --ops softmax,sigmoid
    python benchmarks/bench_attention_ops.py --preset synthetic --ops softmax,sigmoid   # a preset's model and batch
    python benchmarks/bench_attention_ops.py --device cuda --preset paper-60m --compile --ops softmax,sigmoid,elu1 \
        --impl sdpa,flex,eager --json throughput.json      # the GPU issue's table: every path in one run
    python benchmarks/bench_attention_ops.py --device cuda --preset paper-60m --compile --ops softmax,sigmoid,elu1 \
        --impl sdpa,flex,triton --json throughput.json     # issue 39: the Triton sigmoid / elu+1 kernels as a path

Prints one row per operation and path (--impl takes a list): tokens/s, ms per step, the path the attention
took (sdpa / flex / triton / eager, chosen by ``analysis.model.reference.kernels``' table; an operation without the
asked-for fused path is left out of that path's rows, and the table's reason said), the throughput relative to softmax on the same path, and on a GPU the model FLOPs utilisation (MFU:
6 N + 12 L T d FLOPs per token, against the GPU's dense bf16 peak given by --peak-tflops). With a preset, the
batch is its micro-batch (the one forward a step of that preset runs). --json also writes the rows and the run's
settings to a file. Prints figures and the targets of issue 39 from the same run (softmax >= 45% MFU on a GPU;
sigmoid and elu+1 >= 1.0x softmax, each on its fastest path); it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.train import ModelConfig, SinkLM, available_attention  # noqa: E402

MFU_TARGET = 0.45  # softmax, bf16 dense peak (issue 39)
VS_SOFTMAX_TARGET = 1.0  # sigmoid and elu+1 against softmax, each on its fastest path
IMPLS = ("auto", "eager", "sdpa", "flex", "triton")
GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0, "4090": 165.0}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ops", default=",".join(available_attention()), help="comma-separated operation names")
    p.add_argument(
        "--preset",
        help="take the model shape and batch from a training preset (e.g. synthetic, the "
        "reference pair and the emergence grids); explicit options still win",
    )
    p.add_argument("--d-model", type=int)
    p.add_argument("--n-layers", type=int)
    p.add_argument("--n-heads", type=int)
    p.add_argument("--n-ctx", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument(
        "--vocab", type=int, help="vocabulary size (default: the preset's; else 32768 on a GPU, 4096 on CPU)"
    )
    p.add_argument("--iters", type=int)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed rounds per operation; the fastest is reported (robust to other processes on a shared machine)",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--impl", default="auto", help="comma-separated paths to time: auto, eager, sdpa, flex, triton")
    p.add_argument("--json", help="also write the rows and settings to this JSON file")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--peak-tflops", type=float, help="GPU dense bf16 peak for MFU (default: guessed from the name)")
    args = p.parse_args(argv)
    args.impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    bad = sorted(set(args.impls) - set(IMPLS))
    if bad or not args.impls:
        p.error(f"--impl takes a comma-separated list of {', '.join(IMPLS)}; got {args.impl!r}.")
    gpu = args.device.startswith("cuda")
    args.model_fields = {}
    if args.preset:
        from analysis.train.presets import preset

        pre = preset(args.preset)
        for k, field in (
            ("d_model", "d_model"),
            ("n_layers", "n_layers"),
            ("n_heads", "n_heads"),
            ("n_ctx", "n_ctx"),
            ("batch", "micro_batch_size" if "micro_batch_size" in pre else "batch_size"),
        ):
            if getattr(args, k) is None and field in pre:
                setattr(args, k, pre[field])
        args.model_fields = {
            k: pre[k] for k in ("d_mlp", "act_fn", "normalization_type", "positional_embedding_type") if k in pre
        }
        if args.vocab is None:
            args.vocab = 65 if pre.get("dataset") == "synthetic" else pre.get("tokenizer_vocab_size")
    defaults = (
        dict(d_model=768, n_layers=12, n_heads=12, n_ctx=2048, batch=8, iters=10)
        if gpu
        else dict(d_model=256, n_layers=4, n_heads=4, n_ctx=256, batch=4, iters=3)
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.vocab is None:
        args.vocab = 32768 if gpu else 4096
    return args


def make_step(op: str, impl: str, args):
    """(model, step function, cfg) for one operation."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_vocab=args.vocab,
        n_ctx=args.n_ctx,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        attention=op,
        attn_impl=impl,
        **args.model_fields,
    )
    model = SinkLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    runner = torch.compile(model) if args.compile else model
    tokens = torch.randint(0, cfg.d_vocab, (args.batch, args.n_ctx + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        amp = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda"
            else torch.autocast("cpu", enabled=False)
        )
        with amp:
            logits = runner(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step, cfg


def bench(ops, args) -> list[dict]:
    """Warm every (operation, path) up, then time them round-robin ``repeats`` times; keep each one's fastest
    round (interleaving and best-of make the comparison fair when the machine's load varies). A fused path the
    operation does not have (it ran eager) is left out, and said so."""
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    runs = {}
    for impl in args.impls:
        for op in ops:
            try:
                model, step, cfg = make_step(op, impl, args)
                for _ in range(args.warmup):
                    step()
            except Exception as e:  # noqa: BLE001 - report and continue with the other operations
                print(f"{op} ({impl}): failed ({type(e).__name__}: {e})")
                continue
            path = model.blocks[0].attn.last_path or "?"
            if impl in ("sdpa", "flex", "triton") and path != impl:
                dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
                why = model.attention_kernel(device.type, dtype).get("fallback", "")
                print(f"{op}: no {impl} path (it ran {path}{': ' + why if why else ''}); left out of the {impl} rows")
                del model, step
                continue
            runs[op, impl] = (model, step, cfg)
    best = {key: float("inf") for key in runs}
    for _ in range(args.repeats):
        for key, (_, step, _) in runs.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            sync()
            best[key] = min(best[key], (time.perf_counter() - t0) / args.iters)
    rows = []
    for (op, impl), (model, _, cfg) in runs.items():
        dt = best[op, impl]
        tok_s = args.batch * args.n_ctx / dt
        flops_per_token = 6 * model.n_params() + 12 * cfg.n_layers * cfg.n_ctx * cfg.d_model
        rows.append(
            {
                "op": op,
                "impl": impl,
                "tokens_per_s": tok_s,
                "ms_per_step": dt * 1e3,
                "path": model.blocks[0].attn.last_path or "?",
                "tflops": tok_s * flops_per_token / 1e12,
            }
        )
    return rows


def target_lines(rows: list[dict], on_gpu: bool) -> list[str]:
    """Issue 39's training targets from the rows of one run: softmax's MFU, and sigmoid / elu+1 against softmax,
    each operation on its fastest path."""
    fastest = {
        op: max((r for r in rows if r["op"] == op), key=lambda r: r["tokens_per_s"], default=None)
        for op in ("softmax", "sigmoid", "elu1")
    }
    s = fastest["softmax"]
    if s is None:
        return ["targets: not judged (softmax was not timed)."]
    mfu = s.get("mfu")
    out = [
        f"softmax ({s['path']}): MFU {100 * mfu:.1f}%, target >= {100 * MFU_TARGET:.0f}%: "
        f"{'met' if mfu >= MFU_TARGET else 'NOT met'}."
        if mfu is not None
        else f"softmax ({s['path']}): MFU not judged ({'no peak known: --peak-tflops' if on_gpu else 'a CPU run'})."
    ]
    for op in ("sigmoid", "elu1"):
        g = fastest[op]
        if g is not None:
            x = g["tokens_per_s"] / s["tokens_per_s"]
            out.append(
                f"{op} ({g['path']}) / softmax ({s['path']}), each on its fastest path: {x:.2f}, target >= "
                f"{VS_SOFTMAX_TARGET:.1f}: {'met' if x >= VS_SOFTMAX_TARGET else 'NOT met'}."
            )
    return out


def main(argv=None):
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    peak = args.peak_tflops or next((v for k, v in GPU_PEAK_TFLOPS.items() if k in name), None)
    print(
        f"device: {name}; torch {torch.__version__}; {'preset ' + args.preset + ', ' if args.preset else ''}d_model {args.d_model}, {args.n_layers} layers, "
        f"{args.n_heads} heads, vocab {args.vocab}, context {args.n_ctx}, batch {args.batch}, impl {args.impl}"
        f"{', compiled' if args.compile else ''}; forward + backward + AdamW, fastest of {args.repeats} "
        f"interleaved rounds of {args.iters} steps"
    )
    rows = bench(ops, args)
    softmax = {r["impl"]: r["tokens_per_s"] for r in rows if r["op"] == "softmax"}
    header = f"| {'operation':22s} | {'path':5s} | {'tokens/s':>10s} | {'ms/step':>8s} | vs softmax |"
    if device.type == "cuda" and peak:
        header += "   MFU |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        base = softmax.get(r["impl"])
        r["vs_softmax"] = r["tokens_per_s"] / base if base else None
        r["mfu"] = r["tflops"] / peak if device.type == "cuda" and peak else None
        line = (
            f"| {r['op']:22s} | {r['path']:5s} | {r['tokens_per_s']:10.0f} | {r['ms_per_step']:8.1f} | "
            f"{(r['vs_softmax'] or float('nan')):10.2f} |"
        )
        if r["mfu"] is not None:
            line += f" {100 * r['mfu']:4.1f}% |"
        print(line)
    for line in target_lines(rows, device.type == "cuda"):
        print(line)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("model_fields",)}
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "settings": settings,
                    "model_fields": args.model_fields,
                    "peak_tflops": peak,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
        print(f"written {args.json}")


if __name__ == "__main__":
    main()
