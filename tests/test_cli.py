"""The `tensorfold` command line, run as a user would (a subprocess), or in-process through
cli.main where a test looks at the conversation the chat keeps."""
from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from tensorfold import cli

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "smollm2_llamacpp.json").read_text("utf-8"))


def run_cli(*args, stdin: str | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "tensorfold.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("chat", "generate", "serve", "info", "pull"):
        assert cmd in r.stdout
    r = run_cli("generate", "--help")
    assert r.returncode == 0 and "--temperature" in r.stdout and "--max-tokens" in r.stdout


def test_generate_greedy_matches_engine_and_llama_cpp(smollm2_path):
    import tensorfold

    case = next(c for c in FIXTURE["greedy"] if c["kind"] == "plain")
    r = run_cli("generate", smollm2_path, "-p", case["prompt"], "-n", "32", "--temperature", "0",
                "--ignore-eos", "-t", "2")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr
    eng = tensorfold.Engine(smollm2_path, threads=2)
    text = r.stdout[:-1]  # the CLI ends with one newline
    assert text == eng.generate(case["prompt"], max_tokens=32, temperature=0, ignore_eos=True).text
    # Up to llama.cpp's first near-tie (see test_engine.NEAR_TIE) the text is llama.cpp's.
    k = next((i for i, m in enumerate(case["top1_top2_margin"]) if m < 0.5), 32)
    assert text.startswith(eng.detokenize(case["generated_ids"][:k]))


def test_chat_loop_reset_and_exit(smollm2_path):
    r = run_cli("chat", smollm2_path, "--temperature", "0", "-n", "16", "-t", "2",
                stdin="What is 2+2?\n/reset\nHello!\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "conversation cleared" in r.stderr
    assert r.stderr.count("tok/s") == 2
    assert r.stdout.strip()


def test_info_reports_types_and_bpw(smollm2_path):
    r = run_cli("info", smollm2_path)
    assert r.returncode == 0, r.stderr
    assert "llama" in r.stdout and "Q4_1" in r.stdout and "Q8_0" in r.stdout
    assert "bits per weight" in r.stdout
    # the KV cache per token: layers x KV heads x head dim x K and V x 2 bytes (F16), from the file's keys
    gguf = pytest.importorskip("gguf")
    f = gguf.GGUFReader(smollm2_path).fields

    def key(name):
        return int(f[f"llama.{name}"].parts[f[f"llama.{name}"].data[0]][0])

    want = key("block_count") * key("attention.head_count_kv") * (
        key("embedding_length") // key("attention.head_count")) * 2 * 2
    assert f"kv cache:      {want} bytes per token (F16)" in r.stdout


def test_errors_are_clear_not_tracebacks(tmp_path):
    r = run_cli("info", str(tmp_path / "nope.gguf"))
    assert r.returncode == 1 and "error" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    r = run_cli("generate", str(bad), "-p", "x")
    assert r.returncode == 1 and "Traceback" not in r.stderr


# ------------------------------------------------------------------ no tracebacks, ever


def run_cli_bytes(*args, stdin: bytes = b"", timeout: float = 300):
    r = subprocess.run([sys.executable, "-m", "tensorfold.cli", *args], input=stdin, capture_output=True,
                       timeout=timeout, env=dict(os.environ))
    return r.returncode, r.stdout.decode("utf-8"), r.stderr.decode("utf-8", "replace")


def _clean(stderr: str) -> bool:
    return "Traceback" not in stderr and "Exception ignored" not in stderr


def test_version():
    import tensorfold

    r = run_cli("--version")
    assert r.returncode == 0
    extra = tensorfold._core.capabilities().get("cpu_features", "")  # e.g. "sve2/128" on aarch64
    assert r.stdout == f"tensorfold {tensorfold.__version__} ({tensorfold._core.cpu_isa()}{', ' + extra if extra else ''})\n"
    assert re.fullmatch(r"tensorfold \d+\.\d+\.\d+ \((avx512|avx2|i8mm|dotprod|neon|scalar)(, sve2/\d+)?\)\n", r.stdout)


def _walk(parser, path=("tensorfold",)):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, path + (name,))
        else:
            yield path, action


def test_every_option_of_every_command_has_help():
    seen = set()
    missing = []
    for path, action in _walk(cli.build_parser()):
        seen.add(path)
        if isinstance(action, argparse._HelpAction):
            continue
        if not (action.help or "").strip():
            missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help text: {missing}"
    assert {("tensorfold", c) for c in ("chat", "generate", "serve", "worker", "info", "pull", "convert")} <= seen


def test_invalid_utf8_prompt_on_stdin_and_argv(smollm2_path):
    """Bytes that are not UTF-8 become U+FFFD (as Python's 'replace' decodes them), with the
    same output as that text typed in."""
    import tensorfold

    eng = tensorfold.Engine(smollm2_path, threads=2)
    want = eng.generate("\ufffd\ufffd Hello", max_tokens=8, temperature=0, ignore_eos=True).text + "\n"
    args = ("generate", smollm2_path, "-n", "8", "--temperature", "0", "--ignore-eos", "-t", "2")
    rc, out, err = run_cli_bytes(*args, stdin=b"\xff\xfe Hello")
    assert rc == 0 and _clean(err), err
    assert out == want
    rc, out, err = run_cli_bytes(*args, "-p", os.fsdecode(b"\xff\xfe Hello"))  # raw bytes in argv
    assert rc == 0 and _clean(err), err
    assert out == want


def test_closed_stdout_pipe_ends_quietly(smollm2_path):
    p = subprocess.Popen([sys.executable, "-m", "tensorfold.cli", "generate", smollm2_path, "-p", "hi", "-n", "200",
                          "--ignore-eos", "-t", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(os.environ))
    head = p.stdout.read(10)  # `| head -c 10`
    p.stdout.close()
    err = p.stderr.read().decode()
    rc = p.wait(120)
    assert len(head) == 10
    assert rc == 141 and _clean(err) and "BrokenPipe" not in err, err


@pytest.mark.parametrize("opt,match", [
    (["--top-k", "-1"], r"argument --top-k: must be an integer in \[0, 2147483647\], got -1"),
    (["--temperature", "nan"], r"argument --temperature/--temp: must be a finite number >= 0, got nan"),
    (["--temp", "inf"], r"must be a finite number >= 0, got inf"),
    (["--top-p", "nan"], r"argument --top-p: must be a finite number in \(0, 1\], got nan"),
    (["--top-p", "0"], r"argument --top-p: must be a finite number in \(0, 1\], got 0"),
    (["--min-p", "1.5"], r"argument --min-p: must be a finite number in \[0, 1\], got 1.5"),
    (["-n", "-3"], r"argument -n/--max-tokens: must be an integer in \[0, 2147483647\], got -3"),
    (["--seed", "1.5"], r"argument --seed: invalid int value: '1.5'"),
    (["-t", "0"], r"argument -t/--threads: must be an integer in \[1, 2147483647\], got 0"),
    (["-c", "x"], r"argument -c/--context: expected an integer, got 'x'"),
    (["-c", "1"], r"argument -c/--context: must be an integer in \[2, 16777216\], got 1"),
    (["-c", str(2**24 + 1)], r"argument -c/--context: must be an integer in \[2, 16777216\], got 16777217"),
    (["--kv-tokens", "0"], r"argument --kv-tokens: must be an integer in \[1, 1073741824\], got 0"),
    (["--memory-budget", "-5GiB"], r"argument --memory-budget: must be a positive size, got '-5GiB'"),
    (["--memory-budget=lots"], r"argument --memory-budget: 'lots' is not a size"),
    (["--tp-timeout", "nan"], r"argument --tp-timeout: must be a finite number > 0, got nan"),
])
def test_bad_options_are_one_line_errors(capsys, opt, match):
    for cmd in ("generate", "chat"):
        with pytest.raises(SystemExit) as e:
            cli.main([cmd, "model.gguf", "-p", "x", *opt] if cmd == "generate" else [cmd, "model.gguf", *opt])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("tensorfold: error: "), err
        assert re.search(match, err), err


def test_user_mistakes_are_one_line_errors(tmp_path, smollm2_path):
    for args, match in ((("generate", str(tmp_path)), "is a directory"),
                        (("generate", smollm2_path, "-p", ""), "the prompt is empty"),
                        (("generate", smollm2_path, "-p", "hi", "-c", "64", "--kv-tokens", "16"),
                         r"--kv-tokens 16 must be at least the context \(-c 64\).*raise --kv-tokens or lower "
                         r"-c/--context"),
                        (("chat", "no-such-model"), "not found"),
                        (("info", str(tmp_path / "missing.gguf")), "error")):
        r = run_cli(*args, "-t", "1") if args[0] != "info" else run_cli(*args)
        assert r.returncode == 1, (args, r.stderr)
        assert "tensorfold: error:" in r.stderr and re.search(match, r.stderr) and _clean(r.stderr), (args, r.stderr)


def test_context_above_trained_length_warns(smollm2_path):
    r = run_cli("generate", smollm2_path, "-p", "Hi", "-n", "2", "-t", "1", "-c", "8200")
    assert r.returncode == 0 and _clean(r.stderr), r.stderr
    assert "tensorfold: warning: context 8200 is longer than the 8192 tokens" in r.stderr
    assert "RuntimeWarning" not in r.stderr  # one line, not a warnings listing


def test_threads_above_the_usable_cpus_warn_and_still_work(smollm2_path):
    from tensorfold import _core

    n = 2 * _core.usable_cpus()
    r = run_cli("generate", smollm2_path, "-p", "Hi", "-n", "4", "-t", str(n), "--temperature", "0")
    assert r.returncode == 0 and _clean(r.stderr), r.stderr
    assert f"tensorfold: warning: -t {n} is more than the {_core.usable_cpus()} CPUs" in r.stderr
    assert f"usually slower than -t {_core.usable_cpus()}" in r.stderr


def test_ctrl_c_stops_an_oversubscribed_generate_within_a_second(smollm2_path):
    # 64 threads on this machine's few CPUs: the pool must stay responsive (no spinning
    # threads starving the ones with work) and Ctrl-C must end it within a second.
    p = subprocess.Popen([sys.executable, "-m", "tensorfold.cli", "generate", smollm2_path, "-p", "Once upon a time",
                          "-n", "100000", "-c", "8192", "--ignore-eos", "-t", "64"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ))
    assert p.stdout.read(16)  # tokens are coming
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    assert p.returncode == 130 and _clean(err.decode()), err.decode()
    assert elapsed < 1.0, f"took {elapsed:.2f}s to stop"


def test_generate_ctrl_c_exits_130_quietly(smollm2_path):
    p = subprocess.Popen([sys.executable, "-m", "tensorfold.cli", "generate", smollm2_path, "-p", "Once upon a time",
                          "-n", "2000", "-c", "2048", "--ignore-eos", "-t", "1"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ))
    assert p.stdout.read(8)  # generating
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and _clean(err.decode()), err.decode()
    assert "KeyboardInterrupt" not in err.decode()


def test_pull_lists_known_models_with_sizes():
    r = run_cli("pull", "--list")
    assert r.returncode == 0 and _clean(r.stderr)
    assert re.search(r"smollm2-135m-instruct\s+93\.8 MiB\s+SmolLM2", r.stdout), r.stdout
    r = run_cli("pull", "no-such-model")
    assert r.returncode == 1 and _clean(r.stderr)
    assert "unknown model 'no-such-model'" in r.stderr and re.search(r"smollm2-135m-instruct\s+93\.8 MiB", r.stderr)


# ------------------------------------------------------------------------------ chat


class _Spy:
    """Wraps Engine.stream to record the conversation of every turn and, on chosen turns,
    raise KeyboardInterrupt after some pieces (as Ctrl-C does)."""

    def __init__(self, monkeypatch, interrupt_after: dict[int, int] | None = None):
        import tensorfold

        self.turns: list[list[dict]] = []
        self.interrupt_after = interrupt_after or {}
        real = tensorfold.Engine.stream
        spy = self

        def stream(eng, *args, **kw):
            spy.turns.append([dict(m) for m in kw["messages"]])
            k = spy.interrupt_after.get(len(spy.turns) - 1)
            pieces = real(eng, *args, **kw)
            if k is None:
                return pieces

            def cut():
                for i, piece in enumerate(pieces):
                    if i == k:
                        pieces.close()
                        raise KeyboardInterrupt
                    yield piece
                if k >= 0:
                    raise KeyboardInterrupt
            return cut()

        monkeypatch.setattr(tensorfold.Engine, "stream", stream)


def _chat(monkeypatch, capsys, stdin: bytes, *args):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    rc = cli.main(["chat", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_chat_survives_invalid_utf8_input(monkeypatch, capsys, smollm2_path):
    spy = _Spy(monkeypatch)
    rc, out, err = _chat(monkeypatch, capsys, b"Hi\n\xff\xfe what\xed\xa0\x80 now?\nThanks\n/exit\n",
                         smollm2_path, "-n", "4", "--temperature", "0", "-t", "2")
    assert rc == 0 and _clean(err), err
    users = [m["content"] for m in spy.turns[1] if m["role"] == "user"]
    assert users == ["Hi", "\ufffd\ufffd what\ufffd\ufffd\ufffd now?"]
    # the third turn still holds the whole conversation
    assert [m["role"] for m in spy.turns[2]] == ["user", "assistant", "user", "assistant", "user"]


def test_chat_drops_the_oldest_turns_to_fit_the_context(monkeypatch, capsys, smollm2_path):
    spy = _Spy(monkeypatch)
    long = "Tell me a long story about a dragon, with many details about the castle and the knight."
    rc, out, err = _chat(monkeypatch, capsys, (f"{long}\n" * 4 + "/exit\n").encode(), smollm2_path,
                         "-c", "128", "-n", "16", "--temperature", "0", "-t", "2", "--system", "Be brief.")
    assert rc == 0 and _clean(err), err
    assert re.search(r"\(dropped [12] oldest turns? to fit the context\)", err), err
    assert err.count("tok/s") == 4  # every turn got a reply
    for turn in spy.turns:
        assert turn[0] == {"role": "system", "content": "Be brief."} and turn[-1]["content"] == long
        assert [m["role"] for m in turn[1:]] == ["user", "assistant"] * ((len(turn) - 2) // 2) + ["user"]
    assert len(spy.turns[-1]) < 2 + 2 * 3  # older turns went
    # replies are not cut to one token: each prompt leaves the reserve (min(16, 128 // 4))
    import tensorfold

    eng = tensorfold.Engine(smollm2_path, threads=1, context=128)
    for turn in spy.turns:
        assert len(eng._prompt_ids(None, turn)) <= 128 - 16


def test_chat_refuses_a_message_longer_than_the_context(monkeypatch, capsys, smollm2_path):
    spy = _Spy(monkeypatch)
    rc, out, err = _chat(monkeypatch, capsys, b"Hi\n" + b"word " * 300 + b"\nAnd now?\n/exit\n",
                         smollm2_path, "-c", "128", "-n", "16", "--temperature", "0", "-t", "2")
    assert rc == 0 and _clean(err), err
    assert "that message is too long" in err and "it was not sent" in err
    assert len(spy.turns) == 2
    assert [m["content"] for m in spy.turns[1] if m["role"] == "user"] == ["Hi", "And now?"]


def test_chat_ctrl_c_keeps_the_conversation(monkeypatch, capsys, smollm2_path):
    """Ctrl-C during a reply keeps what was written of it; before the first piece it drops
    the unanswered message (the turns still alternate); either way the chat goes on."""
    spy = _Spy(monkeypatch, interrupt_after={0: 3, 1: 0})
    rc, out, err = _chat(monkeypatch, capsys, b"Tell me a story\nWhat?\nHello\n/exit\n", smollm2_path,
                         "-n", "32", "--temperature", "0", "-t", "2")
    assert rc == 0 and _clean(err), err
    assert "(interrupted; the partial reply is kept)" in err and "(interrupted; the message was dropped)" in err
    assert [m["role"] for m in spy.turns[2]] == ["user", "assistant", "user"]
    partial = spy.turns[2][1]["content"]
    assert partial and out.startswith("> " + partial + "\n")  # after the input prompt
    assert [m["content"] for m in spy.turns[2] if m["role"] == "user"] == ["Tell me a story", "Hello"]


def test_chat_real_ctrl_c_stops_the_reply_and_goes_on(smollm2_path):
    p = subprocess.Popen([sys.executable, "-m", "tensorfold.cli", "chat", smollm2_path, "-n", "60",
                          "--temperature", "0", "-t", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    p.stdin.write(b"Write a long story about a dragon.\n")
    p.stdin.flush()
    assert p.stdout.read(12)  # "> " and the reply has begun
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(b"Say hi.\n/exit\n", timeout=120)
    err = err.decode()
    assert p.returncode == 0 and _clean(err), err
    assert "(interrupted; the partial reply is kept)" in err or "(interrupted; the message was dropped)" in err
    assert err.count("tok/s") >= 1 and "KeyboardInterrupt" not in err  # the next turn was answered


# ------------------------------------------------------------------------ first-use papercuts


def _engine_errors(stderr: str) -> list[str]:
    """The engine's Python keyword names a CLI message must not show."""
    return [w for w in ("kv_tokens", "memory_budget", "max_batch_tokens", "threads=") if w in stderr]


def test_over_budget_names_the_cli_options(smollm2_path):
    """Refused over budget: the command line names its options (--kv-tokens, -c/--context,
    --memory-budget), the Python API its keyword arguments."""
    r = run_cli("generate", smollm2_path, "-p", "Hi", "-t", "1", "--kv-tokens", "100000", "--memory-budget", "400MiB")
    assert r.returncode == 1 and _clean(r.stderr), r.stderr
    assert "exceeds its budget (--memory-budget)" in r.stderr and "DOES NOT FIT" in r.stderr
    assert "lower --kv-tokens or -c/--context, or raise --memory-budget" in r.stderr, r.stderr
    assert not _engine_errors(r.stderr), r.stderr
    # serve loads in the background: the error it reports (from the loader) names the options too
    a = cli.build_parser().parse_args(["serve", smollm2_path, "-t", "1", "--kv-tokens", "100000",
                                       "--memory-budget", "400MiB"])
    with pytest.raises(MemoryError) as e:
        cli._load(a, smollm2_path)
    assert "raise --memory-budget" in str(e.value) and not _engine_errors(str(e.value)), str(e.value)
    # the same plan from Python: its keyword arguments
    import tensorfold

    with pytest.raises(MemoryError) as e:
        tensorfold.Engine(smollm2_path, threads=1, kv_tokens=100000, memory_budget="400MiB")
    assert "kv_tokens" in str(e.value) and "memory_budget" in str(e.value) and "--" not in str(e.value)


def test_context_range_is_stated_one_way(smollm2_path):
    """-c, the Python API and the native plan state the same range in the same words."""
    import tensorfold
    from tensorfold import _core

    want = "must be an integer in [2, 16777216]"
    r = run_cli("generate", smollm2_path, "-p", "x", "-c", "0")
    assert r.returncode == 2 and f"argument -c/--context: {want}, got 0" in r.stderr, r.stderr
    r = run_cli("plan", smollm2_path, "-c", "1")
    assert r.returncode == 2 and f"argument -c/--context: {want}, got 1" in r.stderr, r.stderr
    with pytest.raises(ValueError) as e:
        tensorfold.Engine(smollm2_path, context=1)
    assert f"context {want}" in str(e.value)
    with pytest.raises(ValueError) as e:
        _core.plan_memory(smollm2_path, context=2**24 + 1)
    assert f"context {want}" in str(e.value)


def test_generate_reports_the_prompt_size_even_with_n_0(smollm2_path):
    import tensorfold

    prompt = "Hello there, how are you today?"
    n_prompt = len(tensorfold.Engine(smollm2_path, threads=1, context=64).tokenize(prompt))
    for n in ("0", "1"):
        r = run_cli("generate", smollm2_path, "-p", prompt, "-n", n, "-t", "1", "--temperature", "0",
                    "--ignore-eos")
        assert r.returncode == 0 and _clean(r.stderr), r.stderr
        assert f"[prompt {n_prompt} tokens" in r.stderr, r.stderr
        assert f"generated {n} token{'' if n == '1' else 's'} at" in r.stderr, r.stderr


def test_counts_are_pluralised(smollm2_path):
    r = run_cli("generate", smollm2_path, "-p", "Hi", "-n", "1", "-t", "1", "--temperature", "0", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert re.search(r" on cpu:\w+, 1 thread in ", r.stderr) and "generated 1 token at" in r.stderr, r.stderr
    assert not re.search(r"\b1 (threads|tokens|bytes)\b", r.stderr), r.stderr


def test_chat_says_when_a_reply_is_cut_at_max_tokens(monkeypatch, capsys, smollm2_path):
    """The note appears exactly when the reply ended at -n (finish reason "length")."""
    import tensorfold

    eng = tensorfold.Engine(smollm2_path, threads=1, context=512)
    cases = []
    for msg, n in (("Tell me a long story about a dragon.", 3), ("Say just: hi", 200)):
        reason = eng.generate(messages=[{"role": "user", "content": msg}], max_tokens=n, temperature=0).finish_reason
        cases.append((msg, n, reason))
    assert {c[2] for c in cases} == {"length", "stop"}, cases  # one of each, or the test proves nothing
    for msg, n, reason in cases:
        rc, out, err = _chat(monkeypatch, capsys, f"{msg}\n/exit\n".encode(), smollm2_path, "-n", str(n),
                             "--temperature", "0", "-t", "1", "-c", "512")
        assert rc == 0 and _clean(err), err
        note = f"(reply cut at --max-tokens {n}; raise -n for longer replies)"
        assert (note in err) == (reason == "length"), (reason, err)


def test_quantize_and_worker_take_known_model_names(tmp_path):
    from tensorfold.pull import known_models

    name = known_models()[0]
    r = run_cli("quantize", name, "-o", str(tmp_path / "q.gguf"), "--keep", "*=Q8_0", "--dry-run", "-q")
    assert r.returncode == 0 and _clean(r.stderr), r.stderr
    assert "total:" in r.stdout and "bpw" in r.stdout
    # the worker resolves the name before it waits for rank 0 (here: a short wait that ends unanswered)
    r = run_cli("worker", name, "--listen", "127.0.0.1:0", "--wait", "0.2", "-t", "1")
    assert "not found" not in r.stderr and "worker: waiting for rank 0" in r.stderr, r.stderr
    r = run_cli("worker", "no-such-model", "--listen", "127.0.0.1:0", "--wait", "0.2")
    assert r.returncode == 1 and "tensorfold: error: model 'no-such-model' not found" in r.stderr
    assert "waiting for rank 0" not in r.stderr


def test_convert_errors_are_reported_like_every_command(tmp_path):
    r = run_cli("convert", str(tmp_path), "-o", str(tmp_path / "out.gguf"))
    assert r.returncode == 1 and _clean(r.stderr), r.stderr
    assert r.stderr.startswith("tensorfold: error: ") and "config.json not found" in r.stderr, r.stderr
    (tmp_path / "exists.gguf").write_bytes(b"x")
    r = run_cli("convert", str(tmp_path), "-o", str(tmp_path / "exists.gguf"))
    assert r.returncode == 2 and r.stderr.startswith("tensorfold: error: ") and "--force" in r.stderr


# What a plain `pip install .` lacks is told up front, before any model loads (a missing model
# would be reported first otherwise), in one line that says what to install.
_WITHOUT = """
import sys
for m in sys.argv[1].split(","):
    sys.modules[m] = None  # `import m` fails as if the package were not installed
from tensorfold.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _run_without(modules: str, *args):
    return subprocess.run([sys.executable, "-c", _WITHOUT, modules, *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))


def test_missing_dependencies_are_named_before_anything_loads(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    hf = tmp_path / "hf"
    hf.mkdir()
    for modules, args, want in (
        ("gguf", ("calibrate", "no-such-model", "--text", str(text), "-o", str(tmp_path / "c.gguf")),
         "tensorfold calibrate (writing the importance matrix) needs the 'gguf' package: pip install gguf"),
        ("gguf", ("quantize", "no-such-model.gguf", "-o", str(tmp_path / "q.gguf"), "--target-bpw", "3"),
         "tensorfold quantize (writing the GGUF) needs the 'gguf' package"),
        ("safetensors", ("quantize", str(hf), "-o", str(tmp_path / "q.gguf"), "--target-bpw", "3"),
         "needs the 'convert' extra: pip install 'tensorfold[convert]'"),
        ("safetensors", ("convert", str(hf), "-o", str(tmp_path / "c.gguf")),
         "needs the 'convert' extra: pip install 'tensorfold[convert]'")):
        r = _run_without(modules, *args)
        assert r.returncode == 1 and _clean(r.stderr), (args, r.stderr)
        assert r.stderr.startswith("tensorfold: error: ") and want in r.stderr, (args, r.stderr)
        assert "internal error" not in r.stderr and "not found" not in r.stderr, (args, r.stderr)


def test_gguf_is_a_core_dependency():
    """calibrate and quantize write GGUF files through the gguf package: a plain install has it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((pathlib.Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    core = [re.split(r"[<>=!~ ]", d)[0] for d in project["dependencies"]]
    assert "gguf" in core
    assert "safetensors" in [re.split(r"[<>=!~ ]", d)[0] for d in project["optional-dependencies"]["convert"]]


def test_symlink_loops_are_reported_as_such(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.symlink_to(b)
    b.symlink_to(a)
    for args in (("info", str(a)), ("generate", str(a), "-p", "x"), ("plan", str(a)),
                 ("quantize", str(a), "-o", str(tmp_path / "q.gguf"), "--target-bpw", "3"), ("pull", str(a))):
        r = run_cli(*args)
        assert r.returncode == 1 and _clean(r.stderr), (args, r.stderr)
        assert "too many levels of symbolic links" in r.stderr and "not found" not in r.stderr, (args, r.stderr)
    import tensorfold

    with pytest.raises(OSError) as e:
        tensorfold.Engine(str(a))
    assert e.value.errno == __import__("errno").ELOOP and "too many levels of symbolic links" in str(e.value)


def test_info_shows_large_sizes_in_gib(tmp_path, smollm2_path):
    big = tmp_path / "big.gguf"
    big.write_bytes(pathlib.Path(smollm2_path).read_bytes())
    os.truncate(big, 217 * 2**30)  # sparse: no disk is used
    r = run_cli("info", str(big))
    assert r.returncode == 0, r.stderr
    assert "size:          217.00 GiB (GGUF v3" in r.stdout, r.stdout
    r = run_cli("info", smollm2_path)
    size = os.path.getsize(smollm2_path)
    assert f"size:          {size / 2**20:.1f} MiB" in r.stdout


def test_info_describes_an_importance_matrix(tmp_path):
    np = pytest.importorskip("numpy")
    from tensorfold.calibrate import write_imatrix

    stats = {f"blk.{i}.ffn_up.weight": (np.ones((1, 8)), np.array([64])) for i in range(3)}
    path = tmp_path / "calib.gguf"
    write_imatrix(str(path), stats, chunk_count=5, chunk_size=128, datasets=["calib.txt"])
    r = run_cli("info", str(path))
    assert r.returncode == 0 and _clean(r.stderr), r.stderr
    assert "architecture: ?" not in r.stdout and "architecture:" not in r.stdout
    assert "importance matrix (for `tensorfold quantize --calib`" in r.stdout, r.stdout
    assert "3 entries" in r.stdout and "chunks:      5 of 128 tokens" in r.stdout and "calib.txt" in r.stdout


def test_license_file_matches_the_declared_license():
    root = pathlib.Path(__file__).parent.parent
    text = (root / "LICENSE").read_text("utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "Apache-2.0" in (root / "pyproject.toml").read_text("utf-8")
