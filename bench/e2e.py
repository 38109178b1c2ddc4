#!/usr/bin/env python3
"""End-to-end speed of TensorFold on a GGUF, optionally side by side with llama.cpp.

    python bench/e2e.py [--model PATH] [--threads 2] [--llama-bench /path/to/llama-bench]

Reports, for the same file and thread count:
  prefill tok/s  (a 512-token prompt, like `llama-bench -p 512`)
  decode tok/s   (128 tokens after a 1-token prompt, like `llama-bench -n 128`)
  start-up to first token (a fresh process: import, load, first token)
and the ratios TensorFold / llama.cpp when --llama-bench is given.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure_tensorfold(model: str, threads: int, n_prompt: int, n_gen: int, reps: int) -> dict:
    import random

    import tensorfold

    eng = tensorfold.Engine(model, threads=threads, context=max(1024, n_prompt + 16))
    vocab = eng.config["n_vocab"]
    rng = random.Random(0)
    core = eng._core

    def run_prefill() -> float:
        ids = [rng.randrange(vocab) for _ in range(n_prompt)]
        t0 = time.perf_counter()
        rid = core.add_request(ids, 1, 0.0, 1, 1.0, 0.0, 0, [], True)
        while core.has_unfinished():
            core.step()
        return n_prompt / (time.perf_counter() - t0)

    def run_decode() -> float:
        ids = [rng.randrange(vocab)]
        core.add_request(ids, n_gen + 1, 0.0, 1, 1.0, 0.0, 0, [], True)
        core.step()  # the 1-token prompt: produces the first token
        t0 = time.perf_counter()
        n = 0
        while core.has_unfinished():
            n += len(core.step())
        return n / (time.perf_counter() - t0)

    run_prefill(), run_decode()  # warm-up
    pp = [run_prefill() for _ in range(reps)]
    tg = [run_decode() for _ in range(reps)]
    return {"pp": statistics.mean(pp), "pp_sd": statistics.pstdev(pp),
            "tg": statistics.mean(tg), "tg_sd": statistics.pstdev(tg)}


def measure_startup(model: str, threads: int) -> float:
    code = ("import time; t0=time.perf_counter(); import tensorfold; "
            f"e=tensorfold.Engine({model!r}, threads={threads}); "
            "e.generate('Hello', max_tokens=1, temperature=0); print(time.perf_counter()-t0)")
    best = float("inf")
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        best = min(best, float(out.stdout.strip().splitlines()[-1]))
    return best


def measure_llama_bench(binary: str, model: str, threads: int, n_prompt: int, n_gen: int, reps: int) -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.dirname(os.path.abspath(binary)) + ":" + env.get("LD_LIBRARY_PATH", "")
    cmd = [binary, "-m", model, "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
           "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
    res = {}
    for row in json.loads(out.stdout):
        key = "pp" if row["n_prompt"] > 0 else "tg"
        res[key] = row["avg_ts"]
        res[key + "_sd"] = row["stddev_ts"]
        res["build"] = f"{row.get('build_commit', '?')} ({row.get('build_number', '?')})"
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: the pulled SmolLM2 model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-bench", default=None, help="path of a llama-bench binary to compare against")
    ap.add_argument("--no-startup", action="store_true", help="skip the start-up measurement")
    a = ap.parse_args()

    import tensorfold

    model = a.model or tensorfold.pull()
    print(f"model: {model}\nthreads: {a.threads}, prompt {a.n_prompt}, generate {a.n_gen}, {a.reps} reps")
    tf = measure_tensorfold(model, a.threads, a.n_prompt, a.n_gen, a.reps)
    lc = measure_llama_bench(a.llama_bench, model, a.threads, a.n_prompt, a.n_gen, a.reps) if a.llama_bench else None
    print(f"\n{'test':<12}{'TensorFold tok/s':>20}{'llama.cpp tok/s':>20}{'ratio':>10}")
    for key, name in (("pp", f"pp{a.n_prompt}"), ("tg", f"tg{a.n_gen}")):
        ours = f"{tf[key]:.1f} ± {tf[key + '_sd']:.1f}"
        if lc:
            theirs = f"{lc[key]:.1f} ± {lc[key + '_sd']:.1f}"
            print(f"{name:<12}{ours:>20}{theirs:>20}{tf[key] / lc[key]:>9.2f}x")
        else:
            print(f"{name:<12}{ours:>20}{'-':>20}{'-':>10}")
    if lc:
        print(f"llama.cpp build: {lc['build']}")
    if not a.no_startup:
        print(f"start-up to first token (fresh process, best of 3): {measure_startup(model, a.threads):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
