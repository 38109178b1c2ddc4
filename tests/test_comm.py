"""tensorfold.comm: two ranks as two processes on loopback, two rails (127.0.0.1, 127.0.0.2).

Each rank runs tests/comm_worker.py; the workers check their results against numpy
themselves and report digests so that the ranks can be compared bit for bit here.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tensorfold.comm as comm
from tensorfold._core import comm as core_comm

WORKER = str(Path(__file__).with_name("comm_worker.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(mode: str, rank: int, port: int, **kw) -> subprocess.Popen:
    args = [sys.executable, WORKER, mode, str(rank), str(port)]
    args += [f"{k}={v}" for k, v in kw.items()]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ))


def result_of(out: str) -> dict:
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError("worker printed no RESULT:\n" + out[-4000:])


def run_pair(mode: str, kw0: dict | None = None, kw1: dict | None = None, timeout: float = 45):
    port = free_port()
    procs = [spawn(mode, 0, port, **(kw0 or {})), spawn(mode, 1, port, **(kw1 or {}))]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"worker failed (rc={p.returncode}):\n{out[-4000:]}"
            results.append(result_of(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def wait_for_line(p: subprocess.Popen, text: str, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            raise AssertionError(f"worker exited before printing {text!r}")
        if line.strip() == text:
            return
    raise AssertionError(f"worker did not print {text!r} in time")


# --------------------------------------------------------------------------- single process
def test_size_one_is_trivial():
    g = comm.Group(0, 1, "")
    x = np.arange(10, dtype=np.float32)
    assert g.all_reduce(x) is not None
    assert np.array_equal(x, np.arange(10, dtype=np.float32))
    g.broadcast(x, 0)
    g.barrier()
    st = g.stats()
    assert (st["all_reduces"], st["broadcasts"], st["barriers"]) == (1, 1, 1)
    assert g.rank == 0 and g.size == 1
    g.close()
    with pytest.raises(ValueError, match="closed"):
        g.barrier()


def test_unsupported_configurations():
    with pytest.raises(ValueError, match="only 1 and 2"):
        comm.Group(0, 3, "127.0.0.1:1")
    with pytest.raises(ValueError, match="ibverbs transport (not built|unavailable)"):
        comm.Group(0, 2, "127.0.0.1:1", transport="ibverbs")
    with pytest.raises(ValueError, match="unknown comm transport"):
        comm.Group(0, 2, "127.0.0.1:1", transport="carrier-pigeon")
    g = comm.Group(0, 1)
    with pytest.raises(ValueError, match="float32 and float16"):
        g.all_reduce(np.zeros(4, dtype=np.int32))
    with pytest.raises(ValueError, match="bf16"):
        g.all_reduce(np.zeros(4, dtype=np.float32), dtype="bf16")


def test_connect_times_out_without_rank0():
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="peer lost"):
        comm.Group(1, 2, f"127.0.0.1:{free_port()}", timeout=0.5)
    assert time.monotonic() - t < 3


# ------------------------------------------------------------------------------ two ranks
def test_all_reduce_broadcast_barrier_two_rails():
    r0, r1 = run_pair("suite")
    assert r0["digests"] == r1["digests"]  # bit-identical on both ranks
    for r in (r0, r1):
        st = r["stats"]
        assert st["all_reduces"] == 38 and st["broadcasts"] == 4 and st["barriers"] == 3
        assert st["rail_failures"] == 0 and st["small_messages"] > 0
        assert r["rails_up"] == [True, True]
        # large messages were striped over both rails
        assert min(r["rail_bytes"]) > 16 << 20, r["rail_bytes"]


def test_single_default_rail():
    r0, r1 = run_pair("suite", {"rails": "none", "quick": 1}, {"rails": "none", "quick": 1})
    assert r0["digests"] == r1["digests"]
    assert r0["rails_up"] == [True]


def test_handshake_mismatch_fails_on_both_ranks():
    # Rank 1 is refused at once; rank 0 drops the connection and keeps listening for the right
    # peer until its own timeout, then reports what it rejected.
    r0, r1 = run_pair("handshake", {"handshake": "model-sha:aaaa", "timeout": 2},
                      {"handshake": "model-sha:bbbb"})
    for r in (r0, r1):
        assert r["error"] in ("ValueError", "RuntimeError"), r
        assert "handshake" in r["message"] and "differs" in r["message"], r
        assert "model-sha:aaaa" in r["message"] and "model-sha:bbbb" in r["message"]
    assert r1["error"] == "ValueError" and r1["seconds"] < 1.5, r1
    assert r0["error"] == "RuntimeError" and "rejected 1 connection(s)" in r0["message"], r0
    assert "127.0.0.1:" in r0["message"] and "0.0.0.0:0" not in r0["message"], r0


@pytest.mark.parametrize("tok0,tok1,why", [
    ("s3cret", "s3cret", None),
    ("s3cret", "other", "token mismatch"),
    ("s3cret", "", "gave no token"),
    ("", "s3cret", "requires a token"),
])
def test_token_admits_only_a_peer_that_knows_it(tok0, tok1, why):
    r0, r1 = run_pair("handshake", {"token": tok0, "timeout": 2}, {"token": tok1})
    if why is None:
        assert r0 == r1 == {"error": None, "sum": 3.0}
        return
    # the connecting rank learns why at once; the listening rank kept listening, then says why
    assert r1["error"] == "ValueError" and r1["seconds"] < 1.5, r1
    assert r0["error"] == "RuntimeError" and "rejected 1 connection(s)" in r0["message"], r0
    for r in (r0, r1):
        assert "token" in r["message"], r
        # the secret itself never shows up (and never crossed the wire in clear)
        assert "s3cret" not in r["message"] and "other" not in r["message"], r
    assert why in r0["message"] + r1["message"]


def test_sha256_and_hmac_match_hashlib():
    import hashlib
    import hmac

    rng = np.random.default_rng(3)
    for n in (0, 1, 3, 55, 56, 57, 63, 64, 65, 119, 120, 128, 1000, 100_000):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert core_comm._sha256(data) == hashlib.sha256(data).digest(), n
        for klen in (0, 1, 32, 63, 64, 65, 200):
            key = rng.integers(0, 256, klen, dtype=np.uint8).tobytes()
            want = hmac.new(key, data, hashlib.sha256).digest()
            assert core_comm._hmac_sha256(key, data) == want, (n, klen)


def test_stray_connections_do_not_take_the_peers_place():
    """Garbage, a 2^31 length prefix, a connect-then-close and a silent connection reach rank 0
    first; each is rejected (and logged with its real address) and the real peer still gets in."""
    import struct

    port = free_port()
    p0 = spawn("handshake", 0, port, timeout=20)
    try:
        strays = []

        def stray(payload: bytes | None, close: bool = True) -> socket.socket:
            end = time.monotonic() + 10
            while True:
                s = socket.socket()
                try:
                    s.connect(("127.0.0.1", port))
                    break
                except ConnectionRefusedError:
                    s.close()
                    assert time.monotonic() < end, "rank 0 never listened"
                    time.sleep(0.05)
            if payload:
                s.sendall(payload)
            strays.append(s.getsockname()[1])
            if close:
                time.sleep(0.3)
                s.close()
            return s

        stray(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        stray(struct.pack("<I", 2**31) + b"x" * 64)
        stray(struct.pack("<I", 5) + b"hello")
        stray(None)
        silent = stray(None, close=False)
        t = time.monotonic()
        p1 = spawn("handshake", 1, port)
        out1, _ = p1.communicate(timeout=30)
        silent.close()
        out0, _ = p0.communicate(timeout=30)
        assert p0.returncode == 0 and p1.returncode == 0, out0 + out1
        assert result_of(out0) == result_of(out1) == {"error": None, "sum": 3.0}
        # the silent connection did not hold the peer up (handshakes run concurrently)
        assert time.monotonic() - t < 8
        rejected = [ln for ln in out0.splitlines() if "rejected a connection" in ln]
        assert len(rejected) == 5, out0
        for sport in strays:
            assert any(f"from 127.0.0.1:{sport} " in ln for ln in rejected), (sport, out0)
        assert "0.0.0.0:0" not in out0
        assert "bad message length 2147483648" in out0
        assert "not a TensorFold comm peer" in out0
        # the silent one was still in its handshake when the peer got in (closed then)
        assert "by peer" in out0 and ("still in its handshake" in out0 or "timed out" in out0)
    finally:
        for p in (p0,):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("killer,rail,after,n", [
    (0, 1, 3 << 20, 4 << 20),   # rail 1 lost by rank 0 mid-way through a 16 MiB all-reduce
    (1, 0, 1 << 20, 4 << 20),   # rail 0 lost by rank 1
    (1, 0, 0, 1000),            # rail 0 (the latency-path rail) lost on a small message
])
def test_rail_failure_mid_transfer_fails_over(killer, rail, after, n):
    kw = {"killer": killer, "rail": rail, "after": after, "n": n}
    r0, r1 = run_pair("railfail", kw, kw)
    assert r0["digests"] == r1["digests"]  # and each rank checked them against numpy
    up = [True, True]
    up[rail] = False
    for r in (r0, r1):
        assert r["rail_failures"] == 1, r
        assert r["rails_up"] == up, r
    assert "injected" in (r0, r1)[killer]["down_reason"][rail]


def test_peer_close_is_reported():
    r0, _ = run_pair("close")
    assert "peer lost" in r0["error"] and "peer closed the group" in r0["error"], r0
    assert r0["seconds"] < 2, r0


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_peer_lost_is_an_error_within_timeout(how):
    timeout = 2.0
    port = free_port()
    p0 = spawn("loop", 0, port, timeout=timeout)
    p1 = spawn("loop", 1, port, timeout=timeout)
    try:
        wait_for_line(p0, "READY")
        wait_for_line(p0, "LOOPING")
        t = time.monotonic()
        os.kill(p1.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        out, _ = p0.communicate(timeout=timeout + 10)
        elapsed = time.monotonic() - t
        res = result_of(out)
        assert "peer lost" in res["error"], res
        assert elapsed < timeout + 2, elapsed
        if how == "kill":
            assert elapsed < 1.0, elapsed  # a dead process resets its sockets at once
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()
                p.wait()
