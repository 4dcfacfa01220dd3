import socket

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
