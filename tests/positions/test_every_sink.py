"""Sinks at any position: alpha_k of every key against Hugging Face eager attention (both paths), the sink table
against the positions above eps, the residual-stream columns, the ``sinks`` command and its bad inputs."""

import json
import warnings

import numpy as np
import pytest
import torch

from analysis import natural_probe
from analysis.positions.every_sink import SinkPositions, _first_run, sink_positions
from tests.conftest import tol

TOL = 1e-5


def hf_alpha_every_key(hf, tokens) -> torch.Tensor:
    """alpha_k of every key (N, L_attn, H, T), by hand from HF eager attention: column sums of each map over the
    queries that see the key (i >= k), divided by their number T - k."""
    with torch.no_grad():
        att = [a for a in hf(tokens, output_attentions=True, use_cache=False).attentions if a is not None]
    T = tokens.shape[1]
    return torch.stack([a.double().tril().sum(-2) / (T - torch.arange(T)) for a in att], 1).float()


def expected_rows(alpha: torch.Tensor, eps: float, n_measured: int) -> dict:
    """{(sample, position): [(layer index, head)]} of every key above eps among the measured ones."""
    out: dict = {}
    for s, l, h, k in (alpha[..., :n_measured] > eps).nonzero().tolist():
        out.setdefault((s, k), []).append((l, h))
    return out


def assert_table_is_the_positions_above_eps(res: SinkPositions, alpha: torch.Tensor, atol: float = TOL) -> None:
    want = expected_rows(alpha, res.eps, res.n_measured)
    df = res.sinks
    got = {(r.sample, r.position): sorted(r.heads) for r in df.itertuples()}
    assert got == {k: sorted((res.layers[l], h) for l, h in v) for k, v in want.items()}
    for r in df.itertuples():  # each head's share of attention is its alpha
        assert r.alpha == pytest.approx(
            [float(alpha[r.sample, res.layers.index(l), h, r.position]) for l, h in r.heads], abs=atol
        )


@pytest.fixture(scope="module")
def smollm2_hf():
    from transformers import AutoModelForCausalLM

    from analysis.model.loading import smollm2_dir

    return AutoModelForCausalLM.from_pretrained(smollm2_dir(), attn_implementation="eager", dtype=torch.float32).eval()


def test_smollm2_every_position_equals_hf_eager_on_both_paths(smollm2, smollm2_hf, device):
    tokens = natural_probe(smollm2.tokenizer, n=3, T=64, seed=4).tokens
    ref = hf_alpha_every_key(smollm2_hf, tokens)  # on the CPU
    atol = tol(device, TOL)
    fused = sink_positions(smollm2, tokens)
    eager = sink_positions(smollm2, tokens, path="eager")
    assert (fused.meta["path"], eager.meta["path"]) == ("fused", "eager")
    for res in (fused, eager):
        assert res.alpha.shape == (3, 30, 9, 64)
        assert (res.alpha - ref).abs().max() < atol
        assert_table_is_the_positions_above_eps(res, ref, atol)
    # The residual-stream columns come from the same pass on either path.
    torch.testing.assert_close(fused.cos_first, eager.cos_first, atol=1e-4, rtol=0)
    assert torch.equal(fused.peak_dim, eager.peak_dim)
    assert fused.flagged[["sample", "position", "dim"]].equals(eager.flagged[["sample", "position", "dim"]])
    # The first token sinks in most heads and carries dim 507; a later position sinks too on natural text.
    first = fused.sinks.set_index(["sample", "position"])
    assert all(first.loc[(s, 0)].n_heads > 100 and 507 in first.loc[(s, 0)].massive_dims for s in range(3))
    assert (fused.sinks.position > 0).any()
    assert fused.to_dict()["sinks"][0]["heads"][0] == list(fused.sinks.heads.iloc[0][0])


def test_cosine_to_the_first_token_by_hand(smollm2, device):
    tokens = natural_probe(smollm2.tokenizer, n=2, T=24, seed=1).tokens
    res = sink_positions(smollm2, tokens)
    _, cache = smollm2.run_with_cache(tokens.to(device), names_filter=lambda n: n.endswith("hook_resid_post"))
    for l in (0, 5, 29):
        h = cache[f"blocks.{l}.hook_resid_post"].cpu()
        cos = torch.nn.functional.cosine_similarity(h, h[:, :1].expand_as(h), dim=-1)
        torch.testing.assert_close(res.cos_first[:, l], cos, atol=1e-4, rtol=0)
        peak = h.abs().max(-1)
        torch.testing.assert_close(res.peak_abs[:, l], peak.values, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3_next", "gemma2", "gpt_oss"])
def test_tiny_family_every_position_equals_hf_eager(family, family_dir, family_bridge, device):
    """GQA (llama), a sliding window shorter than T (mistral), a hybrid (qwen3_next), soft-capping (gemma2) and
    learned sink logits (gpt_oss), on both paths."""
    from transformers import AutoModelForCausalLM

    model = family_bridge(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(
            family_dir(family), attn_implementation="eager", dtype=torch.float32
        ).eval()
    tokens = torch.randint(3, 96, (3, 20), generator=torch.Generator().manual_seed(5))
    ref = hf_alpha_every_key(hf, tokens)
    for path in ("auto", "eager", "fused"):
        res = sink_positions(model, tokens, eps=0.1, path=path)
        assert res.meta["path"] == ("eager" if path == "eager" else "fused")
        assert res.layers == list(model.family.attention_layers)
        assert (res.alpha - ref).abs().max() < tol(device, TOL)
        assert_table_is_the_positions_above_eps(res, ref, tol(device, TOL))


def test_first_run_of_aligned_layers():
    aligned = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool).T[
        None
    ]  # (1, R=5, T=3)
    created, life = _first_run(aligned)
    assert created.tolist() == [[1, -1, 0]] and life.tolist() == [[2, 0, 5]]


def test_bad_inputs(tiny_llama):
    tokens = torch.randint(3, 90, (1, 12))
    with pytest.raises(ValueError, match=r"eps must lie in \(0, 1\)"):
        sink_positions(tiny_llama, tokens, eps=1.0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        sink_positions(tiny_llama, tokens[:, :1])
    with pytest.raises(ValueError, match=r"min_queries \(--min-queries\) must lie in \[1, T=12\]"):
        sink_positions(tiny_llama, tokens, min_queries=13)
    with pytest.raises(ValueError, match=r"cos_min must lie in \(-1, 1\)"):
        sink_positions(tiny_llama, tokens, cos_min=1.5)
    with pytest.raises(ValueError, match="exceeds the model's context of 128"):
        sink_positions(tiny_llama, torch.randint(3, 90, (1, 129)))


# ----------------------------------------------------------------------------------------------
# python -m analysis sinks
# ----------------------------------------------------------------------------------------------


def _words(n: int) -> str:
    return " ".join(f"w{3 + i % 90}" for i in range(n))


def test_sinks_command_on_a_text_file(tiny_llama_dir, tmp_path, capsys, no_network, device):
    from analysis.__main__ import main

    text, out = tmp_path / "t.txt", tmp_path / "out" / "sinks.json"
    text.write_text(_words(40))
    assert (
        main(
            [
                "sinks",
                "--model",
                str(tiny_llama_dir),
                "--text",
                str(text),
                "--json",
                str(out),
                "--eps",
                "0.05",
                "--bos",
                "--quiet",
                "--device",
                device,
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["n_tokens"] == 41 and data["bos"] and data["eps"] == 0.05
    assert data["sinks"], "the BOS of a random model draws more than 5% of some head's attention"
    for r in data["sinks"]:
        assert {"position", "token", "heads"} <= set(r) and all(len(h) == 2 for h in r["heads"])
        assert 0 <= r["position"] < 41 - data["min_queries"] + 1
    assert data["sinks"][0]["position"] == 0 and data["sinks"][0]["token"] == "<s>"
    assert f"{data['sinks'][0]['n_heads']:>5}" in printed and data["text"] in printed


@pytest.mark.parametrize(
    "content, argv, message",
    [
        (None, [], "no text file"),
        ("", [], "is empty"),
        ("  \n", [], "is empty"),
        (_words(200), [], "more than the model's context of 128: pass --max-tokens 128"),
        (_words(20), ["--eps", "0"], "eps must lie in (0, 1)"),
        (_words(20), ["--eps", "1.5"], "eps must lie in (0, 1)"),
        ("w5", [], "give at least 2"),
    ],
)
def test_sinks_command_bad_input(content, argv, message, tiny_llama_dir, tmp_path, capsys, device):
    from analysis.__main__ import main

    text = tmp_path / "t.txt"
    if content is not None:
        text.write_text(content)
    out = tmp_path / "o.json"
    assert (
        main(
            [
                "sinks",
                "--model",
                str(tiny_llama_dir),
                "--text",
                str(text),
                "--json",
                str(out),
                "--quiet",
                "--device",
                device,
                *argv,
            ]
        )
        == 2
    )
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_sinks_command_max_tokens_keeps_the_start(tiny_llama_dir, tmp_path, capsys, device):
    from analysis.__main__ import main

    text, out = tmp_path / "t.txt", tmp_path / "o.json"
    text.write_text(_words(200))
    assert (
        main(
            [
                "sinks",
                "--model",
                str(tiny_llama_dir),
                "--text",
                str(text),
                "--json",
                str(out),
                "--quiet",
                "--max-tokens",
                "128",
                "--eps",
                "0.05",
                "--device",
                device,
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["n_tokens"] == 128


def test_per_seed_tables_by_hand(smollm2, tiny_llama):
    """Notebook 11's per-seed tables, against the alpha, cosine and activation tensors read by hand; on a model with
    no sink at all, sentences and no table."""
    from analysis.positions.every_sink import later_sink_tokens, later_sinks_by_seed, massive_by_seed, secondary_by_seed

    runs = {
        s: sink_positions(smollm2, natural_probe(smollm2.tokenizer, n=4, T=32, seed=s).tokens, ratio_threshold=100.0)
        for s in (0, 3)
    }
    summary, text = later_sinks_by_seed(runs)
    secondary, _ = secondary_by_seed(runs)
    massive, text_massive = massive_by_seed(runs)
    count: dict = {}
    for seed, r in runs.items():
        later = r.sink_mask()[..., 1:].any(1).any(1)  # (N, T - 1): a later position that sinks in some head
        assert summary.loc[seed, "Sink_1 (%)"] == pytest.approx(float((r.alpha[..., 0] > r.eps).float().mean() * 100))
        assert summary.loc[seed, "sequences with a later sink"] == later.any(1).float().mean().item()
        where = [(s, k + 1) for s, k in later.nonzero().tolist()]
        aligned = [(r.cos_first[s, :, k] > r.cos_min).any().item() for s, k in where]
        assert secondary.loc[seed, "later sinks aligned"] == pytest.approx(np.mean(aligned))
        ratio = r.peak_abs / r.median[..., None]  # (N, R, T): a position is flagged where some layer passes both
        flagged = [((r.peak_abs[s, :, k] > 100) & (ratio[s, :, k] >= 100)).any().item() for s, k in where]
        assert massive.loc[seed, "massive at 100x"] == pytest.approx(np.mean(flagged))
        for s, k in where:
            tok = r.token(r.tokens[s, k])
            count[tok] = count.get(tok, 0) + 1
    tokens, per_token = later_sink_tokens(runs, top=3)
    assert tokens.xs("n_positions", axis=1, level=1).sum(axis=1).tolist() == sorted(count.values(), reverse=True)[:3]
    assert per_token.startswith(repr(tokens.index[0])) and "heads, in layers" in per_token
    assert "of the sequences have a sink besides the first token" in text and "on dim 507" in text_massive
    # A random tiny Llama: nothing sinks after the first token (nor on it), so every table is a sentence.
    none = {
        s: sink_positions(tiny_llama, torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(s)))
        for s in (0, 1)
    }
    texts = [later_sinks_by_seed(none)[1]] + [f(none) for f in (later_sink_tokens, secondary_by_seed, massive_by_seed)]
    assert all(not len(t) for t, _ in texts[1:]) and "nan" not in " ".join(t for _, t in texts[1:]).lower()
    assert all(t.startswith("No position after the first sinks on any of the 2 probe seeds") for _, t in texts[1:])
    assert texts[0].startswith("In ") and "no token to list" in texts[1][1]
    with pytest.raises(TypeError, match="sink_positions result"):
        later_sinks_by_seed({0: summary})
