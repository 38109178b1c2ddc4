#!/usr/bin/env python3
"""All-Reduce between two processes on loopback: TensorFold's TCP group (1 and 2 rails)
side by side with torch.distributed (gloo) and MPI (mpi4py over Open MPI's TCP transport).

    TENSORFOLD_CORE_DIR=build PYTHONPATH=python python3 bench/bench_allreduce.py [--quick]

Latency at 4/16/64 KB and bandwidth at 1/16/64 MB (float32 sum, in place), median of many
iterations measured on rank 0. Ratio columns are time ratios against TensorFold with two
rails (< 1: TensorFold is faster). MPI is forced onto TCP (--mca btl tcp,self) so that all
columns move bytes through the same loopback TCP stack; pass --mpi-btl to change that.
Needs: torch (CPU) for gloo, mpirun + mpi4py for MPI; a missing one is reported and skipped.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

KB, MB = 1 << 10, 1 << 20
LAT_SIZES = [4 * KB, 16 * KB, 64 * KB]
BW_SIZES = [1 * MB, 16 * MB, 64 * MB]
RAILS2 = ["127.0.0.1", "127.0.0.2"]


def iters_for(nbytes: int, quick: bool) -> int:
    base = 2000 if nbytes <= 64 * KB else 200 if nbytes <= MB else 30 if nbytes <= 16 * MB else 10
    return max(5, base // 5) if quick else base


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_loop(fn, nbytes: int, quick: bool) -> float:
    """Median seconds per call of fn() after a warm-up."""
    n = iters_for(nbytes, quick)
    for _ in range(max(3, n // 10)):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# --------------------------------------------------------------------------- workers
def _ensure_tensorfold_path() -> None:
    try:
        import tensorfold  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def tf_worker(rank: int, port: int, rails: list, sizes: list, quick: bool, q) -> None:
    _ensure_tensorfold_path()
    import numpy as np

    import tensorfold.comm as comm

    g = comm.Group(rank, 2, f"127.0.0.1:{port}", rails=rails, timeout=60)
    res = {}
    for nbytes in sizes:
        buf = np.zeros(nbytes // 4, dtype=np.float32)
        g.barrier()
        res[nbytes] = time_loop(lambda: g.all_reduce(buf), nbytes, quick)
    st = g.stats()
    g.close()
    if rank == 0:
        q.put({"times": res, "rail_bytes": [r["bytes_sent"] for r in st["rails"]]})


def gloo_worker(rank: int, port: int, sizes: list, quick: bool, q) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    res = {}
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4, dtype=torch.float32)
        dist.barrier()
        res[nbytes] = time_loop(lambda: dist.all_reduce(t), nbytes, quick)
    dist.destroy_process_group()
    if rank == 0:
        q.put({"times": res})


def mpi_worker(sizes: list, quick: bool) -> None:
    import numpy as np
    from mpi4py import MPI

    c = MPI.COMM_WORLD
    res = {}
    for nbytes in sizes:
        buf = np.zeros(nbytes // 4, dtype=np.float32)
        c.Barrier()
        res[nbytes] = time_loop(lambda: c.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM), nbytes, quick)
    if c.Get_rank() == 0:
        print("MPIRESULT " + json.dumps({"times": res}), flush=True)


# --------------------------------------------------------------------------- drivers
def run_pair(target, args_for_rank) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_for_rank(r), q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        out = q.get(timeout=900)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    out["times"] = {int(k): v for k, v in out["times"].items()}
    return out


def run_tf(rails: list, sizes: list, quick: bool) -> dict:
    port = free_port()
    return run_pair(tf_worker, lambda r: (r, port, rails, sizes, quick))


def run_gloo(sizes: list, quick: bool) -> dict | None:
    try:
        import torch.distributed as dist  # noqa: F401
    except ImportError as e:
        print(f"[gloo] skipped: torch not importable ({e})")
        return None
    port = free_port()
    return run_pair(gloo_worker, lambda r: (r, port, sizes, quick))


def run_mpi(sizes: list, quick: bool, btl: str) -> dict | None:
    mpirun = shutil.which("mpirun")
    if not mpirun:
        print("[MPI] skipped: mpirun not found (apt-get install openmpi-bin libopenmpi-dev)")
        return None
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        print("[MPI] skipped: mpi4py not installed (pip install mpi4py)")
        return None
    cmd = [mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if btl:
        cmd += ["--mca", "btl", btl, "--mca", "btl_tcp_if_include", "lo"]
    cmd += [sys.executable, __file__, "--mpi-worker", "--sizes", ",".join(map(str, sizes))]
    if quick:
        cmd.append("--quick")
    env = dict(os.environ, OMPI_MCA_plm_rsh_agent="")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("MPIRESULT "):
            out = json.loads(line[10:])
            out["times"] = {int(k): v for k, v in out["times"].items()}
            return out
    print(f"[MPI] skipped: mpirun failed (rc={p.returncode}):\n{(p.stdout + p.stderr)[-2000:]}")
    return None


def fmt_size(n: int) -> str:
    return f"{n // MB} MB" if n >= MB else f"{n // KB} KB"


def fmt_cell(nbytes: int, t: float | None) -> str:
    if t is None:
        return "-"
    if nbytes <= 64 * KB:
        return f"{t * 1e6:8.1f} us"
    return f"{t * 1e3:6.2f} ms {nbytes / t / 1e9:5.2f} GB/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--mpi-btl", default="tcp,self", help="Open MPI btl list ('' = MPI's default, "
                    "i.e. shared memory on one host)")
    ap.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else LAT_SIZES + BW_SIZES
    if a.mpi_worker:
        mpi_worker(sizes, a.quick)
        return

    print(f"All-Reduce float32 sum, 2 processes on loopback, {os.cpu_count()} CPUs, "
          f"median of {iters_for(4 * KB, a.quick)} (small) .. {iters_for(64 * MB, a.quick)} (64 MB) iterations")
    cols = {}
    t = time.time()
    cols["ours 1 rail"] = run_tf([], sizes, a.quick)
    cols["ours 2 rails"] = run_tf(RAILS2, sizes, a.quick)
    cols["gloo"] = run_gloo(sizes, a.quick)
    cols["MPI" + ("(tcp)" if a.mpi_btl == "tcp,self" else f"({a.mpi_btl or 'default'})")] = \
        run_mpi(sizes, a.quick, a.mpi_btl)
    names = list(cols)
    ref = cols["ours 2 rails"]["times"]
    others = [n for n in names if not n.startswith("ours") and cols[n]]
    head = f"{'size':>7} | " + " | ".join(f"{n:>22}" for n in names) + " | " + \
        " | ".join(f"ours/{n.split('(')[0]:<5}" for n in others)
    print(head)
    print("-" * len(head))
    for nbytes in sizes:
        cells = [fmt_cell(nbytes, cols[n]["times"].get(nbytes) if cols[n] else None) for n in names]
        ratios = [f"{ref[nbytes] / cols[n]['times'][nbytes]:10.2f}" for n in others]
        print(f"{fmt_size(nbytes):>7} | " + " | ".join(f"{c:>22}" for c in cells) + " | " +
              " | ".join(ratios))
    rb = cols["ours 2 rails"].get("rail_bytes")
    if rb:
        print(f"2-rail run, bytes sent per rail (rank 0): {rb}")
    print(f"(ratios: time of TensorFold 2 rails / time of the other; < 1 = TensorFold faster; "
          f"total {time.time() - t:.0f} s)")


if __name__ == "__main__":
    main()
