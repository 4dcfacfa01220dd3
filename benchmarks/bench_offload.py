"""A model larger than this machine's memory, analysed from disk (issue 29, step 3; not CI).

Builds random weights of a Llama shape (default: Llama-3-70B's width, hidden 8192, MLP 28672, 64 heads, 8 KV heads,
with 15 of its 80 layers and SmolLM2's 49,152-token vocabulary and tokenizer: 13.6 G parameters, 25.4 GiB in bfloat16,
more than this machine's 24 GiB), shard by shard with safetensors (one block in memory at a time), loads it with
every block mapped to "disk" (``load_model(..., device_map=split_device_map(...), offload_folder=...)``), and measures,
in one run and on the same offloaded model:

  forward  a plain forward pass with logits, one per probe kind (natural, random, repeated), N sequences of T tokens
  sink     the sink table (``profile(model, probes, analyses=("sink",))``: alpha and Sink_k on the three kinds)
  massive  the massive-activation table (``profile(..., analyses=("massive",))``)

Time: wall seconds. Peak resident memory: the process's VmHWM (reset before each measurement; file pages mapped
from the offload files count). Ratios are to the forward over the same probes. Targets: sink <= 1.2x the forward
in time and memory; peak resident memory well under the weights' size. The files are removed at the end (--keep
keeps them).

Disk: the weights' size (printed, 25.4 GiB at the defaults; --layers N scales it: 1.6 GiB per 70B-wide layer plus
1.5 GiB of embedding and unembedding) and nothing more: accelerate reads the disk-mapped blocks from the safetensors
shards themselves. Free disk is checked first.

    .venv/bin/python benchmarks/bench_offload.py                      # the full size: 25.4 GiB on disk
    .venv/bin/python benchmarks/bench_offload.py --layers 2 --n 1 --T 16   # a smaller run

Measured (docs/scale.md, data/scale/offload.json): 25.4 GiB of weights, peak resident 2.93 GiB; the sink table 0.77x
the forward's time and 0.98x its memory, the massive table 0.81x and 0.83x.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

GIB = 2**30


def shapes(a) -> tuple[dict[str, tuple[int, ...]], list[dict[str, tuple[int, ...]]]]:
    """(the non-block tensors, one dict per block) of a Llama of these dimensions."""
    hd, D, F = a.d_model // a.heads, a.d_model, a.d_mlp
    block = {
        "self_attn.q_proj.weight": (a.heads * hd, D),
        "self_attn.k_proj.weight": (a.kv_heads * hd, D),
        "self_attn.v_proj.weight": (a.kv_heads * hd, D),
        "self_attn.o_proj.weight": (D, a.heads * hd),
        "mlp.gate_proj.weight": (F, D),
        "mlp.up_proj.weight": (F, D),
        "mlp.down_proj.weight": (D, F),
        "input_layernorm.weight": (D,),
        "post_attention_layernorm.weight": (D,),
    }
    rest = {"model.embed_tokens.weight": (a.vocab, D), "model.norm.weight": (D,), "lm_head.weight": (a.vocab, D)}
    return rest, [{f"model.layers.{i}.{k}": s for k, s in block.items()} for i in range(a.layers)]


def n_bytes(a) -> int:
    rest, blocks = shapes(a)
    size = torch.finfo(getattr(torch, a.dtype)).bits // 8
    return size * sum(int(torch.Size(s).numel()) for d in [rest, *blocks] for s in d.values())


def build(a, folder: Path) -> None:
    """config, tokenizer and safetensors shards (one per block), written one shard at a time."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    from analysis.model.loading import smollm2_dir

    dtype = getattr(torch, a.dtype)
    LlamaConfig(
        hidden_size=a.d_model,
        intermediate_size=a.d_mlp,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        vocab_size=a.vocab,
        max_position_embeddings=8192,
        rope_theta=5e5,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype=a.dtype,
    ).save_pretrained(folder)
    AutoTokenizer.from_pretrained(smollm2_dir()).save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    rest, blocks = shapes(a)
    index, total = {}, 0
    for i, shard in enumerate([rest, *blocks]):
        name = f"model-{i:05d}.safetensors"
        tensors = {
            k: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02).to(dtype)
            for k, s in shard.items()
        }
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        index.update({k: name for k in tensors})
        del tensors
        print(f"  shard {i + 1}/{len(blocks) + 1} written ({total / GIB:.1f} GiB)", flush=True)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index})
    )


def measure(fn) -> tuple[float, float]:
    from analysis.core.memory import peak_mib, reset_peak

    reset_peak("cpu")
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t, peak_mib("cpu")


def run(a, folder: Path) -> dict:
    from analysis import load_model
    from analysis.model.placement import split_device_map
    from analysis.model.probes import model_probe_sets
    from analysis.report.one_pass import profile

    dm = split_device_map(str(folder), {l: "disk" for l in range(a.layers)})
    t = time.perf_counter()
    model = load_model(str(folder), dtype=a.dtype, device_map=dm, offload_folder=str(folder / "offload"))
    load_s = time.perf_counter() - t
    probes = model_probe_sets(model, n=a.n, T=a.T, seed=0)

    def forward():
        with torch.inference_mode():
            for p in probes.values():
                model(p.tokens)

    out = {"load_s": load_s, "resident_after_load_mib": _rss()}
    got = {}
    for name, fn in (
        ("forward", forward),
        ("sink", lambda: got.__setitem__("sink", profile(model, probes, analyses=("sink",)))),
        ("massive", lambda: got.__setitem__("massive", profile(model, probes, analyses=("massive",)))),
    ):
        sec, peak = measure(fn)
        out[name] = {"s": round(sec, 2), "peak_rss_mib": round(peak)}
        print(f"  {name}: {sec:.1f} s, peak resident {peak / 1024:.2f} GiB", flush=True)
    out["sink_1_pct"] = {k: r.to_dict()["sink_k_pct"][0] for k, r in got["sink"].sink.items()}
    for m in ("sink", "massive"):
        out[m]["time_ratio"] = round(out[m]["s"] / out["forward"]["s"], 3)
        out[m]["memory_ratio"] = round(out[m]["peak_rss_mib"] / out["forward"]["peak_rss_mib"], 3)
    return out


def _rss() -> int:
    from analysis.core.memory import _status_kib

    return round(_status_kib("VmRSS") / 1024)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=15, help="blocks (default 15: 25.4 GiB in bfloat16)")
    p.add_argument("--d-model", type=int, default=8192)
    p.add_argument("--d-mlp", type=int, default=28672)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=49152, help="SmolLM2's tokenizer is used: at least 49152")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--n", type=int, default=2, help="sequences per probe kind (2: the measured run, about 15 minutes on 2 cores)"
    )
    p.add_argument("--T", type=int, default=32, help="tokens per sequence")
    p.add_argument("--dir", default="/work/tmp/bench_offload", help="where the weights are written (removed after)")
    p.add_argument("--keep", action="store_true", help="keep the weights")
    p.add_argument("--out", help="append the result as one JSON line here")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run (timeout) still removes its files
    need = n_bytes(a)
    folder = Path(a.dir)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    print(f"weights: {need / GIB:.1f} GiB ({a.dtype}); free disk at {folder}: {free / GIB:.1f} GiB", flush=True)
    if free < need * 1.05 + GIB:
        print(
            f"error: not enough free disk: need {need / GIB:.1f} GiB and 1 GiB spare; pass --layers fewer or "
            "--dir on a larger disk.",
            file=sys.stderr,
        )
        return 2
    try:
        t = time.perf_counter()
        build(a, folder)
        built_s = time.perf_counter() - t
        res = {"weights_gib": round(need / GIB, 2), "build_s": round(built_s, 1), **vars(a), **run(a, folder)}
    finally:
        if not a.keep:
            shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
