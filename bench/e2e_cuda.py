#!/usr/bin/env python3
"""Decode and prefill speed of the CUDA backend, with the share of the GPU's memory bandwidth
that decode reaches (run by bench/device_check.sh on a GPU machine).

    python bench/e2e_cuda.py MODEL.gguf [MODEL2.gguf ...] [--n-prompt 512] [--n-gen 64] [--reps 3]

Per model: prefill tok/s (a 512-token prompt), decode tok/s (after a 1-token prompt), the bytes
of weights one decoded token reads (bench/e2e.py decode_bytes_per_token: dense weights, the LM
head, n_used / n_expert of the expert tensors) times decode tok/s = effective bandwidth, and that
as a share of the device's read bandwidth measured in the same run (a streaming kernel over
1 GiB, best of 5) and of its peak (bus width x memory clock).
The bars of issue 25: decode on a Q4_K_M MoE >= 60% of the bandwidth; prefill on SmolLM2 >= 5,000 tok/s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import decode_bytes_per_token, measure_tensorfold  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    from tensorfold import _core

    cuda = _core.cuda
    if not cuda.built_with_cuda() or cuda.device_count() == 0:
        print(f"no CUDA: built_with_cuda={cuda.built_with_cuda()} ({cuda.build_note()}), "
              f"devices={cuda.device_count()}")
        return 2
    info = cuda.device_info(0)
    measured = cuda.measure_read_bandwidth(1 << 30, 5)
    peak = info["bandwidth_gbs"] * 1e9
    print(f"device: {info['name']} (sm_{info['cc_major']}{info['cc_minor']}, {info['sm_count']} SMs, "
          f"{info['total_bytes'] / 2**30:.1f} GiB, integrated={info['integrated']}); kernels for sm "
          f"{cuda.compiled_archs()}")
    print(f"read bandwidth: measured {measured / 1e9:.0f} GB/s, peak {peak / 1e9:.0f} GB/s")
    results = []
    for m in a.models:
        r = measure_tensorfold(m, 1, a.n_prompt, a.n_gen, a.reps, backend="cuda")
        b = decode_bytes_per_token(m)
        eff = b["total"] * r["tg"]
        row = {"model": os.path.basename(m), "prefill_tok_s": r["pp"], "decode_tok_s": r["tg"],
               "bytes_per_token": b["total"], "effective_gbs": eff / 1e9,
               "share_measured": eff / measured if measured else None, "share_peak": eff / peak if peak else None}
        results.append(row)
        print(f"{row['model']}: prefill {r['pp']:.0f} tok/s, decode {r['tg']:.1f} tok/s, "
              f"{b['total'] / 2**20:.1f} MiB/token -> {eff / 1e9:.0f} GB/s = "
              f"{100 * (row['share_measured'] or 0):.1f}% of measured, {100 * (row['share_peak'] or 0):.1f}% of peak")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": info, "measured_gbs": measured / 1e9, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
