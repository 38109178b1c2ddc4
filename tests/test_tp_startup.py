"""Two-machine start-up that survives big models: ranks that finish loading far apart (longer than
the collective timeout) still start and serve, because they heartbeat while loading and meet at a
barrier with its own deadline; a worker waits for rank 0 for as long as it takes to come."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tensorfold
from test_tp import free_port

MODEL = str(pathlib.Path(__file__).parent / "fixtures" / "deepseek2" / "v3" / "llamacpp-f32.gguf")
TIMEOUT = 4.0  # seconds a collective waits for its peer
IDS = [5, 17, 3, 250, 9, 33, 101, 7]


def _worker(port: int, delay: float = 0.0, *extra: str, model: str = MODEL) -> subprocess.Popen:
    env = dict(os.environ)
    if delay:
        env["TENSORFOLD_TEST_LOAD_DELAY_S"] = str(delay)
    return subprocess.Popen([sys.executable, "-m", "tensorfold.cli", "worker", model, "--listen",
                             f"127.0.0.1:{port}", "-t", "1", "-c", "256", "--tp-timeout", str(TIMEOUT), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _serve_and_check(port: int, worker: subprocess.Popen) -> None:
    ref = tensorfold.Engine(MODEL, threads=1, context=256, tp_compatible=True)
    want = ref.generate(IDS, max_tokens=8, temperature=0, ignore_eos=True).token_ids
    eng = tensorfold.Engine(MODEL, threads=1, context=256, tp=2, rank=0, peer=f"127.0.0.1:{port}",
                            timeout=TIMEOUT)
    try:
        assert eng.generate(IDS, max_tokens=8, temperature=0, ignore_eos=True).token_ids == want
        assert np.array_equal(eng.logits(IDS), ref.logits(IDS))
    finally:
        eng.close()
        _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err


@pytest.mark.parametrize("slow", ["worker", "rank0"])
def test_ranks_loading_far_apart_start_and_serve(slow, monkeypatch):
    # One rank takes 3 x the collective timeout longer to load than the other.
    delay = 3 * TIMEOUT
    port = free_port()
    worker = _worker(port, delay if slow == "worker" else 0.0)
    if slow == "rank0":
        monkeypatch.setenv("TENSORFOLD_TEST_LOAD_DELAY_S", str(delay))
    t0 = time.monotonic()
    _serve_and_check(port, worker)
    assert time.monotonic() - t0 >= delay


@pytest.mark.slow
def test_ranks_loading_60s_apart_start_and_serve():
    # The bar, literally: the worker finishes loading 60 s after rank 0.
    port = free_port()
    worker = _worker(port, 60.0)
    t0 = time.monotonic()
    _serve_and_check(port, worker)
    assert time.monotonic() - t0 >= 60.0


def test_worker_waits_for_a_late_rank0():
    port = free_port()
    worker = _worker(port)
    time.sleep(2.5 * TIMEOUT)  # longer than any collective timeout: the worker keeps listening
    assert worker.poll() is None
    _serve_and_check(port, worker)


def test_worker_wait_limit_and_transport_choice():
    port = free_port()
    worker = _worker(port, 0.0, "--wait", "1")
    _, err = worker.communicate(timeout=60)
    assert worker.returncode != 0 and "tensorfold: error:" in err
    with pytest.raises(ValueError, match="transport must be 'tcp', 'ibverbs' or 'auto'"):
        tensorfold.Engine(MODEL, transport="udp")
    from tensorfold.engine import resolve_transport

    assert resolve_transport("auto") in ("tcp", "ibverbs")  # ibverbs only with an RDMA device



def _rank0_cli(port: int, delay: float = 0.0) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("TENSORFOLD_TEST_LOAD_DELAY_S", None)
    if delay:
        env["TENSORFOLD_TEST_LOAD_DELAY_S"] = str(delay)
    return subprocess.Popen([sys.executable, "-m", "tensorfold.cli", "generate", MODEL, "--tp", "2", "--peer",
                             f"127.0.0.1:{port}", "-t", "1", "-c", "256", "--tp-timeout", str(TIMEOUT), "-p", "hi",
                             "-n", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize("stopped", ["worker", "rank0"])
def test_ctrl_c_at_the_load_barrier_stops_both_sides(stopped):
    # The rank that has loaded waits at the barrier for the other (here 30 s slower). Ctrl-C
    # there ends it at once (exit 130, no traceback), and the other rank stops loading and
    # says why, long before its own load would have finished.
    slow = 30.0
    port = free_port()
    worker = _worker(port, slow if stopped == "rank0" else 0.0)
    rank0 = _rank0_cli(port, slow if stopped == "worker" else 0.0)
    procs = {"worker": worker, "rank0": rank0}
    try:
        time.sleep(4.0)  # both connected; the fast rank has loaded and waits at the barrier
        assert worker.poll() is None and rank0.poll() is None
        target, other = procs[stopped], procs["rank0" if stopped == "worker" else "worker"]
        t = time.monotonic()
        target.send_signal(signal.SIGINT)
        _, err = target.communicate(timeout=10)
        assert time.monotonic() - t < 2.0
        assert target.returncode == 130, err
        assert "Traceback" not in err
        t = time.monotonic()
        _, err_other = other.communicate(timeout=slow)
        assert time.monotonic() - t < 10.0  # it gave up its load, not waited for it
        assert other.returncode not in (0, 130) and "tensorfold: error:" in err_other, err_other
        assert "Traceback" not in err_other and "peer" in err_other, err_other
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

# -- the page cache of TP slices ----------------------------------------------------------
def _resident_pages(path: str) -> np.ndarray:
    """mincore(2) of the whole file: True where the page is in the page cache (asked of the
    kernel through a fresh mapping, not of the engine's own bookkeeping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        rc = libc.mincore(addr, size, vec)
        libc.munmap(addr, size)
        assert rc == 0, os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    return (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)


def test_tp_slices_leave_no_page_cache(smollm2_path, tmp_path):
    # Each rank keeps a private copy of its slices; the file's pages they were read through
    # must not stay cached as well (on a 128 GB machine holding half of a 200 GB file, they
    # would push out what the machine needs). Column slices read whole rows, so this checks
    # their windows are dropped, not just each rank's half.
    import gguf

    model = str(tmp_path / "model.gguf")
    with open(smollm2_path, "rb") as src, open(model, "wb") as dst:
        while chunk := src.read(1 << 24):
            dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    fd = os.open(model, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _resident_pages(model).mean() > 0.05:
        pytest.skip("this filesystem keeps the file's pages cached whatever is asked (tmpfs?)")

    page = os.sysconf("SC_PAGESIZE")
    sliced = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
    ranges = {}
    for t in gguf.GGUFReader(model).tensors:
        role = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if role in sliced:
            first, end = -(-t.data_offset // page), (t.data_offset + t.n_bytes) // page  # whole pages only
            ranges.setdefault(role, []).append((first, end))
    assert {"attn_output", "ffn_down"} <= set(ranges)  # the column-sliced roles

    port = free_port()
    worker = _worker(port, model=model)
    eng = tensorfold.Engine(model, threads=1, context=256, tp=2, rank=0, peer=f"127.0.0.1:{port}", timeout=10)
    try:
        assert len(eng.generate(IDS, max_tokens=4, temperature=0, ignore_eos=True).token_ids) == 4
        resident = _resident_pages(model)
    finally:
        eng.close()
        _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    for role, spans in ranges.items():
        pages = np.concatenate([resident[a:b] for a, b in spans])
        assert pages.size > 0
        assert pages.mean() <= 0.01, f"{role}: {pages.sum()} of {pages.size} pages of the file still cached"

