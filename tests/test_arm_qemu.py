"""aarch64 kernels under qemu-user, on x86 CI machines.

The aarch64 build is a cross build (cmake/aarch64-linux-gnu.cmake, static executables) of two
standalone drivers (tests/native): tf_kernel_check runs every format x ISA level against the
scalar reference (the bound of test_kernels.py), tf_model_check runs a whole-model forward.
Each ISA level runs on a qemu CPU model that has exactly that level, so runtime detection is
exercised too: cortex-a72 (NEON only), neoverse-n1 (dotprod, no i8mm), max with 128-bit SVE
(i8mm, SVE2).

Default run: the kernel check (a ~40 s cross build of the kernel sources, then ~40 s under
qemu for the three levels) and the whole-model forward of a small MoE fixture (deepseek2, F32
and quantized Q8_0/Q4_0/F16) compared with the x86 forward (the full core is cross-built first,
about a minute more). Marked slow: the same for SmolLM2 (~45 s more under qemu).

Skips with the reason when cmake, g++-aarch64-linux-gnu or qemu-user is missing
(Debian: apt-get install qemu-user g++-aarch64-linux-gnu; .ci/run installs them).
TENSORFOLD_ARM_BUILD overrides the cross build directory (default build-aarch64 in the repo).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("TENSORFOLD_ARM_BUILD", ROOT / "build-aarch64"))
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
CXX = shutil.which("aarch64-linux-gnu-g++")
CMAKE = shutil.which("cmake")

_missing = [name for name, path in (("qemu-aarch64 (qemu-user)", QEMU), ("aarch64-linux-gnu-g++", CXX),
                                    ("cmake", CMAKE)) if not path]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"aarch64 cross tools missing: {', '.join(_missing)}")

# The qemu CPU model that has exactly each ISA level (its best level is that one).
QEMU_CPU = {"neon": "cortex-a72", "dotprod": "neoverse-n1", "i8mm": "max,sve128=on"}


def _build(target: str, timeout: int) -> Path:
    if not (BUILD / "CMakeCache.txt").exists():
        subprocess.run([CMAKE, "-S", str(ROOT), "-B", str(BUILD),
                        f"-DCMAKE_TOOLCHAIN_FILE={ROOT / 'cmake' / 'aarch64-linux-gnu.cmake'}",
                        "-DCMAKE_BUILD_TYPE=Release", "-DTENSORFOLD_CUDA=OFF", "-DTENSORFOLD_PYTHON=OFF",
                        "-DTENSORFOLD_CHECK_DRIVERS=ON"], check=True, capture_output=True, timeout=300)
    r = subprocess.run([CMAKE, "--build", str(BUILD), "--target", target, "-j2"], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"cross build of {target} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return BUILD / target


def _qemu(cpu: str, *args: str, timeout: int = 600, env: dict | None = None) -> str:
    r = subprocess.run([QEMU, "-cpu", cpu, *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"qemu -cpu {cpu} {' '.join(args)}: rc {r.returncode}\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def kernel_check() -> Path:
    return _build("tf_kernel_check", timeout=900)


@pytest.mark.parametrize("level", list(QEMU_CPU))
def test_kernels_every_format_under_qemu(kernel_check, level):
    out = _qemu(QEMU_CPU[level], str(kernel_check))
    assert f"best isa {level}" in out, out[:400]  # runtime detection picked this CPU's level
    levels = list(QEMU_CPU)[: list(QEMU_CPU).index(level) + 1]
    assert f"checking: {' '.join(levels)}" in out, out[:400]
    assert "formats without a vector kernel (scalar fallback): none" in out, out
    assert "PASSED" in out and "FAIL" not in out, out


# ---- whole-model forward: aarch64 under qemu vs x86, same GGUF, same tokens ---------------

MOE_FIXTURE = ROOT / "tests" / "fixtures" / "deepseek2" / "v3" / "llamacpp-f32.gguf"
TOKENS = [1, 504, 3458, 282, 253, 1345, 28, 9, 4521, 2114, 17]


def _x86_logits(path: str, ids: list[int], impl: str | None = None) -> np.ndarray:
    import tensorfold

    kw = {"backend": f"cpu:{impl}"} if impl else {}
    eng = tensorfold.Engine(path, threads=2, context=256, **kw)
    # Every row through the row kernels (as generated tokens are): aarch64 has no prefill panels,
    # so x86's row kernels are its like-for-like reference.
    return np.array(eng.logits(ids, generated_from=0), dtype=np.float64)


def _arm_logits(model_check: Path, path: str, ids: list[int], level: str, tmp_path: Path) -> np.ndarray:
    out = tmp_path / f"logits_{level}.f32"
    text = _qemu(QEMU_CPU[level], str(model_check), path, str(out), "2", *map(str, ids), timeout=1200)
    assert f"isa {level}" in text, text
    return np.fromfile(out, dtype=np.float32).astype(np.float64).reshape(len(ids), -1)


def _compare_forward(path: str, ids: list[int], tmp_path: Path) -> dict[str, float]:
    ref = _x86_logits(path, ids)
    # The bound: x86's own vector and scalar forwards may differ this much (float summation
    # order only: both quantize activations identically and sum integers exactly); aarch64
    # differs from x86 for the same reason, so it must stay within the same distance.
    scalar = _x86_logits(path, ids, "scalar")
    scale = np.abs(ref).max()
    bound = max(2.0 * np.abs(scalar - ref).max(), 1e-4 * scale)
    model_check = _build("tf_model_check", timeout=3000)
    devs = {}
    for level in QEMU_CPU:
        arm = _arm_logits(model_check, path, ids, level, tmp_path)
        assert arm.shape == ref.shape
        dev = np.abs(arm - ref).max()
        devs[level] = dev
        assert dev <= bound, f"{level}: max |arm - x86| = {dev:.3g} > bound {bound:.3g} (scale {scale:.3g})"
        # Greedy tokens agree wherever x86's top two logits are further apart than the bound
        # (a near-tie may flip between x86's own scalar and vector forwards too).
        top2 = np.sort(ref, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > bound
        assert (arm.argmax(-1) == ref.argmax(-1))[clear].all(), f"{level}: greedy tokens differ"
    print(f"{Path(path).name}: max |arm - x86| by level {devs}, bound {bound:.3g}, |logits| max {scale:.3g}")
    return devs


@pytest.mark.slow
def test_smollm2_forward_aarch64_equals_x86(smollm2_path, tmp_path):
    _compare_forward(smollm2_path, TOKENS, tmp_path)


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0-q4_0-f16"])
def test_moe_forward_aarch64_equals_x86(tmp_path, quantized):
    path = str(MOE_FIXTURE)
    if quantized:  # the experts as Q8_0 / Q4_0 / F16 (the fixture is too narrow for 256-blocks)
        from tensorfold.quantize import quantize

        path = str(tmp_path / "moe_q.gguf")
        quantize(str(MOE_FIXTURE), path, target_bpw=10, candidates=["Q8_0", "Q4_0", "F16"], progress=False,
                 echo=lambda *a, **k: None)
    _compare_forward(path, [t % 300 for t in TOKENS], tmp_path)
