#!/usr/bin/env python3
"""All-Reduce between two network namespaces joined by two veth pairs (one per rail): the
single-machine stand-in for two hosts with two NICs. Needs root (ip netns, tc).

    TENSORFOLD_CORE_DIR=build PYTHONPATH=python python3 bench/bench_allreduce_netns.py [--quick] [--rate 1gbit]

Part 1: latency (4/16/64 KB) and bandwidth (1/16/64 MB) for TensorFold's Group with 1 rail and
2 rails, torch.distributed gloo and MPI (mpi4py, Open MPI btl tcp) -- all through the veths.
Part 2: each rail's veths (both ends) rate-limited with tc tbf to --rate; 16 MB All-Reduce over
2 rails vs 1 rail and their ratio (target >= 1.8x).
The namespaces (tfbA<pid>, tfbB<pid>) are created and removed by the script. Addresses:
rail 0 192.0.2.1 (A) <-> 192.0.2.2 (B), rail 1 198.51.100.1 (A) <-> 198.51.100.2 (B).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_allreduce import BW_SIZES, KB, LAT_SIZES, MB, fmt_cell, fmt_size, iters_for, time_loop  # noqa: E402

A_IPS = ["192.0.2.1", "198.51.100.1"]
B_IPS = ["192.0.2.2", "198.51.100.2"]
PID = os.getpid()
NS = [f"tfbA{PID}", f"tfbB{PID}"]
VETH = [[f"tbA{r}_{PID}", f"tbB{r}_{PID}"] for r in (0, 1)]


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and p.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {p.stderr.strip()}")
    return p


def setup() -> None:
    for ns in NS:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    for r, (va, vb) in enumerate(VETH):
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for side, dev, ip in ((0, va, A_IPS[r]), (1, vb, B_IPS[r])):
            sh("ip", "link", "set", dev, "netns", NS[side])
            sh("ip", "-n", NS[side], "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", NS[side], "link", "set", dev, "up")


def teardown() -> None:
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)
    for pair in VETH:
        for dev in pair:
            sh("ip", "link", "del", dev, check=False)


def rate_limit(rate: str | None) -> None:
    for r in (0, 1):
        for side in (0, 1):
            dev = VETH[r][side]
            sh("ip", "netns", "exec", NS[side], "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if rate:
                sh("ip", "netns", "exec", NS[side], "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                   "rate", rate, "burst", "256kb", "latency", "100ms")


# --------------------------------------------------------------------------- one rank (in a namespace)
def rank_main(a: argparse.Namespace) -> None:
    sizes = [int(s) for s in a.sizes.split(",")]
    res, extra = {}, {}
    if a.role == "tf":
        import numpy as np

        import tensorfold.comm as comm

        ips = A_IPS if a.rank == 0 else B_IPS
        g = comm.Group(a.rank, 2, f"{A_IPS[0]}:{a.port}", rails=ips[: a.rails], timeout=120)
        for n in sizes:
            buf = np.zeros(n // 4, dtype=np.float32)
            g.barrier()
            res[n] = time_loop(lambda: g.all_reduce(buf), n, a.quick)
        extra["rail_bytes"] = [r["bytes_sent"] for r in g.stats()["rails"]]
        g.close()
    elif a.role == "gloo":
        os.environ["GLOO_SOCKET_IFNAME"] = VETH[0][a.rank].replace(str(PID), a.pid)
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{A_IPS[0]}:{a.port}", rank=a.rank, world_size=2)
        for n in sizes:
            t = torch.zeros(n // 4, dtype=torch.float32)
            dist.barrier()
            res[n] = time_loop(lambda: dist.all_reduce(t), n, a.quick)
        dist.destroy_process_group()
    if a.rank == 0:
        print("RESULT " + json.dumps({"times": res, **extra}), flush=True)


def run_ranks(role: str, sizes: list, quick: bool, port: int, rails: int = 1) -> dict | None:
    procs = []
    for rank in (0, 1):  # rank 0 (listener) in ns A, rank 1 in ns B
        argv = ["ip", "netns", "exec", NS[rank], sys.executable, __file__, "--rank-of", role, "--rank",
                str(rank), "--port", str(port), "--rails", str(rails), "--pid", str(PID),
                "--sizes", ",".join(map(str, sizes))] + (["--quick"] if quick else [])
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=900))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
    for line in outs[0][0].splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[7:])
            out["times"] = {int(k): v for k, v in out["times"].items()}
            return out
    print(f"[{role}] failed: {(outs[0][1] + outs[1][1])[-1500:]}")
    return None


def run_mpi(sizes: list, quick: bool) -> dict | None:
    """MPMD mpirun: rank 0 in ns A, rank 1 in ns B (via `ip netns exec`), btl tcp on rail 0's
    subnet. PMIx's local server must be reachable from both namespaces; if Open MPI cannot set
    that up the column is skipped with its error."""
    mpirun = shutil.which("mpirun")
    if not mpirun:
        print("[MPI] skipped: mpirun not found")
        return None
    worker = [sys.executable, str(HERE / "bench_allreduce.py"), "--mpi-worker", "--sizes",
              ",".join(map(str, sizes))] + (["--quick"] if quick else [])
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "192.0.2.0/24",
           "--mca", "pmix_ptl_tcp_remote_connections", "1",
           "-np", "1", "ip", "netns", "exec", NS[0], *worker, ":",
           "-np", "1", "ip", "netns", "exec", NS[1], *worker]
    env = dict(os.environ, OMPI_MCA_plm_rsh_agent="", PMIX_MCA_ptl_tcp_remote_connections="1")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        print("[MPI] skipped: mpirun timed out")
        return None
    for line in p.stdout.splitlines():
        if line.startswith("MPIRESULT "):
            out = json.loads(line[10:])
            out["times"] = {int(k): v for k, v in out["times"].items()}
            return out
    print(f"[MPI] skipped: mpirun across namespaces failed (rc={p.returncode}): "
          f"{(p.stdout + p.stderr).strip()[-800:]}")
    return None


def table(cols: dict, sizes: list) -> None:
    names = [n for n in cols if cols[n]]
    head = f"{'size':>7} | " + " | ".join(f"{n:>22}" for n in names)
    print(head)
    print("-" * len(head))
    for n in sizes:
        print(f"{fmt_size(n):>7} | " + " | ".join(f"{fmt_cell(n, cols[c]['times'].get(n)):>22}" for c in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--rate", default="1gbit", help="tc tbf rate per rail and direction for part 2")
    ap.add_argument("--skip-compare", action="store_true", help="only part 2 (tc-limited rails)")
    ap.add_argument("--rank-of", dest="role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rails", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pid", default="", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        rank_main(a)
        return
    sizes = LAT_SIZES + BW_SIZES
    t0 = time.time()
    try:
        setup()
    except (RuntimeError, OSError) as e:
        teardown()
        sys.exit(f"cannot create the two-namespace setup (needs root + iproute2): {e}")
    try:
        if not a.skip_compare:
            print(f"Part 1: All-Reduce float32 sum between two namespaces over veth, {os.cpu_count()} CPUs, "
                  f"median of {iters_for(4 * KB, a.quick)} .. {iters_for(64 * MB, a.quick)} iterations")
            cols = {"ours 1 rail": run_ranks("tf", sizes, a.quick, 29601, rails=1),
                    "ours 2 rails": run_ranks("tf", sizes, a.quick, 29602, rails=2),
                    "gloo": run_ranks("gloo", sizes, a.quick, 29603),
                    "MPI(tcp)": run_mpi(sizes, a.quick)}
            table(cols, sizes)
            if cols["ours 2 rails"]:
                print(f"2-rail run, bytes sent per rail (rank 0): {cols['ours 2 rails']['rail_bytes']}")
        print(f"\nPart 2: each rail limited to {a.rate} per direction (tc tbf on both veth ends), 16 MB All-Reduce")
        rate_limit(a.rate)
        n = 16 * MB
        one = run_ranks("tf", [n], a.quick, 29611, rails=1)
        two = run_ranks("tf", [n], a.quick, 29612, rails=2)
        if one and two:
            t1, t2 = one["times"][n], two["times"][n]
            print(f"{'rails':>5} | {'16 MB All-Reduce':>24}")
            print(f"{1:>5} | {fmt_cell(n, t1):>24}")
            print(f"{2:>5} | {fmt_cell(n, t2):>24}   bytes per rail {two['rail_bytes']}")
            print(f"2 rails / 1 rail bandwidth: {t1 / t2:.2f}x (target >= 1.8x)")
    finally:
        teardown()
    print(f"(total {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
