#!/usr/bin/env python3
"""A/B end-to-end speed of two (or more) TensorFold builds on the same GGUF files, in one run.

    python bench/e2e_ab.py --build old=/work/main/build-lead:/work/main/python \\
                           --build new=build:python  MODEL.gguf [MODEL2.gguf ...] [--reps 5]

Each --build is LABEL=CORE_DIR[:PYTHONPATH] (CORE_DIR holds the built _core module, as
TENSORFOLD_CORE_DIR takes it; PYTHONPATH the matching python/ tree, default ./python). For
every model the builds take turns, each measurement in a fresh process, so drift of the
machine (turbo, other load) spreads over both: prefill tok/s of a --n-prompt-token random
prompt and decode tok/s of --n-gen tokens after a 1-token prompt (greedy, EOS ignored), like
llama-bench's pp512 / tg128. Reports the median of --reps per build and each build's ratio to
the first one; with --json, also the raw samples.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# Runs in the child: measures one model once, prints one JSON line.
CHILD = r"""
import json, random, sys, time
import tensorfold
model, threads, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
eng = tensorfold.Engine(model, threads=threads, context=max(1024, n_prompt + n_gen + 16), prefix_cache=False)
vocab = eng.config["n_vocab"]
rng = random.Random(1)
eng.generate([rng.randrange(vocab) for _ in range(32)], max_tokens=4, temperature=0, ignore_eos=True)  # warm-up
ids = [rng.randrange(vocab) for _ in range(n_prompt)]
t0 = time.perf_counter()
eng.generate(ids, max_tokens=1, temperature=0, ignore_eos=True)
prefill = n_prompt / (time.perf_counter() - t0)
t0 = time.perf_counter()
eng.generate([rng.randrange(vocab)], max_tokens=1, temperature=0, ignore_eos=True)
first = time.perf_counter() - t0
t0 = time.perf_counter()
out = eng.generate([rng.randrange(vocab)], max_tokens=n_gen + 1, temperature=0, ignore_eos=True)
decode = n_gen / (time.perf_counter() - t0 - first)
print(json.dumps({"prefill": prefill, "decode": decode}))
"""


def parse_build(spec: str) -> tuple[str, str, str]:
    label, _, rest = spec.partition("=")
    if not label or not rest:
        raise SystemExit(f"--build {spec!r}: expected LABEL=CORE_DIR[:PYTHONPATH]")
    core, _, py = rest.partition(":")
    return label, os.path.abspath(core), os.path.abspath(py or "python")


def measure(build: tuple[str, str, str], model: str, a: argparse.Namespace) -> dict:
    _, core, py = build
    env = dict(os.environ, TENSORFOLD_CORE_DIR=core, PYTHONPATH=py)
    r = subprocess.run([sys.executable, "-c", CHILD, model, str(a.threads), str(a.n_prompt), str(a.n_gen)],
                       env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{build[0]} on {model} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--build", action="append", required=True, metavar="LABEL=CORE_DIR[:PYTHONPATH]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    builds = [parse_build(b) for b in a.build]
    results = {}
    for model in a.models:
        samples = {b[0]: {"prefill": [], "decode": []} for b in builds}
        for rep in range(a.reps):
            order = builds if rep % 2 == 0 else builds[::-1]
            for b in order:
                m = measure(b, model, a)
                for key in ("prefill", "decode"):
                    samples[b[0]][key].append(m[key])
        results[model] = samples
        name = os.path.basename(model)
        base = builds[0][0]
        for key in ("prefill", "decode"):
            ref = statistics.median(samples[base][key])
            cells = []
            for b in builds:
                med = statistics.median(samples[b[0]][key])
                cells.append(f"{b[0]} {med:8.2f}" + ("" if b[0] == base else f" ({med / ref:.3f}x)"))
            print(f"{name:32s} {key:8s} tok/s: " + "   ".join(cells), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
