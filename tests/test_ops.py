"""Standalone CPU kernels against numpy float64 references: paged attention over permuted
pages, vector primitives, and the sampler's distributions."""
from __future__ import annotations

import numpy as np
import pytest

from tensorfold import _core

ops = _core.ops


@pytest.mark.parametrize("D", [1, 17, 64, 80, 128])
# n above 256 crosses the kernel's tiles (online softmax): 257, 1000 and 5000 positions.
@pytest.mark.parametrize("n,bs", [(1, 16), (5, 16), (33, 16), (100, 7), (257, 32), (1000, 16), (5000, 64)])
def test_paged_attention_matches_numpy(D, n, bs):
    rng = np.random.default_rng(D * 1000 + n)
    n_pages = (n + bs - 1) // bs + 3
    k = rng.standard_normal((n_pages, bs, D)).astype(np.float16)
    v = rng.standard_normal((n_pages, bs, D)).astype(np.float16)
    table = rng.permutation(n_pages)[: (n + bs - 1) // bs].astype(np.int32)
    q = (rng.standard_normal(D) * 2).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    out = ops.paged_attention(q, k.view(np.uint16), v.view(np.uint16), table, n, scale)
    K = k[table].reshape(-1, D)[:n].astype(np.float64)
    V = v[table].reshape(-1, D)[:n].astype(np.float64)
    s = K @ q.astype(np.float64) * scale
    p = np.exp(s - s.max())
    p /= p.sum()
    ref = p @ V
    # q and p are rounded to half (llama.cpp's F16-cache numerics): ~1e-3 relative.
    assert np.abs(out - ref).max() <= 3e-3 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("order", ["rising", "falling"])
def test_paged_attention_rescales_across_tiles(order):
    # Scores that rise (the maximum moves into every new tile, forcing a rescale of the
    # running sums) or fall (the first tile holds the maximum) along 1500 positions.
    D, n, bs = 64, 1500, 16
    rng = np.random.default_rng(7)
    n_pages = (n + bs - 1) // bs
    q = rng.standard_normal(D).astype(np.float32)
    ramp = np.linspace(0.0, 12.0, n_pages * bs)
    if order == "falling":
        ramp = ramp[::-1]
    k = (q[None, :] * ramp[:, None] / np.dot(q, q) * np.sqrt(D)).astype(np.float16).reshape(n_pages, bs, D)
    v = rng.standard_normal((n_pages, bs, D)).astype(np.float16)
    table = np.arange(n_pages, dtype=np.int32)
    scale = 1.0 / np.sqrt(D)
    out = ops.paged_attention(q, k.view(np.uint16), v.view(np.uint16), table, n, scale)
    K = k.reshape(-1, D)[:n].astype(np.float64)
    V = v.reshape(-1, D)[:n].astype(np.float64)
    s = K @ q.astype(np.float64) * scale
    p = np.exp(s - s.max())
    ref = (p / p.sum()) @ V
    assert np.abs(out - ref).max() <= 3e-3 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("G", [2, 5, 8])
@pytest.mark.parametrize("n", [1, 300, 700])
def test_paged_attention_grouped_heads(G, n):
    # G query heads sharing one KV head (GQA), each against its own float64 reference; the
    # tiles' K/V rows are converted once for all heads, each head keeps its own softmax state.
    D, bs = 64, 16
    rng = np.random.default_rng(G * 100 + n)
    n_pages = (n + bs - 1) // bs + 2
    k = rng.standard_normal((n_pages, bs, D)).astype(np.float16)
    v = rng.standard_normal((n_pages, bs, D)).astype(np.float16)
    table = rng.permutation(n_pages)[: (n + bs - 1) // bs].astype(np.int32)
    # heads with very different score scales: their running maxima move at different tiles
    q = (rng.standard_normal((G, D)) * np.linspace(0.5, 4.0, G)[:, None]).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    out = ops.paged_attention(q, k.view(np.uint16), v.view(np.uint16), table, n, scale)
    assert out.shape == (G, D)
    K = k[table].reshape(-1, D)[:n].astype(np.float64)
    V = v[table].reshape(-1, D)[:n].astype(np.float64)
    for h in range(G):
        s = K @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        ref = (p / p.sum()) @ V
        assert np.abs(out[h] - ref).max() <= 3e-3 * max(1.0, np.abs(ref).max()), h
    # each head computes exactly what it computes alone
    for h in range(G):
        np.testing.assert_array_equal(out[h], ops.paged_attention(q[h], k.view(np.uint16), v.view(np.uint16),
                                                                  table, n, scale))


@pytest.mark.parametrize("D", [17, 64, 128])
@pytest.mark.parametrize("nt,G", [(2, 1), (7, 3), (8, 8), (64, 1)])
# pos0 250 with 8 tokens straddles the 256-position tile; 600 puts earlier tiles in full view
@pytest.mark.parametrize("pos0", [0, 5, 250, 600])
def test_paged_attention_causal_block(D, nt, G, pos0):
    # A prefill block: nt consecutive tokens from position pos0, G heads each, every token
    # seeing only positions up to its own — against float64 per (token, head), and exactly
    # what the single-query kernel gives each token alone.
    bs = 16
    n = pos0 + nt
    rng = np.random.default_rng(D * 7919 + nt * 31 + G + pos0)
    n_pages = (n + bs - 1) // bs + 2
    k = rng.standard_normal((n_pages, bs, D)).astype(np.float16)
    v = rng.standard_normal((n_pages, bs, D)).astype(np.float16)
    table = rng.permutation(n_pages)[: (n + bs - 1) // bs].astype(np.int32)
    q = (rng.standard_normal((nt, G, D)) * np.linspace(0.5, 3.0, G)[None, :, None]).astype(np.float32)
    scale = 1.0 / np.sqrt(D)
    out = ops.paged_attention_causal(q, k.view(np.uint16), v.view(np.uint16), table, pos0, scale)
    assert out.shape == (nt, G, D)
    K = k[table].reshape(-1, D).astype(np.float64)
    V = v[table].reshape(-1, D).astype(np.float64)
    for t in range(nt):
        seen = pos0 + t + 1
        for h in range(G):
            s = K[:seen] @ q[t, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            ref = (p / p.sum()) @ V[:seen]
            assert np.abs(out[t, h] - ref).max() <= 3e-3 * max(1.0, np.abs(ref).max()), (t, h)
        single = ops.paged_attention(q[t], k.view(np.uint16), v.view(np.uint16), table, seen, scale)
        # bit for bit: chunked prefill and batching must not change a token's attention
        np.testing.assert_array_equal(out[t], single.reshape(G, D))


def test_paged_attention_causal_rejects_bad_shapes():
    k = np.zeros((4, 16, 8), np.uint16)
    table = np.arange(4, dtype=np.int32)
    with pytest.raises(ValueError):  # more rows than a block holds
        ops.paged_attention_causal(np.zeros((65, 1, 8), np.float32), k, k, table, 0, 1.0)
    with pytest.raises(ValueError):  # past the pages
        ops.paged_attention_causal(np.zeros((4, 1, 8), np.float32), k, k, table, 61, 1.0)
    with pytest.raises(ValueError):  # head_dim differs from the pages'
        ops.paged_attention_causal(np.zeros((2, 1, 9), np.float32), k, k, table, 0, 1.0)


@pytest.mark.parametrize("H,kvl,rope,nope,vdim", [(16, 64, 16, 24, 20), (128, 96, 32, 16, 16), (3, 33, 8, 5, 7)])
@pytest.mark.parametrize("n", [1, 40, 300])
def test_latent_attention_absorbed_matches_expanded(H, kvl, rope, nope, vdim, n):
    # Multi-head latent attention (DeepSeek-V2/V3) over a cache of one row per token: the
    # latent c (kvl values) and the rope key (rope values). Absorbed form on the kernel side:
    # q_lat[h] = W_kb[h]^T q_nope[h], scores q_lat . c + q_pe . k_pe, V = the rows' latent
    # prefix, out[h] = W_vb[h] (softmax . c). Reference: the expanded form in float64 — per-head
    # keys [W_kb[h] c, k_pe] and values W_vb[h] c, as the model defines them.
    bs = 16
    rng = np.random.default_rng(H * 1000 + kvl + n)
    n_pages = (n + bs - 1) // bs + 1
    rows = np.concatenate([rng.standard_normal((n_pages, bs, kvl)), rng.standard_normal((n_pages, bs, rope))], axis=2)
    rows = rows.astype(np.float16)
    table = rng.permutation(n_pages)[: (n + bs - 1) // bs].astype(np.int32)
    w_kb = rng.standard_normal((H, nope, kvl)) / np.sqrt(kvl)
    w_vb = rng.standard_normal((H, vdim, kvl)) / np.sqrt(kvl)
    q_nope = rng.standard_normal((H, nope))
    q_pe = rng.standard_normal((H, rope))
    scale = 1.0 / np.sqrt(nope + rope)
    q_lat = np.einsum("hnk,hn->hk", w_kb, q_nope)
    q = np.concatenate([q_lat, q_pe], axis=1).astype(np.float32)
    out_lat = ops.paged_attention(q, rows.view(np.uint16), None, table, n, scale, v_dim=kvl)
    assert out_lat.shape == (H, kvl)
    ours = np.einsum("hvk,hk->hv", w_vb, out_lat.astype(np.float64))
    R = rows[table].reshape(-1, kvl + rope)[:n].astype(np.float64)
    c, k_pe = R[:, :kvl], R[:, kvl:]
    for h in range(H):
        k = np.concatenate([c @ w_kb[h].T, k_pe], axis=1)  # [n, nope + rope]
        s_ = k @ np.concatenate([q_nope[h], q_pe[h]]) * scale
        p_ = np.exp(s_ - s_.max())
        ref = (p_ / p_.sum()) @ (c @ w_vb[h].T)
        assert np.abs(ours[h] - ref).max() <= 3e-3 * max(1.0, np.abs(ref).max()), h


def test_latent_attention_block_equals_single():
    # The prefill block kernel over the same latent rows gives each token exactly what the
    # single-query kernel gives it.
    kvl, rope, G, nt, pos0, bs = 48, 16, 8, 8, 250, 16
    n = pos0 + nt
    rng = np.random.default_rng(5)
    n_pages = (n + bs - 1) // bs
    rows = rng.standard_normal((n_pages, bs, kvl + rope)).astype(np.float16)
    table = np.arange(n_pages, dtype=np.int32)[::-1].copy()
    q = rng.standard_normal((nt, G, kvl + rope)).astype(np.float32)
    out = ops.paged_attention_causal(q, rows.view(np.uint16), None, table, pos0, 0.1, v_dim=kvl)
    assert out.shape == (nt, G, kvl)
    for t in range(nt):
        single = ops.paged_attention(q[t], rows.view(np.uint16), None, table, pos0 + t + 1, 0.1, v_dim=kvl)
        np.testing.assert_array_equal(out[t], single)


def test_attention_of_a_head_does_not_depend_on_the_heads_beside_it():
    # The model splits the query heads of one cache head between threads when there are few
    # items (MLA decode): any subset of heads must get exactly the rows the whole group gets.
    kvl, rope, G, bs, n = 48, 16, 16, 16, 300
    rng = np.random.default_rng(9)
    n_pages = (n + bs - 1) // bs
    rows = rng.standard_normal((n_pages, bs, kvl + rope)).astype(np.float16).view(np.uint16)
    table = np.arange(n_pages, dtype=np.int32)
    q = rng.standard_normal((G, kvl + rope)).astype(np.float32)
    whole = ops.paged_attention(q, rows, None, table, n, 0.2, v_dim=kvl)
    for h0, h1 in [(0, 8), (8, 16), (3, 4), (5, 16)]:
        part = ops.paged_attention(q[h0:h1].copy(), rows, None, table, n, 0.2, v_dim=kvl)
        np.testing.assert_array_equal(part, whole[h0:h1])
    qb = rng.standard_normal((4, G, kvl + rope)).astype(np.float32)
    whole_b = ops.paged_attention_causal(qb[:, :8].copy(), rows, None, table, n - 4, 0.2, v_dim=kvl)
    part_b = ops.paged_attention_causal(qb[:, 3:5].copy(), rows, None, table, n - 4, 0.2, v_dim=kvl)
    np.testing.assert_array_equal(part_b, whole_b[:, 3:5])


def test_paged_attention_rejects_bad_tables():
    k = np.zeros((2, 16, 8), np.uint16)
    with pytest.raises(ValueError, match="v_dim"):  # latent rows need the value width
        ops.paged_attention(np.zeros(8, np.float32), k, None, np.array([0], np.int32), 4, 1.0)
    with pytest.raises(ValueError, match="v_dim"):
        ops.paged_attention(np.zeros(8, np.float32), k, k, np.array([0], np.int32), 4, 1.0, v_dim=9)
    with pytest.raises(ValueError):
        ops.paged_attention(np.zeros(8, np.float32), k, k, np.array([0, 5], np.int32), 20, 1.0)
    with pytest.raises(ValueError):
        ops.paged_attention(np.zeros(8, np.float32), k, k, np.array([0], np.int32), 17, 1.0)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000])
def test_vector_primitives(n):
    rng = np.random.default_rng(n)
    g = (rng.standard_normal(n) * 6).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    ref = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    np.testing.assert_allclose(ops.silu_mul(g, u), ref, rtol=2e-6, atol=1e-6)
    y, s = ops.exp_sub_sum(g, float(g.max()))
    e = np.exp(g.astype(np.float64) - g.max())
    np.testing.assert_allclose(y, e, rtol=2e-6, atol=1e-30)
    assert s == pytest.approx(e.sum(), rel=1e-5)


def _probs(logits, temperature):
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def test_greedy_and_top_k_1():
    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    assert list(ops.sample(logits, n=5, temperature=0.0)) == [int(logits.argmax())] * 5
    assert list(ops.sample(logits, n=5, temperature=2.0, top_k=1)) == [int(logits.argmax())] * 5


def test_temperature_distribution_matches_softmax():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    n = 40000
    draws = ops.sample(logits, n=n, temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    freq = np.bincount(draws, minlength=5) / n
    expect = _probs(logits, 0.7)
    assert np.abs(freq - expect).max() < 4 * np.sqrt(expect.max() / n) + 1e-3


def test_top_k_top_p_min_p_filters():
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], np.float32))
    n = 20000
    d = ops.sample(logits, n=n, temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=1)
    assert set(np.unique(d)) == {0, 1}
    freq = np.bincount(d, minlength=2)[:2] / n
    np.testing.assert_allclose(freq, [0.4 / 0.7, 0.3 / 0.7], atol=0.02)
    # top_p=0.8: smallest prefix with cumulative >= 0.8 is {0, 1, 2} (0.85)
    d = ops.sample(logits, n=n, temperature=1.0, top_k=0, top_p=0.8, min_p=0.0, seed=2)
    assert set(np.unique(d)) == {0, 1, 2}
    # min_p=0.3: keep p >= 0.3 * 0.4 = 0.12 -> {0, 1, 2}
    d = ops.sample(logits, n=n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.3, seed=3)
    assert set(np.unique(d)) == {0, 1, 2}


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.6, 0, 1.0, 0.0),     # the OpenAI API's default (no filter): the whole vocabulary
    (0.8, 0, 0.95, 0.0),    # a nucleus of most of the vocabulary (bucketed selection)
    (1.0, 0, 1.0, 0.002),   # min-p alone
    (0.8, 40, 0.95, 0.05),  # the Python API's defaults (a heap for the top-k)
    (1.5, 5000, 0.98, 0.0), # a large top-k (bucketed selection), then top-p
])
def test_large_vocabulary_distribution(temperature, top_k, top_p, min_p):
    """Draws over a 49K vocabulary (SmolLM2's size; a few likely tokens, a long tail, ties,
    -inf and NaN) follow the float64 filter chain: no token outside its support, a binned
    chi-square at p = 0.001."""
    from sampling_reference import binned_chi2, reference_distribution
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(49152) * 2.0).astype(np.float32)
    logits[rng.choice(49152, 8, replace=False)] += 9.0
    logits[300:320] = logits[299]
    logits[5], logits[6] = -np.inf, np.nan
    p = reference_distribution(np.where(np.isfinite(logits), logits, -np.inf), temperature, top_k, top_p, min_p)
    n = 8000  # 40+ expected draws per chi-square bin: ~200 bins
    draws = ops.sample(logits, n=n, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=4)
    counts = np.bincount(draws, minlength=len(logits))
    assert counts[p == 0].sum() == 0, "a filtered-out token was drawn"
    chi2, crit = binned_chi2(counts, p)
    assert chi2 <= crit, (chi2, crit)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,presence,frequency", [
    (0.0, 0, 1.0, 0.0, 1.5, 0.5),    # greedy: the argmax of the penalized logits
    (1.0, 0, 1.0, 0.0, 0.8, 0.3),
    (0.7, 40, 0.9, 0.02, -0.5, 0.4),  # a negative presence penalty raises generated tokens
])
def test_penalties_follow_openai(temperature, top_k, top_p, min_p, presence, frequency):
    """OpenAI's presence / frequency penalties over the generated tokens, then the filter chain:
    draws against the float64 reference applied to logit - presence * (count > 0) - frequency * count."""
    from sampling_reference import binned_chi2, reference_distribution
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(2000) * 1.5).astype(np.float32)
    top = np.argsort(-logits)[:12]
    generated = [int(top[0])] * 3 + [int(top[1])] + [int(t) for t in top[2:8]]  # repeats too
    counts = np.bincount(generated, minlength=len(logits)).astype(np.float64)
    adjusted = logits.astype(np.float64) - presence * (counts > 0) - frequency * counts
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=presence,
              frequency_penalty=frequency, generated=generated, seed=9)
    if temperature == 0:
        assert list(ops.sample(logits, n=3, **kw)) == [int(np.argmax(adjusted))] * 3
        assert int(np.argmax(adjusted)) != int(np.argmax(logits))  # the penalty decided it
        return
    p = reference_distribution(adjusted, temperature, top_k, top_p, min_p)
    n = 8000
    d = np.bincount(ops.sample(logits, n=n, **kw), minlength=len(logits))
    assert d[p == 0].sum() == 0
    chi2, crit = binned_chi2(d, p)
    assert chi2 <= crit, (chi2, crit)


def test_seed_reproducible_and_independent():
    logits = np.zeros(50000, np.float32)
    a = ops.sample(logits, n=64, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    b = ops.sample(logits, n=64, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    c = ops.sample(logits, n=64, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=8)
    assert (a == b).all() and (a != c).any()


def test_non_finite_logits_are_never_sampled():
    logits = np.full(10, -np.inf, np.float32)
    logits[3] = 0.0
    logits[7] = np.nan
    assert set(ops.sample(logits, n=100, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)) == {3}
