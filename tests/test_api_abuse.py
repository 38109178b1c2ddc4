"""The Python API under misuse: every wrong input gets a clear exception of the right type
(never a crash, a hang, an AttributeError or a silently wrong answer), and streams that are
abandoned, parked or closed under another thread leave the engine healthy."""
from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc
import warnings

import numpy as np
import pytest

import tensorfold


@pytest.fixture(scope="module")
def engine(smollm2_path):
    with tensorfold.Engine(smollm2_path, threads=2, context=512) as eng:
        yield eng


def _idle(eng) -> bool:
    st = eng.stats()
    return st["active_requests"] == 0 and st["free_kv_tokens"] == st["kv_tokens"]


# ------------------------------------------------------------------------------- text


def test_lone_surrogates_become_replacement_characters(engine):
    ref = engine.generate("\ufffd hello \ufffd", max_tokens=4, temperature=0)
    out = engine.generate("\ud800 hello \udcff", max_tokens=4, temperature=0)
    assert out.token_ids == ref.token_ids and out.usage == ref.usage
    assert "".join(engine.stream("\ud800 hello \udcff", max_tokens=4, temperature=0)) == ref.text
    assert engine.tokenize("x\udc80") == engine.tokenize("x\ufffd")
    # a surrogate pair (as a UTF-16 decoder without joining would leave it) is its character
    assert engine.tokenize("a\ud83d\ude00b") == engine.tokenize("a\U0001F600b")
    bad = engine.chat([{"role": "user", "content": "hi \udc80"}], max_tokens=4, temperature=0)
    good = engine.chat([{"role": "user", "content": "hi \ufffd"}], max_tokens=4, temperature=0)
    assert bad.token_ids == good.token_ids
    assert _idle(engine)


# ----------------------------------------------------------------------- prompt types


@pytest.mark.parametrize("bad", [b"abc", bytearray(b"abc"), memoryview(b"abc")],
                         ids=["bytes", "bytearray", "memoryview"])
def test_bytes_are_not_token_ids(engine, bad):
    for call in (engine.generate, engine.stream):
        with pytest.raises(TypeError, match="decode bytes to text first"):
            call(bad, max_tokens=1)
    with pytest.raises(TypeError, match="decode"):
        engine.logits(bad)
    with pytest.raises(TypeError, match="decode"):
        engine.detokenize(bad)


@pytest.mark.parametrize("bad", [[1.5], [True], ["a"], [None], [np.float32(3)], [np.bool_(True)],
                                 np.array([1.0, 2.0]), np.array([[1, 2]]), 5, object()],
                         ids=["float", "bool", "str", "none", "np-float", "np-bool", "float-array", "2d-array",
                              "int", "object"])
def test_non_integer_token_ids_are_refused(engine, bad):
    with pytest.raises(TypeError, match="integer|sequence"):
        engine.generate(bad, max_tokens=1)
    with pytest.raises(TypeError):
        engine.stream(bad, max_tokens=1)
    with pytest.raises(TypeError):
        engine.logits(bad)
    assert _idle(engine)


def test_numpy_and_tuple_token_ids_are_fine(engine):
    ids = engine.tokenize("The weather today")
    ref = engine.generate(ids, max_tokens=4, temperature=0)
    for form in (np.array(ids, dtype=np.int64), np.array(ids, dtype=np.uint16), [np.int32(i) for i in ids],
                 tuple(ids), range(ids[0], ids[0] + 1)):
        want = ref.token_ids if not isinstance(form, range) else engine.generate([ids[0]], max_tokens=4,
                                                                                 temperature=0).token_ids
        assert engine.generate(form, max_tokens=4, temperature=0).token_ids == want
    np.testing.assert_array_equal(engine.logits(np.array(ids)), engine.logits(ids))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(np.array([2**40]), max_tokens=1)


# ------------------------------------------------------------------ sampling parameters

NAN, INF = float("nan"), float("inf")


# The rule: a wrong type is a TypeError, a right type with a bad value a ValueError; either
# message names the valid range.
@pytest.mark.parametrize("kw,exc,match", [
    (dict(top_k=-1), ValueError, r"top_k must be an integer in \[0, 2147483647\] \(0 = off\), got -1"),
    (dict(top_k=2.5), TypeError, r"top_k must be an integer in \[0, 2147483647\] \(0 = off\), got 2.5 \(float\)"),
    (dict(top_k=True), TypeError, r"top_k must be an integer"),
    (dict(top_k=2**40), ValueError, r"top_k must be an integer in \[0, 2147483647\]"),
    (dict(temperature=NAN), ValueError, r"temperature must be a finite number >= 0 \(0 = greedy\), got nan"),
    (dict(temperature=INF), ValueError, r"temperature must be a finite number >= 0"),
    (dict(temperature=-0.5), ValueError, r"temperature must be a finite number >= 0"),
    (dict(temperature="hot"), TypeError, r"temperature must be a finite number >= 0 \(0 = greedy\), got 'hot'"),
    (dict(temperature=None), TypeError, r"temperature must be a finite number"),
    (dict(temperature=10**400), ValueError, r"temperature must be a finite number >= 0"),
    (dict(top_p=NAN), ValueError, r"top_p must be a finite number in \(0, 1\] \(1 = off\), got nan"),
    (dict(top_p=INF), ValueError, r"top_p must be a finite number in \(0, 1\]"),
    (dict(top_p=0.0), ValueError, r"top_p must be a finite number in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"top_p must be a finite number in \(0, 1\]"),
    (dict(top_p="1"), TypeError, r"top_p must be a finite number in \(0, 1\]"),
    (dict(min_p=NAN), ValueError, r"min_p must be a finite number in \[0, 1\] \(0 = off\), got nan"),
    (dict(min_p=-INF), ValueError, r"min_p must be a finite number in \[0, 1\]"),
    (dict(min_p=1.5), ValueError, r"min_p must be a finite number in \[0, 1\]"),
    (dict(max_tokens=-1), ValueError, r"max_tokens must be an integer in \[0, 2147483647\], got -1"),
    (dict(max_tokens=2**40), ValueError, r"max_tokens must be an integer in \[0, 2147483647\]"),
    (dict(max_tokens=4.0), TypeError, r"max_tokens must be an integer"),
    (dict(seed=1.5), TypeError, r"seed must be an integer \(used modulo 2\*\*64\) or None, got 1.5"),
    (dict(seed="7"), TypeError, r"seed must be an integer"),
    (dict(ignore_eos="no"), TypeError, r"ignore_eos must be True or False, not str"),
], ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(f"{k}={v[k]!r}" for k in v))
def test_bad_sampling_parameters_name_the_valid_range(engine, kw, exc, match):
    for call in (engine.generate, engine.stream):
        with pytest.raises(exc, match=match) as e:
            call("Hi", **{"max_tokens": 2, **kw})
        # a bad value is not a TypeError; a wrong type is one (and, for older callers, a ValueError too)
        assert isinstance(e.value, TypeError) == (exc is TypeError), type(e.value)
    with pytest.raises(exc, match=match):
        engine.chat([{"role": "user", "content": "Hi"}], **{"max_tokens": 2, **kw})
    assert _idle(engine)


@pytest.mark.parametrize("kw,exc", [
    (dict(logprobs=1.0), TypeError), (dict(logprobs=True), TypeError), (dict(logprobs="5"), TypeError),
    (dict(logprobs=-1), ValueError), (dict(logprobs=21), ValueError)])
def test_logprobs_argument_type_and_range(engine, kw, exc):
    with pytest.raises(exc, match=r"logprobs must be an integer in \[0, 20\]") as e:
        engine.generate("Hi", max_tokens=1, **kw)
    assert isinstance(e.value, TypeError) == (exc is TypeError)


def test_messages_type_and_roles(engine):
    """A messages argument that is not a list is a TypeError; a role outside the chat roles is
    a ValueError naming them, from the one check the server uses too (chat_template.check_role)."""
    from tensorfold.chat_template import ROLES, check_role

    for bad in ("hi", {"role": "user", "content": "hi"}, 5):
        for call in (lambda m: engine.generate(messages=m, max_tokens=1), lambda m: engine.stream(messages=m),
                     engine.chat, engine.apply_chat_template):
            with pytest.raises(TypeError, match="messages must be a list"):
                call(bad)
    for role in ("wizard", "", None, 3, "User"):
        msgs = [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]
        with pytest.raises(ValueError, match=r"messages\[1\]\.role must be one of \[") as e:
            engine.generate(messages=msgs, max_tokens=1)
        with pytest.raises(ValueError, match=r"messages\[1\]\.role must be one of"):
            engine.stream(messages=msgs)
        # the same words as the shared check gives, for every role it refuses
        with pytest.raises(ValueError) as shared:
            check_role(role, "messages[1].role")
        assert str(e.value) == str(shared.value)
    # every role the check accepts renders; "developer" is given to the template as "system"
    for role in ROLES:
        assert engine.generate(messages=[{"role": role, "content": "hi"}], max_tokens=1, temperature=0).token_ids
    assert engine.apply_chat_template([{"role": "developer", "content": "Be brief."}]) == \
        engine.apply_chat_template([{"role": "system", "content": "Be brief."}])
    assert _idle(engine)


def test_logprobs_carry_the_token_texts(engine):
    """TokenLogprob has its token's text, and every top entry (still a (token, logprob) pair) its own."""
    out = engine.generate("The capital of France is", max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    assert "".join(lp.text for lp in out.logprobs) == out.text  # plain ASCII text: the pieces make it up
    for lp in out.logprobs:
        assert lp.text == engine.detokenize([lp.token])
        assert len(lp.top) == 3
        (t0, v0), first = lp.top[0], lp.top[0]
        assert (t0, first.logprob) == (lp.token, v0) and first.text == lp.text  # greedy: the most likely one
        for t in lp.top:
            assert t == (t.token, t.logprob) and t.text == engine.detokenize([t.token])


def test_stream_tells_why_it_ended(engine):
    it = engine.stream("Once upon a time", max_tokens=3, temperature=0, ignore_eos=True)
    assert it.finish_reason is None
    text = "".join(it)
    assert it.finish_reason == "length"
    ref = engine.generate("Once upon a time", max_tokens=3, temperature=0, ignore_eos=True)
    assert text == ref.text and ref.finish_reason == "length"
    stop = ref.text.strip().split()[0]
    it = engine.stream("Once upon a time", max_tokens=30, temperature=0, ignore_eos=True, stop=stop)
    assert stop not in "".join(it) and it.finish_reason == "stop"
    assert _idle(engine)


def test_any_integer_seed_is_fine(engine):
    a = engine.generate("Hi", max_tokens=4, temperature=1.0, seed=-1)
    b = engine.generate("Hi", max_tokens=4, temperature=1.0, seed=2**64 - 1)  # -1 modulo 2**64
    assert a.token_ids == b.token_ids
    assert engine.generate("Hi", max_tokens=4, temperature=1.0, seed=np.int64(5)).token_ids == \
        engine.generate("Hi", max_tokens=4, temperature=1.0, seed=5).token_ids
    assert len(engine.generate("Hi", max_tokens=2, temperature=1.0, seed=3**90).token_ids) >= 1


def test_bad_stop_strings(engine):
    with pytest.raises(TypeError, match="stop strings must be str"):
        engine.generate("Hi", max_tokens=2, stop=[1])
    with pytest.raises(TypeError, match="stop must be a string or a list"):
        engine.generate("Hi", max_tokens=2, stop=3)


def test_bad_engine_arguments(smollm2_path):
    for kw, match in ((dict(threads=2**40), r"threads must be an integer in \[1, 2147483647\]"),
                      (dict(context=-4), r"context must be an integer in \[2, 16777216\]"),
                      (dict(context=1), r"context must be an integer in \[2, 16777216\]"),
                      (dict(context=2**24 + 1), r"context must be an integer in \[2, 16777216\]"),
                      (dict(kv_tokens=2**64), r"kv_tokens must be an integer in \[1, 1073741824\]"),
                      (dict(max_batch_tokens=0), r"max_batch_tokens must be an integer in \[1,"),
                      (dict(timeout=NAN), "timeout must be a finite number > 0"),
                      (dict(timeout=0), "timeout must be a finite number > 0"),
                      (dict(tp=3), r"tp must be an integer in \[1, 2\]"),
                      (dict(kv_type="f64"), "kv_type must be 'f16' or 'f32'"),
                      (dict(memory_budget="-5GiB"), "memory_budget must be a positive size"),
                      (dict(transport="udp"), "transport must be")):
        with pytest.raises(ValueError, match=match) as e:
            tensorfold.Engine(smollm2_path, **kw)
        assert not isinstance(e.value, TypeError), kw
    for kw, match in ((dict(threads=True), "threads"), (dict(threads=1.0), "threads"),
                      (dict(context="512"), "context must be an integer"), (dict(kv_tokens=4096.0), "kv_tokens"),
                      (dict(timeout="30"), "timeout must be a finite number"), (dict(tp="2"), "tp"),
                      (dict(kv_type=16), "kv_type"), (dict(prefix_cache=1), "prefix_cache must be True or False"),
                      (dict(tp_compatible="yes"), "tp_compatible"), (dict(memory_budget=1.5e9), "memory_budget"),
                      (dict(memory_budget=True), "memory_budget"), (dict(transport=None), "transport"),
                      (dict(rails="10.0.0.1"), "rails must be a list")):
        with pytest.raises(TypeError, match=match):
            tensorfold.Engine(smollm2_path, **kw)
    with pytest.raises(TypeError, match="model must be a path"):
        tensorfold.Engine(b"model.gguf")


def test_engine_context_limits_are_the_native_ones(smollm2_path):
    """The Python layer states the native engine's own context range, in the same words."""
    from tensorfold import _core
    from tensorfold.engine import MAX_CONTEXT

    with pytest.raises(ValueError, match=r"context must be an integer in \[2, 16777216\]"):
        _core.plan_memory(smollm2_path, context=MAX_CONTEXT + 1)
    # the largest value both accept is accepted by both (the plan only counts bytes)
    assert _core.plan_memory(smollm2_path, context=MAX_CONTEXT, memory_budget=-1)["context"] == MAX_CONTEXT


# ----------------------------------------------------------------------------- close()


def test_calls_after_close_raise_a_clear_error(smollm2_path):
    eng = tensorfold.Engine(smollm2_path, threads=1, context=128)
    it = eng.stream("Hi", max_tokens=8, temperature=0, ignore_eos=True)
    next(it)
    eng.close()
    eng.close()  # idempotent
    assert eng.closed
    for call in (lambda: eng.generate("Hi"), lambda: eng.stream("Hi"), lambda: eng.chat([]),
                 lambda: eng.logits([1]), lambda: eng.routing([1]), eng.stats, eng.follow, lambda: next(it)):
        with pytest.raises(RuntimeError, match="the engine is closed"):
            call()
    it.close()
    assert eng.tokenize("Hi") and eng.config["n_vocab"] == 49152  # no native engine needed

    with tensorfold.Engine(smollm2_path, threads=1, context=128) as e2:
        assert e2.generate("Hi", max_tokens=2).token_ids
    assert e2.closed
    with pytest.raises(RuntimeError, match="the engine is closed"):
        e2.generate("Hi")


def test_close_while_another_thread_streams(smollm2_path):
    eng = tensorfold.Engine(smollm2_path, threads=1, context=2048)
    started, result = threading.Event(), {}

    def reader():
        try:
            for _ in eng.stream("Tell me a story", max_tokens=2000, temperature=0, ignore_eos=True):
                started.set()
            result["end"] = "finished"
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            result["end"] = e

    t = threading.Thread(target=reader)
    t.start()
    assert started.wait(120)
    eng.close()
    t.join(60)
    assert not t.is_alive()
    assert isinstance(result["end"], RuntimeError) and "closed" in str(result["end"]), result


def test_exit_while_a_daemon_thread_streams(smollm2_path, tmp_path):
    """Deleting the engine and exiting while a daemon thread is inside a step neither hangs
    nor aborts the process (std::terminate when finalization kills the thread in C++)."""
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(f"""
        import threading, tensorfold
        eng = tensorfold.Engine({smollm2_path!r}, threads=1, context=2048)
        started = threading.Event()
        def reader(e):
            try:
                for _ in e.stream("Tell me a story", max_tokens=2000, ignore_eos=True):
                    started.set()
            except RuntimeError:
                pass
        threading.Thread(target=reader, args=(eng,), daemon=True).start()
        started.wait(120)
        del eng
        print("bye", flush=True)
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "bye\n" and "terminate" not in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- abandoned streams


def test_unread_streams_are_parked_and_resume_exactly(smollm2_path):
    """Half-read streams that are still referenced stop costing decode steps after a few
    unread tokens (their KV is freed), and read later they give exactly the greedy text."""
    eng = tensorfold.Engine(smollm2_path, threads=2, context=256)
    ref = eng.generate("Once upon a time", max_tokens=16, temperature=0, ignore_eos=True).text
    gens = []
    for i in range(8):
        g = eng.stream("Once upon a time", max_tokens=16, temperature=0, ignore_eos=True)
        gens.append((next(g), g))
    before = eng.stats()["generated_tokens"]
    eng.generate("Hello", max_tokens=16, temperature=0, ignore_eos=True)
    made = eng.stats()["generated_tokens"] - before
    # 16 of its own, and at most park_at (4) more per idle stream before it is parked;
    # without parking it would be 16 * 9.
    assert made <= 16 + 8 * 4, made
    assert eng.stats()["active_requests"] == 0
    for first, g in gens:
        assert first + "".join(g) == ref
    assert _idle(eng)


def test_seeded_sampling_is_not_changed_by_parking(smollm2_path):
    """An explicitly seeded sampled stream is never parked (resuming would restart its RNG):
    however it is read, it gives the tokens of a solo run."""
    eng = tensorfold.Engine(smollm2_path, threads=2, context=256)
    kw = dict(max_tokens=20, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42, ignore_eos=True)
    solo = eng.generate("The weather", **kw).text
    g = eng.stream("The weather", **kw)
    first = next(g)
    eng.generate("Hello", max_tokens=12, temperature=0, ignore_eos=True)
    assert first + "".join(g) == solo


def test_collected_streams_release_their_requests(engine):
    # in a reference cycle: released when the garbage collector finds it
    it = engine.stream("Tell me a story", max_tokens=50, temperature=0, ignore_eos=True)
    next(it)
    cycle = [it]
    cycle.append(cycle)
    del it, cycle
    gc.collect()
    assert _idle(engine)
    # finalized while another thread holds the engine: queued, done before the next step
    it = engine.stream("Tell me a story", max_tokens=50, temperature=0, ignore_eos=True)
    next(it)
    held, release = threading.Event(), threading.Event()

    def hold():
        with engine._lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(30)
    del it  # its finally cannot take the lock: it must not block here
    release.set()
    t.join(30)
    assert _idle(engine)


# ------------------------------------------------------------------- load-time checks


def test_context_above_the_trained_length_warns(smollm2_path):
    with pytest.warns(RuntimeWarning, match="context 8200 is longer than the 8192 tokens .* output degrades past 8192"):
        eng = tensorfold.Engine(smollm2_path, threads=1, context=8200)
    eng.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensorfold.Engine(smollm2_path, threads=1, context=8192).close()


def _tiny_llama(path, n_tokens: int, n_rows: int) -> str:
    """A 1-layer random llama GGUF whose tokenizer has n_tokens tokens and whose embedding
    has n_rows rows."""
    gguf = pytest.importorskip("gguf")
    from tensorfold.tokenizer import bytes_to_unicode

    d, ff = 64, 96
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_block_count(1)
    w.add_feed_forward_length(ff)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    tokens = list(bytes_to_unicode().values()) + ["Ġt"]
    tokens += [f"<x{i}>" for i in range(n_tokens - len(tokens))]
    w.add_token_list(tokens[:n_tokens])
    w.add_token_types([1] * n_tokens)
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(0)
    rng = np.random.default_rng(0)

    def t(name, *shape):
        w.add_tensor(name, (0.05 * rng.standard_normal(shape)).astype(np.float32))

    t("token_embd.weight", n_rows, d)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(d, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(d, np.float32))
    for n in ("q", "k", "v", "output"):
        t(f"blk.0.attn_{n}.weight", d, d)
    t("blk.0.ffn_gate.weight", ff, d)
    t("blk.0.ffn_up.weight", ff, d)
    t("blk.0.ffn_down.weight", d, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("rows", [300, 257], ids=["embedding-larger", "embedding-smaller"])
def test_tokenizer_and_embedding_sizes_must_match(tmp_path, rows):
    ok = _tiny_llama(tmp_path / "ok.gguf", 280, 280)
    with tensorfold.Engine(ok, threads=1, context=64) as eng:  # the same file, consistent: loads and runs
        assert len(eng.generate([1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True).token_ids) == 3
    bad = _tiny_llama(tmp_path / "bad.gguf", 280, rows)
    with pytest.raises(ValueError, match=f"the tokenizer has 280 tokens but the embedding has {rows} rows"):
        tensorfold.Engine(bad, threads=1, context=64)


def test_logits_result_is_built_once(engine):
    ids = engine.tokenize("The quick brown fox jumps over the lazy dog") * 4
    engine.logits(ids[:2])  # warm up
    tracemalloc.start()
    try:
        lg = engine.logits(ids)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert lg.shape == (len(ids), engine.config["n_vocab"])
    assert peak < 1.25 * lg.nbytes, (peak, lg.nbytes)  # no second copy on the Python side
    assert math.isfinite(float(lg[-1].max()))


# ------------------------------------------------------------------------------ help()


def test_help_shows_docstrings_not_section_comments(smollm2_path):
    """help(Engine) shows what each public method does: a docstring on every one, and no
    source comment picked up in place of one (inspect.getcomments)."""
    import inspect
    import pydoc

    from tensorfold import Engine

    text = pydoc.render_doc(Engine, renderer=pydoc.plaintext)
    assert "# --" not in text
    public = [(n, o) for n, o in vars(Engine).items() if not n.startswith("_")]
    assert len(public) >= 14
    for name, obj in public:
        func = obj.fget if isinstance(obj, property) else obj
        assert (inspect.getdoc(obj) or "").strip(), f"Engine.{name} has no docstring"
        assert inspect.getcomments(func) is None, (name, inspect.getcomments(func))
    # the default thread count is what the engine really uses: the CPUs this process may use
    doc = inspect.getdoc(Engine)
    assert "all cores" not in doc and "affinity" in doc
    from tensorfold import _core

    with Engine(smollm2_path, context=64) as eng:
        assert eng.threads == _core.usable_cpus()
