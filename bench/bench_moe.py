"""One MoE FFN layer through the backend seam: router product (F32), Backend.route (softmax,
top-k, normalised), grouped expert products (Backend.matmul_stack: gate and up over the gathered
token rows, down over the expert rows), Backend.silu_mul and Backend.combine; no shared expert.

Shapes: hidden 2048, 64 experts of width 1536, top-6 (DeepSeek-V2-Lite-like; its width 1408 is
not a multiple of the 256-value blocks of these formats, 1536 is the next that is), and the
small-expert shape hidden 1024, 80 experts of width 512, top-8; T = 1, 64 and 512 tokens
(512 x 8 / 80 = 51 token rows per expert on average). Weight formats Q4_K, IQ2_XXS, IQ3_XXS,
IQ4_XS. Every round takes the next of 8 input batches, so decode routes to different experts
(the layer's experts are several times the L3; one token's are not).

Reports GFLOP/s of the expert products, the expert weight bytes a call reads (the distinct
experts its tokens route to) per second and their fraction of the DRAM read bandwidth, and
token rows per expert.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

import _common  # noqa: E402
from _common import make_backend, quantized_rows, record  # noqa: E402

pytestmark = pytest.mark.bench

# name: (hidden, experts, expert width, experts per token)
SHAPES = {
    "h2048-e64x1536-top6": (2048, 64, 1536, 6),
    "h1024-e80x512-top8": (1024, 80, 512, 8),
}
TYPES = [Q.Q4_K, Q.IQ2_XXS, Q.IQ3_XXS, Q.IQ4_XS]
TOKENS = [1, 64, 512]
BATCHES = 8
ROUNDS = {1: 16, 64: 5, 512: 3}
CASES = [(s, t, n) for s in SHAPES for t in TYPES for n in TOKENS]


class MoeLayer:
    """The weights of one layer and the backend calls of its forward."""

    def __init__(self, be, t: Q, hidden: int, n_exp: int, width: int, top: int):
        self.be, self.t, self.hidden, self.n_exp, self.width, self.top = be, int(t), hidden, n_exp, width, top
        self.gate = quantized_rows(int(t), n_exp * width, hidden, seed=1).reshape(-1)
        self.up = quantized_rows(int(t), n_exp * width, hidden, seed=2).reshape(-1)
        self.down = quantized_rows(int(t), n_exp * hidden, width, seed=3).reshape(-1)
        rng = np.random.default_rng(4)
        self.router = (rng.standard_normal((n_exp, hidden), dtype=np.float32) * np.float32(hidden ** -0.5))
        self.router_bytes = self.router.reshape(-1).view(np.uint8)
        self.expert_bytes = (self.gate.nbytes + self.up.nbytes + self.down.nbytes) // n_exp

    def route(self, x: np.ndarray):
        logits = self.be.matmul(int(Q.F32), self.router_bytes, self.n_exp, self.hidden, x)
        return self.be.route(logits, self.top, 1, True)

    def forward(self, x: np.ndarray) -> np.ndarray:
        be = self.be
        ids, w, offsets, rows, slot = self.route(x)
        g = be.matmul_stack(self.t, self.gate, self.n_exp, self.width, self.hidden, x, offsets, rows)
        u = be.matmul_stack(self.t, self.up, self.n_exp, self.width, self.hidden, x, offsets, rows)
        h = be.silu_mul(g, u)
        d = be.matmul_stack(self.t, self.down, self.n_exp, self.hidden, self.width, h, offsets)
        return be.combine(d, ids, w, slot, 0, self.n_exp)


_layer: dict[tuple, MoeLayer] = {}


def layer_for(be, backend_name: str, shape: str, t: Q) -> MoeLayer:
    key = (backend_name, shape, t)
    if key not in _layer:
        _layer.clear()  # one layer at a time: cases run shape by shape, format by format
        _layer[key] = MoeLayer(be, t, *SHAPES[shape])
    return _layer[key]


@pytest.mark.parametrize("backend_name", _common.backend_names())
@pytest.mark.parametrize("shape,t,T", CASES, ids=[f"{s}-{t.name}-T{n}" for s, t, n in CASES])
def test_moe_layer(benchmark, dram_gbps, backend_name, shape, t, T):
    be = make_backend(backend_name)
    if not be.supports(int(t)):
        pytest.skip(f"{backend_name} does not compute with {t.name}")
    layer = layer_for(be, backend_name, shape, t)
    hidden, n_exp, width, top = SHAPES[shape]
    rng = np.random.default_rng(T)
    inputs = [rng.standard_normal((T, hidden), dtype=np.float32) for _ in range(BATCHES)]
    distinct = [len(np.unique(layer.route(x)[0])) for x in inputs]
    batches = itertools.cycle(inputs)
    out = benchmark.pedantic(layer.forward, setup=lambda: ((next(batches),), {}), rounds=ROUNDS[T],
                             warmup_rounds=1)
    assert out.shape == (T, hidden) and np.isfinite(out).all(), f"{t.name}: non-finite MoE output"
    sec = _common.best_seconds(benchmark)
    if sec is None:
        return
    touched = float(np.mean(distinct)) * layer.expert_bytes
    gbps = touched / sec / 1e9
    record(benchmark, "moe", f"{shape} {t.name} T={T} {backend_name}",
           rows_per_expert=T * top / n_exp, experts_read=float(np.mean(distinct)), read_MB=touched / 1e6,
           GB_s=gbps, frac_of_dram=gbps / dram_gbps,
           GFLOP_s=2.0 * T * top * 3 * hidden * width / sec / 1e9)
