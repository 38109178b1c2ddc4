#!/usr/bin/env python3
"""TP=2 end to end on one machine (both ranks over loopback or given rail addresses).

    python bench/e2e_tp.py [--model PATH] [--threads-per-rank 1] [--rails 127.0.0.1,127.0.0.2]

Reports decode tok/s at TP=1 (2 x threads-per-rank threads) and TP=2, the share of TP=2
decode time spent inside All-Reduce/broadcast (from the group's own timers), and each
process's resident memory (VmRSS) after decoding, as a fraction of the TP=1 process's.
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

CHILD = r"""
import sys, time, json, tensorfold
model, tp, rank, peer, threads, n_gen, rails = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
rails = [r for r in rails.split(",") if r]
import os
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
def mapped_rss(path):
    # Bytes of the model's tensor-data section mapped and present in this process (weights
    # it has touched through any mapping of the file), from /proc/self/pagemap.
    import struct
    data_offset = tensorfold._core.GgufFile(path).data_offset
    real = os.path.realpath(path)
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    with open("/proc/self/pagemap", "rb") as pm:
        for line in open("/proc/self/maps"):
            parts = line.split()
            if len(parts) < 6 or parts[-1] != real:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            file_off = int(parts[2], 16)
            first = lo + max(0, data_offset - file_off)
            first -= first % page
            for addr in range(first, hi, page):
                pm.seek(addr // page * 8)
                if struct.unpack("<Q", pm.read(8))[0] >> 63:
                    total += page
    return total
if tp == 2 and rank == 1:
    e = tensorfold.Engine(model, threads=threads, context=1024, tp=2, rank=1, peer=peer, rails=rails)
    e.follow()
    print(json.dumps({"rss": rss(), "weights": e._core.weight_bytes, "mapped": mapped_rss(model)}), flush=True)
    sys.exit(0)
kw = dict(tp=2, rank=0, peer=peer, rails=rails) if tp == 2 else {}
e = tensorfold.Engine(model, threads=threads, context=1024, **kw)
core = e._core
core.add_request([1], n_gen + 1, 0.0, 1, 1.0, 0.0, 0, [], True)
core.step()
c0 = e.stats().get("comm", {}).get("seconds_in_collectives", 0.0)
t0 = time.perf_counter(); n = 0
while core.has_unfinished():
    n += len(core.step())
dt = time.perf_counter() - t0
c1 = e.stats().get("comm", {}).get("seconds_in_collectives", 0.0)
out = {"tok_s": n / dt, "comm_share": (c1 - c0) / dt, "rss": rss(), "weights": core.weight_bytes,
       "mapped": mapped_rss(model)}
e.close()
print(json.dumps(out), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, model, tp, rank, peer, threads, n_gen, rails):
    return subprocess.Popen([sys.executable, "-c", CHILD, model, str(tp), str(rank), peer, str(threads),
                             str(n_gen), rails], stdout=subprocess.PIPE, text=True)


def main() -> int:
    import json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--rails", default="", help="comma-separated local addresses (same machine: both ranks use them)")
    a = ap.parse_args()
    import tensorfold

    model = a.model or tensorfold.pull()
    solo = run(a, model, 1, 0, "", 2 * a.threads_per_rank, a.n_gen, "")
    r1 = json.loads(solo.communicate()[0].strip().splitlines()[-1])
    port = free_port()
    peer = f"127.0.0.1:{port}"
    worker = run(a, model, 2, 1, peer, a.threads_per_rank, a.n_gen, a.rails)
    time.sleep(0.5)
    leader = run(a, model, 2, 0, peer, a.threads_per_rank, a.n_gen, a.rails)
    r0 = json.loads(leader.communicate()[0].strip().splitlines()[-1])
    rw = json.loads(worker.communicate()[0].strip().splitlines()[-1])
    print(f"model: {model}")
    print(f"TP=1 ({2 * a.threads_per_rank} threads): {r1['tok_s']:.1f} tok/s, RSS {r1['rss'] / 2**20:.0f} MiB, "
          f"weights {r1['weights'] / 2**20:.0f} MiB")
    print(f"TP=2 ({a.threads_per_rank} thread(s) per rank, loopback): {r0['tok_s']:.1f} tok/s "
          f"({r0['tok_s'] / r1['tok_s']:.2f}x TP=1); {100 * r0['comm_share']:.1f}% of decode time in collectives")
    # Resident weight memory: the mapping's resident pages plus private column slices
    # (TP=1 has no private slices: its weights are all in the mapping).
    base = r1["mapped"]
    print(f"  TP=1 resident weights (mapped tensor data): {base / 2**20:.1f} MiB")
    for name, r in (("rank 0", r0), ("rank 1", rw)):
        print(f"  {name}: process RSS {r['rss'] / 2**20:.0f} MiB ({r['rss'] / r1['rss']:.2f}x TP=1 incl. Python), "
              f"resident weights = mapped {r['mapped'] / 2**20:.1f} MiB + private {r['weights'] / 2**20:.1f} MiB "
              f"= {(r['mapped'] + r['weights']) / base:.2f}x TP=1's resident, "
              f"{(r['mapped'] + r['weights']) / r1['weights']:.2f}x all of TP=1's weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
