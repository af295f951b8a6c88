"""Pytest fixtures around the in-process Hub-protocol server (`hub_server.HubServer`).

Import them into a test module (`from conftest_hub import hub  # noqa: F401`). While a fixture is active,
`HF_ENDPOINT` points at the server (read at call time by `model_cards.publish`) and uploads skip Xet
(`huggingface_hub.constants.HF_HUB_DISABLE_XET`, read by the client at import time, is patched as well).
"""

from __future__ import annotations

import pytest
from hub_server import HubServer
from huggingface_hub import constants


def _serve(monkeypatch: pytest.MonkeyPatch, **kwargs) -> HubServer:
    server = HubServer(**kwargs).start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    return server


@pytest.fixture
def hub(monkeypatch):
    """A fresh server for one test (any bearer token accepted; `hub.valid_tokens`/`hub.refuse` adjustable)."""
    server = _serve(monkeypatch)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_hub():
    """One server for a whole test module."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        server = _serve(monkeypatch)
        yield server
        server.stop()
