"""Measured kernel dispatch (tensorfold.kernel_tuning, backend/cpu/kernel_choice.h): the default
"cpu" backend runs each format's products with the instruction set recorded for its shape class,
exactly that set's kernel (bit for bit what the explicit "cpu:<isa>" backend computes, and near the
`gguf` package's dequantization); the measurement is cached per machine and build; explicit
variants ignore the record. Weights are tensors of llama.cpp-made files."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tensorfold import _core, kernel_tuning  # noqa: E402

FIX = pathlib.Path(__file__).parent / "fixtures" / "quant"
ISAS = [n.split(":", 1)[1] for n in _core.available_backends() if n.startswith("cpu:") and not n.endswith("scalar")]

# (file, a tensor of the wanted type): llama.cpp's quantizer wrote them.
FILES = {"Q4_K": "moe-Q4_K_M.gguf", "Q6_K": "moe-Q4_K_M.gguf", "IQ4_XS": "dense-IQ4_XS.gguf", "Q8_0": "dense-Q8_0.gguf"}


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch, tmp_path):
    monkeypatch.setenv("TENSORFOLD_HOME", str(tmp_path))
    monkeypatch.setenv("TENSORFOLD_KERNEL_TUNING", "on")
    _core.clear_cpu_kernel_choices()
    yield
    _core.clear_cpu_kernel_choices()


def _tensor(type_name: str):
    r = gguf.GGUFReader(str(FIX / FILES[type_name]))
    want = getattr(gguf.GGMLQuantizationType, type_name)
    t = next(t for t in r.tensors if t.tensor_type == want and len(t.shape) == 2)
    k, rows = int(t.shape[0]), int(t.shape[1])
    raw = np.ascontiguousarray(np.asarray(t.data).view(np.uint8).reshape(-1))
    dense = gguf.quants.dequantize(np.asarray(t.data), want).reshape(rows, k).astype(np.float64)
    return want, raw, rows, k, dense


@pytest.mark.skipif(not ISAS, reason="no vector kernels on this CPU or build")
@pytest.mark.parametrize("type_name", sorted(FILES))
@pytest.mark.parametrize("T", [1, 3, 17])  # decode, decode (batch), prefill
def test_recorded_choice_runs_that_kernel(type_name, T):
    want, raw, rows, k, dense = _tensor(type_name)
    x = np.random.default_rng(T).standard_normal((T, k)).astype(np.float32)
    cls = "decode" if T <= 4 else "prefill"
    ref = x.astype(np.float64) @ dense.T
    scale = np.abs(ref).max()
    for isa in ISAS:
        _core.set_cpu_kernel_choice(int(want), cls, isa)
        assert _core.cpu_kernel_choice(int(want), cls) == isa
        tuned = _core.Backend("cpu", 2).matmul(int(want), raw, rows, k, x)
        explicit = _core.Backend(f"cpu:{isa}", 2).matmul(int(want), raw, rows, k, x)
        assert np.array_equal(tuned, explicit), f"{type_name} {cls}: the tuned backend did not run the {isa} kernel"
        assert np.abs(tuned - ref).max() <= 0.05 * scale  # 8-bit activations: well inside this


@pytest.mark.skipif(len(ISAS) < 2, reason="one vector ISA: nothing to choose between")
def test_explicit_variant_ignores_the_record():
    want, raw, rows, k, _ = _tensor("Q4_K")
    x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
    low, high = ISAS[-1], ISAS[0]  # e.g. avx2, avx512
    base = _core.Backend(f"cpu:{high}", 1).matmul(int(want), raw, rows, k, x)
    _core.set_cpu_kernel_choice(int(want), "decode", low)
    assert np.array_equal(_core.Backend(f"cpu:{high}", 1).matmul(int(want), raw, rows, k, x), base)


@pytest.mark.skipif(not ISAS, reason="no vector kernels on this CPU or build")
def test_tune_measures_once_and_caches(monkeypatch):
    calls = []
    real = _core.cpu_kernel_time

    def timed(tid, cls, isa, threads, decode_bytes, reps):
        calls.append((tid, cls, isa))
        return real(tid, cls, isa, threads, 1 << 20, 1)  # small: the test checks the mechanism
    monkeypatch.setattr(_core, "cpu_kernel_time", timed)
    got = kernel_tuning.tune(["Q4_K", "Q8_0", "Q4_K", "I32", "NOT_A_TYPE"], 1, quiet=True)
    assert set(got) == {"Q4_K", "Q8_0"}
    assert all(set(v) == {"decode", "prefill"} and set(v.values()) <= set(ISAS) for v in got.values())
    assert len(calls) == (2 * 2 * len(ISAS) if len(ISAS) > 1 else 0)
    data = json.loads(kernel_tuning.cache_path().read_text())
    entry = data["machines"][kernel_tuning.machine_key()]["threads"]["1"]
    assert entry["Q4_K"]["decode"]["isa"] == got["Q4_K"]["decode"]
    # The second time nothing is measured and the same choices are recorded.
    _core.clear_cpu_kernel_choices()
    monkeypatch.setattr(_core, "cpu_kernel_time", lambda *a: pytest.fail("measured again"))
    assert kernel_tuning.tune(["Q8_0", "Q4_K"], 1, quiet=True) == got
    assert kernel_tuning.choices(["Q4_K"]) == {"Q4_K": got["Q4_K"]}


@pytest.mark.skipif(not ISAS, reason="no vector kernels on this CPU or build")
def test_corrupt_cache_is_measured_again(monkeypatch):
    path = kernel_tuning.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    monkeypatch.setattr(_core, "cpu_kernel_time", lambda tid, cls, isa, *a: 1.0 if isa == ISAS[0] else 0.5)
    got = kernel_tuning.tune(["Q6_K"], 1, quiet=True)
    assert got["Q6_K"]["decode"] == (ISAS[-1] if len(ISAS) > 1 else ISAS[0])
    assert json.loads(path.read_text())["version"] == 1


def test_tuning_off(monkeypatch):
    monkeypatch.setenv("TENSORFOLD_KERNEL_TUNING", "off")
    monkeypatch.setattr(_core, "cpu_kernel_time", lambda *a: pytest.fail("measured while off"))
    assert kernel_tuning.tune(["Q4_K"], 1) == {}
    assert not kernel_tuning.cache_path().exists()
    assert kernel_tuning.choices(["Q4_K"]) == {"Q4_K": {"decode": _core.cpu_isa(), "prefill": _core.cpu_isa()}}


def test_bad_choices_are_refused():
    q4k = int(gguf.GGMLQuantizationType.Q4_K)
    with pytest.raises(ValueError, match="decode"):
        _core.set_cpu_kernel_choice(q4k, "gemv", ISAS[0] if ISAS else "scalar")
    with pytest.raises(ValueError, match="impl must be"):
        _core.set_cpu_kernel_choice(q4k, "decode", "sse9")
    with pytest.raises(ValueError, match="no kernel|supported"):
        _core.set_cpu_kernel_choice(int(gguf.GGMLQuantizationType.I32), "decode", "scalar")


@pytest.mark.skipif(not ISAS, reason="no vector kernels on this CPU or build")
def test_kernel_time_is_a_duration():
    s = _core.cpu_kernel_time(int(gguf.GGMLQuantizationType.IQ4_XS), "prefill", ISAS[0], 1, 1 << 20, 1)
    assert 0 < s < 60
