#!/usr/bin/env python3
"""Write a synthetic, llama.cpp-loadable `qwen3moe` GGUF for DRAM-bound MoE benchmarks.

    python bench/make_synthetic_moe.py -o /tmp/synth-moe.gguf               # ~1.5 GB
    python bench/make_synthetic_moe.py -o /tmp/synth-moe.gguf --size-gb 3
    python bench/make_synthetic_moe.py -o /tmp/x.gguf --layers 4 --hidden 1024 --experts 16 \\
        --used 4 --expert-ff 512 --heads 8 --kv-heads 2 --vocab 8000
    python bench/make_synthetic_moe.py -o /tmp/synth-moe-f16.gguf --outtype f16   # ~4 GB, F16

The default shape follows Qwen3-30B-A3B (hidden 2048, 32 query / 4 KV heads of 128, expert
width 768, q/k norms) with 64 routed experts, top-8, a 32000-token vocabulary, and as many
layers as fit --size-gb (default 1.5 GB, well above the ~260 MB L3 of the benchmark machines).
The type mix is that of real low-bit MoE checkpoints (--mix):

    q2k (default, like Q2_K):  expert gate/up Q2_K, expert down Q3_K
    q3k (like Q3_K_M):         expert gate/up Q3_K, expert down Q4_K
    always:                    attention q/k/v/o Q4_K, token_embd Q4_K, output Q6_K,
                               norms and router (ffn_gate_inp) F32

--outtype f16 instead writes every weight matrix in F16 (norms and router F32, as llama.cpp's
converter does), default --size-gb 4 (6 layers): the input for llama.cpp's own quantizer
(bench/make_quantized_moe.py), whose Q2_K … IQ4_XS outputs are then 0.5-1.1 GB, several times
the L3. F16 values are fresh random normals for every row (no pool; ~1 min for 4 GB).

Weights are random normals (std 0.02; norms 1 + 0.02 N(0,1)) quantized with TensorFold's own
quantizers (tensorfold._core.quantize). Quantizing 1.5 G values at ~7 M/s/thread would take
minutes, so by default each (type, row length) gets a pool of --pool-rows distinct random rows
that is quantized once, and every quantized tensor is assembled from rows drawn at random from
its pool: each row is a genuinely quantized normal row (valid scales, realistic value
distribution), rows merely repeat across the file. --pool-rows 0 quantizes every row (slow).
Tensors are streamed to disk one at a time, so memory stays around the largest tensor.

The tokenizer is a minimal but valid byte-level BPE ('gpt2', pre 'qwen2'): the 256 byte tokens,
merges that grow letter strings, and <|endoftext|>/<|im_start|>/<|im_end|> control tokens.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# ggml type ids (csrc/quant/traits, gguf.GGMLQuantizationType)
F32, F16, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 0, 1, 10, 11, 12, 13, 14
QK_K = 256
BLOCK_BYTES = {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210}
TYPE_NAME = {F32: "F32", F16: "F16", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
# llama_ftype values for general.file_type
FTYPE = {"q2k": 10, "q3k": 12, "f16": 1}  # MOSTLY_Q2_K, MOSTLY_Q3_K_M, MOSTLY_F16
MIX = {"q2k": (Q2_K, Q3_K), "q3k": (Q3_K, Q4_K)}  # (expert gate/up, expert down)
DEFAULT_SIZE_GB = {"mix": 1.5, "f16": 4.0}
HEAD_DIM = 128
W_STD = 0.02


def row_bytes(t: int, n: int) -> int:
    if t == F32:
        return 4 * n
    if t == F16:
        return 2 * n
    assert n % QK_K == 0, f"row length {n} is not a multiple of {QK_K} ({TYPE_NAME[t]})"
    return n // QK_K * BLOCK_BYTES[t]


class Shape:
    def __init__(self, a: argparse.Namespace):
        self.layers = a.layers
        self.hidden, self.experts, self.used = a.hidden, a.experts, a.used
        self.expert_ff, self.heads, self.kv_heads, self.vocab = a.expert_ff, a.heads, a.kv_heads, a.vocab
        self.f16 = a.outtype == "f16"
        self.gate_up_t, self.down_t = (F16, F16) if self.f16 else MIX[a.mix]

    def tensors(self):
        """(name, ggml shape [ne0, ne1, ...], type) in file order."""
        h, q, kv, f, e = (self.hidden, self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM,
                          self.expert_ff, self.experts)
        att, emb, head = (F16, F16, F16) if self.f16 else (Q4_K, Q4_K, Q6_K)
        out = [("token_embd.weight", [h, self.vocab], emb)]
        for i in range(self.layers):
            p = f"blk.{i}."
            out += [
                (p + "attn_norm.weight", [h], F32),
                (p + "attn_q.weight", [h, q], att),
                (p + "attn_k.weight", [h, kv], att),
                (p + "attn_v.weight", [h, kv], att),
                (p + "attn_output.weight", [q, h], att),
                (p + "attn_q_norm.weight", [HEAD_DIM], F32),
                (p + "attn_k_norm.weight", [HEAD_DIM], F32),
                (p + "ffn_norm.weight", [h], F32),
                (p + "ffn_gate_inp.weight", [h, e], F32),
                (p + "ffn_gate_exps.weight", [h, f, e], self.gate_up_t),
                (p + "ffn_up_exps.weight", [h, f, e], self.gate_up_t),
                (p + "ffn_down_exps.weight", [f, h, e], self.down_t),
            ]
        out += [("output_norm.weight", [h], F32), ("output.weight", [h, self.vocab], head)]
        return out

    def nbytes(self) -> int:
        return sum(row_bytes(t, s[0]) * int(np.prod(s[1:], dtype=np.int64)) for _, s, t in self.tensors())


def pick_layers(a: argparse.Namespace) -> int:
    """Number of layers whose file size is closest to --size-gb."""
    a.layers = 1
    one = Shape(a).nbytes()
    a.layers = 2
    per_layer = Shape(a).nbytes() - one
    fixed = one - per_layer
    return max(1, round((a.size_gb * 1e9 - fixed) / per_layer))


def byte_level_tokenizer(vocab: int):
    """Tokens, token types, merges of a small valid byte-level BPE vocabulary of size `vocab`."""
    # GPT-2 byte <-> unicode mapping: printable bytes map to themselves, the rest to U+0100...
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    enc, extra = {}, 0
    for b in range(256):
        if b in keep:
            enc[b] = chr(b)
        else:
            enc[b] = chr(256 + extra)
            extra += 1
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    n_merge = vocab - 256 - len(specials)
    if n_merge < 0:
        raise SystemExit(f"--vocab must be at least {256 + len(specials)}")
    tokens = [enc[b] for b in range(256)]
    seen = set(tokens)
    merges: list[str] = []
    # grow strings one letter at a time, breadth first: every merge "x y" has a single-character
    # right side, so every merged string is new and every merge is reachable.
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    frontier = [enc[ord(" ")]] + letters + [c.upper() for c in letters] + [str(d) for d in range(10)]
    while len(merges) < n_merge:
        nxt = []
        for x in frontier:
            for y in letters:
                if len(merges) == n_merge:
                    break
                s = x + y
                if s in seen:
                    continue
                seen.add(s)
                tokens.append(s)
                merges.append(f"{x} {y}")
                nxt.append(s)
        frontier = nxt
    types = [1] * len(tokens) + [3] * len(specials)  # NORMAL, CONTROL
    tokens += specials
    return tokens, types, merges


class RowSource:
    """Quantized random-normal rows, either all fresh or drawn from a pool per (type, length)."""

    def __init__(self, pool_rows: int, threads: int, seed: int):
        self.pool_rows, self.threads = pool_rows, threads
        self.rng = np.random.default_rng(seed)
        self.pools: dict[tuple[int, int], np.ndarray] = {}
        self.quantized_values = 0

    def _quantize_rows(self, t: int, n: int, rows: int) -> np.ndarray:
        from tensorfold import _core

        # chunks of ~4 M values, quantized on `threads` threads (quantize releases the GIL)
        per = max(1, (4 << 20) // n)
        seeds = self.rng.integers(0, 2**63, size=(rows + per - 1) // per)

        def chunk(k: int) -> np.ndarray:
            r = min(per, rows - k * per)
            x = np.random.default_rng(seeds[k]).standard_normal(r * n, dtype=np.float32)
            x *= W_STD
            return _core.quantize(t, x).reshape(r, row_bytes(t, n))

        with ThreadPoolExecutor(self.threads) as ex:
            parts = list(ex.map(chunk, range(len(seeds))))
        self.quantized_values += rows * n
        return np.concatenate(parts)

    def f16_rows(self, n: int, count: int) -> np.ndarray:
        """`count` fresh random-normal rows of length n in F16 (chunks of ~4 M on `threads` threads)."""
        per = max(1, (4 << 20) // n)
        seeds = self.rng.integers(0, 2**63, size=(count + per - 1) // per)

        def chunk(k: int) -> np.ndarray:
            r = min(per, count - k * per)
            x = np.random.default_rng(seeds[k]).standard_normal(r * n, dtype=np.float32)
            x *= W_STD
            return x.astype(np.float16).reshape(r, n)

        with ThreadPoolExecutor(self.threads) as ex:
            return np.concatenate(list(ex.map(chunk, range(len(seeds)))))

    def rows(self, t: int, n: int, count: int) -> np.ndarray:
        if t == F16:
            return self.f16_rows(n, count)
        if self.pool_rows <= 0:
            return self._quantize_rows(t, n, count)
        key = (t, n)
        if key not in self.pools:
            self.pools[key] = self._quantize_rows(t, n, self.pool_rows)
        return self.pools[key][self.rng.integers(0, self.pool_rows, size=count)]


def tensor_nbytes(s: list[int], t: int) -> int:
    return row_bytes(t, s[0]) * int(np.prod(s[1:], dtype=np.int64))


def type_summary(specs) -> str:
    """'F16 1234 MiB, F32 5 MiB' over (name, shape, type) specs, largest first."""
    by_type: dict[str, int] = {}
    for _, s, t in specs:
        by_type[TYPE_NAME[t]] = by_type.get(TYPE_NAME[t], 0) + tensor_nbytes(s, t)
    return ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]))


def default_f32(name: str, s: list[int], rng: np.random.Generator) -> np.ndarray:
    """F32 tensor values: 1-D norm weights 1 + W_STD N(0,1), anything else (router) W_STD N(0,1)."""
    n = int(np.prod(s, dtype=np.int64))
    if len(s) == 1:
        return (1.0 + W_STD * rng.standard_normal(n)).astype(np.float32)
    return (W_STD * rng.standard_normal(n)).astype(np.float32)


def write_tensors(w, specs, src: RowSource, rng: np.random.Generator, f32_values=default_f32) -> None:
    """Write the tensor table and stream every tensor of `specs` ((name, ggml shape, type) in file
    order) to the GGUFWriter `w`, whose KV data is already set, then close it. F32 tensors come
    from f32_values(name, shape, rng), the others from `src` (random normal rows)."""
    import gguf

    for name, s, t in specs:
        np_shape = list(reversed(s))
        if t == F32:
            w.add_tensor_info(name, np_shape, np.dtype(np.float32), 4 * int(np.prod(s)))
        elif t == F16:
            w.add_tensor_info(name, np_shape, np.dtype(np.float16), 2 * int(np.prod(s)))
        else:
            np_shape[-1] = row_bytes(t, s[0])
            nb = int(np.prod(np_shape, dtype=np.int64))
            w.add_tensor_info(name, np_shape, np.dtype(np.uint8), nb, raw_dtype=gguf.GGMLQuantizationType(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()

    total = sum(tensor_nbytes(s, t) for _, s, t in specs)
    done = 0
    for name, s, t in specs:
        if t == F32:
            data = f32_values(name, s, rng)
        else:
            data = src.rows(t, s[0], int(np.prod(s[1:], dtype=np.int64)))
        w.write_tensor_data(data)
        done += data.nbytes
        if sys.stdout.isatty():
            print(f"\r  {done / 1e9:6.2f} / {total / 1e9:.2f} GB  {name:<28}", end="", flush=True)
        del data
    w.close()
    if sys.stdout.isatty():
        print()


def write(a: argparse.Namespace) -> None:
    import gguf

    shape = Shape(a)
    if not shape.f16:
        from tensorfold import _core  # noqa: F401  (fail before creating the file)

    specs = shape.tensors()
    total = shape.nbytes()
    arch = "qwen3moe"
    mix = "f16" if shape.f16 else a.mix
    print(f"{a.output}: qwen3moe, {shape.layers} layers, hidden {shape.hidden}, heads "
          f"{shape.heads}/{shape.kv_heads}x{HEAD_DIM}, {shape.experts} experts top-{shape.used} "
          f"width {shape.expert_ff}, vocab {shape.vocab}, {'F16' if shape.f16 else 'mix ' + mix}: "
          f"{total / 1e9:.2f} GB of weights")

    w = gguf.GGUFWriter(a.output, arch)
    w.add_name(f"synthetic-qwen3moe-{shape.layers}L-{shape.experts}x{shape.used}")
    w.add_description("random-normal weights in F16 (bench/make_synthetic_moe.py --outtype f16)" if shape.f16
                      else "random-normal weights quantized by TensorFold (bench/make_synthetic_moe.py)")
    w.add_file_type(FTYPE[mix])
    w.add_quantization_version(2)
    w.add_context_length(a.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.expert_ff * shape.used)
    w.add_expert_feed_forward_length(shape.expert_ff)
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.used)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    tokens, types, merges = byte_level_tokenizer(shape.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)

    src = RowSource(a.pool_rows, a.threads, a.seed)
    t0 = time.perf_counter()
    write_tensors(w, specs, src, np.random.default_rng(a.seed + 1))
    size = os.path.getsize(a.output)
    print(f"wrote {a.output}: {size / 1e9:.3f} GB ({size / 2**20:.0f} MiB), {len(specs)} tensors, "
          + ("F16 random normals" if shape.f16 else f"{src.quantized_values / 1e6:.0f} M values quantized"
             f"{f' (pools of {a.pool_rows} rows)' if a.pool_rows > 0 else ''}") + ", "
          f"{time.perf_counter() - t0:.0f} s")
    print("  " + type_summary(specs))


def warn_if_in_repository(path: str) -> None:
    if os.path.abspath(path).startswith(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep):
        print("warning: writing a large GGUF inside the repository; /tmp is the place for it", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", required=True, help="GGUF path to write (put it under /tmp)")
    ap.add_argument("--size-gb", type=float, default=None,
                    help="target size in GB (1e9 bytes); picks --layers when it is not given "
                         "(default 1.5, or 4 with --outtype f16)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--used", type=int, default=8, help="experts per token (top-k)")
    ap.add_argument("--expert-ff", type=int, default=768, help="expert intermediate width")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--context", type=int, default=32768, help="context_length metadata")
    ap.add_argument("--mix", choices=sorted(MIX), default="q2k", help="expert quant mix (see above)")
    ap.add_argument("--outtype", choices=("mix", "f16"), default="mix",
                    help="mix: TensorFold-quantized low-bit mix (--mix); f16: every weight matrix F16, "
                         "for llama.cpp's quantizer (bench/make_quantized_moe.py)")
    ap.add_argument("--pool-rows", type=int, default=8192,
                    help="distinct quantized rows per (type, row length); 0: quantize every row")
    ap.add_argument("--threads", type=int, default=2, help="quantization threads")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    for k in ("hidden", "expert_ff"):
        if getattr(a, k) % QK_K:
            ap.error(f"--{k.replace('_', '-')} must be a multiple of {QK_K} (K-quant block)")
    if a.heads % a.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")
    if not 0 < a.used <= a.experts:
        ap.error("--used must be in 1..--experts")
    if a.size_gb is None:
        a.size_gb = DEFAULT_SIZE_GB[a.outtype]
    if a.layers is None:
        a.layers = pick_layers(a)
    if a.layers < 1:
        ap.error("--layers must be >= 1")
    warn_if_in_repository(a.output)
    write(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
