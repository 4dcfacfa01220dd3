"""One owner per fact (#38): thresholds that change a finding live in ``analysis/core/defaults.py``; a factory and its
public function write their Parameters once (``analysis.core.docs``); the results that stood outside the protocol
(``ActivationMap``, ``PolicyRun``, ``FirstTokenStats``, ``mechanism_chain``, ``window_sink_rates``, ``chain_links``)
keep it, and their old access (a dict, a pair, ``to_dict()``'s keys) still works."""

from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from analysis.core.docs import fill_parameters, parameter_entries, share_parameters
from analysis.core.results import Result

ROOT = Path(__file__).resolve().parents[2] / "analysis"

# Module constants outside core/ that are numbers but do not change a finding, each with its reason. A new numeric
# constant goes to analysis/core/defaults.py, or here with a reason.
PLUMBING = {
    "causal/conditions.py:LOSS_ROWS": "sequences per chunk of the streamed loss: memory, not the number",
    "engine/kernels.py:FLASH_MAX_HEAD_DIM": "the flash kernel's own limit",
    "engine/attention.py:COLUMNS_KEPT": "key columns a layer keeps for its reductions to share: memory",
    "engine/remote.py:REQUEST_LIMIT_BYTES": "NDIF's message size",
    "engine/remote.py:REQUEST_FILL": "how full a remote request is planned",
    "engine/remote.py:CAND_ROWS_PER_SAMPLE": "the size budget of a remote request",
    "model/loading.py:HUB_TIMEOUT_S": "a network timeout",
    "model/reference/checkpoint.py:FORMAT_VERSION": "the checkpoint file format",
    "model/reference/kernels.py:FLEX_MIN_HEAD_DIM": "flex attention's own limit",
    "model/reference/data.py:KEY_RANK": "how the synthetic task is built (a data set, not a threshold)",
    "train/cli.py:NORM_EPS_MAX": "the bound of an input check",
    # Grids of conditions a study runs (what is measured, named in its tables and chosen on the command line), not
    # thresholds: a finding is stated per bit width.
    "quant/kv_cache.py:KV_BITS": "the KV study's bit widths (a grid of conditions)",
    "quant/quantizers.py:ACT_BITS": "the quantization study's bit widths (a grid of conditions)",
    "quant/quantizers.py:WEIGHT_BITS": "the quantization study's bit widths (a grid of conditions)",
}


def _is_number(node: ast.AST) -> bool:
    """A literal number, a signed or computed one (``32 * 2**20``), or a tuple / list of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _is_number(node.operand)
    if isinstance(node, ast.BinOp):
        return _is_number(node.left) and _is_number(node.right)
    if isinstance(node, (ast.Tuple, ast.List)):
        return bool(node.elts) and all(_is_number(e) for e in node.elts)
    return False


def numeric_constants(tree: ast.Module) -> list[str]:
    """The UPPER_CASE module constants of a module whose value is a number (or numbers)."""
    out = []
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        value = getattr(node, "value", None)
        for t in targets:
            if (
                isinstance(t, ast.Name)
                and re.fullmatch(r"_?[A-Z][A-Z0-9_]*", t.id)
                and value is not None
                and _is_number(value)
            ):
                out.append(t.id)
    return out


def test_the_constant_scan_sees_numbers_and_leaves_the_rest():
    tree = ast.parse(
        "A = 1\nB: float = -0.3\nC = 32 * 2**20\nD = (0.1, 0.2)\nE = 'x'\nF = True\nlower = 2\n"
        "G = None\nH = ('a', 1)\n_I = 4\n"
    )
    assert numeric_constants(tree) == ["A", "B", "C", "D", "_I"]


def test_thresholds_live_in_defaults():
    found = {
        f"{p.relative_to(ROOT).as_posix()}:{name}"
        for p in sorted(ROOT.rglob("*.py"))
        if p.relative_to(ROOT).parts[0] != "core"
        for name in numeric_constants(ast.parse(p.read_text()))
    }
    outside = sorted(found - set(PLUMBING))
    assert not outside, (
        "numeric module constants outside analysis/core/defaults.py: move each threshold there "
        "(named and documented; the module imports it) or, if it changes no finding, add it to "
        f"PLUMBING here with its reason: {outside}"
    )
    stale = sorted(set(PLUMBING) - found)
    assert not stale, f"PLUMBING names constants that are gone: {stale}"


def test_moved_thresholds_keep_their_module_names_and_values():
    from analysis.core import defaults as d
    from analysis.causal import conditions, dormant_result, writer_cuts
    from analysis.chain import first_token_cause, key_manifold, qk
    from analysis.dynamics import compare, formation
    from analysis.positions import context_length

    assert (conditions.K_MAX, writer_cuts.N_RANDOM, dormant_result.DORMANT_LAYER_RHO) == (4, 3, -0.3)
    assert (first_token_cause.MAX_NEURONS, first_token_cause.DIVERGED, qk.N_BINS) == (8, 0.3, 40)
    assert (key_manifold.DEFAULT_N_COMPONENTS, key_manifold.VARIANCE_LEVEL, key_manifold.SAME_POINT) == (0.9, 0.9, 1e-6)
    assert (context_length.BARBERO_EPS, context_length.EPS_GRID[0], compare.SPIKE_RATIO_SMALL) == (0.8, 0.1, 100.0)
    onsets = {c.link: c.threshold for c in formation.ONSETS}
    assert onsets["sink_1"] == d.SINK_ONSET_PCT == 10.0 and formation.SPIKE_RATIO_FOLLOW == 20.0


# ----------------------------------------------------------------------------------------------
# Parameter docs written once
# ----------------------------------------------------------------------------------------------


def _written_entries(fn: ast.FunctionDef) -> set[str]:
    """The Parameters entries of a function's docstring as written in the source, those of two lines or more."""
    return {"\n".join(body) for _, body in parameter_entries(ast.get_docstring(fn)) if len(body) >= 2}


def _factories_and_functions():
    """(module path, factory, function) for every accumulator factory (a module function whose return annotation
    names an Accumulator) and each function of its module that calls it."""
    for p in sorted(ROOT.rglob("*.py")):
        funcs = [n for n in ast.parse(p.read_text()).body if isinstance(n, ast.FunctionDef)]
        for fac in funcs:
            if fac.returns is None or "Accumulator" not in ast.unparse(fac.returns):
                continue
            for fn in funcs:
                calls = {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
                if fn is not fac and fac.name in calls:
                    yield p.relative_to(ROOT).as_posix(), fac, fn


def test_no_parameters_block_is_copied_between_a_factory_and_its_function():
    pairs = list(_factories_and_functions())
    assert {(p, a.name) for p, a, _ in pairs} >= {
        ("chain/massive.py", "massive_accumulator"),
        ("chain/key_manifold.py", "key_manifold_accumulator"),
        ("chain/norm_gain.py", "norm_gain_accumulator"),
    }
    copied = {f"{p}: {a.name} ~ {b.name}": sorted(_written_entries(a) & _written_entries(b)) for p, a, b in pairs}
    copied = {k: v for k, v in copied.items() if v}
    assert not copied, (
        "Parameters entries written twice, in a factory and its function: name them in the factory "
        f"over 'As in :func:`function`.' and decorate the function with share_parameters: {copied}"
    )


def test_a_factory_shows_its_functions_entries_in_full():
    from analysis.chain.key_manifold import first_key_manifold, key_manifold_accumulator
    from analysis.chain.massive import massive_accumulator, massive_activations
    from analysis.chain.norm_gain import norm_gain_accumulator, norm_gain_trace

    for fac, fn in (
        (massive_accumulator, massive_activations),
        (key_manifold_accumulator, first_key_manifold),
        (norm_gain_accumulator, norm_gain_trace),
    ):
        doc = inspect.getdoc(fac)
        assert "As in :func:" not in doc
        shared = [
            body
            for names, body in parameter_entries(fn.__doc__)
            if "scatter_heads" in names or "median_over" in names or "spike_dims" in names
        ]
        assert shared and all("\n".join(body) in doc for body in shared), fac.__name__
        documented = {n for names, _ in parameter_entries(doc) for n in names}
        assert documented == set(inspect.signature(fac).parameters), fac.__name__


def test_share_parameters_fills_the_group_and_refuses_what_it_cannot():
    def factory(model, k, *, extra=1):
        """Build it.

        Parameters
        ----------
        extra : int
            Its own.
        model, k
            As in :func:`public`.

        Returns
        -------
        None
        """

    @share_parameters(factory)
    def public(model, k):
        """Run it.

        Parameters
        ----------
        model
            A model.
        k : int
            The key,
            on two lines.

        Returns
        -------
        None
        """

    assert [n for n, _ in parameter_entries(factory.__doc__)] == [["model"], ["k"], ["extra"]]  # signature order
    assert "\nk : int\n    The key,\n    on two lines.\nextra : int\n    Its own.\n\nReturns" in inspect.getdoc(factory)

    def lacking(model):
        """No group.

        Parameters
        ----------
        model
            A model.
        """

    with pytest.raises(ValueError, match="no group of names"):
        fill_parameters(lacking, public)

    def asks_more(model, q):
        """More.

        Parameters
        ----------
        model, q
            As in :func:`public`.
        """

    with pytest.raises(ValueError, match=r"do not document \['q'\]"):
        fill_parameters(asks_more, public)


# ----------------------------------------------------------------------------------------------
# The six results that stood outside the protocol
# ----------------------------------------------------------------------------------------------

SENTENCE = re.compile(r"^[A-Z0-9].*[.!?]$", re.S)
N, T = 4, 16


def keeps_the_protocol(r) -> None:
    """What ``tests/report/test_protocol.py`` asks of every result."""
    assert isinstance(r, Result)
    json.dumps(r.to_dict(), allow_nan=False)
    f = r.findings()
    assert isinstance(f, list) and f and all(isinstance(s, str) and SENTENCE.match(s.strip()) for s in f), f
    assert r.text().strip() and repr(r)
    assert isinstance(r.tables, dict) and r.tables and all(isinstance(v, pd.DataFrame) for v in r.tables.values())
    assert isinstance(int(r.n_samples), int) and hasattr(r, "model_name") and hasattr(r, "kind")


def facts_results(llama, tokens, stream_dir) -> dict[str, Result]:
    """One of each of the six, on tiny models: a Llama of tests/families.py, the committed synthetic reference, a
    windowed reference model and a one-layer Llama stream (``tests/report/test_protocol.py`` can reuse it)."""
    from analysis.chain.activation_map import activation_map
    from analysis.dynamics.compare import mechanism_chain
    from analysis.dynamics.formation import chain_links, follow_final
    from analysis.dynamics.metrics import first_token_stats, window_sink_rates
    from analysis.model.loading import REFERENCE_DIR
    from analysis.model.reference.checkpoint import load_reference
    from analysis.model.reference.config import ModelConfig
    from analysis.model.reference.sink_lm import SinkLM
    from analysis.streaming.perplexity import run_policy
    from analysis.streaming.cache import Policy
    from analysis.model.loading import load_model

    ref = load_reference(REFERENCE_DIR / "synthetic-softmax")
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(1, ref.cfg.d_vocab, (N, T), generator=gen)
    torch.manual_seed(0)
    windowed = SinkLM(ModelConfig(n_ctx=T, d_model=32, n_heads=2, n_layers=1, sliding_window=T // 2)).eval()
    loaded = load_model(str(stream_dir))  # streaming takes the loaded model (no call-form shims)
    return {
        "ActivationMap": activation_map(llama, tokens, 0),
        "FirstTokenStats": first_token_stats(ref, toks),
        "WindowSinkRates": window_sink_rates(windowed, toks),
        "MechanismChain": mechanism_chain(ref, toks),
        "ChainLinks": chain_links(ref, toks, follow_final(ref, toks)),
        "PolicyRun": run_policy(loaded, torch.randint(3, 96, (40,), generator=gen), Policy("sinks", 16, 1)),
    }


@pytest.fixture(scope="module")
def six(family_dir, tmp_path_factory):
    import warnings

    from analysis import load_model
    from tests.tiny import make_tiny_llama_dir

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llama = load_model(str(family_dir("llama")), device="cpu")
    tokens = torch.randint(3, 96, (N, T), generator=torch.Generator().manual_seed(0))
    one = make_tiny_llama_dir(tmp_path_factory.mktemp("facts-llama"), n_layers=1, n_ctx=64)
    return facts_results(llama, tokens, one)


@pytest.mark.parametrize(
    "name", ["ActivationMap", "FirstTokenStats", "WindowSinkRates", "MechanismChain", "ChainLinks", "PolicyRun"]
)
def test_the_six_keep_the_protocol(six, name):
    r = six[name]
    assert type(r).__name__ == name
    keeps_the_protocol(r)


def test_the_old_access_still_works(six):
    from analysis.dynamics.formation import LINKS
    from analysis.streaming.perplexity import PolicyRun

    chain = six["MechanismChain"]
    assert isinstance(chain, dict) and 0 <= chain["sink_1"] <= 100 and "spike_dims" in chain
    assert pd.DataFrame({"a": chain}).loc["sink_1", "a"] == chain["sink_1"]  # notebook 13's table
    links, writes = six["ChainLinks"]  # the pair it always returned
    assert set(links) == set(LINKS) and isinstance(writes, pd.DataFrame)
    assert links["sink_1"] == pytest.approx(chain["sink_1"])  # the same probe: the same Sink_1
    rates = six["WindowSinkRates"]
    assert set(rates) == {"sink_1_in_window", "sink_window_start"} and all(0 <= v <= 100 for v in rates.values())
    stats = six["FirstTokenStats"].to_dict()
    assert {"value_norm_ratio", "resid_norm_ratio", "raw_first_mass", "spike_ratio"} <= set(stats)
    amap = six["ActivationMap"].to_dict()
    assert amap["layer"] == 0 and amap["hook"] == "resid_post" and len(amap["top"]) == 5
    run = six["PolicyRun"]
    again = PolicyRun.from_dict(json.loads(json.dumps(run.to_dict())))
    assert again.policy == run.policy and again.nll.shape == run.nll.shape and again.to_dict() == run.to_dict()
