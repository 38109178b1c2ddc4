"""The AVX-512 prefill panels (CpuKernels::avx512_panels: 16-row VNNI panels, panel_avx512.h and
kernels_avx512.cpp) against the `gguf` package's dequantization in float64, on odd shapes (rows
not a multiple of 16, an odd block count, column counts around the tiles), within the bound the
row kernels meet; and the backend keeps exact rows (BatchToken::exact) off them."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tensorfold import _core  # noqa: E402

Q = gguf.GGMLQuantizationType
FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
HAVE = "cpu:avx512" in _core.available_backends()


@pytest.mark.skipif(not HAVE, reason="the prefill panels need AVX-512 VNNI")
@pytest.mark.parametrize("t", FORMATS, ids=[t.name for t in FORMATS])
def test_panels_vs_gguf_dequant(t):
    block = gguf.GGML_QUANT_SIZES[t][0]
    rng = np.random.default_rng(int(t))
    for k in ((3 * 32, 17 * 32) if block == 32 else (256, 5 * 256)):
        rows = 37
        w = np.asarray(_core.quantize_rows(int(t), rng.standard_normal((rows, k)).astype(np.float32)))
        dense = gguf.quants.dequantize(w.reshape(rows, -1), t).astype(np.float64)
        for ncols in (8, 9, 17, 33):
            x = rng.standard_normal((ncols, k)).astype(np.float32)
            ref = x.astype(np.float64) @ dense.T
            got = _core.kernels_matmul(int(t), w.reshape(-1).view(np.uint8), rows, k, x, "avx512_panels", 2)
            rows_k = _core.kernels_matmul(int(t), w.reshape(-1).view(np.uint8), rows, k, x, "avx512", 1)
            err = np.abs(got - ref).max()
            # the activations' 8-bit rounding dominates: the row kernels' own error, plus float noise
            assert err <= 1.01 * np.abs(rows_k - ref).max() + 1e-5 * np.abs(ref).max(), (t.name, k, ncols)
            # each column is computed the same way whatever the column count
            one = _core.kernels_matmul(int(t), w.reshape(-1).view(np.uint8), rows, k, x[:8], "avx512_panels", 1)
            assert np.array_equal(one, got[:8])
