#!/usr/bin/env python3
"""Quantize a synthetic F16 MoE with llama.cpp's own quantizer, for side-by-side benchmarks.

    LLAMA_BIN=/tmp/dl/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
    python bench/make_quantized_moe.py --llama-bin $LLAMA_BIN                  # all of the below
    python bench/make_quantized_moe.py --llama-bin $LLAMA_BIN --types Q2_K,IQ2_XXS --out-dir /tmp/moe
    python bench/make_quantized_moe.py --llama-bin $LLAMA_BIN --model deepseek2 --types Q2_K,Q4_K_M \\
        --out-dir /tmp/dsb                                                      # synth-ds2-*.gguf
    python bench/make_quantized_moe.py --llama-bin $LLAMA_BIN --model deepseek4 --types Q2_K,Q4_K_M \\
        --out-dir /tmp/ds4b                                                     # synth-ds4-*.gguf

--model picks the generator: qwen3moe (default; bench/make_synthetic_moe.py, files synth-moe-*),
deepseek2 (bench/make_synthetic_deepseek2.py, DeepSeek-V3-like MLA + grouped sigmoid-routed
experts, files synth-ds2-*) or deepseek4 (bench/make_synthetic_deepseek4.py, DeepSeek-V4-Flash
proportions scaled down, made through transformers + `tensorfold convert`, files synth-ds4-*).

1. Unless --f16 names an existing file, writes OUT_DIR/synth-moe-f16.gguf with
   `bench/make_synthetic_moe.py --outtype f16` (default 4 GB: 6 Qwen3-30B-A3B-like layers;
   --size-gb or --gen-args change it), or with --model deepseek2 OUT_DIR/synth-ds2-f16.gguf with
   `bench/make_synthetic_deepseek2.py` (default 4 layers, 1.6 GB; --size-gb picks the layers,
   --gen-args "--layers 8 --experts 128 ..." any other shape), or with --model deepseek4
   OUT_DIR/synth-ds4-f16.gguf with `bench/make_synthetic_deepseek4.py` (8 layers, 1.8 GB).
2. Makes an importance matrix with `llama-imatrix` on a short text (--text, default
   tests/fixtures/quant/calibration.txt, 128-token chunks): llama.cpp refuses IQ2_XXS/IQ2_XS/
   IQ1_* without one, and community low-bit files are made with one.
3. `llama-quantize --imatrix` to each of --types (default Q2_K, Q4_K_M, IQ2_XXS, IQ3_XXS,
   IQ4_XS) → OUT_DIR/synth-moe-TYPE.gguf, with llama.cpp's standard per-tensor mixes (attn_v and
   ffn_down_exps with more bits, token_embd/output in their own types). Existing outputs are
   kept unless --force.

Then: python bench/e2e_formats.py --llama-bench $LLAMA_BIN/llama-bench OUT_DIR/synth-moe-*.gguf
(or OUT_DIR/synth-ds2-*.gguf, with --depth 0 4096 ... for decode at a given context; for
OUT_DIR/synth-ds4-*.gguf: bench/e2e_deepseek4.py).
Files go to /tmp (several GB), never into the repository. IQ2_XXS/IQ3_XXS quantization is slow
(minutes per GB of output on 2 threads).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# --model: (generator script, file stem, default --size-gb for the generator or None to leave it
# to the generator's own default shape)
MODELS = {"qwen3moe": ("make_synthetic_moe.py", "synth-moe", 4.0),
          "deepseek2": ("make_synthetic_deepseek2.py", "synth-ds2", None),
          "deepseek4": ("make_synthetic_deepseek4.py", "synth-ds4", None)}
# extra llama-quantize arguments per --model. deepseek4: llama-imatrix records attn_output_a's
# input as the whole grouped activation (heads x head_dim = 8192 values) while the tensor's rows
# are one group's slice (2048): llama-quantize refuses that entry ("imatrix size 8192 is different
# from tensor size 2048"), so those tensors are quantized without an importance matrix.
QUANTIZE_ARGS = {"deepseek4": ["--exclude-weights", "attn_output_a"]}
DEFAULT_TYPES = ["Q2_K", "Q4_K_M", "IQ2_XXS", "IQ3_XXS", "IQ4_XS"]
DEFAULT_TEXT = HERE.parent / "tests" / "fixtures" / "quant" / "calibration.txt"


def run(cmd: list[str], env: dict, log: Path) -> None:
    print("  $ " + " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        r = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise SystemExit(f"{Path(cmd[0]).name} failed ({r.returncode}), log {log}:\n" + "\n".join(tail))
    print(f"    {time.perf_counter() - t0:.0f} s (log {log})", flush=True)


def type_summary(path: Path) -> str:
    import gguf

    by: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        by[t.tensor_type.name] = by.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN"),
                    help="folder holding llama-quantize and llama-imatrix (env LLAMA_BIN)")
    ap.add_argument("--out-dir", default="/tmp", help="where the GGUFs go (default /tmp)")
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3moe",
                    help="generator of the F16 file: qwen3moe (make_synthetic_moe.py, default), "
                         "deepseek2 (make_synthetic_deepseek2.py) or deepseek4 (make_synthetic_deepseek4.py)")
    ap.add_argument("--f16", default=None,
                    help="existing F16 GGUF to quantize (default: generate OUT_DIR/synth-moe-f16.gguf, "
                         "or synth-ds2-f16.gguf / synth-ds4-f16.gguf with --model deepseek2 / deepseek4)")
    ap.add_argument("--size-gb", type=float, default=None,
                    help="size of the generated F16 file (default 4 for qwen3moe; deepseek2: its default "
                         "4 layers, 1.6 GB; deepseek4 has no --size-gb: shape it with --gen-args)")
    ap.add_argument("--gen-args", default="", help="extra arguments for the generator script (quoted)")
    ap.add_argument("--types", default=",".join(DEFAULT_TYPES), help="comma-separated llama-quantize types")
    ap.add_argument("--text", default=str(DEFAULT_TEXT), help="calibration text for llama-imatrix")
    ap.add_argument("--chunk", type=int, default=128, help="llama-imatrix context per chunk")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="redo the imatrix and outputs that exist")
    a = ap.parse_args()
    if not a.llama_bin:
        ap.error("--llama-bin (or env LLAMA_BIN) is required")
    bin_dir = Path(a.llama_bin)
    for tool in ("llama-quantize", "llama-imatrix"):
        if not (bin_dir / tool).is_file():
            ap.error(f"{bin_dir / tool} not found")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(bin_dir) + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    types = [t.strip() for t in a.types.split(",") if t.strip()]

    script, stem, default_gb = MODELS[a.model]
    f16 = Path(a.f16) if a.f16 else out / f"{stem}-f16.gguf"
    if not f16.exists():
        if a.f16:
            ap.error(f"{f16} does not exist")
        print(f"[1/3] generating {f16}", flush=True)
        size_gb = a.size_gb if a.size_gb is not None else default_gb
        subprocess.run([sys.executable, str(HERE / script), "-o", str(f16), "--outtype", "f16",
                        *(["--size-gb", str(size_gb)] if size_gb is not None else []),
                        "--threads", str(a.threads), *shlex.split(a.gen_args)],
                       check=True)
    else:
        print(f"[1/3] using {f16} ({f16.stat().st_size / 1e9:.2f} GB)", flush=True)

    imat = out / (f16.stem + ".imatrix.gguf")
    if a.force or not imat.exists():
        print(f"[2/3] importance matrix on {a.text}", flush=True)
        run([bin_dir / "llama-imatrix", "-m", f16, "-f", a.text, "-o", imat, "-c", a.chunk, "-b", a.chunk,
             "-t", a.threads, "--no-ppl"], env, out / (imat.name + ".log"))
    else:
        print(f"[2/3] using {imat}", flush=True)

    print(f"[3/3] quantizing to {', '.join(types)}", flush=True)
    stem = f16.stem[:-4] if f16.stem.endswith("-f16") else f16.stem
    for t in types:
        dst = out / f"{stem}-{t}.gguf"
        if dst.exists() and not a.force:
            print(f"  {dst} exists", flush=True)
        else:
            tmp = dst.with_suffix(".gguf.part")
            run([bin_dir / "llama-quantize", "--imatrix", imat, *QUANTIZE_ARGS.get(a.model, []), f16, tmp, t,
                 a.threads], env,
                out / (dst.name + ".log"))
            os.replace(tmp, dst)
        print(f"  {dst.name}: {dst.stat().st_size / 1e9:.3f} GB — {type_summary(dst)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
