#!/usr/bin/env python3
"""Static speed estimate of TensorFold's aarch64 product kernels against llama.cpp's, for a
model CPU (llvm-mca's neoverse-v2 by default), without ARM hardware.

Method (the same for both sides):
  1. bench/arm_mca_harness.cpp is linked with TensorFold's i8mm kernel build and with
     llama.cpp's ggml-cpu ARM quants.c and repack.cpp, all compiled by one compiler with one
     set of flags (-O3 -march=armv8.2-a+dotprod+i8mm, the flags CMake gives our i8mm level).
  2. qemu-aarch64 runs one kernel call (decode: 8 rows x 2048 weights; prefill: 32 rows x 1024 x 32 columns) with
     instruction tracing; the instructions executed between the harness's two markers are the
     call's dynamic instruction stream — every loop iteration, every prologue, the activation
     repacks and block decodes included.
  3. llvm-mca times that stream for the model CPU (L1-resident data: both sides equally).
     The unit is 256 multiply-accumulates (SDOT = 16, SMMLA = 32), i.e. cycles per 256 weights
     for one activation column: decode = 1 column, prefill = per column of a 32-column call.

llama.cpp's paths: vec_dot (nrc = 1, its decode), vec_dot2 (nrc = 2, SMMLA 2x2, where it has
one), gemv / gemm (the repacked interleaved-rows kernels of repack.cpp, where it has them). The
bar compares ours with llama.cpp's best path of each kind.

Needs g++-aarch64-linux-gnu, qemu-user and llvm-mca >= 17 (neoverse-v2; apt install llvm-19).
Usage: bench/arm_mca.py [--llama DIR] [--mcpu neoverse-v2] [--out bench/results/arm_mca.txt]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["-O3", "-DNDEBUG", "-march=armv8.2-a+dotprod+i8mm"]
FORMATS = ["Q4_K", "Q6_K", "Q8_0", "IQ2_XXS", "IQ3_XXS", "IQ4_XS", "MXFP4"]
OURS_SOURCES = ["csrc/backend/cpu/arm/kernels_i8mm.cpp", "csrc/backend/cpu/kernels_scalar.cpp",
                "csrc/quant/tables/iq_tables.cpp"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "csrc/backend/cpu/formats").glob("*.cpp"))
DEFAULT_LLAMA = "/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"
MAC_PER_INSN = {"sdot": 16, "udot": 16, "usdot": 16, "sudot": 16, "smmla": 32, "ummla": 32, "usmmla": 32}


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def build(work: Path, llama: Path) -> Path:
    ggml = llama / "ggml"
    inc = [f"-I{ggml / 'include'}", f"-I{ggml / 'src'}", f"-I{ggml / 'src' / 'ggml-cpu'}"]
    objs = []
    for src in OURS_SOURCES:
        o = work / (src.replace("/", "_") + ".o")
        run(["aarch64-linux-gnu-g++", "-std=c++17", *FLAGS, "-DTF_HAVE_ARM_KERNELS=1", f"-I{ROOT / 'csrc'}", "-c",
             str(ROOT / src), "-o", str(o)])
        objs.append(o)
    arm = ggml / "src" / "ggml-cpu" / "arch" / "arm"
    run(["aarch64-linux-gnu-gcc", *FLAGS, *inc, "-c", str(arm / "quants.c"), "-o", str(work / "llama_quants.o")])
    run(["aarch64-linux-gnu-g++", "-std=c++17", *FLAGS, *inc, "-c", str(arm / "repack.cpp"), "-o",
         str(work / "llama_repack.o")])
    exe = work / "arm_mca_harness"
    run(["aarch64-linux-gnu-g++", "-std=c++17", *FLAGS, "-static", str(ROOT / "bench" / "arm_mca_harness.cpp"),
         *map(str, objs), str(work / "llama_quants.o"), str(work / "llama_repack.o"), "-o", str(exe)])
    return exe


def disassembly(exe: Path) -> tuple[dict[int, str], dict[str, int]]:
    text = run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", str(exe)])
    insns, syms = {}, {}
    for line in text.splitlines():
        m = re.match(r"^([0-9a-f]+) <([^>]+)>:$", line)
        if m:
            syms[m.group(2)] = int(m.group(1), 16)
            continue
        m = re.match(r"^\s+([0-9a-f]+):\s+(.*)$", line)
        if m:
            insns[int(m.group(1), 16)] = m.group(2)
    return insns, syms


def mca_text(insn: str) -> str:
    """objdump's GNU syntax as llvm-mc accepts it: addresses of branch/literal targets become '.'."""
    insn = insn.split("//")[0]
    insn = re.sub(r"\b[0-9a-f]+ <[^>]*>", ".", insn)
    insn = insn.replace("\t", " ").strip()
    # calls and returns as plain branches: llvm-mca would charge a call 100 cycles
    if re.match(r"^(bl|blr|ret)\b", insn):
        return "b ."
    return insn


def trace(exe: Path, case: str, insns: dict[int, str], syms: dict[str, int], work: Path) -> list[str]:
    log = work / "qemu.log"
    if log.exists():
        log.unlink()
    r = subprocess.run(["qemu-aarch64", "-cpu", "max", "-d", "in_asm,exec,nochain", "-D", str(log), str(exe), case],
                       capture_output=True, text=True)
    if r.returncode == 3:
        return []  # the harness says: no such path
    if r.returncode != 0:
        raise RuntimeError(f"{case}: rc {r.returncode} {r.stderr[-2000:]}")
    tbs: dict[int, list[int]] = {}
    seq: list[int] = []
    cur: list[int] | None = None
    begin, end = syms["tf_mca_begin"], syms["tf_mca_end"]
    for line in log.open():
        if line.startswith("IN:"):
            cur = []
            continue
        m = re.match(r"^0x([0-9a-f]+):\s", line)
        if m and cur is not None:
            a = int(m.group(1), 16)
            if not cur:
                tbs[a] = cur
            cur.append(a)
            continue
        if line.startswith("Trace "):
            cur = None
            m = re.search(r"\[[0-9a-f]+/([0-9a-f]+)/", line)
            if m:
                seq.append(int(m.group(1), 16))
    try:
        i0 = seq.index(begin)
        i1 = seq.index(end, i0)
    except ValueError:
        raise RuntimeError(f"{case}: markers not found in the trace")
    out = []
    for pc in seq[i0 + 1:i1]:
        for a in tbs[pc]:
            out.append(mca_text(insns[a]))
    # drop the return into the harness after tf_mca_begin's ret: it is the harness, not the kernel
    return out


def mca(stream: list[str], mcpu: str, mca_bin: str, work: Path) -> float:
    s = work / "stream.s"
    s.write_text("\n".join(stream) + "\n")
    out = run([mca_bin, "-mtriple=aarch64", f"-mcpu={mcpu}", "-iterations=2",
               "-skip-unsupported-instructions=lack-sched", str(s)])
    cycles = int(re.search(r"Total Cycles:\s+(\d+)", out).group(1))
    return cycles / 2.0


def macs(stream: list[str]) -> int:
    n = 0
    for i in stream:
        op = i.split()[0] if i else ""
        n += MAC_PER_INSN.get(op, 0)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama", default=os.environ.get("LLAMA_CPP_DIR", DEFAULT_LLAMA))
    ap.add_argument("--mcpu", default="neoverse-v2")
    ap.add_argument("--mca", default=shutil.which("llvm-mca-19") or "/usr/lib/llvm-19/bin/llvm-mca")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "arm_mca.txt"))
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset (default: all seven)")
    args = ap.parse_args()
    for tool in ("aarch64-linux-gnu-g++", "qemu-aarch64", "aarch64-linux-gnu-objdump"):
        if not shutil.which(tool):
            print(f"missing {tool}", file=sys.stderr)
            return 2
    lines = []

    def emit(s=""):
        print(s, flush=True)
        lines.append(s)

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        exe = build(work, Path(args.llama))
        insns, syms = disassembly(exe)
        version = run([args.mca, "--version"]).splitlines()
        emit(f"llvm-mca -mcpu={args.mcpu} ({next((v.strip() for v in version if 'version' in v), '?')}); "
             f"compiler {run(['aarch64-linux-gnu-g++', '--version']).splitlines()[0]}; flags {' '.join(FLAGS)}")
        emit("cycles per 256 weights x 1 activation column (256 MACs), whole-call dynamic instruction stream")
        emit("decode: 8 rows x 2048 weights x 1 column; prefill: 32 rows x 1024 weights x 32 columns")
        emit("")
        hdr = f"{'format':8} {'kind':8} {'ours':>7} | {'llama best':>10} {'(path)':12} | llama paths"
        emit(hdr)
        emit("-" * len(hdr) + "-" * 30)
        verdict = []
        for fmt in args.formats.split(","):
            res = collections.OrderedDict()
            for case in [f"ours:{fmt}:decode", f"ours:{fmt}:prefill", f"llama:{fmt}:vec_dot", f"llama:{fmt}:vec_dot2",
                         f"llama:{fmt}:gemv", f"llama:{fmt}:gemm"]:
                st = trace(exe, case, insns, syms, work)
                if not st:
                    continue
                n = macs(st)
                if n == 0:
                    raise RuntimeError(f"{case}: no dot-product instructions in the trace")
                res[case.split(":", 2)[2]] = (mca(st, args.mcpu, args.mca, work) / (n / 256.0), len(st), n)
            for kind, ours_key, llama_keys in (("decode", "decode", ["vec_dot", "gemv"]),
                                               ("prefill", "prefill", ["vec_dot", "vec_dot2", "gemm"])):
                ours = res[ours_key][0]
                paths = {k: res[k][0] for k in llama_keys if k in res}
                best = min(paths, key=paths.get)
                ok = ours <= paths[best]
                verdict.append((fmt, kind, ok))
                detail = ", ".join(f"{k} {v:.1f}" for k, v in paths.items())
                emit(f"{fmt:8} {kind:8} {ours:7.1f} | {paths[best]:10.1f} {('(' + best + ')'):12} | {detail}"
                     f"{'' if ok else '   <-- above llama.cpp'}")
        emit("")
        bad = [f"{f} {k}" for f, k, ok in verdict if not ok]
        emit("bar (ours <= llama.cpp's best path): " + ("met for all" if not bad else "NOT met for " + ", ".join(bad)))
    if args.formats == ",".join(FORMATS):  # only a full run replaces the saved table
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
