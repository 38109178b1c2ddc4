"""Importance-weighted quantizers of the ternary / 1-bit formats: TQ1_0, TQ2_0, IQ1_S, IQ1_M
(csrc/quant/quantizers/iq1_tq.cpp), through _core.quantize_rows.

Oracles: gguf.quants.dequantize decodes the bytes (and TensorFold's own reference
dequantization must agree bit for bit); the quality bar is a round-to-nearest baseline
computed here in numpy on the same blocks (TQ: gguf's own absmax quantizer; IQ1: one scale
from the block's absmax, the largest multiplier everywhere, the + shift, the nearest grid
point of each group of 8) — the weighted error sum_j I_j (x - deq)^2 must be clearly lower.
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import IQ1_S as GgufIQ1S  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from tensorfold import _core  # noqa: E402

TYPES = ["TQ1_0", "TQ2_0", "IQ1_S", "IQ1_M"]

from quant_helpers import COLS, ROWS, _data, _deq, _importance, _quantize, _werr  # noqa: E402,F401


def _iq1_grid() -> np.ndarray:
    if GgufIQ1S.grid is None:
        GgufIQ1S.init_grid()
    return np.asarray(GgufIQ1S.grid, dtype=np.float32).reshape(2048, 8)


def _rtn_baseline(name: str, x: np.ndarray) -> np.ndarray:
    """Dequantized round-to-nearest quantization of x (rows, cols) in format name."""
    if name in ("TQ1_0", "TQ2_0"):
        return _deq(name, gguf_quantize(x, T[name]))
    grid = _iq1_grid()
    b = x.reshape(-1, 256).astype(np.float32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    d = (amax / (15 * 1.125)).astype(np.float16).astype(np.float32)  # multiplier 15, shift +1/8
    D = 15 * d
    y = np.where(D > 0, b / np.where(D > 0, D, 1), 0) - 0.125
    g = y.reshape(-1, 8)
    dist = (g ** 2).sum(1, keepdims=True) - 2 * g @ grid.T + (grid ** 2).sum(1)[None, :]
    pts = grid[dist.argmin(1)].reshape(b.shape)
    return (D * (pts + 0.125)).reshape(x.shape)


@pytest.mark.parametrize("imp_kind", ["I", "none"])
@pytest.mark.parametrize("kind", ["gauss", "t3", "outliers"])
@pytest.mark.parametrize("name", TYPES)
def test_valid_and_better_than_round_to_nearest(name, kind, imp_kind):
    x = _data(kind)
    imp = _importance(imp_kind)
    q = _quantize(name, x, imp)
    y = _deq(name, q)
    assert np.isfinite(y).all()
    # TensorFold's reference decoder reads the same values as gguf's
    for r in range(2):
        ours = np.asarray(_core.dequantize(int(T[name]), q[r], COLS), dtype=np.float32)
        assert np.array_equal(ours.view(np.uint32), y[r].view(np.uint32))
    e = _werr(x, y, imp)
    e_rtn = _werr(x, _rtn_baseline(name, x), imp)
    # measured here: TQ 0.29-0.65 of gguf's absmax quantizer, IQ1 0.03-0.36 of the baseline
    assert e < (0.8 if name.startswith("TQ") else 0.6) * e_rtn, (e, e_rtn)
    # and it is a real fit: the error is well below that of all zeros
    assert e < 0.6 * _werr(x, np.zeros_like(x), imp)


@pytest.mark.parametrize("name", TYPES)
def test_deterministic_and_thread_independent(name):
    x = _data("t3", rows=8, seed=3)
    imp = _importance("I")
    a = _quantize(name, x, imp, threads=1)
    b = _quantize(name, x, imp, threads=1)
    c = _quantize(name, x, imp, threads=3)
    assert np.array_equal(a, b) and np.array_equal(a, c)


@pytest.mark.parametrize("name", TYPES)
def test_importance_is_used(name):
    """Weights concentrated on a few columns: those columns must come out more accurate than
    without importance (the quantizer trades the others for them)."""
    x = _data("gauss", seed=4)
    imp = np.full(COLS, 1e-3, np.float32)
    imp[::16] = 1.0
    e_w = _werr(x, _deq(name, _quantize(name, x, imp)), imp)
    e_u = _werr(x, _deq(name, _quantize(name, x, None)), imp)
    assert e_w < 0.95 * e_u, (e_w, e_u)


@pytest.mark.parametrize("name", TYPES)
def test_edge_rows(name):
    rng = np.random.default_rng(5)
    x = np.zeros((5, COLS), np.float32)
    x[1] = 1e-8 * rng.standard_normal(COLS)  # below fp16 resolution of the scale
    x[2] = 3e4 * rng.standard_normal(COLS)  # large values
    x[3, 100] = 5.0  # one spike in a zero row
    x[4] = rng.standard_normal(COLS)
    for imp in (None, _importance("I")):
        y = _deq(name, _quantize(name, x, imp))
        assert np.isfinite(y).all()
        assert not y[0].any()  # zeros stay zeros
        assert np.abs(y[1]).max() < 1e-6
        for r in (2, 3, 4):  # better than dropping the row
            assert _werr(x[r:r + 1], y[r:r + 1], imp) < _werr(x[r:r + 1], 0 * x[r:r + 1], imp)
    # all-zero importance: zeros
    y = _deq(name, _quantize(name, x, np.zeros(COLS, np.float32)))
    assert not y.any()


@pytest.mark.parametrize("name", TYPES)
def test_requantizing_is_stable(name):
    x = _data("gauss", seed=6)
    imp = _importance("I")
    y = _deq(name, _quantize(name, x, imp))
    y2 = _deq(name, _quantize(name, y, imp))
    if name.startswith("TQ"):
        assert np.array_equal(y, y2)  # a ternary block times an fp16 scale is found exactly
    else:
        assert _werr(y, y2, imp) < 1e-2 * _werr(y, np.zeros_like(y), imp)
