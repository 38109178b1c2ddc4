#!/usr/bin/env python3
"""Where TensorFold and llama.cpp disagree about the exact top-1 token, who is right, and is the
imbalance more than chance?

For every llama.cpp-quantized fixture file (tests/fixtures/quant/quant_oracle.json) and every
position: does TensorFold's argmax equal the float64 reference's (tests/reference_forward.py)?
does llama.cpp's? Positions where exactly one of them does are the discordant pairs: "ours-only"
and "llama-only". With the same 8-bit activation rule in both engines, a discordant position is a
near tie of the reference decided by rounding noise, so the two counts should be even; the
two-sided sign test on them says how surprising an imbalance is. The positions are close to
independent here (the discordant positions of the Q3_K_S/M/L files barely overlap), but every
format and sequence set tried is one more test: expect a p below 0.05 now and then.

Modes
  default             the fixture's own sequences; llama.cpp's top-1 as quant_oracle.json
                      recorded it (no llama.cpp needed)
  --windows N         N new windows of calibration.txt (avoiding the fixture's sequences) and
  --random N          N sequences of random token ids: new inputs, to see whether an imbalance
                      replicates. llama.cpp's logits come from llama-cpp-python 0.3.36 with the
                      fixture script's settings (n_ctx = n_batch = 64, 2 threads, no flash
                      attention, no repacked buffers); LLAMA_CPP_LIB_PATH may point at the
                      bin/ folder of a shared-library build of its vendored llama.cpp.

    TENSORFOLD_CORE_DIR=build PYTHONPATH=python python3 bench/top1_discordance.py --files deep-Q3_K
    LLAMA_CPP_LIB_PATH=/path/llama.cpp/build/bin PYTHONPATH=python:/path/llama_cpp_python \\
        python3 bench/top1_discordance.py --files deep-Q3_K --windows 40 --random 20

--isa caps TensorFold's instruction set (TENSORFOLD_ISA): the counts move with the float
summation order, which differs between ISAs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from math import comb
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
QUANT = REPO / "tests" / "fixtures" / "quant"
N_CTX = 64
LENS = (64, 60, 56, 52, 48)


def sign_test(a: int, b: int) -> float:
    """Two-sided exact sign test of a vs b successes (p = 0.5)."""
    n, k = a + b, min(a, b)
    return min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


def new_sequences(eng, n_vocab: int, fixture: list[list[int]], n_windows: int, n_random: int,
                  seed: int) -> list[list[int]]:
    ids = eng.tokenize((QUANT / "calibration.txt").read_text(encoding="utf-8"), add_special=False)
    taken = np.zeros(len(ids), dtype=bool)
    for s in fixture:  # the fixture's windows are runs of the tokenized text
        for i in range(len(ids) - len(s) + 1):
            if ids[i:i + len(s)] == s:
                taken[i:i + len(s)] = True
    out = []
    if n_windows:
        for s0 in np.linspace(0, len(ids) - N_CTX - 1, 3 * n_windows).astype(int):
            n = LENS[len(out) % len(LENS)]
            if not taken[s0:s0 + n].any() and len(out) < n_windows:
                out.append(list(ids[s0:s0 + n]))
    rng = np.random.default_rng(seed)
    for j in range(n_random):
        out.append(rng.integers(0, n_vocab, LENS[j % len(LENS)]).tolist())
    return out


def llama_cpp_logits(path: str, seqs: list[list[int]]) -> list[np.ndarray]:
    import llama_cpp
    from llama_cpp import Llama

    default = llama_cpp.llama_model_default_params

    def params():  # plain CPU buffers, as the fixture script loads them
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params
    import llama_cpp.llama as mod

    mod.llama_cpp.llama_model_default_params = params
    llm = Llama(model_path=path, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=2, n_threads_batch=2,
                logits_all=True, verbose=False, seed=0)
    out = []
    for s in seqs:
        llm.reset()
        llm.eval(s)
        out.append(np.array(llm.scores[:len(s)], dtype=np.float64))
    if hasattr(llm, "close"):
        llm.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default="", help="comma list of substrings of fixture file names (default: all)")
    ap.add_argument("--windows", type=int, default=0, help="new calibration-text windows (needs llama-cpp-python)")
    ap.add_argument("--random", type=int, default=0, help="random-token sequences (needs llama-cpp-python)")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--isa", help="cap TensorFold's ISA (scalar, avx2, avx512, ...)")
    a = ap.parse_args()
    if a.isa:
        os.environ["TENSORFOLD_ISA"] = a.isa
    sys.path.insert(0, str(REPO / "tests"))
    import reference_forward as rf
    import tensorfold

    oracle = json.loads((QUANT / "quant_oracle.json").read_text())
    pats = [p for p in a.files.split(",") if p]
    fresh = a.windows > 0 or a.random > 0
    total = [0, 0, 0]
    print(f"{'file':<24} {'positions':>9} {'ours':>6} {'llama':>6} {'ours-only':>9} {'llama-only':>10} {'p':>6}"
          + ("   KL ours / llama" if fresh else ""))
    for e in oracle["files"]:
        if pats and not any(p in e["file"] for p in pats):
            continue
        path = str(QUANT / e["file"])
        tie = oracle["models"][e["model"]]["router_tie"]
        ref = rf.ReferenceModel(path)
        with tensorfold.Engine(path, threads=2, context=N_CTX) as eng:
            seqs = (new_sequences(eng, ref.n_vocab, e["sequences"], a.windows, a.random, a.seed) if fresh
                    else e["sequences"])
            ours = [np.asarray(eng.logits(s), dtype=np.float64) for s in seqs]
        refs, skip = [], []
        for s in seqs:
            lg, routing = ref.forward(s, return_routing=True)
            refs.append(lg)
            skip.append(rf.router_near_ties(routing, len(s), tie))
        keep = ~np.concatenate(skip)
        r, o = np.concatenate(refs)[keep], np.concatenate(ours)[keep]
        if fresh:
            lg = np.concatenate(llama_cpp_logits(path, seqs))[keep]
            l1 = lg.argmax(-1)
        else:
            l1 = np.concatenate([np.array(t) for t in e["llama_cpp"]["top1"]])[keep]
        best = r.argmax(-1)
        ok_o, ok_l = o.argmax(-1) == best, l1 == best
        oo, lo = int(np.sum(ok_o & ~ok_l)), int(np.sum(ok_l & ~ok_o))
        total[0] += oo
        total[1] += lo
        total[2] += len(r)
        line = (f"{e['file']:<24} {len(r):>9} {ok_o.mean():>6.3f} {ok_l.mean():>6.3f} {oo:>9} {lo:>10} "
                f"{sign_test(oo, lo):>6.2g}")
        if fresh:
            line += f"   {rf.kld(r, o).mean():.4g} / {rf.kld(r, lg).mean():.4g}"
        print(line, flush=True)
    p = sign_test(total[0], total[1])
    print(f"{'total':<24} {total[2]:>9} {'':>6} {'':>6} {total[0]:>9} {total[1]:>10} {p:>6.2g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
