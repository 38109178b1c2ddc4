"""CI keeps the CUDA backend compiling: where nvcc is installed, the package's build must have
compiled the CUDA kernels (the build falls back to the CPU-only stub when they fail to compile,
so that failure would otherwise go unnoticed) for the default architectures, Hopper (sm_90)
and Blackwell sm_120 / sm_121 (GB10). Fast: it only asks the built module; skips without nvcc."""
from __future__ import annotations

import os
import shutil

import pytest

from tensorfold import _core

cuda = _core.cuda
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed here: the CUDA backend is not built")
def test_cuda_kernels_compiled_for_hopper_and_blackwell():
    assert cuda.built_with_cuda(), f"nvcc is at {NVCC} but the CUDA kernels were not built: {cuda.build_note()}"
    archs = cuda.compiled_archs().split(",")
    if os.environ.get("TENSORFOLD_CUDA_ARCHS") is None:
        for a in ("90", "120", "121"):
            assert a in archs, f"sm_{a} missing from the default architectures {archs}"


def test_stub_or_backend_is_consistent():
    if not cuda.built_with_cuda():
        assert cuda.device_count() == 0 and not cuda.forward_supported()
        with pytest.raises(ValueError, match="without CUDA"):
            _core.Backend("cuda")
    else:
        assert cuda.forward_supported()


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None or shutil.which("cmake") is None, reason="needs nvcc and cmake")
def test_a_cuda_build_failure_leaves_the_cpu_build(tmp_path):
    """Configuring with an architecture nvcc refuses: the CUDA kernels fail to build, and the
    configuration goes on with the CPU-only stub, saying why (then the CPU build proceeds)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pybind = subprocess.run([sys.executable, "-m", "pybind11", "--cmakedir"], capture_output=True, text=True)
    if pybind.returncode != 0:
        pytest.skip("pybind11's CMake files are not installed")
    out = subprocess.run(["cmake", "-S", root, "-B", str(tmp_path / "b"), "-DCMAKE_BUILD_TYPE=Release",
                          f"-Dpybind11_DIR={pybind.stdout.strip()}"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, TENSORFOLD_CUDA_ARCHS="11"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "CUDA backend OFF (stub: the CUDA kernels failed to compile" in out.stdout, out.stdout[-2000:]
