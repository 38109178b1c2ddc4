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


def _fixture_tensor(name, t):
    """A tensor of type t from a llama.cpp-made fixture file: (raw bytes, rows, k, float64 dense)."""
    import pathlib
    r = gguf.GGUFReader(str(pathlib.Path(__file__).parent / "fixtures" / "quant" / name))
    x = next(x for x in r.tensors if x.tensor_type == t and len(x.shape) >= 2)
    k, rows = int(x.shape[0]), int(np.prod(x.shape[1:]))
    raw = np.ascontiguousarray(np.asarray(x.data).view(np.uint8).reshape(-1))
    return raw, rows, k, gguf.quants.dequantize(np.asarray(x.data), t).reshape(rows, k).astype(np.float64)


@pytest.mark.skipif(not HAVE, reason="the prefill panels need AVX-512 VNNI")
@pytest.mark.parametrize("name,t", [("dense-IQ4_NL.gguf", Q.IQ4_NL), ("moe-MXFP4_MOE.gguf", Q.MXFP4)],
                         ids=["IQ4_NL", "MXFP4"])
def test_decoded_32_panels_on_llama_cpp_tensors(name, t):
    """IQ4_NL and MXFP4 (signed codes from a table, + 128 in the panels) on tensors llama.cpp wrote."""
    raw, rows, k, dense = _fixture_tensor(name, t)
    rng = np.random.default_rng(1)
    for ncols in (8, 13):
        x = rng.standard_normal((ncols, k)).astype(np.float32)
        ref = x.astype(np.float64) @ dense.T
        got = _core.kernels_matmul(int(t), raw, rows, k, x, "avx512_panels", 2)
        rows_k = _core.kernels_matmul(int(t), raw, rows, k, x, "avx512", 1)
        assert np.abs(got - ref).max() <= 1.01 * np.abs(rows_k - ref).max() + 1e-5 * np.abs(ref).max()
        assert np.array_equal(_core.kernels_matmul(int(t), raw, rows, k, x[:3], "avx512_panels", 1), got[:3])


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
