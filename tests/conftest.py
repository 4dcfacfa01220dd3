import socket
import warnings

import pytest
import torch

torch.set_num_threads(max(1, torch.get_num_threads()))


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


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model, loaded once per test session."""
    from analysis import load_model

    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from tests.tiny import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    from analysis import load_model

    return load_model(str(tiny_llama_dir), device="cpu")


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
def family_bridge(family_dir):
    """family -> the bridge loaded from its folder, once per session and shared by the family tests: add only
    temporary hooks to it (``run_with_hooks``); a test that plants permanent hooks loads its own copy."""
    from analysis import load_model

    cache: dict = {}

    def get(family: str):
        if family not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[family] = load_model(str(family_dir(family)), device="cpu")
        return cache[family]

    return get
