"""Importance-weighted IQ2_XXS / IQ2_XS / IQ2_S quantizers (csrc/quant/quantizers/iq2.cpp).

Through tensorfold._core.quantize_rows(type_id, x, importance):
- validity: the bytes are the format's size, gguf.quants.dequantize reads them back finite,
  rows of zeros give zeros, the output is deterministic and independent of the thread count;
- quality: the weighted error sum_j I_j (x - deq)^2 is below that of a plain absmax
  round-to-nearest encoding of the same blocks, computed here in numpy (sub-block scales
  from the absmax, 4-bit scales against d = max/31, each group of 8 snapped to the nearest
  grid point, signs from x with the parity fix on the cheapest element).
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants as gq  # noqa: E402

_core = pytest.importorskip("tensorfold._core")
if not hasattr(_core, "quantize_rows"):
    pytest.skip("tensorfold._core has no quantize_rows", allow_module_level=True)

# type id -> (gguf quant class, bytes per 256, weights per 4-bit scale, parity signs)
TYPES = {
    16: (gq.IQ2_XXS, 66, 32, True),
    17: (gq.IQ2_XS, 74, 16, True),
    22: (gq.IQ2_S, 82, 16, False),
}
COLS = 1024


def grid_of(cls) -> np.ndarray:
    cls.init_grid()
    return np.asarray(cls.grid, np.float32).reshape(-1, 8)


def dequant(tid: int, b: np.ndarray) -> np.ndarray:
    return gq.dequantize(b, Q(tid)).reshape(b.shape[0], -1).astype(np.float32)


def f16(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float32).astype(np.float16).astype(np.float32)


def rtn_baseline(tid: int, x: np.ndarray) -> np.ndarray:
    """Dequantized values of an absmax round-to-nearest encoding of x (rows of 256-blocks)."""
    cls, _, sub, parity = TYPES[tid]
    grid = grid_of(cls)
    rows, cols = x.shape
    xb = x.reshape(-1, 256)
    a = np.abs(xb)
    s_sub = a.reshape(len(xb), -1, sub).max(-1) / 43.0                      # [B, nsub]
    d = f16(s_sub.max(-1) * 8.0 / 31.0)                                      # [B]
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(d[:, None] > 0, np.rint((8.0 * s_sub / d[:, None] - 1.0) / 2.0), 0)
    u = np.clip(u, 0, 15)
    s = d[:, None] * (2 * u + 1) / 8.0                                       # [B, nsub]
    s_w = np.repeat(s, sub, axis=1)                                          # [B, 256]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(s_w > 0, a / s_w, 0).reshape(-1, 8)                     # [G, 8]
    dist = ((y[:, None, :] - grid[None, :, :]) ** 2).sum(-1)                 # [G, K]
    g = grid[dist.argmin(-1)]                                                # [G, 8]
    sign = np.where(xb.reshape(-1, 8) < 0, -1.0, 1.0)
    if parity:
        odd = (sign < 0).sum(-1) % 2 == 1
        m = np.abs(xb.reshape(-1, 8)).argmin(-1)
        sign[odd, m[odd]] *= -1
    return (sign * g * s_w.reshape(-1, 8)).reshape(rows, cols).astype(np.float32)


def data(kind: str, rng: np.random.Generator, rows: int = 8) -> np.ndarray:
    if kind == "gauss":
        return rng.standard_normal((rows, COLS)).astype(np.float32)
    if kind == "student3":
        return rng.standard_t(3, (rows, COLS)).astype(np.float32)
    if kind == "outliers":
        x = rng.standard_normal((rows, COLS)).astype(np.float32)
        x[rng.random(x.shape) < 0.003] *= 40
        return x
    if kind == "scaled":
        return (rng.standard_normal((rows, COLS)) * np.logspace(-4, 3, rows)[:, None]).astype(np.float32)
    raise ValueError(kind)


def quantize(tid: int, x: np.ndarray, imp: np.ndarray | None, **kw) -> np.ndarray:
    b = np.asarray(_core.quantize_rows(tid, x, imp, **kw))
    assert b.dtype == np.uint8 and b.shape == (x.shape[0], x.shape[1] // 256 * TYPES[tid][1])
    return b


@pytest.mark.parametrize("tid", list(TYPES))
@pytest.mark.parametrize("kind", ["gauss", "student3", "outliers", "scaled"])
@pytest.mark.parametrize("weighted", [True, False])
def test_valid_and_better_than_rtn(tid, kind, weighted):
    rng = np.random.default_rng([tid, len(kind), int(weighted)])
    x = data(kind, rng)
    imp = np.exp(2 * rng.standard_normal(COLS)).astype(np.float32) if weighted else None
    w = imp if weighted else np.ones(COLS, np.float32)
    b = quantize(tid, x, imp)
    d = dequant(tid, b)
    assert np.isfinite(d).all()
    assert np.array_equal(b, quantize(tid, x, imp)), "not deterministic"
    base = rtn_baseline(tid, x)
    for r in range(x.shape[0]):
        ours = float((w * (x[r] - d[r]) ** 2).sum())
        rtn = float((w * (x[r] - base[r]) ** 2).sum())
        assert ours < rtn, f"row {r}: weighted error {ours:.6g} not below round-to-nearest {rtn:.6g}"
    # total: clearly better, not just marginally
    tot = float((w * (x - d) ** 2).sum())
    tot_rtn = float((w * (x - base) ** 2).sum())
    assert tot < 0.95 * tot_rtn, (tot, tot_rtn)


@pytest.mark.parametrize("tid", list(TYPES))
def test_special_rows(tid):
    rng = np.random.default_rng(tid)
    x = rng.standard_normal((6, COLS)).astype(np.float32)
    x[0] = 0                                      # zeros
    x[1] *= 1e-8                                  # below the smallest fp16 scale step
    x[2, :256] = 0                                # a zero block inside a row
    x[3, 300] = 1e4                               # one huge outlier (its group cannot fit both)
    x[4] = np.abs(x[4])                           # all positive (parity of the signs)
    x[5] = -np.abs(x[5])                          # all negative
    imp = np.exp(rng.standard_normal(COLS)).astype(np.float32)
    imp[:64] = 0                                  # ignored columns
    for importance in (imp, None):
        b = quantize(tid, x, importance)
        d = dequant(tid, b)
        assert np.isfinite(d).all()
        assert not d[0].any() and not d[2, :256].any()
        assert np.abs(d[1]).max() <= 1e-6
        w = importance if importance is not None else np.ones(COLS, np.float32)
        for r in (4, 5):
            assert (w * (x[r] - d[r]) ** 2).sum() < 0.5 * (w * x[r] ** 2).sum()
        base = rtn_baseline(tid, x[3:4])[0]
        assert (w * (x[3] - d[3]) ** 2).sum() < (w * (x[3] - base) ** 2).sum()
        # signs follow x where the magnitude matters
        big = (np.abs(x[4]) > 0.5) & (w > 0)
        assert (d[4][big] > 0).mean() > 0.95 and (d[5][big] < 0).mean() > 0.95
    # all-zero importance on the whole row: zeros (nothing to fit)
    b = quantize(tid, x[4:5], np.zeros(COLS, np.float32))
    assert not dequant(tid, b).any()


@pytest.mark.parametrize("tid", list(TYPES))
def test_threads_and_requantize(tid):
    rng = np.random.default_rng(100 + tid)
    x = rng.standard_t(4, (16, COLS)).astype(np.float32)
    imp = np.exp(rng.standard_normal(COLS)).astype(np.float32)
    b1 = quantize(tid, x, imp)
    try:
        b4 = quantize(tid, x, imp, threads=4)
    except TypeError:  # binding without the threads argument
        b4 = b1
    assert np.array_equal(b1, b4)
    # re-quantizing the dequantized values is (nearly) lossless: they lie on the format
    d = dequant(tid, b1)
    d2 = dequant(tid, quantize(tid, d, None))
    assert ((d - d2) ** 2).sum() <= 1e-3 * (d**2).sum()
