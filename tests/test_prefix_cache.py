"""Prefix cache: full KV blocks of earlier prompts (and of generated tokens) are reused by
requests that start with the same tokens. Reuse must never change a single output token:
every case is compared with the same engine configuration with prefix_cache=False."""
from __future__ import annotations

import pytest

import tensorfold

BLOCK = 16
SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about bread, "
          "opening hours, prices and allergens briefly and politely. The bakery opens at seven "
          "in the morning and closes at six in the evening, except on Sundays. ")
QUESTIONS = ["What time do you open?", "Do you sell rye bread?", "Is the croissant vegan?",
             "How much is a baguette?"]


@pytest.fixture(scope="module")
def engines(smollm2_path):
    on = tensorfold.Engine(smollm2_path, threads=2, context=512)
    off = tensorfold.Engine(smollm2_path, threads=2, context=512, prefix_cache=False)
    return on, off


def chat_ids(eng, messages):
    return eng._prompt_ids(None, messages)


def run_together(core, prompts, n):
    """Greedy, every prompt submitted at once (continuous batching); tokens per prompt."""
    rids = [core.add_request(p, max_tokens=n, temperature=0.0, ignore_eos=True) for p in prompts]
    got = {r: [] for r in rids}
    while core.has_unfinished():
        for e in core.step():
            got[e[0]].append(e[1])
    return [got[r] for r in rids]


def gen(eng, ids, n=16):
    return eng.generate(ids, max_tokens=n, temperature=0, ignore_eos=True).token_ids


def check_pool(eng):
    st = eng.stats()
    assert st["kv_blocks_used"] + st["kv_blocks_free"] + st["kv_blocks_cached"] == st["kv_tokens"] // BLOCK
    if st["active_requests"] == 0:
        assert st["kv_blocks_used"] == 0
        assert st["free_kv_tokens"] == st["kv_tokens"]  # cached blocks count as available
    return st


def test_second_chat_turn_reuses_blocks_and_gives_the_same_tokens(engines):
    on, off = engines
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    ids1 = chat_ids(on, turn1)
    reply = gen(on, ids1, 24)
    assert reply == gen(off, ids1, 24)
    turn2 = turn1 + [{"role": "assistant", "content": on.detokenize(reply)},
                     {"role": "user", "content": QUESTIONS[1]}]
    ids2 = chat_ids(on, turn2)
    before_on, before_off = on.stats(), off.stats()
    assert gen(on, ids2, 24) == gen(off, ids2, 24)
    st_on, st_off = check_pool(on), off.stats()
    hits = st_on["prefix_cache_hits"] - before_on["prefix_cache_hits"]
    cached = st_on["prefix_cached_tokens"] - before_on["prefix_cached_tokens"]
    prefilled_on = st_on["prompt_tokens"] - before_on["prompt_tokens"]
    prefilled_off = st_off["prompt_tokens"] - before_off["prompt_tokens"]
    assert hits == 1
    # the whole first turn up to its last full block at least (system prompt + question)
    assert cached >= (len(ids1) // BLOCK) * BLOCK - BLOCK and cached % BLOCK == 0
    assert prefilled_on == prefilled_off - cached == len(ids2) - cached
    assert off.stats()["prefix_cache_hits"] == 0 and off.stats()["kv_blocks_cached"] == 0


def test_shared_prefix_boundaries_and_short_prompts(engines):
    """One long prompt, then prompts that share it: ending exactly on a block boundary, one
    token past it, one short of it, shorter than a block, the same prompt again, and a
    different one. Each gives the tokens of the cache-less engine."""
    on, off = engines
    base = on.tokenize(SYSTEM + " " + QUESTIONS[2])
    assert len(base) > 3 * BLOCK
    cut = (len(base) // BLOCK) * BLOCK
    variants = [base, base[:cut], base[:cut + 1], base[:cut - 1], base[:2 * BLOCK], base[:BLOCK],
                base[:BLOCK - 3], base[:1], base, on.tokenize("Something else entirely " + QUESTIONS[3])]
    before = on.stats()
    for v in variants:
        assert gen(on, v, 12) == gen(off, v, 12), f"prompt of {len(v)} tokens"
    st = check_pool(on)
    assert st["prefix_cache_hits"] - before["prefix_cache_hits"] >= 5
    # a prompt ending exactly on a block boundary recomputes its last block (it needs logits)
    before = on.stats()
    gen(on, base[:2 * BLOCK], 1)
    st = on.stats()
    assert st["prefix_cached_tokens"] - before["prefix_cached_tokens"] == BLOCK
    assert st["prompt_tokens"] - before["prompt_tokens"] == BLOCK


def test_generated_tokens_are_cached_too(engines):
    """A prompt that continues an earlier prompt plus its output (as a parked stream or the
    next turn does) reuses the blocks decode filled, one token at a time."""
    on, off = engines
    p = on.tokenize("Write a short poem about the sea.")
    out = gen(on, p, 40)
    before = on.stats()
    follow = p + out + on.tokenize(" And now about the mountains:", add_special=False)
    assert gen(on, follow, 12) == gen(off, follow, 12)
    st = on.stats()
    assert st["prefix_cached_tokens"] - before["prefix_cached_tokens"] >= ((len(p) + 40) // BLOCK - 1) * BLOCK


def test_concurrent_sequences_share_a_prefix(engines):
    on, off = engines
    prompts = [on.tokenize(SYSTEM + q) for q in QUESTIONS]
    gen(on, prompts[0], 1)  # prime the cache with the system prompt
    before = on.stats()
    core = on._core
    rids = [core.add_request(p, max_tokens=16, temperature=0.0, ignore_eos=True) for p in prompts]
    got = {r: [] for r in rids}

    def collect(events):
        for e in events:
            got[e[0]].append(e[1])

    collect(core.step())  # admits all four: each maps the cached system prompt blocks into its table
    st = check_pool(on)
    shared = st["prefix_cached_tokens"] - before["prefix_cached_tokens"]
    assert st["prefix_cache_hits"] - before["prefix_cache_hits"] == 4 and shared >= 4 * 2 * BLOCK
    own = sum(-(-len(p) // BLOCK) for p in prompts)
    assert st["kv_blocks_used"] < own  # the shared blocks are held once
    while core.has_unfinished():
        collect(core.step())
    assert [got[r] for r in rids] == run_together(off._core, prompts, 16)
    check_pool(on)


def test_abort_of_a_sharing_sequence_leaves_the_other_intact(engines):
    on, off = engines
    prompts = [on.tokenize(SYSTEM + q) for q in QUESTIONS[:2]]
    expected = gen(off, prompts[1], 20)
    gen(on, prompts[0], 1)
    core = on._core
    a = core.add_request(prompts[0], max_tokens=20, temperature=0.0, ignore_eos=True)
    b = core.add_request(prompts[1], max_tokens=20, temperature=0.0, ignore_eos=True)
    got = []
    for i in range(30):
        for e in core.step():
            if e[0] == b:
                got.append(e[1])
        if i == 3:
            core.abort(a)
        if not core.has_unfinished():
            break
    assert got == expected
    check_pool(on)
    assert gen(on, prompts[0], 20) == gen(off, prompts[0], 20)  # its cached blocks are still good


def test_eviction_in_a_tiny_pool_never_fails_a_request_that_fits(smollm2_path):
    """A pool of 8 blocks (128 tokens): cached blocks of earlier prompts fill it and must be
    evicted (least recently released first) for every new request."""
    on = tensorfold.Engine(smollm2_path, threads=2, context=128, kv_tokens=128)
    off = tensorfold.Engine(smollm2_path, threads=2, context=128, kv_tokens=128, prefix_cache=False)
    texts = [f"Story number {i}: " + QUESTIONS[i % 4] * (1 + i % 3) for i in range(6)]
    prompts = [on.tokenize(t) for t in texts]
    for i, p in enumerate(prompts + prompts[::-1]):
        n = 127 - len(p) if i in (0, 7) else 20  # sometimes the whole context
        if i == 7:  # the whole pool is needed while earlier prompts' blocks sit in it
            assert on.stats()["kv_blocks_free"] < 8 - (len(p) - 1) // BLOCK
        assert gen(on, p, n) == gen(off, p, n)
        st = check_pool(on)
    assert st["kv_blocks_cached"] > 0 and st["prefix_cache_hits"] > 0


def test_preemption_with_the_prefix_cache(smollm2_path):
    """Three requests sharing a cached prefix that cannot all fit the pool at once: the newest
    is preempted and readmitted (reusing the shared block again), and every one produces
    exactly the tokens it gives alone without the cache."""
    solo = tensorfold.Engine(smollm2_path, threads=2, context=128, prefix_cache=False)
    eng = tensorfold.Engine(smollm2_path, threads=2, context=128, kv_tokens=128)
    prefix = eng.tokenize(SYSTEM)[:BLOCK + 4]
    prompts = [prefix + eng.tokenize(q, add_special=False) for q in QUESTIONS[:3]]
    expected = [gen(solo, p, 48) for p in prompts]
    gen(eng, prefix, 1)  # the first block of the shared prefix is now cached
    before = eng.stats()
    assert run_together(eng._core, prompts, 48) == expected
    st = check_pool(eng)
    assert st["preemptions"] > 0
    # every admission, readmissions after preemption included, maps the cached block
    assert st["prefix_cache_hits"] - before["prefix_cache_hits"] == 3 + st["preemptions"]


def test_chunked_prefill_blocks_are_reused_exactly(smollm2_path):
    """K/V computed in 7-token chunks, reused by a prompt whose rest is one chunk: the same
    tokens as the cache-less engine (the kernels do not depend on the batch)."""
    on = tensorfold.Engine(smollm2_path, threads=2, context=256, max_batch_tokens=7)
    off = tensorfold.Engine(smollm2_path, threads=2, context=256, prefix_cache=False)
    p = on.tokenize(SYSTEM)
    gen(on, p, 4)
    q = p + on.tokenize(QUESTIONS[3], add_special=False)
    assert gen(on, q, 16) == gen(off, q, 16)
    assert on.stats()["prefix_cache_hits"] == 1


def test_tp2_pair_with_the_prefix_cache(smollm2_path):
    """Rank 1 mirrors rank 0's block tables, shared blocks included: a TP=2 pair with the
    cache gives the tokens of TP=1 (tp_compatible) without it."""
    from test_tp import Pair

    solo = tensorfold.Engine(smollm2_path, threads=1, context=256, tp_compatible=True, prefix_cache=False)
    prompts = [solo.tokenize(SYSTEM + q) for q in QUESTIONS[:3]]
    expected_seq = [gen(solo, p, 12) for p in prompts]
    expected_together = run_together(solo._core, prompts, 12)
    pair = Pair(smollm2_path)
    try:
        got_seq = [gen(pair.engine, p, 12) for p in prompts]
        got_together = run_together(pair.engine._core, prompts, 12)
        st = pair.engine.stats()
    finally:
        err = pair.close()
    assert pair.worker.returncode == 0, err
    assert got_seq == expected_seq and got_together == expected_together
    assert st["prefix_cache_hits"] >= 5 and st["prefix_cached_tokens"] > 0
