"""Scalar reference (de)quantizers against the `gguf` package (the oracle, never our own code).

- dequantize: bit-exact (float32 bit patterns) against gguf.quants.dequantize on random
  blocks of every supported type (Q8_1 / Q8_K, which gguf does not dequantize, against
  ggml's definition y = d * q written out in numpy).
- quantize: bit-exact against gguf.quants.quantize where gguf implements the type;
  K-quants (gguf has no quantizer for them): round trip through gguf's dequantizer within
  relative RMS error bounds calibrated on Gaussian data.
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from tensorfold import _core  # noqa: E402

# Weight types the engine computes with (kernels exist), and every type with a reference
# dequantization: those plus the activation formats Q8_1 / Q8_K (no weight kernels).
COMPUTABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
              "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
              "TQ1_0", "TQ2_0", "MXFP4"]
SUPPORTED = COMPUTABLE + ["Q8_1", "Q8_K"]

# ggml's block_q8_1 is {half d, half s, int8 qs[32]} = 36 bytes; gguf-py's table still lists
# the old 40-byte layout. No GGUF file carries Q8_1 (it is an activation format).
GGML_SIZE_OVERRIDES = {"Q8_1": (32, 36)}

# Byte offsets of the fp16 fields inside one block of each format.
HALF_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q8_1": [0, 2],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ4_NL": [0],
    "IQ4_XS": [0], "IQ1_S": [0], "TQ1_0": [52], "TQ2_0": [64],
}


def _types() -> dict[str, dict]:
    return {t["name"]: t for t in _core.quant_types()}


def _sizes(name: str) -> tuple[int, int]:
    t = _types()[name]
    return t["block_size"], t["type_size"]


def _finite_halves(rng: np.random.Generator, count: int) -> np.ndarray:
    """Random fp16 bit patterns (normals, subnormals, zeros, both signs) that are finite."""
    h = rng.integers(0, 1 << 16, size=count, dtype=np.uint32).astype(np.uint16)
    inf_nan = ((h >> 10) & 0x1F) == 0x1F
    h[inf_nan] &= np.uint16(0xBFFF)  # clear the top exponent bit -> finite
    return h


def _random_data(name: str, nblocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    bs, ts = _sizes(name)
    if name == "F16":
        return _finite_halves(rng, nblocks).view(np.uint8).copy()
    raw = rng.integers(0, 256, size=(nblocks, ts), dtype=np.uint16).astype(np.uint8)
    if name == "Q8_K":  # float32 d
        d = (rng.standard_normal(nblocks) * 10.0 ** rng.uniform(-6, 3, nblocks)).astype(np.float32)
        raw[:, 0:4] = d.view(np.uint8).reshape(nblocks, 4)
    if name == "IQ1_M":  # fp16 d spread over the top nibbles of the four 16-bit scale words
        sc = raw[:, 48:56].copy().view(np.uint16)
        h = _finite_halves(rng, nblocks)
        for i in range(4):
            sc[:, i] = (sc[:, i] & np.uint16(0x0FFF)) | (((h >> np.uint16(4 * i)) & np.uint16(0xF)) << np.uint16(12))
        raw[:, 48:56] = sc.view(np.uint8)
    for off in HALF_FIELDS.get(name, []):
        raw[:, off:off + 2] = _finite_halves(rng, nblocks).view(np.uint8).reshape(nblocks, 2)
    return raw.reshape(-1)


def _oracle_dequantize(name: str, data: np.ndarray) -> np.ndarray:
    if name == "Q8_1":  # ggml: y = x * d (s is a precomputed sum, not used to dequantize)
        blocks = data.reshape(-1, 36)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        return (blocks[:, 4:].copy().view(np.int8).astype(np.float32) * d).reshape(-1)
    if name == "Q8_K":  # ggml: y = d * q, float d
        blocks = data.reshape(-1, 292)
        d = blocks[:, 0:4].copy().view(np.float32)
        return (d * blocks[:, 4:260].copy().view(np.int8).astype(np.float32)).reshape(-1)
    return np.asarray(gguf_dequantize(data, T[name]), dtype=np.float32).reshape(-1)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _rel_rms(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean((x.astype(np.float64) - y) ** 2) / np.mean(x.astype(np.float64) ** 2)))


# --------------------------------------------------------------------------------------------
# The traits table


def test_table_covers_every_gguf_type():
    ours = _types()
    for t in T:
        assert t.name in ours, f"{t.name} missing from the traits table"
        row = ours[t.name]
        assert row["id"] == int(t)
        expect = GGML_SIZE_OVERRIDES.get(t.name, GGML_QUANT_SIZES[t])
        assert (row["block_size"], row["type_size"]) == expect, t.name


def test_supported_set():
    # "supported" means one thing: the engine has kernels for it (Q8_1 / Q8_K, activation
    # formats, have references only).
    ours = _types()
    assert sorted(n for n, r in ours.items() if r["supported"]) == sorted(COMPUTABLE)
    assert sorted(n for n, r in ours.items() if r["has_reference"]) == sorted(SUPPORTED)


# --------------------------------------------------------------------------------------------
# Dequantization: bit-exact


@pytest.mark.parametrize("nblocks", [1, 3, 17])
@pytest.mark.parametrize("name", SUPPORTED)
def test_dequantize_bit_exact(name, nblocks):
    bs, ts = _sizes(name)
    if bs == 1:
        nblocks *= 37  # float types: odd element counts
    for seed in range(3):
        data = _random_data(name, nblocks, seed * 1000 + nblocks)
        n = nblocks * bs
        got = _core.dequantize(int(T[name]), data, n)
        assert got.dtype == np.float32 and got.shape == (n,)
        want = _oracle_dequantize(name, data)
        mism = np.nonzero(_bits(got) != _bits(want))[0]
        assert mism.size == 0, (
            f"{name}: {mism.size} of {n} values differ, first at {mism[0]}: "
            f"{got[mism[0]]!r} vs {want[mism[0]]!r}")


def test_dequantize_accepts_bytes():
    data = _random_data("Q4_K", 2, 7)
    a = _core.dequantize(int(T.Q4_K), data.tobytes(), 512)
    b = _core.dequantize(int(T.Q4_K), data, 512)
    assert np.array_equal(_bits(a), _bits(b))


def test_dequantize_zero_length():
    out = _core.dequantize(int(T.Q8_0), b"", 0)
    assert out.shape == (0,)


# --------------------------------------------------------------------------------------------
# Quantization


def _test_inputs(nblocks: int, bs: int, seed: int) -> np.ndarray:
    """Gaussian blocks of varied magnitudes plus edge cases: zeros, constants, one outlier,
    all-negative, all-positive, ties of the largest magnitude with both signs."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((nblocks, bs)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-3, 3, (nblocks, 1))).astype(np.float32)
    if nblocks >= 8:
        x[1] = 0.0
        x[2] = 0.75
        x[3, :] = rng.standard_normal(bs).astype(np.float32) * 0.01
        x[3, bs // 3] = 40.0
        x[4] = -np.abs(x[4])
        x[5] = np.abs(x[5])
        x[6, 0], x[6, -1] = 2.5, -2.5
        x[7] = np.round(x[7] * 4) / 4  # many exact ties at .5 after scaling
    return x.reshape(-1)


# Types whose quantizer gguf implements and ours reproduces byte for byte.
GGUF_QUANTIZED = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


@pytest.mark.parametrize("nblocks", [1, 3, 17])
@pytest.mark.parametrize("name", GGUF_QUANTIZED)
def test_quantize_bit_exact_with_gguf(name, nblocks):
    bs, _ = _sizes(name)
    if bs == 1:
        bs = 32
    x = _test_inputs(max(nblocks, 8) if nblocks == 17 else nblocks, bs, nblocks + 11)
    got = _core.quantize(int(T[name]), x)
    want = np.ascontiguousarray(gguf_quantize(x, T[name])).view(np.uint8).reshape(-1)
    assert got.dtype == np.uint8
    assert got.shape == want.shape
    mism = np.nonzero(got != want)[0]
    assert mism.size == 0, f"{name}: {mism.size} bytes differ, first at byte {mism[0]}"


def test_quantize_f16_bf16_special_values():
    x = np.array([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 2.9802322e-08,
                  2.9802326e-08, 1e-10, np.inf, -np.inf, 3.0e38, 1.00390625, 1.01171875],
                 dtype=np.float32)
    for name in ("F16", "BF16"):
        got = _core.quantize(int(T[name]), x)
        with np.errstate(over="ignore"):
            want = np.ascontiguousarray(gguf_quantize(x, T[name])).view(np.uint8).reshape(-1)
        assert np.array_equal(got, want), name


def test_quantize_q8_1_matches_q8_0_and_sum():
    x = _test_inputs(17, 32, 5)
    q81 = _core.quantize(int(T.Q8_1), x).reshape(-1, 36)
    q80 = np.ascontiguousarray(gguf_quantize(x, T.Q8_0)).reshape(-1, 34)
    # d and qs are Q8_0's (same rule), s = fp16(d * sum(q)) with d the unrounded float32 scale.
    assert np.array_equal(q81[:, 0:2], q80[:, 0:2])
    assert np.array_equal(q81[:, 4:], q80[:, 2:])
    d32 = (np.abs(x.reshape(-1, 32)).max(axis=1) / np.float32(127)).astype(np.float32)
    qsum = q81[:, 4:].copy().view(np.int8).astype(np.int32).sum(axis=1)
    s = (qsum.astype(np.float32) * d32).astype(np.float16)
    assert np.array_equal(q81[:, 2:4].copy().view(np.uint16).reshape(-1), s.view(np.uint16))


def test_quantize_q8_K():
    x = _test_inputs(9, 256, 3)
    q = _core.quantize(int(T.Q8_K), x).reshape(-1, 292)
    d = q[:, 0:4].copy().view(np.float32).reshape(-1)
    qs = q[:, 4:260].copy().view(np.int8).astype(np.int32)
    bsums = q[:, 260:292].copy().view(np.int16).astype(np.int32)
    assert np.array_equal(bsums, qs.reshape(-1, 16, 16).sum(axis=2))
    assert qs.min() >= -128 and qs.max() <= 127
    xb = x.reshape(-1, 256)
    amax = np.abs(xb).max(axis=1)
    ok = amax > 0
    assert np.all(d[~ok] == 0) and np.all(qs[~ok] == 0)
    # the largest magnitude maps to -127 and every value is within half a step
    assert np.all(np.abs(qs[ok]).max(axis=1) == 127)
    y = d[:, None] * qs
    assert np.all(np.abs(y - xb) <= np.abs(d)[:, None] * 0.5 * (1 + 1e-5) + 1e-30)


# Relative RMS error of quantize -> gguf dequantize on N(0, 1) data (65536 values). Measured
# with this quantizer: Q2_K 0.265, Q3_K 0.144, Q4_K 0.0709, Q5_K 0.0360, Q6_K 0.0167,
# Q4_0 0.0863, Q4_1 0.0785, Q5_0 0.0430, Q5_1 0.0380, Q8_0 0.0054; bounds leave ~10% margin.
RMS_BOUNDS = {
    "Q2_K": 0.29, "Q3_K": 0.16, "Q4_K": 0.078, "Q5_K": 0.040, "Q6_K": 0.0185,
    "Q4_0": 0.095, "Q4_1": 0.086, "Q5_0": 0.047, "Q5_1": 0.042, "Q8_0": 0.006,
}


@pytest.mark.parametrize("name", list(RMS_BOUNDS))
def test_quantize_roundtrip_error(name):
    rng = np.random.default_rng(42)
    x = rng.standard_normal(65536).astype(np.float32)
    q = _core.quantize(int(T[name]), x)
    y = np.asarray(gguf_dequantize(q, T[name]), dtype=np.float32).reshape(-1)
    err = _rel_rms(x, y)
    assert err < RMS_BOUNDS[name], f"{name}: relative RMS error {err:.4f}"
    # our own dequantizer agrees with gguf's on our quantizer's output
    assert np.array_equal(_bits(_core.dequantize(int(T[name]), q, x.size)), _bits(y))


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_kquant_edge_inputs(name):
    bs, _ = _sizes(name)
    x = _test_inputs(12, bs, 9)
    q = _core.quantize(int(T[name]), x)
    y = np.asarray(gguf_dequantize(q, T[name]), dtype=np.float32).reshape(-1, bs)
    xb = x.reshape(-1, bs)
    assert np.all(np.isfinite(y))
    assert np.all(y[1] == 0.0)  # zeros stay zeros
    # every block, whatever its magnitude (1e-3 .. 1e3), within a loose per-block bound
    loose = {"Q2_K": 0.5, "Q3_K": 0.3, "Q4_K": 0.15, "Q5_K": 0.08, "Q6_K": 0.04}[name]
    for i in range(xb.shape[0]):
        if i == 1:
            continue
        assert _rel_rms(xb[i], y[i]) < loose, (name, i, _rel_rms(xb[i], y[i]))


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_kquant_scale_invariance(name, scale):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(4096) * scale).astype(np.float32)
    y = np.asarray(gguf_dequantize(_core.quantize(int(T[name]), x), T[name])).reshape(-1)
    assert _rel_rms(x, y) < RMS_BOUNDS[name] * 1.15


# --------------------------------------------------------------------------------------------
# Errors


def test_unsupported_type_names_it():
    # NVFP4 is a type ggml knows and TensorFold has no reference for; IQ2_XXS has a
    # reference dequantization but no quantizer.
    data = np.zeros(66, dtype=np.uint8)
    with pytest.raises(_core.UnsupportedError, match="NVFP4"):
        _core.dequantize(int(T.NVFP4), data[:36], 64)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        _core.quantize(int(T.IQ2_XXS), np.zeros(256, dtype=np.float32))
    with pytest.raises(_core.UnsupportedError, match="99"):
        _core.dequantize(99, data, 256)
    assert issubclass(_core.UnsupportedError, ValueError)


def test_dequantize_wrong_length():
    data = np.zeros(34 * 2 + 1, dtype=np.uint8)
    with pytest.raises(ValueError, match="bytes"):
        _core.dequantize(int(T.Q8_0), data, 64)
    with pytest.raises(ValueError, match="bytes"):
        _core.dequantize(int(T.Q8_0), data[:-2], 64)


def test_dequantize_n_not_multiple_of_block():
    with pytest.raises(ValueError, match="block size"):
        _core.dequantize(int(T.Q4_K), np.zeros(144, dtype=np.uint8), 255)


def test_dequantize_rejects_wide_items():
    with pytest.raises(ValueError, match="uint8"):
        _core.dequantize(int(T.F32), np.zeros(4, dtype=np.float32), 4)


def test_quantize_validation():
    with pytest.raises(ValueError, match="block size"):
        _core.quantize(int(T.Q4_0), np.zeros(33, dtype=np.float32))
    with pytest.raises(ValueError, match="1-D"):
        _core.quantize(int(T.Q4_0), np.zeros((2, 32), dtype=np.float32))
    with pytest.raises(ValueError, match="float32"):
        _core.quantize(int(T.Q4_0), np.zeros(32, dtype=np.float64))


def test_quantize_non_contiguous_input():
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    a = _core.quantize(int(T.Q8_0), x[::2])
    b = _core.quantize(int(T.Q8_0), np.ascontiguousarray(x[::2]))
    assert np.array_equal(a, b)
