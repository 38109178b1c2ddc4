"""Every quantized matmul kernel computes exactly what its 8-bit activations and the weights say.

Why: on llama.cpp-quantized files TensorFold must agree with an exact float64 forward
(tests/reference_forward.py) at least as often as llama.cpp does (tests/test_community_gguf.py).
Both engines round each activation row to 8 bits before every quantized dot product — that
rounding is the only error either is entitled to — and after it llama.cpp's dot products are
exact integer sums with float32 scales. So each TensorFold kernel must equal, to float32
summation accuracy, the float64 product of the dequantized weights (the `gguf` package, DESIGN
§5) and the activations it quantized; and the quantization itself must round as llama.cpp's does
(quantize_row_q8_K_ref: iscale = -127/m with m the value of largest magnitude, sign included,
q = nearest(iscale * x), ties to even, d = 1/iscale — TensorFold keeps d = max|x|/127 > 0 and
q = nearest(x * 127/max|x|): the same q up to the sign of m, and |d| within one float32 ulp of
llama.cpp's (they differ in about a quarter of the blocks, by ~1e-7 relative); for the 32-value
formats the x86 quantize_row_q8_0's q, the scale kept in float32 where llama.cpp's q8_0 stores a
float16).
A kernel whose tile / prefill path rounds or accumulates differently from its GEMV path, an int16
sum that saturates, a scale applied in float16, a wrong sub-block scale or grid/sign entry shows
up here as an error of ~1e-4 .. 1e-1 of the output; the bound is 2e-6 of the sums' size
max(|x| @ |W|.T) (float32 rounding of the per-block partial sums gives <= 6e-8 on these weights).

The existing kernel tests (test_kernels.py) bound the error against the *float* activations by
the rigorous 8-bit bound (1% of the output), which an inexact kernel can pass; these tests
separate the two errors.

Weights: real tensors made by llama.cpp's quantizer with an importance matrix (the committed
tests/fixtures/quant files: every type of every file mix there, imatrix-chosen scales and grid
points), rows concatenated so that rows hold 9-12 blocks of 256 (the K-quant kernels work in
chunks of 8 blocks; 32-value formats get an odd block count, the activation layout's pad
block). Column counts cover GEMV (1), the small-batch tiles (2-8, 13) and prefill (64, 67);
every ISA this CPU has; 1 and 2 threads.
"""
from __future__ import annotations

import glob
import os
from functools import lru_cache

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

from tensorfold import _core  # noqa: E402

QUANT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "quant")
NCOLS = [1, 2, 3, 4, 5, 8, 13, 64, 67]
MAX_ROWS = 48
REL_TOL = 2e-6


def _impls() -> list[str]:
    isa = _core.kernel_isa()
    return {"avx512": ["scalar", "avx2", "avx512"], "avx2": ["scalar", "avx2"]}.get(isa, ["scalar"])


@lru_cache(maxsize=None)
def _tensors() -> dict[str, tuple[np.ndarray, int, int]]:
    """type name -> (raw bytes [rows, row_bytes], k, type id): per type, the largest tensor found
    in the committed llama.cpp-quantized fixtures (expert tensors: the first expert)."""
    best: dict[str, tuple[int, str, str]] = {}
    for path in sorted(glob.glob(os.path.join(QUANT, "*.gguf"))):
        for t in gguf.GGUFReader(path).tensors:
            name = t.tensor_type.name
            if name in ("F32", "F16", "BF16"):
                continue
            size = int(t.shape[0]) * int(t.shape[1])
            if name not in best or size > best[name][0]:
                best[name] = (size, path, t.name)
    out = {}
    for name, (_, path, tname) in best.items():
        t = next(x for x in gguf.GGUFReader(path).tensors if x.name == tname)
        k, rows = int(t.shape[0]), int(t.shape[1])
        raw = np.asarray(t.data).view(np.uint8).reshape(-1, np.asarray(t.data).view(np.uint8).shape[-1])
        raw = raw[:rows]  # expert tensors: the first expert's matrix
        # concatenate rows (blocks are independent) so that a row holds 9..12 blocks of 256
        # (or the same number of values for 32-value formats)
        f = max(1, -(-2304 // k))
        n = (min(rows, MAX_ROWS * f) // f) * f
        w, kk = raw[:n].reshape(n // f, -1), k * f
        bs, ts = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if bs == 32:  # an odd number of 32-value blocks: the activation layout's pad block
            w, kk = w[:, :-ts], kk - 32
        out[name] = (np.ascontiguousarray(w), kk, int(t.tensor_type))
    return out


TYPES = sorted(_tensors()) if os.path.isdir(QUANT) else []


def _activations(ncols: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ncols, k)).astype(np.float32)
    # what a residual stream looks like to the kernels: some large outliers, some tiny rows
    x[:, rng.integers(0, k, max(1, k // 300))] *= 8.0
    if ncols > 2:
        x[1] *= 1e-3
    return x


def _q8_like_llama_cpp(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's 8-bit activation rounding, literally: per 256 values quantize_row_q8_K_ref
    (iscale = -127/m, m the signed value of largest |x| (the first such), q = min(127,
    nearest_even(iscale * x)), d = 1/iscale: d carries the sign); per 32 values the x86
    quantize_row_q8_0 (d = amax/127, q = nearest_even(x * float32(127/amax)))."""
    xb = x.reshape(x.shape[0], -1, block).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    zero = amax == 0
    if block == 256:
        m = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
        iscale = (np.float32(-127) / np.where(zero, np.float32(1), m)).astype(np.float32)
        q = np.minimum(127, np.rint((iscale * xb).astype(np.float32)))
        d = (np.float32(1) / iscale).astype(np.float32)
    else:
        iscale = np.where(zero, np.float32(0), np.float32(127) / np.where(zero, np.float32(1), amax))
        q = np.rint((xb * iscale.astype(np.float32)).astype(np.float32))
        d = (amax / np.float32(127)).astype(np.float32)
    q = np.where(zero, 0, q)
    d = np.where(zero, np.float32(0), d)
    assert np.abs(q).max() <= 127
    return q.astype(np.int64), d[..., 0]


def _engine_activations(type_id: int, x: np.ndarray, impl: str) -> tuple[np.ndarray, np.ndarray, int]:
    """TensorFold's quantized activation rows, decoded from the layout kernels_internal.h
    documents: q [ncols, k] (int), d [ncols, nblocks] (float32), the block length."""
    qs, ds = [], []
    block = 32 if gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)][0] == 32 else 256
    for row in x:
        b = np.asarray(_core.kernels_quantize_act(type_id, row, impl=impl))
        k = row.size
        if block == 256:  # K layout: one 320-byte ActK per 256 values
            assert b.size == (k // 256) * 320
            blk = b.reshape(-1, 320)
            d = blk[:, :4].copy().view(np.float32)[:, 0]
            q = blk[:, 64:].view(np.int8).astype(np.int64)
            bsums = blk[:, 4:36].copy().view(np.int16).astype(np.int64)
            np.testing.assert_array_equal(bsums, q.reshape(-1, 16, 16).sum(-1), err_msg="bsums")
        else:  # G32 layout: int8 qs[ngroups*64], then float (d0, d1, s0, s1) per group
            ng = (k // 32 + 1) // 2
            q = b[:ng * 64].view(np.int8).astype(np.int64)[:k].reshape(-1, 32)
            sc = b[ng * 64:].copy().view(np.float32).reshape(ng, 4)
            d = sc[:, :2].reshape(-1)[:k // 32]
            s = sc[:, 2:].reshape(-1)[:k // 32]
            np.testing.assert_allclose(s, d * q.sum(-1), rtol=1e-6, err_msg="block sums s = d * sum(q)")
        qs.append(q.reshape(-1))
        ds.append(d)
    return np.array(qs), np.array(ds), block


@pytest.mark.parametrize("tname", TYPES)
def test_activation_rounding_is_llama_cpps(tname):
    """The 8-bit activations of every layout, on every ISA, are llama.cpp's rounding of them."""
    raw, k, tid = _tensors()[tname]
    x = _activations(5, k, 1)
    for impl in _impls():
        q, d, block = _engine_activations(tid, x, impl)
        want_q, want_d = _q8_like_llama_cpp(x, block)
        # llama.cpp's q8_K scale carries the sign of the block's largest value; TensorFold's is
        # positive: the same products (q * d), q equal up to that sign
        sign = np.where(want_d < 0, -1, 1)
        np.testing.assert_array_equal(q.reshape(want_q.shape), want_q * sign[..., None],
                                      err_msg=f"{tname} {impl}: q")
        want_abs = np.abs(want_d)
        if block == 256:  # 1/(127/amax) against amax/127: at most one float32 ulp apart
            ulp = np.spacing(want_abs.astype(np.float32))
            assert np.all(np.abs(d.astype(np.float64) - want_abs) <= ulp), f"{tname} {impl}: scale"
        else:
            np.testing.assert_array_equal(d, want_abs, err_msg=f"{tname} {impl}: scale")


@pytest.mark.parametrize("tname", TYPES)
def test_kernel_is_exact_over_its_activations(tname):
    """y == dequant(W) @ (d * q) in float64 to float32 accuracy, for every ISA, tile shape and
    thread count."""
    raw, k, tid = _tensors()[tname]
    rows = raw.shape[0]
    W = dequantize(raw.reshape(-1), tid).astype(np.float64).reshape(rows, k)
    worst = 0.0
    for ncols in NCOLS:
        x = _activations(ncols, k, 100 + ncols)
        q, d, block = _engine_activations(tid, x, "scalar")
        xq = (q.reshape(ncols, -1, block) * d[..., None].astype(np.float64)).reshape(ncols, k)
        want = xq @ W.T
        size = np.abs(xq) @ np.abs(W).T  # the sums' size without cancellation
        scale = size.max(axis=1, keepdims=True)
        # every backend (the seam's product: each CPU instruction set, a GPU where there is
        # one), 1 and 2 threads, and a row count that leaves a partial tile (rows - 5)
        for backend in _core.available_backends():
            for threads, n_rows in ((1, rows), (2, rows), (2, rows - 5)):
                be = _core.Backend(backend, threads)
                y = np.asarray(be.matmul(tid, np.ascontiguousarray(raw[:n_rows]).reshape(-1), n_rows, k, x),
                               np.float64)
                err = np.abs(y - want[:, :n_rows]) / scale
                worst = max(worst, float(err.max()))
                r, c = np.unravel_index(np.argmax(err), err.shape)
                assert err.max() <= REL_TOL, (
                    f"{tname} k={k} {backend} x{ncols} rows={n_rows} threads={threads}: |y - exact| / max|x||W| = "
                    f"{err.max():.2e} at column {r} row {c} (y {y[r, c]:.6g}, exact {want[r, c]:.6g})")
    print(f"{tname}: k={k} rows={rows} worst relative error {worst:.1e}")


def test_fixture_types_cover_llama_cpp_mixes():
    """The committed files give this test every weight type llama.cpp's mixes use here."""
    want = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
            "IQ3_S", "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"}
    assert want <= set(TYPES), sorted(want - set(TYPES))
