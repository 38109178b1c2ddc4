#!/usr/bin/env python3
"""Quality of TensorFold's quantizer against llama.cpp's imatrix quants, side by side.

One run does everything on the same machine and texts:
  1. the base model: SmolLM2-135M-Instruct's Q4_1 weights held in F16 (`tensorfold quantize
     --keep '*=F16'`), or --base F16.gguf;
  2. calibration and evaluation texts kept apart: alternate topics of Python's own
     documentation (pydoc_data, shipped with every CPython), or --calib-text / --eval-text;
  3. llama.cpp: `llama-imatrix` on the calibration text, then `llama-quantize --imatrix`
     for each of --llama-types;
  4. TensorFold: `tensorfold calibrate` on the same text, `tensorfold quantize --target-bpw`
     sized to each of --sizes (file sizes in MB), its sensitivity probes also on the
     calibration text (--probe-text);
  5. every file measured against the base with `tensorfold eval` (perplexity, KLD mean/p99,
     same top token) on the same evaluation chunks;
  6. a table, and for each TensorFold file the ratio of its mean KLD to that of every
     llama.cpp file of the same or larger size (the nearest such file, and the worst ratio).

    python3 bench/quant_quality.py --llama-bin $LLAMA_BIN --sizes 85.5,93,104.5
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def run(cmd: list[str], log: str | None = None) -> None:
    t0 = time.time()
    print("$", " ".join(cmd), flush=True)
    with open(log, "w") if log else open(os.devnull, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(cmd)}" + (f"; see {log}" if log else ""))
    print(f"  ({time.time() - t0:.0f} s)", flush=True)


def tf(*args: str) -> list[str]:
    return [sys.executable, "-m", "tensorfold", *args]


def texts(work: str) -> tuple[str, str]:
    from pydoc_data.topics import topics

    keys = sorted(topics)
    calib = os.path.join(work, "calib.txt")
    evalt = os.path.join(work, "eval.txt")
    with open(calib, "w", encoding="utf-8") as f:
        f.write("\n\n".join(topics[k] for i, k in enumerate(keys) if i % 2 == 0))
    with open(evalt, "w", encoding="utf-8") as f:
        f.write("\n\n".join(topics[k] for i, k in enumerate(keys) if i % 2 == 1))
    return calib, evalt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN"), help="llama.cpp's build/bin")
    ap.add_argument("--base", default=None, help="F16 GGUF to start from (default: SmolLM2 Q4_1 held in F16)")
    ap.add_argument("--work", default="/tmp/tf-quant-quality")
    ap.add_argument("--sizes", default="85.5,93,104.5", help="TensorFold file sizes in MB (1e6 bytes)")
    ap.add_argument("--llama-types", default="IQ2_M,IQ3_XXS,Q2_K,Q3_K_M,Q4_K_M")
    ap.add_argument("--calib-text", default=None)
    ap.add_argument("--eval-text", default=None)
    ap.add_argument("--calib-chunks", type=int, default=100)
    ap.add_argument("--eval-chunks", type=int, default=40)
    ap.add_argument("--probe-chunks", type=int, default=4, help="tensorfold quantize --probe-chunks")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not a.llama_bin:
        raise SystemExit("give --llama-bin (llama.cpp's build/bin with llama-imatrix and llama-quantize)")
    os.makedirs(a.work, exist_ok=True)
    w = lambda name: os.path.join(a.work, name)  # noqa: E731
    th = str(a.threads)

    calib, evalt = texts(a.work)
    calib = a.calib_text or calib
    evalt = a.eval_text or evalt
    base = a.base
    if base is None:
        from tensorfold.pull import pull

        base = w("base-f16.gguf")
        if not os.path.exists(base):
            run(tf("quantize", pull(), "-o", base, "--keep", "*=F16", "-q"))

    # llama.cpp's imatrix quants
    imat = w("llama-imatrix.gguf")
    if not os.path.exists(imat):
        run([os.path.join(a.llama_bin, "llama-imatrix"), "-m", base, "-f", calib, "-o", imat, "-c", "512",
             "--chunks", str(a.calib_chunks), "-t", th], w("llama-imatrix.log"))
    files: list[tuple[str, str]] = []
    for t in a.llama_types.split(","):
        out = w(f"llama-{t}.gguf")
        if not os.path.exists(out):
            run([os.path.join(a.llama_bin, "llama-quantize"), "--imatrix", imat, base, out, t, th],
                w(f"llama-quantize-{t}.log"))
        files.append((f"llama.cpp {t}", out))

    # TensorFold: calibrate once, then one file per size
    ours_imat = w("tf-calib.gguf")
    if not os.path.exists(ours_imat):
        run(tf("calibrate", base, "--text", calib, "-o", ours_imat, "--chunks", str(a.calib_chunks), "-t", th,
               "-q"))
    from tensorfold import _core

    f = _core.GgufFile(base)
    n_el = sum(int(__import__("math").prod(t["shape"])) for t in f.tensors())
    overhead = f.file_size - sum(t["nbytes"] for t in f.tensors()) + 64 * 1024  # metadata + our recipe
    for mb in (float(s) for s in a.sizes.split(",")):
        bpw = 8 * (mb * 1e6 - overhead) / n_el
        out = w(f"tf-{mb:g}MB.gguf")
        run(tf("quantize", base, "-o", out, "--target-bpw", f"{bpw:.4f}", "--calib", ours_imat, "--probe-text",
               calib, "--probe-chunks", str(a.probe_chunks), "-t", th, "-q"), w(f"tf-quantize-{mb:g}.log"))
        files.append((f"TensorFold {bpw:.3f} bpw", out))

    rows = []
    for label, path in files:
        js = path + ".eval.json"
        run(tf("eval", path, "--ref", base, "--text", evalt, "--chunks", str(a.eval_chunks), "-t", th, "-q",
               "--json", js))
        with open(js) as fh:
            r = json.load(fh)
        rows.append({"label": label, "path": path, "bytes": os.path.getsize(path), **r})

    print(f"\nbase: {base}; calibration {calib} ({a.calib_chunks} chunks), evaluation {evalt} "
          f"({a.eval_chunks} chunks of 512, second halves scored)")
    print(f"{'file':<28} {'MB':>7} {'bpw':>6} {'KLD mean':>9} {'KLD p99':>8} {'top-1':>7} {'PPL':>8}")
    for r in sorted(rows, key=lambda r: r["bytes"]):
        print(f"{r['label']:<28} {r['bytes'] / 1e6:>7.2f} {8 * r['bytes'] / n_el:>6.3f} {r['kld_mean']:>9.5f} "
              f"{r['kld_p99']:>8.4f} {100 * r['same_top']:>6.2f}% {r['ppl']:>8.4f}")
    print(f"(base perplexity {rows[0]['ppl_ref']:.4f})")
    print("\nTensorFold mean KLD / llama.cpp mean KLD, against every llama.cpp file of the same or larger size:")
    for r in rows:
        if not r["label"].startswith("TensorFold"):
            continue
        cmp = [q for q in rows if q["label"].startswith("llama") and q["bytes"] >= r["bytes"]]
        parts = ", ".join(f"{q['label'].split()[-1]} {r['kld_mean'] / q['kld_mean']:.3f}" for q in cmp)
        worst = max((r["kld_mean"] / q["kld_mean"] for q in cmp), default=float("nan"))
        near = min(cmp, key=lambda q: q["bytes"], default=None)
        nearest = f"nearest ({near['label'].split()[-1]}) {r['kld_mean'] / near['kld_mean']:.3f}" if near else ""
        print(f"  {r['label']} ({r['bytes'] / 1e6:.2f} MB): {parts or 'no llama.cpp file that large'}; "
              f"{nearest}; worst {worst:.3f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
