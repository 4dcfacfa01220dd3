"""The report's value and first-key interventions on SmolLM2 through ``auto`` at a longer T: seconds of each
(its baseline pass and conditions, after a warm-up), and the backends its passes ran on.

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
    from analysis.model.probes import model_probe_sets

    torch.set_num_threads(2)
    model = load_model("smollm2-135m", backend="auto")
    tokens = model_probe_sets(model, n=a.n, T=a.T, seed=0)["natural"].tokens
    runs = {"value": value_ablation, "first_key": first_key_ablation}
    print(f"{analysis.__file__}: N = {a.n}, T = {a.T}")
    for name, fn in runs.items():
        fn(model, tokens, batch_size=a.n)  # warm-up
        with pass_log() as log:
            t = time.perf_counter()
            fn(model, tokens, batch_size=a.n)
            took = time.perf_counter() - t
        print(f"{name:10s} {took:7.2f} s  on {', '.join(sorted({k.split(':')[0] for k in log}))}")


if __name__ == "__main__":
    main()
