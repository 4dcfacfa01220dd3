"""analysis.quant: fake quantisers, the packed low-bit KV cache, the conditions against the sink on SmolLM2 at a tiny
setting, and bad input before any work."""

from __future__ import annotations

import math

import pytest
import torch

from analysis.quant.calibrate import calibrate, mean_nll
from analysis.quant.kv_cache import LowBitCache, PackedKV, pack_codes, unpack_codes
from analysis.quant.passes import Scheme
from analysis.quant.quantizers import fake_quant, qmax, quant_activation, token_scale
from analysis.quant.sites import linear_sites
from analysis.streaming.backbone import causal_lm
from tests.conftest import assert_refused_before_work


def test_fake_quant_error_is_bounded_by_half_the_scale():
    x = torch.randn(4, 16, 32) * 5
    for bits in (8, 4):
        s = token_scale(x, bits)
        err = (fake_quant(x, s, bits) - x).abs()
        assert (err <= s / 2 + 1e-6).all()
        assert len(torch.unique(fake_quant(x, s, bits)[0, 0] / s[0, 0])) <= 2 * qmax(bits) + 2
    keep = torch.zeros(4, 16, dtype=torch.bool)
    keep[:, 0] = True
    out = quant_activation(x, 4, float(x.abs().max()) / 7, keep)
    assert torch.equal(out[:, 0], x[:, 0]) and not torch.equal(out[:, 1], x[:, 1])


def test_packed_codes_round_trip_and_hold_fewer_bytes():
    c = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(c, 4), 4), c)
    c2 = torch.randint(0, 4, (3, 64), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(c2, 2), 2), c2)
    x = torch.randn(1, 2, 10, 64)
    p = PackedKV(x, 4)
    assert p.codes.dtype == torch.uint8 and p.nbytes < x.numel() * x.element_size() / 4
    assert ((p.dequantize() - x).abs() <= p.scale.float() / 2 + 1e-3).all()


def test_real_low_bit_cache_holds_fewer_bytes_and_keeps_sinks(tiny_llama):
    ids = torch.randint(3, 90, (1, 40))
    L = tiny_llama.cfg.n_layers
    outs, sizes = {}, {}
    for name, bits, fp in (("fp", None, ()), ("int4", 4, ()), ("int4+sinks", 4, (0, 1, 2, 3)), ("int2", 2, ())):
        cache = LowBitCache(L, bits, fp)
        with torch.no_grad(), causal_lm(tiny_llama) as hf:  # the model's own module, in its own attention
            outs[name] = hf(input_ids=ids, cache=cache, use_cache=True).logits
        sizes[name] = cache.kv_bytes()
    assert sizes["int2"] < sizes["int4"] < sizes["int4+sinks"] < sizes["fp"]
    assert sizes["int4"] < sizes["fp"] / 4
    err4, err2 = ((outs[k] - outs["fp"]).abs().mean() for k in ("int4", "int2"))
    assert 0 < err4 < err2


def test_linear_sites_reach_every_decoder_linear(tiny_llama):
    sites = linear_sites(tiny_llama)
    assert {s.name for s in sites} >= {"mlp.down_proj", "self_attn.q_proj"}
    assert len(sites) == 7 * tiny_llama.cfg.n_layers
    w = tiny_llama.blocks[0].mlp.original_component.down_proj.weight  # the bridge's own weights: hooked, not copied
    assert any(p is w for s in sites for p, _ in s.weights)


def test_unreachable_linears_and_bad_bits_are_refused_before_work(tiny_llama_dir):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from analysis.model.loading import bridge_hf
    from analysis.quant import quant_study

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=32))
    with pytest.raises(ValueError, match="cannot reach the linear layers"):  # GPT-2's maps are Conv1D, not nn.Linear
        linear_sites(bridge_hf(gpt2, tokenizer=AutoTokenizer.from_pretrained(tiny_llama_dir), device="cpu"))
    with pytest.raises(ValueError, match="activation bits"):
        quant_study("no-such-model", a_bits=(3,))
    with pytest.raises(ValueError, match="granularity"):
        quant_study("no-such-model", granularities=("group",))
    with pytest.raises(ValueError, match="packed KV cache"):
        LowBitCache(2, 3)


def test_prefix_beyond_context_and_short_calibration_are_refused():
    from analysis import load_model
    from analysis.quant import quant_study

    model = load_model("synthetic-softmax", device="cpu")
    with pytest.raises(ValueError, match="exceed the context"):
        quant_study(model, T=60, prefix_len=8, kv_bits=())
    with pytest.raises(ValueError, match="shorter than one window"):
        quant_study(model, T=32, calib_tokens=16, kv_bits=())


def test_cli_bad_bits_exit_2(capsys):
    from analysis.__main__ import main

    assert main(["quant", "--act-bits", "3"]) == 2
    assert "activation bits" in capsys.readouterr().err


def test_smollm2_static_per_tensor_against_the_sink(smollm2):
    """The first token's spike sets the per-tensor scales: int4 per-tensor static is worse than per-token dynamic,
    and keeping the first token in full precision (and out of calibration) makes the static scheme better."""
    from analysis.streaming.corpus import stdlib_stream

    tok = smollm2.tokenizer
    sites = linear_sites(smollm2)  # hooked in the model's own module, which the passes run in its own attention
    w = stdlib_stream(tok, 3 * 32, seed=0).tokens.view(3, 32)
    ev, cal = w[:2], w[2:]
    keep_cal = torch.zeros(cal.shape, dtype=torch.bool)
    keep_cal[:, 0] = True
    keep_ev = torch.zeros(ev.shape, dtype=torch.bool)
    keep_ev[:, 0] = True
    as_is = calibrate(smollm2, sites, cal)
    kept = calibrate(smollm2, sites, cal, keep=keep_cal)
    top = max(as_is.values(), key=lambda s: s.absmax)
    assert top.position == 0 and top.linear == "mlp.down_proj"
    assert max(s.absmax for s in kept.values()) < top.absmax / 3
    static = mean_nll(smollm2, sites, ev, Scheme(4, "tensor"), scales=as_is)
    dynamic = mean_nll(smollm2, sites, ev, Scheme(4, "token"))
    static_kept = mean_nll(smollm2, sites, ev, Scheme(4, "tensor"), scales=kept, keep=keep_ev)
    assert static > dynamic
    assert static_kept < static
    assert math.isfinite(static_kept)
    from analysis.quant.study import layer_scales  # every layer's largest scale (notebook 14's figure)

    lay = layer_scales(as_is)
    assert list(lay.layer) == sorted({s.layer for s in sites}) and lay.absmax.max() == top.absmax
    assert lay.site[lay.absmax.idxmax()] == top.site


def _committed():
    from pathlib import Path

    from analysis.quant.study import load_run

    return load_run(Path(__file__).resolve().parents[2] / "data" / "quant" / "smollm2-135m.json")


def test_committed_tables_read_in_fixed_notation_with_readable_tokens():
    """Issue 37 (notebook 14): perplexities print as 54.61 and 12,377,257, not 5.461217e+01; the byte token of seed
    1's scale prints escaped (' \\xe2\\x94'), not as '\ufffd', in its column and in the origin's sentence."""
    from transformers import AutoTokenizer

    from analysis.model.loading import smollm2_dir
    from analysis.quant.study import fixed_notation, seed_spread, with_tokens

    run = _committed()
    spread = seed_spread(run)
    assert "e+" in spread.to_string()  # pandas' own print of these magnitudes
    shown = fixed_notation(spread)
    assert "e+" not in shown.to_string() and "e-" not in shown.to_string()
    assert shown.ppl.iloc[0] == "54.61" and shown.ppl.iloc[2] == "12,377,257" and shown.seeds.iloc[0] == 3
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    sc = with_tokens(run["scales"], tok)
    assert "\ufffd" in "".join(run["scales"].origin)  # as committed
    assert not any("\ufffd" in t for t in [*sc.token, *sc.origin])
    assert "token ' \\xe2\\x94'" in "".join(sc.origin[sc.token_id == 44220])


def test_quant_figures_draw_the_seeds_spread_and_the_spike_blocks():
    """Issue 37 (notebook 14): one bar per scheme and condition with the seeds' range as error bars; the per-layer
    largest scale with the writing and erasing blocks marked."""
    import matplotlib.pyplot as plt
    import pandas as pd

    from analysis.figures.quantization import plot_layer_scales, plot_quant_ppl
    from analysis.quant.study import seed_spread

    spread = seed_spread(_committed())
    fig = plot_quant_ppl(spread, fp_ppl=23.8)
    ax = fig.axes[0]
    assert len(ax.patches) == len(spread) and len(ax.containers) == 2 * spread.condition.nunique()  # bars, error bars
    err = next(c for c in ax.containers if hasattr(c, "lines"))  # the first condition's error bars
    lo, hi = err.lines[2][0].get_segments()[0][:, 1]  # the first scheme's: the seeds' min to max
    assert (lo, hi) == pytest.approx((spread.ppl_min.iloc[0], spread.ppl_max.iloc[0]))
    plt.close(fig)
    lay = pd.DataFrame(
        {"layer": range(6), "absmax": [5.0, 90, 6, 2900, 7, 450], "site": [f"{l}.mlp.down_proj" for l in range(6)]}
    )
    fig = plot_layer_scales({"as is": lay}, writers=[1, 3], erasers=[5])
    ax = fig.axes[0]
    assert len(ax.patches) == 3 and len(ax.lines) == 1  # three marked blocks, one condition
    assert [t.get_text() for t in ax.texts] == ["3.mlp.down_proj: |x| = 2,900", "5.mlp.down_proj: |x| = 450"]
    plt.close(fig)


def _quant_calls():
    from analysis.quant import quant_study
    from analysis.quant.calibrate import find_prefix
    from analysis.quant.kv_study import kv_table
    from analysis.quant.run import check_setting
    from analysis.quant.windows import make_windows

    w = torch.randint(3, 90, (2, 8))
    return {
        "quant_study": lambda m: quant_study(m, T=8, calib_tokens=8),
        "linear_sites": linear_sites,
        "calibrate": lambda m: calibrate(m, [], w),
        "mean_nll": lambda m: mean_nll(m, [], w, Scheme(None)),
        "find_prefix": lambda m: find_prefix(m, [], w, [5], 1),
        "kv_table": lambda m: kv_table(m, w, w > 0),
        "make_windows": lambda m: make_windows(m, None, T=8, n_eval=1, calib_tokens=8, seed=0),
        "check_setting": lambda m: check_setting(m, T=8, prefix_len=0, kv_bits=()),
    }


def test_a_name_or_a_bare_hf_model_is_refused_before_any_work(tiny_llama, tiny_llama_dir):
    """The 0.1.0 call forms are gone: every quant function takes what load_model returns, and says so in one line."""
    bare = tiny_llama.original_model
    assert_refused_before_work(_quant_calls(), (str(tiny_llama_dir), bare), bare)


def test_cli_backend_nnsight_is_refused_with_its_reason(capsys):
    """`quant --backend` runs its analysis passes; the quantised passes hook the local module, which nnsight lacks."""
    from analysis.__main__ import main

    assert main(["quant", "--backend", "nnsight"]) == 2
    err = capsys.readouterr().err
    assert "--backend nnsight does not apply to quant" in err and "transformer_lens" in err
