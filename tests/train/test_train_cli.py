"""`python -m analysis.train` checks before it works, as the analysis command line does (issue 37): bad input exits 2
with one line that says what to do, before any data is prepared, and nothing already written is touched; the
trained model is never thrown away."""

import pytest
import torch

from analysis.train.cli import _parser, main
from analysis.train.presets import build_configs

TINY = [
    "--preset",
    "synthetic",
    "--n-ctx",
    "16",
    "--d-model",
    "16",
    "--n-heads",
    "2",
    "--d-mlp",
    "32",
    "--synthetic-vocab",
    "16",
    "--batch-size",
    "4",
    "--steps",
    "2",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "0",
    "--n",
    "4",
    "--T",
    "16",
    "--quiet",
    "--device",
    "cpu",
]


def _no_training(*args, **kwargs):
    raise AssertionError("training started before the bad input was refused")


@pytest.fixture
def refused(monkeypatch, capsys):
    """main(argv) must exit 2, before training starts, with one line on stderr; returns that line."""
    monkeypatch.setattr("analysis.train.trainer.train", _no_training)

    def run(argv):
        assert main(argv) == 2
        out = capsys.readouterr()
        assert len(out.err.strip().splitlines()) == 1, out.err
        return out.err

    return run


def test_an_out_under_a_file_is_refused(refused, tmp_path):
    (tmp_path / "README.md").write_text("x")
    err = refused(["--preset", "tiny-cpu", "--out", str(tmp_path / "README.md/x")])
    assert "--out" in err and "README.md is a file, not a folder" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused(refused, tmp_path):
    err = refused(["--preset", "tiny-cpu", "--device", "cuda", "--out", str(tmp_path / "run")])
    assert "--device cuda: CUDA is not available here" in err and "--device cpu" in err
    assert not (tmp_path / "run").exists()


def test_an_out_holding_a_run_is_refused_and_kept(refused, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").write_text('{"step": 1}\n')
    err = refused([*TINY, "--out", str(run)])
    assert "already holds a run (train_log.jsonl); pass --resume to continue it" in err
    assert (run / "train_log.jsonl").read_text() == '{"step": 1}\n' and [p.name for p in run.iterdir()] == [
        "train_log.jsonl"
    ]


def test_a_sweep_without_out_and_a_bad_config_are_one_line(refused):
    assert "--out DIR is required" in refused(["sweep", "--seed", "0,1"])
    assert "sigmoidd" in refused([*TINY, "--attention", "sigmoidd"])


def test_eps_is_the_sink_threshold_and_norm_eps_the_norms(refused, tmp_path):
    err = refused([*TINY, "--eps", "1e-5", "--out", str(tmp_path / "r")])
    assert "--eps is the sink threshold" in err and "--norm-eps" in err
    ns = vars(_parser().parse_args(["--norm-eps", "1e-5", "--eps", "0.2"]))
    ns.pop("list"), ns.pop("preset"), ns.pop("threads")
    m, t = build_configs(None, ns)
    assert (m.eps, t.sink_eps) == (1e-5, 0.2)


def test_without_out_the_model_goes_to_a_named_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(TINY) == 0
    assert "no --out given: the run is written to runs/synthetic-softmax-seed0" in capsys.readouterr().out
    assert (tmp_path / "runs/synthetic-softmax-seed0/model.safetensors").is_file()
    assert main(TINY) == 2  # the same command again: refused, the first model kept
    assert "already holds a run" in capsys.readouterr().err
