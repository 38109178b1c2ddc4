"""Shared by the quantizer tests: test matrices, importance vectors, and the quantize ->
gguf-dequantize round trip with its weighted error (gguf.quants is the oracle)."""
from __future__ import annotations

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from tensorfold import _core

COLS = 1024
ROWS = 6


def _data(kind: str, rows: int = ROWS, cols: int = COLS, seed: int = 0) -> np.ndarray:
    """gauss, heavy-tailed (Student t, 3 dof) or mostly-small-with-rare-outliers rows."""
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        return rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "t3":
        return rng.standard_t(3, (rows, cols)).astype(np.float32)
    if kind == "outliers":
        x = 0.02 * rng.standard_normal((rows, cols))
        m = rng.random((rows, cols)) < 0.003
        x[m] *= 60
        return x.astype(np.float32)
    raise ValueError(kind)


def _importance(kind: str, cols: int = COLS) -> np.ndarray | None:
    """None, or log-normal per-column importance spanning a few decades."""
    if kind == "none":
        return None
    return np.exp(2 * np.random.default_rng(7).standard_normal(cols)).astype(np.float32)


def _quantize(name: str, x: np.ndarray, imp: np.ndarray | None, threads: int = 1) -> np.ndarray:
    q = np.asarray(_core.quantize_rows(int(T[name]), x, imp, threads))
    block, size = GGML_QUANT_SIZES[T[name]]
    assert q.dtype == np.uint8 and q.shape == (x.shape[0], x.shape[1] // block * size)
    return q


def _deq(name: str, q: np.ndarray) -> np.ndarray:
    return np.asarray(gguf_dequantize(q, T[name]), dtype=np.float32).reshape(q.shape[0], -1)


def _werr(x: np.ndarray, y: np.ndarray, imp: np.ndarray | None) -> float:
    e = (x.astype(np.float64) - y.astype(np.float64)) ** 2
    return float((e if imp is None else e * imp[None, :].astype(np.float64)).sum())
