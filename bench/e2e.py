#!/usr/bin/env python3
"""End-to-end speed of TensorFold on a GGUF, optionally side by side with llama.cpp.

    python bench/e2e.py [--model PATH] [--threads 2] [--llama-bench /path/to/llama-bench]
                        [--ik-bench /path/to/ik_llama.cpp/llama-bench] [--bandwidth] [--no-tensorfold]

Reports, for the same file and thread count:
  prefill tok/s  (a 512-token prompt, like `llama-bench -p 512`)
  decode tok/s   (128 tokens after a 1-token prompt, like `llama-bench -n 128`)
  start-up to first token (a fresh process: import, load, first token)
and the ratios TensorFold / llama.cpp when --llama-bench is given.

--ik-bench adds ik_llama.cpp (github.com/ikawrakow/ik_llama.cpp, the CPU-first fork) as a third
engine: its llama-bench with the same -p / -n / -r / -t, once with -rtr 0 and once with -rtr 1
(run-time repacking, its best CPU setting), and the ratio TensorFold / ik_llama.cpp -rtr 1.

--bandwidth adds decode effective bandwidth: the bytes of weights one decoded token must read
(every non-expert weight, the LM head, one row of token_embd, and of each MoE layer's expert
tensors the fraction n_used / n_expert) times decode tok/s, for each engine, and that as a
fraction of the machine's DRAM read bandwidth measured in the same run
(tensorfold._core.kernels_read_bytes streaming a >= 2 GiB buffer, best of 3).
--no-tensorfold measures only the llama.cpp peers (and the bandwidth), e.g. for a model
TensorFold cannot load yet.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import IK_BEST, IK_RTR, ik_args, measure_llama_bench  # noqa: E402, F401 (measure_llama_bench: re-exported)


def measure_tensorfold(model: str, threads: int, n_prompt: int, n_gen: int, reps: int, backend: str = "cpu") -> dict:
    import random

    import tensorfold

    eng = tensorfold.Engine(model, threads=threads, context=max(1024, n_prompt + 16), backend=backend)
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
            "tg": statistics.mean(tg), "tg_sd": statistics.pstdev(tg),
            "kv_bytes_per_token": eng.stats().get("kv_bytes_per_token")}


def measure_startup(model: str, threads: int) -> float:
    code = ("import time; t0=time.perf_counter(); import tensorfold; "
            f"e=tensorfold.Engine({model!r}, threads={threads}); "
            "e.generate('Hello', max_tokens=1, temperature=0); print(time.perf_counter()-t0)")
    best = float("inf")
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        best = min(best, float(out.stdout.strip().splitlines()[-1]))
    return best


def decode_bytes_per_token(model: str) -> dict:
    """Bytes of weights one decode step reads, from the GGUF's tensor table and metadata.

    Expert tensors (3-D, *_exps) are stacked [.., .., n_expert]: a token reads n_used of the
    n_expert slices. token_embd is a lookup (one row) unless it doubles as the LM head (no
    output.weight). Everything else (attention, norms, router, shared experts, dense FFNs,
    LM head) is read in full.
    """
    from tensorfold import _core

    f = _core.GgufFile(model)
    arch = f.get_string("general.architecture", "")
    n_expert = f.get_int(f"{arch}.expert_count", 0) or 0
    n_used = f.get_int(f"{arch}.expert_used_count", 0) or 0
    tensors = f.tensors()
    names = {t["name"] for t in tensors}
    tied = "output.weight" not in names
    dense = experts = experts_all = 0
    for t in tensors:
        name, nb, shape = t["name"], t["nbytes"], t["shape"]
        if name == "token_embd.weight":
            dense += nb if tied else nb // shape[-1]
        elif "_exps" in name and len(shape) == 3 and n_expert > 0:
            if shape[-1] != n_expert:
                raise ValueError(f"{name}: last dimension {shape[-1]} != expert_count {n_expert}")
            experts_all += nb
            experts += nb // n_expert * n_used
        else:
            dense += nb
    return {"total": dense + experts, "dense": dense, "experts": experts, "experts_all": experts_all,
            "n_expert": n_expert, "n_used": n_used, "file": f.file_size}


def measure_dram_read(threads: int, gib: float = 2.0, reps: int = 3) -> float:
    """Best-of-`reps` read bandwidth (bytes/s) streaming a `gib` GiB buffer on `threads` threads."""
    import numpy as np

    from tensorfold import _core

    # distinct content on every page (nothing for page deduplication to merge), written once so
    # the pages are resident before timing
    buf = np.arange(int(gib * 2**30) // 8, dtype=np.uint64).view(np.uint8)
    _core.kernels_read_bytes(buf, threads)  # warm-up
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        _core.kernels_read_bytes(buf, threads)
        best = max(best, buf.nbytes / (time.perf_counter() - t0))
    del buf
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: the pulled SmolLM2 model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-bench", default=None, help="path of a llama-bench binary to compare against")
    ap.add_argument("--ik-bench", default=None,
                    help="path of ik_llama.cpp's llama-bench: adds its -rtr 0 and -rtr 1 columns")
    ap.add_argument("--no-startup", action="store_true", help="skip the start-up measurement")
    ap.add_argument("--bandwidth", action="store_true",
                    help="report decode effective bandwidth vs measured DRAM read bandwidth")
    ap.add_argument("--bandwidth-gib", type=float, default=2.0, help="size of the DRAM probe buffer")
    ap.add_argument("--no-tensorfold", action="store_true", help="measure the llama.cpp peers only")
    a = ap.parse_args()
    if a.no_tensorfold and not a.llama_bench and not a.ik_bench and not a.bandwidth:
        ap.error("--no-tensorfold leaves nothing to measure without --llama-bench, --ik-bench or --bandwidth")

    import tensorfold

    model = a.model or tensorfold.pull()
    print(f"model: {model}\nthreads: {a.threads}, prompt {a.n_prompt}, generate {a.n_gen}, {a.reps} reps")
    if a.bandwidth:
        acct = decode_bytes_per_token(model)
        dram = measure_dram_read(a.threads, a.bandwidth_gib)
    tf = None
    if not a.no_tensorfold:
        try:
            tf = measure_tensorfold(model, a.threads, a.n_prompt, a.n_gen, a.reps)
        except Exception as e:  # noqa: BLE001 - report any load/run failure plainly
            print(f"\nerror: TensorFold cannot run {model}: {type(e).__name__}: {e}\n"
                  "(use --no-tensorfold to measure llama.cpp only)", file=sys.stderr)
            return 2
    lc = measure_llama_bench(a.llama_bench, model, a.threads, a.n_prompt, a.n_gen, a.reps) if a.llama_bench else None
    ik = {rtr: measure_llama_bench(a.ik_bench, model, a.threads, a.n_prompt, a.n_gen, a.reps, ik_args(rtr))
          for rtr in IK_RTR} if a.ik_bench else {}

    def cell(r, key):
        return f"{r[key]:.1f} ± {r[key + '_sd']:.1f}" if r else "-"

    def ratio(x, y, key):
        return f"{x[key] / y[key]:>9.2f}x" if x and y else f"{'-':>10}"

    ik_hdr = "".join(f"{f'ik -rtr {rtr} tok/s':>20}" for rtr in IK_RTR) + f"{f'TF/ik{IK_BEST}':>10}" if ik else ""
    print(f"\n{'test':<12}{'TensorFold tok/s':>20}{'llama.cpp tok/s':>20}{'ratio':>10}{ik_hdr}")
    for key, name in (("pp", f"pp{a.n_prompt}"), ("tg", f"tg{a.n_gen}")):
        ik_cells = "".join(f"{cell(ik[rtr], key):>20}" for rtr in IK_RTR) + ratio(tf, ik[IK_BEST], key) if ik else ""
        print(f"{name:<12}{cell(tf, key):>20}{cell(lc, key):>20}{ratio(tf, lc, key)}{ik_cells}")
    if ik:
        print(f"ratio = TensorFold / llama.cpp; TF/ik{IK_BEST} = TensorFold / ik_llama.cpp -rtr {IK_BEST}")
    if lc:
        print(f"llama.cpp build: {lc['build']}")
    if ik:
        print(f"ik_llama.cpp build: {ik[IK_BEST]['build']}")
    if a.bandwidth:
        moe = (f", experts {acct['experts'] / 1e6:.1f} MB = {acct['n_used']}/{acct['n_expert']} "
               f"of {acct['experts_all'] / 1e6:.1f} MB" if acct["n_expert"] else "")
        print(f"\ndecode weight bytes per token: {acct['total'] / 1e6:.1f} MB "
              f"(non-expert incl. LM head {acct['dense'] / 1e6:.1f} MB{moe}; file {acct['file'] / 1e6:.1f} MB)")
        print(f"DRAM read bandwidth: {dram / 1e9:.2f} GB/s "
              f"(kernels_read_bytes, {a.bandwidth_gib:g} GiB buffer, {a.threads} threads, best of 3)")
        print(f"{'decode':<12}{'tok/s':>10}{'effective GB/s':>18}{'of DRAM':>10}")
        for label, r in (("TensorFold", tf), ("llama.cpp", lc), *((f"ik -rtr {k}", v) for k, v in ik.items())):
            if r:
                eff = acct["total"] * r["tg"]
                print(f"{label:<12}{r['tg']:>10.1f}{eff / 1e9:>18.2f}{eff / dram:>9.0%}")
        print(f"{'bound':<12}{dram / acct['total']:>10.1f}{dram / 1e9:>18.2f}{1:>9.0%}"
              "   (decode tok/s if every weight byte came from DRAM at that rate)")
    if tf and not a.no_startup:
        print(f"start-up to first token (fresh process, best of 3): {measure_startup(model, a.threads):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
