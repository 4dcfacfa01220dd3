"""Trainer: loss goes down, schedule, resume (in-process and after SIGKILL), DDP, checkpoints, CLI."""

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from analysis.train import CheckpointError, ModelConfig, TrainConfig, load_reference, train
from analysis.train.cli import main
from analysis.train.presets import build_configs
from analysis.train.trainer import lr_at

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TINY_MODEL = dict(n_ctx=16, d_model=32, n_layers=1, n_heads=2, d_mlp=64)
TINY_TRAIN = dict(
    dataset="synthetic",
    synthetic_vocab=16,
    batch_size=8,
    steps=12,
    lr=1e-2,
    warmup_steps=2,
    log_every=2,
    eval_every=6,
    probe_size=8,
    probe_len=16,
    checkpoint_every=0,
    progress=False,
    device="cpu",
)  # "auto" would train on a GPU (bf16) where one is: a test opts in with device=


def tiny(out=None, **kw):
    m = {k: v for k, v in kw.items() if k in ModelConfig.__dataclass_fields__}
    t = {k: v for k, v in kw.items() if k not in m}
    return ModelConfig(**{**TINY_MODEL, **m}), TrainConfig(**{**TINY_TRAIN, "out": out and str(out), **t})


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    return e


def test_a_few_steps_lower_the_loss(device):
    res = train(*tiny(steps=40, eval_every=0, device=device))
    losses = [r["loss"] for r in res.log]
    assert losses[-1] < losses[0] - 0.5, losses
    assert res.final["step"] == 40 and "sink_1" in res.final  # final evaluation always runs


def test_lr_schedule():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, steps=110, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0) and lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)
    const = TrainConfig(lr=4e-4, warmup_steps=100, steps=20000, schedule="constant")
    assert lr_at(50, const) == pytest.approx(4e-4 * 51 / 100) and lr_at(5000, const) == 4e-4


def test_weight_decay_groups():
    from analysis.model.reference.sink_lm import SinkLM
    from analysis.train.trainer import param_groups

    model = SinkLM(ModelConfig(**TINY_MODEL))
    groups, names = param_groups(model, TrainConfig(decay_all_params=False, weight_decay=0.1))
    decayed = set(names[: len(groups[0]["params"])])
    assert "blocks.0.attn.W_Q" in decayed and "blocks.0.ln1.w" not in decayed
    assert groups[1]["weight_decay"] == 0.0
    groups, names = param_groups(model, TrainConfig(decay_all_params=True, weight_decay=0.1))
    assert len(groups) == 1 and "blocks.0.ln1.w" in names


def test_run_folder_and_load_reference(tmp_path):
    out = tmp_path / "run"
    res = train(*tiny(out, attention="sigmoid"), command="python -m analysis.train --test")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["format"] == "attention-sinks-reference" and cfg["model"]["attention"] == "sigmoid"
    assert cfg["attention_kernel"] == {"kernel": "eager"}  # recorded: auto on the CPU trains eagerly, no fallback
    assert (out / "command.txt").read_text().strip() == "python -m analysis.train --test"
    log = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4, 6, 8, 10, 12]
    assert {"loss", "lr", "tokens_per_s", "grad_norm"} <= set(log[0])
    assert {"sink_1", "resid_norm_ratio", "value_norm_ratio"} <= set(log[2])  # eval at step 6
    model = load_reference(out, device="cpu")
    assert not model.training and model.tokenizer is None
    tokens = torch.randint(0, 17, (2, 16))
    torch.testing.assert_close(model(tokens), res.model(tokens))
    assert load_reference(out / "model.safetensors", dtype="bfloat16").dtype == torch.bfloat16


def weights(path):
    return load_file(str(path))


@pytest.mark.cpu_only  # bitwise-equal resume: CUDA kernels (atomics in the backward pass) are not deterministic
def test_resume_equals_uninterrupted(tmp_path):
    full = train(*tiny(tmp_path / "a", checkpoint_every=4))
    m, t = tiny(tmp_path / "b", checkpoint_every=4)
    train(m, t, _stop_after=6)  # "killed" after step 6: the last checkpoint is step 4
    assert json.loads((tmp_path / "b/checkpoints/latest.json").read_text())["step"] == 4
    with pytest.raises(ValueError, match="--resume"):
        train(m, t)
    t.resume = True
    resumed = train(m, t)
    a, b = weights(tmp_path / "a/model.safetensors"), weights(tmp_path / "b/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log_a = [json.loads(l) for l in (tmp_path / "a/train_log.jsonl").read_text().splitlines()]
    log_b = [json.loads(l) for l in (tmp_path / "b/train_log.jsonl").read_text().splitlines()]
    strip = lambda log: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in log]  # noqa
    assert strip(log_a) == strip(log_b)
    assert resumed.final["loss"] == full.final["loss"]


@pytest.mark.cpu_only  # bitwise-equal resume: CUDA kernels (atomics in the backward pass) are not deterministic
def test_resume_after_sigkill_equals_uninterrupted(tmp_path):
    args = [
        "--preset",
        "synthetic",
        "--n-ctx",
        "16",
        "--d-model",
        "32",
        "--n-heads",
        "2",
        "--d-mlp",
        "64",
        "--synthetic-vocab",
        "16",
        "--batch-size",
        "8",
        "--steps",
        "120",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "2",
        "--n",
        "8",
        "--T",
        "16",
        "--quiet",
        "--device",
        "cpu",
    ]
    subprocess.run(
        [PY, "-m", "analysis.train", *args, "--out", str(tmp_path / "a")],
        check=True,
        env=env(),
        cwd=ROOT,
        capture_output=True,
    )
    proc = subprocess.Popen(
        [PY, "-m", "analysis.train", *args, "--out", str(tmp_path / "b")],
        env=env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    latest = tmp_path / "b/checkpoints/latest.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if json.loads(latest.read_text())["step"] >= 10:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "b/model.safetensors").exists(), "the run finished before it could be killed"
    done = subprocess.run(
        [PY, "-m", "analysis.train", *args, "--out", str(tmp_path / "b"), "--resume"],
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    a, b = weights(tmp_path / "a/model.safetensors"), weights(tmp_path / "b/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.cpu_only  # torchrun with gloo on 2 CPU processes: one GPU cannot host two NCCL ranks
def test_ddp_two_processes_equal_one_process(tmp_path):
    """torchrun with 2 CPU processes (gloo) takes the same steps as one process on the same global batch. The "--"
    after the module ends torchrun's own options: without it torchrun takes ``--n`` for an abbreviation of its
    ``--nnodes`` and refuses it as ambiguous."""
    args = [
        "--preset",
        "synthetic",
        "--n-ctx",
        "16",
        "--d-model",
        "32",
        "--n-heads",
        "2",
        "--d-mlp",
        "64",
        "--synthetic-vocab",
        "16",
        "--batch-size",
        "8",
        "--steps",
        "4",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "2",
        "--n",
        "8",
        "--T",
        "16",
        "--quiet",
        "--device",
        "cpu",
    ]
    one = subprocess.run(
        [PY, "-m", "analysis.train", *args, "--out", str(tmp_path / "one")],
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    with socket.socket() as sock:  # a free port for the rendezvous on localhost
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    two = subprocess.run(
        [
            PY,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "-m",
            "analysis.train",
            "--",
            *args,
            "--out",
            str(tmp_path / "two"),
        ],
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = weights(tmp_path / "one/model.safetensors"), weights(tmp_path / "two/model.safetensors")
    init = train(*tiny(steps=1, lr=1e-9, eval_every=0)).model.state_dict()
    moved = sum(float((a[k] - init[k]).abs().sum()) for k in a)
    assert moved > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-6, rtol=1e-5, msg=k)
    la = [json.loads(l)["loss"] for l in (tmp_path / "one/train_log.jsonl").read_text().splitlines()]
    lb = [json.loads(l)["loss"] for l in (tmp_path / "two/train_log.jsonl").read_text().splitlines()]
    assert la == pytest.approx(lb, abs=1e-4)


@pytest.mark.cpu_only  # equal to 2e-6: fp32 on the CPU (on CUDA "auto" trains in bf16)
def test_gradient_accumulation_equals_full_batch():
    full = train(*tiny(steps=3, eval_every=0)).model.state_dict()
    accum = train(*tiny(steps=3, eval_every=0, micro_batch_size=2)).model.state_dict()
    for k in full:
        torch.testing.assert_close(full[k], accum[k], atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(__import__("shutil").which("cc") is None, reason="torch.compile on CPU needs a C compiler")
@pytest.mark.cpu_only  # the same steps to 1e-5 as eager: fp32 on the CPU (on CUDA "auto" trains in bf16)
def test_torch_compile_takes_the_same_steps():
    eager = train(*tiny(steps=2, eval_every=0)).model.state_dict()
    compiled = train(*tiny(steps=2, eval_every=0, compile=True)).model.state_dict()
    for k in eager:
        torch.testing.assert_close(eager[k], compiled[k], atol=1e-5, rtol=1e-4)


def test_corrupt_and_mismatched_checkpoints_give_clear_errors(tmp_path):
    m, t = tiny(tmp_path / "r", checkpoint_every=4)
    train(m, t, _stop_after=4)
    ckpt = tmp_path / "r/checkpoints/step-0000004"
    t.resume = True
    # a different model on resume
    with pytest.raises(CheckpointError, match="d_model"):
        train(ModelConfig(**{**TINY_MODEL, "d_model": 64}), t)
    # a truncated weight file
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        train(m, t)
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        train(m, t)


def test_load_reference_errors(tmp_path):
    out = tmp_path / "ref"
    train(*tiny(out, steps=2, eval_every=0))
    with pytest.raises(CheckpointError, match="not a folder"):
        load_reference(tmp_path / "missing")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "model": {**cfg["model"], "d_model": 48, "d_head": 24}}))
    with pytest.raises(CheckpointError, match="do not match the model configuration"):
        load_reference(out)
    (out / "config.json").write_text(json.dumps({**cfg, "format": "something-else"}))
    with pytest.raises(CheckpointError, match="format"):
        load_reference(out)
    (out / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_reference(out)


def test_checkpoints_never_unpickle(tmp_path, monkeypatch):
    out = tmp_path / "r"
    m, t = tiny(out, checkpoint_every=2)
    train(m, t, _stop_after=4)

    def forbidden(*a, **k):
        raise AssertionError("pickle-based loading used")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    t.resume = True
    train(m, t)
    load_reference(out)
    src = "".join(p.read_text() for p in (ROOT / "analysis/train").glob("*.py"))
    assert "torch.load" not in src and "import pickle" not in src


def test_cli_presets_and_overrides(capsys):
    m, t = build_configs("paper-60m", {"attention": "sigmoid", "lr": 8e-4})
    assert (m.n_layers, m.d_model, m.n_heads, m.d_mlp, m.n_ctx) == (10, 768, 8, 1536, 2048)
    assert (m.attention, t.lr, t.schedule, t.warmup_steps, t.weight_decay, t.grad_clip) == (
        "sigmoid",
        8e-4,
        "constant",
        100,
        0.1,
        1.0,
    )
    assert (t.beta1, t.beta2, m.normalization_type, m.positional_embedding_type, m.norm_position) == (
        0.9,
        0.95,
        "RMS",
        "rotary",
        "pre",
    )
    with torch.device("meta"):
        from analysis.train import SinkLM

        model = SinkLM(ModelConfig(**{**m.to_dict(), "d_vocab": 50277}))
    assert 55e6 < model.n_params(non_embedding=True) < 65e6  # the paper's "60M"
    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert "sigmoid" in listed and "paper-60m" in listed
    assert main(["--preset", "synthetic", "--attention", "sigmoidd", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "sigmoidd" in err and "softmax" in err
    with pytest.raises(SystemExit):
        main(["--no-such-option", "1"])


def test_natural_deep_preset_runs_a_few_steps_on_cpu(tmp_path):
    """The GPU preset's architecture, on the offline corpus with a small window and batch."""
    out = tmp_path / "deep"
    assert (
        main(
            [
                "--preset",
                "natural-deep",
                "--dataset",
                "stdlib",
                "--tokenizer",
                "bpe",
                "--tokenizer-vocab-size",
                "512",
                "--corpus-max-chars",
                "200000",
                "--n-ctx",
                "64",
                "--batch-size",
                "2",
                "--micro-batch-size",
                "1",
                "--steps",
                "2",
                "--n",
                "4",
                "--T",
                "32",
                "--warmup-steps",
                "1",
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    model = load_reference(out)
    assert model.cfg.n_layers == 8 and model.cfg.d_model == 512 and model.tokenizer is not None
    ids = model.to_tokens("Return the attention sink.")
    assert model.to_string(ids[0]).endswith("Return the attention sink.")
    cmd = (out / "command.txt").read_text()
    assert cmd.startswith("python -m analysis train --preset natural-deep")


def test_tiny_cpu_preset_builds_its_data(tmp_path):
    m, t = build_configs(
        "tiny-cpu",
        {
            "steps": 2,
            "corpus_max_chars": 200_000,
            "tokenizer_vocab_size": 512,
            "out": str(tmp_path / "t"),
            "progress": False,
            "probe_size": 4,
        },
    )
    res = train(m, t)
    assert res.model.cfg.d_vocab == len(res.model.tokenizer) and res.final["step"] == 2


def test_sweep_writes_one_table(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = [
        "sweep",
        "--preset",
        "synthetic",
        "--attention",
        "softmax,sigmoid",
        "--lr",
        "1e-2",
        "--weight-decay",
        "0.1,0",
        "--n-ctx",
        "16",
        "--d-model",
        "32",
        "--n-heads",
        "2",
        "--d-mlp",
        "64",
        "--synthetic-vocab",
        "16",
        "--batch-size",
        "4",
        "--steps",
        "3",
        "--n",
        "4",
        "--T",
        "16",
        "--quiet",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    import pandas as pd

    table = pd.read_csv(out / "sweep.csv")
    assert len(table) == 4 and set(table.attention) == {"softmax", "sigmoid"}
    assert table.sink_1.notna().all() and table.loss.notna().all() and (table.seed == 0).all()
    assert "sigmoid" in printed and "sink_1" in printed
    run = out / "attention-softmax_weight-decay-0.1_seed-0"
    before = (run / "model.safetensors").stat().st_mtime_ns
    assert main(argv) == 0  # a rerun skips finished runs
    assert (run / "model.safetensors").stat().st_mtime_ns == before
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary) == 4 and (summary.n_seeds == 1).all() and "sink_1_mean" in summary
    curves = pd.read_csv(out / "curves.csv")
    assert set(curves.step) == {3} and len(curves) == 4
    assert (out / "command.txt").read_text().startswith("python -m analysis sweep")


def test_snapshots_keep_the_weights_along_training(tmp_path):
    from analysis.model.reference.config import snapshot_steps

    assert snapshot_steps("log:4", 1000) == [10, 46, 215, 1000]
    assert snapshot_steps("3,1, 12", 12) == [1, 3, 12] and snapshot_steps(None, 12) == []
    for bad in ("log:1", "log:x", "0,5", "5,13", "a,b"):
        with pytest.raises(ValueError, match="snapshot"):
            TrainConfig(steps=12, snapshots=bad)
    out = tmp_path / "run"
    res = train(*tiny(out, snapshots="3,8"))
    kept = sorted(p.name for p in (out / "snapshots").iterdir())
    assert kept == ["step-0000003", "step-0000008"]
    snap = load_reference(out / "snapshots" / "step-0000008", device="cpu")
    assert snap.reference_config["step"] == 8 and "sink_1" in snap.reference_config["final"]  # evaluated there
    tokens = torch.randint(0, 17, (2, 16))
    assert not torch.equal(snap(tokens), res.model(tokens))  # step 8's weights, not the final ones
    log = [json.loads(l) for l in (out / "train_log.jsonl").read_text().splitlines()]
    assert {r["step"] for r in log if "sink_1" in r} == {3, 6, 8, 12}
