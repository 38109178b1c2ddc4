"""A tiny random DeepSeek-V4 (``DeepseekV4ForCausalLM``) for converter tests.

``make_tiny_deepseek4(dir, **overrides)`` builds the model with transformers, fills every
parameter and buffer with non-trivial random values (also those transformers initialises to
0 or 1: attention sinks, compressor / indexer ``position_bias``, hyper-connection ``base`` /
``scale``, ``e_score_correction_bias``, norms; ``tid2eid`` gets distinct valid expert ids per
token), saves it as float32 safetensors with a small byte-level BPE tokenizer, and returns the
model (eval mode).

Sizes (``CONFIG``): every width that ends up as a GGUF row is a multiple of 32 (so that the
Q8_0 output type and DeepSeek's FP4 expert packing of the official layout, built from this
model by tests/deepseek4_official.py, apply to every weight), and the widths mostly differ from
each other so that a transposed or mixed-up tensor fails a shape check (the tests compare
values too): hidden 96, 4 heads of 128 (rope on the last 16), q-LoRA 160, output projection
2 groups of rank 32, indexer 8 heads of 64 (top-3), 8 experts (2 per token) of width 64 plus
one shared, hyper-connections 4 (20 Sinkhorn iterations), sliding window 8, vocabulary 320.
Two of these are set by llama.cpp rather than chosen: its deepseek4 rotates the indexer's
queries and keys with a Hadamard matrix of at least 64 (so index_head_dim is a multiple of
64; with 32 it reshapes across heads and aborts), and with only 2 indexer heads many
compressed entries score exactly 0 (ReLU of every head's dot product), so the top-k picks
among ties differently from torch.topk; 8 heads leave no tie at the top-3 boundary for
``prompt_ids()`` (tests/test_convert_deepseek4.py checks that).

The four layers cover the three attention kinds and both routings:

    layer 0  sliding_attention              hash_moe (tid2eid)
    layer 1  compressed_sparse_attention    hash_moe
    layer 2  heavily_compressed_attention   moe (sqrtsoftplus + correction bias)
    layer 3  compressed_sparse_attention    moe

The compression rates are DeepSeek's own (CSA 4, HCA 128): llama.cpp's deepseek4 supports no
others, so a prompt that exercises the HCA layer is longer than 128 tokens. The compressed
branches use YaRN (factor 4 over 256 original positions) as the released model does, with
``compress_rope_theta`` 160000 against the sliding layers' 10000. ``swiglu_limit`` is 2 so
that the clamp of the expert activations actually cuts values.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from checkpoint_helpers import make_bpe_tokenizer

VOCAB = 320          # config vocab_size; the tokenizer has fewer tokens (the tail is padding)
TOKENIZER_SIZE = 300
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
SEED = 20260704

CONFIG = dict(
    vocab_size=VOCAB, hidden_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
    head_dim=128, partial_rotary_factor=0.125, q_lora_rank=160, o_groups=2, o_lora_rank=32,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5, swiglu_limit=2.0,
    index_n_heads=8, index_head_dim=64, index_topk=3, sliding_window=8,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256,
                         beta_fast=32.0, beta_slow=1.0),
    max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    num_nextn_predict_layers=0,
)

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Compressed sparse attention pools every four tokens; a lightning indexer picks the top entries.",
    "Hyper-connections keep four residual streams and mix them with a doubly stochastic matrix.",
    "Numbers 0123456789 and punctuation: (a, b) [c] {d} <e> 'f' \"g\"!",
    "def forward(x):\n    return self.down(silu(self.gate(x)) * self.up(x))\n",
]


def make_config(**overrides):
    """The transformers DeepseekV4Config of the tiny model, with ``overrides`` applied."""
    from transformers import DeepseekV4Config

    kw = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
          for k, v in CONFIG.items()}
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def randomize(model, seed: int = SEED) -> None:
    """Fill every parameter and buffer of ``model`` with non-trivial values (in place)."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def randn(t, std, mean=0.0):
        return mean + std * torch.randn(t.shape, generator=g, dtype=torch.float32)

    cfg = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                v = randn(p, 0.2, 1.0)
            elif name.endswith(("_hc.fn", "hc_head.hc_fn")):
                v = randn(p, 0.05)
            elif name.endswith(("_hc.base", "hc_head.hc_base")):
                v = randn(p, 0.5)
            elif name.endswith(("_hc.scale", "hc_head.hc_scale")):
                v = randn(p, 0.3, 1.0)
            elif name.endswith("sinks"):
                v = randn(p, 1.0)
            elif name.endswith("position_bias"):
                v = randn(p, 0.5)
            else:  # projections, embeddings, routers, stacked experts
                v = randn(p, 0.15)
            p.copy_(v.to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(randn(b, 0.1))
            elif name.endswith("tid2eid"):
                # every token: top_k distinct experts, uniformly at random
                ids = torch.rand((b.shape[0], cfg.n_routed_experts), generator=g).argsort(dim=1)
                b.copy_(ids[:, : b.shape[1]].to(b.dtype))


def make_model(seed: int = SEED, **overrides):
    """A randomised float32 DeepseekV4ForCausalLM (eval mode), not saved."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(make_config(**overrides)).float().eval()
    randomize(model, seed)
    return model


def make_tokenizer():
    """A tiny byte-level BPE (GPT-2 pre-tokenizer regex) as a transformers fast tokenizer."""
    return make_bpe_tokenizer(TEXT, TOKENIZER_SIZE, SPECIAL)


def save_tokenizer(out_dir) -> None:
    """tokenizer.json + tokenizer_config.json of the tiny tokenizer into ``out_dir``."""
    make_tokenizer().save_pretrained(out_dir)


def make_tiny_deepseek4(out_dir, seed: int = SEED, **overrides):
    """Build, randomise and save (float32 safetensors, config.json, tokenizer) the tiny
    DeepSeek-V4 into ``out_dir`` (replaced if it exists); returns the model (eval mode).
    ``overrides`` are DeepseekV4Config fields."""
    out_dir = Path(out_dir)
    model = make_model(seed, **overrides)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(out_dir)
    gen = out_dir / "generation_config.json"
    if gen.exists():  # nothing a converter needs
        gen.unlink()
    return model


def prompt_ids(n: int = 300, seed: int = 7) -> list[int]:
    """``n`` deterministic token ids of the tokenizer's range (not the padding tail), starting
    with BOS. 300 tokens: past the sliding window (8), many CSA windows (4) and two HCA
    windows (128)."""
    import random

    rng = random.Random(seed)
    return [0] + [rng.randrange(len(SPECIAL), TOKENIZER_SIZE) for _ in range(n - 1)]
