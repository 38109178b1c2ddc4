"""Row-interleaved (R8) weights (csrc/backend/cpu/repack.h): K-quant tensors written by llama.cpp
rewritten eight rows at a time in place, their products against the `gguf` package's
dequantization in float64 (within the bound the file-layout row kernels meet), every ISA's
kernel against the scalar reference bit for bit, the prefill panels built from R8 groups equal
to those built from the file, and whole models with repacking on against the same models with
it off (TENSORFOLD_REPACK=off) against the numpy float64 reference forward."""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tensorfold import _core  # noqa: E402

Q = gguf.GGMLQuantizationType
FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "quant"
# (file made by llama.cpp's quantizer, type): one tensor of each R8 type, rows a multiple of 8
CASES = [("dense-Q2_K.gguf", Q.Q2_K), ("dense-Q3_K_M.gguf", Q.Q3_K), ("dense-Q4_K_M.gguf", Q.Q4_K),
         ("dense-Q5_K_S.gguf", Q.Q5_K), ("dense-Q6_K.gguf", Q.Q6_K)]
BACKENDS = _core.available_backends()
ISAS = [i for i in ("avx2", "avx512") if f"cpu:{i}" in BACKENDS]


def _tensor(name, t):
    r = gguf.GGUFReader(str(FIXTURES / name))
    x = max((x for x in r.tensors if x.tensor_type == t and len(x.shape) >= 2), key=lambda x: int(np.prod(x.shape)))
    k, rows = int(x.shape[0]), int(np.prod(x.shape[1:]))
    assert rows % 8 == 0 and k % 256 == 0
    raw = np.ascontiguousarray(np.asarray(x.data).view(np.uint8).reshape(-1))
    return raw, rows, k, gguf.quants.dequantize(np.asarray(x.data), t).reshape(rows, k).astype(np.float64)


@pytest.mark.parametrize("name,t", CASES, ids=[t.name for _, t in CASES])
def test_pack_is_a_permutation_of_the_file_bytes(name, t):
    raw, rows, k, _ = _tensor(name, t)
    packed = _core.r8_pack(int(t), raw, rows, k)
    assert packed.size == raw.size and not np.array_equal(packed, raw)
    assert np.array_equal(_core.r8_unpack(int(t), packed, rows, k), raw)
    # the same bits, moved: a super-block holds exactly its eight file blocks' ones
    assert np.unpackbits(packed).sum() == np.unpackbits(raw).sum()


@pytest.mark.parametrize("name,t", CASES, ids=[t.name for _, t in CASES])
def test_products_against_gguf_dequantization(name, t):
    raw, rows, k, dense = _tensor(name, t)
    packed = _core.r8_pack(int(t), raw, rows, k)
    rng = np.random.default_rng(int(t))
    x = rng.standard_normal((5, k)).astype(np.float32)
    ref = x.astype(np.float64) @ dense.T
    file_rows = _core.kernels_matmul(int(t), raw, rows, k, x, "scalar", 1)
    bound = 1.01 * np.abs(file_rows - ref).max() + 1e-5 * np.abs(ref).max()
    scalar = _core.r8_matmul(int(t), packed, rows, k, x, "scalar")
    # the activations' 8-bit rounding dominates: the file-layout kernels' own error, plus float noise
    assert np.abs(scalar - ref).max() <= bound
    for isa in ISAS:
        assert np.array_equal(_core.r8_matmul(int(t), packed, rows, k, x, isa), scalar), isa
    # a column's result does not depend on the columns beside it
    for c in range(5):
        assert np.array_equal(_core.r8_matmul(int(t), packed, rows, k, x[c:c + 1], "auto")[0], scalar[c])


@pytest.mark.skipif("cpu:avx512" not in BACKENDS, reason="the prefill panels need AVX-512 VNNI")
@pytest.mark.parametrize("name,t", CASES, ids=[t.name for _, t in CASES])
def test_panels_from_groups_equal_panels_from_the_file(name, t):
    raw, rows, k, _ = _tensor(name, t)
    packed = _core.r8_pack(int(t), raw, rows, k)
    rng = np.random.default_rng(3)
    for ncols in (1, 9, 20):
        x = rng.standard_normal((ncols, k)).astype(np.float32)
        want = _core.kernels_matmul(int(t), raw, rows, k, x, "avx512_panels", 1)
        assert np.array_equal(_core.r8_matmul(int(t), packed, rows, k, x, "avx512_panels"), want), ncols


def test_bad_shapes_are_refused():
    raw, rows, k, _ = _tensor("dense-Q2_K.gguf", Q.Q2_K)
    with pytest.raises(ValueError, match="multiple of 8"):
        _core.r8_pack(int(Q.Q2_K), raw[: (rows - 1) * raw.size // rows], rows - 1, k)
    with pytest.raises(ValueError, match="unsupported"):
        _core.r8_pack(int(Q.Q8_0), raw, rows, k)


_LOGITS = r"""
import sys, numpy as np, tensorfold
e = tensorfold.Engine(sys.argv[1], threads=2, context=256, prefix_cache=False)
ids = [int(t) for t in sys.argv[3:]]
exact = e.logits(ids, generated_from=0)      # every row as a decoded token's (the R8 GEMV)
prompt = e.logits(ids)                         # every row as a prompt's (panels built from the groups)
np.save(sys.argv[2], np.stack([exact, prompt]))
"""


def _logits(model, out, ids, repack):
    env = dict(os.environ, TENSORFOLD_REPACK="on" if repack else "off")
    subprocess.run([sys.executable, "-c", _LOGITS, str(model), str(out), *map(str, ids)], env=env, check=True,
                   timeout=600)
    return np.load(out).astype(np.float64)


@pytest.mark.skipif("cpu:avx512" not in BACKENDS, reason="weights are repacked where the AVX-512 panels exist")
@pytest.mark.parametrize("name", ["dense-Q4_K_M.gguf", "dense-Q5_K_S.gguf", "moe-Q2_K.gguf", "deep-Q3_K_L.gguf"])
def test_models_against_the_float64_reference(tmp_path, name):
    """Whole llama.cpp-made models against the independent float64 forward over gguf's
    dequantization (tests/reference_forward.py): with the weights repacked the engine stays as
    close to it as with the file's layout (only the float summation order differs)."""
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from reference_forward import ReferenceModel

    ids = [int(t) for t in np.random.default_rng(0).integers(3, 200, size=24)]
    ref = ReferenceModel(str(FIXTURES / name)).logits(ids)
    on = _logits(FIXTURES / name, tmp_path / "on.npy", ids, True)
    off = _logits(FIXTURES / name, tmp_path / "off.npy", ids, False)
    scale = np.abs(ref).max()
    # the decoded rows did go through the groups (their summation order differs from the file kernels')
    assert not np.array_equal(on[0], off[0])
    for role in (0, 1):  # decoded rows, prompt rows
        err_on, err_off = np.abs(on[role] - ref).max(), np.abs(off[role] - ref).max()
        assert err_on <= 1.25 * err_off + 1e-3 * scale, (name, role, err_on, err_off, scale)
        # top-1 agrees with the oracle wherever its two best are further apart than the error
        top2 = np.sort(ref, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * max(err_on, err_off)
        assert (on[role].argmax(-1) == ref.argmax(-1))[clear].all(), (name, role)
