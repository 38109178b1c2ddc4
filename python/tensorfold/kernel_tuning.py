"""Measured kernel dispatch for the CPU backend.

The CPU backend asked for "the best this CPU has" (``backend="cpu"``) runs each weight format's
products with the instruction set measured fastest for it on this machine, per shape class
(decode: a few activation columns, the weights streamed once; prefill: many columns). On Zen 4,
for example, the AVX-512 K-quant decode products lose to the AVX2 ones while AVX-512 wins most
prefill tiles. Each (format, class) is timed once, on first use, with every instruction set the
CPU has (about half a second per format), and the result is cached per CPU model and build in
``$TENSORFOLD_HOME/kernel-choice.json`` (``~/.cache/tensorfold`` by default).

``TENSORFOLD_KERNEL_TUNING=off`` skips the measurement: every product then uses the highest
instruction set. An explicit ``backend="cpu:avx2"`` (etc.) always runs that set's kernels.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Iterable

from . import _core

__all__ = ["SHAPE_CLASSES", "cache_path", "enabled", "machine_key", "tune", "choices"]

SHAPE_CLASSES = ("decode", "prefill")
_CACHE_VERSION = 1
_REPS = 3
# Variants worth timing: the vector ones (scalar is the reference, never faster).
_VECTOR_ISAS = ("avx512", "avx2", "i8mm", "dotprod", "neon")


def enabled() -> bool:
    return os.environ.get("TENSORFOLD_KERNEL_TUNING", "on").strip().lower() not in ("0", "off", "no", "false")


def cache_path() -> Path:
    home = os.environ.get("TENSORFOLD_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "tensorfold"
    return base / "kernel-choice.json"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "CPU part", "Model"):
                    return value.strip()
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """The CPU model, its instruction sets and this build of the native core: a choice measured
    under one key says nothing about another."""
    core = Path(_core.__file__)
    try:
        st = core.stat()
        build = f"{st.st_size}-{int(st.st_mtime)}"
    except OSError:
        build = "unknown"
    isas = ",".join(_candidates())
    digest = hashlib.sha256(f"{_cpu_model()}|{isas}|{build}".encode()).hexdigest()[:16]
    return f"{_cpu_model()} [{isas}] {digest}"


def _candidates() -> list[str]:
    have = {name.split(":", 1)[1] for name in _core.available_backends() if name.startswith("cpu:")}
    return [isa for isa in _VECTOR_ISAS if isa in have]


def _decode_bytes() -> int:
    """Decode timings read a matrix twice the last-level cache (from DRAM, as a model's are)."""
    l3 = 0
    with contextlib.suppress(OSError, ValueError):
        for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            size = (idx / "size").read_text().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            l3 = max(l3, int(size.rstrip("KMG")) * mult)
    return max(2 * l3, 32 << 20)


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION or not isinstance(data.get("machines"), dict):
        return {}
    return data


def _save(path: Path, data: dict) -> None:
    # Atomic: a concurrent reader sees the old file or the new one, never half of one.
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernel-choice.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def _type_id(name: str) -> int | None:
    import gguf
    t = getattr(gguf.GGMLQuantizationType, name, None)
    return None if t is None else int(t)


def tune(type_names: Iterable[str], threads: int, *, quiet: bool = False) -> dict[str, dict[str, str]]:
    """Records the fastest kernel per (format, shape class) for every computable format in
    `type_names`, measuring what the cache does not hold; returns {format: {class: isa}}."""
    if not enabled():
        return {}
    cands = _candidates()
    probe = _core.Backend("cpu", 1)
    wanted = []
    for name in dict.fromkeys(type_names):
        tid = _type_id(name)
        if tid is not None and probe.supports(tid):
            wanted.append((name, tid))
    if not wanted or not cands:
        return {}
    path = cache_path()
    data = _load(path) or {"version": _CACHE_VERSION, "machines": {}}
    key = machine_key()
    entry = data["machines"].setdefault(key, {"threads": {}})
    table = entry["threads"].setdefault(str(threads), {})
    measured = False
    for name, tid in wanted:
        for cls in SHAPE_CLASSES:
            got = table.get(name, {}).get(cls)
            if isinstance(got, dict) and got.get("isa") in cands:
                continue
            if len(cands) == 1:
                table.setdefault(name, {})[cls] = {"isa": cands[0], "seconds": {}}
                continue
            if not quiet and not measured:
                print(f"tensorfold: measuring the CPU kernels of this model's formats once "
                      f"(cached in {path})", file=sys.stderr, flush=True)
            measured = True
            secs = {isa: _core.cpu_kernel_time(tid, cls, isa, threads, _decode_bytes(), _REPS) for isa in cands}
            best = min(cands, key=lambda isa: secs[isa])
            table.setdefault(name, {})[cls] = {"isa": best, "seconds": secs}
    if measured:
        _save(path, data)
    out: dict[str, dict[str, str]] = {}
    for name, tid in wanted:
        for cls in SHAPE_CLASSES:
            isa = table[name][cls]["isa"]
            _core.set_cpu_kernel_choice(tid, cls, isa)
            out.setdefault(name, {})[cls] = isa
    return out


def choices(type_names: Iterable[str]) -> dict[str, dict[str, str]]:
    """{format: {class: isa}} as the tuned backend runs them now (recorded or the default)."""
    default = _core.cpu_isa()
    out: dict[str, dict[str, str]] = {}
    for name in dict.fromkeys(type_names):
        tid = _type_id(name)
        if tid is None:
            continue
        out[name] = {cls: _core.cpu_kernel_choice(tid, cls) or default for cls in SHAPE_CLASSES}
    return out
