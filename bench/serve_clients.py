#!/usr/bin/env python3
"""Throughput as clients see it: the engine alone, `tensorfold serve` and `llama-server` with the
official `openai` client, same GGUF and thread count, in one run.

    python bench/serve_clients.py [--model PATH] [--llama-server PATH] [--threads 2]
        [--n-gen 128] [--clients 1 4] [--requests 6] [--json OUT]

- engine alone: tensorfold.Engine.generate of --n-gen tokens (fixed length: ignore_eos,
  greedy) in this process; its decode rate ((tokens - 1) / decode seconds, from the engine's
  stats) is the single-stream rate the server is measured against, and its end-to-end rate
  (tokens / call time, prefill included) is shown beside it;
- each server in turn (never both at once): N clients (threads of this process, one
  `openai.OpenAI` client each) send --requests non-streaming /v1/completions of --n-gen tokens
  one after another; the rate is all completion tokens / wall time from the first request
  sent to the last response received (what the clients got, prefill and HTTP included).
  llama-server runs with --parallel = max(--clients) and a context that holds every stream.

Every prompt starts with its own tag, so no prefix is shared between requests (neither
server's prompt cache helps). The DRAM read bandwidth is measured in the same run. The
clients run on the same machine as the servers (both servers pay for them alike).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_concurrency import Server, free_port, prompt  # noqa: E402


def engine_alone(model: str, threads: int, ctx: int, n_gen: int, prompt_words: int, reps: int) -> dict:
    import tensorfold

    eng = tensorfold.Engine(model, threads=threads, context=ctx, kv_tokens=ctx)
    decode, e2e = [], []
    try:
        eng.generate(prompt("warm", prompt_words), max_tokens=8, temperature=0, ignore_eos=True)
        for r in range(reps):
            st0 = eng.stats()
            t0 = time.perf_counter()
            out = eng.generate(prompt(f"engine-{r}", prompt_words), max_tokens=n_gen, temperature=0, ignore_eos=True)
            dt = time.perf_counter() - t0
            st1 = eng.stats()
            n = len(out.token_ids)
            decode.append((n - 1) / (st1["decode_seconds"] - st0["decode_seconds"]))
            e2e.append(n / dt)
    finally:
        eng.close()
    return {"decode_tps": statistics.median(decode), "e2e_tps": statistics.median(e2e),
            "all_decode_tps": decode, "all_e2e_tps": e2e}


def clients_run(port: int, model: str, n_clients: int, n_requests: int, n_gen: int, prompt_words: int,
                tag: str) -> dict:
    import openai

    tokens = [0] * n_clients
    errors: list[BaseException] = []
    start = threading.Barrier(n_clients + 1)

    def client(i: int) -> None:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
        try:
            start.wait()
            for j in range(n_requests):
                r = c.completions.create(model=model, prompt=prompt(f"{tag}-{i}-{j}", prompt_words),
                                         max_tokens=n_gen, temperature=0, extra_body={"ignore_eos": True})
                tokens[i] += r.usage.completion_tokens
        except BaseException as e:  # reported after the run
            errors.append(e)
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]!r}")
    return {"tps": sum(tokens) / dt, "tokens": sum(tokens), "seconds": dt}


def engine_counters(port: int) -> dict | None:
    """tensorfold serve's engine counters from /metrics (None for other servers)."""
    import re

    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    got = {}
    for key in ("generated_tokens", "decode_seconds", "prefill_seconds"):
        m = re.search(rf"^tensorfold_engine_{key}_total (\S+)$", text, re.M)
        if not m:
            return None
        got[key] = float(m.group(1))
    return got


def run_server(srv: Server, model: str, a) -> dict:
    out = {}
    with srv:
        clients_run(srv.port, model, 2, 1, 8, a.prompt_words, f"{srv.name}-warm")  # warm-up, not timed
        for n in a.clients:
            c0 = engine_counters(srv.port) if srv.name == "tensorfold" else None
            r = clients_run(srv.port, model, n, a.requests, a.n_gen, a.prompt_words, f"{srv.name}-{n}")
            c1 = engine_counters(srv.port) if c0 else None
            extra = ""
            if c1:
                busy = (c1["decode_seconds"] - c0["decode_seconds"]) + (c1["prefill_seconds"] - c0["prefill_seconds"])
                r["engine_busy_fraction"] = busy / r["seconds"]
                r["engine_tps_while_busy"] = (c1["generated_tokens"] - c0["generated_tokens"]) / busy
                extra = (f"; engine busy {100 * r['engine_busy_fraction']:.0f}% of the time, "
                         f"{r['engine_tps_while_busy']:.1f} tok/s while busy")
            out[n] = r
            print(f"  {srv.name:14s} clients={n}: {r['tps']:7.1f} tok/s ({r['tokens']} tokens in "
                  f"{r['seconds']:.2f} s{extra})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (omit: TensorFold only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--requests", type=int, default=6, help="requests each client sends in turn (default 6)")
    ap.add_argument("--n-gen", type=int, default=128, help="tokens per request (default 128)")
    ap.add_argument("--prompt-words", type=int, default=20, help="prompt length in words (default 20)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    a = ap.parse_args()

    import tensorfold
    from e2e import measure_dram_read  # noqa: E402  (bench/e2e.py)

    model = a.model or tensorfold.pull("smollm2-135m-instruct")
    n_max = max(a.clients)
    ctx = 2 * a.prompt_words + a.n_gen + 64  # generous: a word is 1-2 tokens
    print(f"model {model} ({os.path.getsize(model) / 2**20:.0f} MiB), threads {a.threads}, clients {a.clients}, "
          f"{a.requests} requests of {a.n_gen} tokens each", flush=True)
    bw = measure_dram_read(a.threads) / 1e9
    print(f"DRAM read bandwidth: {bw:.1f} GB/s", flush=True)
    results: dict = {"model": model, "threads": a.threads, "n_gen": a.n_gen, "dram_gbs": bw, "servers": {}}
    eng = engine_alone(model, a.threads, ctx, a.n_gen, a.prompt_words, a.requests)
    results["engine_alone"] = eng
    print(f"  engine alone    : decode {eng['decode_tps']:7.1f} tok/s, end-to-end {eng['e2e_tps']:7.1f} tok/s",
          flush=True)
    name = "bench-model"
    port = free_port()
    argv = [sys.executable, "-m", "tensorfold", "serve", model, "--port", str(port), "--threads", str(a.threads),
            "--context", str(ctx), "--kv-tokens", str(ctx * n_max), "--max-running", str(n_max),
            "--model-name", name, "--log-level", "warning"]
    results["servers"]["tensorfold"] = run_server(
        Server("tensorfold", argv, "/ready", port, "/tmp/bench-clients-tensorfold.log"), name, a)
    if a.llama_server:
        port = free_port()
        argv = [a.llama_server, "-m", model, "--port", str(port), "-t", str(a.threads), "-tb", str(a.threads),
                "--parallel", str(n_max), "-c", str(ctx * n_max), "--alias", name, "--log-disable"]
        results["servers"]["llama-server"] = run_server(
            Server("llama-server", argv, "/health", port, "/tmp/bench-clients-llama.log"), name, a)

    tf, ll = results["servers"]["tensorfold"], results["servers"].get("llama-server", {})
    one = a.clients[0]
    print(f"\nengine alone: decode {eng['decode_tps']:.1f} tok/s (end-to-end {eng['e2e_tps']:.1f})")
    print("| clients | TF serve tok/s | TF / engine decode | TF N/1 | llama-server tok/s | llama N/1 | TF / llama |")
    print("|---|---|---|---|---|---|---|")
    for n in a.clients:
        t, l = tf[n]["tps"], (ll[n]["tps"] if n in ll else None)
        row = [str(n), f"{t:.1f}", f"{t / eng['decode_tps']:.2f}", f"{t / tf[one]['tps']:.2f}",
               f"{l:.1f}" if l else "-", f"{l / ll[one]['tps']:.2f}" if l else "-", f"{t / l:.2f}" if l else "-"]
        print("| " + " | ".join(row) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
