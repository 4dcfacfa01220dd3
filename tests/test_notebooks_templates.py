"""The notebooks as templates: each notebook that measures a model runs through papermill (``-p MODEL <folder or
name>`` and small probe sizes) on three models that lack parts of what the notebooks are about, and none ends in a
traceback. The published notebooks are read, never written: the runs go to a temporary folder.

The models: a tiny random Llama (4 layers, d_model 96, GQA; no spike, no sink), a tiny GPT-2 whose whole sink chain is
written into its weights (``tests.planted.planted_gpt2_dir``: LayerNorm, learned positions, an MLP neuron that
writes the spike) and the tokenizer-less reference model ``synthetic-softmax`` (one layer); on the notebooks about the
sink and its heads (01, 05, 11, 12) also two other attentions, tests/families.py's tiny DeepSeek-V3 (multi-head latent
attention) and Mistral (a sliding window of 8 tokens, shorter than T).

Cells tagged ``fixed`` measure no MODEL (committed runs, the reference models every reader gets): they are dropped
here, since they do not change with MODEL and CI executes them in the published notebooks (nbmake). The notebooks
run two at a time (CI has 2 cores), each in its own kernel with one thread: the 36 runs took 7.3 CPU-minutes
(user + sys), about 4 minutes on an idle 2-core machine (19 minutes on a shared one under a load of 11-18); the 8 runs
on the two attention families add 1.7 CPU-minutes (11-14 CPU-seconds each, mostly the kernel's start and imports),
about 1 minute: 44 runs, 9 CPU-minutes, about 5 minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
FIXED = "fixed"  # the tag of a cell that measures no MODEL
# notebook prefix -> the parameters that keep it small (beside MODEL, or PAIR for 13)
SMALL = {
    "01": {"N": 4, "T": 16},
    "02": {"N": 4, "T": 16},
    "03": {"N": 4, "T": 16},
    "04": {"N": 6, "T": 16},
    "05": {"N": 4, "T": 16},
    "06": {"N": 4, "T": 16},
    "09": {"WINDOW": 8, "N_TOKENS": 32},
    "10": {"N": 4, "T": 16, "SEEDS": [0], "CUT_SAMPLES": 2},
    "11": {"N": 4, "T": 16, "SEEDS": [0, 1], "CONTEXT_TS": [8, 16]},
    "12": {"N": 4, "T": 16, "SEEDS": [0, 1]},
    "13": {"N": 4, "T": 16},
    "15": {"N": 2, "T": 16},
    "16": {"N": 4, "T": 16, "SEEDS": [0, 1], "GATE_N": 2},
}
# notebooks that read committed runs (not run here: nbmake executes them) -> the parameters they must name
READS_RUNS = {
    "07": ("MODELS", "N", "T", "SEED", "CHAIN"),
    "08": ("RUNS", "GRIDS", "DEMO"),
    "14": ("RUNS", "MODEL", "PAIR", "STREAM", "LIVE"),
}
MODELS = ("no-sink-llama", "planted-gpt2", "synthetic-softmax")
PARTNER = {
    "no-sink-llama": "planted-gpt2",
    "planted-gpt2": "no-sink-llama",  # 13's second model (the same vocabulary)
    "synthetic-softmax": "synthetic-sigmoid",
}
# Families whose attention differs, run on the notebooks about the sink and its heads (tests/families.py's tiny
# configs, random weights, with the char vocabulary): DeepSeek-V3's latent attention (MLA: q and kv LoRA, a shared
# rotary key, v_head_dim != qk head dim; a dense first layer, then routed experts) and Mistral's sliding window (8
# tokens, shorter than T).
FAMILIES = ("deepseek_v3", "mistral")
FAMILY_NOTEBOOKS = ("01", "05", "11", "12")
JOBS = [(p, m) for m in MODELS for p in SMALL] + [(p, f) for f in FAMILIES for p in FAMILY_NOTEBOOKS]


def _notebook(prefix: str) -> Path:
    return next(NOTEBOOK_DIR.glob(f"{prefix}_*.ipynb"))


def _model_dirs(root: Path) -> dict[str, str]:
    """name -> what MODEL is set to: two folders built here and a reference model's name."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.planted import VOCAB, char_tokenizer, planted_gpt2_dir

    llama = root / "no-sink-llama"  # random weights, GQA: no spike, no sink
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=512,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=True,
        )
    ).save_pretrained(llama)
    char_tokenizer().save_pretrained(llama)
    return {
        "no-sink-llama": str(llama),
        "planted-gpt2": str(planted_gpt2_dir(root / "planted-gpt2")),
        "synthetic-softmax": "synthetic-softmax",
        **{f: str(_family_dir(f, root / f)) for f in FAMILIES},
    }


def _family_dir(family: str, path: Path) -> Path:
    """A random ``family`` model of tests/families.py's layout, with the char tokenizer's vocabulary, saved."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.families import family_config
    from tests.planted import VOCAB, char_tokenizer

    config = family_config(family)
    config.vocab_size = VOCAB
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def _without_fixed(src: Path, dst: Path) -> None:
    nb = nbformat.read(src, as_version=4)
    nb.cells = [c for c in nb.cells if FIXED not in c.metadata.get("tags", [])]
    nbformat.write(nb, dst)


def _run(prefix: str, model: str, folders: dict[str, str], out: Path) -> tuple[str, float]:
    """papermill the notebook on ``folder``; '' or the end of its error."""
    import time

    src = out / f"{prefix}-{model}-in.ipynb"
    _without_fixed(_notebook(prefix), src)
    folder = folders[model]
    partner = folders.get(PARTNER.get(model, ""), PARTNER.get(model))
    params = [("PAIR", f"['{folder}', '{partner}']") if prefix == "13" else ("MODEL", folder)]
    params += [(k, repr(v)) for k, v in SMALL[prefix].items()]
    cmd = [
        sys.executable,
        "-m",
        "papermill",
        str(src),
        str(out / f"{prefix}-{model}.ipynb"),
        "--cwd",
        str(NOTEBOOK_DIR),
        "-k",
        "python3",
        "--no-progress-bar",
    ]
    for k, v in params:
        cmd += ["-y", f"{k}: {v}"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return ("" if done.returncode == 0 else done.stderr[-3000:]), time.perf_counter() - t0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(notebook prefix, model) -> the error text of its run ('' when it ran through) and its seconds."""
    pytest.importorskip("papermill")
    root = tmp_path_factory.mktemp("notebook-templates")
    folders = _model_dirs(root)
    jobs = JOBS
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = pool.map(lambda job: _run(job[0], job[1], folders, root), jobs)
        return dict(zip(jobs, done))


@pytest.mark.slow
@pytest.mark.parametrize(("prefix", "model"), JOBS, ids=[f"{p}-{m}" for p, m in JOBS])
def test_notebook_runs_on_the_model(runs, prefix, model):
    """The notebook runs top to bottom on the model through papermill, and the MODEL parameter took effect."""
    error, seconds = runs[(prefix, model)]
    assert not error, f"{_notebook(prefix).name} on {model} ({seconds:.0f} s) ends in an error:\n{error}"


@pytest.mark.parametrize("prefix", sorted({*SMALL, *READS_RUNS}))
def test_first_cell_is_the_parameters(prefix):
    """One parameters cell, the first code cell, naming MODEL (or PAIR) and every small-run parameter; in the
    notebooks that read committed runs, the runs they read."""
    nb = nbformat.read(_notebook(prefix), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    tagged = [i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", [])]
    assert tagged == [0], f"{_notebook(prefix).name}: code cells tagged 'parameters': {tagged} (one, the first)."
    names = {line.split("=")[0].strip() for line in code[0].source.splitlines() if "=" in line}
    names = {n for part in names for n in part.replace(" ", "").split(",")}
    want = set(READS_RUNS[prefix]) if prefix in READS_RUNS else {"PAIR" if prefix == "13" else "MODEL", *SMALL[prefix]}
    assert want <= names, f"{_notebook(prefix).name}'s parameters cell lacks {sorted(want - names)}."
