"""The GPU kit's ``split`` step (issue 29): a model split by an explicit device map (blocks on the GPU, the rest
offloaded to the CPU) gives every analysis of the profile the numbers of the same model on one device.

    python scripts/gpu/split_check.py --shape smollm2 --out results/gpu/split-smollm2.json
    python scripts/gpu/split_check.py --shape llama3-8b --dtype bfloat16 --out results/gpu/split-8b.json
    python scripts/gpu/split_check.py --shape path/to/hf-folder --device cpu --offload disk --out /tmp/split.json

The second half of the blocks goes to --offload ("cpu": accelerate keeps their weights in CPU memory and runs them
on --device; "disk" on a CPU-only machine), everything else to --device. The profile (every analysis: sink, massive,
qk, key manifold, value norms, baseline, gates, resid, origin) runs on both; every number must agree to --tol
(relative). Exit 1 where one does not; the JSON names the first differences.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

CLOCK = {"seconds", "elapsed_s", "wall_s", "timings", "versions", "device", "created"}


def differences(a, b, tol: float, path: str = "") -> list[str]:
    """Where two JSON-like trees differ beyond ``tol`` (relative for numbers above 1), as 'path: a vs b'."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))[:4]}"]
        return [d for k in sorted(set(a) - CLOCK) for d in differences(a[k], b[k], tol, f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, tol, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return []
        return [] if abs(a - b) <= tol * max(1.0, abs(a)) else [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def _profile(model, n: int, T: int) -> dict:
    from analysis.model.probes import model_probe_sets
    from analysis.report.one_pass import profile

    probes = model_probe_sets(model, n=n, T=T, seed=0)
    return json.loads(json.dumps(profile(model, probes).to_dict(), default=str))


def _pair_folder(src: str, a, offload_dir: str):
    """(whole, split) loaders of a Hugging Face folder (or SmolLM2)."""
    from analysis import load_model
    from analysis.model.loading import smollm2_dir
    from analysis.model.placement import split_device_map

    folder = str(smollm2_dir()) if src == "smollm2" else src
    name = "smollm2-135m" if src == "smollm2" else src
    n_layers = json.loads((Path(folder) / "config.json").read_text())["num_hidden_layers"]
    dm = split_device_map(folder, {l: a.offload for l in range(n_layers // 2, n_layers)}, default=a.device)
    return (
        lambda: load_model(name, device=a.device, dtype=a.dtype),
        lambda: load_model(name, dtype=a.dtype, device_map=dm, offload_folder=offload_dir),
        dm,
    )


def _pair_random(shape: str, a, offload_dir: str):
    """(whole, split) of a random Llama shape of bench_scale.py, built once on the CPU (the same weights both times)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_scale  # the shapes and their tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    from analysis.model.loading import bridge_hf
    from analysis.model.placement import split_device_map

    tok = bench_scale.random_shape_tokenizer()
    spec = dict(bench_scale.SHAPES[shape])
    theta = spec.pop("rope_theta")
    spec["vocab_size"] = spec["vocab_size"] or len(tok)
    spec["num_hidden_layers"] = a.layers or spec["num_hidden_layers"]
    cfg = LlamaConfig(
        **spec,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, a.dtype)).eval()
    n_layers = cfg.num_hidden_layers
    dm = split_device_map(hf, {l: a.offload for l in range(n_layers // 2, n_layers)}, default=a.device)
    return (
        lambda: bridge_hf(copy.deepcopy(hf).to(a.device), tokenizer=tok, name=shape, device=a.device),
        lambda: bridge_hf(hf, tokenizer=tok, name=shape, device_map=dm, offload_folder=offload_dir),
        dm,
    )


def run(a) -> dict:
    offload_dir = tempfile.mkdtemp(prefix="split-check-")
    whole_fn, split_fn, dm = (_pair_random if a.shape in ("llama3-8b", "tiny") else _pair_folder)(
        a.shape, a, offload_dir
    )
    out = {
        "shape": a.shape,
        "device": a.device,
        "offload": a.offload,
        "dtype": a.dtype,
        "n": a.n,
        "T": a.T,
        "device_map": {k: str(v) for k, v in dm.items()},
    }
    for name, fn in (("whole", whole_fn), ("split", split_fn)):
        t = time.perf_counter()
        model = fn()
        out[f"{name}_load_s"] = round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        out[f"{name}_profile"] = _profile(model, a.n, a.T)
        out[f"{name}_profile_s"] = round(time.perf_counter() - t, 1)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    diffs = differences(out["whole_profile"], out["split_profile"], a.tol)
    out["n_differences"], out["differences"] = len(diffs), diffs[:20]
    out["sink_1_pct"] = {
        k: v["sink_k_pct"][0]
        for k, v in out["split_profile"].get("results", {}).items()
        if isinstance(v, dict) and v.get("sink_k_pct")
    }
    return out


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2", help="smollm2, llama3-8b, tiny, or a Hugging Face folder")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--offload", default="cpu", choices=["cpu", "disk"], help="where the second half of the blocks go")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int, default=None, help="keep this many blocks of a random shape")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--T", type=int, default=64)
    p.add_argument("--tol", type=float, default=1e-6)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    res = run(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(
        f"{a.shape}: whole {res['whole_profile_s']} s, split ({a.device} + {a.offload}) {res['split_profile_s']} s; "
        f"Sink_1 {res['sink_1_pct']}; {res['n_differences']} numbers differ beyond {a.tol:g}"
    )
    for d in res["differences"][:5]:
        print("  ", d)
    return 1 if res["n_differences"] else 0


if __name__ == "__main__":
    sys.exit(main())
