"""`tensorfold worker` (TP rank 1) facing the network: stray and hostile connections are
rejected while it keeps listening for rank 0, an optional token admits only the intended
peer, every field of every plan received is validated (a bad plan is a one-line error and
exit status 1, never a crash), and Ctrl-C ends it promptly whether it waits for rank 0 or
follows an idle one. Rank 0 is an Engine in this process, or a fake one built from
tensorfold.comm that sends hand-made plans."""
from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import tensorfold
import tensorfold.comm as comm
from tensorfold import _core

CONTEXT = 256  # the worker's context in these tests; kv_tokens defaults to 4096 -> 256 blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(model: str, port: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tensorfold.cli", "worker", model, "--listen",
                             f"127.0.0.1:{port}", "-t", "1", "-c", str(CONTEXT), "--tp-timeout", "20", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})))


def wait_listening(port: int, worker: subprocess.Popen, timeout: float = 20) -> None:
    """Waits until the worker's bootstrap port exists without connecting to it (a probe
    connection would itself be a stray candidate)."""
    end = time.monotonic() + timeout
    hexport = f":{port:04X} "
    while time.monotonic() < end:
        assert worker.poll() is None, worker.communicate()[1]
        with open("/proc/net/tcp") as f:
            if any(hexport in ln and ln.split()[3] == "0A" for ln in f):  # 0A = LISTEN
                return
        time.sleep(0.05)
    raise AssertionError("the worker never listened")


def stray(port: int, payload: bytes | None) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if payload:
        s.sendall(payload)
    return s


def finish(worker: subprocess.Popen, timeout: float = 30) -> str:
    try:
        _, err = worker.communicate(timeout=timeout)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    return err


@pytest.fixture(scope="module")
def reference_tokens(smollm2_path):
    solo = tensorfold.Engine(smollm2_path, threads=1, context=CONTEXT, tp_compatible=True)
    try:
        return solo.generate([1, 504, 3287, 314, 253], max_tokens=12, temperature=0, ignore_eos=True).token_ids
    finally:
        solo.close()


def test_stray_connections_are_rejected_and_the_worker_keeps_listening(smollm2_path, reference_tokens,
                                                                        monkeypatch):
    monkeypatch.delenv("TENSORFOLD_TP_TOKEN", raising=False)
    port = free_port()
    worker = start_worker(smollm2_path, port)
    try:
        wait_listening(port, worker)
        ports = []
        for payload in (b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n",  # garbage (a 542 MB "length")
                        struct.pack("<I", 2**31) + b"\0" * 16,       # a 2^31 length prefix
                        struct.pack("<I", 6) + b"hello!",           # a short non-protocol message
                        None):                                       # connect, then close
            s = stray(port, payload)
            ports.append(s.getsockname()[1])
            time.sleep(0.3)
            s.close()
        # A TensorFold rank 0 with another configuration is refused and told why ...
        with pytest.raises(ValueError, match="handshake .*differs"):
            tensorfold.Engine(smollm2_path, threads=1, context=128, tp=2, rank=0, peer=f"127.0.0.1:{port}",
                              timeout=10)
        # ... and a silent connection holds the worker only for its short handshake deadline.
        silent = stray(port, None)
        ports.append(silent.getsockname()[1])
        t = time.monotonic()
        eng = tensorfold.Engine(smollm2_path, threads=1, context=CONTEXT, tp=2, rank=0,
                                peer=f"127.0.0.1:{port}", timeout=20)
        assert time.monotonic() - t < 6
        silent.close()
        try:
            got = eng.generate([1, 504, 3287, 314, 253], max_tokens=12, temperature=0, ignore_eos=True).token_ids
        finally:
            eng.close()
        err = finish(worker)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0, err
    assert got == reference_tokens  # TP=2 after all that still equals TP=1
    rejected = [ln for ln in err.splitlines() if "rejected a connection" in ln]
    assert len(rejected) == 6, err
    for p in ports:  # logged with the real peer address
        assert any(f"from 127.0.0.1:{p} " in ln for ln in rejected), (p, err)
    assert "0.0.0.0:0" not in err and "Traceback" not in err
    assert "bad message length 2147483648" in err and "not a TensorFold comm peer" in err
    assert "differs" in err
    # the silent one, served alongside rank 0, was closed when rank 0 got in (or timed out first)
    silent_line = next(ln for ln in rejected if f"from 127.0.0.1:{ports[-1]} " in ln)
    assert "(closed: still in its handshake when TP rank 0 was admitted)" in silent_line \
        or "timed out" in silent_line, silent_line


def test_token_admits_only_the_intended_rank0(smollm2_path, reference_tokens, monkeypatch):
    monkeypatch.delenv("TENSORFOLD_TP_TOKEN", raising=False)
    port = free_port()
    # the worker takes its token from the environment, rank 0 from the argument
    worker = start_worker(smollm2_path, port, env={"TENSORFOLD_TP_TOKEN": "s3cret-42"})
    peer = f"127.0.0.1:{port}"
    try:
        with pytest.raises(ValueError, match="requires a token, but this rank has none"):
            tensorfold.Engine(smollm2_path, threads=1, context=CONTEXT, tp=2, rank=0, peer=peer, timeout=10)
        with pytest.raises(ValueError, match="token mismatch"):
            tensorfold.Engine(smollm2_path, threads=1, context=CONTEXT, tp=2, rank=0, peer=peer, timeout=10,
                              token="s3cret-41")
        # a fake rank 0 without the token cannot get a plan in either
        with pytest.raises(ValueError, match="token"):
            comm.Group(1, 2, peer, timeout=10, handshake=_core.Engine._tp_identity(smollm2_path, 2, CONTEXT))
        eng = tensorfold.Engine(smollm2_path, threads=1, context=CONTEXT, tp=2, rank=0, peer=peer, timeout=10,
                                token="s3cret-42")
        try:
            got = eng.generate([1, 504, 3287, 314, 253], max_tokens=12, temperature=0, ignore_eos=True).token_ids
        finally:
            eng.close()
        err = finish(worker)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0, err
    assert got == reference_tokens
    assert err.count("rejected a connection") == 3, err
    assert "s3cret" not in err


def test_cli_token_flag_and_env_default(smollm2_path, monkeypatch):
    """--token on the worker; TENSORFOLD_TP_TOKEN as rank 0's default."""
    port = free_port()
    worker = start_worker(smollm2_path, port, "--token", "flag-token")
    try:
        monkeypatch.setenv("TENSORFOLD_TP_TOKEN", "flag-token")
        eng = tensorfold.Engine(smollm2_path, threads=1, context=CONTEXT, tp=2, rank=0,
                                peer=f"127.0.0.1:{port}", timeout=10)
        assert len(eng.generate([1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True).token_ids) == 3
        eng.close()
        err = finish(worker)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0 and "rejected" not in err, err


# ------------------------------------------------------------- jamming, log floods, messages
@pytest.mark.parametrize("n_silent", [20, 80])  # 80: past the cap of connections in their handshake
def test_silent_connections_do_not_keep_rank0_out(smollm2_path, reference_tokens, monkeypatch, n_silent):
    """Connections that never say a word (no token needed to open them) hold the worker's
    handshake slots for 3 s each; served one by one, 20 of them kept a token-holding rank 0 out
    past its timeout. Served concurrently, rank 0 gets in at once."""
    monkeypatch.delenv("TENSORFOLD_TP_TOKEN", raising=False)
    port = free_port()
    worker = start_worker(smollm2_path, port, "--token", "jam-42")
    silent = []
    try:
        wait_listening(port, worker)
        silent = [stray(port, None) for _ in range(n_silent)]
        t = time.monotonic()
        eng = tensorfold.Engine(smollm2_path, threads=1, context=CONTEXT, tp=2, rank=0,
                                peer=f"127.0.0.1:{port}", timeout=30, token="jam-42")
        # Served one at a time, n_silent x 3 s (>= 60 s) would have passed first.
        assert time.monotonic() - t < 20
        try:
            got = eng.generate([1, 504, 3287, 314, 253], max_tokens=12, temperature=0, ignore_eos=True).token_ids
        finally:
            eng.close()
        err = finish(worker)
    finally:
        for s in silent:
            s.close()
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0, err
    assert got == reference_tokens
    assert "Traceback" not in err and "jam-42" not in err
    # each silent connection is a refused one: logged one by one, then summarised
    lines = err.splitlines()
    one_by_one = [ln for ln in lines if "rejected a connection" in ln]
    summarised = sum(int(ln.split("rejected ")[1].split()[0]) for ln in lines if "more connection(s)" in ln)
    assert len(one_by_one) == min(n_silent, 20) and len(one_by_one) + summarised == n_silent, err


def _reject_and_wait(port: int, payload: bytes) -> None:
    """One connection the worker rejects; returns once the worker has closed it (so it is counted)."""
    s = stray(port, payload)
    s.settimeout(10)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    finally:
        s.close()


def test_a_rejection_flood_is_summarised_never_silenced(smollm2_path, monkeypatch):
    """The first 20 rejections are logged one by one, the rest in summary lines (at most one per
    10 s, and one when the wait ends) that count them and name the last."""
    monkeypatch.delenv("TENSORFOLD_TP_TOKEN", raising=False)
    port = free_port()
    worker = start_worker(smollm2_path, port)
    try:
        wait_listening(port, worker)
        for _ in range(35):
            _reject_and_wait(port, b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n")
        eng = tensorfold.Engine(smollm2_path, threads=1, context=CONTEXT, tp=2, rank=0,
                                peer=f"127.0.0.1:{port}", timeout=20)
        assert len(eng.generate([1, 2, 3], max_tokens=2, temperature=0, ignore_eos=True).token_ids) == 2
        eng.close()
        err = finish(worker)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0, err
    one_by_one = [ln for ln in err.splitlines() if "rejected a connection" in ln]
    assert len(one_by_one) == 20, err
    assert "further rejections are summarised" in one_by_one[-1]
    summaries = [ln for ln in err.splitlines() if "more connection(s)" in ln]
    assert summaries and "no longer logging" not in err, err
    assert sum(int(ln.split("rejected ")[1].split()[0]) for ln in summaries) == 15, err
    assert f"on bootstrap address 127.0.0.1:{port} in the last" in summaries[-1], err
    assert "(the last from 127.0.0.1:" in summaries[-1] and "bad message length" in summaries[-1], err
    # the summary comes before the worker reports the connection it waited for
    assert err.index(summaries[-1]) < err.index("worker: connected"), err


def test_messages_name_the_ranks_as_the_user_knows_them(smollm2_path, monkeypatch):
    """The comm layer numbers the listener rank 0; messages say 'the TP worker' and 'TP rank 0'."""
    monkeypatch.delenv("TENSORFOLD_TP_TOKEN", raising=False)
    port = free_port()  # nothing listens there
    r = subprocess.run([sys.executable, "-m", "tensorfold.cli", "generate", smollm2_path, "-p", "hi", "-n", "1",
                        "-t", "1", "-c", str(CONTEXT), "--tp", "2", "--peer", f"127.0.0.1:{port}",
                        "--tp-timeout", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"could not connect to the TP worker (rank 1, `tensorfold worker`) at 127.0.0.1:{port}" in r.stderr
    assert "rank 0" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    # and the worker, waiting in vain, names TP rank 0
    worker = start_worker(smollm2_path, free_port(), "--wait", "1")
    err = finish(worker)
    assert worker.returncode != 0 and "timed out waiting for TP rank 0 to connect" in err, err
    assert "rank 1 to connect" not in err


def test_a_mismatch_names_the_options_that_differ(smollm2_path, reference_tokens, monkeypatch):
    """Two processes started with different -c: both say which option differs, with both values,
    instead of showing the raw handshake text. Resolved values are compared, so a default on one
    side and the same value given explicitly on the other agree."""
    monkeypatch.delenv("TENSORFOLD_TP_TOKEN", raising=False)
    port = free_port()
    worker = start_worker(smollm2_path, port)  # -c 256, --kv-tokens by default: 4096
    rank0 = [sys.executable, "-m", "tensorfold.cli", "generate", smollm2_path, "-p", "hi", "-n", "1", "-t", "1",
             "--tp", "2", "--peer", f"127.0.0.1:{port}", "--tp-timeout", "10", "--temperature", "0"]
    try:
        r = subprocess.run(rank0 + ["-c", "128"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, r.stderr
        assert "context 128 here, 256 on the peer" in r.stderr, r.stderr
        assert "start both ranks with the same -c/--context" in r.stderr, r.stderr
        assert "tensorfold-tp-" not in r.stderr  # not the raw handshake text
        # kv_tokens given explicitly on rank 0, left to its default (the same 4096) on the worker
        ok = subprocess.run(rank0 + ["-c", str(CONTEXT), "--kv-tokens", "4096"], capture_output=True, text=True,
                            timeout=60)
        assert ok.returncode == 0, ok.stderr
        err = finish(worker)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0, err
    assert "context 256 here, 128 on the peer" in err, err
    assert "tensorfold-tp-" not in err


def _fake_rank1_handshake(s: socket.socket, handshake: str) -> None:
    """The connecting side of the comm handshake, by hand (no token), so a test controls when
    the rail connections come."""
    def send(b: bytes) -> None:
        s.sendall(struct.pack("<I", len(b)) + b)

    def recv() -> bytes:
        def exact(n: int) -> bytes:
            out = b""
            while len(out) < n:
                chunk = s.recv(n - len(out))
                assert chunk, "rank 0 closed the bootstrap link"
                out += chunk
            return out
        return exact(struct.unpack("<I", exact(4))[0])

    send("\n".join(["tensorfold-comm 2", "endian little", "size 2", "rank 1", "transport tcp",
                    "dtypes f32,f16,bf16", "rails 1", f"small {64 << 10}", f"chunk {512 << 10}",
                    f"nonce {os.urandom(16).hex()}", "auth none", f"handshake {handshake}"]).encode())
    assert recv().startswith(b"tensorfold-comm 2")
    send(b"proof none")
    assert recv() == b"proof none"
    send(b"ok")
    assert recv() == b"ok"


def test_silent_connections_to_a_rail_port_do_not_stall_setup(capfd):
    """The listening rank announces its rail ports after the handshake; connections there that
    stay silent, send a wrong hello or close are dropped while the peer's rail gets in. Served one
    by one (3 s each), 5 silent ones held the rails up for 15 s, past the peer's patience."""
    import threading

    port = free_port()
    result = {}

    def rank0() -> None:
        try:
            g = comm.Group(0, 2, f"127.0.0.1:{port}", timeout=30, handshake="rails-test")
            result["ok"] = g.stats()["rails"][0]["peer"]
            g.close()
        except Exception as e:  # reported below
            result["error"] = f"{type(e).__name__}: {e}"

    th = threading.Thread(target=rank0)
    th.start()
    socks = []
    try:
        end = time.monotonic() + 10
        while True:
            try:
                boot = socket.create_connection(("127.0.0.1", port), timeout=10)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < end, "rank 0 never listened"
                time.sleep(0.05)
        socks.append(boot)
        _fake_rank1_handshake(boot, "rails-test")
        n = struct.unpack("<I", boot.recv(4, socket.MSG_WAITALL))[0]
        nonce, rail0 = boot.recv(n, socket.MSG_WAITALL).decode().split()
        host, rport = rail0.rsplit(":", 1)
        t = time.monotonic()
        socks += [socket.create_connection((host, int(rport)), timeout=10) for _ in range(5)]  # silent
        wrong = socket.create_connection((host, int(rport)), timeout=10)
        wrong.sendall(struct.pack("<QII", int(nonce) ^ 1, 0x54465231, 0))
        socks.append(wrong)
        wrong_port = wrong.getsockname()[1]
        socket.create_connection((host, int(rport)), timeout=10).close()
        real = socket.create_connection((host, int(rport)), timeout=10)
        socks.append(real)
        real_port = real.getsockname()[1]
        real.sendall(struct.pack("<QII", int(nonce), 0x54465231, 0))
        n = struct.unpack("<I", boot.recv(4, socket.MSG_WAITALL))[0]
        assert boot.recv(n, socket.MSG_WAITALL) == b"rails-ok"
        assert time.monotonic() - t < 10  # one by one: 5 x 3 s
    finally:
        th.join(timeout=30)
        for s in socks:
            s.close()
    assert "ok" in result and result["ok"].endswith(f":{real_port}"), result
    err = capfd.readouterr().err
    assert f"rejected a connection on rail 0 (" in err, err
    assert f"from 127.0.0.1:{wrong_port} (not our peer's rail 0); still waiting for rank 1" in err, err


# ----------------------------------------------------------------------------- hostile plans
def _plan(T=1, tokens=None, n_seq=None, tables=None):
    """[T, (token, pos, seq, want) * T, n_seq, (slot, n, blocks...) * n_seq]"""
    tokens = tokens if tokens is not None else [(5, 0, 0, 1)]
    tables = tables if tables is not None else [(0, [0])]
    out = [T]
    for t in tokens:
        out += list(t)
    out.append(len(tables) if n_seq is None else n_seq)
    for slot, blocks in tables:
        out += [slot, len(blocks), *blocks]
    return out


_N_VOCAB = 49152
HOSTILE = {
    "seq -1": (_plan(tokens=[(5, 0, -1, 1)]), "sequence slot -1 (valid 0..255)"),
    "seq 7": (_plan(tokens=[(5, 0, 7, 1)]), "uses sequence slot 7 which has no block table"),
    "seq 1e8": (_plan(tokens=[(5, 0, 100_000_000, 1)]), "sequence slot 100000000"),
    "table slot -1": (_plan(tables=[(-1, [0])]), "has slot -1"),
    "token = n_vocab": (_plan(tokens=[(_N_VOCAB, 0, 0, 1)]), f"has id {_N_VOCAB} (vocabulary 0..{_N_VOCAB - 1})"),
    "position = context": (_plan(tokens=[(5, CONTEXT, 0, 1)]), f"position {CONTEXT} (context 0..{CONTEXT - 1})"),
    "position past the table": (_plan(tokens=[(5, 16, 0, 1)]), "position 16 beyond the 1 blocks"),
    "flags 4": (_plan(tokens=[(5, 0, 0, 4)]), "flags 4"),  # want_logits | exact << 1 is 0..3
    "T 0": ([0] * 8, "0 tokens"),
    "T 10^6": (_plan(T=10**6), "1000000 tokens"),
    "n_seq 2 for 1 token": (_plan(n_seq=2), "2 sequences for 1 tokens"),
    "block = n_blocks": (_plan(tables=[(0, [256])]), "lists block 256 (valid 0..255)"),
    "block -1": (_plan(tables=[(0, [-1])]), "lists block -1"),
    "table too long": (_plan(tables=[(0, list(range(17)))]), "block table of 17 blocks (1..16)"),
    "slot twice": (_plan(T=2, tokens=[(5, 0, 0, 1), (6, 1, 0, 1)], tables=[(0, [0]), (0, [1])]), "listed twice"),
    "block twice": (_plan(T=2, tokens=[(5, 0, 0, 1), (6, 0, 1, 1)], tables=[(0, [3]), (1, [3])]),
                    "block 3 is used twice"),
    # a cached prefix may be listed by several tables (read-only), never twice in one
    "block twice in a table": (_plan(tables=[(0, [3, 3])]), "block 3 is used twice in the table of sequence slot 0"),
    "write to a shared block": (_plan(T=2, tokens=[(5, 16, 0, 1), (6, 0, 1, 1)], tables=[(0, [3, 4]), (1, [4])]),
                                "block 4 is used twice: token 0 of sequence slot 0 writes it"),
    "trailing ints": (_plan() + [0], "1 unexpected ints"),
    "truncated": ([2, 5, 0, 0, 1, 1, 0, 1], "truncated"),
    "65 logits rows": (_plan(T=65, tokens=[(5, p, 0, 1) for p in range(65)], tables=[(0, [0, 1, 2, 3, 4])]),
                       "65 logits rows (at most 64"),
}


def _send(g, cmd: int, plan: list[int] | None, length: int | None = None) -> None:
    n = len(plan or []) if length is None else length
    g.broadcast(np.array([cmd, n, 0, 0], dtype=np.int64), 1)
    if plan:
        g.broadcast(np.array(plan, dtype=np.int64).astype(np.int32), 1)


def _loaded(g) -> None:
    """Play rank 0's side of the start-up barrier: report 'loaded' until the worker has too."""
    while True:
        state = np.array([1.0], dtype=np.float32)
        g.all_reduce(state)
        if state[0] >= 2:
            return


def _hostile_case(model: str, case: str) -> str | None:
    """Runs one case against its own worker; returns what went wrong, or None."""
    port = free_port()
    worker = start_worker(model, port, "--tp-timeout", "10", env={"TENSORFOLD_TP_TOKEN": ""})
    try:
        g = comm.Group(1, 2, f"127.0.0.1:{port}", timeout=20,
                       handshake=_core.Engine._tp_identity(model, 2, CONTEXT))
        _loaded(g)
        if case == "huge plan length":
            _send(g, 1, None, length=10**9)
            want = "malformed plan from rank 0: 1000000000 ints"
        elif case == "unknown command":
            _send(g, 99, None, length=0)
            want = "malformed command from rank 0 (99, 0, 0, 0)"
        else:
            plan, want = HOSTILE[case]
            _send(g, 1, plan)
        err = finish(worker, timeout=30)
        g.close()
    except Exception as e:  # reported with the case's name below
        return f"{type(e).__name__}: {e}"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    # a clear one-line error and exit status 1: no crash (negative status), no traceback
    if worker.returncode != 1 or "tensorfold: error: TP follower:" not in err or want not in err \
            or "Traceback" in err:
        return f"exit status {worker.returncode}, expected {want!r} in:\n{err[-2000:]}"
    return None


def test_hostile_plans_stop_the_worker_cleanly(smollm2_path):
    """Each bad plan against a fresh worker (several at once: each is mostly start-up)."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [*HOSTILE, "huge plan length", "unknown command"]
    with ThreadPoolExecutor(max_workers=6) as ex:
        results = dict(zip(cases, ex.map(lambda c: _hostile_case(smollm2_path, c), cases)))
    failed = {c: r for c, r in results.items() if r is not None}
    assert not failed, "\n\n".join(f"[{c}] {r}" for c, r in failed.items())


# ------------------------------------------------------------------------------------- Ctrl-C
def _readline_until(stream, text: str, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = stream.readline()
        if not line:
            raise AssertionError(f"stream ended before {text!r}")
        if text in line:
            return
    raise AssertionError(f"no {text!r} in time")


def test_ctrl_c_while_waiting_for_rank0(smollm2_path):
    port = free_port()
    worker = start_worker(smollm2_path, port)
    try:
        wait_listening(port, worker)
        time.sleep(0.3)
        t = time.monotonic()
        worker.send_signal(signal.SIGINT)
        err = finish(worker, timeout=10)
        elapsed = time.monotonic() - t
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 130, err
    assert elapsed < 1.0, elapsed
    assert "Traceback" not in err


def test_ctrl_c_while_following_an_idle_rank0(smollm2_path, monkeypatch):
    monkeypatch.delenv("TENSORFOLD_TP_TOKEN", raising=False)
    port = free_port()
    worker = start_worker(smollm2_path, port)
    try:
        eng = tensorfold.Engine(smollm2_path, threads=1, context=CONTEXT, tp=2, rank=0,
                                peer=f"127.0.0.1:{port}", timeout=20)
        eng.generate([1, 2, 3], max_tokens=2, temperature=0)
        _readline_until(worker.stderr, "worker: connected")
        time.sleep(0.5)  # rank 0 idle: the worker waits for the next command
        t = time.monotonic()
        worker.send_signal(signal.SIGINT)
        err = finish(worker, timeout=10)
        elapsed = time.monotonic() - t
        # rank 0 learns it at its next forward, within a moment (not the timeout)
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="peer lost"):
            eng.generate([1, 2, 3], max_tokens=2, temperature=0)
        assert time.monotonic() - t < 5
        eng.close()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 130, err
    assert elapsed < 1.0, elapsed
    assert "Traceback" not in err


def test_ctrl_c_while_connections_are_in_their_handshake(smollm2_path):
    """Ctrl-C ends the wait at once although silent connections are being served meanwhile."""
    port = free_port()
    worker = start_worker(smollm2_path, port)
    silent = []
    try:
        wait_listening(port, worker)
        silent = [stray(port, None) for _ in range(5)]
        time.sleep(0.3)
        t = time.monotonic()
        worker.send_signal(signal.SIGINT)
        err = finish(worker, timeout=10)
        elapsed = time.monotonic() - t
    finally:
        for s in silent:
            s.close()
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 130, err
    assert elapsed < 2.0, elapsed
    assert "Traceback" not in err
