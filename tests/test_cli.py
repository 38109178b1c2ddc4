"""The `tensorfold` command line, run as a user would (a subprocess)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "smollm2_llamacpp.json").read_text("utf-8"))


def run_cli(*args, stdin: str | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "tensorfold.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("chat", "generate", "info", "pull"):
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


def test_errors_are_clear_not_tracebacks(tmp_path):
    r = run_cli("info", str(tmp_path / "nope.gguf"))
    assert r.returncode == 1 and "error" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    r = run_cli("generate", str(bad), "-p", "x")
    assert r.returncode == 1 and "Traceback" not in r.stderr
