"""The report's value and first-key interventions on SmolLM2 through ``auto`` at a longer T: seconds of each
(its baseline pass and conditions, after a warm-up), the passes it ran and on which backends, and its time in
forward passes (the floor: a Hugging Face SDPA forward of the same tokens with logits, timed before and after it).

    .venv/bin/python benchmarks/bench_interventions.py [--T 1024] [--n 4]
    PYTHONPATH=OTHER_CHECKOUT .venv/bin/python benchmarks/bench_interventions.py ...   # the same in another checkout

Until 2026-11-29 the value removal's reads of the map and the first key's pre-rotary edit sent these passes to the
bridge, whose eager attention builds every layer's T x T map; since, both run on the Hugging Face forward.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--n", type=int, default=4)
    a = p.parse_args()
    warnings.simplefilter("ignore")
    import analysis
    from analysis import load_model
    from analysis.causal.interventions import first_key_ablation, value_ablation
    from analysis.engine.passes import pass_log
    from analysis.model.contract import hf_module
    from analysis.model.probes import model_probe_sets

    def forward() -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            hf_module(model)(input_ids=tokens, use_cache=False)
        return time.perf_counter() - t

    torch.set_num_threads(2)
    model = load_model("smollm2-135m", backend="auto")
    tokens = model_probe_sets(model, n=a.n, T=a.T, seed=0)["natural"].tokens
    runs = {"value": value_ablation, "first_key": first_key_ablation}
    print(f"{analysis.__file__}: N = {a.n}, T = {a.T}")
    for name, fn in runs.items():
        fn(model, tokens, batch_size=a.n)  # warm-up
        before = forward()
        with pass_log() as log:
            t = time.perf_counter()
            fn(model, tokens, batch_size=a.n)
            took = time.perf_counter() - t
        fwd = (before + forward()) / 2
        on = ", ".join(sorted({k.split(":")[0] for k in log}))
        print(
            f"{name:10s} {took:7.2f} s = {took / fwd:5.2f} forward passes ({fwd:.2f} s) for {sum(log.values())} passes on {on}"
        )


if __name__ == "__main__":
    main()
