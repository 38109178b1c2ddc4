"""tensorfold.comm over transport="ibverbs": two ranks as two processes on one machine.

The workers are tests/comm_worker.py with its Group constructor wrapped so that every group
uses transport="ibverbs" and, where the worker asks for rails, the RDMA rails found here
("DEVICE:PORT" of the active ports; one port is used for both rails when there is only one).
The RDMA tests skip with the reason when the build has no ibverbs or there is no device; the
error-path test always runs.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import tensorfold.comm as comm
from tensorfold._core import comm as _comm

TESTS = str(Path(__file__).parent)

# Runs comm_worker.main() with every Group forced onto ibverbs and the RDMA rails.
WRAPPER = r"""
import json, os, sys, types
sys.path.insert(0, os.environ["TF_IBV_TEST_DIR"])
import comm_worker
import tensorfold.comm as comm
rails = json.loads(os.environ["TF_IBV_TEST_RAILS"])
_Group = comm.Group
def Group(*a, **k):
    k["transport"] = "ibverbs"
    k["rails"] = rails if k.get("rails") else []
    return _Group(*a, **k)
comm_worker.comm = types.SimpleNamespace(Group=Group)
sys.argv = ["comm_worker.py"] + sys.argv[1:]
comm_worker.main()
"""


def active_rails() -> list[str]:
    out = []
    for d in _comm.ibverbs_devices():
        for p in d["ports"]:
            if p["state"] == "ACTIVE" and (p["gids"] or p["link_layer"] == "InfiniBand"):
                out.append(f"{d['name']}:{p['port']}")
    return out


def rdma_skip_reason() -> str | None:
    if not _comm.built_with_ibverbs():
        return "built without ibverbs headers"
    if not _comm.ibverbs_devices():
        return "no RDMA device: ibv_get_device_list found none"
    if not active_rails():
        return "no RDMA device with an ACTIVE port and a GID"
    return None


def rails_for_test() -> list[str]:
    r = active_rails()
    return (r * 2)[:2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def result_of(out: str) -> dict:
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError("worker printed no RESULT:\n" + out[-4000:])


def run_pair(mode: str, kw0: dict | None = None, kw1: dict | None = None, timeout: float = 90):
    port = free_port()
    env = dict(os.environ, TF_IBV_TEST_DIR=TESTS, TF_IBV_TEST_RAILS=json.dumps(rails_for_test()))
    procs = []
    for rank, kw in ((0, kw0), (1, kw1)):
        args = [sys.executable, "-c", WRAPPER, mode, str(rank), str(port)]
        args += [f"{k}={v}" for k, v in (kw or {}).items()]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env))
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


needs_rdma = pytest.mark.skipif(rdma_skip_reason() is not None,
                                reason=rdma_skip_reason() or "")


# ------------------------------------------------------------------------------ always runs
def test_ibverbs_unavailable_or_bad_rail_is_a_clear_error():
    reason = rdma_skip_reason()
    if reason is None:
        # Devices exist: a rail naming no device is refused before any connection.
        with pytest.raises((ValueError, RuntimeError), match="no RDMA device named 'nosuchdev9'"):
            comm.Group(0, 2, "127.0.0.1:1", rails=["nosuchdev9:1"], transport="ibverbs")
        return
    with pytest.raises((ValueError, RuntimeError)) as ei:
        comm.Group(0, 2, "127.0.0.1:1", transport="ibverbs", timeout=2)
    msg = str(ei.value)
    assert "ibverbs" in msg
    if not _comm.built_with_ibverbs():
        assert "built without ibverbs" in msg and "libibverbs-dev" in msg, msg
        assert _comm.ibverbs_devices() == []
    elif not _comm.ibverbs_devices():
        assert "no RDMA device" in msg and "ibv_get_device_list" in msg, msg
    else:
        assert "RDMA" in msg or "port" in msg, msg


def test_ibverbs_device_listing_shape():
    devs = _comm.ibverbs_devices()
    assert isinstance(devs, list)
    assert isinstance(_comm.built_with_ibverbs(), bool)
    for d in devs:
        assert isinstance(d["name"], str) and d["name"]
        for p in d["ports"]:
            assert p["port"] >= 1 and isinstance(p["gids"], list)
            for g in p["gids"]:
                assert len(g["gid"]) == 39 and g["index"] >= 0


# ----------------------------------------------------------------------- needs an RDMA device
@pytest.mark.rdma
@needs_rdma
def test_ibverbs_all_reduce_broadcast_barrier_two_rails():
    r0, r1 = run_pair("suite")
    assert r0["digests"] == r1["digests"]  # bit-identical, and each rank checked numpy
    for r in (r0, r1):
        st = r["stats"]
        assert st["all_reduces"] == 38 and st["broadcasts"] == 4 and st["barriers"] == 3
        assert st["rail_failures"] == 0 and st["small_messages"] > 0
        assert r["rails_up"] == [True, True]
        assert min(r["rail_bytes"]) > 16 << 20, r["rail_bytes"]


@pytest.mark.rdma
@needs_rdma
def test_ibverbs_single_default_rail():
    r0, r1 = run_pair("suite", {"rails": "none", "quick": 1}, {"rails": "none", "quick": 1})
    assert r0["digests"] == r1["digests"]
    assert r0["rails_up"] == [True]


@pytest.mark.rdma
@needs_rdma
@pytest.mark.parametrize("killer,rail,after,n", [
    (0, 1, 3 << 20, 4 << 20),   # rail 1 lost by rank 0 mid-way through a 16 MiB all-reduce
    (1, 0, 1 << 20, 4 << 20),   # rail 0 lost by rank 1
    (1, 0, 0, 1000),            # rail 0 lost on a small message
])
def test_ibverbs_rail_failure_fails_over(killer, rail, after, n):
    kw = {"killer": killer, "rail": rail, "after": after, "n": n}
    r0, r1 = run_pair("railfail", kw, kw)
    assert r0["digests"] == r1["digests"]
    up = [True, True]
    up[rail] = False
    for r in (r0, r1):
        assert r["rail_failures"] == 1, r
        assert r["rails_up"] == up, r
    assert "injected" in (r0, r1)[killer]["down_reason"][rail]
    # the other rank learnt it from the peer's notice or a failed/flushed completion
    assert (r0, r1)[1 - killer]["down_reason"][rail]


@pytest.mark.rdma
@needs_rdma
def test_ibverbs_peer_close_is_reported():
    r0, _ = run_pair("close")
    assert "peer lost" in r0["error"] and "peer closed the group" in r0["error"], r0
    assert r0["seconds"] < 3, r0
