"""Tensor parallel TP=2 as two processes on loopback: rank 1 is `tensorfold worker`, rank 0
is an Engine in this process. TP=2 must give TP=1's tokens; each rank holds about half the
weights; a lost peer is an error within the timeout; mismatched ranks are refused."""
from __future__ import annotations

import json
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import tensorfold

FIXTURE = json.loads((pathlib.Path(__file__).parent / "fixtures" / "smollm2_llamacpp.json").read_text("utf-8"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(model: str, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tensorfold.cli", "worker", model, "--listen",
                             f"127.0.0.1:{port}", "-t", "1", "--tp-timeout", "10", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Pair:
    """Rank 0 (in process) + rank 1 (subprocess)."""

    def __init__(self, model: str, context: int = 256, **kw):
        self.port = free_port()
        self.worker = start_worker(model, self.port, "-c", str(context))
        self.engine = tensorfold.Engine(model, threads=1, context=context, tp=2, rank=0,
                                        peer=f"127.0.0.1:{self.port}", timeout=10, **kw)

    def close(self) -> str:
        self.engine.close()
        try:
            _, err = self.worker.communicate(timeout=30)
        finally:
            if self.worker.poll() is None:
                self.worker.kill()
        return err


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A tiny random Qwen3-MoE from transformers, converted to an F32 GGUF."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from test_hf_parity import _tokenizer  # the same locally trained tokenizer

    from tensorfold.convert import convert

    d = tmp_path_factory.mktemp("tp-moe")
    vocab = _tokenizer(d)
    torch.manual_seed(7)
    cfg = transformers.Qwen3MoeConfig(vocab_size=vocab, hidden_size=72, num_hidden_layers=2, num_attention_heads=6,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                      moe_intermediate_size=64, num_experts=5, num_experts_per_tok=2,
                                      norm_topk_prob=True, max_position_embeddings=256, initializer_range=0.08)
    transformers.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    out = d / "moe-f32.gguf"
    convert(str(d), str(out), "f32", progress=False)
    return str(out)


def test_tp2_equals_tp1_on_tiny_moe(tiny_moe):
    ids = [5, 17, 3, 250, 9, 33, 101, 7]
    solo = tensorfold.Engine(tiny_moe, threads=1, context=256, tp_compatible=True)
    ref_logits = solo.logits(ids)
    ref_tokens = solo.generate(ids, max_tokens=32, temperature=0, ignore_eos=True).token_ids
    ref_routing = solo.routing(ids)
    pair = Pair(tiny_moe)
    try:
        lg = pair.engine.logits(ids)
        span = float(ref_logits.max() - ref_logits.min())
        assert float(np.abs(lg - ref_logits).max()) <= 1e-5 * span
        assert pair.engine.generate(ids, max_tokens=32, temperature=0, ignore_eos=True).token_ids == ref_tokens
        assert pair.engine.routing(ids) == ref_routing
        comm = pair.engine.stats()["comm"]
        assert comm["all_reduces"] > 0 and comm["rail_failures"] == 0
    finally:
        err = pair.close()
    assert pair.worker.returncode == 0, err


def test_tp2_greedy_equals_tp1_on_smollm2(smollm2_path):
    solo = tensorfold.Engine(smollm2_path, threads=1, context=256, tp_compatible=True)
    cases = FIXTURE["greedy"][:3]
    expected = [solo.generate(c["prompt_ids"], max_tokens=32, temperature=0, ignore_eos=True).token_ids for c in cases]
    pair = Pair(smollm2_path)
    try:
        got = [pair.engine.generate(c["prompt_ids"], max_tokens=32, temperature=0, ignore_eos=True).token_ids
               for c in cases]
        # Each rank holds about half of the weights (row halves are views, never touched by the
        # other rank; column halves are private copies).
        assert pair.engine._core.weight_bytes <= 0.55 * solo._core.weight_bytes
    finally:
        err = pair.close()
    assert got == expected
    assert "holding" in err
    held = float(err.split("holding ")[1].split(" MiB")[0]) * 2**20
    assert held <= 0.55 * solo._core.weight_bytes


def test_peer_killed_mid_generation_raises_within_timeout(tiny_moe):
    pair = Pair(tiny_moe)
    try:
        it = pair.engine.stream([5, 6, 7], max_tokens=200, temperature=0, ignore_eos=True)
        next(it)
        pair.worker.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises((RuntimeError, ValueError)):
            for _ in it:
                pass
        assert time.monotonic() - t0 < 10 + 5
    finally:
        pair.worker.kill()
        pair.worker.wait()


def test_rank0_killed_worker_exits_with_error(tiny_moe):
    """Rank 0 crashes (SIGKILL, no shutdown message): the worker reports the lost peer and
    exits with an error within its timeout, never hangs."""
    port = free_port()
    worker = start_worker(tiny_moe, port, "-c", "256")
    leader = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, tensorfold\n"
        f"e = tensorfold.Engine({tiny_moe!r}, threads=1, context=256, tp=2, rank=0, peer='127.0.0.1:{port}', timeout=10)\n"
        "e.generate([5, 6], max_tokens=2, temperature=0)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert leader.stdout.readline().strip() == "ready"
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        t0 = time.monotonic()
        _, err = worker.communicate(timeout=30)
        assert time.monotonic() - t0 < 10 + 5
        assert worker.returncode == 1 and "error" in err and "Traceback" not in err
    finally:
        for p in (leader, worker):
            if p.poll() is None:
                p.kill()


def test_mismatched_ranks_are_refused(tiny_moe):
    """Rank 0 is refused at once; the worker drops it, keeps listening for a matching rank 0
    until its --wait runs out, then exits saying what it rejected."""
    port = free_port()
    worker = start_worker(tiny_moe, port, "-c", "128", "--tp-timeout", "3", "--wait", "3")
    try:
        with pytest.raises((RuntimeError, ValueError), match="(?i)differ|mismatch|handshake"):
            tensorfold.Engine(tiny_moe, threads=1, context=256, tp=2, rank=0, peer=f"127.0.0.1:{port}", timeout=10)
        _, err = worker.communicate(timeout=30)
        assert worker.returncode != 0 and "Traceback" not in err
        assert "rejected a connection" in err and "rejected 1 connection(s)" in err and "differs" in err
    finally:
        if worker.poll() is None:
            worker.kill()
