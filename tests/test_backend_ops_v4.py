"""The backend ops DeepSeek-V4 adds to the seam (csrc/backend/backend.h), through
tensorfold._core.Backend on every backend this machine has, against float64 references written
here in numpy (and, for the hyper-connection maps, transformers' own modules when torch is
importable):

* attention with sinks and a second source of entries (a compressed layer's entries, all of a
  prefix or a per-token list), over rows written into a real KvCache;
* gated pooling (a compressor's softmax-gated windows), the lightning indexer's top-k;
* hyper-connection maps (sigmoid, softmax + Sinkhorn), collapse and expand;
* clamped SwiGLU, sqrtsoftplus routing with a selection bias, hash routing (fixed ids).

Bounds: a half cache's rows are stored rounded to half, and the references read those same
rounded rows; everything else the ops do is float32 arithmetic (q stays float), so they meet
float32 rounding: a dot of D terms is off by at most ~D * 2^-24 of sum |q_i k_i| (2e-5 covers the
sizes here with a wide margin), sums of exponentials and normalisations by a few 2^-24.
"""
from __future__ import annotations

import numpy as np
import pytest

from tensorfold import _core

BACKENDS = _core.available_backends()
F32_EPS = 2.0 ** -24


# A GPU backend's cases carry the `gpu` marker (`pytest -m gpu` selects them on a GPU machine).
BACKEND_PARAMS = [pytest.param(b, marks=pytest.mark.gpu) if b.startswith("cuda") else b for b in BACKENDS]


@pytest.fixture(params=BACKEND_PARAMS, scope="module")
def be(request):
    return _core.Backend(request.param, threads=2)


# The DeepSeek-V4 operations the CUDA backend has no kernel for yet (it refuses them by name).
CUDA_MISSING = {
    "test_attention_extra": "no CUDA kernel yet for attention over a second (compressed) cache layer",
    "test_attention_model_sized_decode": "no CUDA kernel yet for attention over a second (compressed) cache layer",
    "test_gated_pool": "no CUDA kernel yet for gated_pool",
    "test_index_topk": "no CUDA kernel yet for index_topk",
    "test_hyper_maps": "no CUDA kernel yet for hyper_maps",
}


@pytest.fixture(autouse=True)
def _skip_ops_cuda_lacks(request):
    if "be" in request.fixturenames and str(request.node.callspec.params.get("be", "")).startswith("cuda"):
        for prefix, why in CUDA_MISSING.items():
            if request.node.name.startswith(prefix):
                pytest.skip(why)


def _as_stored(a, kv_type):
    """The values a cache of kv_type holds for a (float64)."""
    return (a.astype(np.float16) if kv_type == "f16" else a.astype(np.float32)).astype(np.float64)


# -- attention with sinks and extra entries ----------------------------------------------------
class V4Cache:
    """A KvCache of two layers written through the backend: layer 0 holds every token's rows
    (heads x k_dim, V rows of v_dim or none: V is the K row's prefix), layer 1 one compressed
    entry per 4 tokens (one head; V rows of extra_v_dim or none). Keeps what was stored, as the
    cache holds it, for the reference."""

    def __init__(self, be, kv_type, lengths, heads, D, v_dim=0, extra_v_dim=0, window=0, seed=0):
        rng = np.random.default_rng(seed)
        self.kv_type = kv_type
        specs = [dict(heads=heads, k_dim=D, v_dim=v_dim, window=window),
                 dict(heads=1, k_dim=D, v_dim=extra_v_dim, compression=4)]
        # whole blocks per sequence in both groups (a compressed block covers 64 tokens)
        self.kv = _core.KvCache(specs, sum(-(-n // 64) * 64 + 64 for n in lengths), kv_type, be)
        self.seqs, self.k, self.v, self.ek, self.ev = [], [], [], [], []
        for n in lengths:
            s = self.kv.create_sequence()
            assert self.kv.reserve(s, n)
            n_extra = -(-n // 4)
            entries, extra = np.arange(n, dtype=np.int64), np.arange(n_extra, dtype=np.int64)
            k = rng.standard_normal((n, heads, D)).astype(np.float32)
            ek = rng.standard_normal((n_extra, 1, D)).astype(np.float32)
            self.kv.write_k(be, 0, s, entries, k)
            self.kv.write_k(be, 1, s, extra, ek)
            self.k.append(_as_stored(k, kv_type))
            self.ek.append(_as_stored(ek, kv_type))
            if v_dim:
                v = rng.standard_normal((n, heads, v_dim)).astype(np.float32)
                self.kv.write_v(be, 0, s, entries, v)
                self.v.append(_as_stored(v, kv_type))
            else:
                self.v.append(self.k[-1])
            if extra_v_dim:
                ev = rng.standard_normal((n_extra, 1, extra_v_dim)).astype(np.float32)
                self.kv.write_v(be, 1, s, extra, ev)
                self.ev.append(_as_stored(ev, kv_type))
            else:
                self.ev.append(self.ek[-1])
            self.seqs.append(s)


def _attention_ref(c, q, seq_index, ends, window, scale, v_dim, sinks=None, extra=None):
    """float64 attention of token t over layer 0's entries [lo, ends[t]) of its sequence and the
    layer-1 entries extra[t] (a list of entry indices), one softmax with the sink logit."""
    T, HQ, _ = q.shape
    q = q.astype(np.float64)
    out = np.zeros((T, HQ, v_dim))
    for t in range(T):
        i = seq_index[t]
        lo = max(0, ends[t] - window) if window else 0
        sel = np.asarray(extra[t] if extra is not None else [], dtype=np.int64)
        HK = c.k[i].shape[1]
        for h in range(HQ):
            g = h // (HQ // HK)
            K = np.concatenate([c.k[i][lo:ends[t], g], c.ek[i][sel, 0]])
            V = np.concatenate([c.v[i][lo:ends[t], g, :v_dim], c.ev[i][sel, 0, :v_dim]])
            logits = K @ q[t, h] * scale
            if sinks is not None:
                logits = np.append(logits, sinks[h])
            p = np.exp(logits - logits.max())
            out[t, h] = p[:len(K)] @ V / p.sum()
    return out


ATT_TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "HQ,HK,D,v_dim,latent",
    [(8, 2, 64, 64, False), (8, 1, 96, 64, True), (6, 3, 40, 24, False), (16, 1, 72, 72, True)],
)
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("prefill", [False, True])
def test_attention_with_sinks(be, HQ, HK, D, v_dim, latent, kv_type, window, prefill):
    """Sinks alone: every head's softmax has one more logit and no value; the tokens' entries
    cross blocks (16) and tiles (64 to 256 rows)."""
    n = 300
    c = V4Cache(be, kv_type, [n], HK, D, v_dim=0 if latent else v_dim, seed=HQ + D + window)
    rng = np.random.default_rng(D + prefill)
    ends = np.arange(n - 20, n + 1) if prefill else np.array([1, 17, 160, 257, 300])
    q = rng.standard_normal((len(ends), HQ, D)).astype(np.float32)
    sinks = (rng.standard_normal(HQ) * 2).astype(np.float32)
    sinks[0] = 8.0  # a sink that takes most of the mass
    scale = 1 / np.sqrt(D)
    seqs = np.full(len(ends), c.seqs[0], np.int32)
    out = be.attention_kv(c.kv, 0, q, seqs, ends.astype(np.int64), window, scale, v_dim, sinks=sinks)
    ref = _attention_ref(c, q, [0] * len(ends), ends, window, scale, v_dim, sinks=sinks)
    np.testing.assert_allclose(out, ref, **ATT_TOL)


def _batch(c, rng, HQ, D):
    """Several sequences in one batch (lengths 60, 230, 9, 1): a prefill chunk of sequence 0 (8
    consecutive tokens), a decode token of sequence 1, a prefill chunk of sequence 2, the first
    token of sequence 3."""
    rows = [(0, e) for e in range(41, 49)] + [(1, 200), (2, 3), (2, 4), (2, 5), (3, 1)]
    seq_index = np.array([r[0] for r in rows])
    ends = np.array([r[1] for r in rows], dtype=np.int64)
    seqs = np.array([c.seqs[i] for i in seq_index], dtype=np.int32)
    q = rng.standard_normal((len(rows), HQ, D)).astype(np.float32)
    return seq_index, seqs, ends, q


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize(
    "HQ,HK,D,v_dim,main_v,extra_v",
    [(16, 1, 64, 64, 0, 0), (16, 1, 80, 48, 0, 0), (6, 2, 40, 24, 24, 0), (5, 1, 40, 24, 0, 32)],
)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_attention_extra_entries_by_count(be, kv_type, HQ, HK, D, v_dim, main_v, extra_v, with_sinks):
    """A window over the layer's own rows plus every compressed entry before the token's
    (extra_count = end // 4, the entries whose 4 tokens it has seen), several sequences and
    prefill chunks in one batch; the window group has let go of the blocks behind the window."""
    window = 16
    c = V4Cache(be, kv_type, [60, 230, 9, 1], HK, D, v_dim=main_v, extra_v_dim=extra_v, window=window, seed=D + HQ)
    rng = np.random.default_rng(D * 3 + with_sinks)
    seq_index, seqs, ends, q = _batch(c, rng, HQ, D)
    for i in range(4):  # holes before the window: blocks nothing reads any more
        first_end = ends[seq_index == i].min()
        c.kv.advance(c.seqs[i], np.zeros(first_end, np.int32), int(first_end) - 1)
    assert c.kv.block_table(0, c.seqs[1])[0] == -1
    count = (ends // 4).astype(np.int64)
    sinks = rng.standard_normal(HQ).astype(np.float32) if with_sinks else None
    scale = 1 / np.sqrt(D)
    out = be.attention_kv(c.kv, 0, q, seqs, ends, window, scale, v_dim, sinks=sinks, extra_layer=1,
                          extra_count=count)
    ref = _attention_ref(c, q, seq_index, ends, window, scale, v_dim, sinks=sinks,
                         extra=[np.arange(m) for m in count])
    np.testing.assert_allclose(out, ref, **ATT_TOL)


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("HQ,HK,D,v_dim", [(16, 1, 64, 64), (8, 2, 48, 40), (7, 1, 33, 33)])
@pytest.mark.parametrize("window", [0, 16])
def test_attention_extra_entries_by_list(be, kv_type, HQ, HK, D, v_dim, window):
    """Each token reads its own list of compressed entries (an indexer's top-k): -1 places are
    skipped, one token's list is all -1, lists are in no particular order; with sinks."""
    c = V4Cache(be, kv_type, [60, 230, 9, 1], HK, D, window=window, seed=D + window)
    rng = np.random.default_rng(D + HQ)
    seq_index, seqs, ends, q = _batch(c, rng, HQ, D)
    L = 12
    lst = np.full((len(ends), L), -1, np.int32)
    for t, e in enumerate(ends):
        avail = int(e) // 4
        pick = rng.permutation(avail)[: min(avail, L - 3)]  # never full: some -1 left
        places = rng.choice(L, size=len(pick), replace=False)
        lst[t, places] = pick
    lst[3] = -1
    sinks = rng.standard_normal(HQ).astype(np.float32)
    scale = 1 / np.sqrt(D)
    out = be.attention_kv(c.kv, 0, q, seqs, ends, window, scale, v_dim, sinks=sinks, extra_layer=1, extra_list=lst)
    ref = _attention_ref(c, q, seq_index, ends, window, scale, v_dim, sinks=sinks,
                         extra=[row[row >= 0] for row in lst])
    np.testing.assert_allclose(out, ref, **ATT_TOL)


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_attention_extra_empty_list(be, kv_type):
    """A list of no entries (extra_len 0): the tokens read their window alone."""
    HQ, D = 4, 32
    c = V4Cache(be, kv_type, [50], 1, D, seed=5)
    rng = np.random.default_rng(6)
    ends = np.array([10, 11, 12, 50], dtype=np.int64)
    q = rng.standard_normal((4, HQ, D)).astype(np.float32)
    seqs = np.full(4, c.seqs[0], np.int32)
    out = be.attention_kv(c.kv, 0, q, seqs, ends, 8, 0.2, D, extra_layer=1, extra_list=np.zeros((4, 0), np.int32))
    ref = _attention_ref(c, q, [0] * 4, ends, 8, 0.2, D)
    np.testing.assert_allclose(out, ref, **ATT_TOL)


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("by_list", [False, True])
def test_attention_model_sized_decode(be, kv_type, by_list):
    """DeepSeek-V4's shapes: one row of 512 per entry (K = V), 16 query heads on one cache head,
    a window of 128 and a few hundred compressed entries (tiles of 64 rows), sinks; two tokens
    of one sequence and one of another."""
    HQ, D, window = 16, 512, 128
    c = V4Cache(be, kv_type, [1400, 900], 1, D, window=window, seed=11)
    rng = np.random.default_rng(12)
    seq_index = np.array([0, 0, 1])
    ends = np.array([1399, 1400, 900], dtype=np.int64)
    seqs = np.array([c.seqs[i] for i in seq_index], np.int32)
    q = (rng.standard_normal((3, HQ, D)) * 0.5).astype(np.float32)
    sinks = rng.standard_normal(HQ).astype(np.float32)
    scale = 1 / np.sqrt(D)
    if by_list:
        lst = np.stack([rng.permutation(int(e) // 4)[:200] for e in ends]).astype(np.int32)
        lst[:, ::7] = -1
        kw, extra = dict(extra_list=lst), [row[row >= 0] for row in lst]
    else:
        kw, extra = dict(extra_count=ends // 4), [np.arange(int(e) // 4) for e in ends]
    out = be.attention_kv(c.kv, 0, q, seqs, ends, window, scale, D, sinks=sinks, extra_layer=1, **kw)
    ref = _attention_ref(c, q, seq_index, ends, window, scale, D, sinks=sinks, extra=extra)
    np.testing.assert_allclose(out, ref, **ATT_TOL)


def test_attention_rejects_entries_not_in_the_cache(be):
    """Entries past the sequence's blocks (a compressed block holds 16 entries) are refused."""
    c = V4Cache(be, "f32", [20], 1, 16, seed=1)
    q = np.zeros((1, 2, 16), np.float32)
    seqs = np.array([c.seqs[0]], np.int32)
    ends = np.array([20], np.int64)
    for lst in ([[0, 16]], [[0, -2]]):
        with pytest.raises(ValueError):
            be.attention_kv(c.kv, 0, q, seqs, ends, extra_layer=1, extra_list=np.array(lst, np.int32))
    with pytest.raises(ValueError):
        be.attention_kv(c.kv, 0, q, seqs, ends, extra_layer=1, extra_count=np.array([17], np.int64))
    with pytest.raises(ValueError):
        be.attention_kv(c.kv, 0, q, seqs, np.array([33], np.int64))


# -- gated pooling ------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("n_slots,D,with_bias", [(8, 64, True), (5, 33, True), (128, 16, True), (3, 7, False)])
def test_gated_pool(be, kv_type, n_slots, D, with_bias):
    """A compressor's windows: slot s of entry e reads its values and gate logits from a row
    (the first half of the slots one part of the row, the rest another, as CSA's overlapping
    windows do), absent slots (-1) take no part; an entry with no slot pools to zeros."""
    rng = np.random.default_rng(n_slots * D)
    count, W = 6, 4 * D
    R = count * n_slots
    src = rng.standard_normal((R, W)).astype(np.float32)
    src[:, 2 * D:] *= 3  # gate logits of some spread
    which = rng.permutation(R).reshape(count, n_slots).astype(np.int32)
    which[rng.random((count, n_slots)) < 0.3] = -1
    which[1] = -1
    which[2, 0] = 5  # ...and one entry with a single slot
    which[2, 1:] = -1
    first = np.arange(n_slots) < n_slots // 2
    kv_at = np.where(first, 0, D).astype(np.int64)
    gate_at = np.where(first, 2 * D, 3 * D).astype(np.int64)
    bias = rng.standard_normal((n_slots, D)).astype(np.float32) if with_bias else None
    out = be.gated_pool(src, kv_type, which, kv_at, gate_at, bias, D)
    rows = _as_stored(src, kv_type)
    ref = np.zeros((count, D))
    for e in range(count):
        present = [s for s in range(n_slots) if which[e, s] >= 0]
        if not present:
            continue
        g = np.stack([rows[which[e, s], gate_at[s]:gate_at[s] + D] + (bias[s] if with_bias else 0) for s in present])
        v = np.stack([rows[which[e, s], kv_at[s]:kv_at[s] + D] for s in present])
        p = np.exp(g - g.max(0))
        ref[e] = (p * v).sum(0) / p.sum(0)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert not out[1].any()


# -- lightning indexer ----------------------------------------------------------------------------
def _index_cache(be, kv_type, counts, D, values):
    kv = _core.KvCache([dict(heads=1, k_dim=D, compression=4)], sum(4 * n + 64 for n in counts), kv_type, be)
    seqs, keys = [], []
    for n in counts:
        s = kv.create_sequence()
        assert kv.reserve(s, 4 * n)
        k = values((n, 1, D))
        if n:
            kv.write_k(be, 0, s, np.arange(n, dtype=np.int64), k)
        seqs.append(s)
        keys.append(_as_stored(k[:, 0], kv_type))
    return kv, seqs, keys


def _index_scores(q, w, K):
    """float64 sum_h w[h] relu(q[h] . k_s) for every entry s."""
    return (np.maximum(K @ q.astype(np.float64).T, 0) * w.astype(np.float64)).sum(1)


def _topk_ref(scores, k):
    order = sorted(range(len(scores)), key=lambda s: (-scores[s], s))[:k]
    return order + [-1] * (k - len(order))


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_index_topk_exact_with_ties(be, kv_type):
    """Small integers make every score exact in float (and in half), so the picks must equal the
    reference exactly; they tie often (the lower entry goes first). A token with fewer entries
    than k is padded with -1, one with none is all -1; the long sequence (9000 entries, a lone
    token) is scored in ranges whose picks are merged."""
    H, D, k = 4, 32, 16
    rng = np.random.default_rng(1)
    ints = lambda shape: rng.integers(-2, 3, size=shape).astype(np.float32)  # noqa: E731
    counts = [0, 3, 50, 9000]
    kv, seqs, keys = _index_cache(be, kv_type, counts, D, ints)
    for tokens in ([3], [1, 0, 2, 3, 2, 1]):  # a lone long token (split), then a batch
        T = len(tokens)
        q = ints((T, H, D))
        w = rng.integers(0, 4, size=(T, H)).astype(np.float32)
        idx = be.index_topk(kv, 0, q, w, np.array([seqs[i] for i in tokens], np.int32),
                            np.array([counts[i] for i in tokens], np.int64), k)
        assert idx.shape == (T, k) and idx.dtype == np.int32
        for t, i in enumerate(tokens):
            ref = _topk_ref(_index_scores(q[t], w[t], keys[i]), k)
            np.testing.assert_array_equal(idx[t], ref, err_msg=f"token {t} (sequence {i})")


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("tokens", [[0], [1, 0, 1]])
@pytest.mark.parametrize("H", [8, 20, 32, 64])
def test_index_topk_random(be, kv_type, tokens, H):
    """Continuous data: the picks, in order, have the reference's k best scores (a pick may
    differ from the reference's only where two scores are within float rounding). Head counts
    cover every grouping of the vector kernels (one, two or four vectors of heads, and padding)."""
    D, k = 64, 64
    rng = np.random.default_rng(2)
    normal = lambda shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    counts = [5000, 300]
    kv, seqs, keys = _index_cache(be, kv_type, counts, D, normal)
    T = len(tokens)
    q = normal((T, H, D))
    w = np.abs(normal((T, H)))
    idx = be.index_topk(kv, 0, q, w, np.array([seqs[i] for i in tokens], np.int32),
                        np.array([counts[i] for i in tokens], np.int64), k)
    for t, i in enumerate(tokens):
        scores = _index_scores(q[t], w[t], keys[i])
        assert len(set(idx[t].tolist())) == k and idx[t].min() >= 0
        best = np.sort(scores)[::-1][:k]
        bound = 4 * D * H * F32_EPS * (np.abs(keys[i]) @ np.abs(q[t]).T * w[t]).sum(1).max()
        np.testing.assert_allclose(scores[idx[t]], best, rtol=0, atol=bound)


# -- hyper-connections ----------------------------------------------------------------------------
def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _hyper_maps_ref(mix, base, scale, n, iters, eps):
    mix, base, scale = (a.astype(np.float64) for a in (mix, base, scale))
    pre = _sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * _sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    logits = mix[:, 2 * n:].reshape(-1, n, n) * scale[2] + base[2 * n:].reshape(n, n)
    comb = np.exp(logits - logits.max(-1, keepdims=True))
    comb = comb / comb.sum(-1, keepdims=True) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return pre, post, comb


@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("iters", [1, 20])
def test_hyper_maps(be, n, iters):
    rng = np.random.default_rng(n * 100 + iters)
    T = 9
    mix = (rng.standard_normal((T, (2 + n) * n)) * 3).astype(np.float32)
    base = rng.standard_normal((2 + n) * n).astype(np.float32)
    scale = rng.uniform(0.2, 2.0, 3).astype(np.float32)
    pre, post, comb = be.hyper_maps(mix, base, scale, n, iters, 1e-6)
    rpre, rpost, rcomb = _hyper_maps_ref(mix, base, scale, n, iters, 1e-6)
    for got, ref in ((pre, rpre), (post, rpost), (comb, rcomb)):
        np.testing.assert_allclose(got, ref, rtol=4 * F32_EPS, atol=F32_EPS)


@pytest.mark.parametrize("n", [4, 3])
def test_hyper_maps_final_collapse(be, n):
    rng = np.random.default_rng(n)
    mix = (rng.standard_normal((5, n)) * 3).astype(np.float32)
    base = rng.standard_normal(n).astype(np.float32)
    scale = np.array([0.7], np.float32)
    pre = be.hyper_maps(mix, base, scale, n, 0, 1e-6, final=True)
    ref = _sigmoid(mix.astype(np.float64) * 0.7 + base) + 1e-6
    np.testing.assert_allclose(pre, ref, rtol=4 * F32_EPS, atol=F32_EPS)


@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("E", [8, 300, 1031])
def test_hyper_collapse_and_expand(be, n, E):
    """E crosses the pieces the in-place expand keeps aside (256 values)."""
    rng = np.random.default_rng(n * E)
    T = 3
    streams = rng.standard_normal((T, n, E)).astype(np.float32)
    pre = rng.uniform(0, 1, (T, n)).astype(np.float32)
    post = rng.uniform(0, 2, (T, n)).astype(np.float32)
    comb = rng.uniform(0, 1, (T, n, n)).astype(np.float32)
    block_out = rng.standard_normal((T, E)).astype(np.float32)
    s64 = streams.astype(np.float64)
    out = be.hyper_collapse(streams, pre)
    ref = np.einsum("ti,tie->te", pre.astype(np.float64), s64)
    bound = n * 2 * F32_EPS * np.einsum("ti,tie->te", np.abs(pre), np.abs(s64))
    assert (np.abs(out - ref) <= bound + 1e-30).all()
    new = be.hyper_expand(streams, block_out, post, comb)
    ref = post[:, :, None] * block_out[:, None, :].astype(np.float64) + np.einsum("tji,tje->tie", comb, s64)
    mag = np.abs(post[:, :, None] * block_out[:, None, :]) + np.einsum("tji,tje->tie", np.abs(comb), np.abs(s64))
    assert (np.abs(new - ref) <= (n + 1) * 2 * F32_EPS * mag + 1e-30).all()


@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("iters", [1, 20])
def test_hyper_maps_match_transformers(be, n, iters):
    """The maps (and the collapse) against transformers' DeepseekV4HyperConnection and
    DeepseekV4HyperHead in float64: the mixing logits are what the module computes from its
    streams (its projection runs in float32), fed to our op."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HyperConnection,
        DeepseekV4HyperHead,
    )

    hidden, T = 24, 5
    cfg = DeepseekV4Config(hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=iters, num_hidden_layers=2,
                           vocab_size=32)
    g = torch.Generator().manual_seed(n * 10 + iters)
    streams = torch.randn(1, T, n, hidden, generator=g, dtype=torch.float64)
    streams = streams.float().double()  # values float32 holds exactly: our op takes float32

    def randomise(module):
        with torch.no_grad():
            for p in module.parameters():  # float32-exact values, as our op takes them
                p.copy_((torch.randn(p.shape, generator=g) * (0.5 if p.numel() > 3 else 1)).float())
        return module.double()

    hc = randomise(DeepseekV4HyperConnection(cfg))
    with torch.no_grad():
        post, comb, collapsed = hc(streams)
        flat = hc.input_norm(streams.view(1, T, -1).float())
        mix = torch.nn.functional.linear(flat, hc.fn.float())[0].numpy()
    f32 = lambda t: np.ascontiguousarray(t.detach().numpy(), dtype=np.float32)  # noqa: E731
    pre_ours, post_ours, comb_ours = be.hyper_maps(mix, f32(hc.base), f32(hc.scale), n, iters, cfg.hc_eps)
    np.testing.assert_allclose(post_ours, post[0].numpy(), rtol=4 * F32_EPS, atol=F32_EPS)
    np.testing.assert_allclose(comb_ours, comb[0].numpy(), rtol=4 * F32_EPS, atol=F32_EPS)
    s32 = f32(streams[0])
    np.testing.assert_allclose(be.hyper_collapse(s32, pre_ours), collapsed[0].numpy(), rtol=1e-6, atol=1e-6)

    head = randomise(DeepseekV4HyperHead(cfg))
    with torch.no_grad():
        ref = head(streams)
        flat = head.input_norm(streams.flatten(2).float())
        mix = torch.nn.functional.linear(flat, head.hc_fn.float())[0].numpy()
    pre = be.hyper_maps(mix, f32(head.hc_base), f32(head.hc_scale), n, 0, cfg.hc_eps, final=True)
    np.testing.assert_allclose(be.hyper_collapse(s32, pre), ref[0].numpy(), rtol=1e-6, atol=1e-6)


# -- clamped SwiGLU -------------------------------------------------------------------------------
@pytest.mark.parametrize("split", [0, 5, 1030])
@pytest.mark.parametrize("limit", [7.0, 0.5])
def test_silu_mul_clamped(be, split, limit):
    """Values well past the limit on both sides; rows longer than the 1024-value pieces."""
    rng = np.random.default_rng(int(limit * 10) + split)
    g = (rng.standard_normal((6, 1100)) * 10).astype(np.float32)
    u = (rng.standard_normal((6, 1100)) * 10).astype(np.float32)
    out = be.silu_mul(g, u, split, limit=limit)
    gc = np.minimum(g.astype(np.float64), limit)
    uc = np.clip(u.astype(np.float64), -limit, limit)
    np.testing.assert_allclose(out, gc / (1 + np.exp(-gc)) * uc, rtol=2e-6, atol=1e-6)


# -- routing --------------------------------------------------------------------------------------
def _scores(logits, gating):
    x = logits.astype(np.float64)
    if gating == 1:
        p = np.exp(x - x.max(1, keepdims=True))
        return p / p.sum(1, keepdims=True)
    if gating == 2:
        return _sigmoid(x)
    return np.sqrt(np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x))))


def _check_grouping(ids, offsets, rows, slot_of, NE):
    T, K = ids.shape
    slot_of = slot_of.reshape(T, K)
    np.testing.assert_array_equal(np.diff(offsets), np.bincount(ids.ravel(), minlength=NE))
    for t in range(T):
        for j in range(K):
            r = slot_of[t, j]
            assert rows[r] == t and offsets[ids[t, j]] <= r < offsets[ids[t, j] + 1]
    # token order kept within an expert
    for e in range(NE):
        assert (np.diff(rows[offsets[e]:offsets[e + 1]]) > 0).all()


@pytest.mark.parametrize("norm,scale", [(True, 1.5), (False, 1.0), (True, 2.5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_route_sqrtsoftplus(be, norm, scale, with_bias):
    """DeepSeek-V4's learned routing: scores sqrt(softplus(logits)) (large logits of both signs:
    softplus must neither overflow nor lose the small ones), selection on score + bias, weights
    from the scores (renormalised with + 1e-20)."""
    rng = np.random.default_rng(int(norm) + 2 * with_bias)
    T, NE, K = 11, 16, 4
    logits = (rng.standard_normal((T, NE)) * 4).astype(np.float32)
    logits[0, :3] = [95.0, -120.0, 40.0]
    bias = rng.uniform(-0.3, 0.3, NE).astype(np.float32) if with_bias else None
    ids, w, offsets, rows, slot_of = be.route(logits, K, 4, norm, scale, bias)
    s = _scores(logits, 4)
    sel = s + (bias if with_bias else 0)
    ref_ids = np.argsort(-sel, axis=1, kind="stable")[:, :K]
    ref_w = np.take_along_axis(s, ref_ids, 1)
    if norm:
        ref_w = ref_w / (ref_w.sum(1, keepdims=True) + 1e-20)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(w, ref_w * scale, rtol=1e-5)
    _check_grouping(ids, offsets, rows, slot_of, NE)


@pytest.mark.parametrize("gating", [1, 2, 4])
@pytest.mark.parametrize("norm", [False, True])
def test_route_hash_fixed_ids(be, gating, norm):
    """Hash routing: the ids come from a table (here random, in no order of score); the weights
    are the gating scores at those ids, renormalised with norm (+ 1e-20 for sigmoid and
    sqrtsoftplus), times the scale; grouped by expert as learned routing is. A selection bias
    plays no part."""
    rng = np.random.default_rng(gating * 2 + norm)
    T, NE, K = 13, 12, 3
    logits = (rng.standard_normal((T, NE)) * 3).astype(np.float32)
    fixed = np.stack([rng.permutation(NE)[:K] for _ in range(T)]).astype(np.int32)
    bias = rng.uniform(-5, 5, NE).astype(np.float32)
    ids, w, offsets, rows, slot_of = be.route(logits, K, gating, norm, 1.5, bias, fixed=fixed)
    np.testing.assert_array_equal(ids, fixed)
    ref_w = np.take_along_axis(_scores(logits, gating), fixed.astype(np.int64), 1)
    if norm:
        ref_w = ref_w / (ref_w.sum(1, keepdims=True) + (0 if gating == 1 else 1e-20))
    np.testing.assert_allclose(w, ref_w * 1.5, rtol=1e-5)
    _check_grouping(ids, offsets, rows, slot_of, NE)
    bad = fixed.copy()
    bad[2, 1] = NE
    with pytest.raises(ValueError):
        be.route(logits, K, gating, norm, 1.5, fixed=bad)
