"""The CUDA backend's host-side logic, checked on every machine (no GPU needed):

* the format decoder every CUDA product and embedding kernel runs (csrc/backend/cuda/
  format_decode.h, compiled here by the C++ compiler): bit-exact against the `gguf` package's
  dequantization for each of the 20 formats with a CUDA kernel;
* the kernels' product scheme (activations quantized to int8 per 32 values, integer dot
  products per 16 values with their own scale and min): within the 8-bit activation bound of
  test_kernels.act_quant_bound against float64;
* the CUDA memory plan (device_plan.cpp) on made-up discrete and integrated devices.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from tensorfold import _core  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_kernels import act_quant_bound, block_geometry, make_weights  # noqa: E402

cuda = _core.cuda

KERNEL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS,
                Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_XS, Q.IQ4_NL, Q.MXFP4, Q.F32, Q.F16, Q.BF16]
GiB = 1 << 30


def test_kernel_type_list():
    names = cuda.kernel_types().split(", ")
    assert sorted(names) == sorted(t.name for t in KERNEL_TYPES)
    for t in KERNEL_TYPES:
        assert cuda.has_kernel(int(t))
    for t in (Q.IQ1_S, Q.IQ1_M, Q.TQ1_0, Q.TQ2_0):
        assert not cuda.has_kernel(int(t))


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=lambda t: t.name)
def test_decoder_matches_gguf(t):
    rng = np.random.default_rng(int(t))
    bs, _ = block_geometry(t)
    k = 4 * bs if bs >= 32 else 64
    raw = make_weights(t, 3, k, rng)
    ref = dequantize(raw, t).astype(np.float32).reshape(-1)
    out = cuda.emulate_dequantize(int(t), raw.reshape(-1), ref.size)
    # every value exact (nan where gguf gives nan)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,kb,ncols", [(1, 1, 1), (17, 3, 4), (5, 2, 9)])
def test_product_scheme_within_activation_bound(t, rows, kb, ncols):
    rng = np.random.default_rng(int(t) * 131 + rows)
    bs, _ = block_geometry(t)
    k = kb * max(bs, 32) if bs >= 32 else 96
    raw = make_weights(t, rows, k, rng)
    W = dequantize(raw, t).astype(np.float64).reshape(rows, k)
    x = rng.standard_normal((ncols, k)).astype(np.float32)
    x[0, : min(k, 40)] *= 30.0  # an outlier block, as real activations have
    y = cuda.emulate_matmul(int(t), raw.reshape(-1), rows, k, x)
    ref = x.astype(np.float64) @ W.T
    absprod = np.abs(x.astype(np.float64)) @ np.abs(W).T
    bound = act_quant_bound(t, W, x) * 1.0001 + 2e-6 * absprod + 1e-7 * max(absprod.max(), 1e-30)
    err = np.abs(y.astype(np.float64) - ref)
    assert (err <= bound).all(), f"{t.name}: error {err.max():.3g} over the bound"


def test_emulation_refuses_types_without_kernel():
    with pytest.raises(ValueError, match="no kernel for type IQ1_S"):
        cuda.emulate_dequantize(int(Q.IQ1_S), np.zeros(50, np.uint8), 256)


# -- memory plan -----------------------------------------------------------------------------
H100 = {"name": "H100 (made up)", "cc_major": 9, "cc_minor": 0, "total_bytes": 80 * GiB,
        "free_bytes": 79 * GiB, "integrated": False, "sm_count": 132}
GB10 = {"name": "GB10 (made up)", "cc_major": 12, "cc_minor": 1, "total_bytes": 128 * GiB,
        "free_bytes": 20 * GiB,  # cudaMemGetInfo counts the page cache as used there
        "integrated": True, "sm_count": 48}


def test_plan_discrete_fits_and_counts_lines_separately():
    p = cuda.plan_device(H100, {"weights": 40 * GiB, "kv": 20 * GiB, "scratch": 2 * GiB, "workspace": GiB})
    assert p["fits"] and not p["unified"] and not p["weights_in_place"]
    what = [w for w, _ in p["lines"]]
    assert what == ["weights (uploaded once)", "KV cache pool", "activation scratch", "backend workspace",
                    "CUDA context"]
    ctx = dict(p["lines"])["CUDA context"]
    assert 384 << 20 < ctx < GiB
    assert p["total"] == 63 * GiB + ctx
    # the limit: total less what is in use (1 GiB) less 2%
    assert p["limit"] == 80 * GiB - GiB - (80 * GiB) // 50


def test_plan_discrete_over_budget_is_refused_with_the_table():
    p = cuda.plan_device(H100, {"weights": 60 * GiB, "kv": 18 * GiB, "scratch": GiB})
    assert not p["fits"]
    assert "OVER" in p["table"] and "KV cache pool" in p["table"] and "CUDA context" in p["table"]


def test_plan_discrete_counts_memory_in_use_by_others():
    busy = dict(H100, free_bytes=30 * GiB)
    need = {"weights": 40 * GiB, "kv": 8 * GiB}
    assert cuda.plan_device(H100, need)["fits"]
    assert not cuda.plan_device(busy, need)["fits"]


def test_plan_integrated_is_one_pool_against_the_budget():
    need = {"weights": 98 * GiB, "kv": 20 * GiB, "scratch": GiB, "workspace": GiB // 2, "budget": 122 * GiB}
    p = cuda.plan_device(GB10, need)
    assert p["unified"] and p["weights_in_place"]
    assert dict(p["lines"])["weights (mapped file, in place)"] == 98 * GiB
    assert p["limit"] == 122 * GiB and p["limit_source"] == "the memory budget"
    assert p["fits"]  # cudaMemGetInfo's 20 GiB "free" is not the limit on a unified machine
    assert not cuda.plan_device(GB10, dict(need, kv=23 * GiB))["fits"]


def test_plan_integrated_without_budget_keeps_room_for_the_os():
    p = cuda.plan_device(GB10, {"weights": 100 * GiB, "kv": 16 * GiB})
    assert p["limit"] == 128 * GiB - (128 * GiB) // 10
    assert not p["fits"]
    # a budget above the machine is capped at the machine
    p = cuda.plan_device(GB10, {"weights": GiB, "budget": 512 * GiB})
    assert p["limit"] == 128 * GiB


def test_build_reports_cuda_state():
    if cuda.built_with_cuda():
        archs = cuda.compiled_archs().split(",")
        assert archs and all(a.isdigit() for a in archs)
        assert cuda.build_note() == ""
    else:
        assert cuda.build_note()
        assert cuda.compiled_archs() == ""


def test_auto_picks_cpu_without_a_device():
    if cuda.device_count() > 0:
        pytest.skip("a CUDA device is present: auto picks it")
    assert _core.Backend("auto").name.startswith("cpu:")
    assert "cuda" not in _core.available_backends()
    with pytest.raises(Exception, match="cuda"):
        _core.Backend("cuda")


# -- grouped products: the packing plan (grouping.cpp) the CUDA kernels index by ------------------
def _stack_reference(t, raw, n, rows, k, x, offsets, gather, first, last):
    W = dequantize(raw, t).astype(np.float64).reshape(n, rows, k)
    y = np.full((offsets[-1], rows), np.nan)
    for e in range(first, last):
        for i in range(offsets[e], offsets[e + 1]):
            src = gather[i] if gather is not None else i
            y[i] = W[e] @ x[src].astype(np.float64)
    return W, y


@pytest.mark.parametrize("t", [Q.Q4_K, Q.Q8_0, Q.IQ2_XXS, Q.MXFP4, Q.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("first,last", [(0, 5), (1, 4)])
def test_grouped_lists_through_the_packing_plan(t, gathered, first, last):
    """Routed experts: matrix e takes its list rows (some none, some more than a tile of 8),
    gathered from token rows; an expert-parallel share [first, last) of the stack."""
    rng = np.random.default_rng(int(t) + 7 * gathered + first)
    n, rows = 5, 9
    bs, _ = block_geometry(t)
    k = 2 * max(bs, 32) if bs >= 32 else 64
    raw = make_weights(t, rows * n, k, rng)
    counts = np.array([3, 0, 11, 6, 2])
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x = rng.standard_normal((7 if gathered else offsets[-1], k)).astype(np.float32)
    gather = rng.integers(0, 7, size=offsets[-1]).astype(np.int32) if gathered else None
    y = cuda.emulate_matmul_stack(int(t), raw.reshape(-1), n, rows, k, x, offsets, gather, first, last)
    W, ref = _stack_reference(t, raw, n, rows, k, x, offsets, gather, first, last)
    done = ~np.isnan(ref)
    assert (np.isnan(y) == ~done).all(), "rows outside [first, last) written, or rows inside missed"
    for e in range(first, last):
        for i in range(offsets[e], offsets[e + 1]):
            xi = x[gather[i] if gathered else i][None]
            bound = act_quant_bound(t, W[e], xi)[0] * 1.0001 + 2e-6 * (np.abs(xi[0]) @ np.abs(W[e]).T) + 1e-6
            assert (np.abs(y[i] - ref[i]) <= bound).all(), f"{t.name}: list row {i}"


@pytest.mark.parametrize("t", [Q.Q6_K, Q.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("R", [1, 3, 17])
def test_grouped_batches_through_the_packing_plan(t, R):
    """Per-head products: row j of matrix e at x[j, e*k:(e+1)*k], output [e, j]."""
    rng = np.random.default_rng(R)
    n, rows = 3, 5
    bs, _ = block_geometry(t)
    k = max(bs, 32) if bs >= 32 else 64
    raw = make_weights(t, rows * n, k, rng)
    W = dequantize(raw, t).astype(np.float64).reshape(n, rows, k)
    x = rng.standard_normal((R, n * k)).astype(np.float32)
    y = cuda.emulate_matmul_batches(int(t), raw.reshape(-1), n, rows, k, x)
    assert y.shape == (n, R, rows)
    for e in range(n):
        xe = x[:, e * k:(e + 1) * k]
        ref = xe.astype(np.float64) @ W[e].T
        bound = act_quant_bound(t, W[e], xe) * 1.0001 + 2e-6 * (np.abs(xe) @ np.abs(W[e]).T) + 1e-6
        assert (np.abs(y[e] - ref) <= bound).all(), f"{t.name}: matrix {e}"
