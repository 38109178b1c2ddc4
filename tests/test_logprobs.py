"""Log-probabilities of output tokens (add_request(top_logprobs=...)): the log-softmax of the
model's raw logits (temperature 1, before top-k / top-p / min-p), as OpenAI and vLLM report
them, checked against numpy on Engine.logits of the same tokens."""
from __future__ import annotations

import numpy as np
import pytest

import tensorfold
from tensorfold import native

TOL = 2e-4  # float32 logits; the engine sums in double, numpy in float64


@pytest.fixture(scope="module")
def engine(smollm2_path):
    return tensorfold.Engine(smollm2_path, threads=2, context=512)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def run(core, prompt, n, **kw):
    """Steps one request to the end; returns its events (tensorfold.native.StepEvent)."""
    rid = core.add_request(prompt, max_tokens=n, ignore_eos=True, **kw)
    events = []
    while core.has_unfinished():
        events += [e for e in native.step(core) if e.request_id == rid]
    return events


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_greedy_logprobs_match_numpy_log_softmax(engine, k):
    core = engine._core
    prompt = engine.tokenize("The capital of France is")
    events = run(core, prompt, 8, temperature=0.0, top_logprobs=k)
    assert len(events) == 8 and all(e.logprob is not None for e in events)
    toks = [e.token for e in events]
    ref = log_softmax(engine.logits(prompt + toks[:-1], generated_from=len(prompt))[len(prompt) - 1:])
    for j, e in enumerate(events):
        tok, lp, top = e.token, e.logprob, e.top
        assert isinstance(lp, float) and abs(lp - ref[j, tok]) < TOL
        assert lp <= 0.0
        assert len(top) == k
        if k == 0:
            continue
        ids = [t for t, _ in top]
        vals = np.array([v for _, v in top])
        assert ids[0] == tok  # greedy: the sampled token is the most likely one
        assert len(set(ids)) == k
        assert np.all(np.diff(vals) <= 0)  # most likely first
        np.testing.assert_allclose(vals, ref[j, ids], atol=TOL)
        # the k best: nothing left out is more likely than the last one kept
        rest = np.delete(ref[j], ids)
        assert rest.max() <= vals[-1] + TOL


def test_logprobs_ignore_temperature_and_filters(engine):
    """Sampling at temperature 1.5 with top-k 5: the reported numbers are still the model's
    own distribution (temperature 1, unfiltered)."""
    core = engine._core
    prompt = engine.tokenize("Once upon a time")
    events = run(core, prompt, 6, temperature=1.5, top_k=5, top_p=0.9, min_p=0.0, seed=7, top_logprobs=3)
    toks = [e.token for e in events]
    ref = log_softmax(engine.logits(prompt + toks[:-1], generated_from=len(prompt))[len(prompt) - 1:])
    for j, e in enumerate(events):
        assert abs(e.logprob - ref[j, e.token]) < TOL
        assert [t for t, _ in e.top] == list(np.argsort(-ref[j], kind="stable")[:3])


def test_requests_without_logprobs_keep_the_4_tuple(engine):
    # the native step's own format (tensorfold.native.StepEvent.from_native reads it)
    core = engine._core
    a = core.add_request([1, 2, 3], max_tokens=3, temperature=0.0, ignore_eos=True)
    b = core.add_request([1, 2, 3], max_tokens=3, temperature=0.0, ignore_eos=True, top_logprobs=2)
    c = core.add_request([4, 5], max_tokens=0, temperature=0.0, top_logprobs=1)
    shapes = {a: set(), b: set(), c: set()}
    got = {a: [], b: []}
    while core.has_unfinished():
        for e in core.step():
            shapes[e[0]].add(len(e))
            if e[0] in got:
                got[e[0]].append(e[1])
            if e[0] == c:
                assert e[1] == -1 and e[2] and e[4] is None  # no token, so no log-probabilities
    assert shapes == {a: {4}, b: {5}, c: {5}}
    assert got[a] == got[b]


@pytest.mark.parametrize("bad", [-2, 21, 1000, -100])
def test_out_of_range_top_logprobs_is_refused(engine, bad):
    with pytest.raises(ValueError, match=r"top_logprobs must be -1 \(off\), 0 .* or 1\.\.20, got " + str(bad)):
        engine._core.add_request([1, 2, 3], max_tokens=2, top_logprobs=bad)
    assert not engine._core.has_unfinished()


def test_python_generate_returns_logprobs_of_its_tokens(engine):
    # Engine.generate(logprobs=k): one entry per generated token, the token's log-softmax and
    # the k most likely, checked against numpy on the logits of the same prefix; the sampled
    # (seeded) tokens come out the same with and without logprobs.
    prompt = engine.tokenize("Once upon a time")
    plain = engine.generate(prompt, max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)
    got = engine.generate(prompt, max_tokens=6, temperature=0.9, seed=7, ignore_eos=True, logprobs=3)
    assert plain.logprobs is None and got.token_ids == plain.token_ids
    assert [lp.token for lp in got.logprobs] == got.token_ids
    for i, lp in enumerate(got.logprobs):
        ref = log_softmax(engine.logits(prompt + got.token_ids[:i], generated_from=len(prompt))[-1])
        assert abs(lp.logprob - ref[lp.token]) < TOL
        assert [t for t, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:3])
        assert all(abs(v - ref[t]) < TOL for t, v in lp.top)
    assert engine.generate(prompt, max_tokens=2, temperature=0, logprobs=0).logprobs[0].top == []
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="logprobs"):
            engine.generate(prompt, max_tokens=2, logprobs=bad)
    for bad in (1.5, "3"):  # a wrong type
        with pytest.raises(TypeError, match="logprobs"):
            engine.generate(prompt, max_tokens=2, logprobs=bad)
