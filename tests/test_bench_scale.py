"""benchmarks/bench_scale.py on a tiny random Llama on the CPU: its rows, its results and its time budget."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scale.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_scale", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_smoke_run_writes_one_row_per_measurement(bench, tmp_path, capsys):
    out = tmp_path / "scale.jsonl"
    rc = bench.main(
        [
            "--shape",
            "tiny",
            "--seq",
            "32,64",
            "--dtype",
            "float32,bfloat16",
            "--device",
            "cpu",
            "--methods",
            "forward,sink-fused,sink-streamed,massive",
            "--repeat",
            "1",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rows = _rows(out)
    builds = [r for r in rows if r["method"] == "build"]
    assert [r["dtype"] for r in builds] == ["float32", "bfloat16"] and all(r["weights_mib"] > 0 for r in builds)
    measured = [r for r in rows if r["method"] != "build"]
    assert {(r["dtype"], r["T"], r["method"]) for r in measured} == {
        (d, T, m)
        for d in ("float32", "bfloat16")
        for T in (32, 64)
        for m in ("forward", "sink-fused", "sink-streamed", "massive")
    }
    for r in measured:
        assert r["status"] == "ok" and r["tokens"] == "random" and r["batch"] == 1
        assert r["wall_s"] > 0 and r["x_forward_time"] > 0 and r["peak_mib"] > 0 and r["peak_above_mib"] >= 0
        assert {"attn", "x_forward_mem", "shape", "device"} <= set(r)
    by = {(r["dtype"], r["T"], r["method"]): r for r in measured}
    for d in ("float32", "bfloat16"):
        for T in (32, 64):
            assert by[d, T, "forward"]["attn"] == "sdpa" and by[d, T, "forward"]["x_forward_time"] == 1.0
            assert "eager" in by[d, T, "sink-streamed"]["attn"] and "fused" in by[d, T, "sink-fused"]["attn"]
            for m in ("sink-fused", "sink-streamed"):
                assert 0.0 <= by[d, T, m]["sink_1"] <= 1.0
            assert 0 < by[d, T, "sink-fused"]["mean_alpha_1"] < 1
            # the streamed path measures the same alpha as the fused one (bfloat16: to its precision)
            assert by[d, T, "sink-streamed"]["max_abs_diff_alpha_1_vs_fused"] < (1e-4 if d == "float32" else 2e-2)
            assert by[d, T, "massive"]["top_abs"] > 0
    text = capsys.readouterr().out
    assert "| float32 | 64 | 1 | sink-fused |" in text and "target <= 1.1x in both" in text
    assert "massive costs" in text and "target <= 1.5x in time and <= 1.5x in memory" in text  # issue 39's targets
    assert "cpu-flash" in by["float32", 64, "sink-fused"]["attn"]  # the kernel the table chose, named in the row


def test_budget_zero_skips_every_measurement_and_says_so(bench, tmp_path, capsys):
    out = tmp_path / "scale.jsonl"
    rc = bench.main(
        [
            "--shape",
            "tiny",
            "--seq",
            "32",
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--methods",
            "forward,sink-fused",
            "--budget-s",
            "0",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rows = _rows(out)
    assert [(r["method"], r["status"], r["reason"]) for r in rows] == [
        ("forward", "skipped", "budget"),
        ("sink-fused", "skipped", "budget"),
    ]
    text = capsys.readouterr().out
    assert (
        "skipped: the budget of 0 s had passed before 2 measurement(s): float32 T=32 forward; float32 T=32 "
        "sink-fused" in text
    )


def test_bad_options_stop_with_what_to_do(bench):
    with pytest.raises(SystemExit):
        bench.parse(["--methods", "forward,nope"])
    with pytest.raises(SystemExit):
        bench.parse(["--shape", "smollm2", "--layers", "2"])
