"""Microbenchmarks of the CPU low-bit matmul kernels (pytest-benchmark).

GEMV (decode): one activation row against a weight matrix larger than the L3 cache, on 2
threads; reports effective weight bandwidth (weight bytes / time) and its fraction of the
DRAM read bandwidth measured in the same run (a threaded streaming read of a buffer as large as the weights).
GEMM (prefill): Q4_1 / Q4_K at SmolLM2-135M sizes with 64 and 512 activation rows; reports
GFLOP/s (2*rows*k*ncols / time, activation quantization included).

Run:  TENSORFOLD_CORE_DIR=build PYTHONPATH=python \
      python3 -m pytest -q bench/bench_kernels.py --benchmark-only -s
Environment (bench/_common.py): TF_BENCH_GEMV_MB (weight matrix size, default 4 x the L3),
TF_BENCH_THREADS (2). bench_products.py measures every format through the backend seam; this
file measures the kernels alone (kernels_matmul: no backend, its own row split).
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

import _common  # noqa: E402
from _common import GEMV_BYTES, THREADS  # noqa: E402
from tensorfold import _core  # noqa: E402

pytestmark = pytest.mark.bench
HALF_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}
GEMV_TYPES = [Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
              Q.F16, Q.BF16, Q.F32]


def random_weights(t: Q, rows: int, k: int, seed: int = 0) -> np.ndarray:
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    nb = k // bs
    rng = np.random.default_rng(seed)
    if t in (Q.F32, Q.F16, Q.BF16):
        # random mantissas and signs, exponent fixed near 2^-7 (normal numbers: denormals
        # would measure the FPU's microcode assists, not the kernel)
        if t == Q.F32:
            u = np.frombuffer(rng.bytes(rows * k * 4), dtype=np.uint32).copy()
            u &= np.uint32(0x807FFFFF)
            u |= np.uint32(0x3C000000)
        else:
            u = np.frombuffer(rng.bytes(rows * k * 2), dtype=np.uint16).copy()
            u &= np.uint16(0x83FF if t == Q.F16 else 0x807F)
            u |= np.uint16(0x2000 if t == Q.F16 else 0x3C00)
        return u.view(np.uint8)
    raw = np.frombuffer(rng.bytes(rows * nb * ts), dtype=np.uint8).copy().reshape(rows * nb, ts)
    half = np.float16(0.01).view(np.uint16)
    for off in HALF_FIELDS[t]:
        raw[:, off] = half & 0xFF
        raw[:, off + 1] = half >> 8
    return raw.reshape(-1)


@pytest.mark.parametrize("t", GEMV_TYPES, ids=lambda t: t.name)
def test_gemv_bandwidth(benchmark, dram_gbps, t):
    bs, ts = gguf.GGML_QUANT_SIZES[t]
    k = 4096
    row_bytes = k // bs * ts
    rows = max(1, GEMV_BYTES // row_bytes)
    w = random_weights(t, rows, k)
    x = np.random.default_rng(1).standard_normal((1, k)).astype(np.float32)
    _core.kernels_matmul(int(t), w, rows, k, x, threads=THREADS)  # warm-up (page-in)
    benchmark.pedantic(_core.kernels_matmul, args=(int(t), w, rows, k, x),
                       kwargs={"threads": THREADS}, rounds=5, iterations=1, warmup_rounds=1)
    sec = benchmark.stats.stats.min
    gbps = w.nbytes / sec / 1e9
    frac = gbps / dram_gbps
    benchmark.extra_info["isa"] = _core.kernel_isa()
    _common.record(benchmark, "kernels (kernels_matmul, no backend)", f"GEMV {t.name} {rows}x{k}",
                   weight_MB=w.nbytes / 1e6, GB_s=gbps, frac_of_dram=frac)
    print(f"\n[gemv] {t.name:5s} {rows}x{k} ({w.nbytes / 1e6:.0f} MB): {sec * 1e3:.1f} ms, "
          f"{gbps:.2f} GB/s = {frac:.1%} of DRAM read bandwidth")


GEMM_CASES = [
    (Q.Q4_1, 1536, 576, 64), (Q.Q4_1, 1536, 576, 512),  # ffn up/gate: k = hidden
    (Q.Q4_1, 576, 1536, 64), (Q.Q4_1, 576, 1536, 512),  # ffn down
    (Q.Q4_K, 576, 1536, 64), (Q.Q4_K, 576, 1536, 512),  # Q4_K needs k % 256 == 0
]


@pytest.mark.parametrize("t,rows,k,ncols", GEMM_CASES,
                         ids=[f"{t.name}-{r}x{k}-n{n}" for t, r, k, n in GEMM_CASES])
def test_gemm_gflops(benchmark, t, rows, k, ncols):
    w = random_weights(t, rows, k)
    x = np.random.default_rng(2).standard_normal((ncols, k)).astype(np.float32)
    benchmark.pedantic(_core.kernels_matmul, args=(int(t), w, rows, k, x),
                       kwargs={"threads": THREADS}, rounds=20, iterations=1, warmup_rounds=2)
    sec = benchmark.stats.stats.min
    gflops = 2.0 * rows * k * ncols / sec / 1e9
    benchmark.extra_info["isa"] = _core.kernel_isa()
    _common.record(benchmark, "kernels (kernels_matmul, no backend)", f"GEMM {t.name} {rows}x{k} T={ncols}",
                   GFLOP_s=gflops)
    print(f"\n[gemm] {t.name} {rows}x{k} ncols={ncols}: {sec * 1e3:.2f} ms, {gflops:.1f} GFLOP/s")
