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
