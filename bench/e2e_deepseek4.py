#!/usr/bin/env python3
"""TensorFold vs llama.cpp on DeepSeek-V4 (`deepseek4`) GGUF files: prefill, decode, decode at
depth, KV cache bytes — both engines, same files, same threads, one run.

    LLAMA_BIN=/work/llama/build/bin
    python bench/make_quantized_moe.py --llama-bin $LLAMA_BIN --model deepseek4 --types Q2_K,Q4_K_M \\
        --out-dir /tmp/ds4b                                   # synth-ds4-{Q2_K,Q4_K_M}.gguf
    python bench/e2e_deepseek4.py --llama-bench $LLAMA_BIN/llama-bench \\
        /tmp/ds4b/synth-ds4-{Q2_K,Q4_K_M}.gguf --json /tmp/ds4b/e2e.json
    # quicker: --depth 4096 16384 --depth-reps 2 (or --no-depth)
    # + ik_llama.cpp (-rtr 0 and -rtr 1 columns): --ik-bench /path/to/ik_llama.cpp/build/bin/llama-bench

Per file, in this order:

1. TensorFold prefill of --n-prompt (512) random tokens and decode of --n-gen (64) tokens after a
   1-token prompt, after a warm-up, mean of --reps (bench/e2e.py's measure_tensorfold: the
   engine's own scheduler in-process, as `tensorfold generate` runs it).
2. TensorFold decode at depth: one engine with room for the largest depth; for each N of --depth
   (4096 16384 65536) and its repetitions (--depth-reps, default 2 2 1): one request with an
   N-token random prompt, prefilled in chunks by the engine's scheduler up to its first token
   (that prefill's tok/s is reported too), then the next --n-gen tokens timed.
3. `llama-bench -p 512 -n 64 -r R -t T` on the file; then for each depth N
   `llama-bench -p 0 -n 64 -d N -r R_N -t T -v` (llama-bench fills the depth untimed; -v so that
   the log of the largest depth gives llama.cpp's cache sizes).
4. With --ik-bench (ik_llama.cpp's llama-bench, github.com/ikawrakow/ik_llama.cpp), for -rtr 0 and
   then -rtr 1 (run-time repacking, its best CPU setting): `llama-bench -p 512 -n 64 -r R -t T
   -rtr X`, then per depth `llama-bench -p 0 -n 0 -gp N,64 -r R_N -t T -rtr X -v` (ik's
   llama-bench has no -d; -gp fills N tokens untimed and times the 64). Its columns sit beside
   llama.cpp's with the ratio TensorFold / ik -rtr 1; its KV cache is not parsed (logs kept).

Reported: tok/s of both, the ratio TensorFold / llama.cpp, each engine's decode at the largest
depth over its decode at 0 (the 1-token-prompt tg), decode effective weight bandwidth (bench/e2e.py's
decode bytes per token x tok/s) against the DRAM read bandwidth measured before the first file
and after the last, and the KV cache of both at the engines' default F16 cache:

- TensorFold: Engine.stats()["kv_bytes_per_token"] (the part that grows with the context: the
  compressed entries of CSA / HCA layers and the indexer keys, bytes per token of context) and
  engine.memory_plan["kv_bytes_per_seq"] (the fixed part per sequence: sliding-window rows and the
  compressors' pending state, for the engine's step size), with the plan's KV group lines.
- llama.cpp (src/llama-kv-cache-dsv4.cpp): a raw SWA K cache of every layer (window + ubatch
  cells, rounded up to 256), K-only compressed caches for CSA (one 512-wide row per 4 tokens),
  HCA (one per 128) and the lightning indexer (one index_head_dim row per 4 tokens), each sized
  ceil(ctx / ratio) rounded up to 256 cells, and compressor states (F32, per sequence). Per
  token = sum over the compressed caches of their "llama_kv_cache: size = X MiB (C cells, ...)"
  log line X MiB / C / ratio; per sequence = the raw SWA cache + the three state buffers
  ("llama_dsv4_comp_state: ... size = X MiB") from the same log. Also computed from the GGUF's
  metadata (`model` rows) as a check.

The machine (lscpu model, family/model, CPUs, L3) and the load average are printed with the
results. Noise: shared 2-core VMs; compare numbers of one run only. The 65536-token depth is the
long part (each engine prefills 64K tokens per repetition: ~10+ min per file and engine on
2 cores).
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
import _common  # noqa: E402
from _common import IK_BEST, IK_RTR, ik_args, measure_llama_bench  # noqa: E402
from e2e import decode_bytes_per_token, measure_dram_read, measure_tensorfold  # noqa: E402
from e2e_formats import label_of  # noqa: E402

CSA, HCA = 4, 128


def machine() -> dict:
    """lscpu's model name, family/model/stepping, CPUs and L3, and the DRAM probe's settings."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    f = dict(re.findall(r"^([^:\n]+):\s*(.*)$", out, re.M))
    return {"model_name": f.get("Model name", "?"), "family": f.get("CPU family", "?"), "model": f.get("Model", "?"),
            "stepping": f.get("Stepping", "?"), "cpus": f.get("CPU(s)", "?"), "l3": f.get("L3 cache", "?"),
            "hypervisor": f.get("Hypervisor vendor", ""),
            "avx512": "avx512f" in f.get("Flags", ""), "uname": os.uname().release}


# ------------------------------------------------------------------------------------------------
# KV cache: llama.cpp's formula from the GGUF metadata, and its own log lines


def gguf_ratios(model: str) -> list[int]:
    import gguf

    r = gguf.GGUFReader(model)
    fld = r.fields["deepseek4.attention.compress_ratios"]
    return [int(fld.parts[i][0]) for i in fld.data]


def gguf_int(model: str, key: str) -> int | None:
    import gguf

    r = gguf.GGUFReader(model)
    fld = r.fields.get(key)
    return int(fld.parts[fld.data[0]][0]) if fld is not None else None


def kv_model(model: str) -> dict:
    """Bytes per token of context of the compressed caches, F16, as llama.cpp sizes them:
    CSA layers one head_dim row + one indexer row per 4 tokens, HCA one head_dim row per 128."""
    ratios = gguf_ratios(model)
    hd = gguf_int(model, "deepseek4.attention.key_length")
    ihd = gguf_int(model, "deepseek4.attention.indexer.key_length")
    n_csa, n_hca = ratios.count(CSA), ratios.count(HCA)
    per_tok = n_csa * (hd + ihd) * 2 / CSA + n_hca * hd * 2 / HCA
    return {"ratios": ratios, "head_dim": hd, "index_head_dim": ihd, "n_csa": n_csa, "n_hca": n_hca,
            "n_sliding": ratios.count(0), "bytes_per_token": per_tok}


_CREATE = re.compile(r"llama_kv_cache_dsv4: creating DSV4 (raw|CSA compressed|HCA compressed|lightning-indexer) KV cache")
_SIZE = re.compile(r"llama_kv_cache: size = +([0-9.]+) MiB \( *(\d+) cells, +(\d+) layers")
_STATE = re.compile(r"llama_dsv4_comp_state: (\w+) ratio = (\d+), state = (\d+) x (\d+), .*size = +([0-9.]+) MiB")
_CTX = re.compile(r"llama_context: n_ctx += (\d+)")


def parse_llama_kv(log: str) -> dict | None:
    """llama.cpp's deepseek4 cache sizes from the -v log of its last context."""
    last = log.rsplit("llama_context: constructing llama_context", 1)
    if len(last) < 2:
        return None
    text = last[1]
    caches: dict[str, list] = {}
    current = None
    for line in text.splitlines():
        m = _CREATE.search(line)
        if m:
            current = m.group(1)
            caches.setdefault(current, [])
            continue
        m = _SIZE.search(line)
        if m and current:
            caches[current].append({"mib": float(m.group(1)), "cells": int(m.group(2)), "layers": int(m.group(3)),
                                    "line": line.strip()})
    states = [{"name": m.group(1), "ratio": int(m.group(2)), "rows": int(m.group(3)), "width": int(m.group(4)),
               "mib": float(m.group(5)), "line": m.group(0)} for m in _STATE.finditer(text)]
    ctx = _CTX.search(text)
    if not caches:
        return None
    ratio = {"CSA compressed": CSA, "lightning-indexer": CSA, "HCA compressed": HCA}
    per_tok = 0.0
    parts = {}
    for name, r in ratio.items():
        for c in caches.get(name, []):
            if c["cells"]:
                b = c["mib"] * 2**20 / c["cells"] / r
                per_tok += b
                parts[name] = parts.get(name, 0.0) + b
    raw = sum(c["mib"] for c in caches.get("raw", [])) * 2**20
    state = sum(s["mib"] for s in states) * 2**20
    comp_total = sum(c["mib"] for n in ratio for c in caches.get(n, [])) * 2**20
    return {"n_ctx": int(ctx.group(1)) if ctx else None, "bytes_per_token": per_tok, "parts_per_token": parts,
            "raw_swa_bytes": raw, "state_bytes": state, "per_seq_bytes": raw + state,
            "compressed_total_bytes": comp_total,
            "lines": [c["line"] for n in caches for c in caches[n]] + [s["line"] for s in states]}


# ------------------------------------------------------------------------------------------------
# measurements


def measure_tensorfold_depth(model: str, threads: int, depths: list[int], reps: list[int], n_gen: int) -> dict:
    """{depth: {tg, tg_sd, pp, runs}} plus "_kv": the engine's KV figures. One engine with room for
    the largest depth; per repetition one request with a random depth-token prompt, prefilled by
    the scheduler in chunks (timed as pp), then n_gen decoded tokens timed (tg)."""
    import tensorfold

    eng = tensorfold.Engine(model, threads=threads, context=max(depths) + n_gen + 64)
    core = eng._core
    vocab = eng.config["n_vocab"]
    rng = random.Random(1)

    def once(depth: int) -> tuple[float, float]:
        ids = [rng.randrange(vocab) for _ in range(max(1, depth))]
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
        return len(ids) / (t1 - t0), n / (t2 - t1)

    once(1)  # warm-up
    plan = eng.memory_plan
    res: dict = {"_kv": {"kv_bytes_per_token": eng.stats().get("kv_bytes_per_token"),
                         "kv_bytes_per_seq": plan.get("kv_bytes_per_seq"), "context": plan.get("context"),
                         "max_batch_tokens": plan.get("max_batch_tokens"),
                         "plan_kv_lines": [ln.strip() for ln in plan.get("table", "").splitlines() if "KV group" in ln]}}
    for d, r in zip(depths, reps):
        t0 = time.perf_counter()
        runs = [once(d) for _ in range(r)]
        tg = [x[1] for x in runs]
        res[d] = {"tg": statistics.mean(tg), "tg_sd": statistics.pstdev(tg),
                  "pp": statistics.mean(x[0] for x in runs), "runs": [list(x) for x in runs]}
        print(f"    TF depth {d}: prefill {res[d]['pp']:.1f} tok/s, decode {res[d]['tg']:.2f} tok/s "
              f"({r} rep, {time.perf_counter() - t0:.0f} s)", flush=True)
    eng.close()
    return res


def measure_llama_depth(binary: str, model: str, threads: int, depth: int, n_gen: int, reps: int,
                        log_path: Path | None, extra=(), ik: bool = False) -> dict:
    """tg at one depth from `llama-bench -p 0 -n n_gen -d depth -r reps -v` (ik_llama.cpp: `-p 0
    -n 0 -gp depth,n_gen`; its log kept for the KV cache lines)."""
    res = _common.measure_llama_depth(binary, model, threads, [depth], n_gen, reps, extra, ik=ik,
                                      log_path=log_path, verbose=True)
    if depth not in res:
        raise RuntimeError(f"llama-bench depth {depth}: no tg row in its output")
    return res[depth]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="deepseek4 GGUF files")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), help="llama-bench binary (env LLAMA_BENCH)")
    ap.add_argument("--ik-bench", default=os.environ.get("IK_BENCH"),
                    help="ik_llama.cpp's llama-bench (env IK_BENCH): adds its -rtr 0 / -rtr 1 columns")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of pp / tg at depth 0")
    ap.add_argument("--depth", type=int, nargs="*", default=[4096, 16384, 65536], metavar="N",
                    help="context depths for decode (default 4096 16384 65536; give it after the files)")
    ap.add_argument("--depth-reps", type=int, nargs="*", default=None, metavar="R",
                    help="repetitions per depth (default 2 each, 1 from 32768 up); one value applies to all")
    ap.add_argument("--no-depth", action="store_true", help="skip decode at depth")
    ap.add_argument("--no-tensorfold", action="store_true")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--bandwidth-gib", type=float, default=2.0, help="DRAM probe buffer")
    ap.add_argument("--log-dir", default=None, help="llama-bench -v logs (default: next to --json, else /tmp)")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    depths = [] if a.no_depth else sorted(set(a.depth))
    if a.depth_reps is None:
        dreps = [2 if d < 32768 else 1 for d in depths]
    elif len(a.depth_reps) == 1:
        dreps = a.depth_reps * len(depths)
    elif len(a.depth_reps) == len(depths):
        dreps = list(a.depth_reps)
    else:
        ap.error("--depth-reps: one value, or one per --depth")
    if not a.no_llama and not a.llama_bench:
        ap.error("--llama-bench (env LLAMA_BENCH) is required unless --no-llama")
    for m in a.models:
        if not os.path.isfile(m):
            ap.error(f"{m} not found")
    log_dir = Path(a.log_dir) if a.log_dir else (Path(a.json).parent if a.json else Path("/tmp"))
    log_dir.mkdir(parents=True, exist_ok=True)

    mach = machine()
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    print(f"machine: {mach['model_name']} (family {mach['family']} model {mach['model']} stepping "
          f"{mach['stepping']}), {mach['cpus']} CPUs, L3 {mach['l3']}, AVX-512 {'yes' if mach['avx512'] else 'no'}"
          f"{', ' + mach['hypervisor'] + ' guest' if mach['hypervisor'] else ''}; load average {load0[0]:.2f}", flush=True)
    print(f"threads {a.threads}; pp{a.n_prompt} / tg{a.n_gen} x{a.reps}; decode at depth "
          + (", ".join(f"{d} x{r}" for d, r in zip(depths, dreps)) or "-"), flush=True)
    dram0 = measure_dram_read(a.threads, a.bandwidth_gib)
    print(f"DRAM read bandwidth (before): {dram0 / 1e9:.2f} GB/s", flush=True)

    rows = []
    for m in a.models:
        label = label_of(m)
        acct = decode_bytes_per_token(m)
        kvm = kv_model(m)
        row = {"file": m, "format": label, "file_bytes": acct["file"], "decode_bytes_per_token": acct["total"],
               "kv_model": kvm, "tensorfold": None, "llama_cpp": None, "tf_depth": {}, "lc_depth": {},
               "ik": {}, "ik_depth": {rtr: {} for rtr in IK_RTR},
               "tf_kv": None, "lc_kv": None, "errors": {}}
        print(f"\n== {label}: {m} ({acct['file'] / 1e9:.2f} GB, {acct['total'] / 1e6:.1f} MB weights per decoded "
              f"token; ratios {kvm['ratios']})", flush=True)
        if not a.no_tensorfold:
            t0 = time.perf_counter()
            try:
                tf = row["tensorfold"] = measure_tensorfold(m, a.threads, a.n_prompt, a.n_gen, a.reps)
                print(f"  TensorFold pp{a.n_prompt} {tf['pp']:.1f} tg{a.n_gen} {tf['tg']:.2f} tok/s "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
                if depths:
                    t0 = time.perf_counter()
                    d = measure_tensorfold_depth(m, a.threads, depths, dreps, a.n_gen)
                    row["tf_kv"] = d.pop("_kv")
                    row["tf_depth"] = d
                    print(f"  TensorFold depths done ({time.perf_counter() - t0:.0f} s)", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on
                row["errors"]["tensorfold"] = f"{type(e).__name__}: {e}"
                print(f"  TensorFold failed: {row['errors']['tensorfold']}", flush=True)
        if not a.no_llama:
            t0 = time.perf_counter()
            try:
                lc = row["llama_cpp"] = measure_llama_bench(a.llama_bench, m, a.threads, a.n_prompt, a.n_gen, a.reps)
                print(f"  llama.cpp  pp{a.n_prompt} {lc['pp']:.1f} tg{a.n_gen} {lc['tg']:.2f} tok/s "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            except Exception as e:  # noqa: BLE001
                row["errors"]["llama_cpp"] = f"{type(e).__name__}: {e}"
                print(f"  llama.cpp failed: {row['errors']['llama_cpp']}", flush=True)
            for d, r in zip(depths, dreps):
                t0 = time.perf_counter()
                log = log_dir / f"llama-bench-{Path(m).stem}-d{d}.log"
                try:
                    row["lc_depth"][d] = measure_llama_depth(a.llama_bench, m, a.threads, d, a.n_gen, r, log)
                    print(f"    llama.cpp depth {d}: decode {row['lc_depth'][d]['tg']:.2f} tok/s "
                          f"({r} rep, {time.perf_counter() - t0:.0f} s; log {log})", flush=True)
                    if d == max(depths):
                        row["lc_kv"] = parse_llama_kv(log.read_text(errors="replace"))
                except Exception as e:  # noqa: BLE001
                    row["errors"][f"llama_cpp_d{d}"] = f"{type(e).__name__}: {e}"
                    print(f"    llama.cpp depth {d} failed: {e}", flush=True)
        for rtr in IK_RTR if a.ik_bench else ():
            t0 = time.perf_counter()
            try:
                ik = row["ik"][rtr] = measure_llama_bench(a.ik_bench, m, a.threads, a.n_prompt, a.n_gen, a.reps,
                                                          ik_args(rtr))
                print(f"  ik -rtr {rtr}  pp{a.n_prompt} {ik['pp']:.1f} tg{a.n_gen} {ik['tg']:.2f} tok/s "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            except Exception as e:  # noqa: BLE001
                row["errors"][f"ik_rtr{rtr}"] = f"{type(e).__name__}: {e}"
                print(f"  ik_llama.cpp -rtr {rtr} failed: {row['errors'][f'ik_rtr{rtr}']}", flush=True)
                continue
            for d, r in zip(depths, dreps):
                t0 = time.perf_counter()
                log = log_dir / f"ik-llama-bench-{Path(m).stem}-rtr{rtr}-d{d}.log"
                try:
                    x = row["ik_depth"][rtr][d] = measure_llama_depth(a.ik_bench, m, a.threads, d, a.n_gen, r, log,
                                                                      ik_args(rtr), ik=True)
                    print(f"    ik -rtr {rtr} depth {d}: decode {x['tg']:.2f} tok/s "
                          f"({r} rep, {time.perf_counter() - t0:.0f} s; log {log})", flush=True)
                except Exception as e:  # noqa: BLE001
                    row["errors"][f"ik_rtr{rtr}_d{d}"] = f"{type(e).__name__}: {e}"
                    print(f"    ik -rtr {rtr} depth {d} failed: {e}", flush=True)
        rows.append(row)
    dram1 = measure_dram_read(a.threads, a.bandwidth_gib)
    dram = max(dram0, dram1)
    load1 = os.getloadavg()

    # ---------------------------------------------------------------- report
    def f(v, fmt="{:.2f}"):
        return fmt.format(v) if v is not None else "-"

    def ratio(x, y):
        return f"{x / y:.2f}x" if x is not None and y else "-"

    print(f"\nmachine: {mach['model_name']} (family {mach['family']} model {mach['model']} = Zen 4 if 25/17), "
          f"{mach['cpus']} CPUs, L3 {mach['l3']}, kernel {mach['uname']}")
    print(f"DRAM read bandwidth: {dram0 / 1e9:.2f} GB/s before, {dram1 / 1e9:.2f} GB/s after "
          f"(kernels_read_bytes, {a.bandwidth_gib:g} GiB buffer, {a.threads} threads, best of 3); "
          f"load average {load0[0]:.2f} -> {load1[0]:.2f}; wall {time.perf_counter() - t_start:.0f} s")
    ik_on = bool(a.ik_bench)
    hdr = (f"{'file':<8}{'test':<14} | {'TensorFold':>16} | {'llama.cpp':>16} | {'TF/llama':>8}"
           + "".join(f" | {f'ik -rtr {rtr}':>16}" for rtr in IK_RTR if ik_on)
           + (f" | {f'TF/ik{IK_BEST}':>8}" if ik_on else ""))
    print("\n" + hdr + "\n" + "-" * len(hdr))

    def cell(r, k="tg"):
        return f"{r[k]:.2f} ± {r[k + '_sd']:.2f}" if r else "-"

    for row in rows:
        tf, lc = row["tensorfold"], row["llama_cpp"]
        lines = []
        for k, name in (("pp", f"pp{a.n_prompt}"), ("tg", f"tg{a.n_gen}")):
            x = tf[k] if tf else None
            y = lc[k] if lc else None
            iks = [row["ik"].get(rtr) for rtr in IK_RTR]
            ikb = row["ik"].get(IK_BEST)
            lines.append((name, cell(tf, k), cell(lc, k), ratio(x, y), [cell(r, k) for r in iks],
                          ratio(x, ikb and ikb[k])))
        for d in depths:
            x = row["tf_depth"].get(d)
            y = row["lc_depth"].get(d)
            ikb = row["ik_depth"][IK_BEST].get(d)
            lines.append((f"tg{a.n_gen} @ d{d}", cell(x), cell(y), ratio(x and x["tg"], y and y["tg"]),
                          [cell(row["ik_depth"][rtr].get(d)) for rtr in IK_RTR], ratio(x and x["tg"], ikb and ikb["tg"])))
        for name, sx, sy, r, siks, rik in lines:
            print(f"{row['format']:<8}{name:<14} | {sx:>16} | {sy:>16} | {r:>8}"
                  + ("".join(f" | {si:>16}" for si in siks) + f" | {rik:>8}" if ik_on else ""))
        if depths:
            dm = max(depths)
            x, y = row["tf_depth"].get(dm), row["lc_depth"].get(dm)
            tf0, lc0 = (tf["tg"] if tf else None), (lc["tg"] if lc else None)
            iks = ""
            for rtr in IK_RTR if ik_on else ():
                ikd, ik0 = row["ik_depth"][rtr].get(dm), row["ik"].get(rtr)
                iks += f" | {ratio(ikd and ikd['tg'], ik0 and ik0['tg']):>16}"
            print(f"{row['format']:<8}{f'd{dm} / d0':<14} | {ratio(x and x['tg'], tf0):>16} | "
                  f"{ratio(y and y['tg'], lc0):>16} |" + (f"{'':>9}{iks} |" if ik_on else ""))
            print(f"{row['format']:<8}{'TF prefill @d':<14} | "
                  + ", ".join(f"d{d} {row['tf_depth'][d]['pp']:.1f}" for d in depths if d in row["tf_depth"])
                  + " tok/s (chunked prefill of the depth prompt; llama-bench does not time its own)")
        print("-" * len(hdr))
    print("tok/s, mean ± sd over the repetitions; TF/llama > 1: TensorFold faster. "
          f"tg{a.n_gen} @ dN: {a.n_gen} tokens decoded after N tokens of context (prefill not timed)."
          + (f" ik -rtr 0 / 1: ik_llama.cpp without / with run-time repacking; TF/ik{IK_BEST}: TensorFold / "
             f"ik -rtr {IK_BEST}." if ik_on else ""))

    print(f"\n{'file':<8}{'weights MB/tok':>15}{'TF GB/s':>9}{'of DRAM':>8}{'llama GB/s':>11}{'of DRAM':>8}"
          + (f"{f'ik{IK_BEST} GB/s':>10}{'of DRAM':>8}" if ik_on else "") + f"{'bound tok/s':>12}")
    for row in rows:
        b = row["decode_bytes_per_token"]
        tf, lc, ik = row["tensorfold"], row["llama_cpp"], row["ik"].get(IK_BEST)
        print(f"{row['format']:<8}{b / 1e6:>15.1f}"
              f"{f(tf and b * tf['tg'] / 1e9):>9}{f(tf and b * tf['tg'] / dram, '{:.0%}'):>8}"
              f"{f(lc and b * lc['tg'] / 1e9):>11}{f(lc and b * lc['tg'] / dram, '{:.0%}'):>8}"
              + (f"{f(ik and b * ik['tg'] / 1e9):>10}{f(ik and b * ik['tg'] / dram, '{:.0%}'):>8}" if ik_on else "")
              + f"{dram / b:>12.1f}")

    print("\nKV cache (F16), bytes per token of context / fixed bytes per sequence:")
    for row in rows:
        km, tk, lk = row["kv_model"], row["tf_kv"], row["lc_kv"]
        print(f"  {row['format']}: model (llama.cpp's layout): {km['n_csa']} CSA x ({km['head_dim']} + "
              f"{km['index_head_dim']}) x 2 B / 4 + {km['n_hca']} HCA x {km['head_dim']} x 2 B / 128 = "
              f"{km['bytes_per_token']:.1f} B/token ({km['n_sliding']} sliding-only layers add nothing per token)")
        if tk:
            print(f"    TensorFold: {tk['kv_bytes_per_token']} B/token (Engine.stats kv_bytes_per_token), "
                  f"{tk['kv_bytes_per_seq'] / 2**20:.2f} MiB per sequence (memory_plan kv_bytes_per_seq; context "
                  f"{tk['context']}, step {tk['max_batch_tokens']} tokens)")
            for ln in tk["plan_kv_lines"]:
                print(f"      {ln}")
        if lk:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in lk["parts_per_token"].items())
            print(f"    llama.cpp: {lk['bytes_per_token']:.1f} B/token ({parts}), "
                  f"{lk['per_seq_bytes'] / 2**20:.2f} MiB per sequence (raw SWA cache {lk['raw_swa_bytes'] / 2**20:.2f} "
                  f"MiB + compressor states {lk['state_bytes'] / 2**20:.2f} MiB); n_ctx {lk['n_ctx']}, compressed "
                  f"caches {lk['compressed_total_bytes'] / 2**20:.2f} MiB in all")
            for ln in lk["lines"]:
                print(f"      {ln}")
    for row in rows:
        for k, v in row["errors"].items():
            print(f"error ({row['format']}, {k}): {v}")
    if any(r["llama_cpp"] for r in rows):
        print(f"llama.cpp build: {next(r['llama_cpp']['build'] for r in rows if r['llama_cpp'])}")
    if any(r["ik"] for r in rows):
        print(f"ik_llama.cpp build: {next(next(iter(r['ik'].values()))['build'] for r in rows if r['ik'])}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "machine": mach, "threads": a.threads, "n_prompt": a.n_prompt, "n_gen": a.n_gen, "reps": a.reps,
            "depths": depths, "depth_reps": dreps, "dram_before": dram0, "dram_after": dram1,
            "load_before": load0, "load_after": load1, "rows": rows}, indent=1, default=str) + "\n")
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
