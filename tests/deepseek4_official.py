#!/usr/bin/env python3
"""The tiny DeepSeek-V4 of tests/deepseek4_fixture.py in DeepSeek's OFFICIAL release layout,
and llama.cpp's own conversion of it.

    python tests/deepseek4_official.py [--llama-cpp DIR] [--out tests/fixtures/deepseek4]

writes

    OUT/official/        config.json (the released field names), two safetensors shards +
                         model.safetensors.index.json, tokenizer.json, tokenizer_config.json
    OUT/llamacpp.gguf    llama.cpp's convert_hf_to_gguf.py of OUT/official (main model; its
                         default skips the multi-token-prediction layer)
    OUT/llamacpp-mtp.gguf  the same with --mtp: only the MTP layer (blk.4.*), llama.cpp's
                         naming of next-token-prediction layers

tests/test_convert_deepseek4.py compares ``tensorfold convert`` of OUT/official with these
files. CI never runs this script; it reads the committed outputs.

The layout, as the released DeepSeek-V4 checkpoints have it and as llama.cpp's converter
(conversion/deepseek.py, DeepseekV4Model) and transformers' conversion mapping read it:

- names: ``embed.weight``, ``head.weight``, ``norm.weight``, ``hc_head_{fn,base,scale}``,
  ``layers.N.{attn_norm,ffn_norm}.weight``, ``layers.N.hc_{attn,ffn}_{fn,base,scale}``,
  ``layers.N.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink}``,
  ``layers.N.attn.compressor.{wkv,wgate,ape,norm}``, ``layers.N.attn.indexer.{wq_b,
  weights_proj}``, ``layers.N.attn.indexer.compressor.{wkv,wgate,ape,norm}``,
  ``layers.N.ffn.gate.{weight,bias,tid2eid}``, ``layers.N.ffn.shared_experts.w{1,2,3}``,
  ``layers.N.ffn.experts.E.w{1,2,3}`` (w1 gate, w2 down, w3 up), and one next-token-prediction
  layer ``mtp.0.*``: a sliding-window (compress ratio 0), non-hash block with the same names
  plus ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm`` and its own ``hc_head_*``.
- types: the attention / indexer-query / shared-expert / MTP e,h linears are FP8 e4m3 with one
  E8M0 scale per 128x128 block (``NAME.scale``, shape ceil(out/128) x ceil(in/128)); the
  routed experts are FP4 e2m1 packed two per byte (element 2i in the low nibble, I8) with one
  E8M0 scale per 32 inputs (``NAME.scale``, out x in/32); the embedding, head, router and the
  compressor / indexer-compressor / indexer-weights projections are BF16; norms, sinks,
  ``ape``, hyper-connection tensors and the router bias are F32; ``tid2eid`` is I64.
- config.json: the released field names (``compress_ratios`` per layer including the MTP
  layer, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling`` with YaRN,
  ``expert_dtype``, ``quantization_config`` ...).

Values: the tiny model's weights quantized (FP8: scale = the power of two that brings the
block's largest magnitude to at most 448; FP4: the same with 6, codes rounded to nearest), so
``dequantized_state_dict`` of the written files is a float model transformers can run: the
oracle for llama.cpp running either GGUF.

llama.cpp's converter runs in a subprocess with its own gguf-py first on PYTHONPATH, through a
wrapper whose only change is ``get_vocab_base_pre`` returning ``"gpt-2"`` (the tiny tokenizer's
hash is unknown to llama.cpp; its pre-tokenizer is GPT-2's ByteLevel regex). Requirements
outside the repo: the llama.cpp sources (default: the copy vendored in llama-cpp-python
0.3.36) and the PyPI packages this script and llama.cpp's converter import: torch (with
float8_e4m3fn / float8_e8m0fnu: 2.7 or later; the fixtures were written with 2.13.0+cpu),
transformers (5.25.0: DeepseekV4), tokenizers (0.23.3), safetensors (0.8.0), numpy (2.4.6)
and PyYAML (6.0.3, for llama.cpp's gguf-py). llama.cpp's converter needed nothing else
(no sentencepiece / protobuf / mistral-common for this model).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import deepseek4_fixture as fx  # noqa: E402
from checkpoint_helpers import run_llama_cpp_converter  # noqa: E402

DEFAULT_LLAMA_CPP = Path("/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp")
DEFAULT_OUT = HERE / "fixtures" / "deepseek4"
MTP_SEED = 99

FP8_MAX, FP4_MAX = 448.0, 6.0
FP8_BLOCK, FP4_BLOCK = 128, 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# official per-layer suffix -> storage class
FP8 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
       "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
       "ffn.shared_experts.w3.weight", "e_proj.weight", "h_proj.weight")
BF16 = ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight", "attn.indexer.compressor.wkv.weight",
        "attn.indexer.compressor.wgate.weight", "attn.indexer.weights_proj.weight", "ffn.gate.weight")
ROOT_BF16 = ("embed.weight", "head.weight")


# ----------------------------------------------------------------------------------------
# FP8 / FP4 with E8M0 scales


def _pow2_scale(amax, top):
    """E8M0 scale per block: the smallest power of two with amax / scale <= top."""
    import torch

    e = torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / top))
    return torch.clamp(e, -127, 127)


def quantize_fp8(w):
    """[out, in] float32 -> (e4m3 [out, in], e8m0 scale [ceil(out/128), ceil(in/128)])."""
    import torch

    out_f, in_f = w.shape
    bo, bi = -(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK)
    pad = torch.zeros(bo * FP8_BLOCK, bi * FP8_BLOCK)
    pad[:out_f, :in_f] = w
    blocks = pad.view(bo, FP8_BLOCK, bi, FP8_BLOCK)
    e = _pow2_scale(blocks.abs().amax(dim=(1, 3)), FP8_MAX)
    scale = torch.exp2(e)
    q = (blocks / scale[:, None, :, None]).view(bo * FP8_BLOCK, bi * FP8_BLOCK)[:out_f, :in_f]
    return q.contiguous().to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def dequantize_fp8(q, scale):
    import torch

    out_f, in_f = q.shape
    s = scale.to(torch.float32)
    s = s.repeat_interleave(FP8_BLOCK, 0)[:out_f].repeat_interleave(FP8_BLOCK, 1)[:, :in_f]
    return q.to(torch.float32) * s


def quantize_fp4(w):
    """[out, in] float32 -> (packed I8 [out, in/2]: element 2i low nibble, 2i+1 high nibble;
    e8m0 scale [out, in/32])."""
    import torch

    out_f, in_f = w.shape
    assert in_f % FP4_BLOCK == 0, in_f
    blocks = w.view(out_f, in_f // FP4_BLOCK, FP4_BLOCK)
    e = _pow2_scale(blocks.abs().amax(dim=2), FP4_MAX)
    x = (blocks / torch.exp2(e)[:, :, None]).view(out_f, in_f)
    grid = torch.tensor(E2M1)
    mag = (x.abs()[..., None] - grid).abs().argmin(dim=-1)  # nearest (ties: the smaller code)
    code = (mag | ((x < 0) & (mag > 0)).to(torch.int64) << 3).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(torch.int8), torch.exp2(e).to(torch.float8_e8m0fnu)


def dequantize_fp4(packed, scale):
    import torch

    p = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((p & 15, p >> 4), dim=-1).flatten(-2)  # [out, in]
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1))
    vals = lut[codes]
    s = scale.to(torch.float32).repeat_interleave(FP4_BLOCK, 1)
    return vals * s


# ----------------------------------------------------------------------------------------
# the official checkpoint


def official_config(hf_cfg) -> dict:
    """config.json with the released field names, for transformers config ``hf_cfg``."""
    comp = hf_cfg.compress_rates
    ratios = [0 if t == "sliding_attention" else comp[t] for t in hf_cfg.layer_types]
    n_hash = sum(t == "hash_moe" for t in hf_cfg.mlp_layer_types)
    cr = hf_cfg.rope_parameters["compress"]
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": hf_cfg.vocab_size,
        "hidden_size": hf_cfg.hidden_size,
        "num_hidden_layers": hf_cfg.num_hidden_layers,
        "num_attention_heads": hf_cfg.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": hf_cfg.head_dim,
        "qk_rope_head_dim": hf_cfg.qk_rope_head_dim,
        "q_lora_rank": hf_cfg.q_lora_rank,
        "o_lora_rank": hf_cfg.o_lora_rank,
        "o_groups": hf_cfg.o_groups,
        "sliding_window": hf_cfg.sliding_window,
        "rms_norm_eps": hf_cfg.rms_norm_eps,
        "max_position_embeddings": hf_cfg.max_position_embeddings,
        "num_nextn_predict_layers": 1,
        "n_routed_experts": hf_cfg.n_routed_experts,
        "num_experts_per_tok": hf_cfg.num_experts_per_tok,
        "moe_intermediate_size": hf_cfg.moe_intermediate_size,
        "n_shared_experts": hf_cfg.n_shared_experts,
        "norm_topk_prob": True,
        "routed_scaling_factor": hf_cfg.routed_scaling_factor,
        "swiglu_limit": hf_cfg.swiglu_limit,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "num_hash_layers": n_hash,
        "expert_dtype": "fp4",
        "hc_mult": hf_cfg.hc_mult,
        "hc_sinkhorn_iters": hf_cfg.hc_sinkhorn_iters,
        "hc_eps": hf_cfg.hc_eps,
        "index_head_dim": hf_cfg.index_head_dim,
        "index_n_heads": hf_cfg.index_n_heads,
        "index_topk": hf_cfg.index_topk,
        "compress_rope_theta": cr["rope_theta"],
        "rope_theta": hf_cfg.rope_parameters["main"]["rope_theta"],
        "rope_scaling": {"type": "yarn", "factor": cr["factor"],
                         "original_max_position_embeddings": cr["original_max_position_embeddings"],
                         "beta_fast": int(cr["beta_fast"]), "beta_slow": int(cr["beta_slow"])},
        "compress_ratios": ratios + [0],  # the MTP layer: sliding window only
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": hf_cfg.bos_token_id,
        "eos_token_id": hf_cfg.eos_token_id,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "activation_scheme": "dynamic", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]},
    }


def _transformers_names(model) -> dict:
    """The model's tensors under the names transformers' save_pretrained writes (its reverse
    conversion mapping: official per-layer names under ``model.``)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        return load_file(os.path.join(d, "model.safetensors"))


_ROOT = {"model.embed_tokens.weight": "embed.weight", "head.weight": "head.weight", "model.norm.weight": "norm.weight",
         "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
         "model.hc_head.hc_scale": "hc_head_scale"}


def to_official_name(name: str) -> str:
    """transformers' saved name -> the released name. One rename is not a plain prefix:
    transformers' reverse mapping writes the attention's kv_norm as ``attn.norm`` (its
    ``.norm. <-> .kv_norm.`` renaming is not one-to-one); the release calls it
    ``attn.kv_norm`` (and the compressors' norms ``compressor.norm``)."""
    if name in _ROOT:
        return _ROOT[name]
    assert name.startswith("model.layers."), name
    name = name[len("model."):]
    if name.endswith(".attn.norm.weight"):
        name = name[: -len("norm.weight")] + "kv_norm.weight"
    return name


def from_official_name(name: str) -> str:
    inv = {v: k for k, v in _ROOT.items()}
    return inv.get(name) or "model." + name


def _mtp_float_tensors(model, seed: int) -> dict:
    """Random float tensors of one MTP block ``mtp.0.*``: layer 0's attention (sliding)
    with a non-hash router, plus the MTP projections, norms and its own hc head."""
    import torch

    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    E, hc = cfg.hidden_size, cfg.hc_mult
    src = {to_official_name(k): v for k, v in _transformers_names(model).items() if k.startswith("model.layers.0.")}
    out = {}
    for k, v in src.items():
        suffix = k[len("layers.0."):]
        if suffix == "ffn.gate.tid2eid":
            out["ffn.gate.bias"] = 0.1 * torch.randn(cfg.n_routed_experts, generator=g)
            continue
        if suffix.endswith("norm.weight"):
            t = 1.0 + 0.2 * torch.randn(v.shape, generator=g)
        elif suffix.endswith("_fn"):
            t = 0.05 * torch.randn(v.shape, generator=g)
        elif suffix.endswith(("_base", "ape")):
            t = 0.5 * torch.randn(v.shape, generator=g)
        elif suffix.endswith("_scale"):
            t = 1.0 + 0.3 * torch.randn(v.shape, generator=g)
        elif suffix.endswith("attn_sink"):
            t = torch.randn(v.shape, generator=g)
        else:
            t = 0.15 * torch.randn(v.shape, generator=g)
        out[suffix] = t
    out["e_proj.weight"] = 0.15 * torch.randn(E, E, generator=g)
    out["h_proj.weight"] = 0.15 * torch.randn(E, E, generator=g)
    for n in ("enorm.weight", "hnorm.weight", "norm.weight"):
        out[n] = 1.0 + 0.2 * torch.randn(E, generator=g)
    out["hc_head_fn"] = 0.05 * torch.randn(hc, hc * E, generator=g)
    out["hc_head_base"] = 0.5 * torch.randn(hc, generator=g)
    out["hc_head_scale"] = 1.0 + 0.3 * torch.randn(1, generator=g)
    return {f"mtp.0.{k}": v for k, v in out.items()}


def _suffix(name: str) -> str:
    parts = name.split(".")
    if parts[0] in ("layers", "mtp") and parts[1].isdigit():
        return ".".join(parts[2:])
    return name


def quantize_official(float_tensors: dict) -> dict:
    """Official name -> stored tensor (FP8 + .scale, FP4 + .scale, BF16, F32, I64)."""
    import torch

    out = {}
    for name, t in float_tensors.items():
        s = _suffix(name)
        if t.dtype in (torch.int64, torch.int32):
            out[name] = t.to(torch.int64)
        elif s in FP8:
            out[name], out[name[: -len(".weight")] + ".scale"] = quantize_fp8(t.float())
        elif ".ffn.experts." in name:
            out[name], out[name[: -len(".weight")] + ".scale"] = quantize_fp4(t.float())
        elif s in BF16 or name in ROOT_BF16:
            out[name] = t.to(torch.bfloat16)
        else:
            out[name] = t.to(torch.float32).contiguous()
    return out


def dequantized_state_dict(stored: dict) -> dict:
    """The float32 values of a stored official state dict (no .scale entries)."""
    import torch

    out = {}
    for name, t in stored.items():
        if name.endswith(".scale"):
            continue
        scale = stored.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if t.dtype == torch.float8_e4m3fn:
            out[name] = dequantize_fp8(t, scale)
        elif scale is not None and t.dtype in (torch.int8, torch.uint8):
            out[name] = dequantize_fp4(t, scale)
        elif t.dtype in (torch.int64, torch.int32):
            out[name] = t
        else:
            out[name] = t.to(torch.float32)
    return out


def load_official(official_dir) -> dict:
    """Every tensor of an official checkpoint directory (torch, stored dtypes)."""
    from safetensors.torch import load_file

    d = Path(official_dir)
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def hf_model_from_official(official_dir, tmp_dir):
    """transformers' DeepseekV4ForCausalLM holding the dequantized main-model weights of
    ``official_dir`` (names mapped back by transformers' own loader); float32, eval mode."""
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM

    deq = dequantized_state_dict(load_official(official_dir))
    tensors = {from_official_name(k): v.contiguous() for k, v in deq.items() if not k.startswith("mtp.")}
    tmp_dir = Path(tmp_dir)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fx.make_config().save_pretrained(tmp_dir)
    save_file(tensors, tmp_dir / "model.safetensors", metadata={"format": "pt"})
    return DeepseekV4ForCausalLM.from_pretrained(tmp_dir, dtype=torch.float32).eval()


def write_official(out_dir, seed: int = fx.SEED) -> dict:
    """Write the official-layout checkpoint of the tiny model into ``out_dir`` (replaced);
    returns the stored tensors."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    model = fx.make_model(seed)
    floats = {to_official_name(k): v for k, v in _transformers_names(model).items()}
    floats.update(_mtp_float_tensors(model, MTP_SEED))
    stored = quantize_official(floats)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    names = sorted(stored)
    # two shards, as released checkpoints come sharded: main layers 0-1 + root, the rest
    first = [n for n in names if not n.startswith(("layers.2.", "layers.3.", "mtp."))]
    shards = [first, [n for n in names if n not in set(first)]]
    weight_map = {}
    for i, part in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: stored[n].contiguous() for n in part}, out_dir / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1, sort_keys=True) + "\n")
    (out_dir / "config.json").write_text(json.dumps(official_config(model.config), indent=1) + "\n")
    fx.save_tokenizer(out_dir)
    return stored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", default=DEFAULT_LLAMA_CPP, type=Path,
                    help=f"llama.cpp source directory with convert_hf_to_gguf.py (default {DEFAULT_LLAMA_CPP})")
    ap.add_argument("--out", default=DEFAULT_OUT, type=Path, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--no-llama-cpp", action="store_true", help="write the checkpoint only")
    a = ap.parse_args()
    official = a.out / "official"
    write_official(official)
    if not a.no_llama_cpp:
        if not (a.llama_cpp / "convert_hf_to_gguf.py").is_file():
            ap.error(f"{a.llama_cpp}/convert_hf_to_gguf.py not found")
        run_llama_cpp_converter(a.llama_cpp, official, a.out / "llamacpp.gguf")
        run_llama_cpp_converter(a.llama_cpp, official, a.out / "llamacpp-mtp.gguf", "--mtp")
    size = sum(p.stat().st_size for p in a.out.rglob("*") if p.is_file())
    print(f"{a.out} ({size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
