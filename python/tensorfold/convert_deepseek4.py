"""DeepSeek-V4 (``DeepseekV4ForCausalLM``) → GGUF architecture ``deepseek4``, as llama.cpp's
own converter and loader (src/models/deepseek4.cpp) have it. ``tensorfold convert`` hands
such directories to :func:`convert_deepseek4`.

Inputs. The same model comes in three tensor namings, all accepted (mixed is refused):

- the OFFICIAL release (``deepseek-ai/DeepSeek-V4-*``): ``embed.weight``, ``head.weight``,
  ``norm.weight``, ``hc_head_{fn,base,scale}``, ``layers.N.attn.wq_a.weight``,
  ``layers.N.ffn.experts.E.w1.weight``, … and next-token-prediction layers ``mtp.J.*``;
  linears in FP8 e4m3 with E8M0 block scales (``NAME.scale``, one per
  ``quantization_config.weight_block_size``, default 128x128), routed experts in FP4 e2m1
  packed two per byte (element 2i in the low nibble) with one E8M0 scale per 32 inputs,
  the rest BF16 / F32, ``tid2eid`` integer;
- what transformers' ``save_pretrained`` writes (its default ``save_original_format``): the
  official per-layer names under ``model.`` (``model.layers.N.attn.wq_a.weight``), the root as
  ``model.embed_tokens.weight``, ``model.norm.weight``, ``model.hc_head.hc_{fn,base,scale}``
  and ``head.weight``; one name differs from the release: the attention's kv norm is
  ``attn.norm.weight`` (transformers' ``.norm. <-> .kv_norm.`` renaming is not one-to-one),
  the release's ``attn.kv_norm.weight``;
- transformers' in-memory names (``save_original_format=False``):
  ``model.layers.N.self_attn.q_a_proj.weight``, ``…mlp.experts.gate_up_proj`` (``[E, 2F, H]``,
  gate rows first) and ``…mlp.experts.down_proj`` (``[E, H, F]``), ``…attn_hc.fn``, ….
config.json may use either vocabulary: transformers' (``layer_types`` + ``compress_rates``,
``mlp_layer_types``, ``rope_parameters`` with ``main`` / ``compress``, ``partial_rotary_factor``)
or the release's (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_theta``,
``compress_rope_theta``, ``rope_scaling``).

Output (names, shapes and keys from llama.cpp's gguf-py MODEL_ARCH.DEEPSEEK4 and its loader;
numpy shapes below, GGUF ``ne`` is the reverse):

- root: ``token_embd`` / ``output`` [V, H], ``output_norm`` [H], ``output_hc_fn`` [hc, hc*H],
  ``output_hc_base`` [hc], ``output_hc_scale`` [1];
- per layer ``blk.N``: ``attn_norm``, ``attn_sinks`` [heads], ``attn_q_a`` [q_lora, H],
  ``attn_q_a_norm``, ``attn_q_b`` [heads*hd, q_lora], ``attn_kv`` [hd, H], ``attn_kv_a_norm``,
  ``attn_output_a`` [groups*o_lora, heads*hd/groups] (the loader views it as
  [groups, o_lora, heads*hd/groups]), ``attn_output_b`` [H, groups*o_lora],
  ``hc_{attn,ffn}_fn`` [(2+hc)*hc, hc*H], ``hc_{attn,ffn}_base`` [(2+hc)*hc], ``…_scale`` [3];
  compressed layers (ratio r; c = 2 when r = 4, else 1): ``attn_compressor_{kv,gate}``
  [c*hd, H], ``attn_compressor_ape`` [r, c*hd], ``attn_compressor_norm`` [hd]; CSA layers
  (r = 4) also ``indexer.attn_q_b`` [ih*id, q_lora], ``indexer.proj`` [ih, H],
  ``indexer_compressor_{kv,gate}`` [2*id, H], ``indexer_compressor_ape`` [4, 2*id],
  ``indexer_compressor_norm`` [id]; ``ffn_norm``, ``ffn_gate_inp`` [E, H]; the first
  ``hash_layer_count`` layers ``ffn_gate_tid2eid`` (I32 [V, top_k]), the others
  ``exp_probs_b.bias`` [E] (from ``e_score_correction_bias`` / ``gate.bias``);
  ``ffn_{gate,up}_exps`` [E, F, H], ``ffn_down_exps`` [E, H, F]; ``ffn_{gate,up}_shexp``
  [F, H], ``ffn_down_shexp`` [H, F];
- next-token-prediction layer J (official input only) as llama.cpp names NextN layers: the
  same per-layer tensors as ``blk.{n_layer+J}`` plus ``blk.{n_layer+J}.nextn.eh_proj``
  [H, 2H] (``[e_proj | h_proj]``, the embedding half first), ``nextn.enorm``, ``nextn.hnorm``,
  ``nextn.shared_head_norm`` (the layer's ``norm``); ``block_count`` then counts them and
  ``nextn_predict_layers`` says how many (llama.cpp: n_layer = block_count -
  nextn_predict_layers). The MTP layer's own ``hc_head_{fn,base,scale}`` has no place in a
  GGUF that also holds the main model (llama.cpp's MTP graph collapses the streams with the
  root ``output_hc_*``; only its MTP-only export puts the MTP head there) and is left out,
  with a warning when it differs from the main head.

Types: norms, sinks, ``ape``, hyper-connection tensors, router weights and biases F32;
``tid2eid`` I32; FP4 experts MXFP4, a lossless repack (ggml's block is the E8M0 byte then 16
bytes holding element j in the low and j+16 in the high nibble; the e2m1 codes are ggml's
kvalues_mxfp4 order); every other weight (FP8 ones dequantized exactly: e4m3 value times a
power of two) in ``outtype`` (``q8_0`` falls back to F16 for rows not a multiple of 32).

Refused with a ConvertError naming the field: what deepseek4 as llama.cpp defines it cannot
express — scoring other than sqrtsoftplus, hc_mult other than 4, a CSA rate other than 4 (the
ratio 4 is what marks a CSA layer) or an HCA rate of 4, hash routing on other than the first
layers, rope scaling on the sliding layers or of a kind other than YaRN with attention factor
1, grouped routing, more than one shared expert, a non-positive swiglu_limit. Written with a
warning, because the file describes them but llama.cpp's implementation does not run them:
HCA ratios other than 128 (its loader refuses), MTP layers with compressed attention, an
index_head_dim that is not a multiple of 64, a model without CSA layers.
``norm_topk_prob``: transformers and DeepSeek's reference normalise the top-k weights of a
sqrtsoftplus router whatever it says, so ``expert_weights_norm`` is always written true.
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .convert import (_FILE_TYPE, ConvertError, _bf16_to_f32, _encode, _model_name, _safetensors_header,
                      _shard_paths, _tensor_nbytes, _tokenizer_kv, _weight_type, _write_gguf)

log = logging.getLogger("tensorfold.convert")

ARCH = "deepseek4"
HF_ARCH = "DeepseekV4ForCausalLM"

# GGML type ids (gguf.GGMLQuantizationType) and the MXFP4-experts file type (gguf.LlamaFileType)
_F32, _F16, _I32, _MXFP4 = 0, 1, 26, 39
_FILE_TYPE_MXFP4_MOE = 38
_EXPERT_GATING_SQRTSOFTPLUS = 4  # gguf.ExpertGatingFuncType.SQRTSOFTPLUS

# transformers' DeepseekV4Config defaults, for fields a config.json leaves out
_DEFAULTS = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
    num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024, num_experts_per_tok=6,
    n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
    routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000.0,
    compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
    sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
    rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
)
_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_CSA, _HCA = 4, 128  # CSA is ratio 4 by definition; 128 is the only HCA ratio llama.cpp's deepseek4 runs
_FP4_BLOCK = 32


# --------------------------------------------------------------------------------------
# hyper-parameters


@dataclass
class V4Params:
    n_vocab: int
    n_ctx: int
    n_embd: int
    n_layer: int
    n_head: int
    head_dim: int
    rope_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    weights_scale: float
    swiglu_limit: float
    idx_heads: int
    idx_dim: int
    idx_topk: int
    window: int
    ratios: list[int]           # per main layer: 0 sliding, 4 CSA, 128 HCA
    mtp_ratios: list[int]       # per MTP layer, from compress_ratios where the config has them
    n_hash: int
    hc: int
    hc_iters: int
    hc_eps: float
    rms_eps: float
    rope_base: float
    compress_base: float
    rope_scaling: list | None   # rows (key suffix after "rope.scaling.", kind, value)
    tied: bool
    n_mtp_cfg: int              # num_nextn_predict_layers
    arch: str = ARCH            # for the shared tokenizer code
    n_mtp: int = 0              # MTP layers present in the checkpoint (and written)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def params(cfg: dict) -> V4Params:
    """The model's hyper-parameters from config.json (transformers' or the release's field
    names); ConvertError, naming the field, for what llama.cpp's deepseek4 cannot run."""

    def get(key: str):
        v = cfg.get(key)
        return _DEFAULTS.get(key) if v is None else v

    def pos(key: str) -> int:
        v = get(key)
        if not _is_int(v) or v <= 0:
            raise ConvertError(f"config.json: {key} = {v!r} is not a positive integer")
        return v

    def num(key: str, minimum: float = 0.0) -> float:
        v = get(key)
        if not _is_num(v) or v <= minimum:
            raise ConvertError(f"config.json: {key} = {v!r} is not a number > {minimum}")
        return float(v)

    act = get("hidden_act")
    if act != "silu":
        raise ConvertError(f"config.json: hidden_act '{act}' is not supported (DeepSeek-V4 uses silu / SwiGLU)")
    scoring = get("scoring_func")
    if scoring != "sqrtsoftplus":
        raise ConvertError(f"config.json: scoring_func '{scoring}' cannot be represented: llama.cpp's deepseek4 "
                           "routes with sqrtsoftplus only (expert_gating_func 4)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ConvertError(f"config.json: {key} is true; DeepSeek-V4 has no such biases")
    if cfg.get("num_key_value_heads", 1) != 1:
        raise ConvertError(f"config.json: num_key_value_heads = {cfg['num_key_value_heads']!r}; DeepSeek-V4 "
                           "attention has one shared key/value head")
    hc = pos("hc_mult")
    if hc != 4:
        raise ConvertError(f"config.json: hc_mult = {hc}; llama.cpp's deepseek4 runs 4 hyper-connection streams only")
    n_group, topk_group = cfg.get("n_group"), cfg.get("topk_group")
    if _is_int(n_group) and n_group > 1 and not (_is_int(topk_group) and topk_group >= n_group):
        raise ConvertError(f"config.json: n_group {n_group} / topk_group {topk_group!r} asks for group-limited "
                           "routing, which DeepSeek-V4 does not have and llama.cpp's deepseek4 would apply")
    n_shared = pos("n_shared_experts")
    if n_shared != 1:
        raise ConvertError(f"config.json: n_shared_experts = {n_shared}; DeepSeek-V4 has one shared expert of width "
                           "moe_intermediate_size (transformers builds exactly that, llama.cpp expects "
                           "n_shared_experts times that width)")

    n_embd, n_layer, n_head = pos("hidden_size"), pos("num_hidden_layers"), pos("num_attention_heads")
    head_dim = pos("head_dim")
    rope_dim = _rope_dim(cfg, head_dim)
    o_groups = pos("o_groups")
    if n_head % o_groups:
        raise ConvertError(f"config.json: num_attention_heads {n_head} is not a multiple of o_groups {o_groups}")
    n_expert, n_used = pos("n_routed_experts"), pos("num_experts_per_tok")
    if n_used > n_expert:
        raise ConvertError(f"config.json: num_experts_per_tok {n_used} > n_routed_experts {n_expert}")
    idx_dim = pos("index_head_dim")
    if idx_dim < rope_dim:
        raise ConvertError(f"config.json: index_head_dim {idx_dim} < the rope width {rope_dim}")
    if idx_dim % 64:
        log.warning("config.json: index_head_dim %d is not a multiple of 64; llama.cpp's deepseek4 rotates the "
                    "indexer's queries and keys with a Hadamard matrix of 64 or more that must divide it (it aborts "
                    "or mixes heads otherwise)", idx_dim)
    limit = num("swiglu_limit", 1e-6)  # llama.cpp clamps only above 1e-6; transformers always clamps
    if cfg.get("norm_topk_prob") is False:
        log.warning("config.json: norm_topk_prob is false, but transformers and DeepSeek's reference normalise the "
                    "top-k weights of a sqrtsoftplus router anyway; writing expert_weights_norm = true")
    ratios, mtp_ratios = _ratios(cfg, n_layer)
    base, compress_base, scaling = _rope(cfg, rope_dim, head_dim)
    eps = get("rms_norm_eps")
    if not _is_num(eps) or not 0 < eps < 1:
        raise ConvertError(f"config.json: rms_norm_eps = {eps!r} is invalid")
    hc_eps = get("hc_eps")
    if not _is_num(hc_eps) or not 0 < hc_eps < 1:
        raise ConvertError(f"config.json: hc_eps = {hc_eps!r} is invalid")
    n_mtp = cfg.get("num_nextn_predict_layers") or 0
    if not _is_int(n_mtp) or n_mtp < 0:
        raise ConvertError(f"config.json: num_nextn_predict_layers = {n_mtp!r} is not an integer >= 0")
    return V4Params(
        n_vocab=pos("vocab_size"), n_ctx=pos("max_position_embeddings"), n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, head_dim=head_dim, rope_dim=rope_dim, q_lora=pos("q_lora_rank"), o_groups=o_groups,
        o_lora=pos("o_lora_rank"), n_expert=n_expert, n_expert_used=n_used, n_ff_exp=pos("moe_intermediate_size"),
        weights_scale=num("routed_scaling_factor"), swiglu_limit=limit, idx_heads=pos("index_n_heads"),
        idx_dim=idx_dim, idx_topk=pos("index_topk"), window=pos("sliding_window"), ratios=ratios,
        mtp_ratios=mtp_ratios, n_hash=_hash_layers(cfg, n_layer), hc=hc, hc_iters=pos("hc_sinkhorn_iters"),
        hc_eps=float(hc_eps), rms_eps=float(eps), rope_base=base, compress_base=compress_base, rope_scaling=scaling,
        tied=bool(get("tie_word_embeddings")), n_mtp_cfg=n_mtp,
    )


def _rope_dim(cfg: dict, head_dim: int) -> int:
    """The rotated width of a head: qk_rope_head_dim (release) or head_dim *
    partial_rotary_factor (transformers; its default is 64 / 512)."""
    rd = cfg.get("qk_rope_head_dim")
    prf = cfg.get("partial_rotary_factor")
    if rd is None:
        prf = 64 / 512 if prf is None else prf
        if not _is_num(prf) or not 0 < prf <= 1:
            raise ConvertError(f"config.json: partial_rotary_factor = {prf!r} is invalid")
        rd = int(head_dim * prf)
    elif not _is_int(rd) or rd <= 0:
        raise ConvertError(f"config.json: qk_rope_head_dim = {rd!r} is not a positive integer")
    elif prf is not None and int(head_dim * prf) != rd:
        raise ConvertError(f"config.json: qk_rope_head_dim {rd} disagrees with partial_rotary_factor {prf} * "
                           f"head_dim {head_dim}")
    if rd % 2 or rd >= head_dim:
        raise ConvertError(f"config.json: rope width {rd} must be even and smaller than head_dim {head_dim}")
    return rd


def _ratios(cfg: dict, n_layer: int) -> tuple[list[int], list[int]]:
    """Per-layer compression ratios of the main layers and of the MTP layers. In deepseek4 the
    ratio alone says what a layer is: 0 sliding window only, 4 compressed sparse attention
    (overlapping windows + lightning indexer), any other heavily compressed attention. So a
    CSA rate other than 4, or an HCA rate of 4, cannot be written; an HCA rate other than
    DeepSeek's 128 can (llama.cpp's loader runs 128 only: warned)."""
    layer_types = cfg.get("layer_types")
    listed = cfg.get("compress_ratios")
    if layer_types is not None:
        rates = dict(_DEFAULT_RATES)
        given = cfg.get("compress_rates")
        if given is not None:
            if not isinstance(given, dict):
                raise ConvertError(f"config.json: compress_rates = {given!r} is not an object")
            rates.update(given)
        for key, kind in (("compress_rate_csa", "compressed_sparse_attention"),  # transformers' legacy spellings
                          ("compress_rate_hca", "heavily_compressed_attention")):
            if cfg.get(key) is not None:
                rates[kind] = cfg[key]
        csa, hca = rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]
        if csa != _CSA:
            raise ConvertError(f"config.json: compress_rates gives compressed_sparse_attention rate {csa!r}; deepseek4 "
                               f"marks a CSA layer by its ratio {_CSA}, so no other rate can be represented")
        if not _is_int(hca) or hca <= 0 or hca == _CSA:
            raise ConvertError(f"config.json: compress_rates gives heavily_compressed_attention rate {hca!r}; "
                               f"deepseek4 needs a positive ratio other than {_CSA} (which marks CSA layers)")
        kinds = {"sliding_attention": 0, "compressed_sparse_attention": _CSA, "heavily_compressed_attention": hca}
        if not isinstance(layer_types, list) or len(layer_types) < n_layer or \
                any(t not in kinds for t in layer_types):
            raise ConvertError(f"config.json: layer_types must name one of {sorted(kinds)} for each of the {n_layer} "
                               "layers")
        ratios = [kinds[t] for t in layer_types[:n_layer]]
        extra = listed[n_layer:] if isinstance(listed, list) else []
    elif listed is not None:
        if not isinstance(listed, list) or len(listed) < n_layer or any(not _is_int(r) for r in listed):
            raise ConvertError(f"config.json: compress_ratios must list an integer for each of the {n_layer} layers")
        ratios, extra = list(listed[:n_layer]), list(listed[n_layer:])
    else:  # transformers' default schedule: two HCA layers, then CSA / HCA alternating
        ratios = [_HCA] * min(n_layer, 2) + [_CSA if i % 2 else _HCA for i in range(max(n_layer - 2, 0))]
        extra = []
    bad = sorted({r for r in ratios + extra if not _is_int(r) or r < 0})
    if bad:
        raise ConvertError(f"config.json: compress_ratios {bad} are not ratios (0, {_CSA} or a positive HCA ratio)")
    other = sorted({r for r in ratios + extra if r not in (0, _CSA, _HCA)})
    if other:
        log.warning("compression ratios %s: llama.cpp's deepseek4 loader runs ratios 0, %d and %d only (the file "
                    "describes the model; llama.cpp will refuse to load it)", other, _CSA, _HCA)
    if not any(r == _CSA for r in ratios):
        log.warning("no compressed-sparse-attention layer: llama.cpp's deepseek4 (as vendored in "
                    "llama-cpp-python 0.3.36) fails creating a context for such a model (division by zero)")
    return ratios, extra


def _hash_layers(cfg: dict, n_layer: int) -> int:
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is not None:
        if not isinstance(mlp_types, list) or len(mlp_types) < n_layer or \
                any(t not in ("hash_moe", "moe") for t in mlp_types):
            raise ConvertError(f"config.json: mlp_layer_types must name hash_moe or moe for each of the {n_layer} "
                               "layers")
        types = mlp_types[:n_layer]
        k = sum(t == "hash_moe" for t in types)
        if types != ["hash_moe"] * k + ["moe"] * (n_layer - k):
            raise ConvertError(f"config.json: mlp_layer_types {types} cannot be represented: llama.cpp's deepseek4 "
                               "hash-routes the first hash_layer_count layers only")
        return k
    k = cfg.get("num_hash_layers")
    k = 3 if k is None else k  # transformers' default
    if not _is_int(k) or not 0 <= k <= n_layer:
        raise ConvertError(f"config.json: num_hash_layers = {k!r} is not an integer in [0, {n_layer}]")
    return k


def _rope(cfg: dict, rope_dim: int, head_dim: int) -> tuple[float, float, list | None]:
    """(rope base of the sliding layers, base of the compressed layers and compressors,
    rope.scaling.* rows). DeepSeek-V4 scales (YaRN) only the compressed layers, without
    YaRN's attention factor, which is what llama.cpp's deepseek4 does with the rope.scaling
    keys."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
        where = "rope_parameters.compress"
    else:
        flat = rp if isinstance(rp, dict) and rp else (cfg.get("rope_scaling") or {})
        if not isinstance(flat, dict):
            raise ConvertError(f"config.json: rope scaling {flat!r} is not understood")
        where = "rope_parameters" if flat is rp else "rope_scaling"
        main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", _DEFAULTS["rope_theta"])}
        comp = {k: v for k, v in flat.items() if k != "rope_theta"}
        comp["rope_theta"] = cfg.get("compress_rope_theta", _DEFAULTS["compress_rope_theta"])
    main_type = main.get("rope_type", main.get("type", "default"))
    if main_type not in ("default", None):
        raise ConvertError(f"config.json: rope_parameters.main has rope_type '{main_type}'; DeepSeek-V4's sliding "
                           "layers use plain rope and llama.cpp's deepseek4 scales only the compressed ones")
    for part, d in (("main", main), ("compress", comp)):
        prf = d.get("partial_rotary_factor")
        if prf is not None and int(head_dim * prf) != rope_dim:
            raise ConvertError(f"config.json: rope_parameters.{part}.partial_rotary_factor {prf} disagrees with the "
                               f"rope width {rope_dim}")
    base, cbase = main.get("rope_theta"), comp.get("rope_theta")
    for name, v in (("rope_theta", base), ("compress_rope_theta", cbase)):
        if not _is_num(v) or v <= 0:
            raise ConvertError(f"config.json: {name} = {v!r} is invalid")
    kind = comp.get("rope_type", comp.get("type", "default"))
    if kind in ("default", None, "none"):
        return float(base), float(cbase), None
    if kind != "yarn":
        raise ConvertError(f"config.json: {where} rope type '{kind}' cannot be represented for deepseek4 (only YaRN)")
    orig = comp.get("original_max_position_embeddings")
    if not _is_int(orig) or orig <= 0:
        raise ConvertError(f"config.json: {where}.original_max_position_embeddings = {orig!r} is not a positive "
                           "integer")
    factor = comp.get("factor")
    if factor is None:  # transformers derives it
        factor = cfg.get("max_position_embeddings", _DEFAULTS["max_position_embeddings"]) / orig
    if not _is_num(factor) or factor <= 0:
        raise ConvertError(f"config.json: {where}.factor = {factor!r} is invalid")
    attn = comp.get("attention_factor")
    if attn is not None and attn != 1.0:
        raise ConvertError(f"config.json: {where}.attention_factor = {attn!r} cannot be represented: DeepSeek-V4 and "
                           "llama.cpp's deepseek4 apply YaRN without an attention factor")
    ext = comp.get("extrapolation_factor")
    if ext is not None and ext != 1.0:
        raise ConvertError(f"config.json: {where}.extrapolation_factor = {ext!r} is not supported")
    if False in (comp.get("truncate"), rp.get("truncate") if isinstance(rp, dict) else None):
        raise ConvertError(f"config.json: {where}.truncate = false cannot be represented (llama.cpp rounds the YaRN "
                           "correction range)")
    rows: list = [("type", "str", "yarn"), ("factor", "f32", float(factor)), ("original_context_length", "u32", orig)]
    for key, gkey, default in (("beta_fast", "yarn_beta_fast", 32.0), ("beta_slow", "yarn_beta_slow", 1.0)):
        v = comp.get(key)
        v = default if v is None else v
        if not _is_num(v) or v <= 0:
            raise ConvertError(f"config.json: {where}.{key} = {v!r} is invalid")
        rows.append((gkey, "f32", float(v)))
    return float(base), float(cbase), rows


# --------------------------------------------------------------------------------------
# safetensors, raw


_DT = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2", "F8_E4M3": "u1", "F8_E8M0": "u1", "I8": "u1",
       "U8": "u1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}

# e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 subnormal; S.1111.111 NaN
_E4M3 = np.array([(-1.0 if b & 0x80 else 1.0) * (((b & 7) / 8.0) * 2.0 ** -6 if (b >> 3) & 15 == 0
                                                 else (1 + (b & 7) / 8.0) * 2.0 ** (((b >> 3) & 15) - 7))
                  for b in range(256)], dtype=np.float32)
_E4M3[0x7F] = _E4M3[0xFF] = np.nan
# e2m1 codes in ggml's kvalues_mxfp4 order (value / 2 there, with the scale doubled)
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                 dtype=np.float32)


def _e8m0(b: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 2^(b - 127) (255: NaN)."""
    out = np.ldexp(np.float32(1.0), b.astype(np.int32) - 127).astype(np.float32)
    out[b == 255] = np.nan
    return out


class _Raw:
    """Name -> (file, dtype, shape, byte range) over the checkpoint's safetensors files; reads
    tensors memory-mapped in their stored form (BF16 / F16 widened to float32, FP8 / FP4 /
    E8M0 as raw bytes)."""

    def __init__(self, hf_dir: str):
        self.info: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        for path in _shard_paths(hf_dir):
            data_start, header = _safetensors_header(path)
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                if name in self.info:
                    raise ConvertError(f"tensor {name} appears in two shards")
                dt = meta.get("dtype")
                if dt not in _DT:
                    raise ConvertError(f"{path}: tensor {name} has dtype {dt}, which this converter cannot read")
                start, end = (int(x) for x in meta["data_offsets"])
                self.info[name] = (path, dt, tuple(int(d) for d in meta["shape"]), data_start + start, end - start)

    def __contains__(self, name: str) -> bool:
        return name in self.info

    def dtype(self, name: str) -> str:
        return self.info[name][1]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info[name][2]

    def read(self, name: str) -> np.ndarray:
        path, dt, shape, offset, nbytes = self.info[name]
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        npdt = np.dtype(_DT[dt])
        if n * npdt.itemsize != nbytes:
            raise ConvertError(f"{path}: tensor {name} has inconsistent data offsets")
        if n == 0:
            return np.zeros(shape, dtype=np.float32)
        mm = np.memmap(path, dtype=npdt, mode="r", offset=offset, shape=(n,))
        if dt == "BF16":
            out = _bf16_to_f32(mm)
        elif dt in ("F16", "F64"):
            out = mm.astype(np.float32)
        else:
            out = np.array(mm)
        del mm
        return out.reshape(shape)


# --------------------------------------------------------------------------------------
# names: every input naming -> the release's


_ROOT = {
    "embed.weight": "embed.weight", "model.embed_tokens.weight": "embed.weight",
    "head.weight": "head.weight", "lm_head.weight": "head.weight",
    "norm.weight": "norm.weight", "model.norm.weight": "norm.weight",
    "hc_head_fn": "hc_head_fn", "model.hc_head.hc_fn": "hc_head_fn",
    "hc_head_base": "hc_head_base", "model.hc_head.hc_base": "hc_head_base",
    "hc_head_scale": "hc_head_scale", "model.hc_head.hc_scale": "hc_head_scale",
}
# transformers' in-memory per-layer names -> the release's
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.experts.gate_up_proj": "ffn.experts.gate_up_proj",
    "mlp.experts.down_proj": "ffn.experts.down_proj",
}
_LAYER_RE = re.compile(r"^(?:model\.)?(layers|mtp)\.(\d+)\.(.+)$")


def canonical(name: str) -> str | None:
    """The release's name of a checkpoint tensor in any of the three namings, or None when it
    is none of DeepSeek-V4's (rotary caches and the like are not stored)."""
    if name in _ROOT:
        return _ROOT[name]
    m = _LAYER_RE.match(name)
    if not m:
        return None
    kind, idx, rest = m.groups()
    if name.startswith("model.") and kind == "mtp":
        return None
    rest = _HF_LAYER.get(rest, rest)
    if rest == "attn.norm.weight":  # transformers' saved name of the attention's kv norm
        rest = "attn.kv_norm.weight"
    return f"{kind}.{idx}.{rest}"


# --------------------------------------------------------------------------------------
# the plan


@dataclass
class _Out:
    name: str
    shape: tuple[int, ...]                # numpy order, elements
    kind: str                             # "f32" (always), "i32", "mxfp4", "w" (outtype)
    make: Callable[[], np.ndarray]        # float32 (f32 / w), int32 (i32) or block bytes (mxfp4)
    ggml_type: int = _F32
    nbytes: int = 0
    note: str = ""


class _Reader:
    """The checkpoint by release names: float values (FP8 / FP4 dequantized), raw FP4 blocks."""

    def __init__(self, raw: _Raw, block: tuple[int, int]):
        self.raw = raw
        self.block = block
        self.src: dict[str, str] = {}
        for name in raw.info:
            c = canonical(name)
            if c is None:
                continue
            if c in self.src:
                raise ConvertError(f"tensors {self.src[c]} and {name} are the same tensor in two namings; the "
                                   "checkpoint mixes layouts")
            self.src[c] = name
        self.used: set[str] = set()

    def has(self, c: str) -> bool:
        return c in self.src

    def _scale_of(self, c: str) -> str | None:
        s = c[: -len(".weight")] + ".scale" if c.endswith(".weight") else None
        return s if s is not None and s in self.src else None

    def is_fp4(self, c: str) -> bool:
        return self.has(c) and self.raw.dtype(self.src[c]) in ("I8", "U8") and self._scale_of(c) is not None

    def shape(self, c: str) -> tuple[int, ...]:
        """Logical shape (FP4: unpacked)."""
        if c not in self.src:
            raise ConvertError(f"tensor {c} is missing from the checkpoint")
        s = self.raw.shape(self.src[c])
        if self.is_fp4(c):
            s = (*s[:-1], 2 * s[-1])
        return s

    def use(self, c: str) -> None:
        self.used.add(c)
        sc = self._scale_of(c)
        if sc is not None:
            self.used.add(sc)

    def get(self, c: str) -> np.ndarray:
        """float32 (integers stay integers)."""
        name = self.src[c]
        dt = self.raw.dtype(name)
        a = self.raw.read(name)
        sc = self._scale_of(c)
        if dt == "F8_E4M3":
            if sc is None:
                raise ConvertError(f"tensor {name} is FP8 without its {c[:-7]}.scale")
            return self._dequant_fp8(c, _E4M3[a], self.raw.read(self.src[sc]))
        if dt in ("I8", "U8") and sc is not None:
            codes = np.stack([a & 15, a >> 4], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])
            scale = self._fp4_scale(c, self.raw.read(self.src[sc]), codes.shape)
            return _E2M1[codes] * np.repeat(scale, _FP4_BLOCK, axis=-1)
        if dt in ("I8", "U8", "F8_E8M0"):
            raise ConvertError(f"tensor {name} has dtype {dt} and no scale; cannot interpret it")
        if sc is not None:
            raise ConvertError(f"tensor {name} is {dt} but has a scale {self.src[sc]}; only FP8 / FP4 weights are "
                               "scaled")
        return a

    def _dequant_fp8(self, c: str, w: np.ndarray, s: np.ndarray) -> np.ndarray:
        if w.ndim != 2:
            raise ConvertError(f"FP8 tensor {self.src[c]} is not 2-D")
        (o, i), (bo, bi) = w.shape, self.block
        want = (-(-o // bo), -(-i // bi))
        if s.shape != want:
            raise ConvertError(f"tensor {self.src[c][:-7]}.scale has shape {list(s.shape)}, expected {list(want)} for "
                               f"{bo}x{bi} blocks of a {o}x{i} weight")
        scale = self._scale_values(c, s)
        return w * np.repeat(np.repeat(scale, bo, axis=0)[:o], bi, axis=1)[:, :i]

    def _scale_values(self, c: str, s: np.ndarray) -> np.ndarray:
        dt = self.raw.dtype(self.src[c[: -len(".weight")] + ".scale"])
        if dt in ("F8_E8M0", "U8"):
            return _e8m0(s)
        if dt in ("F32", "BF16", "F16"):
            return s.astype(np.float32)
        raise ConvertError(f"tensor {c[:-7]}.scale has dtype {dt}; expected E8M0 (or a float scale)")

    def _fp4_scale(self, c: str, s: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        want = (*shape[:-1], shape[-1] // _FP4_BLOCK)
        if shape[-1] % _FP4_BLOCK or s.shape != want:
            raise ConvertError(f"tensor {self.src[c][:-7]}.scale has shape {list(s.shape)}, expected {list(want)} "
                               f"(one E8M0 scale per {_FP4_BLOCK} FP4 values)")
        dt = self.raw.dtype(self.src[c[: -len(".weight")] + ".scale"])
        if dt not in ("F8_E8M0", "U8"):
            raise ConvertError(f"tensor {c[:-7]}.scale has dtype {dt}; FP4 weights need E8M0 scales")
        return _e8m0(s)

    def mxfp4(self, c: str) -> np.ndarray:
        """ggml MXFP4 blocks of an FP4 weight [rows, cols]: bytes [rows, cols/32*17]."""
        name = self.src[c]
        packed = self.raw.read(name)
        rows, half = packed.shape
        scale = self.raw.read(self.src[c[: -len(".weight")] + ".scale"])
        self._fp4_scale(c, scale, (rows, 2 * half))
        nb = 2 * half // _FP4_BLOCK
        src = packed.reshape(rows, nb, 16)
        vals = np.stack([src & 15, src >> 4], axis=-1).reshape(rows, nb, 32)  # element order
        qs = vals[:, :, :16] | (vals[:, :, 16:] << 4)
        return np.concatenate([scale.reshape(rows, nb, 1), qs], axis=-1).astype(np.uint8).reshape(rows, nb * 17)


def plan(p: V4Params, rd: _Reader) -> list[_Out]:
    """Every output tensor, checked against config.json; ConvertError for anything missing,
    misshapen or left over."""
    outs: list[_Out] = []
    E, V, hd, H = p.n_embd, p.n_vocab, p.head_dim, p.n_head

    def expect(c: str, shape: tuple[int, ...]) -> None:
        got = rd.shape(c)
        if got != shape:
            raise ConvertError(f"tensor {rd.src[c]} has shape {list(got)}, expected {list(shape)} from config.json")

    def add(gname: str, c: str, shape: tuple[int, ...], kind: str = "w") -> None:
        expect(c, shape)
        rd.use(c)
        outs.append(_Out(gname, shape, kind, lambda c=c: rd.get(c)))

    def add_tid2eid(gname: str, c: str) -> None:
        expect(c, (V, p.n_expert_used))
        rd.use(c)
        if rd.raw.dtype(rd.src[c]) not in ("I64", "I32", "I16", "I8", "U8"):
            raise ConvertError(f"tensor {rd.src[c]} has dtype {rd.raw.dtype(rd.src[c])}; tid2eid must be integer")

        def make(c=c) -> np.ndarray:
            t = rd.raw.read(rd.src[c]).astype(np.int64)
            if t.size and (t.min() < 0 or t.max() >= p.n_expert):
                raise ConvertError(f"tensor {rd.src[c]} holds expert ids outside [0, {p.n_expert})")
            return t.astype(np.int32)

        outs.append(_Out(gname, (V, p.n_expert_used), "i32", make))

    def add_experts(b: str, pre: str) -> None:
        n, F = p.n_expert, p.n_ff_exp
        fused = f"{pre}.ffn.experts.gate_up_proj"
        if rd.has(fused):
            expect(fused, (n, 2 * F, E))
            expect(f"{pre}.ffn.experts.down_proj", (n, E, F))
            for c in (fused, f"{pre}.ffn.experts.down_proj"):
                rd.use(c)
            outs.append(_Out(f"{b}.ffn_gate_exps.weight", (n, F, E), "w",
                             lambda: np.ascontiguousarray(rd.get(fused)[:, :F, :])))
            outs.append(_Out(f"{b}.ffn_up_exps.weight", (n, F, E), "w",
                             lambda: np.ascontiguousarray(rd.get(fused)[:, F:, :])))
            outs.append(_Out(f"{b}.ffn_down_exps.weight", (n, E, F), "w",
                             lambda: rd.get(f"{pre}.ffn.experts.down_proj")))
            return
        for g, w, shape in (("gate", "w1", (F, E)), ("up", "w3", (F, E)), ("down", "w2", (E, F))):
            cs = [f"{pre}.ffn.experts.{e}.{w}.weight" for e in range(n)]
            for c in cs:
                expect(c, shape)
                rd.use(c)
            fp4 = [rd.is_fp4(c) for c in cs]
            if all(fp4):
                outs.append(_Out(f"{b}.ffn_{g}_exps.weight", (n, *shape), "mxfp4",
                                 lambda cs=cs: np.stack([rd.mxfp4(c) for c in cs])))
            elif not any(fp4):
                outs.append(_Out(f"{b}.ffn_{g}_exps.weight", (n, *shape), "w",
                                 lambda cs=cs: np.stack([rd.get(c) for c in cs])))
            else:
                raise ConvertError(f"layer {pre}: some routed experts of {w} are FP4 and some are not")

    def add_layer(i: int, pre: str, ratio: int, hashed: bool) -> None:
        b = f"blk.{i}"
        mix = (2 + p.hc) * p.hc
        add(f"{b}.attn_norm.weight", f"{pre}.attn_norm.weight", (E,), "f32")
        add(f"{b}.ffn_norm.weight", f"{pre}.ffn_norm.weight", (E,), "f32")
        for part in ("attn", "ffn"):
            add(f"{b}.hc_{part}_fn.weight", f"{pre}.hc_{part}_fn", (mix, p.hc * E), "f32")
            add(f"{b}.hc_{part}_base.weight", f"{pre}.hc_{part}_base", (mix,), "f32")
            add(f"{b}.hc_{part}_scale.weight", f"{pre}.hc_{part}_scale", (3,), "f32")
        a = f"{pre}.attn"
        add(f"{b}.attn_sinks.weight", f"{a}.attn_sink", (H,), "f32")
        add(f"{b}.attn_q_a.weight", f"{a}.wq_a.weight", (p.q_lora, E))
        add(f"{b}.attn_q_a_norm.weight", f"{a}.q_norm.weight", (p.q_lora,), "f32")
        add(f"{b}.attn_q_b.weight", f"{a}.wq_b.weight", (H * hd, p.q_lora))
        add(f"{b}.attn_kv.weight", f"{a}.wkv.weight", (hd, E))
        add(f"{b}.attn_kv_a_norm.weight", f"{a}.kv_norm.weight", (hd,), "f32")
        add(f"{b}.attn_output_a.weight", f"{a}.wo_a.weight", (p.o_groups * p.o_lora, H * hd // p.o_groups))
        add(f"{b}.attn_output_b.weight", f"{a}.wo_b.weight", (E, p.o_groups * p.o_lora))
        if ratio:
            coff = 2 if ratio == _CSA else 1
            add(f"{b}.attn_compressor_kv.weight", f"{a}.compressor.wkv.weight", (coff * hd, E))
            add(f"{b}.attn_compressor_gate.weight", f"{a}.compressor.wgate.weight", (coff * hd, E))
            add(f"{b}.attn_compressor_ape.weight", f"{a}.compressor.ape", (ratio, coff * hd), "f32")
            add(f"{b}.attn_compressor_norm.weight", f"{a}.compressor.norm.weight", (hd,), "f32")
        if ratio == _CSA:
            ih, idim = p.idx_heads, p.idx_dim
            add(f"{b}.indexer.attn_q_b.weight", f"{a}.indexer.wq_b.weight", (ih * idim, p.q_lora))
            add(f"{b}.indexer.proj.weight", f"{a}.indexer.weights_proj.weight", (ih, E))
            add(f"{b}.indexer_compressor_kv.weight", f"{a}.indexer.compressor.wkv.weight", (2 * idim, E))
            add(f"{b}.indexer_compressor_gate.weight", f"{a}.indexer.compressor.wgate.weight", (2 * idim, E))
            add(f"{b}.indexer_compressor_ape.weight", f"{a}.indexer.compressor.ape", (_CSA, 2 * idim), "f32")
            add(f"{b}.indexer_compressor_norm.weight", f"{a}.indexer.compressor.norm.weight", (idim,), "f32")
        f = f"{pre}.ffn"
        add(f"{b}.ffn_gate_inp.weight", f"{f}.gate.weight", (p.n_expert, E), "f32")
        if hashed:
            add_tid2eid(f"{b}.ffn_gate_tid2eid.weight", f"{f}.gate.tid2eid")
            if rd.has(f"{f}.gate.bias"):  # the release ships none; llama.cpp drops it too
                expect(f"{f}.gate.bias", (p.n_expert,))
                rd.use(f"{f}.gate.bias")
                log.info("%s: unused in a hash-routed layer, left out", rd.src[f"{f}.gate.bias"])
        else:
            if rd.has(f"{f}.gate.tid2eid"):
                raise ConvertError(f"tensor {rd.src[f'{f}.gate.tid2eid']} present, but config.json does not make "
                                   f"layer {pre} hash-routed")
            add(f"{b}.exp_probs_b.bias", f"{f}.gate.bias", (p.n_expert,), "f32")
        if rd.has(f"{f}.gate.bias_vl"):  # vision variants: routing bias of image tokens
            add(f"{b}.exp_probs_b_vl.bias", f"{f}.gate.bias_vl", (p.n_expert,), "f32")
        add_experts(b, pre)
        F = p.n_ff_exp
        add(f"{b}.ffn_gate_shexp.weight", f"{f}.shared_experts.w1.weight", (F, E))
        add(f"{b}.ffn_up_shexp.weight", f"{f}.shared_experts.w3.weight", (F, E))
        add(f"{b}.ffn_down_shexp.weight", f"{f}.shared_experts.w2.weight", (E, F))

    add("token_embd.weight", "embed.weight", (V, E))
    add("output_norm.weight", "norm.weight", (E,), "f32")
    if rd.has("head.weight"):
        add("output.weight", "head.weight", (V, E))
    elif p.tied:
        outs.append(_Out("output.weight", (V, E), "w", lambda: rd.get("embed.weight")))
    else:
        raise ConvertError("tensor head.weight (lm_head) is missing and tie_word_embeddings is false")
    add("output_hc_fn.weight", "hc_head_fn", (p.hc, p.hc * E), "f32")
    add("output_hc_base.weight", "hc_head_base", (p.hc,), "f32")
    add("output_hc_scale.weight", "hc_head_scale", (1,), "f32")
    for i in range(p.n_layer):
        add_layer(i, f"layers.{i}", p.ratios[i], i < p.n_hash)

    mtp = sorted({int(m.group(1)) for c in rd.src if (m := re.match(r"mtp\.(\d+)\.", c))})
    if mtp and mtp != list(range(len(mtp))):
        raise ConvertError(f"MTP layers {mtp} are not numbered 0..{len(mtp) - 1}")
    if mtp and p.n_mtp_cfg and len(mtp) != p.n_mtp_cfg:
        raise ConvertError(f"config.json: num_nextn_predict_layers = {p.n_mtp_cfg}, but the checkpoint holds "
                           f"{len(mtp)} MTP layers")
    for j in mtp:
        i = p.n_layer + j
        ratio = p.mtp_ratios[j] if j < len(p.mtp_ratios) else 0
        if ratio:
            log.warning("config.json: compress_ratios gives MTP layer %d ratio %d; llama.cpp's deepseek4 runs MTP "
                        "layers with sliding-window attention only (0)", j, ratio)
        pre, b = f"mtp.{j}", f"blk.{i}"
        add_layer(i, pre, ratio, False)
        for c in (f"{pre}.e_proj.weight", f"{pre}.h_proj.weight"):
            expect(c, (E, E))
            rd.use(c)
        outs.append(_Out(f"{b}.nextn.eh_proj.weight", (E, 2 * E), "w",
                         lambda pre=pre: np.concatenate([rd.get(f"{pre}.e_proj.weight"),
                                                         rd.get(f"{pre}.h_proj.weight")], axis=1)))
        add(f"{b}.nextn.enorm.weight", f"{pre}.enorm.weight", (E,), "f32")
        add(f"{b}.nextn.hnorm.weight", f"{pre}.hnorm.weight", (E,), "f32")
        add(f"{b}.nextn.shared_head_norm.weight", f"{pre}.norm.weight", (E,), "f32")
        for part, shape in (("fn", (p.hc, p.hc * E)), ("base", (p.hc,)), ("scale", (1,))):
            c = f"{pre}.hc_head_{part}"
            if not rd.has(c):
                continue
            expect(c, shape)
            rd.use(c)
            if not np.array_equal(rd.get(c), rd.get(f"hc_head_{part}")):
                log.warning("%s differs from the main model's hc_head_%s; a GGUF holding the main model has no place "
                            "for an MTP layer's own stream collapse (llama.cpp's MTP graph uses output_hc_*), "
                            "left out", rd.src[c], part)
    p.n_mtp = len(mtp)
    if not mtp and p.n_mtp_cfg:
        log.info("config.json names %d MTP layer(s) but the checkpoint holds none; block_count counts the main "
                 "layers only", p.n_mtp_cfg)

    left = sorted(rd.src[c] for c in rd.src if c not in rd.used)
    stray = sorted(n for n in rd.raw.info if canonical(n) is None and not n.endswith("rotary_emb.inv_freq"))
    left += stray
    if left:
        more = f" (and {len(left) - 5} more)" if len(left) > 5 else ""
        raise ConvertError(f"the checkpoint has tensors this converter does not map: {', '.join(left[:5])}{more}; "
                           f"the model is not a plain {HF_ARCH} as config.json describes it")
    return outs


def choose_types(outs: list[_Out], outtype: str) -> None:
    for o in outs:
        if o.kind == "f32":
            o.ggml_type = _F32
        elif o.kind == "i32":
            o.ggml_type = _I32
        elif o.kind == "mxfp4":
            o.ggml_type = _MXFP4
        else:
            o.ggml_type, o.note = _weight_type(o.shape, outtype)
        o.nbytes = _tensor_nbytes(o.shape, o.ggml_type)


def _data(o: _Out) -> np.ndarray:
    arr = o.make()
    if o.kind == "mxfp4":
        want = (*o.shape[:-1], o.shape[-1] // 32 * 17)
        if arr.shape != want:  # pragma: no cover - guarded by the plan
            raise ConvertError(f"{o.name}: produced {arr.shape} MXFP4 bytes, planned {want}")
        return np.ascontiguousarray(arr, dtype=np.uint8)
    if arr.shape != o.shape:  # pragma: no cover - guarded by the plan
        raise ConvertError(f"{o.name}: produced shape {arr.shape}, planned {o.shape}")
    if o.kind == "i32":
        return np.ascontiguousarray(arr, dtype=np.int32)
    if o.ggml_type == _F16:
        f16 = np.asarray(arr, dtype=np.float32).astype(np.float16)
        if not np.isfinite(f16).all() and np.isfinite(arr).all():
            raise ConvertError(f"{o.name}: values beyond F16's range (up to {np.abs(arr).max():g}); use --outtype bf16 "
                               "or f32")
        return f16
    return _encode(np.asarray(arr, dtype=np.float32), o.ggml_type)


# --------------------------------------------------------------------------------------
# metadata


def model_kv(p: V4Params, name: str, file_type: int) -> list[tuple[str, str, Any]]:
    """llama.cpp's deepseek4 keys (what its converter writes, for what its loader reads)."""
    a = ARCH
    n_all = p.n_layer + p.n_mtp
    kv: list[tuple[str, str, Any]] = [
        ("general.name", "str", name),
        ("general.file_type", "u32", file_type),
        (f"{a}.vocab_size", "u32", p.n_vocab),
        (f"{a}.block_count", "u32", n_all),
        (f"{a}.context_length", "u32", p.n_ctx),
        (f"{a}.embedding_length", "u32", p.n_embd),
        (f"{a}.attention.head_count", "u32", p.n_head),
        (f"{a}.attention.head_count_kv", "u32", 1),
    ]
    if p.rope_scaling:
        kv += [(f"{a}.rope.scaling.{k}", t, v) for k, t, v in p.rope_scaling]
    kv += [
        (f"{a}.rope.freq_base", "f32", p.rope_base),
        (f"{a}.attention.layer_norm_rms_epsilon", "f32", p.rms_eps),
        (f"{a}.expert_count", "u32", p.n_expert),
        (f"{a}.expert_used_count", "u32", p.n_expert_used),
        (f"{a}.expert_gating_func", "u32", _EXPERT_GATING_SQRTSOFTPLUS),
        (f"{a}.attention.key_length", "u32", p.head_dim),
        (f"{a}.attention.value_length", "u32", p.head_dim),
        (f"{a}.rope.dimension_count", "u32", p.rope_dim),
        (f"{a}.attention.q_lora_rank", "u32", p.q_lora),
        (f"{a}.attention.sliding_window", "u32", p.window),
        (f"{a}.expert_feed_forward_length", "u32", p.n_ff_exp),
        (f"{a}.expert_shared_count", "u32", 1),
        (f"{a}.expert_weights_scale", "f32", p.weights_scale),
        (f"{a}.expert_weights_norm", "bool", True),
        (f"{a}.swiglu_clamp_exp", "arr", [float(p.swiglu_limit)] * n_all),
        (f"{a}.swiglu_clamp_shexp", "arr", [float(p.swiglu_limit)] * n_all),
        (f"{a}.attention.indexer.head_count", "u32", p.idx_heads),
        (f"{a}.attention.indexer.key_length", "u32", p.idx_dim),
        (f"{a}.attention.indexer.top_k", "u32", p.idx_topk),
        (f"{a}.attention.output_group_count", "u32", p.o_groups),
        (f"{a}.attention.output_lora_rank", "u32", p.o_lora),
        (f"{a}.attention.compress_ratios", "arr",
         [int(r) for r in p.ratios] + [int(p.mtp_ratios[j]) if j < len(p.mtp_ratios) else 0 for j in range(p.n_mtp)]),
        (f"{a}.attention.compress_rope_freq_base", "f32", p.compress_base),
        (f"{a}.hyper_connection.count", "u32", p.hc),
        (f"{a}.hyper_connection.sinkhorn_iterations", "u32", p.hc_iters),
        (f"{a}.hyper_connection.epsilon", "f32", p.hc_eps),
        (f"{a}.hash_layer_count", "u32", p.n_hash),
        (f"{a}.embedding_length_out", "u32", p.hc * p.n_embd),
    ]
    if p.n_mtp:
        kv.append((f"{a}.nextn_predict_layers", "u32", p.n_mtp))
    return kv


# --------------------------------------------------------------------------------------
# entry point


def convert_deepseek4(hf_dir: str, out_path: str, outtype: str, cfg: dict, *, progress: bool = True,
                      pre: str | None = None) -> str:
    """Convert a DeepSeek-V4 checkpoint directory (any of the layouts in the module docstring)
    into the GGUF ``out_path``; called by :func:`tensorfold.convert.convert`."""
    p = params(cfg)
    raw = _Raw(hf_dir)
    qc = cfg.get("quantization_config") or {}
    blk = qc.get("weight_block_size", [128, 128]) if isinstance(qc, dict) else [128, 128]
    if not (isinstance(blk, list) and len(blk) == 2 and all(_is_int(x) and x > 0 for x in blk)):
        raise ConvertError(f"config.json: quantization_config.weight_block_size = {blk!r} is not two positive integers")
    rd = _Reader(raw, (blk[0], blk[1]))
    outs = plan(p, rd)
    choose_types(outs, outtype)
    tok_kv = _tokenizer_kv(hf_dir, p, cfg, pre)
    file_type = _FILE_TYPE_MXFP4_MOE if any(o.kind == "mxfp4" for o in outs) else _FILE_TYPE[outtype]
    log.info("%s (%s, %d layers + %d MTP) -> %s: %d tensors, %s", hf_dir, HF_ARCH, p.n_layer, p.n_mtp, out_path,
             len(outs), outtype)
    kv = model_kv(p, _model_name(cfg, hf_dir, HF_ARCH), file_type) + tok_kv
    _write_gguf(out_path, ARCH, kv, outs, _data, progress=progress)
    return out_path
