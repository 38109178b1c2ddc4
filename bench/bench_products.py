"""Products (matmul) of every weight format the backend computes with, through the backend seam
(_core.Backend(name, threads).matmul: activation quantization + the product, as a forward pass
runs it), at 1, 4, 64 and 512 activation rows (columns) of k = 4096.

* 1 and 4 columns (decode): a weight matrix of TF_BENCH_GEMV_MB (default 4 x L3) so that every
  call reads it from DRAM; reports the effective weight bandwidth (weight bytes / time) and its
  fraction of the DRAM read bandwidth measured in the same run, and GFLOP/s.
* 64 and 512 columns (prefill): a TF_BENCH_GEMM_ROWS x 4096 matrix (default 4096 rows);
  reports GFLOP/s (2 * rows * k * columns / time).

Weights are random normal rows quantized by TensorFold's own quantizers (bench/_common.py).
Formats: every GGML type for which backend.supports(type) is true; backends: TF_BENCH_BACKENDS.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

import _common  # noqa: E402
from _common import GEMV_BYTES, make_backend, quantized_rows, record  # noqa: E402
from tensorfold import _core  # noqa: E402

pytestmark = pytest.mark.bench

K = 4096
GEMM_ROWS = int(os.environ.get("TF_BENCH_GEMM_ROWS", "4096"))
COLUMNS = [1, 4, 64, 512]
# Rounds per column count (the best round is reported: on a shared host more rounds find a quiet
# moment): decode calls take milliseconds, 512 columns up to a second.
ROUNDS = {1: 20, 4: 10, 64: 6, 512: 4}


def _computable_types() -> list[Q]:
    probe = _core.Backend("cpu", 1)
    return [t for t in Q if probe.supports(int(t))]


TYPES = _computable_types()
ROW_BYTES = {t: K // gguf.GGML_QUANT_SIZES[t][0] * gguf.GGML_QUANT_SIZES[t][1] for t in TYPES}
CASES = [(b, t, n) for b in _common.backend_names() for t in TYPES for n in COLUMNS]

# The current format's matrices (one format at a time: cases run format by format).
_weights: dict[tuple[Q, int], np.ndarray] = {}


def weights_for(t: Q, rows: int) -> np.ndarray:
    if (t, rows) not in _weights:
        if any(key[0] != t for key in _weights):
            _weights.clear()
        _weights[(t, rows)] = quantized_rows(int(t), rows, K).reshape(-1)
    return _weights[(t, rows)]


@pytest.mark.parametrize("backend_name,t,ncols", CASES, ids=[f"{t.name}-T{n}-{b}" for b, t, n in CASES])
def test_product(benchmark, dram_gbps, backend_name, t, ncols):
    be = make_backend(backend_name)
    if not be.supports(int(t)):
        pytest.skip(f"{backend_name} does not compute with {t.name}")
    decode = ncols <= 4
    rows = max(16, GEMV_BYTES // ROW_BYTES[t]) if decode else GEMM_ROWS
    w = weights_for(t, rows)
    x = np.random.default_rng(ncols).standard_normal((ncols, K), dtype=np.float32)
    y = benchmark.pedantic(be.matmul, args=(int(t), w, rows, K, x), rounds=ROUNDS[ncols], iterations=1,
                           warmup_rounds=1)
    assert y.shape == (ncols, rows) and np.isfinite(y).all(), f"{t.name}: non-finite product"
    sec = _common.best_seconds(benchmark)
    if sec is None:
        return
    gbps = w.nbytes / sec / 1e9
    record(benchmark, "products", f"{t.name} T={ncols} {backend_name}",
           rows=rows, weight_MB=w.nbytes / 1e6,
           GB_s=gbps if decode else None, frac_of_dram=gbps / dram_gbps if decode else None,
           GFLOP_s=2.0 * rows * K * ncols / sec / 1e9)
