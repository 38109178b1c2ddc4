#!/usr/bin/env python3
"""TensorFold vs llama-bench, decode and prefill, on several GGUF files in one run — with each
engine's effective decode bandwidth as a share of the DRAM read bandwidth measured in the same run.

    LB=/tmp/dl/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench
    python bench/e2e_formats.py --llama-bench $LB /tmp/synth-moe-{Q2_K,Q4_K_M,IQ2_XXS,IQ3_XXS,IQ4_XS}.gguf
    python bench/e2e_formats.py --llama-bench $LB /tmp/dsb/synth-ds2-{Q2_K,Q4_K_M}.gguf --depth 0 4096 16384
    python bench/e2e_formats.py --llama-bench $LB --ik-bench $IKB FILES...     # + ik_llama.cpp columns

(the files come from bench/make_quantized_moe.py: a synthetic qwen3moe, or with --model deepseek2
a DeepSeek-V3-like deepseek2, larger than the L3, quantized by llama.cpp's llama-quantize). For each file, in order: TensorFold prefill of
--n-prompt random tokens and decode of --n-gen tokens (bench/e2e.py's measure_tensorfold, after
a warm-up, mean of --reps), then `llama-bench -p N -n M -r R -t T` on the same file. The DRAM
read bandwidth (bench/e2e.py's measure_dram_read) is measured before the first file and after the
last; the larger is the denominator, and both are printed so drift is visible. Decode bytes per
token are bench/e2e.py's decode_bytes_per_token (non-expert weights in full, n_used/n_expert of
each expert tensor, one row of token_embd).

KV cache bytes per token, for each engine and file (the `KV B/tok` columns): TensorFold's from
Engine.stats()["kv_bytes_per_token"] of the engine it measured (for a file it cannot run,
_core.kv_bytes_per_token, or the reason it refuses the file); llama.cpp's from its own log: one
`llama-completion -c 16384 -n 1 -v` run (--llama-completion, default the llama-completion next
to llama-bench; --kv-probe-context sets -c) prints "llama_kv_cache: size = X MiB (N cells, ...)",
and X MiB / N cells is the figure (every such line of the last context summed, so an SWA model's
two caches both count). Without llama-completion, `llama-bench -v -n 1` is used (256 cells, so
the MiB it prints with two decimals make the figure approximate). Both at the engines' default
F16 KV cache.

--depth N [N ...] adds decode at depth: for each N, decode tok/s after N tokens of context.
llama.cpp: `llama-bench -p 0 -n <n_gen> -d N1,N2,... -r <reps>` (it fills the depth untimed).
TensorFold: a fresh engine with room for the largest depth; per rep, one request with an N-token
random prompt (max(N, 1)), prefilled in chunks by the engine's normal scheduler up to its first
token, then the next --n-gen tokens are timed (prefill excluded; its tok/s is kept in the JSON).
The depth table also gives the KV cache each engine reads per decoded token at that depth
(N x KV bytes per token), to set beside the weight bytes per token.

--ik-bench PATH (ik_llama.cpp's llama-bench, github.com/ikawrakow/ik_llama.cpp) adds that engine
after llama.cpp on each file: the same `-p N -n M -r R -t T`, once with -rtr 0 and once with
-rtr 1 (run-time repacking, its best CPU setting), and at depth `-p 0 -n 0 -gp N1,M -gp N2,M ...`
(ik's llama-bench has no -d; -gp fills N tokens untimed and times M). Its columns: pp / tg tok/s
of both, TensorFold / ik -rtr 1, and the decode bandwidth of -rtr 1. Its KV cache is not probed.

A file TensorFold cannot load is reported (with the reason) and measured on llama.cpp only;
--no-tensorfold measures the llama.cpp peers only. --json PATH also writes the numbers as JSON.
Run it on a quiet machine (check `uptime`), one benchmark at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import IK_BEST, IK_RTR, ik_args, llama_env, measure_llama_bench, measure_llama_depth  # noqa: E402
from e2e import decode_bytes_per_token, measure_dram_read, measure_tensorfold  # noqa: E402


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


def measure_tensorfold_depth(model: str, threads: int, depths: list[int], n_gen: int, reps: int) -> dict:
    """{depth: {"tg", "tg_sd", "pp", "kv_bytes_per_token"}}: decode tok/s of n_gen tokens after a
    prompt of `depth` random tokens in one sequence; the chunked prefill (up to the first token)
    is not in the decode time."""
    import tensorfold

    eng = tensorfold.Engine(model, threads=threads, context=max(1024, max(depths) + n_gen + 16))
    core = eng._core
    vocab = eng.config["n_vocab"]
    rng = random.Random(1)

    def once(depth: int) -> tuple[float, float]:
        n_prompt = max(1, depth)
        ids = [rng.randrange(vocab) for _ in range(n_prompt)]
        t0 = time.perf_counter()
        core.add_request(ids, n_gen + 1, 0.0, 1, 1.0, 0.0, 0, [], True)
        while core.has_unfinished():  # prefill, chunk by chunk, until the first sampled token
            if core.step():
                break
        t1 = time.perf_counter()
        n = 0
        while core.has_unfinished():
            n += len(core.step())
        t2 = time.perf_counter()
        if n != n_gen:
            raise RuntimeError(f"depth {depth}: decoded {n} tokens, expected {n_gen}")
        return n_prompt / (t1 - t0), n / (t2 - t1)

    once(1)  # warm-up (scratch buffers, first-touch of the engine's state)
    kv = eng.stats().get("kv_bytes_per_token")
    res = {}
    for d in depths:
        runs = [once(d) for _ in range(reps)]
        tg = [r[1] for r in runs]
        res[d] = {"tg": statistics.mean(tg), "tg_sd": statistics.pstdev(tg),
                  "pp": statistics.mean(r[0] for r in runs), "kv_bytes_per_token": kv}
    eng.close()
    return res


_KV_LINE = re.compile(r"llama_kv_cache(?:_\w+)?: size = +([0-9.]+) MiB \( *(\d+) cells")


def llama_kv_bytes_per_token(llama_bench: str, completion: str | None, model: str, threads: int,
                             probe_ctx: int) -> dict:
    """KV cache bytes per token from llama.cpp's own log line
    "llama_kv_cache: size = X MiB (N cells, L layers, ...)": X MiB / N cells, summed over the
    cache lines of the last context the tool built (the earlier ones are llama.cpp's memory-fit
    probes)."""
    if completion and os.path.isfile(completion):
        tool = completion
        cmd = [completion, "-m", model, "-c", str(probe_ctx), "-n", "1", "-p", "hello", "-t", str(threads),
               "-no-cnv", "--no-warmup", "--temp", "0", "-v"]
    else:
        tool = llama_bench
        cmd = [llama_bench, "-m", model, "-t", str(threads), "-p", "0", "-n", "1", "-r", "1", "-v"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=llama_env(tool), stdin=subprocess.DEVNULL)
    log = out.stdout + "\n" + out.stderr
    last = log.rsplit("constructing llama_context", 1)[-1]
    lines = [m for m in _KV_LINE.finditer(last)]
    if not lines:
        tail = "\n".join(log.splitlines()[-5:])
        raise RuntimeError(f"{os.path.basename(tool)} printed no 'llama_kv_cache: size' line "
                           f"(exit {out.returncode}):\n{tail}")
    per_token = sum(float(m.group(1)) * 2**20 / int(m.group(2)) for m in lines)
    text = [last[m.start():last.find("\n", m.start())].strip() for m in lines]
    cells = [int(m.group(2)) for m in lines]
    # sizes are printed in MiB with two decimals: exact to the byte only when 0.005 MiB / cells < 0.5
    return {"bytes_per_token": round(per_token), "cells": cells, "exact": 0.005 * 2**20 / min(cells) < 0.5,
            "tool": os.path.basename(tool), "log": text}


def tensorfold_kv_fallback(model: str) -> tuple[int | None, str | None]:
    """KV bytes per token the engine would use, without loading it, or why it refuses the file."""
    from tensorfold import _core

    try:
        return int(_core.kv_bytes_per_token(_core.GgufFile(model))), None
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return None, str(e).splitlines()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="GGUF files")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="llama-bench binary (env LLAMA_BENCH)")
    ap.add_argument("--ik-bench", default=os.environ.get("IK_BENCH"),
                    help="ik_llama.cpp's llama-bench (env IK_BENCH): adds its -rtr 0 / -rtr 1 columns")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bandwidth-gib", type=float, default=2.0, help="size of the DRAM probe buffer")
    ap.add_argument("--no-tensorfold", action="store_true", help="measure the llama.cpp peers only")
    ap.add_argument("--depth", type=int, nargs="+", default=None, metavar="N",
                    help="also measure decode (--n-gen tokens) after N tokens of context, for each N "
                         "(give it after the GGUF files, or end the list with --)")
    ap.add_argument("--llama-completion", default=None,
                    help="llama-completion binary whose -v log gives llama.cpp's KV cache size "
                         "(default: next to --llama-bench)")
    ap.add_argument("--kv-probe-context", type=int, default=16384,
                    help="context (-c) of that llama-completion run (default 16384)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = ap.parse_args()
    if not a.llama_bench and not a.ik_bench and a.no_tensorfold:
        ap.error("nothing to measure: give --llama-bench / --ik-bench or drop --no-tensorfold")
    if a.depth and any(d < 0 for d in a.depth):
        ap.error("--depth values must be >= 0")
    if a.depth:
        a.depth = sorted(set(a.depth))
    if a.llama_completion and not os.path.isfile(a.llama_completion):
        ap.error(f"{a.llama_completion} not found")
    if a.llama_bench and not a.llama_completion:
        a.llama_completion = os.path.join(os.path.dirname(os.path.abspath(a.llama_bench)), "llama-completion")
    for m in a.models:
        if not os.path.isfile(m):
            ap.error(f"{m} not found")

    print(f"threads {a.threads}, prefill {a.n_prompt} tokens, decode {a.n_gen} tokens, {a.reps} reps"
          + (f", decode at depth {', '.join(map(str, a.depth))}" if a.depth else "")
          + f"; load average {os.getloadavg()[0]:.2f}", flush=True)
    dram0 = measure_dram_read(a.threads, a.bandwidth_gib)
    print(f"DRAM read bandwidth (before): {dram0 / 1e9:.2f} GB/s", flush=True)
    rows = []
    for m in a.models:
        label = label_of(m)
        acct = decode_bytes_per_token(m)
        row = {"file": m, "format": label, "file_bytes": acct["file"], "decode_bytes_per_token": acct["total"],
               "tensorfold": None, "llama_cpp": None, "ik_llama_cpp": {}, "tensorfold_error": None,
               "kv_bytes_per_token": {"tensorfold": None, "llama_cpp": None},
               "depth": [{"depth": d, "tensorfold": None, "llama_cpp": None, "ik_llama_cpp": {}}
                         for d in (a.depth or [])]}
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
            if row["tensorfold"] and a.depth:
                t0 = time.perf_counter()
                try:
                    tfd = measure_tensorfold_depth(m, a.threads, a.depth, a.n_gen, a.reps)
                    for e in row["depth"]:
                        e["tensorfold"] = tfd[e["depth"]]
                    print("  TensorFold tg at depth " + ", ".join(f"{d} {r['tg']:.2f}" for d, r in tfd.items())
                          + f" tok/s ({time.perf_counter() - t0:.0f} s)", flush=True)
                except Exception as e:  # noqa: BLE001
                    row["tensorfold_depth_error"] = f"{type(e).__name__}: {e}"
                    print(f"  TensorFold at depth failed: {row['tensorfold_depth_error']}", flush=True)
        tf_kv = row["tensorfold"]["kv_bytes_per_token"] if row["tensorfold"] else None
        if tf_kv is None:
            tf_kv, why = tensorfold_kv_fallback(m)
            if why:
                row["tensorfold_kv_error"] = why
        row["kv_bytes_per_token"]["tensorfold"] = tf_kv
        if a.llama_bench:
            t0 = time.perf_counter()
            row["llama_cpp"] = measure_llama_bench(a.llama_bench, m, a.threads, a.n_prompt, a.n_gen, a.reps)
            lc = row["llama_cpp"]
            print(f"  llama.cpp  pp {lc['pp']:.1f} tg {lc['tg']:.2f} tok/s ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
            if a.depth:
                t0 = time.perf_counter()
                try:
                    lcd = measure_llama_depth(a.llama_bench, m, a.threads, a.depth, a.n_gen, a.reps)
                    for e in row["depth"]:
                        e["llama_cpp"] = lcd.get(e["depth"])
                    print("  llama.cpp  tg at depth " + ", ".join(f"{d} {r['tg']:.2f}" for d, r in sorted(lcd.items()))
                          + f" tok/s ({time.perf_counter() - t0:.0f} s)", flush=True)
                except Exception as e:  # noqa: BLE001
                    row["llama_cpp_depth_error"] = f"{type(e).__name__}: {e}"
                    print(f"  llama.cpp at depth failed: {row['llama_cpp_depth_error']}", flush=True)
            try:
                kv = llama_kv_bytes_per_token(a.llama_bench, a.llama_completion, m, a.threads, a.kv_probe_context)
                row["kv_bytes_per_token"]["llama_cpp"] = kv["bytes_per_token"]
                row["llama_cpp_kv_log"] = kv
                print(f"  llama.cpp  KV {kv['bytes_per_token']} bytes/token{'' if kv['exact'] else ' (approximate)'} "
                      f"({kv['tool']}: {' | '.join(kv['log'])})", flush=True)
            except Exception as e:  # noqa: BLE001
                row["llama_cpp_kv_error"] = f"{type(e).__name__}: {e}"
                print(f"  llama.cpp KV size not found: {row['llama_cpp_kv_error']}", flush=True)
        for rtr in IK_RTR if a.ik_bench else ():
            t0 = time.perf_counter()
            try:
                r = row["ik_llama_cpp"][rtr] = measure_llama_bench(a.ik_bench, m, a.threads, a.n_prompt, a.n_gen,
                                                                   a.reps, ik_args(rtr))
                print(f"  ik -rtr {rtr}  pp {r['pp']:.1f} tg {r['tg']:.2f} tok/s ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                row[f"ik_llama_cpp_rtr{rtr}_error"] = f"{type(e).__name__}: {e}"
                print(f"  ik_llama.cpp -rtr {rtr} failed: {row[f'ik_llama_cpp_rtr{rtr}_error']}", flush=True)
                continue
            if a.depth:
                t0 = time.perf_counter()
                try:
                    ikd = measure_llama_depth(a.ik_bench, m, a.threads, a.depth, a.n_gen, a.reps, ik_args(rtr), ik=True)
                    for e in row["depth"]:
                        if e["depth"] in ikd:
                            e["ik_llama_cpp"][rtr] = ikd[e["depth"]]
                    print(f"  ik -rtr {rtr}  tg at depth " + ", ".join(f"{d} {r['tg']:.2f}" for d, r in sorted(ikd.items()))
                          + f" tok/s ({time.perf_counter() - t0:.0f} s)", flush=True)
                except Exception as e:  # noqa: BLE001
                    row[f"ik_llama_cpp_rtr{rtr}_depth_error"] = f"{type(e).__name__}: {e}"
                    print(f"  ik_llama.cpp -rtr {rtr} at depth failed: {e}", flush=True)
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
        r = row[who] if who != "ik" else row["ik_llama_cpp"].get(IK_BEST)
        if not r:
            return "-"
        eff = row["decode_bytes_per_token"] * r["tg"]
        r["decode_effective_bytes_per_s"] = eff
        r["decode_share_of_dram"] = eff / dram
        return f"{eff / 1e9:.2f} GB/s {eff / dram:4.0%}"

    def kv(row, who):
        v = row["kv_bytes_per_token"][who]
        return str(v) if v is not None else "-"

    ik_on = bool(a.ik_bench)

    def ik_cells(r, k, fmt, w):
        """The ik columns of one test of a row (or depth entry) r: -rtr 0, -rtr 1, TF / ik -rtr IK_BEST."""
        if not ik_on:
            return ""
        ik, tf = r["ik_llama_cpp"], r["tensorfold"]
        best = ik.get(IK_BEST)
        x = f"{tf[k] / best[k]:.2f}x" if tf and best else "-"
        return "".join(f"{f(ik.get(rtr), k, fmt):>{w}}" for rtr in IK_RTR) + f"{x:>7}"

    def ik_hdr(k, w):
        return "".join(f"{f'{k} ik{rtr}':>{w}}" for rtr in IK_RTR) + f"{f'/ik{IK_BEST}':>7}" if ik_on else ""

    hdr = (f"{'format':<10}{'file GB':>8}{'MB/tok':>8} | {'pp TF':>8}{'pp llama':>9}{'ratio':>7}{ik_hdr('pp', 9)} | "
           f"{'tg TF':>7}{'tg llama':>9}{'ratio':>7}{ik_hdr('tg', 8)} | {'TF decode bw':>17} | {'llama decode bw':>17} | "
           + (f"{f'ik{IK_BEST} decode bw':>17} | " if ik_on else "") + f"{'KV B/tok TF':>11}{'llama':>7}")
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for row in rows:
        tf, lc = row["tensorfold"], row["llama_cpp"]
        print(f"{row['format']:<10}{row['file_bytes'] / 1e9:>8.2f}{row['decode_bytes_per_token'] / 1e6:>8.1f} | "
              f"{f(tf, 'pp'):>8}{f(lc, 'pp'):>9}{ratio(row, 'pp'):>7}{ik_cells(row, 'pp', '{:.1f}', 9)} | "
              f"{f(tf, 'tg', '{:.2f}'):>7}{f(lc, 'tg', '{:.2f}'):>9}{ratio(row, 'tg'):>7}"
              f"{ik_cells(row, 'tg', '{:.2f}', 8)} | "
              f"{share(row, 'tensorfold'):>17} | {share(row, 'llama_cpp'):>17} | "
              + (f"{share(row, 'ik'):>17} | " if ik_on else "")
              + f"{kv(row, 'tensorfold'):>11}{kv(row, 'llama_cpp'):>7}")
    if ik_on:
        print(f"ik0 / ik1: ik_llama.cpp -rtr 0 / -rtr 1 tok/s; /ik{IK_BEST}: TensorFold / ik_llama.cpp -rtr {IK_BEST}; "
              f"ratio: TensorFold / llama.cpp")
    print(f"bound: decode tok/s = DRAM bandwidth / MB per token, e.g. "
          + ", ".join(f"{r['format']} {dram / r['decode_bytes_per_token']:.1f}" for r in rows))
    if a.depth:
        def kv_mb(row, who, d):
            v = row["kv_bytes_per_token"][who]
            return f"{v * d / 1e6:.1f}" if v is not None else "-"

        hdr = (f"\n{'format':<10}{'depth':>7} | {'tg TF':>7}{'tg llama':>9}{'ratio':>7}{ik_hdr('tg', 8)} | "
               f"{'KV MB/tok TF':>12}{'llama':>7}")
        print(hdr + "\n" + "-" * (len(hdr) - 1))
        for row in rows:
            for e in row["depth"]:
                tf, lc, d = e["tensorfold"], e["llama_cpp"], e["depth"]
                r = f"{tf['tg'] / lc['tg']:.2f}x" if tf and lc else "-"
                print(f"{row['format']:<10}{d:>7} | {f(tf, 'tg', '{:.2f}'):>7}{f(lc, 'tg', '{:.2f}'):>9}{r:>7}"
                      f"{ik_cells(e, 'tg', '{:.2f}', 8)} | "
                      f"{kv_mb(row, 'tensorfold', d):>12}{kv_mb(row, 'llama_cpp', d):>7}")
        print(f"decode at depth N: --n-gen {a.n_gen} tokens after N tokens of context (prefill not timed); "
              "KV MB/tok = N x KV bytes per token, the cache one decoded token reads")
    for row in rows:
        if row["tensorfold_error"]:
            print(f"TensorFold could not run {row['format']}: {row['tensorfold_error']}")
        for k, who in (("tensorfold_depth_error", "TensorFold at depth"), ("llama_cpp_depth_error", "llama.cpp at depth"),
                       ("llama_cpp_kv_error", "llama.cpp KV size"),
                       *((f"ik_llama_cpp_rtr{rtr}{x}", f"ik_llama.cpp -rtr {rtr}{y}") for rtr in IK_RTR
                         for x, y in (("_error", ""), ("_depth_error", " at depth")))):
            if row.get(k):
                print(f"{who} failed on {row['format']}: {row[k]}")
        if row.get("tensorfold_kv_error") and not row["tensorfold_error"]:
            print(f"TensorFold KV bytes per token for {row['format']}: {row['tensorfold_kv_error']}")
    if any(r["llama_cpp"] for r in rows):
        print(f"llama.cpp build: {next(r['llama_cpp']['build'] for r in rows if r['llama_cpp'])}")
    if any(r["ik_llama_cpp"] for r in rows):
        print(f"ik_llama.cpp build: {next(next(iter(r['ik_llama_cpp'].values()))['build'] for r in rows if r['ik_llama_cpp'])}")
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": a.threads, "n_prompt": a.n_prompt, "n_gen": a.n_gen,
                                            "reps": a.reps, "depths": a.depth or [], "dram_before": dram0,
                                            "dram_after": dram1, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
