"""TP=2 across two network namespaces joined by two veth pairs (one per rail), the closest a
single machine gets to two hosts with two NICs. Rank 1 (`tensorfold worker`) runs in ns A,
rank 0 (tests/tp_netns_driver.py) in ns B. TP=2 must give TP=1's greedy tokens with both
rails carrying traffic, and keep giving them when one rail's link goes down mid-generation.

Needs root (or CAP_NET_ADMIN) and iproute2; otherwise the module is skipped. Addresses are
documentation ranges only: rail 0 192.0.2.1 (A) <-> 192.0.2.2 (B), rail 1 198.51.100.1 (A)
<-> 198.51.100.2 (B)."""
from __future__ import annotations

import json
import os
import pathlib
import queue
import subprocess
import sys
import threading
import time

import pytest

import tensorfold

HERE = pathlib.Path(__file__).parent
FIXTURE = json.loads((HERE / "fixtures" / "smollm2_llamacpp.json").read_text("utf-8"))
TIMEOUT = 8.0  # --tp-timeout: a silent rail is dropped after TIMEOUT / 2
CONTEXT = 512
PORT = [29517]  # next bootstrap port (a new one per run: no TIME_WAIT surprises)
RAILS_A = ["192.0.2.1", "198.51.100.1"]
RAILS_B = ["192.0.2.2", "198.51.100.2"]


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({p.returncode}): {p.stderr.strip()}")


class NetnsPair:
    """Two namespaces, two veth pairs (one per rail), lo up. Removed by close()."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.ns = [f"tfA{pid}", f"tfB{pid}"]
        # veth names (<= 15 chars): rail r end in ns A / ns B
        self.veth = [[f"tfa{r}_{pid}", f"tfb{r}_{pid}"] for r in (0, 1)]
        self.created_ns: list[str] = []

    def setup(self) -> None:
        for ns in self.ns:
            _ip("netns", "add", ns)
            self.created_ns.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for r, (va, vb) in enumerate(self.veth):
            _ip("link", "add", va, "type", "veth", "peer", "name", vb)
            _ip("link", "set", va, "netns", self.ns[0])
            _ip("link", "set", vb, "netns", self.ns[1])
            for ns, dev, addr in ((self.ns[0], va, RAILS_A[r]), (self.ns[1], vb, RAILS_B[r])):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")

    def close(self) -> None:
        for ns in self.created_ns:  # deleting a namespace deletes the veth ends inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        for va, vb in self.veth:  # in case setup failed before moving them
            for dev in (va, vb):
                subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=20)

    def popen(self, side: int, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns[side], *argv], text=True, **kw)

    def kill_sockets(self, side: int, peer_ip: str) -> None:
        p = subprocess.run(["ip", "netns", "exec", self.ns[side], "ss", "-K", "-t", "dst", peer_ip],
                           capture_output=True, text=True, timeout=20)
        if p.returncode != 0:
            pytest.skip(f"ss -K failed: {p.stderr.strip()}")

    def link(self, side: int, rail: int, state: str) -> None:
        _ip("-n", self.ns[side], "link", "set", self.veth[rail][side], state)


@pytest.fixture(scope="module")
def netns():
    if sys.platform != "linux":
        pytest.skip("network namespaces are Linux-only")
    pair = NetnsPair()
    try:
        pair.setup()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        pair.close()
        pytest.skip(f"cannot create the two-namespace setup: {e}")
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture(scope="module")
def prompts_and_tp1(smollm2_path):
    """A short fixture prompt and a long one (~300 tokens: its prefill All-Reduces exceed the
    512 KiB chunk size, so they are striped over both rails), with TP=1's 32 greedy tokens."""
    short = FIXTURE["greedy"][0]["prompt_ids"]
    long_ = (FIXTURE["greedy"][5]["prompt_ids"] * 6)[:300]
    prompts = [short, long_]
    solo = tensorfold.Engine(smollm2_path, threads=1, context=CONTEXT, tp_compatible=True)
    expected = [solo.generate(p, max_tokens=32, temperature=0, ignore_eos=True).token_ids for p in prompts]
    solo.close()
    return prompts, expected


class Run:
    """Worker (rank 1) in ns A, driver (rank 0) in ns B."""

    def __init__(self, netns: NetnsPair, model: str, prompts: list, pause: tuple[int, int] | None = None):
        port = PORT[0]
        PORT[0] += 1
        self.worker = netns.popen(0, [sys.executable, "-m", "tensorfold.cli", "worker", model, "--tp", "2",
                                      "--rank", "1", "--listen", f"{RAILS_A[0]}:{port}",
                                      "--rails", ",".join(RAILS_A), "--tp-timeout", str(TIMEOUT),
                                      "-c", str(CONTEXT), "-t", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        argv = [sys.executable, str(HERE / "tp_netns_driver.py"), model, f"{RAILS_A[0]}:{port}",
                ",".join(RAILS_B), str(TIMEOUT), str(CONTEXT), json.dumps(prompts)]
        if pause:
            argv += [str(pause[0]), str(pause[1])]
        self.driver = netns.popen(1, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.driver.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_line(self, prefix: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        last = ""
        while (left := end - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith(prefix):
                return line
            last = line
        raise AssertionError(f"driver did not print {prefix!r} within {timeout} s (last line {last!r}, "
                             f"rc={self.driver.poll()}): {self.kill()}")

    def result(self, timeout: float = 60) -> dict:
        return json.loads(self.wait_line("RESULT ", timeout)[len("RESULT "):])

    def finish(self) -> tuple[int | None, str]:
        try:
            self.driver.wait(timeout=30)
            _, werr = self.worker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            return None, self.kill()
        return self.worker.returncode, werr

    def kill(self) -> str:
        for p in (self.driver, self.worker):
            if p.poll() is None:
                p.kill()
        derr, werr = (p.stderr.read() if p.stderr and not p.stderr.closed else "" for p in (self.driver, self.worker))
        return f"driver stderr: {derr[-2000:]}\nworker stderr: {werr[-2000:]}"


def test_tp2_across_namespaces_equals_tp1_on_both_rails(netns, smollm2_path, prompts_and_tp1):
    prompts, expected = prompts_and_tp1
    run = Run(netns, smollm2_path, prompts)
    try:
        res = run.result()
        rc, werr = run.finish()
    finally:
        run.kill()
    assert "error" not in res, res["error"]
    assert res["tokens"] == expected
    comm = res["comm"]
    assert comm["rail_failures"] == 0, comm
    assert [r["up"] for r in comm["rails"]] == [True, True], comm
    assert all(r["bytes_sent"] > 0 for r in comm["rails"]), comm["rails"]
    assert rc == 0, werr


@pytest.mark.parametrize("how,rail", [("down", 1), ("down", 0), ("reset", 1)])
def test_rail_lost_mid_generation(netns, smollm2_path, prompts_and_tp1, how, rail):
    """After a few tokens of the long prompt a rail is lost: "down" sets rank 0's veth of that
    rail down (the sockets see no error: the rail just goes silent, and must be dropped after
    TIMEOUT/2 of no progress); "reset" aborts rank 0's sockets on that rail (`ss -K`, an RST).
    Generation must finish on the other rail with TP=1's tokens."""
    prompts, expected = prompts_and_tp1
    # Pause right after the long prompt's prefill (its striped All-Reduces), then take the link
    # down on rank 0's side; the last prompt (re-run of the long one) then needs the lost rail.
    prompts = [prompts[1], prompts[0], prompts[1]]
    expected = [expected[1], expected[0], expected[1]]
    run = Run(netns, smollm2_path, prompts, pause=(0, 4))
    try:
        run.wait_line("PAUSED", 60)
        if how == "down":
            netns.link(1, rail, "down")
        else:
            netns.kill_sockets(1, RAILS_A[rail])
        run.driver.stdin.write("go\n")
        run.driver.stdin.flush()
        t0 = time.monotonic()
        res = run.result(timeout=4 * TIMEOUT + 30)
        took = time.monotonic() - t0
        run.finish()
    finally:
        run.kill()
        if how == "down":
            netns.link(1, rail, "up")
    assert "error" not in res, f"{res['error']} (after {took:.1f} s)"
    assert res["tokens"] == expected
    comm = res["comm"]
    assert comm["rail_failures"] >= 1, comm
    assert not comm["rails"][rail]["up"], comm["rails"]
    assert comm["rails"][rail].get("down_reason", "n/a"), comm["rails"]  # Engine stats may not carry it
    assert comm["rails"][1 - rail]["up"], comm["rails"]
    assert took < 2 * TIMEOUT + 20
