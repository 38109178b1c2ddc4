#!/usr/bin/env python3
"""Write a synthetic `deepseek4` GGUF (F16) with DeepSeek-V4-Flash proportions, scaled down.

    python bench/make_synthetic_deepseek4.py -o /tmp/ds4b/synth-ds4-f16.gguf        # ~1.8 GB F16
    python bench/make_synthetic_deepseek4.py -o /tmp/x.gguf --layers 4 --ratios 0,4,128,4 \\
        --experts 16 --vocab 8000                                                  # small
    # quantized by llama.cpp (imatrix + llama-quantize), as the other synthetic models:
    python bench/make_quantized_moe.py --llama-bin $LLAMA_BIN --model deepseek4 --types Q2_K,Q4_K_M \\
        --out-dir /tmp/ds4b                                                        # synth-ds4-*.gguf

How: a transformers ``DeepseekV4ForCausalLM`` of the shape below is built (no weight init),
every parameter and buffer is filled with random values of sane scale, and it is saved (F32
safetensors, a byte-level BPE tokenizer.json) to a scratch directory (--work, default a temp dir
next to the output, removed afterwards unless --keep-hf); then TensorFold's own converter
(``tensorfold convert DIR -o OUT --outtype f16``, python/tensorfold/convert_deepseek4.py) writes
the GGUF as llama.cpp's deepseek4 loader reads it. Peak memory ~2x the F32 model (~7 GB by default).

Shape (DeepSeek-V4-Flash in brackets; its released config has 43 layers with
compress_ratios [0, 0, 4, 128, 4, 128, ..., 4, 128, 4] + the MTP layer, num_hash_layers 3):

    hidden 1024 [4096], 8 layers [43], 16 heads [64] of head_dim 512 [512] with rope on the
    last 64 [64], one shared K=V row per token (num_key_value_heads 1), q-LoRA 256 [1024],
    grouped output projection 4 groups [8] x rank 256 [1024], attention sinks;
    sliding window 128 [128] in every layer, plus per --ratios: 0 = sliding only, 4 = CSA
    (compressed entries of 4 tokens, a lightning indexer of 16 heads [64] x 128 [128] picks
    the top 512 [512]), 128 = HCA (every compressed entry of 128 tokens);
    default --ratios 0,0,4,128,4,128,4,128 (Flash's first 8 layers: 2 sliding-only, then
    CSA / HCA alternating);
    MoE in every layer: 64 routed experts [256] of width 512 [2048], top-6 [6], 1 shared [1],
    sqrtsoftplus scores with a correction bias, top-k weights normalised, x1.5, SwiGLU clamp
    10; the first 3 [3] layers hash-routed (tid2eid: 6 distinct random experts per token);
    hyper-connections: 4 [4] residual streams, 20 Sinkhorn iterations;
    RoPE theta 10000 (sliding) / 160000 (compressed), YaRN factor 16 over 65536 positions
    [same]; vocabulary 32000 [129280], untied LM head.

F16 file ~1.8 GB (experts 1.6 GB), far more than a 32 MiB L3; llama.cpp's Q2_K ~0.35 GB and
Q4_K_M ~0.55 GB. llama.cpp's deepseek4 needs hc_mult 4, ratios in {0, 4, 128} and at least one
CSA layer, index_head_dim a multiple of 64; those are checked here.

Values: weight matrices N(0, 0.02^2) (a projection of an RMS-normalised input of width n gives
outputs of std 0.02 sqrt(n): 0.64 for n = 1024), norms 1 + 0.02 N, router 0.02 N and its
correction bias 0.02 N, attention sinks N(0, 1), compressor position biases 0.02 N,
hyper-connection fn 0.02 N / base 0.5 N / scale 1 + 0.1 N. The text a random model writes is
garbage; that is fine for speed.

The tokenizer is bench/make_synthetic_moe.py's minimal byte-level BPE (256 bytes, merges that
grow letter strings, 3 control tokens) written as a tokenizer.json with the GPT-2 ByteLevel
pre-tokenizer (GGUF pre-tokenizer `gpt-2`).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_synthetic_moe import byte_level_tokenizer, warn_if_in_repository  # noqa: E402

W_STD = 0.02
CSA, HCA = 4, 128
LAYER_TYPE = {0: "sliding_attention", CSA: "compressed_sparse_attention", HCA: "heavily_compressed_attention"}


def hf_config(a: argparse.Namespace) -> dict:
    """DeepseekV4Config fields (transformers' vocabulary) of the synthetic model."""
    return dict(
        vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=1, head_dim=a.head_dim,
        partial_rotary_factor=a.rope_dim / a.head_dim, q_lora_rank=a.q_lora, o_groups=a.o_groups,
        o_lora_rank=a.o_lora, n_routed_experts=a.experts, num_experts_per_tok=a.used,
        moe_intermediate_size=a.expert_ff, n_shared_experts=a.shared, scoring_func="sqrtsoftplus",
        norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=10.0,
        index_n_heads=a.index_heads, index_head_dim=a.index_head_dim, index_topk=a.index_topk,
        sliding_window=a.window,
        layer_types=[LAYER_TYPE[r] for r in a.ratio_list],
        compress_rates={"compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA},
        mlp_layer_types=["hash_moe"] * a.hash_layers + ["moe"] * (a.layers - a.hash_layers),
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_parameters=dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=65536,
                             beta_fast=32.0, beta_slow=1.0),
        max_position_embeddings=1048576, tie_word_embeddings=False,
        bos_token_id=a.bos_id, eos_token_id=a.eos_id, num_nextn_predict_layers=0,
    )


def build_model(a: argparse.Namespace):
    """The randomised float32 DeepseekV4ForCausalLM (no transformers init: every value is set here)."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.initialization import no_init_weights

    torch.set_num_threads(a.threads)
    with no_init_weights():
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**hf_config(a))).float().eval()
    g = torch.Generator().manual_seed(a.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, W_STD, generator=g)
            elif name.endswith(("_hc.base", "hc_head.hc_base")):
                p.normal_(0.0, 0.5, generator=g)
            elif name.endswith(("_hc.scale", "hc_head.hc_scale")):
                p.normal_(1.0, 0.1, generator=g)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0, generator=g)
            else:  # projections, embeddings, routers, stacked experts, hc fn, position biases
                p.normal_(0.0, W_STD, generator=g)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, W_STD, generator=g)
            elif name.endswith("tid2eid"):  # per token: top_k distinct experts, uniformly at random
                ids = torch.rand((b.shape[0], a.experts), generator=g).argsort(dim=1)[:, : b.shape[1]]
                b.copy_(ids.to(b.dtype))
    return model


def write_tokenizer(out_dir: Path, vocab: int) -> tuple[int, int]:
    """tokenizer.json (byte-level BPE, GPT-2 pre-tokenizer) and tokenizer_config.json of
    make_synthetic_moe.py's vocabulary; returns (bos id, eos id)."""
    tokens, types, merges = byte_level_tokenizer(vocab)
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 1}
    specials = [(i, t) for i, (t, ty) in enumerate(zip(tokens, types)) if ty != 1]
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in specials],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": normal, "merges": merges},
    }
    (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    bos, eos = specials[0], specials[0]  # <|endoftext|> for both, as Qwen-style vocabularies do
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos[1], "eos_token": eos[1],
         "model_max_length": 1048576}, indent=1))
    return bos[0], eos[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", required=True, help="GGUF path to write (put it under /tmp)")
    ap.add_argument("--outtype", choices=("f16", "bf16", "f32", "q8_0"), default="f16",
                    help="converter output type of the weight matrices (default f16: llama-quantize's input)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the length of --ratios)")
    ap.add_argument("--ratios", default="0,0,4,128,4,128,4,128",
                    help="compression ratio per layer: 0 sliding only, 4 CSA, 128 HCA (default: V4-Flash's "
                         "first 8); shorter than --layers: repeated")
    ap.add_argument("--hash-layers", type=int, default=3, help="leading hash-routed (tid2eid) layers")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=512)
    ap.add_argument("--rope-dim", type=int, default=64, help="rotary part of the head (its last dims)")
    ap.add_argument("--q-lora", type=int, default=256)
    ap.add_argument("--o-groups", type=int, default=4)
    ap.add_argument("--o-lora", type=int, default=256)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--used", type=int, default=6)
    ap.add_argument("--expert-ff", type=int, default=512)
    ap.add_argument("--shared", type=int, default=1, choices=(0, 1))
    ap.add_argument("--index-heads", type=int, default=16)
    ap.add_argument("--index-head-dim", type=int, default=128)
    ap.add_argument("--index-topk", type=int, default=512)
    ap.add_argument("--window", type=int, default=128, help="sliding window")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=None, help="scratch directory of the transformers checkpoint")
    ap.add_argument("--keep-hf", action="store_true", help="keep the transformers checkpoint (--work)")
    a = ap.parse_args()

    ratios = [int(x) for x in a.ratios.split(",") if x.strip()]
    if not ratios or any(r not in (0, CSA, HCA) for r in ratios):
        ap.error(f"--ratios: each must be 0, {CSA} or {HCA} (the only ratios llama.cpp's deepseek4 runs)")
    a.layers = a.layers or len(ratios)
    a.ratio_list = (ratios * a.layers)[: a.layers]
    if CSA not in a.ratio_list:
        ap.error("llama.cpp's deepseek4 needs at least one CSA (4) layer")
    if not 0 <= a.hash_layers <= a.layers:
        ap.error("--hash-layers must be in 0..--layers")
    if a.index_head_dim % 64:
        ap.error("--index-head-dim must be a multiple of 64 (llama.cpp's Hadamard rotation)")
    if not 0 < a.used <= a.experts:
        ap.error("--used must be in 1..--experts")
    if (a.heads * a.head_dim) % a.o_groups or a.rope_dim >= a.head_dim or a.rope_dim % 2:
        ap.error("heads x head_dim must split into --o-groups; --rope-dim even and < --head-dim")
    for k in ("hidden", "expert_ff", "q_lora", "head_dim"):
        if getattr(a, k) % 256:
            ap.error(f"--{k.replace('_', '-')} must be a multiple of 256 (K-quant rows)")
    warn_if_in_repository(a.output)

    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="synth-ds4-hf-", dir=out.parent))
    t0 = time.perf_counter()
    try:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        a.bos_id, a.eos_id = write_tokenizer(work, a.vocab)
        model = build_model(a)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: {n_params / 1e6:.0f} M parameters, ratios {a.ratio_list}, "
              f"hash layers {a.hash_layers} ({time.perf_counter() - t0:.0f} s)", flush=True)
        model.save_pretrained(work, safe_serialization=True, max_shard_size="2GB")
        gen = work / "generation_config.json"
        if gen.exists():
            gen.unlink()
        del model
        gc.collect()
        print(f"saved {work} ({time.perf_counter() - t0:.0f} s)", flush=True)

        from tensorfold.convert import convert

        print(f"converting: tensorfold convert {work} -o {out} --outtype {a.outtype}", flush=True)
        convert(str(work), str(out), a.outtype, progress=False)
    finally:
        if not a.keep_hf:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out}: {out.stat().st_size / 1e9:.2f} GB ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
