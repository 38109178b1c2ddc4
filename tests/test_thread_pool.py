"""The worker pool under stress: every chunk runs exactly once whatever the thread count
(including far more threads than CPUs), a stalled thread costs its chunk and not the job,
exceptions on workers reach the caller, interrupts stop a job, and the default thread count
follows the affinity mask and the cgroup CPU quota."""
from __future__ import annotations

import os
import threading
import time

import pytest

from tensorfold import _core


@pytest.mark.parametrize("threads", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("n_chunks", [1, 2, 7, 100, 1000])
def test_every_chunk_runs_once(threads, n_chunks):
    pool = _core.ThreadPool(threads)
    seen = [0] * n_chunks
    thread_ids = set()

    def fn(c, t):
        seen[c] += 1
        thread_ids.add(t)

    for _ in range(3):  # consecutive jobs on the same pool
        pool.run_chunks(n_chunks, fn)
    assert seen == [3] * n_chunks
    assert thread_ids <= set(range(threads))
    if n_chunks == 1:
        assert thread_ids == {0}  # a single chunk runs on the caller, no hand-off


@pytest.mark.parametrize("n,grain", [(1, 1), (10, 3), (1000, 16), (1001, 7), (5, 100)])
@pytest.mark.parametrize("threads", [1, 4, 33])
def test_parallel_for_covers_range_on_grain_boundaries(n, grain, threads):
    pool = _core.ThreadPool(threads)
    spans = []
    pool.parallel_for(n, grain, lambda b, e: spans.append((b, e)))
    spans.sort()
    assert spans[0][0] == 0 and spans[-1][1] == n
    for (b0, e0), (b1, _) in zip(spans, spans[1:]):
        assert e0 == b1
    assert all(b % grain == 0 and b < e for b, e in spans)
    assert len(spans) <= threads * 4  # a few chunks per thread, not one per grain


def test_worker_exception_reaches_the_caller_and_pool_stays_usable():
    pool = _core.ThreadPool(4)

    def fn(c, t):
        if c == 37:
            raise ValueError("chunk 37 failed")

    with pytest.raises(ValueError, match="chunk 37 failed"):
        pool.run_chunks(100, fn)
    done = []
    pool.run_chunks(50, lambda c, t: done.append(c))
    assert sorted(done) == list(range(50))


def test_a_stalled_thread_costs_its_chunk_not_the_job():
    # One chunk sleeps; the others are claimed by the free threads meanwhile, so the job takes
    # about one sleep, not one sleep per static share.
    pool = _core.ThreadPool(4)
    stall = 0.3
    when = {}

    def fn(c, t):
        if c == 0:
            time.sleep(stall)
        when[c] = time.perf_counter()

    t0 = time.perf_counter()
    pool.run_chunks(64, fn)
    total = time.perf_counter() - t0
    assert len(when) == 64
    # Every other chunk finished while chunk 0 was still sleeping.
    others = max(v for c, v in when.items() if c != 0) - t0
    assert others < stall, f"other chunks waited for the stalled one ({others:.3f}s)"
    assert total < stall + 0.25


@pytest.mark.parametrize("threads", [1, 3])
def test_interrupt_stops_an_interruptible_job(threads):
    pool = _core.ThreadPool(threads)
    pool.set_interruptible(True)
    ran = []

    def fn(c, t):
        ran.append(c)
        if c == 5 or len(ran) == 6:
            _core.request_interrupt()

    with pytest.raises(KeyboardInterrupt):
        pool.run_chunks(10_000, fn)
    assert len(ran) < 10_000
    # The flag is cleared when the native call ends: the next job runs normally.
    ran.clear()
    pool.run_chunks(20, lambda c, t: ran.append(c))
    assert sorted(ran) == list(range(20))


def test_not_interruptible_job_runs_to_the_end():
    pool = _core.ThreadPool(2)
    ran = []

    def fn(c, t):
        ran.append(c)
        if c == 3:
            _core.request_interrupt()

    pool.run_chunks(50, fn)
    assert sorted(ran) == list(range(50))


def test_second_caller_while_busy_is_refused_not_corrupted():
    pool = _core.ThreadPool(2)
    started = threading.Event()
    release = threading.Event()
    errors = []

    def slow(c, t):
        started.set()
        release.wait(5)

    th = threading.Thread(target=lambda: pool.run_chunks(2, slow))
    th.start()
    started.wait(5)
    try:
        pool.run_chunks(4, lambda c, t: None)
    except RuntimeError as e:
        errors.append(str(e))
    finally:
        release.set()
        th.join(10)
    assert len(errors) == 1 and "second thread" in errors[0]


def test_usable_cpus_respects_the_affinity_mask():
    assert 1 <= _core.usable_cpus() <= len(os.sched_getaffinity(0))


def _cgroup_tree(tmp_path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("files,proc,expect", [
    ({"cpu.max": "max 100000\n"}, "0::/\n", 0),
    ({"cpu.max": "150000 100000\n"}, "0::/\n", 2),             # 1.5 CPUs -> 2 threads
    ({"cpu.max": "100000 100000\n"}, "0::/\n", 1),
    ({"a/b/cpu.max": "max 100000\n", "a/cpu.max": "300000 100000\n"}, "0::/a/b\n", 3),  # quota on a parent
    ({"a/b/cpu.max": "50000 100000\n", "a/cpu.max": "300000 100000\n"}, "0::/a/b\n", 1),
    ({"cpu,cpuacct/x/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"},
     "4:cpu,cpuacct:/x\n0::/\n", 2),                             # cgroup v1
    ({"cpu,cpuacct/x/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"},
     "4:cpu,cpuacct:/x\n", 0),
    ({}, "garbage\n::\n", 0),
])
def test_cgroup_cpu_quota(tmp_path, files, proc, expect):
    assert _core.cgroup_cpu_limit(_cgroup_tree(tmp_path, files), proc) == expect
