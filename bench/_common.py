"""Helpers shared by the pytest-benchmark microbenchmarks in bench/ (bench_*.py).

Environment (all optional):
  TF_BENCH_THREADS    threads of every backend and of the DRAM probe (default 2)
  TF_BENCH_GEMV_MB    size of the decode-shape weight matrices and of the DRAM probe's buffer
                      (default 4 x the L3 cache, so that a call cannot be served from the L3)
  TF_BENCH_BACKENDS   "all" for every backend of _core.available_backends(), or a comma list
                      such as "cpu:avx2,cpu:scalar" (default: the first, i.e. the best CPU ISA)
  TF_BENCH_POOL_ROWS  distinct quantized rows a weight matrix is tiled from (default 256)
and, for one file each, TF_BENCH_GEMM_ROWS (bench_products.py), TF_BENCH_MAX_CONTEXT
(bench_attention.py).

Also the llama-bench runner of the end-to-end scripts (bench/e2e*.py): mainline llama.cpp's
llama-bench and ik_llama.cpp's (github.com/ikawrakow/ik_llama.cpp) take the same -m -t -p -n -r
-o json; ik's has no -d (decode at depth is -gp DEPTH,N there) and adds -rtr 0|1 (run-time
repacking of the weights to its row-interleaved layouts, its best CPU setting).
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import time

import numpy as np

from tensorfold import _core

THREADS = int(os.environ.get("TF_BENCH_THREADS", "2"))
POOL_ROWS = int(os.environ.get("TF_BENCH_POOL_ROWS", "256"))
MB = 1e6

# One dict per measured case, printed as a table at the end of the session (conftest.py).
RESULTS: list[dict] = []
# The session's DRAM read bandwidth in GB/s, once measured (conftest.py's dram_gbps fixture).
DRAM_GBPS: list[float] = []


def l3_bytes() -> int:
    """Total L3 of this machine: each distinct L3 instance counted once (sysfs, else lscpu)."""
    seen: dict[str, int] = {}
    for d in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            with open(f"{d}/level") as f:
                if f.read().strip() != "3":
                    continue
            with open(f"{d}/shared_cpu_list") as f:
                cpus = f.read().strip()
            with open(f"{d}/size") as f:
                size = f.read().strip()
        except OSError:
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", size)
        if m:
            seen[cpus] = int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]
    if seen:
        return sum(seen.values())
    try:
        out = subprocess.run(["lscpu", "-B"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"^L3 cache:\s*(\d+)", out, re.M)
        if m:
            return int(m.group(1))
    except (OSError, subprocess.SubprocessError):
        pass
    return 32 << 20


L3_BYTES = l3_bytes()
GEMV_BYTES = int(float(os.environ["TF_BENCH_GEMV_MB"]) * MB) if "TF_BENCH_GEMV_MB" in os.environ else 4 * L3_BYTES


def backend_names() -> list[str]:
    """Backends to run: the best CPU ISA by default (see TF_BENCH_BACKENDS)."""
    avail = list(_core.available_backends())
    want = os.environ.get("TF_BENCH_BACKENDS", "").strip()
    if want == "all":
        return avail
    if want:
        return [n for n in want.split(",") if n]
    return [next((n for n in avail if n.startswith("cpu")), avail[0])]


def make_backend(name: str):
    """The backend, or a skip naming why it cannot run here (e.g. a CUDA backend without forward)."""
    import pytest

    try:
        return _core.Backend(name, THREADS)
    except (ValueError, RuntimeError) as e:
        pytest.skip(f"backend {name}: {e}")


def isa_of(backend_name: str) -> str:
    """The kernels' impl name of a CPU backend name ('cpu:avx2' -> 'avx2'; 'cpu' -> 'auto')."""
    return backend_name.split(":", 1)[1] if ":" in backend_name else "auto"


def measure_dram_gbps(nbytes: int = 0, threads: int = THREADS, reps: int = 20) -> float:
    """DRAM read bandwidth: `threads` threads streaming a buffer of nbytes (default GEMV_BYTES,
    several times the L3), best of `reps` after a first pass that faults the pages in (as many
    as the decode products' rounds: on a shared host the best of few passes is low)."""
    a = np.ones(nbytes or GEMV_BYTES, dtype=np.uint8)
    _core.kernels_read_bytes(a, threads)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        _core.kernels_read_bytes(a, threads)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


_pools: dict[tuple[int, int], np.ndarray] = {}


def quantized_rows(type_id: int, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """rows x k weights of a format as raw bytes [rows, row_bytes]: POOL_ROWS random-normal rows
    quantized by TensorFold's own quantizer (valid scales and grid indices, finite products),
    repeated to `rows` (quantizing every row of a big matrix would take minutes for IQ formats;
    repeated rows cost the same to read and multiply)."""
    key = (int(type_id), k)
    if key not in _pools:
        rng = np.random.default_rng(seed + 7919 * int(type_id) + k)
        x = rng.standard_normal((POOL_ROWS, k), dtype=np.float32) * np.float32(0.02)
        try:
            _pools[key] = np.ascontiguousarray(_core.quantize_rows(int(type_id), x, None, THREADS))
        except (ValueError, RuntimeError) as e:
            import pytest

            pytest.skip(f"type {type_id}: no quantizer to make weights ({e})")
    pool = _pools[key]
    if pool.shape[0] >= rows:
        return pool[:rows].copy()
    return np.resize(pool, (rows, pool.shape[1]))


def best_seconds(benchmark) -> float | None:
    """Fastest round of a finished benchmark (None when benchmarks are disabled)."""
    stats = getattr(benchmark, "stats", None)
    return stats.stats.min if stats is not None else None


def record(benchmark, group: str, case: str, **fields) -> None:
    """Stores the derived figures in benchmark.extra_info (shown by --benchmark-json) and in the
    session table. fields: GB_s, frac_of_dram, GFLOP_s, and anything else worth a column."""
    sec = best_seconds(benchmark)
    if sec is None:
        return
    fields = {k: v for k, v in fields.items() if v is not None}
    benchmark.extra_info.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in fields.items()})
    benchmark.extra_info["threads"] = THREADS
    if "frac_of_dram" in fields and DRAM_GBPS:
        benchmark.extra_info["dram_GB_s"] = round(DRAM_GBPS[0], 2)
    RESULTS.append({"group": group, "case": case, "ms": sec * 1e3, **fields})


# ------------------------------------------------------------------------------------------------
# llama-bench (mainline llama.cpp and ik_llama.cpp) for the end-to-end scripts


# The ik_llama.cpp columns: its llama-bench without and with run-time repacking (-rtr takes one
# value per run, so each is its own run). The ratios are taken against IK_BEST.
IK_RTR = (0, 1)
IK_BEST = 1


def llama_env(binary: str) -> dict:
    """The environment for a shared-library llama.cpp build: its bin/ on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.dirname(os.path.abspath(binary)) + ":" + env.get("LD_LIBRARY_PATH", "")
    return env


def run_llama_bench(binary: str, model: str, threads: int, args: list, log_path=None) -> list[dict]:
    """The JSON rows of `binary -m model -t threads ARGS -o json`. With log_path its stderr (all of
    it with -v in ARGS) goes to that file; a failure raises with the last lines of it."""
    cmd = [binary, "-m", model, "-t", str(threads), *map(str, args), "-o", "json"]
    if log_path:
        with open(log_path, "w") as err:
            out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=llama_env(binary),
                                 stdin=subprocess.DEVNULL)
        tail = "\n".join(open(log_path, errors="replace").read().splitlines()[-10:])
    else:
        out = subprocess.run(cmd, capture_output=True, text=True, env=llama_env(binary), stdin=subprocess.DEVNULL)
        tail = out.stderr[-2000:]
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:1] + [str(a) for a in args])} failed ({out.returncode}): {tail}")
    return json.loads(out.stdout)


def _build(row: dict) -> str:
    return f"{row.get('build_commit', '?')} ({row.get('build_number', '?')})"


def measure_llama_bench(binary: str, model: str, threads: int, n_prompt: int, n_gen: int, reps: int,
                        extra=()) -> dict:
    """pp and tg tok/s (mean and sd over -r reps) from `llama-bench -p N -n M -r R [extra]`."""
    res = {}
    for row in run_llama_bench(binary, model, threads, ["-p", n_prompt, "-n", n_gen, "-r", reps, *extra]):
        key = "pp" if row["n_prompt"] > 0 else "tg"
        res[key] = row["avg_ts"]
        res[key + "_sd"] = row["stddev_ts"]
        res["build"] = _build(row)
    return res


def measure_llama_depth(binary: str, model: str, threads: int, depths: list[int], n_gen: int, reps: int,
                        extra=(), ik: bool = False, log_path=None, verbose: bool = False) -> dict:
    """{depth: {"tg", "tg_sd", "samples"}}: decode of n_gen tokens after `depth` tokens of context,
    which llama-bench fills untimed; all depths in one run. Mainline: `-p 0 -n n_gen -d N1,N2,...`
    (rows with n_prompt 0, depth in n_depth). ik_llama.cpp (ik=True): `-p 0 -n 0 -gp N1,n_gen -gp
    N2,n_gen ...` (rows "tgM@ppN": n_prompt N, only the n_gen tokens timed)."""
    if ik:
        args = ["-p", 0, "-n", 0]
        for d in depths:
            args += ["-gp", f"{d},{n_gen}"]
    else:
        args = ["-p", 0, "-n", n_gen, "-d", ",".join(str(d) for d in depths)]
    args += ["-r", reps, *extra] + (["-v"] if verbose else [])
    res = {}
    for row in run_llama_bench(binary, model, threads, args, log_path):
        if row["n_gen"] <= 0:
            continue
        if ik:
            d = int(row["n_prompt"])
        elif row["n_prompt"] == 0:
            d = int(row.get("n_depth", 0))
        else:
            continue
        res[d] = {"tg": row["avg_ts"], "tg_sd": row["stddev_ts"], "samples": row.get("samples_ts"),
                  "build": _build(row)}
    return res


def ik_args(rtr: int) -> list:
    """The extra llama-bench arguments of ik_llama.cpp's column `rtr`."""
    return ["-rtr", rtr]
