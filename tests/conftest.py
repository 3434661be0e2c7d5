"""Shared fixtures: real model files (fetched once into the user cache dir) and small synthetic ones."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_path():
    from edgellm.fetch import model_path

    return model_path("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path():
    from edgellm.fetch import model_path

    return model_path("gemma3-270m")


@pytest.fixture(scope="session")
def qwen05_path():
    from edgellm.fetch import model_path

    return model_path("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen15_path():
    from edgellm.fetch import model_path

    return model_path("qwen2.5-coder-1.5b")


def pytest_collection_modifyitems(items):
    """The memory-ledger tests run first. Later in a full session their SmolLM2 worker processes
    (fresh subprocesses, own kernel cache) peaked ~175 MiB higher than alone or early in a session,
    in two clean-clone CI runs. Likely the same cause as the CI failure the ledger test's phases fixed
    (the compiler library's pages resident at the warm-up's peak, counted against the end's; more of
    them in a page cache that holds all of libllvmlite), not re-checked. Other tests keep their order."""
    items.sort(key=lambda item: 0 if item.nodeid.startswith("tests/test_ledger.py") else 1)
