"""CUDA backend: first kernels against the gguf package's dequantization. They run only
where TensorFold was built with nvcc and a CUDA device is present; elsewhere they skip with
the reason, and the stub's behaviour is checked instead."""
from __future__ import annotations

import numpy as np
import pytest

from tensorfold import _core

cuda = _core.cuda
gguf = pytest.importorskip("gguf")

needs_gpu = pytest.mark.skipif(
    not cuda.built_with_cuda() or cuda.device_count() == 0,
    reason=("TensorFold was built without CUDA (no nvcc at build time)" if not cuda.built_with_cuda()
            else "no CUDA device on this machine"),
)

TYPES = {"F16": 1, "Q4_1": 3, "Q8_0": 8}


def _random_weights(name: str, rows: int, k: int, rng) -> np.ndarray:
    t = gguf.GGMLQuantizationType[name]
    x = rng.standard_normal((rows, k)).astype(np.float32)
    return gguf.quants.quantize(x, t).reshape(-1).view(np.uint8)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", sorted(TYPES))
def test_cuda_dequantize_matches_gguf(name):
    rng = np.random.default_rng(1)
    w = _random_weights(name, 3, 96, rng)
    ref = gguf.quants.dequantize(w, gguf.GGMLQuantizationType[name]).reshape(-1)
    out = cuda.dequantize(TYPES[name], w, ref.size)
    np.testing.assert_array_equal(out, ref.astype(np.float32))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("rows,k", [(1, 32), (17, 96), (257, 576)])
def test_cuda_gemv_matches_dequantized_dot(name, rows, k):
    rng = np.random.default_rng(rows + k)
    w = _random_weights(name, rows, k, rng)
    x = rng.standard_normal(k).astype(np.float32)
    ref = gguf.quants.dequantize(w, gguf.GGMLQuantizationType[name]).reshape(rows, k).astype(np.float64) @ x
    y = cuda.gemv(TYPES[name], w, rows, k, x)
    assert np.abs(y - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())


@pytest.mark.skipif(cuda.built_with_cuda(), reason="built with CUDA: the stub is not in use")
def test_stub_reports_missing_cuda():
    assert cuda.device_count() == 0
    with pytest.raises(ValueError, match="without CUDA"):
        cuda.dequantize(8, np.zeros(34, np.uint8), 32)
