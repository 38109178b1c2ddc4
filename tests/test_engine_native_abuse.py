"""The native engine (tensorfold._core.Engine) under abuse: hostile model geometry and absurd
sizes are refused before anything is allocated (a clear MemoryError / ValueError naming the
size in GiB and what to lower, never a heap overflow), scratch memory is capped, logits are
built once, sampling parameters are validated (NaN temperature used to sample the last
candidate every time), NaN logits never pick an out-of-range or NaN token, and several Python
threads may call one engine at once."""
from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tensorfold
from tensorfold import _core


# ----------------------------------------------------------------------------- GGUF writing
# A minimal GGUF v3 writer. Unlike gguf.GGUFWriter it lets several tensors share one data
# range, which is how a 10 MB file can describe a model whose KV cache is petabytes.
def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, v) -> bytes:
    if isinstance(v, str):
        return _str(key) + struct.pack("<I", 8) + _str(v)
    if isinstance(v, float):
        return _str(key) + struct.pack("<If", 6, v)
    return _str(key) + struct.pack("<II", 4, v)


def write_gguf(path, meta: dict, tensors: list[tuple[str, list[int], int, int]], data: bytes) -> None:
    """tensors: (name, ne, ggml type, offset into data)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
    for k, v in meta.items():
        out += _kv(k, v)
    for name, ne, typ, off in tensors:
        out += _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        out += struct.pack("<IQ", typ, off)
    out += b"\0" * (-len(out) % 32)
    out += data
    with open(path, "wb") as f:
        f.write(out)


F32, F16 = 0, 1


def llama_meta(n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff) -> dict:
    return {"general.architecture": "llama", "llama.block_count": n_layer, "llama.embedding_length": n_embd,
            "llama.attention.head_count": n_head, "llama.attention.head_count_kv": n_head_kv,
            "llama.attention.key_length": head_dim, "llama.attention.value_length": head_dim,
            "llama.feed_forward_length": n_ff, "llama.context_length": 4096}


@pytest.fixture(scope="module")
def hostile_kv_model(tmp_path_factory) -> str:
    """1024 layers x 4096 KV heads x head dim 512 (8 GiB of K/V per token) in ~5 MB: n_embd 1,
    F16, every tensor aliasing the same 4 MB."""
    L, H, D, V = 1024, 4096, 512, 32
    tensors = [("token_embd.weight", [1, V], F16, 0), ("output_norm.weight", [1], F32, 0)]
    for i in range(L):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", [1], F32, 0), (p + "attn_q.weight", [1, H * D], F16, 0),
                    (p + "attn_k.weight", [1, H * D], F16, 0), (p + "attn_v.weight", [1, H * D], F16, 0),
                    (p + "attn_output.weight", [H * D, 1], F16, 0), (p + "ffn_norm.weight", [1], F32, 0),
                    (p + "ffn_gate.weight", [1, 1], F16, 0), (p + "ffn_up.weight", [1, 1], F16, 0),
                    (p + "ffn_down.weight", [1, 1], F16, 0)]
    path = tmp_path_factory.mktemp("hostile") / "kv-bomb.gguf"
    write_gguf(path, llama_meta(L, 1, H, H, D, 1), tensors, bytes(2 * H * D))
    assert os.path.getsize(path) < 10 << 20
    return str(path)


def test_hostile_geometry_scratch_is_refused_before_allocation(tmp_path):
    # One layer, one KV head (a small KV pool) but 4096 query heads of 512: every token of a
    # step needs 2M query floats, so 4096 tokens per step would need tens of GiB of scratch.
    H, D, V = 4096, 512, 32
    tensors = [("token_embd.weight", [1, V], F16, 0), ("output_norm.weight", [1], F32, 0),
               ("blk.0.attn_norm.weight", [1], F32, 0), ("blk.0.attn_q.weight", [1, H * D], F16, 0),
               ("blk.0.attn_k.weight", [1, D], F16, 0), ("blk.0.attn_v.weight", [1, D], F16, 0),
               ("blk.0.attn_output.weight", [H * D, 1], F16, 0), ("blk.0.ffn_norm.weight", [1], F32, 0),
               ("blk.0.ffn_gate.weight", [1, 1], F16, 0), ("blk.0.ffn_up.weight", [1, 1], F16, 0),
               ("blk.0.ffn_down.weight", [1, 1], F16, 0)]
    path = tmp_path / "scratch-bomb.gguf"
    write_gguf(path, llama_meta(1, 1, H, 1, D, 1), tensors, bytes(2 * H * D))
    with pytest.raises(MemoryError, match=r"activation scratch for 4096 tokens per step \(.* GiB\).*"
                                          r"lower max_batch_tokens, kv_tokens or context"):
        _core.Engine(str(path), threads=1, context=4096, max_batch_tokens=4096)
    # A small step budget fits: the same file loads.
    e = _core.Engine(str(path), threads=1, context=64, kv_tokens=64, max_batch_tokens=8)
    assert e.max_batch_tokens == 8


def tiny_llama(path, output_rows: np.ndarray) -> str:
    """A working 1-layer llama (n_embd 8, vocab 32) whose LM head is `output_rows`."""
    rng = np.random.default_rng(0)
    E, H, HK, D, F, V = 8, 2, 1, 4, 16, 32
    arrays = {"token_embd.weight": rng.standard_normal((V, E)), "output_norm.weight": np.ones(E),
              "output.weight": output_rows, "blk.0.attn_norm.weight": np.ones(E),
              "blk.0.attn_q.weight": rng.standard_normal((H * D, E)) * 0.3,
              "blk.0.attn_k.weight": rng.standard_normal((HK * D, E)) * 0.3,
              "blk.0.attn_v.weight": rng.standard_normal((HK * D, E)) * 0.3,
              "blk.0.attn_output.weight": rng.standard_normal((E, H * D)) * 0.3,
              "blk.0.ffn_norm.weight": np.ones(E), "blk.0.ffn_gate.weight": rng.standard_normal((F, E)) * 0.3,
              "blk.0.ffn_up.weight": rng.standard_normal((F, E)) * 0.3,
              "blk.0.ffn_down.weight": rng.standard_normal((E, F)) * 0.3}
    tensors, data = [], bytearray()
    for name, a in arrays.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        tensors.append((name, list(reversed(a.shape)), F32, len(data)))
        data += a.tobytes()
        data += b"\0" * (-len(data) % 32)
    write_gguf(path, llama_meta(1, E, H, HK, D, F), tensors, bytes(data))
    return str(path)


# ------------------------------------------------------------------------ KV pool overflow
def test_hostile_geometry_kv_pool_is_refused_with_its_size(hostile_kv_model):
    # default kv_tokens (4096): 32 TiB
    with pytest.raises(MemoryError, match=r"the KV cache would need 32768\.0 GiB \(kv_tokens 4096 x 1024 layers x "
                                          r"4096 KV heads x head dim 512 x K and V x 2 bytes\) but this machine has "
                                          r".* GiB of memory; lower kv_tokens or context"):
        _core.Engine(hostile_kv_model, threads=1)
    # the largest kv_tokens allowed: 2^63 bytes (fits 64 bits, refused by the memory check)
    with pytest.raises(MemoryError, match=r"would need 8589934592\.0 GiB .* lower kv_tokens or context"):
        _core.Engine(hostile_kv_model, threads=1, kv_tokens=2**30)
    # f32 doubles it to 2^64: the size itself overflows and is refused as such
    with pytest.raises(MemoryError, match=r"would need 17179869184\.0 GiB .*more than can be addressed; "
                                          r"lower kv_tokens or context"):
        _core.Engine(hostile_kv_model, threads=1, kv_tokens=2**30, kv_type="f32")


@pytest.mark.parametrize("kv_tokens", [2**30 + 1, 2**62, 2**63 - 1])
def test_kv_tokens_above_the_cap_are_refused(smollm2_path, kv_tokens):
    # 2^63 - 1 used to overflow int64 while rounding up to blocks (UBSan, engine.cpp:73)
    msg = r"kv_tokens must be an integer in \[1, 1073741824\].*got " + str(kv_tokens)
    with pytest.raises(ValueError, match=msg):
        _core.Engine(smollm2_path, threads=1, kv_tokens=kv_tokens)
    with pytest.raises(ValueError, match=msg):
        tensorfold.Engine(smollm2_path, threads=1, kv_tokens=kv_tokens)


def test_kv_pool_larger_than_memory_is_refused(smollm2_path):
    # SmolLM2: 30 layers x 3 KV heads x 64 x K,V x f16 = 23040 bytes per token
    with pytest.raises(MemoryError, match=r"the KV cache would need 23040\.0 GiB \(kv_tokens 1073741824 x 30 "
                                          r"layers x 3 KV heads x head dim 64 x K and V x 2 bytes\) but this "
                                          r"machine has .* GiB of memory; lower kv_tokens or context$"):
        _core.Engine(smollm2_path, threads=1, kv_tokens=2**30)
    e = _core.Engine(smollm2_path, threads=1, context=256, kv_tokens=1000)
    assert e.kv_tokens == 1008 and e.kv_bytes == 1008 * 23040


def test_option_ranges(smollm2_path):
    for mbt in (0, -5):
        with pytest.raises(ValueError, match=f"max_batch_tokens must be >= 1, got {mbt}"):
            _core.Engine(smollm2_path, threads=1, max_batch_tokens=mbt)
    with pytest.raises(ValueError, match=r"threads = -1 is out of range \(1..1024, or 0 for the usable CPUs\)"):
        _core.Engine(smollm2_path, threads=-1)
    with pytest.raises(ValueError, match=r"kv_tokens must be an integer in \[1, 1073741824\] \(0: automatic\), got -1"):
        _core.Engine(smollm2_path, threads=1, kv_tokens=-1)
    with pytest.raises(ValueError, match=r"context must be an integer in \[2, 16777216\] \(0: the model's\), got 16777217"):
        _core.Engine(smollm2_path, threads=1, context=2**24 + 1)


def test_default_threads_are_the_usable_cpus(smollm2_path):
    assert _core.Engine(smollm2_path, context=64).threads == _core.usable_cpus()


# --------------------------------------------------------------------------- scratch memory
# ASan's shadow memory and quarantine make resident-size measurements meaningless.
needs_plain_rss = pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                                     reason="peak RSS is not measurable under AddressSanitizer")


def _run(code: str, timeout: float = 300) -> list[str]:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ))
    assert p.returncode == 0, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p.stdout.split()


@needs_plain_rss
def test_max_batch_tokens_is_capped(smollm2_path):
    """max_batch_tokens=10**5 used to reserve 3.25 GB of scratch for a 4-token generate."""
    out = _run(f"""
        import resource
        from tensorfold import _core
        e = _core.Engine({smollm2_path!r}, 1, 0, 0, 10**5)
        small = _core.Engine({smollm2_path!r}, 1, 0, 1000, 10**5)
        e.add_request([1, 2, 3, 4], max_tokens=4, temperature=0)
        while e.has_unfinished():
            e.step()
        print(e.max_batch_tokens, small.max_batch_tokens,
              int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024)
    """)
    assert out[0] == "4096" and out[1] == "1000"  # at most 4096, and never above the context
    assert int(out[2]) < 700 << 20, f"peak RSS {int(out[2]) >> 20} MiB"


@needs_plain_rss
def test_logits_result_is_built_once(smollm2_path):
    """logits() used to hold its result twice (a vector, then a copy into the array: 2048 ids
    peaked at 1.04 GB). 256 ids here (a 48 MiB result) show the same in a fraction of the time."""
    # Anonymous memory only (the mmapped model's pages come and go with the page cache),
    # sampled while the GIL is released in logits().
    out = _run(f"""
        import threading
        import numpy as np
        from tensorfold import _core
        def anon():
            with open("/proc/self/status") as f:
                for ln in f:
                    if ln.startswith("RssAnon:"):
                        return int(ln.split()[1]) * 1024
        e = _core.Engine({smollm2_path!r}, 2, 0, 256)
        ids = [int(i) for i in np.random.default_rng(0).integers(0, 49152, 256)]
        e.logits(ids[:64])  # warm up (pages of scratch, first KV blocks)
        before = anon()
        peak = [before]
        running = threading.Event()
        running.set()
        def sample():
            while running.is_set():
                peak[0] = max(peak[0], anon())
        t = threading.Thread(target=sample)
        t.start()
        a = e.logits(ids)
        peak[0] = max(peak[0], anon())
        running.clear()
        t.join()
        assert a.shape == (256, 49152) and a.dtype == np.float32 and a.flags.c_contiguous
        assert np.isfinite(a).all()
        print(peak[0] - before, a.nbytes)
    """)
    grew, result = int(out[0]), int(out[1])
    # the result once (the old copy doubled it), plus the KV pages of 256 tokens (6 MiB)
    assert grew < result + (24 << 20), f"peak grew {grew >> 20} MiB for a {result >> 20} MiB result"


def test_logits_written_in_place_match_chunked_calls(smollm2_path):
    e = _core.Engine(smollm2_path, threads=1, context=256)
    ids = list(range(100, 240))
    full = e.logits(ids)
    assert full.shape == (140, 49152)
    # 140 tokens are computed in 64-row chunks straight into the array: each chunk boundary
    # must line up with what a shorter prefix gives
    for n in (1, 64, 65, 130):
        np.testing.assert_allclose(e.logits(ids[:n]), full[:n], rtol=0, atol=2e-4)
    with pytest.raises(ValueError, match="empty token list"):
        e.logits([])
    with pytest.raises(ValueError, match=r"token id 49152 is outside the vocabulary \(0..49151\)"):
        e.logits([1, 49152])


# ------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("kw,msg", [
    ({"temperature": math.nan}, r"temperature must be a finite number >= 0 \(0 = greedy\), got nan"),
    ({"temperature": math.inf}, r"temperature must be a finite number >= 0 \(0 = greedy\), got inf"),
    ({"temperature": -0.5}, r"temperature must be a finite number >= 0 \(0 = greedy\), got -0.5"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\] \(1 = off\), got 0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\] \(1 = off\), got 1.5"),
    ({"top_p": math.nan}, r"top_p must be in \(0, 1\] \(1 = off\), got nan"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\] \(0 = off\), got -0.1"),
    ({"min_p": 1.1}, r"min_p must be in \[0, 1\] \(0 = off\), got 1.1"),
    ({"min_p": math.nan}, r"min_p must be in \[0, 1\] \(0 = off\), got nan"),
    ({"top_k": -1}, r"top_k must be >= 0 \(0 = off\), got -1"),
    ({"max_tokens": -1}, r"max_tokens must be >= 0, got -1"),
])
def test_sampling_params_are_validated(smollm2_path, kw, msg):
    e = _core.Engine(smollm2_path, threads=1, context=64)
    with pytest.raises(ValueError, match=msg):
        e.add_request([1, 2, 3], **kw)
    assert e.n_active() == 0  # nothing was queued


def test_nan_logits_never_pick_a_nan_or_out_of_range_token(tmp_path):
    rng = np.random.default_rng(1)
    head = rng.standard_normal((32, 8))
    head[0] = np.nan  # token 0's logit is NaN at every position
    head[7] = np.nan
    e = _core.Engine(tiny_llama(tmp_path / "nan-head.gguf", head), threads=1, context=64)
    lg = e.logits([3, 4, 5])
    assert np.isnan(lg[:, 0]).all() and np.isfinite(lg[:, 1:7]).all()
    prompts = [[3, 4, 5], [9, 1], [30]]
    for temperature in (0.0, 0.7, 100.0):
        ids = [e.add_request(p, max_tokens=6, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=5)
               for p in prompts]
        got: dict[int, list[int]] = {i: [] for i in ids}
        while e.has_unfinished():
            for rid, tok, _, _ in e.step():
                got[rid].append(tok)
        for rid, p in zip(ids, prompts):
            toks = got[rid]
            assert len(toks) == 6 and all(0 < t < 32 and t != 7 for t in toks), (temperature, toks)
            if temperature == 0:  # greedy: the largest real logit (the old argmax returned the NaN at 0)
                ctx = list(p)
                for t in toks:
                    row = e.logits(ctx)[-1]
                    assert t == int(np.nanargmax(row))
                    ctx.append(t)
    # all NaN: still a valid id
    e2 = _core.Engine(tiny_llama(tmp_path / "all-nan.gguf", np.full((32, 8), np.nan)), threads=1, context=64)
    for temperature in (0.0, 0.8):
        e2.add_request([1, 2], max_tokens=3, temperature=temperature)
        toks = []
        while e2.has_unfinished():
            toks += [t for _, t, _, _ in e2.step()]
        assert toks == [0, 0, 0]


# ------------------------------------------------------------------------------- threads
def test_concurrent_calls_from_python_threads(smollm2_path):
    """Two threads stepping, others adding / aborting requests, computing logits and reading
    stats, all on one engine (used to segfault or livelock)."""
    out = _run(f"""
        import threading, time
        import numpy as np
        from tensorfold import _core
        e = _core.Engine({smollm2_path!r}, 2, 0, 256)
        ref = e.logits([1, 2, 3, 4, 5])
        stop = threading.Event()
        errors, done = [], []
        def guard(fn):
            def run():
                try:
                    fn()
                except BaseException as ex:  # reported below
                    errors.append(repr(ex))
            return run
        def stepper():
            while not stop.is_set():
                for rid, tok, fin, why in e.step():
                    if fin:
                        done.append((rid, why))
        def adder():
            for i in range(60):
                rid = e.add_request([1, 2, 3, i % 50 + 4], max_tokens=6, temperature=0.7, seed=i)
                if i % 3 == 0:
                    e.abort(rid)
        def logits():
            for _ in range(8):
                d = float(np.abs(e.logits([1, 2, 3, 4, 5]) - ref).max())
                assert d <= 1e-4, d
        def reader():
            while not stop.is_set():
                st = e.stats()
                assert st["free_kv_tokens"] <= st["kv_tokens"]
                e.n_active(); e.has_unfinished(); e.free_kv_tokens
        steppers = [threading.Thread(target=guard(stepper)) for _ in range(2)]
        workers = [threading.Thread(target=guard(f)) for f in (adder, adder, logits)]
        rd = threading.Thread(target=guard(reader))
        for t in steppers + workers + [rd]:
            t.start()
        for t in workers:
            t.join()
        while e.has_unfinished() and not errors:
            time.sleep(0.01)
        stop.set()
        for t in steppers + [rd]:
            t.join()
        st = e.stats()
        print(len(errors), len(done), st["active_requests"], st["free_kv_tokens"] == st["kv_tokens"])
        for x in errors[:3]:
            print("ERROR", x)
    """)
    assert out[0] == "0", out
    # 120 requests, 40 aborted before or while running: every other one finished exactly once
    assert 80 <= int(out[1]) <= 120 and out[2:4] == ["0", "True"], out


# ------------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_stops_a_long_native_call_and_the_engine_stays_usable(smollm2_path):
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from tensorfold import _core
        e = _core.Engine({smollm2_path!r}, 1, 0, 256)
        ids = list(range(1, 256))
        print("started", flush=True)
        t = time.monotonic()
        try:
            for _ in range(1000):
                e.logits(ids)
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print("interrupted", time.monotonic(), flush=True)
        # the interrupted call gave its KV blocks back and the engine still works
        assert e.free_kv_tokens == e.kv_tokens
        e.add_request([1, 2, 3], max_tokens=2, temperature=0)
        while e.has_unfinished():
            e.step()
        print("usable", flush=True)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert p.stdout.readline().strip() == "started"
        time.sleep(1.0)
        sent = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    words = out.split()
    assert words[0] == "interrupted" and words[-1] == "usable", out
    assert float(words[1]) - sent < 1.0
