"""Two-machine start-up that survives big models: ranks that finish loading far apart (longer than
the collective timeout) still start and serve, because they heartbeat while loading and meet at a
barrier with its own deadline; a worker waits for rank 0 for as long as it takes to come."""
from __future__ import annotations

import os
import pathlib
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


def _worker(port: int, delay: float = 0.0, *extra: str) -> subprocess.Popen:
    env = dict(os.environ)
    if delay:
        env["TENSORFOLD_TEST_LOAD_DELAY_S"] = str(delay)
    return subprocess.Popen([sys.executable, "-m", "tensorfold.cli", "worker", MODEL, "--listen",
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
