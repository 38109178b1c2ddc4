"""Activation quantization: the 8-bit rows every quantized product makes of its float input
before the dot products (csrc/backend/cpu/kernels_internal.h), in both layouts:

* 32-value blocks (weights Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL / MXFP4 ...): pairs of
  blocks with a scale and a scaled sum each;
* 256-value blocks (K-quants and most IQ formats): a scale and 16 partial sums per block.

Measured through _core.kernels_quantize_act (one thread, the ISA of the backend) at 1, 64 and 512
rows of 2048 and 4096 values. The layouts are block-wise with an even number of 32-value blocks
per row here, so R rows are quantized as one row of R x k values: the same bytes and work as R
calls, without R Python calls. A product spreads its rows over the backend's threads in chunks
of 8 rows, so its share of a T-row product is about this time / threads for T >= 16.
Reports ns per row and input GB/s (float bytes read / time); a last case times the call
itself on 64 values (the 1-row figures include it).
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

import _common  # noqa: E402
from _common import isa_of, record  # noqa: E402
from tensorfold import _core  # noqa: E402

pytestmark = pytest.mark.bench

# layout name: a weight type that multiplies with it
LAYOUTS = {"blocks32": Q.Q8_0, "blocks256": Q.Q4_K}
CASES = [(lay, r, k) for lay in LAYOUTS for k in (2048, 4096) for r in (1, 64, 512)]


@pytest.mark.parametrize("backend_name", [b for b in _common.backend_names() if b.startswith("cpu")])
@pytest.mark.parametrize("layout,rows,k", CASES, ids=[f"{lay}-{r}x{k}" for lay, r, k in CASES])
def test_quantize_activations(benchmark, backend_name, layout, rows, k):
    t = int(LAYOUTS[layout])
    impl = isa_of(backend_name)
    x = np.random.default_rng(rows).standard_normal(rows * k, dtype=np.float32)
    xq = benchmark(_core.kernels_quantize_act, t, x, impl)
    assert xq.nbytes == rows * _core.kernels_act_row_bytes(t, k)
    # the float scales: after all the int8 values (32-value blocks), or leading each 320-byte block
    if layout == "blocks32":
        scales = xq[rows * k:].view(np.float32)
    else:
        scales = xq.reshape(-1, 320)[:, :4].copy().view(np.float32)
    assert np.isfinite(scales).all() and (scales != 0).any(), "bad activation scales"
    sec = _common.best_seconds(benchmark)
    if sec is None:
        return
    record(benchmark, "activation quantization (1 thread)", f"{layout} {rows}x{k} {impl}",
           ns_per_row=sec * 1e9 / rows, GB_s=x.nbytes / sec / 1e9)


def test_quantize_activations_call(benchmark):
    """The Python call around the kernel (64 values): what the 1-row figures carry on top."""
    x = np.ones(64, dtype=np.float32)
    benchmark(_core.kernels_quantize_act, int(Q.Q8_0), x, "auto")
    sec = _common.best_seconds(benchmark)
    if sec is not None:
        record(benchmark, "activation quantization (1 thread)", "call overhead (64 values)", ns_per_row=sec * 1e9)
