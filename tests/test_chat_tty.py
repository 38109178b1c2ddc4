"""`tensorfold chat` in a terminal, driven through a pseudo-terminal as a person would: a long
paste arrives whole (a terminal in its ordinary line mode passes on at most 4095 bytes of a
line and drops the rest silently), arrow keys edit the line and recall history instead of
landing in the message as `^[[A`, and where no line editor is available a line that may have
been cut is said to be. Every wait is bounded."""
from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal (POSIX)")

PASTE = "word " * 4000  # 20,000 characters: far over the terminal's 4095-byte line
WAIT = 120.0  # seconds any one expected output may take (the model loads in well under that)

# The chat as `python -m tensorfold chat`, optionally as if Python had no readline module.
_NO_READLINE = """
import sys
sys.modules["readline"] = None  # `import readline` fails, as on a Python built without it
from tensorfold.cli import main
sys.exit(main(sys.argv[1:]))
"""


class Chat:
    """A chat subprocess whose stdin and stdout are a pseudo-terminal (80x24), stderr a pipe."""

    def __init__(self, model: str, *, readline: bool = True):
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        args = ["chat", model, "-c", "512", "-n", "4", "--temperature", "0", "-t", "1"]
        cmd = [sys.executable, "-m", "tensorfold", *args] if readline else [sys.executable, "-c", _NO_READLINE, *args]
        env = dict(os.environ, TERM="xterm", INPUTRC=os.devnull)  # no user key bindings
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=subprocess.PIPE, env=env,
                                     start_new_session=True)  # the pty becomes its controlling terminal
        os.close(slave)
        self.master = master
        self.out = bytearray()  # what the terminal shows (prompts, echo, replies)
        self.err = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._pump, args=(lambda: os.read(master, 65536), self.out), daemon=True).start()
        threading.Thread(target=self._pump, args=(lambda: self.proc.stderr.read1(65536), self.err),
                         daemon=True).start()

    def _pump(self, read, buf: bytearray) -> None:
        while True:
            try:
                b = read()
            except (OSError, ValueError):  # EIO once the child has closed the terminal
                return
            if not b:
                return
            with self._lock:
                buf.extend(b)

    def stderr(self) -> str:
        with self._lock:
            return self.err.decode("utf-8", "replace")

    def wait_for(self, what: str, pred) -> None:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            with self._lock:
                if pred():
                    return
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the pumps drain what it wrote last
                with self._lock:
                    if pred():
                        return
                break
            time.sleep(0.05)
        raise AssertionError(f"timed out or exited waiting for {what}; stderr:\n{self.stderr()}\n"
                             f"terminal (last 2000 bytes):\n{bytes(self.out[-2000:])!r}")

    def wait_prompt(self, n: int) -> None:
        """Until the input prompt was shown n times (readline writes it to the terminal; Python's
        plain terminal input writes it to stderr)."""
        self.wait_for(f"prompt #{n}", lambda: self.out.count(b"> ") + self.err.count(b"> ") >= n)

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def paste(self, text: str) -> None:
        """As a terminal pastes: inside bracketed-paste marks when the program asked for them."""
        data = text.encode()
        with self._lock:
            bracketed = b"\x1b[?2004h" in self.out
        if bracketed:
            data = b"\x1b[200~" + data + b"\x1b[201~"
        for i in range(0, len(data), 4096):  # a terminal writes a paste in pieces
            os.write(self.master, data[i:i + 4096])

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=WAIT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=30)
            os.close(self.master)


def _too_long_tokens(stderr: str) -> list[int]:
    return [int(n) for n in re.findall(r"\(that message is too long: (\d+) tokens", stderr)]


@pytest.fixture(scope="module")
def engine(smollm2_path):
    import tensorfold

    with tensorfold.Engine(smollm2_path, threads=1, context=512) as eng:
        yield eng


def _prompt_tokens(engine, text: str) -> int:
    """Tokens of `text` as the chat's only message (what the chat measures against the context)."""
    return len(engine._prompt_ids(None, [{"role": "user", "content": text.strip()}]))


def test_a_long_paste_arrives_whole_and_arrow_keys_edit(smollm2_path, engine):
    whole = _prompt_tokens(engine, PASTE)
    fragment = _prompt_tokens(engine, PASTE.encode()[:4095].decode())
    assert whole > 4 * fragment  # the two are told apart by the count the chat reports

    chat = Chat(smollm2_path)
    try:
        chat.wait_prompt(1)
        chat.paste(PASTE)
        chat.type(b"\r")  # Enter
        chat.wait_for("the too-long report", lambda: b"(that message is too long" in chat.err)
        assert _too_long_tokens(chat.stderr()) == [whole], chat.stderr()

        # Left, Right, then the last letter: line editing, not escape bytes in the message
        chat.wait_prompt(2)
        chat.type(b"/rese\x1b[D\x1b[Ct\r")
        chat.wait_for("/reset",
                      lambda: chat.err.count(b"(conversation cleared)") == 1 or b"unknown command" in chat.err)
        assert "unknown command" not in chat.stderr(), chat.stderr()
        # Up recalls the previous line from this session's history
        chat.wait_prompt(3)
        chat.type(b"\x1b[A\r")
        chat.wait_for("/reset again", lambda: chat.err.count(b"(conversation cleared)") == 2 or b"[" in
                      chat.err.rpartition(b"(conversation cleared)")[2])  # or a reply to an "^[[A" message
        assert chat.stderr().count("(conversation cleared)") == 2, chat.stderr()
        chat.wait_prompt(4)
        chat.type(b"/exit\r")
        rc = chat.close()
    finally:
        if chat.proc.poll() is None:
            chat.proc.kill()
    err = chat.stderr()
    assert rc == 0, err
    assert "unknown command" not in err and "Traceback" not in err, err
    assert "the terminal may have cut it" not in err  # a line editor reads the whole line


def test_without_a_line_editor_a_cut_line_is_said_to_be(smollm2_path):
    chat = Chat(smollm2_path, readline=False)
    try:
        chat.wait_prompt(1)
        chat.paste(PASTE)
        chat.type(b"\r")
        # the note comes first, then the (cut) message is answered or refused as too long
        chat.wait_for("the note", lambda: b"the terminal may have cut it" in chat.err or b"(that message" in chat.err
                      or b" tok/s" in chat.err)
        assert "the terminal may have cut it" in chat.stderr(), chat.stderr()
        chat.wait_prompt(2)
        chat.type(b"/exit\r")
        rc = chat.close()
    finally:
        if chat.proc.poll() is None:
            chat.proc.kill()
    err = chat.stderr()
    assert rc == 0 and "Traceback" not in err, err
    # the note states the size of the line the terminal gave: its limit
    m = re.search(r"that line is (\d+) bytes", err)
    assert m and int(m.group(1)) >= 4095, err
