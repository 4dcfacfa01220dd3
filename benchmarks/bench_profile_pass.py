"""The report's natural profile pass, taken apart: each accumulator's updates alone, and the whole pass against a
Hugging Face SDPA forward (issue 47's target: the pass <= 1.2 forward passes).

    .venv/bin/python benchmarks/bench_profile_pass.py replay [--n 32] [--T 64] [--kind natural]
    .venv/bin/python benchmarks/bench_profile_pass.py ab OTHER_CHECKOUT [--rounds 3] [--kind natural] [--env K=V ...]

``replay`` runs the natural pass once (every accumulator the report feeds, ``backend="auto"``), keeping each layer's
activations as the joint reducer hands them over, then replays them into fresh accumulators in the pass's order (the
layer's attention-weight caches cleared, so the first reader pays for the map as in the pass) on one thread: each
accumulator's updates, end and result in thread CPU time (steadier than wall time on a shared machine), best of
--repeat, and the updates' critical path where a second thread takes each layer's list from its far end (the pass on a
CPU with two threads). ``ab`` times the natural pass and a plain Hugging Face forward (logits, no cache) of the same
tokens, interleaved (forward, pass, forward; the pass over the mean of the two), in this checkout and in OTHER_CHECKOUT
(a worker process each, on its own PYTHONPATH), rounds alternating: compare the ratios, never seconds across runs. Each
pass also prints how long the forward waited on the accumulators' updates; ``--env`` sets variables for the other worker
alone (``ab . --env OMP_WAIT_POLICY=passive`` compares a setting in one checkout).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup(n: int, T: int, kind: str = "natural"):
    """The model, the kind's tokens and a maker of the report's accumulators of that probe kind's pass."""
    from analysis import load_model
    from analysis.chain.massive import spike_criterion
    from analysis.core.defaults import RESID_BUDGET_MIB, SPIKE_CUT_SAMPLES
    from analysis.core.registry import PassInputs
    from analysis.report.build import SECTIONS, _Context
    from analysis.report.one_pass import chosen_analyses

    model = load_model("smollm2-135m")
    ctx = _Context(model, n, T, 0, None, list(SECTIONS))
    probe = ctx.probes[kind]
    chosen = [a for a in chosen_analyses(ctx.analyses) if a.accumulators is not None]

    def accumulators() -> dict:
        inputs = PassInputs(
            model, probe.tokens, kind, kind == "natural", probe, eps=ctx.eps, k_max=None, spike=tuple(spike_criterion(model)),
            budget_mib=RESID_BUDGET_MIB, batch_size=None, follow_up_samples=SPIKE_CUT_SAMPLES,
        )  # fmt: skip
        return {a.name: list(a.accumulators(inputs)) for a in chosen}

    return model, probe.tokens, accumulators


def _natural_pass(model, tokens, accumulators) -> float:
    from analysis.engine.passes import run_pass

    flat = [acc for group in accumulators().values() for acc in group]
    t = time.perf_counter()
    run_pass(model, tokens, flat, backend="auto")
    return time.perf_counter() - t


def _forward(model, tokens) -> float:
    from analysis.model.contract import hf_module

    t = time.perf_counter()
    with torch.inference_mode():
        hf_module(model)(input_ids=tokens, use_cache=False)
    return time.perf_counter() - t


def replay(n: int, T: int, repeat: int, kind: str) -> None:
    from analysis.engine import passes
    from analysis.engine.attention import AttentionWeights

    model, tokens, accumulators = _setup(n, T, kind)
    calls, fired = [], passes._JointReducer.fired

    def keep(self, layer, name, x):  # the layer's activations, as the reducer hands them over
        if layer not in self.done and self.required[layer] <= {*self.slot.get(layer, {}), name}:
            calls.append((layer, {**self.slot.get(layer, {}), name: x}, self.batch))
        return fired(self, layer, name, x)

    passes._JointReducer.fired = keep
    _natural_pass(model, tokens, accumulators)
    passes._JointReducer.fired = fired
    torch.set_num_threads(1)
    best: dict = collections.defaultdict(lambda: float("inf"))
    paths = []  # per repeat: the layers' critical paths on two threads (engine.passes._feed's split)
    for _ in range(repeat):
        accs = [(f"{name}[{i}] {type(a).__name__}", a) for name, g in accumulators().items() for i, a in enumerate(g)]
        accs.sort(key=lambda kv: not kv[1].reads_rows)
        took = collections.Counter()
        with torch.inference_mode():
            for layer, slot, batch in calls:
                rows = any(a.reads_rows and layer in a.hooks() for _, a in accs)
                for x in slot.values():
                    if isinstance(x, AttentionWeights):
                        x._cols = x._sums = x._full = None
                        x.share(rows)  # as the pass: the map, where one reads rows, built by its first reader
                scratch, spans = {}, []
                for key, acc in accs:
                    want = acc.hooks().get(layer)
                    if want:
                        t = time.thread_time()
                        acc.update(layer, passes.LayerActs({k: slot[v] for k, v in want.items() if v in slot}, scratch), batch)  # fmt: skip
                        spans.append(time.thread_time() - t)
                        took[key] += spans[-1]
                paths.append(_two_threads(spans))
            for key, acc in accs:
                t = time.thread_time()
                acc.end_batch(calls[-1][2], None)
                acc.result()
                took[key] += time.thread_time() - t
        for key, s in took.items():
            best[key] = min(best[key], s)
    for key, s in sorted(best.items(), key=lambda kv: -kv[1]):
        print(f"{s:7.3f} s  {key}")
    print(f"{sum(best.values()):7.3f} s  in all (thread CPU time, 1 thread, best of {repeat}; one batch of {n} x {T})")
    layers = len(calls)
    two = min(sum(paths[i : i + layers]) for i in range(0, len(paths), layers))
    print(f"{two:7.3f} s  the updates' critical path on two threads (each layer's list taken from both ends, best)")


def _two_threads(spans: list) -> float:
    """The longer of the two threads' shares of one layer's updates, this thread taking them from the front and the
    second from the far end (``engine.passes._feed``), each span as measured on one thread."""
    a = b = 0.0
    i, j = 0, len(spans) - 1
    while i <= j:
        if a <= b:
            a, i = a + spans[i], i + 1
        else:
            b, j = b + spans[j], j - 1
    return max(a, b)


def worker(n: int, T: int, kind: str) -> None:
    """Answers "fwd" or "pass" on stdin with the seconds taken and, for a pass, the seconds the forward waited on
    the accumulators' updates (``engine.passes._feed``) (``ab``'s worker)."""
    from analysis.engine import passes

    torch.set_num_threads(2)
    model, tokens, accumulators = _setup(n, T, kind)
    feed, waited = passes._feed, [0.0]

    def timed(*args):
        t = time.perf_counter()
        feed(*args)
        waited[0] += time.perf_counter() - t

    passes._feed = timed
    _forward(model, tokens), _natural_pass(model, tokens, accumulators)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        waited[0] = 0.0
        s = _forward(model, tokens) if line.strip() == "fwd" else _natural_pass(model, tokens, accumulators)
        print(f"{s:.4f} {waited[0]:.4f}", flush=True)


def ab(other: str, n: int, T: int, rounds: int, kind: str, env: list[str]) -> None:
    def start(path, extra=()):
        cmd = [sys.executable, os.path.abspath(__file__), "worker", "--n", str(n), "--T", str(T), "--kind", kind]
        extra = dict(e.split("=", 1) for e in extra)
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": path, **extra},
        )
        while p.stdout.readline().strip() != "ready":
            pass
        return p

    def ask(p, what: str) -> list[float]:
        p.stdin.write(what + "\n")
        p.stdin.flush()
        return [float(x) for x in p.stdout.readline().split()]

    workers = {
        "this": start(HERE),
        "other" + (f" ({' '.join(env)})" if env else ""): start(os.path.abspath(other), env),
    }
    ratios = collections.defaultdict(list)
    for _ in range(rounds):
        for name, p in workers.items():
            (f1, _), (s, fed), (f2, _) = ask(p, "fwd"), ask(p, "pass"), ask(p, "fwd")
            ratios[name].append(s / ((f1 + f2) / 2))
            print(
                f"{name}: forward {f1:.2f} s, pass {s:.2f} s (waiting on the updates {fed:.2f} s), forward {f2:.2f} s: "
                f"{ratios[name][-1]:.3f}",
                flush=True,
            )
    for name, r in ratios.items():
        print(f"{name}: natural pass / forward {sorted(r)[len(r) // 2]:.3f} (median of {len(r)}), best {min(r):.3f}")
    for p in workers.values():
        p.stdin.close()
        p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("replay", "ab", "worker"))
    p.add_argument("other", nargs="?", help="ab: the other checkout's root (e.g. the main branch's)")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--T", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--env", nargs="*", default=[], help="ab: KEY=VALUE set for the other worker only")
    p.add_argument("--kind", choices=("natural", "random", "repeated"), default="natural", help="the probe kind's pass")
    a = p.parse_args()
    if a.mode == "ab" and not a.other:
        p.error("ab needs the other checkout's root, e.g. /work/main.")
    if a.mode == "replay":
        replay(a.n, a.T, a.repeat, a.kind)
    elif a.mode == "worker":
        worker(a.n, a.T, a.kind)
    else:
        ab(a.other, a.n, a.T, a.rounds, a.kind, a.env)


if __name__ == "__main__":
    main()
