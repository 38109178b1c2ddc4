"""The KV cache by spec (csrc/kv): layers with equal specs share a pool group; sequences grow,
shrink (truncate) and, in window groups, let go of what the window has passed; the prefix cache
shares full blocks read-only. The expected block counts and row contents are worked out here
from the rules (16-token blocks, a block freed when no sequence holds it), and the rows written
are read back through the backend."""
from __future__ import annotations

import numpy as np
import pytest

from tensorfold import _core

BLOCK = 16
GQA = dict(heads=2, k_dim=8, v_dim=8)
SWA = dict(heads=2, k_dim=8, v_dim=8, window=20)
MLA = dict(heads=1, k_dim=12)  # one latent row, V its first values


@pytest.fixture(scope="module", params=_core.available_backends())
def backend(request):
    return _core.Backend(request.param, 1)


def _rows(seed: int, n: int, spec: dict) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, spec["heads"], spec["k_dim"])).astype(np.float32)


def _read(kv, be, layer, seq, entries, kv_type="f32"):
    raw = kv.read_k(be, layer, seq, np.asarray(entries, dtype=np.int64))
    return raw.view(np.float32 if kv_type == "f32" else np.float16).astype(np.float32)


def _fill(kv, be, seq, n, seed, specs, start=0):
    rows = {}
    for layer, spec in enumerate(specs):
        r = _rows(seed + layer, n - start, spec)
        kv.write_k(be, layer, seq, np.arange(start, n, dtype=np.int64), r)
        rows[layer] = r
    return rows


def test_layers_with_equal_specs_share_a_group(backend):
    specs = [GQA, SWA, GQA, SWA, MLA]
    kv = _core.KvCache(specs, 100, "f16", backend)
    assert kv.n_groups == 3
    assert [kv.group_layers(g) for g in range(3)] == [[0, 2], [1, 3], [4]]
    plan = _core.KvCache.plan(specs, 100, "f16")
    blocks = -(-100 // BLOCK)
    assert [g["n_blocks"] for g in plan] == [blocks] * 3
    # rows of every layer of the group, K and V, over whole blocks, 2 bytes a value
    assert [g["bytes"] for g in plan] == [2 * blocks * BLOCK * 2 * 16 * 2, 2 * blocks * BLOCK * 2 * 16 * 2,
                                          blocks * BLOCK * 12 * 2]
    assert [g["bytes_per_token"] for g in plan] == [2 * 2 * 16 * 2, 2 * 2 * 16 * 2, 12 * 2]
    assert kv.bytes == sum(g["bytes"] for g in plan)
    assert "window 20" in plan[1]["spec"] and "window" not in plan[0]["spec"]


def test_truncate_keeps_the_first_tokens_and_frees_the_rest(backend):
    specs = [GQA, MLA]
    kv = _core.KvCache(specs, 160, "f32", backend)
    seq = kv.create_sequence()
    assert kv.reserve(seq, 40)
    rows = _fill(kv, backend, seq, 40, 1, specs)
    assert kv.counts()["used"] == 2 * 3  # 3 blocks in each group
    assert kv.truncate(seq, 20)
    assert kv.counts()["used"] == 2 * 2 and kv.capacity(seq) == 32
    for layer in range(2):
        np.testing.assert_array_equal(_read(kv, backend, layer, seq, range(20)), rows[layer][:20])
    # grows again: the new rows land after the kept ones, which stay as they were
    assert kv.reserve(seq, 48)
    new = _fill(kv, backend, seq, 48, 7, specs, start=20)
    for layer in range(2):
        np.testing.assert_array_equal(_read(kv, backend, layer, seq, range(20)), rows[layer][:20])
        np.testing.assert_array_equal(_read(kv, backend, layer, seq, range(20, 48)), new[layer])
    assert kv.truncate(seq, 0) and kv.counts()["used"] == 0
    kv.free_sequence(seq)
    assert kv.counts()["empty"] == kv.counts()["total"]


def test_truncate_inside_a_cached_block_copies_it(backend):
    # A sequence that reuses cached blocks and is cut back inside one must write its new
    # tokens into a copy: the cache keeps the rows it registered for the next sequence.
    specs = [GQA]
    kv = _core.KvCache(specs, 160, "f32", backend)
    kv.enable_prefix_cache(1)
    tokens = np.arange(100, 140, dtype=np.int32)
    a = kv.create_sequence()
    assert kv.reserve(a, 40)
    rows = _fill(kv, backend, a, 40, 3, specs)
    kv.advance(a, tokens, 40)  # two full blocks registered
    kv.free_sequence(a)
    assert kv.counts()["cached"] == 2
    b = kv.create_sequence()
    assert kv.attach_prefix(b, tokens) == 32
    cached = list(kv.block_table(0, b))
    assert kv.truncate(b, 20)
    table = kv.block_table(0, b)
    assert table[0] == cached[0] and table[1] != cached[1]  # the block it ends inside is its own now
    np.testing.assert_array_equal(_read(kv, backend, 0, b, range(20)), rows[0][:20])
    assert kv.reserve(b, 40)
    _fill(kv, backend, b, 40, 9, specs, start=20)
    kv.free_sequence(b)
    c = kv.create_sequence()
    assert kv.attach_prefix(c, tokens) == 32
    assert list(kv.block_table(0, c)) == cached
    np.testing.assert_array_equal(_read(kv, backend, 0, c, range(32)), rows[0][:32])
    # released references: only c holds blocks; the rest are free or cached
    kv.free_sequence(c)
    counts = kv.counts()
    assert counts["used"] == 0 and counts["empty"] + counts["cached"] == counts["total"]


def test_a_window_group_lets_go_of_blocks_behind_the_window(backend):
    specs = [GQA, SWA]
    kv = _core.KvCache(specs, 256, "f32", backend)
    seq = kv.create_sequence()
    tokens = np.arange(200, dtype=np.int32)
    for n in range(16, 200, 16):
        assert kv.reserve(seq, n)
        kv.advance(seq, tokens, n)
        # the next token reads from n + 1 - 20 on: the window group holds only the blocks from there
        first = max(0, n + 1 - 20) // BLOCK
        window_table = kv.block_table(1, seq)
        assert all(b == -1 for b in window_table[:first]) and all(b >= 0 for b in window_table[first:])
        assert kv.counts()["used"] == -(-n // BLOCK) + len(window_table) - first
    # a cut behind the window cannot be undone (those rows are gone): refused, nothing changed
    before = list(kv.block_table(0, seq)), list(kv.block_table(1, seq))
    assert not kv.truncate(seq, 100)
    assert (list(kv.block_table(0, seq)), list(kv.block_table(1, seq))) == before
    # within the window it can
    assert kv.truncate(seq, 190)


def test_reservation_is_all_or_nothing_across_groups(backend):
    # The MLA group holds as many tokens as the GQA one; a reservation that does not fit
    # takes nothing from either.
    specs = [GQA, MLA]
    kv = _core.KvCache(specs, 64, "f32", backend)
    a = kv.create_sequence()
    assert kv.reserve(a, 48)
    b = kv.create_sequence()
    assert not kv.reserve(b, 32)
    assert kv.counts()["used"] == 2 * 3 and kv.capacity(b) == 0
    assert kv.reserve(b, 16)
