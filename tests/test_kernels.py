"""CPU low-bit matmul kernels (csrc/backend/cpu) against an independent oracle.

Oracle: the `gguf` package's numpy dequantization of the same bytes, multiplied by the float
activations in float64. The kernels quantize each activation row to 8 bits per block (32
values for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, 256 for the K-quants; F32/F16/BF16 keep float
activations), so besides a per-format relative bound we check the rigorous bound of that
quantization: each activation value moves by at most amax(block)/254, hence

    |y - y_ref| <= sum_blocks amax(x_block)/254 * sum_{i in block} |W[r, i]|   (+ float slack)

Scalar, AVX2 and AVX-512 must agree with each other to 1e-5 relative to max(|x| @ |W|.T)
(they differ in float summation order only).
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from tensorfold import _core  # noqa: E402

# Offsets of the fp16 scale fields inside one block (overwritten with sane finite halves).
HALF_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
    Q.IQ2_XXS: [0], Q.IQ2_XS: [0], Q.IQ2_S: [0], Q.IQ3_XXS: [0], Q.IQ3_S: [0], Q.IQ4_NL: [0],
    Q.IQ4_XS: [0], Q.IQ1_S: [0], Q.TQ1_0: [52], Q.TQ2_0: [64],
    Q.IQ1_M: [], Q.MXFP4: [],  # scales set by make_weights (spread fp16 / E8M0 exponent)
}
FLOAT_TYPES = [Q.F32, Q.F16, Q.BF16]
QUANT_TYPES = list(HALF_FIELDS)
ALL_TYPES = QUANT_TYPES + FLOAT_TYPES

# Error allowed per format, relative to max(|x| @ |W|.T) (the size of the sums without
# cancellation; max|y| itself can be tiny for a single block). Quantized formats: 8-bit
# activation quantization dominates (typically ~0.3%); float formats only float32 rounding.
REL_BOUND = {t: 1.5e-2 if t.name.startswith(("IQ1", "TQ")) else 1e-2 for t in QUANT_TYPES}
REL_BOUND.update({Q.F32: 1e-5, Q.F16: 1e-5, Q.BF16: 1e-5})
ACT_BLOCK = {t: 32 if gguf.GGML_QUANT_SIZES[t][0] == 32 else 256 for t in QUANT_TYPES}

ROWS = [1, 17, 31, 33, 257]
KBLOCKS = [1, 3, 5]
NCOLS = [1, 3, 4, 5, 8, 17]


def available_impls() -> list[str]:
    isa = _core.kernel_isa()
    return {"avx512": ["scalar", "avx2", "avx512"], "avx2": ["scalar", "avx2"]}.get(isa, ["scalar"])


def block_geometry(t: Q) -> tuple[int, int]:
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    if t in FLOAT_TYPES:
        bs = 17  # exercise the vector tails (16 / 8 lanes)
        ts = ts * 17
    return bs, ts


def make_weights(t: Q, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random data: random bytes with finite fp16 scales, or finite floats."""
    bs, ts = block_geometry(t)
    nb = k // bs
    if t == Q.F32:
        return rng.standard_normal((rows, k)).astype(np.float32).view(np.uint8).reshape(rows, -1)
    if t == Q.F16:
        return rng.standard_normal((rows, k)).astype(np.float16).view(np.uint8).reshape(rows, -1)
    if t == Q.BF16:
        f = rng.standard_normal((rows, k)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    raw = rng.integers(0, 256, size=(rows, nb, ts), dtype=np.uint8)
    for off in HALF_FIELDS[t]:
        mag = 10.0 ** rng.uniform(-3, -1, size=(rows, nb))
        sign = rng.choice([-1.0, 1.0], size=(rows, nb))
        raw[:, :, off:off + 2] = (mag * sign).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    if t == Q.IQ1_M:  # fp16 d in the top nibbles of the four 16-bit scale words (bytes 48..55)
        h = (10.0 ** rng.uniform(-3, -1, size=(rows, nb))).astype(np.float16).view(np.uint16)
        sc = raw[:, :, 48:56].copy().view(np.uint16)
        for i in range(4):
            sc[..., i] = (sc[..., i] & np.uint16(0x0FFF)) | (((h >> np.uint16(4 * i)) & np.uint16(0xF)) << np.uint16(12))
        raw[:, :, 48:56] = sc.view(np.uint8)
    if t == Q.MXFP4:  # E8M0 exponent byte: scales 2^-9 .. 2^3
        raw[:, :, 0] = rng.integers(118, 131, size=(rows, nb), dtype=np.uint8)
    return raw.reshape(rows, nb * ts)


def act_quant_bound(t: Q, W: np.ndarray, x: np.ndarray) -> np.ndarray:
    """[ncols, rows] bound on the error caused by 8-bit block quantization of x."""
    if t in FLOAT_TYPES:
        return np.zeros((x.shape[0], W.shape[0]))
    ab = ACT_BLOCK[t]
    k = x.shape[1]
    amax = np.abs(x.reshape(x.shape[0], k // ab, ab)).max(axis=2) / 254.0  # [ncols, nblk]
    wabs = np.abs(W.astype(np.float64)).reshape(W.shape[0], k // ab, ab).sum(axis=2)  # [rows, nblk]
    return amax @ wabs.T


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kb", KBLOCKS)
@pytest.mark.parametrize("ncols", NCOLS)
def test_matmul_vs_gguf_dequant(t, rows, kb, ncols):
    rng = np.random.default_rng(hash((int(t), rows, kb, ncols)) % 2**32)
    bs, _ = block_geometry(t)
    k = kb * bs
    raw = make_weights(t, rows, k, rng)
    W = dequantize(raw, t).astype(np.float64)
    assert W.shape == (rows, k) and np.isfinite(W).all()
    x = rng.standard_normal((ncols, k)).astype(np.float32)
    ref = x.astype(np.float64) @ W.T
    absprod = np.abs(x.astype(np.float64)) @ np.abs(W).T  # sum |x||w|: the cancellation-free size
    scale = max(absprod.max(), 1e-30)
    # float32 accumulation slack on top of the activation-quantization bound
    slack = 1e-5 * absprod + 1e-7 * scale
    bound = act_quant_bound(t, W, x) * 1.0001 + slack

    outs = {}
    for impl in available_impls():
        y = _core.kernels_matmul(int(t), raw.reshape(-1), rows, k, x, impl=impl)
        assert y.shape == (ncols, rows) and y.dtype == np.float32
        err = np.abs(y.astype(np.float64) - ref)
        assert (err <= bound).all(), (
            f"{t.name} {impl}: error {err.max():.3g} exceeds the activation-quantization bound "
            f"at {np.unravel_index(np.argmax(err - bound), err.shape)}")
        assert err.max() <= REL_BOUND[t] * scale, f"{t.name} {impl}: rel err {err.max() / scale:.3g}"
        outs[impl] = y.astype(np.float64)
    base = outs["scalar"]
    for impl, y in outs.items():
        assert np.abs(y - base).max() <= 1e-5 * scale, (
            f"{t.name}: {impl} disagrees with scalar by {np.abs(y - base).max() / scale:.3g}")


@pytest.mark.parametrize("t", [Q.Q4_0, Q.Q4_K, Q.IQ2_XXS], ids=lambda t: t.name)
def test_activation_quantization_identical_across_isas(t):
    # Every ISA's activation quantizer writes the scalar reference's bytes: the same scales,
    # the same round-half-to-even, the same sums — including exact ties, zero blocks, huge
    # and tiny magnitudes, and a non-finite value (its block poisoned, the others intact).
    rng = np.random.default_rng(int(t))
    k = 1024
    rows = [rng.standard_normal(k).astype(np.float32) * s for s in (1e-30, 1e-3, 1.0, 1e30)]
    ties = (rng.integers(-127, 128, k) + 0.5).astype(np.float32)
    ties[::37] = 127.0  # amax 127: x * 127 / amax lands on the .5 ties exactly
    rows += [ties, np.zeros(k, np.float32)]
    poisoned = rng.standard_normal(k).astype(np.float32)
    poisoned[300] = np.nan
    poisoned[700] = np.inf
    rows.append(poisoned)
    for x in rows:
        ref = _core.kernels_quantize_act(int(t), x, impl="scalar")
        for impl in available_impls():
            np.testing.assert_array_equal(_core.kernels_quantize_act(int(t), x, impl=impl), ref, err_msg=impl)


def test_isa_availability_reported():
    isa = _core.kernel_isa()
    assert isa in ("avx512", "avx2", "scalar")
    for impl in ("avx2", "avx512"):
        if impl not in available_impls():
            pytest.skip(f"CPU lacks {impl}: cannot check the fast path here")


@pytest.mark.parametrize("t", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F16], ids=lambda t: t.name)
def test_threads_and_auto_match(t):
    rng = np.random.default_rng(7)
    bs, _ = block_geometry(t)
    rows, k = 301, 4 * bs
    raw = make_weights(t, rows, k, rng)
    x = rng.standard_normal((6, k)).astype(np.float32)
    y1 = _core.kernels_matmul(int(t), raw.reshape(-1), rows, k, x, impl="auto", threads=1)
    y2 = _core.kernels_matmul(int(t), raw.reshape(-1), rows, k, x, impl="auto", threads=2)
    y3 = _core.kernels_matmul(int(t), raw.reshape(-1), rows, k, x, impl=_core.kernel_isa(), threads=3)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(y1, y3)
    # GEMV (one column) must equal the corresponding column of the GEMM
    yv = _core.kernels_matmul(int(t), raw.reshape(-1), rows, k, x[2:3], impl="auto")
    np.testing.assert_allclose(yv[0], y1[2], rtol=1e-5, atol=1e-5 * np.abs(y1).max())


def test_large_activations_no_overflow():
    """Extreme activation outliers and max-magnitude quants must not overflow int paths."""
    rng = np.random.default_rng(3)
    for t in QUANT_TYPES:
        bs, ts = block_geometry(t)
        rows, k = 9, 2 * bs
        raw = make_weights(t, rows, k, rng)
        x = rng.standard_normal((2, k)).astype(np.float32)
        x[0, ::7] *= 1000.0
        x[1] = np.where(np.arange(k) % 2 == 0, 1e4, -1e4).astype(np.float32)
        ref = x.astype(np.float64) @ dequantize(raw, t).astype(np.float64).T
        for impl in available_impls():
            y = _core.kernels_matmul(int(t), raw.reshape(-1), rows, k, x, impl=impl)
            W = dequantize(raw, t).astype(np.float64)
            bound = act_quant_bound(t, W, x) * 1.0001 + 1e-5 * (np.abs(x) @ np.abs(W).T) + 1e-6
            assert (np.abs(y - ref) <= bound).all(), (t.name, impl)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_activations_poison_their_rows(bad):
    """A NaN/inf activation makes its output row non-finite (as float math would) on every
    ISA — no integer conversion of non-finite values, no overflowing integer sums — and the
    other rows stay exact."""
    rng = np.random.default_rng(11)
    for t in QUANT_TYPES + FLOAT_TYPES:
        bs, _ = block_geometry(t)
        rows, k = 5, 2 * bs
        raw = make_weights(t, rows, k, rng)
        x = rng.standard_normal((3, k)).astype(np.float32)
        x[1, 3] = bad
        x[2, :] = bad
        W = dequantize(raw, t).astype(np.float64)
        for impl in available_impls():
            y = _core.kernels_matmul(int(t), raw.reshape(-1), rows, k, x, impl=impl)
            assert not np.isfinite(y[1:]).any(), (t.name, impl)
            ref = x[0].astype(np.float64) @ W.T
            bound = act_quant_bound(t, W, x[:1])[0] * 1.0001 + 1e-5 * (np.abs(x[0]) @ np.abs(W).T) + 1e-6
            assert (np.abs(y[0] - ref) <= bound).all(), (t.name, impl)


def test_bad_inputs():
    t = Q.Q4_1
    rows, k = 4, 64
    raw = make_weights(t, rows, k, np.random.default_rng(1)).reshape(-1)
    x = np.zeros((2, k), np.float32)
    with pytest.raises(ValueError):  # wrong byte count
        _core.kernels_matmul(int(t), raw[:-1], rows, k, x)
    with pytest.raises(ValueError):  # k not a multiple of the block size
        _core.kernels_matmul(int(t), raw, rows, 48, np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError):  # x columns != k
        _core.kernels_matmul(int(t), raw, rows, k, np.zeros((2, k + 32), np.float32))
    with pytest.raises(ValueError):  # x not 2-D
        _core.kernels_matmul(int(t), raw, rows, k, np.zeros(k, np.float32))
    with pytest.raises(ValueError):  # unknown impl
        _core.kernels_matmul(int(t), raw, rows, k, x, impl="neon")
    with pytest.raises(ValueError):  # unsupported type (Q8_K is activation-only)
        _core.kernels_matmul(int(Q.Q8_K), raw, rows, k, x)
    with pytest.raises(ValueError):  # unknown type id
        _core.kernels_matmul(63, raw, rows, k, x)
    with pytest.raises(ValueError):
        _core.kernels_matmul(int(t), raw, rows, k, x, threads=0)
    with pytest.raises(ValueError):
        _core.kernels_matmul(int(t), raw, 0, k, x[:, :0])
    with pytest.raises(ValueError):  # zero activation rows
        _core.kernels_matmul(int(t), raw, rows, k, np.zeros((0, k), np.float32))
    for impl in ("avx2", "avx512"):
        if impl not in available_impls():
            with pytest.raises(ValueError):
                _core.kernels_matmul(int(t), raw, rows, k, x, impl=impl)
