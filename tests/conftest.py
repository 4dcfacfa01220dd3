import os
import socket
import subprocess
import warnings

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels' tests run on the CPU under Triton's interpreter, which a
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernel reads when it is defined: before any test module imports it
torch.set_num_threads(max(1, torch.get_num_threads()))

DEVICES = ("cpu", "cuda")


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the models and tensors of the tests run: cpu (the default, CI's) or cuda (every test "
        "that can use the GPU; those marked cpu_only stay on the CPU).",
    )
    parser.addoption(
        "--shard",
        default=None,
        metavar="I/N",
        help="run the I-th of N parts of the suite, cut by test file (tests/shards.py): one part per "
        "device call (docs/gpu.md); the files that use SmolLM2 are in the last part.",
    )


def pytest_configure(config):
    shard = config.getoption("--shard", default=None)
    if shard is not None:
        from tests.shards import parse_shard

        try:
            parse_shard(shard)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if config.getoption("--device", default="cpu") == "cuda" and workers:
        # each xdist worker's CPU work (tokenizers, host reductions, the cpu_only tests) on its share of the cores,
        # not 12 workers of 16 torch threads each on 16 cores (the first GPU run, whose models sat on the CPU: its
        # SmolLM2 setup took 48-157 s a worker)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
    config.addinivalue_line("markers", "cpu_only: runs on the CPU whatever --device says (the reason is in a comment)")
    if config.getoption("--device", default="cpu") == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"--device cuda: torch {torch.__version__} sees no CUDA device (torch.version.cuda is {torch.version.cuda}). "
            "Install the CUDA build of torch (README: TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 bash "
            "scripts/setup.sh) on a machine with a GPU, or run with --device cpu."
        )


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"


def pytest_report_header(config):
    import transformers

    device = config.getoption("--device")
    lines = [f"device: {device}; torch {torch.__version__}, transformers {transformers.__version__}"]
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        lines.append(
            f"gpu: {torch.cuda.get_device_name(0)} ({props.total_memory / 2**30:.0f} GiB, capability "
            f"{props.major}.{props.minor}); driver {_driver_version()}, CUDA {torch.version.cuda} (torch's "
            f"build), TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, cuDNN {torch.backends.cudnn.version()}"
        )
    return lines


_CPU_ONLY = pytest.StashKey[list]()


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard is not None:
        from collections import Counter

        from tests.shards import assign, parse_shard

        i, n = parse_shard(shard)
        files = Counter(item.nodeid.split("::")[0] for item in items)
        embedded = {it.nodeid.split("::")[0] for it in items if any(f.startswith("smollm2") for f in it.fixturenames)}
        where = assign(dict(files), n, embedded)
        config.hook.pytest_deselected(items=[it for it in items if where[it.nodeid.split("::")[0]] != i])
        items[:] = [it for it in items if where[it.nodeid.split("::")[0]] == i]
    config.stash[_CPU_ONLY] = [item.nodeid for item in items if item.get_closest_marker("cpu_only")]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    kept = config.stash.get(_CPU_ONLY, [])
    if config.getoption("--device") != "cpu" and kept:  # the GPU log says which tests stayed on the CPU on purpose
        terminalreporter.section(f"{len(kept)} tests marked cpu_only ran on the CPU")
        for nodeid in kept:
            terminalreporter.write_line(nodeid)


@pytest.fixture(scope="session")
def device(request) -> str:
    """Where a test runs its models and tensors: "cpu" (default) or "cuda" (``pytest --device cuda``)."""
    return request.config.getoption("--device")


def assert_refused_before_work(calls: dict, givens, bare) -> None:
    """Each ``calls[name](given)`` stops with the one-line TypeError of ``analysis.model.causal.require_model`` (load
    the model first) for every given name, path or bare Hugging Face model, and ``bare`` never runs."""
    ran = []
    handle = bare.register_forward_pre_hook(lambda *a: ran.append(1))
    try:
        for name, call in calls.items():
            for given in givens:
                with pytest.raises(
                    TypeError,
                    match=rf"^{name} takes the model analysis\.load_model returns, not "
                    rf".*call {name}\(load_model\(name_or_path\), \.\.\.\)",
                ) as e:
                    call(given)
                assert "\n" not in str(e.value)
    finally:
        handle.remove()
    assert not ran, "a refused call ran the model"


def tol(device: str, atol: float, *, cuda: float | None = None) -> float:
    """The absolute tolerance of a comparison between two computations of the same numbers: ``atol`` on the CPU, and on
    CUDA ``cuda`` (default 10 x atol) where the kernels (SDPA, reductions, fused attention) sum in another order.

    Parameters
    ----------
    device : str
        The ``device`` fixture.
    atol : float
        The CPU tolerance, unchanged.
    cuda : float, optional
        The tolerance on CUDA.

    Returns
    -------
    float
    """
    return atol if device == "cpu" else (10 * atol if cuda is None else cuda)


class NetworkAttempt(AssertionError):
    pass


@pytest.fixture
def no_network(monkeypatch):
    """Refuse every DNS lookup and socket connection; record the attempts."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[1:] if args else kwargs)
        raise NetworkAttempt(f"network access attempted: {args[1:] if args else kwargs}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: refuse(None, *a))
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: refuse(None, *a))
    return attempts


def placed(model, device: str):
    """``model``, after checking that its inputs go to ``device`` (the loader moved it there): a test then sends its
    tokens to ``device`` and the model is there too.

    Parameters
    ----------
    model : torch.nn.Module
    device : str
        The ``device`` fixture.

    Returns
    -------
    torch.nn.Module
    """
    from analysis.model.placement import input_device

    got = input_device(model)
    if got.type != torch.device(device).type:
        raise AssertionError(f"the model was asked for {device} but its inputs go to {got}")
    return model


@pytest.fixture(scope="session")
def smollm2(device):
    """The embedded default model, loaded once per test session on ``device``."""
    from analysis import load_model

    return placed(load_model("smollm2-135m", device=device), device)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from tests.tiny import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir, device):
    from analysis import load_model

    return placed(load_model(str(tiny_llama_dir), device=device), device)


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """family -> the folder of its tiny random model (``tests/families.py``), saved once per session."""
    from tests.families import make_family_dir

    root = tmp_path_factory.mktemp("families")
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[family] = make_family_dir(family, root / family)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def family_bridge(family_dir, device):
    """family -> the bridge loaded from its folder, once per session and shared by the family tests: add only
    temporary hooks to it (``run_with_hooks``); a test that plants permanent hooks loads its own copy."""
    from analysis import load_model

    cache: dict = {}

    def get(family: str):
        if family not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[family] = placed(load_model(str(family_dir(family)), device=device), device)
        return cache[family]

    return get


def cpu_cache(model, tokens, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``model.run_with_cache`` over ``tokens`` (moved to the model's device), its logits and activations moved to the
    CPU, where the tests compare them with the analyses' results.

    Parameters
    ----------
    model
        Any model with TransformerLens hook names.
    tokens : torch.Tensor, shape (N, T)
    **kwargs
        Passed to ``run_with_cache`` (e.g. ``names_filter``).

    Returns
    -------
    logits : torch.Tensor, shape (N, T, d_vocab)
    cache : dict of str to torch.Tensor
    """
    from analysis.model.hooks import model_device

    logits, cache = model.run_with_cache(tokens.to(model_device(model)), **kwargs)
    return logits.cpu(), {name: x.cpu() for name, x in cache.items()}
