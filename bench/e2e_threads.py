#!/usr/bin/env python3
"""Decode and prefill speed as the thread count grows past the usable CPUs (oversubscription),
optionally with other work competing for the CPUs — the case a shared machine or a container
with a CPU quota below its CPU count puts the thread pool in.

    python bench/e2e_threads.py [--model PATH] [--threads 2,4,8,64] [--busy N] [--n-gen 64]

For each thread count, in this one run: decode tok/s (greedy, --n-gen tokens after a short
prompt, best of --reps) and prefill tok/s (--n-prompt random tokens), and both as a ratio to
threads = usable CPUs. --busy N starts N busy-looping processes for the whole run (other work
on the machine). Each thread count runs in a fresh process with a --timeout, so a collapse
shows as "timeout" instead of a stuck benchmark.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time


def _spin() -> None:
    while True:
        pass


def measure(model: str, threads: int, n_prompt: int, n_gen: int, reps: int) -> dict:
    import random

    import tensorfold

    eng = tensorfold.Engine(model, threads=threads, context=max(1024, n_prompt + n_gen + 16))
    core = eng._core
    rng = random.Random(0)
    vocab = eng.config["n_vocab"]

    def decode() -> float:
        core.add_request([rng.randrange(vocab) for _ in range(4)], n_gen + 1, 0.0, 1, 1.0, 0.0, 0, [], True)
        core.step()
        t0, n = time.perf_counter(), 0
        while core.has_unfinished():
            n += len(core.step())
        return n / (time.perf_counter() - t0)

    def prefill() -> float:
        core.add_request([rng.randrange(vocab) for _ in range(n_prompt)], 1, 0.0, 1, 1.0, 0.0, 0, [], True)
        t0 = time.perf_counter()
        while core.has_unfinished():
            core.step()
        return n_prompt / (time.perf_counter() - t0)

    decode()  # warm-up
    return {"decode": max(decode() for _ in range(reps)), "prefill": max(prefill() for _ in range(reps))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: the pulled SmolLM2-135M Q4_1)")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default: u, 2u, 4u, 64)")
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes competing for the CPUs")
    ap.add_argument("--n-gen", type=int, default=64, help="decoded tokens per measurement")
    ap.add_argument("--n-prompt", type=int, default=256, help="prefill tokens per measurement")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (best is reported)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per thread count")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        model, threads = a.child.rsplit(":", 1)
        print(json.dumps(measure(model, int(threads), a.n_prompt, a.n_gen, a.reps)))
        return 0

    import tensorfold

    model = a.model or tensorfold.pull("smollm2-135m-instruct")
    usable = getattr(tensorfold._core, "usable_cpus", lambda: len(os.sched_getaffinity(0)))()
    counts = [int(x) for x in a.threads.split(",")] if a.threads else [usable, 2 * usable, 4 * usable, 64]
    print(f"model {os.path.basename(model)}; usable CPUs {usable} (os.cpu_count {os.cpu_count()}); "
          f"ISA {tensorfold._core.cpu_isa()}; busy processes {a.busy}")
    hogs = [mp.Process(target=_spin, daemon=True) for _ in range(a.busy)]
    for h in hogs:
        h.start()
    results: dict[int, dict | None] = {}
    try:
        for t in counts:
            cmd = [sys.executable, __file__, "--child", f"{model}:{t}", "--n-gen", str(a.n_gen),
                   "--n-prompt", str(a.n_prompt), "--reps", str(a.reps)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, check=True)
                results[t] = json.loads(out.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                results[t] = None
            except subprocess.CalledProcessError as e:
                print(e.stderr, file=sys.stderr)
                results[t] = None
    finally:
        for h in hogs:
            h.terminate()
    base = results.get(usable) or results.get(counts[0])
    print(f"{'threads':>8} {'decode tok/s':>13} {'ratio':>6} {'prefill tok/s':>14} {'ratio':>6}")
    for t in counts:
        r = results[t]
        if r is None:
            print(f"{t:>8} {'timeout':>13}")
            continue
        rd = r["decode"] / base["decode"] if base else float("nan")
        rp = r["prefill"] / base["prefill"] if base else float("nan")
        print(f"{t:>8} {r['decode']:>13.1f} {rd:>6.2f} {r['prefill']:>14.1f} {rp:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
