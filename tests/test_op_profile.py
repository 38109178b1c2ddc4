"""The per-op profile (TENSORFOLD_PROFILE_OPS=1, backend/profiled_backend.h): the wrapped backend
computes exactly what the plain one does, and each op is counted once with the weight bytes its
product read. Weights: a tensor of a llama.cpp-made file."""
import pathlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tensorfold import _core  # noqa: E402

FIX = pathlib.Path(__file__).parent / "fixtures" / "quant"


def test_profiled_backend_is_transparent_and_counts(monkeypatch, smollm2_path):
    r = gguf.GGUFReader(str(FIX / "moe-Q4_K_M.gguf"))
    t = next(t for t in r.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_K and len(t.shape) == 2)
    k, rows = int(t.shape[0]), int(t.shape[1])
    raw = np.ascontiguousarray(np.asarray(t.data).view(np.uint8).reshape(-1))
    x = np.random.default_rng(0).standard_normal((9, k)).astype(np.float32)
    q4k = int(gguf.GGMLQuantizationType.Q4_K)
    plain = [_core.Backend("cpu", 1).matmul(q4k, raw, rows, k, x[:n]) for n in (1, 9)]
    monkeypatch.setenv("TENSORFOLD_PROFILE_OPS", "1")
    _core.reset_op_profile()
    b = _core.Backend("cpu", 1)
    for n, ref in zip((1, 9), plain):
        assert np.array_equal(b.matmul(q4k, raw, rows, k, x[:n]), ref)
    prof = _core.op_profile()
    assert set(prof) == {"matmul Q4_K decode", "matmul Q4_K prefill"}
    for v in prof.values():
        assert v["calls"] == 1 and v["seconds"] > 0 and v["weight_bytes"] == raw.nbytes
    _core.reset_op_profile()
    assert _core.op_profile() == {}
    # A whole engine under the profiler: the same greedy tokens, and the step's ops recorded.
    import tensorfold
    monkeypatch.setenv("TENSORFOLD_PROFILE_OPS", "0")
    ref = tensorfold.Engine(smollm2_path, threads=1, context=256)
    want = ref.generate("The capital of France is", max_tokens=6, temperature=0).token_ids
    ref.close()
    monkeypatch.setenv("TENSORFOLD_PROFILE_OPS", "1")
    eng = tensorfold.Engine(smollm2_path, threads=1, context=256)
    assert eng.generate("The capital of France is", max_tokens=6, temperature=0).token_ids == want
    eng.close()
    prof = _core.op_profile()
    assert {"attention decode", "rmsnorm", "matmul Q4_1 decode"} <= set(prof), sorted(prof)
    _core.reset_op_profile()
