#!/usr/bin/env python3
"""Aggregate decode and time to first token at 1, 2, 4, 8 concurrent streams: `tensorfold serve`
and `llama-server --parallel` on the same GGUF and thread count, in the same run.

    python bench/serve_concurrency.py [--model PATH] [--llama-server PATH] [--threads 2]
        [--streams 1 2 4 8] [--n-gen 128] [--prompt-words 100] [--reps 2] [--json OUT]

Each server is started in turn (never both at once) with the same threads, a KV pool that
holds every stream (--parallel N × per-stream context for llama-server, --kv-tokens the same
for TensorFold) and greedy sampling. For each stream count N, N clients send /v1/completions
with stream=true at the same moment; each prompt starts with its own tag so that no prefix
is shared (neither server's prompt cache helps), and ignore_eos makes every stream generate
exactly --n-gen tokens. Per stream the first and last streamed chunk are timed:

- TTFT: request sent → first chunk (includes waiting for the batch's prefill);
- stream decode rate: (tokens − 1) / (last chunk − first chunk);
- aggregate decode: tokens streamed by all N streams while all N were decoding (from the
  last stream's first chunk to the first stream's last chunk) / that window, so that
  prefills of late streams do not count as decode time; a chunk normally carries one token
  (where a server merged some, the stream's tokens/chunks ratio is applied);
- end-to-end: all tokens / (first request sent → last stream done).

The median over --reps is reported, with TensorFold / llama-server ratios and each server's
N-stream / 1-stream scaling. The DRAM read bandwidth is measured in the same run. The
client runs on the same machine as the server (both servers pay for it alike).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WORDS = ("the harbour town wakes before dawn fishing boats slip out past the lighthouse while the baker "
         "lights the ovens and gulls argue over the quay as the tide turns and nets dry in the wind").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(tag: str, n_words: int) -> str:
    body = " ".join(WORDS[i % len(WORDS)] for i in range(n_words))
    return f"Request {tag}. {body}"


class Server:
    """One server process; stopped on exit even when the benchmark fails."""

    def __init__(self, name: str, argv: list[str], ready_path: str, port: int, log_path: str):
        self.name, self.argv, self.ready_path, self.port = name, argv, ready_path, port
        self.log_path = log_path

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        import httpx
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after 600 s; see {self.log_path}")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# --sampling: greedy, or the OpenAI API's defaults (temperature 1, top_p 1, no top-k / min-p:
# a draw from the whole vocabulary), which a client gets when it names no sampling parameter.
SAMPLING = {"greedy": {"temperature": 0.0},
            "openai": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": 1}}
_sampling = SAMPLING["greedy"]


async def one_stream(client, url: str, model: str, text: str, n_gen: int, t_start: float) -> dict:
    body = {"model": model, "prompt": text, "max_tokens": n_gen, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **_sampling}
    times = []
    tokens = None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                tokens = ev["usage"].get("completion_tokens", tokens)
            ch = ev.get("choices") or []
            if ch and ch[0].get("text"):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError(f"{url}: the stream carried no text")
    tokens = tokens or n_gen
    return {"ttft_s": times[0] - t_start, "tokens": tokens, "decode_s": times[-1] - times[0], "end": times[-1],
            "times": times}


async def burst(port: int, model: str, n: int, n_gen: int, prompt_words: int, tag: str) -> dict:
    import httpx
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one_stream(client, url, model, prompt(f"{tag}-{i}", prompt_words), n_gen, t0)
                                     for i in range(n)))
    rates = [(r["tokens"] - 1) / r["decode_s"] for r in res if r["decode_s"] > 0]
    w0, w1 = max(r["times"][0] for r in res), min(r["times"][-1] for r in res)
    if w1 > w0:
        in_window = sum(sum(w0 <= t <= w1 for t in r["times"]) * r["tokens"] / len(r["times"]) for r in res)
        aggregate = in_window / (w1 - w0)
    else:  # the streams never all decoded at once
        aggregate = sum(rates)
    return {"aggregate_decode_tps": aggregate, "stream_decode_tps": statistics.mean(rates),
            "chunks_per_token": statistics.mean(len(r["times"]) / r["tokens"] for r in res),
            "ttft_mean_s": statistics.mean(r["ttft_s"] for r in res), "ttft_max_s": max(r["ttft_s"] for r in res),
            "e2e_tps": sum(r["tokens"] for r in res) / (max(r["end"] for r in res) - t0),
            "tokens": [r["tokens"] for r in res]}


def run_server(srv: Server, model: str, a, label: str) -> dict:
    out = {}
    with srv:
        asyncio.run(burst(srv.port, model, 2, 8, a.prompt_words, f"{label}-warm"))   # warm-up, not timed
        for n in a.streams:
            reps = [asyncio.run(burst(srv.port, model, n, a.n_gen, a.prompt_words, f"{label}-{n}-{r}"))
                    for r in range(a.reps)]
            med = {k: statistics.median(r[k] for r in reps) for k in reps[0] if k != "tokens"}
            med["all_aggregate_decode_tps"] = [r["aggregate_decode_tps"] for r in reps]
            out[n] = med
            print(f"  {srv.name:14s} streams={n}: aggregate decode {med['aggregate_decode_tps']:7.1f} tok/s, "
                  f"per stream {med['stream_decode_tps']:6.1f}, TTFT mean {med['ttft_mean_s'] * 1e3:7.1f} ms "
                  f"max {med['ttft_max_s'] * 1e3:7.1f} ms, end-to-end {med['e2e_tps']:7.1f} tok/s, "
                  f"chunks/token {med['chunks_per_token']:.2f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (omit: TensorFold only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--n-gen", type=int, default=128, help="tokens each stream generates (default 128)")
    ap.add_argument("--prompt-words", type=int, default=100, help="prompt length in words (default 100)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--only", choices=("tensorfold", "llama-server"), default=None)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                    help="greedy (default), or openai: temperature 1 over the whole vocabulary, the API's "
                         "default (top_k=0 and min_p=0 spelled out: llama-server's own defaults filter)")
    a = ap.parse_args()
    global _sampling
    _sampling = SAMPLING[a.sampling]

    import tensorfold
    from e2e import measure_dram_read  # noqa: E402  (bench/e2e.py)

    model = a.model or tensorfold.pull("smollm2-135m-instruct")
    n_max = max(a.streams)
    ctx = 2 * a.prompt_words + a.n_gen + 64          # generous: a word is 1–2 tokens
    print(f"model {model} ({os.path.getsize(model) / 2**20:.0f} MiB), threads {a.threads}, "
          f"streams {a.streams}, {a.n_gen} tokens each, prompt ~{a.prompt_words} words", flush=True)
    bw = measure_dram_read(a.threads) / 1e9
    print(f"DRAM read bandwidth: {bw:.1f} GB/s", flush=True)
    results = {"model": model, "threads": a.threads, "n_gen": a.n_gen, "dram_gbs": bw, "servers": {}}
    name = "bench-model"

    if a.only != "llama-server":
        port = free_port()
        argv = [sys.executable, "-m", "tensorfold", "serve", model, "--port", str(port), "--threads", str(a.threads),
                "--context", str(ctx), "--kv-tokens", str(ctx * n_max), "--max-running", str(n_max),
                "--model-name", name, "--log-level", "warning"]
        results["servers"]["tensorfold"] = run_server(
            Server("tensorfold", argv, "/ready", port, "/tmp/bench-serve-tensorfold.log"), name, a, "tf")
    if a.llama_server and a.only != "tensorfold":
        port = free_port()
        argv = [a.llama_server, "-m", model, "--port", str(port), "-t", str(a.threads), "-tb", str(a.threads),
                "--parallel", str(n_max), "-c", str(ctx * n_max), "--alias", name, "--log-disable"]
        results["servers"]["llama-server"] = run_server(
            Server("llama-server", argv, "/health", port, "/tmp/bench-serve-llama.log"), name, a, "ll")

    print("\n| streams | TF aggregate | llama-server aggregate | TF / llama | TF N/1 | llama N/1 | "
          "TF TTFT mean | llama TTFT mean |")
    print("|---|---|---|---|---|---|---|---|")
    tf, ll = results["servers"].get("tensorfold", {}), results["servers"].get("llama-server", {})
    one_tf, one_ll = tf.get(a.streams[0]), ll.get(a.streams[0])
    for n in a.streams:
        t, l = tf.get(n), ll.get(n)
        f = lambda r, k, s=1.0: f"{r[k] * s:.1f}" if r else "—"  # noqa: E731
        ratio = f"**{t['aggregate_decode_tps'] / l['aggregate_decode_tps']:.2f}×**" if t and l else "—"
        sc_t = f"{t['aggregate_decode_tps'] / one_tf['aggregate_decode_tps']:.2f}×" if t and one_tf else "—"
        sc_l = f"{l['aggregate_decode_tps'] / one_ll['aggregate_decode_tps']:.2f}×" if l and one_ll else "—"
        print(f"| {n} | {f(t, 'aggregate_decode_tps')} | {f(l, 'aggregate_decode_tps')} | {ratio} | {sc_t} | {sc_l} "
              f"| {f(t, 'ttft_mean_s', 1e3)} ms | {f(l, 'ttft_mean_s', 1e3)} ms |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
