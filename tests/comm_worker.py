"""One rank of a two-process tensorfold.comm test (run by tests/test_comm.py).

usage: comm_worker.py MODE RANK PORT [key=value ...]
Prints progress lines, then one final line "RESULT <json>".
"""
from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

import tensorfold.comm as comm

RAILS = ["127.0.0.1", "127.0.0.2"]
MIB = 1 << 20


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def make_input(rank: int, n: int, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 7919 + rank)
    x = rng.standard_normal(n, dtype=np.float32)
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(np.float16)
    return f32_to_bf16_bits(x)


def expected_sum(a0: np.ndarray, a1: np.ndarray, dtype: str) -> np.ndarray:
    """Rank-order sum (rank 0 + rank 1), computed the way the group defines it."""
    if dtype == "f32":
        return a0 + a1
    if dtype == "f16":
        return (a0.astype(np.float32) + a1.astype(np.float32)).astype(np.float16)
    return f32_to_bf16_bits(bf16_bits_to_f32(a0) + bf16_bits_to_f32(a1))


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()[:16]


def connect(rank: int, port: int, rails=RAILS, timeout: float = 10.0, handshake: str = "test",
            token: str = ""):
    return comm.Group(rank, 2, f"127.0.0.1:{port}", rails=rails, timeout=timeout,
                      handshake=handshake, token=token)


def check_all_reduce(g, rank: int, n: int, dtype: str, seed: int) -> str:
    mine = make_input(rank, n, dtype, seed)
    a0 = make_input(0, n, dtype, seed)
    a1 = make_input(1, n, dtype, seed)
    want = expected_sum(a0, a1, dtype)
    buf = mine.copy()
    g.all_reduce(buf, dtype="bf16" if dtype == "bf16" else "")
    if not np.array_equal(buf.view(np.uint8), want.view(np.uint8)):
        bad = int(np.flatnonzero(buf.view(np.uint16 if buf.itemsize == 2 else np.uint32)
                                 != want.view(np.uint16 if want.itemsize == 2 else np.uint32))[0])
        raise AssertionError(f"all_reduce mismatch n={n} dtype={dtype} at {bad}: "
                             f"got {buf[bad]!r} want {want[bad]!r}")
    return digest(buf)


def mode_suite(rank: int, port: int, args: dict) -> dict:
    rails = [] if args.get("rails") == "none" else RAILS
    g = connect(rank, port, rails=rails)
    out: dict = {"digests": {}}
    assert g.rank == rank and g.size == 2
    if args.get("quick"):
        cases = [(n, "f32") for n in (1, 65537, 4 * MIB // 4)]
    else:
        cases = [(n, "f32") for n in (1, 2, 3, 17, 1000, 65537, MIB // 4, 16 * MIB // 4,
                                      64 * MIB // 4)]
        cases += [(n, dt) for dt in ("f16", "bf16") for n in (3, 1000, 65537, MIB)]
        cases += [(0, "f32")]
    for i, (n, dt) in enumerate(cases):
        out["digests"][f"{dt}:{n}"] = check_all_reduce(g, rank, n, dt, seed=i)
    # broadcast from each root, small and large, arbitrary dtype
    for root in (0, 1):
        for n in (5, 300_000):
            src = np.arange(n, dtype=np.int64) * (root + 3)
            buf = src.copy() if rank == root else np.zeros(n, dtype=np.int64)
            g.broadcast(buf, root)
            assert np.array_equal(buf, src), f"broadcast root={root} n={n}"
    for _ in range(3):
        g.barrier()
    # interleave small and large after everything else (pipelining across collectives)
    for i in range(20):
        check_all_reduce(g, rank, 7 if i % 2 else 200_000, "f32", seed=100 + i)
    st = g.stats()
    out["stats"] = {k: v for k, v in st.items() if k != "rails"}
    out["rails_up"] = [r["up"] for r in st["rails"]]
    out["rail_bytes"] = [r["bytes_sent"] for r in st["rails"]]
    g.close()
    return out


def mode_handshake(rank: int, port: int, args: dict) -> dict:
    t = time.monotonic()
    try:
        g = connect(rank, port, handshake=args.get("handshake", "test"), token=args.get("token", ""),
                    timeout=float(args.get("timeout", 10.0)))
    except (ValueError, RuntimeError) as e:
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t}
    # admitted: prove the link works
    x = np.full(5, rank + 1, dtype=np.float32)
    g.all_reduce(x)
    g.close()
    return {"error": None, "sum": float(x[0])}


def mode_loop(rank: int, port: int, args: dict) -> dict:
    """Run large all-reduces until the peer disappears; report how long the failure took."""
    timeout = float(args.get("timeout", 3.0))
    g = connect(rank, port, timeout=timeout)
    buf = np.ones(int(args.get("n", 4 * MIB)), dtype=np.float32)
    print("READY", flush=True)
    count = 0
    t = time.monotonic()
    try:
        while True:
            t = time.monotonic()
            g.all_reduce(buf)
            buf[:] = 1
            count += 1
            if count == 3:
                print("LOOPING", flush=True)
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.monotonic() - t, "count": count}


def mode_railfail(rank: int, port: int, args: dict) -> dict:
    g = connect(rank, port)
    out = {"digests": []}
    # warm up so both rails have measured throughput, then lose rail 1 mid-transfer
    out["digests"].append(check_all_reduce(g, rank, 4 * MIB // 4, "f32", seed=1))
    if rank == int(args.get("killer", 0)):
        g._debug_fail_rail(int(args.get("rail", 1)), after_bytes=int(args.get("after", 2 * MIB)))
    out["digests"].append(check_all_reduce(g, rank, int(args.get("n", 16 * MIB // 4)), "f32",
                                           seed=2))
    # the group keeps working on the remaining rail, small and large
    out["digests"].append(check_all_reduce(g, rank, 1000, "f32", seed=3))
    out["digests"].append(check_all_reduce(g, rank, 3 * MIB // 4, "f32", seed=4))
    g.barrier()
    st = g.stats()
    out["rail_failures"] = st["rail_failures"]
    out["rails_up"] = [r["up"] for r in st["rails"]]
    out["down_reason"] = [r["down_reason"] for r in st["rails"]]
    g.close()
    return out


def mode_close(rank: int, port: int, args: dict) -> dict:
    """Rank 1 closes after one collective; rank 0's next collective must fail promptly."""
    g = connect(rank, port)
    check_all_reduce(g, rank, 1000, "f32", seed=5)
    if rank == 1:
        g.close()
        return {"error": None}
    t = time.monotonic()
    try:
        check_all_reduce(g, rank, 1000, "f32", seed=6)
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.monotonic() - t}
    return {"error": None}


def main() -> None:
    mode, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    args = dict(a.split("=", 1) for a in sys.argv[4:])
    res = {"mode_suite": mode_suite, "mode_handshake": mode_handshake, "mode_loop": mode_loop,
           "mode_railfail": mode_railfail, "mode_close": mode_close}["mode_" + mode](rank, port, args)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
