"""The interface a researcher meets (issue 30): errors before the work, one validation layer for the API and the CLI, a
visible BOS, devices and the network, one command-line vocabulary, short reprs, findings that agree."""

from __future__ import annotations

import json
import socket
import time
import warnings
from pathlib import Path

import pytest
import torch

from analysis.core import io
from analysis.__main__ import build_parser, main
from analysis.model.probes import random_probe, text_probe
from analysis.sinks.metric import sink_metric

T1_MESSAGE = "T (--T, tokens per sequence) must be at least 2; got 1."


def _no_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the bad input was refused")


@pytest.fixture
def paths(tmp_path, monkeypatch):
    """FILE (a file) and DIR (a folder) in the working folder, as the issue's commands name them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "DIR").mkdir()
    return tmp_path


# ---- 1. Check before you compute -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sink", "--json", "FILE/x.json"], "--json FILE/x.json: FILE is a file, not a folder"),
        (["sink", "--json", "DIR"], "--json DIR: it exists and is a folder"),
        (["report", "--out", "FILE/sub"], "--out FILE/sub: FILE is a file, not a folder"),
        (["report", "--out", "FILE"], "--out FILE: it exists and is a file"),
        (["stream", "--json", "FILE/x.json"], "--json FILE/x.json: FILE is a file, not a folder"),
        (["stream", "--csv", "DIR"], "--csv DIR: it exists and is a folder"),
        (["sinks", "--text", "FILE", "--json", "DIR"], "--json DIR: it exists and is a folder"),
    ],
)
def test_bad_output_paths_stop_before_the_model_loads(argv, message, paths, monkeypatch, capsys):
    monkeypatch.setattr("analysis.model.loading.load_model", _no_load)  # the CLI imports it once the options pass
    monkeypatch.setattr("analysis.streaming.run.streaming_perplexity", _no_load)
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and message in out.err and len(out.err.strip().splitlines()) == 1


def test_unwritable_folder_is_refused(paths, monkeypatch, capsys):
    monkeypatch.setattr("analysis.model.loading.load_model", _no_load)  # the CLI imports it once the options pass
    monkeypatch.setattr("analysis.core.paths.os.access", lambda path, mode: False)  # root may write anywhere
    assert main(["sink", "--json", "DIR/x.json"]) == 2
    assert "--json DIR/x.json: the folder DIR is not writable" in capsys.readouterr().err


def test_results_printed_before_a_failed_write_which_keeps_the_old_file(
    tiny_llama_dir, paths, monkeypatch, capsys, device
):
    old = paths / "out.json"
    old.write_text('{"keep": true}')
    real = io.write_json

    def fail_there(path, payload, **kw):
        if Path(path) == old:
            raise OSError(28, "No space left on device")
        return real(path, payload, **kw)

    monkeypatch.setattr(io, "write_json", fail_there)
    argv = ["sink", "--model", str(tiny_llama_dir), "--n", "2", "--T", "8", "--quiet", "--device", device]
    assert main(argv + ["--json", str(old)]) == 1
    out = capsys.readouterr()
    assert "natural" in out.out and "Sink_1 (%)" in out.out  # the table came first
    assert json.loads(old.read_text()) == {"keep": True}
    assert "what it held before is unchanged" in out.err and "No space left on device" in out.err
    spare = Path(out.err.split("written to ")[1].split(" instead")[0])
    data = json.loads(spare.read_text())
    assert data["model"] == str(tiny_llama_dir) and data["device"].startswith(device) and data["dtype"] == "float32"


# ---- 2. One validation layer --------------------------------------------------------------------------------------


def test_api_refuses_T1_with_the_cli_message(tiny_llama, capsys):
    tokens = random_probe(tiny_llama.tokenizer, n=2, T=8).tokens
    with pytest.raises(ValueError) as api:
        sink_metric(tiny_llama, tokens[:, :1])
    assert main(["sink", "--T", "1"]) == 2
    cli_err = capsys.readouterr().err.strip().removeprefix("error: ")
    assert str(api.value) == cli_err and T1_MESSAGE in cli_err


@pytest.mark.parametrize(
    "bad, hint",
    [
        ("the cat sat", "got a string. Tokenize it first"),
        (["the cat sat", "on the mat"], "got a list of strings"),
        ("probe", "got a ProbeSet: pass its .tokens"),
    ],
)
def test_text_and_probe_sets_say_what_to_pass(tiny_llama, bad, hint):
    if bad == "probe":
        bad = random_probe(tiny_llama.tokenizer, n=2, T=8)
    with pytest.raises(ValueError, match="tokens must be token ids") as e:
        sink_metric(tiny_llama, bad)
    assert hint in str(e.value)


# ---- 3. The BOS made visible ---------------------------------------------------------------------------------------


def test_results_record_the_bos_and_note_one_not_asked_for(tiny_llama):
    tok = tiny_llama.tokenizer
    plain = random_probe(tok, n=2, T=8).tokens
    res = sink_metric(tiny_llama, plain)
    assert res.meta["bos"]["starts_with_bos"] == 0.0 and "No sequence starts with the tokenizer's BOS" in res.text()
    with_bos = random_probe(tok, n=2, T=8, bos=True).tokens  # as model.to_tokens(text) would give
    res = sink_metric(tiny_llama, with_bos)
    assert res.meta["bos"] == {"bos_id": tok.bos_token_id, "bos_token": tok.bos_token, "starts_with_bos": 1.0}
    assert "Every sequence starts with the tokenizer's BOS" in res.text() and "Note: no BOS was asked for" in res.text()
    assert res.to_dict()["bos"]["starts_with_bos"] == 1.0


def test_natural_probe_with_and_without_bos_draws_the_same_windows(tiny_llama):
    tok = tiny_llama.tokenizer
    texts = [" ".join(f"w{(7 * i + j) % 90}" for j in range(40)) for i in range(10)]
    a, b = text_probe(tok, texts, n=6, T=12), text_probe(tok, texts, n=6, T=12, bos=True)
    assert torch.equal(b.tokens[:, 0], torch.full((6,), tok.bos_token_id))
    assert torch.equal(a.tokens[:, :-1], b.tokens[:, 1:])


def test_text_probe_says_when_it_repeats_windows(tiny_llama):
    text = " ".join(f"w{i}" for i in range(14))  # 14 tokens: 7 windows of 8
    with pytest.warns(UserWarning, match="repeat windows"):
        p = text_probe(tiny_llama.tokenizer, [text], T=8)
    assert p.n == 100 and p.meta["distinct_windows"] == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text_probe(tiny_llama.tokenizer, [text], n=5, T=8)  # 5 distinct windows: nothing to say


def test_load_model_documents_the_bridge_bos():
    from analysis import load_model

    assert "add_bos_token" in load_model.__doc__ and "prepend_bos=False" in load_model.__doc__


# ---- 4. Devices and network ---------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", [["sink"], ["report", "--out", "unused"], ["stream"], ["sinks", "--text", "FILE"]])
def test_cuda_without_cuda_is_an_error(command, paths, monkeypatch, capsys):
    monkeypatch.setattr("analysis.model.loading.load_model", _no_load)  # the CLI imports it once the options pass
    assert main(command + ["--device", "cuda"]) == 2
    assert "--device cuda: CUDA is not available here" in capsys.readouterr().err


def test_hub_id_offline_fails_fast_after_one_try(monkeypatch, capsys):
    tries = []

    def refuse(*args, **kwargs):
        tries.append(args)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    t0 = time.perf_counter()
    assert main(["sink", "--model", "gpt2"]) == 2  # looks like a hub id: tried as one
    err = capsys.readouterr().err
    assert time.perf_counter() - t0 < 10 and 1 <= len(tries) <= 2
    assert "unknown model 'gpt2'" in err and "HF_HUB_OFFLINE" in err and "local Hugging Face folder" in err
    assert len(err.strip().splitlines()) == 1


def test_near_miss_names_get_did_you_mean(capsys):
    assert main(["sink", "--model", "SmolLM2-135M"]) == 2
    assert "unknown model 'SmolLM2-135M'; did you mean 'smollm2-135m'?" in capsys.readouterr().err


# ---- 5. One command-line vocabulary ----------------------------------------------------------------------------------

COMMON = ["--model", "--n", "--T", "--seed", "--eps", "--bos", "--device", "--dtype", "--threads", "--quiet"]


def _options(command: str) -> dict:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {a.option_strings[0]: a for a in sub._actions if a.option_strings and a.option_strings[0] != "-h"}


def test_shared_options_have_one_default_and_help_everywhere():
    by_command = {c: _options(c) for c in ("sink", "report", "sinks", "stream")}
    assert set(COMMON) <= set(by_command["sink"]) and set(COMMON) <= set(by_command["report"])
    for flag in COMMON:
        takers = [opts[flag] for opts in by_command.values() if flag in opts]
        assert len({a.help for a in takers}) == 1, flag
        if flag != "--n":  # sink: the paper's 100; report: the 32 its published numbers were measured on
            assert len({a.default for a in takers}) == 1, flag
    assert by_command["sink"]["--n"].default == 100 and by_command["report"]["--n"].default == 32
    for c in ("sinks", "stream"):
        assert {"--model", "--device", "--dtype", "--threads", "--quiet"} <= set(by_command[c])


@pytest.mark.parametrize("command", ["sink", "report", "sinks", "stream"])
def test_help_shows_the_defaults(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--model MODEL" in out and "(default: smollm2-135m)" in out and "(default: float32)" in out


def test_report_takes_eps_and_bos_and_flags_are_named(paths, monkeypatch, capsys):
    monkeypatch.setattr("analysis.model.loading.load_model", _no_load)  # the CLI imports it once the options pass
    assert main(["report", "--out", "r", "--eps", "1.5"]) == 2
    assert "--eps must lie in (0, 1)" in capsys.readouterr().err
    assert main(["report", "--out", "r", "--T", "1"]) == 2
    assert "T (--T, tokens per sequence) must be at least 4" in capsys.readouterr().err
    assert main(["sinks", "--text", "FILE", "--max-tokens", "1"]) == 2
    assert "--max-tokens must be at least 2" in capsys.readouterr().err
    args = build_parser().parse_args(["report", "--out", "r", "--eps", "0.5", "--bos"])
    assert args.eps == 0.5 and args.bos


# ---- 6. Short reprs --------------------------------------------------------------------------------------------------


def test_reprs_are_one_or_two_lines(tiny_llama):
    from analysis.positions.every_sink import sink_positions

    tokens = random_probe(tiny_llama.tokenizer, n=4, T=16).tokens
    res = sink_metric(tiny_llama, tokens, kind="random")
    pos = sink_positions(tiny_llama, tokens)
    for r in (res, pos, random_probe(tiny_llama.tokenizer, n=4, T=16)):
        text = repr(r)
        assert len(text.splitlines()) <= 2 and len(text) < 400 and "tensor(" not in text, text
    assert repr(res).startswith("<SinkResult model=") and "N=4, T=16" in repr(res) and "Sink_1" in repr(res)
    assert repr(pos).startswith("<SinkPositions model=")


# ---- 7. Findings that agree ------------------------------------------------------------------------------------------


def test_findings_of_a_model_without_a_sink_agree(family_bridge, tmp_path, monkeypatch):
    """A tiny random Qwen2 has no sink: no finding contradicts another, none shows NaN, and one massive-activation
    criterion serves every section."""
    from analysis.report.build import build_report

    monkeypatch.setattr("analysis.report.html.figure_html", lambda fig, caption="", dpi=90: "")
    model = family_bridge("qwen2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_report(
            model,
            tmp_path,
            n=3,
            T=16,
            sections=("sink", "massive", "norm_gain", "interventions", "positions", "context"),
        )
    data = json.loads((tmp_path / "report.json").read_text())
    found = [s for link in data["findings"] for s in [link["headline"], *link["details"]]]
    text = " ".join(found)
    assert data["sections"]["sink"]["sink_1_pct"]["natural"] == 0.0
    assert "nan" not in text.lower() and "12-12" not in text
    assert "is the only sink" not in text and "no position but the first token" not in text
    crit = data["config"]["criteria"]["massive_activation"]
    assert crit.startswith(">= 50x") and "1000x" not in text
    assert all(crit in s for s in found if "passes" in s)
    assert data["config"]["device"] and data["config"]["dtype"] == "float32" and data["config"]["bos"] is False
