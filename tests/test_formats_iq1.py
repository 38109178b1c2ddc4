"""IQ1_S / IQ1_M on blocks made by llama.cpp's own quantizer.

Random bytes (test_quant_reference / test_kernels) reach every bit pattern but not the
statistics of real files: llama-quantize picks grid points near the weights, mixes both shift
signs within a block and uses all 2048 grid entries (11-bit indices) with real scales. Here
TensorFold's reference dequantization must be bit-exact with gguf.quants.dequantize on such
blocks, and every kernel ISA must stay within the 8-bit activation-quantization bound of the
float product.

- tests/fixtures/formats/iq1.gguf (committed, ~6 KB): one IQ1_S and one IQ1_M tensor that
  llama-quantize wrote (CI has no llama.cpp). Regenerate with
      LLAMA_BIN=/path/to/llama.cpp/build/bin python tests/test_formats_iq1.py
- When llama-quantize is available (LLAMA_BIN folder or PATH), a fresh, larger file is
  quantized in a temporary folder and checked the same way.
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "formats" / "iq1.gguf"
# tensor name -> llama-quantize type; the names are llama FFN weights so that the loader
# accepts the file, and --tensor-type puts each in its own format.
TENSORS = {"blk.0.ffn_up.weight": "iq1_s", "blk.0.ffn_gate.weight": "iq1_m"}


# ------------------------------------------------------------------------------- llama.cpp side

def llama_quantize_path() -> Path | None:
    d = os.environ.get("LLAMA_BIN")
    p = Path(d) / "llama-quantize" if d else None
    if p is not None and p.is_file():
        return p
    w = shutil.which("llama-quantize")
    return Path(w) if w else None


def write_f16_model(path: Path, k: int, rows: int, seed: int) -> dict[str, np.ndarray]:
    """A minimal llama GGUF (metadata llama-quantize's loader needs + two FFN weights) whose
    rows mix Gaussian and heavy-tailed values with per-column spread, so that real blocks get
    varied scales and both shift signs."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(k)
    w.add_feed_forward_length(k)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    col = 0.5 + rng.random(k)
    out = {}
    for i, name in enumerate(TENSORS):
        base = rng.standard_normal((rows, k)) if i % 2 == 0 else rng.laplace(size=(rows, k))
        out[name] = (base * col * 0.02).astype(np.float16)
        w.add_tensor(name, out[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_legacy_imatrix(path: Path, names, k: int, seed: int) -> None:
    """llama.cpp's legacy imatrix file: int32 count, then per entry (name length, name,
    ncall, nval, float[nval]). llama-quantize refuses IQ1 types without one."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(names)))
        for n in names:
            f.write(struct.pack("<i", len(n)) + n.encode())
            f.write(struct.pack("<ii", 1, k) + (0.25 + rng.random(k)).astype(np.float32).tobytes())


def quantize_with_llama(quantize: Path, out: Path, work: Path, k: int, rows: int, seed: int) -> None:
    f16, imat = work / "iq1-f16.gguf", work / "iq1.imatrix"
    write_f16_model(f16, k, rows, seed)
    write_legacy_imatrix(imat, list(TENSORS), k, seed + 1)
    overrides = [a for name, t in TENSORS.items() for a in ("--tensor-type", f"{name.split('.')[-2]}={t}")]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(quantize.parent) + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    r = subprocess.run([str(quantize), "--imatrix", str(imat), *overrides, str(f16), str(out), "IQ1_M", "2"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    assert r.returncode == 0, r.stdout[-3000:]


# ------------------------------------------------------------------------------- checks

def _impls(core) -> list[str]:
    return {"avx512": ["scalar", "avx2", "avx512"], "avx2": ["scalar", "avx2"]}.get(core.kernel_isa(), ["scalar"])


def _coverage(t: Q, raw: np.ndarray) -> tuple[set, int]:
    """(shift signs used, number of distinct grid indices) of the blocks in raw."""
    if t == Q.IQ1_S:
        b = raw.reshape(-1, 50)
        qh = b[:, 34:50].copy().view(np.uint16)  # [nb, 8]
        hi = (qh[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7  # [nb, 8, 4]
        idx = b[:, 2:34].reshape(-1, 8, 4).astype(np.int64) | (hi.astype(np.int64) << 8)
        signs = set(((qh >> 15) & 1).reshape(-1).tolist())
    else:
        b = raw.reshape(-1, 56)
        nib = (b[:, 32:48, None] >> np.array([0, 4], dtype=np.uint8)) & 0xF  # [nb, 16, 2]
        nib = nib.reshape(-1, 32)
        idx = b[:, 0:32].astype(np.int64) | ((nib & 7).astype(np.int64) << 8)
        signs = set(((nib >> 3) & 1).reshape(-1).tolist())
    return signs, len(np.unique(idx))


def check_file(path: Path, core) -> None:
    reader = gguf.GGUFReader(str(path))
    seen = set()
    rng = np.random.default_rng(5)
    for t in reader.tensors:
        qt = Q(t.tensor_type)
        assert qt in (Q.IQ1_S, Q.IQ1_M), (t.name, qt.name)
        seen.add(qt)
        k, rows = (int(v) for v in t.shape)  # gguf order: [k, rows]
        raw = np.ascontiguousarray(np.asarray(t.data).reshape(-1), dtype=np.uint8)
        signs, ngrid = _coverage(qt, raw)
        assert signs == {0, 1} and ngrid > 100, (t.name, signs, ngrid)  # real blocks, varied

        W = np.asarray(dequantize(raw, qt), dtype=np.float32).reshape(rows, k)
        ours = core.dequantize(int(qt), raw, rows * k)
        np.testing.assert_array_equal(ours.view(np.uint32), W.reshape(-1).view(np.uint32), err_msg=t.name)

        # the matmul kernels vs the float64 product: within the bound of quantizing each
        # activation block of 256 to 8 bits (|dx| <= amax/254), plus float32 summation slack
        W64 = W.astype(np.float64)
        for ncols in (1, 3, 8):
            x = rng.standard_normal((ncols, k)).astype(np.float32)
            ref = x.astype(np.float64) @ W64.T
            absprod = np.abs(x.astype(np.float64)) @ np.abs(W64).T
            amax = np.abs(x.reshape(ncols, k // 256, 256)).max(axis=2) / 254.0
            bound = amax @ np.abs(W64).reshape(rows, k // 256, 256).sum(axis=2).T * 1.0001 + 1e-5 * absprod + 1e-7 * absprod.max()
            outs = {}
            for impl in _impls(core):
                y = core.kernels_matmul(int(qt), raw, rows, k, x, impl=impl).astype(np.float64)
                err = np.abs(y - ref)
                assert (err <= bound).all(), f"{t.name} {impl} ncols={ncols}: err {err.max():.3g}"
                outs[impl] = y
            for impl, y in outs.items():
                assert np.abs(y - outs["scalar"]).max() <= 1e-5 * absprod.max(), (t.name, impl, ncols)
    assert seen == {Q.IQ1_S, Q.IQ1_M}


@pytest.fixture(scope="module")
def core():
    from tensorfold import _core
    return _core


def test_llama_quantized_fixture(core):
    assert FIXTURE.is_file(), f"{FIXTURE} missing (see this file's docstring to regenerate)"
    check_file(FIXTURE, core)


def test_llama_quantized_fresh(core, tmp_path):
    quantize = llama_quantize_path()
    if quantize is None:
        pytest.skip("llama-quantize not found (set LLAMA_BIN to llama.cpp's build/bin): fixture only")
    out = tmp_path / "iq1-fresh.gguf"
    quantize_with_llama(quantize, out, tmp_path, k=1024, rows=48, seed=11)
    check_file(out, core)


if __name__ == "__main__":  # regenerate the committed fixture
    q = llama_quantize_path()
    if q is None:
        sys.exit("llama-quantize not found: set LLAMA_BIN")
    import tempfile
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        quantize_with_llama(q, FIXTURE, Path(d), k=512, rows=24, seed=3)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
