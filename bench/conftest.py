"""pytest setup of the microbenchmarks: collects bench_*.py, measures the DRAM read bandwidth
once per session, and prints every benchmark's derived figures as one table per file at the end.

    pytest bench/ --benchmark-only           (bench/ is outside the default testpaths)
"""
from __future__ import annotations

import pytest

import _common

# Scripts with their own command line, not pytest modules.
SCRIPTS = {"bench_allreduce.py", "bench_allreduce_netns.py"}


def pytest_collect_file(file_path, parent):
    # pytest's default pattern is test_*.py; the benchmarks are named bench_*.py. A file named on
    # the command line is collected by pytest itself already.
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_") and file_path.name not in SCRIPTS
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


_dram = _common.DRAM_GBPS


@pytest.fixture(scope="session")
def dram_gbps() -> float:
    """DRAM read bandwidth of this run (GB/s), the denominator of every 'fraction of DRAM'."""
    if not _dram:
        _dram.append(_common.measure_dram_gbps())
        print(f"\n[dram] {_dram[0]:.2f} GB/s: {_common.THREADS} threads streaming "
              f"{_common.GEMV_BYTES / 1e6:.0f} MB (L3 {_common.L3_BYTES / 1e6:.0f} MB)")
    return _dram[0]


def _cell(col: str, v) -> str:
    if isinstance(v, float):
        if col.startswith("frac"):
            return f"{v:.1%}"
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(v)


def pytest_terminal_summary(terminalreporter):
    rows = _common.RESULTS
    if not rows:
        return
    tr = terminalreporter
    tr.section("microbenchmark figures (best round)")
    if _dram:
        # measured again: on a shared host it drifts, and the fractions above use the first figure
        tr.write_line(f"DRAM read bandwidth {_dram[0]:.2f} GB/s at the start, {_common.measure_dram_gbps():.2f} GB/s "
                      f"at the end ({_common.THREADS} threads, {_common.GEMV_BYTES / 1e6:.0f} MB buffer; "
                      f"L3 {_common.L3_BYTES / 1e6:.0f} MB); frac_of_dram uses the start")
    for group in dict.fromkeys(r["group"] for r in rows):
        sel = [r for r in rows if r["group"] == group]
        cols = list(dict.fromkeys(k for r in sel for k in r if k != "group"))
        table = [[_cell(c, r.get(c, "")) for c in cols] for r in sel]
        widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
        tr.write_line("")
        tr.write_line(f"[{group}]")
        tr.write_line("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths))))
        for t in table:
            tr.write_line("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(t, widths))))
