"""CUDA backend entry points on a GPU (marker `gpu`): dequantization through the embedding
kernel (bit-exact against the gguf package) and the product kernel (within the 8-bit activation
bound) for every format with a CUDA kernel. They run only where TensorFold was built with CUDA
and a device is present; elsewhere they skip with the reason, and the stub's behaviour is
checked instead."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from tensorfold import _core

cuda = _core.cuda
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_kernels import act_quant_bound, block_geometry, make_weights  # noqa: E402

needs_gpu = pytest.mark.skipif(
    not cuda.built_with_cuda() or cuda.device_count() == 0,
    reason=(f"TensorFold was built without CUDA ({cuda.build_note()})" if not cuda.built_with_cuda()
            else "no CUDA device on this machine"),
)

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.IQ2_XS,
         Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_XS, Q.IQ4_NL, Q.MXFP4, Q.F32, Q.F16, Q.BF16]


def _k(t, blocks):
    bs, _ = block_geometry(t)
    return blocks * bs if bs >= 32 else 32 * blocks


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_cuda_dequantize_matches_gguf(t):
    rng = np.random.default_rng(int(t))
    k = _k(t, 3)
    w = make_weights(t, 1, k, rng).reshape(-1)
    ref = gguf.quants.dequantize(w, t).reshape(-1).astype(np.float32)
    out = cuda.dequantize(int(t), w, ref.size)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (17, 3), (257, 2)])
def test_cuda_gemv_within_the_activation_bound(t, rows, blocks):
    rng = np.random.default_rng(rows + int(t))
    k = _k(t, blocks)
    w = make_weights(t, rows, k, rng)
    W = gguf.quants.dequantize(w, t).reshape(rows, k).astype(np.float64)
    x = rng.standard_normal(k).astype(np.float32)
    y = cuda.gemv(int(t), w.reshape(-1), rows, k, x)
    ref = W @ x.astype(np.float64)
    absprod = np.abs(W) @ np.abs(x.astype(np.float64))
    bound = act_quant_bound(t, W, x[None])[0] * 1.0001 + 1e-5 * absprod + 1e-6
    assert (np.abs(y - ref) <= bound).all(), f"{t.name}: error {np.abs(y - ref).max():.3g}"


@pytest.mark.skipif(cuda.built_with_cuda(), reason="built with CUDA: the stub is not in use")
def test_stub_reports_missing_cuda():
    assert cuda.device_count() == 0
    with pytest.raises(ValueError, match="without CUDA"):
        cuda.dequantize(8, np.zeros(34, np.uint8), 32)
