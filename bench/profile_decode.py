#!/usr/bin/env python3
"""Where a decode step's time goes: every backend op of N decode steps timed (the engine's
backend wrapped by the profiling decorator, TENSORFOLD_PROFILE_OPS=1), per token.

    python bench/profile_decode.py [--model PATH] [--threads 2] [--n-gen 64] [--depth 0] [--json OUT]
    python bench/profile_decode.py --prefill 512 [...]     # a 512-token prompt instead, per prompt token
                                                           # (products' GFLOP/s and share of the int8 peak)

Prints one row per op (products split by weight type and shape class): calls and milliseconds per
token, share of the step, and for products the weight bytes read per token and their rate against
the DRAM read bandwidth measured in the same run. "outside the ops" is the step's time that no
backend op accounts for (the engine's scheduling, sampling, Python). The last lines give the
bytes a decode step must read (weights of every product, routed experts as routed), the
effective bandwidth (those bytes x tok/s) and its fraction of DRAM. The timers cost a clock read
and a table update per op: the profiled step is slightly slower than a plain one (printed
beside it, from a plain engine on the same file in the same run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def prefill_rate(model: str, threads: int, n_prompt: int, profiled: bool) -> tuple[float, int, dict]:
    os.environ["TENSORFOLD_PROFILE_OPS"] = "1" if profiled else "0"
    import numpy as np

    import tensorfold
    from tensorfold import _core

    eng = tensorfold.Engine(model, threads=threads, context=n_prompt + 16, prefix_cache=False)
    try:
        vocab = eng.config["n_vocab"]
        prompt = [int(t) for t in np.random.default_rng(0).integers(100, min(vocab, 30000), size=n_prompt)]
        eng.generate(prompt, max_tokens=1, temperature=0, ignore_eos=True)  # warm-up
        _core.reset_op_profile()
        t0 = time.perf_counter()
        eng.generate(prompt, max_tokens=1, temperature=0, ignore_eos=True)
        dt = time.perf_counter() - t0
        return n_prompt / dt, n_prompt, _core.op_profile()
    finally:
        eng.close()


def decode_rate(model: str, threads: int, n_gen: int, depth: int, profiled: bool) -> tuple[float, int, dict]:
    os.environ["TENSORFOLD_PROFILE_OPS"] = "1" if profiled else "0"
    import numpy as np

    import tensorfold
    from tensorfold import _core

    eng = tensorfold.Engine(model, threads=threads, context=max(512, depth + n_gen + 16))
    try:
        rng = np.random.default_rng(0)
        vocab = eng.config["n_vocab"]
        prompt = [int(t) for t in rng.integers(100, min(vocab, 30000), size=max(1, depth))]
        eng.generate(prompt[:8], max_tokens=4, temperature=0, ignore_eos=True)  # warm-up
        eng.generate(prompt, max_tokens=1, temperature=0, ignore_eos=True)  # prefill to depth (then cached)
        _core.reset_op_profile()
        t0 = time.perf_counter()
        r = eng.generate(prompt, max_tokens=n_gen + 1, temperature=0, ignore_eos=True)
        dt = time.perf_counter() - t0
        # One forward per token: the first reads what the prefix cache did not hold of the prompt.
        return len(r.token_ids) / dt, len(r.token_ids), _core.op_profile()
    finally:
        eng.close()


def weights_per_byte(key: str) -> float:
    """Weights per byte of the product's type (from the key "op TYPE class")."""
    import gguf
    t = getattr(gguf.GGMLQuantizationType, key.split()[1], None)
    if t is None:
        return 0.0
    block, size = gguf.GGML_QUANT_SIZES[t]
    return block / size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: the pulled SmolLM2 model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--depth", type=int, default=0, help="tokens in the cache before decoding (default 0)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="profile the prefill of an N-token prompt instead (figures per prompt token)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    import tensorfold
    from e2e import measure_dram_read  # noqa: E402  (bench/e2e.py)

    model = a.model or tensorfold.pull()
    dram = measure_dram_read(a.threads)
    from tensorfold import _core
    peak = None
    if a.prefill:
        try:  # the int8 dot-product peak (vpdpbusd on registers), for the products' share of it
            peak = 2 * _core.kernels_int8_peak(a.threads, 1.0)
        except Exception as e:  # noqa: BLE001 - no VNNI: no peak column
            print(f"(no int8 peak probe: {e})")
    if a.prefill:
        if peak:
            print(f"int8 dot-product peak {peak / 1e9:.0f} GOPS ({a.threads} threads, measured now)")
        plain_tps, _, _ = prefill_rate(model, a.threads, a.prefill, profiled=False)
        tps, n, rows = prefill_rate(model, a.threads, a.prefill, profiled=True)
        what = f"prefill of {a.prefill} tokens"
    else:
        plain_tps, _, _ = decode_rate(model, a.threads, a.n_gen, a.depth, profiled=False)
        tps, n, prof = decode_rate(model, a.threads, a.n_gen, a.depth, profiled=True)
        # Prefill-class entries belong to the prompt's last chunk: left out of the per-token figures.
        rows = {k: v for k, v in prof.items() if not k.endswith("prefill")}
        what = f"decode at depth {a.depth}"
    step = 1.0 / tps
    total_ops = sum(v["seconds"] for v in rows.values()) / n
    print(f"{os.path.basename(model)}: {what}, {tps:.1f} tok/s profiled ({plain_tps:.1f} plain), "
          f"{a.threads} threads; DRAM read {dram / 1e9:.1f} GB/s")
    print(f"{'op':34s} {'calls/tok':>9s} {'ms/tok':>8s} {'share':>6s} {'MB/tok':>8s} {'GB/s':>6s} {'of DRAM':>7s}"
          f"{'  GFLOP/s' if a.prefill else ''}")
    weight_bytes = 0.0
    for key, v in sorted(rows.items(), key=lambda kv: -kv[1]["seconds"]):
        sec = v["seconds"] / n
        mb = v["weight_bytes"] / n / 1e6
        weight_bytes += v["weight_bytes"] / n
        if v["weight_bytes"] and v["seconds"] > 0:
            gbs = v["weight_bytes"] / v["seconds"]
            rate = f"{mb:8.1f} {gbs / 1e9:6.1f} {gbs / dram:7.0%}"
            if a.prefill and key.endswith("prefill"):  # every weight byte multiplies all prompt tokens: 2 flops per weight per token
                ops = 2 * v["weight_bytes"] * weights_per_byte(key) * n / v["seconds"]
                rate += f" {ops / 1e9:8.1f}" + (f" ({ops / peak:.0%} of int8 peak)" if peak else "")
        else:
            rate = ""
        print(f"{key:34s} {v['calls'] / n:9.1f} {sec * 1e3:8.3f} {sec / step:6.1%} {rate}")
    print(f"{'outside the ops':34s} {'':9s} {(step - total_ops) * 1e3:8.3f} {(step - total_ops) / step:6.1%}")
    eff = weight_bytes * plain_tps
    if not a.prefill:
        print(f"weights read per token {weight_bytes / 1e6:.1f} MB; effective bandwidth at the plain rate "
              f"{eff / 1e9:.1f} GB/s = {eff / dram:.0%} of DRAM")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": model, "tps": tps, "plain_tps": plain_tps, "dram_bps": dram, "n_gen": n,
                       "ops": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
