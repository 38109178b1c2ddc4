#!/usr/bin/env python3
"""Decode speed under sampling settings, against greedy, in one run:

    python bench/e2e_sampling.py [--model PATH] [--threads 2] [--n-gen 128] [--reps 3]

greedy; temperature 1 with no filter (the OpenAI API's default: a draw from the whole
vocabulary); temperature 0.8 with top-p 0.95 (a nucleus over most of the vocabulary); the Python
API's defaults (top-k 40, top-p 0.95, min-p 0.05); the best of --reps for each, and each as a
fraction of greedy. The sampler is O(vocabulary) (csrc/engine/sampler.cpp): the issue-31 bar is
full-vocabulary sampling >= 0.9x greedy."""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import tensorfold
    eng = tensorfold.Engine(a.model or tensorfold.pull(), threads=a.threads, context=a.n_gen + 64)
    cfgs = [("greedy", dict(temperature=0)),
            ("temperature 1, whole vocabulary", dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)),
            ("temperature 0.8, top-p 0.95", dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0)),
            ("Python API defaults", dict())]
    best: dict[str, float] = {}
    for _ in range(a.reps):
        for name, kw in cfgs:
            t = time.perf_counter()
            r = eng.generate("Once upon a time", max_tokens=a.n_gen, ignore_eos=True, seed=1, **kw)
            best[name] = max(best.get(name, 0.0), len(r.token_ids) / (time.perf_counter() - t))
    for name, v in best.items():
        print(f"{name:34s} {v:7.1f} tok/s  {v / best['greedy']:.2f}x greedy")


if __name__ == "__main__":
    main()
