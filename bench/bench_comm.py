"""All-Reduce (float32 sum, in place) of TensorFold's TCP process group between two processes on
loopback, 4 KiB .. 16 MiB, over one rail and over two (127.0.0.1 and 127.0.0.2): rank 0 is the
pytest process, rank 1 a peer process running this file with --peer. Reports the time per
All-Reduce and bytes / time. Loopback needs no hardware; for two namespaces joined by veth
pairs, and for gloo / MPI side by side, see bench_allreduce_netns.py and bench_allreduce.py.

Protocol with the peer: rank 0 broadcasts the size of the next case (0: stop); both ranks then
all-reduce a zero buffer of that size until rank 0 reduces one whose first value is 1, so the
peer follows however many calls pytest-benchmark makes.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import _common

pytestmark = pytest.mark.bench

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB]
RAIL_SETS = {"1rail": [], "2rails": ["127.0.0.1", "127.0.0.2"]}
TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer(port: int, rails: list[str]) -> None:
    from tensorfold import comm

    with comm.Group(1, 2, f"127.0.0.1:{port}", rails=rails, timeout=TIMEOUT_S) as g:
        while True:
            size = np.zeros(1, dtype=np.int64)
            g.broadcast(size, 0)
            if size[0] == 0:
                return
            buf = np.zeros(int(size[0]) // 4, dtype=np.float32)
            while True:
                g.all_reduce(buf)
                if buf[0] != 0:
                    break


@pytest.fixture(scope="module", params=list(RAIL_SETS))
def group(request):
    import tensorfold
    from tensorfold import comm

    rails = RAIL_SETS[request.param]
    port = free_port()
    # the peer imports the same tensorfold (and _core) as this process
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(tensorfold.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--peer", str(port), ",".join(rails)],
                            env=env)
    try:
        g = comm.Group(0, 2, f"127.0.0.1:{port}", rails=rails, timeout=TIMEOUT_S)
    except (RuntimeError, ValueError) as e:
        proc.kill()
        proc.wait()
        pytest.skip(f"no loopback group with rails {rails or 'default'}: {e}")
    yield request.param, g
    g.broadcast(np.zeros(1, dtype=np.int64), 0)
    g.close()
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("nbytes", SIZES, ids=[f"{n // KIB}KiB" if n < MIB else f"{n // MIB}MiB" for n in SIZES])
def test_all_reduce(benchmark, group, nbytes):
    rails, g = group
    g.broadcast(np.array([nbytes], dtype=np.int64), 0)
    buf = np.zeros(nbytes // 4, dtype=np.float32)
    # microseconds per call up to 64 KiB: several calls per timed round
    iterations = max(1, min(20, 256 * KIB // nbytes))
    try:
        benchmark.pedantic(g.all_reduce, args=(buf,), rounds=25 if nbytes <= MIB else 10, iterations=iterations,
                           warmup_rounds=2)
    finally:
        stop = np.zeros(nbytes // 4, dtype=np.float32)
        stop[0] = 1.0
        g.all_reduce(stop)
    assert not buf.any(), "the sum of zero buffers is not zero"
    sec = _common.best_seconds(benchmark)
    if sec is not None:
        _common.record(benchmark, "all-reduce (loopback TCP, 2 processes)", f"{nbytes // KIB} KiB {rails}",
                       us=sec * 1e6, GB_s=nbytes / sec / 1e9)


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--peer":
    peer(int(sys.argv[2]), [r for r in (sys.argv[3] if len(sys.argv) > 3 else "").split(",") if r])
