"""Attention over the paged KV cache (F16 entries), through the backend seam: decode (one query
token) at 1K, 16K and 64K cached positions and prefill blocks (64 / 512 query tokens, the last
ones of a cache of 1K or 16K: causal within the block), for

* GQA: 32 query heads over 8 cache heads of 128 (K and V rows);
* MLA: one latent row of 576 per position (V = its first 512) read by 16 or 128 query heads.

The K/V rows are stored once per layout (_core.BenchAttention, the largest context; a shorter
context reads a prefix of the same sequence), so a timed call is one Backend.attention.
Reports GFLOP/s (2 * query heads * (K dim + V dim) * positions read) and, for decode, the cache
bytes read per second and their fraction of the DRAM read bandwidth (1K positions fit the L3).
TF_BENCH_MAX_CONTEXT (default 65536) skips the cases of a longer context.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import _common  # noqa: E402
from _common import make_backend, record  # noqa: E402
from tensorfold import _core  # noqa: E402

pytestmark = pytest.mark.bench

MAX_CONTEXT = int(os.environ.get("TF_BENCH_MAX_CONTEXT", "65536"))
KV_BYTES = 2  # F16 cache entries

# name: (query heads, cache heads, K dim, V dim, latent: V is the K row's prefix)
LAYOUTS = {
    "gqa32/8x128": (32, 8, 128, 128, False),
    "mla16x576": (16, 1, 576, 512, True),
    "mla128x576": (128, 1, 576, 512, True),
}
# (layout, query tokens, context); prefill of 512 tokens stops at 16K on GQA and 1K on 128-head
# MLA, whose cost grows as heads x context x tokens (seconds per call beyond).
CASES = [(lay, 1, n) for lay in LAYOUTS for n in (1024, 16384, 65536)]
CASES += [("gqa32/8x128", t, n) for t in (64, 512) for n in (1024, 16384)]
CASES += [("mla16x576", t, n) for t, n in ((64, 1024), (64, 16384), (512, 1024))]
CASES += [("mla128x576", 64, 1024)]

_caches: dict[tuple[str, int], object] = {}


def cache_for(be, backend_name: str, cache_heads: int, k_dim: int, v_dim: int, latent: bool):
    """One sequence of the longest context this run needs, its rows random normals."""
    key = (backend_name, cache_heads, k_dim, v_dim, latent)
    if key not in _caches:
        n = min(MAX_CONTEXT, max(n for _, _, n in CASES))
        rng = np.random.default_rng(0)
        k = rng.standard_normal((n, cache_heads, k_dim), dtype=np.float32)
        v = None if latent else rng.standard_normal((n, cache_heads, v_dim), dtype=np.float32)
        _caches[key] = _core.BenchAttention(be, k, v, v_dim, 0, "f16")
    return _caches[key]


_backends: dict[str, object] = {}


@pytest.mark.parametrize("backend_name", _common.backend_names())
@pytest.mark.parametrize("layout,T,context", CASES, ids=[f"{lay}-T{t}-ctx{n}" for lay, t, n in CASES])
def test_attention(benchmark, dram_gbps, backend_name, layout, T, context):
    if context > MAX_CONTEXT:
        pytest.skip(f"context {context} > TF_BENCH_MAX_CONTEXT={MAX_CONTEXT}")
    if backend_name not in _backends:
        _backends[backend_name] = make_backend(backend_name)
    be = _backends[backend_name]
    HQ, HK, D, DV, latent = LAYOUTS[layout]
    cache = cache_for(be, backend_name, HK, D, DV, latent)
    q = np.random.default_rng(T).standard_normal((T, HQ, D), dtype=np.float32)
    ends = np.arange(context - T + 1, context + 1, dtype=np.int64)
    flops = 2.0 * HQ * (D + DV) * float(ends.sum())
    rounds = 3 if flops > 20e9 else 8  # the largest prefill blocks take seconds a call
    out = benchmark.pedantic(cache.run, args=(q, ends, D ** -0.5), rounds=rounds, iterations=1, warmup_rounds=1)
    assert out.shape == (T, HQ, DV) and np.isfinite(out).all(), "non-finite attention output"
    sec = _common.best_seconds(benchmark)
    if sec is None:
        return
    # the cache rows of the context, read once per call (a prefill block shares its tiles)
    kv_bytes = context * HK * (D + (0 if latent else DV)) * KV_BYTES
    gbps = kv_bytes / sec / 1e9
    record(benchmark, "attention", f"{layout} T={T} ctx={context} {backend_name}",
           kv_MB=kv_bytes / 1e6, GB_s=gbps if T == 1 else None, frac_of_dram=gbps / dram_gbps if T == 1 else None,
           GFLOP_s=flops / sec / 1e9)


# -- the lightning indexer (DeepSeek-V4 CSA layers) ---------------------------------------------
# V4-Flash's indexer: 64 heads of 128 over one compressed key per 4 tokens, top 512; the synthetic
# bench model's 16 heads. Decode (one query token) at 16K entries = 64K tokens of context.
INDEX_CASES = [(h, n) for h in (16, 64) for n in (4096, 16384)]
_index_caches: dict[tuple[str, int], tuple] = {}


@pytest.mark.parametrize("backend_name", _common.backend_names())
@pytest.mark.parametrize("H,entries", INDEX_CASES, ids=[f"H{h}-entries{n}" for h, n in INDEX_CASES])
def test_index_topk(benchmark, dram_gbps, backend_name, H, entries):
    D, k = 128, 512
    if backend_name not in _backends:
        _backends[backend_name] = make_backend(backend_name)
    be = _backends[backend_name]
    key = (backend_name, entries)
    if key not in _index_caches:
        kv = _core.KvCache([dict(heads=1, k_dim=D, compression=4)], 4 * entries + 64, "f16", be)
        s = kv.create_sequence()
        assert kv.reserve(s, 4 * entries)
        rows = np.random.default_rng(0).standard_normal((entries, 1, D), dtype=np.float32)
        kv.write_k(be, 0, s, np.arange(entries, dtype=np.int64), rows)
        _index_caches[key] = (kv, s)
    kv, s = _index_caches[key]
    rng = np.random.default_rng(H)
    q = rng.standard_normal((1, H, D), dtype=np.float32)
    w = np.abs(rng.standard_normal((1, H), dtype=np.float32))
    args = (kv, 0, q, w, np.array([s], np.int32), np.array([entries], np.int64), k)
    idx = benchmark.pedantic(be.index_topk, args=args, rounds=8, iterations=1, warmup_rounds=1)
    assert idx.shape == (1, k) and idx.min() >= 0
    sec = _common.best_seconds(benchmark)
    if sec is None:
        return
    gbps = entries * D * KV_BYTES / sec / 1e9
    record(benchmark, "index_topk", f"H={H} entries={entries} {backend_name}",
           GMAC_s=H * D * entries / sec / 1e9, GB_s=gbps, frac_of_dram=gbps / dram_gbps)
