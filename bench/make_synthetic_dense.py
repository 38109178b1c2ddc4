#!/usr/bin/env python3
"""Writes a synthetic dense llama GGUF in F16 (random weights, SmolLM2's tokenizer) for
per-format kernel benchmarks: quantize it with llama.cpp's own quantizer to one type for
every tensor (`llama-quantize --pure`), then run TensorFold and llama-bench on the same file.

    python3 bench/make_synthetic_dense.py -o /tmp/dense-f16.gguf [--layers 8 --embd 2048]
    python3 bench/make_synthetic_dense.py --imatrix /tmp/dense.imatrix   # uniform importance
    llama-quantize --pure --imatrix /tmp/dense.imatrix /tmp/dense-f16.gguf /tmp/dense-IQ2_XXS.gguf IQ2_XXS

Default geometry (hidden 2048, 16 heads of 128 over 4 KV heads, FFN 5632, 8 layers, vocab
49152): ~560M weights, 1.1 GB in F16, ~150 MB at 2 bits — several times a 32 MB L3 (use more
--layers on machines with a larger L3). Every width is a multiple of 256, so llama.cpp keeps
the requested type on every tensor. --imatrix writes a legacy-format importance matrix of
ones for every weight (llama.cpp refuses IQ1/IQ2 types without one; uniform importance is
what an absent matrix means, so it changes nothing else).
"""
from __future__ import annotations

import argparse
import struct

import numpy as np


def tensor_shapes(embd: int, layers: int, heads: int, kv_heads: int, ff: int, vocab: int) -> dict[str, tuple]:
    hd = embd // heads
    shapes = {"token_embd.weight": (vocab, embd), "output_norm.weight": (embd,), "output.weight": (vocab, embd)}
    for i in range(layers):
        p = f"blk.{i}."
        shapes.update({p + "attn_norm.weight": (embd,), p + "attn_q.weight": (heads * hd, embd),
                       p + "attn_k.weight": (kv_heads * hd, embd), p + "attn_v.weight": (kv_heads * hd, embd),
                       p + "attn_output.weight": (embd, heads * hd), p + "ffn_norm.weight": (embd,),
                       p + "ffn_gate.weight": (ff, embd), p + "ffn_up.weight": (ff, embd),
                       p + "ffn_down.weight": (embd, ff)})
    return shapes


def write_imatrix(path: str, shapes: dict[str, tuple]) -> None:
    # Legacy llama.cpp imatrix: int32 count, then per entry: int32 name length, name, int32
    # ncall, int32 nval, float32[nval]; then int32 last_call and the dataset name.
    entries = [(n, s[-1]) for n, s in shapes.items() if len(s) == 2]
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, k in entries:
            b = name.encode()
            f.write(struct.pack("<i", len(b)) + b + struct.pack("<ii", 1, k))
            f.write(np.ones(k, np.float32).tobytes())
        f.write(struct.pack("<i", 1))
        ds = b"uniform"
        f.write(struct.pack("<i", len(ds)) + ds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", help="F16 GGUF to write")
    ap.add_argument("--imatrix", help="also write a uniform importance matrix here")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ff", type=int, default=5632)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import gguf

    import tensorfold

    src = gguf.GGUFReader(tensorfold.pull("smollm2-135m-instruct"))
    tokens = src.fields["tokenizer.ggml.tokens"].contents()
    vocab = len(tokens)
    shapes = tensor_shapes(a.embd, a.layers, a.heads, a.kv_heads, a.ff, vocab)
    if a.imatrix:
        write_imatrix(a.imatrix, shapes)
        print(f"wrote {a.imatrix}")
    if not a.output:
        return
    w = gguf.GGUFWriter(a.output, "llama")
    w.add_name("synthetic-dense")
    w.add_context_length(4096)
    w.add_embedding_length(a.embd)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_dimension_count(a.embd // a.heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in src.fields.items():  # the tokenizer, as SmolLM2 ships it
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    rng = np.random.default_rng(a.seed)
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, np.float32))
        else:
            w.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
