"""`python -m analysis sink`: the table, the JSON, and errors that say what to do."""

import json
import subprocess
import sys

import pytest
import torch

from analysis.__main__ import format_sink_table, main


def test_sink_json_on_a_local_model(tiny_llama_dir, tmp_path, capsys, device):
    out = tmp_path / "sub" / "out.json"
    assert (
        main(
            [
                "sink",
                "--model",
                str(tiny_llama_dir),
                "--n",
                "3",
                "--T",
                "12",
                "--k-max",
                "4",
                "--json",
                str(out),
                "--quiet",
                "--device",
                device,
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert set(data["inputs"]) == {"natural", "random", "repeated"}
    for kind, v in data["inputs"].items():
        assert len(v["tokens"]) == 3 and all(len(r) == 12 for r in v["tokens"])
        assert (
            len(v["per_head_alpha"]) == 4 and len(v["per_head_alpha"][0]) == 2 and len(v["per_head_alpha"][0][0]) == 4
        )
        assert len(v["sink_k_pct"]) == 4
        assert f"{kind:<10} {v['sink_k_pct'][0]:>10.2f}" in printed
    assert data["eps"] == 0.3 and data["versions"]["torch"].startswith("2.")
    assert data["inputs"]["repeated"]["tokens"][0] == [data["inputs"]["repeated"]["tokens"][0][0]] * 12


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sink", "--model", "nope"], "unknown model 'nope'"),
        (["sink", "--eps", "1.5"], "eps must lie in (0, 1)"),
        (["sink", "--k-max", "0", "--T", "8"], "--k-max must lie in [1, T=8]"),
        (["sink", "--n", "0"], "--n must be at least 1"),
        (["sink", "--T", "1"], "with one token the only query can attend to nothing else, so alpha_1 = 1"),
        (["sink", "--model", "/nonexistent"], "no such file or folder: /nonexistent"),
        (["report", "--model", "/nonexistent", "--out", "unused"], "no such file or folder: /nonexistent"),
        (["stream", "--model", "/nonexistent"], "no such file or folder: /nonexistent"),
        (["sink", "--dtype", "int8"], "--dtype must be one of float32, bfloat16, float16; got 'int8'"),
        (["report", "--dtype", "bf", "--out", "unused"], "--dtype must be one of float32, bfloat16, float16; got 'bf'"),
    ],
)
def test_bad_input_exits_2_with_advice(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_sink_in_bfloat16(tiny_llama_dir, tmp_path, capsys, device):
    out = tmp_path / "bf16.json"
    argv = [
        "sink",
        "--model",
        str(tiny_llama_dir),
        "--n",
        "3",
        "--T",
        "12",
        "--k-max",
        "4",
        "--quiet",
        "--device",
        device,
    ]
    assert main(argv + ["--dtype", "bfloat16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dtype"] == "bfloat16" and ", bfloat16" in capsys.readouterr().out.splitlines()[0]
    assert main(argv + ["--json", str(tmp_path / "fp32.json")]) == 0
    ref = json.loads((tmp_path / "fp32.json").read_text())
    assert ref["dtype"] == "float32" and ", float32" not in capsys.readouterr().out
    for kind, v in data["inputs"].items():  # the same tokens; alpha within bf16 rounding of the float32 model's
        assert v["tokens"] == ref["inputs"][kind]["tokens"]
        a, b = torch.tensor(v["per_head_alpha"]), torch.tensor(ref["inputs"][kind]["per_head_alpha"])
        assert (a - b).abs().max() < 0.05 and not torch.equal(a, b)


def test_context_too_long(tiny_llama_dir, capsys, device):
    assert main(["sink", "--model", str(tiny_llama_dir), "--T", "500", "--n", "1", "--device", device]) == 2
    assert "exceeds the context" in capsys.readouterr().err


def test_existing_json_survives_a_failed_run(tmp_path, capsys):
    out = tmp_path / "out.json"
    out.write_text('{"keep": true}')
    assert main(["sink", "--model", "nope", "--json", str(out)]) == 2
    assert json.loads(out.read_text()) == {"keep": True}


def test_module_entry_point_runs_the_embedded_model(tmp_path, device):
    out = tmp_path / "s.json"
    proc = subprocess.run(
        [sys.executable, "-m", "analysis", "sink", "--n", "4", "--json", str(out), "--quiet", "--device", device],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert format_sink_table(data) in proc.stdout
    assert data["sink_1_pct"]["natural"] > 30 and data["sink_1_pct"]["repeated"] < 5
