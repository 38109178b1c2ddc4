"""TensorFold: a native inference engine for large Mixture-of-Experts language models."""
from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# Development builds: TENSORFOLD_CORE_DIR points at a CMake build folder holding _core*.so.
if _os.environ.get("TENSORFOLD_CORE_DIR"):
    __path__.insert(0, _os.environ["TENSORFOLD_CORE_DIR"])  # type: ignore[name-defined]

from . import _core  # noqa: E402
from .engine import Completion, Engine, TokenLogprob  # noqa: E402
from .pull import pull  # noqa: E402

available_backends = _core.available_backends  # e.g. ['cpu:avx512', 'cpu:avx2', 'cpu:scalar']

__all__ = ["Engine", "Completion", "TokenLogprob", "available_backends", "pull", "__version__"]
