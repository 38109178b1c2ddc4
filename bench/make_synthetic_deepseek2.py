#!/usr/bin/env python3
"""Write a synthetic, llama.cpp-loadable `deepseek2` GGUF (F16) with DeepSeek-V3-like proportions.

    python bench/make_synthetic_deepseek2.py -o /tmp/dsb/synth-ds2-f16.gguf          # ~1.6 GB, 4 layers
    python bench/make_synthetic_deepseek2.py -o /tmp/x.gguf --layers 8 --experts 128
    python bench/make_synthetic_deepseek2.py -o /tmp/x.gguf --size-gb 3              # picks --layers
    python bench/make_synthetic_deepseek2.py -o /tmp/x.gguf --layers 2 --hidden 1024 --heads 8 \\
        --experts 16 --used 4 --expert-groups 4 --groups-used 2 --vocab 8000       # tiny, for tests

The input for llama.cpp's quantizer: `bench/make_quantized_moe.py --model deepseek2` turns it into
Q2_K, Q4_K_M, ... files with llama.cpp's own per-tensor mixes. Layout, as llama.cpp's converter
writes DeepSeek-V3 (convert_hf_to_gguf.py DeepseekV2Model, src/models/deepseek2.cpp):

  - multi-head latent attention, MLA split form: attn_q_a [hidden, q_lora] + attn_q_a_norm +
    attn_q_b [q_lora, heads*(nope+rope)]; attn_kv_a_mqa [hidden, kv_lora+rope] + attn_kv_a_norm;
    attn_k_b [nope, kv_lora, heads] (k_b transposed) and attn_v_b [kv_lora, v_head, heads];
    attn_output [heads*v_head, hidden]. Metadata: head_count_kv 1, key_length kv_lora+rope (576),
    value_length kv_lora (512), key_length_mla nope+rope (192), value_length_mla v_head (128),
    rope.dimension_count rope (64). (ggml shapes, innermost first.)
  - --dense-layers leading dense FFN layers (ffn_gate/up/down of width --dense-ff), then MoE
    layers: ffn_gate_inp router (F32), exp_probs_b.bias (F32, the V3 score-correction bias),
    --experts routed experts of width --expert-ff stacked in ffn_{gate,up,down}_exps, top --used,
    in --expert-groups groups of which --groups-used are kept, sigmoid gating
    (expert_gating_func 2), expert_weights_norm true, expert_weights_scale 2.5, and --shared
    shared experts (ffn_{gate,up,down}_shexp of width shared * expert-ff).
  - RoPE: freq_base 10000, YaRN like V3 (factor 40, original_context_length 4096, beta_fast 32,
    beta_slow 1, yarn_log_multiplier 0.1 = 0.1 * mscale_all_dim), context_length 163840.

Defaults: hidden 2048, 4 layers (1 dense of width 5120 + 3 MoE), 16 heads, q_lora 768, kv_lora 512,
rope 64, nope 128, v_head 128, 64 experts of 512, top-8, 8 groups / 4 used, 1 shared expert,
vocab 32000: 1.6 GB F16, ~0.3 GB after Q2_K (several times a 32 MiB L3).

Weights are fresh random normals, std 0.02, in F16 (make_synthetic_moe.py's RowSource); norm
weights 1 + 0.02 N(0,1), router and exp_probs_b 0.02 N(0,1), all F32 as llama.cpp's converter
keeps them. At std 0.02 a [n, m] projection of an RMS-normalised input gives outputs of std
0.02 sqrt(n) (0.9 for n = 2048), and MLA re-normalises both latents (attn_q_a_norm,
attn_kv_a_norm), so activations stay of order 1 over the layers. The tokenizer is
make_synthetic_moe.py's minimal byte-level BPE (`gpt2`), with pre-tokenizer `deepseek-v3`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_synthetic_moe import (F16, F32, QK_K, W_STD, RowSource, byte_level_tokenizer,  # noqa: E402
                                default_f32, tensor_nbytes, type_summary, warn_if_in_repository,
                                write_tensors)

ARCH = "deepseek2"
GATING_SIGMOID = 2  # llama_expert_gating_func_type / gguf.ExpertGatingFuncType.SIGMOID


class Shape:
    def __init__(self, a: argparse.Namespace):
        self.layers, self.dense_layers = a.layers, a.dense_layers
        self.hidden, self.dense_ff, self.heads, self.vocab = a.hidden, a.dense_ff, a.heads, a.vocab
        self.q_lora, self.kv_lora = a.q_lora_rank, a.kv_lora_rank
        self.rope, self.nope, self.v_head = a.qk_rope, a.qk_nope, a.v_head
        self.experts, self.used, self.expert_ff, self.shared = a.experts, a.used, a.expert_ff, a.shared

    def tensors(self):
        """(name, ggml shape [ne0, ne1, ...], type) in file order (llama.cpp's loader order)."""
        h, nh = self.hidden, self.heads
        out = [("token_embd.weight", [h, self.vocab], F16)]
        for i in range(self.layers):
            p = f"blk.{i}."
            out += [(p + "attn_norm.weight", [h], F32)]
            if self.q_lora > 0:
                out += [(p + "attn_q_a_norm.weight", [self.q_lora], F32)]
            out += [(p + "attn_kv_a_norm.weight", [self.kv_lora], F32)]
            if self.q_lora > 0:
                out += [(p + "attn_q_a.weight", [h, self.q_lora], F16),
                        (p + "attn_q_b.weight", [self.q_lora, nh * (self.nope + self.rope)], F16)]
            else:
                out += [(p + "attn_q.weight", [h, nh * (self.nope + self.rope)], F16)]
            out += [
                (p + "attn_kv_a_mqa.weight", [h, self.kv_lora + self.rope], F16),
                (p + "attn_k_b.weight", [self.nope, self.kv_lora, nh], F16),
                (p + "attn_v_b.weight", [self.kv_lora, self.v_head, nh], F16),
                (p + "attn_output.weight", [nh * self.v_head, h], F16),
                (p + "ffn_norm.weight", [h], F32),
            ]
            if i < self.dense_layers:
                out += [(p + "ffn_gate.weight", [h, self.dense_ff], F16),
                        (p + "ffn_down.weight", [self.dense_ff, h], F16),
                        (p + "ffn_up.weight", [h, self.dense_ff], F16)]
            else:
                e, f = self.experts, self.expert_ff
                out += [(p + "ffn_gate_inp.weight", [h, e], F32),
                        (p + "exp_probs_b.bias", [e], F32),
                        (p + "ffn_down_exps.weight", [f, h, e], F16),
                        (p + "ffn_gate_exps.weight", [h, f, e], F16),
                        (p + "ffn_up_exps.weight", [h, f, e], F16)]
                if self.shared > 0:
                    fs = f * self.shared
                    out += [(p + "ffn_gate_shexp.weight", [h, fs], F16),
                            (p + "ffn_down_shexp.weight", [fs, h], F16),
                            (p + "ffn_up_shexp.weight", [h, fs], F16)]
        out += [("output_norm.weight", [h], F32), ("output.weight", [h, self.vocab], F16)]
        return out

    def nbytes(self) -> int:
        return sum(tensor_nbytes(s, t) for _, s, t in self.tensors())


def pick_layers(a: argparse.Namespace) -> int:
    """Number of layers (dense ones included) whose file size is closest to --size-gb."""
    a.layers = a.dense_layers + 1
    one = Shape(a).nbytes()
    a.layers += 1
    per_layer = Shape(a).nbytes() - one
    return max(a.dense_layers + 1, a.dense_layers + 1 + round((a.size_gb * 1e9 - one) / per_layer))


def f32_values(name: str, s: list[int], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("exp_probs_b.bias"):  # score-correction bias: small, not a norm
        return (W_STD * rng.standard_normal(s[0])).astype(np.float32)
    return default_f32(name, s, rng)


def write(a: argparse.Namespace) -> None:
    import gguf

    shape = Shape(a)
    specs = shape.tensors()
    total = shape.nbytes()
    n_moe = shape.layers - shape.dense_layers
    print(f"{a.output}: {ARCH}, {shape.layers} layers ({shape.dense_layers} dense of {shape.dense_ff}, "
          f"{n_moe} MoE), hidden {shape.hidden}, {shape.heads} heads MLA q_lora {shape.q_lora} kv_lora "
          f"{shape.kv_lora} nope/rope/v {shape.nope}/{shape.rope}/{shape.v_head}, {shape.experts} experts "
          f"top-{shape.used} width {shape.expert_ff} in {a.expert_groups} groups ({a.groups_used} used) "
          f"+ {shape.shared} shared, vocab {shape.vocab}, F16: {total / 1e9:.2f} GB of weights", flush=True)

    w = gguf.GGUFWriter(a.output, ARCH)
    w.add_name(f"synthetic-deepseek2-{shape.layers}L-{shape.experts}x{shape.used}")
    w.add_description("random-normal weights in F16, DeepSeek-V3-like (bench/make_synthetic_deepseek2.py)")
    w.add_file_type(1)  # MOSTLY_F16
    w.add_quantization_version(2)
    # as convert_hf_to_gguf.py writes DeepSeek-V3 (TextModel + DeepseekV2Model.set_gguf_parameters)
    w.add_block_count(shape.layers)
    w.add_context_length(a.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.dense_ff)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(1)  # MLA in absorbed form is MQA over one latent+rope row
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(a.yarn_factor)
    w.add_rope_scaling_orig_ctx_len(a.yarn_orig_context)
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.used)
    w.add_expert_group_count(a.expert_groups)
    w.add_expert_group_used_count(a.groups_used)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType(GATING_SIGMOID))
    w.add_leading_dense_block_count(shape.dense_layers)
    w.add_vocab_size(shape.vocab)
    if shape.q_lora > 0:
        w.add_q_lora_rank(shape.q_lora)
    w.add_kv_lora_rank(shape.kv_lora)
    w.add_key_length(shape.kv_lora + shape.rope)
    w.add_value_length(shape.kv_lora)
    w.add_key_length_mla(shape.nope + shape.rope)
    w.add_value_length_mla(shape.v_head)
    w.add_expert_feed_forward_length(shape.expert_ff)
    w.add_expert_shared_count(shape.shared)
    w.add_expert_weights_scale(2.5)
    w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(shape.rope)
    w.add_rope_scaling_yarn_log_mul(0.1 * a.mscale_all_dim)
    tokens, types, merges = byte_level_tokenizer(shape.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("deepseek-v3")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(True)  # as DeepSeek-V3

    t0 = time.perf_counter()
    write_tensors(w, specs, RowSource(0, a.threads, a.seed), np.random.default_rng(a.seed + 1), f32_values)
    size = os.path.getsize(a.output)
    print(f"wrote {a.output}: {size / 1e9:.3f} GB ({size / 2**20:.0f} MiB), {len(specs)} tensors, "
          f"F16 random normals, {time.perf_counter() - t0:.0f} s")
    print("  " + type_summary(specs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", required=True, help="GGUF path to write (put it under /tmp)")
    ap.add_argument("--layers", type=int, default=None, help="layers, dense ones included (default 4)")
    ap.add_argument("--size-gb", type=float, default=None,
                    help="target F16 size in GB (1e9 bytes): picks --layers when it is not given")
    ap.add_argument("--dense-layers", type=int, default=1, help="leading dense FFN layers (leading_dense_block_count)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dense-ff", type=int, default=5120, help="dense FFN width (feed_forward_length)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--q-lora-rank", type=int, default=768, help="0: no q compression (attn_q, like V2-Lite)")
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--qk-rope", type=int, default=64, help="rope part of the q/k head")
    ap.add_argument("--qk-nope", type=int, default=128, help="non-rope part of the q/k head")
    ap.add_argument("--v-head", type=int, default=128, help="value head width")
    ap.add_argument("--experts", type=int, default=64, help="routed experts")
    ap.add_argument("--used", type=int, default=8, help="experts per token (top-k)")
    ap.add_argument("--expert-ff", type=int, default=512, help="expert (and shared expert) width")
    ap.add_argument("--expert-groups", type=int, default=8, help="expert groups (expert_group_count)")
    ap.add_argument("--groups-used", type=int, default=4, help="groups kept per token (expert_group_used_count)")
    ap.add_argument("--shared", type=int, default=1, help="shared experts")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--context", type=int, default=163840, help="context_length metadata")
    ap.add_argument("--yarn-factor", type=float, default=40.0)
    ap.add_argument("--yarn-orig-context", type=int, default=4096, help="rope.scaling.original_context_length")
    ap.add_argument("--mscale-all-dim", type=float, default=1.0,
                    help="V3's rope_scaling.mscale_all_dim; written as yarn_log_multiplier = 0.1 x this")
    ap.add_argument("--outtype", choices=("f16",), default="f16", help="only f16 (the input for llama-quantize)")
    ap.add_argument("--threads", type=int, default=2, help="threads generating random rows")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    for k in ("hidden", "expert_ff", "dense_ff", "kv_lora_rank"):
        if getattr(a, k) % QK_K:
            ap.error(f"--{k.replace('_', '-')} must be a multiple of {QK_K} (K-quant block)")
    if a.q_lora_rank % QK_K:
        ap.error(f"--q-lora-rank must be a multiple of {QK_K} (K-quant block), or 0")
    if not 0 < a.used <= a.experts:
        ap.error("--used must be in 1..--experts")
    if a.expert_groups < 1 or a.experts % a.expert_groups:
        ap.error("--experts must be a multiple of --expert-groups")
    if not 0 < a.groups_used <= a.expert_groups or a.groups_used * (a.experts // a.expert_groups) < a.used:
        ap.error("--groups-used must be in 1..--expert-groups and leave at least --used experts")
    if a.expert_groups > 1 and a.experts // a.expert_groups < 2:
        ap.error("llama.cpp scores a group by its top-2 experts: need >= 2 experts per group")
    if a.dense_layers < 0:
        ap.error("--dense-layers must be >= 0")
    if a.layers is None:
        if a.size_gb is not None:
            a.layers = pick_layers(a)
        else:
            a.layers = 4
    if a.layers <= a.dense_layers:
        ap.error("--layers must exceed --dense-layers (at least one MoE layer)")
    warn_if_in_repository(a.output)
    write(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
