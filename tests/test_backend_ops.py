"""Every operation of the backend seam (csrc/backend/backend.h), through tensorfold._core.Backend,
on every backend this machine has (_core.available_backends(): today the CPU at each
instruction set; a CUDA device adds "cuda" to the list and this whole suite runs on it),
against float64 references written here in numpy. The weight formats' references are the
`gguf` package's dequantizations.

Bounds: products with 8-bit activations meet the rigorous bound of that quantization
(test_kernels.act_quant_bound: each activation value moves by at most amax(block)/254) plus
float32 slack; float operations meet float32 rounding; attention with a half cache meets the
rounding of q, K, V and the probabilities to half (2^-11 relative each).
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
from test_kernels import ALL_TYPES, FLOAT_TYPES, act_quant_bound, block_geometry, make_weights  # noqa: E402

BACKENDS = _core.available_backends()


# A GPU backend's cases carry the `gpu` marker (`pytest -m gpu` selects them on a GPU machine).
BACKEND_PARAMS = [pytest.param(b, marks=pytest.mark.gpu) if b.startswith("cuda") else b for b in BACKENDS]


@pytest.fixture(params=BACKEND_PARAMS, scope="module")
def be(request):
    return _core.Backend(request.param, threads=2)


def test_available_backends_name_this_cpu():
    assert BACKENDS and all(b.startswith(("cpu:", "cuda")) for b in BACKENDS)
    assert "cpu:scalar" in BACKENDS
    with pytest.raises(ValueError, match="unknown backend"):
        _core.Backend("tpu")


# -- products -------------------------------------------------------------------------------
def _check_product(t, W, x, y):
    ref = x.astype(np.float64) @ W.T
    absprod = np.abs(x.astype(np.float64)) @ np.abs(W).T
    scale = max(absprod.max(), 1e-30)
    bound = act_quant_bound(t, W, x) * 1.0001 + 1e-5 * absprod + 1e-7 * scale
    err = np.abs(y.astype(np.float64) - ref)
    assert (err <= bound).all(), f"{t.name}: error {err.max():.3g} over the bound"


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,kb,ncols", [(1, 1, 1), (17, 3, 4), (33, 2, 33)])
def test_matmul(be, t, rows, kb, ncols):
    if not be.supports(int(t)):
        pytest.skip(f"{be.name} has no product kernel for {t.name} (refused at load)")
    rng = np.random.default_rng(hash((int(t), rows, kb, ncols)) % 2**32)
    bs, _ = block_geometry(t)
    k = kb * bs
    raw = make_weights(t, rows, k, rng)
    W = dequantize(raw, t).astype(np.float64)
    x = rng.standard_normal((ncols, k)).astype(np.float32)
    y = be.matmul(int(t), raw.reshape(-1), rows, k, x)
    assert y.shape == (ncols, rows)
    _check_product(t, W, x, y)


@pytest.mark.parametrize("t", [Q.Q4_K, Q.Q8_0, Q.IQ2_XXS, Q.MXFP4, Q.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("gathered", [False, True])
def test_matmul_stack_over_grouped_rows(be, t, gathered):
    """Routed experts: matrix e takes its list rows (some none), gathered from token rows."""
    rng = np.random.default_rng(int(t) + 7 * gathered)
    n, rows = 5, 17
    bs, _ = block_geometry(t)
    k = 2 * bs
    raw = make_weights(t, rows * n, k, rng)
    W = dequantize(raw, t).astype(np.float64).reshape(n, rows, k)
    counts = np.array([3, 0, 1, 6, 2])
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    x = rng.standard_normal((7 if gathered else offsets[-1], k)).astype(np.float32)
    gather = rng.integers(0, x.shape[0], size=offsets[-1]).astype(np.int32) if gathered else None
    y = be.matmul_stack(int(t), raw.reshape(-1), n, rows, k, x, offsets, gather)
    assert y.shape == (offsets[-1], rows)
    for e in range(n):
        for i in range(offsets[e], offsets[e + 1]):
            xi = x[gather[i] if gathered else i][None]
            _check_product(t, W[e], xi, y[i][None])


# -- rows -------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,n", [(1, 7), (5, 576), (33, 64)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rmsnorm(be, T, n, weighted):
    rng = np.random.default_rng(T * n)
    x = rng.standard_normal((T, n)).astype(np.float32) * 3
    w = rng.standard_normal(n).astype(np.float32) if weighted else None
    y = be.rmsnorm(x, w, 1e-6)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * (w if weighted else 1.0)
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("at", [0, 4])
def test_rope_and_its_inverse(be, neox, at):
    rng = np.random.default_rng(3 + at + neox)
    T, H, D, R = 5, 3, 16, 8
    v = rng.standard_normal((T, H * D)).astype(np.float32)
    ang = rng.uniform(0, 6.3, size=(T, R // 2))
    cs = np.stack([np.cos(ang), np.sin(ang)], axis=-1).reshape(T, R).astype(np.float32)
    out = be.rope(v, H, D, at, cs, R, neox)
    ref = v.astype(np.float64).reshape(T, H, D).copy()
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    idx = np.arange(R // 2)
    a = at + (idx if neox else 2 * idx)
    b = at + (idx + R // 2 if neox else 2 * idx + 1)
    x0, x1 = ref[:, :, a].copy(), ref[:, :, b].copy()
    ref[:, :, a] = x0 * c - x1 * s
    ref[:, :, b] = x0 * s + x1 * c
    np.testing.assert_allclose(out, ref.reshape(T, H * D), rtol=1e-5, atol=1e-6)
    back = be.rope(out, H, D, at, cs, R, neox, inverse=True)
    np.testing.assert_allclose(back, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [0, 5])
def test_silu_mul(be, split):
    rng = np.random.default_rng(11 + split)
    g = rng.standard_normal((6, 37)).astype(np.float32) * 4
    u = rng.standard_normal((6, 37)).astype(np.float32)
    out = be.silu_mul(g, u, split)
    g64 = g.astype(np.float64)
    np.testing.assert_allclose(out, g64 / (1 + np.exp(-g64)) * u, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("sigmoid", [False, True])
def test_add_scaled_and_bias(be, sigmoid):
    rng = np.random.default_rng(5)
    y = rng.standard_normal((4, 9)).astype(np.float32)
    x = rng.standard_normal((4, 9)).astype(np.float32)
    s = rng.standard_normal(4).astype(np.float32)
    g = 1 / (1 + np.exp(-s.astype(np.float64))) if sigmoid else s
    np.testing.assert_allclose(be.add_scaled(y, x, s, sigmoid), y + g[:, None] * x, rtol=1e-6, atol=1e-6)
    b = rng.standard_normal(9).astype(np.float32)
    np.testing.assert_allclose(be.add_bias(y, b), 2 * y.astype(np.float64) + b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ4_XS], ids=lambda t: t.name)
def test_embed(be, t):
    rng = np.random.default_rng(int(t))
    bs, _ = block_geometry(t)
    k = bs * 2
    raw = make_weights(t, 9, k, rng)
    tokens = np.array([3, 0, 8, 3], dtype=np.int32)
    out = be.embed(int(t), raw.reshape(-1), 9, k, tokens)
    np.testing.assert_array_equal(out, dequantize(raw, t)[tokens].astype(np.float32))


# -- mixture of experts ----------------------------------------------------------------------
def _route_ref(logits, k, gating, norm, scale):
    p = np.exp(logits - logits.max(1, keepdims=True))
    p = p / p.sum(1, keepdims=True) if gating == 1 else 1 / (1 + np.exp(-logits))
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, 1)
    if norm:
        w = w / w.sum(1, keepdims=True)
    return ids, w * scale


@pytest.mark.parametrize("gating,norm", [(1, False), (1, True), (2, True)])
def test_route_and_combine(be, gating, norm):
    rng = np.random.default_rng(gating * 2 + norm)
    T, NE, K, n = 9, 12, 3, 7
    logits = rng.standard_normal((T, NE)).astype(np.float32) * 3
    ids, w, offsets, rows, slot_of = be.route(logits, K, gating, norm, 1.5)
    slot_of = slot_of.reshape(T, K)
    ref_ids, ref_w = _route_ref(logits.astype(np.float64), K, gating, norm, 1.5)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5)
    # grouped by expert, token order kept: list row slot_of[t, k] is token t's row for its k-th expert
    np.testing.assert_array_equal(np.diff(offsets), np.bincount(ids.ravel(), minlength=NE))
    for t in range(T):
        for j in range(K):
            r = slot_of[t, j]
            assert rows[r] == t and offsets[ids[t, j]] <= r < offsets[ids[t, j] + 1]
    eo = rng.standard_normal((T * K, n)).astype(np.float32)
    out = be.combine(eo, ids, w, slot_of, 0, NE)
    ref = np.zeros((T, n))
    for t in range(T):
        for j in range(K):
            ref[t] += w[t, j] * eo[slot_of[t, j]]
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    half = be.combine(eo, ids, w, slot_of, 0, NE // 2) + be.combine(eo, ids, w, slot_of, NE // 2, NE)
    np.testing.assert_allclose(half, ref, rtol=1e-5, atol=1e-6)


# -- attention --------------------------------------------------------------------------------
def _attention_ref(q, k, v, ends, window, scale, half):
    r = (lambda a: a.astype(np.float16).astype(np.float64)) if half else (lambda a: a.astype(np.float64))
    q, k, v = r(q), r(k), r(v)
    T, HQ, D = q.shape
    HK = k.shape[1]
    out = np.zeros((T, HQ, v.shape[2]))
    for t in range(T):
        lo = max(0, ends[t] - window) if window else 0
        for h in range(HQ):
            g = h // (HQ // HK)
            s = k[lo:ends[t], g] @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = p @ v[lo:ends[t], g] / p.sum()
    return out


@pytest.mark.parametrize("HQ,HK,D", [(4, 2, 64), (8, 1, 128), (3, 3, 80)])
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("prefill", [False, True])
def test_attention_over_the_paged_cache(be, HQ, HK, D, kv_type, window, prefill):
    """Decode (each token alone) and prefill (consecutive positions attended as a block), with
    and without a sliding window, over K/V rows stored through the backend into a paged cache
    (several blocks, tiles of 256 positions: n crosses both)."""
    rng = np.random.default_rng(HQ * D + window + prefill)
    n = 300
    k = rng.standard_normal((n, HK, D)).astype(np.float32)
    v = rng.standard_normal((n, HK, D)).astype(np.float32)
    ends = np.arange(n - 20, n + 1) if prefill else np.array([1, 17, 160, 257, 300])
    q = rng.standard_normal((len(ends), HQ, D)).astype(np.float32)
    scale = 1 / np.sqrt(D)
    out = be.attention(q, k, v, 0, ends.astype(np.int64), window, scale, kv_type)
    ref = _attention_ref(q, k, v, ends, window, scale, kv_type == "f16")
    tol = 4e-3 if kv_type == "f16" else 1e-5
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)


def test_latent_attention_reads_v_from_the_k_rows(be):
    """Multi-head latent attention: one cache row per position, V its first v_dim values."""
    rng = np.random.default_rng(9)
    n, H, D, Dv = 40, 8, 96, 64
    k = rng.standard_normal((n, 1, D)).astype(np.float32)
    ends = np.array([5, 40], dtype=np.int64)
    q = rng.standard_normal((2, H, D)).astype(np.float32)
    out = be.attention(q, k, None, Dv, ends, 0, 0.1, "f32")
    ref = _attention_ref(q, k, k[:, :, :Dv], ends, 0, 0.1, False)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
