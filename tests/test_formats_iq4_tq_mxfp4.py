"""IQ4_XS, TQ1_0 and MXFP4 on blocks made by llama.cpp's own quantizer (random bytes are
covered by test_quant_reference.py / test_kernels.py; these are the blocks real files hold).

For every tensor of these types: TensorFold's reference dequantization (`_core.dequantize`)
must be bit-exact with `gguf.quants.dequantize`, and its matmul kernels (scalar, AVX2 and
AVX-512 where the CPU has them) must stay within the 8-bit activation-quantization bound of
the float64 product with those dequantized weights (the bound test_kernels.py derives).

Two sources of blocks:
- tests/fixtures/formats/iq4_tq_mxfp4.gguf (committed, a few KB: rows cut from tensors that
  llama-quantize wrote), so CI without llama.cpp checks real blocks;
- a fresh run of llama-quantize when it is available (LLAMA_QUANTIZE=path, or LLAMA_BIN=dir,
  or llama-quantize on PATH, or the vendored llama-cpp-python build under /tmp/dl): a tiny
  one-layer llama written here with gguf.GGUFWriter in F32, quantized with base type IQ4_XS
  and `--tensor-type` overrides for TQ1_0 and MXFP4 (this llama.cpp build accepts MXFP4 on
  any tensor; the MXFP4_MOE file type would put it on expert tensors only).

Regenerate the fixture (deterministic for a given llama.cpp build):
    TENSORFOLD_CORE_DIR=build PYTHONPATH=python python tests/test_formats_iq4_tq_mxfp4.py \\
        --regenerate [--llama-quantize PATH]
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from tensorfold import _core  # noqa: E402

FORMATS = [Q.IQ4_XS, Q.TQ1_0, Q.MXFP4]
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "formats" / "iq4_tq_mxfp4.gguf"
VENDORED = Path("/tmp/dl/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize")

# The tiny model: every row length a multiple of 256 (so llama.cpp never falls back to
# another type). Which tensor gets which of our formats:
HIDDEN, FFN, VOCAB = 512, 768, 64
OVERRIDES = {"ffn_gate": "mxfp4", "ffn_up": "tq1_0"}  # the rest: base type IQ4_XS
FIXTURE_ROWS = 6  # rows kept per tensor in the committed fixture


def find_llama_quantize() -> str | None:
    cands = [os.environ.get("LLAMA_QUANTIZE")]
    if os.environ.get("LLAMA_BIN"):
        cands.append(str(Path(os.environ["LLAMA_BIN"]) / "llama-quantize"))
    cands += [shutil.which("llama-quantize"), str(VENDORED)]
    for c in cands:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return None


def available_impls() -> list[str]:
    isa = _core.kernel_isa()
    return {"avx512": ["scalar", "avx2", "avx512"], "avx2": ["scalar", "avx2"]}.get(isa, ["scalar"])


# --------------------------------------------------------------------------------------------
# Generating blocks with llama.cpp


def write_tiny_f32(path: Path, seed: int = 0) -> None:
    """One-layer llama in F32. Rows get magnitudes spread over 2^-12 .. 2^4 (fp16 and E8M0
    scales far from 1, some fp16 d subnormal); ffn_up is ternary-like (a BitNet-style
    weight, so TQ1_0 meets all three codes rather than mostly zeros)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(1)
    w.add_feed_forward_length(FFN)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(128)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)

    def mat(name: str, rows: int, cols: int, ternary: bool = False) -> None:
        if ternary:
            a = rng.choice([-1.0, 0.0, 1.0], size=(rows, cols)) + 0.05 * rng.standard_normal((rows, cols))
        else:
            a = rng.standard_normal((rows, cols))
            a[rng.random((rows, cols)) < 0.01] *= 8.0  # outliers, as trained weights have
        a *= 2.0 ** rng.uniform(-12, 4, size=(rows, 1))
        w.add_tensor(name, a.astype(np.float32))

    ones = np.ones(HIDDEN, np.float32)
    mat("token_embd.weight", VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("blk.0.attn_norm.weight", ones)
    w.add_tensor("blk.0.ffn_norm.weight", ones)
    for name, rows, cols in [("attn_q", HIDDEN, HIDDEN), ("attn_k", 256, HIDDEN), ("attn_v", 256, HIDDEN),
                             ("attn_output", HIDDEN, HIDDEN), ("ffn_gate", FFN, HIDDEN),
                             ("ffn_up", FFN, HIDDEN), ("ffn_down", HIDDEN, FFN)]:
        mat(f"blk.0.{name}.weight", rows, cols, ternary=name == "ffn_up")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_quantize(exe: str, src: Path, dst: Path) -> None:
    cmd = [exe]
    for tensor, typ in OVERRIDES.items():
        cmd += ["--tensor-type", f"{tensor}={typ}"]
    cmd += [str(src), str(dst), "IQ4_XS", "1"]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(Path(exe).resolve().parent) + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert out.returncode == 0, f"llama-quantize failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"


def format_tensors(path: Path) -> list[tuple[str, Q, np.ndarray, int]]:
    """(name, type, raw rows [rows, row bytes], k) of every tensor in one of FORMATS."""
    out = []
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type in FORMATS:
            k = int(t.shape[0])
            raw = np.ascontiguousarray(np.asarray(t.data, dtype=np.uint8)).reshape(-1, gguf.quant_shape_to_byte_shape((k,), t.tensor_type)[0])
            out.append((t.name, Q(t.tensor_type), raw, k))
    return out


# --------------------------------------------------------------------------------------------
# The checks


def check_tensor(name: str, t: Q, raw: np.ndarray, k: int) -> None:
    rows = raw.shape[0]
    flat = raw.reshape(-1)
    W32 = np.asarray(dequantize(raw, t), dtype=np.float32).reshape(rows, k)
    got = _core.dequantize(int(t), flat, rows * k).reshape(rows, k)
    bad = np.nonzero(got.view(np.uint32) != W32.view(np.uint32))
    assert bad[0].size == 0, f"{name} ({t.name}): dequantize differs at {bad[0].size} values, first {bad[0][0]},{bad[1][0]}"

    # Activations with a per-block spread and outliers; the bound is the exact worst case of
    # 8-bit quantization of x per activation block (32 values for MXFP4, 256 for the others).
    W = W32.astype(np.float64)
    rng = np.random.default_rng(rows * 1000 + k)
    ab = 32 if t == Q.MXFP4 else 256
    ncols_list = [1, 2, 5]
    for ncols in ncols_list:
        x = rng.standard_normal((ncols, k)).astype(np.float32)
        x[:, ::37] *= 20.0
        ref = x.astype(np.float64) @ W.T
        absprod = np.abs(x.astype(np.float64)) @ np.abs(W).T
        amax = np.abs(x.reshape(ncols, k // ab, ab)).max(axis=2) / 254.0
        wabs = np.abs(W).reshape(rows, k // ab, ab).sum(axis=2)
        bound = (amax @ wabs.T) * 1.0001 + 1e-5 * absprod + 1e-30
        outs = {}
        for impl in available_impls():
            y = _core.kernels_matmul(int(t), flat, rows, k, x, impl=impl).astype(np.float64)
            err = np.abs(y - ref)
            assert (err <= bound).all(), (
                f"{name} ({t.name}) {impl} ncols={ncols}: error {err.max():.3g} over the bound at "
                f"{np.unravel_index(np.argmax(err - bound), err.shape)}")
            outs[impl] = y
        for impl, y in outs.items():  # ISAs differ only in float summation order
            assert (np.abs(y - outs["scalar"]) <= 1e-5 * absprod + 1e-30).all(), f"{name} {impl} vs scalar"


def test_fixture_real_blocks():
    assert FIXTURE.is_file(), f"missing {FIXTURE} (regenerate: see the module docstring)"
    tensors = format_tensors(FIXTURE)
    assert sorted({t.name for _, t, _, _ in tensors}) == sorted(f.name for f in FORMATS)
    for name, t, raw, k in tensors:
        check_tensor(name, t, raw, k)


def test_fixture_blocks_are_llama_cpp_made():
    """The fixture records where its blocks came from (not hand-made bytes)."""
    r = gguf.GGUFReader(str(FIXTURE))
    src = r.fields["tensorfold.fixture.source"]
    assert "llama-quantize" in bytes(src.parts[src.data[0]]).decode()


@pytest.fixture(scope="module")
def fresh_quantized(tmp_path_factory) -> Path:
    exe = find_llama_quantize()
    if exe is None:
        pytest.skip("llama-quantize not found (set LLAMA_QUANTIZE or LLAMA_BIN); the committed fixture covers real blocks")
    d = tmp_path_factory.mktemp("llamacpp")
    write_tiny_f32(d / "tiny-f32.gguf", seed=1)
    llama_quantize(exe, d / "tiny-f32.gguf", d / "tiny-q.gguf")
    return d / "tiny-q.gguf"


def test_fresh_llama_quantize_blocks(fresh_quantized):
    tensors = format_tensors(fresh_quantized)
    types = {t for _, t, _, _ in tensors}
    assert types == set(FORMATS), f"llama-quantize wrote {sorted(x.name for x in types)}"
    for name, t, raw, k in tensors:
        check_tensor(name, t, raw, k)


# --------------------------------------------------------------------------------------------
# Fixture regeneration


def regenerate(exe: str, out: Path = FIXTURE) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        write_tiny_f32(d / "tiny-f32.gguf", seed=0)
        llama_quantize(exe, d / "tiny-f32.gguf", d / "tiny-q.gguf")
        picked = {}
        for name, t, raw, k in format_tensors(d / "tiny-q.gguf"):
            picked.setdefault(t, (name, raw, k))  # first tensor of each type
        assert set(picked) == set(FORMATS)
        out.parent.mkdir(parents=True, exist_ok=True)
        w = gguf.GGUFWriter(str(out), "tensorfold-fixture")
        w.add_string("tensorfold.fixture.source",
                     "rows of tensors written by llama.cpp's llama-quantize (base IQ4_XS, --tensor-type "
                     + " ".join(f"{a}={b}" for a, b in OVERRIDES.items())
                     + ") from a random F32 llama; see tests/test_formats_iq4_tq_mxfp4.py")
        for t in FORMATS:
            name, raw, k = picked[t]
            w.add_string(f"tensorfold.fixture.{t.name}.from", name)
            # Rows spread over the tensor (their magnitudes differ by row).
            idx = np.linspace(0, raw.shape[0] - 1, FIXTURE_ROWS).astype(int)
            w.add_tensor(t.name, np.ascontiguousarray(raw[idx]), raw_dtype=t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regenerate", action="store_true", help=f"rewrite {FIXTURE}")
    ap.add_argument("--llama-quantize", default=None)
    a = ap.parse_args()
    if not a.regenerate:
        ap.error("nothing to do (use pytest to run the tests, --regenerate to rewrite the fixture)")
    exe = a.llama_quantize or find_llama_quantize()
    if exe is None:
        sys.exit("llama-quantize not found")
    regenerate(exe)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
