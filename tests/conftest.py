"""Project-wide test setup: GPU tests skip cleanly on machines without CUDA; ``helm`` for every
test that renders the chart (installed on first use, whichever test comes first);
``no_dtkv_env`` for tests whose settings must not come from the shell's environment."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def helm() -> str:
    from helm_tool import find_helm

    path, why = find_helm()
    if path is None:
        pytest.skip(why)
    return path


@pytest.fixture
def no_dtkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``DYN_TIERED_KV_*`` setting of the environment reaches the test."""
    for k in list(os.environ):
        if k.startswith("DYN_TIERED_KV_"):
            monkeypatch.delenv(k)
