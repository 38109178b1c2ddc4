#!/usr/bin/env python3
"""TensorFold vs llama-bench, decode and prefill, on several GGUF files in one run — with each
engine's effective decode bandwidth as a share of the DRAM read bandwidth measured in the same run.

    LB=/tmp/dl/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench
    python bench/e2e_formats.py --llama-bench $LB /tmp/synth-moe-{Q2_K,Q4_K_M,IQ2_XXS,IQ3_XXS,IQ4_XS}.gguf

(the files come from bench/make_quantized_moe.py: a synthetic qwen3moe larger than the L3,
quantized by llama.cpp's llama-quantize). For each file, in order: TensorFold prefill of
--n-prompt random tokens and decode of --n-gen tokens (bench/e2e.py's measure_tensorfold, after
a warm-up, mean of --reps), then `llama-bench -p N -n M -r R -t T` on the same file. The DRAM
read bandwidth (bench/e2e.py's measure_dram_read) is measured before the first file and after the
last; the larger is the denominator, and both are printed so drift is visible. Decode bytes per
token are bench/e2e.py's decode_bytes_per_token (non-expert weights in full, n_used/n_expert of
each expert tensor, one row of token_embd).

A file TensorFold cannot load is reported (with the reason) and measured on llama.cpp only;
--no-tensorfold measures llama.cpp only. --json PATH also writes the numbers as JSON.
Run it on a quiet machine (check `uptime`), one benchmark at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import decode_bytes_per_token, measure_dram_read, measure_llama_bench, measure_tensorfold  # noqa: E402


def label_of(path: str) -> str:
    """The llama.cpp file type from general.file_type, else the file name."""
    from tensorfold import _core

    names = {1: "F16", 7: "Q8_0", 10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S",
             15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
             22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
             29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE"}
    try:
        ft = _core.GgufFile(path).get_int("general.file_type", -1)
    except Exception:  # noqa: BLE001 - a label is not worth failing for
        ft = -1
    return names.get(ft, Path(path).stem)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="GGUF files")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="llama-bench binary (env LLAMA_BENCH)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bandwidth-gib", type=float, default=2.0, help="size of the DRAM probe buffer")
    ap.add_argument("--no-tensorfold", action="store_true", help="measure llama.cpp only")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = ap.parse_args()
    if not a.llama_bench and a.no_tensorfold:
        ap.error("nothing to measure: give --llama-bench or drop --no-tensorfold")
    for m in a.models:
        if not os.path.isfile(m):
            ap.error(f"{m} not found")

    print(f"threads {a.threads}, prefill {a.n_prompt} tokens, decode {a.n_gen} tokens, {a.reps} reps; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    dram0 = measure_dram_read(a.threads, a.bandwidth_gib)
    print(f"DRAM read bandwidth (before): {dram0 / 1e9:.2f} GB/s", flush=True)
    rows = []
    for m in a.models:
        label = label_of(m)
        acct = decode_bytes_per_token(m)
        row = {"file": m, "format": label, "file_bytes": acct["file"], "decode_bytes_per_token": acct["total"],
               "tensorfold": None, "llama_cpp": None, "tensorfold_error": None}
        print(f"\n== {label}: {m} ({acct['file'] / 1e9:.2f} GB, {acct['total'] / 1e6:.1f} MB read per decoded token)",
              flush=True)
        if not a.no_tensorfold:
            t0 = time.perf_counter()
            try:
                row["tensorfold"] = measure_tensorfold(m, a.threads, a.n_prompt, a.n_gen, a.reps)
                tf = row["tensorfold"]
                print(f"  TensorFold pp {tf['pp']:.1f} tg {tf['tg']:.2f} tok/s ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on with llama.cpp
                row["tensorfold_error"] = f"{type(e).__name__}: {e}"
                print(f"  TensorFold cannot run it: {row['tensorfold_error']}", flush=True)
        if a.llama_bench:
            t0 = time.perf_counter()
            row["llama_cpp"] = measure_llama_bench(a.llama_bench, m, a.threads, a.n_prompt, a.n_gen, a.reps)
            lc = row["llama_cpp"]
            print(f"  llama.cpp  pp {lc['pp']:.1f} tg {lc['tg']:.2f} tok/s ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        rows.append(row)
    dram1 = measure_dram_read(a.threads, a.bandwidth_gib)
    dram = max(dram0, dram1)
    print(f"\nDRAM read bandwidth (after): {dram1 / 1e9:.2f} GB/s; denominator {dram / 1e9:.2f} GB/s "
          f"(kernels_read_bytes, {a.bandwidth_gib:g} GiB buffer, {a.threads} threads, best of 3)")

    def f(r, k, fmt="{:.1f}"):
        return fmt.format(r[k]) if r else "-"

    def ratio(row, k):
        tf, lc = row["tensorfold"], row["llama_cpp"]
        return f"{tf[k] / lc[k]:.2f}x" if tf and lc else "-"

    def share(row, who):
        r = row[who]
        if not r:
            return "-"
        eff = row["decode_bytes_per_token"] * r["tg"]
        r["decode_effective_bytes_per_s"] = eff
        r["decode_share_of_dram"] = eff / dram
        return f"{eff / 1e9:.2f} GB/s {eff / dram:4.0%}"

    hdr = (f"{'format':<10}{'file GB':>8}{'MB/tok':>8} | {'pp TF':>8}{'pp llama':>9}{'ratio':>7} | "
           f"{'tg TF':>7}{'tg llama':>9}{'ratio':>7} | {'TF decode bw':>17} | {'llama decode bw':>17}")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for row in rows:
        tf, lc = row["tensorfold"], row["llama_cpp"]
        print(f"{row['format']:<10}{row['file_bytes'] / 1e9:>8.2f}{row['decode_bytes_per_token'] / 1e6:>8.1f} | "
              f"{f(tf, 'pp'):>8}{f(lc, 'pp'):>9}{ratio(row, 'pp'):>7} | "
              f"{f(tf, 'tg', '{:.2f}'):>7}{f(lc, 'tg', '{:.2f}'):>9}{ratio(row, 'tg'):>7} | "
              f"{share(row, 'tensorfold'):>17} | {share(row, 'llama_cpp'):>17}")
    print(f"bound: decode tok/s = DRAM bandwidth / MB per token, e.g. "
          + ", ".join(f"{r['format']} {dram / r['decode_bytes_per_token']:.1f}" for r in rows))
    for row in rows:
        if row["tensorfold_error"]:
            print(f"TensorFold could not run {row['format']}: {row['tensorfold_error']}")
    if any(r["llama_cpp"] for r in rows):
        print(f"llama.cpp build: {next(r['llama_cpp']['build'] for r in rows if r['llama_cpp'])}")
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": a.threads, "n_prompt": a.n_prompt, "n_gen": a.n_gen,
                                            "reps": a.reps, "dram_before": dram0, "dram_after": dram1,
                                            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
