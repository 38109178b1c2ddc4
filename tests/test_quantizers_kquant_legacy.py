"""Importance-weighted quantizers of the 4-8 bit formats (csrc/quant/quantizers/legacy.cpp,
kquants.cpp, iq4.cpp) through `_core.quantize_rows`.

Oracles: the `gguf` package decodes every output (and the project's reference dequantizer must
agree with it bit for bit); the quality bar is a plain absmax round-to-nearest quantizer of the
same blocks written here in numpy (fp16 scales, integer sub-block scales against an fp16
super-scale, as the formats store them): the weighted error sum_i w_i (x_i - deq_i)^2 of the
quantizer under test must be below it, with and without importance weights.
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from tensorfold import _core  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_NL", "IQ4_XS", "MXFP4"]
COLS = 2048
IQ4NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
MXFP4_LEVELS = np.array([-12, -8, -6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6, 8, 12], np.float32)  # doubled E2M1


def _quantize(name: str, x: np.ndarray, imp: np.ndarray | None) -> np.ndarray:
    out = _core.quantize_rows(int(T[name]), np.ascontiguousarray(x, np.float32), imp)
    bs, ts = GGML_QUANT_SIZES[T[name]]
    assert out.dtype == np.uint8 and out.shape == (x.shape[0], x.shape[1] // bs * ts)
    return out


def _dequantize(name: str, q: np.ndarray) -> np.ndarray:
    y = gguf_dequantize(q, T[name]).astype(np.float32).reshape(q.shape[0], -1)
    assert np.isfinite(y).all()
    return y


def _werr(x: np.ndarray, y: np.ndarray, imp: np.ndarray | None) -> float:
    w = 1.0 if imp is None else imp.astype(np.float64)
    return float((w * (x.astype(np.float64) - y) ** 2).sum())


# ---- the round-to-nearest baseline, in numpy -------------------------------------------------

def _f16(v):
    return np.asarray(v, np.float32).astype(np.float16).astype(np.float32)


def _div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def _signed_absmax(b):
    i = np.argmax(np.abs(b), -1)
    return np.take_along_axis(b, i[..., None], -1)


def _nearest(v, levels):
    return levels[np.argmin(np.abs(v[..., None] - levels), -1)]


def _rtn_sym(b, qmin, qmax):  # the largest magnitude on qmin (ggml's reference convention)
    d = _f16(_signed_absmax(b) / qmin)
    return d * np.clip(np.rint(_div(b, d)), qmin, qmax)


def _rtn_affine(b, qmax):
    lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
    d, m = _f16((hi - lo) / qmax), _f16(lo)
    return d * np.clip(np.rint(_div(b - m, d)), 0, qmax) + m


def _rtn_k_affine(x, sub, qmax, smax):
    b = x.reshape(x.shape[0], -1, 256 // sub, sub)
    mn = np.maximum(0, -b.min(-1, keepdims=True))
    s = (b.max(-1, keepdims=True) + mn) / qmax
    d = _f16(s.max(-2, keepdims=True) / smax)
    dm = _f16(mn.max(-2, keepdims=True) / smax)
    e = d * np.clip(np.rint(_div(s, d)), 0, smax)
    o = dm * np.clip(np.rint(_div(mn, dm)), 0, smax)
    return (e * np.clip(np.rint(_div(b + o, e)), 0, qmax) - o).reshape(x.shape)


def _rtn_k_sym(x, sub, qmin, qmax, slo, shi, levels=None):
    b = x.reshape(x.shape[0], -1, 256 // sub, sub)
    lmin = qmin if levels is None else levels[0]
    s = _signed_absmax(b) / lmin
    d = _f16(_signed_absmax(s[..., 0])[..., None] / slo)
    e = d * np.clip(np.rint(_div(s, d)), slo, shi)
    if levels is None:
        y = e * np.clip(np.rint(_div(b, e)), qmin, qmax)
    else:
        y = e * _nearest(_div(b, e), levels)
    return y.reshape(x.shape)


def _rtn(name: str, x: np.ndarray) -> np.ndarray:
    b32 = x.reshape(x.shape[0], -1, 32)
    if name == "Q4_0":
        y = _rtn_sym(b32, -8, 7)
    elif name == "Q5_0":
        y = _rtn_sym(b32, -16, 15)
    elif name == "Q8_0":
        d = _f16(np.abs(b32).max(-1, keepdims=True) / 127)
        y = d * np.clip(np.rint(_div(b32, d)), -127, 127)
    elif name == "Q4_1":
        y = _rtn_affine(b32, 15)
    elif name == "Q5_1":
        y = _rtn_affine(b32, 31)
    elif name == "IQ4_NL":
        d = _f16(_signed_absmax(b32) / -127)
        y = d * _nearest(_div(b32, d), IQ4NL_LEVELS)
    elif name == "MXFP4":
        amax = np.abs(b32).max(-1, keepdims=True)
        s = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax, 1) / 12)), 0).astype(np.float32)
        y = s * _nearest(_div(b32, s), MXFP4_LEVELS)
    elif name == "Q2_K":
        return _rtn_k_affine(x, 16, 3, 15)
    elif name == "Q4_K":
        return _rtn_k_affine(x, 32, 15, 63)
    elif name == "Q5_K":
        return _rtn_k_affine(x, 32, 31, 63)
    elif name == "Q3_K":
        return _rtn_k_sym(x, 16, -4, 3, -32, 31)
    elif name == "Q6_K":
        return _rtn_k_sym(x, 16, -32, 31, -128, 127)
    elif name == "IQ4_XS":
        return _rtn_k_sym(x, 32, 0, 0, -32, 31, IQ4NL_LEVELS)
    else:
        raise AssertionError(name)
    return y.reshape(x.shape)


# ---- data ------------------------------------------------------------------------------------

def _data(kind: str, seed: int, rows: int = 8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        x = rng.standard_normal((rows, COLS))
    elif kind == "student_t":
        x = rng.standard_t(3, (rows, COLS))
    elif kind == "outliers":
        x = rng.standard_normal((rows, COLS))
        m = rng.random((rows, COLS)) < 0.003
        x[m] *= 30
    else:
        raise AssertionError(kind)
    return (0.02 * x).astype(np.float32)


def _importance(seed: int) -> np.ndarray:
    return np.exp(2 * np.random.default_rng(seed).standard_normal(COLS)).astype(np.float32)


# ---- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("kind", ["gauss", "student_t", "outliers"])
@pytest.mark.parametrize("weighted", [False, True], ids=["uniform", "importance"])
def test_valid_and_better_than_round_to_nearest(name, kind, weighted):
    x = _data(kind, seed=10 * TYPES.index(name) + len(kind))
    imp = _importance(7) if weighted else None
    q = _quantize(name, x, imp)
    y = _dequantize(name, q)
    # The project's reference decoder reads the same values (bit for bit) as the gguf package.
    ref = np.stack([np.asarray(_core.dequantize(int(T[name]), q[r].tobytes(), COLS)) for r in range(x.shape[0])])
    assert np.array_equal(ref.view(np.uint32), y.view(np.uint32))
    ours, rtn = _werr(x, y, imp), _werr(x, _rtn(name, x), imp)
    assert ours < rtn, f"{name} {kind}: weighted error {ours:.4g} >= round-to-nearest {rtn:.4g}"


@pytest.mark.parametrize("name", TYPES)
def test_importance_steers_the_error(name):
    """Quantizing with the importance lowers the importance-weighted error versus quantizing
    the same rows without it."""
    x = _data("student_t", seed=3)
    imp = _importance(11)
    with_imp = _werr(x, _dequantize(name, _quantize(name, x, imp)), imp)
    without = _werr(x, _dequantize(name, _quantize(name, x, None)), imp)
    assert with_imp < without


@pytest.mark.parametrize("name", TYPES)
def test_zeros_extremes_and_zero_weights(name):
    rng = np.random.default_rng(5)
    zeros = np.zeros((2, COLS), np.float32)
    assert (_dequantize(name, _quantize(name, zeros, None)) == 0).all()
    assert (_dequantize(name, _quantize(name, zeros, _importance(1))) == 0).all()
    # Values far below / above the fp16 scale range: finite, and never worse than zeros.
    for scale in (1e-8, 1e-42, 1e6):
        v = (rng.standard_normal((2, COLS)) * scale).astype(np.float32)
        y = _dequantize(name, _quantize(name, v, None))
        assert _werr(v, y, None) <= _werr(v, np.zeros_like(v), None)
    # Columns of zero importance: blocks made only of them come back as zeros, the rest as usual.
    x = _data("gauss", seed=6, rows=2)
    imp = _importance(2)
    imp[:256] = 0
    imp[rng.random(COLS) < 0.2] = 0
    y = _dequantize(name, _quantize(name, x, imp))
    assert (y[:, :256] == 0).all()
    assert _werr(x, y, imp) < _werr(x, _rtn(name, x), imp)


@pytest.mark.parametrize("name", TYPES)
def test_requantization_is_stable(name):
    """Quantizing dequantized output again changes it by far less than the first quantization
    did."""
    x = _data("gauss", seed=9, rows=4)
    y1 = _dequantize(name, _quantize(name, x, None))
    y2 = _dequantize(name, _quantize(name, y1, None))
    assert _werr(y1, y2, None) <= 0.02 * _werr(x, y1, None)


def _grid_blocks(name: str, rows: int, seed: int) -> np.ndarray:
    """Random blocks of a legacy format (random levels, fp16 scale d > 0 and, for the offset
    formats, min m) dequantized: values that lie on that format's grid."""
    rng = np.random.default_rng(seed)
    bs, ts = GGML_QUANT_SIZES[T[name]]
    nb = rows * COLS // bs
    raw = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    raw[:, 0:2] = (np.abs(rng.standard_normal(nb)) * 0.002 + 1e-4).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if name in ("Q4_1", "Q5_1"):
        raw[:, 2:4] = (rng.standard_normal(nb) * 0.02).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return gguf_dequantize(raw.reshape(rows, -1), T[name]).astype(np.float32).reshape(rows, COLS)


@pytest.mark.parametrize("name", ["Q4_1", "Q5_1", "Q4_0", "Q5_0"])
@pytest.mark.parametrize("weighted", [False, True], ids=["uniform", "importance"])
def test_values_on_the_grid_come_back(name, weighted):
    """Weights that already lie on the format's grid (dequantized blocks, stored as fp16, the
    usual source precision) are reproduced up to that fp16 rounding."""
    grid = _grid_blocks(name, rows=8, seed=21)
    x = grid.astype(np.float16).astype(np.float32)
    imp = _importance(4) if weighted else None
    y = _dequantize(name, _quantize(name, x, imp))
    # The grid itself is one encoding, off only by the fp16 rounding of x; the offset formats
    # may land an fp16 step away in d or m (measured: 0.7 .. 1.12 times the grid's error).
    floor = _werr(x, grid, imp)
    assert _werr(x, y, imp) <= 1.25 * floor
    rel = np.sqrt(((x - y) ** 2).sum() / (x ** 2).sum())
    assert rel < 5e-4, rel  # fp16 rounding of x alone: ~2e-4
