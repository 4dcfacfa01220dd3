"""The ground truth of the sink's kind (issue 50): the broadcast task's data (the nop task is the bigram-copy task,
tested in test_data.py), and the six committed models (``nop-task-s0..s2``, ``broadcast-task-s0..s2``) loaded by
name, each showing a sink of its known kind.

Cheap: the data tests draw a few hundred sequences (under 1 s); each model test is one probe of 100 x 64 tokens
through a 1-layer model, a sink pass, a value-norm pass and a forward pass per sink head. The file took 48 s of wall
time (23 s of CPU) on the shared 2-core machine at load 15, 4-8 s per model after the first's imports.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.chain.values import value_norms
from analysis.model.loading import REFERENCE_DIR, load_model, model_names
from analysis.model.probes import task_probe_sets
from analysis.model.reference.data import SyntheticBroadcast, build_data
from analysis.sinks.metric import sink_metric
from analysis.train import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (0, 1, 2)
DATASET = {"nop": "synthetic", "broadcast": "synthetic-broadcast"}
# Sink_1 (%) at least: a nop model's heads park on BOS wherever they copy nothing (100% measured); a broadcast
# model's heads read the topic on most queries (59-98% measured)
SINK_MIN = {"nop": 50.0, "broadcast": 50.0}
SINK_HEAD_ALPHA = 0.3  # a sink head: mean alpha_1 over the probe above the sink threshold


def task(dataset, **kw):
    return build_data(TrainConfig(dataset=dataset, **{"synthetic_vocab": 32, **kw}), 64)


def test_broadcast_sequences_open_with_a_topic_whose_permutation_every_position_follows():
    data = task("synthetic-broadcast", synthetic_topics=4, synthetic_noise=0.2)
    assert isinstance(data, SyntheticBroadcast) and data.vocab_size == 37 and not data.starts_with_fixed_token()
    x = data.batch(0, 512).inputs.numpy()
    assert set(np.unique(x[:, 0])) == {33, 34, 35, 36} and (x[:, 1:] <= 32).all() and (x[:, 1:] >= 1).all()
    topic = x[:, 0] - 33
    hit = data.perms[topic][np.arange(512)[:, None], x[:, 1:-1]] == x[:, 2:]
    assert 0.78 < hit.mean() < 0.84
    wrong = data.perms[(topic + 1) % 4][np.arange(512)[:, None], x[:, 1:-1]] == x[:, 2:]
    assert wrong.mean() < 0.1  # another topic's permutation does not predict: the topic is needed
    for k in range(4):  # the counts of the tokens say nothing of the topic: uniform under every topic
        counts = np.bincount(x[topic == k, 1:].ravel(), minlength=33)[1:]
        assert counts.min() > 0.75 * counts.mean() and counts.max() < 1.25 * counts.mean()


def test_broadcast_batches_are_a_function_of_seed_and_step():
    dataset = "synthetic-broadcast"
    a, b = task(dataset, seed=1), task(dataset, seed=1)
    assert torch.equal(a.batch(5, 8).inputs, b.batch(5, 8).inputs)
    assert not torch.equal(a.batch(5, 8).inputs, a.batch(6, 8).inputs)
    assert not torch.equal(a.batch(5, 8).inputs, task(dataset, seed=2).batch(5, 8).inputs)
    batch = a.batch(5, 8)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    assert torch.equal(a.probe(10, 64), b.probe(10, 64)) and not torch.equal(a.probe(8, 64), batch.inputs)


def test_the_broadcast_task_refuses_options_it_cannot_honour():
    with pytest.raises(ValueError, match="sets its own first token"):
        task("synthetic-broadcast", fixed_token_position=1)
    with pytest.raises(ValueError, match="synthetic_vocab"):
        task("synthetic-broadcast", synthetic_vocab=1)
    with pytest.raises(ValueError, match="synthetic_noise"):
        TrainConfig(dataset="synthetic-broadcast", synthetic_noise=1.5)


def _kind_traces(name):
    """Sink_1, and per sink head: |v_1| / mean |v_j|, the cosine of v_1 across sequences, and the loss added when
    each sequence's first value is swapped for another's in that head alone."""
    model = load_model(name)
    probe = task_probe_sets(model, n=100, T=64)["natural"].tokens
    res = sink_metric(model, probe)
    vn = value_norms(model, probe, sink=res)
    heads = [h for h in range(model.cfg.n_heads) if float(res.alpha[:, 0, h, 0].mean()) > SINK_HEAD_ALPHA]
    with torch.no_grad():
        base = float(model(probe, return_type="loss"))
    swap = {}
    for h in heads:

        def roll(v, hook, h=h):
            v = v.clone()
            v[:, 0, h] = v[:, 0, h].roll(1, 0)
            return v

        with torch.no_grad():
            loss = model.run_with_hooks(probe, return_type="loss", fwd_hooks=[("blocks.0.attn.hook_v", roll)])
        swap[h] = float(loss) - base
    return res.sink_rate(1), heads, vn, swap


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["nop", "broadcast"])
def test_the_ground_truth_models_show_a_sink_of_their_kind(kind, seed):
    name = f"{kind}-task-s{seed}"
    assert name in model_names()
    sink, heads, vn, swap = _kind_traces(name)
    assert sink >= SINK_MIN[kind] and heads, (sink, heads)
    for h in heads:
        ratio, cos = float(vn.ratio[0, h]), float(vn.v1_cos_pair[0, h])
        if kind == "nop":  # a small first value, the same in every sequence (BOS): nothing to broadcast
            assert ratio < 0.3 and abs(swap[h]) < 0.01, (h, ratio, swap[h])
        else:  # a large first value that differs between sequences and that every query needs
            assert ratio > 1.0 and cos < 0.6 and swap[h] > 0.2, (h, ratio, cos, swap[h])


def test_the_committed_ground_truth_models_keep_their_command_and_log():
    for kind in ("nop", "broadcast"):
        for seed in SEEDS:
            d = REFERENCE_DIR / f"{kind}-task-s{seed}"
            cfg = json.loads((d / "config.json").read_text())
            assert cfg["train"]["dataset"] == DATASET[kind] and cfg["train"]["seed"] == seed
            assert (d / "command.txt").read_text().startswith(f"python -m analysis.train --preset {kind}")
            log = [json.loads(line) for line in (d / "train_log.jsonl").read_text().splitlines()]
            assert log[-1]["step"] == cfg["train"]["steps"]
